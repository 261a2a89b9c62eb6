"""The benchmark's plots, drawn with bench.plots: f1_per_round[_c<c>].png
(macro-F1 per round per heuristic, with the baselines), messages_vs_fraction.png
(DFU Fig. 7), rounds_to_threshold.png (DFU Table 2) and site_gain.png (each
site's gain over the same site alone against its size and skew); and the
per-site gain table as printed lines."""

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


def _f(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.3f}" if sign else f"{value:.3f}"


def gain_table_lines(table: dict[str, Any], label: str) -> list[str]:
    """The per-site gain table (stats.site_gain_table) as printable lines; with
    a personal and a federated model per node, both models' macro-F1 too."""
    metrics = ("macro_f1", "balanced_accuracy", "auc")
    personal = any(r["personal_macro_f1"] is not None for r in table["sites"])
    header = f"{'site':<10}{'train':>7}{'major':>7}{'test':>6}  {'model':<10}"
    header += "".join(
        f"{name:>9}{'alone':>7}{'gain':>8}" for name in ("macro-F1", "bal.acc", "AUROC")
    )
    header += f"{'personal':>10}{'federated':>10}" if personal else ""
    lines = [
        f"per-site gain, {label}: each site's reported model minus the same site alone "
        "(standalone, best on validation), on the site's test split",
        header,
    ]
    for r in table["sites"]:
        line = f"{r['node'] + (' *' if r['below_test_minimum'] else ''):<10}{r['train_size']:>7}"
        line += f"{_f(r['majority_share']):>7}{r['test_size']:>6}  {r['reported_model']:<10}"
        line += "".join(
            f"{_f(r[k]):>9}{_f(r[f'standalone_{k}']):>7}{_f(r[f'gain_{k}'], True):>8}"
            for k in metrics
        )
        if personal:
            line += f"{_f(r['personal_macro_f1']):>10}{_f(r['federated_macro_f1']):>10}"
        lines.append(line)
    lines.append(_gain_line(table, ""))
    if table["sites_apart"]:
        short = "; ".join(
            f"{r['node']}: {_short_classes(r['test_short_classes'])}"
            for r in table["sites"]
            if r["below_test_minimum"]
        )
        lines.append(
            f"* reported apart: test split under {table['min_test_per_class']} images of a "
            f"class the site trains on ({short})"
        )
        lines.append(_gain_line(table, "_without_apart"))
    if table.get("global_test_n"):
        lines.append(_global_line(table))
    return lines


def _global_line(table: dict[str, Any]) -> str:
    """The global test set's line: the sites alone, pooled, and the nodes (or why not)."""
    text = (
        f"global test set ({table['global_test_n']} images): standalone macro-F1 mean "
        f"{_f(table['global_standalone_macro_f1_mean'])}, pooled "
        f"{_f(table['global_pooled_macro_f1'])}; "
    )
    if table.get("global_missing"):
        return text + f"the nodes' models: not scored ({table['global_missing']})"
    return text + (
        f"the nodes' models {_f(table['global_macro_f1_mean'])} (mean gain "
        f"{_f(table['global_mean_gain_macro_f1'], True)}, {table['global_sites_gained']} of "
        f"{table['global_sites_compared']} sites gained); their federated models "
        f"{_f(table.get('global_federated_macro_f1_mean'))} (pooled minus federated "
        f"{_f(table.get('global_federated_gap_to_pooled'), True)})"
    )


def _short_classes(short: dict[str, int], shown: int = 3) -> str:
    """'class 3: 2, class 5: 4 (+6 more)': the classes with the fewest test images first."""
    ordered = sorted(short.items(), key=lambda item: item[1])
    text = ", ".join(f"class {c}: {n}" for c, n in ordered[:shown])
    return text + (f" (+{len(ordered) - shown} more)" if len(ordered) > shown else "")


def _gain_line(table: dict[str, Any], suffix: str) -> str:
    n = table[f"sites_compared{suffix}"]
    what = "all sites" if not suffix else "without the sites apart"
    if not n:
        return f"{what}: no site to compare"
    gained, share = table[f"sites_gained{suffix}"], table[f"share_gained{suffix}"]
    within = table[f"share_within_tolerance{suffix}"]
    alone = table.get(f"sites_reporting_alone{suffix}") or 0
    return (
        f"{what}: {gained} of {n} gained ({share:.0%}), {within:.0%} not worse than alone by "
        f"more than {table['tolerance'] * 100:g} points"
        + (f"; {alone} of {n} report the model they trained alone" if alone else "")
        + "; mean gain macro-F1 "
        f"{_f(table[f'mean_gain_macro_f1{suffix}'], True)}, balanced accuracy "
        f"{_f(table[f'mean_gain_balanced_accuracy{suffix}'], True)}, AUROC "
        f"{_f(table[f'mean_gain_auc{suffix}'], True)}"
    )


def write_gain_plot(out: Path, name: str, table: dict[str, Any], title: str) -> Path | None:
    """site_gain[...].png: each site's macro-F1 gain against its size and skew."""
    points = [
        plots.SitePoint(
            r["node"],
            r["train_size"],
            r["majority_share"],
            r["gain_macro_f1"],
            r["below_test_minimum"],
        )
        for r in table["sites"]
        if r["gain_macro_f1"] is not None and r["majority_share"] is not None
    ]
    if not points:
        return None
    return plots.site_gain(points, out / f"{name}.png", title=title)
