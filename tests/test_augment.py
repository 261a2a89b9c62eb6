"""The batched augmentations against torchvision's per-image transforms (the
reference the module replaced): each operation on given parameters, and the
distributions of the random parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torchvision.transforms.v2 import functional as TF

from p2pfl.learning.data import augment as A


def pixels(n: int, c: int = 1, size: int = 28, seed: int = 0) -> torch.Tensor:
    """Whole pixel values with structure (a gradient, a bright blob, noise)."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    base = (xx * 5 + yy * 3).float() % 256
    blob = ((xx - size // 3) ** 2 + (yy - size // 2) ** 2 < (size // 4) ** 2).float() * 120
    noise = torch.randint(0, 60, (n, c, size, size), generator=g).float()
    return (base + blob + noise).clamp(0, 255).floor()


def as_u8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.uint8)


def close(ours: torch.Tensor, ref: torch.Tensor, off_by_one: float = 0.0) -> None:
    """Equal pixels, or (float rounding at an integer boundary) at most a share
    `off_by_one` of them one grey level apart."""
    diff = (ours.float() - ref.float()).abs()
    assert diff.max() <= (1 if off_by_one else 0), diff.max()
    assert (diff > 0).float().mean() <= off_by_one


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_every_randaugment_op_matches_torchvision(channels: int, sign: float) -> None:
    x = pixels(6, channels)
    h = w = x.shape[-1]
    mag = 0.27 * sign
    reference = {
        "Identity": lambda im: im,
        "ShearX": lambda im: TF.affine(
            im,
            angle=0.0,
            translate=[0, 0],
            scale=1.0,
            shear=[math.degrees(math.atan(0.09 * sign)), 0.0],
            center=[0, 0],
        ),
        "ShearY": lambda im: TF.affine(
            im,
            angle=0.0,
            translate=[0, 0],
            scale=1.0,
            shear=[0.0, math.degrees(math.atan(0.09 * sign))],
            center=[0, 0],
        ),
        "TranslateX": lambda im: TF.affine(
            im,
            angle=0.0,
            translate=[int(A._bin(150 / 331 * w) * sign), 0],
            scale=1.0,
            shear=[0.0, 0.0],
        ),
        "TranslateY": lambda im: TF.affine(
            im,
            angle=0.0,
            translate=[0, int(A._bin(150 / 331 * h) * sign)],
            scale=1.0,
            shear=[0.0, 0.0],
        ),
        "Rotate": lambda im: TF.rotate(im, angle=9.0 * sign),
        "Brightness": lambda im: TF.adjust_brightness(im, 1.0 + mag),
        "Color": lambda im: TF.adjust_saturation(im, 1.0 + mag),
        "Contrast": lambda im: TF.adjust_contrast(im, 1.0 + mag),
        "Sharpness": lambda im: TF.adjust_sharpness(im, 1.0 + mag),
        "Posterize": lambda im: TF.posterize(im, 7),
        "Solarize": lambda im: TF.solarize(im, 255.0 * A._bin(0.0, 1.0)),
        "AutoContrast": TF.autocontrast,
        "Equalize": TF.equalize,
    }
    assert tuple(reference) == A.OPS
    for index, name in enumerate(A.OPS):
        ops = torch.full((len(x),), index)
        ours = A.rand_augment_op(x, ops, torch.full((len(x),), sign))
        ref = torch.stack([reference[name](as_u8(im)) for im in x])
        # float rounding of a blend can land a pixel on the other side of an integer
        close(ours, ref, off_by_one=0.01 if name in ("Brightness", "Color", "Contrast") else 0.0)


def test_one_batch_mixes_operations_per_image_as_if_applied_one_by_one() -> None:
    x = pixels(len(A.OPS) * 2, 3, size=16, seed=1)
    ops = torch.arange(len(x)) % len(A.OPS)
    signs = torch.where(torch.arange(len(x)) % 3 == 0, -1.0, 1.0)
    mixed = A.rand_augment_op(x, ops, signs)
    for i in range(len(x)):
        alone = A.rand_augment_op(x[i : i + 1], ops[i : i + 1], signs[i : i + 1])
        assert torch.equal(mixed[i : i + 1], alone), A.OPS[int(ops[i])]


def test_weak_affine_matches_torchvision_for_given_parameters() -> None:
    x = pixels(5, 1).div(255)
    angles = torch.tensor([-9.7, -3.0, 0.0, 4.2, 10.0])
    tx = torch.tensor([-3.0, 0.0, 2.0, 1.0, 3.0])
    ty = torch.tensor([1.0, -2.0, 0.0, 3.0, -3.0])
    zero = torch.zeros(5)
    ours = A.warp(x, A.inverse_affine(angles, tx, ty, zero, zero, zero, zero))
    for i in range(5):
        ref = TF.affine(
            x[i],
            angle=float(angles[i]),
            translate=[int(tx[i]), int(ty[i])],
            scale=1.0,
            shear=[0.0, 0.0],
        )
        assert (ours[i] != ref).float().mean() < 0.01  # nearest sampling at exact pixel ties


def _moments(views: torch.Tensor) -> np.ndarray:
    """Per image: mean, spread and horizontal centre of mass (flip, translation)."""
    flat = views.flatten(1)
    xs = torch.arange(views.shape[-1]).float()
    mass = views.sum(dim=1)  # N, W: column sums
    centre = (mass * xs).sum(-1) / mass.sum(-1).clamp(min=1e-6)
    return torch.stack([flat.mean(1), flat.std(1), centre], 1).numpy()


@pytest.mark.parametrize("kind", ["weak", "strong"])
def test_views_follow_torchvision_distributions(kind: str) -> None:
    """Two-sample KS tests of per-image statistics, batched vs torchvision's
    per-image transforms, 2000 views each (seeded, so the test is exact)."""
    from torchvision.transforms import v2

    torch.manual_seed(0)
    image = pixels(1, 1, seed=3)[0]
    n = 2000
    weak = v2.Compose(
        [v2.RandomHorizontalFlip(0.5), v2.RandomAffine(degrees=10, translate=(0.1, 0.1))]
    )
    rand = v2.RandAugment(num_ops=2, magnitude=9)
    ref = []
    for _ in range(n):
        view = weak(image / 255.0)
        if kind == "strong":
            view = rand((view * 255).round().clamp(0, 255).to(torch.uint8)).float() / 255
        ref.append(view[0])
    normalised = (image / 255.0 - 0.5) / 0.5
    batch = normalised.expand(n, 1, -1, -1)
    fn = A.weak_augment_batch if kind == "weak" else A.strong_augment_batch
    ours = fn(batch)[:, 0] * 0.5 + 0.5
    a, b = _moments(ours), _moments(torch.stack(ref))
    for column, what in enumerate(("mean", "spread", "centre of mass")):
        result = stats.ks_2samp(a[:, column], b[:, column])
        assert result.pvalue > 0.001, (kind, what, result)


def test_flip_rate_and_the_translation_grid() -> None:
    torch.manual_seed(1)
    x = torch.zeros(4000, 1, 28, 28)
    x[..., 14, 3] = 1.0  # one lit pixel left of centre on the middle row
    views = A.weak_unit(x)
    cols = views.flatten(2).argmax(-1).squeeze(1) % 28
    flipped = (cols > 14).float().mean()
    assert abs(float(flipped) - 0.5) < 0.03  # p = 0.5, 4000 draws: 4 sigma = 0.032


def test_batches_stay_on_their_device_and_shape() -> None:
    for channels, size in ((1, 8), (3, 28), (4, 12)):
        x = torch.rand(7, channels, size, size) * 2 - 1
        for view in (A.weak_augment_batch(x), A.strong_augment_batch(x)):
            assert view.shape == x.shape and view.dtype == torch.float32
            assert view.min() >= -1.0 and view.max() <= 1.0
    with pytest.raises(ValueError, match="N,C,H,W"):
        A.weak_augment_batch(torch.zeros(3, 8, 8))
