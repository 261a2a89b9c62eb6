"""The Ray engine (protocols/memory/ray_engine.py, ray_shard.py): 20 nodes over 2 shard
actors on a 2-node Ray cluster give every node the same macro-F1 each round,
the same neighbours and the same traffic as the single-process simulator; a
missing ray is one line; a shard actor killed mid-run stops the run at once
with one line naming the shard; the time of each round is the shards' own."""

from __future__ import annotations

import ast
import asyncio
import contextvars
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.scale import round_times, write_sites
from p2pfl.config import SiteConfig
from p2pfl.secure.tensors import dumps
from protocols.base import Kept, PeerUnavailable
from protocols.memory import InMemoryNetwork, SimulationResult, simulate, simulation_configs
from protocols.memory.network import REQUEST_SUFFIX
from protocols.memory.nodes import MemoryNode
from protocols.memory.ray_engine import (
    RAY_MISSING,
    RayMissing,
    RayRun,
    ShardDied,
    ShardsDoNotFit,
    progress,
    train_workers,
)
from protocols.memory.ray_shard import _ANSWERING, ShardNetwork

# one worker starts the one 2-node Ray cluster both cluster tests share
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]

NODES, ROUNDS, K = 20, 3, 4
STORE = 80 * 1024 * 1024  # each Ray node's object store: the models here are ~100 KB


def configs(sources: list[str], state: Path, rounds: int = ROUNDS) -> list[SiteConfig]:
    # augment "none": the weak augmentation draws from torch's global generator,
    # in whatever order the nodes happen to train (see the module docstring).
    return simulation_configs(
        sources,
        protocol={
            "name": "fedavgp2p",
            "rounds": rounds,
            "fraction": min(1.0, K / (len(sources) - 1)),
        },
        state_root=state,
        seed=7,
        data={"image_size": 28, "augment": "none"},
        training={"epochs": 1, "batch_size": 32, "threads": 1},
        selection={"name": "random"},
    )


def scale_network() -> InMemoryNetwork:
    return InMemoryNetwork(inline_train=True, keep_checkpoints=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("ray_sites")
    return [str(p) for p in write_sites(out, NODES, per_site=8, seed=0)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two Ray nodes of one CPU each on this machine, this process connected."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 1, "object_store_memory": STORE}
    made = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    try:
        made.add_node(**small)
        ray.init(address=made.address, log_to_driver=False)
        try:
            yield made
        finally:
            ray.shutdown()
    finally:
        made.shutdown()


def f1s(result: SimulationResult) -> dict[tuple[str, int], float]:
    return {(r["node"], r["round"]): r["macro_f1"] for r in result.records}


def requests(result: SimulationResult) -> dict[tuple[str, str], int]:
    """(node, kind) -> request messages that node sent."""
    return {
        (node, kind): counts["messages"]
        for node, traffic in result.traffic.items()
        for kind, counts in traffic["by_kind"].items()
        if kind.endswith(REQUEST_SUFFIX)
    }


def untimed(result: SimulationResult) -> dict[tuple[str, int], dict[str, Any]]:
    """Every record's values but its timings (train_s, round_s, ...) and the
    traffic its node had sent when it logged (what its peers had pulled from it
    by then depends on timing; the totals do not)."""
    timed = {"messages_sent", "bytes_sent"}
    return {
        (r["node"], r["round"]): {
            k: v for k, v in r.items() if not k.endswith("_s") and k not in timed
        }
        for r in result.records
    }


def test_two_shards_on_two_ray_nodes_equal_one_process(
    cluster: Any, sources: list[str], tmp_path: Path
) -> None:
    import ray

    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    cfgs = configs(sources, tmp_path)
    local = asyncio.run(simulate(cfgs, network=scale_network()))
    sharded = asyncio.run(simulate(cfgs, network=scale_network(), engine="ray", shards=2))
    assert local.errors == {} and sharded.errors == {}
    assert sharded.rounds_completed() == dict.fromkeys(local.nodes(), ROUNDS)
    assert len(f1s(local)) == NODES * ROUNDS
    assert f1s(sharded) == f1s(local)  # exactly: the same models, every node, every round
    # and every other value logged (losses, validation F1, neighbours)
    assert untimed(sharded) == untimed(local)
    assert sorted(map(str, sharded.choices)) == sorted(map(str, local.choices))
    # Requests are counted alike, each node's and each kind's. Replies are not
    # compared one for one: a pull that has its neighbours cancels the requests
    # still held open, and whether such a request was answered (and counted)
    # before its cancel arrived is a race in either engine (under a load
    # average of 10, one node's count of model replies was 18 in one process
    # and 16 over the shards, with every F1 and choice equal).
    assert requests(sharded) == requests(local)
    assert sharded.traffic.keys() == local.traffic.keys()
    # the nodes trained: their loss fell, so equal values are not equal constants
    loss = local.mean_by_round("train_loss")
    assert loss[ROUNDS] < loss[1], loss


def test_a_missing_ray_is_one_line(
    monkeypatch: pytest.MonkeyPatch, sources: list[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayMissing) as missing:
        asyncio.run(simulate(configs(sources[:3], tmp_path), engine="ray"))
    assert str(missing.value) == RAY_MISSING
    assert "\n" not in str(missing.value) and "pip install 'p2pfl-node[ray]'" in RAY_MISSING


def test_nothing_but_the_ray_engine_imports_ray() -> None:
    """ray is an optional extra: the engine's two modules import it, inside functions."""
    root = Path(__file__).resolve().parent.parent
    importers = set()
    for package in ("p2pfl", "genbuffer", "protocols", "node", "bench"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                else:
                    continue
                if any(n == "ray" or n.startswith("ray.") for n in names):
                    importers.add(str(path.relative_to(root)))
    engine = {"protocols/memory/ray_engine.py", "protocols/memory/ray_shard.py"}
    assert importers == engine
    for path in engine:
        module = ast.parse((root / path).read_text(encoding="utf-8"))
        top = [n for n in module.body if isinstance(n, ast.Import | ast.ImportFrom)]
        assert not [n for n in top if ast.unparse(n).split()[1].split(".")[0] == "ray"], path


def test_a_killed_shard_stops_the_run_at_once_naming_it(
    cluster: Any, sources: list[str], tmp_path: Path
) -> None:
    import ray

    run = RayRun(configs(sources, tmp_path, rounds=30), shards=2, network=scale_network())

    async def drill() -> None:
        await run.start()
        waiting = asyncio.ensure_future(run.wait(simulate))
        try:
            # into round 2: every node of shard 0 logged round 1
            while await progress(run.shards[0], "records_logged").remote() < NODES // 2:
                assert not waiting.done(), waiting
                await asyncio.sleep(0.2)
            ray.kill(run.shards[1], no_restart=True)
            # promptly: long before 30 rounds could finish (the run would take minutes)
            await asyncio.wait_for(waiting, 60)
        finally:
            run.stop()

    with pytest.raises(ShardDied) as died:
        asyncio.run(drill())
    line = str(died.value)
    assert line.startswith("shard 1 (nodes site10..site19) died: "), line
    assert "\n" not in line


def test_a_failed_node_with_fail_fast_stops_every_shard(
    cluster: Any, sources: list[str], tmp_path: Path
) -> None:
    """A node of shard 1 fails (its data file is missing): with fail_fast, shard
    0's nodes are stopped too, as one process would stop them, instead of
    waiting on shard 1's stopped nodes until their round timeouts."""
    broken = [*sources[:-1], str(tmp_path / "missing.npz")]
    cfgs = configs(broken, tmp_path, rounds=30)
    run = simulate(cfgs, network=scale_network(), engine="ray", shards=2, fail_fast=True)
    result = asyncio.run(asyncio.wait_for(run, 300))
    assert result.first_failure() is not None
    assert result.first_failure()[0] == "site19"  # type: ignore[index]
    assert result.errors["site19"].startswith("DataError: "), result.errors
    stopped = {name for name, e in result.errors.items() if e == "stopped: another node failed"}
    assert stopped == {f"site{i}" for i in range(NODES - 1)}  # shard 0's nodes among them
    assert all(r["round"] < 30 for r in result.records)


def test_a_ray_runs_round_times_are_the_shards_own_and_real(
    cluster: Any, sources: list[str], tmp_path: Path
) -> None:
    """bench.scale's time per round over Ray comes from the times the shards'
    nodes logged their rounds, not from when the driver's polls got through
    (at 10,000 nodes those waited behind the shards' traffic and saw both
    rounds end together: 0.0 s a round). Each round takes time, and the
    rounds together fit in the run. The shards' mail went in batches."""
    run = RayRun(configs(sources, tmp_path, rounds=2), shards=2, network=scale_network())

    async def timed() -> tuple[float, SimulationResult, dict[int, tuple[int, float]], Any, float]:
        started = time.time()
        try:
            await run.start()
            result = await run.wait(simulate)
            ends, mail = await run.round_ends(), await run.mail()
            # a shard whose nodes are done still answers slower shards'
            # requests, some of them in its training pool: the pool still works
            for pool in await asyncio.gather(*(s.resources.remote() for s in run.shards)):
                assert pool["to_thread_runs_in"].startswith("train"), pool
        finally:
            run.stop()
        return started, result, ends, mail, time.time()

    started, result, ends, mail, finished = asyncio.run(timed())
    assert result.errors == {}
    assert {r: count for r, (count, _) in ends.items()} == {1: NODES, 2: NODES}
    times = round_times(ends, NODES, started)
    assert len(times) == 2 and all(t > 0 for t in times), times
    assert sum(times) <= finished - started, (times, finished - started)
    # fewer actor calls between the shards than messages they carried
    assert 0 < mail["calls"] < mail["items"], mail
    # each kept model went into the object store once and was answered by
    # reference: more replies than copies, and no more fetches than replies
    assert 0 < mail["kept_put"] < mail["kept_replies"], mail
    assert 0 < mail["kept_fetched"] <= mail["kept_replies"], mail


def test_a_kept_copy_is_fetched_once_and_a_lost_one_fails_with_a_reason(cluster: Any) -> None:
    """A shard fetches a kept model from the object store once for all its
    nodes that ask at the same time; one that never arrives fails the
    request with `timeout`, and one whose owner died ends within the
    request's time too (Ray may still serve it, or report it lost)."""
    import ray

    # defined here, so Ray's workers get them by value (they cannot import tests/)
    class Owner:
        """Stands in for another shard: holds a kept model's one copy in
        the object store and hands out a reference to it, as a reply does."""

        def __init__(self) -> None:
            self.ref: Any = None

        def put(self, size: int) -> list[Any]:
            self.ref = ray.put(dumps(Kept({"w": np.ones(size, dtype=np.float32)})))
            return [self.ref]  # inside a list: Ray hands the reference on as it is

        def ping(self) -> bool:
            return True

    def sleep() -> None:
        time.sleep(3600)

    owner = ray.remote(num_cpus=0)(Owner).remote()
    (ref,) = ray.get(owner.put.remote(3))
    net = ShardNetwork(0)

    async def fetch_twice() -> list[Any]:
        body = ("ref", ("1", [ref]))
        return list(await asyncio.gather(*(net._decode("site3", body, 30.0) for _ in range(2))))

    first, second = asyncio.run(fetch_twice())
    assert first is second and net.fetches == 1  # one fetch, one decoded object
    assert np.array_equal(first["w"], np.ones(3, dtype=np.float32))

    never = ray.remote(num_cpus=0)(sleep).remote()  # a copy that never comes
    with pytest.raises(PeerUnavailable) as late:
        asyncio.run(net._decode("site4", ("ref", ("2", [never])), 0.5))
    assert late.value.reason == "timeout"
    ray.cancel(never, force=True)

    (late_ref,) = ray.get(owner.put.remote(1 << 20))  # 4 MB: in the owner node's store
    ray.kill(owner, no_restart=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # ray.kill is asynchronous: dead before the fetch
        try:
            ray.get(owner.ping.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the killed owner still answered after 60 s")
    # Ray may still serve the copy (here it does) or report it lost: either
    # way the request ends within its timeout, with the model or a reason
    started = time.monotonic()
    try:
        kept = asyncio.run(net._decode("site5", ("ref", ("3", [late_ref])), 30.0))
        assert kept["w"].shape == (1 << 20,)
    except PeerUnavailable as exc:
        assert exc.reason in ("shard_dead", "payload_lost", "timeout"), exc.reason
    assert time.monotonic() - started < 40


def test_each_kept_model_is_put_once_while_kept_and_let_go_with_it(cluster: Any) -> None:
    """A node keeps a few rounds' models for slower peers, and replies with
    them in any order: each is put into the object store once and keeps its
    token (no new copy per switch), and the shard lets a copy go when the
    node lets the model go."""
    import gc

    net = ShardNetwork(0)
    node = MemoryNode(name="site1", config=None, agreement=None)  # type: ignore[arg-type]
    older, newer = Kept({"w": np.zeros(4, dtype=np.float32)}), Kept({"w": np.ones(4, np.float32)})

    def reply(payload: Kept) -> tuple[int, Any]:
        return contextvars.copy_context().run(_answering_shard_1, net, node, payload)

    bodies = [reply(p)[1] for p in (older, newer, older, newer, older, newer)]
    tokens = [body[1][0] for body in bodies]
    assert tokens == tokens[:2] * 3 and tokens[0] != tokens[1], tokens
    assert net.mail_figures()["kept_put"] == 2 and net.mail_figures()["kept_replies"] == 6
    assert len(net._kept) == 2
    del older, bodies
    gc.collect()
    assert len(net._kept) == 1  # the node let the older model go: so did the shard


def _answering_shard_1(net: ShardNetwork, node: MemoryNode, payload: Kept) -> tuple[int, Any]:
    _ANSWERING.set(1)
    return net._reply(node, payload)


def test_whatever_ray_raises_on_a_fetch_fails_the_request_with_a_reason(cluster: Any) -> None:
    """Not only a dead owner or a lost object: any Ray error on a fetch (a
    system error, a node gone) is a peer that did not answer, which the
    protocols handle, never an exception they do not expect."""
    import ray

    class Failing:
        def __await__(self) -> Any:
            raise ray.exceptions.RaySystemError("the object store went away")
            yield  # a generator, as __await__ must be

    net = ShardNetwork(0)
    with pytest.raises(PeerUnavailable) as failed:
        asyncio.run(net._decode("site6", ("ref", ("9", [Failing()])), 5.0))
    assert (failed.value.peer, failed.value.reason) == ("site6", "payload_lost")
    assert net._fetching == {}  # nothing left waiting


def test_a_full_object_store_fails_that_reply_with_a_reason(
    cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner cannot store a kept model (the store is full): that one
    request fails as a peer that did not answer, with the reason, and the
    next reply tries again."""
    import ray

    def full(_: Any) -> Any:
        raise ray.exceptions.ObjectStoreFullError("no room")

    net = ShardNetwork(0)
    node = MemoryNode(name="site2", config=None, agreement=None)  # type: ignore[arg-type]
    payload = Kept({"w": np.ones(4, dtype=np.float32)})
    monkeypatch.setattr(ray, "put", full)
    with pytest.raises(PeerUnavailable) as failed:
        contextvars.copy_context().run(_answering_shard_1, net, node, payload)
    assert (failed.value.peer, failed.value.reason) == ("site2", "object_store")
    monkeypatch.undo()
    size, body = contextvars.copy_context().run(_answering_shard_1, net, node, payload)
    assert body[0] == "ref" and size > 0 and net.mail_figures()["kept_put"] == 1


def test_shards_the_cluster_cannot_hold_are_refused_in_one_line(
    cluster: Any, sources: list[str], tmp_path: Path
) -> None:
    """A shard asks Ray for CPUs (its training pool) and GPUs; shards the
    cluster cannot place are refused within the placement wait, in one
    line, instead of waiting for resources that never come, and hold nothing
    afterwards. Those that fit train in a pool of one worker per whole CPU,
    and a shard given no GPU hides every GPU from torch."""
    import ray

    cfgs = configs(sources, tmp_path)
    # each Ray node here has 1 CPU and no GPU; 3 shards of 1 CPU fit on no 2 such nodes
    for shards, cpus, gpus in ((2, 2.0, 0.0), (2, 1.0, 0.5), (3, 1.0, 0.0)):
        run = RayRun(cfgs, shards=shards, cpus_per_shard=cpus, gpus_per_shard=gpus, place_wait_s=3)
        with pytest.raises(ShardsDoNotFit) as refused:
            asyncio.run(asyncio.wait_for(run.start(), 60))
        line = str(refused.value)
        assert "could not be placed on the Ray cluster within 3 s" in line, line
        assert "\n" not in line and run.shards == []  # nothing was started
    # a caller that gives up while the shards wait for room leaves no reservation behind
    waiting = RayRun(cfgs, shards=3, place_wait_s=600)
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(waiting.start(), 2))
    waiting.stop()
    live = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    assert live == [], live
    for cpus, gpus in ((0.0, 0.0), (float("nan"), 0.0), (1.0, -1.0), (1.0, 1.5)):
        with pytest.raises(ValueError):
            RayRun(cfgs, shards=2, cpus_per_shard=cpus, gpus_per_shard=gpus)
    assert (train_workers(0.5), train_workers(1.0), train_workers(2.5)) == (1, 1, 2)
    run = RayRun(cfgs, shards=2, cpus_per_shard=0.5)

    async def pools() -> list[Any]:
        await run.start()
        try:  # on the nodes' loop (the default group), where training runs
            return list(await asyncio.gather(*(s.resources.remote() for s in run.shards)))
        finally:
            run.stop()

    for pool in asyncio.run(pools()):
        assert pool["train_workers"] == 1 and pool["to_thread_runs_in"].startswith("train"), pool
        assert pool["cuda_visible_devices"] == "", pool
    # every shard's resources were given back: the refusals held none either
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0.0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) == 2
