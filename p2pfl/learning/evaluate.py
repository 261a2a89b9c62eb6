"""Inference and evaluation of a classifier: class probabilities in batches, the
report of a labelled split, and the inference batch size a CPU runs fastest.
`LocalSite.predict_proba`, `.evaluate` and `.calibrate_eval_batch` are these
applied to one site's model and data.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from p2pfl.config import TrainingSection
from p2pfl.learning.metrics import classification_report

log = logging.getLogger(__name__)

# Inference batch sizes tried once per site on CPU, on this many images.
EVAL_CHUNKS = (16, 32, 64, 128, 256, 512)
EVAL_CHUNK_DEFAULT = 512
CALIBRATION_IMAGES = 256


def predict_proba(
    model: nn.Module,
    x: Tensor,
    *,
    device: torch.device,
    batch_size: int,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    num_classes: int,
) -> Tensor:
    """softmax(model(x)) in eval mode, `batch_size` images at a time on `device`
    under `autocast()`: CPU float32, shape N x num_classes."""
    model.eval()
    out: list[Tensor] = []
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            chunk = x[start : start + batch_size].to(device)
            with autocast():
                logits = model(chunk)
            out.append(torch.softmax(logits.float(), dim=1).cpu())
    if not out:
        return torch.zeros(0, num_classes)
    return torch.cat(out)


def split_report(proba: Tensor, labels: Tensor, num_classes: int, split: str) -> dict[str, Any]:
    """classification_report of predicted probabilities against `labels`, plus
    'loss' (their negative log-likelihood), 'split' and 'n'."""
    report = classification_report(labels.numpy(), proba.numpy(), num_classes=num_classes)
    nll = -proba[torch.arange(len(labels)), labels].clamp_min(1e-12).log()
    report["loss"] = float(nll.mean())
    # the mean over the classes present of each class's mean NLL: the proper
    # scoring rule that weighs a rare class as much as a common one, as
    # macro-F1 and balanced accuracy do (training.select_by balanced_loss)
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.bincount(labels, weights=nll.double(), minlength=num_classes)
    present = counts > 0
    report["balanced_loss"] = (
        float((sums[present] / counts[present]).mean()) if present.any() else None
    )
    report["classes_present"] = int(present.sum())
    report["split"] = split
    report["n"] = len(labels)
    return report


# fastest_batch_size's answers in this process, by what decides them: the
# model's class and parameter shapes, the forward timed, the images' shape and
# dtype, and torch's thread count. An in-memory federation builds many sites of
# one model in one process; timing the same thing again for each (12 passes
# over CALIBRATION_IMAGES images, more than a small site's whole evaluation)
# only added noise and CPU time.
_FASTEST: dict[tuple[Any, ...], int] = {}


def _calibration_key(
    model: nn.Module, forward: Callable[[Tensor], Tensor], sample: Tensor
) -> tuple[Any, ...]:
    return (
        type(model).__qualname__,
        tuple((name, tuple(p.shape)) for name, p in model.named_parameters()),
        getattr(forward, "__name__", type(forward).__qualname__),
        tuple(sample.shape[1:]),
        sample.dtype,
        torch.get_num_threads(),
    )


def fastest_batch_size(
    model: nn.Module, forward: Callable[[Tensor], Tensor], sample: Tensor
) -> int:
    """On CPU the fastest inference batch size depends on the model, the image
    size and the caches (the small CNN at 28 px runs 2.9x faster in batches of
    32 than of 512 here, resnet18 the other way round): time `forward` (the
    model's, or a Siamese model's embedding) over `sample` in each of
    EVAL_CHUNKS, twice, in eval mode, and return the fastest. `model` is left in
    the mode it was in. Timed once per process for each model, forward, image
    shape and thread count (`_FASTEST`)."""
    key = _calibration_key(model, forward, sample)
    if key in _FASTEST:
        return _FASTEST[key]
    was_training = model.training
    model.eval()
    timings: dict[int, float] = {}
    with torch.no_grad():
        for _ in range(2):
            for size in EVAL_CHUNKS:
                start = time.perf_counter()
                for i in range(0, len(sample), size):
                    forward(sample[i : i + size])
                took = time.perf_counter() - start
                timings[size] = min(took, timings.get(size, took))
    model.train(was_training)
    fastest = min(timings, key=lambda size: timings[size])
    log.debug("inference batch size %d (seconds per sample: %s)", fastest, timings)
    _FASTEST[key] = fastest
    return fastest


# balanced accuracy and AUROC (one-vs-rest) come from the same classification
# report as macro-F1: logging them each round costs nothing, and gives the
# best-on-validation model (best_*) and the per-site gain table all three.
HEADLINE_KEYS = ("macro_f1", "accuracy", "balanced_accuracy", "auc")
CALIBRATION_KEYS = ("macro_f1", "accuracy", "balanced_accuracy", "ece", "mce", "auc")


# What chooses among a site's models on its validation split (the round kept as
# best, the fine-tuning epoch, personal or federated): training.select_by's
# figure of the val split, as a score where higher wins.
SCORE_KEY = "val_score"
VAL_CLASSES_KEY = "val_classes"


def select_by(site: Any) -> str:
    """training.select_by of the site (its default where a site has no training
    section)."""
    training = getattr(site, "training", None) or TrainingSection()
    return str(training.select_by)


def selection_score(report: dict[str, Any], by: str) -> float | None:
    """The split report's `by` figure as a score where higher wins (None where
    the figure is undefined or not finite, e.g. a diverged model's NaN
    probabilities: a NaN best would never be beaten): macro_f1 as it is,
    balanced_loss negated."""
    if by not in ("macro_f1", "balanced_loss"):
        raise ValueError(f"unknown training.select_by {by!r}: use macro_f1 or balanced_loss")
    value = report.get(by)
    if value is None or not math.isfinite(float(value)):
        return None
    return float(value) if by == "macro_f1" else -float(value)


def evaluate_site(site: Any, test_keys: tuple[str, ...] = HEADLINE_KEYS) -> dict[str, Any]:
    """A site's round metrics: `test_keys` of its test split (the headline
    macro-F1, accuracy, balanced accuracy and AUC, None where the split lacks a
    class; CALIBRATION_KEYS adds ECE and MCE), `val_macro_f1`/`val_accuracy`/
    `val_balanced_loss` of its val split, the score that chooses among its
    models (SCORE_KEY) and the number of classes the val split holds
    (VAL_CLASSES_KEY), whichever splits exist, and `per_class_f1` of val (else
    test), which the node gossips for the F1 peer-selection heuristic."""
    out: dict[str, Any] = {}
    reports = site.evaluate_available()
    if "test" in reports:
        for key in test_keys:
            out[key] = reports["test"][key]
    if "val" in reports:
        out["val_macro_f1"] = reports["val"]["macro_f1"]
        out["val_accuracy"] = reports["val"]["accuracy"]
        out["val_balanced_loss"] = reports["val"].get("balanced_loss")
        out[SCORE_KEY] = selection_score(reports["val"], select_by(site))
        # how many classes the val split holds: with fewer than two, its score
        # cannot choose among models (p2pfl.learning.best.CHOOSING_CLASSES)
        out[VAL_CLASSES_KEY] = reports["val"].get("classes_present")
    gossip = reports.get("val") or reports.get("test")
    out["per_class_f1"] = list(gossip["per_class_f1"]) if gossip else None
    return out
