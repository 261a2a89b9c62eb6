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

A node takes a relay only from a member that may send it one (in a ring, its
predecessor), checks it in full (the relayed model against its own, the buffer
against the federation's bounds) and refuses and counts any other
(`relay_<reason>`), keeping its own model: protocols/feder_relays.py says how.
With `protocol.compression` the relayed model travels as fp16 or blockwise
int8 (topk:F relays int8: top-k of raw weights is no model), with no shared
reference and no error feedback: each hop rounds the model afresh.

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
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

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
from protocols.compression import compress_state, payload_nbytes
from protocols.feder_buffers import (
    buffer_training_tensors,
    checked_buffer,
    gate_buffer,
    make_buffer,
)
from protocols.feder_relays import (
    BUFFER_KIND,
    MAX_KEPT_BUFFERS,
    RELAY_KIND,
    RelayIntake,
    derive_ring,
    ring_successor,
)
from protocols.rounds import Round
from protocols.site import build_site

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------- the protocol


class FedER(RelayIntake):
    # Alg. 1: receive the predecessor's model and buffer, take its model, then train.
    phases = ("exchange", "aggregate", "train")
    kinds = (RELAY_KIND, BUFFER_KIND)
    push_kinds = (RELAY_KIND,)  # the relay is pushed; a buffer is only served and pulled

    def __init__(self, params: FedERParams) -> None:
        super().__init__(params)
        self.own_buffer: dict[str, Any] | None = None
        self.sent_buffers: dict[str, set[str]] = {}  # peer -> hashes it acknowledged
        self.last_received_hash: str | None = None  # the buffer replayed until a new one comes

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
