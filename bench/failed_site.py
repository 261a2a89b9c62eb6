"""A federation with one failed site runs at the speed of the others.

    python -m bench.failed_site --seeds 0,1,2 --rounds 5 --out DIR

Real `p2pfl-node` processes on loopback, FedAVGP2P with c = 1 on digits (iid
over --survivors sites, 4 by default). Per seed, two runs of the same sites
with the same data: `alone`, those sites alone, and `with_failed`, the same
sites plus one more whose training split is empty, so its protocol fails at start (DataError)
while its process stays up and keeps sending heartbeats: the case where one
hospital's data export broke. With c = 1 each survivor pulls from every
alive peer, so both runs do the same work when the failed site is skipped;
had it been chosen, each of its peers would wait for its model until the
round timeout (--round-timeout, 60 s by default), every round.

The figure: `round_ratio` = the survivors' mean round time (metrics.jsonl
`round_s`, every round) in `with_failed` over `alone`, per seed and over all seeds.
The order of the two runs alternates with the seed. Writes DIR/failed_site.json;
the last stdout line is the summary (one JSON object).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.federation.processes import run_processes
from bench.federation.specs import RunSpec, partition
from p2pfl.files import atomic_savez, atomic_write_text


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def empty_site(like: Path, path: Path) -> Path:
    """A copy of `like` whose training split is empty: its node fails at start."""
    with np.load(like) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["train_images"] = arrays["train_images"][:0]
    arrays["train_labels"] = arrays["train_labels"][:0]
    atomic_savez(path, arrays, compressed=False)  # the site's images: 0600 whatever the umask
    return path


def survivors_round_s(
    rows: list[dict[str, Any]], rounds: int, survivors: int
) -> tuple[float | None, bool]:
    """(mean round_s of site_0..site_{survivors-1} over every round, whether all finished)."""
    names = {f"site_{i}" for i in range(survivors)}
    times = [r["round_s"] for r in rows if r["node"] in names and r.get("round_s") is not None]
    finished = all(any(r["node"] == name and r["round"] == rounds for r in rows) for name in names)
    return (statistics.fmean(times) if times else None), finished


def one_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    out = args.out / f"seed_{seed}"
    spec = RunSpec(
        nodes=args.survivors,
        protocol="fedavgp2p",
        fraction=1.0,
        rounds=args.rounds,
        partition="iid",
        seed=seed,
        round_timeout_s=args.round_timeout,
        startup_wait_s=30.0,
        timeout_s=args.timeout,
    )
    sources, _ = partition(spec, out / "data")
    empty = empty_site(sources[0], out / "data" / "empty_train.npz")
    failed = f"site_{args.survivors}"  # the last node of the run with it
    runs = {
        "alone": (spec, sources, frozenset()),
        "with_failed": (
            dataclasses.replace(spec, nodes=args.survivors + 1),
            [*sources, empty],
            frozenset({failed}),
        ),
    }
    order = ["alone", "with_failed"] if seed % 2 == 0 else ["with_failed", "alone"]
    figures: dict[str, Any] = {"seed": seed, "order": order}
    for name in order:
        run_spec, run_sources, expendable = runs[name]
        _say(f"--- seed {seed}: {name} ({run_spec.nodes} processes)")
        outcome = run_processes(run_spec, out / name, run_sources, expendable=expendable)
        mean_s, finished = survivors_round_s(outcome.rows, args.rounds, args.survivors)
        figures[name] = {
            "round_s_mean": None if mean_s is None else round(mean_s, 3),
            "survivors_finished": finished,
            "wall_s": round(outcome.wall_s, 1),
            "errors": outcome.errors,
        }
    alone, with_failed = figures["alone"]["round_s_mean"], figures["with_failed"]["round_s_mean"]
    figures["round_ratio"] = round(with_failed / alone, 3) if alone and with_failed else None
    return figures


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.failed_site", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma list (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--survivors", type=int, default=4, help="sites that train (default %(default)s)"
    )
    parser.add_argument("--round-timeout", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    parser.add_argument("--out", type=Path, default=Path("runs/failed_site"))
    args = parser.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be a comma list of integers, got {args.seeds!r}")
    if not args.seed_list or args.rounds < 1 or args.survivors < 1:
        parser.error("give at least one seed, one round and one survivor")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    per_seed = []
    for seed in args.seed_list:
        per_seed.append(one_seed(args, seed))
        _say(f"    {json.dumps(per_seed[-1])}")
        atomic_write_text(
            args.out / "failed_site.json", json.dumps({"seeds": per_seed}, indent=2) + "\n"
        )
    ratios = [s["round_ratio"] for s in per_seed if s["round_ratio"] is not None]
    alone = [s["alone"]["round_s_mean"] for s in per_seed if s["alone"]["round_s_mean"]]
    with_failed = [
        s["with_failed"]["round_s_mean"] for s in per_seed if s["with_failed"]["round_s_mean"]
    ]
    summary = {
        "bench": "failed_site",
        "seeds": args.seed_list,
        "rounds": args.rounds,
        "survivors": args.survivors,
        "round_ratio_per_seed": [s["round_ratio"] for s in per_seed],
        "round_ratio": round(statistics.fmean(with_failed) / statistics.fmean(alone), 3)
        if alone and with_failed
        else None,
        "round_s_alone": round(statistics.fmean(alone), 3) if alone else None,
        "round_s_with_failed": round(statistics.fmean(with_failed), 3) if with_failed else None,
        "survivors_finished": all(
            s[run]["survivors_finished"] for s in per_seed for run in ("alone", "with_failed")
        ),
        "target": 1.2,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    summary["ok"] = bool(
        summary["survivors_finished"] and ratios and summary["round_ratio"] <= summary["target"]
    )
    atomic_write_text(
        args.out / "failed_site.json",
        json.dumps({"seeds": per_seed, "summary": summary}, indent=2) + "\n",
    )
    _say(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
