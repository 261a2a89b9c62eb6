"""The checks a peer's tensors pass before they are merged into this node's model.

A refused input is counted by the caller through `RoundContext.reject` with the
reason returned here (prefixed by what it was: `model_`, `grad_`, ...).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def incompatibility(
    state: Any, reference: dict[str, Tensor], *, max_norm_ratio: float | None = None
) -> str | None:
    """Why a peer's state dict cannot be merged with ours (None if it can):
    other keys, shapes or dtypes, non-finite values, or (with `max_norm_ratio`)
    an L2 norm more than that many times ours."""
    if not isinstance(state, dict):
        return "not_a_state_dict"
    if set(state) != set(reference):
        return "key_mismatch"
    for key, ref in reference.items():
        value = state[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(ref.shape):
            return "shape_mismatch"
        if value.dtype != ref.dtype:
            return "dtype_mismatch"
        if value.is_floating_point() and value.numel() and not bool(torch.isfinite(value).all()):
            return "non_finite"
    if max_norm_ratio is not None:
        theirs, ours = float_norm(state), float_norm(reference)
        if theirs > max_norm_ratio * max(ours, 1e-12):
            return "huge_norm"
    return None


def float_norm(state: dict[str, Tensor]) -> float:
    """L2 norm over every floating-point entry, in float64."""
    total = 0.0
    for value in state.values():
        if value.is_floating_point():
            total += float(value.detach().double().square().sum())
    return total**0.5
