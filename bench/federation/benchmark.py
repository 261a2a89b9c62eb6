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

from bench.federation.baselines import compute_baselines, score_states
from bench.federation.inmemory import run_in_memory
from bench.federation.limit import epoch_seconds, limit_figures
from bench.federation.outcome import Report, RunOutcome, stdout_line
from bench.federation.processes import OnStarted, run_processes
from bench.federation.report import gain_table_lines, write_gain_plot, write_plots
from bench.federation.specs import RunSpec, in_process_configs, partition, site_names
from bench.federation.stats import (
    add_global_test,
    grid_summary,
    last_records,
    site_gain_table,
    summarize_run,
    with_baselines,
)
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
    compute_limit: bool = True,
    threshold: float = 0.9,
    report: Report = stdout_line,
    on_started: OnStarted | None = None,
) -> BenchmarkResult:
    """Partition once, run the federation for every (heuristic, c) in `cells`,
    the baselines once, and write results.json and the plots under `out`.
    `compute_limit=False` skips timing one epoch of every site (the compute
    limit's figures are then absent): a caller that never reads them saves
    two local rounds per site."""
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
    site_epochs: list[float] | None = None  # --no-compute-limit: not measured
    if compute_limit:
        report("compute limit: one epoch over every site's data, one thread (in process)")
        site_epochs = list(epoch_seconds(base, sources, out / "limit_state"))
    reference: dict[str, Any] | None = None
    if baselines:
        report("baselines: standalone and centralized FedAvg (in process, same partition)")
        reference = compute_baselines(base, sources, out / "baseline_state", threshold)
    # the baselines' models on the global test set: results.json's `global_test`
    global_test = (reference or {}).pop("global_test", None)
    summaries = [summarize_run(s, o, threshold) for s, o in zip(specs, outcomes, strict=True)]
    for m in summaries:
        if site_epochs is not None:
            m.update(limit_figures(m, site_epochs))
    plot_paths = write_plots(out, specs, outcomes, summaries, reference, threshold)
    global_nodes = nodes_on_global_test(out, specs, outcomes, sources, global_test)
    gains = site_gains(
        out,
        specs,
        outcomes,
        summaries,
        reference,
        partition_summary,
        global_test,
        global_nodes,
        report,
    )
    plot_paths.update(gains.pop("_plots"))
    if len(specs) == 1:
        summary = with_baselines(summaries[0], reference)
    else:
        summary = grid_summary(base, outcomes, summaries, reference)
        if site_epochs is not None:
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
        "partition_sites_below_test_minimum": partition_summary["sites_below_test_minimum"],
    }
    results = {
        "config": config,
        "rounds": [row for o in outcomes for row in o.rows],
        "baselines": reference or {},
        "site_gains": gains,
        "global_test": {**(global_test or {}), "nodes": global_nodes}
        if base.test_split == "local"
        else {"note": "--test-split global: every site's test split is the global test set"},
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


def site_gains(
    out: Path,
    specs: list[RunSpec],
    outcomes: list[RunOutcome],
    summaries: list[dict[str, Any]],
    reference: dict[str, Any] | None,
    partition_summary: dict[str, Any],
    global_test: dict[str, Any] | None,
    global_nodes: dict[str, Any],
    report: Report,
) -> dict[str, Any]:
    """Each run's per-site gain table (stats.site_gain_table) against the
    standalone baseline, keyed by the run's slug: printed, plotted
    (site_gain[_<slug>].png; paths under "_plots"), and its summary figures
    added to the run's summary as `site_gain`. Only "_plots" without baselines."""
    tables: dict[str, Any] = {"_plots": {}}
    if not reference:
        report("per-site gain: not measured (--no-baselines: no standalone baseline)")
        return tables
    alone = reference["standalone"]["per_site"]
    for spec, outcome, summary in zip(specs, outcomes, summaries, strict=True):
        table = site_gain_table(
            site_names(spec.nodes), last_records(outcome.rows), alone, partition_summary
        )
        if global_test:
            add_global_test(table, global_nodes.get(spec.slug), global_test)
        tables[spec.slug] = table
        summary["site_gain"] = {k: v for k, v in table.items() if k != "sites"}
        for line in gain_table_lines(table, f"{spec.protocol} {spec.label}"):
            report(line)
        name = "site_gain" if len(specs) == 1 else f"site_gain_{spec.slug}"
        title = f"{spec.protocol} {spec.label}, {spec.nodes} sites: gain over the site alone"
        path = write_gain_plot(out, name, table, title)
        if path is not None:
            tables["_plots"][name] = str(path)
    return tables


def nodes_on_global_test(
    out: Path,
    specs: list[RunSpec],
    outcomes: list[RunOutcome],
    sources: list[Path],
    global_test: dict[str, Any] | None,
) -> dict[str, Any]:
    """run slug -> {"models": node -> figures on the global test set, "which"}
    for runs of real node processes: the model each node reports (its personal
    or its best federated model, as the site chose on its validation split),
    read from its last checkpoint as `p2pfl-node evaluate --model best` reads
    it, else its latest model. In-memory nodes keep no checkpoints, so
    their runs get {"missing": why}. Only with local test splits and baselines
    (the standalone figures it is compared with)."""
    from node.evaluate import checkpointed_model
    from p2pfl.config import ConfigError, load_config
    from protocols.site import build_site

    found: dict[str, Any] = {}
    if not global_test:
        return found
    evaluator = None
    for spec, outcome in zip(specs, outcomes, strict=True):
        if outcome.mode != "processes":
            found[spec.slug] = {"missing": "in-memory nodes keep no checkpoints to score"}
            continue
        states: dict[str, Any] = {}
        federated: dict[str, Any] = {}  # each node's best federated model, personal or not
        which: dict[str, str] = {}
        for name in site_names(spec.nodes):
            path = out / "fed" / spec.slug / name / "site.yaml"
            try:
                cfg = load_config(path, check_files=False)
                try:
                    states[name] = checkpointed_model(cfg, path, "best")[0]
                    federated[name] = checkpointed_model(cfg, path, "federated")[0]
                    which[name] = "reported"
                except ConfigError:
                    states[name] = checkpointed_model(cfg, path, "latest")[0]
                    federated[name] = states[name]
                    which[name] = "latest"
            except (ConfigError, OSError) as exc:
                which[name] = f"unreadable: {exc}"
        if evaluator is None:
            evaluator = build_site(in_process_configs(spec, sources, out / "global_state")[0])
        scored = score_states(spec, evaluator, states) or {}
        scored_federated = score_states(spec, evaluator, federated) or {}
        found[spec.slug] = {
            "models": scored.get("models", {}),
            "federated_models": scored_federated.get("models", {}),
            "which": which,
        }
    return found


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
