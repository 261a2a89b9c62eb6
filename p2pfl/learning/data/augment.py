"""Augmentations on image tensors (torchvision.transforms.v2).

- weak: random horizontal flip + small random rotation/translation;
- strong: weak, then RandAugment (on uint8, as several of its ops need integer
  pixels), then back to float.

The per-image transforms work on C,H,W tensors in [0, 1] (weak) or uint8
(RandAugment) with 1, 3 or 4 channels and sizes down to 8x8. The batch helpers
take and return the normalised float batches the training loop uses
(N,C,H,W in [-1, 1], see loaders.to_float_tensor) and draw fresh random
parameters for every image. Randomness comes from torch's global generator, so
`seed_everything` makes a run repeatable.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torchvision.transforms import v2

from p2pfl.learning.data.loaders import MEAN, STD

AugmentKind = Literal["none", "weak", "strong"]


def weak_transform(degrees: float = 10.0, translate: float = 0.1) -> v2.Transform:
    """Flip + small affine jitter for one float C,H,W image in [0, 1]."""
    return v2.Compose(
        [
            v2.RandomHorizontalFlip(p=0.5),
            v2.RandomAffine(degrees=degrees, translate=(translate, translate), fill=0.0),
        ]
    )


def randaugment_transform(num_ops: int = 2, magnitude: int = 9) -> v2.Transform:
    """RandAugment for one uint8 C,H,W image."""
    return v2.RandAugment(num_ops=num_ops, magnitude=magnitude)


def _to_unit(x: Tensor) -> Tensor:
    return (x.float() * STD + MEAN).clamp_(0.0, 1.0)


def _to_normalised(x: Tensor) -> Tensor:
    return (x - MEAN) / STD


def _check_batch(x: Tensor) -> None:
    if x.ndim != 4:
        raise ValueError(f"expected an N,C,H,W batch, got shape {tuple(x.shape)}")


def weak_augment_batch(x: Tensor) -> Tensor:
    """Weak view of every image of a normalised float batch (same shape, float32)."""
    _check_batch(x)
    transform = weak_transform()
    unit = _to_unit(x)
    out = torch.stack([transform(image) for image in unit])
    return _to_normalised(out)


def strong_augment_batch(x: Tensor) -> Tensor:
    """Strong view (weak + RandAugment) of every image of a normalised float batch."""
    _check_batch(x)
    weak = weak_transform()
    rand = randaugment_transform()
    unit = _to_unit(x)
    views = []
    for image in unit:
        pixels = (weak(image) * 255.0).round().clamp(0, 255).to(torch.uint8)
        views.append(rand(pixels).float() / 255.0)
    return _to_normalised(torch.stack(views)).to(x.device)


def augment_batch(x: Tensor, kind: AugmentKind) -> Tensor:
    """Dispatch on 'none' | 'weak' | 'strong'."""
    if kind == "none":
        return x
    if kind == "weak":
        return weak_augment_batch(x)
    if kind == "strong":
        return strong_augment_batch(x)
    raise ValueError(f"unknown augmentation {kind!r}: use 'none', 'weak' or 'strong'")
