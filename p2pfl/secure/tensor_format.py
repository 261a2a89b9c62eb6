"""The wire format of p2pfl.secure.tensors, shared by its encoder (tensors.py)
and its decoder (tensor_decode.py): the tensor map's key, the alignment of
tensor bytes, nesting and dimension limits, the whitelisted dtypes, and the one
error every malformed payload raises.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

TENSOR_KEY = "$t"
ALIGN = 64
MAX_DEPTH = 64

# dtype name -> (torch dtype, numpy dtype used to view the bytes, itemsize)
DTYPES: dict[str, tuple[torch.dtype, np.dtype, int]] = {
    "float16": (torch.float16, np.dtype("<f2"), 2),
    "bfloat16": (torch.bfloat16, np.dtype("<i2"), 2),
    "float32": (torch.float32, np.dtype("<f4"), 4),
    "float64": (torch.float64, np.dtype("<f8"), 8),
    "int8": (torch.int8, np.dtype("i1"), 1),
    "uint8": (torch.uint8, np.dtype("u1"), 1),
    "int16": (torch.int16, np.dtype("<i2"), 2),
    "int32": (torch.int32, np.dtype("<i4"), 4),
    "int64": (torch.int64, np.dtype("<i8"), 8),
    "bool": (torch.bool, np.dtype("?"), 1),
}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
MAX_DIMS = 8

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("p2pfl.secure.tensors assumes a little-endian host")


class CodecError(Exception):
    """Malformed or disallowed payload; `reason` is a short code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
