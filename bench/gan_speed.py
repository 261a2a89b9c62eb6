"""Speed of the genbuffer GAN's training: iterations per second at 32 and 64 px, and
the wall time a site needs to train its generator.

    python -m bench.gan_speed [--lpips-weights ../shared/weights/lpips_alex_v0.1_full_state.pth]

For each resolution: seconds per iteration of stage 1 (no privacy loss) and of
stage 2 (with the LPIPS privacy loss), fp32 on this machine's CPU; on a CUDA
device also bf16 autocast + channels-last against fp32 on the same device (the
baseline of the ratio). The site's wall time is each stage's iterations times
its seconds per iteration (quality scores and checkpoints not counted), for
the benchmark's schedule (bench/genbuffer.py: 1600 + 400 + 400 reference) and
the paper's upper bounds (50,000 + 10,000). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genbuffer.config import GenbufferSection
from genbuffer.privacy import build_perceptual_distance
from genbuffer.trainer import GanTrainer, prepare_images

SCHEDULES = {"bench": (1600, 400, 400), "paper_max": (50_000, 10_000, 0)}


def images_for(
    data: Path | None, resolution: int, n: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """pneumoniamnist's first n training images when given, else scikit-learn's digits."""
    if data is not None and data.is_file():
        arrays = np.load(data)
        x, y = arrays["train_images"][:n], arrays["train_labels"][:n].reshape(-1)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = (digits.images[:n] * (255 / 16)).round().astype(np.uint8)
        y = digits.target[:n] % 2
    return prepare_images(x, resolution), torch.as_tensor(y.astype(np.int64))


def seconds_per_iteration(trainer: GanTrainer, use_pp: bool, n: int, device: torch.device) -> float:
    for _ in range(2):  # warm-up (cudnn autotune, allocator)
        trainer.step(use_pp)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(n):
        trainer.step(use_pp)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / n


def measure(
    resolution: int, device: torch.device, precision: str, args: argparse.Namespace
) -> dict[str, Any]:
    cfg = GenbufferSection(
        resolution=resolution,
        channel_base=args.channel_base,
        channel_max=args.channel_max,
        z_dim=64,
        w_dim=64,
        mapping_layers=2,
        lpips_backbone=args.lpips_backbone,
        lpips_weights=args.lpips_weights,
        precision=precision,  # type: ignore[arg-type]
        channels_last="on" if precision == "bf16" else "off",
        device=device.type,  # type: ignore[arg-type]
    )
    metric = build_perceptual_distance(
        cfg.lpips_backbone, cfg.lpips_weights, min_size=cfg.lpips_min_size, device=device
    )
    x, y = images_for(args.data, resolution)
    trainer = GanTrainer(cfg, x, y, 2, metric=metric, device=device)
    trainer.augment.p = 0.2  # the augmentation pipeline's cost included
    plain = seconds_per_iteration(trainer, False, args.iterations, device)
    pp = seconds_per_iteration(trainer, True, args.iterations, device)
    row: dict[str, Any] = {
        "resolution": resolution,
        "device": device.type,
        "precision": precision,
        "s_per_iter": round(plain, 4),
        "s_per_iter_with_pp": round(pp, 4),
        "iter_per_s": round(1 / plain, 2),
        "iter_per_s_with_pp": round(1 / pp, 2),
    }
    for name, (stage1, stage2, reference) in SCHEDULES.items():
        row[f"site_wall_s_{name}"] = round((stage1 + reference) * plain + stage2 * pp, 1)
    print(
        f"{resolution:>3} px {device.type:<4} {precision:<4}: {row['iter_per_s']:7.2f} it/s "
        f"({row['iter_per_s_with_pp']:.2f} with the privacy loss); site: "
        f"{row['site_wall_s_bench'] / 60:.1f} min (bench schedule), "
        f"{row['site_wall_s_paper_max'] / 3600:.1f} h (paper's maxima)",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("../shared/data/pneumoniamnist.npz"))
    p.add_argument("--resolutions", type=int, nargs="+", default=[32, 64])
    p.add_argument("--channel-base", type=int, default=1024, help="bench.feder's generator")
    p.add_argument("--channel-max", type=int, default=64)
    p.add_argument("--iterations", type=int, default=10, help="timed iterations per figure")
    p.add_argument("--lpips-backbone", default="alex", choices=["alex", "vgg", "squeeze", "random"])
    p.add_argument("--lpips-weights", type=Path, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    rows = []
    for resolution in args.resolutions:
        rows.append(measure(resolution, torch.device("cpu"), "fp32", args))
        if torch.cuda.is_available():
            cuda = torch.device("cuda")
            base = measure(resolution, cuda, "fp32", args)
            fast = measure(resolution, cuda, "bf16", args)
            fast["speedup_vs_fp32"] = round(base["s_per_iter"] / fast["s_per_iter"], 2)
            rows += [base, fast]
    summary = {
        "rows": rows,
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "lpips_backbone": args.lpips_backbone,
        "generator": {"channel_base": args.channel_base, "channel_max": args.channel_max},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
