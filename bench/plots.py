"""Plots shared by the benchmarks (matplotlib, Agg backend, PNG files).

- `f1_per_round`: macro-F1 per round, one curve per run (e.g. per heuristic),
  optional thin per-node curves, baselines as dashed curves and the
  threshold of DFU Table 2 as a dotted line.
- `messages_vs_fraction`: protocol messages sent by the whole federation versus
  the fraction c, one line per heuristic (DFU Fig. 7 counts them up to the
  round where the threshold is reached; points whose run never reached it are
  drawn hollow and count the whole run).
- `rounds_to_threshold`: rounds until the mean macro-F1 over the nodes first
  reaches the threshold, one bar per run (DFU Table 2); runs that never reach
  it get a hatched bar labelled "not reached".
- `site_gain`: each site's gain over the same site alone against its train
  size and its skew (majority-class share), one labelled point per site.
- `final_per_seed`: one figure per method and seed (dots, one colour per seed,
  so a hard seed shows up across every method) and the mean over the seeds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


@dataclass(frozen=True)
class FractionPoint:
    """One run of the Fig. 7 plot: c, messages counted, and whether the
    threshold was reached (otherwise the count is the whole run's)."""

    fraction: float
    messages: int
    reached: bool


def f1_per_round(
    curves: Mapping[str, Mapping[int, float]],
    path: Path,
    *,
    title: str,
    baselines: Mapping[str, Mapping[int, float]] | None = None,
    per_node: Mapping[str, Mapping[int, float]] | None = None,
    threshold: float | None = None,
) -> Path:
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for _node, series in sorted((per_node or {}).items()):
        rounds = sorted(series)
        ax.plot(rounds, [series[r] for r in rounds], color="0.75", linewidth=0.8, zorder=1)
    if per_node:
        ax.plot([], [], color="0.75", linewidth=0.8, label="single nodes")
    for label, series in curves.items():
        rounds = sorted(series)
        ax.plot(
            rounds, [series[r] for r in rounds], marker="o", markersize=3, label=label, zorder=3
        )
    styles = ["--", "-.", (0, (5, 2, 1, 2))]
    for i, (label, series) in enumerate((baselines or {}).items()):
        rounds = sorted(series)
        ax.plot(
            rounds,
            [series[r] for r in rounds],
            linestyle=styles[i % len(styles)],
            color=f"C{7 + i}",
            label=label,
            zorder=2,
        )
    if threshold is not None:
        ax.axhline(
            threshold, linestyle=":", color="black", linewidth=0.8, label=f"threshold {threshold:g}"
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("round")
    ax.set_ylabel("macro-F1 (test, mean over nodes)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    return save(fig, path)


def messages_vs_fraction(
    points: Mapping[str, Sequence[FractionPoint]], path: Path, *, title: str
) -> Path:
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for i, (label, series) in enumerate(points.items()):
        ordered = sorted(series, key=lambda p: p.fraction)
        colour = f"C{i}"
        ax.plot(
            [p.fraction for p in ordered], [p.messages for p in ordered], color=colour, label=label
        )
        for p in ordered:
            ax.plot(
                p.fraction,
                p.messages,
                marker="o",
                color=colour,
                markerfacecolor=colour if p.reached else "white",
            )
    ax.plot(
        [],
        [],
        marker="o",
        linestyle="",
        color="0.3",
        markerfacecolor="white",
        label="threshold not reached (whole run)",
    )
    ax.set_xlim(0.0, 1.05)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("fraction of peers c")
    ax.set_ylabel("protocol messages sent (all nodes)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save(fig, path)


def rounds_to_threshold(
    rows: Sequence[tuple[str, int | None]],
    path: Path,
    *,
    threshold: float,
    max_round: int,
    title: str,
) -> Path:
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(rows) + 2.0), 4.0))
    for i, (_label, rounds) in enumerate(rows):
        if rounds is None:
            ax.bar(i, max_round + 1, color="white", edgecolor="0.4", hatch="//")
            ax.text(i, max_round + 1, "not reached", ha="center", va="bottom", fontsize="small")
        else:
            ax.bar(i, rounds, color=f"C{i % 10}")
            ax.text(i, rounds, str(rounds), ha="center", va="bottom", fontsize="small")
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], rotation=30, ha="right")
    ax.set_ylabel(f"rounds to mean macro-F1 >= {threshold:g}")
    ax.set_ylim(0, max_round + 2)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)


def final_per_seed(values: Mapping[str, Mapping[int, float]], path: Path) -> Path:
    """`values`: method -> seed -> final macro-F1."""
    methods = list(values)
    all_seeds = sorted({s for seeds in values.values() for s in seeds})
    colours = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(all_seeds)}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(methods)), 4.0))
    labelled: set[int] = set()
    for i, method in enumerate(methods):
        points = sorted(values[method].items())
        for j, (seed, y) in enumerate(points):
            x = i + 0.06 * (j - (len(points) - 1) / 2)
            label = f"seed {seed}" if seed not in labelled else None
            labelled.add(seed)
            ax.scatter([x], [y], s=20, color=colours[seed], label=label, zorder=3)
        if points:
            mean = sum(y for _, y in points) / len(points)
            ax.hlines(mean, i - 0.3, i + 0.3, colors="black", zorder=4)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods, rotation=30, ha="right")
    ax.set_ylabel("final macro-F1 (mean over nodes)")
    ax.set_title("final macro-F1 per seed (dots) and mean over the seeds (bar)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left", ncols=max(1, min(5, len(all_seeds))))
    return save(fig, path)


def label_efficiency(
    path: Path,
    fractions: list[float],
    table: dict[str, dict[str, Any]],
    curves: dict[str, dict[int, float]],
    pretrain_curves: dict[str, dict[int, float]],
    arms: Mapping[str, tuple[str, str]],
) -> Path:
    """Bars (mean over seeds, std as error bars), the first seed's fine-tuning
    curves, and the mean pre-training curves of both methods (bench.label_efficiency;
    `arms`: arm -> (name, colour), scratch first)."""
    fig = plt.figure(figsize=(16, 3.9))
    ax_bar, ax_curve, ax_mae, ax_beit = fig.subplots(1, 4)
    width = 0.27
    xs = range(len(fractions))
    for i, (arm, (name, colour)) in enumerate(arms.items()):
        values = [table[str(f)][f"{arm}_macro_f1"] for f in fractions]
        errors = [table[str(f)][f"{arm}_macro_f1_std"] for f in fractions]
        bars = ax_bar.bar(
            [x + (i - 1) * width for x in xs],
            values,
            width,
            yerr=errors,
            capsize=3,
            label=name,
            color=colour,
        )
        ax_bar.bar_label(bars, fmt="%.3f", fontsize=6)
    ax_bar.set_xticks(list(xs), [f"{f:.0%}" for f in fractions])
    ax_bar.set_xlabel("labelled share of the training images")
    ax_bar.set_ylabel("final test macro-F1 (mean over nodes, seeds)")
    ax_bar.set_ylim(0, 1)
    ax_bar.legend(loc="lower right", fontsize=7)
    ax_bar.set_title("FedAVGP2P fine-tuning")
    styles = {"scratch": ":", "fedmae": "-", "fedbeit": "--"}
    for key, series in curves.items():
        fraction, arm = key.split("|")
        ax_curve.plot(
            list(series),
            list(series.values()),
            styles[arm],
            marker=".",
            color=arms[arm][1],
            alpha=0.4 + 0.6 * float(fraction),
            label=f"{arms[arm][0]} {float(fraction):.0%}",
        )
    ax_curve.set_xlabel("fine-tuning round")
    ax_curve.set_ylabel("test macro-F1 (first seed)")
    ax_curve.legend(fontsize=5, ncol=3)
    ax_curve.set_title("fine-tuning curves")
    for ax, arm, label in (
        (ax_mae, "fedmae", "test reconstruction loss (masked patches)"),
        (ax_beit, "fedbeit", "test token cross-entropy (masked patches)"),
    ):
        curve = pretrain_curves.get(arm, {})
        ax.plot(list(curve), list(curve.values()), marker=".", color=arms[arm][1])
        ax.set_xlabel("round (Fed-BEiT: after the tokenizer's)")
        ax.set_ylabel(label)
        ax.set_title(f"P2P {arms[arm][0]} pre-training")
    return save(fig, path)


@dataclass(frozen=True)
class SitePoint:
    """One site of the gain plot: its name, train size, majority-class share,
    gain in macro-F1 over the same site alone, and whether its test split is
    under the per-class minimum (drawn hollow: its gain is noisy)."""

    name: str
    train_size: int
    majority_share: float
    gain: float
    apart: bool = False


def site_gain(points: Sequence[SitePoint], path: Path, *, title: str) -> Path:
    """Per-site gain (reported model minus standalone, macro-F1) against the
    site's train size (left) and its skew, the majority class's share of its
    train split (right); one labelled point per site."""
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.0), sharey=True)
    for ax, attr, label in (
        (axes[0], "train_size", "train images at the site"),
        (axes[1], "majority_share", "majority class's share of the site's train split"),
    ):
        for p in points:
            x = getattr(p, attr)
            colour = "C2" if p.gain > 0 else "C3"
            ax.scatter(
                [x],
                [p.gain],
                s=36,
                color=colour,
                facecolor="white" if p.apart else colour,
                zorder=3,
            )
            ax.annotate(p.name, (x, p.gain), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    if points and max(p.train_size for p in points) > 20 * max(
        1, min(p.train_size for p in points)
    ):
        axes[0].set_xscale("log")
    axes[1].set_xlim(0.0, 1.02)
    axes[0].set_ylabel("macro-F1 gain over the site alone")
    axes[1].scatter(
        [], [], s=36, color="0.3", facecolor="white", label="test split under the minimum"
    )
    if any(p.apart for p in points):
        axes[1].legend(fontsize="small", loc="best")
    fig.suptitle(title)
    return save(fig, path)


def save(fig: plt.Figure, path: Path) -> Path:
    """Lay out, write (100 dpi, folders made) and close `fig`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
