"""Pairwise additive masking: a requester learns the average of T models, not one of them.

FedPerl's anonymized peer (MICCAI Eq. 4, journal Sec. 2.3.4) is the mean of the
T most similar peers' models. In the papers a server builds it; here the T
contributors build it for the requester so that it only ever sees the mean.

For a contributor set C = {P_1 < ... < P_T} (sorted names) and one request:

    masked_i = fixed(w_i * model_i) + sum_{j > i} m_ij - sum_{j < i} m_ij   (mod 2^64)

where m_ij = m_ji is a keystream both P_i and P_j derive from their shared
pair secret (X25519 + HKDF salted with the request context, `pair_secret_from_shared`)
and nobody else can. Every m_ij is added once and subtracted once, so

    sum_i masked_i = sum_i fixed(w_i * model_i)                             (mod 2^64)

bit-exactly, and the requester divides by the (also masked) total weight
sum_i w_i. Each masked_i on its own is uniformly distributed: it says nothing
about model_i to whoever lacks the pair secrets.

Domain: fixed point, scale 2^FIXED_POINT_BITS (2^20, resolution ~9.5e-7), in
uint64 with wraparound (numpy's unsigned arithmetic wraps by definition).
Range: every |w_i * value| must stay below 2^MAX_VALUE_BITS (2^35, ~3.4e10),
which leaves room for 2^8 contributors before the int64 sum could overflow.
A value out of range or not finite is refused (`MaskingError("out_of_range")`),
never sent in clear. On the wire the masked entries travel as int64 tensors
(the same 64 bits, reinterpreted).

Masks are ChaCha20 keystreams (`cryptography`): key = the 32-byte pair secret,
nonce = SHA-256 of the state-dict entry name, counter 0, so both ends of a
pair draw the same stream for the same entry on any machine.

Only floating-point entries are masked and averaged; counters such as
BatchNorm's `num_batches_tracked` are not sent at all (the requester keeps its
own).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray
from torch import Tensor

from p2pfl.learning.state import averaged_keys

FIXED_POINT_BITS = 20
MAX_VALUE_BITS = 35
WEIGHT_KEY = "$weight"  # the masked weight travels as one more entry
PAIR_SECRET_BYTES = 32
_PAIR_INFO = b"p2pfl pairwise mask v1"

Fixed = NDArray[np.uint64]


class MaskingError(Exception):
    """A contribution that cannot be masked or summed; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------- pair secrets


def pair_secret_from_shared(shared_secret: bytes, me: str, peer: str, context: bytes) -> bytes:
    """32 bytes both ends of a pair derive alike: HKDF-SHA256 over their X25519
    shared secret, salted with the request context, bound to both names (in
    sorted order, so me/peer may be swapped)."""
    if me == peer:
        raise MaskingError("self_pair", f"{me}: a pair secret needs two different nodes")
    first, second = sorted((me, peer))
    info = _PAIR_INFO + b"|" + first.encode() + b"|" + second.encode()
    return HKDF(
        algorithm=hashes.SHA256(), length=PAIR_SECRET_BYTES, salt=context, info=info
    ).derive(shared_secret)


def request_context(requester: str, request_id: str, round: int) -> bytes:
    """What salts the pair secrets of one anonymized-peer request: a fresh
    request id gives fresh masks, so no two contributions ever share masks."""
    return f"p2pfl-anon|{requester}|{request_id}|{round}".encode()


def mask_stream(secret: bytes, entry: str, numel: int) -> Fixed:
    """The pair mask of one state-dict entry: `numel` uniform uint64 values."""
    if len(secret) != PAIR_SECRET_BYTES:
        raise MaskingError("bad_secret", f"pair secret must be {PAIR_SECRET_BYTES} bytes")
    nonce = b"\x00" * 4 + hashlib.sha256(entry.encode()).digest()[:12]  # counter 0 + 96-bit nonce
    encryptor = Cipher(algorithms.ChaCha20(secret, nonce), mode=None).encryptor()
    stream = encryptor.update(bytes(8 * numel))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64)


# ---------------------------------------------------------------------- fixed point


def to_fixed(values: Tensor | NDArray[np.floating], bits: int = FIXED_POINT_BITS) -> Fixed:
    """Float values -> round(x * 2^bits) as two's-complement uint64; refuses
    non-finite values and |x| >= 2^MAX_VALUE_BITS."""
    x = (
        values.detach().to(torch.float64).cpu().numpy()
        if isinstance(values, Tensor)
        else np.asarray(values, dtype=np.float64)
    )
    if x.size and (not np.isfinite(x).all() or np.abs(x).max() >= 2.0**MAX_VALUE_BITS):
        raise MaskingError(
            "out_of_range",
            f"values must be finite and below 2^{MAX_VALUE_BITS} in magnitude to be masked",
        )
    return np.rint(x * 2.0**bits).astype(np.int64).reshape(-1).view(np.uint64)


def from_fixed(values: Fixed, bits: int = FIXED_POINT_BITS) -> NDArray[np.float64]:
    return values.view(np.int64).astype(np.float64) / 2.0**bits


# ---------------------------------------------------------------------- contributor side


def masked_contribution(
    state: Mapping[str, Tensor],
    *,
    me: str,
    contributors: Sequence[str],
    secrets: Mapping[str, bytes],
    weight: float = 1.0,
    bits: int = FIXED_POINT_BITS,
) -> dict[str, Tensor]:
    """masked_i = fixed(w_i * model_i) + sum_{j>i} m_ij - sum_{j<i} m_ij for every
    float entry, plus the masked weight under WEIGHT_KEY; int64 tensors of the
    entries' shapes. `secrets[p]` is my pair secret with contributor p."""
    others = sorted(set(contributors) - {me})
    if me not in contributors or len(set(contributors)) < 2:
        raise MaskingError(
            "bad_contributors",
            f"{me}: contributors {list(contributors)} must include me and one other",
        )
    missing = [p for p in others if p not in secrets]
    if missing:
        raise MaskingError("missing_secret", f"{me}: no pair secret with {missing}")
    if not weight > 0 or not np.isfinite(weight):
        raise MaskingError("bad_weight", f"{me}: weight must be a positive number, got {weight}")

    def masked(entry: str, fixed: Fixed) -> Tensor:
        out = fixed.copy()
        for peer in others:
            mask = mask_stream(secrets[peer], entry, out.size)
            if me < peer:
                out += mask
            else:
                out -= mask
        return torch.from_numpy(out.view(np.int64))

    result: dict[str, Tensor] = {}
    for entry in averaged_keys(state):
        value = state[entry]
        scaled = value.detach().to(torch.float64) * weight
        result[entry] = masked(entry, to_fixed(scaled, bits)).reshape(value.shape)
    result[WEIGHT_KEY] = masked(WEIGHT_KEY, to_fixed(np.array([weight]), bits))
    return result


# ---------------------------------------------------------------------- requester side


def sum_contributions(
    contributions: Sequence[Mapping[str, Tensor]], reference: Mapping[str, Tensor]
) -> dict[str, Fixed]:
    """Sum (mod 2^64) of masked contributions whose entries and shapes match
    the float entries of `reference` (plus WEIGHT_KEY)."""
    if len(contributions) < 2:
        raise MaskingError("too_few", "an anonymized sum needs at least two contributions")
    expected = {k: tuple(reference[k].shape) for k in averaged_keys(reference)}
    expected[WEIGHT_KEY] = (1,)
    totals: dict[str, Fixed] = {}
    for contribution in contributions:
        if not isinstance(contribution, Mapping) or set(contribution) != set(expected):
            raise MaskingError("key_mismatch", "a masked contribution has other entries than ours")
        for key, shape in expected.items():
            value = contribution[key]
            if (
                not isinstance(value, Tensor)
                or value.dtype != torch.int64
                or tuple(value.shape) != shape
            ):
                raise MaskingError("shape_mismatch", f"masked entry {key!r} is not int64{shape}")
            flat = value.detach().cpu().numpy().reshape(-1).view(np.uint64)
            if key in totals:
                totals[key] += flat
            else:
                totals[key] = flat.copy()
    return totals


def unmask_mean(
    contributions: Sequence[Mapping[str, Tensor]],
    reference: Mapping[str, Tensor],
    bits: int = FIXED_POINT_BITS,
) -> tuple[dict[str, Tensor], float]:
    """(sum_i w_i model_i / sum_i w_i, sum_i w_i): the float entries of the
    weighted mean (dtypes of `reference`) and the total weight. Entries of
    `reference` that are not floats (counters) are copied from it."""
    totals = sum_contributions(contributions, reference)
    total_weight = float(from_fixed(totals.pop(WEIGHT_KEY), bits)[0])
    if not total_weight > 0:
        raise MaskingError("bad_weight", f"masked weights sum to {total_weight}")
    mean: dict[str, Tensor] = {}
    for key, ref in reference.items():
        if key in totals:
            values = from_fixed(totals[key], bits) / total_weight
            mean[key] = torch.from_numpy(values).reshape(ref.shape).to(ref.dtype)
        else:
            mean[key] = ref.detach().clone()
    return mean, total_weight
