"""The `genbuffer:` section of site.yaml, and a loader for a standalone genbuffer YAML.

`load_genbuffer_config` reads either a standalone YAML that holds `genbuffer:`
(and optionally `data:` and `seed:`), or a full site.yaml, of which it uses the
`genbuffer:` and `data:` sections and the seeds and leaves the rest to the
daemon's own validation. Relative paths are taken relative to the YAML file's
folder, like the rest of site.yaml; in a site.yaml, `out_dir` defaults to
`<node.state_dir>/genbuffer`.

`GenbufferSection` depends on pydantic only, so it can move into
p2pfl/config.py as it is when SiteConfig gets its `genbuffer:` section.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from p2pfl.config import ConfigError, DataSection


class GenbufferSection(BaseModel):
    """Privacy-preserving GAN (FedER Sec. 3.2 / 4.2.2), synthetic buffers and the privacy audit."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    # --- network (StyleGAN2) ---------------------------------------------------------------
    resolution: int = Field(32, description="image side the GAN works at: a power of two, 16-256")
    channels: int | None = Field(
        None, ge=1, le=16, description="image channels; default: those of the data"
    )
    z_dim: int = Field(128, ge=1, description="latent z size")
    w_dim: int = Field(128, ge=1, description="intermediate latent w size")
    mapping_layers: int = Field(4, ge=1, le=8, description="layers of the mapping network")
    channel_base: int = Field(
        4096, ge=16, description="feature maps at resolution r: min(channel_base / r, channel_max)"
    )
    channel_max: int = Field(256, ge=1)
    # --- optimisation -------------------------------------------------------------------------
    batch_size: int = Field(32, ge=2, description="minibatch (FedER: 32)")
    lr: float = Field(0.0025, gt=0.0, description="Adam learning rate of G and D (FedER: 0.0025)")
    adam_betas: tuple[float, float] = Field((0.0, 0.99), description="Adam betas of G and D")
    r1_gamma: float | None = Field(
        None, ge=0.0, description="R1 weight; default 0.0002 * resolution^2 / batch_size"
    )
    r1_interval: int = Field(
        16, ge=1, description="apply R1 every this many D steps (lazy regularization)"
    )
    ema_half_life_images: int = Field(
        10_000, ge=1, description="half-life of the generator EMA, in images"
    )
    ema_rampup: float | None = Field(
        0.05, gt=0.0, description="EMA half-life at most this share of the images seen so far"
    )
    style_mixing_prob: float = Field(0.9, ge=0.0, le=1.0)
    # --- adaptive discriminator augmentation ---------------------------------------------------
    augment: bool = Field(True, description="adaptive discriminator augmentation on/off")
    ada_target: float = Field(0.6, gt=0.0, lt=1.0, description="target of r_t = E[sign(D(real))]")
    ada_interval: int = Field(4, ge=1, description="adjust p every this many D steps")
    ada_speed_images: int = Field(
        500_000, ge=1, description="images over which p can move from 0 to 1"
    )
    # --- privacy loss (FedER Eq. 3-5) ----------------------------------------------------------
    alpha: float = Field(
        1.0, ge=0.0, description="weight of the LPIPS privacy term: L_G-PP = L_G - alpha * L_PP"
    )
    pp_normalization: Literal["pairs", "batch"] = Field(
        "pairs",
        description="L_PP = sum of the pairwise distances divided by the number of pairs (a mean), "
        "or by the batch size as FedER Eq. 3 writes it (batch size times the mean)",
    )
    lpips_backbone: Literal["alex", "vgg", "random"] = Field(
        "alex",
        description="ImageNet backbone under LPIPS; 'random' is for tests only and gives no real privacy",
    )
    lpips_weights: Path | None = Field(
        None,
        description="torchvision ImageNet weights file of the backbone; default: the torch hub cache",
    )
    lpips_min_size: int = Field(
        64, ge=16, description="smaller images are upsampled to this side before LPIPS"
    )
    # --- two-stage training (FedER Sec. 4.2.2) -------------------------------------------------
    iterations: int = Field(50_000, ge=1, description="stage 1 (no privacy loss): most iterations")
    stage1_patience: int = Field(
        10_000,
        ge=1,
        description="stage 1 stops after this many iterations without a better quality score",
    )
    stage2_iterations: int = Field(
        10_000, ge=0, description="stage 2 (with privacy loss): most iterations"
    )
    stage2_degrade_factor: float = Field(
        2.5,
        gt=1.0,
        description="stage 2 stops once the quality score exceeds this factor times stage 1's",
    )
    quality_features: Literal["classifier", "lpips"] = Field(
        "classifier",
        description="Frechet distance on a small CNN trained on the site's images, or on the LPIPS backbone's features",
    )
    quality_classifier_steps: int = Field(
        500, ge=1, description="training steps of the quality-score CNN"
    )
    quality_every: int = Field(500, ge=1, description="iterations between quality evaluations")
    stage2_quality_every: int | None = Field(
        None,
        ge=1,
        description="iterations between quality evaluations in stage 2; default quality_every",
    )
    quality_samples: int = Field(1000, ge=16, description="synthetic images per quality evaluation")
    train_reference: bool = Field(
        True, description="also continue stage 1 without the privacy loss, for the audit"
    )
    checkpoint_every: int = Field(
        1000, ge=1, description="iterations between resumable training-state saves"
    )
    # --- buffers ------------------------------------------------------------------------------
    buffer_size: int = Field(512, ge=1, description="synthetic images per buffer (B)")
    per_class: Literal["balanced", "prior"] = Field(
        "balanced", description="equal counts per class, or the local label prior"
    )
    truncation_psi: float = Field(1.0, gt=0.0, le=1.0)
    # --- audit (FedER Sec. 4.4) ---------------------------------------------------------------
    audit_images: int = Field(64, ge=1, description="real training images projected into W")
    audit_steps: int = Field(300, ge=1, description="optimisation steps per projection")
    audit_lr: float = Field(0.1, gt=0.0)
    # --- where and how ------------------------------------------------------------------------
    out_dir: Path = Field(Path("genbuffer"), description="checkpoints, buffers and audit files")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0

    @field_validator("resolution")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 16 or v > 256 or v & (v - 1):
            raise ValueError(f"resolution must be a power of two between 16 and 256, got {v}")
        return v

    @model_validator(mode="after")
    def _weights_need_imagenet_backbone(self) -> GenbufferSection:
        if self.lpips_backbone == "random" and self.lpips_weights is not None:
            raise ValueError(
                "lpips_weights is set but lpips_backbone is 'random': remove one of them"
            )
        return self

    def stage2_settings(self) -> dict[str, object]:
        """The settings that define stage 2; changing them redoes stage 2 from the stage-1 result."""
        return {
            "alpha": self.alpha,
            "pp_normalization": self.pp_normalization,
            "stage2_iterations": self.stage2_iterations,
            "stage2_degrade_factor": self.stage2_degrade_factor,
            "stage2_quality_every": self.stage2_quality_every or self.quality_every,
            "train_reference": self.train_reference,
        }

    def effective_r1_gamma(self) -> float:
        """StyleGAN2-ADA's heuristic: 0.0002 * resolution^2 / batch_size."""
        if self.r1_gamma is not None:
            return self.r1_gamma
        return 0.0002 * self.resolution**2 / self.batch_size


@dataclass
class GenbufferConfig:
    """What the genbuffer CLI needs from a YAML file."""

    path: Path
    genbuffer: GenbufferSection
    data: DataSection | None
    seed: int


def _resolve(path: Path | None, base: Path) -> Path | None:
    if path is None:
        return None
    path = path.expanduser()
    return path if path.is_absolute() else base / path


def _field(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def genbuffer_config_from_dict(raw: dict[str, Any], path: Path) -> GenbufferConfig:
    """Validate the `genbuffer:` (and `data:`) sections of a parsed YAML mapping."""
    base = path.parent
    try:
        section = GenbufferSection.model_validate(raw.get("genbuffer") or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        problem = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise ConfigError(
            path, _field(("genbuffer", *err["loc"])), problem, "fix or remove it"
        ) from None
    data: DataSection | None = None
    if raw.get("data") is not None:
        try:
            data = DataSection.model_validate(raw["data"])
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ConfigError(
                path, _field(("data", *err["loc"])), err["msg"], "fix or remove it"
            ) from None
        if data.source != "digits" and not Path(data.source).is_absolute():
            data.source = str(base / data.source)
    node = raw.get("node") if isinstance(raw.get("node"), dict) else None
    if node is not None and "out_dir" not in (raw.get("genbuffer") or {}):
        # In a site.yaml the GAN's files live in the node's state folder by default.
        section.out_dir = Path(str(node.get("state_dir", "state"))) / "genbuffer"
    section.out_dir = _resolve(section.out_dir, base)  # type: ignore[assignment]
    section.lpips_weights = _resolve(section.lpips_weights, base)
    # The data split seed: a standalone `seed:`, else the daemon's (federation.seed + training.seed).
    if "seed" in raw:
        seed, where = raw["seed"], "seed"
    else:
        federation = raw.get("federation") if isinstance(raw.get("federation"), dict) else {}
        training = raw.get("training") if isinstance(raw.get("training"), dict) else {}
        seed, where = federation.get("seed", 0), "federation.seed"
        if isinstance(seed, int) and isinstance(training.get("seed", 0), int):
            seed += training.get("seed", 0)
    if not isinstance(seed, int):
        raise ConfigError(path, where, f"expected an integer, got {seed!r}", "write a whole number")
    return GenbufferConfig(path=path, genbuffer=section, data=data, seed=seed)


def load_genbuffer_config(path: str | Path) -> GenbufferConfig:
    """Read site.yaml (or a standalone genbuffer YAML). Raises ConfigError only."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            path, "", "file not found", "pass the path of an existing YAML file (--config)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            path, "", f"cannot read: {exc}", "check the file's permissions and encoding"
        ) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        raise ConfigError(
            path, where, "YAML syntax error", "fix the indentation or quoting there"
        ) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(path, "", "top level must be a mapping", "start it with `genbuffer:`")
    return genbuffer_config_from_dict(raw, path)
