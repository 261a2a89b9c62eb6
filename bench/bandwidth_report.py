"""The figures of bench.bandwidth (issue 32, item 4): one federation run's
bytes per round, round, exchange and training times and final macro-F1
(`run_figures`), the means and per-seed ratios between arms over seeds
(`model_summary`), the issue's acceptance targets checked against them
(`acceptance`) and the plot of bytes and round time per arm (`plot`).

Split from the arms and the runs (bench/bandwidth.py) so that the reporting
can be read, and reused by bench.heterogeneous and bench.network (`mean`,
`ratio`, `rounded`), without the federation machinery.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.federation.outcome import RunOutcome
from bench.federation.stats import per_node_final
from bench.plots import save

# The acceptance (issue 32): bytes ratios against `none`, F1 points
# within which a lossy format must stay, secure / plain, resnet18 int8 / none.
TARGETS = {
    "int8_bytes": 0.27,
    "int8_f1_points": 1.0,
    "topk_bytes": 0.15,
    "topk_f1_points": 2.0,
    "secagg_bytes": 1.05,
    "secagg_resnet18_round_time": 1.1,
    "resnet18_int8_round_time": 0.4,
}


def mean(values: Sequence[float | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return statistics.fmean(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None where either is missing or zero (a run that exchanged no
    byte measured nothing to compare)."""
    return None if not a or not b else a / b


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def run_figures(outcome: RunOutcome, rounds: int, link_mbit: float) -> dict[str, Any]:
    """The figures of one federation run (one arm, one seed)."""
    rows = outcome.rows
    final = per_node_final(rows)
    last: dict[str, tuple[int, int]] = {}
    for r in rows:
        if r.get("bytes_sent") is not None and r["round"] >= last.get(r["node"], (0, 0))[0]:
            last[r["node"]] = (r["round"], int(r["bytes_sent"]))
    per_site = [b / rnd for rnd, b in last.values() if rnd > 0]
    site_bytes = mean(per_site)

    def mean_of(key: str) -> float | None:
        return mean([r.get(key) for r in rows])

    return {
        "macro_f1_final": rounded(mean(list(final.values()))),
        "macro_f1_final_per_node": final,
        "bytes_per_round_site": rounded(site_bytes, 1),
        "bytes_per_round_federation": rounded(sum(per_site), 1) if per_site else None,
        "round_s_mean": rounded(mean_of("round_s")),
        "round_s_before_last": rounded(
            mean([r.get("round_s") for r in rows if r["round"] < last.get(r["node"], (0, 0))[0]])
        ),
        "exchange_s_mean": rounded(mean_of("exchange_s")),
        "train_s_mean": rounded(mean_of("train_s")),
        "neighbours_mean": rounded(mean_of("neighbours"), 2),
        "link_floor_s": rounded(site_bytes * 8 / (link_mbit * 1e6))
        if site_bytes is not None and link_mbit > 0
        else None,
        "rounds_completed_min": min((rnd for rnd, _ in last.values()), default=0),
        "rounds": rounds,
        "wall_s": round(outcome.wall_s, 1),
        "errors": outcome.errors,
        "timed_out": outcome.timed_out,
    }


def seed_ratio(
    per_seed: dict[int, dict[str, Any]], num: str, den: str, key: str
) -> tuple[float | None, list[float | None]]:
    """The mean over seeds of figures[num][key] / figures[den][key], and each seed's."""
    each = [
        rounded(ratio(f.get(num, {}).get(key), f.get(den, {}).get(key))) for f in per_seed.values()
    ]
    return rounded(mean(each)), each


def seed_difference(
    per_seed: dict[int, dict[str, Any]], a: str, b: str, key: str = "macro_f1_final"
) -> tuple[float | None, list[float | None]]:
    """Points (x100) by which a's figure is above b's, mean over seeds and each seed's."""
    each: list[float | None] = []
    for f in per_seed.values():
        x, y = f.get(a, {}).get(key), f.get(b, {}).get(key)
        each.append(None if x is None or y is None else round(100 * (x - y), 2))
    return rounded(mean(each), 2), each


def model_summary(per_seed: dict[int, dict[str, Any]], labels: Sequence[str]) -> dict[str, Any]:
    """Means over seeds per arm, and the ratios between arms."""
    arms: dict[str, Any] = {}
    for label in labels:
        runs = [f[label] for f in per_seed.values() if label in f]
        if not runs:
            continue
        arms[label] = {
            key: rounded(mean([r[key] for r in runs]), 1 if key.startswith("bytes") else 4)
            for key in (
                "macro_f1_final",
                "bytes_per_round_site",
                "bytes_per_round_federation",
                "round_s_mean",
                "round_s_before_last",
                "exchange_s_mean",
                "train_s_mean",
                "neighbours_mean",
                "link_floor_s",
            )
        }
    ratios: dict[str, Any] = {}
    for label in labels:
        secure = label.endswith("+secagg")
        plain = label.removesuffix("+secagg")
        none = "none+secagg" if secure else "none"
        # each arm against `none` of its own kind, and a secure arm against its plain twin
        for base in ([none] if label != none else []) + ([plain] if secure else []):
            for what, field in (
                ("bytes", "bytes_per_round_site"),
                ("round_s", "round_s_mean"),
                ("round_s_before_last", "round_s_before_last"),
            ):
                ratios[f"{label}/{base} {what}"] = seed_ratio(per_seed, label, base, field)
            ratios[f"{label}-{base} macro_f1 points"] = seed_difference(per_seed, label, base)
    return {
        "seeds": sorted(per_seed),
        "arms": arms,
        "ratios": {
            k: {"mean": v[0], "per_seed": v[1]} for k, v in ratios.items() if v[0] is not None
        },
    }


def acceptance(models: dict[str, Any], formats: Sequence[str]) -> dict[str, Any]:
    """The issue's figures from the model summaries: value, target, met (None
    where the run did not measure it). A lossy format's F1 must not fall more
    than the target's points under `none` (a gain meets it). The resnet18
    round times are judged over every round and over the rounds before the
    last (the fine-tuning after the last round is `personalize_s`, not in
    either)."""
    checks = [
        ("small_cnn", f"{fmt}/none bytes", TARGETS[f"{key}_bytes"], "<=")
        for fmt, key in (("int8", "int8"), ("topk:0.1", "topk"))
    ] + [
        ("small_cnn", f"{fmt}-none macro_f1 points", -TARGETS[f"{key}_f1_points"], ">=")
        for fmt, key in (("int8", "int8"), ("topk:0.1", "topk"))
    ]
    for suffix in ("round_s", "round_s_before_last"):
        checks.append(
            ("resnet18", f"int8/none {suffix}", TARGETS["resnet18_int8_round_time"], "<=")
        )
        checks.append(
            ("resnet18", f"none+secagg/none {suffix}", TARGETS["secagg_resnet18_round_time"], "<=")
        )
    for model in models:
        checks += [(model, f"{f}+secagg/{f} bytes", TARGETS["secagg_bytes"], "<=") for f in formats]
    out = {}
    for model, key, target, op in checks:
        value = (models.get(model, {}).get("ratios", {}).get(key) or {}).get("mean")
        met = None if value is None else (value <= target if op == "<=" else value >= target)
        out[f"{model} {key}"] = {"value": value, "target": f"{op} {target:g}", "met": met}
    return out


def plot(models: dict[str, Any], path: Path, link_mbit: float) -> Path:
    """Bytes per round per site (bars) and round time (dots) of every arm, one
    panel per model."""
    import matplotlib.pyplot as plt  # bench.plots chose the Agg backend

    fig, axes = plt.subplots(1, len(models), figsize=(6.0 * len(models), 4.2), squeeze=False)
    for ax, (model, summary) in zip(axes[0], models.items(), strict=True):
        labels = list(summary["arms"])
        mb = [(summary["arms"][k]["bytes_per_round_site"] or 0) / 1e6 for k in labels]
        ax.bar(range(len(labels)), mb, color=["C1" if "secagg" in k else "C0" for k in labels])
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_ylabel("MB sent per site per round (bars)")
        ax.set_title(model)
        ax.grid(axis="y", alpha=0.3)
        twin = ax.twinx()
        twin.plot(
            range(len(labels)),
            [summary["arms"][k]["round_s_mean"] for k in labels],
            "ko",
            label="round time",
        )
        twin.set_ylabel("round time, s (dots)")
        twin.set_ylim(bottom=0)
    link = f"{link_mbit:g} Mbit/s uplinks (emulated)" if link_mbit else "unshaped loopback"
    fig.suptitle(f"FedAVGP2P, {link}: bytes and round time per arm", fontsize="medium")
    return save(fig, path)
