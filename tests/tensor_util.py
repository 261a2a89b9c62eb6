"""What tests look for in payloads."""

from __future__ import annotations

from typing import Any

import torch


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a payload tree (dicts and lists)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in tensors_in(v)]
    return []
