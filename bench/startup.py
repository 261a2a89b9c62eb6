"""How long a local federation takes from launch to its first round.

    python -m bench.startup [--nodes 5] [--data digits|PATH.npz] [--repeats 3] --out DIR

Each repeat provisions N sites on 127.0.0.1 exactly as bench.federation does
(same partition, site.yaml and node settings: FedAVGP2P, one training thread
per node), launches the N `p2pfl-node` processes at once, and polls their
/status until every node runs round 1. Each node reports when it reached each
start-up milestone, in seconds from its own process launch (/status
`startup`): node_created (interpreter, imports, config, keys), listening
(transport and status endpoint up), peers_ready (every peer seen), first_round
(data loaded, model built: round 1 runs). The nodes are then stopped.

Prints, per repeat, the time from the launch of the first process to every
node being in round 1 (`first_round_s`, the figure of issue 17: <= 8 s for 5
nodes), to the first node in round 1, and the median over nodes of each
milestone; the last stdout line is one JSON object with every repeat and the
median over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.federation.specs import RunSpec, node_overrides, partition, protocol_section, site_names
from bench.forkstart import LAUNCH_ENV
from bench.localfed import LocalFederation
from node.provision import provision

MILESTONES = ("node_created", "listening", "peers_ready", "first_round")


def one_start(spec: RunSpec, out: Path, sources: list[Path], timeout_s: float) -> dict[str, Any]:
    """Launch the federation once; every node's milestones and the wall times."""
    plans = provision(
        out / "fed",
        site_names(spec.nodes),
        protocol=protocol_section(spec),
        data_sources=[str(s.resolve()) for s in sources],
        federation="bench-startup",
        seed=spec.seed,
        overrides=node_overrides(spec),
    )
    started = time.time()
    reached: dict[str, float] = {}
    milestones: dict[str, dict[str, float]] = {}
    with LocalFederation(plans, out / "logs") as fed:
        deadline = time.monotonic() + timeout_s
        while len(reached) < len(plans) and time.monotonic() < deadline:
            for name, node in fed.nodes.items():
                if name in reached:
                    continue
                if not node.running:
                    raise RuntimeError(f"{name} exited during start-up: {node.log_tail(10)}")
                status = node.status() or {}
                startup = status.get("startup") or {}
                if "first_round" in startup:
                    reached[name] = startup["launched_at"] + startup["first_round"] - started
                    milestones[name] = {k: startup[k] for k in MILESTONES if k in startup}
            time.sleep(0.05)
        fed.stop_all(grace_s=5.0)
    if len(reached) < len(plans):
        missing = sorted(set(site_names(spec.nodes)) - set(reached))
        raise TimeoutError(f"not in round 1 after {timeout_s:.0f} s: {', '.join(missing)}")
    return {
        "first_round_s": round(max(reached.values()), 3),
        "first_node_s": round(min(reached.values()), 3),
        "median_node": {
            k: round(statistics.median(m[k] for m in milestones.values()), 3) for k in MILESTONES
        },
        "per_node": milestones,
    }


def main(argv: list[str] | None = None) -> int:
    # this benchmark measures the very imports a forked start skips (bench/forkstart.py)
    os.environ.pop(LAUNCH_ENV, None)
    parser = argparse.ArgumentParser(
        prog="python -m bench.startup", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--data", default="digits", help="'digits' or a MedMNIST-style .npz")
    parser.add_argument("--partition", default="dirichlet:0.5")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="bound of one start, seconds")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.repeats < 1:
        parser.error("--nodes >= 2 and --repeats >= 1")
    spec = RunSpec(nodes=args.nodes, rounds=2, data=args.data, partition=args.partition)
    out = args.out.resolve()
    sources, _ = partition(spec, out / "data")
    runs = []
    for i in range(args.repeats):
        run = one_start(spec, out / f"run{i}", sources, args.timeout)
        runs.append(run)
        m = run["median_node"]
        print(
            f"repeat {i + 1}/{args.repeats}: every node in round 1 after {run['first_round_s']:.2f} s "
            f"(first node {run['first_node_s']:.2f} s); median node: created {m['node_created']:.2f} s, "
            f"listening {m['listening']:.2f} s, peers ready {m['peers_ready']:.2f} s, "
            f"round 1 {m['first_round']:.2f} s",
            flush=True,
        )
    summary = {
        "nodes": args.nodes,
        "data": args.data,
        "first_round_s": [r["first_round_s"] for r in runs],
        "first_node_s": [r["first_node_s"] for r in runs],
        "first_round_s_median": round(statistics.median(r["first_round_s"] for r in runs), 3),
        "breakdown_median_node": {
            k: round(statistics.median(r["median_node"][k] for r in runs), 3) for k in MILESTONES
        },
        "target_s": 8.0,
    }
    summary["pass"] = summary["first_round_s_median"] <= summary["target_s"]
    (out / "startup.json").write_text(json.dumps({**summary, "runs": runs}, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
