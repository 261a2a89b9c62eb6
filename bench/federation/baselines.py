"""The baselines measured in the same run, in this process, on the same
partition files, model, epochs, batch size, lr, seed and rounds as the
federation (bench/baselines.py): standalone (every site alone), centralized
FedAvg and pooled (centralized) training, plus centralized FedSGD for
fedsgdp2p. Each keeps every site's best model on its validation split, as the
nodes do."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.baselines import (
    BaselineResult,
    centralized_fedavg,
    centralized_fedsgd,
    pooled,
    standalone,
)
from bench.federation.specs import RunSpec, in_process_configs, one_torch_thread


def _baseline_figures(result: BaselineResult, threshold: float) -> dict[str, Any]:
    final = result.final()
    best = result.final("best_macro_f1")
    return {
        "macro_f1_by_node": final,
        "macro_f1_mean_by_round": result.mean_by_round(),
        "best_macro_f1_by_node": best,
        "best_macro_f1": statistics.fmean(best.values()) if best else None,
        "rounds_to_threshold": result.rounds_to_threshold(threshold),
        "wall_s": round(result.wall_s, 2),
        "_mean": statistics.fmean(final.values()) if final else None,
    }


def compute_baselines(
    spec: RunSpec, sources: Sequence[Path], state_root: Path, threshold: float
) -> dict[str, Any]:
    """Standalone, centralized FedAvg and pooled training in this process, on
    the same partition files, model, epochs and rounds as the federation."""
    one_torch_thread()
    configs = in_process_configs(spec, sources, state_root)
    alone = _baseline_figures(standalone(configs, rounds=spec.rounds), threshold)
    central = _baseline_figures(centralized_fedavg(configs, rounds=spec.rounds), threshold)
    union = _baseline_figures(pooled(configs, rounds=spec.rounds), threshold)
    out = {
        "standalone": {"macro_f1_mean": alone.pop("_mean"), **alone},
        "centralized": {"macro_f1": central.pop("_mean"), **central},
        "pooled": {"macro_f1": union.pop("_mean"), **union},
    }
    if spec.protocol == "fedsgdp2p":
        sgd = _baseline_figures(centralized_fedsgd(configs, rounds=spec.rounds), threshold)
        out["centralized_fedsgd"] = {"macro_f1": sgd.pop("_mean"), **sgd}
    return out


def baseline_by_round(baseline: dict[str, Any]) -> dict[int, float]:
    """A baseline's mean macro-F1 per round (results.json keys are strings)."""
    return {int(k): v for k, v in baseline["macro_f1_mean_by_round"].items()}
