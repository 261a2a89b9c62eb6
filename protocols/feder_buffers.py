"""FedER's synthetic buffers (Sec. 4.2-4.3): making this site's buffer B_j
(its privacy-preserving generator, sampled and put through the privacy gate),
and checking a received one and turning it into replay images at the
classifier's input. The protocol itself, the ring and the relay intake are in
protocols/feder.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from genbuffer.buffer import verify_buffer
from genbuffer.config import GenbufferSection
from genbuffer.errors import SyntheticBufferError
from genbuffer.gate import GateDecision
from p2pfl.config import FedERParams
from p2pfl.learning.data.loaders import convert_images, to_float_tensor
from p2pfl.learning.train import LocalSite

if TYPE_CHECKING:  # genbuffer.train loads lpips: only when a generator is trained
    from genbuffer.train import ProgressFn

log = logging.getLogger(__name__)

# What a received buffer may be, federation-wide: sites set genbuffer.resolution,
# genbuffer.channels, their generator and protocol.buffer_size each for itself,
# so a receiver checks these bounds, not its own buffer's shape, and resizes the
# images to its classifier's input. Channels: what convert_images converts
# (grey, RGB, RGBA); sides: a generator's (a power of two, 16 to 256) and 8 px,
# the smallest classifier input; at most MAX_BUFFER_IMAGES images (also the
# most protocol.buffer_size may be).
BUFFER_CHANNELS = (1, 3, 4)
BUFFER_SIDES = (8, 16, 32, 64, 128, 256)
MAX_BUFFER_IMAGES = 2048
CONVERT_CHUNK = 256  # images resized at a time: bounds the float copy convert_images makes


def replay_images(buffer: dict[str, Any], image_size: int, channels: int) -> np.ndarray:
    """A uint8 buffer (N,C,H,W) as the classifier's images: uint8 (N, size, size, channels),
    resized CONVERT_CHUNK images at a time (the float copy of a chunk, not of the buffer)."""
    images = buffer["images"]
    chunks = [
        convert_images(
            images[i : i + CONVERT_CHUNK].permute(0, 2, 3, 1).contiguous().numpy(),
            image_size,
            channels,
        )
        for i in range(0, len(images), CONVERT_CHUNK)
    ]
    if not chunks:
        return np.zeros((0, image_size, image_size, channels), dtype=np.uint8)
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


def buffer_training_tensors(
    buffers: list[dict[str, Any]], image_size: int, channels: int
) -> tuple[Tensor, Tensor]:
    """uint8 synthetic buffers (N,C,H,W) -> normalised float images at the classifier's size."""
    xs = [to_float_tensor(replay_images(buffer, image_size, channels)) for buffer in buffers]
    ys = [buffer["labels"].long() for buffer in buffers]
    if not xs:
        return torch.zeros(0, channels, image_size, image_size), torch.zeros(0, dtype=torch.long)
    return torch.cat(xs), torch.cat(ys)


BUFFER_BOUNDS: dict[str, Any] = {
    "max_images": MAX_BUFFER_IMAGES,
    "channels": BUFFER_CHANNELS,
    "sides": BUFFER_SIDES,
}


def checked_buffer(
    buffer: object,
    *,
    num_classes: int | None,
    image_size: int,
    channels: int,
) -> tuple[dict[str, Any], np.ndarray]:
    """A received buffer verified (schema, count and shape within the
    federation's bounds, labels, hash) and its replay images at the
    classifier's input (`replay_images`), or SyntheticBufferError with the
    reason: whatever goes wrong making the images is `buffer_unusable`. Blocking."""
    checked = verify_buffer(buffer, num_classes=num_classes, **BUFFER_BOUNDS)
    try:
        images = replay_images(dict(checked), image_size, channels)
    except Exception as exc:  # noqa: BLE001 - a case the checks missed: the sender's, refused
        raise SyntheticBufferError("buffer_unusable", f"no replay images ({exc!r})"[:200]) from None
    return dict(checked), images


def is_sha256(value: object) -> bool:
    """A buffer's name: a SHA-256 in lower-case hex (what buffer_content_hash gives)."""
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def _perceptual_distance(section: GenbufferSection) -> Any:
    """The LPIPS network of the privacy loss and the gate, as genbuffer.lpips_* say."""
    from genbuffer.privacy import build_perceptual_distance
    from genbuffer.train import resolve_device

    return build_perceptual_distance(
        section.lpips_backbone,
        section.lpips_weights,
        min_size=section.lpips_min_size,
        device=resolve_device(section.device),
    )


def _members_and_holdout(site: LocalSite, section: GenbufferSection) -> tuple[Any, Any]:
    """The indices of the training images the GAN may see, and of the holdout
    the membership test compares them with (the same split every time)."""
    from genbuffer.audit import holdout_split

    return holdout_split(
        np.asarray(site.data.train_labels),
        section.holdout_fraction,
        section.holdout_min_images,
        section.seed,
    )


def make_buffer(
    params: FedERParams,
    site: LocalSite,
    section: GenbufferSection,
    out_dir: Path,
    seed: int,
    progress: ProgressFn | None = None,
) -> tuple[dict[str, Any], GateDecision | None]:
    """Load or train this site's privacy-preserving generator (its files in
    `out_dir`), sample B_j and put it through the privacy gate (blocking).
    `progress` is called at every GAN training iteration (genbuffer.progress).

    Returns the buffer and the gate's decision (None when the gate is switched
    off); the caller must not share a buffer the gate refused."""
    from genbuffer.buffer import sample_buffer
    from genbuffer.checkpoint import load_generator
    from genbuffer.train import resolve_device, train_generator
    from genbuffer.trainer import label_prior

    device = resolve_device(section.device)
    metric = None  # one LPIPS network for the privacy loss and the gate
    if not params.generator or section.privacy_gate:
        metric = _perceptual_distance(section)
    data = site.data
    # The membership test's holdout never reaches the GAN (a generator given by path must
    # have been trained the same way: `p2pfl-node genbuffer train` holds out the same images).
    members, _ = _members_and_holdout(site, section)
    if params.generator:
        generator_path = Path(params.generator)
    else:
        result = train_generator(
            data.train_uint8[members],
            np.asarray(data.train_labels)[members],
            data.num_classes,
            section,
            out_dir,
            metric=metric,
            progress=progress,
        )
        generator_path = result.generator_path
    generator, info = load_generator(generator_path, device)
    prior = info.label_prior or label_prior(
        torch.as_tensor(site.data.train_labels).long(), site.data.num_classes
    )
    buffer = dict(
        sample_buffer(
            generator,
            params.buffer_size,
            per_class=params.buffer_per_class,
            label_prior=prior,
            seed=seed,
        )
    )
    return buffer, gate_buffer(buffer, site, section, out_dir, seed, metric)


def gate_buffer(
    buffer: dict[str, Any],
    site: LocalSite,
    section: GenbufferSection,
    out_dir: Path,
    seed: int,
    metric: Any = None,
) -> GateDecision | None:
    """The privacy gate's decision on `buffer` against this site's training images
    (blocking; None, said loudly, when `genbuffer.privacy_gate` is off). Also run
    on a buffer a checkpoint kept: a review restarted a node made with the gate
    off, with the gate on, and its ungated buffer went on being shared unchecked."""
    from genbuffer.gate import check_buffer

    if not section.privacy_gate:
        log.warning(
            "PRIVACY GATE OFF (genbuffer.privacy_gate: false): synthetic buffer %s leaves this "
            "site WITHOUT being checked against the site's own images",
            buffer["content_hash"][:12],
        )
        return None
    if metric is None:
        metric = _perceptual_distance(section)
    data = site.data
    members, holdout = _members_and_holdout(site, section)
    return check_buffer(
        buffer,
        data.train_uint8[members],
        metric,
        section,
        out_dir,
        holdout_uint8=data.train_uint8[holdout],
        seed=seed,
        real_labels=np.asarray(data.train_labels)[members],
        holdout_labels=np.asarray(data.train_labels)[holdout],
    )
