"""Class weighting of a site's labelled training split (training.class_weighted)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from p2pfl.config import TrainingSection


def median_frequency_weights(counts: list[int] | np.ndarray) -> Tensor:
    """weight_c = median class frequency / frequency of class c (over the classes
    that occur; 0 for a class without labels): the class weighting of the FedPerl
    reference code, also useful for imbalanced sites under any protocol."""
    counts_arr = np.asarray(counts, dtype=np.float64)
    present = counts_arr > 0
    if not present.any():
        return torch.ones(len(counts_arr))
    weights = np.zeros_like(counts_arr)
    weights[present] = float(np.median(counts_arr[present])) / counts_arr[present]
    return torch.as_tensor(weights, dtype=torch.float32)


def class_weighting(counts: list[int], training: TrainingSection) -> dict[str, Any]:
    """What training.class_weighted means for a labelled train split with these
    class counts: {'mode' (true | false | auto), 'applied', 'imbalance' (largest
    class / smallest class present; 1.0 with fewer than two classes present),
    'threshold', 'class_counts', 'weights' (median-frequency weights, or None
    when not applied)}. `auto` applies the weights when the imbalance exceeds
    training.imbalance_threshold: a skewed site then learns its minority classes
    instead of collapsing to the majority one."""
    present = [int(c) for c in counts if c > 0]
    imbalance = max(present) / min(present) if len(present) >= 2 else 1.0
    mode = training.class_weighted
    applied = imbalance > training.imbalance_threshold if mode == "auto" else bool(mode)
    weights = median_frequency_weights(counts).tolist() if applied else None
    return {
        "mode": str(mode).lower(),
        "applied": applied,
        "imbalance": round(imbalance, 4),
        "threshold": training.imbalance_threshold,
        "class_counts": [int(c) for c in counts],
        "weights": None if weights is None else [round(w, 6) for w in weights],
    }


def log_class_prior(counts: list[int] | np.ndarray, num_classes: int) -> Tensor:
    """log p(c) of the site's labelled train split, with add-one smoothing so a
    class the site has never seen still has a finite prior: the term balanced
    softmax (Ren et al. 2020, Eq. 4) adds to the logits in training, so the
    model learns p(x | c) rather than the site's class mix (FedLC, Zhang et al.
    2022, calibrates the logits against label skew the same way)."""
    counts_arr = np.zeros(num_classes, dtype=np.float64)
    given = np.asarray(counts, dtype=np.float64)[:num_classes]
    counts_arr[: len(given)] = given
    prior = (counts_arr + 1.0) / (counts_arr.sum() + num_classes)
    return torch.as_tensor(np.log(prior), dtype=torch.float32)
