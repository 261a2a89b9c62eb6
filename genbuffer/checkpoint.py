"""Generator files and resumable training state: torch.save of plain dicts, read with weights_only=True.

Every file is written 0600 (PRIVATE_FILE): a generator, a discriminator or a
classifier trained on a site's images can be made to give them back (the
projection audit, projection.py, is that attack), so they are as private as the
images themselves.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2pfl.files import PRIVATE_FILE, atomic_torch_save

from .errors import CheckpointError
from .stylegan2 import Generator, GeneratorSpec

GENERATOR_FORMAT = "p2pfl-genbuffer-generator"
TRAINING_STATE_FORMAT = "p2pfl-genbuffer-training-state"
FORMAT_VERSION = 1


@dataclass
class GeneratorInfo:
    """What a generator file says about itself besides its weights."""

    spec: GeneratorSpec
    label_prior: list[float]
    stage: str
    quality: float | None = None
    iterations: int = 0
    alpha: float = 0.0
    lpips_backbone: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def safe_torch_load(path: Path, expected_format: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(
            "checkpoint_missing", f"{path}: file not found — run `p2pfl-node genbuffer train` first"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            "checkpoint_unreadable",
            f"{path}: holds Python objects besides tensors, which are never unpickled "
            "(weights_only=True) — not a genbuffer file",
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(
            "checkpoint_unreadable", f"{path}: cannot read ({exc}) — delete it and train again"
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != expected_format:
        raise CheckpointError("checkpoint_format", f"{path}: not a {expected_format} file")
    if obj.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            "checkpoint_version",
            f"{path}: format version {obj.get('version')}, expected {FORMAT_VERSION}",
        )
    return obj


def save_generator(path: Path, generator: Generator, info: GeneratorInfo) -> None:
    atomic_torch_save(
        {
            "format": GENERATOR_FORMAT,
            "version": FORMAT_VERSION,
            "spec": generator.spec.to_dict(),
            "state_dict": {k: v.detach().cpu() for k, v in generator.state_dict().items()},
            "label_prior": [float(x) for x in info.label_prior],
            "stage": info.stage,
            "quality": info.quality,
            "iterations": info.iterations,
            "alpha": info.alpha,
            "lpips_backbone": info.lpips_backbone,
            "extra": info.extra,
        },
        path,
        mode=PRIVATE_FILE,
    )


def load_generator(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Generator, GeneratorInfo]:
    """Rebuild a generator saved by `save_generator` (eval mode, on `device`)."""
    path = Path(path)
    obj = safe_torch_load(path, GENERATOR_FORMAT)
    try:
        spec = GeneratorSpec(**obj["spec"])
        generator = Generator(spec)
        generator.load_state_dict(obj["state_dict"])
    except (KeyError, TypeError, RuntimeError, ValueError) as exc:
        raise CheckpointError(
            "checkpoint_mismatch", f"{path}: weights do not fit the stored spec ({exc})"
        ) from None
    info = GeneratorInfo(
        spec=spec,
        label_prior=list(obj.get("label_prior", [])),
        stage=str(obj.get("stage", "")),
        quality=obj.get("quality"),
        iterations=int(obj.get("iterations", 0)),
        alpha=float(obj.get("alpha", 0.0)),
        lpips_backbone=str(obj.get("lpips_backbone", "")),
        extra=dict(obj.get("extra", {})),
    )
    return generator.to(device).eval(), info
