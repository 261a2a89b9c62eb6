"""The wire format of p2pfl.secure.tensors, shared by its encoder (tensors.py)
and its decoder (tensor_decode.py): the tensor map's key, the alignment of
tensor bytes, nesting and dimension limits, the whitelisted dtypes, and the one
error every malformed payload raises.

torch and numpy are imported on the first tensor, not with this module: a
relay decodes only clear headers, msgpack maps without tensors, and must start
without paying ~4 s of torch imports (issue 31). `libs()` and `dtypes()` load
them once; the encoder and decoder keep what they need in a module global, so
a tensor costs one global read, not an import statement.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

TENSOR_KEY = "$t"
ALIGN = 64
MAX_DEPTH = 64

# dtype name -> (torch dtype attribute, numpy dtype used to view the bytes, itemsize)
DTYPE_SPECS: dict[str, tuple[str, str, int]] = {
    "float16": ("float16", "<f2", 2),
    "bfloat16": ("bfloat16", "<i2", 2),
    "float32": ("float32", "<f4", 4),
    "float64": ("float64", "<f8", 8),
    "int8": ("int8", "i1", 1),
    "uint8": ("uint8", "u1", 1),
    "int16": ("int16", "<i2", 2),
    "int32": ("int32", "<i4", 4),
    "int64": ("int64", "<i8", 8),
    "bool": ("bool", "?", 1),
}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
MAX_DIMS = 8

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("p2pfl.secure.tensors assumes a little-endian host")

_LIBS: tuple[ModuleType, ModuleType] | None = None
_DTYPES: dict[str, tuple[torch.dtype, np.dtype, int]] | None = None


def libs() -> tuple[ModuleType, ModuleType]:
    """(torch, numpy), imported on the first call and cached."""
    global _LIBS
    if _LIBS is None:
        import numpy
        import torch

        _LIBS = (torch, numpy)
    return _LIBS


def dtypes() -> dict[str, tuple[torch.dtype, np.dtype, int]]:
    """dtype name -> (torch dtype, numpy dtype, itemsize): DTYPE_SPECS resolved
    on the first call (which imports torch and numpy) and cached."""
    global _DTYPES
    if _DTYPES is None:
        torch, numpy = libs()
        _DTYPES = {
            name: (getattr(torch, attr), numpy.dtype(view), size)
            for name, (attr, view, size) in DTYPE_SPECS.items()
        }
    return _DTYPES


class CodecError(Exception):
    """Malformed or disallowed payload; `reason` is a short code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
