"""FedER: federated learning through experience replay (Pennisi et al., Alg. 1, Eq. 6).

Before federation every node n_j
  trains (or loads) its privacy-preserving generator G_j   (genbuffer, Sec. 3.2)
  samples its buffer B_j of synthetic images               (default 512)
  trains M_j^0 on its private data D_j.
Every round r, every node in parallel
  sends (M_j^{r-1}, B_j) to its successor n_k               (Alg. 1)
  receives (M_i^{r-1}, B_i) from a predecessor n_i
  M_j^r <- M_i^{r-1}, trained for E epochs on D_j and B_i   (Eq. 6: every mini-batch
                                                             holds as many synthetic
                                                             images as private ones,
                                                             loss = lam*CE(D_j) + (1-lam)*CE(B_i))
Successors: a fresh random ring per round that every node derives alike from
(federation seed, round, roster) — no coordinator; a dead successor is skipped to
the next alive one in the ring. Or a random alive peer (asynchronous: arrivals
queue), or the selection heuristic. A node that receives nothing keeps training
the model it holds.

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
(`relay_<reason>`), and the node keeps training its own model. With
`protocol.compression` the relayed model travels as fp16 or blockwise int8
(topk:F relays int8: top-k of raw weights is no model), with no shared
reference and no error feedback: each hop rounds the model afresh. It is
decoded (refusals counted as `compression_<reason>`) before those checks.

Buffers travel once: a buffer is named by its content hash, and a node sends
only the hash to a peer that already acknowledged that buffer (the peer keeps
the buffers it received, and can pull one it lost). Sites choose their
generator's resolution and channels and their `buffer_size` each for itself,
so a received buffer must be within the federation's bounds, not like this
node's own: C in BUFFER_CHANNELS, H = W in BUFFER_SIDES, 1 to MAX_BUFFER_IMAGES
images. It is verified and turned into the classifier's replay images (resized
to its input, off the event loop) before the relay is taken, so a buffer that
cannot be trained on is a counted refusal (`relay_buffer_<reason>`), never a
failure in `fit`. A node keeps at most MAX_KEPT_BUFFERS buffers, the latest of
each sender (the least recently received goes first): that bounds memory
(MAX_KEPT_BUFFERS x MAX_BUFFER_IMAGES images at the classifier's input),
checkpoints and FedER-A's replay.

Variants (Sec. 4.4): FedER-A shares buffers only (each node trains its own model
on its data plus every buffer received so far); FedER-B relays models like FedER
but trains on synthetic images only (its own buffer plus the received one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from genbuffer.buffer import check_buffer_layout
from genbuffer.config import GenbufferSection
from genbuffer.errors import SyntheticBufferError
from genbuffer.gate import PrivacyGateRefused, gate_status
from genbuffer.progress import TrainingProgress
from p2pfl.config import FedERParams
from p2pfl.learning.data.loaders import to_float_tensor
from p2pfl.learning.evaluate import evaluate_site
from p2pfl.learning.train import LocalSite
from p2pfl.secure.tensors import state_dict_nbytes
from protocols.base import NotReady, PeerUnavailable, Received, RoundContext
from protocols.checks import admit
from protocols.compressed_exchange import relayed_model
from protocols.compression import compress_state, parse, payload_nbytes
from protocols.feder_buffers import (
    BUFFER_BOUNDS,
    buffer_training_tensors,
    checked_buffer,
    gate_buffer,
    is_sha256,
    make_buffer,
)
from protocols.rounds import Round, RoundLoop
from protocols.site import build_site

log = logging.getLogger(__name__)

RELAY_KIND = "feder"  # model and/or buffer pushed to the successor
BUFFER_KIND = "buffer"  # pull a buffer by hash (when a relay carried only the hash)
EARLY_RELAYS = 4  # a relay of round r+1..r+4 is held, and checked in full in its round
LIVENESS_POLL_S = 0.5  # how often a relay waiting on its predecessor's death is looked at again
# Received buffers kept (in memory and in every checkpoint), the latest of each
# sender; FedER-A replays all of them: at most 16 x MAX_BUFFER_IMAGES images at
# the classifier's input size.
MAX_KEPT_BUFFERS = 16


# ---------------------------------------------------------------------- successors


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


# ---------------------------------------------------------------------- the protocol


class FedER(RoundLoop[FedERParams]):
    # Alg. 1: receive the predecessor's model and buffer, take its model, then train.
    phases = ("exchange", "aggregate", "train")
    kinds = (RELAY_KIND, BUFFER_KIND)
    push_kinds = (RELAY_KIND,)  # the relay is pushed; a buffer is only served and pulled

    def __init__(self, params: FedERParams) -> None:
        super().__init__(params)
        self.variant = params.name  # feder | feder_a | feder_b
        self.own_buffer: dict[str, Any] | None = None
        self.buffers: dict[str, dict[str, Any]] = {}  # received, by content hash
        self.buffer_of: dict[str, str] = {}  # sender -> hash of its latest buffer, oldest first
        self.replay: dict[str, np.ndarray] = {}  # hash -> the buffer as classifier images
        self.image_size, self.channels = 0, 0  # the classifier's input (setup)
        self.sent_buffers: dict[str, set[str]] = {}  # peer -> hashes it acknowledged
        self.last_received_hash: str | None = None  # the buffer replayed until a new one comes
        self.num_classes: int | None = None
        self.refused = 0  # relays refused this round
        self.early: list[Received] = []  # relays of rounds r+1..r+4, held (hold_or_refuse)
        self.waiting: dict[str, Received] = {}  # this round's, behind the predecessor
        self.compression = parse(params.compression)  # how the relayed model travels

    @property
    def relays_model(self) -> bool:
        return self.variant != "feder_a"

    # ------------------------------------------------------------------ serving

    async def serve_buffer(self, requester: str, query: dict[str, Any]) -> dict[str, Any]:
        wanted = query.get("hash")
        if self.own_buffer is not None and wanted == self.own_buffer["content_hash"]:
            return self.own_buffer
        raise NotReady(f"no buffer {wanted!r} here")

    # ------------------------------------------------------------------ exchange

    def successors(self, ctx: RoundContext, r: int) -> list[str]:
        alive = {p.name for p in ctx.peers()}
        seed = ctx.config.federation.seed
        if self.params.successor == "ring":
            return ring_successor(derive_ring(ctx.roster(), seed, r), ctx.me, alive)
        candidates = sorted(alive)
        if self.params.successor == "random":
            random.Random(f"feder-random|{seed}|{ctx.me}|{r}").shuffle(candidates)
            return candidates
        return self.heuristic.select(ctx.me, ctx.peers(), 1, round_no=r, seed=seed)

    async def send_relay(
        self, ctx: RoundContext, r: int, site: LocalSite
    ) -> tuple[str | None, int, int]:
        """Alg. 1 'Send M_j^{r-1}, B_j to n_k'; returns (successor, model bytes, buffer bytes)."""
        assert self.own_buffer is not None
        digest = self.own_buffer["content_hash"]
        for peer in self.successors(ctx, r):
            needs_buffer = digest not in self.sent_buffers.get(peer, set())
            payload: dict[str, Any] = {
                "round": r,
                "buffer_hash": digest,
                "buffer": self.own_buffer if needs_buffer else None,
            }
            model_bytes = 0
            if self.relays_model:
                state = site.state_dict()
                if self.compression.lossy:  # the raw model, rounded afresh at every hop
                    model = await ctx.run_blocking(compress_state, state, self.compression, True)
                    payload.update(compression=self.compression.setting)
                    model_bytes = payload_nbytes(model)
                else:
                    model, model_bytes = state, state_dict_nbytes(state)
                payload.update(model=model, num_train=site.num_train)
            try:
                await ctx.send(peer, RELAY_KIND, payload, round_no=r)
            except PeerUnavailable as exc:
                log.info(
                    "%s round %d: successor %s unavailable (%s), trying the next",
                    ctx.me,
                    r,
                    peer,
                    exc.reason,
                )
                continue
            self.sent_buffers.setdefault(peer, set()).add(digest)
            ctx.record_choice([peer])
            return peer, model_bytes, self.own_buffer["images"].numel() if needs_buffer else 0
        return None, 0, 0

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

    # ------------------------------------------------------------------ the round

    async def setup(self, ctx: RoundContext) -> Any:
        site = await ctx.run_blocking(build_site, ctx.config)
        self.num_classes = site.num_classes
        self.image_size, self.channels = site.data.image_size, site.data.channels
        ctx.serve(BUFFER_KIND, self.serve_buffer)
        return site

    async def exchange(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        """Send (M_j^{r-1}, B_j) to the successor; receive (M_i^{r-1}, B_i)."""
        reference = site.state_dict()
        successor, model_bytes, buffer_bytes = await self.send_relay(ctx, rnd.number, site)
        self.refused = 0
        msg = await self.receive_relay(ctx, rnd.number, reference)
        rnd.received = [msg] if msg is not None else []
        rnd.log.update(
            received=int(msg is not None),
            relays_refused=self.refused,
            sent_model_bytes=model_bytes,
            sent_buffer_bytes=buffer_bytes,
            successor_found=int(successor is not None),
        )

    async def aggregate(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        """M_j^r <- M_i^{r-1} (FedER-A keeps its own model)."""
        for msg in rnd.received:
            self.last_received_hash = msg.payload["buffer_hash"]
            if self.relays_model:
                await ctx.run_blocking(site.load_state_dict, msg.payload["model"])
                rnd.merged = [(msg.sender, msg.round)]

    async def fit(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        """Train on D_j and the replayed synthetic images (Eq. 6)."""
        p = self.params
        if p.reset_optimizer:
            site.reset_optimizer()
        replay = self.replay_hashes(self.last_received_hash)
        rx, ry = await ctx.run_blocking(self.replay_tensors, replay)
        if self.variant == "feder_b":  # synthetic-only: own buffer + received
            rx, ry = torch.cat([self.own_x, rx]), torch.cat([self.own_y, ry])
            fit = await ctx.run_blocking(
                site.train_replay_epochs, rx, ry, lam=p.lambda_, private=False
            )
        else:
            fit = await ctx.run_blocking(site.train_replay_epochs, rx, ry, lam=p.lambda_)
        rnd.log.update(train_loss=fit["loss"], replayed_images=len(ry))

    async def evaluate_round(self, ctx: RoundContext, site: Any) -> dict[str, Any]:
        """Test (and val) metrics; FedER gossips nothing for a heuristic."""
        metrics = await ctx.run_blocking(evaluate_site, site)
        metrics.pop("per_class_f1", None)
        return metrics

    def replay_hashes(self, last_received: str | None) -> list[str]:
        if self.variant == "feder_a":  # every buffer kept (MAX_KEPT_BUFFERS at most)
            return sorted(self.replay)
        if last_received is not None and last_received in self.replay:
            return [last_received]
        return []

    def replay_tensors(self, hashes: list[str]) -> tuple[Tensor, Tensor]:
        """The kept buffers' replay images as normalised floats, and their labels."""
        if not hashes:
            size = self.image_size
            return torch.zeros(0, self.channels, size, size), torch.zeros(0, dtype=torch.long)
        x = to_float_tensor(np.concatenate([self.replay[h] for h in hashes]))
        return x, torch.cat([self.buffers[h]["labels"].long() for h in hashes])

    # ------------------------------------------------------------------ before federation, resume

    async def before_rounds(self, ctx: RoundContext, site: Any) -> None:
        """Before federation (a fresh start): G_j, B_j and M_j^0, logged as round 0."""
        if self.own_buffer is None:
            await self.prepare(ctx, site)
        else:  # resumed: the checkpoint's buffer goes through today's gate, as in prepare,
            # and is not served (serve_buffer) before the gate has released it
            kept, self.own_buffer = self.own_buffer, None
            section, out_dir = self.genbuffer_settings(ctx)
            seed = ctx.config.federation.seed + ctx.config.training.seed
            decision = await ctx.run_blocking(gate_buffer, kept, site, section, out_dir, seed)
            ctx.set_privacy_gate(gate_status(decision))
            if decision is not None and not decision.released:
                raise PrivacyGateRefused(decision)  # the node reports why and stops
            self.own_buffer = kept
            ctx.offered(BUFFER_KIND)
        assert self.own_buffer is not None
        self.own_x, self.own_y = buffer_training_tensors(
            [self.own_buffer], site.data.image_size, site.data.channels
        )
        if self.buffers:  # resumed: the kept buffers' replay images, each checked again
            await ctx.run_blocking(self.restore_replay)

    def restore_replay(self) -> None:
        """The replay images of the buffers a checkpoint kept, made again; one
        that fails today's checks (a checkpoint of an older version) is dropped."""
        kept: dict[str, tuple[dict[str, Any], np.ndarray]] = {}
        for digest, buffer in self.buffers.items():
            try:
                kept[digest] = checked_buffer(
                    buffer,
                    num_classes=self.num_classes,
                    image_size=self.image_size,
                    channels=self.channels,
                )
            except SyntheticBufferError as exc:
                log.warning("checkpointed buffer %s dropped (%s)", digest[:12], exc)
        self.buffers = {h: kept[h][0] for h in kept}
        self.replay = {h: kept[h][1] for h in kept}
        self.buffer_of = {s: h for s, h in self.buffer_of.items() if h in kept}

    async def prepare(self, ctx: RoundContext, site: Any) -> None:
        ctx.set_phase("generator")
        section, out_dir = self.genbuffer_settings(ctx)
        seed = ctx.config.federation.seed + ctx.config.training.seed
        loop = asyncio.get_running_loop()
        # The GAN trains on the trainer thread; the phase is set on the event loop's.
        progress = TrainingProgress(lambda line: loop.call_soon_threadsafe(ctx.set_phase, line))
        buffer, decision = await ctx.run_blocking(
            make_buffer, self.params, site, section, out_dir, seed, progress
        )
        ctx.set_phase("generator: privacy gate decided")
        ctx.set_privacy_gate(gate_status(decision))
        if decision is not None and not decision.released:
            raise PrivacyGateRefused(decision)  # nothing was sent; the node reports why and stops
        self.own_buffer = buffer
        ctx.offered(BUFFER_KIND)
        ctx.set_phase("train")
        if self.variant == "feder_b":  # M_j^0 on its own synthetic images only
            x, y = buffer_training_tensors(
                [self.own_buffer], site.data.image_size, site.data.channels
            )
            await ctx.run_blocking(
                site.train_replay_epochs, x, y, self.params.initial_epochs, private=False
            )
        elif self.params.initial_epochs:
            await ctx.run_blocking(site.train_epochs, self.params.initial_epochs)  # M_j^0 on D_j
        ctx.log_metrics(0, **await self.evaluate_round(ctx, site))
        ctx.checkpoint(self.checkpoint_state(0, site))

    def genbuffer_settings(self, ctx: RoundContext) -> tuple[GenbufferSection, Path]:
        """The GAN settings and the folder of the generator's files: the site-level
        `genbuffer:` section (validated and path-resolved by `check`); the older
        free-form `protocol.genbuffer` still wins when it is given."""
        if self.params.genbuffer:
            return GenbufferSection(**self.params.genbuffer), ctx.artifact("genbuffer")
        section = ctx.config.genbuffer
        out_dir = section.out_dir  # load_config made it absolute (default <state_dir>/genbuffer)
        return section, out_dir if out_dir.is_absolute() else ctx.artifact(str(out_dir))

    def checkpoint_state(self, round_no: int, site: Any) -> dict[str, Any]:
        return {
            **super().checkpoint_state(round_no, site),
            "own_buffer": self.own_buffer,
            "buffers": self.buffers,
            "buffer_of": [[sender, h] for sender, h in self.buffer_of.items()],  # oldest first
            "sent_buffers": {peer: sorted(h) for peer, h in self.sent_buffers.items()},
            # Held relays of later rounds: their pushes count as consumed with this
            # checkpoint (they left the inbox), so a restart gets them from here.
            "early": [
                {"sender": x.sender, "round": x.round, "payload": x.payload, "msg_id": x.msg_id}
                for x in self.early
            ],
        }

    def load_extra(self, saved: dict[str, Any]) -> None:
        self.own_buffer = saved["own_buffer"]
        buffers = dict(saved["buffers"])
        # A checkpoint of before buffers were kept per sender: each its own "sender".
        pairs = saved.get("buffer_of") or [[h, h] for h in buffers]
        self.buffer_of = {str(s): str(h) for s, h in pairs if h in buffers}
        while len(self.buffer_of) > MAX_KEPT_BUFFERS:
            del self.buffer_of[next(iter(self.buffer_of))]
        self.buffers = {h: buffers[h] for h in buffers if h in set(self.buffer_of.values())}
        self.sent_buffers = {peer: set(hashes) for peer, hashes in saved["sent_buffers"].items()}
        # Held early relays (none in a checkpoint of an older version); each is
        # checked in its round as if it had just come.
        self.early = [
            Received(str(x["sender"]), RELAY_KIND, int(x["round"]), x["payload"], str(x["msg_id"]))
            for x in saved.get("early") or []
        ]
