"""Adaptive discriminator augmentation (Karras et al., NeurIPS 2020), our own implementation.

Every image the discriminator sees, real or generated, passes through the same
random pipeline. Each transformation is applied independently with probability
p. All of them are differentiable in the image, so the generator is trained
through the augmentation and never learns to produce augmented images (the
augmentations "leak" only if p gets close to 1).

Geometric group (one resampling per image, reflection padding):
    horizontal flip, rotation by a multiple of 90 degrees, integer translation
    (up to 1/8 of the size), isotropic scale, arbitrary rotation, anisotropic
    scale.
Colour group:
    brightness (additive), contrast (multiplicative around the image mean),
    saturation (around the per-pixel channel mean; a no-op for one channel).

`AdaController` adjusts p from the overfitting heuristic r_t = E[sign(D(real))]:
every `interval` discriminator steps p moves by sign(r_t - target) * batch *
interval / speed_images, so it can go from 0 to 1 within `speed_images` images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _rotation(theta: Tensor) -> Tensor:
    """(B,) angles -> (B, 3, 3) rotation matrices."""
    c, s = torch.cos(theta), torch.sin(theta)
    m = torch.zeros(theta.shape[0], 3, 3, device=theta.device)
    m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1], m[:, 2, 2] = c, -s, s, c, 1.0
    return m


def _scaling(sx: Tensor, sy: Tensor) -> Tensor:
    m = torch.zeros(sx.shape[0], 3, 3, device=sx.device)
    m[:, 0, 0], m[:, 1, 1], m[:, 2, 2] = sx, sy, 1.0
    return m


def _translation(tx: Tensor, ty: Tensor) -> Tensor:
    m = torch.eye(3, device=tx.device).repeat(tx.shape[0], 1, 1)
    m[:, 0, 2], m[:, 1, 2] = tx, ty
    return m


class AdaptiveAugment(nn.Module):
    """The augmentation pipeline; `p` is set by the training loop (see AdaController)."""

    def __init__(
        self,
        p: float = 0.0,
        *,
        translate_max: float = 0.125,
        scale_std: float = 0.2,
        aniso_std: float = 0.2,
        brightness_std: float = 0.2,
        contrast_std: float = 0.5,
        saturation_std: float = 1.0,
    ) -> None:
        super().__init__()
        self.p = float(p)
        self.translate_max = translate_max
        self.scale_std = scale_std  # log2 std of the isotropic scale
        self.aniso_std = aniso_std
        self.brightness_std = brightness_std
        self.contrast_std = contrast_std  # log2 std
        self.saturation_std = saturation_std  # log2 std

    def _chosen(self, batch: int, device: torch.device) -> Tensor:
        """Which images get a transformation (probability p each)."""
        return torch.rand(batch, device=device) < self.p

    def geometric_matrix(self, batch: int, size: int, device: torch.device) -> Tensor:
        """(B, 3, 3) maps from output to input coordinates in [-1, 1] (identity when nothing applies)."""
        eye = torch.eye(3, device=device).repeat(batch, 1, 1)
        m = eye.clone()
        ones = torch.ones(batch, device=device)

        flip = self._chosen(batch, device)
        m = m @ _scaling(torch.where(flip, -ones, ones), ones)

        quarter = self._chosen(batch, device)
        k = torch.randint(1, 4, (batch,), device=device).float()
        m = m @ _rotation(torch.where(quarter, k, torch.zeros_like(k)) * (math.pi / 2))

        shift = self._chosen(batch, device)
        pixels = torch.round(
            (torch.rand(batch, 2, device=device) * 2 - 1) * self.translate_max * size
        )
        pixels = torch.where(shift[:, None], pixels, torch.zeros_like(pixels))
        m = m @ _translation(pixels[:, 0] * 2 / size, pixels[:, 1] * 2 / size)

        iso = self._chosen(batch, device)
        s = torch.exp2(torch.randn(batch, device=device) * self.scale_std)
        s = torch.where(iso, s, ones)
        m = m @ _scaling(s, s)

        rot = self._chosen(batch, device)
        theta = (torch.rand(batch, device=device) * 2 - 1) * math.pi
        m = m @ _rotation(torch.where(rot, theta, torch.zeros_like(theta)))

        aniso = self._chosen(batch, device)
        a = torch.exp2(torch.randn(batch, device=device) * self.aniso_std)
        a = torch.where(aniso, a, ones)
        m = m @ _scaling(a, 1 / a)
        return m

    def color(self, x: Tensor) -> Tensor:
        batch, channels = x.shape[:2]
        device = x.device
        zeros = torch.zeros(batch, device=device)

        bright = self._chosen(batch, device)
        b = torch.where(bright, torch.randn(batch, device=device) * self.brightness_std, zeros)
        x = x + b[:, None, None, None]

        contrast = self._chosen(batch, device)
        c = torch.where(
            contrast, torch.randn(batch, device=device) * self.contrast_std, zeros
        ).exp2()
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        x = mean + (x - mean) * c[:, None, None, None]

        if channels > 1:  # saturation of a single channel is a no-op
            sat = self._chosen(batch, device)
            s = torch.where(
                sat, torch.randn(batch, device=device) * self.saturation_std, zeros
            ).exp2()
            gray = x.mean(dim=1, keepdim=True)
            x = gray + (x - gray) * s[:, None, None, None]
        return x

    def forward(self, images: Tensor) -> Tensor:
        if self.p <= 0:
            return images
        batch, _, height, width = images.shape
        if height != width:
            raise ValueError("AdaptiveAugment expects square images")
        matrix = self.geometric_matrix(batch, height, images.device)
        grid = F.affine_grid(matrix[:, :2, :].float(), list(images.shape), align_corners=False)
        x = grid_sample_reflect(images, grid)
        return self.color(x)


# Bilinear grid sampling, reflection padding, align_corners=False, that can be differentiated
# twice in the image: R1 (the gradient of D(augment(x)) in x) is itself differentiated
# during D's step, and PyTorch's CUDA grid_sampler_2d_backward has no derivative
# ("derivative for aten::grid_sampler_2d_backward is not implemented"; the CPU happens to
# take a differentiable fallback). As StyleGAN2-ADA's grid_sample_gradfix: the sampling
# is linear in the image, so the derivative of its backward in the incoming gradient is
# the sampling itself; the grid never needs a second derivative (it has no parameters).
_BILINEAR, _REFLECTION = 0, 2


class _GridSample(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, images: Tensor, grid: Tensor) -> Tensor:
        ctx.save_for_backward(images, grid)
        return F.grid_sample(
            images, grid, mode="bilinear", padding_mode="reflection", align_corners=False
        )

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[Tensor, Tensor]:
        images, grid = ctx.saved_tensors  # type: ignore[attr-defined]
        grad_images, grad_grid = _GridSampleBackward.apply(grad_out, images, grid)
        return grad_images, grad_grid


class _GridSampleBackward(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor, images: Tensor, grid: Tensor
    ) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(grid)
        grad_images, grad_grid = torch.ops.aten.grid_sampler_2d_backward(
            grad_out, images, grid, _BILINEAR, _REFLECTION, False, [True, True]
        )
        return grad_images, grad_grid

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad2_images: Tensor, grad2_grid: Tensor
    ) -> tuple[Tensor | None, None, None]:
        (grid,) = ctx.saved_tensors  # type: ignore[attr-defined]
        grad2_out = None
        if ctx.needs_input_grad[0]:  # type: ignore[attr-defined]
            grad2_out = _GridSample.apply(grad2_images, grid)
        return grad2_out, None, None


def grid_sample_reflect(images: Tensor, grid: Tensor) -> Tensor:
    """F.grid_sample(bilinear, reflection, align_corners=False), twice differentiable in images;
    computed in fp32 (under bf16 autocast too: the hand-written backward needs one dtype)."""
    return _GridSample.apply(images.float(), grid.float())


@dataclass
class AdaController:
    """Moves p towards the value where r_t = E[sign(D(real))] stays at `target` (ADA Sec. 2.4)."""

    batch_size: int
    target: float = 0.6
    interval: int = 4
    speed_images: int = 500_000
    p: float = 0.0
    sign_sum: float = 0.0
    sign_count: int = 0
    steps: int = 0
    last_rt: float | None = None

    def observe(self, real_logits: Tensor) -> float:
        """Record one discriminator step's logits on real images; returns the (possibly updated) p."""
        self.sign_sum += float(torch.sign(real_logits.detach()).sum())
        self.sign_count += int(real_logits.numel())
        self.steps += 1
        if self.steps % self.interval == 0 and self.sign_count > 0:
            self.last_rt = self.sign_sum / self.sign_count
            step = self.batch_size * self.interval / self.speed_images
            direction = (
                math.copysign(1.0, self.last_rt - self.target)
                if self.last_rt != self.target
                else 0.0
            )
            self.p = min(1.0, max(0.0, self.p + direction * step))
            self.sign_sum, self.sign_count = 0.0, 0
        return self.p

    def state_dict(self) -> dict[str, float | int | None]:
        return {
            "p": self.p,
            "sign_sum": self.sign_sum,
            "sign_count": self.sign_count,
            "steps": self.steps,
            "last_rt": self.last_rt,
        }

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        self.p = float(state["p"])  # type: ignore[arg-type]
        self.sign_sum = float(state["sign_sum"])  # type: ignore[arg-type]
        self.sign_count = int(state["sign_count"])  # type: ignore[arg-type]
        self.steps = int(state["steps"])  # type: ignore[arg-type]
        self.last_rt = None if state["last_rt"] is None else float(state["last_rt"])  # type: ignore[arg-type]
