"""Secure aggregation benchmark: FedAVGP2P with and without
`protocol.secure_aggregation`, real `p2pfl-node` processes on loopback, paired
in the same run (same partition, seed, steps and settings; only the flag
differs), and a dropout drill.

For every seed: partition the data once, run the plain federation, then the
secure one (the order alternates with the seed so neither always runs on a
warmer machine). Reported per mode: final macro-F1 (mean over nodes), mean
round time, exchange time and protocol bytes; and the ratios secure / plain.

The dropout drill (`--dropout`): 6 nodes by default and c = 1, so each
node's sum has every other node as a contributor (5: a sum must have at least
5 contributors to survive a dropout after masking, since the Shamir threshold
is t = floor(2h/3) + 1 of the h = n - 1 other holders,
`secagg_messages.least_threshold`); the last node (`site_5`) is killed by its
fault plan when
the first Round 2 request (masked input) of the drill round reaches it: the
others have masked with it (its mask key's shares dealt), its own input never
comes. The sums of that round must still complete with the survivors: the
bench reports, per node, the contributors and the dropped contributors of that
round and whether the node finished.

    python -m bench.secagg --data ../shared/data/pneumoniamnist.npz --seeds 0 1 2 \\
        --out runs/secagg
    python -m bench.secagg --model resnet18 --rounds 3 --steps-per-round 10 --seeds 0 \\
        --out runs/secagg_resnet18
    python -m bench.secagg --dropout --rounds 4 --seeds 0 --out runs/secagg_dropout

Progress goes to stdout line by line; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.federation.outcome import RunOutcome, stdout_line
from bench.federation.processes import run_processes
from bench.federation.specs import RunSpec, partition, site_names
from bench.federation.stats import per_node_final

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared/data/pneumoniamnist.npz"
DRILL_NODES = 6  # the fewest with c = 1 whose sums survive one dropout (module doc)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", default=str(DEFAULT_DATA), help="'digits' or a MedMNIST .npz")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--nodes", type=int, default=None, help=f"5; the dropout drill: {DRILL_NODES} (at least)"
    )
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--partition", default="dirichlet:0.5")
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--heuristic", default="random")
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--steps-per-round", type=int, default=100)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=3600.0, help="per federation run, seconds")
    p.add_argument(
        "--dropout",
        action="store_true",
        help="the dropout drill instead of the comparison (c = 1, the last site killed after "
        "masking)",
    )
    p.add_argument("--drill-round", type=int, default=2)
    return p.parse_args(argv)


def base_spec(args: argparse.Namespace, seed: int) -> RunSpec:
    """The README table's FedAVGP2P settings (global test split, class-weighted
    loss, no augmentation), with this bench's model, rounds and steps."""
    return RunSpec(
        nodes=args.nodes,
        protocol="fedavgp2p",
        heuristic=args.heuristic,
        fraction=1.0 if args.dropout else args.fraction,
        rounds=args.rounds,
        data=args.data,
        partition=args.partition,
        test_split="global",
        lr=args.lr,
        batch_size=args.batch_size,
        model=args.model,
        augment="none",
        seed=seed,
        steps_per_round=args.steps_per_round,
        class_weighted=True,
        lr_schedule="constant",  # as the README's figures were measured
        timeout_s=args.timeout,
        # secure aggregation needs wire.encryption; the plain runs encrypt too, so
        # the secure_aggregation flag is the only difference between the modes
        encryption=True,
    )


def mode_figures(outcome: RunOutcome) -> dict[str, Any]:
    rows = outcome.rows
    final = per_node_final(rows)

    def mean_of(key: str) -> float | None:
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    last = max((r["round"] for r in rows), default=0)
    bytes_total = sum(int(r["bytes_sent"] or 0) for r in rows if r["round"] == last)
    return {
        "macro_f1_final": statistics.fmean(final.values()) if final else None,
        "macro_f1_final_per_node": final,
        "round_s_mean": mean_of("round_s"),
        "exchange_s_mean": mean_of("exchange_s"),
        "train_s_mean": mean_of("train_s"),
        "protocol_bytes": bytes_total,  # cumulative per node at its last round, summed
        "neighbours_mean": mean_of("neighbours"),
        "wall_s": round(outcome.wall_s, 1),
        "errors": outcome.errors,
        "timed_out": outcome.timed_out,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def compare(args: argparse.Namespace) -> dict[str, Any]:
    per_seed: dict[int, dict[str, Any]] = {}
    for i, seed in enumerate(args.seeds):
        spec = base_spec(args, seed)
        out = args.out / f"seed{seed}"
        sources, _ = partition(spec, out / "data")
        modes = ["plain", "secure"] if i % 2 == 0 else ["secure", "plain"]
        figures: dict[str, Any] = {}
        for mode in modes:
            run_spec = replace(spec, protocol_options=(("secure_aggregation", mode == "secure"),))
            stdout_line(f"--- seed {seed}: {mode} ({spec.model}, {spec.nodes} nodes)")
            outcome = run_processes(run_spec, out / mode, sources)
            figures[mode] = mode_figures(outcome)
            stdout_line(
                f"--- seed {seed} {mode}: macro-F1 {figures[mode]['macro_f1_final']}, "
                f"round {figures[mode]['round_s_mean']} s, wall {figures[mode]['wall_s']} s"
            )
        plain, secure = figures["plain"], figures["secure"]
        figures["delta_macro_f1"] = (
            None
            if plain["macro_f1_final"] is None or secure["macro_f1_final"] is None
            else secure["macro_f1_final"] - plain["macro_f1_final"]
        )
        figures["round_time_ratio"] = ratio(secure["round_s_mean"], plain["round_s_mean"])
        figures["exchange_time_ratio"] = ratio(secure["exchange_s_mean"], plain["exchange_s_mean"])
        figures["bytes_ratio"] = ratio(secure["protocol_bytes"], plain["protocol_bytes"])
        per_seed[seed] = figures

    def mean(key: str, mode: str | None = None) -> float | None:
        values = [
            (f[mode][key] if mode else f[key])
            for f in per_seed.values()
            if (f[mode][key] if mode else f[key]) is not None
        ]
        return round(statistics.fmean(values), 4) if values else None

    return {
        "bench": "secagg",
        "model": args.model,
        "nodes": args.nodes,
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "fraction": args.fraction,
        "seeds": args.seeds,
        "macro_f1_plain": mean("macro_f1_final", "plain"),
        "macro_f1_secure": mean("macro_f1_final", "secure"),
        "delta_macro_f1": mean("delta_macro_f1"),
        "round_time_ratio": mean("round_time_ratio"),
        "exchange_time_ratio": mean("exchange_time_ratio"),
        "bytes_ratio": mean("bytes_ratio"),
        "per_seed": per_seed,
        "ok": all(
            not f[m]["errors"] and not f[m]["timed_out"]
            for f in per_seed.values()
            for m in ("plain", "secure")
        ),
    }


def dropout_drill(args: argparse.Namespace) -> dict[str, Any]:
    seed = args.seeds[0]
    spec = replace(base_spec(args, seed), protocol_options=(("secure_aggregation", True),))
    dropped = site_names(spec.nodes)[-1]
    out = args.out / f"seed{seed}"
    sources, _ = partition(spec, out / "data")
    plan_file = out / "faults.json"
    out.mkdir(parents=True, exist_ok=True)
    for sidecar in (".fired", ".events.jsonl"):  # a fresh drill: no kill fired yet
        plan_file.with_name(plan_file.name + sidecar).unlink(missing_ok=True)
    plan_file.write_text(
        json.dumps(
            {
                "kill": [
                    {
                        "id": "after-masking",
                        "round": args.drill_round,
                        "phase": "asked:secagg:mask",
                        "delay_s": 0.0,
                    }
                ]
            }
        )
    )

    stdout_line(f"--- dropout drill: {dropped} killed after masking in round {args.drill_round}")
    outcome = run_processes(
        spec,
        out / "run",
        sources,
        node_env={dropped: {"P2PFL_FAULTS": str(plan_file)}},
        expendable=frozenset({dropped}),
    )
    survivors = [n for n in site_names(spec.nodes) if n != dropped]
    drill = {
        node: next(
            (
                {
                    "neighbours": r.get("neighbours"),
                    "secagg_dropped": r.get("secagg_dropped"),
                }
                for r in outcome.rows
                if r["node"] == node and r["round"] == args.drill_round
            ),
            None,
        )
        for node in survivors
    }
    finished = {
        node: max((r["round"] for r in outcome.rows if r["node"] == node), default=0)
        for node in survivors
    }
    completed = all(d is not None and (d["neighbours"] or 0) >= 2 for d in drill.values()) and all(
        r == spec.rounds for r in finished.values()
    )
    return {
        "bench": "secagg_dropout",
        "dropped": dropped,
        "drill_round": args.drill_round,
        "drill": drill,
        "survivors_finished_round": finished,
        "dropped_seen": sum(int(d["secagg_dropped"] or 0) for d in drill.values() if d),
        "round_completed_with_survivors": completed,
        "errors": {k: v for k, v in outcome.errors.items() if k != dropped},
        "ok": completed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nodes is None:
        args.nodes = DRILL_NODES if args.dropout else 5
    if args.dropout and args.nodes < DRILL_NODES:
        raise SystemExit(
            f"--dropout needs --nodes >= {DRILL_NODES}: with fewer, each sum has fewer than "
            f"{DRILL_NODES - 1} contributors and its threshold leaves no room for a dropout"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = dropout_drill(args) if args.dropout else compare(args)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
