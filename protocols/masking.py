"""The arithmetic of additive masking, for secure aggregation (protocols/secagg.py).

A masked value is fixed(w * x) plus keystreams that cancel in the sum over the
contributors (pairwise masks, each added by one member of a pair and
subtracted by the other) or that the requester removes once it may (self
masks). Sums are taken mod 2^64, so every mask cancels bit-exactly, and each
masked value on its own is uniformly distributed. This module has the pieces:
the pair secret two roster members derive from their X25519 keys
(`pair_secret_from_shared`), the fixed-point encoding, and the keystreams.

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

Only floating-point entries are masked and summed; counters such as
BatchNorm's `num_batches_tracked` are not sent at all (the requester keeps its
own).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray
from torch import Tensor

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


_ZEROS = bytes(0)  # read-only zeros to encrypt into a keystream, grown on demand


def _zeros(nbytes: int) -> memoryview:
    global _ZEROS
    if len(_ZEROS) < nbytes:
        _ZEROS = bytes(nbytes)
    return memoryview(_ZEROS)[:nbytes]


def mask_stream(secret: bytes, entry: str, numel: int) -> Fixed:
    """The pair mask of one state-dict entry: `numel` uniform uint64 values
    (the ChaCha20 keystream, encrypted straight into the returned array)."""
    if len(secret) != PAIR_SECRET_BYTES:
        raise MaskingError("bad_secret", f"pair secret must be {PAIR_SECRET_BYTES} bytes")
    nonce = b"\x00" * 4 + hashlib.sha256(entry.encode()).digest()[:12]  # counter 0 + 96-bit nonce
    encryptor = Cipher(algorithms.ChaCha20(secret, nonce), mode=None).encryptor()
    out = np.empty(numel + 2, dtype="<u8")  # update_into wants 15 bytes of room beyond the data
    written = encryptor.update_into(_zeros(8 * numel), memoryview(out).cast("B"))
    assert written == 8 * numel
    return out[:numel]


# ---------------------------------------------------------------------- fixed point


def to_fixed(
    values: Tensor | NDArray[np.floating], bits: int = FIXED_POINT_BITS, *, scale: float = 1.0
) -> Fixed:
    """Float values (times `scale`) -> round(x * 2^bits) as two's-complement
    uint64; refuses non-finite values and |x| >= 2^MAX_VALUE_BITS. In torch,
    in place on one float64 copy (the state dicts of large models)."""
    x = (
        values.detach().to("cpu", torch.float64, copy=True)
        if isinstance(values, Tensor)
        else torch.tensor(np.asarray(values, dtype=np.float64))
    ).reshape(-1)
    if scale != 1.0:
        x.mul_(scale)
    if x.numel() and (
        not bool(torch.isfinite(x).all()) or float(x.abs().max()) >= 2.0**MAX_VALUE_BITS
    ):
        raise MaskingError(
            "out_of_range",
            f"values must be finite and below 2^{MAX_VALUE_BITS} in magnitude to be masked",
        )
    return x.mul_(2.0**bits).round_().to(torch.int64).numpy().view(np.uint64)


def from_fixed(values: Fixed, bits: int = FIXED_POINT_BITS) -> NDArray[np.float64]:
    return values.view(np.int64).astype(np.float64) / 2.0**bits
