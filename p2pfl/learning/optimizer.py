"""A site's local optimizer: built from the `training:` section, and its state
saved and restored in a codec-friendly form (string keys, tensors, plain
values) for checkpoints and data-parallel workers."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from p2pfl.config import TrainingSection


def build_optimizer(model: nn.Module, training: TrainingSection) -> torch.optim.Optimizer:
    """Adam or SGD (training.optimizer) over the trainable parameters, with
    training.lr and training.weight_decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    if training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=training.lr, weight_decay=training.weight_decay)
    return torch.optim.Adam(params, lr=training.lr, weight_decay=training.weight_decay)


def export_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with string parameter ids and CPU tensor clones."""
    raw = optimizer.state_dict()
    state = {
        str(pid): {
            k: (v.detach().cpu().clone() if isinstance(v, Tensor) else v) for k, v in entry.items()
        }
        for pid, entry in raw["state"].items()
    }
    return {"state": state, "param_groups": raw["param_groups"]}


def import_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load what `export_optimizer_state` gave into `optimizer`."""
    restored = {
        "state": {int(pid): dict(entry) for pid, entry in saved["state"].items()},
        "param_groups": [dict(g) for g in saved["param_groups"]],
    }
    optimizer.load_state_dict(restored)
