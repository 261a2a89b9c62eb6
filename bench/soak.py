"""Soak: N real node processes, a tiny model, many rounds; do RSS and open file
descriptors stay flat?

    python -m bench.soak --nodes 6 --rounds 100 --out DIR

The nodes run FedAVGP2P on the embedded digits (8 x 8 images, two training
steps and an evaluation per round), so a round is mostly the daemon's
own work: heartbeats, model requests, checkpoints, spool and journal, logs.
Every half second the benchmark reads each process's RSS and open descriptors
(psutil) and the round it reports on /status. After a warm-up (the first
--warmup share of the rounds: allocator pools, imports, the first
checkpoints), it fits a least-squares line per node, value against round:
`rss_mb_per_100_rounds` and `fds_per_100_rounds` are those slopes.

Descriptors are split in two: sockets (psutil's connections: keep-alive
pools that fill, at their own pace, up to the transport's bound of
limit_per_host = 8 per peer and direction) and everything else (`files`:
spool, journal, checkpoints, logs), which must not grow at all once the node
runs: `files_per_100_rounds`, `files_end - files_after_warmup` and
`sockets_max` are the figures a leak shows in, whatever the machine's load.

Writes DIR/soak.json (samples, slopes) and DIR/soak.png, prints the summary
as the last stdout line (one JSON object).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.localfed import LocalFederation
from node.provision import provision


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of y on x (None with fewer than 3 distinct x)."""
    if len({x for x, _ in points}) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx


def soak_overrides(rounds: int) -> dict[str, Any]:
    return {
        "node": {"exit_when_done": True, "startup_wait_s": 60},
        "data": {"image_size": 8, "augment": "none"},
        "training": {"steps_per_round": 2, "batch_size": 16, "threads": 1},
        "transport": {"heartbeat_s": 0.5, "suspect_after_s": 3.0, "dead_after_s": 8.0},
        "logging": {"level": "INFO"},
    }


def run_soak(
    out: Path, nodes: int, rounds: int, *, warmup: float = 0.2, timeout_s: float = 1800.0
) -> dict[str, Any]:
    if out.exists():
        shutil.rmtree(out)
    names = [f"soak_{i}" for i in range(nodes)]
    protocol = {
        "name": "fedavgp2p",
        "rounds": rounds,
        "fraction": 0.5,
        "round_timeout_s": 5.0,
        "eval_every": 1,
    }
    plans = provision(out / "fed", names, protocol=protocol, overrides=soak_overrides(rounds))
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    started = time.perf_counter()
    with LocalFederation(plans, out / "logs") as fed:
        procs = {n: psutil.Process(fed[n].proc.pid) for n in names if fed[n].proc is not None}
        next_report = 0
        while time.perf_counter() - started < timeout_s and any(
            n.running for n in fed.nodes.values()
        ):
            for name in names:
                status = fed[name].status()
                if status is None or not fed[name].running or status["phase"] == "done":
                    continue  # (a finished node is closing its connections)
                try:
                    rss = procs[name].memory_info().rss / 2**20
                    fds = procs[name].num_fds()
                    sockets = len(procs[name].net_connections(kind="all"))
                except psutil.Error:
                    continue
                samples[name].append(
                    {
                        "t": round(time.perf_counter() - started, 2),
                        "round": status["round"],
                        "rss_mb": round(rss, 2),
                        "fds": fds,
                        "sockets": sockets,
                        "files": fds - sockets,
                    }
                )
            low = min((s[-1]["round"] for s in samples.values() if s), default=0)
            if low >= next_report:
                _say(f"round {low}/{rounds} (slowest node), {time.perf_counter() - started:.0f} s")
                next_report = low + max(1, rounds // 10)
            time.sleep(0.5)
        codes = fed.stop_all()
    wall = time.perf_counter() - started
    first = max(1, int(rounds * warmup))
    per_node: dict[str, dict[str, Any]] = {}
    for name, rows in samples.items():
        late = [r for r in rows if r["round"] >= first]
        rss_slope = slope([(r["round"], r["rss_mb"]) for r in late])
        fd_slope = slope([(r["round"], r["fds"]) for r in late])
        file_slope = slope([(r["round"], r["files"]) for r in late])
        logged = (out / "fed" / name / "state" / "metrics.jsonl").read_text().splitlines()
        per_node[name] = {
            "last_round": max((json.loads(x)["round"] for x in logged), default=0),
            "rss_mb_after_warmup": late[0]["rss_mb"] if late else None,
            "rss_mb_end": late[-1]["rss_mb"] if late else None,
            "rss_mb_max": max((r["rss_mb"] for r in rows), default=None),
            "fds_after_warmup": late[0]["fds"] if late else None,
            "fds_end": late[-1]["fds"] if late else None,
            "fds_max": max((r["fds"] for r in rows), default=None),
            # medians of 5 samples: a file open for a moment (a checkpoint being
            # written) is not a leak
            "files_after_warmup": _median([r["files"] for r in late[:5]]),
            "files_end": _median([r["files"] for r in late[-5:]]),
            "sockets_max": max((r["sockets"] for r in rows), default=None),
            "files_per_100_rounds": None if file_slope is None else round(100 * file_slope, 2),
            "rss_mb_per_100_rounds": None if rss_slope is None else round(100 * rss_slope, 2),
            "fds_per_100_rounds": None if fd_slope is None else round(100 * fd_slope, 2),
        }
    summary = {
        "nodes": nodes,
        "rounds": rounds,
        "rounds_completed": {n: v["last_round"] for n, v in per_node.items()},
        "exit_codes": codes,
        "wall_s": round(wall, 1),
        "warmup_rounds": first,
        "rss_mb_per_100_rounds_max": _max_abs(
            v["rss_mb_per_100_rounds"] for v in per_node.values()
        ),
        "fds_per_100_rounds_max": _max_abs(v["fds_per_100_rounds"] for v in per_node.values()),
        "rss_mb_max": max((v["rss_mb_max"] or 0.0) for v in per_node.values()),
        "fds_max": max((v["fds_max"] or 0) for v in per_node.values()),
    }
    plot = _plot(samples, out / "soak.png", first)
    summary["plot"] = str(plot)
    (out / "soak.json").write_text(
        json.dumps({"summary": summary, "per_node": per_node, "samples": samples}, indent=1)
    )
    return summary


def _median(values: list[int]) -> float | None:
    return float(statistics.median(values)) if values else None


def _max_abs(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return max(present, key=abs) if present else None


def _plot(samples: dict[str, list[dict[str, float]]], path: Path, warmup: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10.0, 3.8))
    for name, rows in sorted(samples.items()):
        ax1.plot([r["round"] for r in rows], [r["rss_mb"] for r in rows], label=name, lw=1)
        ax2.plot([r["round"] for r in rows], [r["fds"] for r in rows], label=name, lw=1)
    for ax, label in ((ax1, "RSS (MiB)"), (ax2, "open file descriptors")):
        ax.axvline(warmup, color="0.5", ls=":", lw=0.8)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax1.set_title("memory per node")
    ax2.set_title("descriptors per node")
    ax2.legend(fontsize="x-small", loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--warmup", type=float, default=0.2, help="share of rounds left out of the fit")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=Path("runs/soak"))
    args = p.parse_args(argv)
    summary = run_soak(
        args.out, args.nodes, args.rounds, warmup=args.warmup, timeout_s=args.timeout
    )
    _say(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
