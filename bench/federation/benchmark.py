"""One benchmark: partition the data once, run the federation for every
(heuristic, c) asked for (node processes or in memory), the baselines once, and
write results.json and the plots."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.federation.baselines import compute_baselines
from bench.federation.inmemory import run_in_memory
from bench.federation.limit import epoch_seconds, limit_figures
from bench.federation.outcome import Report, RunOutcome, stdout_line
from bench.federation.processes import OnStarted, run_processes
from bench.federation.report import write_plots
from bench.federation.specs import RunSpec, partition
from bench.federation.stats import grid_summary, summarize_run, with_baselines
from p2pfl.files import atomic_write_text


@dataclass
class BenchmarkResult:
    """results.json's content, its path, and whether every run ended cleanly."""

    results: dict[str, Any]
    path: Path
    ok: bool


def run_benchmark(
    base: RunSpec,
    cells: Sequence[tuple[str, float]],
    out: Path,
    *,
    baselines: bool = True,
    threshold: float = 0.9,
    report: Report = stdout_line,
    on_started: OnStarted | None = None,
) -> BenchmarkResult:
    """Partition once, run the federation for every (heuristic, c) in `cells`,
    the baselines once, and write results.json and the plots under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sources, partition_summary = partition(base, out / "data")
    report(
        f"partitioned {base.data} ({partition_summary['scheme']}, label skew "
        f"{partition_summary['label_skew']:.3f}) into {base.nodes} sites under {out / 'data'}"
    )
    specs = [replace(base, heuristic=h, fraction=c) for h, c in cells]
    outcomes: list[RunOutcome] = []
    for spec in specs:
        report(
            f"--- {spec.protocol} {spec.label}: {spec.nodes} nodes, {spec.rounds} rounds"
            + (" (in memory)" if spec.in_memory else "")
        )
        run_dir = out / "fed" / spec.slug
        if spec.in_memory:
            outcome = run_in_memory(spec, sources, run_dir / "state", report=report)
        else:
            outcome = run_processes(spec, run_dir, sources, report=report, on_started=on_started)
        outcomes.append(outcome)
        if outcome.failure is not None:
            return failed_benchmark(out, spec, outcome, time.perf_counter() - started)
        report(f"--- {spec.label}: done in {outcomes[-1].wall_s:.1f} s")
    report("compute limit: one epoch over every site's data, one thread (in process)")
    site_epochs = epoch_seconds(base, sources, out / "limit_state")
    reference: dict[str, Any] | None = None
    if baselines:
        report("baselines: standalone and centralized FedAvg (in process, same partition)")
        reference = compute_baselines(base, sources, out / "baseline_state", threshold)
    summaries = [summarize_run(s, o, threshold) for s, o in zip(specs, outcomes, strict=True)]
    for m in summaries:
        m.update(limit_figures(m, site_epochs))
    plot_paths = write_plots(out, specs, outcomes, summaries, reference, threshold)
    if len(specs) == 1:
        summary = with_baselines(summaries[0], reference)
    else:
        summary = grid_summary(base, outcomes, summaries, reference)
        summary.update(limit_figures({}, site_epochs))
    summary["benchmark_wall_s"] = round(time.perf_counter() - started, 1)
    summary["results"] = str(out / "results.json")
    config = {
        **{k: v for k, v in asdict(base).items() if k not in ("heuristic", "fraction")},
        "heuristics": sorted({s.heuristic for s in specs}, key=[s.heuristic for s in specs].index),
        "fractions": sorted({s.fraction for s in specs}),
        "threshold": threshold,
        "baselines": baselines,
        "partition_label_skew": partition_summary["label_skew"],
        "partition_train_sizes": [row["labelled"] for row in partition_summary["per_site"]],
    }
    results = {
        "config": config,
        "rounds": [row for o in outcomes for row in o.rows],
        "baselines": reference or {},
        "summary": summary,
        "runs": [
            {
                "heuristic": s.heuristic,
                "fraction": s.fraction,
                "run_dir": str(out / "fed" / s.slug),
                "summary": m,
                "exit_codes": o.exit_codes,
                "dashboards": o.dashboards,
            }
            for s, o, m in zip(specs, outcomes, summaries, strict=True)
        ],
        "plots": plot_paths,
    }
    path = out / "results.json"
    atomic_write_text(
        path, json.dumps(results, indent=2, allow_nan=False, default=json_default) + "\n"
    )
    ok = all(not o.errors and not o.timed_out for o in outcomes)
    return BenchmarkResult(results, path, ok)


def failed_benchmark(
    out: Path, spec: RunSpec, outcome: RunOutcome, wall_s: float
) -> BenchmarkResult:
    """A node failed: no baselines, no plots; results.json and the summary say which and why."""
    assert outcome.failure is not None
    node, error = outcome.failure
    summary = {
        "failed": True,
        "failed_node": node,
        "error": error,
        "protocol": spec.protocol,
        "errors": outcome.errors,
        "benchmark_wall_s": round(wall_s, 1),
        "results": str(out / "results.json"),
    }
    results = {
        "config": asdict(spec),
        "rounds": outcome.rows,
        "summary": summary,
        "plots": {},
    }
    path = out / "results.json"
    atomic_write_text(
        path, json.dumps(results, indent=2, allow_nan=False, default=json_default) + "\n"
    )
    return BenchmarkResult(results, path, False)


def json_default(value: Any) -> Any:
    """json.dumps' `default`: paths as strings, anything else refused."""
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
