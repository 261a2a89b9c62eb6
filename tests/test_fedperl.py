"""FedPerl and SSFL-P2P on in-memory federations of digit sites; FixMatch pieces."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensor_util import tensors_in
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
from protocols import create, secagg
from protocols.communities import COMMUNITY_KEY, FEATURES_KEY
from protocols.fedperl import ANON_PURPOSE, FedPerl
from protocols.memory import InMemoryContext, InMemoryNetwork, simulate, simulation_configs
from protocols.secagg import SECAGG_KIND
from protocols.secure_exchange import SecureExchange
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
        assert by_node(result.records, node, "anon_dropped")[:2] == [0.0, 0.0]
        assert by_node(result.records, node, "peer_learning") == [0.0, 1.0, 1.0]
        assert by_node(result.records, node, "consistency_loss")[0] == 0.0
        assert by_node(result.records, node, "consistency_loss")[2] > 0.0
        for key in ("macro_f1", "ece", "val_accuracy", "mask_rate"):
            assert all(v is not None for v in by_node(result.records, node, key))
    # who chose whom: T = 2 peers per node per peer-learning round
    assert len(result.choices) == 8 and all(len(c["chosen"]) == 2 for c in result.choices)
    assert all(c["node"] not in c["chosen"] for c in result.choices)
    # 8 anonymized peers built by secure sums of 2 (4 rounds to each of 2 contributors + the
    # consistency check); FedAVGP2P pulled 4 x 3 x 2 models
    assert result.messages_sent(SECAGG_KIND) == 8 * 5 * 2
    assert result.messages_sent("model") == 24
    # feature vectors are gossiped; communities are not (no node reads them: /status shows
    # a node's own)
    observer = network.join("observer")
    meta = {p.name: p.meta for p in observer.peers()}
    assert meta["site0"][FEATURES_KEY]["round"] == 3
    assert len(meta["site0"][FEATURES_KEY]["vector"]) > 10
    assert all(COMMUNITY_KEY not in m for m in meta.values())
    saved = network.saved_state("site0")
    assert saved is not None and saved["protocol"] == "fedperl" and saved["peer_state"] is None


def test_a_restarted_node_resumes_with_its_anonymized_peer(
    sources: list[str], tmp_path: Path
) -> None:
    cfgs = configs(sources, {"name": "fedperl", "rounds": 3, "warmup_rounds": 1, "fraction": 1.0})
    network = InMemoryNetwork(inline_train=True, checkpoint_dir=tmp_path)

    async def crash_in_round_3() -> None:
        async def kill_all() -> None:
            # With c = 1 nobody can finish round 3 before the last node trained it,
            # and every round-2 sum is complete once all nodes are in round 3.
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
    assert result.messages_sent(SECAGG_KIND) == 0
    assert result.messages_sent("model") == 4 * 3 * 2  # everybody, every round
    for node in SITES:
        assert by_node(result.records, node, "peer_learning") == [0.0, 0.0]
        assert by_node(result.records, node, "neighbours") == [3, 3]
    assert len(result.choices) == 8  # SSFL records its FedAVGP2P neighbours


def test_status_shows_fixmatchs_class_weighting_not_the_training_sections(tmp_path: Path) -> None:
    """FixMatch weights its loss by protocol.class_weighted; /status's training
    block shows that choice whatever training.class_weighted says."""
    partition_dataset("digits", 2, "iid", tmp_path, label_fraction=0.5, seed=0)
    cfgs = simulation_configs(
        [str(tmp_path / f"site_{i}.npz") for i in range(2)],
        names=SITES[:2],
        protocol={"name": "ssfl", "rounds": 1, "fraction": 1.0, "class_weighted": False},
        data={"image_size": 8, "augment": "none"},
        training={"device": "cpu", "max_steps_per_epoch": 1, "class_weighted": True},
    )
    network = InMemoryNetwork(inline_train=True)
    assert asyncio.run(simulate(cfgs, network=network)).errors == {}
    for node in SITES[:2]:
        weighting = network.training[node]["class_weighting"]
        assert weighting["mode"] == "false" and weighting["applied"] is False


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
    assert result.messages_sent(SECAGG_KIND) == 0
    assert all(c["chosen"] == [] for c in result.choices)
    for node in SITES:
        assert by_node(result.records, node, "peer_learning") == [0.0, 0.0]


# ---------------------------------------------------------------------- anonymized peer, directly


def model_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"w": torch.randn(64), "b": torch.randn(3, 4), "n": torch.tensor(seed)}


def contributor_federation(
    names: list[str], top_t: int = 2, timeout_s: float = 10.0, **params: Any
) -> tuple[InMemoryNetwork, dict[str, InMemoryContext], dict[str, FedPerl]]:
    """A requester and contributors in memory. `timeout_s` is each request's
    wait: a peer that answers does so at once, so only a silenced one costs
    it, and 0.5 s was too short for key agreement at a load average of 12."""
    network = InMemoryNetwork()
    ctxs = {name: network.join(name) for name in ["req", *names]}
    protocols: dict[str, FedPerl] = {}
    for i, name in enumerate(names):
        protocol = FedPerl(
            FedPerlParams(name="fedperl", top_t=top_t, round_timeout_s=timeout_s, **params)
        )
        protocol.store.put(1, model_state(i), 100)
        protocol.anonymizer.start(ctxs[name])
        protocols[name] = protocol
    requester = FedPerl(
        FedPerlParams(name="fedperl", top_t=top_t, round_timeout_s=timeout_s, **params)
    )
    return network, ctxs, {"req": requester, **protocols}


def plain_mean(names: list[str], all_names: list[str]) -> dict[str, torch.Tensor]:
    states = [model_state(all_names.index(n)) for n in names]
    return {k: torch.stack([s[k] for s in states]).mean(0) for k in ("w", "b")}


async def anonymized_peer(
    protocols: dict[str, FedPerl], ctxs: dict[str, InMemoryContext], names: list[str]
) -> secagg.SecureSum | None:
    return await protocols["req"].anonymizer.sum_of(
        ctxs["req"], 1, model_state(42), names, purpose=ANON_PURPOSE
    )


async def test_the_requester_gets_the_mean_and_only_masked_contributions_travel() -> None:
    names = ["p1", "p2", "p3"]
    network, ctxs, protocols = contributor_federation(names, top_t=3)
    peer = await anonymized_peer(protocols, ctxs, names)
    assert peer is not None and peer.contributors == names
    expected = plain_mean(names, names)  # Eq. 4: the plain mean, every model weighs 1
    for key in ("w", "b"):
        assert torch.allclose(peer.mean[key], expected[key], atol=1e-6)
    assert torch.equal(peer.mean["n"], model_state(42)["n"])  # counters: the requester's own
    for name in names:
        assert network.traffic(name).by_kind.keys() == {SECAGG_KIND}  # no plain "model" reply


async def test_a_contributor_dead_before_masking_is_left_out_of_a_fresh_session() -> None:
    names = ["p1", "p2", "p3"]
    network, ctxs, protocols = contributor_federation(names, top_t=3)
    network.kill("p3")
    peer = await anonymized_peer(protocols, ctxs, names)
    assert peer is not None and peer.contributors == ["p1", "p2"]
    assert torch.allclose(peer.mean["w"], plain_mean(["p1", "p2"], names)["w"], atol=1e-6)


async def test_with_fewer_than_two_contributors_left_there_is_no_peer() -> None:
    names = ["p1", "p2"]
    network, ctxs, protocols = contributor_federation(names, timeout_s=0.5)
    network.silence("p2")  # looks alive, never answers: costs the timeout
    assert await anonymized_peer(protocols, ctxs, names) is None
    # p1 never sent its model in clear
    assert "model" not in network.traffic("p1").by_kind


async def test_the_subset_difference_attack_gets_one_sum_only() -> None:
    """The old retry rule answered {p1,p2,p3} and then its strict subset
    {p1,p2}: their difference is p3's model. Each model now goes into one sum
    per requester, so the second sum is refused."""
    names = ["p1", "p2", "p3"]
    _, ctxs, protocols = contributor_federation(names, top_t=3)
    first = await anonymized_peer(protocols, ctxs, names)
    assert first is not None and first.contributors == names
    assert await anonymized_peer(protocols, ctxs, ["p1", "p2"]) is None
    reply = await ctxs["req"].request(
        "p1",
        SECAGG_KIND,
        {
            "session": "a" * 32,
            "phase": "advertise",
            "contributors": ["p1", "p2"],
            "round": 1,
            "max_round": 1,
            "purpose": ANON_PURPOSE,
        },
        timeout=1.0,
    )
    assert reply == {"refused": "already_contributed"}


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_secure_fedperl_shows_no_individual_model_to_any_node(
    sources: list[str], compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With secure_aggregation every model a node receives is inside a secure
    sum: no plain `model` reply travels, and every tensor any node receives
    is integer masked data (the anonymized peer and the FedAVGP2P step alike).
    With int8 the sums are in the narrow rings, and the community's sums and
    those over the other neighbours keep their own steps (two groups of one
    purpose: one's spread would drop or coarsen the other's sums)."""
    streams: list[str] = []
    decoded_well = SecureExchange.decoded_well

    async def spying(
        self: SecureExchange, ctx: Any, round_no: int, stream: str, *rest: Any
    ) -> bool:
        streams.append(stream)
        return await decoded_well(self, ctx, round_no, stream, *rest)

    monkeypatch.setattr(SecureExchange, "decoded_well", spying)
    network = InMemoryNetwork(inline_train=True)
    received: list[Any] = []
    original = network.request

    async def recording(
        src: str, dst: str, kind: str, query: dict[str, Any], timeout: float
    ) -> Any:
        reply = await original(src, dst, kind, query, timeout)
        received.append((kind, reply))
        return reply

    network.request = recording  # type: ignore[method-assign]
    cfgs = configs(
        sources,
        {
            "name": "fedperl",
            "rounds": 3,
            "warmup_rounds": 1,
            "top_t": 2,
            "fraction": 1.0,
            "secure_aggregation": True,
            "compression": compression,
            # the neighbour counts below assume no sum times out: 5 s did once
            # on a loaded machine (a round-2 sum of 0); rounds end as soon as
            # every sum is in, so this costs nothing when the machine is idle
            "round_timeout_s": 30.0,
        },
    )
    result = asyncio.run(simulate(cfgs, network=network))
    assert result.errors == {}
    assert result.messages_sent("model") == 0
    kinds = {kind for kind, _ in received}
    assert kinds == {SECAGG_KIND}
    floats = [t for _, reply in received for t in tensors_in(reply) if t.is_floating_point()]
    assert floats == []
    for node in SITES:
        # rounds 1-2: the community's sum (2), and k - T = 1 other raised to 2 for a sum of
        # its own, but only 1 other is left: no second sum; round 3 (no peer learning
        # after the last round): one sum over all 3 others
        assert by_node(result.records, node, "neighbours") == [2, 2, 3]
        assert by_node(result.records, node, "anon_contributors") == [2.0, 2.0, 0.0]
        assert by_node(result.records, node, "peer_learning") == [0.0, 1.0, 1.0]
        assert all(v is not None for v in by_node(result.records, node, "macro_f1"))
    dtypes = {t.dtype for _, reply in received for t in tensors_in(reply)}
    if compression == "int8":
        assert torch.int8 in dtypes and set(streams) == {"community", "others"}
    else:
        assert torch.int8 not in dtypes


@pytest.mark.slow
def test_local_baselines_report_f1_and_calibration(sources: list[str]) -> None:
    cfgs = configs(sources, {"name": "ssfl", "rounds": 2}, n=2)
    for result in (local_supervised(cfgs), local_fixmatch(cfgs)):
        assert len(result.records) == 4
        assert all(0.0 <= r["macro_f1"] <= 1.0 and 0.0 <= r["ece"] <= 1.0 for r in result.records)
    assert all(r["mask_rate"] == 0.0 for r in local_supervised(cfgs).records)


# ---------------------------------------------------------------------- hostile gossip
# Reviews of 2026-12: a peer sending each node its own feature vector back was
# the most similar peer (and anonymized-peer contributor) of every node; two
# peers gossiping finite +-1.7e308 made similarities NaN, /status refused the
# community and the node stopped training; a val_accuracy of 1e9 passed every gate.


class GossipContext:
    """What FedPerl's community step reads of a RoundContext, with a real
    Telemetry behind set_community (it refuses NaN, as /status must)."""

    def __init__(self, me: str, peers: dict[str, dict[str, Any]]) -> None:
        from types import SimpleNamespace

        from node.telemetry import Telemetry
        from protocols.base import PeerInfo

        self.me = me
        self.config = SimpleNamespace(federation=SimpleNamespace(seed=0))
        self._peers = [PeerInfo(n, "alive", meta=m) for n, m in sorted(peers.items())]
        self.telemetry = Telemetry(me)
        self.rejected: list[tuple[str, str]] = []
        self.published: dict[str, Any] = {}

    def peers(self) -> list[Any]:
        return list(self._peers)

    def reject(self, peer: str, reason: str) -> None:
        self.rejected.append((peer, reason))

    def publish(self, key: str, value: Any) -> None:
        self.published[key] = value

    def set_community(self, community: dict[str, Any]) -> None:
        self.telemetry.set_community(community)


def honest_features(n: int = 6) -> dict[str, list[float]]:
    from p2pfl.learning.models import create_model
    from p2pfl.learning.state import feature_vector

    torch.manual_seed(0)
    out = {}
    for i in range(n):
        model = create_model("small_cnn", num_classes=2, in_chans=1, image_size=28)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05 * (i + 1))
        out[f"site{i}"] = feature_vector(model.state_dict())
    return out


def fedperl_node(me: str, own: list[float], **params: Any) -> FedPerl:
    node = create("fedperl", **params)
    assert isinstance(node, FedPerl)
    node.gossip[FEATURES_KEY] = {"round": 3, "vector": own}
    return node


def test_a_peer_echoing_each_nodes_own_vector_joins_no_community_and_is_counted() -> None:
    honest = honest_features()
    for me, own in honest.items():
        peers = {n: {FEATURES_KEY: {"round": 3, "vector": v}} for n, v in honest.items() if n != me}
        peers["zed"] = {FEATURES_KEY: {"round": 3, "vector": list(own)}}  # my own, sent back
        ctx = GossipContext(me, peers)
        node = fedperl_node(me, own, top_t=2, policy="gated_similarity")
        sims = node.similarities(ctx)  # type: ignore[arg-type]
        ranked, chosen = node.choose_peers(ctx, 11, sims)  # type: ignore[arg-type]
        assert "zed" not in sims and "zed" not in ranked  # before: top-1 of all 6, sim 1.0
        assert ctx.rejected == [("zed", "gossip_echo")]


def test_extreme_feature_vectors_are_refused_and_the_node_keeps_training() -> None:
    """demo4 of the review: two colluders, finite +-1.7e308 in two columns,
    fewer honest peers than top_t (so the community is filled at random)."""
    width = 8
    mine = [0.01 * i for i in range(width)]
    e1 = [0.0] * width
    e1[0], e1[1] = 1.7e308, -1.7e308
    e2 = [-x for x in e1]
    peers = {
        "h1": {FEATURES_KEY: {"vector": [0.012 * i for i in range(width)]}},
        "e1": {FEATURES_KEY: {"vector": e1}},
        "e2": {FEATURES_KEY: {"vector": e2}},
        "e3": {FEATURES_KEY: {"vector": [1e300, "x"]}},
        "e4": {FEATURES_KEY: {"vector": "not a list"}},
    }
    ctx = GossipContext("me", peers)
    node = fedperl_node("me", mine, top_t=2, warmup_rounds=20)
    sims = node.similarities(ctx)  # type: ignore[arg-type]
    assert set(sims) == {"h1"} and all(np.isfinite(list(sims.values())))
    # peer_learning shows the community on /status (no NaN, no exception) and gossips nothing
    out = asyncio.run(node.peer_learning(ctx, None, 11, {}))  # type: ignore[arg-type]
    assert out == {"anon_contributors": 0.0}  # warm-up
    assert ctx.published == {} and COMMUNITY_KEY not in node.gossip
    shown = ctx.telemetry.status_json("me", "fedperl")["community"]
    assert shown["similarity"]["h1"] is not None
    assert all(v is None or np.isfinite(v) for v in shown["similarity"].values())
    assert sorted(ctx.rejected) == sorted(
        [
            ("e1", "gossip_features_range"),
            ("e2", "gossip_features_range"),
            ("e3", "gossip_features_length"),  # its length is checked first now
            ("e4", "gossip_features_malformed"),
        ]
        * 2  # similarities() above, then peer_learning's own call: once per round
    )


def test_vectors_of_another_length_are_refused_so_colluders_cannot_drop_mine() -> None:
    """Review 6: the similarity matrix keeps the most common length, so two
    colluders sending vectors one entry longer than the honest ones (mine and
    h1's) left this node out of its own matrix (no similarities at all) and
    nothing was counted; an empty vector was dropped silently too."""
    width = 8
    mine = [0.01 * i for i in range(width)]
    peers = {
        "h1": {FEATURES_KEY: {"vector": [0.012 * i for i in range(width)]}},
        "c1": {FEATURES_KEY: {"vector": [0.02 * i for i in range(width + 1)]}},
        "c2": {FEATURES_KEY: {"vector": [0.03 * i for i in range(width + 1)]}},
        "c3": {FEATURES_KEY: {"vector": []}},
    }
    ctx = GossipContext("me", peers)
    node = fedperl_node("me", mine, top_t=2, warmup_rounds=20)
    sims = node.similarities(ctx)  # type: ignore[arg-type]
    assert set(sims) == {"h1"}
    assert sorted(ctx.rejected) == [
        ("c1", "gossip_features_length"),
        ("c2", "gossip_features_length"),
        ("c3", "gossip_features_length"),
    ]


class Unreadable(list):  # type: ignore[type-arg]
    """A gossiped vector whose numbers must not be read (len is free)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a huge feature vector read number by number")

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        raise AssertionError("a huge feature vector read number by number")


def test_a_feature_vector_is_checked_by_type_and_length_before_its_numbers_are_read() -> None:
    """A review (rv_proto2, 2026-11-28): every number of a peer's vector was
    converted before its length was compared with mine, once a round per peer
    on the event loop (20 million: about 1.6 s), and numbers sent as text or
    booleans were taken ("1e5" as 100000.0, True as 1.0)."""
    width = 8
    mine = [0.01 * i for i in range(width)]
    peers = {
        "h1": {FEATURES_KEY: {"vector": [0.012 * i for i in range(width)]}},
        "huge": {FEATURES_KEY: {"vector": Unreadable([0.0] * 100_000)}},
        "text": {FEATURES_KEY: {"vector": ["1e5"] * width}},
        "bools": {FEATURES_KEY: {"vector": [True] * width}},
        "nested": {FEATURES_KEY: {"vector": [[0.0]] * width}},
        "ints": {FEATURES_KEY: {"vector": list(range(width))}},  # numbers all the same
    }
    ctx = GossipContext("me", peers)
    node = fedperl_node("me", mine, top_t=2, warmup_rounds=20)
    sims = node.similarities(ctx)  # type: ignore[arg-type]
    assert set(sims) == {"h1", "ints"}
    assert sorted(ctx.rejected) == [
        ("bools", "gossip_features_malformed"),
        ("huge", "gossip_features_length"),
        ("nested", "gossip_features_malformed"),
        ("text", "gossip_features_malformed"),
    ]
    # without a vector of its own a node has no similarities and reads none
    ctx = GossipContext("me", peers)
    assert create("fedperl", top_t=2).similarities(ctx) == {}  # type: ignore[union-attr, arg-type]
    assert ctx.rejected == []


def test_a_nan_similarity_is_shown_as_none() -> None:
    from protocols.fedperl import round_sim

    assert round_sim(float("nan")) is None and round_sim(float("inf")) is None
    assert round_sim(0.123456) == 0.1235 and round_sim(None) is None


@pytest.mark.parametrize("claim", [1e9, -0.5, float("nan"), float("inf"), "0.9", True])
def test_a_validation_accuracy_outside_0_1_passes_no_gate_and_is_counted(claim: Any) -> None:
    honest = honest_features(3)
    peers = {
        "site1": {FEATURES_KEY: {"vector": honest["site1"]}, "val_accuracy": 0.9},
        "liar": {FEATURES_KEY: {"vector": honest["site2"]}, "val_accuracy": claim},
    }
    ctx = GossipContext("site0", peers)
    node = fedperl_node("site0", honest["site0"], top_t=2, policy="gated_validation", rho=0.5)
    ranked, chosen = node.choose_peers(ctx, 11, node.similarities(ctx))  # type: ignore[arg-type]
    assert sorted(ranked) == ["liar", "site1"] and chosen == ["site1"]
    assert ctx.rejected == [("liar", "gossip_val_accuracy_range")]
    # the policies that do not read it do not count it
    static = fedperl_node("site0", honest["site0"], top_t=2, policy="static")
    ctx.rejected.clear()
    static.choose_peers(ctx, 11, static.similarities(ctx))  # type: ignore[arg-type]
    assert ctx.rejected == []


def test_a_near_copy_of_a_nodes_vector_still_joins_its_community_the_stated_limit() -> None:
    """Not fixed (docs/threat-model.md): a vector off from the node's own in
    one entry by more than float tolerance is no echo; the sender is its most similar peer
    and, in the community, steers the anonymized peer within the norm bound."""
    honest = honest_features()
    captured = 0
    for me, own in honest.items():
        peers = {n: {FEATURES_KEY: {"vector": v}} for n, v in honest.items() if n != me}
        copy = list(own)
        copy[0] *= 1 + 1e-6  # one entry off by more than float tolerance
        peers["zed"] = {FEATURES_KEY: {"vector": copy}}
        ctx = GossipContext(me, peers)
        node = fedperl_node(me, own, top_t=2)
        ranked, _ = node.choose_peers(ctx, 11, node.similarities(ctx))  # type: ignore[arg-type]
        captured += ranked[0] == "zed"
        assert ctx.rejected == []
    assert captured == len(honest)
