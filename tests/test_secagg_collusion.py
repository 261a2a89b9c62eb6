"""A requester and contributors colluding with it against one honest contributor.

Found by a review (2026-11-27): with the threshold a majority of the other
holders, a requester and ONE colluding contributor peeled an honest
contributor's exact model out of an ordinary sum of 4. The requester tells
one group of honest holders "V stayed" (U3 with V: they reveal shares of V's
self-mask seed b_V) and another "V dropped" (U3 without V: they reveal shares
of V's mask key s_V); the colluder vouches for both stories and gives its own
shares of both. Bonawitz et al. 2017 (Sec. 6) ask t > 2n/3 against such a
requester: `least_threshold`. These tests run the attack with real
Contributors and count what the requester gets; with the majority rule put
back (monkeypatched) the same attack peels the model, so the tests can tell.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from protocols import secagg_messages
from protocols.exchange import ServedModels
from protocols.masking import WEIGHT_KEY, from_fixed, mask_stream, ring_of
from protocols.memory import InMemoryNetwork
from protocols.secagg import SECAGG_KIND, SecAggError, share_keys_body
from protocols.secagg_messages import Advertised, SessionRequest, Shared, session_context
from protocols.secagg_primitives import combine_shares, mask_seed, view_tag
from protocols.secure_exchange import SecureExchange

REQUESTER = "r"
VICTIM = "v"
OPTIONS = dict(max_staleness=1, timeout=5.0, max_norm_ratio=10.0, max_weight_ratio=16.0)


def majority(others: int) -> int:
    """The threshold of before the fix."""
    return max(1, others // 2 + 1)


async def attack(honest: int, colluders: int) -> dict[str, Any]:
    """One session over V, `honest` honest holders and `colluders` colluding
    contributors, at the least threshold the contributors accept. Honest
    holders are split between the two stories, the first half "V stayed";
    every colluder vouches for whatever story each holder was told. Returns
    the shares of b_V and s_V the requester got, t, and V's model peeled out
    where both secrets rebuilt."""
    network = InMemoryNetwork()
    torch.manual_seed(0)
    good = [f"h{i}" for i in range(honest)]
    bad = [f"m{i}" for i in range(colluders)]
    members = sorted([VICTIM, *good, *bad])
    exchanges, models = {}, {}
    for name in members:
        exchange = SecureExchange(ServedModels(keep=3), **OPTIONS)
        exchange.start(network.join(name))
        models[name] = {"conv.weight": torch.randn(8, 3, 3, 3) * 0.1, "fc.bias": torch.randn(2)}
        exchange.store.put(1, models[name], 100)
        exchanges[name] = exchange
    me = network.join(REQUESTER)
    base = dict(
        session=secrets.token_hex(16),
        contributors=members,
        round=1,
        max_round=2,
        purpose="model",
        weight_scale=100.0,
    )

    async def ask(peer: str, phase: str, body: dict[str, Any]) -> Any:
        return await me.request(peer, SECAGG_KIND, {**base, "phase": phase, "body": body}, 5.0)

    t = secagg_messages.threshold_for(len(members) - 1, None)
    adverts = {p: Advertised.model_validate(await ask(p, "advertise", {})) for p in members}
    shared = {
        p: Shared.model_validate(await ask(p, "share", share_keys_body(adverts, members, t, p)))
        for p in members
    }
    views, inputs = {}, {}
    for p in members:
        body = {
            "u2": members,
            "shares": {v: shared[v].shares[p] for v in members if v != p},
            "commitments": {v: shared[v].commitments[p].model_dump() for v in members if v != p},
        }
        reply = await ask(p, "mask", body)
        views[p], inputs[p] = reply["view_tags"], reply["masked"]

    stayed = members
    dropped = [m for m in members if m != VICTIM]
    stories = {h: (stayed if i < (honest + 1) // 2 else dropped) for i, h in enumerate(good)}

    def colluder_tag(colluder: str, holder: str, u3: list[str]) -> bytes:
        contributor = exchanges[colluder].contributor
        session = contributor.sessions[(REQUESTER, base["session"])]
        key = contributor._pair_key(holder, session.context)
        return view_tag(key, colluder, "u3", t, members, members, u3)

    vouched: dict[str, dict[str, bytes]] = {}
    for holder, u3 in stories.items():
        told = {"u3": u3, "view_tags": {v: views[v][holder] for v in u3 if v != holder}}
        reply = await ask(holder, "consistency", told)
        if "tags" in reply:
            vouched[holder] = reply["tags"]
    b_shares: list[tuple[int, bytes]] = []
    s_shares: list[tuple[int, bytes]] = []
    for holder in vouched:
        u3 = stories[holder]
        friends = [h for h in vouched if h != holder and stories[h] == u3]
        u4 = sorted([holder, *friends, *bad])
        words = {h: vouched[h][holder] for h in friends}
        words.update({m: colluder_tag(m, holder, u3) for m in bad})
        revealed = await ask(holder, "unmask", {"u4": u4, "tags": words})
        if VICTIM in revealed.get("self_shares", {}):
            item = revealed["self_shares"][VICTIM]
            b_shares.append((item["idx"], item["share"]))
        if VICTIM in revealed.get("key_shares", {}):
            item = revealed["key_shares"][VICTIM]
            s_shares.append((item["idx"], item["share"]))
    for m in bad:  # what each colluder holds of V's secrets
        idx, sk, b = exchanges[m].contributor.sessions[(REQUESTER, base["session"])].held[VICTIM]
        b_shares.append((idx, b))
        s_shares.append((idx, sk))
    out: dict[str, Any] = {"t": t, "b": len(b_shares), "s": len(s_shares), "peeled": None}
    if len(b_shares) >= t and len(s_shares) >= t:
        out["peeled"] = peel(
            combine_shares(b_shares[:t], len(members) - 1),
            combine_shares(s_shares[:t], len(members) - 1),
            adverts,
            members,
            inputs[VICTIM],
            base,
        )
        out["victim"] = models[VICTIM]
    return out


def peel(
    b_v: bytes,
    s_v: bytes,
    adverts: dict[str, Advertised],
    members: list[str],
    masked: dict[str, Any],
    base: dict[str, Any],
) -> dict[str, torch.Tensor] | None:
    """V's model from its masked input, given b_V and s_V (None if s_V is wrong)."""
    private = X25519PrivateKey.from_private_bytes(s_v)
    if private.public_key().public_bytes_raw() != adverts[VICTIM].s_pk:
        return None
    context = session_context(REQUESTER, SessionRequest(**base, phase="advertise"))
    peeled = {}
    for entry in ("conv.weight", "fc.bias", WEIGHT_KEY):
        total = ring_of(masked[entry])
        total -= mask_stream(b_v, entry, total.size)
        for p in members:
            if p == VICTIM:
                continue
            stream = mask_stream(
                mask_seed(private, adverts[p].s_pk, context, VICTIM, p), entry, total.size
            )
            total = total - stream if p > VICTIM else total + stream
        peeled[entry] = torch.as_tensor(from_fixed(total))
    share = float(peeled[WEIGHT_KEY][0])
    return {k: v / share for k, v in peeled.items() if k != WEIGHT_KEY}


# ---------------------------------------------------------------------- the tests


@pytest.mark.parametrize(
    ("honest", "colluders"),
    [(2, 1), (3, 1), (4, 1), (4, 2), (6, 2)],
    ids=["sum of 4, 1 colluder", "5, 1", "6, 1", "7, 2", "9, 2"],
)
def test_colluders_below_the_bound_cannot_peel_a_model(honest: int, colluders: int) -> None:
    """Within `colluders_tolerated`, the two stories never give the requester
    t shares of both of V's secrets, whichever way the honest holders split."""
    others = honest + colluders  # V's holders
    t = secagg_messages.least_threshold(others)
    assert colluders <= secagg_messages.colluders_tolerated(others, t)
    got = asyncio.run(attack(honest, colluders))
    assert got["t"] == t
    assert min(got["b"], got["s"]) < t, got
    assert got["peeled"] is None


@pytest.mark.parametrize(("honest", "colluders"), [(2, 1), (4, 1)], ids=["sum of 4", "sum of 6"])
def test_with_a_majority_threshold_one_colluder_peels_the_model(
    honest: int, colluders: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack of the review, against the rule before the fix: it works,
    so the test above would see it."""
    monkeypatch.setattr(secagg_messages, "least_threshold", majority)
    got = asyncio.run(attack(honest, colluders))
    assert got["b"] >= got["t"] and got["s"] >= got["t"]
    assert got["peeled"] is not None
    for key, value in got["victim"].items():
        assert torch.allclose(
            got["peeled"][key].reshape(value.shape).double(), value.double(), atol=1e-5
        )


def test_the_bound_is_a_third_of_the_holders() -> None:
    """t = floor(2h/3) + 1 of h holders; the colluders it tolerates, 2t - h - 1,
    and the dropouts after masking it leaves room for, h - t."""
    table = {h: (secagg_messages.least_threshold(h),) for h in range(1, 10)}
    assert [t for (t,) in table.values()] == [1, 2, 3, 3, 4, 5, 5, 6, 7]
    assert [secagg_messages.colluders_tolerated(h, t) for h, (t,) in table.items()] == [
        0,
        1,
        2,
        1,
        2,
        3,
        2,
        3,
        4,
    ]


def test_one_colluder_past_the_bound_peels_the_model_the_documented_limit() -> None:
    """A sum of 5 (4 holders, t = 3) tolerates one colluder; with two, each
    story needs one honest holder only, and the requester gets the model.
    docs/threat-model.md states this limit; choose a minimum of contributors
    (or protocol.secagg_threshold) accordingly."""
    got = asyncio.run(attack(honest=2, colluders=2))
    assert secagg_messages.colluders_tolerated(4, got["t"]) == 1
    assert got["peeled"] is not None
    for key, value in got["victim"].items():
        assert torch.allclose(
            got["peeled"][key].reshape(value.shape).double(), value.double(), atol=1e-5
        )


# ---------------------------------------------------------------------- the sum's size


def test_a_requester_and_one_colluder_see_a_model_in_a_sum_of_two_unless_refused() -> None:
    """A second review: the requester picks the sum's size, so the threshold's
    bound holds only with a minimum size the contributors keep. In a sum of
    {victim, colluder} the colluder's known model comes off and the victim's
    is left; a victim with secagg_min_contributors 3 refuses that sum
    (`sum_too_small`, counted against the requester)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_secagg import Federation

    fed = Federation(names=["alice", "bob", "carol", "erin", "mallory"])
    got = asyncio.run(fed.ask(["alice", "mallory"]))
    alice = got.total_weight - fed.weights["mallory"]
    for key, value in got.mean.items():
        if key.endswith("num_batches_tracked"):
            continue
        peeled = (
            value.double() * got.total_weight
            - fed.weights["mallory"] * fed.states["mallory"][key].double()
        ) / alice
        assert torch.allclose(peeled, fed.states["alice"][key].double(), atol=1e-3)

    fed = Federation(names=["alice", "bob", "carol", "erin", "mallory"])
    fed.contributors["alice"].min_sum = 3
    with pytest.raises(SecAggError):
        asyncio.run(fed.ask(["alice", "mallory"]))
    counted = {(r["node"], r["reason"]) for r in fed.network.rejections}
    assert ("alice", "secagg_sum_too_small") in counted
    assert asyncio.run(fed.ask(["alice", "bob", "mallory"])).contributors == [
        "alice",
        "bob",
        "mallory",
    ]


def test_check_says_how_many_colluders_the_sums_need() -> None:
    """`p2pfl-node check`'s lines: the fewest colluders over every sum size
    answered (a requester picks it), with a warning at one."""
    from p2pfl.config import FedAvgP2PParams
    from p2pfl.config.secagg_guarantees import secagg_colluders_needed, secagg_guarantee_lines

    assert [secagg_colluders_needed(n, None) for n in range(2, 12)] == [
        1,
        2,
        3,
        2,
        3,
        4,
        3,
        4,
        5,
        4,
    ]
    default = FedAvgP2PParams(name="fedavgp2p", secure_aggregation=True)
    lines = secagg_guarantee_lines(default, roster_size=5, wanted=2)
    assert "collude with 1 contributor(s)" in lines[0] and "WARNING" in lines[1]
    three = FedAvgP2PParams(name="fedavgp2p", secure_aggregation=True, secagg_min_contributors=3)
    lines = secagg_guarantee_lines(three, roster_size=5, wanted=2)
    assert lines == [
        "# protocol: secure sums of 3 contributors (threshold t = 2 of 2 holders) survive 0 "
        "dropout(s) after masking; a requester must collude with 2 contributor(s) to see a "
        "site's model (sums of 3 to 4 answered)"
    ]
    assert "no secure sum can be made" in secagg_guarantee_lines(three, roster_size=3, wanted=2)[0]


def test_the_minimum_reaches_both_sides_of_a_node() -> None:
    """protocol.secagg_min_contributors: the sums a node asks for (max(k, m)
    of its ranking) and the sums it answers."""
    from p2pfl.config import FedAvgP2PParams
    from protocols.secure_exchange import exchange_for

    params = FedAvgP2PParams(name="fedavgp2p", secure_aggregation=True, secagg_min_contributors=3)
    exchange = exchange_for(params, ServedModels(keep=3))
    assert isinstance(exchange, SecureExchange) and exchange.min_contributors == 3
    network = InMemoryNetwork()
    exchange.start(network.join("me"))
    assert exchange.contributor is not None and exchange.contributor.min_sum == 3
    asked: list[list[str]] = []

    async def sum_of(ctx: Any, round_no: int, own: Any, chosen: list[str], **kw: Any) -> None:
        asked.append(chosen)

    exchange.sum_of = sum_of  # type: ignore[method-assign]
    ctx = network.join("requester")
    own = {"w": torch.zeros(2)}
    asyncio.run(exchange.collect(ctx, 1, own, 1.0, ["a", "b", "c", "d"], k=2))
    assert asked == [["a", "b", "c"]]
