"""What of a model's state dict is learned, averaged and described.

One rule for every protocol: floating-point entries (weights, biases,
BatchNorm running statistics) are averaged, masked and described; integer
counters such as BatchNorm's `num_batches_tracked` are each node's own.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def is_averaged(key: str, value: Tensor) -> bool:
    """Whether a state entry takes part in averaging (and masking, and the
    feature vector): floating point and not a counter."""
    return value.is_floating_point() and not key.endswith("num_batches_tracked")


def averaged_keys(state: Mapping[str, Tensor]) -> list[str]:
    """The averaged entries of `state`, sorted by name."""
    return sorted(k for k, v in state.items() if isinstance(v, Tensor) and is_averaged(k, v))


def feature_vector(state: Mapping[str, Tensor]) -> list[float]:
    """A model's description (FedPerl's F_m, the cosine heuristic's model
    statistics): (mean, unbiased std) of every averaged entry, in key order;
    std 0.0 for a one-element entry, where it is undefined."""
    out: list[float] = []
    for key, value in state.items():
        if not is_averaged(key, value):
            continue
        flat = value.detach().to(torch.float64).flatten()
        out.append(float(flat.mean()) if flat.numel() else 0.0)
        out.append(float(flat.std(unbiased=True)) if flat.numel() > 1 else 0.0)
    return out
