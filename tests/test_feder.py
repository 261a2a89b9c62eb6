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
from protocols.feder import derive_ring, ring_successor
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
    from protocols.feder import RELAY_KIND, FedER
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
    from protocols.feder import RELAY_KIND, FedER
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
