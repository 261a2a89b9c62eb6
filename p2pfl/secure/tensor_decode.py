"""The decoder of p2pfl.secure.tensors: msgpack bytes to a payload tree, parsed
here (no msgpack library), bounded by a budget of units spent per decoded
object (tensors.py's docstring), tensors viewing a writable buffer without a
copy. Every malformed input raises `CodecError`, nothing else. torch and
numpy load on the first tensor (tensor_format.py's docstring): a payload
without tensors, such as a relay's clear header, decodes without them.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import TYPE_CHECKING, Any

from p2pfl.secure.tensor_format import (
    DTYPE_SPECS,
    MAX_DEPTH,
    MAX_DIMS,
    TENSOR_KEY,
    CodecError,
    dtypes,
    libs,
)

if TYPE_CHECKING:
    import torch

# (torch, numpy, dtype table): loaded on the first tensor, then one global read per tensor.
_LOADED: tuple[Any, Any, dict[str, tuple[Any, Any, int]]] | None = None


def _load() -> tuple[Any, Any, dict[str, tuple[Any, Any, int]]]:
    global _LOADED
    if _LOADED is None:
        _LOADED = (*libs(), dtypes())
    return _LOADED


# The decoding budget (tensors.py's module docstring): units of about 8 bytes of Python memory.
ITEM_BYTES = 8
ITEMS_FLOOR = 1 << 18  # any payload may cost 2 MiB of objects
_CONTAINER_UNITS = 8
_SCALAR_UNITS = 3
_STRING_UNITS = 6
_TENSOR_UNITS = 32
# The most elements a tensor map may span: its data is one bin32 (< 2**32 bytes),
# so no honest tensor has more. Bounded for the product of its dims with a zero
# counted as one too: [2**40-1, 2**40-1, 0] holds no element, matches 0 data
# bytes, and its strides overflowed torch (a RuntimeError, not a CodecError).
MAX_ELEMENTS = 1 << 32


class _Reader:
    __slots__ = ("buf", "pos", "end", "writable", "budget", "tensors")

    def __init__(self, buf: memoryview, writable: bool, budget: int, tensors: bool = True) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.writable = writable
        self.budget = budget
        self.tensors = tensors

    def spend(self, units: int) -> None:
        self.budget -= units
        if self.budget < 0:
            raise CodecError(
                "too_many_items",
                f"decoding {self.end} bytes would cost more than {ITEM_BYTES} x their size "
                "in objects",
            )

    def take(self, n: int) -> memoryview:
        start = self.pos
        stop = start + n
        if n < 0 or stop > self.end:
            raise CodecError(
                "truncated", f"need {n} bytes at offset {start}, have {self.end - start}"
            )
        self.pos = stop
        return self.buf[start:stop]

    def byte(self) -> int:
        if self.pos >= self.end:
            raise CodecError("truncated", "unexpected end of payload")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def unpack(self, fmt: str, n: int) -> Any:
        return struct.unpack(fmt, self.take(n))[0]

    def container_len(self, n: int, per_item: int = 1) -> int:
        if n > self.end - self.pos:  # every element needs at least one byte
            raise CodecError("truncated", f"container of {n} items in {self.end - self.pos} bytes")
        self.spend(_CONTAINER_UNITS + per_item * n)  # before a single element exists
        return n


def _read_str(r: _Reader, n: int) -> str:
    r.spend(_STRING_UNITS + n // ITEM_BYTES)
    try:
        return str(r.take(n), "utf-8")
    except UnicodeDecodeError:
        raise CodecError("bad_string", "invalid UTF-8") from None


def _read_bin_len(r: _Reader, b: int) -> int | None:
    if b == 0xC4:
        return r.byte()
    if b == 0xC5:
        return r.unpack(">H", 2)
    if b == 0xC6:
        return r.unpack(">I", 4)
    return None


def _decode(r: _Reader, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CodecError("too_deep", f"nesting deeper than {MAX_DEPTH}")
    b = r.byte()
    if b <= 0x7F:
        return b
    if b >= 0xE0:
        return b - 0x100
    if 0xA0 <= b <= 0xBF:
        return _read_str(r, b & 0x1F)
    if 0x90 <= b <= 0x9F:
        return [_decode(r, depth + 1) for _ in range(r.container_len(b & 0x0F))]
    if 0x80 <= b <= 0x8F:
        return _decode_map(r, b & 0x0F, depth)
    if b == 0xC0:
        return None
    if b == 0xC2:
        return False
    if b == 0xC3:
        return True
    n = _read_bin_len(r, b)
    if n is not None:
        r.spend(_STRING_UNITS + n // ITEM_BYTES)
        return bytes(r.take(n))
    simple = {
        0xCA: (">f", 4),
        0xCB: (">d", 8),
        0xCC: (">B", 1),
        0xCD: (">H", 2),
        0xCE: (">I", 4),
        0xCF: (">Q", 8),
        0xD0: (">b", 1),
        0xD1: (">h", 2),
        0xD2: (">i", 4),
        0xD3: (">q", 8),
    }.get(b)
    if simple:
        r.spend(_SCALAR_UNITS)
        return r.unpack(*simple)
    if b == 0xD9:
        return _read_str(r, r.byte())
    if b == 0xDA:
        return _read_str(r, r.unpack(">H", 2))
    if b == 0xDB:
        return _read_str(r, r.unpack(">I", 4))
    if b == 0xDC:
        return [_decode(r, depth + 1) for _ in range(r.container_len(r.unpack(">H", 2)))]
    if b == 0xDD:
        return [_decode(r, depth + 1) for _ in range(r.container_len(r.unpack(">I", 4)))]
    if b == 0xDE:
        return _decode_map(r, r.unpack(">H", 2), depth)
    if b == 0xDF:
        return _decode_map(r, r.unpack(">I", 4), depth)
    raise CodecError(
        "unsupported_type", f"msgpack type byte 0x{b:02x} (ext types are not accepted)"
    )


def _decode_map(r: _Reader, n: int, depth: int) -> Any:
    n = r.container_len(n, per_item=3)  # a dict entry: hash, key and value
    if n == 4 and _peek_tensor(r):
        if not r.tensors:
            raise CodecError("tensor_not_allowed", "this payload carries no tensors")
        return _decode_tensor(r)
    out: dict[str, Any] = {}
    for _ in range(n):
        key = _decode(r, depth + 1)
        if not isinstance(key, str):
            raise CodecError("bad_key", "map keys must be strings")
        if key == TENSOR_KEY:
            raise CodecError("bad_tensor", "tensor map with unexpected layout")
        out[key] = _decode(r, depth + 1)
    return out


def _peek_tensor(r: _Reader) -> bool:
    return (
        r.end - r.pos >= 3 and r.buf[r.pos] == 0xA2 and bytes(r.buf[r.pos + 1 : r.pos + 3]) == b"$t"
    )


def _expect_key(r: _Reader, key: str) -> None:
    b = r.byte()
    if not 0xA0 <= b <= 0xBF or _read_str(r, b & 0x1F) != key:
        raise CodecError("bad_tensor", f"tensor map must have key {key!r} here")


def _decode_tensor(r: _Reader) -> torch.Tensor:
    r.spend(_TENSOR_UNITS)
    _expect_key(r, TENSOR_KEY)
    dtype_name = _decode(r, MAX_DEPTH)
    if not isinstance(dtype_name, str) or dtype_name not in DTYPE_SPECS:
        raise CodecError("dtype_not_allowed", repr(dtype_name)[:40])
    _expect_key(r, "shape")
    shape = _decode(r, MAX_DEPTH - 1)
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ELEMENTS for d in shape
        )
        or math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS  # Python ints: no overflow
    ):
        raise CodecError("bad_shape", repr(shape)[:60])
    _expect_key(r, "pad")
    pad_len = _read_bin_len(r, r.byte())
    if pad_len is None or pad_len >= 256:
        raise CodecError("bad_tensor", "pad must be a short binary")
    r.take(pad_len)
    _expect_key(r, "data")
    n = _read_bin_len(r, r.byte())
    if n is None:
        raise CodecError("bad_tensor", "data must be binary")
    torch, np, table = _LOADED or _load()
    torch_dtype, np_dtype, itemsize = table[dtype_name]
    count = math.prod(shape)
    if count * itemsize != n:
        raise CodecError(
            "size_mismatch", f"{dtype_name}{shape} needs {count * itemsize} bytes, got {n}"
        )
    data = r.take(n)
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if r.writable and (r.pos - n) % itemsize == 0:
        flat = torch.frombuffer(
            data, dtype=torch.int16 if dtype_name == "bfloat16" else torch_dtype
        )
    else:
        flat = torch.from_numpy(np.frombuffer(data, dtype=np_dtype).copy())
    if dtype_name == "bfloat16":
        flat = flat.view(torch.bfloat16)
    return flat.view(shape)


def decode(
    buf: bytes | bytearray | memoryview, *, bounded: bool = True, tensors: bool = True
) -> Any:
    """Bytes -> payload tree. Tensors view `buf` when it is writable. Raises CodecError only.

    `bounded` (the default, for anything that came from the network): the
    decoding budget of the module docstring. Only this node's own files
    (checkpoints, outbox) are read with bounded=False. `tensors=False` refuses
    a tensor map (`tensor_not_allowed`) before torch is imported: a frame's
    clear header, which a relay reads from anyone who connects (issue 31)."""
    view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
    budget = ITEMS_FLOOR + len(view) // ITEM_BYTES if bounded else sys.maxsize
    r = _Reader(view, writable=not view.readonly, budget=budget, tensors=tensors)
    try:
        obj = _decode(r, 0)
    except CodecError:
        raise
    except Exception as exc:  # noqa: BLE001 - the promise above: CodecError, nothing else
        # ValueError, struct.error, RecursionError, and whatever torch or numpy
        # raise on a case the checks missed (a RuntimeError once failed a pull
        # and made a push a 500 with nothing counted).
        raise CodecError("malformed", f"{type(exc).__name__}: {exc}"[:200]) from None
    if r.pos != r.end:
        raise CodecError("trailing_bytes", f"{r.end - r.pos} bytes after the payload")
    return obj
