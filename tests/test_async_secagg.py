"""Asynchronous secure aggregation (protocols/secure_exchange.py
`AsyncSecureExchange`): `protocol.asynchronous` with `secure_aggregation`.

- A requester never waits: its sum is over the freshest model each
  contributor holds, each weighted by its contributor with FedAsync's
  (t - tau + 1)^-a against the requester's round t, as the plain
  asynchronous exchange weighs it.
- Each model is in at most one of a requester's sums (the contributor's
  ledger): asked again, a contributor with nothing newer refuses benignly
  (`not_newer`, not counted), and the requester asks the next neighbour of
  its ranking in a fresh session.
- What a requester may not do: ask with `at_round` outside an asynchronous
  sum, or an asynchronous sum without it (refused and counted); tell two
  contributors different rounds t (their tags fail, nobody's model comes
  out); ask a synchronous contributor for one (refused).
- A real in-memory federation with a slow site: the fast sites finish while
  it is rounds behind, nothing is held open, and its models are merged, each
  once, through secure sums only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from test_async import (
    FACTOR,
    ROUNDS,
    SITES,
    run_with_a_slow_site,
    slow_models_merged,
    write_plan,
)
from test_async import configs as async_configs
from test_async import sources as sources  # noqa: F401 - the module's data fixture

from node.faults import FaultPlan
from p2pfl.config import FedAvgP2PParams, FedPerlParams, SSFLParams
from protocols import create
from protocols.async_exchange import staleness_factor
from protocols.exchange import ServedModels
from protocols.fedavgp2p import FedAvgP2P
from protocols.memory import InMemoryNetwork
from protocols.secagg import SECAGG_KIND, SecAggError, secure_sum
from protocols.secagg_messages import FRESHEST_PURPOSE
from protocols.secure_exchange import AsyncSecureExchange, SecureExchange

REQUESTER = "dave"
OPTIONS: dict[str, Any] = {
    "max_staleness": 1,
    "timeout": 5.0,
    "max_norm_ratio": 10.0,
    "max_weight_ratio": 16.0,
    "staleness_bound": 10,
    "staleness_exponent": 0.5,
}


def model(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


class Sites:
    """Contributors with AsyncSecureExchange over one in-memory network, and a requester."""

    def __init__(self, names: list[str], **overrides: Any) -> None:
        self.network = InMemoryNetwork()
        self.exchanges: dict[str, AsyncSecureExchange] = {}
        for name in [*names, REQUESTER]:
            exchange = AsyncSecureExchange(ServedModels(keep=3), **{**OPTIONS, **overrides})
            exchange.start(self.network.join(name))
            self.exchanges[name] = exchange
        self.ctx = self.exchanges[REQUESTER].contributor.ctx  # type: ignore[union-attr]

    def put(self, name: str, round_no: int, value: float, samples: int) -> None:
        self.exchanges[name].store.put(round_no, model(value), samples)

    async def collect(self, round_no: int, ranking: list[str], k: int) -> Any:
        mine = self.exchanges[REQUESTER]
        return await asyncio.wait_for(
            mine.collect(self.ctx, round_no, model(1.0), 10.0, ranking, k), 60
        )

    def counted(self) -> list[tuple[str, str]]:
        return [(r["peer"], r["reason"]) for r in self.network.rejections]

    async def freshest(
        self, reference: float = 1.0, at_round: int = 5, weight_scale: float = 40.0
    ) -> Any:
        """The requester's freshest sum over alice and bob, asked directly."""
        return await secure_sum(
            self.ctx,
            ["alice", "bob"],
            round_no=0,
            max_round=100,
            reference=model(reference),
            timeout=2.0,
            purpose=FRESHEST_PURPOSE,
            at_round=at_round,
            weight_scale=weight_scale,
        )


def weighted(values: dict[str, tuple[float, float]]) -> float:
    """The mean of constant models {peer: (value, weight)}."""
    return sum(v * w for v, w in values.values()) / sum(w for _, w in values.values())


async def test_the_sum_is_over_the_freshest_models_each_weighted_by_its_staleness() -> None:
    sites = Sites(["alice", "bob", "carol"])
    sites.put("alice", 5, 1.0, 20)
    sites.put("bob", 2, 2.0, 30)
    sites.put("bob", 3, 3.0, 30)  # bob's freshest
    sites.put("carol", 1, 4.0, 40)
    got = await sites.collect(5, ["alice", "bob", "carol"], 2)
    (term,) = got.terms
    assert sorted(term.merged) == [("alice", 5), ("bob", 3)]
    s_bob = staleness_factor(2, 0.5)  # 3^-0.5
    expected = weighted({"alice": (1.0, 20.0), "bob": (3.0, 30.0 * s_bob)})
    assert torch.allclose(term.state["w"], torch.full((4,), expected), atol=1e-5)
    assert term.weight == pytest.approx(20.0 + 30.0 * s_bob, rel=1e-5)
    assert got.log["asynchronous"] == 1 and got.log["staleness_max"] == 2
    assert got.log["staleness_factor_min"] == pytest.approx(s_bob)
    assert got.log["secagg_sessions"] == 1 and got.log["neighbours_skipped"] == 0
    assert sites.counted() == []


async def test_a_model_is_in_one_sum_and_the_next_neighbour_is_asked_instead() -> None:
    sites = Sites(["alice", "bob", "carol"])
    sites.put("alice", 5, 1.0, 20)
    sites.put("bob", 3, 3.0, 30)
    sites.put("carol", 1, 4.0, 40)
    first = await sites.collect(5, ["alice", "bob", "carol"], 2)
    assert sorted(first.terms[0].merged) == [("alice", 5), ("bob", 3)]
    # Round 6: nobody has anything newer but carol, and a sum needs two: none,
    # and nothing counted against an honest requester.
    again = await sites.collect(6, ["alice", "bob", "carol"], 2)
    assert again.terms == [] and again.log["neighbours_skipped"] == 2
    assert sites.counted() == []
    # Round 7: alice trained round 6; bob has nothing new and is replaced by carol
    # (round 1: 6 rounds stale, inside the bound of 10).
    sites.put("alice", 6, 1.5, 20)
    third = await sites.collect(7, ["alice", "bob", "carol"], 2)
    (term,) = third.terms
    assert sorted(term.merged) == [("alice", 6), ("carol", 1)]
    assert third.log["secagg_sessions"] == 2 and third.log["neighbours_skipped"] == 1
    expected = weighted(
        {"alice": (1.5, 20.0 * staleness_factor(1, 0.5)), "carol": (4.0, 40.0 * 7**-0.5)}
    )
    assert torch.allclose(term.state["w"], torch.full((4,), expected), atol=1e-5)
    assert sites.counted() == []
    # Every contributor's ledger holds each of its models once for the requester.
    for name, rounds in (("alice", [5, 6]), ("bob", [3]), ("carol", [1])):
        ledger = sites.exchanges[name].contributor.ledger  # type: ignore[union-attr]
        assert sorted(r for (who, r) in ledger.contributed if who == REQUESTER) == rounds


async def test_a_model_past_the_staleness_bound_is_not_masked() -> None:
    sites = Sites(["alice", "bob", "carol"], staleness_bound=2)
    sites.put("alice", 9, 1.0, 20)
    sites.put("bob", 9, 2.0, 20)
    sites.put("carol", 6, 4.0, 40)  # 4 rounds behind round 10: past the bound of 2
    got = await sites.collect(10, ["carol", "alice", "bob"], 2)
    (term,) = got.terms
    assert sorted(term.merged) == [("alice", 9), ("bob", 9)]  # carol replaced by bob
    assert got.log["neighbours_skipped"] == 1 and sites.counted() == []


async def raw(
    sites: Sites, peer: str, members: list[str], sender: Any = None, **fields: Any
) -> Any:
    """A Round 0 request to `peer` as the requester (or `sender`) words it;
    None removes a field."""
    query = {
        "session": fields.pop("session", "a" * 32),
        "phase": "advertise",
        "contributors": members,
        "round": 0,
        "max_round": 100,
        "purpose": FRESHEST_PURPOSE,
        "at_round": 5,
        "body": {},
        **fields,
    }
    query = {k: v for k, v in query.items() if v is not None}
    return await (sender or sites.ctx).request(peer, SECAGG_KIND, query, 2.0)


async def test_what_a_requester_may_not_ask_is_refused_and_counted() -> None:
    sites = Sites(["alice", "bob"])
    sites.put("alice", 5, 1.0, 20)
    members = ["alice", "bob"]
    # at_round outside an asynchronous sum, and an asynchronous sum without it
    assert await raw(sites, "alice", members, purpose="model") == {"refused": "bad_request"}
    no_round = await raw(sites, "alice", members, session="b" * 32, at_round=None)
    assert no_round == {"refused": "bad_request"}
    assert sites.counted() == [(REQUESTER, "secagg_bad_request")] * 2
    # a synchronous contributor answers no asynchronous sum
    network = sites.network
    plain = SecureExchange(ServedModels(keep=3), **{k: OPTIONS[k] for k in list(OPTIONS)[:4]})
    plain.start(network.join("sync"))
    plain.store.put(5, model(1.0), 20)
    refused = await raw(sites, "sync", ["sync", "alice"], session="c" * 32)
    assert refused == {"refused": "not_asynchronous"}
    assert (REQUESTER, "secagg_not_asynchronous") in sites.counted()


async def test_a_contributor_keeps_its_own_bound_and_masks_only_its_latest_model() -> None:
    """The window is the requester's word, the bound and the model are the
    contributor's: asked with round 0 and t far ahead, it refuses (too_stale)
    rather than mask a model at a weight near zero; asked for a window below
    its latest model, it masks no older one (too_new). Neither is counted."""
    sites = Sites(["alice", "bob"], staleness_bound=2)
    sites.put("alice", 4, 1.0, 20)
    sites.put("alice", 5, 2.0, 20)
    members = ["alice", "bob"]
    far = await raw(sites, "alice", members, round=0, max_round=100, at_round=50)
    assert far == {"refused": "too_stale"}
    older = await raw(sites, "alice", members, session="d" * 32, round=0, max_round=4)
    assert older == {"refused": "too_new"}
    ok = await raw(sites, "alice", members, session="e" * 32, round=0, max_round=100, at_round=7)
    assert "c_pk" in ok  # t - tau = 2: within the bound
    assert sites.counted() == []
    ledger = sites.exchanges["alice"].contributor.ledger  # type: ignore[union-attr]
    assert ledger.contributed == {}  # advertised only: nothing masked


def test_secure_sums_refuse_a_staleness_weight_that_would_weigh_models_away() -> None:
    fine = FedAvgP2PParams(
        name="fedavgp2p", asynchronous=True, secure_aggregation=True, staleness_bound=15
    )
    assert (fine.staleness_bound + 1) ** fine.staleness_exponent == 4  # the edge: allowed
    with pytest.raises(ValueError, match="1/11 of a fresh one"):
        FedAvgP2PParams(
            name="fedavgp2p", asynchronous=True, secure_aggregation=True, staleness_exponent=1.0
        )
    # without secure aggregation the requester sees each model: no such bound
    assert FedAvgP2PParams(name="fedavgp2p", asynchronous=True, staleness_exponent=2.0)


async def test_contributors_told_different_rounds_give_no_sum() -> None:
    """at_round is bound into the session's context: a requester that tells
    alice t = 5 and bob t = 14 (to weigh bob down, inside his bound) makes
    their pair tags fail in Round 1, and the session ends with no sum."""
    sites = Sites(["alice", "bob"])
    sites.put("alice", 5, 1.0, 20)
    sites.put("bob", 5, 2.0, 20)
    ctx = sites.ctx
    request = ctx.request

    async def lying(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        if kind == SECAGG_KIND and peer == "bob":
            query = {**query, "at_round": 14}
        return await request(peer, kind, query, timeout)

    ctx.request = lying  # type: ignore[method-assign]
    with pytest.raises(SecAggError):
        await sites.freshest(reference=0.0)
    for name in ("alice", "bob"):  # nobody masked: no model of theirs went anywhere
        assert sites.exchanges[name].contributor.ledger.contributed == {}  # type: ignore[union-attr]
    assert (REQUESTER, "secagg_bad_key_tag") in sites.counted()  # the tags, not a bound


async def test_a_weight_unit_too_large_to_keep_a_model_raises_its_weight_instead() -> None:
    """A W so large that a contributor's w/W would fall under 2^-12 (its model
    rounding out of the sum while a heavier one's stays) does not exclude it,
    nor tell the requester its weight: it masks 2^-12 of W instead. The sum's
    total weight shows it: 20 samples count as W / 4096."""
    sites = Sites(["alice", "bob"])
    sites.put("alice", 5, 1.0, 20)
    sites.put("bob", 5, 3.0, 20)
    unit = 20 * 2.0**14  # 20 samples are 2^-14 of it

    async def freshest_sum(at_round: int) -> Any:
        return await sites.freshest(at_round=at_round, weight_scale=unit)

    got = await freshest_sum(5)
    assert got.total_weight == pytest.approx(2 * unit * 2.0**-12, rel=1e-4)
    assert torch.allclose(got.mean["w"], torch.full((4,), 2.0), atol=1e-2)
    assert sites.counted() == []
    # never past a contributor's roster card: alice's card says 10 samples, under
    # the floor of this W, so raising bob and not her would leave bob's model
    # alone in the sum (a review's attack): alice refuses the W, counted
    alice = sites.exchanges["alice"].contributor
    assert alice is not None
    alice.max_weight = 10.0
    sites.put("alice", 6, 1.5, 20)  # new models: each model goes into one sum
    sites.put("bob", 6, 3.5, 20)
    with pytest.raises(SecAggError) as err:
        await freshest_sum(6)
    assert err.value.reason == "too_few"
    assert any(reason == "secagg_weight_scale_too_large" for _, reason in sites.counted())
    sites.network.rejections.clear()
    # a model of no weight (a site without training data) joins no sum, uncounted
    sites.put("bob", 7, 3.25, 0)
    assert await raw(sites, "bob", ["alice", "bob"], at_round=7) == {"refused": "no_weight"}
    assert sites.counted() == []


async def test_a_requester_retrying_leaves_no_session_open_behind() -> None:
    """Eight neighbours with nothing yet, alice with a model: each round the
    requester opens sessions in turn, and alice keeps only its latest one open,
    so it never reaches its limit of open sessions for that requester."""
    others = [f"p{i}" for i in range(8)]
    sites = Sites(["alice", *others])
    sites.put("alice", 5, 1.0, 20)
    contributor = sites.exchanges["alice"].contributor
    assert contributor is not None
    for round_no in (5, 6, 7, 8):
        got = await sites.collect(round_no, [*others[:1], "alice", *others[1:]], 2)
        assert got.terms == [] and got.log["secagg_sessions"] == 8
        assert sum(1 for r, _ in contributor.sessions if r == REQUESTER) <= 1
    assert sites.counted() == []


async def test_a_new_session_ends_only_its_requesters_unmasked_asynchronous_ones() -> None:
    """What a new asynchronous Round 0 ends at a contributor: the same
    requester's earlier asynchronous sessions it has not masked in. Not
    another requester's, not one of another purpose, not one it masked in."""
    sites = Sites(["alice", "bob"])
    sites.put("alice", 5, 1.0, 20)
    mallory = sites.network.join("mallory")
    contributor = sites.exchanges["alice"].contributor
    assert contributor is not None
    members = ["alice", "bob"]

    async def advertise(ctx: Any, session: str, **fields: Any) -> Any:
        return await raw(sites, "alice", members, ctx, session=session, weight_scale=40.0, **fields)

    assert "c_pk" in await advertise(sites.ctx, "1" * 32)  # dave's asynchronous session
    plain = {"purpose": "model", "at_round": None, "round": 5, "max_round": 5}
    assert "c_pk" in await advertise(sites.ctx, "2" * 32, **plain)  # dave's synchronous one
    assert "c_pk" in await advertise(mallory, "3" * 32)  # another requester's
    held = {(r, sid) for r, sid in contributor.sessions}
    assert {(REQUESTER, "1" * 32), (REQUESTER, "2" * 32), ("mallory", "3" * 32)} <= held
    # a session alice has masked in stays to its end, whatever comes next
    contributor.sessions[(REQUESTER, "1" * 32)].phase = "mask"
    assert "c_pk" in await advertise(sites.ctx, "4" * 32)
    contributor.sessions[(REQUESTER, "1" * 32)].phase = "advertise"
    # dave's next asynchronous Round 0 ends its unmasked asynchronous sessions only
    assert "c_pk" in await advertise(sites.ctx, "5" * 32)
    held = {(r, sid) for r, sid in contributor.sessions}
    assert (REQUESTER, "1" * 32) not in held and (REQUESTER, "4" * 32) not in held
    assert {(REQUESTER, "2" * 32), ("mallory", "3" * 32), (REQUESTER, "5" * 32)} <= held


async def test_no_new_session_after_twice_the_rounds_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sessions that keep failing stop after 2 x timeout (a plain pull's
    bound), each given no more than the time left."""
    import protocols.secure_exchange as module

    calls: list[float] = []

    async def slow_refusal(ctx: Any, chosen: list[str], **kwargs: Any) -> Any:
        calls.append(kwargs["timeout"])
        await asyncio.sleep(0.3)
        raise SecAggError("too_few", "one had nothing", unmasked=[chosen[0]])

    monkeypatch.setattr(module, "secure_sum", slow_refusal)
    sites = Sites(["alice"], timeout=0.5)
    got = await sites.collect(5, [f"p{i}" for i in range(12)], 2)
    assert got.terms == [] and 3 <= len(calls) <= 4, calls
    assert calls[0] == 0.5 and all(t <= 0.5 for t in calls) and calls[-1] < 0.5


async def test_a_silent_neighbour_costs_one_session_not_the_round() -> None:
    """A neighbour that never answers is a dropout of the first session; the
    next session, with the next neighbour of the ranking, still fits in the
    round and gives the sum."""
    sites = Sites(["alice", "bob"], timeout=0.5)
    sites.put("alice", 5, 1.0, 20)
    sites.put("bob", 5, 3.0, 20)

    async def silent(requester: str, query: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(30)
        return {}

    sites.network.join("hung").serve(SECAGG_KIND, silent)
    got = await sites.collect(5, ["hung", "alice", "bob"], 2)
    (term,) = got.terms
    assert sorted(term.merged) == [("alice", 5), ("bob", 5)]
    assert got.log["secagg_sessions"] == 2 and got.log["neighbours_skipped"] == 1


def test_asynchronous_secure_aggregation_is_a_setting_and_fedperl_refuses_it() -> None:
    for proto in (
        create("fedavgp2p", asynchronous=True, secure_aggregation=True),
        create("ssfl", asynchronous=True, secure_aggregation=True),
    ):
        assert isinstance(proto, FedAvgP2P) and type(proto.exchanger) is AsyncSecureExchange
    assert FedAvgP2PParams(name="fedavgp2p", asynchronous=True, secure_aggregation=True)
    assert SSFLParams(name="ssfl", asynchronous=True, secure_aggregation=True)
    with pytest.raises(ValueError, match="anonymized peer"):
        FedPerlParams(name="fedperl", asynchronous=True, secure_aggregation=True)


def test_a_slow_site_holds_back_no_one_with_secure_sums(sources: list[str], tmp_path: Path) -> None:  # noqa: F811
    plan = FaultPlan(write_plan(tmp_path, {"slow_train": FACTOR}))
    cfgs = [
        cfg.model_copy(
            update={"protocol": cfg.protocol.model_copy(update={"secure_aggregation": True})}
        )
        for cfg in async_configs(sources, tmp_path, asynchronous=True)
    ]
    run = run_with_a_slow_site(cfgs, plan)
    fast = ("fast0", "fast1")
    assert run.not_ready == dict.fromkeys(SITES, 0)  # nothing held open
    assert all(run.slow_round_when_done[f] < ROUNDS for f in fast), run.slow_round_when_done
    for name in SITES:  # no plain model travelled, only secure sums
        kinds = run.network.traffic(name).by_kind
        assert "model" not in kinds and kinds[SECAGG_KIND].messages > 0, sorted(kinds)
    records = {(r["node"], r["round"]): r for r in run.network.records}
    rounds = range(1, ROUNDS + 1)
    assert all(records[(f, r)]["asynchronous"] == 1 for f in SITES for r in rounds)
    for f in fast:
        merged = slow_models_merged(run.protos[f])
        assert merged, f"{f} never merged the slow site's model"
        assert len(set(merged)) == len(merged), merged
    assert run.network.rejections == []


# ---------------------------------------------------------------------- a hostile requester

HOSTILE_VALUES: list[Any] = [
    float("nan"),
    float("inf"),
    -float("inf"),
    -1,
    0,
    1.5,
    2**31 + 1,
    2**63,
    -(2**63),
    "",
    "5",
    "x" * 200,
    True,
    None,
    b"\xff" * 64,
    [],
    ["alice", "alice"],
    {},
]
REQUEST_FIELDS = [
    "session",
    "contributors",
    "round",
    "max_round",
    "purpose",
    "weight_scale",
    "at_round",
]


@pytest.mark.parametrize("field", REQUEST_FIELDS)
async def test_every_hostile_field_of_an_asynchronous_request_is_refused_with_a_reason(
    field: str,
) -> None:
    """Each field of a freshest Round 0 set to NaN, inf, negative, huge, empty,
    repeated, of the wrong type or missing: answered at once, refused with a
    reason and counted unless the refusal is one an honest requester meets
    (too_new, not_newer, too_stale, no_weight); whatever is accepted opens at
    most one session, and the contributor still gives an honest sum after."""
    from protocols.secagg import BENIGN_REFUSALS

    sites = Sites(["alice", "bob"])
    sites.put("alice", 5, 1.0, 20)
    sites.put("bob", 5, 3.0, 20)
    contributor = sites.exchanges["alice"].contributor
    assert contributor is not None
    for i, value in enumerate(HOSTILE_VALUES):
        before = len(sites.counted())
        session = f"{i:032x}" if field != "session" else value
        fields = {"session": session, field: value, "weight_scale": 40.0}
        if field == "weight_scale":
            fields["weight_scale"] = value
        reply = await asyncio.wait_for(raw(sites, "alice", ["alice", "bob"], **fields), 5)
        assert isinstance(reply, dict), (field, value, reply)
        if "refused" in reply:
            reason = reply["refused"]
            assert isinstance(reason, str) and reason, (field, value)
            counted = sites.counted()[before:]
            if reason in BENIGN_REFUSALS:
                assert counted == [], (field, value, counted)
            else:
                assert counted == [(REQUESTER, f"secagg_{reason}")], (field, value, counted)
        else:  # a value that happens to be legal (None: the field's default)
            assert "c_pk" in reply, (field, value, reply)
        held = [key for key in contributor.sessions if key[0] == REQUESTER]
        assert len(held) <= 1, (field, value, held)
    honest = await sites.collect(5, ["alice", "bob"], 2)
    assert sorted(honest.terms[0].merged) == [("alice", 5), ("bob", 5)]


async def test_a_flood_of_asynchronous_round_zeros_holds_one_session() -> None:
    """Five hundred freshest Round 0 requests with fresh ids, none followed up:
    the contributor holds one session and a bounded memory of ids, and the
    same id twice is refused (`session_reused`, counted)."""
    from protocols.secagg import MAX_SEEN_SESSIONS

    sites = Sites(["alice", "bob"])
    sites.put("alice", 5, 1.0, 20)
    contributor = sites.exchanges["alice"].contributor
    assert contributor is not None
    replies = await asyncio.gather(
        *(raw(sites, "alice", ["alice", "bob"], session=f"{i:032x}") for i in range(500))
    )
    assert all("c_pk" in r for r in replies)
    assert len([key for key in contributor.sessions if key[0] == REQUESTER]) == 1
    assert len(contributor.seen[REQUESTER]) <= MAX_SEEN_SESSIONS
    again = await raw(sites, "alice", ["alice", "bob"], session=f"{499:032x}")
    assert again == {"refused": "session_reused"}
    assert sites.counted() == [(REQUESTER, "secagg_session_reused")]


async def test_two_asynchronous_sums_at_once_put_each_model_in_one_of_them() -> None:
    """A requester running two freshest sums over the same contributors at
    once gets at most one: each model is masked at most once for it."""
    sites = Sites(["alice", "bob"])
    sites.put("alice", 5, 1.0, 20)
    sites.put("bob", 5, 3.0, 20)

    async def one() -> Any:
        try:
            return await sites.freshest()
        except SecAggError as exc:
            return exc

    results = await asyncio.wait_for(asyncio.gather(one(), one()), 30)
    sums = [r for r in results if not isinstance(r, SecAggError)]
    assert len(sums) <= 1, results
    for name in ("alice", "bob"):
        ledger = sites.exchanges[name].contributor.ledger  # type: ignore[union-attr]
        assert list(ledger.contributed) in ([], [(REQUESTER, 5)]), ledger.contributed
