"""Label efficiency of peer-to-peer self-supervised pre-training (issues 8 and 19).

A ViT classifier fine-tuned with FedAVGP2P starting from a P2P Fed-MAE
encoder, from a P2P Fed-BEiT encoder, and from scratch, at several label
fractions, on an in-memory federation (protocols/memory/), for every seed of
--seeds (the seed draws the partition, the kept labels and every model):

1. Partition the data among --nodes sites (--scheme, seed), once per label
   fraction. The Dirichlet draw comes first, so every fraction gives each site
   the same images; only which of them keep their label changes.
2. Pre-train, over every image of every site, labelled or not, for
   --pretrain-rounds rounds each (FedAVGP2P exchange, --selection heuristic):
   Fed-MAE (mask 0.6, pixel regression), and Fed-BEiT (a tokenizer trained by
   the federation for --tokenizer-rounds rounds first, then blockwise masks of
   at most 40 %, visual-token cross-entropy). Each node writes its encoder
   (and its reconstruction grid or token maps PNG) under its state dir.
3. Scratch: Fed-MAE with 0 rounds writes each node's untouched initial
   encoder, so every arm builds the same classifier (same depth, patch size,
   average pooling, head) through the same code path (`model.pretrained_from`);
   only the pre-training differs.
4. Fine-tune: FedAVGP2P for --finetune-rounds rounds at every label fraction,
   from each arm's encoders, the same seeds, the same --steps-per-round local
   steps per round at every fraction, class-weighted cross-entropy, once per
   lr of --finetune-lrs; each arm keeps, per seed and fraction, the lr whose
   validation macro-F1 (mean over the nodes, last 3 evaluations) is best.

Reported per seed and as mean and standard deviation over the seeds: the mean
over the nodes of the final test macro-F1 (each node's own test share), the
mean of its last 3 evaluations, and accuracy, per fraction and arm; the
tokenizer's codebook perplexity and share of codes in use. Plot: macro-F1
against the label fraction (error bars: std over seeds), the fine-tuning
curves, the pre-training curves. The last stdout line is one JSON object.
Pre-training checkpoints go to disk: a killed run resumes it, and
--reuse skips a pre-training (OUT/seedS/pretrain_ARM.json) or a whole seed
(OUT/seedS/seed.json) finished with the same settings, so the seeds can run
as separate processes (--seeds 0, --seeds 1, ...) and a last run with every
seed and --reuse pools them.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m bench.label_efficiency --out runs/label_efficiency
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import plots
from bench.label_efficiency_runs import ARM_NAMES, ARMS, MODEL, curve_of, run_seed
from p2pfl.files import atomic_write_text

log = logging.getLogger("bench.label_efficiency")

ARM_COLOURS = {"scratch": "tab:gray", "fedmae": "tab:blue", "fedbeit": "tab:orange"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", default="/work/shared/data/pneumoniamnist.npz")
    p.add_argument("--out", type=Path, default=Path("runs/label_efficiency"))
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--scheme", default="dirichlet:0.5")
    p.add_argument("--fractions", default="0.01,0.1,1.0")
    p.add_argument(
        "--seeds", default="0,1,2", help="each draws the partition, the kept labels and the models"
    )
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument(
        "--depth", type=int, default=4, help="ViT blocks (vit_tiny has 12; fewer for CPU)"
    )
    p.add_argument("--pretrain-rounds", type=int, default=40)
    p.add_argument("--pretrain-epochs", type=int, default=1)
    p.add_argument("--pretrain-lr", type=float, default=1e-3)
    p.add_argument("--tokenizer-rounds", type=int, default=10, help="Fed-BEiT's tokenizer stage")
    p.add_argument("--codebook-size", type=int, default=256, help="Fed-BEiT's visual tokens")
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
        "--reuse",
        action="store_true",
        help="reuse finished work in OUT run with the same settings: a pre-training "
        "(OUT/seedS/pretrain_ARM.json) and a whole seed (OUT/seedS/seed.json), so seeds can run "
        "in separate processes and one last run pools them",
    )
    return p.parse_args(argv)


def pooled(per_seed: dict[int, dict[str, Any]], fractions: list[float]) -> dict[str, Any]:
    """Mean and standard deviation over the seeds, per fraction and arm, and the
    gains of the pre-trained arms over scratch."""
    out: dict[str, Any] = {}
    for fraction in fractions:
        rows = [r["table"][str(fraction)] for r in per_seed.values()]
        entry: dict[str, Any] = {"labelled_images": [r["labelled_images"] for r in rows]}
        for arm in ARMS:
            for key in ("macro_f1", "macro_f1_last3", "accuracy"):
                values = [r[f"{arm}_{key}"] for r in rows]
                entry[f"{arm}_{key}"] = round(statistics.fmean(values), 4)
                entry[f"{arm}_{key}_std"] = round(statistics.pstdev(values), 4)
                entry[f"{arm}_{key}_per_seed"] = values
        for arm in ARMS[1:]:
            for key in ("macro_f1", "macro_f1_last3"):
                entry[f"{arm}_{key}_gain"] = round(
                    entry[f"{arm}_{key}"] - entry[f"scratch_{key}"], 4
                )
        out[str(fraction)] = entry
    return out


def mean_curve(records: list[dict[str, Any]]) -> dict[int, float]:
    """Mean over seeds of pre-training curves, over the rounds they all logged."""
    curves = [curve_of(r) for r in records]
    rounds = sorted(set.intersection(*(set(c) for c in curves)))
    return {k: statistics.fmean(c[k] for c in curves) for k in rounds}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    fractions = [float(x) for x in args.fractions.split(",")]
    lrs = [float(x) for x in args.finetune_lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]

    per_seed = {seed: run_seed(args, seed, fractions, lrs) for seed in seeds}
    if args.pretrain_only:
        print(json.dumps({str(s): r["pretraining"] for s, r in per_seed.items()}))
        return
    table = pooled(per_seed, fractions)
    pretrain_curves = {
        arm: mean_curve([r["pretraining"][arm] for r in per_seed.values()]) for arm in ARMS[1:]
    }
    png = args.out / "label_efficiency.png"
    plots.label_efficiency(
        png,
        fractions,
        table,
        per_seed[seeds[0]]["curves"],
        pretrain_curves,
        {arm: (ARM_NAMES[arm], ARM_COLOURS[arm]) for arm in ARMS},
    )

    print()
    print(
        f"| labels | macro-F1 scratch | Fed-MAE | Fed-BEiT | gain Fed-MAE | gain Fed-BEiT "
        f"| last-3 scratch | last-3 Fed-MAE | last-3 Fed-BEiT |   (mean ± std over seeds {seeds})"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for fraction in fractions:
        r = table[str(fraction)]
        cells = [f"{r[f'{arm}_macro_f1']:.3f} ± {r[f'{arm}_macro_f1_std']:.3f}" for arm in ARMS]
        last3 = [f"{r[f'{arm}_macro_f1_last3']:.3f}" for arm in ARMS]
        print(
            f"| {fraction:.0%} | {' | '.join(cells)} | {r['fedmae_macro_f1_gain']:+.3f} "
            f"| {r['fedbeit_macro_f1_gain']:+.3f} | {' | '.join(last3)} |"
        )
    low_label = [str(f) for f in fractions if f < 1.0]
    summary = {
        "bench": "label_efficiency",
        "data": str(args.data),
        "nodes": args.nodes,
        "scheme": args.scheme,
        "seeds": seeds,
        "model": f"{MODEL} depth {args.depth}, patch {pre_patch(args)}, {args.image_size}px, avg pool",
        "pretrain": {
            "rounds": args.pretrain_rounds,
            "epochs_per_round": args.pretrain_epochs,
            "lr": args.pretrain_lr,
            "fedmae": {"mask_ratio": 0.6, "metric": "recon_loss"},
            "fedbeit": {
                "mask_ratio": 0.4,
                "masking": "blockwise",
                "metric": "token_loss",
                "tokenizer_rounds": args.tokenizer_rounds,
                "codebook_size": args.codebook_size,
            },
            "per_seed": {
                str(s): {
                    arm: {
                        "first": curve_of(rec)[min(curve_of(rec))],
                        "last": curve_of(rec)[max(curve_of(rec))],
                        "wall_s": rec["wall_s"],
                        **({"tokenizer": rec["tokenizer"]} if "tokenizer" in rec else {}),
                    }
                    for arm, rec in r["pretraining"].items()
                }
                for s, r in per_seed.items()
            },
        },
        "finetune": {
            "protocol": "fedavgp2p",
            "rounds": args.finetune_rounds,
            "steps_per_round": args.steps_per_round,
            "lrs": lrs,
            "lr_selection": "per seed, arm and fraction: best validation macro-F1 (mean of the last 3 evaluations)",
            "selection": args.selection,
            "fraction": args.fraction,
        },
        "results": table,
        "per_seed": {str(s): r["table"] for s, r in per_seed.items()},
        "target_met": {
            arm: all(table[f][f"{arm}_macro_f1_gain"] > 0 for f in low_label) for arm in ARMS[1:]
        },
        "target_met_last3": {
            arm: all(table[f][f"{arm}_macro_f1_last3_gain"] > 0 for f in low_label)
            for arm in ARMS[1:]
        },
        "plot": str(png),
        "token_maps": [r["pretraining"]["fedbeit"].get("token_maps") for r in per_seed.values()],
        "wall_s": round(time.perf_counter() - start, 1),
    }
    atomic_write_text(args.out / "results.json", json.dumps(summary, indent=2) + "\n")
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
