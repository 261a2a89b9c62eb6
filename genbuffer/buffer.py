"""Synthetic buffers: class-conditional samples as uint8 images + labels, ready for the wire.

A buffer is the dict {"images": uint8 (N, C, H, W), "labels": int64 (N,),
"content_hash": sha256 hex}. The hash covers the image bytes followed by the
label bytes (little-endian int64), so a receiver can check what it got and a
sender can refer to a buffer by hash. `buffer_to_bytes`/`buffer_from_bytes`
use the project's tensor codec (no pickle). The same generator, size, class
mode and seed always give the same buffer on the same device type.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from typing import Literal, TypedDict

import numpy as np
import torch
from torch import Tensor

from p2pfl.secure.tensors import CodecError, dumps, loads

from .errors import SyntheticBufferError
from .stylegan2 import Generator

PerClass = Literal["balanced", "prior"]


class SyntheticBuffer(TypedDict):
    images: Tensor  # uint8 (N, C, H, W)
    labels: Tensor  # int64 (N,)
    content_hash: str


def class_counts(
    size: int, num_classes: int, mode: PerClass, prior: Sequence[float] | None = None
) -> list[int]:
    """How many images of each class: equal shares, or proportional to `prior` (largest remainders)."""
    if size < 0 or num_classes < 1:
        raise ValueError("size must be >= 0 and num_classes >= 1")
    if mode == "balanced":
        weights = np.ones(num_classes)
    elif mode == "prior":
        if prior is None or len(prior) != num_classes:
            raise SyntheticBufferError(
                "no_label_prior",
                "per_class 'prior' needs the local label prior (one weight per class)",
            )
        weights = np.clip(np.asarray(prior, dtype=np.float64), 0, None)
        if weights.sum() <= 0:
            raise SyntheticBufferError("no_label_prior", "the label prior has no positive weight")
    else:
        raise ValueError(f"unknown per-class mode {mode!r}")
    exact = size * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    remainder = size - int(counts.sum())
    # Ties go to the lower class index (stable sort on the negated fractional parts).
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:remainder]] += 1
    return [int(c) for c in counts]


def to_uint8(images: Tensor) -> Tensor:
    """[-1, 1] floats -> uint8 in [0, 255] (round half away from zero after clamping)."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def buffer_content_hash(images: Tensor, labels: Tensor) -> str:
    digest = hashlib.sha256()
    digest.update(images.detach().cpu().contiguous().numpy().tobytes())
    digest.update(
        labels.detach().cpu().to(torch.int64).contiguous().numpy().astype("<i8").tobytes()
    )
    return digest.hexdigest()


@torch.no_grad()
def sample_buffer(
    generator: Generator,
    size: int = 512,
    *,
    per_class: PerClass = "balanced",
    label_prior: Sequence[float] | None = None,
    seed: int = 0,
    truncation_psi: float = 1.0,
    batch_size: int = 128,
) -> SyntheticBuffer:
    """Generate `size` class-conditional images; deterministic for (generator, seed) on one device type."""
    counts = class_counts(size, generator.num_classes, per_class, label_prior)
    rng = torch.Generator().manual_seed(seed)
    labels = torch.repeat_interleave(torch.arange(generator.num_classes), torch.tensor(counts))
    labels = labels[torch.randperm(len(labels), generator=rng)]
    device = next(generator.parameters()).device
    was_training = generator.training
    generator.eval()
    chunks = []
    for start in range(0, size, batch_size):
        chunk_labels = labels[start : start + batch_size]
        z = torch.randn(len(chunk_labels), generator.z_dim, generator=rng)
        images = generator(
            z.to(device),
            chunk_labels.to(device),
            truncation_psi=truncation_psi,
            noise_mode="random",
            rng=rng,
        )
        chunks.append(to_uint8(images).cpu())
    generator.train(was_training)
    shape = (0, generator.spec.channels, generator.spec.resolution, generator.spec.resolution)
    images_u8 = torch.cat(chunks) if chunks else torch.zeros(shape, dtype=torch.uint8)
    labels = labels.to(torch.int64)
    return {
        "images": images_u8,
        "labels": labels,
        "content_hash": buffer_content_hash(images_u8, labels),
    }


def check_buffer_layout(
    buffer: object,
    *,
    image_shape: tuple[int, int, int] | None = None,
    max_images: int | None = None,
    channels: Collection[int] | None = None,
    sides: Collection[int] | None = None,
) -> None:
    """The checks of `verify_buffer` that read no pixel: the schema, the image
    count and the image shape (cheap, whatever the buffer's size)."""
    if not isinstance(buffer, dict) or set(buffer) != {"images", "labels", "content_hash"}:
        raise SyntheticBufferError(
            "buffer_schema", "a buffer is a dict with exactly images, labels, content_hash"
        )
    images, labels = buffer["images"], buffer["labels"]
    if not isinstance(images, Tensor) or images.dtype != torch.uint8 or images.ndim != 4:
        raise SyntheticBufferError(
            "buffer_schema", "images must be a uint8 tensor shaped (N, C, H, W)"
        )
    if max_images is not None and not 1 <= images.shape[0] <= max_images:
        raise SyntheticBufferError(
            "buffer_count", f"{images.shape[0]} images, expected 1 to {max_images}"
        )
    shape = tuple(int(n) for n in images.shape[1:])
    if image_shape is not None and shape != tuple(image_shape):
        raise SyntheticBufferError(
            "buffer_shape",
            f"images of shape {shape}, expected (C, H, W) = {tuple(image_shape)}",
        )
    c, h, w = shape
    if channels is not None and c not in channels:
        raise SyntheticBufferError(
            "buffer_shape", f"images of {c} channels, expected one of {sorted(channels)}"
        )
    if sides is not None and not (h == w and h in sides):
        raise SyntheticBufferError(
            "buffer_shape", f"images of {h}x{w} px, expected square, a side in {sorted(sides)}"
        )
    if (
        not isinstance(labels, Tensor)
        or labels.dtype != torch.int64
        or labels.shape != (images.shape[0],)
    ):
        raise SyntheticBufferError(
            "buffer_schema", "labels must be an int64 tensor with one label per image"
        )


def verify_buffer(
    buffer: object,
    *,
    num_classes: int | None = None,
    image_shape: tuple[int, int, int] | None = None,
    max_images: int | None = None,
    channels: Collection[int] | None = None,
    sides: Collection[int] | None = None,
) -> SyntheticBuffer:
    """Check a received buffer's schema and hash; returns it typed, or raises SyntheticBufferError.

    `image_shape` (C, H, W): every image must have exactly that shape, else
    `buffer_shape`; `channels` and `sides`: bounds instead of one shape (C one
    of `channels`, H == W one of `sides`; what a FedER receiver passes, the
    federation's bounds, since sites may make buffers of different shapes).
    `max_images`: the buffer must hold 1 to that many images, else
    `buffer_count`. All are checked before anything reads the pixels
    (`check_buffer_layout`)."""
    check_buffer_layout(
        buffer, image_shape=image_shape, max_images=max_images, channels=channels, sides=sides
    )
    assert isinstance(buffer, dict)
    images, labels, digest = buffer["images"], buffer["labels"], buffer["content_hash"]
    if len(labels) and (
        labels.min() < 0 or (num_classes is not None and labels.max() >= num_classes)
    ):
        raise SyntheticBufferError("buffer_labels", f"labels outside [0, {num_classes})")
    if not isinstance(digest, str) or digest != buffer_content_hash(images, labels):
        raise SyntheticBufferError(
            "buffer_hash", "content_hash does not match the images and labels"
        )
    return {"images": images, "labels": labels, "content_hash": digest}


def buffer_to_bytes(buffer: SyntheticBuffer) -> bytes:
    return dumps(dict(buffer))


def buffer_from_bytes(
    data: bytes | bytearray | memoryview,
    *,
    num_classes: int | None = None,
    image_shape: tuple[int, int, int] | None = None,
    max_images: int | None = None,
) -> SyntheticBuffer:
    try:
        decoded = loads(data)
    except CodecError as exc:
        raise SyntheticBufferError("buffer_decode", f"not a tensor-codec payload: {exc}") from None
    return verify_buffer(
        decoded, num_classes=num_classes, image_shape=image_shape, max_images=max_images
    )
