"""Payloads to msgpack bytes and back: state dicts, gradients, image buffers, metadata.

No pickle. A payload is a tree of dict (str keys), list, str, int, float, bool,
None, bytes, numpy arrays and torch tensors. A tensor travels as the msgpack map
{"$t": dtype, "shape": [...], "pad": bin, "data": bin} with a whitelisted dtype,
little-endian raw bytes; "pad" aligns "data" to 64 bytes from the payload start.

Decoding cost is bounded by the bytes received: every decoded object spends
units of a budget (one unit ~ 8 bytes of Python memory: a container 8 plus 1
per element, 3 per map entry, a number 3, a string or binary 6 plus its length
/ 8), and the budget is `ITEMS_FLOOR` + len(payload) / 8. So a payload never
costs much more memory decoded than its own size (a msgpack array of 24 Mi
empty maps, 24 MiB on the wire, once cost 1.7 GiB); a container whose declared
length would overspend is refused (`too_many_items`) before a single element
is allocated. Tensors view their bytes and cost a constant.

Copies: `encode` returns chunks that reference the tensors' own memory (tensor
bytes are copied zero times; only small framing is written). `decode` parses
msgpack itself and, when given a writable buffer (a bytearray, as the transport
receives into), returns tensors that view that buffer without copying. Every
malformed input raises `CodecError`, nothing else.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

TENSOR_KEY = "$t"
ALIGN = 64
MAX_DEPTH = 64
_BIG = 4096  # bins at least this large become their own chunk instead of being copied
# The decoding budget (module docstring): units of about 8 bytes of Python memory.
ITEM_BYTES = 8
ITEMS_FLOOR = 1 << 18  # any payload may cost 2 MiB of objects
_CONTAINER_UNITS = 8
_SCALAR_UNITS = 3
_STRING_UNITS = 6
_TENSOR_UNITS = 32

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
_TORCH_NAME = {v[0]: k for k, v in DTYPES.items()}
_NUMPY_NAME = {
    np.dtype(v[1]).newbyteorder("=") if k != "bfloat16" else None: k for k, v in DTYPES.items()
}
_NUMPY_NAME.pop(None, None)
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


# ----------------------------------------------------------------------------- encode


@dataclass
class Encoded:
    """An encoded payload as a list of bytes-like chunks (no tensor bytes copied)."""

    chunks: list[bytes | memoryview]
    nbytes: int

    def to_bytes(self) -> bytes:
        return b"".join(self.chunks)


class _Writer:
    def __init__(self) -> None:
        self.chunks: list[bytes | memoryview] = []
        self.head = bytearray()
        self.offset = 0  # bytes emitted before `head`

    @property
    def pos(self) -> int:
        return self.offset + len(self.head)

    def raw(self, data: bytes | memoryview) -> None:
        if len(data) >= _BIG:
            self.flush()
            self.chunks.append(data)
            self.offset += len(data)
        else:
            self.head += data

    def flush(self) -> None:
        if self.head:
            self.chunks.append(bytes(self.head))
            self.offset += len(self.head)
            self.head = bytearray()

    # msgpack primitives
    def nil(self) -> None:
        self.head.append(0xC0)

    def boolean(self, v: bool) -> None:
        self.head.append(0xC3 if v else 0xC2)

    def integer(self, v: int) -> None:
        h = self.head
        if 0 <= v < 128:
            h.append(v)
        elif -32 <= v < 0:
            h.append(v & 0xFF)
        elif 0 <= v < 2**64:
            h += b"\xcf" + struct.pack(">Q", v) if v >= 2**32 else b"\xce" + struct.pack(">I", v)
        elif -(2**63) <= v < 0:
            h += b"\xd3" + struct.pack(">q", v)
        else:
            raise CodecError("unsupported_value", f"integer {v} does not fit 64 bits")

    def double(self, v: float) -> None:
        self.head += b"\xcb" + struct.pack(">d", v)

    def string(self, v: str) -> None:
        data = v.encode("utf-8")
        n = len(data)
        if n < 32:
            self.head.append(0xA0 | n)
        elif n < 256:
            self.head += bytes((0xD9, n))
        elif n < 65536:
            self.head += b"\xda" + struct.pack(">H", n)
        else:
            self.head += b"\xdb" + struct.pack(">I", n)
        self.head += data

    def bin_header(self, n: int) -> None:
        if n < 256:
            self.head += bytes((0xC4, n))
        elif n < 65536:
            self.head += b"\xc5" + struct.pack(">H", n)
        elif n < 2**32:
            self.head += b"\xc6" + struct.pack(">I", n)
        else:
            raise CodecError("unsupported_value", "binary larger than 4 GiB")

    def binary(self, data: bytes | memoryview) -> None:
        self.bin_header(len(data))
        self.raw(data)

    def array_header(self, n: int) -> None:
        if n < 16:
            self.head.append(0x90 | n)
        elif n < 65536:
            self.head += b"\xdc" + struct.pack(">H", n)
        else:
            self.head += b"\xdd" + struct.pack(">I", n)

    def map_header(self, n: int) -> None:
        if n < 16:
            self.head.append(0x80 | n)
        elif n < 65536:
            self.head += b"\xde" + struct.pack(">H", n)
        else:
            self.head += b"\xdf" + struct.pack(">I", n)


def tensor_bytes(value: torch.Tensor | np.ndarray) -> tuple[str, list[int], memoryview]:
    """(dtype name, shape, little-endian bytes view) without copying contiguous CPU data."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype not in _TORCH_NAME:
            raise CodecError("dtype_not_allowed", str(t.dtype))
        name = _TORCH_NAME[t.dtype]
        t = t.contiguous()
        shape = list(t.shape)
        arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    else:
        arr = value
        key = arr.dtype.newbyteorder("=") if arr.dtype.byteorder in "<>=|" else arr.dtype
        if key not in _NUMPY_NAME:
            raise CodecError("dtype_not_allowed", str(arr.dtype))
        name = _NUMPY_NAME[key]
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        shape = list(arr.shape)
    if len(shape) > MAX_DIMS:
        raise CodecError("unsupported_value", f"tensor with {len(shape)} dimensions")
    view = memoryview(arr.reshape(-1)).cast("B") if arr.size else memoryview(b"")
    return name, shape, view


def _encode(w: _Writer, obj: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise CodecError("unsupported_value", "nesting too deep")
    if obj is None:
        w.nil()
    elif obj is True or obj is False:
        w.boolean(obj)
    elif isinstance(obj, int):
        w.integer(int(obj))
    elif isinstance(obj, float):
        w.double(obj)
    elif isinstance(obj, str):
        w.string(obj)
    elif isinstance(obj, bytes | bytearray | memoryview):
        w.binary(memoryview(obj).cast("B") if isinstance(obj, memoryview) else obj)
    elif isinstance(obj, torch.Tensor | np.ndarray):
        _encode_tensor(w, obj)
    elif isinstance(obj, np.generic):
        _encode(w, obj.item(), depth)
    elif isinstance(obj, dict):
        w.map_header(len(obj))
        for key, value in obj.items():
            if not isinstance(key, str):
                raise CodecError("unsupported_value", f"map key {key!r} is not a string")
            if key == TENSOR_KEY:
                raise CodecError("unsupported_value", f"map key {TENSOR_KEY!r} is reserved")
            w.string(key)
            _encode(w, value, depth + 1)
    elif isinstance(obj, list | tuple):
        w.array_header(len(obj))
        for item in obj:
            _encode(w, item, depth + 1)
    else:
        raise CodecError("unsupported_value", f"cannot encode {type(obj).__name__}")


def _encode_tensor(w: _Writer, value: torch.Tensor | np.ndarray) -> None:
    name, shape, data = tensor_bytes(value)
    w.map_header(4)
    w.string(TENSOR_KEY)
    w.string(name)
    w.string("shape")
    w.array_header(len(shape))
    for dim in shape:
        w.integer(int(dim))
    w.string("pad")
    # Position of the data after: bin8 pad header (2) + pad + "data" key (5) + bin32 header (5).
    pad = (-(w.pos + 2 + 5 + 5)) % ALIGN
    w.head += bytes((0xC4, pad)) + bytes(pad)
    w.string("data")
    w.head += b"\xc6" + struct.pack(">I", len(data))
    w.raw(data)


def encode(obj: Any) -> Encoded:
    """Payload tree -> chunks. Raises CodecError for values that cannot travel."""
    w = _Writer()
    _encode(w, obj, 0)
    w.flush()
    return Encoded(w.chunks, w.offset)


def dumps(obj: Any) -> bytes:
    return encode(obj).to_bytes()


# ----------------------------------------------------------------------------- decode


class _Reader:
    __slots__ = ("buf", "pos", "end", "writable", "budget")

    def __init__(self, buf: memoryview, writable: bool, budget: int) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.writable = writable
        self.budget = budget

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
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise CodecError("dtype_not_allowed", repr(dtype_name)[:40])
    _expect_key(r, "shape")
    shape = _decode(r, MAX_DEPTH - 1)
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)
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
    torch_dtype, np_dtype, itemsize = DTYPES[dtype_name]
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


def decode(buf: bytes | bytearray | memoryview, *, bounded: bool = True) -> Any:
    """Bytes -> payload tree. Tensors view `buf` when it is writable. Raises CodecError only.

    `bounded` (the default, for anything that came from the network): the
    decoding budget of the module docstring. Only this node's own files
    (checkpoints, outbox) are read with bounded=False."""
    view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
    budget = ITEMS_FLOOR + len(view) // ITEM_BYTES if bounded else sys.maxsize
    r = _Reader(view, writable=not view.readonly, budget=budget)
    try:
        obj = _decode(r, 0)
    except CodecError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError, struct.error) as exc:
        raise CodecError("malformed", f"{type(exc).__name__}: {exc}") from None
    if r.pos != r.end:
        raise CodecError("trailing_bytes", f"{r.end - r.pos} bytes after the payload")
    return obj


def loads(buf: bytes | bytearray | memoryview) -> Any:
    return decode(buf)


# ----------------------------------------------------------------------------- helpers


def iter_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from iter_tensors(v)


def check_finite(obj: Any) -> None:
    """Raise CodecError('non_finite') if any floating tensor holds NaN or Inf."""
    for t in iter_tensors(obj):
        if not t.is_floating_point() or not t.numel():
            continue
        # NaN and Inf always make the sum non-finite; a finite sum proves the tensor
        # finite in one cheap pass. Only a non-finite sum (or an overflow of huge but
        # finite values) needs the exact element-wise check.
        if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            raise CodecError("non_finite", "tensor with NaN or Inf values")


def state_dict_nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())
