"""A site's local optimizer: built from the `training:` section, its learning
rate over the protocol's rounds (`lr_factor`), and its state saved and
restored in a codec-friendly form (string keys, tensors, plain values) for
checkpoints and data-parallel workers."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor, nn

from p2pfl.config import TrainingSection

log = logging.getLogger(__name__)


def build_optimizer(
    model: nn.Module, training: TrainingSection, lr_factor: float = 1.0
) -> torch.optim.Optimizer:
    """Adam or SGD (training.optimizer) over the trainable parameters, with
    training.lr x lr_factor and training.weight_decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    lr = training.lr * lr_factor
    if training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=training.weight_decay)
    return torch.optim.Adam(params, lr=lr, weight_decay=training.weight_decay)


def lr_factor(training: TrainingSection, round_no: int, rounds: int) -> float:
    """training.lr_schedule's factor of training.lr in `round` (1-based) of `rounds`:
    - constant: 1;
    - cosine: 1 in round 1 down to lr_min_factor in the last round,
      lr_min_factor + (1 - lr_min_factor) * (1 + cos(pi * (round - 1) / (rounds - 1))) / 2;
    - step: lr_gamma ** ((round - 1) // lr_step_rounds).
    The factor holds for a whole round, so every protocol (and every baseline)
    follows the same schedule whatever its steps per round. Rounds past `rounds`
    (a protocol asked to go on) keep the last round's factor."""
    if rounds < 1 or round_no < 1:
        raise ValueError(f"round {round_no} of {rounds}: both must be at least 1")
    round_no = min(round_no, rounds)
    if training.lr_schedule == "cosine":
        if rounds == 1:
            return 1.0
        progress = (round_no - 1) / (rounds - 1)
        floor = training.lr_min_factor
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if training.lr_schedule == "step":
        return training.lr_gamma ** ((round_no - 1) // training.lr_step_rounds)
    return 1.0


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
    """Load what `export_optimizer_state` gave into `optimizer`; nothing when
    it is another optimizer's state (its groups lack this one's settings: SGD's
    under training.dp, resumed after training.dp was taken out, stopped Adam's
    first step on KeyError 'betas', review r1), which starts afresh."""
    groups = saved["param_groups"]
    given = set().union(*map(set, groups)) if groups else set()
    # a flag (bool or None) a newer torch added is filled in by torch itself
    missing = sorted(
        k
        for k, v in optimizer.defaults.items()
        if k not in given and not isinstance(v, bool | None)
    )
    if missing:
        log.warning(
            "the checkpoint's optimizer state is another optimizer's (it has no %s): "
            "the optimizer starts afresh",
            ", ".join(missing[:3]),
        )
        return
    restored = {
        "state": {int(pid): dict(entry) for pid, entry in saved["state"].items()},
        "param_groups": [dict(g) for g in saved["param_groups"]],
    }
    optimizer.load_state_dict(restored)
