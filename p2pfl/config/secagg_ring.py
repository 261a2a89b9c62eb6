"""Secure aggregation's ring, as configuration sees it: the 32-bit fixed-point
ring masked values live in, the narrow rings of `protocol.compression`, the
fewest and most contributors of a sum, and whether a clip norm could overflow
a sum (protocols/masking.py does the arithmetic). Here, in the foundation, so
that the params validators (p2pfl/config/protocols.py), `check` (which knows
the roster) and the protocols share one bound."""

from __future__ import annotations

import math

from pydantic import BaseModel

SECAGG_RING_BITS = 32  # masked entries are uint32 with wraparound, int32 on the wire
SECAGG_FIXED_POINT_BITS = 20  # a masked value is round(w/W * x * 2^20)
SECAGG_MIN_SUM = 2  # the fewest contributors of a secure sum
SECAGG_MAX_CONTRIBUTORS = 64  # the most a session names (protocols/secagg_messages.py)
# An asynchronous secure sum weighs the stalest model it admits at most this many
# times less than a fresh one of the same size ((staleness_bound + 1)^a; 3.3 at
# the defaults): the requester picks t, so it picks whose model the sum leans to
SECAGG_MAX_STALENESS_RATIO = 4.0
SECAGG_RING_MAX = 2 ** (SECAGG_RING_BITS - 1) - 1  # the largest |sum| an int32 decodes
# protocol.compression with secure_aggregation: fp16 and int8 mask quantized
# values in a 16- and an 8-bit ring (the size of the plain format on the wire),
# decoded against the requester's own model (protocols/masking.py); topk cannot
# be summed (every contributor keeps other positions)
SECAGG_RINGS = {"none": 32, "fp16": 16, "int8": 8}


def secagg_ring_bits(compression: str) -> int | None:
    """The ring a secure sum masks in for `compression`, None where it cannot."""
    return SECAGG_RINGS.get(compression)


# In a narrow sum, an entry of fewer values than this (a bias, a norm layer's
# weights and statistics) is masked in the 32-bit fixed-point ring as without
# compression: a few kilobytes at most, exact, and nothing to wrap for the
# entries whose values differ most between sites (a site's own running
# statistics can lie far outside anybody's estimate)
SECAGG_WIDE_ENTRY = 1024


def secagg_entry_ring(bits: int, numel: int) -> int:
    """The ring one entry of `numel` values is masked in, in a `bits`-bit sum."""
    return SECAGG_RING_BITS if numel < SECAGG_WIDE_ENTRY else bits


def narrow_entries(ring: int, sizes: dict[str, int]) -> list[str]:
    """The entries (name -> number of values) a `ring`-bit sum quantizes in
    the narrow ring: every one of 1,024 values or more; none in 32 bits."""
    if ring == SECAGG_RING_BITS:
        return []
    return [k for k, n in sizes.items() if secagg_entry_ring(ring, n) != SECAGG_RING_BITS]


def secagg_calibration_ring(bits: int) -> int:
    """The ring of a narrow federation's calibration sums (a requester's first,
    and its next after one was dropped at the ring's edge): 16 bits, which an
    int8 federation's contributors accept besides their own 8."""
    return bits if bits >= 16 else 16


def secagg_entry_limit(contributors: int) -> int:
    """The largest |fixed-point value| one of `contributors` may mask: n of them
    sum to at most 2^31 - 1 in magnitude, so the int32 sum never wraps."""
    return SECAGG_RING_MAX // max(1, contributors)


def secagg_ring_overflow(contributors: int, clip_norm: float | None) -> tuple[str, str] | None:
    """(problem, fix) when a secure sum of `contributors` models clipped to
    `clip_norm` could overflow the 32-bit ring, with the bound written out;
    None if it cannot. Weights are w/W <= 1 (the session's weight unit W), so
    every masked entry is at most the clip norm C in magnitude, ceil(C * 2^bits)
    in fixed point. Without a clip norm each contributor refuses its own
    out-of-range entries instead (`out_of_range`): nothing overflows either."""
    if clip_norm is None:
        return None
    n = min(max(contributors, 1), SECAGG_MAX_CONTRIBUTORS)
    bits = SECAGG_FIXED_POINT_BITS
    largest = math.ceil(clip_norm * 2.0**bits)
    if n * largest <= SECAGG_RING_MAX:
        return None
    return (
        f"secagg_clip_norm {clip_norm!r} could overflow the 32-bit ring of secure aggregation: "
        f"n={n} contributors x clip {clip_norm!r} x 2^{bits} = {n * largest} >= 2^31",
        f"set secagg_clip_norm <= {secagg_entry_limit(n) / 2.0**bits!r}, the largest for "
        f"{n} contributors",
    )


def secagg_ring_problem(protocol: BaseModel, contributors: int) -> tuple[str, str, str] | None:
    """(field, problem, fix) when `protocol` (or its chained fine-tuning) runs
    secure aggregation with a clip norm that could overflow a sum of
    `contributors` (`check` and `run`: the roster's other sites)."""
    finetune = getattr(protocol, "finetune", None)
    for field, params in (("protocol", protocol), ("protocol.finetune", finetune)):
        if params is None or not getattr(params, "secure_aggregation", False):
            continue
        found = secagg_ring_overflow(contributors, getattr(params, "secagg_clip_norm", None))
        if found is not None:
            return (f"{field}.secagg_clip_norm", *found)
    return None
