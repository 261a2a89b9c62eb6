"""All nodes of a run in this process over the in-memory network
(protocols/memory/): the same protocol code as the daemon, one progress line
per round once every node has reported it."""

from __future__ import annotations

import asyncio
import math
import resource
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.federation.outcome import POLL_INTERVAL_S, Report, RunOutcome, bench_row, stdout_line
from bench.federation.specs import RunSpec, in_process_configs, one_torch_thread, site_names
from protocols.memory import InMemoryNetwork, SimulationResult, simulate


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
    network = InMemoryNetwork(keep_checkpoints=False)  # no node restarts in a benchmark
    started = time.perf_counter()

    async def follow() -> SimulationResult:
        # fail_fast: one failed node ends the benchmark at once
        task = asyncio.create_task(simulate(configs, network=network, fail_fast=True))
        printed = 0
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=POLL_INTERVAL_S)
                printed = _report_complete_rounds(network.records, spec, printed, started, report)
            return task.result()
        finally:
            task.cancel()

    timed_out = False
    node_errors: dict[str, str] = {}
    failure: tuple[str, str] | None = None
    try:
        result = asyncio.run(asyncio.wait_for(follow(), spec.timeout_s))
        node_errors, failure = result.errors, result.first_failure()
        if failure is not None:
            report(f"{failure[0]} failed: {failure[1]}")
            report("stopped the simulation: it cannot measure a federation with a failed site")
    except TimeoutError:
        timed_out = True
        report(f"timeout after {spec.timeout_s:.0f} s: the simulation was cancelled")
    wall = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB
    rows = [bench_row(r, spec) for r in network.records]
    done = {r["node"] for r in rows if r["round"] == spec.rounds}
    errors = {name: "did not finish" for name in site_names(spec.nodes) if name not in done}
    errors.update(node_errors)
    return RunOutcome(
        mode="in_memory",
        rows=rows,
        wall_s=wall,
        peak_rss_mb={"process": round(peak_mb, 1)},
        errors=errors,
        timed_out=timed_out,
        failure=failure,
    )


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
