"""Fed-MAE's local training: a `Trainer` whose objective is masked-patch
reconstruction (p2pfl.learning.mae) over every local image, labelled or not;
everything else (optimizer, batches, augmentation, state, statistics) is
Trainer's. Also the figure of what the autoencoder sees and restores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from p2pfl.config import TrainingSection
from p2pfl.files import atomic_savefig
from p2pfl.learning.data import SiteData
from p2pfl.learning.data.loaders import MEAN, STD
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.mae import NORM_EPS, MaskedAutoencoder, patchify, unpatchify
from p2pfl.learning.trainer import Trainer

EVAL_MASK_SEED = 1234  # evaluation draws the same masks every time, so rounds compare


# ---------------------------------------------------------------------- local objective


def mae_training_data(data: SiteData) -> SiteData:
    """The site's data with `train` holding every local training image, labelled
    or not (labels are not used by the reconstruction loss and set to 0)."""
    images = [data.train.tensors[0]]
    if data.unlabeled is not None and len(data.unlabeled):
        images.append(data.unlabeled.tensors[0])
    pooled = torch.cat(images)
    return dataclasses.replace(
        data, train=TensorDataset(pooled, torch.zeros(len(pooled), dtype=torch.int64))
    )


class PretrainingSite(Trainer):
    """A Trainer for self-supervised training (Fed-MAE, Fed-BEiT and its
    tokenizer): every local image, labelled or not, is training data; it runs
    in one process and never privately (no DP-SGD plan covers its stages; the
    site.yaml's guard refuses training.dp first, this is the second line), and
    has none of a classifier's class weighting, replay or gradient exchange.
    `method` names it in the refusals."""

    method = "self-supervised pre-training"

    def __init__(
        self,
        model: nn.Module,
        data: SiteData,
        training: TrainingSection,
        *,
        augment: str = "none",
        device: str | torch.device | None = None,
    ) -> None:
        if training.devices > 1:
            raise TrainingError(
                "data_parallel_unsupported",
                f"{self.method} runs in one process — set training.devices: 1",
            )
        if training.dp is not None:
            raise TrainingError(
                "dp_unsupported",
                f"training.dp: differential privacy is not planned for {self.method} "
                "— remove training.dp",
            )
        super().__init__(model, mae_training_data(data), training, augment=augment, device=device)


class MAESite(PretrainingSite):
    """A Trainer whose local objective is masked-patch reconstruction over every
    local image; `evaluate(split)` reports the reconstruction loss on that split
    with masks drawn from a fixed seed (so successive rounds compare)."""

    method = "Fed-MAE pre-training"

    def __init__(
        self,
        model: MaskedAutoencoder,
        data: SiteData,
        training: TrainingSection,
        *,
        augment: str = "none",
        device: str | torch.device | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(model, data, training, augment=augment, device=device)
        self.mae: MaskedAutoencoder = model
        self.mask_generator = torch.Generator().manual_seed(seed)

    def loss(self, x: Tensor, y: Tensor, weight: Tensor | None | str = "site") -> Tensor:
        with self.autocast():
            return self.mae(x, generator=self.mask_generator).loss

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        images, _ = self._split_tensors(split)
        generator = torch.Generator().manual_seed(EVAL_MASK_SEED)
        self.model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(images), 256):
                x = images[start : start + 256].to(self.device)
                with self.autocast():
                    out = self.mae(x, generator=generator)
                total += float(out.loss) * len(x)
                count += len(x)
        return {"recon_loss": total / max(count, 1), "split": split, "n": count}

    def sample_images(self, count: int = 8) -> Tensor:
        """Up to `count` images for the reconstruction grid: val, else test, else train."""
        return first_split_images(self, count)


def first_split_images(site: Trainer, count: int) -> Tensor:
    """Up to `count` of a site's images for a figure: val, else test, else train."""
    for split in ("val", "test", "train"):
        try:
            images, _ = site._split_tensors(split)
        except TrainingError:
            continue
        return images[:count]
    raise TrainingError("missing_split", "no images to show")


# ---------------------------------------------------------------------- reconstruction grid


def reconstruction_views(
    model: MaskedAutoencoder, images: Tensor, *, seed: int = EVAL_MASK_SEED
) -> tuple[Tensor, Tensor, Tensor]:
    """(masked input, reconstruction, original) as N,C,H,W in [-1, 1]. Masked
    patches show grey in the input; in the reconstruction the visible patches are
    the original pixels and the masked ones the prediction, mapped from normalised
    pixels back with each patch's own mean and standard deviation (as MAE's
    figures do)."""
    model.eval()
    device = next(model.parameters()).device
    x = images.to(device)
    with torch.no_grad():
        out = model(x, generator=torch.Generator().manual_seed(seed))
    target = patchify(x, model.patch_size).float()
    mean = target.mean(dim=-1, keepdim=True)
    std = (target.var(dim=-1, keepdim=True) + NORM_EPS).sqrt()
    predicted = out.pred.float() * std + mean
    mask = out.mask[..., None]
    masked_input = target * (1 - mask)  # 0.0 is mid grey in [-1, 1]
    reconstruction = target * (1 - mask) + predicted * mask
    views = [
        unpatchify(v, model.patch_size, model.in_chans).clamp(-1, 1).cpu()
        for v in (masked_input, reconstruction, target)
    ]
    return views[0], views[1], views[2]


def save_image_grid(
    path: str | Path,
    columns: Sequence[tuple[str, Callable[[Any, int], None]]],
    rows: int,
    *,
    title: str = "",
) -> Path:
    """A PNG of `rows` rows, one column per (label, draw(ax, row))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        rows, len(columns), figsize=(1.5 * len(columns), 1.5 * rows + 0.6), squeeze=False
    )
    for col, (label, draw) in enumerate(columns):
        for row in range(rows):
            ax = axes[row][col]
            draw(ax, row)
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(label, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_savefig(fig, path, dpi=100)  # the site's own images: 0600
    plt.close(fig)
    return path


def image_column(images: Tensor) -> Callable[[Any, int], None]:
    """A column of images given as N,C,H,W normalised pixels (grey or the first
    three channels)."""
    pixels = (images.detach().float().cpu() * STD + MEAN).clamp(0, 1).permute(0, 2, 3, 1).numpy()

    def draw(ax: Any, row: int) -> None:
        image = pixels[row]
        if image.shape[2] == 1:
            ax.imshow(image[..., 0], cmap="gray", vmin=0.0, vmax=1.0)
        else:
            ax.imshow(np.clip(image[..., :3], 0.0, 1.0))

    return draw


def save_reconstruction_grid(
    model: MaskedAutoencoder, images: Tensor, path: str | Path, *, title: str = ""
) -> Path:
    """A PNG with one row per image: masked input | reconstruction | original."""
    columns = reconstruction_views(model, images)
    labels = ("masked input", "reconstruction", "original")
    return save_image_grid(
        path,
        [(label, image_column(view)) for label, view in zip(labels, columns, strict=True)],
        len(images),
        title=title,
    )
