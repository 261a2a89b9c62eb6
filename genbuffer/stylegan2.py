"""A compact class-conditional StyleGAN2 generator and the layers it shares with
the discriminator (`discriminator.py`).

Written from the papers' descriptions (Karras et al., "Analyzing and Improving
the Image Quality of StyleGAN", CVPR 2020, and "Training Generative Adversarial
Networks with Limited Data", NeurIPS 2020); no code of the reference
implementation is used.

Generator: z and a class embedding, each normalised to unit second moment, are
concatenated and mapped to w by an MLP with equalized learning rate and a 0.01
learning-rate multiplier. The synthesis network starts from a learned 4x4
constant; every layer is a 3x3 convolution whose input channels are scaled by a
per-sample style (modulation) and whose output channels are rescaled to unit
expected variance (demodulation), followed by per-pixel noise, bias and leaky
ReLU. Each resolution adds its RGB contribution to an upsampled running image
(the "skip" architecture).

Modulation is applied to activations rather than by building per-sample
weights (the two are mathematically equal); it is faster on CPUs and for small
batches. Resampling uses bilinear up- and average down-sampling.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SQRT2 = math.sqrt(2.0)
NoiseMode = Literal["random", "const", "none"]
MIN_RESOLUTION = 16
MAX_RESOLUTION = 256


def normalize_second_moment(x: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
    """Scale each vector so that the mean of its squared entries is 1."""
    return x * torch.rsqrt(x.square().mean(dim=dim, keepdim=True) + eps)


def leaky_relu_gain(x: Tensor) -> Tensor:
    """Leaky ReLU (slope 0.2) scaled by sqrt(2) so activations keep unit variance."""
    return F.leaky_relu(x, 0.2) * SQRT2


def channels_at(resolution: int, channel_base: int, channel_max: int) -> int:
    """Feature maps at a resolution: channel_base / resolution, capped by channel_max."""
    return max(1, min(channel_base // resolution, channel_max))


def check_resolution(resolution: int) -> int:
    if resolution < MIN_RESOLUTION or resolution > MAX_RESOLUTION or resolution & (resolution - 1):
        raise ValueError(
            f"resolution must be a power of two between {MIN_RESOLUTION} and {MAX_RESOLUTION}, got {resolution}"
        )
    return int(math.log2(resolution))


# ----------------------------------------------------------------------------- equalized layers


class EqualizedLinear(nn.Module):
    """Fully connected layer with weights stored at unit scale and scaled at run time.

    Storing N(0, 1/lr_multiplier) weights and multiplying by lr_multiplier/sqrt(fan_in)
    in the forward pass makes Adam's effective step size the same for every layer
    (equalized learning rate), and lr_multiplier < 1 slows a layer down.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        bias_init: float = 0.0,
        lr_multiplier: float = 1.0,
        activation: Literal["linear", "lrelu"] = "linear",
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / lr_multiplier)
        self.bias = (
            nn.Parameter(torch.full((out_features,), bias_init / lr_multiplier)) if bias else None
        )
        self.weight_gain = lr_multiplier / math.sqrt(in_features)
        self.bias_gain = lr_multiplier
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias * self.bias_gain if self.bias is not None else None
        x = F.linear(x, self.weight * self.weight_gain, bias)
        return leaky_relu_gain(x) if self.activation == "lrelu" else x


class EqualizedConv2d(nn.Module):
    """Plain convolution with equalized learning rate, optionally followed by 2x average pooling."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        bias: bool = True,
        activation: Literal["linear", "lrelu"] = "linear",
        down: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, kernel_size, kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.weight_gain = 1.0 / math.sqrt(in_channels * kernel_size * kernel_size)
        self.padding = kernel_size // 2
        self.activation = activation
        self.down = down

    def forward(self, x: Tensor) -> Tensor:
        x = F.conv2d(x, self.weight * self.weight_gain, self.bias, padding=self.padding)
        if self.down:
            x = F.avg_pool2d(x, 2)
        return leaky_relu_gain(x) if self.activation == "lrelu" else x


# ----------------------------------------------------------------------------- mapping


class MappingNetwork(nn.Module):
    """(z, class) -> w. With z_dim == 0 it maps the class alone (the discriminator's embedding)."""

    def __init__(
        self,
        z_dim: int,
        num_classes: int,
        w_dim: int,
        num_layers: int,
        *,
        lr_multiplier: float = 0.01,
        w_avg_beta: float = 0.995,
    ) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError("num_classes must be at least 1")
        self.z_dim = z_dim
        self.num_classes = num_classes
        self.w_dim = w_dim
        self.w_avg_beta = w_avg_beta
        self.class_embed = EqualizedLinear(num_classes, w_dim)
        features = [z_dim + w_dim] + [w_dim] * num_layers
        self.layers = nn.ModuleList(
            EqualizedLinear(a, b, lr_multiplier=lr_multiplier, activation="lrelu")
            for a, b in zip(features[:-1], features[1:], strict=True)
        )
        self.register_buffer("w_avg", torch.zeros(w_dim))

    def forward(
        self,
        z: Tensor | None,
        labels: Tensor,
        *,
        truncation_psi: float = 1.0,
        update_w_avg: bool = False,
    ) -> Tensor:
        # Always in fp32, also under autocast (as StyleGAN2-ADA): w and its running mean stay exact.
        with torch.autocast(labels.device.type, enabled=False):
            onehot = F.one_hot(labels.long(), self.num_classes).to(self.class_embed.weight.dtype)
            x = normalize_second_moment(self.class_embed(onehot))
            if self.z_dim > 0:
                if z is None:
                    raise ValueError("this mapping network needs a latent z")
                x = torch.cat([normalize_second_moment(z.float()), x], dim=1)
            for layer in self.layers:
                x = layer(x)
            if update_w_avg:
                self.w_avg.copy_(x.detach().mean(0).lerp(self.w_avg, self.w_avg_beta))
            if truncation_psi != 1.0:
                x = self.w_avg.lerp(x, truncation_psi)
            return x


# ----------------------------------------------------------------------------- synthesis


class ModulatedConv2d(nn.Module):
    """Convolution modulated by a style vector, optionally demodulated.

    For style s (one scale per input channel) the layer computes
    conv(x * s, weight) * d with d_o = 1 / sqrt(sum_{i,k} (weight_oik * s_i)^2):
    equal to convolving with the per-sample weight w'_oik = s_i w_oik normalised
    to unit L2 norm per output channel, so unit-variance inputs give
    unit-variance outputs whatever the style's magnitude (StyleGAN2, Sec. 2.2).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        w_dim: int,
        kernel_size: int = 3,
        *,
        demodulate: bool = True,
        up: bool = False,
    ) -> None:
        super().__init__()
        self.affine = EqualizedLinear(w_dim, in_channels, bias_init=1.0)
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, kernel_size, kernel_size))
        self.weight_gain = 1.0 / math.sqrt(in_channels * kernel_size * kernel_size)
        self.padding = kernel_size // 2
        self.demodulate = demodulate
        self.up = up

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        styles = self.affine(w)  # (B, in)
        weight = self.weight * self.weight_gain
        x = x * styles[:, :, None, None]
        if self.up:
            x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
        y = F.conv2d(x, weight, padding=self.padding)
        if self.demodulate:
            # sum_{i,k} (w_oik s_i)^2 = sum_i (sum_k w_oik^2) s_i^2
            energy = styles.square() @ weight.square().sum(dim=(2, 3)).t()  # (B, out)
            y = y * torch.rsqrt(energy + 1e-8)[:, :, None, None]
        return y


class SynthesisLayer(nn.Module):
    """Modulated 3x3 conv + per-pixel noise + bias + leaky ReLU."""

    def __init__(
        self, in_channels: int, out_channels: int, w_dim: int, resolution: int, *, up: bool
    ) -> None:
        super().__init__()
        self.conv = ModulatedConv2d(in_channels, out_channels, w_dim, 3, up=up)
        self.resolution = resolution
        self.noise_strength = nn.Parameter(torch.zeros([]))
        self.register_buffer("noise_const", torch.randn(resolution, resolution))
        self.bias = nn.Parameter(torch.zeros(out_channels))

    def forward(
        self,
        x: Tensor,
        w: Tensor,
        noise_mode: NoiseMode = "random",
        rng: torch.Generator | None = None,
    ) -> Tensor:
        y = self.conv(x, w)
        if noise_mode == "random":
            shape = (y.shape[0], 1, self.resolution, self.resolution)
            if rng is None:
                noise = torch.randn(shape, device=y.device, dtype=y.dtype)
            else:  # reproducible sampling: draw on the generator's device, then move
                noise = torch.randn(shape, generator=rng, device=rng.device).to(y.device, y.dtype)
            y = y + noise * self.noise_strength
        elif noise_mode == "const":
            y = y + self.noise_const * self.noise_strength
        return leaky_relu_gain(y + self.bias[None, :, None, None])


class ToImage(nn.Module):
    """1x1 modulated conv (no demodulation) from features to image channels."""

    def __init__(self, in_channels: int, img_channels: int, w_dim: int) -> None:
        super().__init__()
        self.conv = ModulatedConv2d(in_channels, img_channels, w_dim, 1, demodulate=False)
        self.bias = nn.Parameter(torch.zeros(img_channels))

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return self.conv(x, w) + self.bias[None, :, None, None]


class SynthesisBlock(nn.Module):
    """One resolution of the skip generator: (upsampling conv) + conv + to-image."""

    def __init__(
        self, in_channels: int, out_channels: int, w_dim: int, resolution: int, img_channels: int
    ) -> None:
        super().__init__()
        self.first = resolution == 4
        if self.first:
            self.const = nn.Parameter(torch.randn(out_channels, 4, 4))
            self.conv0 = None
        else:
            self.conv0 = SynthesisLayer(in_channels, out_channels, w_dim, resolution, up=True)
        self.conv1 = SynthesisLayer(out_channels, out_channels, w_dim, resolution, up=False)
        self.to_image = ToImage(out_channels, img_channels, w_dim)
        self.num_conv = 1 if self.first else 2

    def forward(
        self,
        x: Tensor | None,
        img: Tensor | None,
        ws: Tensor,
        noise_mode: NoiseMode,
        rng: torch.Generator | None,
    ) -> tuple[Tensor, Tensor]:
        """ws holds num_conv + 1 vectors: one per conv and one for the to-image layer."""
        k = 0
        if self.conv0 is None:
            x = self.const[None].expand(ws.shape[0], -1, -1, -1)
        else:
            assert x is not None
            x = self.conv0(x, ws[:, k], noise_mode, rng)
            k += 1
        x = self.conv1(x, ws[:, k], noise_mode, rng)
        k += 1
        contribution = self.to_image(x, ws[:, k])
        if img is None:
            img = contribution
        else:
            img = (
                F.interpolate(img, scale_factor=2.0, mode="bilinear", align_corners=False)
                + contribution
            )
        return x, img


class SynthesisNetwork(nn.Module):
    def __init__(
        self, w_dim: int, resolution: int, img_channels: int, channel_base: int, channel_max: int
    ) -> None:
        super().__init__()
        log2_res = check_resolution(resolution)
        self.resolutions = [2**i for i in range(2, log2_res + 1)]
        blocks = []
        in_channels = 0
        for res in self.resolutions:
            out_channels = channels_at(res, channel_base, channel_max)
            blocks.append(SynthesisBlock(in_channels, out_channels, w_dim, res, img_channels))
            in_channels = out_channels
        self.blocks = nn.ModuleList(blocks)
        # Each block's to-image layer shares its w with the next block's first conv.
        self.num_ws = sum(b.num_conv for b in self.blocks) + 1

    def forward(
        self, ws: Tensor, noise_mode: NoiseMode = "random", rng: torch.Generator | None = None
    ) -> Tensor:
        if ws.ndim == 2:
            ws = ws[:, None].expand(-1, self.num_ws, -1)
        x: Tensor | None = None
        img: Tensor | None = None
        start = 0
        for block in self.blocks:
            x, img = block(x, img, ws[:, start : start + block.num_conv + 1], noise_mode, rng)
            start += block.num_conv
        assert img is not None
        return img


# ----------------------------------------------------------------------------- generator


@dataclass(frozen=True)
class GeneratorSpec:
    """Everything needed to rebuild a generator from its state dict."""

    num_classes: int
    resolution: int = 32
    channels: int = 1
    z_dim: int = 128
    w_dim: int = 128
    mapping_layers: int = 4
    channel_base: int = 4096
    channel_max: int = 256

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Generator(nn.Module):
    """G(z, class) -> image in roughly [-1, 1], shape (B, channels, resolution, resolution)."""

    def __init__(self, spec: GeneratorSpec) -> None:
        super().__init__()
        self.spec = spec
        self.synthesis = SynthesisNetwork(
            spec.w_dim, spec.resolution, spec.channels, spec.channel_base, spec.channel_max
        )
        self.mapping = MappingNetwork(spec.z_dim, spec.num_classes, spec.w_dim, spec.mapping_layers)
        self.num_ws = self.synthesis.num_ws

    @property
    def z_dim(self) -> int:
        return self.spec.z_dim

    @property
    def num_classes(self) -> int:
        return self.spec.num_classes

    def forward(
        self,
        z: Tensor,
        labels: Tensor,
        *,
        truncation_psi: float = 1.0,
        noise_mode: NoiseMode = "random",
        rng: torch.Generator | None = None,
    ) -> Tensor:
        w = self.mapping(z, labels, truncation_psi=truncation_psi)
        return self.synthesis(w, noise_mode, rng)

    def mixed_ws(
        self, z: Tensor, labels: Tensor, mixing_prob: float, *, update_w_avg: bool = False
    ) -> Tensor:
        """Per-layer w for training, with style mixing regularization.

        With probability `mixing_prob` a sample switches, at a random layer, to the
        w of a second latent of the same class, so that neighbouring layers cannot
        rely on sharing one style.
        """
        w = self.mapping(z, labels, update_w_avg=update_w_avg)
        ws = w[:, None].repeat(1, self.num_ws, 1)
        if mixing_prob > 0:
            batch = z.shape[0]
            w2 = self.mapping(torch.randn_like(z), labels)
            cutoff = torch.randint(1, self.num_ws, (batch,), device=z.device)
            mixed = torch.rand(batch, device=z.device) < mixing_prob
            cutoff = torch.where(mixed, cutoff, torch.full_like(cutoff, self.num_ws))
            use_second = torch.arange(self.num_ws, device=z.device)[None, :] >= cutoff[:, None]
            ws = torch.where(use_second[:, :, None], w2[:, None], ws)
        return ws

    @torch.no_grad()
    def class_mean_w(self, label: int, num_samples: int = 512, seed: int = 0) -> Tensor:
        """Centre of W for one class: mean of the mapping of many latents."""
        rng = torch.Generator().manual_seed(seed)
        device = self.mapping.w_avg.device
        z = torch.randn(num_samples, self.z_dim, generator=rng).to(device)
        labels = torch.full((num_samples,), label, dtype=torch.long, device=device)
        return self.mapping(z, labels).mean(0)
