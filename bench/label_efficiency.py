"""Label efficiency of peer-to-peer Fed-MAE pre-training (issue 8).

A ViT classifier fine-tuned with FedAVGP2P starting from a P2P Fed-MAE
pre-trained encoder against the same classifier started from scratch, at
several label fractions, on an in-memory federation (protocols/memory/):

1. Partition the data among --nodes sites (--scheme, --seed), once per label
   fraction. The Dirichlet draw comes first, so every fraction gives each site
   the same images; only which of them keep their label changes.
2. Pre-train: Fed-MAE (FedAVGP2P exchange, --selection heuristic) for
   --pretrain-rounds rounds over every image of every site, labelled or not.
   Each node writes its encoder and its reconstruction grid PNG under its
   state dir.
3. Scratch: the same protocol with 0 rounds writes each node's untouched
   initial encoder, so both arms build the same classifier (same depth, patch
   size, average pooling, head) through the same code path
   (`model.pretrained_from`); only the pre-training differs.
4. Fine-tune: FedAVGP2P for --finetune-rounds rounds at every label fraction,
   from each arm's encoders, same seeds, the same --steps-per-round local steps
   per round at every fraction, class-weighted cross-entropy, once per lr of
   --finetune-lrs; each arm keeps, per fraction, the lr whose validation
   macro-F1 (mean over the nodes, last 3 evaluations) is best.

Reported, for the kept lr: mean over the nodes of the final test macro-F1
(each node's own test share), the mean of the last 3 evaluations of it, and
accuracy, per fraction and arm. Plot: macro-F1 against the label fraction, the
fine-tuning curves, and the pre-training reconstruction loss. The last stdout
line is one JSON object. Pre-training checkpoints go to disk: a killed run
resumes it, a larger --pretrain-rounds extends it, and --reuse-pretraining
skips it when OUT/pretrain.json holds a finished one.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m bench.label_efficiency --out runs/label_efficiency
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from p2pfl.config import SiteConfig
from p2pfl.files import atomic_write_text
from p2pfl.learning.data.partition import partition_dataset
from protocols.memory import InMemoryNetwork, SimulationResult, simulate, simulation_configs

log = logging.getLogger("bench.label_efficiency")

MODEL = "vit_tiny_patch16_224"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", default="/work/shared/data/pneumoniamnist.npz")
    p.add_argument("--out", type=Path, default=Path("runs/label_efficiency"))
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--scheme", default="dirichlet:0.5")
    p.add_argument("--fractions", default="0.01,0.1,1.0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument(
        "--depth", type=int, default=4, help="ViT blocks (vit_tiny has 12; fewer for CPU)"
    )
    p.add_argument("--pretrain-rounds", type=int, default=40)
    p.add_argument("--pretrain-epochs", type=int, default=1)
    p.add_argument("--pretrain-lr", type=float, default=1e-3)
    p.add_argument("--finetune-rounds", type=int, default=20)
    p.add_argument(
        "--finetune-lrs",
        default="3e-4,5e-4",
        help="each arm is fine-tuned with each; it keeps the best on validation macro-F1",
    )
    p.add_argument("--steps-per-round", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--fraction", type=float, default=0.5, help="c of the FedAVGP2P exchange")
    p.add_argument("--selection", default="random")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 wastes least on shared cores)"
    )
    p.add_argument("--pretrain-only", action="store_true", help="stop after pre-training")
    p.add_argument(
        "--reuse-pretraining",
        action="store_true",
        help="skip pre-training when OUT/pretrain.json holds a finished one with these settings",
    )
    return p.parse_args(argv)


def run_simulation(
    configs: list[SiteConfig], checkpoint_dir: Path | None = None
) -> SimulationResult:
    network = InMemoryNetwork(inline_train=True, checkpoint_dir=checkpoint_dir)
    result = asyncio.run(simulate(configs, network=network, fail_fast=True))
    if result.errors:
        raise RuntimeError(f"simulation failed: {result.first_error() or result.errors}")
    return result


def last_evaluations_mean(result: SimulationResult, metric: str, count: int = 3) -> float:
    """Mean over the last `count` evaluated rounds of the mean over the nodes
    (one round can swing by several points)."""
    by_round = result.mean_by_round(metric)
    return statistics.fmean(by_round[r] for r in sorted(by_round)[-count:])


def run_figures(result: SimulationResult) -> dict[str, float]:
    return {
        "macro_f1": round(final_mean(result, "macro_f1"), 4),
        "macro_f1_last3": round(last_evaluations_mean(result, "macro_f1"), 4),
        "accuracy": round(final_mean(result, "accuracy"), 4),
        "val_macro_f1_last3": round(last_evaluations_mean(result, "val_macro_f1"), 4),
    }


def final_mean(result: SimulationResult, metric: str) -> float:
    """Mean over the nodes of the metric at each node's last logged round."""
    values = []
    for node in result.nodes():
        series = result.metric(metric, node)
        values.append(series[max(series)])
    return statistics.fmean(values)


def site_configs(
    args: argparse.Namespace,
    sources: list[str],
    state_root: Path,
    *,
    protocol: dict[str, Any],
    training: dict[str, Any],
) -> list[SiteConfig]:
    """Both arms' sites: the ViT on --image-size grey images, weak augmentation,
    --selection neighbours, --seed; `protocol` and `training` per phase."""
    return simulation_configs(
        sources,
        protocol=protocol,
        seed=args.seed,
        state_root=state_root,
        model={"name": MODEL},
        data={"image_size": args.image_size, "channels": 1, "augment": "weak"},
        training=training,
        selection={"name": args.selection},
    )


def pretrain(
    args: argparse.Namespace, sources: list[str], rounds: int, state_root: Path
) -> tuple[list[Path], SimulationResult]:
    configs = site_configs(
        args,
        sources,
        state_root,
        protocol={
            "name": "fedmae",
            "rounds": rounds,
            "fraction": args.fraction,
            "encoder_depth": args.depth,
            "round_timeout_s": 600.0,
            "eval_every": 1,
        },
        training={
            "epochs": args.pretrain_epochs,
            "batch_size": 64,
            "lr": args.pretrain_lr,
            "device": "cpu",
            "lr_schedule": "constant",  # as the README's figures were measured
        },
    )
    # on disk, so a killed benchmark resumes pre-training where it stopped
    result = run_simulation(configs, checkpoint_dir=state_root / "checkpoints")
    return [Path(cfg.node.state_dir) / cfg.protocol.encoder_out for cfg in configs], result


def finetune(
    args: argparse.Namespace,
    sources: list[str],
    encoders: list[Path],
    lr: float,
    state_root: Path,
) -> SimulationResult:
    """FedAVGP2P from the given per-node encoders: --steps-per-round local steps
    per round whatever the number of labels, class-weighted cross-entropy (the
    training split is 90 % pneumonia)."""
    configs = site_configs(
        args,
        sources,
        state_root,
        protocol={
            "name": "fedavgp2p",
            "rounds": args.finetune_rounds,
            "fraction": args.fraction,
            "round_timeout_s": 600.0,
            "eval_every": args.eval_every,
        },
        training={
            "steps_per_round": args.steps_per_round,
            "class_weighted": True,
            "batch_size": args.batch_size,
            "lr": lr,
            "device": "cpu",
            "lr_schedule": "constant",  # as the README's figures were measured
        },
    )
    for cfg, encoder in zip(configs, encoders, strict=True):
        cfg.model.pretrained_from = encoder
    return run_simulation(configs)


def plot(
    path: Path,
    fractions: list[float],
    table: dict[str, dict[str, Any]],
    curves: dict[str, dict[str, dict[int, float]]],
    pretrain_curve: dict[int, float],
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.8))
    FigureCanvasAgg(fig)
    ax_bar, ax_curve, ax_pre = fig.subplots(1, 3)
    labels = [f"{f:.0%}" for f in fractions]
    width = 0.38
    xs = range(len(fractions))
    for offset, arm, colour in (
        (-width / 2, "scratch", "tab:gray"),
        (width / 2, "fedmae", "tab:blue"),
    ):
        values = [table[str(f)][f"{arm}_macro_f1"] for f in fractions]
        bars = ax_bar.bar([x + offset for x in xs], values, width, label=arm, color=colour)
        ax_bar.bar_label(bars, fmt="%.3f", fontsize=7)
    ax_bar.set_xticks(list(xs), labels)
    ax_bar.set_xlabel("labelled share of the training images")
    ax_bar.set_ylabel("final macro-F1 (mean over nodes)")
    ax_bar.set_ylim(0, 1)
    ax_bar.legend(loc="lower right")
    ax_bar.set_title("FedAVGP2P fine-tuning")
    styles = {"fedmae": "-", "scratch": "--"}
    for key, series in curves.items():
        fraction, arm = key.split("|")
        ax_curve.plot(
            list(series),
            list(series.values()),
            styles[arm],
            marker=".",
            label=f"{arm} {float(fraction):.0%}",
        )
    ax_curve.set_xlabel("fine-tuning round")
    ax_curve.set_ylabel("test macro-F1 (mean over nodes)")
    ax_curve.legend(fontsize=7)
    ax_curve.set_title("fine-tuning curves")
    ax_pre.plot(list(pretrain_curve), list(pretrain_curve.values()), marker=".")
    ax_pre.set_xlabel("pre-training round")
    ax_pre.set_ylabel("test reconstruction loss (masked patches)")
    ax_pre.set_title("P2P Fed-MAE pre-training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    fractions = [float(x) for x in args.fractions.split(",")]
    lrs = [float(x) for x in args.finetune_lrs.split(",")]

    # 1. One partition per label fraction (same images per site in each).
    partitions: dict[float, tuple[list[str], list[int]]] = {}
    for fraction in fractions:
        folder = out / "data" / f"labels_{fraction:g}"
        summary = partition_dataset(
            args.data,
            args.nodes,
            args.scheme,
            folder,
            label_fraction=None if fraction >= 1.0 else fraction,
            seed=args.seed,
        )
        sources = [str(folder / row["file"]) for row in summary["per_site"]]
        partitions[fraction] = (sources, [row["labelled"] for row in summary["per_site"]])
    all_images_sources = partitions[fractions[0]][0]

    # 2-3. Pre-trained and untouched (0-round) encoders for every node.
    pretrain_json = out / "pretrain.json"
    setting = {"rounds": args.pretrain_rounds, "depth": args.depth, "seed": args.seed}
    saved = json.loads(pretrain_json.read_text()) if pretrain_json.exists() else {}
    if args.reuse_pretraining and saved.get("setting") == setting:
        pretrained = [Path(p) for p in saved["encoders"]]
        pretrain_s = saved["wall_s"]
        pretrain_curve = {int(k): v for k, v in saved["curve"].items()}
        print(f"pre-training: reusing {pretrain_json}", flush=True)
    else:
        t0 = time.perf_counter()
        pretrained, pre = pretrain(
            args, all_images_sources, args.pretrain_rounds, out / "state" / "pretrain"
        )
        pretrain_s = time.perf_counter() - t0
        # a run that resumed from checkpoints (killed, or asked for more rounds)
        # logs only its new rounds: the earlier ones come from pretrain.json
        pretrain_curve = pre.mean_by_round("recon_loss")
        earlier = saved.get("setting", {})
        if pretrain_curve and (earlier.get("depth"), earlier.get("seed")) == (
            args.depth,
            args.seed,
        ):
            first = min(pretrain_curve)
            old = {int(k): v for k, v in saved["curve"].items() if int(k) < first}
            pretrain_curve = {**old, **pretrain_curve}
            pretrain_s += saved["wall_s"] if old else 0.0
        if not pretrain_curve:
            raise SystemExit(
                f"{out / 'state' / 'pretrain'}: checkpoints already hold a finished pre-training — "
                "pass --reuse-pretraining or delete that folder"
            )
        # read back by the next run (--reuse-pretraining): whole or absent
        atomic_write_text(
            pretrain_json,
            json.dumps(
                {
                    "setting": setting,
                    "encoders": [str(p) for p in pretrained],
                    "wall_s": pretrain_s,
                    "curve": pretrain_curve,
                },
                indent=2,
            )
            + "\n",
        )
    if args.pretrain_only:
        print(json.dumps({"pretrain_rounds": args.pretrain_rounds, "curve": pretrain_curve}))
        return
    scratch, _ = pretrain(args, all_images_sources, 0, out / "state" / "scratch")
    print(
        f"pre-training: {args.pretrain_rounds} rounds in {pretrain_s:.0f} s, test reconstruction "
        f"loss {pretrain_curve[min(pretrain_curve)]:.4f} -> {pretrain_curve[max(pretrain_curve)]:.4f}",
        flush=True,
    )

    # 4. Fine-tune both arms at every label fraction, each lr of --finetune-lrs;
    #    each arm keeps the lr with the best validation macro-F1.
    table: dict[str, dict[str, Any]] = {}
    curves: dict[str, dict[int, float]] = {}
    for fraction in fractions:
        sources, labelled = partitions[fraction]
        row: dict[str, Any] = {"labelled_images": sum(labelled)}
        for arm, encoders in (("scratch", scratch), ("fedmae", pretrained)):
            tried: dict[str, dict[str, float]] = {}
            results: dict[str, SimulationResult] = {}
            for lr in lrs:
                t0 = time.perf_counter()
                result = finetune(
                    args,
                    sources,
                    encoders,
                    lr,
                    out / "state" / f"finetune_{arm}_{fraction:g}_lr{lr:g}",
                )
                figures = run_figures(result)
                figures["wall_s"] = round(time.perf_counter() - t0, 1)
                tried[f"{lr:g}"], results[f"{lr:g}"] = figures, result
                print(
                    f"labels {fraction:.0%} ({sum(labelled)} images) {arm} lr {lr:g}: test macro-F1 "
                    f"{figures['macro_f1']:.4f} (last 3 evaluations {figures['macro_f1_last3']:.4f}), "
                    f"val macro-F1 {figures['val_macro_f1_last3']:.4f} ({figures['wall_s']:.0f} s)",
                    flush=True,
                )
            best = max(tried, key=lambda lr: tried[lr]["val_macro_f1_last3"])
            row[f"{arm}_lr"] = float(best)
            for key in ("macro_f1", "macro_f1_last3", "accuracy"):
                row[f"{arm}_{key}"] = tried[best][key]
            row[f"{arm}_by_lr"] = tried
            curves[f"{fraction}|{arm}"] = results[best].mean_by_round("macro_f1")
        row["macro_f1_gain"] = round(row["fedmae_macro_f1"] - row["scratch_macro_f1"], 4)
        row["macro_f1_last3_gain"] = round(
            row["fedmae_macro_f1_last3"] - row["scratch_macro_f1_last3"], 4
        )
        table[str(fraction)] = row

    png = out / "label_efficiency.png"
    plot(png, fractions, table, curves, pretrain_curve)
    grids = sorted(str(p) for p in (out / "state" / "pretrain").glob("*/mae_reconstruction.png"))

    print()
    print(
        "| labels | labelled images | macro-F1 scratch | macro-F1 Fed-MAE | gain "
        "| last-3 mean scratch | last-3 mean Fed-MAE | gain | accuracy scratch | accuracy Fed-MAE "
        "| lr scratch | lr Fed-MAE |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fraction in fractions:
        r = table[str(fraction)]
        print(
            f"| {fraction:.0%} | {r['labelled_images']} | {r['scratch_macro_f1']:.4f} "
            f"| {r['fedmae_macro_f1']:.4f} | {r['macro_f1_gain']:+.4f} "
            f"| {r['scratch_macro_f1_last3']:.4f} | {r['fedmae_macro_f1_last3']:.4f} "
            f"| {r['macro_f1_last3_gain']:+.4f} | {r['scratch_accuracy']:.4f} "
            f"| {r['fedmae_accuracy']:.4f} | {r['scratch_lr']:g} | {r['fedmae_lr']:g} |"
        )
    low_label = [f for f in fractions if f < 1.0]
    summary = {
        "bench": "label_efficiency",
        "data": str(args.data),
        "nodes": args.nodes,
        "scheme": args.scheme,
        "seed": args.seed,
        "model": f"{MODEL} depth {args.depth}, patch {pre_patch(args)}, {args.image_size}px, avg pool",
        "pretrain": {
            "rounds": args.pretrain_rounds,
            "epochs_per_round": args.pretrain_epochs,
            "mask_ratio": 0.6,
            "recon_loss_first_round": round(pretrain_curve[min(pretrain_curve)], 4),
            "recon_loss_last_round": round(pretrain_curve[max(pretrain_curve)], 4),
            "wall_s": round(pretrain_s, 1),
        },
        "finetune": {
            "protocol": "fedavgp2p",
            "rounds": args.finetune_rounds,
            "steps_per_round": args.steps_per_round,
            "lrs": lrs,
            "lr_selection": "per arm and fraction, best validation macro-F1 (mean of the last 3 evaluations)",
            "selection": args.selection,
            "fraction": args.fraction,
        },
        "results": table,
        "target_met": all(table[str(f)]["macro_f1_gain"] > 0 for f in low_label),
        "target_met_last3": all(table[str(f)]["macro_f1_last3_gain"] > 0 for f in low_label),
        "plot": str(png),
        "reconstruction_grids": grids,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary))


def pre_patch(args: argparse.Namespace) -> int:
    from p2pfl.learning.mae import mae_patch_size

    return mae_patch_size(args.image_size, 1)


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as exc:  # a failed node: its one-line reason, non-zero exit
        sys.stderr.write(f"error: {str(exc).splitlines()[0]}\n")
        sys.exit(1)
