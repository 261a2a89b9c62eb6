"""FedAVGP2P: federated averaging without a server (DFU paper, Sec. 4, Alg. 3/5/7/9).

Every node, every round r:
  1. fit: E local epochs on its own data          (Alg. 3 line 3)
  2. offer: its round-r model to whoever asks       (serve "model")
  3. choose k = max(1, round(c * (N - 1))) neighbours with the configured
     heuristic (H0 random, H1 n-latest, H2 F1, H3 cosine)
  4. pull their round-r models, concurrently        (Alg. 3 line 6)
  5. aggregate: sample-count-weighted mean of its own model and theirs
     (or a robust variant, `protocol.aggregation`)
  6. evaluate on val and test, gossip per-class F1 and model statistics for
     the heuristics, log, checkpoint.

Rounds are per node. A pull for "round r" waits (up to `round_timeout_s` for
each request) while the neighbour is still training r, and also accepts
its model of a newer round up to r + `max_staleness`. A neighbour that fails
or times out is replaced by the next one in the heuristic's ranking while
time is left (an exchange lasts at most 2 x `round_timeout_s`); the round
always finishes, at worst with the node's own model.
Each node keeps its last max_staleness + 2 models to serve slower peers.

Unlike the paper's box (w <- Mean(neighbours' w)), the node's own model is
part of the mean, weighted by its sample count like every other.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from p2pfl.config import FedAvgP2PParams, SiteConfig
from p2pfl.learning.site_model import create_site_model
from p2pfl.learning.sites import create_site
from p2pfl.learning.train import LocalSite
from protocols import selection
from protocols.aggregate import aggregate
from protocols.base import NotReady, PeerUnavailable, Protocol, RoundContext

log = logging.getLogger(__name__)

MODEL_KIND = "model"
T = TypeVar("T")
HISTORY_KEEP = 1000  # selection history entries kept in checkpoints


# ---------------------------------------------------------------------- shared by the P2P protocols


# Seeding torch's global generator and drawing a model from it is not safe
# while other threads draw from it (many simulated nodes in one process), so
# the common initial state is drawn once per process under a lock and shared.
_initial_states_lock = threading.Lock()
_initial_states: dict[str, dict[str, Tensor]] = {}


def common_initial_state(
    config: SiteConfig, *, channels: int, num_classes: int, image_size: int
) -> dict[str, Tensor]:
    """The federation's common initial weights (the paper starts every client
    from the same model): `create_site_model` drawn from `federation.seed`, so
    every site builds the same ones without a message. The torch generator is
    restored afterwards."""
    key = f"{config.model.model_dump_json()}|{channels}|{num_classes}|{image_size}|{config.federation.seed}"
    with _initial_states_lock:
        if key not in _initial_states:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.federation.seed)
                model = create_site_model(
                    config.model, in_chans=channels, num_classes=num_classes, image_size=image_size
                )
            if len(_initial_states) >= 4:
                _initial_states.pop(next(iter(_initial_states)))
            _initial_states[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {k: v.clone() for k, v in _initial_states[key].items()}


def build_site(config: SiteConfig) -> LocalSite:
    """The site's LocalSite (model, optimizer, data), starting from the common
    initial weights, its inference batch size calibrated before any round."""
    site = create_site(config)
    site.load_state_dict(
        common_initial_state(
            config,
            channels=site.data.channels,
            num_classes=site.data.num_classes,
            image_size=site.data.image_size,
        )
    )
    site.calibrate_eval_batch()
    return site


def evaluate_site(site: LocalSite) -> dict[str, Any]:
    """Test metrics (the headline `macro_f1`/`accuracy`) and validation metrics
    (`val_*`; their per-class F1 is what the node gossips). A site without a
    val split gossips its test F1; one without a test split logs val only."""
    out: dict[str, Any] = {}
    reports = site.evaluate_available()
    if "test" in reports:
        out["macro_f1"] = reports["test"]["macro_f1"]
        out["accuracy"] = reports["test"]["accuracy"]
    if "val" in reports:
        out["val_macro_f1"] = reports["val"]["macro_f1"]
        out["val_accuracy"] = reports["val"]["accuracy"]
    gossip = reports.get("val") or reports.get("test")
    out["per_class_f1"] = list(gossip["per_class_f1"]) if gossip else None
    return out


def incompatibility(
    state: Any, reference: dict[str, Tensor], *, max_norm_ratio: float | None = None
) -> str | None:
    """Why a peer's state dict cannot be averaged with ours (None if it can):
    other keys, shapes or dtypes, non-finite values, or (with `max_norm_ratio`)
    an L2 norm more than that many times ours."""
    if not isinstance(state, dict):
        return "not_a_state_dict"
    if set(state) != set(reference):
        return "key_mismatch"
    for key, ref in reference.items():
        value = state[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(ref.shape):
            return "shape_mismatch"
        if value.dtype != ref.dtype:
            return "dtype_mismatch"
        if value.is_floating_point() and value.numel() and not bool(torch.isfinite(value).all()):
            return "non_finite"
    if max_norm_ratio is not None:
        theirs, ours = _float_norm(state), _float_norm(reference)
        if theirs > max_norm_ratio * max(ours, 1e-12):
            return "huge_norm"
    return None


def _float_norm(state: dict[str, Tensor]) -> float:
    total = 0.0
    for value in state.values():
        if value.is_floating_point():
            total += float(value.detach().double().square().sum())
    return total**0.5


async def pull_concurrently(
    ranking: list[str],
    k: int,
    timeout: float,
    fetch: Callable[[str, float], Awaitable[T | None]],
) -> list[T]:
    """Ask the first k of `ranking` at once, each with `timeout`; each failure
    (fetch returns None) is replaced by the next candidate. No request is
    started or runs past 2 x timeout from the start, so one failed wave can be
    replaced but a dead federation costs a bounded wait. Returns the successful
    results in the order they arrived."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2 * timeout
    queue = list(ranking)
    pending: dict[asyncio.Task[T | None], str] = {}
    results: list[T] = []

    def launch() -> None:
        while queue and len(pending) + len(results) < k:
            remaining = min(timeout, deadline - loop.time())
            if remaining <= 0:
                return
            peer = queue.pop(0)
            pending[asyncio.create_task(fetch(peer, remaining))] = peer

    launch()
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.pop(task)
                result = task.result()
                if result is not None:
                    results.append(result)
            launch()
    finally:
        for task in pending:
            task.cancel()
    return results


@dataclass
class PeerModel:
    peer: str
    round: int
    state: dict[str, Tensor]
    num_train: int


# ---------------------------------------------------------------------- the protocol


class FedAvgP2P(Protocol):
    name = "fedavgp2p"

    def __init__(self, params: FedAvgP2PParams) -> None:
        self.params = params
        self.served: OrderedDict[int, dict[str, Any]] = OrderedDict()  # round -> model payload
        self.selection_history: list[list[str]] = []
        # What each committed round merged: [round, [[peer, peer's round], ...]] (bounded).
        self.merged: list[list[Any]] = []
        self.gossip: dict[str, Any] = {}

    # ------------------------------------------------------------------ serving

    def keep_for_peers(self, round: int, state: dict[str, Tensor], num_train: int) -> None:
        self.served[round] = {"round": round, "state": state, "num_train": num_train}
        while len(self.served) > self.params.max_staleness + 2:
            self.served.popitem(last=False)

    async def serve_model(self, requester: str, query: dict[str, Any]) -> dict[str, Any]:
        """'Your model of round r': the one of round r, or the nearest newer one
        up to `max_round`; NotReady while this node has not finished r."""
        wanted = int(query.get("round", 0))
        newest = int(query.get("max_round", wanted))
        for r in sorted(self.served):
            if wanted <= r <= newest:
                return self.served[r]
        latest = max(self.served, default=-1)
        if latest < wanted:
            raise NotReady(f"round {wanted} not trained yet (latest {latest})")
        return {"round": latest, "state": None, "num_train": 0, "reason": "too_new"}

    # ------------------------------------------------------------------ exchange

    async def fetch_model(
        self, ctx: RoundContext, round: int, reference: dict[str, Tensor], peer: str, timeout: float
    ) -> PeerModel | None:
        query = {"round": round, "max_round": round + self.params.max_staleness}
        try:
            reply = await ctx.request(peer, MODEL_KIND, query, timeout)
        except PeerUnavailable as exc:
            log.info("%s round %d: no model from %s (%s)", ctx.me, round, peer, exc.reason)
            return None
        if not isinstance(reply, dict):
            log.warning("%s round %d: malformed reply from %s", ctx.me, round, peer)
            ctx.reject(peer, "model_malformed")
            return None
        got_round, state, num_train = reply.get("round"), reply.get("state"), reply.get("num_train")
        if state is None:
            log.info("%s round %d: %s is past round %s", ctx.me, round, peer, got_round)
            return None
        if not isinstance(got_round, int) or not round <= got_round <= query["max_round"]:
            log.warning("%s round %d: %s sent round %r", ctx.me, round, peer, got_round)
            ctx.reject(peer, "model_wrong_round")
            return None
        if not isinstance(num_train, int) or num_train < 1:
            log.warning("%s round %d: %s sent num_train %r", ctx.me, round, peer, num_train)
            ctx.reject(peer, "model_bad_num_train")
            return None
        problem = incompatibility(state, reference, max_norm_ratio=self.params.max_norm_ratio)
        if problem is not None:
            log.warning("%s round %d: model from %s rejected (%s)", ctx.me, round, peer, problem)
            ctx.reject(peer, f"model_{problem}")
            return None
        return PeerModel(peer, got_round, state, num_train)

    async def pull_neighbours(
        self,
        ctx: RoundContext,
        round: int,
        own: dict[str, Tensor],
        heuristic: selection.Heuristic,
        k: int,
    ) -> list[PeerModel]:
        """Choose k neighbours among the alive peers with the heuristic (H0-H3) and
        pull their round-r models concurrently (DFU Alg. 3 line 6); a neighbour
        that fails is replaced by the next in the ranking. Sorted by peer name."""
        ranking = heuristic.select(
            ctx.me,
            ctx.peers(),
            k,
            round=round,
            seed=ctx.config.federation.seed,
            my_meta=self.gossip,
            history=self.selection_history,
        )
        fetch = functools.partial(self.fetch_model, ctx, round, own)
        received = await pull_concurrently(ranking, k, self.params.round_timeout_s, fetch)
        return sorted(received, key=lambda m: m.peer)

    # ------------------------------------------------------------------ the loop

    async def run(self, ctx: RoundContext) -> None:
        site: LocalSite = await ctx.train(build_site, ctx.config)
        await self.run_rounds(ctx, site)
        ctx.set_phase("done")

    async def run_rounds(self, ctx: RoundContext, site: Any) -> None:
        """The rounds, resumed from the last checkpoint. `site` is anything with
        LocalSite's training surface (train_epochs, state_dict, load_state_dict,
        num_train, optimizer state, model_stats_vector): Fed-MAE runs its
        autoencoder through the same loop, with its own evaluate_round and
        checkpoint_state."""
        p = self.params
        cfg = ctx.config
        heuristic = selection.from_config(cfg.selection)
        start = self.resume(ctx, site)
        ctx.serve(MODEL_KIND, self.serve_model)
        k_max = selection.neighbour_count(p.fraction, len(ctx.roster()) - 1)
        if p.aggregation == "trimmed_mean" and int(p.trim_ratio * (k_max + 1)) == 0:
            log.warning(
                "%s: trimmed_mean with trim_ratio %.2f over %d models cuts nothing (a plain "
                "mean): raise protocol.trim_ratio or protocol.fraction, or use median",
                ctx.me,
                p.trim_ratio,
                k_max + 1,
            )

        for r in range(start, p.rounds + 1):
            ctx.round = r
            round_start = time.perf_counter()

            # 1. E local epochs (DFU Alg. 3 line 3: w = fit(w, data, epochs)).
            ctx.set_phase("train")
            fit = await ctx.train(site.train_epochs)
            train_s = time.perf_counter() - round_start
            own = site.state_dict()
            self.keep_for_peers(r, own, site.num_train)
            ctx.offered(MODEL_KIND)

            # 2-3. Choose k neighbours among the alive peers (H0-H3).
            ctx.set_phase("exchange")
            exchange_start = time.perf_counter()
            k = selection.neighbour_count(p.fraction, len(ctx.roster()) - 1)
            received = await self.pull_neighbours(ctx, r, own, heuristic, k)
            exchange_s = time.perf_counter() - exchange_start

            # 5. w <- weighted mean of own + neighbours' models (DFU Alg. 3 line 6).
            ctx.set_phase("aggregate")
            aggregate_start = time.perf_counter()
            if received:
                averaged = await ctx.train(
                    aggregate,
                    p.aggregation,
                    [own] + [m.state for m in received],
                    [float(site.num_train)] + [float(m.num_train) for m in received],
                    own=0,
                    trim_ratio=p.trim_ratio,
                    clip_norm=p.clip_norm,
                )
                await ctx.train(site.load_state_dict, averaged)
            aggregate_s = time.perf_counter() - aggregate_start
            ctx.record_choice(self.note_merged(r, received))

            # 6. Evaluate, gossip what the heuristics read, log, checkpoint.
            metrics: dict[str, Any] = {}
            if r % p.eval_every == 0 or r == p.rounds:
                ctx.set_phase("evaluate")
                metrics = await self.evaluate_round(ctx, site)
            self.update_recent(ctx)
            ctx.log_metrics(
                r,
                **metrics,
                train_loss=fit["loss"],
                train_s=train_s,
                exchange_s=exchange_s,
                aggregate_s=aggregate_s,
                round_s=time.perf_counter() - round_start,
                neighbours=len(received),
                neighbours_wanted=k,
                stale_models=sum(1 for m in received if m.round != r),
            )
            ctx.checkpoint(self.checkpoint_state(r, site))

    async def evaluate_round(self, ctx: RoundContext, site: Any) -> dict[str, Any]:
        """The round's logged metrics; also refreshes the gossip the heuristics read
        (per-class F1 on val, model statistics)."""
        metrics = await ctx.train(evaluate_site, site)
        stats = await ctx.train(site.model_stats_vector)
        self.update_gossip(ctx, metrics.pop("per_class_f1"), stats)
        return metrics

    def checkpoint_state(self, round: int, site: Any) -> dict[str, Any]:
        """Everything `resume` needs to carry on after `round`."""
        return {
            "protocol": self.name,
            "round": round,
            "model": site.state_dict(),
            "optimizer": site.optimizer_state(),
            "selection_history": self.selection_history,
            "merged": self.merged,
            "gossip": self.gossip,
        }

    def note_merged(self, round: int, received: list[PeerModel]) -> list[str]:
        """Remember whom round `round` averaged with (the n-latest history and the
        `merged` ledger of the checkpoint); returns those peers' names."""
        used = [m.peer for m in received]
        self.selection_history = (self.selection_history + [used])[-HISTORY_KEEP:]
        entry = [round, [[m.peer, m.round] for m in received]]
        self.merged = (self.merged + [entry])[-HISTORY_KEEP:]
        return used

    # ------------------------------------------------------------------ gossip and resume

    def update_gossip(
        self, ctx: RoundContext, per_class_f1: list[float] | None, stats: list[float]
    ) -> None:
        if per_class_f1 is not None:
            self.gossip[selection.F1_KEY] = [float(x) for x in per_class_f1]
            ctx.publish(selection.F1_KEY, self.gossip[selection.F1_KEY])
        self.gossip[selection.MODEL_STATS_KEY] = [float(x) for x in stats]
        ctx.publish(selection.MODEL_STATS_KEY, self.gossip[selection.MODEL_STATS_KEY])

    def update_recent(self, ctx: RoundContext) -> None:
        """H1: the n most recent neighbours, gossiped for the others' overlap test."""
        recent = selection.recent_neighbours(self.selection_history, ctx.config.selection.n)
        self.gossip[selection.RECENT_KEY] = recent
        ctx.publish(selection.RECENT_KEY, recent)

    def resume(self, ctx: RoundContext, site: LocalSite) -> int:
        """Load the last checkpoint (if any) and return the first round to run."""
        saved = ctx.restore()
        if not saved or saved.get("protocol") != self.name:
            return 1
        site.load_state_dict(saved["model"])
        site.load_optimizer_state(saved["optimizer"])
        self.selection_history = [list(x) for x in saved.get("selection_history", [])]
        self.merged = [list(x) for x in saved.get("merged", [])]
        self.gossip = dict(saved.get("gossip", {}))
        for key, value in self.gossip.items():
            ctx.publish(key, value)
        ctx.round = int(saved["round"])
        log.info("%s: resumed after round %d", ctx.me, saved["round"])
        return int(saved["round"]) + 1
