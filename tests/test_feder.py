"""FedER: ring derivation, dead-successor skip, buffer dedup, mixed batches, and
small in-memory federations with real (tiny) privacy-preserving generators."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.attacks import TINY_GAN  # the smallest generator that trains
from p2pfl.config import TrainingSection
from p2pfl.learning.data import site_data_from_arrays
from p2pfl.learning.data.partition import partition_dataset
from p2pfl.learning.models import create_model
from p2pfl.learning.train import LocalSite
from protocols.feder_relays import derive_ring, ring_successor
from protocols.memory import InMemoryNetwork, simulate, simulation_configs

# TINY_GAN with a cheaper quality score and gate: the quality CNN trains 20 steps,
# not 500, and LPIPS upsamples the 16 px images to 32 px, not 64. Each node's
# generator, buffer and privacy gate then cost ~3.7 CPU-s instead of ~17.5 (measured
# on one site); none of these tests judges the generator's quality.
FAST_GAN = {**TINY_GAN, "quality_classifier_steps": 20, "lpips_min_size": 32}


def test_ring_is_the_same_permutation_on_every_node_and_changes_per_round():
    names = ["a", "b", "c", "d", "e"]
    for r in range(1, 6):
        views = [
            derive_ring(list(reversed(names)) if i % 2 else names, seed=7, round_no=r)
            for i in range(5)
        ]
        assert all(v == views[0] for v in views)  # every node derives the same ring
        assert sorted(views[0]) == names  # a permutation
        successors = {n: ring_successor(views[0], n, set(names))[0] for n in names}
        assert sorted(successors.values()) == names  # everyone sends once and receives once
        assert all(successors[n] != n for n in names)
    rings = {tuple(derive_ring(names, seed=7, round_no=r)) for r in range(1, 11)}
    assert len(rings) > 1


def test_dead_successor_is_skipped_to_the_next_alive():
    ring = ["a", "b", "c", "d"]
    assert ring_successor(ring, "a", {"b", "c", "d"})[0] == "b"
    assert ring_successor(ring, "a", {"c", "d"})[0] == "c"
    assert ring_successor(ring, "d", {"b"})[0] == "b"
    assert ring_successor(ring, "a", set()) == []


def _site(seed: int = 0) -> LocalSite:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(64, 8, 8, 1), dtype=np.uint8)
    labels = np.arange(64) % 2
    data = site_data_from_arrays((images, labels), class_names=["0", "1"])
    torch.manual_seed(seed)
    model = create_model("small_cnn", in_chans=1, num_classes=2, image_size=8)
    return LocalSite(
        model, data, TrainingSection(epochs=1, batch_size=16, lr=0.01, optimizer="sgd")
    )


def test_mixed_batches_pair_private_and_replayed_images_with_lambda():
    replay_x = torch.randn(40, 1, 8, 8)
    labels_a, labels_b = torch.zeros(40, dtype=torch.long), torch.ones(40, dtype=torch.long)
    site = _site()
    out = site.train_replay_epochs(replay_x, labels_a, lam=0.5)
    private = len(site.data.train)
    assert out["samples"] == 2 * private - (
        private % 16 if private % 16 < 2 else 0
    )  # one replayed image per private one
    # lam = 1: the replayed half carries no weight, so its labels change nothing.
    s1, s2 = _site(), _site()
    s1.train_replay_epochs(replay_x, labels_a, lam=1.0)
    s2.train_replay_epochs(replay_x, labels_b, lam=1.0)
    assert all(torch.equal(s1.state_dict()[k], s2.state_dict()[k]) for k in s1.state_dict())
    # lam = 0.5: it does.
    s1, s2 = _site(), _site()
    s1.train_replay_epochs(replay_x, labels_a, lam=0.5)
    s2.train_replay_epochs(replay_x, labels_b, lam=0.5)
    assert any(not torch.equal(s1.state_dict()[k], s2.state_dict()[k]) for k in s1.state_dict())
    # Synthetic-only (FedER-B) sees no private image.
    out = _site().train_replay_epochs(replay_x, labels_a, private=False)
    assert out["samples"] == (40 // 16) * 16


def _configs(tmp_path: Path, protocol: dict, n: int = 3) -> list:
    parts = tmp_path / "parts"
    partition_dataset("digits", n, "dirichlet:0.5", parts, seed=0)
    sources = [str(parts / f"site_{i}.npz") for i in range(n)]
    return simulation_configs(
        sources,
        protocol=protocol,
        state_root=tmp_path / "state",
        data={"image_size": 16, "augment": "none"},
        training={"epochs": 1, "batch_size": 32, "lr": 0.003},
    )


@pytest.mark.slow
def test_three_node_feder_with_tiny_generators_improves_and_dedups_buffers(tmp_path):
    protocol = {
        "name": "feder",
        "rounds": 3,
        "buffer_size": 64,
        "initial_epochs": 1,
        "round_timeout_s": 30,
        "genbuffer": FAST_GAN,
    }
    configs = _configs(tmp_path, protocol)
    network = InMemoryNetwork()
    result = asyncio.run(simulate(configs, network=network))
    assert not result.errors, result.errors
    assert result.rounds_completed() == {c.node.name: 3 for c in configs}
    by_round = result.mean_by_round("macro_f1")
    assert by_round[3] > by_round[0] + 0.05, by_round
    records = [r for r in result.records if r["round"] >= 1]
    assert all(r["received"] == 1 and r["replayed_images"] == 64 for r in records)
    # Every node's buffer goes to each peer at most once: with 3 nodes and 3 rounds,
    # a node meets each of its 2 peers at most once as successor before repeating.
    buffer_sends = sum(1 for r in records if r["sent_buffer_bytes"] > 0)
    model_sends = sum(1 for r in records if r["sent_model_bytes"] > 0)
    assert model_sends == 9 and buffer_sends <= 6 and buffer_sends < model_sends
    # Generators were trained before federation, one per node.
    for c in configs:
        assert (Path(c.node.state_dir) / "genbuffer").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["feder_a", "feder_b"])
def test_privacy_enhanced_variants_run(tmp_path, variant):
    protocol = {
        "name": variant,
        "rounds": 2,
        "buffer_size": 64,
        "initial_epochs": 1,
        "round_timeout_s": 30,
        "genbuffer": FAST_GAN,
    }
    configs = _configs(tmp_path, protocol)
    result = asyncio.run(simulate(configs))
    assert not result.errors, result.errors
    records = [r for r in result.records if r["round"] >= 1]
    assert all(r["replayed_images"] > 0 for r in records)
    if variant == "feder_a":
        assert all(r["sent_model_bytes"] == 0 for r in records)  # only buffers travel
        # Buffers accumulate: 64 images per distinct predecessor so far (rings are deterministic).
        names = sorted(c.node.name for c in configs)
        for node in names:
            senders: set[str] = set()
            for r in (1, 2):
                ring = derive_ring(names, seed=0, round_no=r)
                senders |= {
                    n
                    for n in names
                    if n != node and ring_successor(ring, n, set(names) - {n})[0] == node
                }
                got = next(
                    x["replayed_images"] for x in records if x["node"] == node and x["round"] == r
                )
                assert got == 64 * len(senders), (node, r, got, senders)
    else:
        assert all(r["sent_model_bytes"] > 0 for r in records)


@pytest.mark.slow
def test_a_dead_node_is_skipped_and_the_others_finish(tmp_path):
    protocol = {
        "name": "feder",
        "rounds": 2,
        "buffer_size": 32,
        "initial_epochs": 1,
        "round_timeout_s": 3,
        "genbuffer": FAST_GAN,
    }
    configs = _configs(tmp_path, protocol)
    network = InMemoryNetwork()
    network.join(configs[2].node.name, configs[2])
    network.kill(configs[2].node.name)
    result = asyncio.run(simulate(configs, network=network))
    alive = [c.node.name for c in configs[:2]]
    assert {n: result.rounds_completed().get(n) for n in alive} == {n: 2 for n in alive}
    records = [r for r in result.records if r["round"] >= 1 and r["node"] in alive]
    assert all(r["successor_found"] == 1 for r in records)


@pytest.mark.slow
def test_feder_over_real_daemons_then_cross_site_and_ensemble_evaluation(tmp_path):
    """Three real daemons (in the test process: tests/inproc_util.py), their
    relays through the spool and journal, then `node.cli evaluate` in its own
    process over their state directories."""
    import json
    import subprocess
    import sys

    from inproc_util import InProcessFederation

    from node.provision import provision

    parts = tmp_path / "parts"
    partition_dataset("digits", 3, "dirichlet:0.5", parts, seed=0)
    protocol = {
        "name": "feder",
        "rounds": 2,
        "buffer_size": 64,
        "initial_epochs": 1,
        "round_timeout_s": 60,
        "genbuffer": FAST_GAN,
    }
    plans = provision(
        tmp_path / "fed",
        ["a", "b", "c"],
        protocol=protocol,
        data_sources=[str(parts / f"site_{i}.npz") for i in range(3)],
        overrides={
            "transport": {"heartbeat_s": 0.3},
            "data": {"image_size": 16, "augment": "none"},
            "node": {"exit_when_done": True},
        },
    )
    with InProcessFederation(plans) as fed:
        codes = fed.wait_all_exit(240)
    assert codes == {"a": 0, "b": 0, "c": 0}, codes
    for name in "abc":
        lines = [
            json.loads(x)
            for x in (tmp_path / "fed" / name / "state" / "metrics.jsonl").read_text().splitlines()
        ]
        assert [x["round"] for x in lines] == [0, 1, 2]
        assert all(x["received"] == 1 for x in lines[1:])
        # Model + buffer relays went through the spool and were journaled once each.
        journal = [
            json.loads(x)
            for x in (tmp_path / "fed" / name / "state" / "journal.jsonl").read_text().splitlines()
        ]
        assert len(journal) == 2 and len({j["id"] for j in journal}) == 2
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "evaluate",
            "--federation-dir",
            str(tmp_path / "fed"),
            "--ensemble",
            "--json",
            str(tmp_path / "eval.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert set(result["matrix"]) == {"a", "b", "c"} and all(
        set(row) == {"a", "b", "c"} for row in result["matrix"].values()
    )
    assert 0.0 <= result["macro_f1_std"] <= 1.0 and "ensemble" in result
    assert "ensemble of 3 models" in out.stdout


def _buffer(images: int = 8, size: int = 8) -> dict:
    from genbuffer.buffer import buffer_content_hash

    x = torch.randint(0, 256, (images, 1, size, size), dtype=torch.uint8)
    y = torch.arange(images, dtype=torch.int64) % 2
    return {"images": x, "labels": y, "content_hash": buffer_content_hash(x, y)}


@pytest.mark.parametrize("scale", [1.0, 1000.0])
def test_a_relayed_model_must_fit_the_receivers_own(tmp_path: Path, scale: float) -> None:
    """The relayed model replaces the receiver's: one 1000 times the norm of the
    receiver's current model is refused and counted, and the receiver trains
    its own model on; one of the same size is taken."""
    from protocols.feder import FedER
    from protocols.feder_relays import RELAY_KIND
    from protocols.site import build_site

    parts = tmp_path / "parts"
    partition_dataset("digits", 2, "iid", parts, seed=0)
    (cfg,) = simulation_configs(
        [str(parts / "site_0.npz")],
        names=["victim"],
        protocol={"name": "feder", "rounds": 1, "initial_epochs": 0, "round_timeout_s": 1.0},
        state_root=tmp_path / "state",
        data={"image_size": 8, "augment": "none"},
        training={"epochs": 1, "batch_size": 32, "lr": 0.003},
        genbuffer={"privacy_gate": False},  # its buffer is made up, as in _victim_config
    )
    initial = build_site(cfg).state_dict()
    forged = {k: v * scale if v.is_floating_point() else v for k, v in initial.items()}
    network = InMemoryNetwork(inline_train=True)
    victim = FedER(cfg.protocol)  # type: ignore[arg-type]
    victim.own_buffer = _buffer()  # no generator to train: its buffer is given
    mallory = network.join("mallory")  # a roster member that runs no protocol, only pushes
    buffer = _buffer()
    relay = {"round": 1, "buffer_hash": buffer["content_hash"], "buffer": buffer}

    async def scenario() -> None:
        ctx = network.join("victim", cfg)
        await mallory.send("victim", RELAY_KIND, {**relay, "model": forged, "num_train": 9}, 1)
        await victim.run(ctx)

    asyncio.run(scenario())
    (record,) = [r for r in network.records if r["node"] == "victim"]
    final = network.saved_state("victim")["model"]  # type: ignore[index]
    norm = sum(float(v.double().square().sum()) for k, v in final.items() if v.is_floating_point())
    initial_norm = sum(
        float(v.double().square().sum()) for v in initial.values() if v.is_floating_point()
    )
    # Either way the node trained a model of its own size, not the forged one.
    assert norm**0.5 < 2 * initial_norm**0.5
    if scale == 1.0:
        assert record["received"] == 1 and record["relays_refused"] == 0
        assert network.rejections == []
    else:
        assert record["received"] == 0 and record["relays_refused"] == 1
        assert [(r["peer"], r["reason"]) for r in network.rejections] == [
            ("mallory", "relay_huge_norm")
        ]
        assert record["replayed_images"] == 0  # nothing of the refused relay is used


def test_a_relay_of_another_round_is_refused_not_taken(tmp_path: Path) -> None:
    """A stale (or replayed) relay must not replace the round's own: the one of
    round 0 that arrives first is refused and counted, the round-1 relay is taken."""
    from protocols.feder import FedER
    from protocols.feder_relays import RELAY_KIND
    from protocols.site import build_site

    parts = tmp_path / "parts"
    partition_dataset("digits", 2, "iid", parts, seed=0)
    (cfg,) = simulation_configs(
        [str(parts / "site_0.npz")],
        names=["victim"],
        protocol={"name": "feder", "rounds": 1, "initial_epochs": 0, "round_timeout_s": 1.0},
        state_root=tmp_path / "state",
        data={"image_size": 8, "augment": "none"},
        training={"epochs": 1, "batch_size": 32, "lr": 0.003},
        genbuffer={"privacy_gate": False},  # its buffer is made up, as in _victim_config
    )
    model = build_site(cfg).state_dict()
    network = InMemoryNetwork(inline_train=True)
    victim = FedER(cfg.protocol)  # type: ignore[arg-type]
    victim.own_buffer = _buffer()
    mallory = network.join("mallory")
    buffer = _buffer()
    relay = {"buffer_hash": buffer["content_hash"], "buffer": buffer, "model": model}

    async def scenario() -> None:
        ctx = network.join("victim", cfg)
        await mallory.send("victim", RELAY_KIND, {**relay, "round": 0, "num_train": 9}, 0)
        await mallory.send("victim", RELAY_KIND, {**relay, "round": 1, "num_train": 9}, 1)
        await victim.run(ctx)

    asyncio.run(scenario())
    (record,) = [r for r in network.records if r["node"] == "victim"]
    assert record["received"] == 1 and record["relays_refused"] == 1
    assert [(r["peer"], r["reason"]) for r in network.rejections] == [
        ("mallory", "relay_wrong_round")
    ]


# ---------------------------------------------------------------------- relay intake (hostile)


def _buffer_of(images: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
    from genbuffer.buffer import buffer_content_hash

    y = torch.arange(len(images), dtype=torch.int64) % 2 if labels is None else labels
    return {"images": images, "labels": y, "content_hash": buffer_content_hash(images, y)}


def _victim_config(tmp_path: Path, rounds: int = 1, seed: int = 0, **protocol: object):
    parts = tmp_path / "parts"
    if not parts.exists():
        partition_dataset("digits", 2, "iid", parts, seed=0)
    (cfg,) = simulation_configs(
        [str(parts / "site_0.npz")],
        names=["victim"],
        seed=seed,
        protocol={
            "name": "feder",
            "rounds": rounds,
            "initial_epochs": 0,
            "round_timeout_s": 1.0,
            **protocol,
        },
        state_root=tmp_path / "state",
        data={"image_size": 8, "augment": "none"},
        training={"epochs": 1, "batch_size": 32, "lr": 0.003},
        # the victim's buffer is made up (`_buffer`, no generator): a node that starts
        # with a buffer puts it through the gate first (tests/test_privacy_gate.py),
        # which these tests of the relay path leave out
        genbuffer={"privacy_gate": False},
    )
    return cfg


def _run_victim(cfg, pushes: list, members: tuple[str, ...] = ("mallory",), serves=None):
    """`members` join the roster and play no protocol (`serves`: the buffer
    handler of each that has one); `pushes` (sender, round, payload) reach the
    victim's inbox, in order, before it starts; then it runs."""
    from protocols.feder import FedER
    from protocols.feder_relays import BUFFER_KIND, RELAY_KIND

    network = InMemoryNetwork(inline_train=True)
    victim = FedER(cfg.protocol)  # type: ignore[arg-type]
    victim.own_buffer = _buffer()  # 8 images (1, 8, 8): no generator to train
    peers = {name: network.join(name) for name in members}
    for name, handler in (serves or {}).items():
        peers[name].serve(BUFFER_KIND, handler)

    async def scenario() -> None:
        ctx = network.join("victim", cfg)
        for sender, round_no, payload in pushes:
            await peers[sender].send("victim", RELAY_KIND, payload, round_no)
        await victim.run(ctx)

    asyncio.run(scenario())
    records = {r["round"]: r for r in network.records if r["node"] == "victim"}
    rejected = [(r["peer"], r["reason"]) for r in network.rejections]
    return victim, records, rejected


def _relay(model: dict, buffer: dict | None, round_no: int = 1, **extra: object) -> dict:
    digest = buffer["content_hash"] if buffer is not None else "0" * 64
    relay = {"round": round_no, "buffer_hash": digest, "buffer": buffer, "model": model}
    return {**relay, "num_train": 9, **extra}


def _model(cfg) -> dict:
    from protocols.site import build_site

    return build_site(cfg).state_dict()


def test_verify_buffer_checks_the_image_count_and_shape_before_the_pixels() -> None:
    from genbuffer.buffer import verify_buffer
    from genbuffer.errors import SyntheticBufferError

    good = _buffer(images=8, size=8)
    assert verify_buffer(good, num_classes=2, image_shape=(1, 8, 8), max_images=8)
    cases = {
        "buffer_count": [_buffer(images=9), _buffer_of(torch.zeros(0, 1, 8, 8, dtype=torch.uint8))],
        "buffer_shape": [
            _buffer_of(torch.zeros(4, 0, 8, 8, dtype=torch.uint8)),  # no channel
            _buffer_of(torch.zeros(4, 1, 0, 0, dtype=torch.uint8)),  # no pixel
            _buffer_of(torch.zeros(4, 1, 1, 1, dtype=torch.uint8)),  # 1x1: upsampled x64
            _buffer_of(torch.zeros(4, 3, 8, 8, dtype=torch.uint8)),  # another channel count
            _buffer_of(torch.zeros(4, 1, 8, 16, dtype=torch.uint8)),  # not square
        ],
    }
    for reason, buffers in cases.items():
        for buffer in buffers:
            with pytest.raises(SyntheticBufferError) as err:
                verify_buffer(buffer, num_classes=2, image_shape=(1, 8, 8), max_images=8)
            assert err.value.reason == reason, (reason, buffer["images"].shape)
    # the count and shape come first: a bad hash of a wrong shape says shape
    bad = {**_buffer_of(torch.zeros(4, 1, 1, 1, dtype=torch.uint8)), "content_hash": "x"}
    with pytest.raises(SyntheticBufferError) as err:
        verify_buffer(bad, image_shape=(1, 8, 8), max_images=8)
    assert err.value.reason == "buffer_shape"


@pytest.mark.parametrize(
    ("images", "reason"),
    [
        ((64, 0, 8, 8), "relay_buffer_shape"),  # crashed fit: the protocol FAILED, uncounted
        ((64, 1, 0, 0), "relay_buffer_shape"),
        ((1000, 1, 1, 1), "relay_buffer_shape"),  # 1x1 px: x64 bytes once upsampled
        ((64, 2, 8, 8), "relay_buffer_shape"),  # no channel count convert_images knows
        ((64, 17, 8, 8), "relay_buffer_shape"),
        ((64, 1, 8, 16), "relay_buffer_shape"),  # not square
        ((64, 1, 12, 12), "relay_buffer_shape"),  # not a power of two
        ((64, 1, 4, 4), "relay_buffer_shape"),  # below 8 px
        ((4, 1, 512, 512), "relay_buffer_shape"),  # above 256 px
        ((2048 + 1, 1, 8, 8), "relay_buffer_count"),  # more than MAX_BUFFER_IMAGES
    ],
)
def test_a_buffer_the_classifier_cannot_train_on_is_refused_counted_and_never_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, images: tuple, reason: str
) -> None:
    """F1: a buffer of 0 channels or 0x0 px passed `accept` and raised in `fit`
    (the protocol FAILED, nothing counted); one of 1x1 px was upsampled to the
    classifier's size (a 0.9 MB push became a 1.6 GB tensor). Now the shape
    (within the federation's bounds: 1, 3 or 4 channels, square, a power of two
    from 8 to 256 px) and count (at most MAX_BUFFER_IMAGES) are checked before
    any pixel is converted, the relay is refused with a reason and counted, and
    the node trains its own model on, over the rounds that follow too."""
    from protocols.feder_buffers import MAX_BUFFER_IMAGES

    assert MAX_BUFFER_IMAGES == 2048
    import protocols.feder_buffers as feder

    converted: list[tuple] = []
    real = feder.convert_images
    monkeypatch.setattr(
        feder, "convert_images", lambda x, *a: converted.append(x.shape) or real(x, *a)
    )
    cfg = _victim_config(tmp_path, rounds=2)
    hostile = _buffer_of(torch.zeros(images, dtype=torch.uint8))
    _, records, rejected = _run_victim(cfg, [("mallory", 1, _relay(_model(cfg), hostile))])
    assert rejected == [("mallory", reason)]
    assert records[1]["received"] == 0 and records[1]["relays_refused"] == 1
    assert records[1]["replayed_images"] == 0 and set(records) == {1, 2}  # it went on
    assert all(shape[0] == 8 for shape in converted), converted  # only its own buffer's


def test_a_buffer_whose_replay_images_cannot_be_made_is_a_counted_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever making the replay images raises happens in `accept`, off the
    event loop, and is the sender's refusal (`relay_buffer_unusable`), not a
    failure of the protocol in `fit`."""
    import protocols.feder_buffers as feder

    real = feder.replay_images

    def fragile(buffer: dict, size: int, channels: int):
        if len(buffer["images"]) == 7:
            raise ValueError("matmul: Input operand 1 has a mismatch")
        return real(buffer, size, channels)

    monkeypatch.setattr(feder, "replay_images", fragile)
    cfg = _victim_config(tmp_path)
    odd = _buffer(images=7)
    _, records, rejected = _run_victim(cfg, [("mallory", 1, _relay(_model(cfg), odd))])
    assert rejected == [("mallory", "relay_buffer_unusable")]
    assert records[1]["received"] == 0 and records[1]["relays_refused"] == 1


def test_an_honest_buffer_is_replayed_from_the_images_made_at_intake(tmp_path: Path) -> None:
    cfg = _victim_config(tmp_path)
    buffer = _buffer(images=8)
    victim, records, rejected = _run_victim(cfg, [("mallory", 1, _relay(_model(cfg), buffer))])
    assert rejected == [] and records[1]["received"] == 1
    assert records[1]["replayed_images"] == 8
    assert victim.replay[buffer["content_hash"]].shape == (8, 8, 8, 1)  # N, H, W, C


def test_kept_buffers_are_bounded_per_sender_and_in_all_also_through_a_checkpoint() -> None:
    """FedER-A replays every buffer it keeps, and every checkpoint holds them: a
    sender's new buffer replaces its old one, and at most MAX_KEPT_BUFFERS
    senders' are kept (the least recently received goes first). A checkpoint of
    an older version, with more, is cut to the bound, and a kept buffer that
    fails today's checks is dropped on resume instead of failing `fit`."""
    from p2pfl.config import FedERParams
    from protocols.feder import FedER
    from protocols.feder_buffers import replay_images
    from protocols.feder_relays import MAX_KEPT_BUFFERS

    node = FedER(FedERParams(name="feder_a"))
    node.own_buffer, node.num_classes, node.image_size, node.channels = _buffer(), 2, 8, 1

    def keep(sender: str) -> str:
        buffer = _buffer()
        node.keep_buffer(sender, buffer["content_hash"], buffer, replay_images(buffer, 8, 1))
        return buffer["content_hash"]

    first = keep("s0")
    keep("s0")  # s0's new buffer replaces its first
    assert first not in node.buffers and len(node.buffers) == 1
    hashes = [keep(f"s{i}") for i in range(1, MAX_KEPT_BUFFERS + 5)]
    assert len(node.buffers) == len(node.replay) == len(node.buffer_of) == MAX_KEPT_BUFFERS
    assert set(node.buffers) == set(hashes[-MAX_KEPT_BUFFERS:])
    assert node.replay_hashes(None) == sorted(hashes[-MAX_KEPT_BUFFERS:])
    x, y = node.replay_tensors(node.replay_hashes(None))
    assert x.shape == (8 * MAX_KEPT_BUFFERS, 1, 8, 8) and len(y) == len(x)

    # an older checkpoint: every buffer ever received, no senders, one of them unusable
    old = {h: node.buffers[h] for h in node.buffers}
    broken = _buffer_of(torch.zeros(4, 0, 8, 8, dtype=torch.uint8))
    extra = [_buffer() for _ in range(3)] + [broken]
    old.update({b["content_hash"]: b for b in extra})
    resumed = FedER(FedERParams(name="feder_a"))
    resumed.num_classes, resumed.image_size, resumed.channels = 2, 8, 1
    resumed.load_extra({"own_buffer": _buffer(), "buffers": old, "sent_buffers": {}})
    assert len(resumed.buffers) == MAX_KEPT_BUFFERS  # the latest ones
    assert broken["content_hash"] in resumed.buffers
    resumed.restore_replay()
    assert broken["content_hash"] not in resumed.buffers
    assert len(resumed.buffers) == len(resumed.replay) == MAX_KEPT_BUFFERS - 1
    assert set(resumed.buffer_of.values()) == set(resumed.buffers)
    again = FedER(FedERParams(name="feder_a"))
    saved = {
        "own_buffer": resumed.own_buffer,
        "buffers": resumed.buffers,
        "buffer_of": [[s, h] for s, h in resumed.buffer_of.items()],
        "sent_buffers": {},
    }
    again.load_extra(saved)
    assert again.buffer_of == resumed.buffer_of and set(again.buffers) == set(resumed.buffers)


def test_a_relay_whose_buffer_cannot_be_obtained_or_is_another_than_named_is_refused(
    tmp_path: Path,
) -> None:
    """F4: a relay naming a buffer this node does not hold, with none attached
    and none served, was taken anyway (the round trained on no replay), and the
    hash a relay names was never compared with the buffer it brings. Each is now
    a counted refusal, and nothing of the relay is kept."""
    cfg = _victim_config(tmp_path)
    model, buffer, other = _model(cfg), _buffer(), _buffer()
    cases = {
        "relay_buffer_unavailable": _relay(model, None, buffer_hash=buffer["content_hash"]),
        "relay_buffer_mismatch": _relay(model, buffer, buffer_hash=other["content_hash"]),
        "relay_malformed": _relay(model, buffer, buffer_hash=buffer["content_hash"][:12]),
    }
    for reason, payload in cases.items():
        victim, records, rejected = _run_victim(cfg, [("mallory", 1, payload)])
        assert rejected == [("mallory", reason)], reason
        assert records[1]["received"] == 0 and records[1]["replayed_images"] == 0
        assert victim.buffers == {} and victim.last_received_hash is None


def test_a_buffer_named_by_hash_is_pulled_checked_and_must_be_the_one_named(
    tmp_path: Path,
) -> None:
    """A relay carrying only the hash makes the node pull the buffer from the
    sender: the buffer served is checked like an attached one and must be the
    one the relay named."""
    cfg = _victim_config(tmp_path)
    model, buffer, other = _model(cfg), _buffer(), _buffer()
    relay = _relay(model, None, buffer_hash=buffer["content_hash"])

    async def serve(requester: str, query: dict) -> dict:
        return buffer

    async def serve_other(requester: str, query: dict) -> dict:
        return other

    victim, records, rejected = _run_victim(cfg, [("mallory", 1, relay)], serves={"mallory": serve})
    assert rejected == [] and records[1]["received"] == 1 and records[1]["replayed_images"] == 8
    assert set(victim.buffers) == {buffer["content_hash"]}
    _, records, rejected = _run_victim(
        cfg, [("mallory", 1, relay)], serves={"mallory": serve_other}
    )
    assert rejected == [("mallory", "relay_buffer_mismatch")] and records[1]["received"] == 0


def test_ring_predecessors_mirror_the_successor_a_sender_picks() -> None:
    """Whatever members are dead, the member whose successor is `me` (in its own
    view) is among `me`'s predecessors (in `me`'s view), and that list holds
    exactly one member `me` considers alive: the last."""
    from protocols.feder_relays import ring_predecessors

    names = [f"n{i}" for i in range(7)]
    rng = np.random.default_rng(0)
    for r in range(1, 40):
        ring = derive_ring(names, seed=3, round_no=r)
        live = {n for n in names if rng.random() < 0.7}
        for me in names:
            preds = ring_predecessors(ring, me, live - {me})
            assert me not in preds and all(p not in live for p in preds[:-1])
            for sender in live - {me}:
                successor = ring_successor(ring, sender, live - {sender})
                if successor and successor[0] == me:
                    assert sender == preds[-1], (ring, live, me, sender, preds)
    assert ring_predecessors(["a", "b", "c", "d"], "c", {"a", "b", "d"}) == ["b"]
    assert ring_predecessors(["a", "b", "c", "d"], "c", {"a", "d"}) == ["b", "a"]
    assert ring_predecessors(["a", "b", "c", "d"], "a", {"b", "c"}) == ["d", "c"]


def _marked(model: dict, value: float) -> dict:
    return {k: torch.full_like(v, value) if v.is_floating_point() else v for k, v in model.items()}


def test_only_the_ring_predecessor_replaces_the_model_and_far_early_relays_hold_nothing(
    tmp_path: Path,
) -> None:
    """F2: any member's relay of the round, if it came first, replaced the
    node's model, every round, and the honest predecessor's was refused
    `relay_wrong_round`, counted against it. Relays of round ~2^31 held the
    four early slots for good. Now: only the ring predecessor's relay is taken
    (`relay_not_predecessor` for the other), early relays only for the next
    EARLY_RELAYS rounds, after the checks, one per sender."""
    names = ["bob", "zed", "victim"]
    for r in (1, 2):  # the rounds' rings: bob comes right before victim
        ring = derive_ring(names, seed=0, round_no=r)
        assert ring[ring.index("victim") - 1] == "bob", ring
    cfg = _victim_config(tmp_path, rounds=2)
    model, buffer = _model(cfg), _buffer()
    evil, honest = _marked(model, 0.0123), _marked(model, 0.01)
    far = 2**31 - 1
    pushes = [("zed", far - i, _relay(evil, buffer, far - i)) for i in range(4)]
    for r in (1, 2):  # zed first, every round, then the predecessor
        pushes += [("zed", r, _relay(evil, buffer, r)), ("bob", r, _relay(honest, buffer, r))]
    victim, records, rejected = _run_victim(cfg, pushes, members=("bob", "zed"))
    assert victim.merged == [[1, [["bob", 1]]], [2, [["bob", 2]]]]
    assert records[1]["received"] == records[2]["received"] == 1
    assert victim.early == []
    assert ("bob", "relay_wrong_round") not in rejected
    assert rejected.count(("zed", "relay_wrong_round")) == 4  # round 2^31-1...: not held
    assert rejected.count(("zed", "relay_not_predecessor")) == 2
    assert len(rejected) == 6


def test_an_honest_predecessor_rounds_ahead_is_held_and_taken_in_each_round(
    tmp_path: Path,
) -> None:
    """The ring predecessor (of every round: two members) relays rounds 2 and 3
    before round 1: both are held, one per round, and taken in their rounds. A
    second relay of a held round from the same sender is refused
    (`relay_duplicate`). An early relay is checked in full in its own round:
    one that fails a check there is refused and counted then."""
    cfg = _victim_config(tmp_path, rounds=3)
    model, buffer = _model(cfg), _buffer()
    huge = _marked(model, 1e3)
    pushes = [
        ("mallory", 2, _relay(model, buffer, 2)),
        ("mallory", 2, _relay(model, buffer, 2)),  # the same round again
        ("mallory", 3, _relay(model, buffer, 3)),  # another round: held too
        ("mallory", 1, _relay(model, buffer, 1)),
    ]
    victim, records, rejected = _run_victim(cfg, pushes)
    assert [records[r]["received"] for r in (1, 2, 3)] == [1, 1, 1]
    assert victim.merged == [[r, [["mallory", r]]] for r in (1, 2, 3)]
    assert rejected == [("mallory", "relay_duplicate")]
    victim, records, rejected = _run_victim(cfg, [("mallory", 2, _relay(huge, buffer, 2))])
    assert rejected == [("mallory", "relay_huge_norm")]
    assert records[1]["relays_refused"] == 0 and records[2]["relays_refused"] == 1
    assert records[2]["received"] == 0


@pytest.mark.parametrize("dies", ["before", "during"])
def test_a_relay_from_behind_a_dead_predecessor_is_taken(tmp_path: Path, dies: str) -> None:
    """The sender skipped its dead successor (bob) and relayed to the next
    alive, victim: victim takes it once it holds bob dead too, at once or, while
    it still thinks bob alive, as soon as it learns otherwise in the round (a
    relay still waiting when the round's time is up is refused, so `received`
    says which happened; no wall-clock bound)."""
    from protocols.feder import FedER
    from protocols.feder_relays import RELAY_KIND

    names = ["bob", "zed", "victim"]
    ring = derive_ring(names, seed=0, round_no=1)
    assert ring_successor(ring, "zed", {"victim"})[0] == "victim"
    assert ring_successor(ring, "zed", {"bob", "victim"})[0] == "bob"
    cfg = _victim_config(tmp_path, round_timeout_s=10.0)
    network = InMemoryNetwork(inline_train=True)
    victim = FedER(cfg.protocol)  # type: ignore[arg-type]
    victim.own_buffer = _buffer()
    network.join("bob")
    zed = network.join("zed")
    if dies == "before":
        network.kill("bob")
    relay = _relay(_model(cfg), _buffer())

    async def scenario() -> None:
        ctx = network.join("victim", cfg)
        await zed.send("victim", RELAY_KIND, relay, 1)
        task = asyncio.create_task(victim.run(ctx))
        await asyncio.sleep(0.3)
        if dies == "during":
            assert set(victim.waiting) == {"zed"}  # bob still looks alive
            network.kill("bob")
        await task

    asyncio.run(scenario())
    (record,) = [r for r in network.records if r["node"] == "victim"]
    assert record["received"] == 1 and network.rejections == []
    assert victim.merged == [[1, [["zed", 1]]]]


def test_with_random_successors_each_sender_has_one_relay_per_round(tmp_path: Path) -> None:
    """Any member may be chosen as successor (random, heuristic): a sender gets
    one try per round, so a refused relay is not followed by another."""
    cfg = _victim_config(tmp_path, successor="random")
    model, buffer = _model(cfg), _buffer()
    pushes = [
        ("mallory", 1, _relay(_marked(model, 1e3), buffer)),  # refused: huge norm
        ("mallory", 1, _relay(_marked(model, 0.0123), buffer)),  # a second try: refused
        ("eve", 1, _relay(model, buffer)),
    ]
    victim, records, rejected = _run_victim(cfg, pushes, members=("mallory", "eve"))
    assert victim.merged == [[1, [["eve", 1]]]]
    assert rejected == [("mallory", "relay_huge_norm"), ("mallory", "relay_duplicate")]


# ---------------------------------------------------------------------- second review (R1-R5)


def _predecessor(names: list[str], seed: int, round_no: int) -> str:
    from protocols.feder_relays import ring_predecessors

    ring = derive_ring(names, seed=seed, round_no=round_no)
    (pred,) = ring_predecessors(ring, "victim", set(names) - {"victim"})
    return pred


@pytest.mark.parametrize("queued", [0, 12])
def test_early_relays_never_pull_in_another_round_so_queueing_them_stalls_nothing(
    tmp_path: Path, queued: int
) -> None:
    """R1: a relay of round r+1..r+4 was checked in full on arrival, buffer
    pull included: each naming a buffer its sender never serves blocked round
    r's exchange for round_timeout_s while the honest predecessor's relay
    waited in the inbox (k of them: k x the timeout; 256 x 120 s with the
    defaults). Now an early relay is held after the checks that cost nothing,
    one per round, and pulls only in its own round, within that round's time:
    however many mallory queues, round 1 takes bob's relay at once and round 2
    ends by its deadline."""
    timeout = 1.5
    names = ["bob", "mallory", "victim"]
    assert _predecessor(names, 4, 1) == "bob" and _predecessor(names, 4, 2) == "mallory"
    cfg = _victim_config(tmp_path, rounds=2, seed=4, round_timeout_s=timeout)
    model, good = _model(cfg), _buffer()
    pushes = [  # round 2 relays naming buffers nobody serves, before bob's of round 1
        ("mallory", 2, _relay(model, None, 2, buffer_hash=f"{i:064x}")) for i in range(queued)
    ]
    pushes.append(("bob", 1, _relay(model, good, 1)))
    victim, records, rejected = _run_victim(cfg, pushes, members=("bob", "mallory"))
    assert records[1]["received"] == 1 and victim.merged[0] == [1, [["bob", 1]]]
    assert records[1]["exchange_s"] < timeout / 2, records[1]  # nothing pulled in round 1
    assert records[2]["exchange_s"] < timeout + 1.0, records[2]  # its pull ends by the deadline
    assert records[2]["received"] == 0
    expected = [("mallory", "relay_duplicate")] * (queued - 1)
    if queued:
        expected.append(("mallory", "relay_buffer_unavailable"))  # pulled in round 2
    assert rejected == expected


def test_a_pull_never_outlasts_the_round_and_intake_ends_at_the_deadline(
    tmp_path: Path,
) -> None:
    """R1: a pull waited round_timeout_s wherever in the round it began (a relay
    that became ready late stretched the round to 2 x the timeout), and the
    intake loop ran on after the deadline while the inbox held anything. Now a
    pull ends by the round's deadline, and intake ends there too: what is
    still queued is refused by the next round (`relay_wrong_round`), counted."""
    from protocols.feder import FedER
    from protocols.feder_relays import RELAY_KIND

    timeout = 3.0
    names = ["bob", "zed", "victim"]
    ring = derive_ring(names, seed=0, round_no=1)
    assert ring_successor(ring, "zed", {"bob", "victim"})[0] == "bob"  # zed -> bob -> victim
    cfg = _victim_config(tmp_path, rounds=2, round_timeout_s=timeout)
    network = InMemoryNetwork(inline_train=True)
    victim = FedER(cfg.protocol)  # type: ignore[arg-type]
    victim.own_buffer = _buffer()
    network.join("bob")
    zed = network.join("zed")  # serves no buffer: its pull waits until it is cut off
    model = _model(cfg)

    async def scenario() -> None:
        ctx = network.join("victim", cfg)
        # zed's relay waits behind bob; its buffer must be pulled
        await zed.send("victim", RELAY_KIND, _relay(model, None, 1, buffer_hash="1" * 64), 1)
        task = asyncio.create_task(victim.run(ctx))
        while set(victim.waiting) != {"zed"} and not task.done():
            await asyncio.sleep(0.01)  # the round began; zed's relay waits behind bob
        await asyncio.sleep(timeout / 2)
        network.kill("bob")  # zed's relay is ready: its pull may use what is left
        while victim.waiting and not task.done():
            await asyncio.sleep(0.01)
        for _ in range(20):  # queued behind the pull: still there at the deadline
            await zed.send("victim", RELAY_KIND, _relay(model, _buffer(), 1), 1)
        await task

    asyncio.run(scenario())
    records = {r["round"]: r for r in network.records if r["node"] == "victim"}
    assert records[1]["exchange_s"] < timeout + 0.7, records[1]  # was ~1.5 x the timeout
    assert records[1]["received"] == 0
    rejected = [(r["peer"], r["reason"]) for r in network.rejections]
    assert rejected[0] == ("zed", "relay_buffer_unavailable")
    assert rejected[1:] == [("zed", "relay_wrong_round")] * 20  # in round 2, counted
    assert records[2]["relays_refused"] == 20


def test_a_ring_holds_one_early_relay_per_round_not_per_sender(tmp_path: Path) -> None:
    """R3: one early slot per sender refused an honest sender that precedes
    the node in two of the next rounds (`relay_wrong_round`, counted against
    it; the node trained that round alone). In a ring one relay is held per
    round, from that round's predecessor; another member's relay for a round
    is refused on arrival (`relay_not_predecessor`) and takes no slot."""
    names = ["bob", "carol", "victim"]
    assert [_predecessor(names, 4, r) for r in (1, 2, 3)] == ["bob", "carol", "carol"]
    cfg = _victim_config(tmp_path, rounds=3, seed=4)
    model, buffer = _model(cfg), _buffer()
    pushes = [
        ("bob", 2, _relay(model, buffer, 2)),  # not round 2's predecessor
        ("carol", 2, _relay(model, buffer, 2)),  # honest and fast: rounds 2 and 3 sent
        ("carol", 3, _relay(model, buffer, 3)),
        ("bob", 1, _relay(model, buffer, 1)),  # honest and late
    ]
    victim, records, rejected = _run_victim(cfg, pushes, members=("bob", "carol"))
    assert [records[r]["received"] for r in (1, 2, 3)] == [1, 1, 1]
    assert victim.merged == [[1, [["bob", 1]]], [2, [["carol", 2]]], [3, [["carol", 3]]]]
    assert rejected == [("bob", "relay_not_predecessor")]


def test_with_random_successors_a_sender_holds_one_early_relay(tmp_path: Path) -> None:
    """Where any member may send (`successor: random` or `heuristic`), early
    relays are held one per sender, so no member pins more than one slot."""
    cfg = _victim_config(tmp_path, rounds=3, successor="random")
    model, buffer = _model(cfg), _buffer()
    pushes = [
        ("mallory", 2, _relay(model, buffer, 2)),
        ("mallory", 3, _relay(model, buffer, 3)),  # its one slot is taken
        ("eve", 3, _relay(model, buffer, 3)),
        ("eve", 1, _relay(model, buffer, 1)),
    ]
    victim, records, rejected = _run_victim(cfg, pushes, members=("mallory", "eve"))
    assert victim.merged == [[1, [["eve", 1]]], [2, [["mallory", 2]]], [3, [["eve", 3]]]]
    assert rejected == [("mallory", "relay_wrong_round")]


def test_buffers_of_differently_configured_honest_sites_are_resized_not_refused(
    tmp_path: Path,
) -> None:
    """R4: a received buffer had to match the receiver's own (C, H, W) and at
    most 2 x its own buffer_size, though genbuffer.resolution and .channels, a
    loaded generator and protocol.buffer_size are each site's own settings:
    every relay from a differently configured honest site was refused, every
    round. Within the federation's bounds a buffer is now taken and resized to
    the classifier's input, as before the first fixes; buffer_size itself is
    capped at what every peer takes."""
    from pydantic import ValidationError

    from p2pfl.config import FedERParams

    cfg = _victim_config(tmp_path, buffer_size=8)  # victim's own buffer: (8, 1, 8, 8)
    model = _model(cfg)
    cases = {
        "peer genbuffer.resolution 16": (8, 1, 16, 16),
        "peer buffer_size 32": (32, 1, 8, 8),
        "peer RGB generator": (8, 3, 8, 8),
        "peer RGBA generator, buffer_size 2048": (2048, 4, 16, 16),
        "peer genbuffer.resolution 256": (4, 3, 256, 256),
    }
    for label, shape in cases.items():
        buffer = _buffer_of(torch.randint(0, 256, shape, dtype=torch.uint8))
        victim, records, rejected = _run_victim(cfg, [("mallory", 1, _relay(model, buffer))])
        assert rejected == [] and records[1]["received"] == 1, label
        assert victim.replay[buffer["content_hash"]].shape == (shape[0], 8, 8, 1), label
        assert records[1]["replayed_images"] == shape[0], label
    FedERParams(name="feder", buffer_size=2048)
    with pytest.raises(ValidationError):
        FedERParams(name="feder", buffer_size=2049)


def test_replay_images_are_made_in_chunks_like_the_whole_buffer_at_once() -> None:
    """The classifier's images are made CONVERT_CHUNK images at a time (the float
    copy convert_images makes is a chunk's, not a 2048 x 256 px buffer's)."""
    from p2pfl.learning.data.loaders import convert_images
    from protocols.feder_buffers import CONVERT_CHUNK, replay_images

    buffer = _buffer_of(torch.randint(0, 256, (2 * CONVERT_CHUNK + 3, 3, 16, 16)).to(torch.uint8))
    whole = convert_images(buffer["images"].permute(0, 2, 3, 1).contiguous().numpy(), 8, 1)
    assert np.array_equal(replay_images(buffer, 8, 1), whole)


def test_a_held_early_relay_survives_a_restart(tmp_path: Path) -> None:
    """R5: a relay held for a later round left the inbox, so the end-of-round
    checkpoint counted its push as consumed (journaled, never requeued), but
    the relay itself was not saved: a node restarted after round 1 lost its
    round-2 relay and trained that round alone. The checkpoint now keeps held
    relays, and the restarted node takes it in its round, checked in full."""
    from protocols.feder import FedER
    from protocols.feder_relays import RELAY_KIND

    cfg1 = _victim_config(tmp_path, rounds=1)
    cfg2 = _victim_config(tmp_path, rounds=2)
    model, buffer = _model(cfg1), _buffer()
    network = InMemoryNetwork(inline_train=True)
    mallory = network.join("mallory")  # the ring predecessor (two members)

    async def first() -> None:
        ctx = network.join("victim", cfg1)
        await mallory.send("victim", RELAY_KIND, _relay(model, buffer, 2), 2)
        await mallory.send("victim", RELAY_KIND, _relay(model, buffer, 1), 1)
        victim = FedER(cfg1.protocol)  # type: ignore[arg-type]
        victim.own_buffer = _buffer()
        await victim.run(ctx)

    asyncio.run(first())
    saved = network.saved_state("victim")
    assert saved is not None
    held = [(x["sender"], x["round"]) for x in saved.get("early", [])]

    async def restarted() -> FedER:
        ctx = network.join("victim", cfg2)  # a new process: empty inboxes
        victim = FedER(cfg2.protocol)  # type: ignore[arg-type]
        await victim.run(ctx)
        return victim

    victim = asyncio.run(restarted())
    records = {r["round"]: r for r in network.records if r["node"] == "victim"}
    assert records[2]["received"] == 1 and network.rejections == []
    assert victim.merged[-1] == [2, [["mallory", 2]]] and victim.early == []
    assert held == [("mallory", 2)]
    assert network.saved_state("victim")["early"] == []  # type: ignore[index]


@pytest.mark.parametrize("case", ["labels", "labels_negative", "hash"])
def test_a_relayed_buffer_with_labels_out_of_range_or_bytes_off_its_hash_is_refused(
    tmp_path: Path, case: str
) -> None:
    """Review 6: the threat model's promises that a relayed buffer's labels are
    below the class count and its bytes match its hash had no intake test."""
    cfg = _victim_config(tmp_path, rounds=2)
    images = torch.zeros((8, 1, 8, 8), dtype=torch.uint8)
    if case == "hash":
        hostile = _buffer_of(images)
        hostile["images"] = images + 1  # the bytes changed after hashing
        reason = "relay_buffer_hash"
    else:
        bad = 7 if case == "labels" else -1  # digits here: a 2-site split of 10 classes
        labels = torch.full((8,), bad, dtype=torch.int64)
        labels[0] = 0
        hostile = _buffer_of(images, labels if case == "labels_negative" else labels + 1000)
        reason = "relay_buffer_labels"
    _, records, rejected = _run_victim(cfg, [("mallory", 1, _relay(_model(cfg), hostile))])
    assert rejected == [("mallory", reason)]
    assert records[1]["received"] == 0 and set(records) == {1, 2}  # it went on
