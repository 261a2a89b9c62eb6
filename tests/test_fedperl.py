"""FedPerl and SSFL-P2P on in-memory federations of digit sites; FixMatch pieces."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from bench.semisup_baselines import local_fixmatch, local_supervised
from p2pfl.config import FedPerlParams, SiteConfig
from p2pfl.learning.data.partition import partition_dataset
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.semisup import (
    fixmatch_epoch,
    fixmatch_loss,
    pseudo_labels,
    steps_per_epoch,
    supervised_epoch,
)
from protocols import create, masking
from protocols.communities import COMMUNITY_KEY, FEATURES_KEY
from protocols.fedperl import ANON_KIND, FedPerl
from protocols.memory import InMemoryContext, InMemoryNetwork, simulate, simulation_configs
from protocols.site import build_site
from protocols.ssfl import SSFL

SITES = ["site0", "site1", "site2", "site3"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The embedded digits over 4 sites, 30% of each site's images labeled."""
    out: Path = tmp_path_factory.mktemp("digits4ssl")
    partition_dataset("digits", 4, "dirichlet:1.0", out, label_fraction=0.3, seed=0)
    return [str(out / f"site_{i}.npz") for i in range(4)]


def configs(sources: list[str], protocol: dict[str, Any], n: int = 4) -> list[SiteConfig]:
    return simulation_configs(
        sources[:n],
        names=SITES[:n],
        protocol={"round_timeout_s": 5.0, **protocol},
        data={"image_size": 8, "augment": "weak"},
        training={"batch_size": 32, "lr": 3e-3, "device": "cpu", "max_steps_per_epoch": 3},
    )


def by_node(records: list[dict[str, Any]], node: str, key: str) -> list[Any]:
    return [r.get(key) for r in sorted(records, key=lambda r: r["round"]) if r["node"] == node]


# ---------------------------------------------------------------------- FixMatch pieces


def test_pseudo_labels_use_the_mean_of_local_and_peer_softmax() -> None:
    local = torch.tensor([[0.5, 0.5], [0.1, 0.9], [0.55, 0.45]])
    peer = torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.45, 0.55]])
    labels, mask = pseudo_labels(local, tau=0.6)  # Eq. 3: local only
    assert mask.tolist() == [False, True, False]
    labels, mask = pseudo_labels(local, tau=0.6, peer_probs=peer)  # Eq. 4: (local + peer) / 2
    assert mask.tolist() == [True, True, False]  # q = (0.7, 0.3), (0.1, 0.9), (0.5, 0.5)
    assert labels.tolist()[:2] == [0, 1]


def test_consistency_loss_sends_gradient_into_the_local_model_only() -> None:
    torch.manual_seed(0)
    local = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    peer = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    u = torch.randn(6, 1, 2, 2)
    empty_x, empty_y = u[:0], torch.zeros(0, dtype=torch.int64)
    losses = fixmatch_loss(
        local, empty_x, empty_y, u, u, tau=2.0, beta=0.0, peer_model=peer, gamma=1.0
    )
    assert float(losses.consistency.detach()) > 0
    losses.total.backward()
    assert float(local[1].weight.grad.abs().sum()) > 0  # the reference code's no_grad bug is gone
    assert peer[1].weight.grad is None
    local.zero_grad()
    without = fixmatch_loss(
        local, empty_x, empty_y, u, u, tau=2.0, beta=0.0, peer_model=peer, gamma=0.0
    )
    assert float(without.total.detach()) == 0.0


def test_fixmatch_epoch_walks_the_unlabeled_set_and_lower_bound_matches_its_steps(
    sources: list[str],
) -> None:
    cfg = configs(sources, {"name": "ssfl"})[0]
    cfg.training.max_steps_per_epoch = None
    site = build_site(cfg)
    labeled, unlabeled = len(site.data.train), len(site.data.unlabeled)
    assert unlabeled > 2 * labeled  # 30% labeled
    steps = steps_per_epoch(site, unlabeled_ratio=2)
    assert steps == -(-unlabeled // 64)  # ceil(U / (mu * B)) > ceil(L / B)
    fit = fixmatch_epoch(site, tau=0.0, unlabeled_ratio=2)
    assert fit["steps"] == steps
    assert fit["mask_rate"] == 1.0  # tau = 0: every unlabeled image gets a pseudo-label
    assert fit["unlabeled"] > 0
    low = supervised_epoch(site, unlabeled_ratio=2)
    assert low["steps"] == steps and low["unlabeled"] == 0.0 and low["mask_rate"] == 0.0
    site.training.steps_per_round = 3  # equal work per site, whatever its size
    assert fixmatch_epoch(site)["steps"] == 3
    assert supervised_epoch(site)["steps"] == 3


def test_fixmatch_without_unlabeled_images_says_how_to_fix_it(tmp_path: Path) -> None:
    partition_dataset("digits", 2, "iid", tmp_path, seed=0)
    cfg = simulation_configs(
        [str(tmp_path / "site_0.npz")],
        protocol={"name": "ssfl"},
        data={"image_size": 8},
        training={"device": "cpu"},
    )[0]
    with pytest.raises(TrainingError) as err:
        fixmatch_epoch(build_site(cfg))
    assert err.value.reason == "no_unlabeled" and "label_fraction" in str(err.value)


# ---------------------------------------------------------------------- the protocols


def test_registry_builds_both_protocols() -> None:
    assert isinstance(create("ssfl"), SSFL)
    fedperl = create("fedperl", top_t=3, policy="gated_similarity")
    assert isinstance(fedperl, FedPerl) and fedperl.params.top_t == 3


def test_fedperl_learns_from_anonymized_peers_after_warm_up(sources: list[str]) -> None:
    network = InMemoryNetwork(inline_train=True)
    cfgs = configs(sources, {"name": "fedperl", "rounds": 3, "warmup_rounds": 1, "top_t": 2})
    result = asyncio.run(simulate(cfgs, network=network))
    assert result.errors == {}
    for node in SITES:
        # peers are built at the end of rounds 1 and 2 and used in rounds 2 and 3
        assert by_node(result.records, node, "anon_contributors") == [2.0, 2.0, 0.0]
        assert by_node(result.records, node, "anon_attempts")[:2] == [1.0, 1.0]
        assert by_node(result.records, node, "peer_learning") == [0.0, 1.0, 1.0]
        assert by_node(result.records, node, "consistency_loss")[0] == 0.0
        assert by_node(result.records, node, "consistency_loss")[2] > 0.0
        for key in ("macro_f1", "ece", "val_accuracy", "mask_rate"):
            assert all(v is not None for v in by_node(result.records, node, key))
    # who chose whom: T = 2 peers per node per peer-learning round
    assert len(result.choices) == 8 and all(len(c["chosen"]) == 2 for c in result.choices)
    assert all(c["node"] not in c["chosen"] for c in result.choices)
    # 2 contributions per anonymized peer, 8 peers built; FedAVGP2P pulled 4 x 3 x 2 models
    assert result.messages_sent(ANON_KIND) == 16
    assert result.messages_sent("model") == 24
    # feature vectors and communities are gossiped
    observer = network.join("observer")
    meta = {p.name: p.meta for p in observer.peers()}
    assert meta["site0"][FEATURES_KEY]["round"] == 3
    assert len(meta["site0"][FEATURES_KEY]["vector"]) > 10
    community = meta["site0"][COMMUNITY_KEY]
    assert len(community["top_t"]) == 2 and set(community["similarity"]) == set(community["top_t"])
    saved = network.saved_state("site0")
    assert saved is not None and saved["protocol"] == "fedperl" and saved["peer_state"] is None


def test_a_restarted_node_resumes_with_its_anonymized_peer(
    sources: list[str], tmp_path: Path
) -> None:
    cfgs = configs(sources, {"name": "fedperl", "rounds": 3, "warmup_rounds": 1})
    network = InMemoryNetwork(inline_train=True, checkpoint_dir=tmp_path)

    async def crash_in_round_3() -> None:
        async def kill_all() -> None:
            for node in SITES:
                await network.wait_for_round(node, 3)
            for node in SITES:
                network.kill(node)

        killer = asyncio.create_task(kill_all())
        result = await simulate(cfgs, network=network)
        await killer
        assert set(result.errors.values()) == {"killed"}

    asyncio.run(crash_in_round_3())
    saved = network.saved_state("site0")
    assert saved is not None and saved["round"] == 2
    assert isinstance(saved["peer_state"], dict)  # built at the end of round 2
    again = InMemoryNetwork(inline_train=True, checkpoint_dir=tmp_path)
    result = asyncio.run(simulate(cfgs, network=again))
    assert result.errors == {}
    for node in SITES:
        assert by_node(result.records, node, "round") == [3]
        assert by_node(result.records, node, "peer_learning") == [1.0]  # the saved peer


def test_ssfl_is_fixmatch_plus_fedavgp2p_without_peers(sources: list[str]) -> None:
    cfgs = configs(sources, {"name": "ssfl", "rounds": 2, "fraction": 1.0})
    result = asyncio.run(simulate(cfgs, network=InMemoryNetwork(inline_train=True)))
    assert result.errors == {}
    assert result.messages_sent(ANON_KIND) == 0
    assert result.messages_sent("model") == 4 * 3 * 2  # everybody, every round
    for node in SITES:
        assert by_node(result.records, node, "peer_learning") == [0.0, 0.0]
        assert by_node(result.records, node, "neighbours") == [3, 3]
    assert len(result.choices) == 8  # SSFL records its FedAVGP2P neighbours


def test_a_gate_nobody_passes_means_no_peer_and_no_model_sent(sources: list[str]) -> None:
    cfgs = configs(
        sources,
        {
            "name": "fedperl",
            "rounds": 2,
            "warmup_rounds": 1,
            "policy": "gated_similarity",
            "rho": 1.01,
        },
    )
    result = asyncio.run(simulate(cfgs, network=InMemoryNetwork(inline_train=True)))
    assert result.errors == {}
    assert result.messages_sent(ANON_KIND) == 0
    assert all(c["chosen"] == [] for c in result.choices)
    for node in SITES:
        assert by_node(result.records, node, "peer_learning") == [0.0, 0.0]


# ---------------------------------------------------------------------- anonymized peer, directly


def model_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"w": torch.randn(64), "b": torch.randn(3, 4), "n": torch.tensor(seed)}


def contributor_federation(
    names: list[str], top_t: int = 2
) -> tuple[InMemoryNetwork, dict[str, InMemoryContext], dict[str, FedPerl]]:
    network = InMemoryNetwork()
    ctxs = {name: network.join(name) for name in ["req", *names]}
    protocols: dict[str, FedPerl] = {}
    for i, name in enumerate(names):
        protocol = FedPerl(FedPerlParams(name="fedperl", top_t=top_t, round_timeout_s=0.5))
        protocol.keep_for_peers(1, model_state(i), 100)
        protocol.serve_anonymized_peer(ctxs[name])
        protocols[name] = protocol
    requester = FedPerl(FedPerlParams(name="fedperl", top_t=top_t, round_timeout_s=0.5))
    return network, ctxs, {"req": requester, **protocols}


def plain_mean(names: list[str], all_names: list[str]) -> dict[str, torch.Tensor]:
    states = [model_state(all_names.index(n)) for n in names]
    return {k: torch.stack([s[k] for s in states]).mean(0) for k in ("w", "b")}


async def test_the_requester_gets_the_mean_and_only_masked_contributions_travel() -> None:
    names = ["p1", "p2", "p3"]
    network, ctxs, protocols = contributor_federation(names, top_t=3)
    reference = model_state(42)
    state, used, attempts = await protocols["req"].anonymized_peer(ctxs["req"], 1, names, reference)
    assert used == names and attempts == 1 and state is not None
    expected = plain_mean(names, names)
    for key in ("w", "b"):
        assert torch.allclose(state[key], expected[key], atol=1e-6)
    assert torch.equal(state["n"], reference["n"])  # counters: the requester's own
    for name in names:
        assert network.traffic(name).by_kind.keys() == {ANON_KIND}  # no plain "model" reply
    # what one contributor sends is int64 noise, not its model (asked by another requester:
    # "req" already had its answer for this round and set)
    query = {"request_id": "a" * 32, "contributors": names, "round": 1, "max_round": 1}
    reply = await network.join("req2").request("p1", ANON_KIND, query, timeout=1.0)
    assert reply["masked"]["w"].dtype == torch.int64
    decoded = torch.from_numpy(masking.from_fixed(reply["masked"]["w"].numpy().view("uint64")))
    assert float((decoded - model_state(0)["w"].double()).abs().median()) > 1e9


async def test_a_dropped_contributor_is_retried_without_it() -> None:
    names = ["p1", "p2", "p3"]
    network, ctxs, protocols = contributor_federation(names, top_t=3)
    network.kill("p3")
    state, used, attempts = await protocols["req"].anonymized_peer(
        ctxs["req"], 1, names, model_state(42)
    )
    assert used == ["p1", "p2"] and attempts == 2 and state is not None
    expected = plain_mean(["p1", "p2"], names)
    assert torch.allclose(state["w"], expected["w"], atol=1e-6)


async def test_with_fewer_than_two_contributors_left_there_is_no_peer() -> None:
    names = ["p1", "p2"]
    network, ctxs, protocols = contributor_federation(names)
    network.silence("p2")  # looks alive, never answers: costs the timeout
    state, used, attempts = await protocols["req"].anonymized_peer(
        ctxs["req"], 1, names, model_state(42)
    )
    assert state is None and used == [] and attempts == 1
    # p1's masked answer (if any) is useless alone; p1 never sent its model in clear
    assert "model" not in network.traffic("p1").by_kind


async def test_contributors_refuse_requests_that_could_unmask_a_model() -> None:
    names = ["p1", "p2", "p3"]
    _, ctxs, protocols = contributor_federation(names, top_t=3)
    p1, ctx = protocols["p1"], ctxs["p1"]

    async def ask(requester: str, contributors: list[str], request_id: str) -> dict[str, Any]:
        query = {"request_id": request_id, "contributors": contributors, "round": 1, "max_round": 1}
        return await p1.serve_anonymized(ctx, requester, query)

    # the requester must not be a contributor: it would hold a pair secret with p1
    assert (await ask("p2", ["p1", "p2"], "1" * 32))["refused"] == "requester_is_contributor"
    assert (await ask("req", ["p1"], "2" * 32))["refused"] == "bad_request"  # one contributor
    assert (await ask("req", ["p1", "p1"], "3" * 32))["refused"] == "bad_contributors"
    assert (await ask("req", ["p2", "p3"], "4" * 32))["refused"] == "not_a_contributor"
    assert (await ask("req", ["p1", "mallory"], "5" * 32))["refused"] == "unknown_contributor"
    assert "masked" in await ask("req", ["p1", "p2", "p3"], "6" * 32)
    assert (await ask("req", ["p1", "p2", "p3"], "6" * 32))["refused"] == "request_id_reused"
    # same round: only a strict subset (an honest retry) is answered, not an overlapping set
    assert "masked" in await ask("req", ["p1", "p2"], "7" * 32)
    assert (await ask("req", ["p1", "p3"], "8" * 32))["refused"] == "not_a_retry"


@pytest.mark.slow
def test_local_baselines_report_f1_and_calibration(sources: list[str]) -> None:
    cfgs = configs(sources, {"name": "ssfl", "rounds": 2}, n=2)
    for result in (local_supervised(cfgs), local_fixmatch(cfgs)):
        assert len(result.records) == 4
        assert all(0.0 <= r["macro_f1"] <= 1.0 and 0.0 <= r["ece"] <= 1.0 for r in result.records)
    assert all(r["mask_rate"] == 0.0 for r in local_supervised(cfgs).records)
