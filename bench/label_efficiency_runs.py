"""One seed of bench/label_efficiency.py: the arms' site configurations,
pre-training (cached per arm and seed), fine-tuning at every label fraction
and lr, and the figures of a run."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from p2pfl.config import SiteConfig
from p2pfl.files import atomic_write_text
from p2pfl.learning.data.partition import partition_dataset
from protocols.memory import InMemoryNetwork, SimulationResult, simulate, simulation_configs

MODEL = "vit_tiny_patch16_224"
ARMS = ("scratch", "fedmae", "fedbeit")
ARM_NAMES = {"scratch": "scratch", "fedmae": "Fed-MAE", "fedbeit": "Fed-BEiT"}
PRETRAIN_METRIC = {"fedmae": "recon_loss", "fedbeit": "token_loss"}


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
    seed: int,
    protocol: dict[str, Any],
    training: dict[str, Any],
) -> list[SiteConfig]:
    """Every arm's sites: the ViT on --image-size grey images, weak augmentation,
    --selection neighbours, `seed`; `protocol` and `training` per phase."""
    return simulation_configs(
        sources,
        protocol=protocol,
        seed=seed,
        state_root=state_root,
        model={"name": MODEL},
        data={"image_size": args.image_size, "channels": 1, "augment": "weak"},
        training=training,
        selection={"name": args.selection},
    )


def pretrain_protocol(args: argparse.Namespace, arm: str, rounds: int) -> dict[str, Any]:
    """The pre-training section of an arm: the same rounds, exchange, depth and
    local training for Fed-MAE and Fed-BEiT (scratch: Fed-MAE with 0 rounds)."""
    common = {
        "rounds": rounds,
        "fraction": args.fraction,
        "encoder_depth": args.depth,
        "round_timeout_s": 600.0,
        "eval_every": 1,
    }
    if arm == "fedbeit":
        return {
            "name": "fedbeit",
            **common,
            "tokenizer_rounds": args.tokenizer_rounds,
            "codebook_size": args.codebook_size,
        }
    return {"name": "fedmae", **common}


def pretrain(
    args: argparse.Namespace,
    sources: list[str],
    arm: str,
    rounds: int,
    state_root: Path,
    seed: int,
) -> tuple[list[Path], SimulationResult]:
    configs = site_configs(
        args,
        sources,
        state_root,
        seed=seed,
        protocol=pretrain_protocol(args, arm, rounds),
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
    seed: int,
) -> SimulationResult:
    """FedAVGP2P from the given per-node encoders: --steps-per-round local steps
    per round whatever the number of labels, class-weighted cross-entropy (the
    training split is 90 % pneumonia)."""
    configs = site_configs(
        args,
        sources,
        state_root,
        seed=seed,
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


def cached_pretraining(
    args: argparse.Namespace, sources: list[str], arm: str, out: Path, seed: int
) -> dict[str, Any]:
    """An arm's pre-training for one seed: its encoders, wall time, the curve of
    its pre-training loss (and for Fed-BEiT the tokenizer's figures), from
    OUT/seedS/pretrain_ARM.json when --reuse finds a finished one."""
    record = out / f"pretrain_{arm}.json"
    setting = {
        "protocol": pretrain_protocol(args, arm, args.pretrain_rounds),
        "epochs": args.pretrain_epochs,
        "lr": args.pretrain_lr,
        "seed": seed,
    }
    if args.reuse and record.exists():
        saved = json.loads(record.read_text())
        if saved.get("setting") == setting:
            print(f"seed {seed}: {ARM_NAMES[arm]} pre-training reused from {record}", flush=True)
            return saved
    t0 = time.perf_counter()
    encoders, result = pretrain(args, sources, arm, args.pretrain_rounds, out / "state" / arm, seed)
    metric = PRETRAIN_METRIC[arm]
    curve = result.mean_by_round(metric)
    if not curve:
        raise SystemExit(
            f"{out / 'state' / arm}: its checkpoints hold a finished pre-training — pass "
            "--reuse or delete that folder"
        )
    saved = {
        "setting": setting,
        "encoders": [str(p) for p in encoders],
        "wall_s": round(time.perf_counter() - t0, 1),
        "metric": metric,
        "curve": {str(k): v for k, v in curve.items()},
    }
    if arm == "fedbeit":
        last = args.tokenizer_rounds
        saved["tokenizer"] = {
            "rounds": last,
            "codebook_size": args.codebook_size,
            "recon_loss_first": result.mean_by_round("tokenizer_recon_loss").get(1),
            "recon_loss_last": result.mean_by_round("tokenizer_recon_loss").get(last),
            "perplexity_last": result.mean_by_round("codebook_perplexity").get(last),
            "codes_used_last": result.mean_by_round("codebook_used").get(last),
        }
        maps = out / "state" / arm / result.nodes()[0] / "beit_tokens.png"
        if maps.is_file():
            shutil.copyfile(maps, out / "beit_tokens.png")
            saved["token_maps"] = str(out / "beit_tokens.png")
    atomic_write_text(record, json.dumps(saved, indent=2) + "\n")  # whole or absent
    return saved


def run_seed(
    args: argparse.Namespace, seed: int, fractions: list[float], lrs: list[float]
) -> dict[str, Any]:
    """Every arm at every fraction for one seed: the table row per fraction, the
    kept runs' fine-tuning curves, the pre-training records (from
    OUT/seedS/seed.json with --reuse when that seed finished with these settings)."""
    out: Path = args.out / f"seed{seed}"
    seed_file = out / "seed.json"
    setting = seed_setting(args, seed, fractions, lrs)
    if args.reuse and seed_file.exists() and not args.pretrain_only:
        saved = json.loads(seed_file.read_text())
        if saved.get("setting") == setting:
            print(f"seed {seed}: reused from {seed_file}", flush=True)
            saved["curves"] = {
                k: {int(r): v for r, v in c.items()} for k, c in saved["curves"].items()
            }
            return saved
    partitions: dict[float, tuple[list[str], list[int]]] = {}
    for fraction in fractions:
        folder = out / "data" / f"labels_{fraction:g}"
        summary = partition_dataset(
            args.data,
            args.nodes,
            args.scheme,
            folder,
            label_fraction=None if fraction >= 1.0 else fraction,
            seed=seed,
        )
        sources = [str(folder / row["file"]) for row in summary["per_site"]]
        partitions[fraction] = (sources, [row["labelled"] for row in summary["per_site"]])
    all_images = partitions[fractions[0]][0]

    pretrained = {arm: cached_pretraining(args, all_images, arm, out, seed) for arm in ARMS[1:]}
    for arm, record in pretrained.items():
        curve = curve_of(record)
        print(
            f"seed {seed}: {ARM_NAMES[arm]} pre-training {args.pretrain_rounds} rounds in "
            f"{record['wall_s']:.0f} s, test {record['metric']} "
            f"{curve[min(curve)]:.4f} -> {curve[max(curve)]:.4f}",
            flush=True,
        )
    if args.pretrain_only:
        return {"pretraining": pretrained}
    scratch, _ = pretrain(args, all_images, "scratch", 0, out / "state" / "scratch", seed)
    encoders = {
        "scratch": scratch,
        **{arm: [Path(p) for p in r["encoders"]] for arm, r in pretrained.items()},
    }

    table: dict[str, dict[str, Any]] = {}
    curves: dict[str, dict[int, float]] = {}
    for fraction in fractions:
        sources, labelled = partitions[fraction]
        row: dict[str, Any] = {"labelled_images": sum(labelled)}
        for arm in ARMS:
            tried: dict[str, dict[str, float]] = {}
            results: dict[str, SimulationResult] = {}
            for lr in lrs:
                t0 = time.perf_counter()
                result = finetune(
                    args,
                    sources,
                    encoders[arm],
                    lr,
                    out / "state" / f"finetune_{arm}_{fraction:g}_lr{lr:g}",
                    seed,
                )
                figures = run_figures(result)
                figures["wall_s"] = round(time.perf_counter() - t0, 1)
                tried[f"{lr:g}"], results[f"{lr:g}"] = figures, result
                print(
                    f"seed {seed} labels {fraction:.0%} ({sum(labelled)} images) {ARM_NAMES[arm]} "
                    f"lr {lr:g}: test macro-F1 {figures['macro_f1']:.4f} (last 3 evaluations "
                    f"{figures['macro_f1_last3']:.4f}), val macro-F1 "
                    f"{figures['val_macro_f1_last3']:.4f} ({figures['wall_s']:.0f} s)",
                    flush=True,
                )
            best = max(tried, key=lambda lr: tried[lr]["val_macro_f1_last3"])
            row[f"{arm}_lr"] = float(best)
            for key in ("macro_f1", "macro_f1_last3", "accuracy"):
                row[f"{arm}_{key}"] = tried[best][key]
            row[f"{arm}_by_lr"] = tried
            curves[f"{fraction}|{arm}"] = results[best].mean_by_round("macro_f1")
        table[str(fraction)] = row
    done = {"setting": setting, "table": table, "curves": curves, "pretraining": pretrained}
    atomic_write_text(seed_file, json.dumps(done, indent=2) + "\n")
    return done


def seed_setting(
    args: argparse.Namespace, seed: int, fractions: list[float], lrs: list[float]
) -> dict[str, Any]:
    """What a seed's figures depend on: a cached seed is reused only when all match."""
    keys = [
        "data",
        "nodes",
        "scheme",
        "image_size",
        "depth",
        "pretrain_rounds",
        "pretrain_epochs",
        "pretrain_lr",
        "tokenizer_rounds",
        "codebook_size",
        "finetune_rounds",
        "steps_per_round",
        "batch_size",
        "fraction",
        "selection",
        "eval_every",
    ]
    return {"seed": seed, "fractions": fractions, "lrs": lrs, **{k: getattr(args, k) for k in keys}}


def curve_of(record: dict[str, Any]) -> dict[int, float]:
    """A pre-training record's curve with int rounds (JSON keeps them as text)."""
    return {int(k): float(v) for k, v in record["curve"].items()}
