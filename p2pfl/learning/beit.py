"""BEiT's masked image modelling around a timm ViT encoder (Fed-BEiT, Fed-MAE
paper Sec. III-B/C; Bao et al., BEiT).

Every patch of an image has a visual token (p2pfl.learning.tokenizer). About
40 % of the patches are masked in blocks (`blockwise_mask`, BEiT's
blockwise masking); the ViT encoder sees *every* patch, the masked ones
replaced by a learnable mask embedding [M], with position embeddings; a single
linear layer over the last layer's patch representations predicts the visual
token of each masked patch. The loss is the cross-entropy on the masked
patches only.

The encoder is built as Fed-MAE's is (timm ViT at the data's size, average
pooling after the final norm), so its weights load one to one into the
fine-tuning classifier (`p2pfl.learning.mae.create_pretrained_classifier`);
the mask embedding and the token head stay behind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.learning.mae import (
    checked_patch_size,
    pretraining_encoder,
    square_grid,
    with_positions,
)

BEIT_GRID_PATCHES = 196  # BEiT's 14 x 14 grid, for which its 16-patch minimum block was set
BEIT_MIN_BLOCK = 16
MIN_ASPECT = 0.3
BLOCK_ATTEMPTS = 10  # BEiT's tries per block before settling for less


# ---------------------------------------------------------------------- blockwise masking


def min_block_patches(num_patches: int) -> int:
    """BEiT's smallest block (16 patches of a 14 x 14 grid), scaled to the grid:
    16 x L / 196, at least 1 (7 x 7 -> 4)."""
    return max(1, round(BEIT_MIN_BLOCK * num_patches / BEIT_GRID_PATCHES))


def blockwise_mask(
    height: int,
    width: int,
    mask_ratio: float,
    rng: np.random.Generator,
    *,
    min_block: int | None = None,
    min_aspect: float = MIN_ASPECT,
) -> np.ndarray:
    """`mask_blocks`' mask alone."""
    return mask_blocks(height, width, mask_ratio, rng, min_block=min_block, min_aspect=min_aspect)[
        0
    ]


def mask_blocks(
    height: int,
    width: int,
    mask_ratio: float,
    rng: np.random.Generator,
    *,
    min_block: int | None = None,
    min_aspect: float = MIN_ASPECT,
) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """One image's mask (height x width, True where masked) by BEiT's blockwise
    masking: blocks of at least `min_block` patches (default: BEiT's 16, scaled
    to the grid) with an aspect ratio drawn log-uniformly in [min_aspect,
    1/min_aspect] (kept within it after rounding to whole patches), never as
    tall or as wide as the grid, placed at random, until round(mask_ratio x L) patches are
    masked; a block may overlap earlier ones and only adds what it newly covers
    without going past the target. Like BEiT's generator it can stop short of
    the target when no block fits (at most mask_ratio, as the paper writes).
    Returns the mask and the blocks placed, as (top, left, height, width)."""
    total = height * width
    target = max(1, min(total - 1, round(mask_ratio * total)))
    smallest = min(target, min_block if min_block is not None else min_block_patches(total))
    log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))
    mask = np.zeros((height, width), dtype=bool)
    blocks: list[tuple[int, int, int, int]] = []
    count = 0
    while count < target:
        budget = target - count
        added = 0
        for _ in range(BLOCK_ATTEMPTS):
            area = rng.uniform(smallest, max(smallest, budget))
            aspect = math.exp(rng.uniform(*log_aspect))
            h = int(round(math.sqrt(area * aspect)))
            w = int(round(math.sqrt(area / aspect)))
            fits = 1 <= h < height and 1 <= w < width  # BEiT: a block never spans the grid
            # rounding may leave a block under the minimum or outside the aspect
            # range: unlike BEiT, such a block is drawn again
            if fits and h * w >= smallest and min_aspect - 1e-9 <= h / w <= 1 / min_aspect + 1e-9:
                top = int(rng.integers(0, height - h + 1))
                left = int(rng.integers(0, width - w + 1))
                block = mask[top : top + h, left : left + w]
                new = h * w - int(block.sum())
                if 0 < new <= budget:
                    block[...] = True
                    blocks.append((top, left, h, w))
                    added = new
                    break
        if added == 0:
            break
        count += added
    return mask, blocks


def blockwise_masks(
    batch: int,
    grid: int,
    mask_ratio: float,
    rng: np.random.Generator,
    *,
    min_block: int | None = None,
) -> Tensor:
    """N,L boolean masks (row-major patches) for a batch of square grids."""
    masks = [
        blockwise_mask(grid, grid, mask_ratio, rng, min_block=min_block).reshape(-1)
        for _ in range(batch)
    ]
    return torch.from_numpy(np.stack(masks))


# ---------------------------------------------------------------------- the model


@dataclass
class BEiTOutput:
    loss: Tensor  # cross-entropy over the masked patches
    accuracy: Tensor  # share of masked patches whose token is predicted right
    masked: int  # masked patches in the batch


class BEiTPretrainer(nn.Module):
    """timm ViT encoder over all patches (masked ones replaced by the mask
    embedding) + a linear head over the codebook."""

    def __init__(
        self,
        encoder: nn.Module,
        *,
        codebook_size: int,
        mask_ratio: float = 0.4,
        min_block: int | None = None,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.grid = square_grid(encoder, "Fed-BEiT")
        self.num_patches = self.grid * self.grid
        self.mask_ratio = mask_ratio
        self.min_block = min_block  # None: BEiT's 16 of 196 patches, scaled to the grid
        self.codebook_size = codebook_size
        dim = encoder.embed_dim
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.token_head = nn.Linear(dim, codebook_size)
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.token_head.weight, std=0.02)
        nn.init.zeros_(self.token_head.bias)

    def patch_representations(self, images: Tensor, mask: Tensor) -> Tensor:
        """N,L,D last-layer representations of every patch, masked patches' inputs
        replaced by the mask embedding before the position embeddings are added."""
        enc = self.encoder
        tokens = enc.patch_embed(images)  # N,L,D
        w = mask[..., None].to(tokens.dtype)
        tokens = tokens * (1 - w) + self.mask_token.to(tokens.dtype) * w
        tokens, cls = with_positions(enc, tokens)
        h = torch.cat([cls.expand(len(images), -1, -1), tokens], dim=1)
        h = enc.norm_pre(enc.pos_drop(h))
        return enc.norm(enc.blocks(h))[:, 1:]

    def forward(self, images: Tensor, tokens: Tensor, mask: Tensor) -> BEiTOutput:
        """Cross-entropy of the predicted visual tokens at the masked patches only
        (mask: N,L bool; tokens: N,L indices)."""
        h = self.patch_representations(images, mask)
        logits = self.token_head(h[mask]).float()
        target = tokens[mask]
        loss = F.cross_entropy(logits, target)
        accuracy = (logits.argmax(dim=1) == target).float().mean()
        return BEiTOutput(loss, accuracy, int(mask.sum()))

    def encoder_state_dict(self) -> dict[str, Tensor]:
        """The encoder's weights (CPU clones), as the fine-tuning classifier names them."""
        return {k: v.detach().cpu().clone() for k, v in self.encoder.state_dict().items()}


def create_beit(
    name: str,
    *,
    in_chans: int,
    image_size: int,
    codebook_size: int,
    patch_size: int | None = None,
    encoder_depth: int | None = None,
    mask_ratio: float = 0.4,
    min_block: int | None = None,
) -> BEiTPretrainer:
    """A BEiT pre-trainer around timm ViT `name` (random weights)."""
    patch = checked_patch_size(image_size, in_chans, patch_size)
    encoder = pretraining_encoder(name, in_chans, image_size, patch, encoder_depth)
    return BEiTPretrainer(
        encoder, codebook_size=codebook_size, mask_ratio=mask_ratio, min_block=min_block
    )
