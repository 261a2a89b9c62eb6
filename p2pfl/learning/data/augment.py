"""Augmentations of whole training batches, with per-image random parameters.

- weak: random horizontal flip (p = 0.5) + random affine jitter (rotation
  uniform in +-10 degrees, translation uniform in +-10 % of each side rounded to
  whole pixels, nearest-neighbour sampling, zero fill);
- strong: weak, then RandAugment (2 ops, magnitude 9 of 31 bins) on 8-bit
  pixels, then back to float.

These are the distributions of torchvision.transforms.v2's RandomHorizontalFlip,
RandomAffine(degrees=10, translate=(0.1, 0.1)) and RandAugment(2, 9), which this
module used to run image by image in Python (slower than the training step
itself). Here every random parameter is drawn per image, but each operation
runs once on the whole batch, on the batch's device (CPU or CUDA):

- every geometric operation (flip, rotation, translation, shear) is one inverse
  affine matrix per image, built as torchvision builds it, and one
  `grid_sample` over the batch (nearest, zero padding), so a given parameter
  gives torchvision's pixels exactly;
- every photometric operation of RandAugment (brightness, colour, contrast,
  sharpness, posterize, solarize, autocontrast, equalize) is torchvision's
  uint8 formula written on an N,C,H,W tensor of whole pixel values with a
  per-image factor (tests/test_augment.py compares each with torchvision's).

The batch helpers take and return the normalised float batches the training
loop uses (N,C,H,W in [-1, 1], see loaders.to_float_tensor), any number of
channels (colour on anything but 3 channels is the identity, as in torchvision)
and sizes down to 8x8. Randomness comes from torch's generator of the batch's
device, so `seed_everything` makes a run repeatable.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from p2pfl.learning.data.loaders import MEAN, STD

AugmentKind = Literal["none", "weak", "strong"]

WEAK_DEGREES = 10.0
WEAK_TRANSLATE = 0.1
RAND_OPS = 2
RAND_MAGNITUDE = 9
RAND_BINS = 31
# RandAugment's operations, in torchvision's order.
OPS = (
    "Identity",
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "Rotate",
    "Brightness",
    "Color",
    "Contrast",
    "Sharpness",
    "Posterize",
    "Solarize",
    "AutoContrast",
    "Equalize",
)
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
SIGNED = GEOMETRIC + ("Brightness", "Color", "Contrast", "Sharpness")


def _bin(top: float, bottom: float = 0.0) -> float:
    """Magnitude bin RAND_MAGNITUDE of torch.linspace(bottom, top, RAND_BINS)."""
    return float(torch.linspace(bottom, top, RAND_BINS)[RAND_MAGNITUDE])


# ---------------------------------------------------------------------- geometry


def inverse_affine(
    angle: Tensor, tx: Tensor, ty: Tensor, shear_x: Tensor, shear_y: Tensor, cx: Tensor, cy: Tensor
) -> Tensor:
    """N x 2 x 3 inverse affine matrices, torchvision's `_get_inverse_affine_matrix`
    (scale 1) for per-image angle and shears in degrees, translation in pixels and
    centre relative to the image centre."""
    rot, sx, sy = torch.deg2rad(angle), torch.deg2rad(shear_x), torch.deg2rad(shear_y)
    a = torch.cos(rot - sy) / torch.cos(sy)
    b = -torch.cos(rot - sy) * torch.tan(sx) / torch.cos(sy) - torch.sin(rot)
    c = torch.sin(rot - sy) / torch.cos(sy)
    d = -torch.sin(rot - sy) * torch.tan(sx) / torch.cos(sy) + torch.cos(rot)
    m0, m1, m3, m4 = d, -b, -c, a
    m2 = m0 * (-cx - tx) + m1 * (-cy - ty) + cx
    m5 = m3 * (-cx - tx) + m4 * (-cy - ty) + cy
    return torch.stack([m0, m1, m2, m3, m4, m5], dim=1).view(-1, 2, 3)


def warp(x: Tensor, theta: Tensor) -> Tensor:
    """Each image of x resampled through its inverse matrix (torchvision's
    `_affine_grid` + `grid_sample`, nearest, zero fill)."""
    n, _, h, w = x.shape
    xs = torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=x.device)
    ys = torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=x.device)
    base = torch.stack(
        [xs.expand(h, w), ys.unsqueeze(-1).expand(h, w), torch.ones(h, w, device=x.device)], -1
    )
    scale = torch.tensor([0.5 * w, 0.5 * h], device=x.device)
    rescaled = theta.to(x.device, torch.float32).transpose(1, 2) / scale
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(rescaled).view(n, h, w, 2)
    return F.grid_sample(x, grid, mode="nearest", padding_mode="zeros", align_corners=False)


def _zeros(n: int, device: torch.device) -> Tensor:
    return torch.zeros(n, device=device)


def weak_unit(x: Tensor) -> Tensor:
    """Weak view of a batch of [0, 1] images: flip, then RandomAffine's jitter."""
    n, _, h, w = x.shape
    dev = x.device
    flip = torch.rand(n, device=dev) < 0.5
    x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
    angle = torch.empty(n, device=dev).uniform_(-WEAK_DEGREES, WEAK_DEGREES)
    max_dx, max_dy = WEAK_TRANSLATE * w, WEAK_TRANSLATE * h
    tx = torch.empty(n, device=dev).uniform_(-max_dx, max_dx).round()
    ty = torch.empty(n, device=dev).uniform_(-max_dy, max_dy).round()
    zero = _zeros(n, dev)
    return warp(x, inverse_affine(angle, tx, ty, zero, zero, zero, zero))


# ---------------------------------------------------------------------- RandAugment on pixels


def _per_image(v: Tensor) -> Tensor:
    return v.view(-1, 1, 1, 1)


def _blend(x: Tensor, other: Tensor, ratio: Tensor) -> Tensor:
    """torchvision's `_blend` on uint8 values: x * r + other * (1 - r), clamped,
    truncated to whole pixels."""
    r = _per_image(ratio)
    return (x * r + other * (1.0 - r)).clamp_(0.0, 255.0).floor_()


def _grayscale(x: Tensor) -> Tensor:
    r, g, b = x.unbind(dim=1)
    return (r * 0.2989 + g * 0.587 + b * 0.114).unsqueeze(1).floor_()


def brightness(x: Tensor, factor: Tensor) -> Tensor:
    return _blend(x, torch.zeros_like(x), factor)


def color(x: Tensor, factor: Tensor) -> Tensor:
    if x.shape[1] != 3:
        return x  # saturation of a grey (or non-RGB) image: unchanged, as in torchvision
    return _blend(x, _grayscale(x), factor)


def contrast(x: Tensor, factor: Tensor) -> Tensor:
    grey = _grayscale(x) if x.shape[1] == 3 else x
    return _blend(x, grey.mean(dim=(1, 2, 3), keepdim=True), factor)


def sharpness(x: Tensor, factor: Tensor) -> Tensor:
    _, c, h, w = x.shape
    if h <= 2 or w <= 2:
        return x
    kernel = torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]], device=x.device) / 13
    blurred = F.conv2d(x, kernel.expand(c, 1, 3, 3), groups=c).round_()
    out = x.clone()
    inner = out[..., 1:-1, 1:-1]
    inner.add_((blurred - inner) * (1.0 - _per_image(factor)))
    return out.clamp_(0.0, 255.0).floor_()


def posterize(x: Tensor, bits: int) -> Tensor:
    step = float(2 ** (8 - bits))
    return torch.div(x, step, rounding_mode="floor") * step


def solarize(x: Tensor, threshold: float) -> Tensor:
    return torch.where(x >= threshold, 255.0 - x, x)


def autocontrast(x: Tensor) -> Tensor:
    low = x.amin(dim=(-2, -1), keepdim=True)
    high = x.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    inv_scale = torch.where(flat, torch.ones_like(high), (high - low) * (1.0 / 255.0))
    low = torch.where(flat, torch.zeros_like(low), low)
    return ((x - low) / inv_scale).clamp_(0.0, 255.0).floor_()


def equalize(x: Tensor) -> Tensor:
    """PIL's histogram equalization per image and channel (torchvision's
    `equalize_image`, batched)."""
    n, c, h, w = x.shape
    flat = x.reshape(n * c, h * w).long()
    hist = torch.zeros(n * c, 256, dtype=torch.int64, device=x.device)
    hist.scatter_add_(1, flat, torch.ones_like(flat))
    cum = hist.cumsum(dim=1)
    last = cum.argmax(dim=1, keepdim=True)
    step = torch.div(h * w - hist.gather(1, last), 255, rounding_mode="floor")
    lut = torch.div(cum[:, :-1] + step // 2, step.clamp(min=1), rounding_mode="floor").clamp_(
        0, 255
    )
    lut = torch.cat([torch.zeros_like(lut[:, :1]), lut], dim=1)
    out = lut.gather(1, flat).to(x.dtype)
    return torch.where(step.ne(0), out, x.reshape(n * c, h * w)).view(n, c, h, w)


def _geometry_of(op: str, sign: Tensor, h: int, w: int) -> Tensor:
    """The inverse matrices of one geometric RandAugment op for signed magnitudes."""
    n, dev = len(sign), sign.device
    zero = _zeros(n, dev)
    if op in ("ShearX", "ShearY"):  # sheared about the top-left corner
        shear = torch.rad2deg(torch.atan(sign * _bin(0.3)))
        cx, cy = torch.full((n,), -0.5 * w, device=dev), torch.full((n,), -0.5 * h, device=dev)
        sx, sy = (shear, zero) if op == "ShearX" else (zero, shear)
        return inverse_affine(zero, zero, zero, sx, sy, cx, cy)
    if op == "TranslateX":
        return inverse_affine(
            zero, (sign * _bin(150.0 / 331.0 * w)).trunc(), zero, zero, zero, zero, zero
        )
    if op == "TranslateY":
        return inverse_affine(
            zero, zero, (sign * _bin(150.0 / 331.0 * h)).trunc(), zero, zero, zero, zero
        )
    # Rotate: torchvision's rotate passes -angle to the same matrix
    return inverse_affine(-sign * _bin(30.0), zero, zero, zero, zero, zero, zero)


def rand_augment_op(x: Tensor, op: Tensor, sign: Tensor) -> Tensor:
    """One RandAugment slot: image i gets operation OPS[op[i]] with magnitude
    bin RAND_MAGNITUDE times sign[i] (+-1). `x` holds whole pixel values 0..255."""
    n, _, h, w = x.shape
    out = x.clone()
    geometric = torch.zeros(n, dtype=torch.bool, device=x.device)
    theta = inverse_affine(*([_zeros(n, x.device)] * 7))
    for index, name in enumerate(OPS):
        chosen = op == index
        if name == "Identity" or not bool(chosen.any()):
            continue
        if name in GEOMETRIC:
            theta[chosen] = _geometry_of(name, sign[chosen], h, w)
            geometric |= chosen
            continue
        sub, s = x[chosen], sign[chosen]
        if name == "Brightness":
            sub = brightness(sub, 1.0 + s * _bin(0.9))
        elif name == "Color":
            sub = color(sub, 1.0 + s * _bin(0.9))
        elif name == "Contrast":
            sub = contrast(sub, 1.0 + s * _bin(0.9))
        elif name == "Sharpness":
            sub = sharpness(sub, 1.0 + s * _bin(0.9))
        elif name == "Posterize":
            sub = posterize(sub, int(8 - round(RAND_MAGNITUDE / ((RAND_BINS - 1) / 4))))
        elif name == "Solarize":
            sub = solarize(sub, 255.0 * _bin(0.0, 1.0))
        elif name == "AutoContrast":
            sub = autocontrast(sub)
        else:
            sub = equalize(sub)
        out[chosen] = sub
    if bool(geometric.any()):
        out[geometric] = warp(x[geometric], theta[geometric])
    return out


def rand_augment(pixels: Tensor) -> Tensor:
    """RandAugment(RAND_OPS, RAND_MAGNITUDE) of whole pixel values 0..255, every
    image drawing its own operations and signs."""
    n = len(pixels)
    for _ in range(RAND_OPS):
        op = torch.randint(len(OPS), (n,), device=pixels.device)
        sign = torch.where(torch.rand(n, device=pixels.device) <= 0.5, -1.0, 1.0)
        pixels = rand_augment_op(pixels, op, sign)
    return pixels


# ---------------------------------------------------------------------- batch helpers


def _to_unit(x: Tensor) -> Tensor:
    return (x.float() * STD + MEAN).clamp_(0.0, 1.0)


def _to_normalised(x: Tensor) -> Tensor:
    return (x - MEAN) / STD


def _check_batch(x: Tensor) -> None:
    if x.ndim != 4:
        raise ValueError(f"expected an N,C,H,W batch, got shape {tuple(x.shape)}")


def weak_augment_batch(x: Tensor) -> Tensor:
    """Weak view of every image of a normalised float batch (same shape and device, float32)."""
    _check_batch(x)
    if len(x) == 0:
        return x.float()
    return _to_normalised(weak_unit(_to_unit(x)))


def strong_augment_batch(x: Tensor) -> Tensor:
    """Strong view (weak + RandAugment on 8-bit pixels) of every image of a normalised float batch."""
    _check_batch(x)
    if len(x) == 0:
        return x.float()
    pixels = (weak_unit(_to_unit(x)) * 255.0).round_().clamp_(0.0, 255.0)
    return _to_normalised(rand_augment(pixels) / 255.0)


def augment_batch(x: Tensor, kind: AugmentKind) -> Tensor:
    """Dispatch on 'none' | 'weak' | 'strong'."""
    if kind == "none":
        return x
    if kind == "weak":
        return weak_augment_batch(x)
    if kind == "strong":
        return strong_augment_batch(x)
    raise ValueError(f"unknown augmentation {kind!r}: use 'none', 'weak' or 'strong'")
