"""Scale: thousands of simulated nodes on one machine, or over Ray.

    python -m bench.scale --nodes 100,300,1000,5000 --rounds 3 [--model NAME] --out DIR

Every N runs FedAVGP2P in memory (protocols/memory: the same protocol code as
the daemon) in a fresh process of its own, so each peak RSS is that N's
alone: digits at 28 x 28, the small CNN (or --model: resnet18, ...), k = 4
neighbours (random heuristic), one local epoch per round. Every site holds
the same amount of data whatever N is (--per-site training images, a
quarter of that for validation and for test, drawn from the digits splits
with replacement, so sites overlap when N x per-site exceeds the 1,259
training images): the time per round then grows with N alone. The
simulation runs as a large one should (`InMemoryNetwork(inline_train=True,
keep_checkpoints=False)`: training on the event loop, no checkpoint kept
per node, since no node restarts).

The baseline, measured in the same run: the largest N that is at most
--baseline-nodes with the in-memory network's defaults (training in worker
threads, every node's last checkpoint kept in memory).

Per N: the time of each round, from the wall-clock times at which the nodes
logged their rounds, as the process (or shard) running them recorded them
(`InMemoryNetwork.round_ends`; not when this process polled them): round r
runs from the moment the last node logged r - 1 to the moment the last node
logged r, round 1 from the start (it includes building the sites); the mean
of rounds 2..R (`round_s`), peak RSS, and what one more node costs
(`marginal_kb_per_node`: the growth of peak RSS from the next smaller N, per
node; `nodes_per_gb` from it). Writes DIR/scale.json and DIR/scale.png; the
last stdout line is the summary (one JSON object).

    python -m bench.scale --engine ray --shards K [--address auto|HOST:PORT] ...

runs every N over K Ray shard actors (protocols/memory/ray_engine.py; without
--address, one Ray node per shard started on this machine) and, as the
baseline, the local engine's scale settings at the same N (`--baseline-nodes`):
`round_s_ratio_ray_vs_local`, each shard's peak RSS, what the nodes cost over
the shards' base (`kb_per_node_in_shards`), the marginal cost over the
shards' summed peaks, and the actor calls between shards with the messages
they carried (`cross_shard_calls`, `cross_shard_messages`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.scale_plot import plot
from p2pfl.files import atomic_write_text
from protocols.memory.ray_engine import ShardsDoNotFit, check_shard_resources

DEFAULT_NODES = (100, 300, 1000, 5000)
K = 4
ROUND_TIMES_FROM = (
    "the wall time (time.time()) at which the last node logged each round, as the process "
    "or shard running it recorded it; round 1 from the start of the run"
)


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
    """The local engine behind `RayRun`'s face (`start`, `wait`, `round_ends`,
    `mail`, `peak_rss_mb`, `stop`), so one loop follows either."""

    def __init__(self, configs: Sequence[Any], network: Any) -> None:
        self.configs = configs
        self.network = network

    async def start(self) -> None:
        return None

    async def wait(self, local: Any) -> Any:
        return await local(self.configs, network=self.network)

    async def round_ends(self) -> dict[int, tuple[int, float]]:
        """round -> (nodes that logged it, wall time of the last)."""
        return dict(self.network.round_ends)

    async def mail(self) -> dict[str, int]:
        return {}  # no shards, no calls between them

    async def peak_rss_mb(self) -> list[tuple[float, float]]:
        return []  # no shards: this process's peak is the row's peak_rss_mb

    def stop(self) -> None:
        return None


def round_times(ends: dict[int, tuple[int, float]], nodes: int, started: float) -> list[float]:
    """Each round's time, from the times the nodes logged their rounds
    (`round_ends`: wall clock, as the process running the nodes, or each
    shard, recorded them): round r took from the moment the last node logged
    r - 1 (for round 1: `started`, so it includes building the sites) to the
    moment the last node logged r. Up to the first round not every node logged."""
    out, before = [], started
    for r in range(1, max(ends, default=0) + 1):
        count, at = ends.get(r, (0, 0.0))
        if count < nodes:
            break
        out.append(round(at - before, 4))
        before = at
    return out


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
    model: str = "small_cnn",
    store_mb: int = 1024,
    shard_cpus: float = 1.0,
    shard_gpus: float = 0.0,
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
        model={"name": model},
    )
    network = (
        InMemoryNetwork(inline_train=True, keep_checkpoints=False) if scale else InMemoryNetwork()
    )
    base_mb = rss_mb()
    said: set[int] = set()
    last_say = time.perf_counter()

    def note(ends: dict[int, tuple[int, float]]) -> None:
        """Progress lines (the figures come from the round-end times at the end)."""
        nonlocal last_say
        for r, (count, at) in sorted(ends.items()):
            if count >= nodes and r not in said:
                said.add(r)
                _say(f"  {nodes} nodes: round {r}/{rounds} done at {at - started:.1f} s")
        if time.perf_counter() - last_say > 60:
            last_say = time.perf_counter()
            counts = {r: count for r, (count, _) in sorted(ends.items())}
            _say(f"  {nodes} nodes: {time.time() - started:.0f} s, rounds {counts}")

    shutdown = None
    run: Any = LocalRun(configs, network)
    if engine == "ray":
        from protocols.memory.ray_engine import RayRun, connect, local_cluster

        if address is None:
            cpus, gpus = math.ceil(shard_cpus), math.ceil(shard_gpus)
            if gpus and torch.cuda.device_count() < gpus:
                raise ValueError(
                    f"--shard-gpus {shard_gpus:g} needs a GPU on this machine; torch sees "
                    f"{torch.cuda.device_count()} (or pass --address of a cluster with GPUs)"
                )
            shutdown = local_cluster(shards, cpus=cpus, gpus=gpus, object_store_mb=store_mb)
        else:
            connect(address)
        run = RayRun(
            configs,
            shards=shards,
            network=network,
            cpus_per_shard=shard_cpus,
            gpus_per_shard=shard_gpus,
        )
    # a shard is asked over an actor call: less often than this process's dict is read
    poll_s = 1.0 if engine == "ray" else 0.2

    async def follow() -> tuple[Any, dict[int, tuple[int, float]], dict[str, int], list[Any]]:
        try:
            await run.start()
            task = asyncio.ensure_future(run.wait(simulate))
            while not task.done():
                await asyncio.wait({task}, timeout=poll_s)
                if not task.done():
                    note(await run.round_ends())
            ends = await run.round_ends()
            note(ends)
            return task.result(), ends, await run.mail(), await run.peak_rss_mb()
        finally:
            run.stop()

    started = time.time()  # the clock the nodes' round ends are logged with
    try:
        result, ends, mail, shard_peaks = asyncio.run(follow())
    finally:
        if shutdown is not None:
            shutdown()
    wall = time.time() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_round = round_times(ends, nodes, started)
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
            # actor calls between shards, and the messages they carried
            "cross_shard_calls": mail.get("calls"),
            "cross_shard_messages": mail.get("items"),
            # kept models put into Ray's object store (once each), the replies
            # that carried a reference to one, and the fetches of one
            "kept_put": mail.get("kept_put"),
            "kept_replies": mail.get("kept_replies"),
            "kept_fetched": mail.get("kept_fetched"),
        }
    final = [r["macro_f1"] for r in result.records if r["round"] == rounds and "macro_f1" in r]
    return {
        "nodes": nodes,
        "settings": settings_name(scale, engine),
        "model": model,
        **ray_figures,
        "rounds": rounds,
        "rounds_completed_by_all": len(per_round),
        "errors": len(result.errors),
        "first_error": result.first_error(),
        "round_times_s": per_round,
        "round_times_from": ROUND_TIMES_FROM,
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
    model: str = "small_cnn",
    store_mb: int = 1024,
    shard_cpus: float = 1.0,
    shard_gpus: float = 0.0,
) -> dict[str, Any]:
    """Run one N in a fresh process (its own peak RSS), return its figures."""
    cmd = [sys.executable, "-m", "bench.scale", "--child", str(nodes), "--rounds", str(rounds)]
    cmd += ["--data-dir", str(data_dir), "--state-dir", str(state_dir), "--model", model]
    if not scale:
        cmd.append("--defaults")
    if engine == "ray":
        cmd += ["--engine", "ray", "--shards", str(shards)]
        cmd += ["--address", address] if address else ["--object-store-mb", str(store_mb)]
        cmd += ["--shard-cpus", str(shard_cpus), "--shard-gpus", str(shard_gpus)]
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


def add_marginals(rows: list[dict[str, Any]]) -> None:
    """What one more node costs, free of the fixed overhead: the growth of
    peak memory from the next smaller N of the same settings, per node (for
    ray, the shards' peaks summed: the nodes live there), and how many such
    nodes fit in a GB."""
    for settings in ("scale", "ray"):
        same = [r for r in rows if r["settings"] == settings and r.get("peak_rss_mb")]
        for before, after in zip(same, same[1:], strict=False):
            grown = memory_mb(after) - memory_mb(before)
            kb = grown * 1024 / (after["nodes"] - before["nodes"])
            after["marginal_kb_per_node"] = round(kb, 1)
            if kb > 0:
                after["nodes_per_gb"] = round(1024 * 1024 / kb, 1)


def memory_mb(row: dict[str, Any]) -> float:
    """Where a run's nodes live: the shards' peaks summed (ray), else the process's."""
    shards = row.get("shard_peak_rss_mb")
    return float(sum(shards)) if shards else float(row["peak_rss_mb"])


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
    parser.add_argument(
        "--shard-cpus",
        type=float,
        default=1.0,
        help="CPUs each Ray shard actor asks for; its training pool has one worker per "
        "whole CPU (default %(default)s)",
    )
    parser.add_argument(
        "--shard-gpus",
        type=float,
        default=0.0,
        help="GPUs each Ray shard actor asks for (a fraction shares one; its nodes then "
        "train on it with training.device auto; default %(default)s)",
    )
    parser.add_argument(
        "--object-store-mb",
        type=int,
        default=1024,
        help="each Ray node's object store when this machine starts them (no --address): "
        "it holds one copy of each kept model another shard asked for (default %(default)s)",
    )
    parser.add_argument(
        "--model",
        default="small_cnn",
        help="every site's model (model.name: small_cnn, resnet18, ...; default %(default)s)",
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
    try:
        check_shard_resources(args.shard_cpus, args.shard_gpus)
    except ValueError as exc:
        parser.error(f"--shard-cpus/--shard-gpus: {exc}")
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
                model=args.model,
                store_mb=args.object_store_mb,
                shard_cpus=args.shard_cpus,
                shard_gpus=args.shard_gpus,
            )
        except RuntimeError as exc:  # a shard died, or ray is missing: one line
            if type(exc).__name__ not in ("ShardDied", "RayMissing"):
                raise
            _say(str(exc))
            return 1
        except ShardsDoNotFit as exc:  # the cluster cannot place the shards: one line
            _say(f"bench.scale: {exc}")
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
        ray_args = (args.shards, args.address, args.model, args.object_store_mb)
        ray_args += (args.shard_cpus, args.shard_gpus)
        rows.append(child(nodes, args.rounds, data_dir, state, scale, engine, *ray_args))
        _say(f"    {json.dumps(rows[-1])}")
        atomic_write_text(args.out / "scale.json", json.dumps({"runs": rows}, indent=2) + "\n")
    add_marginals(rows)
    plot(rows, args.out / "scale.png", k=K, model=args.model)
    summary: dict[str, Any] = {"bench": "scale", "k": K, "rounds": args.rounds}
    summary.update(model=args.model, round_times_from=ROUND_TIMES_FROM)
    for row in rows:
        tag = f"{row['nodes']}" + {"scale": "", "defaults": "_defaults"}.get(
            row["settings"], "_" + row["settings"]
        )
        summary[f"round_s_{tag}"] = row.get("round_s")
        summary[f"peak_rss_mb_{tag}"] = row.get("peak_rss_mb")
        summary[f"completed_{tag}"] = row.get("rounds_completed_by_all") == args.rounds
        for key in ("marginal_kb_per_node", "nodes_per_gb"):
            if key in row:
                summary[f"{key}_{tag}"] = row[key]
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
