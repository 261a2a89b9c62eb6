"""The class-conditional StyleGAN2 discriminator (Karras et al., CVPR 2020),
built from the equalized layers in `stylegan2.py`.

Residual blocks down to 4x4, a minibatch-standard-deviation feature, and
projection conditioning: the output features are dot-multiplied with a mapped
class embedding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from .stylegan2 import (
    SQRT2,
    EqualizedConv2d,
    EqualizedLinear,
    MappingNetwork,
    channels_at,
    check_resolution,
)


@dataclass(frozen=True)
class DiscriminatorSpec:
    num_classes: int
    resolution: int = 32
    channels: int = 1
    channel_base: int = 4096
    channel_max: int = 256
    cmap_dim: int = 128
    mapping_layers: int = 2
    mbstd_group_size: int = 4

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class DiscriminatorBlock(nn.Module):
    """Residual block: two 3x3 convs (the second downsamples) plus a 1x1 downsampling shortcut."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv0 = EqualizedConv2d(in_channels, in_channels, 3, activation="lrelu")
        self.conv1 = EqualizedConv2d(in_channels, out_channels, 3, activation="lrelu", down=True)
        self.shortcut = EqualizedConv2d(in_channels, out_channels, 1, bias=False, down=True)

    def forward(self, x: Tensor) -> Tensor:
        # Divide the sum by sqrt(2) so the block keeps the signal's variance.
        return (self.shortcut(x) + self.conv1(self.conv0(x))) / SQRT2


def minibatch_stddev(x: Tensor, group_size: int) -> Tensor:
    """Append one feature map: the average std of the features within groups of samples.

    It lets the discriminator see how varied a batch is, which penalises a generator
    that collapses to few outputs.
    """
    batch, channels, height, width = x.shape
    group = min(group_size, batch)
    while batch % group:
        group -= 1
    grouped = x.reshape(group, batch // group, channels, height, width)
    std = (grouped.var(dim=0, unbiased=False) + 1e-8).sqrt()  # (batch/group, C, H, W)
    per_group = std.mean(dim=(1, 2, 3))  # (batch/group,)
    feature = per_group.repeat(group)[:, None, None, None].expand(batch, 1, height, width)
    return torch.cat([x, feature], dim=1)


class Discriminator(nn.Module):
    """D(image, class) -> one logit per image (real > 0)."""

    def __init__(self, spec: DiscriminatorSpec) -> None:
        super().__init__()
        self.spec = spec
        log2_res = check_resolution(spec.resolution)
        top = channels_at(spec.resolution, spec.channel_base, spec.channel_max)
        self.from_image = EqualizedConv2d(spec.channels, top, 1, activation="lrelu")
        blocks = []
        for i in range(log2_res, 2, -1):  # resolution ... 8 -> each halves
            blocks.append(
                DiscriminatorBlock(
                    channels_at(2**i, spec.channel_base, spec.channel_max),
                    channels_at(2 ** (i - 1), spec.channel_base, spec.channel_max),
                )
            )
        self.blocks = nn.ModuleList(blocks)
        last = channels_at(4, spec.channel_base, spec.channel_max)
        self.epilogue_conv = EqualizedConv2d(last + 1, last, 3, activation="lrelu")
        self.epilogue_fc = EqualizedLinear(last * 16, last, activation="lrelu")
        self.epilogue_out = EqualizedLinear(last, spec.cmap_dim)
        self.class_mapping = MappingNetwork(0, spec.num_classes, spec.cmap_dim, spec.mapping_layers)

    def forward(self, img: Tensor, labels: Tensor) -> Tensor:
        x = self.from_image(img)
        for block in self.blocks:
            x = block(x)
        x = minibatch_stddev(x, self.spec.mbstd_group_size)
        x = self.epilogue_conv(x)
        x = self.epilogue_fc(x.flatten(1))
        features = self.epilogue_out(x)
        # Projection conditioning: score = <features, embedding(class)> / sqrt(dim).
        cmap = self.class_mapping(None, labels)
        return (features * cmap).sum(dim=1, keepdim=True) / math.sqrt(self.spec.cmap_dim)
