"""FedER's relays as a node takes them in (protocols/feder.py runs the rounds
and sends them): the ring every node derives alike, who may relay to whom, the
checks a relay passes before it is taken, and the received buffers a node keeps.

Intake: in a ring a node takes a relay only from its ring predecessor, the
nearest member before it that it holds alive (`ctx.peers()`: a suspect, unknown
or failed member counts as gone, the mirror of the sender's skip;
`relay_not_predecessor` otherwise); with the other successors, from any member.
Either way one relay per sender per round (`relay_duplicate`), none of an
earlier round (`relay_wrong_round`). One of the next EARLY_RELAYS rounds is held
for its round after the checks that cost nothing (its sender is that round's
predecessor, its buffer's count and shape are within bounds), one per round in
a ring, one per sender otherwise; all other checks, and any pull of its
buffer, run in its own round. Intake ends at the round's deadline, and a pull
never runs past it (nor past `round_timeout_s`).

The relayed model replaces the receiver's own, so it must fit that model: the
same keys, shapes and dtypes, finite values, and an L2 norm at most
`max_norm_ratio` times the receiver's current model's. A relay that fails this
(or is malformed, or carries a bad buffer) is refused and counted
(`relay_<reason>`), and the node keeps training its own model. A model
relayed with `protocol.compression` is decoded (refusals counted as
`compression_<reason>`) before those checks.

A buffer a relay brings (or names, and this node pulls) is verified against
the federation's bounds and turned into the classifier's replay images before
the relay is taken (`relay_buffer_<reason>` otherwise); a node keeps at most
MAX_KEPT_BUFFERS of them, the latest of each sender.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from genbuffer.buffer import check_buffer_layout
from genbuffer.errors import SyntheticBufferError
from p2pfl.config import FedERParams
from protocols.base import PeerUnavailable, Received, RoundContext
from protocols.checks import admit
from protocols.compressed_exchange import relayed_model
from protocols.compression import parse
from protocols.feder_buffers import BUFFER_BOUNDS, checked_buffer, is_sha256
from protocols.rounds import RoundLoop

log = logging.getLogger(__name__)

RELAY_KIND = "feder"  # model and/or buffer pushed to the successor
BUFFER_KIND = "buffer"  # pull a buffer by hash (when a relay carried only the hash)
EARLY_RELAYS = 4  # a relay of round r+1..r+4 is held, and checked in full in its round
LIVENESS_POLL_S = 0.5  # how often a relay waiting on its predecessor's death is looked at again
# Received buffers kept (in memory and in every checkpoint), the latest of each
# sender; FedER-A replays all of them: at most 16 x MAX_BUFFER_IMAGES images at
# the classifier's input size.
MAX_KEPT_BUFFERS = 16


# ---------------------------------------------------------------------- the ring


def derive_ring(names: list[str], seed: int, round_no: int) -> list[str]:
    """The round's random directed ring; identical on every node (no coordinator)."""
    order = sorted(names)
    random.Random(f"feder-ring|{seed}|{round_no}").shuffle(order)
    return order


def ring_successor(ring: list[str], me: str, alive: set[str]) -> list[str]:
    """Candidates after `me` in ring order, alive ones only (the first is the successor)."""
    i = ring.index(me)
    after = ring[i + 1 :] + ring[:i]
    return [n for n in after if n in alive]


def ring_predecessors(ring: list[str], me: str, alive: set[str]) -> list[str]:
    """Who may relay to `me`, the mirror of `ring_successor`: the members before
    `me` in ring order, nearest first, up to and including the first one in
    `alive` (those skipped are the ones `me` holds dead, as a sender skips a
    dead successor)."""
    i = ring.index(me)
    before = ring[:i][::-1] + ring[i + 1 :][::-1]
    out: list[str] = []
    for name in before:
        out.append(name)
        if name in alive:
            break
    return out


# ---------------------------------------------------------------------- relays


@dataclass
class Relay:
    """A relay that passed every check: what taking it stores and trains on."""

    msg: Received  # its payload's "model" is the decoded model
    digest: str  # the buffer it names, verified to be `buffer`'s hash
    buffer: dict[str, Any]  # verified
    images: np.ndarray  # the buffer as the classifier's images (replay_images)


# ---------------------------------------------------------------------- intake


class RelayIntake(RoundLoop[FedERParams]):
    """The receiving side of FedER's relay: which relays of which round a node
    takes, holds or refuses, their checks, and the buffers it keeps (the
    latest of each sender, with their replay images). `FedER` adds sending,
    the rounds and the node's own buffer."""

    def __init__(self, params: FedERParams) -> None:
        super().__init__(params)
        self.variant = params.name  # feder | feder_a | feder_b
        self.buffers: dict[str, dict[str, Any]] = {}  # received, by content hash
        self.buffer_of: dict[str, str] = {}  # sender -> hash of its latest buffer, oldest first
        self.replay: dict[str, np.ndarray] = {}  # hash -> the buffer as classifier images
        self.image_size, self.channels = 0, 0  # the classifier's input (setup)
        self.num_classes: int | None = None
        self.refused = 0  # relays refused this round
        self.early: list[Received] = []  # relays of rounds r+1..r+4, held (hold_or_refuse)
        self.waiting: dict[str, Received] = {}  # this round's, behind the predecessor
        self.compression = parse(params.compression)  # how the relayed model travels

    @property
    def relays_model(self) -> bool:
        return self.variant != "feder_a"

    def sender_status(self, ctx: RoundContext, sender: str, round_no: int) -> str:
        """Whether this node takes a relay of `round_no` from `sender`: "ok";
        "wait" (a ring member farther back than the predecessor: "ok" once no
        member between is alive to this node, `ctx.peers()`: a suspect, unknown
        or failed member counts as gone, as it does for a sender picking its
        successor); "no" (not a member)."""
        roster = ctx.roster()
        if sender == ctx.me or sender not in roster:
            return "no"
        if self.params.successor != "ring":
            return "ok"  # any member may be chosen: docs/threat-model.md says what that allows
        ring = derive_ring(roster, ctx.config.federation.seed, round_no)
        alive = {p.name for p in ctx.peers()}
        return "ok" if sender in ring_predecessors(ring, ctx.me, alive) else "wait"

    def refuse(self, ctx: RoundContext, msg: Received, reason: str, r: int) -> None:
        log.warning(
            "%s: relay of round %d from %s refused in round %d (%s)",
            ctx.me,
            msg.round,
            msg.sender,
            r,
            reason,
        )
        ctx.reject(msg.sender, reason)
        self.refused += 1

    @staticmethod
    def unfit_to_hold(msg: Received) -> str | None:
        """The refusal of a relay any check that costs nothing sees (it names a
        buffer; a buffer it brings is the one named, within the count and shape
        bounds), or None. No pixel is read, no model touched, nothing awaited."""
        p = msg.payload
        if not isinstance(p, dict) or not is_sha256(p.get("buffer_hash")):
            return "relay_malformed"
        buffer = p.get("buffer")
        if buffer is None:
            return None
        if isinstance(buffer, dict) and buffer.get("content_hash") != p["buffer_hash"]:
            return "relay_buffer_mismatch"
        try:
            check_buffer_layout(buffer, **BUFFER_BOUNDS)
        except SyntheticBufferError as exc:
            return f"relay_{exc.reason}"
        return None

    def hold_or_refuse(self, ctx: RoundContext, msg: Received, r: int) -> None:
        """A relay of another round than `r`: one of rounds r+1..r+EARLY_RELAYS
        from that round's predecessor is held for its round after the checks
        that cost nothing (`unfit_to_hold`); every other check, and any pull of
        its buffer, runs in its own round, so no relay of another round spends
        this round's time. With `successor: ring` one relay is held per round,
        from its predecessor (an honest sender may precede this node in several
        of those rounds); with the other successors, where any member may send,
        one per sender, so no sender pins them all. Any other is refused and
        counted."""
        m = msg.round
        if not r < m <= r + EARLY_RELAYS:
            self.refuse(ctx, msg, "relay_wrong_round", r)
            return
        if any(x.sender == msg.sender and x.round == m for x in self.early):
            self.refuse(ctx, msg, "relay_duplicate", r)
            return
        if self.sender_status(ctx, msg.sender, m) != "ok":
            self.refuse(ctx, msg, "relay_not_predecessor", r)
            return
        reason = self.unfit_to_hold(msg)
        if reason is not None:
            self.refuse(ctx, msg, reason, r)
            return
        if self.params.successor == "ring":
            rival = next((x for x in self.early if x.round == m), None)
            if rival is not None:
                if self.sender_status(ctx, rival.sender, m) == "ok":
                    self.refuse(ctx, msg, "relay_wrong_round", r)  # the round's slot is taken
                    return
                # A nearer member is alive again: the one held is no longer the
                # round's predecessor (in its round it would only wait), this one is.
                self.early.remove(rival)
                self.refuse(ctx, rival, "relay_not_predecessor", r)
        elif any(x.sender == msg.sender for x in self.early):
            self.refuse(ctx, msg, "relay_wrong_round", r)  # its one slot is taken
            return
        self.early.append(msg)

    async def receive_relay(
        self, ctx: RoundContext, r: int, reference: dict[str, Tensor]
    ) -> Received | None:
        """Alg. 1 'Receive M_i^{r-1}, B_i': the first relay of round `r` that
        passes every check from a sender this node takes one from (with
        `successor: ring` its predecessor, `sender_status`), once per sender
        (`relay_duplicate`). A relay from a ring member farther back waits while
        the members between may be alive, and is refused (`relay_not_predecessor`)
        when the round's relay is taken or the time is up. A relay of an earlier
        round is refused (`relay_wrong_round`): stale or replayed, it must not
        replace this round's; one of a later round goes to `hold_or_refuse`.
        Intake ends at the round's deadline (`round_timeout_s` after it began),
        whatever is still queued, and no pull runs past it: relays still queued
        stay for the next round (which refuses or holds them), held ones of this
        round not yet looked at are refused (`relay_wrong_round`)."""
        inbox = ctx.inbox(RELAY_KIND)
        held = [x for x in self.early if x.round == r]
        self.early = [x for x in self.early if x.round > r]
        seen = {x.sender for x in held}  # one relay per sender per round
        waiting = self.waiting = {}  # sender -> its relay of round r, behind the predecessor
        deadline = time.monotonic() + self.params.round_timeout_s
        taken: Received | None = None
        while taken is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = [s for s in waiting if self.sender_status(ctx, s, r) == "ok"]
            if held or ready:
                msg = held.pop(0) if held else waiting.pop(ready[0])
                taken = await self.consider(ctx, msg, r, reference, deadline)
                continue
            try:
                if inbox.empty():
                    wait = min(remaining, LIVENESS_POLL_S) if waiting else remaining
                    msg = await asyncio.wait_for(inbox.get(), wait)
                else:
                    msg = inbox.get_nowait()
            except TimeoutError:
                continue
            if msg.round != r:
                self.hold_or_refuse(ctx, msg, r)
            elif msg.sender in seen:
                self.refuse(ctx, msg, "relay_duplicate", r)
            else:
                seen.add(msg.sender)
                taken = await self.consider(ctx, msg, r, reference, deadline)
        for msg in held:  # the round's relay was taken, or its time ran out, first
            self.refuse(ctx, msg, "relay_wrong_round", r)
        for msg in waiting.values():
            self.refuse(ctx, msg, "relay_not_predecessor", r)
        waiting.clear()
        return taken

    async def consider(
        self,
        ctx: RoundContext,
        msg: Received,
        r: int,
        reference: dict[str, Tensor],
        deadline: float,
    ) -> Received | None:
        """One relay of round `r` (also one held since it came early): taken
        (returned), set waiting, or refused and counted."""
        status = self.sender_status(ctx, msg.sender, r)
        if status == "wait":
            self.waiting[msg.sender] = msg
            return None
        if status == "no":
            self.refuse(ctx, msg, "relay_not_predecessor", r)
            return None
        relay = await self.accept(ctx, msg, reference, deadline)
        if relay is None:
            self.refused += 1
            return None
        return self.take(relay)

    def admits(
        self, ctx: RoundContext, sender: str, model: Any, reference: dict[str, Tensor]
    ) -> bool:
        """The relayed model fits this node's (`protocols.checks.admit`); FedER-A relays none."""
        return not self.relays_model or admit(
            ctx,
            sender,
            "relay",
            model,
            reference,
            max_norm_ratio=self.params.max_norm_ratio,
            where=f" round {ctx.round}",
        )

    async def accept(
        self, ctx: RoundContext, msg: Received, reference: dict[str, Tensor], deadline: float
    ) -> Relay | None:
        """Every check of a relay, or None: refused and counted (`relay_<reason>`,
        `compression_<reason>`). Nothing is stored: `take` does that. A buffer
        it names and does not bring is pulled until `deadline` at the latest
        (the round's) and for at most `round_timeout_s`."""
        p = msg.payload
        if not isinstance(p, dict) or not is_sha256(p.get("buffer_hash")):
            log.warning("%s: malformed relay from %s", ctx.me, msg.sender)
            ctx.reject(msg.sender, "relay_malformed")
            return None
        model = p.get("model")
        if self.relays_model and self.compression.lossy:
            model = await relayed_model(ctx, msg.sender, p, reference, self.compression)
            if model is None:
                return None
        if not self.admits(ctx, msg.sender, model, reference):
            return None
        digest = p["buffer_hash"]
        buffer = p.get("buffer")
        if buffer is None and digest in self.replay:  # one this node verified and keeps
            buffer_checked, images = self.buffers[digest], self.replay[digest]
        else:
            if buffer is None:
                try:  # a buffer we should have but lost: pull it once, within the round
                    timeout = min(self.params.round_timeout_s, deadline - time.monotonic())
                    if timeout <= 0:
                        raise PeerUnavailable(msg.sender, "the round's time is up")
                    buffer = await ctx.request(msg.sender, BUFFER_KIND, {"hash": digest}, timeout)
                except PeerUnavailable as exc:
                    log.warning(
                        "%s: relay from %s refused: its buffer %s is unavailable (%s)",
                        ctx.me,
                        msg.sender,
                        digest[:12],
                        exc.reason,
                    )
                    ctx.reject(msg.sender, "relay_buffer_unavailable")
                    return None
            if isinstance(buffer, dict) and buffer.get("content_hash") != digest:
                log.warning(
                    "%s: relay from %s refused: it names buffer %s and brings another",
                    ctx.me,
                    msg.sender,
                    digest[:12],
                )
                ctx.reject(msg.sender, "relay_buffer_mismatch")
                return None
            try:
                buffer_checked, images = await ctx.run_blocking(
                    checked_buffer,
                    buffer,
                    num_classes=self.num_classes,
                    image_size=self.image_size,
                    channels=self.channels,
                )
            except SyntheticBufferError as exc:
                log.warning("%s: buffer from %s rejected (%s)", ctx.me, msg.sender, exc)
                ctx.reject(msg.sender, f"relay_{exc.reason}")
                return None
        payload = {**p, "model": model} if self.relays_model else p
        return Relay(dataclasses.replace(msg, payload=payload), digest, buffer_checked, images)

    def take(self, relay: Relay) -> Received:
        """Keep the relay's buffer (the sender's latest) and hand its message on."""
        self.keep_buffer(relay.msg.sender, relay.digest, relay.buffer, relay.images)
        return relay.msg

    def keep_buffer(
        self, sender: str, digest: str, buffer: dict[str, Any], images: np.ndarray
    ) -> None:
        """`sender`'s latest buffer; at most MAX_KEPT_BUFFERS senders' are kept
        (the least recently received goes first), and no buffer no sender names."""
        self.buffers[digest], self.replay[digest] = buffer, images
        self.buffer_of.pop(sender, None)
        self.buffer_of[sender] = digest
        while len(self.buffer_of) > MAX_KEPT_BUFFERS:
            del self.buffer_of[next(iter(self.buffer_of))]
        named = set(self.buffer_of.values())
        for stale in [h for h in self.buffers if h not in named]:
            del self.buffers[stale]
            self.replay.pop(stale, None)
