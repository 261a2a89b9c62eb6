"""FedSGDP2P: gradient averaging without a server (DFU paper, Sec. 4, Alg. 4/6/8/10).

Every node, every local step s of round r:
  1. grad: the gradient of its loss on its next local batch    (Alg. 4 line 5)
  2. offer: that gradient to whoever asks for (r, s)             (serve "grad")
  3. choose neighbours with the configured heuristic and pull their (r, s)
     gradients concurrently                                       (Alg. 4 line 6)
  4. apply the batch-size-weighted mean of its own gradient and theirs with
     its optimizer                                                (Alg. 4 line 7)
     (or a robust variant, `protocol.aggregation`: median, trimmed_mean, or
     norm_clip, which clips each neighbour's gradient itself)
A neighbour's gradient must have the node's own gradient's names, shapes and
dtypes, finite values and an L2 norm at most `max_norm_ratio` times the own
gradient's of the same step; every refusal is counted (`grad_<reason>`). Its
batch size is a claim, capped like a sample count (`max_weight_ratio`, the
roster's max_samples; counted as `weight_capped`, logged as `weights_capped`).
A neighbour that fails or does not answer within `step_timeout_s` is skipped,
and then left out for 1, 2, 4, ... steps (at most one round's worth) until it
answers again: the step goes on with what arrived. A neighbour whose
gradient is refused, or that answers that the step is gone from its memory,
is backed off the same way.

A round is `training.steps_per_round` steps when set (the same for every site,
cycling through its reshuffled data), else `training.epochs` passes over the
local batches (each capped at `training.max_steps_per_epoch`); nodes gossip
their steps per round so nobody waits for a step a smaller site never takes. After each round the node
evaluates, gossips and checkpoints exactly like FedAVGP2P. Batches are not
augmented here: neighbours' gradients are averaged as computed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from p2pfl.config import FedSGDP2PParams
from p2pfl.learning.train import LocalSite
from protocols import selection
from protocols.aggregate import aggregate_gradients
from protocols.base import PeerInfo, RoundContext
from protocols.checks import warn_if_trim_cuts_nothing
from protocols.compressed_exchange import CompressedGradientExchange
from protocols.exchange import GRAD_KIND, GradientExchange
from protocols.rounds import Round, RoundLoop
from protocols.site import build_site

log = logging.getLogger(__name__)

STEPS_KEY = "sgd_steps"
GRADIENTS_KEPT = 8  # latest step gradients kept for slower neighbours


def steps_per_round(site: LocalSite) -> int:
    """Optimizer steps of one round: `LocalSite.steps_per_round` (the DP recipe's
    under training.recipe dp, else `p2pfl.learning.steps.steps_per_round`)."""
    return site.steps_per_round()


class FedSgdP2P(RoundLoop[FedSGDP2PParams]):
    # A round is its steps, each with its own exchange: one "train" phase.
    phases = ("train",)
    kinds = (GRAD_KIND,)

    def __init__(self, params: FedSGDP2PParams) -> None:
        super().__init__(params)
        options: dict[str, Any] = {
            "keep": GRADIENTS_KEPT,
            "timeout": params.step_timeout_s,
            "max_norm_ratio": params.max_norm_ratio,
            "max_weight_ratio": params.max_weight_ratio,
            "on_unavailable": self.failed,
            "on_refused": self.back_off,
        }
        # protocol.compression: each step's g + e compressed once, with error
        # feedback (protocols/compressed_exchange.py); the residual e is checkpointed.
        self.exchanger: GradientExchange = (
            CompressedGradientExchange(compression=params.compression, **options)
            if params.compression != "none"
            else GradientExchange(**options)
        )
        # neighbour -> (first step it may be asked again, consecutive failures)
        self.backoff: dict[str, tuple[int, int]] = {}
        self.steps_done = 0  # steps over all rounds: the clock of the backoff
        self.max_skip = 1
        self.timeouts = 0  # failed pulls this round

    # ------------------------------------------------------------------ the loop

    def failed(self, peer: str) -> None:
        """Skip a neighbour that did not answer for 1, 2, 4, ... steps (at most a
        round's worth): a neighbour stalled for a moment is back at once, a dead
        one costs a handful of timeouts per round rather than one per step."""
        self.back_off(peer)
        self.timeouts += 1

    def back_off(self, peer: str) -> None:
        """Skip `peer` for the next 1, 2, 4, ... steps: it did not answer, or
        its gradient was refused (counted by the exchange; before a review of
        2026-11-28 it was asked again at the next step, and one answering late
        with what is refused cost a wait at every step)."""
        _, failures = self.backoff.get(peer, (0, 0))
        skip = min(2**failures, self.max_skip)
        self.backoff[peer] = (self.steps_done + 1 + skip, failures + 1)

    def candidates(self, ctx: RoundContext, step: int) -> list[PeerInfo]:
        """Alive peers that will take step `step` this round and are not backed off."""
        out = []
        for peer in ctx.peers():
            if self.backoff.get(peer.name, (0, 0))[0] > self.steps_done:
                continue
            steps = peer.meta.get(STEPS_KEY)
            if isinstance(steps, int) and steps < step:
                continue
            out.append(peer)
        return out

    async def setup(self, ctx: RoundContext) -> Any:
        site: LocalSite = await ctx.run_blocking(build_site, ctx.config)
        total_steps = steps_per_round(site)
        self.max_skip = max(1, total_steps)
        ctx.publish(STEPS_KEY, total_steps)
        self.exchanger.start(ctx)
        p = self.params
        k_max = selection.neighbour_count(p.fraction, len(ctx.roster()) - 1)
        warn_if_trim_cuts_nothing(ctx, p.aggregation, p.trim_ratio, k_max, "gradients")
        return site

    async def fit(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        """Every local step: gradient, exchange, optimizer step (DFU Alg. 4)."""
        p = self.params
        r = rnd.number
        others = len(ctx.roster()) - 1
        self.timeouts = 0
        train_s = exchange_s = 0.0
        losses: list[float] = []
        neighbours_used = 0
        merged: set[str] = set()
        capped: dict[str, int] = {}  # neighbour -> steps its batch size was capped
        step = 0
        # The same batches as FedAVGP2P's local training: E epochs, or exactly
        # training.steps_per_round steps whatever the site's size.
        for x, y in site.training_batches(site.training.epochs):
            step += 1
            self.steps_done += 1
            # 1. g = Gradient(w, data) (DFU Alg. 4 line 5), offered to the neighbours.
            t0 = time.perf_counter()
            grad = await ctx.run_blocking(site.compute_gradient, x, y)
            losses.append(site.last_loss if site.last_loss is not None else float("nan"))
            # Under training.recipe dp the gradient is a sum over a Poisson batch
            # divided by the expected batch, which is its weight: the realised size
            # is never used (under training.dp the accountant covers only the noised
            # sum, and an empty batch, weight 0, stopped a lone node: review r1).
            own_size = float(site.recipe.batch_size if site.recipe is not None else len(y))
            self.exchanger.offer(ctx, (r, step), grad, own_size)
            train_s += time.perf_counter() - t0

            # 2. Pull the neighbours' (r, s) gradients (Alg. 4 line 6).
            t0 = time.perf_counter()
            k = selection.neighbour_count(p.fraction, others)
            ranking = self.heuristic.select(
                ctx.me,
                self.candidates(ctx, step),
                k,
                round_no=r,
                step=step,
                seed=ctx.config.federation.seed,
                my_meta=self.gossip,
                history=self.selection_history,
                reject=ctx.reject,
            )
            # The neighbours' batch sizes are claims: capped (roster, median ratio).
            got = await self.exchanger.collect(ctx, (r, step), grad, own_size, ranking, k)
            for peer in got.capped:
                capped[peer] = capped.get(peer, 0) + 1
            exchange_s += time.perf_counter() - t0

            # 3. w <- optimizer step with the batch-size-weighted mean gradient (Alg. 4 line 7).
            t0 = time.perf_counter()
            mean = aggregate_gradients(
                p.aggregation,
                [grad] + [t.state for t in got.terms],
                [own_size] + [t.weight for t in got.terms],
                trim_ratio=p.trim_ratio,
                clip_norm=p.clip_norm,
            )
            await ctx.run_blocking(site.apply_gradient, mean)
            train_s += time.perf_counter() - t0
            used = [peer for t in got.terms for peer, _ in t.merged]
            for peer in used:
                self.backoff.pop(peer, None)
            neighbours_used += len(used)
            merged.update(used)
            self.remember_neighbours(used)
            self.update_recent(ctx)
            ctx.record_choice(used)

        rnd.merged = [(peer, r) for peer in sorted(merged)]
        for peer, times in sorted(capped.items()):
            log.warning(
                "%s round %d: %s's claimed batch size capped at %d of its steps",
                ctx.me,
                r,
                peer,
                times,
            )
        rnd.log.update(
            train_loss=sum(losses) / len(losses) if losses else float("nan"),
            train_s=train_s,
            exchange_s=exchange_s,
            steps=step,
            neighbours=neighbours_used / step if step else 0.0,
            timeouts=self.timeouts,
            weights_capped=sum(capped.values()),
        )
        if isinstance(self.exchanger, CompressedGradientExchange):
            rnd.log.update(self.exchanger.round_log())

    def checkpoint_state(self, round_no: int, site: Any) -> dict[str, Any]:
        state = super().checkpoint_state(round_no, site)
        if isinstance(self.exchanger, CompressedGradientExchange):
            state["compression_residual"] = self.exchanger.residual
        return state

    def load_extra(self, saved: dict[str, Any]) -> None:
        # Every step of the saved round is done: serve none of them as "not yet".
        self.exchanger.latest = (int(saved["round"]), 1 << 30)
        if isinstance(self.exchanger, CompressedGradientExchange):
            self.exchanger.restore_residual(saved.get("compression_residual"))
