"""The requester's side of secure aggregation (protocols/secagg.py has the
protocol, its rounds and why it is safe): `secure_sum` runs the four rounds
with a set of contributors and returns the weighted mean of those that stayed.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import secrets as random_source
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from pydantic import BaseModel, ValidationError
from torch import Tensor

from p2pfl.config.secagg_ring import narrow_entries, secagg_entry_ring
from p2pfl.learning.state import averaged_keys
from p2pfl.text import shown
from protocols.base import PeerUnavailable, RoundContext
from protocols.checks import clamp_variances, negative_variances
from protocols.masking import RING_BITS, WEIGHT_KEY, WIRE_DTYPE, WIRE_DTYPES
from protocols.secagg_messages import (
    MAX_WEIGHT_SCALE,
    MIN_SUM,
    MIN_WEIGHT_SHARE,
    SECAGG_KIND,
    Advertised,
    Revealed,
    SessionRequest,
    Shared,
    Vouched,
    parse,
    session_context,
    threshold_for,
)
from protocols.secagg_primitives import (
    SecAggError,
    combine_shares,
    seed_commitment,
    share_commitment,
    unmask_sum,
)

log = logging.getLogger(__name__)

# With neither a roster cap nor max_weight_ratio, the weight unit W is this many
# times the requester's own count (max_weight_ratio's default), or, with no own
# count either (a direct caller), UNBOUNDED_WEIGHT_SCALE.
DEFAULT_WEIGHT_RATIO = 16.0
UNBOUNDED_WEIGHT_SCALE = 1024.0
# A narrow ring's steps (`ring_steps`), for its entries of 1,024 values or more
# (smaller ones are 32-bit fixed point in every sum). The requester decodes
# each entry's sum S = sum_i (w_i/W) x_i / step as the value nearest to
# sum(w/W) * own / step (`masking.from_narrow`): exact while they lie less
# than 2^(bits-1) - 1 steps apart, i.e. while
# |sum_i (w_i/W)(x_i - own)| < (2^(bits-1) - 1) * step.
# - A calibration sum (16 bits; no kept sum before it): every |x_i - own| taken
#   as at most CALIBRATION_MARGIN x max(max|own entry|, the median over the
#   model's entries of max|own entry|, RANGE_FLOOR), every w/W as 1 (n
#   contributors reach n times as far).
# - After a kept sum: RANGE_MARGIN x its spread (max |mean - own| of the entry
#   then, less its rounding noise; at least SPREAD_FLOOR x the calibration's
#   reach), times SHARES_MARGIN x its sum of w/W (at most n).
# Every step is rounded up to a power of two: what the steps disclose of the
# requester's own model is the binary order of a magnitude.
RANGE_FLOOR = 2.0**-4
CALIBRATION_MARGIN = 16.0
RANGE_MARGIN = 4.0
SHARES_MARGIN = 2.0
SPREAD_FLOOR = 2.0**-13


def ring_steps(
    reference: Mapping[str, Tensor],
    ring: int,
    contributors: int,
    spread: Mapping[str, float] | None = None,
    shares: float | None = None,
) -> dict[str, float]:
    """One quantization step per entry a narrow-ring sum quantizes (see the
    constants above): from `reference` (the requester's own model) alone, or
    from the `spread` and sum of w/W (`shares`) of its last kept sum. What the
    requester discloses to the contributors it chose: one power of two per
    entry (docs/threat-model.md)."""
    half = (1 << (ring - 1)) - 1
    keys = averaged_keys(reference)
    largest: dict[str, float] = {}
    for key in keys:
        value = reference[key].detach()
        top = float(value.abs().max()) if value.numel() else 0.0
        if not math.isfinite(top):
            raise SecAggError("bad_reference", f"my own {key} is not finite")
        largest[key] = top
    typical = max(float(np.median(list(largest.values()))) if largest else 0.0, RANGE_FLOOR)
    weight = float(contributors)
    if spread is not None and shares is not None and math.isfinite(shares) and shares > 0:
        weight = min(weight, SHARES_MARGIN * shares)
    steps = {}
    for key in narrow_entries(ring, {k: reference[k].numel() for k in keys}):
        reach = CALIBRATION_MARGIN * max(largest[key], typical)
        if spread is not None and key in spread and math.isfinite(spread[key]):
            reach = RANGE_MARGIN * max(spread[key], SPREAD_FLOOR * reach)
            step = weight * reach / half
        else:
            step = contributors * reach / half
        if not (math.isfinite(step) and 2.0**-64 <= step <= 2.0**60):
            raise SecAggError("bad_reference", f"no step for my own {key} ({step!r})")
        steps[key] = 2.0 ** math.ceil(math.log2(step))
    return steps


@dataclass
class SecureSum:
    """What a requester obtains: the weighted mean of the contributors in U3,
    their total weight, who they are and the rounds of their models."""

    mean: dict[str, Tensor]
    total_weight: float
    contributors: list[str]
    rounds: dict[str, int]
    dropped: list[str]  # masked in Round 2 by U2 but gone before their input arrived
    nbytes: int = 0
    ring: int = RING_BITS  # the ring it was summed in
    steps: dict[str, float] | None = None  # a narrow ring's: the requester's own
    # a narrow ring: how many values decoded in the outer quarter of their ring
    # around the requester's estimate (0 unless some lay farther than its steps
    # reach, or a contributor sent values far off), and in which entries
    ring_edge: int = 0
    ring_edge_entries: dict[str, int] = field(default_factory=dict)
    # BatchNorm running variance values its mean had below zero, raised to zero
    variances_raised: int = 0


async def secure_sum(
    ctx: RoundContext,
    contributors: Sequence[str],
    *,
    round_no: int,
    max_round: int,
    reference: Mapping[str, Tensor],
    timeout: float,
    purpose: str = "model",
    threshold: int | None = None,
    weight_scale: float | None = None,
    at_round: int | None = None,
    ring: int = RING_BITS,
    steps: Mapping[str, float] | None = None,
) -> SecureSum:
    """Run the four rounds with `contributors` as U and return the sum of
    U3's weighted models (as a weighted mean and its total weight).
    `weight_scale` is the session's weight unit W: every contributor's weight
    counts at most W, and is masked as w/W <= 1 (default: `weight_scale_for`
    from the roster caps alone). `at_round` (purpose FRESHEST_PURPOSE): this
    node's round, against which each contributor weighs its model's
    staleness. `ring`: 32 bits (fixed point), or 16 / 8 (protocol.compression
    fp16 / int8), quantized in `steps` (default `ring_steps` of `reference`,
    which must be the requester's own model: the sum is decoded against it).
    Raises
    SecAggError when too few stay for a sum (reason `too_few`) or the shares
    of a secret do not rebuild it (`too_few_shares`, `bad_share`)."""
    me = ctx.me
    u = sorted(set(contributors))
    if len(u) < MIN_SUM:
        raise SecAggError("too_few", f"{len(u)} contributors")
    if weight_scale is None:
        weight_scale = weight_scale_for(ctx.sample_caps(), u, None, None)
    base = {
        "session": random_source.token_hex(16),
        "contributors": u,
        "round": round_no,
        "max_round": max_round,
        "purpose": purpose,
        "weight_scale": float(weight_scale),
        **({} if at_round is None else {"at_round": int(at_round)}),
    }
    if ring != RING_BITS:
        steps = dict(steps) if steps is not None else ring_steps(reference, ring, len(u))
        base.update(ring=ring, steps=steps)
    else:
        steps = None
    try:  # what every contributor will check: a model it cannot name is not sent
        SessionRequest(**base, phase="advertise")
    except ValidationError as exc:
        raise SecAggError("unsupported", f"this sum cannot be asked for: {exc}") from None

    async def ask(peer: str, phase: str, body: dict[str, Any]) -> dict[str, Any] | None:
        query = {**base, "phase": phase, "body": body}
        if phase != "advertise":  # a narrow ring's steps travel once: they are in the context
            query.pop("steps", None)
        try:
            reply = await ctx.request(peer, SECAGG_KIND, query, timeout)
        except PeerUnavailable as exc:
            log.info("%s: secagg %s: no answer from %s (%s)", me, phase, peer, exc.reason)
            return None
        if not isinstance(reply, dict) or "refused" in reply:
            # the contributor's words, bounded: until a review (rv_comp2, 2026-11-28)
            # logged whole, so a refusal of a megabyte wrote a megabyte, and forged lines
            reason = shown(reply.get("refused")) if isinstance(reply, dict) else "malformed"
            log.warning("%s: secagg %s refused by %s: %s", me, phase, peer, reason)
            return None
        return reply

    async def everyone(
        peers: list[str], phase: str, body: Callable[[str], dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        replies = await asyncio.gather(*(ask(p, phase, body(p)) for p in peers))
        return {p: r for p, r in zip(peers, replies, strict=True) if r is not None}

    def valid(
        model: type[BaseModel], replies: dict[str, dict[str, Any]], members: list[str]
    ) -> dict[str, Any]:
        out = {}
        for peer, reply in replies.items():
            parsed = parse(model, reply)
            if parsed is None or not covers(parsed, members, peer):
                ctx.reject(peer, "secagg_malformed")
            else:
                out[peer] = parsed
        return out

    # Round 0: AdvertiseKeys
    adverts: dict[str, Advertised] = valid(
        Advertised, await everyone(u, "advertise", lambda p: {}), u
    )
    u1 = sorted(adverts)
    t = threshold_for(len(u) - 1, threshold)
    if len(u1) < max(MIN_SUM, t + 1):
        raise SecAggError("too_few", f"{len(u1)} of {len(u)} advertised keys (t={t})", unmasked=u1)

    # Round 1: ShareKeys
    shared: dict[str, Shared] = valid(
        Shared, await everyone(u1, "share", lambda p: share_keys_body(adverts, u1, t, p)), u1
    )
    u2 = sorted(shared)
    if len(u2) < max(MIN_SUM, t + 1):
        raise SecAggError(
            "too_few", f"{len(u2)} of {len(u1)} shared their keys (t={t})", unmasked=u2
        )

    # Round 2: MaskedInputCollection
    masked_replies = await everyone(
        u2,
        "mask",
        lambda p: {
            "u2": u2,
            "shares": {v: shared[v].shares[p] for v in u2 if v != p},
            "commitments": {v: shared[v].commitments[p].model_dump() for v in u2 if v != p},
        },
    )
    inputs, rounds, views = masked_inputs_of(
        ctx, masked_replies, reference, u2, round_no, max_round, ring
    )
    u3 = sorted(inputs)
    if len(u3) < max(MIN_SUM, t + 1):
        raise SecAggError("too_few", f"{len(u3)} of {len(u2)} masked inputs (t={t})")
    dropped = [v for v in u2 if v not in inputs]

    # Round 3: ConsistencyCheck
    vouched: dict[str, Vouched] = valid(
        Vouched,
        await everyone(
            u3,
            "consistency",
            lambda p: {"u3": u3, "view_tags": {v: views[v][p] for v in u3 if v != p}},
        ),
        u3,
    )
    u4 = sorted(vouched)
    if len(u4) < t:
        raise SecAggError("too_few", f"{len(u4)} of {len(u3)} vouched for U3 (t={t})")

    # Round 4: Unmasking
    revealed = await everyone(
        u4, "unmask", lambda p: {"u4": u4, "tags": {v: vouched[v].tags[p] for v in u4 if v != p}}
    )
    context = session_context(me, SessionRequest(**base, phase="unmask"))
    self_shares: dict[str, list[tuple[int, bytes]]] = {v: [] for v in u3}
    key_shares: dict[str, list[tuple[int, bytes]]] = {v: [] for v in dropped}
    for peer, reply in revealed.items():
        given = parse(Revealed, reply)
        if given is None:
            ctx.reject(peer, "secagg_malformed")
            continue
        for name, bucket, items in (
            ("b", self_shares, given.self_shares),
            ("sk", key_shares, given.key_shares),
        ):
            for v, item in items.items():
                if v not in bucket or v == peer:
                    continue
                # the index is the holder's place among v's holders, not its claim
                idx = [h for h in u1 if h != v].index(peer) + 1
                committed = getattr(shared[v].commitments.get(peer), name, None)
                made = share_commitment(context, v, peer, idx, name, item.share)
                if committed is None or not hmac.compare_digest(made, committed):
                    ctx.reject(peer, "secagg_bad_share")  # not the share v dealt it
                    continue
                bucket[v].append((idx, item.share))
    short = [v for bucket in (self_shares, key_shares) for v, s in bucket.items() if len(s) < t]
    if short:
        raise SecAggError("too_few_shares", f"fewer than t={t} good shares for {short}")

    def rebuild_and_unmask() -> tuple[dict[str, Tensor], float]:
        holders = len(u1) - 1
        seeds = {
            v: rebuild(s, t, holders, lambda b, v=v: matches_seed(b, adverts[v], context))
            for v, s in self_shares.items()
        }
        keys = {
            v: rebuild(s, t, holders, lambda sk, v=v: matches_key(sk, adverts[v].s_pk))
            for v, s in key_shares.items()
        }
        public = {v: adverts[v].s_pk for v in u1}
        return unmask_sum(
            inputs,
            seeds,
            keys,
            public,
            context,
            reference,
            weight_scale=float(weight_scale),
            ring=ring,
            steps=steps,
            edge=edge,
        )

    edge: dict[str, int] = {}
    mean, total = await ctx.run_blocking(rebuild_and_unmask)
    # A variance below zero makes every evaluation NaN (sqrt of var + eps) once
    # merged. An honest sum has none (a ring's rounding keeps a value at or above
    # zero), a contributor's reaches the mean unseen, and the sum cannot say
    # whose: its variances are raised to zero, logged, counted against nobody.
    # Until a review (rv_comp2, 2026-11-28) every secure sum merged them.
    raised = negative_variances(mean)
    if raised:
        mean = clamp_variances(mean)
        log.warning(
            "%s: secure sum of %s: %d BatchNorm running variance value(s) of its mean "
            "below zero raised to zero (a contributor sent them; the sum cannot say which)",
            me,
            u3,
            raised,
        )
    return SecureSum(
        mean,
        total,
        u3,
        rounds,
        dropped,
        ring=ring,
        steps=steps,
        ring_edge=sum(edge.values()),
        ring_edge_entries=edge,
        variances_raised=raised,
    )


def weight_scale_for(
    caps: Mapping[str, int],
    contributors: Sequence[str],
    own_weight: float | None,
    ratio: float | None,
) -> float:
    """W for a sum of `contributors`' sample-count weights: the most any of them
    may claim, the bound `checks.cap_sum` holds each to (its roster card's
    max_samples, and `ratio` x the requester's own count), the largest over
    them; where neither bounds one, DEFAULT_WEIGHT_RATIO x the own count, or
    UNBOUNDED_WEIGHT_SCALE without one. A contributor past W counts as W. The
    tighter W, the finer the weighted values in the ring (resolution 2^-20 of
    w/W * x). Never past 2^12 x the smallest card among them: a contributor
    refuses a W that would round its model out (`weight_scale_too_large`)."""
    own = own_weight if own_weight is not None and own_weight > 0 else None
    bounds: list[float] = []
    for peer in contributors:
        limits = [float(caps[peer])] if peer in caps else []
        if ratio is not None and own is not None:
            limits.append(ratio * own)
        if not limits:
            limits.append(UNBOUNDED_WEIGHT_SCALE if own is None else DEFAULT_WEIGHT_RATIO * own)
        bounds.append(min(limits))
    scale = max(bounds, default=1.0)
    carded = [float(caps[peer]) for peer in contributors if peer in caps]
    if carded:
        scale = min(scale, min(carded) / MIN_WEIGHT_SHARE)
    return float(min(max(scale, 1.0), MAX_WEIGHT_SCALE))


def rebuild(
    shares: Sequence[tuple[int, bytes]], t: int, holders: int, good: Callable[[bytes], bool]
) -> bytes:
    """The secret t of `shares` (already checked against their dealer's
    commitments) rebuild, if `good` accepts it (the commitment to b_v, or the
    public s_v); else the dealer dealt inconsistent shares: `bad_share`."""
    unique: dict[int, bytes] = {}
    for idx, share in shares:
        if type(idx) is int and 1 <= idx <= holders and idx not in unique:
            unique[idx] = share
    chosen = sorted(unique.items())[:t]
    if len(chosen) == t:
        secret = combine_shares(chosen, holders)
        if good(secret):
            return secret
    raise SecAggError("bad_share", f"{len(chosen)} committed shares do not rebuild the secret")


def matches_seed(seed: bytes, advert: Advertised, context: bytes) -> bool:
    return hmac.compare_digest(seed_commitment(seed, context), advert.b_hash)


def matches_key(private: bytes, public: bytes) -> bool:
    try:
        key = X25519PrivateKey.from_private_bytes(private)
    except ValueError:
        return False
    return hmac.compare_digest(key.public_key().public_bytes_raw(), public)


def covers(parsed: Any, members: Sequence[str], peer: str) -> bool:
    """A reply that names every other member where it must: tags in Round 0
    and 3, sealed shares and the commitments to them in Round 1 (a reply
    without a commitment for some holder crashed Round 2's relay before)."""
    if isinstance(parsed, Shared):
        needed = [parsed.shares, parsed.commitments]
    else:
        needed = [getattr(parsed, "tags", None)]
    return all(
        isinstance(part, dict) and all(v in part for v in members if v != peer) for part in needed
    )


def masked_inputs_of(
    ctx: RoundContext,
    replies: Mapping[str, Mapping[str, Any]],
    reference: Mapping[str, Tensor],
    u2: Sequence[str],
    round_no: int,
    max_round: int,
    ring: int = RING_BITS,
) -> tuple[dict[str, dict[str, Tensor]], dict[str, int], dict[str, dict[str, bytes]]]:
    """Round 2's answers that hold a masked input of the expected entries and
    shapes (the ring's wire form: int32, or int16 / int8 in a narrow ring, the
    weight int32 always), a model round in range and a view tag for every other
    member of U2: (inputs, model rounds, view tags) by contributor."""
    expected = {
        k: (tuple(reference[k].shape), WIRE_DTYPES[secagg_entry_ring(ring, reference[k].numel())])
        for k in averaged_keys(reference)
    }
    expected[WEIGHT_KEY] = ((1,), WIRE_DTYPE)
    inputs: dict[str, dict[str, Tensor]] = {}
    rounds: dict[str, int] = {}
    views: dict[str, dict[str, bytes]] = {}
    for peer, reply in replies.items():
        masked, model_round, tags = (
            reply.get("masked"),
            reply.get("model_round"),
            reply.get("view_tags"),
        )
        if (
            isinstance(masked, dict)
            and set(masked) == set(expected)
            and all(
                isinstance(masked[k], Tensor)
                and masked[k].dtype == dtype
                and tuple(masked[k].shape) == shape
                for k, (shape, dtype) in expected.items()
            )
            and type(model_round) is int
            and round_no <= model_round <= max_round
            and isinstance(tags, dict)
            and all(isinstance(tags.get(v), bytes) and len(tags[v]) <= 32 for v in u2 if v != peer)
        ):
            inputs[peer] = masked
            rounds[peer] = model_round
            views[peer] = tags
        else:
            ctx.reject(peer, "secagg_malformed")
    return inputs, rounds, views


def share_keys_body(
    adverts: Mapping[str, Advertised], u1: Sequence[str], threshold: int, peer: str
) -> dict[str, Any]:
    """Round 1's query to `peer`: the threshold and every key of U1 with the
    tag its owner made for `peer` (from the Round 0 answers)."""
    return {
        "threshold": threshold,
        "keys": {
            v: {
                "c_pk": adverts[v].c_pk,
                "s_pk": adverts[v].s_pk,
                "b_hash": adverts[v].b_hash,
                "tag": b"" if v == peer else adverts[v].tags.get(peer, b""),
            }
            for v in u1
        },
    }
