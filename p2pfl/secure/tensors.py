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

This module encodes and is the codec's one entry point; the format's constants,
dtypes and `CodecError` are in tensor_format.py, the bounded decoder in
tensor_decode.py.

torch and numpy are imported on first use, not with this module (issue 31): a
relay, which encodes and decodes only tensor-free clear headers, starts without
them. A value can only be a torch tensor or a numpy array if its library was
imported, so the encoder asks `sys.modules` (once per payload) which types to test.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2pfl.secure.tensor_decode import decode
from p2pfl.secure.tensor_format import (
    ALIGN,
    MAX_DEPTH,
    MAX_DIMS,
    TENSOR_KEY,
    CodecError,
    dtypes,
    libs,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

_BIG = 4096  # bins at least this large become their own chunk instead of being copied

# (torch, numpy, torch dtype -> name, native-order numpy dtype -> name): built on the
# first tensor, then one global read per tensor.
_ENCODER: tuple[Any, Any, dict[Any, str], dict[Any, str]] | None = None


def _encoder() -> tuple[Any, Any, dict[Any, str], dict[Any, str]]:
    global _ENCODER
    if _ENCODER is None:
        torch, np = libs()
        table = dtypes()
        numpy_names = {v[1].newbyteorder("="): k for k, v in table.items() if k != "bfloat16"}
        _ENCODER = (torch, np, {v[0]: k for k, v in table.items()}, numpy_names)
    return _ENCODER


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
        # The tensor and numpy-scalar types that exist in this process, looked up once per
        # payload and never imported here: if torch or numpy never was, no value is one.
        torch = sys.modules.get("torch")
        np = sys.modules.get("numpy")
        arrays = (torch.Tensor,) if torch is not None else ()
        self.arrays: tuple[type, ...] = (*arrays, np.ndarray) if np is not None else arrays
        self.scalars: tuple[type, ...] = (np.generic,) if np is not None else ()

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
    torch, np, torch_names, numpy_names = _ENCODER or _encoder()
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype not in torch_names:
            raise CodecError("dtype_not_allowed", str(t.dtype))
        name = torch_names[t.dtype]
        t = t.contiguous()
        shape = list(t.shape)
        arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    else:
        arr = value
        key = arr.dtype.newbyteorder("=") if arr.dtype.byteorder in "<>=|" else arr.dtype
        if key not in numpy_names:
            raise CodecError("dtype_not_allowed", str(arr.dtype))
        name = numpy_names[key]
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
    elif isinstance(obj, w.arrays):
        _encode_tensor(w, obj)
    elif isinstance(obj, w.scalars):
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


def loads(buf: bytes | bytearray | memoryview) -> Any:
    return decode(buf)


# ----------------------------------------------------------------------------- helpers


def iter_tensors(obj: Any) -> Iterable[torch.Tensor]:
    torch = sys.modules.get("torch")
    if torch is None:  # never imported: nothing here can be a tensor
        return
    yield from _iter_tensors(obj, torch.Tensor)


def _iter_tensors(obj: Any, tensor_type: type) -> Iterable[torch.Tensor]:
    if isinstance(obj, tensor_type):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_tensors(v, tensor_type)
    elif isinstance(obj, list):
        for v in obj:
            yield from _iter_tensors(v, tensor_type)


def check_finite(obj: Any) -> None:
    """Raise CodecError('non_finite') if any floating tensor holds NaN or Inf."""
    for t in iter_tensors(obj):
        if not t.is_floating_point() or not t.numel():
            continue
        # NaN and Inf always make the sum non-finite; a finite sum proves the tensor
        # finite in one cheap pass. Only a non-finite sum (or an overflow of huge but
        # finite values) needs the exact element-wise check.
        if not bool(t.sum().isfinite()) and not bool(t.isfinite().all()):
            raise CodecError("non_finite", "tensor with NaN or Inf values")


def state_dict_nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())
