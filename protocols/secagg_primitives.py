"""The building blocks of secure aggregation (protocols/secagg.py runs the
rounds with them): the tags that authenticate keys and vouch for a set of
survivors, the pairwise mask seeds, Shamir sharing of a 32-byte secret
(pycryptodome, GF(2^128), as two 16-byte halves), the sealed shares, a
contributor's masked input and the requester's unmasking. The fixed point and
the keystreams are protocols/masking.py's.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from torch import Tensor

from p2pfl.config.secagg_ring import narrow_entries, secagg_entry_ring
from p2pfl.learning.state import averaged_keys
from protocols.masking import (
    FIXED_POINT_BITS,
    RING_BITS,
    WEIGHT_KEY,
    Fixed,
    MaskingError,
    entry_limit,
    from_fixed,
    from_narrow,
    mask_stream,
    ring_of,
    to_fixed,
    to_narrow,
    to_wire,
)
from protocols.secagg_messages import MAX_CONTRIBUTORS

SECRET_BYTES = 32
NONCE_BYTES = 12  # random per sealed message: a key is never used twice with one nonce
MAX_SHARE_INDEX = 255  # Shamir indices are 1..holders; anything else is refused before combining


class SecAggError(Exception):
    """A session that cannot go on; `reason` is a stable code (what a contributor
    answers as {"refused": reason}, what a requester logs)."""

    def __init__(
        self, reason: str, message: str = "", *, unmasked: list[str] | None = None
    ) -> None:
        super().__init__(message or reason)
        self.reason = reason
        # Failed before anyone masked: these answered and may be asked again in a new session.
        self.unmasked = unmasked


def _hkdf(secret: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(secret)


def _framed(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: no two different part lists frame alike."""
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def auth_tag(key: bytes, sender: str, *public: bytes) -> bytes:
    """Round 0: what proves to v that these session keys (and the commitment to
    the self-mask seed) came from `sender`: HMAC under k_uv^auth, a key only u
    and v derive from their roster keys."""
    return hmac.new(key, _framed(b"secagg-keys", sender.encode(), *public), "sha256").digest()


def view_tag(key: bytes, sender: str, label: str, threshold: int, *sets: Sequence[str]) -> bytes:
    """`sender`'s word to the holder of `key` about the session as it saw it:
    the threshold and the sets U1, U2 (label "u2", given with the masked
    input) and U3 (label "u3", the consistency check)."""
    parts = [b"secagg-view", label.encode(), sender.encode(), str(threshold).encode()]
    parts += [",".join(sorted(s)).encode() for s in sets]
    return hmac.new(key, _framed(*parts), "sha256").digest()


def seed_commitment(self_seed: bytes, context: bytes) -> bytes:
    """Round 0: H(context, b_u), so the requester can tell a rebuilt b_u from a
    wrong one (a contributor that reveals a bad share) without learning it."""
    return hashlib.sha256(_framed(b"secagg-b", context, self_seed)).digest()


def share_commitment(
    context: bytes, dealer: str, holder: str, idx: int, name: str, share: bytes
) -> bytes:
    """Round 1: H(context, dealer, holder, idx, which secret, share), given to
    the requester with the sealed shares, so in Round 4 it keeps only the
    shares their dealer made (a holder revealing junk or another index is
    caught) without learning any of them."""
    parts = (b"secagg-share", context, dealer.encode(), holder.encode(), str(idx).encode())
    return hashlib.sha256(_framed(*parts, name.encode(), share)).digest()


def share_key(
    private: X25519PrivateKey, peer_public: bytes, context: bytes, dealer: str, holder: str
) -> bytes:
    """The key that seals dealer's shares for holder: HKDF over the X25519 of
    their ephemeral session keys (c_u, c_v), so it is new every session and
    gone with it (forward secrecy), and one per direction."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:
        raise SecAggError("bad_public_key", "a low-order or malformed X25519 key") from None
    info = b"p2pfl secagg seal|" + dealer.encode() + b">" + holder.encode()
    return _hkdf(shared, context, info)


def mask_seed(
    private: X25519PrivateKey, peer_public: bytes, context: bytes, a: str, b: str
) -> bytes:
    """s_uv: HKDF over X25519(sk_u, pk_v), the same for (u, v) and (v, u)."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:
        raise SecAggError("bad_public_key", "a low-order or malformed X25519 key") from None
    first, second = sorted((a, b))
    return _hkdf(shared, context, b"p2pfl secagg mask|" + first.encode() + b"|" + second.encode())


def share_secret(secret: bytes, threshold: int, holders: int) -> list[tuple[int, bytes]]:
    """Shamir shares (index 1..holders) of a 32-byte secret, any `threshold` of
    which rebuild it: the two 16-byte halves shared alike (pycryptodome)."""
    first = Shamir.split(threshold, holders, secret[:16])
    second = Shamir.split(threshold, holders, secret[16:])
    return [(i, a + b) for (i, a), (_, b) in zip(first, second, strict=True)]


def combine_shares(shares: Sequence[tuple[int, bytes]], holders: int = MAX_SHARE_INDEX) -> bytes:
    """The secret `shares` rebuild. Indices must be distinct ints in 1..holders
    and every share 32 bytes: pycryptodome loops forever on a negative index
    and raises on a duplicate, so nothing else reaches it; whatever it still
    raises becomes SecAggError("bad_share")."""
    indices = [i for i, _ in shares]
    if (
        not shares
        or any(type(i) is not int or not 1 <= i <= min(holders, MAX_SHARE_INDEX) for i in indices)
        or len(set(indices)) != len(indices)
    ):
        raise SecAggError("bad_share", f"share indices must be distinct in 1..{holders}")
    if any(not isinstance(s, bytes) or len(s) != SECRET_BYTES for _, s in shares):
        raise SecAggError("bad_share", "a share is not 32 bytes")
    try:
        first = Shamir.combine([(i, s[:16]) for i, s in shares])
        second = Shamir.combine([(i, s[16:]) for i, s in shares])
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        raise SecAggError("bad_share", f"shares do not combine: {exc}") from None
    return first + second


def seal(key: bytes, plain: bytes, aad: bytes) -> bytes:
    """nonce || ChaCha20-Poly1305(plain): a fresh random nonce every time."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plain, aad)


def unseal(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except (InvalidTag, ValueError):
        raise SecAggError("bad_share", "a share does not authenticate") from None


def _signed(mask: Fixed, positive: bool, out: Fixed) -> None:
    if positive:
        out += mask
    else:
        out -= mask


def clip_state(state: Mapping[str, Tensor], max_norm: float | None) -> dict[str, Tensor]:
    """The float entries scaled down together to L2 norm `max_norm` (a
    contributor's own clipping before masking); unchanged below it. Scaled in
    float64 and rounded toward zero into the entry's dtype, so no entry ends
    above its float64 value: a clipped entry never exceeds `max_norm`, which
    is what the ring's bound (`check`) counts on."""
    out = dict(state)
    if max_norm is None:
        return out
    keys = averaged_keys(state)
    norm = math.sqrt(sum(float(state[k].detach().double().square().sum()) for k in keys))
    if norm > max_norm > 0:
        scale = max_norm / norm
        for k in keys:
            exact = state[k].detach().double() * scale
            value = exact.to(state[k].dtype)
            over = value.double().abs() > exact.abs()
            if bool(over.any()):
                value[over] = torch.nextafter(value[over], torch.zeros_like(value[over]))
            out[k] = value
    return out


def fits_ring(
    state: Mapping[str, Tensor],
    share: float,
    contributors: int,
    bits: int = FIXED_POINT_BITS,
    ring: int = RING_BITS,
) -> bool:
    """Whether every entry of `share` * state fits a sum of `contributors`
    (what `masked_input` checks entry by entry): asked before anyone masks, so
    a model that cannot be summed is refused while it can still be left out.
    In a narrow ring (16 or 8 bits) every finite value of an entry of 1,024
    values or more fits (it is reduced mod 2^ring; the requester decodes the
    sum against its own model); smaller entries are fixed point as always."""
    limit = entry_limit(contributors)
    for key in averaged_keys(state):
        value = state[key].detach()
        if value.numel() == 0:
            continue
        largest = float(value.abs().max()) * share * 2.0**bits
        in_fixed_point = secagg_entry_ring(ring, value.numel()) == RING_BITS
        if not math.isfinite(largest) or (in_fixed_point and round(largest) > limit):
            return False
    return True


def masked_input(
    state: Mapping[str, Tensor],
    weight: float,
    *,
    me: str,
    self_seed: bytes,
    pair_seeds: Mapping[str, bytes],
    bits: int = FIXED_POINT_BITS,
    weight_scale: float = 1.0,
    contributors: int = MAX_CONTRIBUTORS,
    ring: int = RING_BITS,
    steps: Mapping[str, float] | None = None,
) -> dict[str, Tensor]:
    """Round 2: y_u for every averaged entry and the weight (int32 tensors):
    fixed(w/W * x) and fixed(w/W), W = `weight_scale`, each entry within the
    limit of a sum of `contributors` (else `out_of_range`).

    A narrow `ring` (16 or 8 bits; protocol.compression fp16 / int8): each
    entry is w/W * x in units of its `steps[entry]` (the requester's, the same
    for every contributor: they are in the session's context), stochastically
    rounded, mod 2^ring, and travels as int16 / int8 (`masking.to_narrow`);
    the weight stays a 32-bit fixed-point entry."""
    if not weight > 0 or not math.isfinite(weight):
        raise SecAggError("bad_weight", f"{me}: weight must be a positive number, got {weight}")
    if not weight_scale > 0 or not math.isfinite(weight_scale):
        raise SecAggError("bad_weight", f"{me}: weight scale must be positive, got {weight_scale}")
    share = weight / weight_scale
    limit = entry_limit(contributors)
    keys = averaged_keys(state)
    narrow = narrow_entries(ring, {k: state[k].numel() for k in keys})
    if ring != RING_BITS and (steps is None or set(steps) != set(narrow)):
        raise SecAggError(
            "bad_steps", f"{me}: a {ring}-bit ring needs one step per entry of 1,024 values or more"
        )

    def masked(entry: str, out: Fixed, bits: int) -> Tensor:
        out += mask_stream(self_seed, entry, out.size, bits)
        for peer, seed in pair_seeds.items():
            _signed(mask_stream(seed, entry, out.size, bits), me < peer, out)
        return to_wire(out)

    result: dict[str, Tensor] = {}
    # stochastic rounding from a private generator: not the seeded global one
    # training draws from (reproducible training, no rounding shared across sites)
    rounding = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    try:
        for entry in keys:
            value = state[entry]
            width = secagg_entry_ring(ring, value.numel())
            if width == RING_BITS:
                fixed = to_fixed(value, bits, scale=share, limit=limit)
            else:
                assert steps is not None
                fixed = to_narrow(value.detach().double() * share, steps[entry], width, rounding)
            result[entry] = masked(entry, fixed, width).reshape(value.shape)
        result[WEIGHT_KEY] = masked(
            WEIGHT_KEY, to_fixed(np.array([share]), bits, limit=limit), RING_BITS
        )
    except MaskingError as exc:
        raise SecAggError(exc.reason, str(exc)) from None
    return result


def unmask_sum(
    inputs: Mapping[str, Mapping[str, Tensor]],
    self_seeds: Mapping[str, bytes],
    dropped_keys: Mapping[str, bytes],
    public_keys: Mapping[str, bytes],
    context: bytes,
    reference: Mapping[str, Tensor],
    bits: int = FIXED_POINT_BITS,
    weight_scale: float = 1.0,
    ring: int = RING_BITS,
    steps: Mapping[str, float] | None = None,
    edge: dict[str, int] | None = None,
) -> tuple[dict[str, Tensor], float]:
    """sum_u y_u - PRG(b_u) - the dropped contributors' pair masks, as the
    weighted mean (entries of `reference`, its dtypes) and the total weight
    (in the caller's units: the decoded sum of w/W times W). A narrow `ring`:
    each entry's sum of quantized values is decoded as the one nearest to
    sum(w/W) * reference / step (`masking.from_narrow`; `reference` is the
    requester's own model), and for each entry with values whose offset from
    that estimate lies in the outer quarter of the ring, their number goes to
    `edge`. Entries of fewer than 1,024 values are in the 32-bit fixed-point
    ring in every sum (`secagg_entry_ring`)."""
    dropped = {d: X25519PrivateKey.from_private_bytes(sk) for d, sk in dropped_keys.items()}
    seeds = {
        (u, d): mask_seed(private, public_keys[u], context, d, u)
        for d, private in dropped.items()
        for u in inputs
    }
    totals: dict[str, Fixed] = {}
    for entry in [*averaged_keys(reference), WEIGHT_KEY]:
        total: Fixed | None = None
        for y in inputs.values():
            flat = ring_of(y[entry])
            total = flat if total is None else total + flat
        assert total is not None
        width = (
            RING_BITS if entry == WEIGHT_KEY else secagg_entry_ring(ring, reference[entry].numel())
        )
        if total.dtype.itemsize * 8 != width:
            raise SecAggError("bad_sum", f"{entry} is not in the session's {width}-bit ring")
        for u in inputs:
            total -= mask_stream(self_seeds[u], entry, total.size, width)
            for d in dropped:
                # y_u holds +PRG(s_ud) when u < d, -PRG(s_ud) otherwise: take it out.
                _signed(mask_stream(seeds[(u, d)], entry, total.size, width), not u < d, total)
        totals[entry] = total
    shares = float(from_fixed(totals.pop(WEIGHT_KEY), bits)[0])
    if not shares > 0:
        raise SecAggError("bad_sum", f"the weights sum to {shares * weight_scale}")
    mean: dict[str, Tensor] = {}
    for key, ref in reference.items():
        if key in totals:
            if secagg_entry_ring(ring, ref.numel()) == RING_BITS:
                values = from_fixed(totals[key], bits) / shares
            else:
                assert steps is not None
                expected = ref.detach().to("cpu", torch.float64).reshape(-1).numpy()
                try:
                    decoded, offset = from_narrow(
                        totals[key], steps[key], expected * (shares / steps[key])
                    )
                except MaskingError as exc:
                    raise SecAggError(exc.reason, str(exc)) from None
                outer = int((np.abs(offset) > 3 * (1 << (ring - 1)) // 4).sum())
                if outer and edge is not None:
                    edge[key] = outer
                values = decoded / shares
            mean[key] = torch.from_numpy(values).reshape(ref.shape).to(ref.dtype)
        else:
            mean[key] = ref.detach().clone()
    return mean, shares * weight_scale
