"""The attack bench's driver: the registry of every scenario in the order the
bench lists and runs them, `run_bench`, and the command line
(`python -m bench.attacks`, bench/attacks/__init__.py says what it does)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.attacks.fedperl import run_fedperl
from bench.attacks.kit import GROUPS, SCENARIOS, Options, inconclusive, say
from bench.attacks.poisoning import run_feder, run_inflation, run_sgd
from bench.attacks.relay import GROUPS as RELAY_GROUPS
from bench.attacks.relay import SCENARIOS as RELAY_SCENARIOS
from bench.attacks.review import GROUPS as REVIEW_GROUPS
from bench.attacks.review import SCENARIOS as REVIEW_SCENARIOS
from bench.attacks.secagg import GROUPS as SECAGG_GROUPS
from bench.attacks.secagg import SCENARIOS as SECAGG_SCENARIOS
from bench.attacks.wire import run_wire

# The registry (bench/attacks/kit.py): issue #16's scenarios, then issue #28's
# (bench/attacks/review.py, bench/attacks/secagg.py), then issue 31's
# (bench/attacks/relay.py). name -> (hole, group); group -> its runner.
SCENARIOS.update(
    {
        "fedperl_subset_difference": ("1", "fedperl"),
        "fedperl_model_pull": ("1", "fedperl"),
        "unencrypted_injection": ("2", "wire"),
        "replay_after_restart": ("3", "wire"),
        "poisoned_sgd_gradients": ("5", "sgd"),
        "poisoned_feder_relay": ("5", "feder"),
        "inflated_sample_count": ("6", "inflation"),
        "inflated_sample_count_capped": ("6", "inflation"),
        "forged_signature": ("earlier", "wire"),
        "wrong_federation": ("earlier", "wire"),
        "nan_model": ("earlier", "wire"),
        "replayed_answer": ("earlier", "wire"),
        "huge_norm_model": ("earlier", "wire"),
    }
)
SCENARIOS.update(REVIEW_SCENARIOS)
SCENARIOS.update(SECAGG_SCENARIOS)
SCENARIOS.update(RELAY_SCENARIOS)
GROUPS.update(
    {
        "wire": run_wire,
        "fedperl": run_fedperl,
        "sgd": run_sgd,
        "inflation": run_inflation,
        "feder": run_feder,
    }
)
GROUPS.update(REVIEW_GROUPS)
GROUPS.update(SECAGG_GROUPS)
GROUPS.update(RELAY_GROUPS)


def run_bench(opts: Options, names: list[str]) -> dict[str, Any]:
    """Run the named scenarios (group by group); the result object."""
    opts.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    attacks: dict[str, dict[str, Any]] = {}
    for group, runner in GROUPS.items():
        selected = {n for n in names if SCENARIOS[n][1] == group}
        if not selected:
            continue
        group_start = time.monotonic()
        try:
            found = runner(opts, selected)
        except Exception as exc:  # noqa: BLE001 - every scenario of the group reports it
            say(f"{group}: failed: {exc!r}")
            found = {
                n: inconclusive(
                    SCENARIOS[n][0], f"{group} federation failed: {type(exc).__name__}: {exc}"[:600]
                )
                for n in selected
            }
        for name in sorted(selected):
            entry = found.get(name) or inconclusive(SCENARIOS[name][0], "not run")
            attacks[name] = entry
            say(
                f"{name}: {entry['outcome']}{' (inconclusive)' if entry.get('inconclusive') else ''} - {entry['why']}"
            )
        say(f"{group}: {time.monotonic() - group_start:.0f} s")
    ordered = {n: attacks[n] for n in SCENARIOS if n in attacks}
    return {
        "attacks": ordered,
        "all_defended": all(e["outcome"] != "succeeded" for e in ordered.values()),
        "wall_s": round(time.monotonic() - started, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.attacks",
        description="Attack real daemons on 127.0.0.1, one scenario per trust hole (issue #16).",
    )
    p.add_argument(
        "--scenarios",
        default="all",
        help="comma-separated scenario names (see --list), or 'all' (default)",
    )
    p.add_argument("--list", action="store_true", help="print the scenarios and exit")
    p.add_argument("--out", type=Path, default=Path("runs/attacks"), help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bound",
        type=float,
        default=0.05,
        help="macro-F1 (0-1) an accepted attack may cost the honest nodes and still be neutralised",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per federation, seconds")
    p.add_argument("--inflation-factor", type=float, default=100.0)
    p.add_argument("--inflation-nodes", type=int, default=5)
    p.add_argument("--sgd-scale", type=float, default=1000.0)
    p.add_argument("--feder-scale", type=float, default=1000.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for name, (hole, group) in SCENARIOS.items():
            print(f"{name:28s} hole {hole:8s} federation {group}")
        return 0
    names = (
        list(SCENARIOS)
        if args.scenarios == "all"
        else [s.strip() for s in args.scenarios.split(",") if s.strip()]
    )
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(
            f"--scenarios: unknown {', '.join(unknown)}; known: {', '.join(SCENARIOS)}"
        )
    if args.inflation_nodes < 3:
        raise SystemExit("--inflation-nodes: at least 3")
    opts = Options(
        out=args.out.resolve(),  # site.yaml files name their data by absolute path
        seed=args.seed,
        bound=args.bound,
        timeout_s=args.timeout,
        inflation_factor=args.inflation_factor,
        inflation_nodes=args.inflation_nodes,
        sgd_scale=args.sgd_scale,
        feder_scale=args.feder_scale,
    )
    result = run_bench(opts, names)
    (opts.out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    line = {"attacks": result["attacks"], "all_defended": result["all_defended"]}
    sys.stdout.write(json.dumps(line, default=str) + "\n")
    sys.stdout.flush()
    return 0
