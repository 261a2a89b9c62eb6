"""probe: check a federation before training on it.

Every round each node pushes a tensor of `payload_kb` to every alive peer and
waits (up to round_timeout_s) for one from each of them. It logs how many it
sent, received and lost, and the push throughput. Operators run it once after
provisioning to prove keys, roster, reachability, encryption and bandwidth;
the test suite uses it to exercise spooling and crash recovery with real pushes.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

import torch

from p2pfl.config import ProbeParams
from protocols.base import PeerUnavailable, Received, RoundContext
from protocols.rounds import Round, RoundLoop

PROBE_KIND = "probe"
# Probes of at most this many rounds ahead are kept for their round: a peer
# further ahead is not waited for long anyway (its probes of the rounds this
# node has yet to run are already consumed), and a member pushing probes of
# every later round of a long probe (rounds: 1,000,000) grew the memory by an
# entry a push even after a first review capped them at the last round.
EARLY_ROUNDS = 16


class Probe(RoundLoop[ProbeParams]):
    phases = ("exchange",)  # no model: nothing to train, merge or evaluate
    kinds = (PROBE_KIND,)
    push_kinds = (PROBE_KIND,)  # sent with ctx.send, read from ctx.inbox

    def __init__(self, params: ProbeParams) -> None:
        super().__init__(params)
        self.received: dict[str, int] = {}  # sender -> probes processed
        # Probes of a later round than this node's (a peer ahead of it): kept for
        # that round, so a node one round behind catches up instead of waiting out
        # round_timeout_s for a probe it already consumed, round after round.
        self.early: dict[int, set[str]] = {}

    def payload(self, me: str, round_no: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(zlib.crc32(f"{me}:{round_no}".encode()))
        return {
            "round": round_no,
            "from": me,
            "tensor": torch.randn(self.params.payload_kb * 256, generator=g),
        }

    async def push(self, ctx: RoundContext, peer: str, round_no: int) -> float | None:
        start = time.perf_counter()
        try:
            await ctx.send(peer, PROBE_KIND, self.payload(ctx.me, round_no), round_no=round_no)
        except PeerUnavailable:
            return None
        return time.perf_counter() - start

    async def setup(self, ctx: RoundContext) -> Any:
        return None

    def take(self, msg: Received, round_no: int, got_this_round: set[str]) -> None:
        self.received[msg.sender] = self.received.get(msg.sender, 0) + 1
        if msg.round == round_no:
            got_this_round.add(msg.sender)
        elif isinstance(msg.round, int) and round_no < msg.round <= min(
            self.params.rounds, round_no + EARLY_ROUNDS
        ):
            # Only rounds this node will run, and soon: a member pushing probes of
            # rounds 11, 12, ... 2^31 - 1 grew `early` by an entry a push, never
            # read (a review, 2026-11-28), and of rounds up to a long probe's last
            # (a second review) by as many.
            self.early.setdefault(msg.round, set()).add(msg.sender)

    async def exchange(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        """Push a probe to every alive peer, and wait for one from each of them."""
        r = rnd.number
        inbox = ctx.inbox(PROBE_KIND)
        peers = [p.name for p in ctx.peers()]
        timings = await asyncio.gather(*(self.push(ctx, p, r) for p in peers))
        sent = [t for t in timings if t is not None]
        got_this_round: set[str] = self.early.pop(r, set())
        self.early = {k: v for k, v in self.early.items() if k > r}
        deadline = time.monotonic() + self.params.round_timeout_s
        while True:
            # Take everything already delivered, then wait for the missing peers.
            while not inbox.empty():
                self.take(inbox.get_nowait(), r, got_this_round)
            missing = [p for p in (x.name for x in ctx.peers()) if p not in got_this_round]
            if not missing or time.monotonic() >= deadline:
                break
            try:
                msg = await asyncio.wait_for(
                    inbox.get(), timeout=min(0.5, deadline - time.monotonic())
                )
            except TimeoutError:
                continue
            self.take(msg, r, got_this_round)
        mb = self.params.payload_kb / 1024
        rnd.log.update(
            sent=len(sent),
            send_failures=len(timings) - len(sent),
            received=len(got_this_round),
            received_total=sum(self.received.values()),
            push_mb_s=(mb * len(sent) / sum(sent)) if sent and sum(sent) > 0 else 0.0,
        )

    async def after_round(self, ctx: RoundContext, site: Any, round_no: int) -> None:
        # Pause after the checkpoint, so what this round consumed is off the spool meanwhile.
        if self.params.interval_s:
            await ctx.sleep(self.params.interval_s)

    def evaluates(self, round_no: int) -> bool:
        return False

    def checkpoint_state(self, round_no: int, site: Any) -> dict[str, Any]:
        return {"round": round_no, "received": self.received}

    def resume(self, ctx: RoundContext, site: Any) -> int:
        state = ctx.restore() or {"round": 0, "received": {}}
        self.received = dict(state["received"])
        return int(state["round"]) + 1
