"""Robust aggregation under a model-poisoning peer: real node processes on loopback.

    python -m bench.robustness --nodes 5 --rounds 10 --data digits --partition iid \\
        --attack scaled_random --scale 3 --aggregations mean,trimmed_mean,median --out DIR

One of the N nodes (the last) is compromised: it trains like the others but
answers every model request from round 1 on with an attack (a fault plan,
node/faults.py; `scaled_random` = random tensors with `scale` times the norm
of each of its tensors, which stays under the default `max_norm_ratio` guard
for scale < 10 so only the aggregation can stop it). Every node averages with
all the others (c = 1), so every honest node receives the attack every round.

Runs, all on the same partition, model and seed, in this order:
  1. attack-free, plain mean (the reference);
  2. attacked, once per aggregation in --aggregations.
For each run: the honest nodes' test macro-F1 per round; figures are the mean
over honest nodes at the last round, and of the last three rounds' means.
Writes DIR/results.json and DIR/robustness.png, and prints the summary as the
last stdout line (one JSON object): `drop_points[agg]` = attack-free final -
attacked final, in macro-F1 points (x 100).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import plots
from bench.federation import (
    RunSpec,
    mean_by_round,
    node_overrides,
    partition,
    protocol_section,
    read_metrics,
    site_names,
    spec_from_options,
    stdout_line,
)
from bench.localfed import LocalFederation
from node.faults import ENV, POISON_MODES
from node.provision import provision


def run_one(
    spec: RunSpec,
    run_dir: Path,
    sources: Sequence[Path],
    *,
    aggregation: str,
    attack: dict[str, Any] | None,
    trim_ratio: float,
    clip_norm: float | None,
) -> dict[str, Any]:
    """One federation run; returns per-node rows and the attacker's name."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    names = site_names(spec.nodes)
    attacker = names[-1]
    proto = {
        **protocol_section(spec),
        "fraction": 1.0,
        "aggregation": aggregation,
        "trim_ratio": trim_ratio,
    }
    if clip_norm is not None:
        proto["clip_norm"] = clip_norm
    plans = provision(
        run_dir,
        names,
        protocol=proto,
        data_sources=[str(s.resolve()) for s in sources],
        federation="bench-robust",
        seed=spec.seed,
        overrides=node_overrides(spec),
    )
    fed = LocalFederation(plans, run_dir / "logs")
    if attack is not None:
        plan_path = run_dir / "faults.json"
        plan_path.write_text(json.dumps({"poison": attack}))
        fed[attacker].env = {ENV: str(plan_path)}
    started = time.perf_counter()
    deadline = started + spec.timeout_s
    with fed:
        last_seen: dict[str, int] = {}
        while time.perf_counter() < deadline and any(n.running for n in fed.nodes.values()):
            for name, node in fed.nodes.items():
                status = node.status()
                if status and status.get("metrics_round", 0) != last_seen.get(name):
                    last_seen[name] = status.get("metrics_round", 0)
                    f1 = (status.get("metrics") or {}).get("macro_f1")
                    if f1 is not None:
                        stdout_line(f"  {name} round {last_seen[name]}: macro-F1 {f1:.3f}")
            time.sleep(1.0)
        codes = fed.stop_all()
    rows = {p.name: read_metrics(p.config_path.parent / "state" / "metrics.jsonl") for p in plans}
    return {
        "attacker": attacker if attack is not None else None,
        "exit_codes": codes,
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": rows,
    }


def honest_curve(run: dict[str, Any], attacker: str) -> dict[int, float]:
    """Round -> mean test macro-F1 over the honest nodes (the attacker is left out
    of every run, attack-free included, so the runs compare the same nodes)."""
    return mean_by_round(
        [row for name, rows in run["rows"].items() if name != attacker for row in rows]
    )


def figures(curve: dict[int, float]) -> dict[str, float | None]:
    if not curve:
        return {"final": None, "last3": None}
    rounds = sorted(curve)
    return {
        "final": round(curve[rounds[-1]], 4),
        "last3": round(statistics.fmean(curve[r] for r in rounds[-3:]), 4),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.robustness", description=__doc__.split("\n")[0]
    )
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--data", default="digits", help="digits or a MedMNIST-style .npz")
    p.add_argument("--partition", default="iid")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--attack", default="scaled_random", choices=POISON_MODES)
    p.add_argument("--scale", type=float, default=3.0, help="scaled_random: norm multiple")
    p.add_argument("--aggregations", default="mean,trimmed_mean,median")
    p.add_argument("--trim-ratio", type=float, default=0.2)
    p.add_argument("--clip-norm", type=float, default=None, help="for norm_clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    p.add_argument("--out", type=Path, default=Path("runs/robustness"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    aggregations = [a.strip() for a in args.aggregations.split(",") if a.strip()]
    if args.nodes < 3:
        raise SystemExit("--nodes: at least 3 (one attacker and two honest nodes)")
    if "norm_clip" in aggregations and args.clip_norm is None:
        raise SystemExit("--clip-norm is required with norm_clip")
    # nodes, rounds, data, partition, epochs, lr and seed: the options of the same names
    spec = spec_from_options(args, timeout_s=args.timeout, startup_wait_s=60.0)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    sources, part = partition(spec, out / "data")
    attack = {"kind": "model", "mode": args.attack, "scale": args.scale, "from_round": 1}
    attacker = site_names(spec.nodes)[-1]
    plan = [("attack_free_mean", "mean", None)] + [
        (f"attacked_{agg}", agg, attack) for agg in aggregations
    ]
    runs: dict[str, Any] = {}
    curves: dict[str, dict[int, float]] = {}
    for label, agg, atk in plan:
        stdout_line(f"{label}: {spec.nodes} nodes, {spec.rounds} rounds, aggregation {agg}")
        run = run_one(
            spec,
            out / "fed" / label,
            sources,
            aggregation=agg,
            attack=atk,
            trim_ratio=args.trim_ratio,
            clip_norm=args.clip_norm,
        )
        curves[label] = honest_curve(run, attacker)
        runs[label] = {
            "aggregation": agg,
            "attacked": atk is not None,
            "honest": figures(curves[label]),
            "wall_s": run["wall_s"],
            "exit_codes": run["exit_codes"],
            "rows": run["rows"],
        }
        stdout_line(f"{label}: honest macro-F1 {runs[label]['honest']}")
    clean = runs["attack_free_mean"]["honest"]["final"]
    drop = {
        agg: (
            None
            if clean is None or runs[f"attacked_{agg}"]["honest"]["final"] is None
            else round(100 * (clean - runs[f"attacked_{agg}"]["honest"]["final"]), 1)
        )
        for agg in aggregations
    }
    png = plots.f1_per_round(
        curves,
        out / "robustness.png",
        title=f"{spec.nodes} nodes, 1 attacker ({args.attack} x{args.scale:g}): honest nodes",
    )
    summary = {
        "nodes": spec.nodes,
        "rounds": spec.rounds,
        "attack": args.attack,
        "scale": args.scale,
        "attacker": attacker,
        "honest_macro_f1_final": {k: v["honest"]["final"] for k, v in runs.items()},
        "honest_macro_f1_last3": {k: v["honest"]["last3"] for k, v in runs.items()},
        "drop_points": drop,
        "plot": str(png),
    }
    (out / "results.json").write_text(
        json.dumps(
            {
                "config": vars(args) | {"out": str(out)},
                "partition": part,
                "runs": runs,
                "summary": summary,
            },
            indent=1,
            default=str,
        )
    )
    stdout_line(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
