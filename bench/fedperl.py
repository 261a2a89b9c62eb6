"""FedPerl acceptance experiment on PneumoniaMNIST, in memory (protocols/memory/).

Seven sites, 10% of each site's training images labeled, the rest unlabeled:

  community A (siteA0-A2): 350 images each, 25% normal   } two differently skewed
  community B (siteB0-B2): 350 images each,  4% normal   } halves of the data set
  outlier     (siteO)    : 100 images,      80% normal

(the training split has only 388 normal images, which bounds the design).
Each site's val and test sets are drawn from the data set's val and test
splits with the site's class mix, the minority share floored at 20% so a
macro-F1 on a few hundred images is not decided by a handful of images; val
and test sets of different sites may overlap (they are only evaluated on).

Methods, same model (small_cnn), data, rounds, steps per round and seed:
  local_supervised  labeled images only, no communication (lower bound)
  local_fixmatch    FixMatch alone
  ssfl              FixMatch + FedAVGP2P (SSFL-P2P; FedPerl with T = 0)
  fedperl           SSFL-P2P + communities + anonymized peer (T = 2, by secure aggregation)
  fedperl_secure    the same with protocol.secure_aggregation: the FedAVGP2P step is
                    secure sums too, so no node sees another's model

Headline figure: macro-F1 on each site's test set averaged over the last
`--last` rounds, then over sites and seeds (decided before the first run).
Also reported: the final round, ECE/MCE (15 bins), and the who-chose-whom
matrix of FedPerl with the share of choices inside the chooser's community.

    nice -n 10 .venv/bin/python -m bench.fedperl --out runs/fedperl

Last stdout line: one JSON object; fedperl.png (curves, ECE, choice matrix)
and fedperl_choices.png (the frequency matrix alone) go to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.semisup_baselines import local_fixmatch, local_supervised
from p2pfl.config import SiteConfig
from p2pfl.files import atomic_savez, make_private_dirs
from protocols.communities import choice_frequencies
from protocols.memory import InMemoryNetwork, SimulationResult, simulate, simulation_configs
from protocols.secagg import SECAGG_KIND

log = logging.getLogger("bench.fedperl")

# name -> (community, training images, share of class 0 = normal)
SITES: dict[str, tuple[str, int, float]] = {
    "siteA0": ("A", 350, 0.25),
    "siteA1": ("A", 350, 0.25),
    "siteA2": ("A", 350, 0.25),
    "siteB0": ("B", 350, 0.04),
    "siteB1": ("B", 350, 0.04),
    "siteB2": ("B", 350, 0.04),
    "siteO": ("O", 100, 0.80),
}
METHODS = ("local_supervised", "local_fixmatch", "ssfl", "fedperl", "fedperl_secure")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", type=Path, default=Path("/work/shared/data/pneumoniamnist.npz"))
    p.add_argument("--out", type=Path, default=Path("runs/fedperl"))
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="FedPerl warm-up rounds")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--label-fraction", type=float, default=0.1)
    p.add_argument("--last", type=int, default=5, help="rounds averaged for the headline")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--policy", default="static")
    p.add_argument("--top-t", type=int, default=2)
    p.add_argument("--fraction", type=float, default=0.5, help="FedAVGP2P c")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tau", type=float, default=0.6)
    p.add_argument("--gamma", type=float, default=0.01)
    p.add_argument("--test-size", type=int, default=250)
    p.add_argument("--val-size", type=int, default=100)
    p.add_argument("--min-share", type=float, default=0.2, help="floor of a class in val/test")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- data


def _take(pool: dict[int, list[int]], label: int, n: int) -> list[int]:
    if len(pool[label]) < n:
        raise SystemExit(f"not enough images of class {label}: need {n}, have {len(pool[label])}")
    taken, pool[label] = pool[label][:n], pool[label][n:]
    return taken


def _eval_indices(
    labels: np.ndarray, share0: float, size: int, rng: np.random.Generator
) -> np.ndarray:
    n0 = int(round(size * share0))
    idx0 = rng.choice(np.flatnonzero(labels == 0), size=n0, replace=False)
    idx1 = rng.choice(np.flatnonzero(labels == 1), size=size - n0, replace=False)
    return np.sort(np.concatenate([idx0, idx1]))


def build_sites(args: argparse.Namespace, seed: int, out: Path) -> list[str]:
    """Write one .npz per site (train = labeled, unlabeled_images, val, test)."""
    rng = np.random.default_rng(seed)
    with np.load(args.data, allow_pickle=False) as archive:
        data = {k: archive[k] for k in archive.files}
    labels = {s: data[f"{s}_labels"].reshape(-1).astype(np.int64) for s in ("train", "val", "test")}
    pool = {c: rng.permutation(np.flatnonzero(labels["train"] == c)).tolist() for c in (0, 1)}
    make_private_dirs(out)
    paths: list[str] = []
    for name, (_, size, share0) in SITES.items():
        n0 = int(round(size * share0))
        idx = np.array(_take(pool, 0, n0) + _take(pool, 1, size - n0))
        images, site_labels = data["train_images"][idx], labels["train"][idx]
        labeled: list[int] = []
        for c in (0, 1):
            of_class = rng.permutation(np.flatnonzero(site_labels == c))
            labeled += of_class[: max(1, int(round(args.label_fraction * len(of_class))))].tolist()
        is_labeled = np.zeros(len(idx), dtype=bool)
        is_labeled[labeled] = True
        eval_share = min(max(share0, args.min_share), 1 - args.min_share)
        val = _eval_indices(labels["val"], eval_share, args.val_size, rng)
        test = _eval_indices(labels["test"], eval_share, args.test_size, rng)
        path = out / f"{name}.npz"
        atomic_savez(  # the source's images: 0600 whatever the umask
            path,
            dict(
                train_images=images[is_labeled],
                train_labels=site_labels[is_labeled],
                unlabeled_images=images[~is_labeled],
                val_images=data["val_images"][val],
                val_labels=labels["val"][val],
                test_images=data["test_images"][test],
                test_labels=labels["test"][test],
                class_names=np.array(["normal", "pneumonia"]),
            ),
        )
        paths.append(str(path))
    return paths


# ---------------------------------------------------------------------- runs


def site_configs(
    args: argparse.Namespace, sources: list[str], protocol: dict[str, Any], seed: int
) -> list[SiteConfig]:
    return simulation_configs(
        sources,
        names=list(SITES),
        protocol=protocol,
        seed=seed,
        data={"image_size": 28, "channels": 1, "augment": "weak", "val_fraction": 0.0},
        model={"name": "small_cnn"},
        training={
            "epochs": 1,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "device": "cpu",
            "seed": seed,
            "threads": 1,
            "lr_schedule": "constant",  # the reference code's Adam at a constant lr
        },
        selection={"name": "random"},
    )


def protocol_section(args: argparse.Namespace, method: str) -> dict[str, Any]:
    common = {
        "rounds": args.rounds,
        "fraction": args.fraction,
        "tau": args.tau,
        "beta": 0.5,
        "unlabeled_ratio": 1,
        "class_weighted": True,
        "round_timeout_s": 600.0,
        "max_staleness": 0,
    }
    if method in ("fedperl", "fedperl_secure"):
        return {
            "name": "fedperl",
            **common,
            "top_t": args.top_t,
            "warmup_rounds": args.warmup,
            "gamma": args.gamma,
            "policy": args.policy,
            "secure_aggregation": method == "fedperl_secure",
        }
    return {"name": "ssfl", **common}


def records_of(method: str, configs: list[SiteConfig]) -> tuple[list[dict[str, Any]], Any]:
    if method == "local_supervised":
        return local_supervised(configs).records, None
    if method == "local_fixmatch":
        return local_fixmatch(configs).records, None
    result: SimulationResult = asyncio.run(
        simulate(configs, network=InMemoryNetwork(inline_train=True), fail_fast=True)
    )
    if result.errors:
        raise SystemExit(f"error: {method}: {result.first_error() or result.errors}")
    return result.records, result


def summarise(records: list[dict[str, Any]], last: int) -> dict[str, Any]:
    nodes = sorted({r["node"] for r in records})
    final_round = max(r["round"] for r in records)
    window = range(final_round - last + 1, final_round + 1)
    per_node: dict[str, dict[str, float]] = {}
    for node in nodes:
        mine = {r["round"]: r for r in records if r["node"] == node and "macro_f1" in r}
        per_node[node] = {
            "macro_f1_last": statistics.fmean(mine[r]["macro_f1"] for r in window if r in mine),
            "macro_f1_final": mine[final_round]["macro_f1"],
            "ece_last": statistics.fmean(mine[r]["ece"] for r in window if r in mine),
            "mce_last": statistics.fmean(mine[r]["mce"] for r in window if r in mine),
        }
    curve: dict[int, float] = {}
    for r in sorted({r["round"] for r in records}):
        values = [x["macro_f1"] for x in records if x["round"] == r and "macro_f1" in x]
        curve[r] = statistics.fmean(values)
    return {
        "macro_f1": statistics.fmean(v["macro_f1_last"] for v in per_node.values()),
        "macro_f1_final": statistics.fmean(v["macro_f1_final"] for v in per_node.values()),
        "ece": statistics.fmean(v["ece_last"] for v in per_node.values()),
        "mce": statistics.fmean(v["mce_last"] for v in per_node.values()),
        "per_node": per_node,
        "curve": curve,
    }


def community_share(freq: np.ndarray, names: list[str]) -> dict[str, float]:
    """Share of each community's choices that stayed inside it (random: 2/6)."""
    out: dict[str, float] = {}
    for community in ("A", "B"):
        rows = [i for i, n in enumerate(names) if SITES[n][0] == community]
        inside = [j for j, n in enumerate(names) if SITES[n][0] == community]
        total = freq[rows].sum()
        out[community] = float(freq[np.ix_(rows, inside)].sum() / total) if total else 0.0
    return out


# ---------------------------------------------------------------------- plots


def plot(
    out: Path,
    summaries: dict[str, dict[str, Any]],
    freq: np.ndarray | None,
    names: list[str],
    title: str,
) -> list[str]:
    written: list[str] = []
    fig = Figure(figsize=(15, 4.6))
    FigureCanvasAgg(fig)
    ax_curve, ax_ece, ax_freq = fig.subplots(1, 3)
    for method, summary in summaries.items():
        rounds = sorted(summary["curve"])
        ax_curve.plot(rounds, [summary["curve"][r] for r in rounds], label=method)
    ax_curve.set_xlabel("round")
    ax_curve.set_ylabel("mean test macro-F1 over sites")
    ax_curve.legend(fontsize=8)
    ax_curve.set_title("macro-F1")
    methods = list(summaries)
    ax_ece.bar(methods, [summaries[m]["ece"] for m in methods], color="tab:orange")
    ax_ece.set_ylabel("ECE (15 bins), mean of the last rounds")
    ax_ece.tick_params(axis="x", rotation=20)
    ax_ece.set_title("calibration")
    if freq is not None:
        _draw_frequencies(ax_freq, freq, names)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / "fedperl.png"
    fig.savefig(path, dpi=110)
    written.append(str(path))
    if freq is not None:
        fig2 = Figure(figsize=(5.6, 5))
        FigureCanvasAgg(fig2)
        _draw_frequencies(fig2.subplots(), freq, names)
        fig2.tight_layout()
        path2 = out / "fedperl_choices.png"
        fig2.savefig(path2, dpi=110)
        written.append(str(path2))
    return written


def _draw_frequencies(ax: Any, freq: np.ndarray, names: list[str]) -> None:
    image = ax.imshow(freq * 100, cmap="viridis", vmin=0, vmax=100)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    for i in range(len(names)):
        for j in range(len(names)):
            ax.text(
                j,
                i,
                f"{freq[i, j] * 100:.0f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if freq[i, j] < 0.6 else "black",
            )
    ax.set_xlabel("chosen peer")
    ax.set_ylabel("chooser")
    ax.set_title("FedPerl who-chose-whom (% of rounds)")
    ax.figure.colorbar(image, ax=ax, fraction=0.046)


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    names = list(SITES)
    per_seed: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    choices: list[dict[str, Any]] = []
    seconds: dict[str, float] = dict.fromkeys(args.methods, 0.0)
    traffic: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        sources = build_sites(args, seed, args.out / f"data_seed{seed}")
        for method in args.methods:
            start = time.perf_counter()
            configs = site_configs(args, sources, protocol_section(args, method), seed)
            records, result = records_of(method, configs)
            seconds[method] += time.perf_counter() - start
            per_seed[method].append(summarise(records, args.last))
            if result is not None:
                traffic[method] = {
                    "model_messages": result.messages_sent("model"),
                    "secagg_messages": result.messages_sent(SECAGG_KIND),
                    "secagg_bytes": result.bytes_sent(SECAGG_KIND),
                    "model_bytes": result.bytes_sent("model"),
                }
                if method == "fedperl":
                    choices += result.choices
                    contributors = [
                        r["anon_contributors"] for r in records if r.get("anon_contributors")
                    ]
                    traffic[method]["anonymized_peers_built"] = len(contributors)
            (args.out / f"{method}_seed{seed}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in records), encoding="utf-8"
            )
            print(
                f"seed {seed} {method}: macro-F1 {per_seed[method][-1]['macro_f1']:.4f} "
                f"ECE {per_seed[method][-1]['ece']:.4f} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    summaries: dict[str, dict[str, Any]] = {}
    for method, runs in per_seed.items():
        rounds = sorted(runs[0]["curve"])
        summaries[method] = {
            "macro_f1": statistics.fmean(r["macro_f1"] for r in runs),
            "macro_f1_per_seed": [round(r["macro_f1"], 4) for r in runs],
            "macro_f1_final": statistics.fmean(r["macro_f1_final"] for r in runs),
            "ece": statistics.fmean(r["ece"] for r in runs),
            "mce": statistics.fmean(r["mce"] for r in runs),
            "per_node_macro_f1": {
                n: round(statistics.fmean(r["per_node"][n]["macro_f1_last"] for r in runs), 4)
                for n in names
            },
            "curve": {r: statistics.fmean(x["curve"][r] for x in runs) for r in rounds},
            "seconds": round(seconds[method], 1),
        }
    freq = choice_frequencies(choices, names) if choices else None
    written = plot(
        args.out,
        summaries,
        freq,
        names,
        f"PneumoniaMNIST, 7 sites, {args.label_fraction:.0%} labels, {args.rounds} rounds, "
        f"seeds {args.seeds}",
    )
    mf1 = {m: s["macro_f1"] for m, s in summaries.items()}
    checks: dict[str, bool] = {}
    if {"fedperl", "ssfl"} <= set(mf1):
        checks["fedperl_ge_ssfl"] = mf1["fedperl"] >= mf1["ssfl"]
    for fed in ("fedperl", "ssfl"):
        for local in ("local_fixmatch", "local_supervised"):
            if {fed, local} <= set(mf1):
                checks[f"{fed}_gt_{local}"] = mf1[fed] > mf1[local]
    report = {
        "bench": "fedperl",
        "sites": {
            n: {"community": c, "train": s, "normal_share": f} for n, (c, s, f) in SITES.items()
        },
        "rounds": args.rounds,
        "warmup": args.warmup,
        "seeds": args.seeds,
        "label_fraction": args.label_fraction,
        "headline": f"mean test macro-F1 over the last {args.last} rounds, sites and seeds",
        "macro_f1": {m: round(v, 4) for m, v in mf1.items()},
        "macro_f1_final_round": {m: round(s["macro_f1_final"], 4) for m, s in summaries.items()},
        "ece": {m: round(s["ece"], 4) for m, s in summaries.items()},
        "mce": {m: round(s["mce"], 4) for m, s in summaries.items()},
        "per_seed_macro_f1": {m: s["macro_f1_per_seed"] for m, s in summaries.items()},
        "per_node_macro_f1": {m: s["per_node_macro_f1"] for m, s in summaries.items()},
        "choice_share_inside_community": community_share(freq, names) if freq is not None else None,
        "choice_frequency": (
            {n: [round(float(x), 3) for x in freq[i]] for i, n in enumerate(names)}
            if freq is not None
            else None
        ),
        "traffic": traffic,
        "seconds": {m: s["seconds"] for m, s in summaries.items()},
        "checks": checks,
        "png": written,
    }
    (args.out / "fedperl.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
