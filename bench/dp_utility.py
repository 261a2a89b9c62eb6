"""Utility of differentially private local training: macro-F1 against ε.

    python -m bench.dp_utility [--data ../shared/data/pneumoniamnist.npz]
                               [--epsilons 1,3,8] [--seeds 0,1,2] [--out DIR]

The reference job (`bench.federation`: 5 nodes, dirichlet:0.5, 10 rounds,
FedAVGP2P) in memory, with one model in every arm (`--model`: `small_cnn_ws`,
GroupNorm and weight standardization, by default; `scatternet_linear`, fixed
scattering features and a linear layer), so only the training differs:

- `ε = E` for each --epsilons value: training.dp.target_epsilon E (δ = 1e-5,
  clipping norm 1.0), which trains with the DP recipe
  (`p2pfl.learning.dp_recipe`: Poisson batches, augmentation multiplicity,
  class balance after clipping, EMA, SGD); the noise multiplier is the one
  Opacus computes for all the run's steps;
- `∞ recipe`: the same recipe with its clipping and without noise
  (training.dp.noise_multiplier: 0, ε = ∞), the like-for-like non-private
  baseline: same data, batches, steps, views, class weights after clipping,
  clipped SGD and EMA, so only the noise (the privacy) differs;
- `∞ standard`: the site's ordinary training (batch 32, Adam, class-weighted
  loss), for reference.

The recipe's numbers were chosen before this table, on the validation split of
seed 0 at ε = 3 (5 nodes, 10 rounds, final validation macro-F1 over the nodes):
lr 0.5 / 1 / 2 / 4 at expected batch 256 with 1 pass and 4 views (0.41, 0.54,
0.29, 0.20), lr 0.5 / 1 at batch 64 (0.35, 0.21), then at lr 1: 2 passes x 2
views 0.65, 4 passes x 1 view 0.23 (0.41 with EMA), lr 0.5 variants 0.23-0.44;
the standard training's validation figure showed that standardizing the
one-channel stem costs 0.22 (0.49 against 0.71), so it is left plain, and the
grid was run again with the plain stem (rule fixed before: the highest
validation figure wins): 4 passes x 1 view without EMA 0.578, 3 x 1 0.577,
4 x 1 with EMA 0.570, 2 x 2 at lr 2 0.570, 4 x 2 0.568, 2 x 2 0.565, 1 x 4
0.547, 2 x 2 at lr 0.5 0.521 (all within noise of each other).

Every arm of a seed uses the same partition. `--jobs N` runs N arms at once,
each in its own process (set OMP_NUM_THREADS=1). Per arm and seed: the nodes'
final mean macro-F1 on their test splits, the recipe in effect, and for the
private arms the ε the nodes report after the last round next to the ε a
fresh Opacus RDP accountant gives for the same noise, sample rate and steps
(they must be equal). Writes DIR/dp_utility.{json,png}; the last stdout line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from p2pfl.files import atomic_write_text


def _option(text: str) -> tuple[str, Any]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. epochs=4")
    return key.strip(), yaml.safe_load(value)


def parse_epsilons(text: str) -> list[float]:
    return [math.inf if e.strip() in ("inf", "∞") else float(e) for e in text.split(",") if e]


MODEL = "small_cnn_ws"


def arms(epsilons: list[float]) -> list[tuple[str, float, str]]:
    """(label, ε, training.recipe) of every arm: the private ones, then the two
    baselines (recipe "dp" at ε = ∞: clipping without noise)."""
    private = [(f"{e:g}", e, "dp") for e in epsilons if not math.isinf(e)]
    return [*private, ("∞ recipe", math.inf, "dp"), ("∞ standard", math.inf, "standard")]


def arm_recipe(
    epsilon: float, recipe: str, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The training recipe an arm runs with (as `p2pfl-node check` prints it)."""
    from p2pfl.config.sections import DPRecipeSection, DPSection, TrainingSection
    from p2pfl.learning.dp_recipe import recipe_settings

    if recipe == "standard":
        dp = None
    elif math.isinf(epsilon):
        dp = DPSection(noise_multiplier=0.0)  # the recipe's clipping, no noise
    else:
        dp = DPSection(target_epsilon=epsilon)
    training = TrainingSection(dp=dp, recipe=recipe, dp_recipe=DPRecipeSection(**(options or {})))
    return recipe_settings(training) or {
        "recipe": "standard",
        "batch_size": training.batch_size,
        "optimizer": f"{training.optimizer}, lr {training.lr:g} x training.lr_schedule",
        "class_weighted": training.class_weighted,
    }


def one_run(
    args: argparse.Namespace, label: str, epsilon: float, recipe: str, seed: int
) -> dict[str, Any]:
    tag = label.replace("∞ ", "inf_")
    out = args.out / f"eps_{tag}_s{seed}"
    cmd = [
        sys.executable, "-m", "bench.federation", "--in-memory", "--no-baselines",
        "--no-compute-limit",
        "--data", str(args.data), "--nodes", str(args.nodes), "--rounds", str(args.rounds),
        "--partition", args.partition, "--seed", str(seed), "--model", args.model,
        "--recipe", recipe, "--out", str(out),
    ]  # fmt: skip
    if args.image_size is not None:
        cmd += ["--image-size", str(args.image_size)]
    if not math.isinf(epsilon):
        cmd += ["--dp-target-epsilon", str(epsilon)]
    elif recipe == "dp":
        cmd += ["--dp-noise-multiplier", "0"]
    if recipe == "dp":
        for key, value in args.recipe_option:
            cmd += ["--dp-recipe-option", f"{key}={value}"]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"epsilon {tag} seed {seed}: {done.stderr.strip()[-800:]}")
    results = json.loads((out / "results.json").read_text())
    rows = results["rounds"]
    last = [r for r in rows if r["round"] == args.rounds]
    figures: dict[str, Any] = {
        "label": label,
        "model": args.model,
        "epsilon_target": None if math.isinf(epsilon) else epsilon,
        "seed": seed,
        "recipe": arm_recipe(epsilon, recipe, dict(args.recipe_option)),
        "macro_f1_final": statistics.fmean(r["macro_f1"] for r in last),
        "best_macro_f1_final": statistics.fmean(
            r["best_macro_f1"] for r in last if r.get("best_macro_f1") is not None
        ),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if not math.isinf(epsilon):
        figures["epsilon_reported_max"] = max(r["dp_epsilon"] for r in last)
        figures["epsilon_opacus_max"] = max(
            opacus_epsilon(r["dp_noise_multiplier"], r["dp_sample_rate"], int(r["dp_steps"]))
            for r in last
        )
        figures["noise_multiplier"] = [round(r["dp_noise_multiplier"], 4) for r in last]
        figures["steps"] = [int(r["dp_steps"]) for r in last]
        figures["sample_rate"] = [round(r["dp_sample_rate"], 4) for r in last]
    return figures


def opacus_epsilon(noise_multiplier: float, sample_rate: float, steps: int) -> float:
    """ε at δ = 1e-5 of a fresh Opacus RDP accountant that took `steps` steps."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return float(accountant.get_epsilon(delta=1e-5))


DIAGNOSIS = (  # (label, noise multiplier or None for no DP, clipping norm)
    ("no DP", None, None),
    ("clip 1e6, no noise", 0.0, 1e6),
    ("clip 1, no noise", 0.0, 1.0),
    ("clip 5, no noise", 0.0, 5.0),
    ("clip 1, noise 0.7", 0.7, 1.0),
    ("clip 5, noise 0.7", 0.7, 5.0),
)


def diagnose(data: Path, model_name: str = MODEL, epochs: int = 2) -> list[dict[str, Any]]:
    """Which part of DP-SGD costs the utility: one site holding the whole
    training split, the same training settings, `epochs` epochs, each row a
    different clipping norm / noise multiplier (clipping without noise is
    DP-SGD's bias alone; a clipping norm no gradient reaches is the mechanics
    check: it must match no DP). Scored on the validation split."""
    import torch

    from p2pfl.config.sections import DataSection, DPSection, TrainingSection
    from p2pfl.learning.data import load_site_data
    from p2pfl.learning.models import create_model
    from p2pfl.learning.train import LocalSite

    torch.set_num_threads(1)
    site_data = load_site_data(DataSection(source=str(data)))
    rows = []
    for label, sigma, clip in DIAGNOSIS:
        torch.manual_seed(0)
        dp = None if sigma is None else DPSection(noise_multiplier=sigma, max_grad_norm=clip)
        model = create_model(
            model_name,
            in_chans=site_data.channels,
            num_classes=site_data.num_classes,
            image_size=site_data.image_size,
        )
        site = LocalSite(
            model,
            site_data,
            TrainingSection(dp=dp, recipe="dp"),
            rounds=epochs,
            model_name=model_name,
        )
        for _ in range(epochs):
            site.train_epochs()
        report = site.evaluate("val")
        rows.append(
            {
                "setting": label,
                "val_macro_f1": round(float(report["macro_f1"]), 4),
                "val_accuracy": round(float(report["accuracy"]), 4),
                "epsilon": None if site.dp is None or sigma == 0 else round(site.dp.epsilon, 3),
            }
        )
        print(f"    diagnosis {json.dumps(rows[-1])}", flush=True)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    means = [statistics.fmean(r["macro_f1_final"] for r in rows if r["label"] == x) for x in labels]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in rows:
        ax.plot(labels.index(r["label"]), r["macro_f1_final"], "o", color="0.6", ms=4)
    ax.plot(range(len(labels)), means, "-o", color="C0", label="mean over seeds")
    ax.set_xticks(range(len(labels)), [f"ε = {x}" for x in labels], fontsize=8)
    ax.set_ylabel("final macro-F1 (mean over nodes)")
    ax.set_title("DP-SGD local training, FedAVGP2P")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.dp_utility", description=__doc__.splitlines()[0]
    )
    p.add_argument("--data", type=Path, default=Path("../shared/data/pneumoniamnist.npz"))
    p.add_argument(
        "--epsilons", default="1,3,8", help="the private arms (the baselines always run)"
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--partition", default="dirichlet:0.5")
    p.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="data.image_size of every arm (default: bench.federation's); a smaller one "
        "makes a cheap smoke run, the accounting does not depend on it",
    )
    p.add_argument(
        "--model",
        default=MODEL,
        help=f"model.name of every arm (default {MODEL}; scatternet_linear: Tramèr & Boneh 2021)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    p.add_argument("--out", type=Path, default=Path("runs/dp_utility"))
    p.add_argument(
        "--recipe-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a training.dp_recipe field for the recipe arms (e.g. epochs=4); repeatable",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time (each its own process, one thread); pair with OMP_NUM_THREADS=1",
    )
    p.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        default=None,
        metavar="DIR",
        help="run nothing: pool the rows of earlier runs' DIR/dp_utility.json into --out",
    )
    p.add_argument(
        "--diagnose-only",
        action="store_true",
        help="only the clipping/noise diagnosis on one site with all the training data",
    )
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.diagnose_only:
        found = diagnose(args.data, args.model)
        atomic_write_text(args.out / "dp_diagnosis.json", json.dumps(found, indent=2) + "\n")
        print(json.dumps({"bench": "dp_diagnosis", "rows": found}))
        return 0
    rows: list[dict[str, Any]] = []
    if args.pool:
        for folder in args.pool:
            rows += json.loads((folder / "dp_utility.json").read_text())["rows"]
        models = {r.get("model", MODEL) for r in rows}  # rows before --model: small_cnn_ws
        if len(models) > 1:
            raise SystemExit(f"--pool: the runs trained different models ({sorted(models)})")
        args.model = models.pop() if models else args.model
        args.out.mkdir(parents=True, exist_ok=True)
    else:
        jobs = [
            (label, epsilon, recipe, seed)
            for seed in [int(x) for x in args.seeds.split(",") if x]
            for label, epsilon, recipe in arms(parse_epsilons(args.epsilons))
        ]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(one_run, args, *job) for job in jobs]
            for future in futures:  # in the table's order, each as it is done
                row = future.result()
                rows.append(row)
                print(f"    {json.dumps(row, ensure_ascii=False)}", flush=True)
                atomic_write_text(
                    args.out / "dp_utility.json", json.dumps({"rows": rows}, indent=2) + "\n"
                )
    plot(rows, args.out / "dp_utility.png")
    table = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        f1 = [r["macro_f1_final"] for r in mine]
        table[label] = {
            "macro_f1_mean": round(statistics.fmean(f1), 4),
            "macro_f1_std": round(statistics.pstdev(f1), 4),
            "macro_f1_per_seed": [round(x, 4) for x in f1],
            "epsilon_reported_max": max(r.get("epsilon_reported_max", 0.0) for r in mine),
            "recipe": mine[0]["recipe"],
        }
    baseline = table.get("∞ recipe")
    if baseline is not None:
        for label, entry in table.items():
            if label not in ("∞ recipe", "∞ standard"):
                entry["points_below_non_dp_recipe"] = round(
                    100 * (baseline["macro_f1_mean"] - entry["macro_f1_mean"]), 2
                )
    gaps = [
        abs(r["epsilon_reported_max"] - r["epsilon_opacus_max"])
        for r in rows
        if "epsilon_reported_max" in r
    ]
    summary = {
        "bench": "dp_utility",
        "data": str(args.data),
        "nodes": args.nodes,
        "rounds": args.rounds,
        "image_size": args.image_size,
        "model": args.model,
        "table": table,
        "epsilon_reported_vs_opacus_max_gap": max(gaps) if gaps else None,
        "within_target": all(
            r["epsilon_reported_max"] <= r["epsilon_target"] * 1.001
            for r in rows
            if r["epsilon_target"] is not None
        ),
        "plot": str(args.out / "dp_utility.png"),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    atomic_write_text(
        args.out / "dp_utility.json",
        json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n",
    )
    print(json.dumps(summary, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
