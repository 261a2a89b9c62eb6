"""The asynchronous exchange: slow sites don't hold the others back.

`AsyncExchange` is `PlainExchange` (protocols/exchange.py) with two changes,
picked by `protocol.asynchronous: true` (`secure_exchange.exchange_for`):

- A pull never waits. It asks each chosen neighbour for the FRESHEST model it
  has (`freshest` in the query: its latest finished round), and the neighbour
  answers at once, with no NotReady hold. A neighbour that has no model yet
  (its round 1 is not trained) answers "none" and is skipped: the next one in
  the heuristic's ranking is asked instead, as for a neighbour that fails.
- Each model is weighted by its claimed sample count (capped as before,
  `checks.cap_claims`) times FedAsync's polynomial staleness function

      s(t - tau) = (t - tau + 1) ** -a        a = protocol.staleness_exponent

  (Xie, Koyejo and Gupta 2019, "Asynchronous Federated Optimization",
  arXiv:1903.03934, Sec. 5.2, the polynomial s_a), where t is this node's
  round and tau the round of the neighbour's model: staleness is counted in
  rounds. s(0) = 1; with a = 0.5, s(2) = 3 ** -0.5. A model of a later round
  than t (a faster neighbour) counts as fresh, s = 1: a peer that claims a
  future round gains no more than an honest, up-to-date one. This node's own
  model always has s = 1.
- The staleness bound: a model more than `protocol.staleness_bound` rounds
  behind t is not merged (logged and counted in the round's
  `models_too_stale`; the next neighbour in the ranking is asked instead).
  It is a separate setting from `max_staleness` (how much NEWER a synchronous
  pull may be, and how many models a node keeps: max_staleness + 2), because
  a slow site lags by several rounds and keeping that many models for it
  would cost memory for nothing: asynchronously only the latest is served.
- Each model is merged once. A pull names the round of the peer's model this
  node merged last (`after`); a peer with nothing newer answers "not_newer"
  without a model, and the next neighbour in the ranking is asked (counted in
  the round's `models_already_merged`, nobody's fault). A reply of a round
  already merged (a peer that ignored `after`) is skipped the same way. A
  peer whose latest round is below the one merged last (a restart from an
  older checkpoint, or a claimed future round that was not true) costs one
  skipped pull: the node then asks from that round on. As FedAsync and
  FedBuff use each client's update once: merging a slow site's unchanged
  model every round it is chosen would pull the merge back toward it again
  and again, though its information is already in the model. The memory
  (one round per roster member) is rebuilt after a restart from the
  checkpoint's ledger of merged models (`resumed`); a merge older
  than the ledger keeps (its last 1,000 rounds) may happen once more.

Per-node round counters are the clock, so a site k times slower falls further
behind as the run goes on; with the default bound 10 and a = 0.5 its model of
10 rounds ago still weighs 11 ** -0.5 = 0.30 of a fresh one.

The weighting applies to `aggregation: mean` (and the mean under
`norm_clip`); the median and the trimmed mean ignore weights, so there a
stale model is only bounded by `staleness_bound`.

The round's log (metrics.jsonl, /status) gains `asynchronous` (1),
`staleness_mean`, `staleness_max` (rounds, of the merged models; 0 when none
was merged), `staleness_factor_min` and `staleness_factor_mean` (s of the
merged models), `neighbour_weight_share` (the neighbours' share of the merge's
total weight after staleness, own model included in the total),
`models_too_stale`, `models_already_merged` and `neighbours_without_model`.
Which of a peer's models were merged is the skeleton's ledger (`Round.merged`,
checkpointed).

`AsyncCompressedExchange` is the same over `CompressedExchange`
(protocols/compressed_exchange.py): with `protocol.compression`, the freshest
model travels as the difference from the pair's copy.

With secure aggregation the freshest models are summed by
`protocols.secure_exchange.AsyncSecureExchange` instead (each contributor
weighs its own model by staleness, and masks it at most once per requester).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from protocols.base import RoundContext
from protocols.compressed_exchange import CompressedExchange
from protocols.exchange import ROUND_LIMIT, Collected, PlainExchange, ServedModels, Term

log = logging.getLogger(__name__)

FRESHEST = "freshest"  # the query key of an asynchronous pull
AFTER = "after"  # ... and the round of the peer's model merged last, if any


def _round_or_none(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < ROUND_LIMIT:
        return value
    return None


def staleness_factor(staleness: int, exponent: float) -> float:
    """FedAsync's polynomial staleness function s_a(t - tau) = (t - tau + 1)^-a
    (Xie, Koyejo, Gupta 2019, Sec. 5.2); a model from the future (negative
    staleness) counts as fresh: s = 1."""
    return float((max(0, staleness) + 1) ** -exponent)


@dataclass
class _Skipped:
    """What one collect left out without counting it against anybody."""

    no_model: int = 0
    too_stale: int = 0
    already_merged: int = 0


class AsyncExchange(PlainExchange):
    """Plain models, pulled without waiting: each neighbour's freshest, weighted
    by staleness (see the module docstring). Written as overrides that call
    the next class's (serve, query, fetch's `decoded`/`adopt`, collect), so it
    composes with another PlainExchange subclass: `AsyncCompressedExchange`."""

    def __init__(
        self,
        store: ServedModels,
        *,
        staleness_bound: int,
        staleness_exponent: float,
        **options: Any,
    ) -> None:
        super().__init__(store, **options)
        self.staleness_bound = staleness_bound
        self.staleness_exponent = staleness_exponent
        self.skipped = _Skipped()  # of the collect under way (one per round)
        # peer -> the round of its model this node merged last (roster members only)
        self.last_merged: dict[str, int] = {}

    # ------------------------------------------------------------------ serving

    async def serve(self, requester: str, query: dict[str, Any]) -> dict[str, Any]:
        """'Your freshest model': the latest kept, at once; 'none yet' (state
        None) before the first round is trained. A synchronous pull (no
        `freshest`) is answered as PlainExchange answers it."""
        if query.get(FRESHEST) is not True:
            return await super().serve(requester, query)
        latest = self.store.latest
        if latest < 0:
            return {"round": -1, "state": None, "num_train": 0, "reason": "no_model"}
        after = _round_or_none(query.get(AFTER))
        if after is not None and latest <= after:
            return {"round": latest, "state": None, "num_train": 0, "reason": "not_newer"}
        # The latest round, asked as a synchronous pull of exactly that round:
        # never NotReady, and what the next class does to a served model applies.
        return await super().serve(requester, {**query, "round": latest, "max_round": latest})

    # ------------------------------------------------------------------ pulling

    def resumed(self, merged: list[Any]) -> None:
        """The round of each peer's model merged last, from a checkpoint's
        ledger (`[[round, [[peer, peer_round], ...]], ...]`, in order: the
        latest entry counts, as `rolled_back` may have lowered it). What is
        not of that shape is skipped: the file is this node's own, but a
        damaged one must not stop a resume."""
        for entry in merged:
            pairs = entry[1] if isinstance(entry, list) and len(entry) == 2 else []
            for pair in pairs if isinstance(pairs, list) else []:
                if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str):
                    peer_round = _round_or_none(pair[1])
                    if peer_round is not None:
                        self.last_merged[pair[0]] = peer_round  # the ledger is in order

    def rolled_back(self, peer: str, latest: int | None) -> None:
        """`peer`'s latest round is below the one merged last: it restarted from
        an older checkpoint, or the round it claimed was not true. Its next
        model is merged again (after one skipped pull), never starved."""
        if latest is not None and latest < self.last_merged.get(peer, -1):
            log.info("%s is back at round %d (merged last: %d)", peer, latest, self.last_merged[peer])  # fmt: skip
            self.last_merged[peer] = latest

    def query(self, peer: str, round_no: int, newest: int) -> dict[str, Any]:
        query = {**super().query(peer, round_no, newest), FRESHEST: True}
        if peer in self.last_merged:
            query[AFTER] = self.last_merged[peer]
        return query

    def no_model(self, ctx: RoundContext, round_no: int, peer: str, reply: dict[str, Any]) -> None:
        """`peer` has no model yet, or none newer than the one merged last:
        skipped (the next in the ranking is asked)."""
        if reply.get("reason") == "not_newer":
            log.info("%s round %d: %s has no model newer than the one merged", ctx.me, round_no, peer)  # fmt: skip
            self.skipped.already_merged += 1
            self.rolled_back(peer, _round_or_none(reply.get("round")))
            return
        log.info("%s round %d: %s has no model yet", ctx.me, round_no, peer)
        self.skipped.no_model += 1

    def round_fits(
        self, ctx: RoundContext, round_no: int, peer: str, reply: dict[str, Any]
    ) -> bool:
        """Any round >= 0 within the staleness bound (a later one counts as
        fresh); a negative round is refused and counted, a too stale one skipped."""
        theirs = reply["round"]  # in [0, ROUND_LIMIT): ModelReply's schema
        if theirs <= self.last_merged.get(peer, -1):
            # A peer that ignored `after`: its transfer is spent, its model not merged twice.
            log.info("%s round %d: %s's model of round %d was merged already", ctx.me, round_no, peer, theirs)  # fmt: skip
            self.skipped.already_merged += 1
            self.rolled_back(peer, theirs)
            return False
        if round_no - theirs > self.staleness_bound:
            log.info(
                "%s round %d: %s's freshest model is of round %d, past the staleness bound %d",
                ctx.me,
                round_no,
                peer,
                theirs,
                self.staleness_bound,
            )
            self.skipped.too_stale += 1
            return False
        return True

    async def collect(
        self,
        ctx: RoundContext,
        key: Any,
        own: dict[str, Tensor],
        own_weight: float,
        ranking: list[str],
        k: int,
    ) -> Collected:
        """The first k of `ranking` that have a model within the bound (sorted
        by name), each weighted by its capped sample count x s(staleness)."""
        round_no = int(key)
        self.skipped = _Skipped()
        got = await super().collect(ctx, key, own, own_weight, ranking, k)
        staleness: list[int] = []
        factors: list[float] = []
        terms: list[Term] = []
        for term in got.terms:
            (peer, peer_round), *_ = term.merged
            self.last_merged[peer] = max(peer_round, self.last_merged.get(peer, -1))
            staleness.append(max(0, round_no - peer_round))
            factors.append(staleness_factor(staleness[-1], self.staleness_exponent))
            terms.append(Term(term.state, term.weight * factors[-1], term.merged))
        got.terms = terms
        neighbours_weight = sum(t.weight for t in terms)
        total = own_weight + neighbours_weight  # the merge weighs its own model uncapped
        got.log.update(
            {
                "stale_models": sum(1 for s in staleness if s > 0),
                "asynchronous": 1,
                "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
                "staleness_max": max(staleness, default=0),
                "staleness_factor_min": min(factors, default=1.0),
                "staleness_factor_mean": sum(factors) / len(factors) if factors else 1.0,
                "neighbour_weight_share": neighbours_weight / total if total > 0 else 0.0,
                "models_too_stale": self.skipped.too_stale,
                "models_already_merged": self.skipped.already_merged,
                "neighbours_without_model": self.skipped.no_model,
            }
        )
        return got


class AsyncCompressedExchange(AsyncExchange, CompressedExchange):
    """`asynchronous` with `compression`: the freshest model, served as
    CompressedExchange serves any model (the difference from the pair's copy),
    weighted by staleness."""
