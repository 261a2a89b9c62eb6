"""bench.scale's figure: time per round and peak memory against the number
of simulated nodes, for each engine and settings (bench/scale.py writes it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(rows: list[dict[str, Any]], path: Path, *, k: int = 4, model: str = "small_cnn") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("round_s") is not None and r["settings"] == "scale"]
    base = [r for r in rows if r.get("round_s") is not None and r["settings"] == "defaults"]
    ray = [r for r in rows if r.get("round_s") is not None and r["settings"] == "ray"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for series, style, label in (
        (ok, "o-", "scale settings"),
        (base, "s", "defaults"),
        (ray, "^-", "ray shards (memory: all shards + driver)"),
    ):
        xs = [r["nodes"] for r in series]
        left.plot(xs, [r["round_s"] for r in series], style, label=label)
        right.plot(
            xs,
            [r["peak_rss_mb"] + sum(r.get("shard_peak_rss_mb", [])) for r in series],
            style,
            label=label,
        )
    left.set(xscale="log", yscale="log", xlabel="nodes", ylabel="seconds per round")
    right.set(xscale="log", xlabel="nodes", ylabel="peak RSS (MB)")
    right.axhline(1500, color="grey", linestyle=":", label="1,500 MB at 1,000 nodes (target)")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"in-memory FedAVGP2P, digits, {model}, k = {k}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["plot"]
