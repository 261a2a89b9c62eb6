"""A node gossips a key only where some node's configured heuristic or protocol
reads it (a review, 2026-12: per-class F1, which shows which classes a site's
validation split lacks, went to every roster member under every heuristic,
`random` included, which never reads it)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from p2pfl.config import SelectionSection
from protocols import create
from protocols.communities import COMMUNITY_KEY, FEATURES_KEY, VAL_ACCURACY_KEY
from protocols.rounds import RoundLoop
from protocols.selection import F1_KEY, MODEL_STATS_KEY, RECENT_KEY


class Recorder:
    """The parts of a RoundContext gossip goes through."""

    def __init__(self, selection: SelectionSection, saved: dict[str, Any] | None = None) -> None:
        self.me = "me"
        self.config = SimpleNamespace(selection=selection)
        self.published: dict[str, Any] = {}
        self._saved = saved

    def publish(self, key: str, value: Any) -> None:
        self.published[key] = value

    def restore(self) -> dict[str, Any] | None:
        return self._saved

    def durable_file(self, name: str) -> None:
        return None  # keeps nothing across restarts (no privacy ledger)


def gossiped(protocol: RoundLoop[Any], section: SelectionSection) -> set[str]:
    ctx = Recorder(section)
    protocol.selection_history = [["a"], ["b"]]
    protocol.merged = [[1, [["a", 1]]]]  # the round merged a peer's model
    protocol.update_gossip(ctx, [0.9, 0.0, 0.8], [0.1, 0.2])  # type: ignore[arg-type]
    protocol.update_recent(ctx)  # type: ignore[arg-type]
    return set(ctx.published)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (SelectionSection(name="random"), set()),
        (SelectionSection(name="n_latest"), {RECENT_KEY}),
        (SelectionSection(name="f1"), {F1_KEY}),
        (SelectionSection(name="cosine"), {F1_KEY}),  # vector: f1 is the default
        (SelectionSection(name="cosine", vector="model_stats"), {MODEL_STATS_KEY}),
    ],
)
def test_each_heuristic_gets_what_it_reads_and_nothing_else(
    section: SelectionSection, expected: set[str]
) -> None:
    staged = create("fedmae")  # Fed-MAE's pre-training stage is a RoundLoop of its own
    stages = [s.loop for s in staged.stages(None)]  # type: ignore[attr-defined]
    for protocol in [create(n) for n in ("fedavgp2p", "fedsgdp2p", "ssfl", "fedperl")] + stages:
        assert isinstance(protocol, RoundLoop)
        assert gossiped(protocol, section) == expected, type(protocol).__name__


@pytest.mark.parametrize(
    ("name", "params", "extra"),
    [
        ("ssfl", {}, set()),  # T = 0: no communities, nobody reads the feature vector
        ("fedperl", {"policy": "static"}, {FEATURES_KEY}),
        ("fedperl", {"policy": "gated_similarity"}, {FEATURES_KEY}),
        ("fedperl", {"policy": "validation"}, {FEATURES_KEY, VAL_ACCURACY_KEY}),
        ("fedperl", {"policy": "gated_validation"}, {FEATURES_KEY, VAL_ACCURACY_KEY}),
    ],
)
def test_ssfl_and_fedperl_publish_their_own_keys_only_where_read(
    name: str, params: dict[str, Any], extra: set[str]
) -> None:
    protocol = create(name, **params)
    assert isinstance(protocol, RoundLoop)
    read = protocol.gossip_read(Recorder(SelectionSection(name="random")))  # type: ignore[arg-type]
    assert read == extra


def test_a_resumed_node_stops_gossiping_what_its_heuristic_no_longer_reads() -> None:
    """A checkpoint written under f1 (or before this fix) holds per-class F1:
    resumed under random, it is not published again."""
    protocol = create("fedavgp2p", rounds=5)
    assert isinstance(protocol, RoundLoop)
    protocol.personal = SimpleNamespace(restore=lambda *a, **k: None)  # type: ignore[assignment]
    saved = {
        "protocol": "fedavgp2p",
        "round": 2,
        "model": {},
        "optimizer": None,
        "select_by": "macro_f1",
        "gossip": {F1_KEY: [0.9, 0.0], MODEL_STATS_KEY: [0.1], RECENT_KEY: ["a"], "other": 1},
    }
    site = SimpleNamespace(load_state_dict=lambda s: None, load_optimizer_state=lambda s: None)
    ctx = Recorder(SelectionSection(name="random"), saved)
    assert protocol.resume(ctx, site) == 3  # type: ignore[arg-type]
    assert ctx.published == {"other": 1} and protocol.gossip == {"other": 1}
    ctx = Recorder(SelectionSection(name="f1"), saved)
    protocol.resume(ctx, site)  # type: ignore[arg-type]
    assert ctx.published == {F1_KEY: [0.9, 0.0], "other": 1}


@pytest.mark.parametrize("policy", ["static", "validation"])
def test_fedperl_never_gossips_its_community_not_even_from_an_old_checkpoint(
    policy: str,
) -> None:
    """FedPerl published its community (top T, chosen, similarities) and no
    node, dashboard or bench read it (a review): it is not read under any
    heuristic, and a checkpoint of before, which holds it, does not bring it
    back at a resume."""
    protocol = create("fedperl", rounds=5, policy=policy)
    assert isinstance(protocol, RoundLoop)
    for name in ("random", "n_latest", "f1", "cosine"):
        assert COMMUNITY_KEY not in protocol.gossip_read(Recorder(SelectionSection(name=name)))  # type: ignore[arg-type]
    protocol.personal = SimpleNamespace(restore=lambda *a, **k: None)  # type: ignore[assignment]
    saved = {
        "protocol": "fedperl",
        "round": 2,
        "model": {},
        "optimizer": None,
        "select_by": "macro_f1",
        "gossip": {COMMUNITY_KEY: {"top_t": ["a", "b"]}, FEATURES_KEY: {"vector": [0.1]}},
    }
    site = SimpleNamespace(load_state_dict=lambda s: None, load_optimizer_state=lambda s: None)
    ctx = Recorder(SelectionSection(name="random"), saved)
    assert protocol.resume(ctx, site) == 3  # type: ignore[arg-type]
    assert ctx.published == {FEATURES_KEY: {"vector": [0.1]}}
    assert COMMUNITY_KEY not in protocol.gossip


def test_an_ssfl_federation_gossips_no_class_mix_and_no_feature_vector(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """End to end on the in-memory network: what an observer (any roster
    member) sees of SSFL sites under the default heuristic."""
    from p2pfl.learning.data.partition import partition_dataset
    from protocols.memory import InMemoryNetwork, simulate, simulation_configs

    out = tmp_path_factory.mktemp("digits2ssl")
    partition_dataset("digits", 2, "dirichlet:1.0", out, label_fraction=0.3, seed=0)
    cfgs = simulation_configs(
        [str(out / f"site_{i}.npz") for i in range(2)],
        names=["site0", "site1"],
        protocol={"name": "ssfl", "rounds": 1, "round_timeout_s": 5.0},
        data={"image_size": 8, "augment": "weak"},
        training={"batch_size": 32, "device": "cpu", "max_steps_per_epoch": 2},
    )
    network = InMemoryNetwork(inline_train=True)
    result = asyncio.run(simulate(cfgs, network=network))
    assert result.errors == {}
    seen = {p.name: p.meta for p in network.join("observer").peers()}
    for meta in seen.values():
        assert not {F1_KEY, MODEL_STATS_KEY, RECENT_KEY, FEATURES_KEY, VAL_ACCURACY_KEY} & set(meta)


def test_a_round_that_merged_nothing_does_not_gossip_the_sites_own_model_stats() -> None:
    """A review silenced both peers of a node under secure aggregation: its round
    merged nothing, and the model statistics it gossiped to every roster member
    were those of its own model, which secure aggregation shows to no one. The
    last merged model's statistics stay published."""
    section = SelectionSection(name="cosine", vector="model_stats")
    protocol = create("fedavgp2p", secure_aggregation=True)
    assert isinstance(protocol, RoundLoop)
    ctx = Recorder(section)
    protocol.merged = [[1, []]]  # round 1: no peer's model merged
    protocol.update_gossip(ctx, None, [0.1, 0.2])  # type: ignore[arg-type]
    assert MODEL_STATS_KEY not in ctx.published
    protocol.merged.append([2, [["a", 2]]])
    protocol.update_gossip(ctx, None, [0.3, 0.4])  # type: ignore[arg-type]
    assert ctx.published[MODEL_STATS_KEY] == [0.3, 0.4]
    protocol.merged.append([3, []])
    protocol.update_gossip(ctx, None, [0.5, 0.6])  # type: ignore[arg-type]
    assert ctx.published[MODEL_STATS_KEY] == [0.3, 0.4]  # round 2's, not round 3's own


@pytest.mark.slow
def test_a_secure_aggregation_node_whose_peers_are_silent_gossips_no_model_stats(tmp_path) -> None:
    """The review's run: three in-memory sites under secure aggregation, two of them
    silent; the third merges nothing, and publishes no model statistics."""
    from p2pfl.learning.data.partition import partition_dataset
    from protocols.memory import InMemoryNetwork, simulate, simulation_configs

    partition_dataset("digits", 3, "iid", tmp_path / "parts", seed=0)
    configs = simulation_configs(
        [str(tmp_path / "parts" / f"site_{i}.npz") for i in range(3)],
        protocol={
            "name": "fedavgp2p",
            "rounds": 1,
            "fraction": 1.0,
            "secure_aggregation": True,
            "round_timeout_s": 2.0,
        },
        state_root=tmp_path / "state",
        data={"image_size": 8, "augment": "none"},
        training={"epochs": 1, "batch_size": 32},
        selection={"name": "cosine", "vector": "model_stats"},
    )
    network = InMemoryNetwork(inline_train=True)
    names = [c.node.name for c in configs]

    async def run() -> None:
        task = asyncio.ensure_future(simulate(configs, network=network))
        await asyncio.sleep(0)
        for name in names[1:]:
            network.silence(name)
        await task

    asyncio.run(run())
    (record,) = [r for r in network.records if r["node"] == names[0]]
    assert record["neighbours"] == 0
    assert MODEL_STATS_KEY not in network._node(names[0]).meta


def test_a_round_that_merged_nothing_does_not_gossip_the_sites_own_f1() -> None:
    """The model_stats review's attack on per-class F1: a node under secure
    aggregation whose peers were silent gossiped the F1 of its own model (trained
    on its images alone) to every roster member. F1 goes out only after a round
    that merged a peer's model; the last merged model's stays published, and the
    f1 heuristic ranks by it (most dissimilar first) as it did."""
    from protocols.base import PeerInfo
    from protocols.selection import F1Selection

    section = SelectionSection(name="f1")
    protocol = create("fedavgp2p", secure_aggregation=True)
    assert isinstance(protocol, RoundLoop)
    ctx = Recorder(section)
    protocol.merged = [[1, []]]  # round 1: no peer's model merged
    protocol.update_gossip(ctx, [0.9, 0.0, 0.8], [0.1])  # type: ignore[arg-type]
    assert F1_KEY not in ctx.published
    protocol.merged.append([2, [["a", 2]]])
    protocol.update_gossip(ctx, [0.5, 0.5, 0.5], [0.1])  # type: ignore[arg-type]
    assert ctx.published[F1_KEY] == [0.5, 0.5, 0.5]
    protocol.merged.append([3, []])
    protocol.update_gossip(ctx, [1.0, 0.0, 1.0], [0.1])  # type: ignore[arg-type]
    assert ctx.published[F1_KEY] == [0.5, 0.5, 0.5]  # round 2's, not round 3's own
    peers = [
        PeerInfo(name="near", state="alive", meta={F1_KEY: [0.5, 0.5, 0.6]}),
        PeerInfo(name="far", state="alive", meta={F1_KEY: [1.0, 0.0, 1.0]}),
    ]
    ranking = F1Selection(n=0).select("me", peers, 1, round_no=4, seed=0, my_meta=ctx.published)
    assert ranking == ["far", "near"]


def test_a_round_that_merged_nothing_does_not_gossip_the_sites_own_val_accuracy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The F1 and model_stats reviews' attack on FedPerl's validation accuracy
    (rv_sa review): under secure aggregation, a node whose secure sums failed
    (silent peers, too few contributors) gossiped the validation accuracy of its
    own model, trained on its images alone, to every roster member. It goes out
    only after a round that merged a peer's model, as F1 does; the last merged
    model's stays published, and the node's own validation gate reads it."""
    import protocols.ssfl as ssfl_module

    protocol = create("fedperl", policy="validation", secure_aggregation=True)
    assert isinstance(protocol, RoundLoop)
    ctx = Recorder(SelectionSection(name="random"))
    accuracy = {"value": 0.0}

    def fake_evaluate(site: Any, keys: Any = None) -> dict[str, Any]:
        return {"per_class_f1": [0.5, 0.5], "val_accuracy": accuracy["value"]}

    async def run_blocking(fn: Any, *args: Any) -> Any:
        return fn(*args)

    ctx.run_blocking = run_blocking  # type: ignore[attr-defined]
    monkeypatch.setattr(ssfl_module, "evaluate_site", fake_evaluate)

    def evaluate(round_no: int, merged: list[list[Any]], value: float) -> None:
        protocol.merged.append([round_no, merged])
        accuracy["value"] = value
        asyncio.run(protocol.evaluate_round(ctx, object()))  # type: ignore[arg-type]

    evaluate(1, [], 0.91)  # the site's own model: not published
    assert VAL_ACCURACY_KEY not in ctx.published
    evaluate(2, [["a", 2], ["b", 2]], 0.7)  # merged a secure sum: published
    assert ctx.published[VAL_ACCURACY_KEY] == 0.7
    evaluate(3, [], 0.93)  # its own model again: round 2's stays
    assert ctx.published[VAL_ACCURACY_KEY] == 0.7
    assert protocol.gossip[VAL_ACCURACY_KEY] == 0.7
