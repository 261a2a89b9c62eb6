"""The arithmetic of additive masking, for secure aggregation (protocols/secagg.py).

A masked value is fixed(w/W * x) plus keystreams that cancel in the sum over
the contributors (pairwise masks, each added by one member of a pair and
subtracted by the other) or that the requester removes once it may (self
masks). Sums are taken mod 2^32, so every mask cancels bit-exactly, and each
masked value on its own is uniformly distributed. This module has the pieces:
the pair secret two roster members derive from their X25519 keys
(`pair_secret_from_shared`), the fixed-point encoding, and the keystreams.

Domain: fixed point, scale 2^FIXED_POINT_BITS (2^20: resolution 2^-20, about
9.5e-7, of the weighted value w/W * x), in uint32 with wraparound (numpy's
unsigned arithmetic wraps by definition); on the wire the masked entries
travel as int32 tensors (the same 32 bits, reinterpreted), the size of a
float32 model. The weight w of a contribution is masked as one more entry in
the unit W of the session (the requester's `weight_scale`, the most a
contributor may claim): w/W <= 1, so with the model clipped to L2 norm C every
|w/W * x_j| <= C.

Range, exact: a contributor to a sum of n refuses any entry whose fixed-point
value exceeds (2^31 - 1) // n in magnitude (`MaskingError("out_of_range")`,
never sent in clear), so the n values it is summed with cannot carry the sum
past an int32: the decoded sum is exact, never wrapped. With a clip norm C no
honest entry is refused while n * ceil(C * 2^20) <= 2^31 - 1; `check` refuses
a clip norm for which that fails with the roster's other sites as n
(p2pfl/config/secagg_ring.py `secagg_ring_overflow`). Not finite: refused too.

Masks are ChaCha20 keystreams (`cryptography`): key = the 32-byte pair secret,
nonce = SHA-256 of the state-dict entry name, counter 0, so both ends of a
pair draw the same stream for the same entry on any machine; 4 bytes of it per
entry.

Narrow rings (protocol.compression fp16 / int8, for entries of 1,024 values
or more; smaller ones stay fixed point here): `mask_stream` draws 2- or 1-byte
elements, and `to_narrow` / `from_narrow` quantize and decode. A value is
w/W * x in a step the requester chose, stochastically rounded, mod 2^16 or
2^8, never refused for its size: the sum wraps, and the requester decodes it
as the value congruent to it nearest to its own estimate.

Only floating-point entries are masked and summed; counters such as
BatchNorm's `num_batches_tracked` are not sent at all (the requester keeps its
own).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray
from torch import Tensor

from p2pfl.config.secagg_ring import (
    SECAGG_FIXED_POINT_BITS,
    SECAGG_MAX_CONTRIBUTORS,
    SECAGG_RING_BITS,
    SECAGG_RING_MAX,
    secagg_entry_limit,
)

RING_BITS = SECAGG_RING_BITS
FIXED_POINT_BITS = SECAGG_FIXED_POINT_BITS
RING_MAX = SECAGG_RING_MAX  # 2^31 - 1: the largest |sum| that decodes
WIRE_DTYPE = torch.int32  # how a masked entry travels
WEIGHT_KEY = "$weight"  # the masked weight travels as one more entry
PAIR_SECRET_BYTES = 32
_PAIR_INFO = b"p2pfl pairwise mask v1"
# a ring's elements, their signed reading, and how they travel
_UNSIGNED: dict[int, type[np.unsignedinteger]] = {8: np.uint8, 16: np.uint16, 32: np.uint32}
_SIGNED: dict[int, type[np.signedinteger]] = {8: np.int8, 16: np.int16, 32: np.int32}
WIRE_DTYPES = {8: torch.int8, 16: torch.int16, 32: torch.int32}

Fixed = NDArray[np.uint32]


class MaskingError(Exception):
    """A contribution that cannot be masked or summed; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def entry_limit(contributors: int = SECAGG_MAX_CONTRIBUTORS) -> int:
    """The largest |fixed-point value| one of `contributors` may mask."""
    return secagg_entry_limit(contributors)


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


_ZEROS = bytes(0)  # read-only zeros to encrypt into a keystream, grown on demand


def _zeros(nbytes: int) -> memoryview:
    global _ZEROS
    if len(_ZEROS) < nbytes:
        _ZEROS = bytes(nbytes)
    return memoryview(_ZEROS)[:nbytes]


def mask_stream(secret: bytes, entry: str, numel: int, bits: int = RING_BITS) -> Fixed:
    """The pair mask of one state-dict entry: `numel` uniform values of the
    `bits`-bit ring (uint32, uint16 or uint8: the ChaCha20 keystream,
    encrypted straight into the returned array)."""
    if len(secret) != PAIR_SECRET_BYTES:
        raise MaskingError("bad_secret", f"pair secret must be {PAIR_SECRET_BYTES} bytes")
    unsigned = _UNSIGNED[bits]
    nonce = b"\x00" * 4 + hashlib.sha256(entry.encode()).digest()[:12]  # counter 0 + 96-bit nonce
    encryptor = Cipher(algorithms.ChaCha20(secret, nonce), mode=None).encryptor()
    nbytes = bits // 8 * numel
    room = np.empty(nbytes + 16, dtype=np.uint8)  # update_into wants 15 bytes beyond the data
    written = encryptor.update_into(_zeros(nbytes), memoryview(room))
    assert written == nbytes
    return room[:nbytes].view(unsigned)


# ---------------------------------------------------------------------- fixed point


def to_fixed(
    values: Tensor | NDArray[np.floating],
    bits: int = FIXED_POINT_BITS,
    *,
    scale: float = 1.0,
    limit: int | None = None,
) -> Fixed:
    """Float values (times `scale`) -> round(x * 2^bits) as two's-complement
    uint32; refuses non-finite values and any |round(x * 2^bits)| > `limit`
    (default 2^31 - 1, one value alone; a contributor passes its sum's
    `entry_limit`). In torch, in place on one float64 copy (the state dicts of
    large models)."""
    bound = RING_MAX if limit is None else limit
    x = (
        values.detach().to("cpu", torch.float64, copy=True)
        if isinstance(values, Tensor)
        else torch.tensor(np.asarray(values, dtype=np.float64))
    ).reshape(-1)
    x.mul_(scale * 2.0**bits).round_()
    # one pass for both checks: NaN fails every comparison, +-inf the bound
    low, high = torch.aminmax(x) if x.numel() else (torch.zeros(()), torch.zeros(()))
    if not (-bound <= float(low) and float(high) <= bound):
        raise MaskingError(
            "out_of_range",
            f"values must be finite and at most {bound / 2.0**bits!r} in magnitude to be "
            "masked into this sum",
        )
    return x.to(torch.int32).numpy().view(np.uint32)


def from_fixed(values: Fixed, bits: int = FIXED_POINT_BITS) -> NDArray[np.float64]:
    return values.view(np.int32).astype(np.float64) / 2.0**bits


def to_wire(values: Fixed) -> Tensor:
    """A masked entry as it travels: the same bits as a signed tensor (int32,
    int16 or int8, the ring's width)."""
    return torch.from_numpy(values.view(_SIGNED[values.dtype.itemsize * 8]))


def ring_of(value: Tensor) -> Fixed:
    """A received int32 / int16 / int8 tensor as ring elements (a copy, flat)."""
    flat = value.detach().cpu().numpy().reshape(-1)
    return flat.view(_UNSIGNED[flat.dtype.itemsize * 8]).copy()


# ---------------------------------------------------------------------- narrow rings


def to_narrow(
    values: Tensor, step: float, bits: int, generator: torch.Generator | None = None
) -> Fixed:
    """Float values -> q = values / `step`, stochastically rounded (E[q] * step
    = values: unbiased, as QSGD, Alistarh et al. 2017), reduced mod 2^bits: an
    element of the `bits`-bit ring. Nothing is clamped: the sum of n such
    values wraps, and the requester takes it back out against its own model
    (`from_narrow`). Non-finite values are refused (`out_of_range`)."""
    if not (step > 0 and math.isfinite(step)):
        raise MaskingError("bad_step", f"a quantization step must be positive, got {step!r}")
    x = values.detach().to("cpu", torch.float64, copy=True).reshape(-1)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise MaskingError("out_of_range", "values must be finite to be masked into this sum")
    x.div_(step)
    low = x.floor()
    up = torch.rand(x.shape, dtype=torch.float64, generator=generator) < (x - low)
    q = torch.remainder(low.add_(up.to(torch.float64)), 2.0**bits)  # exact below 2^53
    return q.to(torch.int64).numpy().astype(_UNSIGNED[bits])


def from_narrow(
    total: Fixed, step: float, expected: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """A narrow ring's sum S (in steps) from its residue mod 2^bits: the value
    congruent to `total` nearest to `expected` (the requester's estimate, in
    steps), so exact while |S - expected| < 2^(bits-1) - 1/2. Modular decoding
    with side information at the decoder, as the lattice mean estimation of
    Davies et al. (ICLR 2021): the error depends on how far the inputs are
    from the requester's own model, not on how large they are. Returns S *
    step, and S - round(expected) (the offsets, for the caller's edge check:
    offsets near +-2^(bits-1) say the range was too tight)."""
    bits = total.dtype.itemsize * 8
    modulus = 1 << bits
    if expected.size and not bool(np.all(np.abs(expected) < 2.0**52)):
        raise MaskingError("out_of_range", "the estimate is too far out for this ring's step")
    base = np.round(expected).astype(np.int64)
    offset = (total.astype(np.int64) - base) % modulus
    offset[offset >= modulus // 2] -= modulus
    return (base + offset).astype(np.float64) * step, offset
