"""The baselines measured in the same run, in this process, on the same
partition files, model, epochs, batch size, lr, seed and rounds as the
federation (bench/baselines.py): standalone (every site alone), centralized
FedAvg and pooled (centralized) training, plus centralized FedSGD for
fedsgdp2p. Each keeps every site's best model on its validation split, as the
nodes do.

With per-site (local) test splits, the models each site reports (standalone:
its best on validation; pooled: its one best model) are also scored on the
source's whole test split, the global test set (`global_test`), which is what
a model is worth on the population rather than on the site's own class mix
(run_benchmark moves it to results.json's top level).
`score_states` does the same for the nodes' checkpointed models."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.baselines import (
    BaselineResult,
    centralized_fedavg,
    centralized_fedsgd,
    pooled,
    standalone,
)
from bench.federation.specs import RunSpec, in_process_configs, one_torch_thread
from p2pfl.learning.data.loaders import convert_images, to_float_tensor
from p2pfl.learning.data.sources import read_source
from p2pfl.learning.metrics import classification_report
from p2pfl.learning.train import LocalSite
from protocols.site import build_site

GLOBAL_KEYS = ("macro_f1", "balanced_accuracy", "auc", "accuracy")

# A site's figures kept per baseline (`per_site`): the latest and the best-on-
# validation model's, for the per-site gain table (stats.site_gain_table).
SITE_KEYS = tuple(
    f"{prefix}{key}"
    for prefix in ("", "best_")
    for key in ("macro_f1", "accuracy", "balanced_accuracy", "auc")
) + ("best_round",)


def per_site_last(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """node -> SITE_KEYS of its record of the last round it logged."""
    last: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["round"] >= last.get(r["node"], {"round": -1})["round"]:
            last[r["node"]] = r
    return {
        node: {k: r[k] for k in ("round", *SITE_KEYS) if r.get(k) is not None}
        for node, r in sorted(last.items())
    }


def _baseline_figures(result: BaselineResult, threshold: float) -> dict[str, Any]:
    final = result.final()
    best = result.final("best_macro_f1")
    return {
        "per_site": per_site_last(result.records),
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
    alone_result = standalone(configs, rounds=spec.rounds)
    alone = _baseline_figures(alone_result, threshold)
    central = _baseline_figures(centralized_fedavg(configs, rounds=spec.rounds), threshold)
    union_result = pooled(configs, rounds=spec.rounds)
    union = _baseline_figures(union_result, threshold)
    out: dict[str, Any] = {
        "standalone": {"macro_f1_mean": alone.pop("_mean"), **alone},
        "centralized": {"macro_f1": central.pop("_mean"), **central},
        "pooled": {"macro_f1": union.pop("_mean"), **union},
    }
    if spec.protocol == "fedsgdp2p":
        sgd = _baseline_figures(centralized_fedsgd(configs, rounds=spec.rounds), threshold)
        out["centralized_fedsgd"] = {"macro_f1": sgd.pop("_mean"), **sgd}
    if spec.test_split == "local":
        evaluator = build_site(configs[0])
        scored = score_states(spec, evaluator, alone_result.best_states)
        if scored is not None:
            pooled_scores = score_states(spec, evaluator, union_result.best_states) or {}
            by_site = scored.pop("models")
            out["global_test"] = {
                **scored,
                "standalone": by_site,
                "standalone_macro_f1_mean": _round_mean([f["macro_f1"] for f in by_site.values()]),
                "pooled": pooled_scores.get("models", {}).get("pooled"),
            }
    return out


def _round_mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def score_states(
    spec: RunSpec, evaluator: LocalSite, states: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    """Each model of `states` (name -> state dict) on the global test set (the
    source's whole test split, prepared as the sites' data is): {"n",
    "per_class", "models": name -> GLOBAL_KEYS}; None when the source has no
    test split. `evaluator` is any site of the run (its model's architecture)."""
    pair = read_source(spec.data).split("test")
    if pair is None:
        return None
    images = convert_images(pair[0], evaluator.data.image_size, evaluator.data.channels)
    x = to_float_tensor(images)
    labels = pair[1]
    models: dict[str, dict[str, Any]] = {}
    for name, state in states.items():
        evaluator.load_state_dict(state)
        report = classification_report(
            labels, evaluator.predict_proba(x).numpy(), num_classes=evaluator.num_classes
        )
        models[name] = {
            k: None if report[k] is None else round(float(report[k]), 4) for k in GLOBAL_KEYS
        }
    counts = [int(n) for n in np.bincount(labels, minlength=evaluator.num_classes)]
    return {"n": int(len(labels)), "per_class": counts, "models": models}


def baseline_by_round(baseline: dict[str, Any]) -> dict[int, float]:
    """A baseline's mean macro-F1 per round (results.json keys are strings)."""
    return {int(k): v for k, v in baseline["macro_f1_mean_by_round"].items()}
