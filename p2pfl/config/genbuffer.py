"""The `genbuffer:` section of site.yaml: the privacy-preserving GAN, its
synthetic buffers and the privacy audit (also read standalone by the genbuffer CLI)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from p2pfl.config.sections import Section


class GenbufferSection(Section):
    """Privacy-preserving GAN (FedER Sec. 3.2 / 4.2.2), synthetic buffers and the privacy audit."""

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
    lpips_backbone: Literal["alex", "vgg", "squeeze", "random"] = Field(
        "alex",
        description="ImageNet backbone under LPIPS; 'random' is for tests only and gives no real privacy",
    )
    lpips_weights: Path | None = Field(
        None,
        description="a full lpips.LPIPS state dict of that net, or torchvision's ImageNet backbone "
        "file (alexnet-owt-*.pth, vgg16-*.pth, squeezenet1_1-*.pth); default: the torch hub cache",
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
    # --- privacy gate (beyond the paper): checked before a buffer leaves the site ---------------
    privacy_gate: bool = Field(
        True,
        description="check every buffer against the site's own images before it leaves the site; "
        "false only for experiments (logged as a warning at every buffer)",
    )
    gate_distance: float | None = Field(
        None,
        gt=0.0,
        description="a real image counts as exposed when a synthetic image lies closer than this "
        "LPIPS distance; default: gate_distance_factor x the median distance from each checked real "
        "image to its nearest other real image",
    )
    gate_distance_factor: float = Field(0.5, gt=0.0, le=1.0)
    gate_max_fraction: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="refuse the buffer when more than this share of the checked real images is exposed",
    )
    gate_images: int = Field(
        1000, ge=2, description="real training images the gate checks (all of them when fewer)"
    )
    # --- membership test (genbuffer/audit.py): members vs a holdout kept out of GAN training ----
    # Defaults chosen before any benchmark ran. Under no leakage the AUC of members against
    # the holdout has standard error sqrt((m + h + 1) / (12 m h)) (Hanley & McNeil 1982): for a
    # site of ~900 images (the FedER node of issue 33: 908) with 20 % held out, m = 726 and
    # h = 182 give 0.024, so 0.6 lies 4.2 standard errors above chance and a buffer that
    # leaks nothing is refused about once in 70,000 (one-sided normal tail); at the smallest
    # holdout kept (50, with 200 members) it is 0.046: 2.2 standard errors, ~1.4 % false refusals.
    # The near-copy excess (share of members minus share of holdout images with a synthetic
    # image closer than the gate distance) has, for a 1 % base rate, standard error 0.008 at
    # 726/182 and 0.016 at 200/50: 0.03 is 3.6 and 1.9 of them.
    holdout_fraction: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="share of each class of the site's training images kept out of GAN training, "
        "for the membership test (seeded by genbuffer.seed); 0: no holdout",
    )
    holdout_min_images: int = Field(
        50,
        ge=2,
        description="keep no holdout (and train on every image) when it would be smaller than "
        "this: the gate then uses the distance rule alone and says so",
    )
    gate_max_auc: float = Field(
        0.6,
        gt=0.5,
        le=1.0,
        description="refuse the buffer when the membership attack's AUC (members nearer to the "
        "synthetic images than the holdout) exceeds this",
    )
    gate_max_near_copy_excess: float = Field(
        0.03,
        ge=0.0,
        le=1.0,
        description="refuse the buffer when the share of members with a near copy (closer than the "
        "gate distance) exceeds the holdout's share by more than this",
    )
    # --- where and how ------------------------------------------------------------------------
    out_dir: Path = Field(
        Path("genbuffer"),
        description="the site's private GAN folder, made 0700 with files 0600: generators, "
        "training state, the privacy gate's and audits' evidence (grids of real images); default "
        "in a site.yaml: STATE/genbuffer, in a standalone genbuffer YAML: genbuffer/ beside it",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="GAN training arithmetic: bf16 autocast (no loss scaling needed) or fp32; "
        "auto: bf16 on a CUDA device that supports it, fp32 elsewhere",
    )
    channels_last: Literal["auto", "on", "off"] = Field(
        "auto", description="channels-last memory format for G, D and the images; auto: on CUDA"
    )
    seed: int = 0

    @field_validator("resolution")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 16 or v > 256 or v & (v - 1):
            raise ValueError(
                f"{v} is not a power of two between 16 and 256 — use 16, 32, 64, 128 or 256"
            )
        return v

    @field_validator("lpips_weights")
    @classmethod
    def _weights_need_imagenet_backbone(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        # A field validator (lpips_backbone is declared first), so the error names lpips_weights.
        if v is not None and info.data.get("lpips_backbone") == "random":
            raise ValueError(
                "set, but lpips_backbone 'random' loads no weights — remove one of the two keys"
            )
        return v

    def stage2_settings(self) -> dict[str, object]:
        """The settings that define stage 2; changing them redoes stage 2 from the stage-1 result."""
        return {
            "alpha": self.alpha,
            "pp_normalization": self.pp_normalization,
            "stage2_iterations": self.stage2_iterations,
            "stage2_degrade_factor": self.stage2_degrade_factor,
            "stage2_quality_every": self.stage2_quality_every or self.quality_every,
            "train_reference": self.train_reference,
            # how the stage-2 snapshot is chosen; a state from an older rule redoes stage 2
            "selection": "last_within_limit_rescored",
        }

    def effective_r1_gamma(self) -> float:
        """StyleGAN2-ADA's heuristic: 0.0002 * resolution^2 / batch_size."""
        if self.r1_gamma is not None:
            return self.r1_gamma
        return 0.0002 * self.resolution**2 / self.batch_size
