"""The round skeleton: the one loop every protocol runs.

    setup (build the site, serve what peers ask for)
    resume from the last checkpoint, or prepare a fresh start
    for each round r:
        the round's learning rate (training.lr_schedule)
        the protocol's phases, in its order        train -> fit()
                                                    exchange -> exchange()
                                                    aggregate -> aggregate()
        evaluate (every `eval_every` rounds and the last); keep the best model
            on the site's validation split (p2pfl.learning.best)
        log: the phases' timers, the evaluation, what the protocol noted
        checkpoint: everything resume needs, with the ledger of what was merged
            and the best model
        after_round (probe: the pause between rounds)
        (before the round's first exchange, with protocol.min_peers: wait for a
        quorum of alive peers, phase waiting_for_quorum)
    finish (export what the protocol produces), phase "done"

The skeleton owns the loop, the learning-rate schedule, the phases and their
timers, logging, the best model, the checkpoint and resume, the merged ledger
and the gossip a selection heuristic reads. A protocol (FedAVGP2P, FedSGDP2P, SSFL/FedPerl, FedER, Fed-MAE, probe)
overrides only the hooks its paper's algorithm box makes different.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar
from typing import Protocol as Structural

from p2pfl.config import ConfigError
from p2pfl.learning.best import BestModel
from p2pfl.learning.dp import LEDGER, mark_unprivate
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.evaluate import evaluate_site, select_by
from p2pfl.learning.optimizer import lr_factor
from p2pfl.learning.personal import Personalization
from protocols import selection
from protocols.base import Protocol, RoundContext

log = logging.getLogger(__name__)

HISTORY_KEEP = 1000  # selection history and merged-ledger entries kept in checkpoints
QUORUM_POLL_S = 0.5  # how often a node below quorum counts its alive peers again
QUORUM_LOG_EVERY_S = 30.0

# A phase's name (what /status shows) -> the hook that runs it.
PHASE_HOOKS = {"train": "fit", "exchange": "exchange", "aggregate": "aggregate"}


@dataclass
class Round:
    """What one round's phases hand each other, and what the round logs."""

    number: int
    own: dict[str, Any] | None = None  # this node's update of the round (after fit)
    received: list[Any] = field(default_factory=list)  # the neighbours' updates (exchange)
    merged: list[tuple[str, int]] = field(default_factory=list)  # (peer, its round) merged
    log: dict[str, Any] = field(default_factory=dict)  # the protocol's own logged values


class LoopParams(Structural):
    """What the skeleton reads of every protocol's params (p2pfl.config's BaseParams)."""

    name: str
    rounds: int
    eval_every: int
    min_peers: int | None


P = TypeVar("P", bound=LoopParams)


class RoundLoop(Protocol, Generic[P]):
    """A protocol run as rounds, over its params type `P`. Hooks, in the order
    the skeleton calls them: `setup`, `load_extra` (on resume), `before_rounds`,
    the phase hooks of `phases`, `evaluate_round`, `checkpoint_state`, `finish`."""

    phases: ClassVar[tuple[str, ...]] = ("train", "exchange", "aggregate")
    params: P

    def __init__(self, params: P) -> None:
        self.params = params
        self.name = params.name  # the one place a protocol's name is written is its params
        self.selection_history: list[list[str]] = []  # neighbours used, most recent last
        self.merged: list[list[Any]] = []  # [round, [[peer, peer's round], ...]] (bounded)
        self.gossip: dict[str, Any] = {}  # what this node publishes for the heuristics
        # the best federated model so far on the site's validation split (the
        # latest where that split holds one class: p2pfl.learning.best)
        self.best = BestModel(federated=True)

    # ------------------------------------------------------------------ the loop

    async def run(self, ctx: RoundContext) -> None:
        await self.run_stage(ctx)
        ctx.set_phase("done")

    async def run_stage(self, ctx: RoundContext) -> None:
        """setup, the rounds, finish: the whole protocol, or one stage of a
        chained one (Fed-MAE, Fed-BEiT)."""
        site = await self.setup(ctx)
        await self.run_rounds(ctx, site)
        await self.finish(ctx, site)

    async def run_rounds(self, ctx: RoundContext, site: Any) -> None:
        """The rounds, resumed from the last checkpoint."""
        self.heuristic = selection.from_config(ctx.config.selection)  # who to exchange with
        self.check_quorum(ctx)
        self.personal = self.personalization(ctx, site)
        start = self.resume(ctx, site)
        self.show_training(ctx, site, announce=True)
        await self.before_rounds(ctx, site)
        for r in range(start, self.params.rounds + 1):
            ctx.round = r
            rnd = Round(r)
            round_start = time.perf_counter()
            timers: dict[str, float] = {}
            lr = self.schedule_lr(ctx, site, r)
            if lr is not None:
                rnd.log["lr"] = lr
            for phase in self.phases:
                if phase == self.quorum_phase:
                    await self.wait_for_quorum(ctx)
                ctx.set_phase(phase)
                phase_start = time.perf_counter()
                await self.run_phase(ctx, site, rnd, phase)
                if phase == "train":  # a node's slow_train drill (node/faults.py) waits here
                    await ctx.after_training(time.perf_counter() - phase_start)
                timers[f"{phase}_s"] = time.perf_counter() - phase_start
                if phase == "train" and self.personal.ditto:  # the personal model's steps
                    rnd.log.update(await ctx.run_blocking(self.personal.after_fit, site))
            self.note_merged(r, rnd.merged)
            dp = getattr(site, "dp", None)
            if dp is not None:  # training.dp: ε spent so far (Opacus's RDP accountant)
                rnd.log["dp_epsilon"] = dp.epsilon
                rnd.log["dp_delta"] = dp.delta  # what dp_epsilon is at (export reads it)
                rnd.log["dp_steps"] = float(dp.steps)
                rnd.log["dp_noise_multiplier"] = dp.noise_multiplier
                rnd.log["dp_sample_rate"] = dp.sample_rate

            metrics: dict[str, Any] = {}
            if self.evaluates(r):
                ctx.set_phase("evaluate")
                metrics = await self.evaluate_round(ctx, site)
                metrics.update(self.best.observe(r, metrics, site.state_dict))
                if self.personal.ditto:  # the personal model's figures, its best round
                    metrics.update(await ctx.run_blocking(self.personal.observe, r, site))
                made_after = (self.personal.choice or {}).get("round")
                if r == self.params.rounds and made_after != r:  # (again, if rounds grew)
                    ctx.set_phase("personalize")  # the personal model, and which to report
                    phase_start = time.perf_counter()
                    metrics.update(await ctx.run_blocking(self.personal.choose, site, self.best, r))
                    # once per run, not a round's cost: logged apart, out of round_s
                    timers["personalize_s"] = time.perf_counter() - phase_start
                self.show_training(ctx, site)
            # A hook's own timers (FedSGDP2P splits its steps) win over the phase's.
            values = {**metrics, **timers, **rnd.log}
            round_s = time.perf_counter() - round_start - timers.get("personalize_s", 0.0)
            ctx.log_metrics(r, **values, round_s=round_s)
            ctx.checkpoint(
                {
                    **self.checkpoint_state(r, site),
                    "best": self.best.checkpoint(),
                    "personal": self.personal.checkpoint(),
                    "select_by": select_by(site),  # what the two bests' scores are of
                }
            )
            await self.after_round(ctx, site, r)
            # A round whose peers are all gone may not await anything (a probe
            # with interval_s 0): give the event loop its turn, or /healthz,
            # heartbeats and SIGTERM starve behind it.
            await asyncio.sleep(0)

    async def run_phase(self, ctx: RoundContext, site: Any, rnd: Round, phase: str) -> None:
        """The phase's hook, with what personalization needs around it (off the
        event loop: state copies): Ditto's w, the model the round's training
        starts from; FedBN's BatchNorm entries, the site's own again after a merge."""
        personal = self.personal
        if phase == "train" and personal.ditto:
            await ctx.run_blocking(personal.start_round, site)
        kept = None
        if phase == "aggregate" and personal.local_norm:
            kept = await ctx.run_blocking(personal.keep_norm, site)
        await getattr(self, PHASE_HOOKS[phase])(ctx, site, rnd)
        if kept is not None:
            await ctx.run_blocking(personal.restore_norm, site, kept)

    @property
    def quorum_phase(self) -> str:
        """The phase a quorum is awaited before: the exchange, or the first
        phase of a protocol that exchanges inside it (FedSGDP2P's train)."""
        return "exchange" if "exchange" in self.phases else self.phases[0]

    def check_quorum(self, ctx: RoundContext) -> None:
        """A quorum the roster cannot reach is a configuration mistake."""
        needed = self.params.min_peers
        others = len([n for n in ctx.roster() if n != ctx.me])
        if needed and needed > others:
            raise ConfigError(
                "site.yaml",
                "protocol.min_peers",
                f"{needed} peers can never be alive: the roster lists {others} other site(s)",
                f"set min_peers to at most {others}, or leave it out",
            )

    async def wait_for_quorum(self, ctx: RoundContext) -> None:
        """With protocol.min_peers, wait until that many peers are alive (a failed
        or departed peer does not count); /status shows waiting_for_quorum."""
        needed = self.params.min_peers
        if not needed:
            return
        alive = len(ctx.peers())
        if alive >= needed:
            return
        ctx.set_phase("waiting_for_quorum")
        log.warning(
            "%s round %d: %d of the %d peers a quorum needs are alive: waiting",
            ctx.me,
            ctx.round,
            alive,
            needed,
        )
        started = last_log = time.monotonic()
        while alive < needed:
            await asyncio.sleep(QUORUM_POLL_S)
            alive = len(ctx.peers())
            if time.monotonic() - last_log >= QUORUM_LOG_EVERY_S:
                last_log = time.monotonic()
                log.warning(
                    "%s round %d: still waiting for a quorum (%d of %d peers alive, %.0f s)",
                    ctx.me,
                    ctx.round,
                    alive,
                    needed,
                    last_log - started,
                )
        log.info(
            "%s round %d: quorum reached (%d peers alive) after %.1f s",
            ctx.me,
            ctx.round,
            alive,
            time.monotonic() - started,
        )

    def personalization(self, ctx: RoundContext, site: Any) -> Personalization:
        """The site's personal model (training.personalization); FedBN's
        local_norm needs a protocol that merges models in its aggregate phase."""
        # built before any training (and before a checkpoint is loaded): the site's
        # weights now start its local candidate, unless they are a federation's
        # pre-trained encoder (a chained protocol's fine-tuning stage)
        personal = Personalization(
            ctx.config.training, site, own_start=ctx.config.model.pretrained_from is None
        )
        if personal.section.local_norm and "aggregate" not in self.phases:
            raise ConfigError(
                "site.yaml",
                "training.personalization.local_norm",
                f"{self.name} merges no models (it has no aggregate phase), so there are no "
                "BatchNorm entries to keep local",
                "leave local_norm out for this protocol",
            )
        return personal

    def evaluates(self, round_no: int) -> bool:
        return round_no % self.params.eval_every == 0 or round_no == self.params.rounds

    def schedule_lr(self, ctx: RoundContext, site: Any, round_no: int) -> float | None:
        """Set the round's learning rate (training.lr_schedule over this
        protocol's rounds) on a site that trains with one; returns it."""
        if not hasattr(site, "set_lr_factor"):
            return None
        site.set_lr_factor(lr_factor(ctx.config.training, round_no, self.params.rounds))
        return float(site.lr)

    def show_training(self, ctx: RoundContext, site: Any, *, announce: bool = False) -> None:
        """/status's `training` block: the class weighting the site trains with,
        the learning-rate schedule and the best model so far. `announce` also
        logs the class-weighting choice (once, at start)."""
        training = ctx.config.training
        weighting = getattr(site, "class_weighting", None)
        if announce and weighting is not None:
            log.info(
                "%s: class-weighted loss %s (class_weighted: %s, imbalance %.2f, threshold %.2f, "
                "train class counts %s)",
                ctx.me,
                "ON" if weighting["applied"] else "off",
                weighting["mode"],
                weighting["imbalance"],
                weighting["threshold"],
                weighting["class_counts"],
            )
        ctx.set_training(
            {
                "class_weighting": weighting,
                "lr": float(site.lr) if hasattr(site, "lr") else None,
                "lr_schedule": training.lr_schedule,
                "best": self.best.summary(),
                "dp": site.dp.summary() if getattr(site, "dp", None) is not None else None,
                "recipe": site.recipe.summary() if getattr(site, "recipe", None) else None,
                "personalization": self.personal.summary()
                if getattr(self, "personal", None) is not None
                else None,
            }
        )

    # ------------------------------------------------------------------ hooks

    async def setup(self, ctx: RoundContext) -> Any:
        """Build the site and start serving; returns the site the rounds train."""
        raise NotImplementedError

    async def before_rounds(self, ctx: RoundContext, site: Any) -> None:
        """After resume, before the first round to run (FedER: its buffer)."""

    async def fit(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        """Phase "train": local training."""

    async def exchange(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        """Phase "exchange": what travels between this node and its peers."""

    async def aggregate(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        """Phase "aggregate": merge what arrived into this node's model; note
        what was merged in `rnd.merged`."""

    async def evaluate_round(self, ctx: RoundContext, site: Any) -> dict[str, Any]:
        """The round's logged metrics (test, and val_* where the site has a val
        split); also refreshes the gossip the configured heuristic reads
        (per-class F1 on val, or model statistics; nothing under random)."""
        metrics = await ctx.run_blocking(evaluate_site, site)
        stats: list[float] = []  # computed only where the heuristic reads it
        if selection.MODEL_STATS_KEY in self.gossip_read(ctx):
            stats = await ctx.run_blocking(site.model_stats_vector)
        self.update_gossip(ctx, metrics.pop("per_class_f1"), stats)
        return metrics

    async def after_round(self, ctx: RoundContext, site: Any, round_no: int) -> None:
        """After the round's checkpoint (probe: its pause between rounds)."""

    async def finish(self, ctx: RoundContext, site: Any) -> None:
        """After the last round (Fed-MAE: export the encoder)."""

    # ------------------------------------------------------------------ checkpoint and resume

    def checkpoint_state(self, round_no: int, site: Any) -> dict[str, Any]:
        """Everything `resume` needs to carry on after `round`."""
        return {
            "protocol": self.name,
            "round": round_no,
            "model": site.state_dict(),
            "optimizer": site.optimizer_state(),
            "selection_history": self.selection_history,
            "merged": self.merged,
            "gossip": self.gossip,
            "dp_steps": site.dp.steps if getattr(site, "dp", None) is not None else None,
            "dp_history": site.dp.history() if getattr(site, "dp", None) is not None else None,
        }

    def resume(self, ctx: RoundContext, site: Any) -> int:
        """Load the last checkpoint (if it is this protocol's) and return the first
        round to run."""
        dp = getattr(site, "dp", None)
        if dp is not None:  # training.dp: every private step is on disk before it is used
            dp.keep_ledger(ctx.durable_file(LEDGER))
        saved = ctx.restore()
        finished = (  # nothing left to train: a restart that only serves the last model
            bool(saved)
            and saved.get("protocol") == self.name
            and int(saved["round"]) >= self.params.rounds
        )
        if dp is None and not (finished and saved.get("dp_history") is not None):
            # a ledger here: what this run trains is not private, and it says so first
            # (not a restart after the last round of a private run: it trains nothing)
            mark_unprivate(
                ctx.durable_file(LEDGER),
                private_checkpoint=bool(saved)
                and (saved.get("dp_history") is not None or saved.get("dp_steps") is not None),
            )
        if not saved or saved.get("protocol") != self.name:
            if dp is not None:  # a ledger of a run killed before its first checkpoint
                dp.replan(dp.total_steps)
            return 1
        history = saved.get("dp_history")
        if history is None and saved.get("dp_steps") is not None:  # a checkpoint before the ledger
            history = (
                [[dp.noise_multiplier, dp.sample_rate, int(saved["dp_steps"])]] if dp else None
            )
        if dp is not None and history is None:
            raise TrainingError(
                "dp_resume_unprivate",
                f"training.dp is set but the checkpoint of round {saved.get('round')} was "
                "trained without it: its model carries no privacy guarantee — start from a "
                "fresh state directory to train privately",
            )
        if (  # its ledger deleted, or copied here without it: later steps and a mark are lost
            dp is not None
            and saved.get("dp_history")  # (one of before the ledger records only dp_steps)
            and dp.ledger is not None
            and not dp.ledger.exists()
        ):
            raise TrainingError(
                "dp_ledger_missing",
                f"training.dp: the checkpoint of round {saved.get('round')} records private "
                f"steps but the privacy ledger {dp.ledger} is missing: what was spent (or "
                "trained in the clear) after that checkpoint is unknown — restore the file or "
                "start from a fresh state directory",
            )
        site.load_state_dict(saved["model"])
        if saved.get("optimizer") is not None:
            site.load_optimizer_state(saved["optimizer"])
        self.selection_history = [list(x) for x in saved.get("selection_history", [])]
        self.merged = [list(x) for x in saved.get("merged", [])]
        read = self.gossip_read(ctx)  # a checkpoint of another heuristic may hold more
        self.gossip = {
            key: value
            for key, value in dict(saved.get("gossip", {})).items()
            if key not in self.gossip_gated or key in read
        }
        if dp is not None:  # the privacy already spent stays spent, at its own price,
            dp.restore(history)  # and the rounds left have their noise planned on top of it
            dp.replan(max(0, self.params.rounds - int(saved["round"])) * site.steps_per_round())
        # a checkpoint of before training.select_by chose by macro-F1
        chosen_by, by = saved.get("select_by", "macro_f1"), select_by(site)
        if chosen_by == by or finished:
            self.best = BestModel.restore(saved.get("best"), federated=True)
            self.personal.restore(saved.get("personal"))
        else:  # scores of another figure cannot be compared with this run's
            log.warning(
                "%s: the checkpoint's best models were chosen by validation %s and this run "
                "chooses by %s (training.select_by): they are chosen afresh from the next "
                "evaluated round",
                ctx.me,
                chosen_by,
                by,
            )
            self.best = BestModel(federated=True)
            self.personal.restore(saved.get("personal"), keep_best=False)
        for key, value in self.gossip.items():
            ctx.publish(key, value)
        self.load_extra(saved)
        ctx.round = int(saved["round"])
        log.info("%s: resumed after round %d", ctx.me, saved["round"])
        return int(saved["round"]) + 1

    def load_extra(self, saved: dict[str, Any]) -> None:
        """The protocol's own part of a checkpoint (what checkpoint_state added)."""

    # ------------------------------------------------------------------ ledger and gossip

    def note_merged(self, round_no: int, merged: list[tuple[str, int]]) -> None:
        """The ledger of what round `round` merged (peer, the peer's round), kept
        in the checkpoint for audit."""
        entry = [round_no, [[peer, peer_round] for peer, peer_round in merged]]
        self.merged = (self.merged + [entry])[-HISTORY_KEEP:]

    def remember_neighbours(self, used: list[str]) -> None:
        """Whom this node just exchanged with: the n-latest heuristic's history."""
        self.selection_history = (self.selection_history + [list(used)])[-HISTORY_KEEP:]

    def publish(self, ctx: RoundContext, key: str, value: Any) -> None:
        """Gossip `value` under `key` (and keep it for the checkpoint)."""
        self.gossip[key] = value
        ctx.publish(key, value)

    def gossip_read(self, ctx: RoundContext) -> frozenset[str]:
        """The keys of `gossip_gated` that some node reads under this site's
        `selection` (and protocol): only those are published. The sites of a
        federation share these sections; a peer whose heuristic reads a key
        this site does not publish ranks it as a peer without a vector.

        Per-class F1 shows which classes a site's validation split lacks (an
        absent class scores 0.0 every round) and, over rounds, narrows down
        per-class counts: it went to every roster member under every
        heuristic, `random` included, which never reads it (a review, 2026-12)."""
        section = ctx.config.selection
        read: set[str] = set()
        if section.name == "f1" or (section.name == "cosine" and section.vector == "f1"):
            read.add(selection.F1_KEY)
        if section.name == "cosine" and section.vector == "model_stats":
            read.add(selection.MODEL_STATS_KEY)
        if section.name == "n_latest":
            read.add(selection.RECENT_KEY)
        return frozenset(read)

    # The gossip keys published only where `gossip_read` says they are read.
    gossip_gated: ClassVar[frozenset[str]] = frozenset(
        {selection.F1_KEY, selection.MODEL_STATS_KEY, selection.RECENT_KEY}
    )

    def update_gossip(
        self, ctx: RoundContext, per_class_f1: list[float] | None, stats: list[float]
    ) -> None:
        """What the F1 and cosine heuristics read (per-class F1 on val, model
        statistics), each published only where the configured heuristic reads it.
        Both only after a round that merged a peer's model: after one that merged
        none (its peers silent, a secure sum that failed) the model is this site's
        own, and reviews read its statistics, then its per-class F1, in the gossip
        of a node under secure aggregation; the last merged model's stay published
        (the heuristics rank by them, and randomly before a node has its own)."""
        read = self.gossip_read(ctx)
        merged_any = self.merged_last_round()
        if per_class_f1 is not None and selection.F1_KEY in read and merged_any:
            self.publish(ctx, selection.F1_KEY, [float(x) for x in per_class_f1])
        if selection.MODEL_STATS_KEY in read and merged_any:
            self.publish(ctx, selection.MODEL_STATS_KEY, [float(x) for x in stats])

    def merged_last_round(self) -> bool:
        """Whether the last round merged a peer's model: a figure of the model
        after one that merged none is of the site's own model, and is not gossiped."""
        return bool(self.merged and self.merged[-1][1])

    def update_recent(self, ctx: RoundContext) -> None:
        """H1: the n most recent neighbours, gossiped for the others' overlap test
        (only under n_latest, the one heuristic that reads them)."""
        if selection.RECENT_KEY not in self.gossip_read(ctx):
            return
        recent = selection.recent_neighbours(self.selection_history, ctx.config.selection.n)
        self.publish(ctx, selection.RECENT_KEY, recent)
