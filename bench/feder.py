"""FedER vs FedER-A vs FedER-B vs FedAVGP2P vs standalone, cross-site (FedER Tables 3, 7, 8).

    python -m bench.feder --data ../shared/data/pneumoniamnist.npz --nodes 4 \\
        --partition dirichlet:0.3 --rounds 10 --seeds 0 1 2 \\
        --lpips-weights ../shared/weights/lpips_alex_v0.1_full_state.pth --out runs/feder

For each seed:
1. Partition the data among the nodes (label skew).
2. Train one privacy-preserving generator per node on its own training images
   (genbuffer, two stages, with the configured LPIPS; reused by every FedER
   variant, so all compare on the same buffers; kept in OUT/seed_S/gan/). Every
   buffer goes through the node's privacy gate before it is shared.
3. Run each protocol in one process over the in-memory network (the same
   protocol code as the daemon) on one footing: same model, local steps per
   round, class weighting, learning-rate schedule, augmentation and rounds.
4. Evaluate every final node model on every node's test set (cross-site).
A seed's results are kept in OUT/seed_S/results.json and reused when the command
is run again, so seeds can run in separate processes and a crash loses one seed
at most. Then: mean and std over seeds per method, bytes sent per node per round,
OUT/results.json and OUT/feder.png; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.baselines import standalone  # noqa: E402
from genbuffer.config import GenbufferSection  # noqa: E402
from genbuffer.errors import GenbufferError  # noqa: E402
from genbuffer.train import GENERATOR_FILE, train_generator  # noqa: E402
from node.evaluate import cross_site  # noqa: E402
from p2pfl.files import atomic_write_text  # noqa: E402
from p2pfl.learning.data import load_site_data  # noqa: E402
from p2pfl.learning.data.partition import partition_dataset  # noqa: E402
from p2pfl.learning.train import LocalSite  # noqa: E402
from protocols.memory import InMemoryNetwork, simulate, simulation_configs  # noqa: E402

log = logging.getLogger("bench.feder")
PROTOCOLS = ("feder", "feder_a", "feder_b", "fedavgp2p")


def train_generators(configs: list, args: argparse.Namespace, out: Path) -> dict[str, str]:
    section = GenbufferSection(
        resolution=args.gan_resolution,
        channel_base=args.gan_channel_base,
        channel_max=args.gan_channel_max,
        z_dim=64,
        w_dim=64,
        mapping_layers=2,
        iterations=args.gan_iterations,
        stage1_patience=args.gan_iterations,
        stage2_iterations=args.gan_iterations // 4,
        quality_every=max(50, args.gan_iterations // 8),
        quality_samples=256,
        train_reference=False,
        lpips_backbone=args.lpips_backbone,
        lpips_weights=args.lpips_weights,
        device="auto",
        seed=args.seed,
    )
    paths = {}
    for cfg in configs:
        gan_dir = out / "gan" / cfg.node.name
        path = gan_dir / GENERATOR_FILE
        if not path.exists():
            data = load_site_data(cfg.data, seed=cfg.federation.seed + cfg.training.seed)
            t0 = time.perf_counter()
            train_generator(data.train_uint8, data.train_labels, data.num_classes, section, gan_dir)
            log.info("generator for %s trained in %.0f s", cfg.node.name, time.perf_counter() - t0)
        paths[cfg.node.name] = str(path)
    return paths


def run_protocol(
    name: str, sources: list[str], args: argparse.Namespace, generators: dict[str, str], out: Path
) -> dict[str, Any]:
    protocol: dict[str, Any] = {"name": name, "rounds": args.rounds, "round_timeout_s": 120}
    if name.startswith("feder"):
        protocol.update(buffer_size=args.buffer_size, initial_epochs=args.initial_epochs)
    else:
        protocol.update(fraction=args.fraction)
    configs = simulation_configs(
        sources,
        protocol=protocol,
        state_root=out / "state" / name,
        seed=args.seed,
        **common_sections(args),
    )
    for cfg in configs:
        if name.startswith("feder"):
            cfg.protocol.generator = generators[cfg.node.name]
    network = InMemoryNetwork()
    t0 = time.perf_counter()
    result = asyncio.run(simulate(configs, network=network, fail_fast=True))
    wall = time.perf_counter() - t0
    if result.errors:
        raise RuntimeError(f"{name}: {result.first_error() or result.errors}")
    states = {c.node.name: network.saved_state(c.node.name)["model"] for c in configs}
    records = [r for r in result.records if r["round"] >= 1]
    rounds = max(r["round"] for r in records)
    bytes_total = sum(
        max(r["bytes_sent"] for r in records if r["node"] == c.node.name) for c in configs
    )
    return {
        "states": states,
        "configs": configs,
        "per_round_macro_f1": result.mean_by_round("macro_f1"),
        "bytes_per_node_per_round": bytes_total / len(configs) / rounds,
        "wall_s": wall,
    }


def common_sections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """What every method shares: one footing for FedER, its variants, FedAVGP2P and
    standalone (the project's defaults: class weighting where a site is skewed,
    the cosine schedule, weak augmentation), and the same local steps per round."""
    training: dict[str, Any] = {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "class_weighted": args.class_weighted,
        "lr_schedule": args.lr_schedule,
    }
    if args.steps_per_round:
        training["steps_per_round"] = args.steps_per_round
    return {
        "data": {"image_size": args.image_size, "augment": args.augment},
        "model": {"name": args.model},
        "training": training,
        "genbuffer": {
            "lpips_backbone": args.lpips_backbone,
            **({"lpips_weights": str(args.lpips_weights.resolve())} if args.lpips_weights else {}),
        },
    }


METRICS = ("accuracy", "balanced_accuracy", "macro_f1")


def run_seed(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Every method on one partition (seed args.seed); kept in OUT/results.json and
    read back instead of recomputed when present."""
    done = out / "results.json"
    if done.is_file():
        log.info("seed %d: reusing %s", args.seed, done)
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    partition_dataset(args.data, args.nodes, args.partition, out / "data", seed=args.seed)
    sources = [str(out / "data" / f"site_{i}.npz") for i in range(args.nodes)]
    base_configs = simulation_configs(
        sources,
        protocol={"name": "fedavgp2p", "rounds": args.rounds},
        state_root=out / "state" / "standalone",
        seed=args.seed,
        **common_sections(args),
    )
    generators = train_generators(base_configs, args, out)
    sites = {cfg.node.name: LocalSite.from_config(cfg) for cfg in base_configs}

    methods: dict[str, dict[str, Any]] = {}
    for name in args.protocols.split(","):
        log.info("seed %d: running %s", args.seed, name)
        run = run_protocol(name, sources, args, generators, out)
        methods[name] = method_row(
            cross_site(sites, run["states"], "test", ensemble=True),
            per_round_macro_f1=run["per_round_macro_f1"],
            bytes_per_node_per_round=run["bytes_per_node_per_round"],
            wall_s=run["wall_s"],
        )
    alone = standalone(base_configs)
    methods["standalone"] = method_row(
        cross_site(sites, alone.final_states, "test", ensemble=True),
        bytes_per_node_per_round=0.0,
    )
    result = {"seed": args.seed, "methods": methods, "gates": gate_decisions(out)}
    atomic_write_text(done, json.dumps(result, indent=2, default=str))
    return result


def method_row(evaluation: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One method's entry of a seed's results: its cross-site figures and `extra`."""
    return {
        "cross_site": {k: v for k, v in evaluation.items() if k.endswith(("_mean", "_std"))},
        "ensemble_accuracy": evaluation["ensemble"]["accuracy_mean"],
        "per_model": evaluation["per_model"],
        **extra,
    }


def gate_decisions(out: Path) -> dict[str, Any]:
    """The privacy gate's decision for each node's buffer (FedER runs), by node."""
    from genbuffer.gate import read_decision

    found: dict[str, Any] = {}
    for state in sorted((out / "state").glob("feder*/*/genbuffer")):
        decision = read_decision(state)
        if decision is not None:
            found[f"{state.parent.parent.name}/{state.parent.name}"] = {
                k: decision[k] for k in ("released", "exposed_fraction", "distance")
            }
    return found


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """mean and std over seeds of each method's cross-site means (and of its bytes)."""
    table: dict[str, dict[str, float]] = {}
    for name in per_seed[0]["methods"]:
        row: dict[str, float] = {}
        for metric in METRICS:
            values = [r["methods"][name]["cross_site"][f"{metric}_mean"] for r in per_seed]
            row[f"{metric}_mean"] = float(np.mean(values))
            row[f"{metric}_std_over_seeds"] = float(np.std(values))
            row[f"{metric}_per_seed"] = [round(v, 4) for v in values]
            within = [r["methods"][name]["cross_site"][f"{metric}_std"] for r in per_seed]
            row[f"{metric}_std_models_x_sites"] = float(np.mean(within))
        row["kb_per_node_per_round"] = float(
            np.mean([r["methods"][name]["bytes_per_node_per_round"] for r in per_seed]) / 1024
        )
        table[name] = row
    return table


def plot(table: dict[str, dict[str, float]], args: argparse.Namespace, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(table)
    colours = ["#2b6cb0", "#4299e1", "#90cdf4", "#dd6b20", "#a0aec0"]
    for ax, metric in zip(axes, ("accuracy", "macro_f1"), strict=True):
        means = [table[n][f"{metric}_mean"] for n in names]
        stds = [table[n][f"{metric}_std_over_seeds"] for n in names]
        ax.bar(names, means, yerr=stds, capsize=6, color=colours[: len(names)])
        for i, n in enumerate(names):
            ax.plot([i] * len(table[n][f"{metric}_per_seed"]), table[n][f"{metric}_per_seed"], "k.")
        ax.set_ylim(0, 1)
        ax.set_ylabel(
            f"cross-site {metric.replace('_', '-')}\n(mean over seeds ± std; dots: seeds)"
        )
    fig.suptitle(
        f"FedER on {Path(args.data).name}, {args.nodes} nodes, {args.partition}, "
        f"{args.rounds} rounds, seeds {', '.join(map(str, args.seeds))}, LPIPS {args.lpips_backbone}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="digits")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--epochs", type=int, default=1, help="local epochs when no --steps-per-round"
    )
    parser.add_argument(
        "--steps-per-round",
        type=int,
        default=50,
        help="local steps per round of every method and site (0: --epochs instead)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lr-schedule", default="cosine", choices=["cosine", "step", "constant"])
    parser.add_argument(
        "--class-weighted",
        default="auto",
        choices=["auto", "true", "false"],
        help="training.class_weighted of every method",
    )
    parser.add_argument("--augment", default="weak", choices=["none", "weak", "strong"])
    parser.add_argument("--fraction", type=float, default=0.5, help="FedAVGP2P's c")
    parser.add_argument("--model", default="small_cnn")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--buffer-size", type=int, default=512)
    parser.add_argument(
        "--initial-epochs",
        type=int,
        default=0,
        help="FedER's M^0 epochs before federation (0: every method does the same steps)",
    )
    parser.add_argument("--gan-iterations", type=int, default=800)
    parser.add_argument("--gan-resolution", type=int, default=32)
    parser.add_argument("--gan-channel-base", type=int, default=1024)
    parser.add_argument("--gan-channel-max", type=int, default=64)
    parser.add_argument(
        "--lpips-backbone", default="alex", choices=["alex", "vgg", "squeeze", "random"]
    )
    parser.add_argument(
        "--lpips-weights",
        type=Path,
        default=None,
        help="an lpips.LPIPS state dict or torchvision backbone file (default: the torch hub cache)",
    )
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.class_weighted = {"true": True, "false": False}.get(args.class_weighted, "auto")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    try:
        per_seed = []
        for seed in args.seeds:
            args.seed = seed
            per_seed.append(run_seed(args, out / f"seed_{seed}"))
    except (GenbufferError, RuntimeError) as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(1) from None
    table = aggregate(per_seed)

    print(
        f"\n{'method':<12}{'cross-site accuracy':>24}{'macro-F1':>22}{'KB/node/round':>16}"
        f"   (mean ± std over seeds {args.seeds})"
    )
    for name, row in table.items():
        print(
            f"{name:<12}{row['accuracy_mean']:>15.3f} ± {row['accuracy_std_over_seeds']:.3f}"
            f"{row['macro_f1_mean']:>13.3f} ± {row['macro_f1_std_over_seeds']:.3f}"
            f"{row['kb_per_node_per_round']:>16.0f}"
        )
    plot(table, args, out / "feder.png")
    feder, fedavg = table.get("feder"), table.get("fedavgp2p")
    summary = {
        "data": str(args.data),
        "nodes": args.nodes,
        "partition": args.partition,
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round or None,
        "class_weighted": args.class_weighted,
        "lr_schedule": args.lr_schedule,
        "augment": args.augment,
        "seeds": args.seeds,
        "gan_iterations": args.gan_iterations,
        "lpips_backbone": args.lpips_backbone,
        **{
            f"{n}_{m}": round(row[f"{m}_mean"], 4)
            for n, row in table.items()
            for m in ("accuracy", "macro_f1")
        },
        **{
            f"{n}_{m}_std": round(row[f"{m}_std_over_seeds"], 4)
            for n, row in table.items()
            for m in ("accuracy", "macro_f1")
        },
        **{
            f"{n}_kb_per_node_per_round": round(r["kb_per_node_per_round"], 1)
            for n, r in table.items()
        },
        "feder_above_fedavgp2p_macro_f1": bool(
            feder and fedavg and feder["macro_f1_mean"] > fedavg["macro_f1_mean"]
        ),
        "paper_claim": "FedER above FedAvg (FedER Table 4)",
        "gates_refused": sum(1 for r in per_seed for g in r["gates"].values() if not g["released"]),
        "plot": str(out / "feder.png"),
    }
    atomic_write_text(
        out / "results.json",
        json.dumps(
            {"summary": summary, "table": table, "per_seed": per_seed}, indent=2, default=str
        ),
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
