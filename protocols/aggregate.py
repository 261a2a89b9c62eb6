"""Aggregation of model state dicts: pure functions over dict[str, Tensor].

`states[own]` is this node's model; the others are its neighbours'. Every
function returns a new state dict with the keys and dtypes of `states[own]`.

- `weighted_mean`: FedAvg's sum_k (n_k / n) w_k (DFU Alg. 2 line 9, applied
  by each node to itself and its neighbours in FedAVGP2P).
- `coordinate_median`, `trimmed_mean`: robust to a minority of arbitrary
  models (coordinate-wise median / beta-trimmed mean, Yin et al. 2018).
- `norm_clip`: each neighbour's update w_j - w_own is scaled down to at most
  `clip_norm` in L2 norm (all float entries together) before the weighted mean,
  so one huge update cannot drag the model far.
- `aggregate_gradients`: the same methods over FedSGDP2P's gradients. A
  gradient is already an update (the step from the model every node shares), so
  norm_clip there clips each neighbour's gradient itself (its update measured
  from zero, not from our own gradient); our own gradient is never clipped.

The weights are sample counts (or batch sizes) the peers claim: callers cap
them first (protocols.checks.cap_weights). Median and trimmed mean ignore them.

Non-float entries (BatchNorm's `num_batches_tracked`, integer buffers) are
not averaged: the node keeps its own value. Arithmetic runs in float64 and is
cast back to each entry's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from p2pfl.learning.state import is_averaged

StateDict = Mapping[str, Tensor]
Method = Literal["mean", "median", "trimmed_mean", "norm_clip"]


class AggregationError(ValueError):
    """States that cannot be combined; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _check(states: Sequence[StateDict], own: int, weights: Sequence[float] | None = None) -> None:
    if not states:
        raise AggregationError("no_states", "nothing to aggregate")
    if not 0 <= own < len(states):
        raise AggregationError(
            "bad_own_index", f"own={own} is not an index of {len(states)} states"
        )
    reference = states[own]
    for i, state in enumerate(states):
        if set(state) != set(reference):
            missing = sorted(set(reference) - set(state))[:3]
            extra = sorted(set(state) - set(reference))[:3]
            raise AggregationError(
                "key_mismatch", f"state {i} does not match ours: missing {missing}, extra {extra}"
            )
        for key, value in state.items():
            if tuple(value.shape) != tuple(reference[key].shape):
                raise AggregationError(
                    "shape_mismatch",
                    f"state {i} entry {key} has shape {tuple(value.shape)}, ours {tuple(reference[key].shape)}",
                )
    if weights is not None:
        if len(weights) != len(states):
            raise AggregationError(
                "bad_weights", f"{len(weights)} weights for {len(states)} states"
            )
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise AggregationError(
                "bad_weights", f"weights must be >= 0 with a positive sum, got {list(weights)}"
            )


def _stack(states: Sequence[StateDict], key: str) -> Tensor:
    return torch.stack([s[key].detach().to("cpu", torch.float64) for s in states])


def _entrywise(
    states: Sequence[StateDict], own: int, combine: Callable[[Tensor], Tensor]
) -> dict[str, Tensor]:
    """combine(the float64 stack of every state's value) for each averaged
    entry, in its own dtype; our own value for the rest."""
    out: dict[str, Tensor] = {}
    for key, mine in states[own].items():
        if not is_averaged(key, mine):
            out[key] = mine.detach().clone()
            continue
        out[key] = combine(_stack(states, key)).to(mine.dtype)
    return out


def weighted_mean(
    states: Sequence[StateDict], weights: Sequence[float], *, own: int = 0
) -> dict[str, Tensor]:
    """sum_k (w_k / sum w) * state_k for float entries; our own value for the rest."""
    _check(states, own, weights)
    total = float(sum(weights))
    coeffs = torch.tensor([w / total for w in weights], dtype=torch.float64)
    return _entrywise(states, own, lambda stacked: torch.tensordot(coeffs, stacked, dims=1))


def coordinate_median(states: Sequence[StateDict], *, own: int = 0) -> dict[str, Tensor]:
    """Coordinate-wise median (the mean of the two middle values for an even count)."""
    _check(states, own)
    m = len(states)

    def median(stacked: Tensor) -> Tensor:
        ordered = stacked.sort(dim=0).values
        return ordered[m // 2] if m % 2 else 0.5 * (ordered[m // 2 - 1] + ordered[m // 2])

    return _entrywise(states, own, median)


def trimmed_mean(
    states: Sequence[StateDict], trim_ratio: float, *, own: int = 0
) -> dict[str, Tensor]:
    """Coordinate-wise mean after cutting the floor(trim_ratio * m) largest and
    smallest values of each coordinate (m = number of states); with too few
    states to cut anything it is the plain mean."""
    if not 0.0 <= trim_ratio < 0.5:
        raise AggregationError(
            "bad_trim_ratio", f"trim_ratio must be in [0, 0.5), got {trim_ratio}"
        )
    _check(states, own)
    m = len(states)
    cut = int(math.floor(trim_ratio * m))

    def trimmed(stacked: Tensor) -> Tensor:
        if cut:
            stacked = stacked.sort(dim=0).values[cut : m - cut]
        return stacked.mean(dim=0)

    return _entrywise(states, own, trimmed)


def update_norm(state: StateDict, reference: StateDict) -> float:
    """L2 norm of state - reference over all float entries together."""
    total = 0.0
    for key, ref in reference.items():
        if is_averaged(key, ref):
            diff = state[key].detach().to("cpu", torch.float64) - ref.detach().to(
                "cpu", torch.float64
            )
            total += float((diff * diff).sum())
    return math.sqrt(total)


def norm_clip(
    states: Sequence[StateDict],
    weights: Sequence[float],
    clip_norm: float | None = None,
    *,
    own: int = 0,
    origin: StateDict | None = None,
) -> dict[str, Tensor]:
    """origin + sum_k (n_k / n) * clip(w_k - origin), where clip scales an update
    down to L2 norm `clip_norm` and `origin` is our own state unless given (a
    gradient's origin is zero: `aggregate_gradients`). Our own update is never
    clipped. Without `clip_norm` the bound adapts, so a lone huge update is cut
    to the size of the typical one: the median of the neighbours' update norms
    (ours is 0 when measured from our own state), or, with an `origin`, the
    lower median of every update norm, ours included (with two, the smaller)."""
    _check(states, own, weights)
    reference = states[own] if origin is None else origin
    if origin is not None:
        _check([states[own], origin], 0)
    norms = [update_norm(s, reference) for s in states]
    if clip_norm is None:
        if len(states) == 1:
            return {k: v.detach().clone() for k, v in states[own].items()}
        if origin is not None:
            clip_norm = sorted(norms)[(len(norms) - 1) // 2]
        else:
            others = sorted(n for i, n in enumerate(norms) if i != own)
            mid = len(others) // 2
            clip_norm = others[mid] if len(others) % 2 else 0.5 * (others[mid - 1] + others[mid])
    elif clip_norm <= 0:
        raise AggregationError("bad_clip_norm", f"clip_norm must be > 0, got {clip_norm}")
    scales = [
        1.0 if i == own or n <= clip_norm or n == 0.0 else clip_norm / n
        for i, n in enumerate(norms)
    ]
    total = float(sum(weights))
    out: dict[str, Tensor] = {}
    for key, mine in states[own].items():
        if not is_averaged(key, mine):
            out[key] = mine.detach().clone()
            continue
        base = reference[key].detach().to("cpu", torch.float64)
        step = torch.zeros_like(base)
        for state, weight, scale in zip(states, weights, scales, strict=True):
            step += (weight / total) * scale * (state[key].detach().to("cpu", torch.float64) - base)
        out[key] = (base + step).to(mine.dtype)
    return out


def aggregate(
    method: Method,
    states: Sequence[StateDict],
    weights: Sequence[float],
    *,
    own: int = 0,
    trim_ratio: float = 0.2,
    clip_norm: float | None = None,
    origin: StateDict | None = None,
) -> dict[str, Tensor]:
    """Dispatch on `protocol.aggregation`. Median and trimmed mean ignore the
    weights (a sample count is a claim a faulty peer can inflate); `origin` is
    where norm_clip measures updates from (default: our own state)."""
    if method == "mean":
        return weighted_mean(states, weights, own=own)
    if method == "median":
        return coordinate_median(states, own=own)
    if method == "trimmed_mean":
        return trimmed_mean(states, trim_ratio, own=own)
    if method == "norm_clip":
        return norm_clip(states, weights, clip_norm, own=own, origin=origin)
    raise AggregationError(
        "unknown_method",
        f"unknown aggregation {method!r}: use mean, median, trimmed_mean or norm_clip",
    )


def aggregate_gradients(
    method: Method,
    grads: Sequence[StateDict],
    weights: Sequence[float],
    *,
    own: int = 0,
    trim_ratio: float = 0.2,
    clip_norm: float | None = None,
) -> dict[str, Tensor]:
    """`aggregate` over gradients (FedSGDP2P). A gradient is itself the update,
    so norm_clip scales each neighbour's gradient down to `clip_norm` (default:
    the lower median of all the gradients' norms, ours included) and takes the
    weighted mean with our own, unclipped, gradient."""
    zero = {k: torch.zeros_like(v) for k, v in grads[own].items()} if grads else None
    return aggregate(
        method,
        grads,
        weights,
        own=own,
        trim_ratio=trim_ratio,
        clip_norm=clip_norm,
        origin=zero,
    )
