"""Asynchronous FedAVGP2P (protocols/async_exchange.py) and the slow-site drill
(node/faults.py `slow_train`).

- FedAsync's staleness weight, as documented: s(0) = 1, s(2) = 3^-0.5 with
  a = 0.5, times the capped sample count; a model past `staleness_bound` is
  not merged, a neighbour without a model is skipped, neither is waited for.
- A real in-memory federation with one site made slow by the real fault plan:
  synchronously its neighbours finish only once it has (they wait for its
  models); asynchronously they finish while it is still rounds behind, and
  they merged its models all the same (the checkpointed ledger).
- The drill's FACTOR parses, bad values are refused with a reason (the plan
  stays as it was), and the wait is (FACTOR - 1) x the training's duration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from pydantic import ValidationError

from node.faults import FaultPlan, parse_slow_train
from node.status import create_status_app, exchange_settings, start_status_server
from node.telemetry import Telemetry
from p2pfl.config import (
    FedAvgP2PParams,
    FedBEiTParams,
    FedMAEParams,
    FedPerlParams,
    SiteConfig,
    SSFLParams,
)
from p2pfl.learning.data.partition import partition_dataset
from protocols import create, from_params
from protocols.aggregate import weighted_mean
from protocols.async_exchange import AsyncCompressedExchange, AsyncExchange, staleness_factor
from protocols.base import NotReady
from protocols.exchange import MODEL_KIND, PlainExchange, ServedModels
from protocols.fedavgp2p import FedAvgP2P
from protocols.memory import InMemoryNetwork, simulation_configs

SITES = ["fast0", "fast1", "slow"]
SLOW = "slow"
FACTOR = 10.0  # the slow site's drill: its training lasts 10 x its real duration
ROUNDS = 3


def model(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def exchange(**overrides: Any) -> AsyncExchange:
    options: dict[str, Any] = {
        "max_staleness": 1,
        "timeout": 60.0,
        "max_norm_ratio": 10.0,
        "max_weight_ratio": 16.0,
        "staleness_bound": 2,
        "staleness_exponent": 0.5,
    }
    options.update(overrides)
    return AsyncExchange(ServedModels(keep=3), **options)


# ---------------------------------------------------------------------- the weighting


def test_fedasyncs_polynomial_staleness_function() -> None:
    assert staleness_factor(0, 0.5) == 1.0
    assert staleness_factor(2, 0.5) == pytest.approx(3**-0.5)
    assert staleness_factor(3, 1.0) == pytest.approx(0.25)
    assert staleness_factor(-4, 0.5) == 1.0  # a model from the future counts as fresh
    assert staleness_factor(7, 0.0) == 1.0  # a = 0: every model alike


async def test_a_stale_model_weighs_less_and_one_past_the_bound_is_not_merged() -> None:
    """Node `me` in round 5 (bound 2) asks four neighbours: `fresh` has round 6
    (from the future: s = 1), `stale` round 3 (s(2) = 3^-0.5), `ancient` round 2
    (3 behind: past the bound) and `empty` nothing yet. Nobody is waited for."""
    network = InMemoryNetwork()
    peers = {"fresh": (6, 1.0, 20), "stale": (3, 2.0, 30), "ancient": (2, 3.0, 10)}
    for name in [*peers, "empty"]:
        served = exchange()
        served.start(network.join(name))
        if name in peers:
            round_no, value, count = peers[name]
            served.store.put(round_no, model(value), count)
    ctx = network.join("me")
    mine = exchange()
    mine.start(ctx)
    own = model(0.5)
    mine.store.put(5, own, 10)
    ranking = ["ancient", "empty", "fresh", "stale"]
    got = await asyncio.wait_for(mine.collect(ctx, 5, own, 10.0, ranking, k=4), 120)
    weights = {t.merged[0][0]: t.weight for t in got.terms}
    assert weights == pytest.approx({"fresh": 20.0, "stale": 30.0 * 3**-0.5})
    assert [t.merged for t in got.terms] == [[("fresh", 6)], [("stale", 3)]]
    log = got.log
    assert log["asynchronous"] == 1 and log["neighbours"] == 2
    assert log["models_too_stale"] == 1 and log["neighbours_without_model"] == 1
    assert log["staleness_max"] == 2 and log["staleness_mean"] == 1.0
    assert log["staleness_factor_min"] == pytest.approx(3**-0.5)
    share = (20 + 30 * 3**-0.5) / (10 + 20 + 30 * 3**-0.5)
    assert log["neighbour_weight_share"] == pytest.approx(share)
    assert network.rejections == []  # staleness and 'no model yet' are nobody's fault
    # the merge FedAVGP2P makes of it: own + the two, with those weights
    merged = weighted_mean([own, *[t.state for t in got.terms]], [10.0, *weights.values()])
    expected = (10 * 0.5 + 20 * 1.0 + 30 * 3**-0.5 * 2.0) / (10 + 20 + 30 * 3**-0.5)
    assert merged["w"] == pytest.approx(torch.full((4,), expected))


async def test_a_neighbours_model_is_merged_once_and_the_next_neighbour_asked_instead() -> None:
    """Round 5 merges `slow`'s model of round 2; in round 6 `slow` still has
    only that one: asked with `after: 2`, it answers "not_newer" without a
    model, and the next in the ranking (`other`) is merged. A peer that ignores
    `after` and sends round 2 again is skipped all the same (its transfer is
    spent, the model not merged twice), nobody's fault."""
    network = InMemoryNetwork()
    served = {name: exchange(staleness_bound=10) for name in ("slow", "other", "deaf")}
    for name, ex in served.items():
        ex.start(network.join(name))
    served["slow"].store.put(2, model(2.0), 10)
    served["other"].store.put(6, model(6.0), 10)
    ctx = network.join("me")
    mine = exchange(staleness_bound=10)
    mine.start(ctx)
    first = await asyncio.wait_for(mine.collect(ctx, 5, model(1.0), 10.0, ["slow", "other"], 1), 60)  # fmt: skip
    assert [t.merged for t in first.terms] == [[("slow", 2)]]
    assert mine.query("slow", 6, 7)["after"] == 2
    again = await asyncio.wait_for(mine.collect(ctx, 6, model(1.0), 10.0, ["slow", "other"], 1), 60)  # fmt: skip
    assert [t.merged for t in again.terms] == [[("other", 6)]]
    assert again.log["models_already_merged"] == 1 and again.log["neighbours_without_model"] == 0
    reply = await served["slow"].serve("me", {"round": 6, "max_round": 7, "freshest": True, "after": 2})  # fmt: skip
    assert reply["state"] is None and reply["reason"] == "not_newer"
    # a deaf peer: serves its round 3 whatever `after` says
    served["deaf"].store.put(3, model(3.0), 10)
    mine.last_merged["deaf"] = 3
    deaf = served["deaf"]
    deaf.serve = lambda who, q: AsyncExchange.serve(deaf, who, {k: v for k, v in q.items() if k != "after"})  # type: ignore[method-assign]  # fmt: skip
    third = await asyncio.wait_for(mine.collect(ctx, 7, model(1.0), 10.0, ["deaf", "other"], 1), 60)  # fmt: skip
    assert third.terms == []  # deaf's round 3 skipped, other's round 6 merged already
    assert third.log["models_already_merged"] == 2
    assert network.rejections == []


def test_the_merged_ledger_of_a_checkpoint_rebuilds_what_was_merged_and_junk_is_skipped() -> None:
    ex = exchange()
    ledger: list[Any] = [
        [3, [["a", 2], ["b", 3]]],
        [4, [["a", 4]]],
        [5, [["a", 1]]],  # a peer that rolled back: its latest merge counts
        [6, [["c", -1], ["d", True], [7, 8], ["e"], "x"]],
        "junk",
        [7, "junk"],
    ]
    ex.resumed(ledger)
    assert ex.last_merged == {"a": 1, "b": 3}


async def test_a_false_future_round_costs_one_pull_and_an_absurd_one_is_refused() -> None:
    """A peer that claimed round 10^9 (or restarted from an older checkpoint)
    is not starved: its `not_newer` answer names its real round, and its next
    model is merged. A round past 2^62 (one `after` could not name) is refused
    and counted."""
    network = InMemoryNetwork()
    liar = exchange(staleness_bound=10)
    liar.start(network.join("liar"))
    ctx = network.join("me")
    mine = exchange(staleness_bound=10)
    mine.start(ctx)
    liar.store.put(10**9, model(2.0), 10)  # its "future" model, fresh by the rules
    got = await asyncio.wait_for(mine.collect(ctx, 5, model(1.0), 10.0, ["liar"], 1), 60)
    assert [t.merged for t in got.terms] == [[("liar", 10**9)]]
    honest = exchange(staleness_bound=10)  # the same peer, back at its real round
    honest.start(network.join("liar"))
    honest.store.put(6, model(3.0), 10)
    skipped = await asyncio.wait_for(mine.collect(ctx, 6, model(1.0), 10.0, ["liar"], 1), 60)
    assert skipped.terms == [] and skipped.log["models_already_merged"] == 1
    assert mine.last_merged["liar"] == 6  # the round it answered with
    honest.store.put(7, model(3.0), 10)
    again = await asyncio.wait_for(mine.collect(ctx, 7, model(1.0), 10.0, ["liar"], 1), 60)
    assert [t.merged for t in again.terms] == [[("liar", 7)]]
    assert network.rejections == []
    honest.store.put(1 << 62, model(3.0), 10)
    absurd = await asyncio.wait_for(mine.collect(ctx, 8, model(1.0), 10.0, ["liar"], 1), 60)
    assert absurd.terms == []
    assert [(r["peer"], r["reason"]) for r in network.rejections] == [("liar", "model_wrong_round")]


async def test_a_freshest_pull_is_answered_at_once_and_a_plain_one_as_before() -> None:
    served = exchange()
    none_yet = await served.serve("x", {"round": 4, "max_round": 5, "freshest": True})
    assert none_yet["state"] is None and none_yet["reason"] == "no_model"
    for r in (1, 2, 3):
        served.store.put(r, model(float(r)), 10)
    freshest = await served.serve("x", {"round": 9, "max_round": 10, "freshest": True})
    assert freshest["round"] == 3 and float(freshest["state"]["w"][0]) == 3.0
    # a synchronous pull is PlainExchange's: its round, the nearest newer, or NotReady
    plain = PlainExchange(served.store, max_staleness=1, timeout=1.0, **_caps())
    for query in ({"round": 2, "max_round": 3}, {"round": 1, "max_round": 2}):
        assert (await served.serve("x", query))["round"] == (await plain.serve("x", query))["round"]


def _caps() -> dict[str, Any]:
    return {"max_norm_ratio": 10.0, "max_weight_ratio": 16.0}


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ({"round": -3, "num_train": 10, "state": model(1.0)}, "model_wrong_round"),
        ({"round": "5", "num_train": 10, "state": model(1.0)}, "model_wrong_round"),
        ({"round": 5, "num_train": 0, "state": model(1.0)}, "model_bad_num_train"),
        ({"round": 5, "num_train": 10, "state": model(float("nan"))}, "model_non_finite"),
        (["not", "a", "map"], "model_malformed"),
    ],
)
async def test_a_hostile_freshest_reply_is_refused_counted_and_replaced(
    reply: Any, reason: str
) -> None:
    network = InMemoryNetwork()
    hostile = network.join("mallory")

    async def answer(requester: str, query: dict[str, Any]) -> Any:
        return reply

    hostile.serve(MODEL_KIND, answer)
    honest = exchange()
    honest.start(network.join("honest"))
    honest.store.put(5, model(2.0), 10)
    ctx = network.join("me")
    mine = exchange()
    got = await asyncio.wait_for(
        mine.collect(ctx, 5, model(1.0), 10.0, ["mallory", "honest"], 1), 120
    )
    assert [t.merged for t in got.terms] == [[("honest", 5)]]  # the next in the ranking
    assert [(r["peer"], r["reason"]) for r in network.rejections] == [("mallory", reason)]


# ---------------------------------------------------------------------- the settings


def test_asynchronous_is_a_setting_of_every_fedavgp2p_exchange() -> None:
    for cls, name in (
        (FedAvgP2PParams, "fedavgp2p"),
        (SSFLParams, "ssfl"),
        (FedPerlParams, "fedperl"),
        (FedMAEParams, "fedmae"),
        (FedBEiTParams, "fedbeit"),
    ):
        params = cls(name=name, asynchronous=True)
        assert (params.staleness_exponent, params.staleness_bound) == (0.5, 10)
        assert not cls(name=name).asynchronous  # off by default
    fine = FedMAEParams(name="fedmae", finetune={"name": "fedavgp2p", "asynchronous": True})
    assert fine.finetune is not None and fine.finetune.asynchronous
    for proto in (create("fedavgp2p", asynchronous=True), create("ssfl", asynchronous=True)):
        assert isinstance(proto, FedAvgP2P) and type(proto.exchanger) is AsyncExchange
    assert type(create("fedavgp2p").exchanger) is PlainExchange  # as today


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"staleness_exponent": -0.5}, "greater than or equal to 0"),
        ({"staleness_bound": -1}, "greater than or equal to 0"),
    ],
)
def test_settings_that_cannot_work_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FedAvgP2PParams(name="fedavgp2p", **fields)


async def test_status_shows_the_staleness_bound_and_weighting() -> None:
    sync = exchange_settings(FedAvgP2PParams(name="fedavgp2p"))
    assert sync == {"asynchronous": False, "max_staleness": 1}
    params = FedAvgP2PParams(name="fedavgp2p", asynchronous=True, staleness_bound=6)
    shown = exchange_settings(params)
    assert shown == {
        "asynchronous": True,
        "staleness_bound": 6,
        "staleness_weighting": "polynomial",
        "staleness_exponent": 0.5,
        "staleness_function": "(t - tau + 1)^-0.5",
    }
    app = create_status_app(
        Telemetry("a"), node_name="a", protocol_name="fedavgp2p", token=None, exchange=shown
    )
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/status") as response,
        ):
            assert (await response.json())["exchange"] == shown
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------------- the drill


def write_plan(tmp_path: Path, plan: dict[str, Any]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(plan))
    return path


def events(path: Path) -> list[dict[str, Any]]:
    side = path.with_name(path.name + ".events.jsonl")
    return [json.loads(line) for line in side.read_text().splitlines()] if side.exists() else []


@pytest.mark.parametrize("value", [0.5, 0, -2, "4", True, None, [4], float("nan"), float("inf")])
def test_slow_train_refuses_what_is_not_a_factor(value: Any) -> None:
    with pytest.raises(ValueError, match="slow_train must be a"):
        parse_slow_train(value)


def test_slow_train_parses_and_a_bad_value_leaves_the_plan_as_it_was(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert parse_slow_train(4) == 4.0 and parse_slow_train(1.5) == 1.5
    path = write_plan(tmp_path, {"slow_train": 4})
    plan = FaultPlan(path)
    assert plan.slow_train == 4.0
    path.write_text(json.dumps({"slow_train": 0.25, "latency_s": 3}))
    with caplog.at_level(logging.ERROR, logger="node.faults"):
        plan.reload(force=True)
    assert (plan.slow_train, plan.latency_s) == (4.0, 0.0)  # unchanged, all of it
    assert "slow_train must be a finite number >= 1" in caplog.text
    assert FaultPlan(None).slow_train == 1.0


async def test_slow_train_waits_factor_minus_one_times_the_training(tmp_path: Path) -> None:
    """A real training step's duration, then the drill's wait: the whole is
    FACTOR x the training (measured against the training itself)."""
    plan = FaultPlan(write_plan(tmp_path, {"slow_train": 3}))
    net = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    started = time.perf_counter()
    for _ in range(60):
        optimizer.zero_grad()
        net(torch.randn(32, 64)).square().mean().backward()
        optimizer.step()
    train_s = time.perf_counter() - started
    waited = time.perf_counter()
    extra = await plan.after_training(4, train_s)
    waited = time.perf_counter() - waited
    assert extra == pytest.approx(2 * train_s)
    assert waited >= 0.9 * extra  # asyncio.sleep may end a clock tick early, never much
    (event,) = events(plan.path)  # type: ignore[arg-type]
    assert event["event"] == "slow_train" and event["round"] == 4 and event["factor"] == 3.0
    assert await FaultPlan(write_plan(tmp_path / "off", {})).after_training(4, 1.0) == 0.0


# ---------------------------------------------------------------------- a federation


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out: Path = tmp_path_factory.mktemp("digits_async")
    partition_dataset("digits", len(SITES), "iid", out, seed=0)
    return [str(out / f"site_{i}.npz") for i in range(len(SITES))]


def configs(sources: list[str], tmp_path: Path, *, asynchronous: bool) -> list[SiteConfig]:
    return simulation_configs(
        sources,
        names=SITES,
        protocol={
            "name": "fedavgp2p",
            "rounds": ROUNDS,
            "fraction": 1.0,  # everyone averages with everyone: a synchronous node waits for all
            "round_timeout_s": 60.0,
            "asynchronous": asynchronous,
        },
        state_root=tmp_path / ("async" if asynchronous else "sync"),
        data={"image_size": 8, "augment": "none"},
        training={"epochs": 1, "batch_size": 32, "lr": 3e-3, "device": "cpu"},
        selection={"name": "random"},
    )


@dataclass
class Run:
    network: InMemoryNetwork
    protos: dict[str, FedAvgP2P]
    slow_round_when_done: dict[str, int]  # the slow site's round as each site finished
    not_ready: dict[str, int]  # pulls each site's store held open (NotReady)


def counting_not_ready(store: ServedModels, counts: dict[str, int], name: str) -> Any:
    """The store's own `model_of`, counting each time it holds a pull open."""
    model_of = store.model_of

    def counted(wanted: int, newest: int) -> Any:
        try:
            return model_of(wanted, newest)
        except NotReady:
            counts[name] += 1
            raise

    return counted


def run_with_a_slow_site(cfgs: list[SiteConfig], plan: FaultPlan) -> Run:
    """Every site's real protocol on one in-memory network; the slow site's
    context calls the real fault plan after each training, as a node's does."""
    network = InMemoryNetwork(inline_train=True)
    contexts = {cfg.node.name: network.join(cfg.node.name, cfg) for cfg in cfgs}
    slow = contexts[SLOW]
    slow.after_training = lambda s: plan.after_training(slow.round, s)  # type: ignore[attr-defined]
    run = Run(network, {}, {}, dict.fromkeys(contexts, 0))
    for cfg in cfgs:
        proto = from_params(cfg.protocol)
        assert isinstance(proto, FedAvgP2P)
        run.protos[cfg.node.name] = proto
        proto.store.model_of = counting_not_ready(proto.store, run.not_ready, cfg.node.name)  # type: ignore[method-assign]

    async def one(name: str) -> None:
        await run.protos[name].run(contexts[name])
        run.slow_round_when_done[name] = network.round_of(SLOW)

    async def everyone() -> None:
        await asyncio.gather(*(one(name) for name in contexts))

    asyncio.run(everyone())
    return run


def slow_models_merged(proto: FedAvgP2P) -> list[int]:
    """The rounds of the slow site's models this node merged (its ledger)."""
    return [r for _, pairs in proto.merged for peer, r in pairs if peer == SLOW]


def test_a_slow_site_holds_back_a_synchronous_federation_but_not_an_asynchronous_one(
    sources: list[str], tmp_path: Path
) -> None:
    plan = FaultPlan(write_plan(tmp_path, {"slow_train": FACTOR}))
    fast = ("fast0", "fast1")
    rounds = list(range(1, ROUNDS + 1))
    # Synchronous: every fast site needs the slow site's round-r model in its
    # round r, so it waits for it (pulls held open) and finishes with it.
    sync = run_with_a_slow_site(configs(sources, tmp_path, asynchronous=False), plan)
    assert all(sync.slow_round_when_done[f] == ROUNDS for f in fast), sync.slow_round_when_done
    assert sync.not_ready[SLOW] > 0, sync.not_ready
    for f in fast:  # each merged the slow site's model of its own round
        assert slow_models_merged(sync.protos[f]) == rounds

    # Asynchronous: no pull is held open anywhere, and the fast sites finish
    # while the slow one is still rounds behind...
    async_cfgs = configs(sources, tmp_path, asynchronous=True)
    run = run_with_a_slow_site(async_cfgs, plan)
    assert run.not_ready == dict.fromkeys(SITES, 0)
    assert all(run.slow_round_when_done[f] < ROUNDS for f in fast), run.slow_round_when_done
    records = {(r["node"], r["round"]): r for r in run.network.records}
    assert all(records[(f, r)]["asynchronous"] == 1 for f in SITES for r in rounds)
    # ...and still merged its models, each once: while the slow site had
    # nothing newer, it answered "not_newer" (the slow site's model is ready
    # one training after the start, its next only after ten more).
    for f in fast:
        merged = slow_models_merged(run.protos[f])
        assert merged, f"{f} never merged the slow site's model"
        assert len(set(merged)) == len(merged), merged
        assert sum(records[(f, r)]["models_already_merged"] for r in rounds) >= 1
        # a restart rebuilds which models it merged from its checkpoint's ledger
        cfg = next(c for c in async_cfgs if c.node.name == f)
        restarted = from_params(cfg.protocol)
        assert isinstance(restarted, FedAvgP2P) and isinstance(restarted.exchanger, AsyncExchange)
        assert restarted.exchanger.last_merged == {}
        ctx = run.network.join(f, cfg)  # a restarted process, past its last round

        async def rerun(proto: FedAvgP2P = restarted, ctx: Any = ctx) -> None:
            await proto.run_rounds(ctx, await proto.setup(ctx))

        asyncio.run(rerun())
        assert restarted.exchanger.last_merged == run.protos[f].exchanger.last_merged != {}
    # The slow site merged the fast sites' models: from its future, so fresh (s = 1).
    assert {p for _, pairs in run.protos[SLOW].merged for p, _ in pairs} == set(fast)
    assert all(records[(SLOW, r)]["staleness_max"] == 0 for r in rounds)

    # The drill made the slow site's training FACTOR x as long, by its own events.
    waits = [e for e in events(plan.path) if e["event"] == "slow_train"]  # type: ignore[arg-type]
    assert [e["round"] for e in waits] == rounds + rounds  # two runs
    for e in waits:
        assert e["wait_s"] == pytest.approx((FACTOR - 1) * e["train_s"], rel=1e-3, abs=1e-3)
    for r, e in zip(rounds, waits[ROUNDS:], strict=True):
        assert records[(SLOW, r)]["train_s"] >= 0.9 * FACTOR * e["train_s"]


async def test_asynchronous_composes_with_compression() -> None:
    """`compression` with `asynchronous`: the freshest model travels as
    CompressedExchange's difference from the pair's copy, then is weighted by
    staleness like any other."""
    proto = create("fedavgp2p", asynchronous=True, compression="fp16")
    assert isinstance(proto, FedAvgP2P) and type(proto.exchanger) is AsyncCompressedExchange
    network = InMemoryNetwork()
    options = {"compression": "fp16", "staleness_bound": 4, "staleness_exponent": 0.5}
    served = AsyncCompressedExchange(ServedModels(keep=3), **options, **_plain())
    served.start(network.join("peer"))
    served.store.put(3, model(1.5), 20)
    ctx = network.join("me")
    mine = AsyncCompressedExchange(ServedModels(keep=3), **options, **_plain())
    mine.start(ctx)
    got = await asyncio.wait_for(mine.collect(ctx, 5, model(1.0), 20.0, ["peer"], 1), 120)
    (term,) = got.terms
    assert term.merged == [("peer", 3)] and term.weight == pytest.approx(20 * 3**-0.5)
    assert torch.equal(term.state["w"], model(1.5)["w"])  # 1.5 is exact in fp16
    assert got.log["staleness_max"] == 2 and network.rejections == []


def _plain() -> dict[str, Any]:
    return {"max_staleness": 1, "timeout": 60.0, **_caps()}
