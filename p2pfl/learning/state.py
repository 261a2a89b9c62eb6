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


# An entry described on its own has at least this many values: (mean, std) of
# n values fix 2 of them, so an entry of 1 or 2 values was given exactly (a
# review, 2026-11-27: the classifier bias of a binary task, which shows the
# site's label skew, in SSFL/FedPerl's gossip of the model it had just trained,
# with secure aggregation on). Smaller entries are described together.
DESCRIBED_ALONE = 64


def feature_vector(state: Mapping[str, Tensor]) -> list[float]:
    """A model's description (FedPerl's F_m, the cosine heuristic's model
    statistics): (mean, unbiased std) of every averaged entry of at least
    DESCRIBED_ALONE values, in key order, then of all smaller averaged entries
    pooled into one (biases, normalization layers). A pool itself under
    DESCRIBED_ALONE values (resnet18: its 2-value fc.bias alone, which a second
    review read back from the pool) joins the last entry described instead; a
    model with no entry that large (a toy) is described as one pool. std 0.0
    for one value, where it is undefined. Every node of a federation has the
    same entries, so the vectors line up."""
    alone: list[Tensor] = []
    pooled: list[Tensor] = []
    for key, value in state.items():
        if not is_averaged(key, value):
            continue
        flat = value.detach().to(torch.float64).flatten()
        (alone if flat.numel() >= DESCRIBED_ALONE else pooled).append(flat)
    pool = torch.cat(pooled) if pooled else None
    if pool is not None and pool.numel() < DESCRIBED_ALONE and alone:
        alone[-1], pool = torch.cat([alone[-1], pool]), None
    out: list[float] = []
    for flat in [*alone, *([] if pool is None else [pool])]:
        out.extend(_mean_std(flat))
    return out


def _mean_std(flat: Tensor) -> list[float]:
    mean = float(flat.mean()) if flat.numel() else 0.0
    return [mean, float(flat.std(unbiased=True)) if flat.numel() > 1 else 0.0]
