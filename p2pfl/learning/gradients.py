"""Gradients as messages (FedSGDP2P): a model's gradients by name, and back.

`LocalSite.compute_gradient` and `.apply_gradient` are the calls protocols
make; these are the parts that read gradients off a model and put received
ones onto it, checked against the model first.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from p2pfl.learning.errors import TrainingError


def gradients_by_name(model: nn.Module) -> dict[str, Tensor]:
    """The gradient of every trainable parameter, by name, as CPU float32 clones
    (zeros where a parameter got none)."""
    grads: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        grads[name] = grad.detach().float().cpu().clone()
    return grads


def set_gradients(model: nn.Module, grads: dict[str, Tensor]) -> None:
    """Put `grads` in the model's trainable parameters' .grad (device and dtype
    of each parameter). A name missing, unknown or of another shape raises
    TrainingError, before any .grad is set."""
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in grads]
    unknown = [n for n in grads if n not in params]
    if missing or unknown:
        raise TrainingError(
            "gradient_mismatch",
            f"gradient names do not match the model: missing {missing[:3]}, unknown {unknown[:3]} "
            "— all sites must use the same model.name and data shape",
        )
    for name, param in params.items():
        if param.requires_grad and tuple(grads[name].shape) != tuple(param.shape):
            raise TrainingError(
                "gradient_mismatch",
                f"gradient {name} has shape {tuple(grads[name].shape)}, "
                f"model has {tuple(param.shape)}",
            )
    for name, param in params.items():
        if param.requires_grad:
            param.grad = grads[name].to(device=param.device, dtype=param.dtype)
