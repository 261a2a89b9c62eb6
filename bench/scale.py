"""Scale: thousands of simulated nodes on one machine.

    python -m bench.scale --nodes 100,300,1000,5000 --rounds 3 --out DIR

Every N runs FedAVGP2P in memory (protocols/memory: the same protocol code as
the daemon) in a fresh process of its own, so each peak RSS is that N's
alone: digits, the small CNN at 28 x 28, k = 4 neighbours (random
heuristic), one local epoch per round. Every site holds the same amount of
data whatever N is (--per-site training images, a quarter of that for
validation and for test, drawn from the digits splits with replacement, so
sites overlap when N x per-site exceeds the 1,259 training images): the time
per round then grows with N alone. The simulation runs as a large one should
(`InMemoryNetwork(inline_train=True, keep_checkpoints=False)`: training on the
event loop, no checkpoint kept per node, since no node restarts).

The baseline, measured in the same run: the largest N that is at most
--baseline-nodes with the in-memory network's defaults (training in worker
threads, every node's last checkpoint kept in memory), what a simulation of
a handful of nodes uses.

Per N: the time of each round (from the moment the last node logged the
previous one; round 1 includes building the sites), the mean of rounds 2..R
(`round_s`), peak RSS, and what one more node costs (`marginal_kb_per_node`:
the growth of peak RSS from the next smaller N, per node). Writes DIR/scale.json and
DIR/scale.png (time per round and memory against N); the last stdout line
is the summary (one JSON object).

    python -m bench.scale --engine ray --shards K [--address auto|HOST:PORT] ...

runs every N over K Ray shard actors (protocols/memory/ray_engine.py; without
--address, one Ray node per shard started on this machine) and, as the
baseline, the local engine's scale settings at the same N (`--baseline-nodes`):
`round_s_ratio_ray_vs_local`, each shard's peak RSS and what the nodes cost
over the shards' base (`kb_per_node_in_shards`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from p2pfl.files import atomic_write_text

DEFAULT_NODES = (100, 300, 1000, 5000)
K = 4


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------- data


def write_sites(out: Path, nodes: int, per_site: int, seed: int) -> list[Path]:
    """site_<i>.npz for every node: per_site training images and per_site / 4
    (at least 2) validation and test images each, drawn with replacement
    from the digits splits; every class keeps its name."""
    from p2pfl.learning.data.sources import read_source

    raw = read_source("digits")
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    small = max(2, per_site // 4)
    paths = []
    for i in range(nodes):
        arrays: dict[str, np.ndarray] = {"class_names": np.array(raw.class_names)}
        for split, count in (("train", per_site), ("val", small), ("test", small)):
            pair = raw.split(split)
            assert pair is not None, f"digits has no {split} split"
            pick = rng.integers(0, len(pair[1]), size=count)
            arrays[f"{split}_images"], arrays[f"{split}_labels"] = pair[0][pick], pair[1][pick]
        path = out / f"site_{i}.npz"
        np.savez(path, **arrays)
        paths.append(path)
    return paths


# ---------------------------------------------------------------- one N (child process)


def rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class LocalRun:
    """The local engine behind `RayRun`'s face (`start`, `wait`,
    `rounds_logged`, `peak_rss_mb`, `stop`), so one loop follows either."""

    def __init__(self, configs: Sequence[Any], network: Any) -> None:
        self.configs = configs
        self.network = network
        self._seen = 0
        self._counts: dict[int, int] = {}

    async def start(self) -> None:
        return None

    async def wait(self, local: Any) -> Any:
        return await local(self.configs, network=self.network)

    async def rounds_logged(self) -> dict[int, int]:
        """round -> how many nodes logged it (read on from where it last stopped)."""
        records = self.network.records
        for record in records[self._seen :]:
            self._counts[record["round"]] = self._counts.get(record["round"], 0) + 1
        self._seen = len(records)
        return dict(self._counts)

    async def peak_rss_mb(self) -> list[tuple[float, float]]:
        return []  # no shards: this process's peak is the row's peak_rss_mb

    def stop(self) -> None:
        return None


def settings_name(scale: bool, engine: str) -> str:
    """A row's `settings`: scale | defaults (local engine) | ray."""
    if engine == "ray":
        return "ray"
    return "scale" if scale else "defaults"


def run_one(
    nodes: int,
    rounds: int,
    data_dir: Path,
    state_dir: Path,
    *,
    scale: bool,
    engine: str = "local",
    shards: int = 2,
    address: str | None = None,
) -> dict[str, Any]:
    """One in-memory federation of `nodes`; called in a fresh process. With
    engine "ray", over `shards` Ray actors of the cluster at `address` (None:
    one Ray node per shard started on this machine)."""
    import torch

    from protocols.memory import InMemoryNetwork, simulate, simulation_configs

    torch.set_num_threads(1)
    sources = [str(data_dir / f"site_{i}.npz") for i in range(nodes)]
    configs = simulation_configs(
        sources,
        protocol={"name": "fedavgp2p", "rounds": rounds, "fraction": K / (nodes - 1)},
        state_root=state_dir,
        data={"image_size": 28, "augment": "weak"},
        training={"epochs": 1, "batch_size": 32, "threads": 1},
        selection={"name": "random"},
    )
    network = (
        InMemoryNetwork(inline_train=True, keep_checkpoints=False) if scale else InMemoryNetwork()
    )
    base_mb = rss_mb()
    done_at: dict[int, float] = {}
    last_say = time.perf_counter()

    def note(counts: dict[int, int]) -> None:
        nonlocal last_say
        for r, count in sorted(counts.items()):
            if count == nodes and r not in done_at:
                done_at[r] = time.perf_counter() - started
                _say(f"  {nodes} nodes: round {r}/{rounds} done at {done_at[r]:.1f} s")
        if time.perf_counter() - last_say > 60:
            last_say = time.perf_counter()
            _say(f"  {nodes} nodes: {time.perf_counter() - started:.0f} s, rounds {counts}")

    shutdown = None
    run: Any = LocalRun(configs, network)
    if engine == "ray":
        from protocols.memory.ray_engine import RayRun, connect, local_cluster

        if address is None:
            shutdown = local_cluster(shards)
        else:
            connect(address)
        run = RayRun(configs, shards=shards, network=network)
    # a shard is asked over an actor call: less often than this process's list is read
    poll_s = 1.0 if engine == "ray" else 0.2

    async def follow() -> tuple[Any, list[tuple[float, float]]]:
        try:
            await run.start()
            task = asyncio.ensure_future(run.wait(simulate))
            while not task.done():
                await asyncio.wait({task}, timeout=poll_s)
                if not task.done():
                    note(await run.rounds_logged())
            note(await run.rounds_logged())
            peaks = await run.peak_rss_mb()
            return task.result(), peaks
        finally:
            run.stop()

    started = time.perf_counter()
    try:
        result, shard_peaks = asyncio.run(follow())
    finally:
        if shutdown is not None:
            shutdown()
    wall = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_round = [round(done_at[r] - done_at.get(r - 1, 0.0), 4) for r in sorted(done_at)]
    later = per_round[1:]
    ray_figures: dict[str, Any] = {}
    if shard_peaks:
        ray_figures = {
            "shards": shards,
            "shard_peak_rss_mb": [round(peak, 1) for peak, _ in shard_peaks],
            "shard_base_rss_mb": [round(base, 1) for _, base in shard_peaks],
            # what the nodes cost over the shards' base (torch imported)
            "kb_per_node_in_shards": round(
                sum(peak - base for peak, base in shard_peaks) * 1024 / nodes, 1
            ),
        }
    final = [r["macro_f1"] for r in result.records if r["round"] == rounds and "macro_f1" in r]
    return {
        "nodes": nodes,
        "settings": settings_name(scale, engine),
        **ray_figures,
        "rounds": rounds,
        "rounds_completed_by_all": max(done_at, default=0),
        "errors": len(result.errors),
        "first_error": result.first_error(),
        "round_times_s": per_round,
        "round_s": round(float(np.mean(later)), 4) if later else None,
        "wall_s": round(wall, 1),
        "base_rss_mb": round(base_mb, 1),
        "peak_rss_mb": round(peak_mb, 1),
        "macro_f1_final_mean": round(float(np.mean(final or [float("nan")])), 4),
    }


def child(
    nodes: int,
    rounds: int,
    data_dir: Path,
    state_dir: Path,
    scale: bool,
    engine: str = "local",
    shards: int = 2,
    address: str | None = None,
) -> dict[str, Any]:
    """Run one N in a fresh process (its own peak RSS), return its figures."""
    cmd = [sys.executable, "-m", "bench.scale", "--child", str(nodes), "--rounds", str(rounds)]
    cmd += ["--data-dir", str(data_dir), "--state-dir", str(state_dir)]
    if not scale:
        cmd.append("--defaults")
    if engine == "ray":
        cmd += ["--engine", "ray", "--shards", str(shards)]
        cmd += ["--address", address] if address else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    last = ""
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith("{"):
            last = line
        else:
            _say(line)
    code = proc.wait()
    if code != 0 or not last:
        return {"nodes": nodes, "settings": settings_name(scale, engine), "failed": code}
    return json.loads(last)


# ---------------------------------------------------------------- report


def baseline_ratios(rows: list[dict[str, Any]], baseline: int, *, ray: bool) -> dict[str, Any]:
    """The run at `baseline` nodes against its baseline in the same run: with
    ray, its time per round over the local engine's (scale settings); locally,
    the scale settings' peak RSS and time per round over the defaults'."""
    new_settings, old_settings = ("ray", "scale") if ray else ("scale", "defaults")
    new = next(r for r in rows if r["nodes"] == baseline and r["settings"] == new_settings)
    old = next(r for r in rows if r["nodes"] == baseline and r["settings"] == old_settings)
    keys = (
        [("round_s", "round_s_ratio_ray_vs_local")]
        if ray
        else [
            ("peak_rss_mb", "peak_rss_ratio_vs_defaults"),
            ("round_s", "round_s_ratio_vs_defaults"),
        ]
    )
    out: dict[str, Any] = {}
    for figure, name in keys:
        if new.get(figure) and old.get(figure):
            out["baseline_nodes"] = baseline
            out[name] = round(new[figure] / old[figure], 3)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("round_s") is not None and r["settings"] == "scale"]
    base = [r for r in rows if r.get("round_s") is not None and r["settings"] == "defaults"]
    ray = [r for r in rows if r.get("round_s") is not None and r["settings"] == "ray"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for series, style, label in (
        (ok, "o-", "scale settings"),
        (base, "s", "defaults"),
        (ray, "^-", "ray shards (memory: all shards + driver)"),
    ):
        xs = [r["nodes"] for r in series]
        left.plot(xs, [r["round_s"] for r in series], style, label=label)
        right.plot(
            xs,
            [r["peak_rss_mb"] + sum(r.get("shard_peak_rss_mb", [])) for r in series],
            style,
            label=label,
        )
    left.set(xscale="log", yscale="log", xlabel="nodes", ylabel="seconds per round")
    right.set(xscale="log", xlabel="nodes", ylabel="peak RSS (MB)")
    right.axhline(1500, color="grey", linestyle=":", label="1,500 MB at 1,000 nodes (target)")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"in-memory FedAVGP2P, digits, small CNN, k = {K}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--nodes",
        default=",".join(str(n) for n in DEFAULT_NODES),
        help="comma list of federation sizes (default %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-site", type=int, default=8, help="training images per site")
    parser.add_argument(
        "--baseline-nodes",
        type=int,
        default=1000,
        help="the baseline (in-memory defaults) runs at the largest N up to this; 0: none",
    )
    parser.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="ray: the simulator sharded over Ray actors (protocols/memory/ray_engine.py); "
        "the baseline is then the local engine at the same N",
    )
    parser.add_argument("--shards", type=int, default=2, help="Ray shard actors (--engine ray)")
    parser.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster (auto, or HOST:PORT); default: one Ray node per shard "
        "started on this machine",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/scale"))
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--defaults", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.sizes = sorted({int(n) for n in str(args.nodes).split(",") if n.strip()})
    except ValueError:
        parser.error(f"--nodes must be a comma list of integers, got {args.nodes!r}")
    if not args.sizes or min(args.sizes) < K + 1:
        parser.error(f"--nodes: every size must be at least {K + 1} (k = {K} neighbours)")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (round 1 includes building the sites)")
    if args.per_site < 2:
        parser.error("--per-site must be at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        try:
            figures = run_one(
                args.child,
                args.rounds,
                args.data_dir,
                args.state_dir,
                scale=not args.defaults,
                engine=args.engine,
                shards=args.shards,
                address=args.address,
            )
        except RuntimeError as exc:  # a shard died, or ray is missing: one line
            if type(exc).__name__ not in ("ShardDied", "RayMissing"):
                raise
            _say(str(exc))
            return 1
        _say(json.dumps(figures))
        return 0 if figures["errors"] == 0 else 1
    started = time.perf_counter()
    largest = max(args.sizes)
    data_dir = args.out / f"data_{largest}"
    _say(f"writing {largest} site files ({args.per_site} training images each) to {data_dir}")
    write_sites(data_dir, largest, args.per_site, args.seed)
    rows: list[dict[str, Any]] = []
    # every N on the engine asked for; then the baseline at one N: with ray, the
    # local engine's scale settings; locally, the in-memory defaults
    runs = [(n, args.engine, True) for n in args.sizes]
    baseline = max((n for n in args.sizes if n <= args.baseline_nodes), default=None)
    if baseline is not None:
        runs.append((baseline, "local", args.engine == "ray"))
    for nodes, engine, scale in runs:
        what = {"ray": f"ray, {args.shards} shards", "scale": "scale settings"}
        what["defaults"] = "in-memory defaults"
        _say(f"--- {nodes} nodes, {what[settings_name(scale, engine)]}")
        state = args.out / "state"
        rows.append(
            child(nodes, args.rounds, data_dir, state, scale, engine, args.shards, args.address)
        )
        _say(f"    {json.dumps(rows[-1])}")
        atomic_write_text(args.out / "scale.json", json.dumps({"runs": rows}, indent=2) + "\n")
    scaled = [r for r in rows if r["settings"] == "scale" and r.get("peak_rss_mb")]
    for before, after in zip(scaled, scaled[1:], strict=False):
        # what one more node costs, free of the process's fixed overhead
        after["marginal_kb_per_node"] = round(
            (after["peak_rss_mb"] - before["peak_rss_mb"])
            * 1024
            / (after["nodes"] - before["nodes"]),
            1,
        )
    plot(rows, args.out / "scale.png")
    summary: dict[str, Any] = {"bench": "scale", "k": K, "rounds": args.rounds}
    for row in rows:
        tag = f"{row['nodes']}" + {"scale": "", "defaults": "_defaults"}.get(
            row["settings"], "_" + row["settings"]
        )
        summary[f"round_s_{tag}"] = row.get("round_s")
        summary[f"peak_rss_mb_{tag}"] = row.get("peak_rss_mb")
        summary[f"completed_{tag}"] = row.get("rounds_completed_by_all") == args.rounds
        if "marginal_kb_per_node" in row:
            summary[f"marginal_kb_per_node_{tag}"] = row["marginal_kb_per_node"]
        if "shard_peak_rss_mb" in row:
            summary[f"shard_peak_rss_mb_{tag}"] = row["shard_peak_rss_mb"]
            summary[f"kb_per_node_in_shards_{tag}"] = row["kb_per_node_in_shards"]
    if baseline is not None:
        summary.update(baseline_ratios(rows, baseline, ray=args.engine == "ray"))
    summary["ok"] = all(row.get("rounds_completed_by_all") == args.rounds for row in rows)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    summary["plot"] = str(args.out / "scale.png")
    atomic_write_text(
        args.out / "scale.json", json.dumps({"runs": rows, "summary": summary}, indent=2) + "\n"
    )
    _say(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
