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

Steps 2 and 4 are the exchange (protocols/exchange.py): `PlainExchange`
serves and pulls models, checks each reply and caps each claim; with
`protocol.secure_aggregation: true`, `SecureExchange`
(protocols/secure_exchange.py) serves only masked contributions to a
requester's secure sum and obtains the sample-count-weighted sum of the k
neighbours chosen (those that stayed to the end, at least two), averaged with
the node's own model; only the sum's mean can be checked, and the aggregation
is the weighted mean. With `protocol.asynchronous: true`, `AsyncExchange`
(protocols/async_exchange.py) never waits: each chosen neighbour answers at
once with its freshest model (one without a model yet is skipped), weighted by
its sample count x FedAsync's staleness function (t - tau + 1)^-a (Xie et al.
2019), and one more than `staleness_bound` rounds behind is not merged.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, ClassVar

from p2pfl.config import FedAvgP2PParams
from protocols import selection
from protocols.aggregate import aggregate as aggregate_models
from protocols.base import RoundContext
from protocols.checks import warn_if_trim_cuts_nothing
from protocols.exchange import MODEL_KIND, Collected, Exchange, ServedModels
from protocols.rounds import Round, RoundLoop
from protocols.secure_exchange import SECAGG_KIND, exchange_for
from protocols.site import build_site

log = logging.getLogger(__name__)


class FedAvgP2P(RoundLoop[FedAvgP2PParams]):
    kinds = (MODEL_KIND, SECAGG_KIND)

    def __init__(self, params: FedAvgP2PParams) -> None:
        super().__init__(params)
        self.store = ServedModels(keep=params.max_staleness + 2)  # for slower peers
        self.exchanger: Exchange = self.make_exchange()

    @property
    def secure(self) -> bool:
        """Models travel only inside secure sums (`protocol.secure_aggregation`)."""
        return self.params.secure_aggregation

    # Weights a contributor masks into a sum of another purpose, by purpose
    # (FedPerl's anonymized peer weighs every model alike).
    purpose_weights: ClassVar[dict[str, float]] = {}

    def make_exchange(self) -> Exchange:
        """Plain models, or secure sums only (`protocol.secure_aggregation`)."""
        return exchange_for(self.params, self.store, self.purpose_weights)

    # ------------------------------------------------------------------ the round

    async def setup(self, ctx: RoundContext) -> Any:
        site = await ctx.run_blocking(build_site, ctx.config)
        self.start_exchange(ctx)
        return site

    def resume(self, ctx: RoundContext, site: Any) -> int:
        """RoundLoop's resume; the exchange then sees the checkpoint's ledger of
        merged models (an asynchronous one merges each model once)."""
        start = super().resume(ctx, site)
        self.exchanger.resumed(self.merged)
        return start

    def start_exchange(self, ctx: RoundContext) -> None:
        """Before the first round: serve this node's models (or secure sums of
        them), and warn about a trimmed mean that trims nothing."""
        self.exchanger.start(ctx)
        p = self.params
        k_max = selection.neighbour_count(p.fraction, len(ctx.roster()) - 1)
        warn_if_trim_cuts_nothing(ctx, p.aggregation, p.trim_ratio, k_max, "models")

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
        fit = await ctx.run_blocking(site.train_epochs)
        rnd.log["train_loss"] = fit["loss"]
        self.offer(ctx, site, rnd)

    def offer(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        rnd.own = site.state_dict()
        self.exchanger.offer(ctx, rnd.number, rnd.own, self.sample_weight(site))

    async def exchange(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        # 3-4. Choose k neighbours among the alive peers (H0-H3) and pull their
        # models (or, with secure aggregation, obtain their secure sum).
        assert rnd.own is not None
        got = await self.collect(ctx, site, rnd, self.neighbours_wanted(ctx, rnd.number))
        rnd.received = got.terms
        rnd.log.update(got.log)
        rnd.log["weights_capped"] = len(got.capped)

    async def collect(self, ctx: RoundContext, site: Any, rnd: Round, k: int) -> Collected:
        """The exchange's terms from the k neighbours the heuristic ranks first
        (plain models: one that fails is replaced by the next in the ranking)."""
        assert rnd.own is not None
        ranking = self.rank_neighbours(ctx, rnd.number, k)
        own_weight = float(self.sample_weight(site))
        return await self.exchanger.collect(ctx, rnd.number, rnd.own, own_weight, ranking, k)

    def neighbours_wanted(self, ctx: RoundContext, round_no: int) -> int:
        """k of round `round_no`: the share `protocol.fraction` of the other nodes
        (Fed-BEiT's tokenizer stage asks for all of them in its last round)."""
        return selection.neighbour_count(self.params.fraction, len(ctx.roster()) - 1)

    def rank_neighbours(
        self,
        ctx: RoundContext,
        round_no: int,
        k: int,
        exclude: set[str] | frozenset[str] = frozenset(),
    ) -> list[str]:
        """The heuristic's ranking of the alive peers (H0-H3), best first."""
        peers = [x for x in ctx.peers() if x.name not in exclude]
        return self.heuristic.select(
            ctx.me,
            peers,
            k,
            round_no=round_no,
            seed=ctx.config.federation.seed,
            my_meta=self.gossip,
            history=self.selection_history,
            reject=ctx.reject,
        )

    async def aggregate(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        # 5. w <- weighted mean of own + neighbours' models (DFU Alg. 3 line 6).
        terms = rnd.received
        if terms:
            options = self.aggregation_options()
            averaged = await ctx.run_blocking(
                functools.partial(aggregate_models, options.pop("method"), own=0, **options),
                [rnd.own] + [t.state for t in terms],
                [float(self.sample_weight(site))] + [t.weight for t in terms],
            )
            await ctx.run_blocking(site.load_state_dict, averaged)
        rnd.merged = [pair for t in terms for pair in t.merged]
        used = [peer for peer, _ in rnd.merged]
        self.remember_neighbours(used)
        self.update_recent(ctx)
        self.record_neighbours(ctx, used)

    def record_neighbours(self, ctx: RoundContext, used: list[str]) -> None:
        ctx.record_choice(used)
