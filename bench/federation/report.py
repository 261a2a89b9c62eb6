"""The benchmark's plots, drawn with bench.plots: f1_per_round[_c<c>].png
(macro-F1 per round per heuristic, with the baselines), messages_vs_fraction.png
(DFU Fig. 7) and rounds_to_threshold.png (DFU Table 2)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import plots
from bench.federation.baselines import baseline_by_round
from bench.federation.outcome import RunOutcome
from bench.federation.specs import RunSpec
from bench.federation.stats import mean_by_round

# results.json baseline key -> its label on the per-round curves and on the bars
BASELINE_LABELS = {
    "standalone": ("standalone (mean)", "standalone"),
    "centralized": ("centralized FedAvg", "centralized"),
    "centralized_fedsgd": ("centralized FedSGD", "centralized FedSGD"),
    "pooled": ("pooled (centralized training)", "pooled"),
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
        for s, o in picked:  # the model each node reports: its best on validation so far
            best = mean_by_round(o.rows, "best_macro_f1")
            if best:
                curves[f"{s.heuristic} (reported: best on val)"] = best
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
