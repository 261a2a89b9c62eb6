"""Fed-BEiT's local training: the tokenizer's (`TokenizerSite`, VQ-VAE loss) and
the masked-token pre-training's (`BEiTSite`), both `Trainer`s over every
local image, labelled or not (labels are not used). Optimizer, batches,
augmentation, state and statistics are Trainer's; only the loss and
`evaluate` differ. Also the figure of the token maps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from p2pfl.config import TrainingSection
from p2pfl.learning.beit import BEiTPretrainer, blockwise_masks
from p2pfl.learning.data import SiteData
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.mae_site import PretrainingSite, image_column, save_image_grid
from p2pfl.learning.tokenizer import VQTokenizer, codebook_usage

EVAL_MASK_SEED = 1234  # evaluation draws the same masks every time, so rounds compare
EVAL_BATCH = 256


class TokenizerSite(PretrainingSite):
    """The tokenizer's local training: VQ-VAE loss over every local image;
    `evaluate(split)` reports the reconstruction error and the codebook's use."""

    method = "Fed-BEiT's tokenizer training"

    def __init__(
        self,
        model: VQTokenizer,
        data: SiteData,
        training: TrainingSection,
        *,
        augment: str = "none",
        device: str | torch.device | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(model, data, training, augment=augment, device=device)
        self.tokenizer: VQTokenizer = model
        model.restart_generator = torch.Generator().manual_seed(seed)

    def loss(self, x: Tensor, y: Tensor, weight: Tensor | None | str = "site") -> Tensor:
        with self.autocast():
            return self.tokenizer(x).loss

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        images, _ = self._split_tensors(split)
        self.model.eval()
        total, count, tokens = 0.0, 0, []
        with torch.no_grad():
            for start in range(0, len(images), EVAL_BATCH):
                x = images[start : start + EVAL_BATCH].to(self.device)
                out = self.tokenizer(x)
                total += float(out.recon_loss) * len(x)
                count += len(x)
                tokens.append(out.tokens.cpu())
        usage = codebook_usage(torch.cat(tokens), self.tokenizer.codebook_size)
        return {"tokenizer_recon_loss": total / max(count, 1), **usage, "split": split, "n": count}


class BEiTSite(PretrainingSite):
    """Masked-token pre-training over every local image: the frozen tokenizer
    gives each (augmented) training image's tokens, blockwise masks are drawn
    from the site's seeded generator; `evaluate(split)` reports the token
    cross-entropy and accuracy on the masked patches with masks drawn from a
    fixed seed (so successive rounds compare)."""

    method = "Fed-BEiT pre-training"

    def __init__(
        self,
        model: BEiTPretrainer,
        tokenizer: VQTokenizer,
        data: SiteData,
        training: TrainingSection,
        *,
        augment: str = "none",
        device: str | torch.device | None = None,
        seed: int = 0,
    ) -> None:
        if tokenizer.codebook_size != model.codebook_size:
            raise TrainingError(
                "tokenizer_mismatch",
                f"the tokenizer has {tokenizer.codebook_size} codes, the token head "
                f"{model.codebook_size} — set protocol.codebook_size to the tokenizer's",
            )
        super().__init__(model, data, training, augment=augment, device=device)
        self.beit: BEiTPretrainer = model
        self.tokenizer = tokenizer.to(self.device).eval()
        for p in self.tokenizer.parameters():
            p.requires_grad_(False)
        self.mask_rng = np.random.default_rng(seed)

    def _masks(self, batch: int, rng: np.random.Generator) -> Tensor:
        beit = self.beit
        return blockwise_masks(batch, beit.grid, beit.mask_ratio, rng, min_block=beit.min_block).to(
            self.device
        )

    def loss(self, x: Tensor, y: Tensor, weight: Tensor | None | str = "site") -> Tensor:
        tokens = self.tokenizer.tokens(x)
        with self.autocast():
            return self.beit(x, tokens, self._masks(len(x), self.mask_rng)).loss

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        images, _ = self._split_tensors(split)
        rng = np.random.default_rng(EVAL_MASK_SEED)
        self.model.eval()
        loss_sum, correct, masked = 0.0, 0.0, 0
        with torch.no_grad():
            for start in range(0, len(images), EVAL_BATCH):
                x = images[start : start + EVAL_BATCH].to(self.device)
                with self.autocast():
                    out = self.beit(x, self.tokenizer.tokens(x), self._masks(len(x), rng))
                loss_sum += float(out.loss) * out.masked
                correct += float(out.accuracy) * out.masked
                masked += out.masked
        return {
            "token_loss": loss_sum / max(masked, 1),
            "token_accuracy": correct / max(masked, 1),
            "split": split,
            "n": len(images),
        }


# ---------------------------------------------------------------------- token maps


def save_token_maps(
    tokenizer: VQTokenizer, images: Tensor, path: str | Path, *, title: str = ""
) -> Path:
    """A PNG with one row per image: the image | its token map (each patch
    coloured by its token index, numbered on small grids) | the tokenizer's
    reconstruction from the tokens."""
    tokenizer.eval()
    device = next(tokenizer.parameters()).device
    x = images.to(device)
    with torch.no_grad():
        tokens = tokenizer.tokens(x)
        recon = tokenizer.decode_tokens(tokens)
    side = int(round(tokens.shape[1] ** 0.5))
    maps = tokens.reshape(-1, side, side).cpu().numpy()

    def token_map(ax: Any, row: int) -> None:
        # 20 colours cycle over the indices; the numbers say which token
        ax.imshow(maps[row] % 20, cmap="tab20", vmin=0, vmax=19)
        if side <= 8:
            for (i, j), token in np.ndenumerate(maps[row]):
                ax.text(j, i, str(token), ha="center", va="center", fontsize=4)

    return save_image_grid(
        path,
        [("image", image_column(x)), ("tokens", token_map), ("from tokens", image_column(recon))],
        len(images),
        title=title,
    )
