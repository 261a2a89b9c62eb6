"""Which torch device a setting names: one rule for training and the GAN."""

from __future__ import annotations

import torch

from p2pfl.learning.errors import TrainingError


def resolve_device(name: str = "auto", *, setting: str = "training.device") -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error
    that names the `setting` to change."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TrainingError(
            "no_cuda",
            f"{setting} is {name!r} but no CUDA device is available — set {setting} to 'auto' or 'cpu'",
        )
    return torch.device(name)
