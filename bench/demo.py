"""`make demo`: four sites learn the embedded digits scans together, peer to peer.

Four real `p2pfl-node` processes on loopback, each holding a label-skewed
(Dirichlet 0.5) share of the digits data set, run FedAVGP2P (random
neighbours, c = 0.5). The terminal shows where each node's live dashboard is,
one line per node per round, and at the end a table of every node's final
macro-F1 next to the two baselines measured in the same run on the same
shares (each site alone; server-based FedAvg) and the path of the plot.
Everything is written under runs/demo/ (results.json, plots, node state).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bench.federation import RunSpec, run_benchmark
from node.provision import SitePlan

OUT = Path("runs/demo")
SPEC = RunSpec(
    nodes=4,
    protocol="fedavgp2p",
    heuristic="random",
    fraction=0.5,
    rounds=8,
    data="digits",
    partition="dirichlet:0.5",
    epochs=3,
    batch_size=32,
    lr=3e-3,
    image_size=16,
    augment="none",
    timeout_s=150.0,
)
THRESHOLD = 0.8


def say(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def show_dashboards(plans: list[SitePlan]) -> None:
    say("live dashboards (while the nodes run):")
    terminal = sys.stdout.isatty()  # the token only for a terminal, not a log file
    for plan in plans:
        say(f"  {plan.name}: {plan.dashboard_url(with_token=terminal)}")


def closing_table(results: dict[str, Any]) -> list[str]:
    final: dict[str, float] = {}
    last_round: dict[str, int] = {}
    for row in results["rounds"]:
        if row.get("macro_f1") is not None and row["round"] >= last_round.get(row["node"], 0):
            last_round[row["node"]] = row["round"]
            final[row["node"]] = row["macro_f1"]
    baselines = results["baselines"]
    alone = baselines.get("standalone", {}).get("macro_f1_by_node", {})
    central = baselines.get("centralized", {}).get("macro_f1_by_node", {})
    lines = [
        f"{'node':<8} {'rounds':>6} {'FedAVGP2P':>10} {'standalone':>11} {'centralized':>12}",
    ]
    for node in sorted(set(final) | set(alone)):
        lines.append(
            f"{node:<8} {last_round.get(node, 0):>6} {_cell(final.get(node)):>10}"
            f" {_cell(alone.get(node)):>11} {_cell(central.get(node)):>12}"
        )
    summary = results["summary"]
    lines.append(
        f"{'mean':<8} {'':>6} {_cell(summary['macro_f1_mean_final']):>10}"
        f" {_cell(summary['standalone_macro_f1_mean']):>11} {_cell(summary['centralized_macro_f1']):>12}"
    )
    return lines


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> int:
    say(
        f"p2pfl-node demo: {SPEC.nodes} sites on the embedded digits scans ({SPEC.partition}), "
        f"{SPEC.protocol} with {SPEC.heuristic} neighbours, c = {SPEC.fraction:g}, {SPEC.rounds} rounds"
    )
    bench = run_benchmark(
        SPEC,
        [(SPEC.heuristic, SPEC.fraction)],
        OUT,
        baselines=True,
        threshold=THRESHOLD,
        report=say,
        on_started=show_dashboards,
    )
    results = bench.results
    summary = results["summary"]
    say()
    say("test macro-F1 at the last round (standalone: each site alone; centralized: server FedAvg)")
    for line in closing_table(results):
        say("  " + line)
    say()
    shares = summary.get("non_training_share")
    if shares is not None:
        say(
            f"federation wall time {summary['wall_s']:.1f} s; {summary['messages_sent_total']} protocol messages, "
            f"{(summary['bytes_sent_total'] or 0) / 1e6:.2f} MB; {shares:.0%} of a round outside local training"
        )
    say(f"plot: {results['plots']['f1_per_round']}")
    say(f"results: {bench.path}")
    if not bench.ok:
        say(f"some nodes did not finish cleanly: {summary['errors']}")
    return 0 if bench.ok else 1


if __name__ == "__main__":
    sys.exit(main())
