"""`p2pfl-node evaluate`: cross-site and ensemble evaluation of node models.

Every node model (the latest checkpoint in each state dir) is evaluated on every
site's test split; per model the mean +/- std across sites measures how well
the federation converged (FedER Table 3). `--ensemble` averages the softmax of
all node models (FedER Table 5). This reads every listed site's data and
checkpoints, so it is a tool for a federation's own benchmark or a joint
audit, run where all those files are; a hospital node never runs it on its own.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from node.queues import Checkpoints
from p2pfl.config import ConfigError, SiteConfig, load_config
from p2pfl.errors import UserError
from p2pfl.files import atomic_write_text
from p2pfl.learning.metrics import classification_report
from p2pfl.learning.train import LocalSite


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", action="append", default=[], help="a site.yaml (repeat for every site)"
    )
    parser.add_argument("--federation-dir", type=Path, help="every DIR/*/site.yaml")
    parser.add_argument("--split", default="test", choices=["test", "val"])
    parser.add_argument(
        "--model",
        dest="which",
        default="latest",
        choices=list(WHICH_MODELS),
        help="each node's latest model; federated: its best federated model on its own "
        "validation split (its latest where that split holds one class); personal: its personal model; best: whichever of the two the "
        "site chose on its validation split (what it reports)",
    )
    parser.add_argument(
        "--ensemble",
        action="store_true",
        help="also evaluate the softmax ensemble of all node models",
    )
    parser.add_argument("--json", type=Path, help="write the full results here")


WHICH_MODELS = ("latest", "best", "federated", "personal")


def latest_model(cfg: SiteConfig, path: Path, which: str = "latest") -> dict[str, torch.Tensor]:
    """The node's latest model, or (`which="best"`) its best on its own
    validation split, from its last checkpoint."""
    return checkpointed_model(cfg, path, which)[0]


# which -> (where a checkpoint keeps it, why it may not, what to do instead)
KEPT_MODELS = {
    "personal": (
        ("personal", "best"),
        "no personal model (training.personalization.method none, no validation split, "
        "or the run has not reached its last round)",
        "export --which federated (or best), or run with personalization",
    ),
    "federated": (
        ("best",),
        "no best model (the site has no validation split, or the node ran before best "
        "models were kept)",
        "evaluate --model latest, or give the site a val split (data.val_fraction)",
    ),
}


@dataclass
class Checkpointed:
    """A model read from the node's last checkpoint: its weights, the round it
    is the model of, which model it is (`best` resolved to personal or
    federated), the site's personalization choice (None before it) and the
    checkpoint's whole protocol state (its round, dp_history, ...)."""

    state: dict[str, torch.Tensor]
    round: int | None
    which: str
    choice: dict[str, Any] | None
    saved: dict[str, Any] = field(default_factory=dict)


def read_checkpointed(cfg: SiteConfig, path: Path, which: str = "latest") -> Checkpointed:
    """One read of the last checkpoint: the model `which` (one of WHICH_MODELS)
    names, with the choice that resolves `best`."""
    state = Checkpoints(Path(cfg.node.state_dir) / "checkpoints").latest()
    if not state or not isinstance(state.get("protocol"), dict) or "model" not in state["protocol"]:
        raise ConfigError(
            path,
            "node.state_dir",
            f"no checkpoint with a model in {cfg.node.state_dir}/checkpoints",
            "run the node first",
        )
    saved = state["protocol"]
    choice = _dict_at(saved, ("personal", "choice"))
    if which == "best":  # the model the site reports: chosen on its validation split
        which = "personal" if (choice or {}).get("reported") == "personal" else "federated"
    if which not in KEPT_MODELS:
        return Checkpointed(saved["model"], _round_of(saved), which, choice, saved)
    keys, missing, hint = KEPT_MODELS[which]
    entry = _dict_at(saved, keys)
    if entry is None or not isinstance(entry.get("model"), dict):
        raise ConfigError(
            path,
            "node.state_dir",
            f"the last checkpoint in {cfg.node.state_dir}/checkpoints keeps {missing}",
            hint,
        )
    return Checkpointed(entry["model"], _round_of(entry), which, choice, saved)


def checkpointed_model(
    cfg: SiteConfig, path: Path, which: str = "latest"
) -> tuple[dict[str, torch.Tensor], int | None]:
    """(`latest_model`'s model, the round it is the model of) from one read of
    the last checkpoint; `which` is one of WHICH_MODELS."""
    found = read_checkpointed(cfg, path, which)
    return found.state, found.round


def _dict_at(saved: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any] | None:
    """saved[k1][k2]... when every step is a dict, else None."""
    value: Any = saved
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, dict) else None


def _round_of(entry: dict[str, Any]) -> int | None:
    value = entry.get("round")
    return value if isinstance(value, int) else None


def cross_site(
    sites: dict[str, LocalSite],
    models: dict[str, dict[str, torch.Tensor]],
    split: str,
    ensemble: bool,
) -> dict[str, Any]:
    """probabilities of each model on each site's split -> reports."""
    evaluator = next(iter(sites.values()))
    probs: dict[str, dict[str, torch.Tensor]] = {}  # model -> site -> proba
    labels: dict[str, np.ndarray] = {}
    for site_name, site in sites.items():
        x, y = getattr(site.data, split).tensors
        labels[site_name] = y.numpy()
        for model_name, state in models.items():
            evaluator.load_state_dict(state)
            probs.setdefault(model_name, {})[site_name] = evaluator.predict_proba(x)
    matrix: dict[str, dict[str, dict[str, Any]]] = {}
    summary: dict[str, dict[str, float]] = {}
    for model_name, per_site in probs.items():
        matrix[model_name] = {
            s: classification_report(labels[s], p.numpy(), evaluator.num_classes)
            for s, p in per_site.items()
        }
        for metric in ("accuracy", "balanced_accuracy", "macro_f1"):
            values = [r[metric] for r in matrix[model_name].values()]
            summary.setdefault(model_name, {})[f"{metric}_mean"] = float(np.mean(values))
            summary[model_name][f"{metric}_std"] = float(np.std(values))
    out: dict[str, Any] = {"split": split, "matrix": matrix, "per_model": summary}
    for metric in ("accuracy", "balanced_accuracy", "macro_f1"):
        all_values = [r[metric] for per in matrix.values() for r in per.values()]
        out[f"{metric}_mean"] = float(np.mean(all_values))
        out[f"{metric}_std"] = float(np.std(all_values))
    if ensemble:
        reports = {}
        for site_name in sites:
            mean_p = torch.stack([probs[m][site_name] for m in models]).mean(0)
            reports[site_name] = classification_report(
                labels[site_name], mean_p.numpy(), evaluator.num_classes
            )
        out["ensemble"] = {
            "per_site": reports,
            **{
                f"{m}_mean": float(np.mean([r[m] for r in reports.values()]))
                for m in ("accuracy", "balanced_accuracy", "macro_f1")
            },
        }
    return out


def run_evaluate(args: argparse.Namespace) -> int:
    paths = [Path(p) for p in args.config]
    if args.federation_dir:
        paths += sorted(Path(args.federation_dir).glob("*/site.yaml"))
    if not paths:
        raise UserError("evaluate: give --config SITE.yaml (repeatable) or --federation-dir DIR")
    configs = {p: load_config(p, check_files=False) for p in paths}
    sites = {cfg.node.name: LocalSite.from_config(cfg) for cfg in configs.values()}
    models = {cfg.node.name: latest_model(cfg, p, args.which) for p, cfg in configs.items()}
    result = cross_site(sites, models, args.split, args.ensemble)
    names = list(sites)
    print(
        f"{'model':<12}"
        + "".join(f"{n:>10}" for n in names)
        + f"{'mean':>10}{'std':>8}   ({args.split} macro-F1)"
    )
    for model_name in names:
        row = result["matrix"][model_name]
        s = result["per_model"][model_name]
        print(
            f"{model_name:<12}"
            + "".join(f"{row[n]['macro_f1']:>10.3f}" for n in names)
            + f"{s['macro_f1_mean']:>10.3f}{s['macro_f1_std']:>8.3f}"
        )
    print(
        f"all node models on all sites: macro-F1 {result['macro_f1_mean']:.3f} +/- {result['macro_f1_std']:.3f}, accuracy {result['accuracy_mean']:.3f} +/- {result['accuracy_std']:.3f}"
    )
    if args.ensemble:
        e = result["ensemble"]
        print(
            f"ensemble of {len(models)} models: macro-F1 {e['macro_f1_mean']:.3f}, accuracy {e['accuracy_mean']:.3f}"
        )
    if args.json:
        # atomic (a crash leaves the earlier file, never half of one), a link at the
        # name replaced rather than written through, this account's only as every
        # figure of every site's test split is (it took the umask, through a link)
        atomic_write_text(args.json, json.dumps(result, indent=2))
    print(
        json.dumps(
            {k: v for k, v in result.items() if k.endswith(("_mean", "_std"))}
            | ({"ensemble_macro_f1": result["ensemble"]["macro_f1_mean"]} if args.ensemble else {})
        )
    )
    return 0
