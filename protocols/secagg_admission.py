"""What a contributor checks of a secure-aggregation request before it opens a
session (protocols/secagg.py runs the rounds and lists the rules): who is in
the sum, the terms it is asked on (rounds, purpose, weight unit, ring), the
model it would mask against those terms, and the weight that model is masked
with in the session's unit W. Functions of the request, the model and the
contributor's own settings only: what a contributor remembers (its ledger, the
sessions it has seen and holds open) stays with `Contributor`, which calls
these in Round 0 in the order their refusals are given."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from p2pfl.config.secagg_ring import narrow_entries, secagg_calibration_ring
from p2pfl.learning.state import averaged_keys
from protocols.async_exchange import staleness_factor
from protocols.masking import RING_BITS
from protocols.secagg_messages import FRESHEST_PURPOSE, MIN_WEIGHT_SHARE, SessionRequest
from protocols.secagg_primitives import SecAggError


def check_contributors(
    request: SessionRequest, requester: str, me: str, roster: Collection[str], min_sum: int
) -> set[str]:
    """The sum's contributors U: distinct roster members, me among them and the
    requester not, at least `min_sum` (protocol.secagg_min_contributors)."""
    group = set(request.contributors)
    if len(group) != len(request.contributors):
        raise SecAggError("bad_contributors", "a contributor is listed twice")
    if me not in group:
        raise SecAggError("not_a_contributor")
    if requester in group:
        raise SecAggError("requester_is_contributor")
    if not group <= set(roster):
        raise SecAggError("unknown_contributor")
    if len(group) < min_sum:
        # The requester picks a sum's size: in a sum of 2 one contributor
        # colluding with it sees the other's model (a review, 2026-11-27).
        raise SecAggError(
            "sum_too_small",
            f"{len(group)} contributors, I answer sums of {min_sum} or more",
        )
    return group


def check_terms(
    request: SessionRequest, *, asynchronous: bool, max_weight: float | None, ring: int
) -> None:
    """The terms of the request this contributor answers: its rounds, an
    asynchronous sum only where it runs asynchronously (`asynchronous`), a
    weight unit W its roster card (`max_weight`) is not rounded out of, and
    the federation's `ring` (or its calibration ring) with steps exactly when
    that ring is narrow."""
    if request.max_round < request.round:
        raise SecAggError("bad_request", "max_round < round")
    freshest = request.purpose == FRESHEST_PURPOSE
    if freshest != (request.at_round is not None):
        raise SecAggError("bad_request", "at_round is given with the freshest purpose only")
    if freshest and not asynchronous:
        raise SecAggError("not_asynchronous", "I answer no asynchronous sums")
    if max_weight is not None and MIN_WEIGHT_SHARE * request.weight_scale > max_weight:
        # My card keeps me under the floor W / 2^12 the card-less are raised to:
        # a W this large rounds my model out of the sum while theirs stays in,
        # and a sum of two is then the other one's model (found by a review).
        raise SecAggError(
            "weight_scale_too_large",
            f"W = {request.weight_scale:g} > 2^12 x my card's {max_weight:g} samples",
        )
    if request.ring not in (ring, secagg_calibration_ring(ring)):
        raise SecAggError(
            "ring_mismatch",
            f"this federation sums in a {ring}-bit ring (16 bits to calibrate), not {request.ring}",
        )
    if (request.steps is None) != (request.ring == RING_BITS):
        raise SecAggError("bad_steps", "steps come with a narrow ring, and only then")


def check_model(
    request: SessionRequest,
    model_round: int,
    state: dict[str, Any],
    staleness_bound: int | None,
) -> None:
    """The model the request would have masked, before any work on it (its
    digest, the clip): steps that name exactly its large entries (clipping
    keeps every size), and in an asynchronous sum a model within this
    contributor's own `staleness_bound` of the requester's round."""
    if request.steps is not None and set(request.steps) != set(
        narrow_entries(request.ring, {k: state[k].numel() for k in averaged_keys(state)})
    ):
        raise SecAggError("bad_steps", "the steps do not name my model's large entries")
    freshest = request.purpose == FRESHEST_PURPOSE
    if freshest and request.at_round - model_round > staleness_bound:  # type: ignore[operator]
        # My own bound, whatever window the requester asked: every weight I mask in
        # an asynchronous sum is at least (bound + 1)^-a of my sample count.
        raise SecAggError(
            "too_stale", f"my model of round {model_round} for round {request.at_round}"
        )


def session_weight(
    request: SessionRequest,
    model_round: int,
    weight: float,
    *,
    max_weight: float | None,
    staleness_exponent: float | None,
) -> float:
    """The weight w a model is masked with, as w/W in the session's unit W:
    capped at the roster card (`max_weight`), times FedAsync's staleness
    weight in an asynchronous sum, at most W, and at least W / 2^12 (never past
    the card). A model of no weight is refused (`no_weight`)."""
    if not float(weight) > 0:  # no training data: nothing to add to anybody's sum
        raise SecAggError("no_weight", "my model has no weight")
    if max_weight is not None:
        weight = min(weight, max_weight)
    if request.purpose == FRESHEST_PURPOSE:  # FedAsync's, against the requester's round
        assert request.at_round is not None and staleness_exponent is not None
        weight *= staleness_factor(request.at_round - model_round, staleness_exponent)
    weight = min(float(weight), request.weight_scale)  # w/W <= 1: the ring's bound
    # ...and w/W >= 2^-12: a tiny site counts a little more, never rounds away
    # (never past its roster card, which the requester's cap_sum holds it to)
    floor = MIN_WEIGHT_SHARE * request.weight_scale
    if max_weight is not None:
        floor = min(floor, max_weight)
    return max(weight, floor)
