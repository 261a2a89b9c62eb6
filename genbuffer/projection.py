"""Privacy audit by latent projection (FedER Sec. 4.4, Figs. 3-4): the paper's own
metric. The membership-inference test of the buffers that leave a site is audit.py.

For each of M real training images x we search the generator's W space for the
w whose image G(w) is closest to x in LPIPS (the projection of Karras et al.
2020a: Adam on a single w shared by all layers, starting from the class's mean
w, with latent noise that fades out over the first three quarters of the steps
and a learning rate that ramps up and then down). A generator that has stored
its training images reaches small distances; the privacy-preserving one should
not. We run it for the generators trained with and without the privacy loss
from the same stage-1 start, and write

    audit.json            per-image distances, means, relative increase
    audit_histogram.png   both distance histograms (Fig. 3)
    audit_grid.png        rows: real | projection without PP | projection with PP (Fig. 4)

The grid shows private images and the JSON measures each of them: the folder is
made 0700 and the files 0600 (write_grid writes every grid that way, since a grid
is how a person looks at the site's images or at what a generator trained on
them makes).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from p2pfl.files import PRIVATE_FILE, atomic_savefig, atomic_write_json, make_private_dir

from .buffer import to_uint8
from .privacy import PerceptualDistance
from .stylegan2 import Generator

log = logging.getLogger(__name__)

AUDIT_JSON = "audit.json"
AUDIT_HISTOGRAM = "audit_histogram.png"
AUDIT_GRID = "audit_grid.png"


@dataclass
class Projection:
    images: Tensor  # (M, C, H, W), roughly [-1, 1]: the closest images found (not clamped)
    distances: Tensor  # (M,) LPIPS distance of each to its target
    ws: Tensor  # (M, w_dim)


def project_to_w(
    generator: Generator,
    targets: Tensor,
    labels: Tensor,
    metric: PerceptualDistance,
    *,
    steps: int = 300,
    lr: float = 0.1,
    seed: int = 0,
) -> Projection:
    """Find, for every target image, the w minimising LPIPS(G(w), target); keeps the best w seen."""
    device = next(generator.parameters()).device
    generator.eval().requires_grad_(False)
    targets = targets.to(device)
    labels = labels.long().to(device)
    class_means = {
        int(c): generator.class_mean_w(int(c), seed=seed) for c in labels.unique().tolist()
    }
    w_start = torch.stack([class_means[int(c)] for c in labels.tolist()])
    # Spread of W around the mean: scale of the exploration noise.
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        z = torch.randn(512, generator.z_dim, generator=rng).to(device)
        sample_labels = labels[torch.randint(0, len(labels), (512,), generator=rng).to(device)]
        w_std = float(
            (generator.mapping(z, sample_labels) - w_start.mean(0)).square().sum(1).mean().sqrt()
        )

    w = w_start.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([w], lr=lr, betas=(0.9, 0.999))
    best_distance = torch.full((len(targets),), math.inf, device=device)
    best_images = torch.zeros_like(targets)
    best_ws = w_start.clone()
    for step in range(steps + 1):
        t = step / max(steps, 1)
        noise_scale = w_std * 0.05 * max(0.0, 1.0 - t / 0.75) ** 2
        # Learning rate: linear warm-up over 5% of the steps, cosine decay over the last 25%.
        ramp = 0.5 - 0.5 * math.cos(min(1.0, (1.0 - t) / 0.25) * math.pi)
        ramp *= min(1.0, t / 0.05)
        for group in optimizer.param_groups:
            group["lr"] = lr * ramp
        # The last pass measures the final w without noise.
        w_noisy = w + torch.randn_like(w) * noise_scale if step < steps else w
        images = generator.synthesis(w_noisy, noise_mode="const")
        distances = metric(images, targets)
        with torch.no_grad():
            better = distances.detach() < best_distance
            best_distance = torch.where(better, distances.detach(), best_distance)
            best_images[better] = images.detach()[better]
            best_ws[better] = w_noisy.detach()[better]
        if step == steps:
            break
        optimizer.zero_grad(set_to_none=True)
        distances.sum().backward()
        optimizer.step()
    return Projection(images=best_images, distances=best_distance, ws=best_ws)


@dataclass
class AuditResult:
    distances_pp: list[float]
    distances_nopp: list[float]
    mean_pp: float
    mean_nopp: float
    increase: float  # (mean_pp - mean_nopp) / mean_nopp
    files: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "mean_dist_pp": self.mean_pp,
            "mean_dist_nopp": self.mean_nopp,
            "increase": self.increase,
            "distances_pp": self.distances_pp,
            "distances_nopp": self.distances_nopp,
            "files": self.files,
        }


def _tile(images_u8: np.ndarray, scale: int) -> np.ndarray:
    """(C, H, W) uint8 -> (H*scale, W*scale[, 3]) for imsave; shows channel 0 unless it is RGB."""
    img = images_u8[:3].transpose(1, 2, 0) if images_u8.shape[0] == 3 else images_u8[0]
    return img.repeat(scale, axis=0).repeat(scale, axis=1)


def write_grid(rows: list[Tensor], path: Path, *, min_tile: int = 64, gap: int = 2) -> None:
    """Rows of [-1, 1] image batches (same shape) -> one PNG, rows top to bottom,
    written 0600 (the rows are the site's images or a generator's copies of them)."""
    count, channels, height, _ = rows[0].shape
    scale = max(1, math.ceil(min_tile / height))
    tiles = [[_tile(to_uint8(r[i]).cpu().numpy(), scale) for i in range(count)] for r in rows]
    tile_h = height * scale
    rgb = channels == 3
    shape = (len(rows) * (tile_h + gap) - gap, count * (tile_h + gap) - gap) + ((3,) if rgb else ())
    canvas = np.full(shape, 255, dtype=np.uint8)
    for r, row in enumerate(tiles):
        for c, tile in enumerate(row):
            y, x = r * (tile_h + gap), c * (tile_h + gap)
            canvas[y : y + tile_h, x : x + tile_h] = tile
    fig = Figure(figsize=(shape[1] / 100, shape[0] / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.imshow(canvas, cmap=None if rgb else "gray", vmin=0, vmax=255, interpolation="nearest")
    ax.axis("off")
    atomic_savefig(fig, path, mode=PRIVATE_FILE, dpi=100)


def write_histogram(
    distances_nopp: list[float], distances_pp: list[float], path: Path, backbone: str
) -> None:
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    upper = max(distances_nopp + distances_pp + [1e-6])
    bins = np.linspace(0, upper * 1.05, 25)
    ax.hist(distances_nopp, bins=bins, color="tab:blue", alpha=0.6, label="without privacy loss")
    ax.hist(distances_pp, bins=bins, color="tab:red", alpha=0.6, label="with privacy loss")
    ax.set_xlabel(f"LPIPS distance to the projection ({backbone} backbone)")
    ax.set_ylabel("real images")
    ax.set_title("Closest synthetic image found by W-space projection")
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, path, mode=PRIVATE_FILE)


def audit_privacy(
    generator_pp: Generator,
    generator_nopp: Generator,
    real_images: Tensor,
    real_labels: Tensor,
    metric: PerceptualDistance,
    out_dir: str | Path,
    *,
    steps: int = 300,
    lr: float = 0.1,
    seed: int = 0,
    grid_columns: int = 16,
) -> AuditResult:
    """Project M real images (float, [-1, 1], at the generators' resolution) into both generators' W."""
    out_dir = make_private_dir(out_dir)
    nopp = project_to_w(
        generator_nopp, real_images, real_labels, metric, steps=steps, lr=lr, seed=seed
    )
    pp = project_to_w(generator_pp, real_images, real_labels, metric, steps=steps, lr=lr, seed=seed)
    d_pp = pp.distances.cpu().tolist()
    d_nopp = nopp.distances.cpu().tolist()
    mean_pp, mean_nopp = float(np.mean(d_pp)), float(np.mean(d_nopp))
    increase = (mean_pp - mean_nopp) / mean_nopp if mean_nopp > 0 else math.inf
    files = {
        "json": str(out_dir / AUDIT_JSON),
        "histogram": str(out_dir / AUDIT_HISTOGRAM),
        "grid": str(out_dir / AUDIT_GRID),
    }
    result = AuditResult(d_pp, d_nopp, mean_pp, mean_nopp, increase, files)
    write_histogram(d_nopp, d_pp, out_dir / AUDIT_HISTOGRAM, metric.backbone)
    k = min(grid_columns, len(real_images))
    write_grid(
        [real_images[:k].cpu(), nopp.images[:k].cpu(), pp.images[:k].cpu()], out_dir / AUDIT_GRID
    )
    payload = {
        **result.to_json(),
        "lpips_backbone": metric.backbone,
        "images": len(real_images),
        "steps": steps,
    }
    atomic_write_json(out_dir / AUDIT_JSON, payload, mode=PRIVATE_FILE)
    log.info(
        "privacy audit on %d images: mean LPIPS to projection %.4f without / %.4f with the privacy loss (%+.1f%%)",
        len(real_images),
        mean_nopp,
        mean_pp,
        100 * increase,
    )
    return result
