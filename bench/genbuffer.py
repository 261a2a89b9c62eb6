"""Benchmark of the genbuffer package on PneumoniaMNIST (one site's share of the training split).

1. Train the privacy-preserving conditional StyleGAN2-ADA in two stages (plus the
   no-privacy continuation from the same stage-1 start, for the audit).
2. Sample a synthetic buffer and train the same small classifier on it and, as the
   baseline, on the site's real images; compare macro-F1 on the real test split.
3. Privacy audit: project M real training images into W of both generators;
   and the privacy gate (genbuffer/gate.py) on a buffer of each, against the
   site's training images (gate_pp/ and gate_nopp/: JSON, histogram, and a
   grid of the closest real images next to their nearest synthetic ones), with
   its membership test (genbuffer/audit.py): the site holds out
   --holdout-fraction of its images (stratified, seeded) from GAN training, and
   the test asks whether the members are nearer to the buffer than the holdout.
   Two more arms stand for a generator that stored its training images (no
   generator is trained for them): gate_copy/, a "synthetic" buffer made of
   every member image itself plus uniform noise of +-2 grey levels, and
   gate_copy_b/, --buffer-size draws with replacement from the same copies
   (what such a generator's buffer of B images holds). The gate must refuse both.
4. Seconds per GAN training iteration at 32 px, batch 32, on this CPU
   (--timing-iterations 0 skips it).

The GAN, classifiers and buffers see the members only; the real-data baseline
classifier is trained on the members too.

LPIPS needs torchvision's ImageNet AlexNet/VGG weights, which cannot be
downloaded here: by default the benchmark runs with the random backbone and says
so in its output; with the weights file at hand, `--lpips-backbone alex
--lpips-weights FILE` (or the file in the torch hub cache) gives the real audit. The last stdout line is one JSON
object; PNGs and JSON files go to --out.

    OMP_NUM_THREADS=1 .venv/bin/python bench/genbuffer.py --out runs/gb_bench4 \
        --pp-normalization batch --iterations 1600 --patience 600 --stage2-iterations 400 \
        --quality-every 200 --stage2-quality-every 25

(one thread is faster than two on a shared 2-core machine). Re-running with other
stage-2 settings (--alpha, --pp-normalization, --stage2-*) in the same --out keeps
stage 1 and redoes stage 2 and its reference from the same stage-1 start.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

# `python bench/genbuffer.py` puts bench/ first on sys.path, where this file would
# shadow the genbuffer package; drop it so the imports below find the package.
_BENCH_DIR = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH_DIR]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from genbuffer.audit import holdout_split  # noqa: E402
from genbuffer.buffer import buffer_content_hash, buffer_to_bytes, sample_buffer  # noqa: E402
from genbuffer.checkpoint import load_generator  # noqa: E402
from genbuffer.config import GenbufferSection  # noqa: E402
from genbuffer.gate import check_buffer  # noqa: E402
from genbuffer.privacy import build_perceptual_distance  # noqa: E402
from genbuffer.progress import TrainingProgress  # noqa: E402
from genbuffer.projection import audit_privacy, write_grid  # noqa: E402
from genbuffer.train import resolve_device, train_generator  # noqa: E402
from genbuffer.trainer import GanTrainer, prepare_images  # noqa: E402
from p2pfl.files import (  # noqa: E402
    atomic_savefig,
    atomic_write_bytes,
    atomic_write_text,
    make_private_dirs,
)
from p2pfl.learning.metrics import macro_f1  # noqa: E402
from p2pfl.learning.models import create_model  # noqa: E402

log = logging.getLogger("bench.genbuffer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", type=Path, default=Path("/work/shared/data/pneumoniamnist.npz"))
    p.add_argument("--out", type=Path, default=Path("runs/genbuffer_bench"))
    p.add_argument(
        "--share", type=float, default=0.25, help="share of the training split this site holds"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device", choices=["cpu", "cuda", "auto"], default="cpu", help="GAN, LPIPS and audits"
    )
    p.add_argument("--holdout-fraction", type=float, default=0.2)
    p.add_argument("--holdout-min-images", type=int, default=50)
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--channel-base", type=int, default=512)
    p.add_argument("--channel-max", type=int, default=32)
    p.add_argument("--latent", type=int, default=64, help="z and w size")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--iterations", type=int, default=2400, help="stage 1 at most")
    p.add_argument("--patience", type=int, default=800, help="stage 1 patience (iterations)")
    p.add_argument("--stage2-iterations", type=int, default=600)
    p.add_argument("--quality-every", type=int, default=200)
    p.add_argument("--stage2-quality-every", type=int, default=50)
    p.add_argument(
        "--stage2-degrade-factor",
        type=float,
        default=2.5,
        help="stage 2 stops once the quality score exceeds this x stage 1's (FedER: 2.5); a "
        "large value runs all --stage2-iterations",
    )
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--pp-normalization", choices=["pairs", "batch"], default="pairs")
    p.add_argument("--ada-speed-images", type=int, default=100_000)
    p.add_argument("--buffer-size", type=int, default=512)
    p.add_argument("--classifier-steps", type=int, default=600)
    p.add_argument("--classifier-seeds", type=int, default=3)
    p.add_argument("--audit-images", type=int, default=64)
    p.add_argument("--audit-steps", type=int, default=200)
    p.add_argument("--timing-iterations", type=int, default=10)
    p.add_argument(
        "--restart", action="store_true", help="ignore a previous GAN training state in --out"
    )
    p.add_argument(
        "--lpips-backbone",
        choices=["random", "alex", "vgg", "squeeze"],
        default="random",
        help="alex/vgg/squeeze need ImageNet weights: --lpips-weights FILE (an lpips state dict or torchvision backbone file) or the torch hub cache",
    )
    p.add_argument("--lpips-weights", type=Path, default=None)
    return p.parse_args(argv)


def site_share(data: Any, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    images, labels = data["train_images"], data["train_labels"].reshape(-1).astype(np.int64)
    picks = np.sort(
        np.random.default_rng(seed).permutation(len(images))[: int(round(share * len(images)))]
    )
    return images[picks], labels[picks]


def train_classifier(
    images: torch.Tensor, labels: torch.Tensor, num_classes: int, steps: int, seed: int
) -> torch.nn.Module:
    """small_cnn, Adam 1e-3, batch 32, flips, class-weighted cross-entropy (same recipe for both)."""
    torch.manual_seed(seed)
    model = create_model(
        "small_cnn", in_chans=images.shape[1], num_classes=num_classes, image_size=images.shape[-1]
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    counts = torch.bincount(labels, minlength=num_classes).float().clamp(min=1)
    weights = counts.sum() / (num_classes * counts)
    rng = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(images), (32,), generator=rng)
        x = images[idx]
        flip = torch.rand(len(idx), generator=rng) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        loss = F.cross_entropy(model(x), labels[idx], weight=weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


@torch.no_grad()
def evaluate_f1(
    model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> float:
    preds = torch.cat([model(images[i : i + 256]).argmax(1) for i in range(0, len(images), 256)])
    return macro_f1(labels.numpy(), preds.numpy(), num_classes)


def seconds_per_iteration(
    cfg: GenbufferSection, images: torch.Tensor, labels: torch.Tensor, metric: Any, n: int
) -> dict[str, float]:
    trainer = GanTrainer(cfg, images, labels, 2, metric=metric, device=torch.device("cpu"))
    trainer.augment.p = 0.2  # include the augmentation pipeline's cost
    out = {}
    for use_pp in (False, True):
        trainer.step(use_pp)  # warm-up
        t0 = time.perf_counter()
        for _ in range(n):
            trainer.step(use_pp)
        out["pp" if use_pp else "plain"] = (time.perf_counter() - t0) / n
    return out


def copy_buffer(
    images: torch.Tensor, labels: torch.Tensor, seed: int, size: int | None = None
) -> dict[str, Any]:
    """A memoriser's buffer: member images themselves plus uniform noise of +-2 grey levels;
    every member once, or `size` draws with replacement (the buffer of B images that a
    generator which stored every member would sample)."""
    rng = torch.Generator().manual_seed(seed)
    if size is not None:
        picks = torch.randint(0, len(images), (size,), generator=rng)
        images, labels = images[picks], labels[picks]
    u8 = ((images.clamp(-1, 1) + 1) * 127.5).round()
    noise = torch.randint(-2, 3, u8.shape, generator=rng).float()
    copies = (u8 + noise).clamp(0, 255).to(torch.uint8)
    return {
        "images": copies,
        "labels": labels.long(),
        "content_hash": buffer_content_hash(copies, labels.long()),
    }


def plot_quality(history: list[dict[str, Any]], path: Path) -> None:
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for phase, color in (("stage1", "black"), ("stage2", "tab:red"), ("reference", "tab:blue")):
        pts = [(h["iteration"], h["quality"]) for h in history if h["phase"] == phase]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, "o-", color=color, label=phase, markersize=3)
    ax.set_xlabel("iteration")
    ax.set_ylabel("Frechet distance (LPIPS-backbone features)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, path)  # 0600: a figure measured on the site's own images


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Tiny values in the slowly-moving mapping layers and Adam moments turn subnormal on long CPU
    # runs, and subnormal arithmetic is many times slower on x86; flushing them costs nothing.
    torch.set_flush_denormal(True)
    out: Path = args.out
    # Every output (the generator's copies of the site's images, grids of them, figures
    # measured on them) is this account's only, whatever the umask: a review read
    # buffer.bin, quality.png and summary.json at 0644. A folder that exists keeps its mode.
    make_private_dirs(out)
    t_start = time.perf_counter()
    data = np.load(args.data)
    train_u8, train_labels = site_share(data, args.share, args.seed)
    num_classes = int(max(train_labels.max(), data["test_labels"].max()) + 1)
    log.info(
        "site share: %d images, class counts %s", len(train_u8), np.bincount(train_labels).tolist()
    )

    # every option named like a GenbufferSection field (--channel-base, --alpha, ...)
    # is that field; the others are the benchmark's own or named otherwise
    same_named = {k: v for k, v in vars(args).items() if k in GenbufferSection.model_fields}
    cfg = GenbufferSection(
        **same_named,
        z_dim=args.latent,
        w_dim=args.latent,
        mapping_layers=2,
        stage1_patience=args.patience,
        quality_samples=500,
        checkpoint_every=args.quality_every,
        out_dir=out / "gan",
    )
    device = resolve_device(cfg.device)
    metric = build_perceptual_distance(
        cfg.lpips_backbone, cfg.lpips_weights, min_size=cfg.lpips_min_size, device=device
    )
    site_u8, site_labels = train_u8, train_labels
    members, holdout = holdout_split(
        site_labels, cfg.holdout_fraction, cfg.holdout_min_images, cfg.seed
    )
    train_u8, train_labels, holdout_u8 = site_u8[members], site_labels[members], site_u8[holdout]
    holdout_labels = site_labels[holdout]
    log.info("%d members train the GAN, %d held out", len(members), len(holdout))

    # 1. GAN, two stages + reference.
    t0 = time.perf_counter()
    result = train_generator(
        train_u8,
        train_labels,
        num_classes,
        cfg,
        cfg.out_dir,
        resume=not args.restart,
        metric=metric,
        progress=TrainingProgress(),
    )
    gan_seconds = time.perf_counter() - t0
    plot_quality(result.history, out / "quality.png")

    # 2. Buffer and classifiers.
    generator, info = load_generator(result.generator_path, device)
    buffer = sample_buffer(generator, args.buffer_size, per_class="balanced", seed=args.seed)
    atomic_write_bytes(out / "buffer.bin", buffer_to_bytes(buffer))
    synth_x = buffer["images"].float() / 127.5 - 1
    synth_y = buffer["labels"]
    rows = [synth_x[synth_y == c][:16] for c in range(num_classes)]
    write_grid(rows, out / "synthetic_samples.png")
    real_x = prepare_images(train_u8, args.resolution)
    real_y = torch.as_tensor(train_labels)
    test_x = prepare_images(data["test_images"], args.resolution)
    test_y = torch.as_tensor(data["test_labels"].reshape(-1).astype(np.int64))
    write_grid([real_x[real_y == c][:16] for c in range(num_classes)], out / "real_samples.png")
    f1_synth, f1_real = [], []
    for s in range(args.classifier_seeds):
        f1_synth.append(
            evaluate_f1(
                train_classifier(synth_x, synth_y, num_classes, args.classifier_steps, s),
                test_x,
                test_y,
                num_classes,
            )
        )
        f1_real.append(
            evaluate_f1(
                train_classifier(real_x, real_y, num_classes, args.classifier_steps, s),
                test_x,
                test_y,
                num_classes,
            )
        )
    log.info("macro-F1 on the real test split: synthetic %s, real %s", f1_synth, f1_real)

    # 3. Audit.
    audit_json: dict[str, Any] = {}
    if result.reference_path is not None:
        rng = np.random.default_rng(args.seed + 1)
        picks = np.sort(
            rng.choice(len(train_u8), size=min(args.audit_images, len(train_u8)), replace=False)
        )
        reference, _ = load_generator(result.reference_path, device)
        audit = audit_privacy(
            generator,
            reference,
            real_x[picks],
            real_y[picks],
            metric,
            out / "audit",
            steps=args.audit_steps,
            lr=cfg.audit_lr,
            seed=args.seed,
        )
        audit_json = {
            "audit_mean_dist_pp": audit.mean_pp,
            "audit_mean_dist_nopp": audit.mean_nopp,
            "audit_increase": audit.increase,
            "w_projection_ratio": audit.mean_pp / audit.mean_nopp if audit.mean_nopp else None,
        }

    # 3b. The privacy gate on what would leave the site: the buffer of each generator,
    # and the copy arm, checked against the members with the membership test.
    gate_json: dict[str, Any] = {}
    membership: dict[str, Any] = {}
    candidates = {
        name: sample_buffer(
            load_generator(path, device)[0],
            args.buffer_size,
            per_class="balanced",
            seed=args.seed,
        )
        for name, path in (("pp", result.generator_path), ("nopp", result.reference_path))
        if path is not None
    }
    candidates["copy"] = copy_buffer(real_x, real_y, args.seed)
    candidates["copy_b"] = copy_buffer(real_x, real_y, args.seed, size=args.buffer_size)
    for name, candidate in candidates.items():
        decision = check_buffer(
            candidate,
            train_u8,
            metric,
            cfg,
            out / f"gate_{name}",
            holdout_uint8=holdout_u8,
            seed=args.seed,
            real_labels=train_labels,
            holdout_labels=holdout_labels,
        )
        gate_json.update(
            {
                f"gate_{name}_released": decision.released,
                f"gate_{name}_refused_by": decision.refused_by,
                f"gate_{name}_exposed_fraction": decision.exposed_fraction,
                f"gate_{name}_nearest_median": decision.nearest_synthetic["median"],
            }
        )
        membership[name] = {
            k: v for k, v in decision.membership.items() if k not in ("files", "reason")
        }
    gate_json["gate_distance"] = decision.distance

    # 4. Timing (on the CPU, whatever --device is).
    timing = {"plain": None, "pp": None}
    if args.timing_iterations > 0:
        timing = seconds_per_iteration(
            cfg, real_x, real_y, metric.to("cpu"), args.timing_iterations
        )

    synthetic_f1, real_f1 = float(np.mean(f1_synth)), float(np.mean(f1_real))
    summary = {
        "synthetic_macro_f1": synthetic_f1,
        "real_macro_f1": real_f1,
        "ratio": synthetic_f1 / real_f1 if real_f1 > 0 else None,
        **audit_json,
        **gate_json,
        "membership": membership,
        "members": len(members),
        "holdout": len(holdout),
        "device": str(device),
        "s_per_iter_cpu": timing["plain"],
        "s_per_iter_cpu_with_pp": timing["pp"],
        "torch_threads": torch.get_num_threads(),
        "lpips_backbone": cfg.lpips_backbone,
        "note": (
            "LPIPS backbone is random (no ImageNet weights offline): privacy figures are not real-privacy evidence"
            if cfg.lpips_backbone == "random"
            else f"LPIPS on ImageNet {cfg.lpips_backbone}"
        ),
        "synthetic_macro_f1_per_seed": f1_synth,
        "real_macro_f1_per_seed": f1_real,
        "site_images": len(site_u8),
        "site_class_counts": np.bincount(site_labels, minlength=num_classes).tolist(),
        "stage1_iterations": result.stage1_iterations,
        "stage1_quality": result.stage1_quality,
        "stage2_iterations": result.stage2_iterations,
        "stage2_quality": result.stage2_quality,
        "stage2_stop": result.stage2_stop,
        "reference_quality": result.reference_quality,
        "train_s_per_iter": result.seconds_per_iteration,
        "gan_seconds": gan_seconds,
        "total_seconds": time.perf_counter() - t_start,
        "buffer_hash": buffer["content_hash"],
        "generator_stage": info.stage,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.model_dump().items()},
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from genbuffer.errors import LpipsBackboneMissing

    try:
        sys.exit(main())
    except LpipsBackboneMissing as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)
