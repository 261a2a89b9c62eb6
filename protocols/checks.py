"""What a peer's tensors and claims must pass before they are merged into this node's model.

Every protocol merges what its peers send through two doors, both here:

- `admit` (with `incompatibility` as its core): a peer's state dict or
  gradient must have our keys, shapes and dtypes, finite values, (with
  `max_norm_ratio`) an L2 norm at most that many times ours, and no negative
  BatchNorm running variance. A refusal is
  logged and counted through `RoundContext.reject` as `<what>_<reason>`
  (`model_huge_norm`, `grad_shape_mismatch`, `relay_non_finite`, ...).
- `cap_weights` / `cap_claims`: a sample count (or batch size) a peer claims
  weighs its update in a weighted mean, and nothing checks it. Each claim is
  capped at the site's roster `max_samples` (where the federation admin wrote
  one) and at `max_weight_ratio` times the median claim of the merge; a cap that
  bites is logged and counted as `weight_capped`, and the peer still takes part
  with the capped weight.

The caps bound how far an inflated claim pulls a weighted mean; they do not
stop it. Against a peer that lies within the caps, the roster's `max_samples`
(set to what each site really holds) or a robust `protocol.aggregation`
(median, trimmed_mean: they ignore the claims) is the defence.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from protocols.base import RoundContext

log = logging.getLogger(__name__)

WEIGHT_CAPPED = "weight_capped"


def incompatibility(
    state: Any,
    reference: dict[str, Tensor],
    *,
    max_norm_ratio: float | None = None,
    variances: bool = False,
) -> str | None:
    """Why a peer's state dict cannot be merged with ours (None if it can):
    other keys, shapes or dtypes, non-finite values, (with `max_norm_ratio`)
    an L2 norm more than that many times ours, or (with `variances`: one
    peer's own state, as `admit` checks it) a negative BatchNorm running
    variance. A secure sum's mean is not checked for that one: its
    variances were raised to zero when it was decoded (`clamp_variances`)."""
    if not isinstance(state, dict):
        return "not_a_state_dict"
    # The count first: a set of a peer's 5 million keys cost 0.6 s on the event loop.
    if len(state) != len(reference) or any(key not in state for key in reference):
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
        theirs, ours = float_norm(state), float_norm(reference)
        if theirs > max_norm_ratio * max(ours, 1e-12):
            return "huge_norm"
    if variances and any(_negative_variance(key, value) for key, value in state.items()):
        return "negative_variance"
    return None


def _negative_variance(key: str, value: Tensor) -> bool:
    """A BatchNorm running variance (`*running_var`) below zero: no training
    makes one, and a mean with it can be negative, which the node's every
    evaluation turns into NaN (sqrt of var + eps). Finite and small, it
    passed every other check until a review (rv_comp, 2026-11-28). Means,
    medians, trimmed means and norm_clip of non-negative values stay
    non-negative, so refusing it here keeps the merged variance valid."""
    return (
        key.endswith("running_var")
        and value.is_floating_point()
        and value.numel() > 0
        and bool((value < 0).any())
    )


def negative_variances(state: Mapping[str, Tensor]) -> int:
    """How many BatchNorm running variance values of `state` are below zero."""
    return sum(
        int((value < 0).sum()) for key, value in state.items() if _negative_variance(key, value)
    )


def clamp_variances(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state` with each negative BatchNorm running variance raised to zero (a
    new dict; the other entries as they are): for a lossy reconstruction,
    whose rounding takes an honest variance near zero below it (int8: to
    -0.008 for a variance of 1e-3 sent as a difference from 0.5), which is
    then not the peer's fault; and for a secure sum's mean, which cannot say
    which contributor sent one (`secagg_requester.secure_sum`)."""
    return {
        key: value.clamp(min=0) if _negative_variance(key, value) else value
        for key, value in state.items()
    }


def float_norm(state: dict[str, Tensor]) -> float:
    """L2 norm over every floating-point entry, in float64."""
    total = 0.0
    for value in state.values():
        if value.is_floating_point():
            total += float(value.detach().double().square().sum())
    return total**0.5


def admit(
    ctx: RoundContext,
    peer: str,
    what: str,
    state: Any,
    reference: dict[str, Tensor],
    *,
    max_norm_ratio: float | None = None,
    where: str = "",
) -> bool:
    """Whether `state` from `peer` may be merged with `reference` (ours); if not,
    the refusal is logged and counted as `<what>_<reason>` (`what`: model, grad,
    relay). `where` says which round or step, for the log."""
    problem = incompatibility(state, reference, max_norm_ratio=max_norm_ratio, variances=True)
    if problem is None:
        return True
    log.warning("%s%s: %s from %s refused (%s)", ctx.me, where, what, peer, problem)
    ctx.reject(peer, f"{what}_{problem}")
    return False


# ---------------------------------------------------------------------- claimed weights


def lower_median(values: list[float]) -> float:
    """The median of an odd count, the lower of the two middle values of an even
    one: with two claims (ours and one neighbour's) it is the smaller, so a
    neighbour cannot raise the median it is capped against by inflating its own."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def cap_weights(
    claims: Mapping[str, float],
    *,
    ratio: float | None,
    caps: Mapping[str, float] | None = None,
    own: str | None = None,
) -> tuple[dict[str, float], list[str]]:
    """(capped claims, the names whose claim was capped, sorted).

    Each claim is cut to its site's cap in `caps` (the roster's max_samples),
    then to `ratio` times the lower median of the claims so capped (`own`'s
    included); `ratio` None: no median cap. `own` is this node's count of its
    own data, not a claim: it is never capped. Pure: no logging, no counting."""
    caps = caps or {}
    capped: dict[str, float] = {}
    bitten: set[str] = set()
    for name, claim in claims.items():
        value = float(claim)
        cap = caps.get(name)
        if name != own and cap is not None and value > cap:
            value = float(cap)
            bitten.add(name)
        capped[name] = value
    if ratio is not None and capped:
        bound = ratio * lower_median(list(capped.values()))
        for name, value in capped.items():
            if name != own and value > bound:
                capped[name] = bound
                bitten.add(name)
    return capped, sorted(bitten)


def cap_claims(
    ctx: RoundContext,
    claims: Mapping[str, float],
    *,
    ratio: float | None,
    where: str = "",
    quiet: bool = False,
) -> tuple[dict[str, float], list[str]]:
    """`cap_weights` for this node's merge (`claims` holds ours under `ctx.me`),
    with the roster's caps (`ctx.sample_caps()`); each capped claim is counted
    as `weight_capped` against its peer and (unless `quiet`: the caller logs a
    summary) logged as a warning."""
    capped, bitten = cap_weights(claims, ratio=ratio, caps=ctx.sample_caps(), own=ctx.me)
    for peer in bitten:
        if not quiet:
            log.warning(
                "%s%s: %s claims %g samples, capped at %g",
                ctx.me,
                where,
                peer,
                float(claims[peer]),
                capped[peer],
            )
        ctx.reject(peer, WEIGHT_CAPPED)
    return capped, bitten


def own_weight_cap(ctx: RoundContext) -> float | None:
    """The most samples this site may claim (its roster card's max_samples), or
    None: what a contributor clips its own weight to where nobody else can see
    and cap it (secure aggregation)."""
    cap = ctx.sample_caps().get(ctx.me)
    return None if cap is None else float(cap)


def cap_sum(
    ctx: RoundContext,
    contributors: list[str],
    total_weight: float,
    own: float,
    *,
    ratio: float | None,
    where: str = "",
) -> float:
    """A secure sum's total weight, at most the sum over its contributors of
    what each may claim: its roster cap and `ratio` x our own count. Nobody can
    tell which contributor overclaimed: a cap that bites is counted against
    each (`sum_weight_capped`)."""
    caps = ctx.sample_caps()
    bound = 0.0
    for peer in contributors:
        limits = [float(caps[peer])] if peer in caps else []
        if ratio is not None:
            limits.append(ratio * own)
        bound += min(limits) if limits else float("inf")
    if total_weight <= bound:
        return total_weight
    log.warning(
        "%s%s: the secure sum of %s claims %g samples, capped at %g",
        ctx.me,
        where,
        contributors,
        total_weight,
        bound,
    )
    for peer in contributors:
        ctx.reject(peer, "sum_weight_capped")
    return bound


def warn_if_trim_cuts_nothing(
    ctx: RoundContext, aggregation: str, trim_ratio: float, k_max: int, what: str
) -> None:
    """A trimmed mean over k_max neighbours plus this node that trims nothing
    is a plain mean: say so once, at start."""
    if aggregation == "trimmed_mean" and int(trim_ratio * (k_max + 1)) == 0:
        log.warning(
            "%s: trimmed_mean with trim_ratio %.2f over %d %s cuts nothing (a plain "
            "mean): raise protocol.trim_ratio or protocol.fraction, or use median",
            ctx.me,
            trim_ratio,
            k_max + 1,
            what,
        )
