"""FedAVGP2P: federated averaging without a server (DFU paper, Sec. 4, Alg. 3/5/7/9).

Every node, every round r:
  1. fit: E local epochs on its own data          (Alg. 3 line 3)
  2. offer: its round-r model to whoever asks       (serve "model")
  3. choose k = max(1, round(c * (N - 1))) neighbours with the configured
     heuristic (H0 random, H1 n-latest, H2 F1, H3 cosine)
  4. pull their round-r models, concurrently        (Alg. 3 line 6)
  5. aggregate: sample-count-weighted mean of its own model and theirs
     (or a robust variant, `protocol.aggregation`); a neighbour's count is a
     claim, capped by the roster's max_samples and `max_weight_ratio`
     (protocols/checks.py)
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

With `protocol.secure_aggregation: true`, steps 2 and 4 go through secure
aggregation (protocols/secagg.py): the node serves no plain model, only masked
contributions to a requester's sum, and obtains the sample-count-weighted sum
of the k neighbours it chose (those that stayed to the end, at least two), which
it averages with its own model. It never sees a single neighbour's model, so
only the mean's norm can be checked, and the aggregation is the weighted mean.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from p2pfl.config import FedAvgP2PParams
from protocols import selection
from protocols.aggregate import aggregate as aggregate_models
from protocols.base import Kept, NotReady, PeerUnavailable, RoundContext
from protocols.checks import admit, cap_claims, incompatibility, own_weight_cap
from protocols.exchange import pull_concurrently
from protocols.rounds import Round, RoundLoop
from protocols.secagg import SECAGG_KIND, Contributor, SecAggError, SecureSum, secure_sum
from protocols.site import build_site

log = logging.getLogger(__name__)

MODEL_KIND = "model"


@dataclass
class PeerModel:
    peer: str
    round: int
    state: dict[str, Tensor]
    num_train: int


class FedAvgP2P(RoundLoop):
    kinds = (MODEL_KIND, SECAGG_KIND)

    def __init__(self, params: FedAvgP2PParams) -> None:
        super().__init__(params)
        self.served: OrderedDict[int, dict[str, Any]] = OrderedDict()  # round -> model payload
        self.contributor: Contributor | None = None  # answers secure-aggregation requests

    @property
    def secure(self) -> bool:
        """Models travel only inside secure sums (`protocol.secure_aggregation`)."""
        return bool(getattr(self.params, "secure_aggregation", False))

    # ------------------------------------------------------------------ serving

    def keep_for_peers(self, round: int, state: dict[str, Tensor], num_train: int) -> None:
        self.served[round] = Kept(round=round, state=state, num_train=num_train)
        while len(self.served) > self.params.max_staleness + 2:
            self.served.popitem(last=False)

    def model_of(self, wanted: int, newest: int) -> dict[str, Any] | None:
        """This node's served model of round `wanted`, or the nearest newer one
        up to `newest`; None if it only has newer ones; NotReady while it has
        not finished `wanted`."""
        for r in sorted(self.served):
            if wanted <= r <= newest:
                return self.served[r]
        latest = max(self.served, default=-1)
        if latest < wanted:
            raise NotReady(f"round {wanted} not trained yet (latest {latest})")
        return None

    async def serve_model(self, requester: str, query: dict[str, Any]) -> dict[str, Any]:
        """'Your model of round r': the one of round r, or the nearest newer one
        up to `max_round`; NotReady while this node has not finished r."""
        wanted = int(query.get("round", 0))
        found = self.model_of(wanted, int(query.get("max_round", wanted)))
        if found is None:
            latest = max(self.served, default=-1)
            return {"round": latest, "state": None, "num_train": 0, "reason": "too_new"}
        return found

    def serve_secure_sums(self, ctx: RoundContext) -> None:
        """Answer secure-aggregation requests with this node's served models."""
        if self.contributor is not None:
            return
        p = self.params
        self.contributor = Contributor(
            ctx,
            self.contribution,
            min_threshold=getattr(p, "secagg_threshold", None),
            clip_norm=getattr(p, "secagg_clip_norm", None),
            max_weight=own_weight_cap(ctx),  # nobody can cap it after masking: I do
            keep_rounds=p.max_staleness + 2,
            ledger_path=ledger_file(ctx),
        )
        ctx.serve(SECAGG_KIND, self.contributor.serve)

    def contribution(
        self, wanted: int, newest: int, purpose: str
    ) -> tuple[int, dict[str, Tensor], float] | None:
        """(round, model, weight) this node masks into a requester's sum: its
        model of round `wanted` (or the nearest newer one up to `newest`),
        weighted by its sample count; NotReady while `wanted` is not trained."""
        found = self.model_of(wanted, newest)
        if found is None:
            return None
        return found["round"], found["state"], float(found["num_train"])

    # ------------------------------------------------------------------ exchange

    async def fetch_model(
        self, ctx: RoundContext, round: int, reference: dict[str, Tensor], peer: str, timeout: float
    ) -> PeerModel | None:
        query = {"round": round, "max_round": round + self.params.max_staleness}
        where = f" round {round}"
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
        if not isinstance(num_train, int) or isinstance(num_train, bool) or num_train < 1:
            log.warning("%s round %d: %s sent num_train %r", ctx.me, round, peer, num_train)
            ctx.reject(peer, "model_bad_num_train")
            return None
        max_ratio = self.params.max_norm_ratio
        if not admit(ctx, peer, "model", state, reference, max_norm_ratio=max_ratio, where=where):
            return None
        return PeerModel(peer, got_round, state, num_train)

    async def pull_neighbours(
        self, ctx: RoundContext, round: int, own: dict[str, Tensor], k: int
    ) -> list[PeerModel]:
        """Choose k neighbours among the alive peers with the heuristic (H0-H3) and
        pull their round-r models concurrently (DFU Alg. 3 line 6); a neighbour
        that fails is replaced by the next in the ranking. Sorted by peer name."""
        ranking = self.rank_neighbours(ctx, round, k)
        fetch = functools.partial(self.fetch_model, ctx, round, own)
        received = await pull_concurrently(ranking, k, self.params.round_timeout_s, fetch)
        return sorted(received, key=lambda m: m.peer)

    def rank_neighbours(
        self,
        ctx: RoundContext,
        round: int,
        k: int,
        exclude: set[str] | frozenset[str] = frozenset(),
    ) -> list[str]:
        """The heuristic's ranking of the alive peers (H0-H3), best first."""
        peers = [x for x in ctx.peers() if x.name not in exclude]
        return self.heuristic.select(
            ctx.me,
            peers,
            k,
            round=round,
            seed=ctx.config.federation.seed,
            my_meta=self.gossip,
            history=self.selection_history,
        )

    async def secure_neighbours(
        self, ctx: RoundContext, round: int, own: dict[str, Tensor], k: int
    ) -> list[SecureSum]:
        """The secure sum of the k neighbours the heuristic ranks first (no
        replacement: a neighbour that fails is a dropout of the sum)."""
        chosen = self.rank_neighbours(ctx, round, k)[:k]
        result = await self.secure_sum_of(ctx, round, own, chosen, purpose="model")
        return [] if result is None else [result]

    async def secure_sum_of(
        self,
        ctx: RoundContext,
        round: int,
        own: dict[str, Tensor],
        chosen: list[str],
        *,
        purpose: str,
    ) -> SecureSum | None:
        """The weighted mean of `chosen`'s round-r models through secure
        aggregation, or None (fewer than two stayed; logged)."""
        if len(chosen) < 2:
            log.info(
                "%s round %d: %d neighbour(s) for a secure sum, which needs two: own model only",
                ctx.me,
                round,
                len(chosen),
            )
            return None
        while True:
            try:
                return await secure_sum(
                    ctx,
                    chosen,
                    round=round,
                    max_round=round + self.params.max_staleness,
                    reference=own,
                    timeout=self.params.round_timeout_s,
                    purpose=purpose,
                    threshold=getattr(self.params, "secagg_threshold", None),
                )
            except SecAggError as exc:
                log.warning("%s round %d: no secure sum of %s (%s)", ctx.me, round, chosen, exc)
                retry = exc.unmasked
                if retry is None or len(retry) < 2 or len(retry) >= len(chosen):
                    return None
                # Nobody masked yet: a fresh session without those that did not answer.
                chosen = retry

    # ------------------------------------------------------------------ the round

    async def setup(self, ctx: RoundContext) -> Any:
        site = await ctx.train(build_site, ctx.config)
        self.start_exchange(ctx)
        return site

    def start_exchange(self, ctx: RoundContext) -> None:
        """Before the first round: this node's models offered to its peers, and a
        warning about a trimmed mean that trims nothing."""
        if self.secure:
            self.serve_secure_sums(ctx)
        else:
            ctx.serve(MODEL_KIND, self.serve_model)
        options = self.aggregation_options()
        k_max = selection.neighbour_count(self.params.fraction, len(ctx.roster()) - 1)
        if options["method"] == "trimmed_mean" and int(options["trim_ratio"] * (k_max + 1)) == 0:
            log.warning(
                "%s: trimmed_mean with trim_ratio %.2f over %d models cuts nothing (a plain "
                "mean): raise protocol.trim_ratio or protocol.fraction, or use median",
                ctx.me,
                options["trim_ratio"],
                k_max + 1,
            )

    def aggregation_options(self) -> dict[str, Any]:
        """How models are averaged: `protocol.aggregation` and its settings."""
        p = self.params
        return {"method": p.aggregation, "trim_ratio": p.trim_ratio, "clip_norm": p.clip_norm}

    def sample_weight(self, site: Any) -> int:
        """This node's weight in the neighbours' means: its training images."""
        return site.num_train

    async def fit(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        # 1. E local epochs (DFU Alg. 3 line 3: w = fit(w, data, epochs)), then
        # 2. offer the round's model to the neighbours.
        fit = await ctx.train(site.train_epochs)
        rnd.log["train_loss"] = fit["loss"]
        self.offer(ctx, site, rnd)

    def offer(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        rnd.own = site.state_dict()
        self.keep_for_peers(rnd.number, rnd.own, self.sample_weight(site))
        ctx.offered(MODEL_KIND)
        if self.contributor is not None:
            ctx.offered(SECAGG_KIND)

    async def exchange(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        # 3-4. Choose k neighbours among the alive peers (H0-H3) and pull their
        # models (or, with secure aggregation, obtain their secure sum).
        assert rnd.own is not None
        k = self.neighbours_wanted(ctx, rnd.number)
        if self.secure:
            sums = await self.secure_neighbours(ctx, rnd.number, rnd.own, k)
            rnd.received = sums
            rounds = [r for x in sums for r in x.rounds.values()]
            rnd.log.update(
                neighbours=len(rounds),
                neighbours_wanted=k,
                stale_models=sum(1 for r in rounds if r != rnd.number),
                secagg_dropped=sum(len(x.dropped) for x in sums),
            )
            return
        rnd.received = await self.pull_neighbours(ctx, rnd.number, rnd.own, k)
        rnd.log.update(
            neighbours=len(rnd.received),
            neighbours_wanted=k,
            stale_models=sum(1 for m in rnd.received if m.round != rnd.number),
        )

    def neighbours_wanted(self, ctx: RoundContext, round: int) -> int:
        """k of round `round`: the share `protocol.fraction` of the other nodes
        (Fed-BEiT's tokenizer stage asks for all of them in its last round)."""
        return selection.neighbour_count(self.params.fraction, len(ctx.roster()) - 1)

    def merge_terms(
        self, ctx: RoundContext, site: Any, rnd: Round
    ) -> tuple[list[dict[str, Tensor]], list[float], list[tuple[str, int]], int]:
        """(states, weights, merged (peer, its round), weights capped) of what
        arrived: each neighbour's model, weighted by its claimed sample count
        capped (roster, `max_weight_ratio` x the median claim), or each secure
        sum as one term, weighted by its total weight capped at the sum of its
        contributors' caps (checked as a whole: the only check possible)."""
        assert rnd.own is not None
        own = float(self.sample_weight(site))
        models = [m for m in rnd.received if isinstance(m, PeerModel)]
        claims = {ctx.me: own}
        claims.update((m.peer, float(m.num_train)) for m in models)
        weights, capped = cap_claims(
            ctx, claims, ratio=self.params.max_weight_ratio, where=f" round {rnd.number}"
        )
        states: list[dict[str, Tensor]] = []
        terms: list[float] = []
        merged: list[tuple[str, int]] = []
        bitten = len(capped)
        for item in rnd.received:
            if isinstance(item, PeerModel):
                states.append(item.state)
                terms.append(weights[item.peer])
                merged.append((item.peer, item.round))
                continue
            problem = incompatibility(item.mean, rnd.own, max_norm_ratio=self.params.max_norm_ratio)
            if problem is not None:
                log.warning(
                    "%s round %d: secure sum of %s rejected (%s)",
                    ctx.me,
                    rnd.number,
                    item.contributors,
                    problem,
                )
                for peer in item.contributors:
                    ctx.reject(peer, f"sum_{problem}")
                continue
            states.append(item.mean)
            terms.append(self.cap_sum(ctx, rnd.number, item, own))
            bitten += terms[-1] < item.total_weight
            merged += [(peer, item.rounds[peer]) for peer in item.contributors]
        return states, terms, merged, bitten

    def cap_sum(self, ctx: RoundContext, round: int, item: SecureSum, own: float) -> float:
        """A secure sum's total weight, at most the sum over its contributors of
        what each may claim: its roster cap and `max_weight_ratio` x our own
        count. Nobody can tell which contributor overclaimed: each is counted."""
        ratio = self.params.max_weight_ratio
        caps = ctx.sample_caps()
        bound = 0.0
        for peer in item.contributors:
            limits = [float(caps[peer])] if peer in caps else []
            if ratio is not None:
                limits.append(ratio * own)
            bound += min(limits) if limits else float("inf")
        if item.total_weight <= bound:
            return item.total_weight
        log.warning(
            "%s round %d: the secure sum of %s claims %g samples, capped at %g",
            ctx.me,
            round,
            item.contributors,
            item.total_weight,
            bound,
        )
        for peer in item.contributors:
            ctx.reject(peer, "sum_weight_capped")
        return bound

    async def aggregate(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        # 5. w <- weighted mean of own + neighbours' models (DFU Alg. 3 line 6).
        states, weights, merged, capped = self.merge_terms(ctx, site, rnd)
        if states:
            options = self.aggregation_options()
            averaged = await ctx.train(
                functools.partial(aggregate_models, options.pop("method"), own=0, **options),
                [rnd.own] + states,
                [float(self.sample_weight(site))] + weights,
            )
            await ctx.train(site.load_state_dict, averaged)
        rnd.log["weights_capped"] = capped
        rnd.merged = merged
        used = [peer for peer, _ in merged]
        self.remember_neighbours(used)
        self.update_recent(ctx)
        self.record_neighbours(ctx, used)

    def record_neighbours(self, ctx: RoundContext, used: list[str]) -> None:
        ctx.record_choice(used)


def ledger_file(ctx: RoundContext) -> Path | None:
    """Where this node's secure-aggregation ledger outlives a restart (its
    state directory), or None for a simulated node with no storage."""
    stage = getattr(ctx, "prefix", "")  # a stage's own contributor, its own file
    try:
        return ctx.durable_file(f"secagg_ledger.{stage}json")
    except (RuntimeError, OSError):
        return None
