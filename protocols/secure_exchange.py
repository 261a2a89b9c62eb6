"""The exchange through secure aggregation: no single model leaves a node.

`SecureExchange` implements protocols/exchange.py's interface over
protocols/secagg.py. It serves masked contributions (`Contributor`) of the
node's kept models instead of the models, and `collect` obtains the secure
sum of the k neighbours the heuristic ranks first (no replacement: a
neighbour that fails is a dropout of the sum; nobody is asked twice for one
model). The requester sees only the sum, so only its mean can be checked
(keys, shapes, dtypes, finite, norm) and only its total weight capped
(`checks.cap_sum`), and the merge is the weighted mean.

`AsyncSecureExchange` (protocol.asynchronous with secure_aggregation) never
waits for a round-r model: its sums are over the freshest model each
contributor holds that is not yet in one of this requester's sums (purpose
FRESHEST_PURPOSE), each weighted by its contributor with FedAsync's
(t - tau + 1)^-a against the requester's round t (`at_round`, bound into the
session). A contributor whose freshest model is already in one of its sums,
or who has none within the staleness bound, answers a benign refusal; the
requester then runs a fresh session with the next neighbours of its ranking
(nobody has masked yet). A sum needs two contributors, so a round may merge
nothing when fewer than two neighbours have something new.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from torch import Tensor

from p2pfl.config.secagg_ring import secagg_calibration_ring, secagg_ring_bits
from protocols.async_exchange import AsyncCompressedExchange, AsyncExchange, staleness_factor
from protocols.base import RoundContext
from protocols.checks import cap_sum, incompatibility, own_weight_cap
from protocols.compressed_exchange import CompressedExchange
from protocols.exchange import Collected, Exchange, PlainExchange, ServedModels, Term
from protocols.masking import RING_BITS
from protocols.secagg import (
    MIN_WEIGHT_SHARE,
    SECAGG_KIND,
    Contributor,
    SecAggError,
    SecureSum,
    secure_sum,
)
from protocols.secagg_messages import FRESHEST_PURPOSE
from protocols.secagg_requester import ring_steps, weight_scale_for

log = logging.getLogger(__name__)


class SecureExchange:
    """Secure sums of the neighbours' kept models (`kind` "secagg")."""

    kind = SECAGG_KIND

    def __init__(
        self,
        store: ServedModels,
        *,
        max_staleness: int,
        timeout: float,
        max_norm_ratio: float | None,
        max_weight_ratio: float | None,
        threshold: int | None = None,
        clip_norm: float | None = None,
        purpose_weights: dict[str, float] | None = None,
        ring: int = RING_BITS,
        min_contributors: int = 2,
    ) -> None:
        self.store = store
        # protocol.secagg_min_contributors: the fewest contributors of a sum I ask
        # for, and answer (my Contributor refuses a smaller one, `sum_too_small`)
        self.min_contributors = max(2, int(min_contributors))
        self.ring = ring  # protocol.compression's: 32 (none), 16 (fp16) or 8 (int8) bits
        # a narrow ring, per stream: how far my last kept sum's mean lay from my
        # own model, entry by entry, its total weight and its number of
        # contributors (my next steps)
        self.spreads: dict[str, tuple[dict[str, float], float, int]] = {}
        self.ring_edge_drops = 0
        self.max_staleness = max_staleness
        self.timeout = timeout
        self.max_norm_ratio = max_norm_ratio
        self.max_weight_ratio = max_weight_ratio
        self.threshold = threshold
        self.clip_norm = clip_norm
        # A sum for another purpose may weigh every model alike (FedPerl's
        # anonymized peer: Eq. 4's plain mean).
        self.purpose_weights = dict(purpose_weights or {})
        self.contributor: Contributor | None = None
        self.staleness_exponent: float | None = None  # AsyncSecureExchange's
        self.staleness_bound: int | None = None

    # ------------------------------------------------------------------ contributor side

    def resumed(self, merged: list[Any]) -> None:
        """Nothing to rebuild: a contributor's ledger of masked models is its own."""

    def start(self, ctx: RoundContext) -> None:
        """Answer secure-aggregation requests with this node's kept models."""
        if self.contributor is not None:
            return
        self.contributor = Contributor(
            ctx,
            self.contribution,
            min_threshold=self.threshold,
            min_sum=self.min_contributors,
            clip_norm=self.clip_norm,
            max_weight=own_weight_cap(ctx),  # nobody can cap it after masking: I do
            keep_rounds=self.store.keep,
            ledger_path=ledger_file(ctx),
            staleness_exponent=self.staleness_exponent,
            staleness_bound=self.staleness_bound,
            ring=self.ring,
            kept=lambda: {r: kept["state"] for r, kept in self.store.models.items()},
        )
        ctx.serve(self.kind, self.contributor.serve)

    def offer(self, ctx: RoundContext, key: Any, state: dict[str, Tensor], weight: float) -> None:
        self.store.put(int(key), state, int(weight))
        if self.contributor is not None:
            ctx.offered(self.kind)

    def contribution(
        self, wanted: int, newest: int, purpose: str
    ) -> tuple[int, dict[str, Tensor], float] | None:
        """(round, model, weight) this node masks into a requester's sum: its
        model of round `wanted` (or the nearest newer one up to `newest`),
        weighted by its sample count; NotReady while `wanted` is not trained.
        An asynchronous sum (FRESHEST_PURPOSE): the latest model at once, or
        None when it is not in [wanted, newest] (a requester cannot pick an
        older one)."""
        if purpose == FRESHEST_PURPOSE:
            latest = self.store.latest
            found = self.store.models.get(latest) if wanted <= latest <= newest else None
        else:
            found = self.store.model_of(wanted, newest)
        if found is None:
            return None
        weight = self.purpose_weights.get(purpose, float(found["num_train"]))
        return found["round"], found["state"], weight

    # ------------------------------------------------------------------ requester side

    async def sum_of(
        self,
        ctx: RoundContext,
        round_no: int,
        own: dict[str, Tensor],
        chosen: list[str],
        *,
        purpose: str = "model",
        stream: str | None = None,
    ) -> SecureSum | None:
        """The weighted mean of `chosen`'s round-r models through secure
        aggregation, or None (fewer than two stayed, or a narrow ring's sum
        dropped at its edge; logged). `stream` (default: the purpose) names
        whose last sum sets a narrow ring's steps: FedPerl's community and its
        other neighbours are two groups of one purpose."""
        stream = stream or purpose
        if len(chosen) < self.min_contributors:
            log.info(
                "%s round %d: %d neighbour(s) for a secure sum, which needs %d "
                "(protocol.secagg_min_contributors): own model only",
                ctx.me,
                round_no,
                len(chosen),
                self.min_contributors,
            )
            return None
        while True:
            try:
                scale = self.weight_scale(ctx, chosen, purpose)
                ring, steps = await ctx.run_blocking(self.narrow, own, chosen, stream, scale)
                result = await secure_sum(
                    ctx,
                    chosen,
                    round_no=round_no,
                    max_round=round_no + self.max_staleness,
                    reference=own,
                    timeout=self.timeout,
                    purpose=purpose,
                    threshold=self.threshold,
                    weight_scale=scale,
                    ring=ring,
                    steps=steps,
                )
                kept = await self.decoded_well(ctx, round_no, stream, result, own, scale)
                return result if kept else None
            except SecAggError as exc:
                log.warning("%s round %d: no secure sum of %s (%s)", ctx.me, round_no, chosen, exc)
                retry = exc.unmasked
                if retry is None or len(retry) < self.min_contributors or len(retry) >= len(chosen):
                    return None
                # Nobody masked yet: a fresh session without those that did not answer.
                chosen = retry

    def sum_size(self, k: int) -> int:
        """How many of the ranking a sum asks for: the protocol's k neighbours,
        but never fewer than `min_contributors`, which the contributors answer."""
        return max(k, self.min_contributors)

    def weight_scale(self, ctx: RoundContext, chosen: list[str], purpose: str) -> float:
        """The sum's weight unit W (the ring holds w/W <= 1): a purpose's fixed
        weight, else the most a chosen contributor may claim."""
        if purpose in self.purpose_weights:
            return self.purpose_weights[purpose]
        own = self.store.models.get(self.store.latest)
        own_weight = None if own is None else float(own["num_train"])
        return weight_scale_for(ctx.sample_caps(), chosen, own_weight, self.max_weight_ratio)

    def narrow(
        self, own: dict[str, Tensor], chosen: list[str], stream: str, weight_scale: float
    ) -> tuple[int, dict[str, float] | None]:
        """The ring and quantization steps (`ring_steps`) of my next sum of
        `stream` (a purpose, or one of FedPerl's groups), in the unit W =
        `weight_scale`. In a narrow federation, a sum without a kept sum
        before it (the first, or the next after one was dropped at the ring's
        edge) is a calibration sum: 16 bits, steps from my own model's range;
        after it, the federation's ring, with steps from that sum's spread and
        its sum of w/W carried over to this W and this many contributors (the
        last sum's total weight / W x n now / n then, within [n x 2^-12, n]):
        W changes with the chosen contributors' roster caps."""
        if self.ring == RING_BITS:
            return RING_BITS, None
        last = self.spreads.get(stream)
        if last is None:
            wide = secagg_calibration_ring(self.ring)
            return wide, ring_steps(own, wide, len(chosen))
        spread, total, counted = last
        n = len(chosen)
        shares = total / weight_scale * n / max(counted, 1)
        shares = min(max(shares, n * MIN_WEIGHT_SHARE), float(n))
        return self.ring, ring_steps(own, self.ring, n, spread, shares)

    async def decoded_well(
        self,
        ctx: RoundContext,
        round_no: int,
        stream: str,
        result: SecureSum,
        own: dict[str, Tensor],
        weight_scale: float,
    ) -> bool:
        """A narrow ring's sum is kept unless a value decoded in the outer
        quarter of its ring around my estimate (`ring_edge`): it lay farther
        from my model than the steps reach, or a contributor sent a value far
        off, and some may have wrapped. Then it is dropped (logged, counted
        against each contributor, since nobody can tell which one it was) and
        my next sum calibrates again. A kept sum that passes the norm check
        sets my next steps: its spread (max |mean - own| per entry, less the
        largest its own rounding noise would give) and its sum of w/W."""
        if self.ring == RING_BITS:
            return True
        if result.ring_edge > 0:
            where = sorted(result.ring_edge_entries.items(), key=lambda kv: -kv[1])[:3]
            log.warning(
                "%s round %d: secure sum of %s dropped: %d value(s) decoded at the edge of the "
                "%d-bit ring (most in %s; farther from my model than the steps reach, or sent "
                "far off by a contributor; counted against each); the next sum calibrates again",
                ctx.me,
                round_no,
                result.contributors,
                result.ring_edge,
                result.ring,
                ", ".join(f"{k} ({n})" for k, n in where),
            )
            self.spreads.pop(stream, None)
            self.ring_edge_drops += 1
            for peer in result.contributors:
                ctx.reject(peer, "sum_ring_edge")
            return False
        calibration = stream not in self.spreads
        spread = await ctx.run_blocking(  # passes over the whole model: off the event loop
            self.spread_if_sound, result, own, weight_scale, calibration
        )
        if spread is not None:
            self.spreads[stream] = (spread, result.total_weight, len(result.contributors))
        return True

    def spread_if_sound(
        self, result: SecureSum, own: dict[str, Tensor], weight_scale: float, calibration: bool
    ) -> dict[str, float] | None:
        """The kept sum's spread (`spread_of`), or None if its mean fails the
        norm check (nobody merges it, so it sets no steps)."""
        if incompatibility(result.mean, own, max_norm_ratio=self.max_norm_ratio) is not None:
            return None
        return spread_of(result, own, result.total_weight / weight_scale, calibration)

    def refused(
        self, ctx: RoundContext, round_no: int, item: SecureSum, own: dict[str, Tensor]
    ) -> bool:
        """Whether a sum's mean cannot be merged with `own` (logged, and counted
        against each contributor: nobody can tell which one caused it)."""
        problem = incompatibility(item.mean, own, max_norm_ratio=self.max_norm_ratio)
        if problem is None:
            return False
        log.warning(
            "%s round %d: secure sum of %s rejected (%s)",
            ctx.me,
            round_no,
            item.contributors,
            problem,
        )
        for peer in item.contributors:
            ctx.reject(peer, f"sum_{problem}")
        return True

    def collected(
        self,
        ctx: RoundContext,
        round_no: int,
        sums: list[SecureSum],
        own: dict[str, Tensor],
        own_weight: float,
        k: int,
    ) -> Collected:
        """`sums` as merge terms: each checked as a whole, weighted by its total
        weight capped at what its contributors may claim together."""
        rounds = [r for x in sums for r in x.rounds.values()]
        out = Collected(
            log={
                "neighbours": len(rounds),
                "neighbours_wanted": k,
                "stale_models": sum(1 for r in rounds if r != round_no),
                "secagg_dropped": sum(len(x.dropped) for x in sums),
                "secagg_variances_raised": sum(x.variances_raised for x in sums),
                **(
                    {"secagg_ring_edge_drops": self.ring_edge_drops}
                    if self.ring != RING_BITS
                    else {}
                ),
            }
        )
        for item in sums:
            if self.refused(ctx, round_no, item, own):
                continue
            weight = cap_sum(
                ctx,
                item.contributors,
                item.total_weight,
                own_weight,
                ratio=self.max_weight_ratio,
                where=f" round {round_no}",
            )
            if weight < item.total_weight:
                out.capped.append(",".join(item.contributors))
            merged = [(peer, item.rounds[peer]) for peer in item.contributors]
            out.terms.append(Term(item.mean, weight, merged))
        return out

    async def collect(
        self,
        ctx: RoundContext,
        key: Any,
        own: dict[str, Tensor],
        own_weight: float,
        ranking: list[str],
        k: int,
    ) -> Collected:
        """The secure sum of the first k of `ranking` (at least
        `min_contributors` of them), as one term."""
        round_no = int(key)
        result = await self.sum_of(ctx, round_no, own, ranking[: self.sum_size(k)], purpose="model")
        sums = [] if result is None else [result]
        return self.collected(ctx, round_no, sums, own, own_weight, k)


class AsyncSecureExchange(SecureExchange):
    """`asynchronous` with `secure_aggregation`: secure sums of the freshest
    models (see the module docstring)."""

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

    async def collect(
        self,
        ctx: RoundContext,
        key: Any,
        own: dict[str, Tensor],
        own_weight: float,
        ranking: list[str],
        k: int,
    ) -> Collected:
        """One secure sum of the freshest models of k neighbours of `ranking`:
        those that refused before anybody masked (nothing new, nothing within
        the bound, gone) are replaced by the next in the ranking, in a fresh
        session, until two or more stay, the ranking runs out, or 2 x the
        round's timeout has passed (no new session after it; each session's
        requests get the time left)."""
        round_no = int(key)
        k = self.sum_size(k)
        chosen, queue = list(ranking[:k]), list(ranking[k:])
        sessions, skipped, result = 0, 0, None
        # no new session after 2 x timeout (a plain pull's bound), each session's
        # requests given the time left, so one silent neighbour does not end the
        # round; a session's five phases may each take up to that time
        deadline = time.monotonic() + 2 * self.timeout
        while len(chosen) >= self.min_contributors and (left_s := deadline - time.monotonic()) > 0:
            sessions += 1
            try:
                scale = self.weight_scale(ctx, chosen, FRESHEST_PURPOSE)
                ring, steps = await ctx.run_blocking(
                    self.narrow, own, chosen, FRESHEST_PURPOSE, scale
                )
                result = await secure_sum(
                    ctx,
                    chosen,
                    round_no=max(0, round_no - self.staleness_bound),
                    max_round=FRESHEST_MAX_ROUND,  # a neighbour ahead of me counts as fresh
                    reference=own,
                    timeout=min(self.timeout, left_s),
                    purpose=FRESHEST_PURPOSE,
                    threshold=self.threshold,
                    weight_scale=scale,
                    at_round=round_no,
                    ring=ring,
                    steps=steps,
                )
                if not await self.decoded_well(ctx, round_no, FRESHEST_PURPOSE, result, own, scale):
                    result = None
                break
            except SecAggError as exc:
                stayed = exc.unmasked
                if stayed is None:  # someone masked already: no second session this round
                    log.warning("%s round %d: no secure sum of %s (%s)", ctx.me, round_no, chosen, exc)  # fmt: skip
                    break
                left = [p for p in chosen if p not in stayed]
                skipped += len(left)
                if not left:  # everyone answered and still too few: a retry changes nothing
                    break
                refill, queue = queue[: len(left)], queue[len(left) :]
                log.info(
                    "%s round %d: %s had nothing for an asynchronous sum; asking %s instead",
                    ctx.me,
                    round_no,
                    left,
                    refill,
                )
                chosen = sorted(stayed) + refill
        got = self.collected(ctx, round_no, [] if result is None else [result], own, own_weight, k)
        staleness = [max(0, round_no - r) for r in (result.rounds.values() if result else [])]
        factors = [staleness_factor(s, self.staleness_exponent) for s in staleness]
        got.log.update(
            {
                "asynchronous": 1,
                "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
                "staleness_max": max(staleness, default=0),
                "staleness_factor_min": min(factors, default=1.0),
                "staleness_factor_mean": sum(factors) / len(factors) if factors else 1.0,
                "secagg_sessions": sessions,
                "neighbours_skipped": skipped,
            }
        )
        return got


def spread_of(
    result: SecureSum, own: dict[str, Tensor], shares: float, calibration: bool = False
) -> dict[str, float]:
    """Per entry the sum quantized: max |mean - own|. After a calibration
    sum, as measured: an upper bound within the calibration's rounding, and
    the calibration's steps do not depend on a spread, so nothing feeds back.
    After a narrow sum, less what its own rounding could add (each of n
    contributors' stochastic rounding is off by less than one step, so the
    mean's error has a standard deviation of at most sqrt(n) / 2 x step /
    sum(w/W), and its largest over m values is about sqrt(2 ln m) of those),
    but by three quarters of the measure at most: without the allowance, the
    spread of many contributors fed on its own noise and the steps grew sum
    after sum; with all of it, a spread under the noise read as none."""
    n = max(len(result.contributors), 1)
    out = {}
    for key in result.steps or {}:  # the narrow entries; the others are fixed point
        if key not in result.mean or key not in own or own[key].numel() == 0:
            continue
        farthest = float((result.mean[key].double() - own[key].double()).abs().max())
        if calibration:
            out[key] = farthest
            continue
        sigma = math.sqrt(n) / 2 * result.steps[key] / max(shares, 1e-12)  # type: ignore[index]
        allowance = sigma * math.sqrt(2 * math.log(max(own[key].numel(), 2)))
        out[key] = max(farthest - allowance, farthest / 4)
    return out


# The newest model round an asynchronous sum accepts: any (SessionRequest's bound).
FRESHEST_MAX_ROUND = 2**31


def ledger_file(ctx: RoundContext) -> Path | None:
    """Where this node's secure-aggregation ledger outlives a restart (its
    state directory), or None for a simulated node with no storage."""
    stage = getattr(ctx, "prefix", "")  # a stage's own contributor, its own file
    try:
        return ctx.durable_file(f"secagg_ledger.{stage}json")
    except (RuntimeError, OSError):
        return None


def exchange_for(
    params: Any, store: ServedModels, purpose_weights: dict[str, float] | None = None
) -> Exchange:
    """The exchange a FedAVGP2P-family protocol's params ask for: secure sums
    only with `secure_aggregation` (of the freshest models with
    `asynchronous`), else models, compressed with `compression`,
    pulled without waiting with `asynchronous`."""
    if params.secure_aggregation:
        if params.asynchronous:  # secure sums of the freshest models (AsyncSecureExchange)
            return AsyncSecureExchange(
                store,
                **_options(params),
                threshold=params.secagg_threshold,
                clip_norm=params.secagg_clip_norm,
                purpose_weights=purpose_weights,
                staleness_bound=params.staleness_bound,
                staleness_exponent=params.staleness_exponent,
                ring=ring_of_params(params),
                min_contributors=getattr(params, "secagg_min_contributors", 2),
            )
        return secure_exchange_for(params, store, purpose_weights)
    compression = getattr(params, "compression", "none")
    if params.asynchronous:  # the freshest models, weighted by staleness (async_exchange.py)
        staleness = {
            "staleness_bound": params.staleness_bound,
            "staleness_exponent": params.staleness_exponent,
        }
        if compression != "none":
            return AsyncCompressedExchange(
                store, compression=compression, **staleness, **_options(params)
            )
        return AsyncExchange(store, **staleness, **_options(params))
    if compression != "none":  # differences from per-pair copies (compressed_exchange.py)
        return CompressedExchange(store, compression=compression, **_options(params))
    return PlainExchange(store, **_options(params))


def secure_exchange_for(
    params: Any, store: ServedModels, purpose_weights: dict[str, float] | None = None
) -> SecureExchange:
    return SecureExchange(
        store,
        **_options(params),
        threshold=params.secagg_threshold,
        clip_norm=params.secagg_clip_norm,
        purpose_weights=purpose_weights,
        ring=ring_of_params(params),
        min_contributors=getattr(params, "secagg_min_contributors", 2),
    )


def ring_of_params(params: Any) -> int:
    """The ring of a secure sum under `params.compression`: none 32 bits, fp16
    16, int8 8. Top-k cannot be summed (the params refuse it with
    secure_aggregation); FedPerl's anonymized peer, a secure sum in every mode,
    then travels in the 32-bit ring."""
    return secagg_ring_bits(getattr(params, "compression", "none")) or RING_BITS


def _options(params: Any) -> dict[str, Any]:
    return {
        "max_staleness": params.max_staleness,
        "timeout": params.round_timeout_s,
        "max_norm_ratio": params.max_norm_ratio,
        "max_weight_ratio": params.max_weight_ratio,
    }
