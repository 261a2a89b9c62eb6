"""The in-memory network: pulls, pushes, gossip, faults, byte counts, checkpoints."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from p2pfl.secure.tensors import CodecError, dumps
from protocols.base import NotReady, PeerUnavailable
from protocols.memory import InMemoryNetwork, simulation_configs


def trio(**kw: Any) -> tuple[InMemoryNetwork, Any, Any, Any]:
    net = InMemoryNetwork(**kw)
    return net, net.join("a"), net.join("b"), net.join("c")


async def test_request_reaches_the_handler_and_counts_bytes_on_the_wire() -> None:
    net, a, b, _ = trio()
    payload = {"round": 3, "state": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}}

    async def handler(requester: str, query: dict[str, Any]) -> Any:
        assert requester == "a"
        return {**payload, "asked": query["round"]}

    b.serve("model", handler)
    reply = await a.request("b", "model", {"round": 3}, timeout=1.0)
    assert torch.equal(reply["state"]["w"], payload["state"]["w"])
    assert reply["asked"] == 3
    assert net.traffic("b").by_kind["model"].bytes == len(dumps({**payload, "asked": 3}))
    assert net.traffic("a").by_kind["model.request"].bytes == len(dumps({"round": 3}))
    assert (net.traffic("a").messages_sent, net.traffic("b").messages_sent) == (1, 1)


async def test_request_waits_while_the_peer_is_not_ready() -> None:
    _, a, b, _ = trio()
    ready = asyncio.Event()

    async def handler(requester: str, query: dict[str, Any]) -> Any:
        if not ready.is_set():
            raise NotReady("still training")
        return "model-of-round-1"

    b.serve("model", handler)
    asyncio.get_running_loop().call_later(0.1, ready.set)
    start = time.perf_counter()
    assert await a.request("b", "model", {}, timeout=2.0) == "model-of-round-1"
    assert 0.09 <= time.perf_counter() - start < 1.0
    with pytest.raises(PeerUnavailable) as exc:
        ready.clear()
        await a.request("b", "model", {}, timeout=0.1)
    assert exc.value.reason == "timeout"


async def test_faults_dead_partitioned_silent_and_slow_peers() -> None:
    net, a, b, c = trio()

    async def echo(requester: str, query: dict[str, Any]) -> Any:
        return query

    for ctx in (a, b, c):
        ctx.serve("echo", echo)

    net.kill("c")
    assert [p.name for p in a.peers()] == ["b"]
    assert {p.name: p.state for p in a.peers(alive_only=False)} == {"b": "alive", "c": "dead"}
    with pytest.raises(PeerUnavailable) as dead:
        await a.request("c", "echo", {}, timeout=5.0)
    assert dead.value.reason == "dead"

    net.partition("b")
    assert a.peers() == [] and b.peers() == []
    with pytest.raises(PeerUnavailable) as cut:
        await b.request("a", "echo", {}, timeout=5.0)
    assert cut.value.reason == "unreachable"
    net.partition("b", on=False)

    net.silence("b")
    assert [p.name for p in a.peers()] == ["b"]  # looks alive ...
    start = time.perf_counter()
    with pytest.raises(PeerUnavailable) as silent:
        await a.request("b", "echo", {}, timeout=0.2)  # ... but costs the full timeout
    assert silent.value.reason == "timeout"
    assert time.perf_counter() - start >= 0.19
    net.silence("b", on=False)

    net.set_latency("b", 0.05)
    start = time.perf_counter()
    assert await a.request("b", "echo", {"x": 1}, timeout=1.0) == {"x": 1}
    assert time.perf_counter() - start >= 0.1  # there and back
    with pytest.raises(PeerUnavailable):
        await a.request("b", "echo", {}, timeout=0.05)

    with pytest.raises(PeerUnavailable) as unknown:
        await a.request("zed", "echo", {}, timeout=0.1)
    assert unknown.value.reason == "unknown_peer"


async def test_publish_is_visible_to_peers_and_must_survive_the_codec() -> None:
    _, a, b, _ = trio()
    a.publish("f1", [0.5, 0.75])
    a.round = 4
    a.set_phase("train")
    seen = {p.name: p for p in b.peers()}["a"]
    assert seen.meta["f1"] == [0.5, 0.75]
    assert (seen.round, seen.phase) == (4, "train")
    assert sorted(b.roster()) == ["a", "b", "c"]
    with pytest.raises(CodecError):
        a.publish("bad", {1, 2})  # a set does not travel


async def test_push_lands_in_the_peer_inbox() -> None:
    net, a, b, _ = trio()
    await a.send("b", "buffer", {"images": torch.zeros(2, 3, dtype=torch.uint8)}, round_no=2)
    got = await asyncio.wait_for(b.inbox("buffer").get(), 1.0)
    assert (got.sender, got.kind, got.round) == ("a", "buffer", 2)
    assert got.payload["images"].shape == (2, 3)
    net.kill("b")
    with pytest.raises(PeerUnavailable):
        await a.send("b", "buffer", {}, round_no=2)


async def test_train_runs_in_a_worker_thread_or_inline() -> None:
    _, a, _, _ = trio()
    loop_thread = threading.get_ident()
    assert await a.run_blocking(threading.get_ident) != loop_thread
    _, inline, _, _ = trio(inline_train=True)
    assert await inline.run_blocking(threading.get_ident) == loop_thread


async def test_checkpoint_survives_a_restart_through_the_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    net = InMemoryNetwork(checkpoint_dir=tmp_path)
    ctx = net.join("a")
    assert ctx.restore() is None
    ctx.checkpoint({"round": 2, "model": {"w": torch.ones(3)}, "history": [["b"], ["c"]]})
    assert (tmp_path / "a.ckpt").exists()
    again = InMemoryNetwork(checkpoint_dir=tmp_path).join("a")
    saved = again.restore()
    assert saved is not None
    assert saved["round"] == 2 and saved["history"] == [["b"], ["c"]]
    assert torch.equal(saved["model"]["w"], torch.ones(3))


def test_artifacts_live_in_the_state_dir_or_beside_the_checkpoints(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (config,) = simulation_configs(
        ["site0.npz"], protocol={"name": "fedavgp2p"}, state_root=tmp_path / "state"
    )
    net = InMemoryNetwork(checkpoint_dir=tmp_path / "ckpt")
    with_config = net.join("site0", config).artifact("genbuffer/generator.pt")
    assert with_config == tmp_path / "state" / "site0" / "genbuffer" / "generator.pt"
    assert with_config.parent.is_dir()
    without_config = net.join("observer").artifact("encoder.pt")
    assert without_config == tmp_path / "ckpt" / "observer" / "encoder.pt"
    with pytest.raises(ValueError, match="relative path"):
        net.join("observer").artifact("../escape.pt")
    with pytest.raises(RuntimeError, match="nowhere to keep files"):
        InMemoryNetwork().join("a").artifact("encoder.pt")


async def test_metrics_and_choices_are_collected_per_node() -> None:
    net, a, _, _ = trio()
    a.round = 1
    a.record_choice(["b"])
    a.log_metrics(1, macro_f1=0.5)
    assert net.choices == [{"node": "a", "round": 1, "chosen": ["b"]}]
    assert net.records == [
        {"node": "a", "round": 1, "macro_f1": 0.5, "messages_sent": 0, "bytes_sent": 0}
    ]


def test_fail_fast_stops_the_others_when_one_node_fails(tmp_path) -> None:
    """A benchmark's simulation ends when one node fails, instead of the others
    waiting out their round timeouts (here 60 s per round)."""
    from p2pfl.learning.data.partition import partition_dataset
    from protocols.memory import simulate

    partition_dataset("digits", 3, "iid", tmp_path / "parts", seed=0)
    sources = [str(tmp_path / "parts" / f"site_{i}.npz") for i in range(3)]
    sources[2] = str(tmp_path / "missing.npz")  # site2 cannot load its data
    configs = simulation_configs(
        sources,
        protocol={"name": "fedavgp2p", "rounds": 5, "round_timeout_s": 60},
        state_root=tmp_path / "state",
        data={"image_size": 8, "augment": "none"},
        training={"max_steps_per_epoch": 1},
    )
    started = time.monotonic()
    result = asyncio.run(simulate(configs, network=InMemoryNetwork(), fail_fast=True))
    assert time.monotonic() - started < 30
    assert result.errors["site0"] == result.errors["site1"] == "stopped: another node failed"
    assert result.first_error().startswith("site2: ") and "\n" not in result.first_error()


@pytest.mark.parametrize("aggregation", ["mean", "trimmed_mean", "norm_clip", "median"])
def test_a_kept_model_is_shared_by_its_requesters_and_nobody_modifies_it(
    tmp_path, aggregation: str
) -> None:  # type: ignore[no-untyped-def]
    """A model kept for peers reaches every requester as the one kept object
    (bytes counted per request); after the whole federation aggregated with
    it, it still equals a copy taken when it was first served."""
    from p2pfl.learning.data.partition import partition_dataset
    from protocols.base import Kept
    from protocols.memory import simulate

    partition_dataset("digits", 4, "iid", tmp_path / "parts", seed=0)
    configs = simulation_configs(
        [str(tmp_path / "parts" / f"site_{i}.npz") for i in range(4)],
        protocol={"name": "fedavgp2p", "rounds": 2, "fraction": 1.0, "aggregation": aggregation},
        state_root=tmp_path / "state",
        data={"image_size": 8, "augment": "none"},
        training={"max_steps_per_epoch": 2},
    )
    network = InMemoryNetwork(inline_train=True, keep_checkpoints=False)
    first_served: dict[int, tuple[Kept, dict[str, torch.Tensor]]] = {}
    reply = InMemoryNetwork._reply

    def watching(dst: Any, payload: Any) -> tuple[int, Any]:
        if isinstance(payload, Kept) and id(payload) not in first_served:
            snapshot = {k: v.clone() for k, v in payload["state"].items()}
            first_served[id(payload)] = (payload, snapshot)
        size, got = reply(dst, payload)
        if isinstance(payload, Kept):
            assert got is payload
        return size, got

    network._reply = watching  # type: ignore[method-assign]
    result = asyncio.run(simulate(configs, network=network))
    assert not result.errors
    assert len(first_served) == 8  # every node's model of both rounds was pulled
    for payload, snapshot in first_served.values():
        for key, value in payload["state"].items():
            assert torch.equal(value, snapshot[key]), f"a requester modified {key}"
    model_bytes = [t["by_kind"]["model"]["bytes"] for t in result.traffic.values()]
    model_messages = [t["by_kind"]["model"]["messages"] for t in result.traffic.values()]
    assert model_messages == [6] * 4  # 3 requesters x 2 rounds, each counted
    assert len(set(model_bytes)) == 1 and model_bytes[0] > 6 * 1000


def test_rounds_with_nothing_to_await_still_let_the_event_loop_run(tmp_path) -> None:
    """A probe alone (interval_s 0, no alive peer) awaits nothing in a round:
    without a yield between rounds it froze its node's loop, /healthz and
    SIGTERM included (found by issue 28's acceptance test)."""
    import asyncio

    from protocols.memory.simulate import simulate, simulation_configs

    configs = simulation_configs(
        ["digits"],
        protocol={"name": "probe", "rounds": 300, "interval_s": 0},
        names=["lonely"],
        state_root=tmp_path,
    )
    ticks = 0

    async def run() -> None:
        nonlocal ticks
        task = asyncio.ensure_future(simulate(configs))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0)
        await task

    asyncio.run(run())
    assert ticks >= 100, f"the loop ran other work only {ticks} times in 300 rounds"


def test_a_simulation_keeps_durable_files_only_beside_its_checkpoints(tmp_path) -> None:
    """Files that outlive a restart (the secure-aggregation ledger) go where a
    simulated node's checkpoints go, and nowhere when it keeps none: a test or
    benchmark leaves no state in the working directory for the next run."""
    from protocols.memory import InMemoryNetwork

    assert InMemoryNetwork().join("a").durable_file("ledger.json") is None
    kept = InMemoryNetwork(checkpoint_dir=tmp_path).join("a").durable_file("ledger.json")
    assert kept == tmp_path / "a" / "ledger.json" and kept.parent.is_dir()
