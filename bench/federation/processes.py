"""Real `p2pfl-node` processes on loopback, one per site: provision them,
follow them through /status (one progress line per node per round, peak RSS
polled with psutil) until they all exit or the run's timeout passes, stop them,
and read every node's state/metrics.jsonl."""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.federation.outcome import POLL_INTERVAL_S, Report, RunOutcome, bench_row, stdout_line
from bench.federation.specs import RunSpec, node_overrides, protocol_section, site_names
from bench.localfed import LocalFederation, NodeProcess
from node.metricslog import read_metrics
from node.provision import SitePlan, provision

log = logging.getLogger(__name__)

HEARTBEAT_KIND = "heartbeat"

OnStarted = Callable[[list[SitePlan]], None]
CFS_STEP = 1.25  # Linux's CFS: each nice level weighs about 1.25 x less than the one below
MAX_NICE = 19


def cpu_niceness(sources: Sequence[Path], names: Sequence[str]) -> dict[str, int]:
    """`cpu_shares: data`: each node's nice value, so that its share of the
    cores follows its share of the training images (its share of a round's
    work). Linux's CFS weighs a process about 1024 / 1.25^nice, so the site
    with the most images gets 0 and one with a quarter of them
    round(log_1.25 4) = 6. With equal shares (nice 0 for all), 5 nodes on 2
    cores each get 0.4 of a core: the small sites finish early and the largest
    ends its epoch alone on one core while the other idles. Measured
    (docs/benchmarks.md, compute limit): rounds 0.94x as long over seeds 0-4,
    one seed slower, and no difference in a whole run's wall time, so that
    idle tail is not where the rounds lose their time, and this is not the
    default. Only a simulation on one machine has cores to share.
    Sources that are not one partitioned .npz per site: equal shares ({})."""
    if len(sources) != len(names):
        return {}
    counts = []
    try:
        for source in sources:
            with np.load(source) as data:
                counts.append(int(data["train_labels"].shape[0]))
    except (OSError, KeyError, ValueError) as exc:
        log.warning("cpu shares: equal (%s)", exc)
        return {}
    top = max([*counts, 1])
    return {
        name: min(MAX_NICE, round(math.log(top / max(1, count)) / math.log(CFS_STEP)))
        for name, count in zip(names, counts, strict=True)
    }


class RoundWatcher:
    """Turns polled /status documents into one progress line per node per round
    and remembers each node's protocol traffic when it reported a round (used
    when metrics.jsonl carries no traffic figures)."""

    def __init__(self, rounds: int, report: Report) -> None:
        self.rounds = rounds
        self.report = report
        self.started = time.perf_counter()
        self.last_round: dict[str, int] = {}
        self.traffic: dict[str, dict[int, tuple[int, int]]] = {}
        self.phase: dict[str, str] = {}

    def observe(self, name: str, status: dict[str, Any]) -> None:
        self._observe_round(name, status)
        phase = str(status.get("phase", ""))
        if phase in ("failed", "done") and self.phase.get(name) != phase:
            self.report(f"[{self.elapsed():7.1f}s] {name} {phase}")
        self.phase[name] = phase

    def _observe_round(self, name: str, status: dict[str, Any]) -> None:
        metrics_round = status.get("metrics_round")
        if not isinstance(metrics_round, int) or metrics_round <= self.last_round.get(name, 0):
            return
        self.last_round[name] = metrics_round
        self.traffic.setdefault(name, {})[metrics_round] = protocol_traffic(status)
        self._report_round(name, metrics_round, status.get("metrics") or {})

    def report_row(self, row: dict[str, Any]) -> None:
        """A round read from metrics.jsonl after the node exited."""
        self._report_round(row["node"], row["round"], row, " (from metrics.jsonl)")

    def _report_round(self, name: str, round_: int, m: dict[str, Any], source: str = "") -> None:
        self.report(
            f"[{self.elapsed():7.1f}s] {name} round {round_}/{self.rounds}"
            f"  macro-F1 {_fmt(m.get('macro_f1'))}  acc {_fmt(m.get('accuracy'))}"
            f"  best {_fmt(m.get('best_macro_f1'))} (round {_fmt(m.get('best_round'), 0)})"
            f"  train {_fmt(m.get('train_s'), 1)}s  exchange {_fmt(m.get('exchange_s'), 1)}s"
            f"  round {_fmt(m.get('round_s'), 1)}s{source}"
        )

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def _fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


def poll_node(
    node: NodeProcess,
    handle: psutil.Process | None,
    peak_rss: dict[str, float],
    watcher: RoundWatcher,
) -> str | None:
    """Follow one node once (peak RSS, /status); why it failed, or None while it has not."""
    if not node.running:
        code = node.proc.returncode if node.proc is not None else None
        if code in (0, None):
            return None
        line = error_line(node.log_tail(40))
        reason = line.removeprefix("error: ")
        return f"{reason} (exit code {code})"
    try:
        if handle is not None:
            rss = handle.memory_info().rss / 2**20
            peak_rss[node.name] = max(peak_rss[node.name], rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    status = node.status()
    if status is None:
        return None
    watcher.observe(node.name, status)
    if status.get("phase") == "failed":
        return str(status.get("error") or error_line(node.log_tail(40)))
    return None


def error_line(log_tail: str) -> str:
    """The line of a node's log that says why it stopped: its `error: ...` line
    (a start-up error), else the last ERROR record, else the last line."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error:"):
            return line
    for line in reversed(lines):
        if " ERROR " in line:
            return line.split(" ERROR ", 1)[1]
    return lines[-1] if lines else "(no log output)"


def protocol_traffic(status: dict[str, Any]) -> tuple[int, int]:
    """(messages, bytes) this node sent, heartbeats left out, from its /status."""
    out = []
    for field_name in ("messages", "bytes"):
        by_kind = ((status.get(field_name) or {}).get("sent") or {}).get("by_kind") or {}
        out.append(sum(int(v) for k, v in by_kind.items() if k != HEARTBEAT_KIND))
    return out[0], out[1]


def run_processes(
    spec: RunSpec,
    run_dir: Path,
    sources: Sequence[Path],
    *,
    report: Report = stdout_line,
    on_started: OnStarted | None = None,
    node_env: dict[str, dict[str, str]] | None = None,
    expendable: frozenset[str] = frozenset(),
) -> RunOutcome:
    """Provision and start one `p2pfl-node` process per site, follow them until
    they all exit (or spec.timeout_s passes), stop them, collect metrics.jsonl.
    `node_env`: extra environment per node name (a drill's fault plan).
    `expendable`: nodes a drill kills on purpose; their failure is reported
    but does not end the benchmark (every other node's failure does)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    names = site_names(spec.nodes)
    plans = provision(
        run_dir,
        names,
        protocol=protocol_section(spec),
        data_sources=[str(s.resolve()) for s in sources],
        federation=f"bench-{spec.slug}",
        seed=spec.seed,
        overrides=node_overrides(spec),
    )
    dashboards = {p.name: f"http://127.0.0.1:{p.status_port}/" for p in plans}
    watcher = RoundWatcher(spec.rounds, report)
    peak_rss: dict[str, float] = dict.fromkeys(names, 0.0)
    started = time.perf_counter()
    deadline = started + spec.timeout_s
    niceness = cpu_niceness(sources, names) if spec.cpu_shares == "data" else None
    if niceness and any(niceness.values()):
        report("cpu shares by training images: nice " + ", ".join(f"{k} {v}" for k, v in niceness.items()))  # fmt: skip
    with LocalFederation(plans, run_dir / "logs", node_env=node_env, niceness=niceness) as fed:
        if on_started is not None:
            on_started(plans)
        handles: dict[str, psutil.Process] = {}
        for name, node in fed.nodes.items():
            if node.proc is not None:
                handles[name] = psutil.Process(node.proc.pid)
        failure: tuple[str, str] | None = None
        drilled: set[str] = set()
        while (
            failure is None
            and time.perf_counter() < deadline
            and any(n.running for n in fed.nodes.values())
        ):
            for name, node in fed.nodes.items():
                if name in drilled:
                    continue
                reason = poll_node(node, handles.get(name), peak_rss, watcher)
                if reason is None:
                    continue
                if name in expendable:
                    drilled.add(name)
                    report(f"{name} stopped as the drill planned: {reason}")
                    continue
                failure = (name, reason)
                break
            else:
                time.sleep(POLL_INTERVAL_S)
        if failure is None:  # nodes that failed and exited between two polls
            for name, node in fed.nodes.items():
                if name in drilled or name in expendable or node.running:
                    continue
                reason = poll_node(node, None, peak_rss, watcher)
                if reason is not None:
                    failure = (name, reason)
                    break
        if failure is not None:  # one failed node ends the benchmark at once
            report(f"{failure[0]} failed: {failure[1]}")
            report(
                "stopping every node: the benchmark cannot measure a federation with a failed site"
            )
        timed_out = failure is None and any(n.running for n in fed.nodes.values())
        if timed_out:
            report(f"timeout after {spec.timeout_s:.0f} s: stopping the nodes still running")
        exit_codes = fed.stop_all()
        errors = {
            name: f"exit code {code}: {error_line(fed[name].log_tail(40))}"
            for name, code in exit_codes.items()
            if code != 0
        }
        if failure is not None:  # the others were stopped by the benchmark, not failed
            errors = {failure[0]: failure[1]}
    wall = time.perf_counter() - started
    rows: list[dict[str, Any]] = []
    traffic_source = "metrics"
    for plan in plans:
        for record in read_metrics(plan.config_path.parent / "state" / "metrics.jsonl"):
            row = bench_row(record, spec)
            if row["messages_sent"] is None:
                # metrics.jsonl has no traffic figures: use the /status counters
                # read when the node reported that round (polled, so approximate).
                snapshot = watcher.traffic.get(row["node"], {}).get(row["round"])
                if snapshot is not None:
                    row["messages_sent"], row["bytes_sent"] = snapshot
                    traffic_source = "status_poll"
            rows.append(row)
            if row["round"] > watcher.last_round.get(row["node"], 0):
                watcher.report_row(row)  # exited before its last round was polled
    return RunOutcome(
        mode="processes",
        rows=rows,
        wall_s=wall,
        peak_rss_mb={k: round(v, 1) for k, v in peak_rss.items()},
        exit_codes=exit_codes,
        errors=errors,
        timed_out=timed_out,
        traffic_source=traffic_source,
        dashboards=dashboards,
        failure=failure,
    )
