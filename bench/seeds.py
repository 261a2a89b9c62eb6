"""Pool `bench.federation` runs that differ only in the seed.

    python -m bench.seeds runs/acc8_fedavg_s0 runs/acc8_fedavg_s1 ... \
        [--sgd runs/acc8_fedsgd_s0 ...] --out runs/acc8_seeds

Each DIR holds a results.json. For every run (each heuristic of a FedAVGP2P
grid, FedSGDP2P, and the centralized and standalone baselines measured in the
same invocation) it lists, per seed, the final macro-F1 (mean over the nodes
of the last round), the mean of the last three rounds, the distance to
centralized FedAvg and the gain over standalone, and the non-training share;
then the mean and the standard deviation over the seeds. It writes
OUT/seeds.json and OUT/seeds.png (final macro-F1 per seed and method, the
baselines beside them) and prints a table, then one JSON object as its last
line. A seed whose runs or baselines differ in anything but the seed is
refused: pooled numbers must compare like with like.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import plots

# config keys allowed to differ between pooled runs
PER_RUN_KEYS = {
    "seed",
    "out",
    "protocol",
    "heuristic",
    "heuristics",
    "fraction",
    "fractions",
    "partition_label_skew",  # drawn from the seed
    "partition_train_sizes",
}


def load(directory: Path) -> dict[str, Any]:
    path = directory / "results.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(
            f"{path}: no results.json — run bench.federation --out {directory}"
        ) from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in PER_RUN_KEYS}


def rows_of(result: dict[str, Any], protocol: str) -> dict[str, dict[str, float | None]]:
    """method -> figures of one results.json (a grid gives one method per heuristic)."""
    summary = result["summary"]
    out: dict[str, dict[str, float | None]] = {}
    for cell in summary.get("grid") or [summary]:
        name = protocol if protocol != "fedavgp2p" else f"fedavgp2p {cell.get('heuristic')}"
        out[name] = {
            "final": cell.get("macro_f1_mean_final"),
            "last3": cell.get("macro_f1_mean_last3"),
            "gap_to_centralized": cell.get("gap_to_centralized"),
            "gain_over_standalone": cell.get("gain_over_standalone"),
            "non_training_share": cell.get("non_training_share"),
        }
    out["centralized"] = {
        "final": summary.get("centralized_macro_f1"),
        "last3": summary.get("centralized_macro_f1_last3"),
    }
    out["standalone"] = {
        "final": summary.get("standalone_macro_f1_mean"),
        "last3": summary.get("standalone_macro_f1_mean_last3"),
    }
    if summary.get("centralized_fedsgd_macro_f1") is not None:
        out["centralized FedSGD"] = {
            "final": summary.get("centralized_fedsgd_macro_f1"),
            "last3": summary.get("centralized_fedsgd_macro_f1_last3"),
        }
        out[protocol]["gap_to_centralized_fedsgd"] = summary.get("gap_to_centralized_fedsgd")
    return out


def pool(results: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, float | None]]]:
    """method -> seed -> figures, checking that only the seed differs."""
    reference = comparable(results[0]["config"])
    by_method: dict[str, dict[int, dict[str, float | None]]] = {}
    for result in results:
        config = result["config"]
        if comparable(config) != reference:
            diff = sorted(
                k
                for k in set(reference) | set(comparable(config))
                if reference.get(k) != config.get(k)
            )
            raise SystemExit(
                f"seed {config.get('seed')}: differs from seed {results[0]['config'].get('seed')} "
                f"in {', '.join(diff)} — pool only runs that differ in the seed"
            )
        for method, figures in rows_of(result, config["protocol"]).items():
            by_method.setdefault(method, {})[int(config["seed"])] = figures
    return by_method


def describe(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    return {
        "mean": round(statistics.fmean(values), 4),
        "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def summarise(by_method: dict[str, dict[int, dict[str, float | None]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for method, seeds in by_method.items():
        keys = sorted({k for figures in seeds.values() for k in figures})
        entry: dict[str, Any] = {"seeds": sorted(seeds)}
        for key in keys:
            values = [f[key] for f in seeds.values() if f.get(key) is not None]
            entry[key] = describe([float(v) for v in values])  # type: ignore[arg-type]
            entry[key]["per_seed"] = {s: seeds[s].get(key) for s in sorted(seeds)}
        out[method] = entry
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench.federation --out directories")
    parser.add_argument(
        "--sgd", nargs="*", type=Path, default=[], help="further runs (e.g. FedSGDP2P) to pool"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    groups = [list(args.runs)] + ([list(args.sgd)] if args.sgd else [])
    by_method: dict[str, dict[int, dict[str, float | None]]] = {}
    for group in groups:
        for method, seeds in pool([load(d) for d in group]).items():
            if method in ("centralized", "standalone") and method in by_method:
                continue  # the same baselines measured again beside another protocol
            by_method.setdefault(method, {}).update(seeds)
    summary = summarise(by_method)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "seeds.json").write_text(json.dumps(summary, indent=1))
    finals = {
        method: {s: float(f["final"]) for s, f in seeds.items() if f.get("final") is not None}
        for method, seeds in by_method.items()
    }
    png = plots.final_per_seed(finals, args.out / "seeds.png")
    print(
        f"{'method':<22}{'final mean±std':>16}{'last-3 mean':>13}{'gap':>8}{'gain':>8}{'non-train max':>15}"
    )
    for method, entry in summary.items():
        final, last3 = entry["final"], entry.get("last3", {})
        gap = entry.get("gap_to_centralized", {}).get("mean")
        gain = entry.get("gain_over_standalone", {}).get("mean")
        share = entry.get("non_training_share", {}).get("max")
        print(
            f"{method:<22}{final['mean']:>9.4f}±{final['std']:<6.4f}"
            f"{(last3.get('mean') or float('nan')):>13.4f}"
            f"{(gap if gap is not None else float('nan')):>8.4f}"
            f"{(gain if gain is not None else float('nan')):>8.4f}"
            f"{(share if share is not None else float('nan')):>15.4f}"
        )
    print(f"plot: {png}")
    print(json.dumps({"seeds": summary[next(iter(summary))]["seeds"], "methods": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
