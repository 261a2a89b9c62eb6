"""A roster that grows while a node runs (a SIGHUP reload) and the compressed
exchange's per-pair copies: every pair is kept, on both sides, as long as its
peer is on the roster as it is now (review rv_comp, 2026-11-28: the bound was
the roster's size at start, so a grown roster evicted live pairs, and honest
replies built on an evicted copy were refused and counted `compression_bad_ref`)."""

from __future__ import annotations

import asyncio
from typing import Any

from test_exchange_attacks import OWN, Ctx, exchange, sender

from p2pfl.secure.tensors import dumps, loads

PEERS = ["a", "b", "c", "d", "e"]


class GrowingCtx(Ctx):
    """Pulls answered by one honest sender per peer; every second peer answers
    a little later, so replies are adopted while other pulls are in flight."""

    def __init__(self, senders: dict[str, Any], roster: list[str]) -> None:
        super().__init__(roster=roster)
        self.senders = senders

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        self.queries.append(query)
        await asyncio.sleep(0.01 * (PEERS.index(peer) % 2))
        return loads(dumps(await self.senders[peer].serve("me", query)))


def test_a_grown_roster_keeps_every_pair_and_refuses_no_honest_reply() -> None:
    senders = {p: sender("int8") for p in PEERS}
    rx = exchange("int8")
    ctx = GrowingCtx(senders, roster=["me", "a", "b"])
    rx.start(ctx)  # type: ignore[arg-type]
    ctx._roster = ["me", *PEERS]  # reloaded: three more sites
    for _ in range(3):
        got = asyncio.run(rx.collect(ctx, 1, OWN, 10.0, PEERS, 5))  # type: ignore[arg-type]
        assert ctx.rejected == [] and len(got.terms) == 5
    assert sorted(rx.held) == PEERS
    assert all(q["ref"] != 0 for q in ctx.queries[-5:])  # no keyframe after the first round
    tx = senders["a"]  # and a sender keeps the copies of every requester now on the roster
    tx.start(Ctx(roster=["me", "p"]))  # type: ignore[arg-type]
    tx.roster = lambda: ["me", *PEERS]
    for requester in PEERS:
        asyncio.run(tx.serve(requester, {"round": 1, "max_round": 2, "ref": 0}))
    assert sorted(tx.sent) == [*PEERS, "me"]  # "me" pulled it above
