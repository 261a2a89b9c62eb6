"""All nodes of a run in this process over the in-memory network
(protocols/memory/): the same protocol code as the daemon, one progress line
per round once every node has reported it. With `spec.engine == "ray"` the
nodes run sharded over Ray actors (protocols/memory/ray_engine.py), their
records read from the shards as they log them."""

from __future__ import annotations

import asyncio
import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.federation.outcome import POLL_INTERVAL_S, Report, RunOutcome, bench_row, stdout_line
from bench.federation.specs import RunSpec, in_process_configs, one_torch_thread, site_names
from protocols.memory import InMemoryNetwork, SimulationResult, simulate
from protocols.memory.ray_engine import RayRun, ShardDied, connect, import_ray


def run_in_memory(
    spec: RunSpec,
    sources: Sequence[Path],
    state_root: Path,
    *,
    report: Report = stdout_line,
    training: dict[str, Any] | None = None,
) -> RunOutcome:
    """All nodes in this process over InMemoryNetwork; one progress line per
    round once every node has reported it. `training`: fields added to every
    site's training: section (`in_process_configs`)."""
    one_torch_thread()  # the nodes' training threads share the cores
    configs = in_process_configs(spec, sources, state_root, training)
    # no node restarts in a benchmark: no checkpoint kept per node
    network = InMemoryNetwork(inline_train=spec.inline_train, keep_checkpoints=False)
    # the ray engine's records are read from its shards while it runs
    records: list[dict[str, Any]] = network.records if spec.engine == "local" else []
    shard_peaks: dict[str, float] = {}  # the ray engine's: each shard actor's peak RSS
    started = time.perf_counter()

    async def follow() -> SimulationResult:
        # fail_fast: one failed node ends the benchmark at once
        ray_run = None
        task: asyncio.Future[SimulationResult] | None = None
        printed = 0
        try:
            if spec.engine == "ray":
                ray_run = RayRun(
                    configs,
                    shards=spec.shards,
                    network=network,
                    cpus_per_shard=spec.shard_cpus,
                    gpus_per_shard=spec.shard_gpus,
                )
                await ray_run.start()  # inside the try: a failed start is stopped too
                task = asyncio.ensure_future(ray_run.wait(simulate, fail_fast=True))
            else:
                task = asyncio.ensure_future(simulate(configs, network=network, fail_fast=True))
            while True:
                await asyncio.wait({task}, timeout=POLL_INTERVAL_S)
                if ray_run is not None:
                    records.extend(await ray_run.records_since())
                printed = _report_complete_rounds(records, spec, printed, started, report)
                if task.done():
                    break
            if ray_run is not None and task.exception() is None:
                for i, (peak, _) in enumerate(await ray_run.peak_rss_mb()):
                    shard_peaks[f"shard_{i}"] = round(peak, 1)
            return task.result()
        finally:
            if task is not None:
                task.cancel()
            if ray_run is not None:
                ray_run.stop()

    timed_out = False
    node_errors: dict[str, str] = {}
    failure: tuple[str, str] | None = None
    stop_ray = connect_ray(spec) if spec.engine == "ray" else None
    try:
        result = asyncio.run(asyncio.wait_for(follow(), spec.timeout_s))
        node_errors, failure = result.errors, result.first_failure()
        if failure is not None:
            report(f"{failure[0]} failed: {failure[1]}")
            report("stopped the simulation: it cannot measure a federation with a failed site")
    except TimeoutError:
        timed_out = True
        report(f"timeout after {spec.timeout_s:.0f} s: the simulation was cancelled")
    except ShardDied as exc:  # one line: which shard (its nodes) and why
        failure = ("ray", str(exc))
        report(str(exc))
        report("stopped the simulation: a shard actor died")
    finally:
        if stop_ray is not None:
            stop_ray()
    wall = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB
    rows = [bench_row(r, spec) for r in records]
    done = {r["node"] for r in rows if r["round"] == spec.rounds}
    errors = {name: "did not finish" for name in site_names(spec.nodes) if name not in done}
    errors.update(node_errors)
    return RunOutcome(
        mode="in_memory" if spec.engine == "local" else f"in_memory_{spec.engine}",
        rows=rows,
        wall_s=wall,
        peak_rss_mb={"process": round(peak_mb, 1), **shard_peaks},
        errors=errors,
        timed_out=timed_out,
        failure=failure,
    )


def connect_ray(spec: RunSpec) -> Callable[[], None] | None:
    """Join the Ray cluster at spec.ray_address, or start a local Ray of
    spec.shards x spec.shard_cpus CPUs; what shuts down a Ray this call
    started (None when this process was already connected: its owner shuts it
    down)."""
    local = spec.ray_address is None
    cpus = math.ceil(spec.shards * spec.shard_cpus)
    if not connect(spec.ray_address, num_cpus=cpus if local else None):
        return None
    return import_ray().shutdown


def _report_complete_rounds(
    records: list[dict[str, Any]], spec: RunSpec, printed: int, started: float, report: Report
) -> int:
    counts: dict[int, list[float]] = {}
    for r in records:
        counts.setdefault(r["round"], []).append(float(r.get("macro_f1", math.nan)))
    while printed + 1 in counts and len(counts[printed + 1]) >= spec.nodes:
        printed += 1
        values = [v for v in counts[printed] if not math.isnan(v)]
        mean = statistics.fmean(values) if values else math.nan
        report(
            f"[{time.perf_counter() - started:7.1f}s] round {printed}/{spec.rounds}: "
            f"{spec.nodes} nodes, macro-F1 mean {mean:.3f}"
            + (f" (min {min(values):.3f}, max {max(values):.3f})" if values else "")
        )
    return printed
