"""N-node federation benchmark: real `p2pfl-node` processes on loopback (or, with
`--in-memory`, N nodes in this process over the in-memory network; the same
protocol code either way), compared with baselines measured in the same run.

    python -m bench.federation --nodes 5 --protocol fedavgp2p --heuristic random \\
        --fraction 0.5 --rounds 10 --data PATH.npz|digits --partition dirichlet:0.5 \\
        [--test-split local|global] --out DIR
    python -m bench.federation ... --grid [--heuristics random,f1] [--fractions 0.25,1.0]

What it does:
1. splits the data set's train split among the N sites (`partition_dataset`,
   files under DIR/data; val follows each site's class shares; test does too
   with `--test-split local` (the default), while with `--test-split global`
   every site's test split is the whole source test split, as in the DFU
   paper, which scores every client on the common test data);
2. for each (heuristic, c) asked for: provisions keys, roster and site.yaml
   under DIR/fed/<heuristic>_c<c>/ (a previous run's node state there is
   removed), starts one process per site with `node.exit_when_done: true`,
   prints one line per node per round as the nodes report on /status, waits
   for every process to exit (bounded by --timeout; the processes are always
   stopped), then reads every node's state/metrics.jsonl;
3. runs the baselines in this process (protocols/baselines.py) on the SAME
   partition files with the same model, epochs, batch size, lr, seed and
   number of rounds: standalone (every site alone) and centralized FedAvg,
   plus centralized FedSGD (every site's gradient every step) for fedsgdp2p;
4. writes DIR/results.json and the plots, and prints the `summary` object of
   results.json as the last stdout line (one JSON object).

Figures (keys of `summary`):
- macro_f1_mean_first / _final: test macro-F1 (each node on its own test
  split: its share with `--test-split local`, the common test set with
  `global`), mean over the nodes, at the first round and at each node's last
  logged round; macro_f1_mean_last3: the mean of the last three rounds' means
  (one round can swing by several points);
- standalone_macro_f1_mean, centralized_macro_f1: the same figure for the two
  baselines at their last round (centralized: the global model evaluated on
  each site's test split, mean over sites; with `--test-split global` that is
  one figure, the common test set); gain_over_standalone = final -
  standalone, gap_to_centralized = centralized - final (positive: below it);
  for fedsgdp2p also centralized_fedsgd_macro_f1 (_last3) and
  gap_to_centralized_fedsgd, its own centralized counterpart;
- non_training_share = 1 - sum(train_s) / sum(round_s) over every logged
  round of every node: the share of a round's wall time a node spends outside
  local training (waiting for and pulling neighbours' models, aggregation,
  evaluation, gossip). round_s runs from the start of the round's training to
  the metrics line (the checkpoint written after it is not in it;
  non_training_share_wall, from the wall-clock gaps between a node's metrics
  lines, counts it). exchange_share and aggregate_share split out the first
  two parts;
- messages_sent_total / bytes_sent_total: protocol traffic (requests,
  responses and pushes; heartbeats are not counted) of all nodes over the run;
- rounds_to_threshold: first round whose mean macro-F1 over the nodes reaches
  --threshold (DFU Table 2), messages_to_threshold: messages all nodes had sent
  by then (DFU Fig. 7);
- wall_s, peak_rss_mb (per node for processes, polled with psutil; with
  --in-memory, the peak of this whole process so far (getrusage), read before
  the baselines run).
With several (heuristic, c) runs, `summary.grid` holds each run's figures;
macro_f1_mean_first/_final are then the lowest over the runs, and
non_training_share and the traffic totals pool every run.

Plots: f1_per_round[_c<c>].png (macro-F1 per round per heuristic, with the
baselines), messages_vs_fraction.png (DFU Fig. 7) and rounds_to_threshold.png
(DFU Table 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench import plots
from bench.localfed import LocalFederation
from node.provision import SitePlan, provision
from p2pfl.config import SiteConfig
from p2pfl.learning.data.partition import partition_dataset
from p2pfl.protocol_params import ProtocolParams, protocol_names
from protocols.baselines import BaselineResult, centralized_fedavg, centralized_fedsgd, standalone
from protocols.memory import InMemoryNetwork, simulate, simulation_configs

log = logging.getLogger(__name__)

HEURISTICS = ("random", "n_latest", "f1", "cosine")
GRID_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
ROW_KEYS = (
    "node",
    "round",
    "macro_f1",
    "accuracy",
    "messages_sent",
    "bytes_sent",
    "train_s",
    "round_s",
)
EXTRA_ROW_KEYS = (
    "exchange_s",
    "aggregate_s",
    "train_loss",
    "val_macro_f1",
    "neighbours",
    "neighbours_wanted",
    "stale_models",
    "steps",
    "timeouts",
    "t",
)
HEARTBEAT_KIND = "heartbeat"
POLL_INTERVAL_S = 0.5

Report = Callable[[str], None]


def _stdout(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------- what to run


@dataclass(frozen=True)
class RunSpec:
    """One federation run: everything the nodes and the baselines share."""

    nodes: int
    protocol: str = "fedavgp2p"
    heuristic: str = "random"
    fraction: float = 0.5
    rounds: int = 10
    data: str = "digits"
    partition: str = "dirichlet:0.5"
    test_split: str = "local"  # local | global (partition_dataset's `test`)
    epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-3
    model: str = "small_cnn"
    image_size: int = 28
    augment: str = "weak"
    seed: int = 0
    max_steps_per_epoch: int | None = None
    steps_per_round: int | None = None
    class_weighted: bool = False
    label_fraction: float | None = None
    round_timeout_s: float | None = None
    startup_wait_s: float = 60.0
    timeout_s: float = 1800.0
    in_memory: bool = False
    protocol_options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.heuristic} c={self.fraction:g}"

    @property
    def slug(self) -> str:
        return f"{self.heuristic}_c{self.fraction:g}"


def site_names(nodes: int) -> list[str]:
    return [f"site_{i}" for i in range(nodes)]


def _params_class(protocol: str) -> type[Any]:
    for cls in ProtocolParams.__args__:  # type: ignore[attr-defined]
        if protocol in cls.model_fields["name"].annotation.__args__:
            return cls
    raise ValueError(f"unknown protocol {protocol!r}: use one of {', '.join(protocol_names())}")


def protocol_section(spec: RunSpec) -> dict[str, Any]:
    """The `protocol:` section every node gets."""
    fields = _params_class(spec.protocol).model_fields
    section: dict[str, Any] = {"name": spec.protocol, "rounds": spec.rounds}
    if "fraction" in fields:
        section["fraction"] = spec.fraction
    if spec.round_timeout_s is not None:
        section["round_timeout_s"] = spec.round_timeout_s
    section.update(dict(spec.protocol_options))
    return section


def shared_sections(spec: RunSpec) -> dict[str, dict[str, Any]]:
    """site.yaml sections the nodes and the baselines share (data.source is per site)."""
    training: dict[str, Any] = {
        "epochs": spec.epochs,
        "batch_size": spec.batch_size,
        "lr": spec.lr,
        "seed": spec.seed,
    }
    if spec.max_steps_per_epoch is not None:
        training["max_steps_per_epoch"] = spec.max_steps_per_epoch
    if spec.steps_per_round is not None:
        training["steps_per_round"] = spec.steps_per_round
    if spec.class_weighted:
        training["class_weighted"] = True
    return {
        "model": {"name": spec.model},
        "training": training,
        "selection": {"name": spec.heuristic},
        "data": {"image_size": spec.image_size, "augment": spec.augment},
    }


def node_overrides(spec: RunSpec) -> dict[str, Any]:
    """Everything a benchmark node's site.yaml sets beyond `provision`'s defaults."""
    sections = shared_sections(spec)
    sections["training"] = {**sections["training"], "threads": 1}
    return {
        **sections,
        "node": {"exit_when_done": True, "startup_wait_s": spec.startup_wait_s},
        "transport": {"heartbeat_s": 1.0, "suspect_after_s": 5.0, "dead_after_s": 15.0},
    }


def partition(spec: RunSpec, data_dir: Path) -> tuple[list[Path], dict[str, Any]]:
    """site_<i>.npz for every node under data_dir, and the partition summary."""
    summary = partition_dataset(
        spec.data,
        spec.nodes,
        spec.partition,
        data_dir,
        label_fraction=spec.label_fraction,
        seed=spec.seed,
        test=spec.test_split,
    )
    return [data_dir / row["file"] for row in summary["per_site"]], summary


def one_torch_thread() -> None:
    """Work done in this process (baselines, in-memory nodes) uses one torch
    thread: several threads contend on a shared machine and beside the nodes."""
    import torch

    torch.set_num_threads(1)


def in_process_configs(
    spec: RunSpec, sources: Sequence[Path], state_root: Path
) -> list[SiteConfig]:
    return simulation_configs(
        [str(s) for s in sources],
        protocol=protocol_section(spec),
        names=site_names(spec.nodes),
        federation_id="bench",
        seed=spec.seed,
        state_root=state_root,
        **shared_sections(spec),
    )


# ---------------------------------------------------------------------- running the nodes


@dataclass
class RunOutcome:
    """What one federation run produced (rows: one per node per round)."""

    mode: str
    rows: list[dict[str, Any]]
    wall_s: float
    peak_rss_mb: dict[str, float]
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False
    traffic_source: str = "metrics"
    dashboards: dict[str, str] = field(default_factory=dict)


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
        m = status.get("metrics") or {}
        self.report(
            f"[{self.elapsed():7.1f}s] {name} round {metrics_round}/{self.rounds}"
            f"  macro-F1 {_fmt(m.get('macro_f1'))}  acc {_fmt(m.get('accuracy'))}"
            f"  train {_fmt(m.get('train_s'), 1)}s  exchange {_fmt(m.get('exchange_s'), 1)}s"
            f"  round {_fmt(m.get('round_s'), 1)}s"
        )

    def report_row(self, row: dict[str, Any]) -> None:
        """A round read from metrics.jsonl after the node exited."""
        self.report(
            f"[{self.elapsed():7.1f}s] {row['node']} round {row['round']}/{self.rounds}"
            f"  macro-F1 {_fmt(row.get('macro_f1'))}  acc {_fmt(row.get('accuracy'))}"
            f"  train {_fmt(row.get('train_s'), 1)}s  exchange {_fmt(row.get('exchange_s'), 1)}s"
            f"  round {_fmt(row.get('round_s'), 1)}s (from metrics.jsonl)"
        )

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def _fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


def protocol_traffic(status: dict[str, Any]) -> tuple[int, int]:
    """(messages, bytes) this node sent, heartbeats left out, from its /status."""
    out = []
    for field_name in ("messages", "bytes"):
        by_kind = ((status.get(field_name) or {}).get("sent") or {}).get("by_kind") or {}
        out.append(sum(int(v) for k, v in by_kind.items() if k != HEARTBEAT_KIND))
    return out[0], out[1]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s: unreadable metrics line skipped", path)
            continue
        if isinstance(record, dict) and isinstance(record.get("round"), int):
            rows.append(record)
    return rows


def _finite(value: Any) -> Any:
    """NaN/inf (a loss with no step) become None so results.json stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def bench_row(record: dict[str, Any], spec: RunSpec) -> dict[str, Any]:
    row = {key: _finite(record.get(key)) for key in ROW_KEYS}
    row.update({key: _finite(record[key]) for key in EXTRA_ROW_KEYS if key in record})
    row["heuristic"] = spec.heuristic
    row["fraction"] = spec.fraction
    return row


def run_processes(
    spec: RunSpec,
    run_dir: Path,
    sources: Sequence[Path],
    *,
    report: Report = _stdout,
    on_started: Callable[[list[SitePlan]], None] | None = None,
) -> RunOutcome:
    """Provision and start one `p2pfl-node` process per site, follow them until
    they all exit (or spec.timeout_s passes), stop them, collect metrics.jsonl."""
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
    with LocalFederation(plans, run_dir / "logs") as fed:
        if on_started is not None:
            on_started(plans)
        handles: dict[str, psutil.Process] = {}
        for name, node in fed.nodes.items():
            if node.proc is not None:
                handles[name] = psutil.Process(node.proc.pid)
        while time.perf_counter() < deadline and any(n.running for n in fed.nodes.values()):
            for name, node in fed.nodes.items():
                if not node.running:
                    continue
                try:
                    rss = handles[name].memory_info().rss / 2**20
                    peak_rss[name] = max(peak_rss[name], rss)
                except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
                    pass
                status = node.status()
                if status is not None:
                    watcher.observe(name, status)
            time.sleep(POLL_INTERVAL_S)
        timed_out = any(n.running for n in fed.nodes.values())
        if timed_out:
            report(f"timeout after {spec.timeout_s:.0f} s: stopping the nodes still running")
        exit_codes = fed.stop_all()
        errors = {
            name: f"exit code {code}; log tail: {fed[name].log_tail(5)}"
            for name, code in exit_codes.items()
            if code != 0
        }
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
    )


def run_in_memory(
    spec: RunSpec, sources: Sequence[Path], state_root: Path, *, report: Report = _stdout
) -> RunOutcome:
    """All nodes in this process over InMemoryNetwork; one progress line per
    round once every node has reported it."""
    one_torch_thread()  # the nodes' training threads share the cores
    configs = in_process_configs(spec, sources, state_root)
    network = InMemoryNetwork()
    started = time.perf_counter()

    async def follow() -> dict[str, str]:
        task = asyncio.create_task(simulate(configs, network=network))
        printed = 0
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=POLL_INTERVAL_S)
                printed = _report_complete_rounds(network.records, spec, printed, started, report)
            return task.result().errors
        finally:
            task.cancel()

    timed_out = False
    node_errors: dict[str, str] = {}
    try:
        node_errors = asyncio.run(asyncio.wait_for(follow(), spec.timeout_s))
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


def run_federation(
    spec: RunSpec,
    run_dir: Path,
    sources: Sequence[Path],
    *,
    report: Report = _stdout,
    on_started: Callable[[list[SitePlan]], None] | None = None,
) -> RunOutcome:
    if spec.in_memory:
        return run_in_memory(spec, sources, run_dir / "state", report=report)
    return run_processes(spec, run_dir, sources, report=report, on_started=on_started)


# ---------------------------------------------------------------------- baselines and figures


def _baseline_figures(result: BaselineResult, threshold: float) -> dict[str, Any]:
    final = result.final()
    return {
        "macro_f1_by_node": final,
        "macro_f1_mean_by_round": result.mean_by_round(),
        "rounds_to_threshold": result.rounds_to_threshold(threshold),
        "wall_s": round(result.wall_s, 2),
        "_mean": statistics.fmean(final.values()) if final else None,
    }


def compute_baselines(
    spec: RunSpec, sources: Sequence[Path], state_root: Path, threshold: float
) -> dict[str, Any]:
    """Standalone and centralized FedAvg in this process, on the same partition
    files, model, epochs and rounds as the federation."""
    one_torch_thread()
    configs = in_process_configs(spec, sources, state_root)
    alone = _baseline_figures(standalone(configs, rounds=spec.rounds), threshold)
    central = _baseline_figures(centralized_fedavg(configs, rounds=spec.rounds), threshold)
    out = {
        "standalone": {"macro_f1_mean": alone.pop("_mean"), **alone},
        "centralized": {"macro_f1": central.pop("_mean"), **central},
    }
    if spec.protocol == "fedsgdp2p":
        sgd = _baseline_figures(centralized_fedsgd(configs, rounds=spec.rounds), threshold)
        out["centralized_fedsgd"] = {"macro_f1": sgd.pop("_mean"), **sgd}
    return out


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def mean_by_round(rows: Sequence[dict[str, Any]]) -> dict[int, float]:
    by_round: dict[int, list[float]] = {}
    for r in rows:
        if r.get("macro_f1") is not None:
            by_round.setdefault(r["round"], []).append(float(r["macro_f1"]))
    return {k: statistics.fmean(v) for k, v in sorted(by_round.items())}


def per_node_final(rows: Sequence[dict[str, Any]], key: str = "macro_f1") -> dict[str, float]:
    last: dict[str, tuple[int, float]] = {}
    for r in rows:
        if r.get(key) is not None and r["round"] >= last.get(r["node"], (-1, 0.0))[0]:
            last[r["node"]] = (r["round"], float(r[key]))
    return {node: value for node, (_, value) in sorted(last.items())}


def traffic_totals(rows: Sequence[dict[str, Any]]) -> tuple[int | None, int | None]:
    """Sum over nodes of each node's last cumulative (messages, bytes)."""
    messages, nbytes = per_node_final(rows, "messages_sent"), per_node_final(rows, "bytes_sent")
    if not messages:
        return None, None
    return int(sum(messages.values())), int(sum(nbytes.values()))


def time_shares(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Where a round's time goes, pooled over every row (see the module doc)."""
    total = sum(float(r.get("round_s") or 0.0) for r in rows)
    train = sum(float(r.get("train_s") or 0.0) for r in rows)
    shares = {
        "non_training_share": None if total <= 0 else 1.0 - train / total,
        "exchange_share": _share(sum(float(r.get("exchange_s") or 0.0) for r in rows), total),
        "aggregate_share": _share(sum(float(r.get("aggregate_s") or 0.0) for r in rows), total),
        "non_training_share_wall": wall_non_training_share(rows),
    }
    return {k: None if v is None else round(v, 4) for k, v in shares.items()}


def wall_non_training_share(rows: Sequence[dict[str, Any]]) -> float | None:
    """1 - train_s / (time between a node's consecutive metrics lines), rounds
    2.. only: unlike round_s this also counts what happens after the metrics
    line (the checkpoint). Needs the lines' wall-clock `t` (real processes)."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("t") is not None:
            by_node.setdefault(r["node"], []).append(r)
    train = wall = 0.0
    for node_rows in by_node.values():
        node_rows.sort(key=lambda r: r["round"])
        for before, after in zip(node_rows, node_rows[1:], strict=False):
            if after["round"] == before["round"] + 1 and after.get("train_s") is not None:
                train += float(after["train_s"])
                wall += float(after["t"]) - float(before["t"])
    return None if wall <= 0 else 1.0 - train / wall


def summarize_run(spec: RunSpec, outcome: RunOutcome, threshold: float) -> dict[str, Any]:
    rows = outcome.rows
    by_round = mean_by_round(rows)
    final = per_node_final(rows)
    first_round = min(by_round, default=None)
    first = [
        float(r["macro_f1"])
        for r in rows
        if r["round"] == first_round and r.get("macro_f1") is not None
    ]
    messages, nbytes = traffic_totals(rows)
    reached = next((r for r, v in by_round.items() if v >= threshold), None)
    messages_to_threshold = None
    if reached is not None and messages is not None:
        messages_to_threshold = sum(
            int(r["messages_sent"])
            for r in rows
            if r["round"] == reached and r.get("messages_sent") is not None
        )
    completed = {name: 0 for name in site_names(spec.nodes)}
    for r in rows:
        completed[r["node"]] = max(completed.get(r["node"], 0), r["round"])
    round_s = [float(r["round_s"]) for r in rows if r.get("round_s") is not None]
    train_s = [float(r["train_s"]) for r in rows if r.get("train_s") is not None]
    rounds_done = min(completed.values(), default=0)
    return {
        "protocol": spec.protocol,
        "heuristic": spec.heuristic,
        "fraction": spec.fraction,
        "nodes": spec.nodes,
        "rounds": spec.rounds,
        "rounds_completed_min": rounds_done,
        "mode": outcome.mode,
        "macro_f1_mean_first": _round(_mean(first)),
        "macro_f1_mean_final": _round(_mean(list(final.values()))),
        "macro_f1_mean_last3": _round(mean_of_last(by_round)),
        "macro_f1_min_final": _round(min(final.values(), default=None)),
        "macro_f1_max_final": _round(max(final.values(), default=None)),
        **time_shares(rows),
        "train_s_mean": _round(_mean(train_s), 3),
        "round_s_mean": _round(_mean(round_s), 3),
        "messages_sent_total": messages,
        "bytes_sent_total": nbytes,
        "messages_per_round": None
        if messages is None or not rounds_done
        else round(messages / rounds_done, 1),
        "traffic_source": outcome.traffic_source,
        "threshold": threshold,
        "rounds_to_threshold": reached,
        "messages_to_threshold": messages_to_threshold,
        "wall_s": round(outcome.wall_s, 2),
        "peak_rss_mb": outcome.peak_rss_mb,
        "peak_rss_mb_max": max(outcome.peak_rss_mb.values(), default=None),
        "timed_out": outcome.timed_out,
        "errors": outcome.errors,
    }


def mean_of_last(by_round: dict[int, float], k: int = 3) -> float | None:
    """Mean of the last k rounds' means: less at the mercy of one noisy round
    than the final value alone."""
    rounds = sorted(by_round)[-k:]
    return statistics.fmean(by_round[r] for r in rounds) if rounds else None


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def with_baselines(summary: dict[str, Any], baselines: dict[str, Any] | None) -> dict[str, Any]:
    alone = baselines["standalone"]["macro_f1_mean"] if baselines else None
    central = baselines["centralized"]["macro_f1"] if baselines else None
    final = summary.get("macro_f1_mean_final")
    last3: dict[str, float | None] = {"standalone": None, "centralized": None}
    for name in last3:
        if baselines:
            last3[name] = mean_of_last(baseline_by_round(baselines[name]))
    return {
        **summary,
        "standalone_macro_f1_mean": _round(alone),
        "centralized_macro_f1": _round(central),
        "standalone_macro_f1_mean_last3": _round(last3["standalone"]),
        "centralized_macro_f1_last3": _round(last3["centralized"]),
        "gain_over_standalone": None if alone is None or final is None else round(final - alone, 4),
        "gap_to_centralized": None
        if central is None or final is None
        else round(central - final, 4),
        **fedsgd_figures(baselines, final),
    }


def fedsgd_figures(baselines: dict[str, Any] | None, final: float | None) -> dict[str, Any]:
    """The centralized FedSGD keys of the summary, when that baseline ran."""
    if not baselines or "centralized_fedsgd" not in baselines:
        return {}
    sgd = baselines["centralized_fedsgd"]
    return {
        "centralized_fedsgd_macro_f1": _round(sgd["macro_f1"]),
        "centralized_fedsgd_macro_f1_last3": _round(mean_of_last(baseline_by_round(sgd))),
        "gap_to_centralized_fedsgd": None
        if final is None or sgd["macro_f1"] is None
        else round(sgd["macro_f1"] - final, 4),
    }


def baseline_by_round(baseline: dict[str, Any]) -> dict[int, float]:
    """A baseline's mean macro-F1 per round (results.json keys are strings)."""
    return {int(k): v for k, v in baseline["macro_f1_mean_by_round"].items()}


# ---------------------------------------------------------------------- plots

# results.json baseline key -> its label on the per-round curves and on the bars
BASELINE_LABELS = {
    "standalone": ("standalone (mean)", "standalone"),
    "centralized": ("centralized FedAvg", "centralized"),
    "centralized_fedsgd": ("centralized FedSGD", "centralized FedSGD"),
}


def write_plots(
    out: Path,
    specs: Sequence[RunSpec],
    outcomes: Sequence[RunOutcome],
    summaries: Sequence[dict[str, Any]],
    baselines: dict[str, Any] | None,
    threshold: float,
) -> dict[str, str]:
    paths: dict[str, str] = {}
    reference = {
        BASELINE_LABELS[name][0]: baseline_by_round(baseline)
        for name, baseline in (baselines or {}).items()
    }
    fractions = sorted({s.fraction for s in specs})
    protocol = specs[0].protocol
    for c in fractions:
        picked = [(s, o) for s, o in zip(specs, outcomes, strict=True) if s.fraction == c]
        curves = {s.heuristic: mean_by_round(o.rows) for s, o in picked}
        per_node: dict[str, dict[int, float]] | None = None
        if len(picked) == 1 and picked[0][0].nodes <= 20:
            per_node = {}
            for r in picked[0][1].rows:
                if r.get("macro_f1") is not None:
                    per_node.setdefault(r["node"], {})[r["round"]] = float(r["macro_f1"])
        name = "f1_per_round.png" if len(fractions) == 1 else f"f1_per_round_c{c:g}.png"
        paths[name.removesuffix(".png")] = str(
            plots.f1_per_round(
                curves,
                out / name,
                title=f"{protocol}, {specs[0].nodes} nodes, c={c:g}",
                baselines=reference,
                per_node=per_node,
                threshold=threshold,
            )
        )
    points: dict[str, list[plots.FractionPoint]] = {}
    for s, summary in zip(specs, summaries, strict=True):
        if summary["messages_sent_total"] is None:
            continue
        reached = summary["messages_to_threshold"] is not None
        messages = summary["messages_to_threshold"] if reached else summary["messages_sent_total"]
        points.setdefault(s.heuristic, []).append(
            plots.FractionPoint(s.fraction, int(messages), reached)
        )
    if points:
        paths["messages_vs_fraction"] = str(
            plots.messages_vs_fraction(
                points,
                out / "messages_vs_fraction.png",
                title=f"{protocol}: messages sent until mean macro-F1 >= {threshold:g}",
            )
        )
    bars: list[tuple[str, int | None]] = [
        (s.label, m["rounds_to_threshold"]) for s, m in zip(specs, summaries, strict=True)
    ]
    bars += [
        (BASELINE_LABELS[name][1], baseline["rounds_to_threshold"])
        for name, baseline in (baselines or {}).items()
    ]
    paths["rounds_to_threshold"] = str(
        plots.rounds_to_threshold(
            bars,
            out / "rounds_to_threshold.png",
            threshold=threshold,
            max_round=max(s.rounds for s in specs),
            title=f"{protocol}, {specs[0].nodes} nodes: rounds to threshold",
        )
    )
    return paths


# ---------------------------------------------------------------------- the benchmark


@dataclass
class BenchmarkResult:
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
    report: Report = _stdout,
    on_started: Callable[[list[SitePlan]], None] | None = None,
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
        outcomes.append(
            run_federation(
                spec, out / "fed" / spec.slug, sources, report=report, on_started=on_started
            )
        )
        report(f"--- {spec.label}: done in {outcomes[-1].wall_s:.1f} s")
    reference: dict[str, Any] | None = None
    if baselines:
        report("baselines: standalone and centralized FedAvg (in process, same partition)")
        reference = compute_baselines(base, sources, out / "baseline_state", threshold)
    summaries = [summarize_run(s, o, threshold) for s, o in zip(specs, outcomes, strict=True)]
    plot_paths = write_plots(out, specs, outcomes, summaries, reference, threshold)
    if len(specs) == 1:
        summary = with_baselines(summaries[0], reference)
    else:
        summary = grid_summary(base, outcomes, summaries, reference)
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
    path.write_text(json.dumps(results, indent=2, allow_nan=False, default=_json_default) + "\n")
    ok = all(not o.errors and not o.timed_out for o in outcomes)
    return BenchmarkResult(results, path, ok)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def grid_summary(
    base: RunSpec,
    outcomes: Sequence[RunOutcome],
    summaries: Sequence[dict[str, Any]],
    reference: dict[str, Any] | None,
) -> dict[str, Any]:
    """Several runs: the lowest macro-F1 over the runs, traffic and time shares pooled."""
    all_rows = [row for o in outcomes for row in o.rows]
    finals = [m["macro_f1_mean_final"] for m in summaries if m["macro_f1_mean_final"] is not None]
    firsts = [m["macro_f1_mean_first"] for m in summaries if m["macro_f1_mean_first"] is not None]
    messages = [m["messages_sent_total"] for m in summaries if m["messages_sent_total"] is not None]
    nbytes = [m["bytes_sent_total"] for m in summaries if m["bytes_sent_total"] is not None]
    keep = (
        "heuristic",
        "fraction",
        "macro_f1_mean_first",
        "macro_f1_mean_final",
        "macro_f1_mean_last3",
        "non_training_share",
        "non_training_share_wall",
        "exchange_share",
        "messages_sent_total",
        "bytes_sent_total",
        "rounds_to_threshold",
        "messages_to_threshold",
        "wall_s",
        "peak_rss_mb_max",
        "rounds_completed_min",
        "errors",
    )
    summary = {
        "protocol": base.protocol,
        "nodes": base.nodes,
        "rounds": base.rounds,
        "mode": summaries[0]["mode"],
        "macro_f1_mean_first": min(firsts, default=None),
        "macro_f1_mean_final": min(finals, default=None),
        **time_shares(all_rows),
        "messages_sent_total": sum(messages) if messages else None,
        "bytes_sent_total": sum(nbytes) if nbytes else None,
        "threshold": summaries[0]["threshold"],
        "grid": [{k: m[k] for k in keep} for m in summaries],
    }
    out = with_baselines(summary, reference)
    for cell in out["grid"]:
        cell.update(
            {
                k: v
                for k, v in with_baselines(cell, reference).items()
                if k in ("gain_over_standalone", "gap_to_centralized")
            }
        )
    return out


# ---------------------------------------------------------------------- CLI


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in HEURISTICS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown heuristic(s) {unknown}: use {', '.join(HEURISTICS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.federation", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--protocol", default="fedavgp2p", choices=protocol_names())
    parser.add_argument("--heuristic", default="random", choices=HEURISTICS)
    parser.add_argument(
        "--fraction",
        type=float,
        default=0.5,
        help="c: share of the other nodes each node pulls from",
    )
    parser.add_argument(
        "--grid",
        action="store_true",
        help="every heuristic x c (defaults: all four heuristics, c in 0.25,0.5,0.75,1.0)",
    )
    parser.add_argument(
        "--heuristics", type=_names, default=None, help="comma list, e.g. random,n_latest,f1,cosine"
    )
    parser.add_argument(
        "--fractions", type=_floats, default=None, help="comma list, e.g. 0.25,0.5,0.75,1.0"
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--data",
        default="digits",
        help="'digits' (embedded), a MedMNIST-style .npz or an ImageFolder directory",
    )
    parser.add_argument(
        "--partition",
        default="dirichlet:0.5",
        help="iid, dirichlet:ALPHA, shards:K or quantity:ALPHA",
    )
    parser.add_argument(
        "--test-split",
        choices=("local", "global"),
        default="local",
        help="local: each site's test follows its train class shares; "
        "global: every site is scored on the whole test split (DFU paper)",
    )
    parser.add_argument("--label-fraction", type=float, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--model", default="small_cnn")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument(
        "--augment",
        default="weak",
        choices=("none", "weak", "strong"),
        help="data.augment of every site (training batches only)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps-per-epoch", type=int, default=None)
    parser.add_argument(
        "--steps-per-round",
        type=int,
        default=None,
        help="local steps per round instead of epochs (equal work per site)",
    )
    parser.add_argument(
        "--class-weighted",
        action="store_true",
        help="class-weighted cross-entropy (median frequency / frequency) for every method",
    )
    parser.add_argument(
        "--round-timeout",
        type=float,
        default=None,
        help="protocol.round_timeout_s (default: the protocol's)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="overall bound of one run in seconds; the nodes are always stopped",
    )
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="run the nodes in this process over the in-memory network",
    )
    parser.add_argument(
        "--protocol-option",
        dest="protocol_options",
        type=_protocol_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another protocol: field for every node, VALUE read as YAML "
        "(e.g. aggregation=median); repeatable",
    )
    parser.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.9,
        help="macro-F1 threshold of the rounds-to-threshold figures (DFU: 0.9)",
    )
    parser.add_argument("--verbose", action="store_true")
    return parser


def _protocol_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. aggregation=median")
    return key.strip(), yaml.safe_load(value)


def grid_cells(args: argparse.Namespace) -> list[tuple[str, float]]:
    if args.grid:
        heuristics = args.heuristics or list(HEURISTICS)
        fractions = args.fractions or list(GRID_FRACTIONS)
    else:
        heuristics = args.heuristics or [args.heuristic]
        fractions = args.fractions or [args.fraction]
    for c in fractions:
        if not 0.0 < c <= 1.0:
            raise SystemExit(f"bench.federation: --fraction(s) must be in (0, 1], got {c}")
    return [(h, c) for h in heuristics for c in fractions]


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    if args.nodes < 2:
        raise SystemExit(f"bench.federation: --nodes must be at least 2, got {args.nodes}")
    return RunSpec(
        nodes=args.nodes,
        protocol=args.protocol,
        heuristic=args.heuristic,
        fraction=args.fraction,
        rounds=args.rounds,
        data=args.data,
        partition=args.partition,
        test_split=args.test_split,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        model=args.model,
        image_size=args.image_size,
        augment=args.augment,
        seed=args.seed,
        max_steps_per_epoch=args.max_steps_per_epoch,
        steps_per_round=args.steps_per_round,
        class_weighted=args.class_weighted,
        label_fraction=args.label_fraction,
        round_timeout_s=args.round_timeout,
        timeout_s=args.timeout,
        in_memory=args.in_memory,
        protocol_options=tuple(args.protocol_options),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    bench = run_benchmark(
        spec_from_args(args),
        grid_cells(args),
        args.out,
        baselines=args.baselines,
        threshold=args.threshold,
    )
    for name, path in bench.results["plots"].items():
        _stdout(f"plot {name}: {path}")
    _stdout(f"results: {bench.path}")
    _stdout(json.dumps(bench.results["summary"], allow_nan=False, default=_json_default))
    return 0 if bench.ok else 1


if __name__ == "__main__":
    sys.exit(main())
