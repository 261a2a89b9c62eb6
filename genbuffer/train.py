"""Two-stage training of the privacy-preserving conditional GAN (FedER Sec. 3.2 and 4.2.2).

Stage 1 trains StyleGAN2-ADA with its usual losses until the quality score
(`quality.py`) has not improved for `stage1_patience` iterations. Stage 2
starts from the best stage-1 state and adds the LPIPS privacy term (Eq. 5)
until the score exceeds `stage2_degrade_factor` times stage 1's (FedER: FID x
2.5). For the privacy audit, the same best stage-1 state is also continued
without the privacy term for as many iterations as stage 2 kept ("both models
start from the same w", FedER Sec. 4.4), with the same data order and latents.

Losses (per iteration, one G step then one D step):
    L_G = softplus(-D(A(G(z, c)), c))                      non-saturating form of FedER Eq. 2
    L_G-PP = L_G - alpha * L_PP(real batch, G(z, c))        FedER Eq. 3-5 (stage 2)
    L_D = softplus(D(A(fake))) + softplus(-D(A(real)))      FedER Eq. 1 (logistic form)
          + every r1_interval steps: r1_interval * gamma/2 * ||grad_x D(A(x))||^2  (lazy R1)
where A is the adaptive augmentation.

Everything runs on the GPU when there is one; `train_state.pt` in the output
folder is rewritten every `checkpoint_every` iterations and at every stage
boundary, and a new call with the same folder resumes from it.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .ada import AdaController, AdaptiveAugment
from .checkpoint import (
    FORMAT_VERSION,
    TRAINING_STATE_FORMAT,
    GeneratorInfo,
    atomic_torch_save,
    safe_torch_load,
    save_generator,
)
from .config import GenbufferSection
from .errors import CheckpointError, GenbufferError
from .privacy import (
    PerceptualDistance,
    build_perceptual_distance,
    privacy_loss,
    privacy_preserving_generator_loss,
)
from .quality import QualityScorer, quality_classifier_features
from .stylegan2 import Discriminator, DiscriminatorSpec, Generator, GeneratorSpec

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int, dict[str, float]], None]

STATE_FILE = "train_state.pt"
STAGE1_BEST_FILE = "stage1_best_state.pt"
STAGE1_GENERATOR = "stage1.pt"
GENERATOR_FILE = "generator.pt"  # stage 2, with the privacy loss: the one buffers come from
REFERENCE_GENERATOR = "reference_nopp.pt"  # stage 2 without the privacy loss: for the audit only
QUALITY_LOG = "quality.json"
QUALITY_CLASSIFIER = "quality_classifier.pt"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise GenbufferError(
            "no_cuda",
            "genbuffer.device is 'cuda' but no CUDA device is available — use 'auto' or 'cpu'",
        )
    return torch.device(name)


def prepare_images(
    images_uint8: np.ndarray | Tensor, resolution: int, channels: int | None = None
) -> Tensor:
    """uint8 (N, H, W) or (N, H, W, C) -> float (N, C, resolution, resolution) in [-1, 1]."""
    x = torch.as_tensor(
        np.asarray(images_uint8) if not isinstance(images_uint8, Tensor) else images_uint8
    )
    if x.dtype != torch.uint8:
        raise GenbufferError("bad_images", f"training images must be uint8, got {x.dtype}")
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[1] != x.shape[2]:
        raise GenbufferError(
            "bad_images", f"expected square images shaped (N, H, W[, C]), got {tuple(x.shape)}"
        )
    if channels is not None and x.shape[3] != channels:
        raise GenbufferError(
            "channels_mismatch",
            f"genbuffer.channels is {channels} but the images have {x.shape[3]} — remove genbuffer.channels or fix it",
        )
    x = x.permute(0, 3, 1, 2).float() / 127.5 - 1.0
    if x.shape[-1] != resolution:
        x = F.interpolate(
            x, size=(resolution, resolution), mode="bilinear", align_corners=False, antialias=True
        )
    return x.clamp(-1, 1).contiguous()


def label_prior(labels: Tensor, num_classes: int) -> list[float]:
    counts = torch.bincount(labels.long(), minlength=num_classes).double()
    return (counts / counts.sum()).tolist()


def r1_penalty(real_logits: Tensor, real_inputs: Tensor) -> Tensor:
    """Per-sample ||grad_x D(x)||^2 (R1, Mescheder et al. 2018), differentiable for the D update."""
    (grad,) = torch.autograd.grad(real_logits.sum(), real_inputs, create_graph=True)
    return grad.square().sum(dim=(1, 2, 3))


def build_specs(
    cfg: GenbufferSection, num_classes: int, channels: int
) -> tuple[GeneratorSpec, DiscriminatorSpec]:
    g = GeneratorSpec(
        num_classes=num_classes,
        resolution=cfg.resolution,
        channels=channels,
        z_dim=cfg.z_dim,
        w_dim=cfg.w_dim,
        mapping_layers=cfg.mapping_layers,
        channel_base=cfg.channel_base,
        channel_max=cfg.channel_max,
    )
    d = DiscriminatorSpec(
        num_classes=num_classes,
        resolution=cfg.resolution,
        channels=channels,
        channel_base=cfg.channel_base,
        channel_max=cfg.channel_max,
        cmap_dim=cfg.w_dim,
        mapping_layers=min(2, cfg.mapping_layers),
    )
    return g, d


class GanTrainer:
    """G, D, the EMA generator, their optimisers and ADA; `step()` is one training iteration."""

    def __init__(
        self,
        cfg: GenbufferSection,
        images: Tensor,
        labels: Tensor,
        num_classes: int,
        *,
        metric: PerceptualDistance | None,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.images = images.to(device)
        self.labels = labels.long().to(device)
        self.num_classes = num_classes
        self.metric = metric
        torch.manual_seed(cfg.seed)
        g_spec, d_spec = build_specs(cfg, num_classes, images.shape[1])
        self.G = Generator(g_spec).to(device)
        self.D = Discriminator(d_spec).to(device)
        self.G_ema = copy.deepcopy(self.G).eval().requires_grad_(False)
        betas = tuple(cfg.adam_betas)
        self.opt_g = torch.optim.Adam(self.G.parameters(), lr=cfg.lr, betas=betas)  # type: ignore[arg-type]
        self.opt_d = torch.optim.Adam(self.D.parameters(), lr=cfg.lr, betas=betas)  # type: ignore[arg-type]
        self.augment = AdaptiveAugment(0.0)
        self.ada = AdaController(
            batch_size=cfg.batch_size,
            target=cfg.ada_target,
            interval=cfg.ada_interval,
            speed_images=cfg.ada_speed_images,
        )
        self.r1_gamma = cfg.effective_r1_gamma()
        self.iteration = 0
        self.images_seen = 0
        self.data_rng = torch.Generator().manual_seed(cfg.seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._cursor = 0

    # ------------------------------------------------------------------ batches

    def _next_batch(self) -> tuple[Tensor, Tensor]:
        n, b = len(self.images), self.cfg.batch_size
        if n < b:  # tiny data sets: sample with replacement
            idx = torch.randint(0, n, (b,), generator=self.data_rng)
        else:
            if self._cursor + b > len(self._order):
                self._order = torch.randperm(n, generator=self.data_rng)
                self._cursor = 0
            idx = self._order[self._cursor : self._cursor + b]
            self._cursor += b
        idx = idx.to(self.device)
        return self.images[idx], self.labels[idx]

    def _fake_labels(self, batch: int) -> Tensor:
        """Conditioning labels for generated images, drawn from the training label distribution."""
        return self.labels[torch.randint(0, len(self.labels), (batch,), device=self.device)]

    # ------------------------------------------------------------------ one iteration

    def step(self, use_privacy: bool) -> dict[str, float]:
        cfg = self.cfg
        real, real_labels = self._next_batch()
        batch = real.shape[0]
        stats: dict[str, float] = {}

        # Generator: L_G, or L_G-PP in stage 2 (FedER Eq. 5).
        self.G.requires_grad_(True)
        self.D.requires_grad_(False)
        z = torch.randn(batch, self.G.z_dim, device=self.device)
        fake_labels = self._fake_labels(batch)
        ws = self.G.mixed_ws(z, fake_labels, cfg.style_mixing_prob, update_w_avg=True)
        fake = self.G.synthesis(ws)
        loss_g = F.softplus(-self.D(self.augment(fake), fake_labels)).mean()
        loss = loss_g
        if use_privacy:
            if self.metric is None:
                raise GenbufferError("no_lpips", "the privacy loss needs an LPIPS metric")
            loss_pp = privacy_loss(self.metric, real, fake, cfg.pp_normalization)  # FedER Eq. 3
            loss = privacy_preserving_generator_loss(loss_g, loss_pp, cfg.alpha)  # FedER Eq. 5
            stats["loss_pp"] = float(loss_pp.detach())
        self.opt_g.zero_grad(set_to_none=True)
        loss.backward()
        self.opt_g.step()
        stats["loss_g"] = float(loss_g.detach())

        # Discriminator: logistic loss (FedER Eq. 1) + lazy R1 on real images.
        self.G.requires_grad_(False)
        self.D.requires_grad_(True)
        do_r1 = self.r1_gamma > 0 and self.iteration % cfg.r1_interval == 0
        fake_logits = self.D(self.augment(fake.detach()), fake_labels)
        real_in = real.detach().requires_grad_(do_r1)
        real_logits = self.D(self.augment(real_in), real_labels)
        loss_d = F.softplus(fake_logits).mean() + F.softplus(-real_logits).mean()
        if do_r1:
            penalty = r1_penalty(real_logits, real_in).mean()
            loss_d = loss_d + penalty * (self.r1_gamma / 2) * cfg.r1_interval
            stats["r1"] = float(penalty.detach())
        self.opt_d.zero_grad(set_to_none=True)
        loss_d.backward()
        self.opt_d.step()
        stats["loss_d"] = float(loss_d.detach())

        if cfg.augment:
            self.augment.p = self.ada.observe(real_logits)
        stats["ada_p"] = self.augment.p
        self.images_seen += batch
        self._update_ema(batch)
        self.iteration += 1
        return stats

    @torch.no_grad()
    def _update_ema(self, batch: int) -> None:
        half_life = float(self.cfg.ema_half_life_images)
        if self.cfg.ema_rampup is not None:
            half_life = min(half_life, self.images_seen * self.cfg.ema_rampup)
        beta = 0.5 ** (batch / max(half_life, 1e-8))
        for p_ema, p in zip(self.G_ema.parameters(), self.G.parameters(), strict=True):
            p_ema.copy_(p.detach().lerp(p_ema, beta))
        for b_ema, b in zip(self.G_ema.buffers(), self.G.buffers(), strict=True):
            b_ema.copy_(b)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "G": self.G.state_dict(),
            "D": self.D.state_dict(),
            "G_ema": self.G_ema.state_dict(),
            "opt_g": self.opt_g.state_dict(),
            "opt_d": self.opt_d.state_dict(),
            "ada": self.ada.state_dict(),
            "augment_p": self.augment.p,
            "iteration": self.iteration,
            "images_seen": self.images_seen,
            "data_rng": self.data_rng.get_state(),
            "order": self._order.clone(),
            "cursor": self._cursor,
            "torch_rng": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return copy.deepcopy(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.G.load_state_dict(state["G"])
        self.D.load_state_dict(state["D"])
        self.G_ema.load_state_dict(state["G_ema"])
        self.opt_g.load_state_dict(state["opt_g"])
        self.opt_d.load_state_dict(state["opt_d"])
        self.ada.load_state_dict(state["ada"])
        self.augment.p = float(state["augment_p"])
        self.iteration = int(state["iteration"])
        self.images_seen = int(state["images_seen"])
        self.data_rng.set_state(state["data_rng"])
        self._order = state["order"].clone()
        self._cursor = int(state["cursor"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)


# ----------------------------------------------------------------------------- two stages


@dataclass
class TrainingResult:
    """Where the generators are and how training went."""

    out_dir: Path
    generator_path: Path  # buffers come from this one (stage 2, or stage 1 when stage 2 is off)
    stage1_path: Path
    reference_path: Path | None  # stage 2 without the privacy loss, same start (audit)
    stage1_quality: float
    stage1_iterations: int
    stage2_quality: float | None
    stage2_iterations: int
    reference_quality: float | None
    stage2_stop: str  # "degraded", "max_iterations" or "skipped"
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds_per_iteration: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "generator": str(self.generator_path),
            "stage1": str(self.stage1_path),
            "reference": str(self.reference_path) if self.reference_path else None,
            "stage1_quality": self.stage1_quality,
            "stage1_iterations": self.stage1_iterations,
            "stage2_quality": self.stage2_quality,
            "stage2_iterations": self.stage2_iterations,
            "reference_quality": self.reference_quality,
            "stage2_stop": self.stage2_stop,
            "seconds_per_iteration": self.seconds_per_iteration,
        }


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2), encoding="utf-8")
    os.replace(tmp, path)


class _TwoStageRun:
    """The stage machine: stage1 -> stage2 -> reference -> done, saved after every change."""

    def __init__(
        self,
        trainer: GanTrainer,
        scorer: QualityScorer,
        cfg: GenbufferSection,
        out_dir: Path,
        prior: list[float],
        progress: ProgressFn | None,
    ) -> None:
        self.trainer = trainer
        self.scorer = scorer
        self.cfg = cfg
        self.out_dir = out_dir
        self.prior = prior
        self.progress = progress
        self.meta: dict[str, Any] = {
            "phase": "stage1",
            "phase_start": 0,
            "best_quality": None,
            "best_iteration": 0,
            "stage1_quality": None,
            "stage1_iterations": 0,
            "selected_iteration": None,
            "selected_quality": None,
            "stage2_stop": "skipped",
            "reference_quality": None,
            "history": [],
            "train_seconds": 0.0,
            "train_steps": 0,
            "stage2_settings": cfg.stage2_settings(),
        }

    # -------------------------------------------------------------- persistence

    def save(self) -> None:
        atomic_torch_save(
            {
                "format": TRAINING_STATE_FORMAT,
                "version": FORMAT_VERSION,
                "meta": json.dumps(self.meta),
                "trainer": self.trainer.state_dict(),
            },
            self.out_dir / STATE_FILE,
        )
        _write_json(self.out_dir / QUALITY_LOG, self.meta["history"])

    def load(self, path: Path) -> None:
        obj = safe_torch_load(path, TRAINING_STATE_FORMAT)
        try:
            self.trainer.load_state_dict(obj["trainer"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(
                "checkpoint_mismatch",
                f"{path} was written by a run with another network or data ({str(exc).splitlines()[0]}) — "
                "train again with --restart, or use another output folder",
            ) from None
        self.meta = json.loads(obj["meta"])
        log.info(
            "resuming %s at phase %s, iteration %d",
            path,
            self.meta["phase"],
            self.trainer.iteration,
        )
        settings = self.cfg.stage2_settings()
        if self.meta["phase"] != "stage1" and self.meta.get("stage2_settings") != settings:
            # Retuning alpha (or the other stage-2 settings) keeps stage 1: redo stage 2 from its best state.
            log.info(
                "stage-2 settings changed (%s -> %s): redoing stage 2 from the stage-1 best state",
                self.meta.get("stage2_settings"),
                settings,
            )
            self.meta.update(
                stage2_settings=settings,
                selected_iteration=None,
                selected_quality=None,
                stage2_stop="skipped",
                reference_quality=None,
                history=[h for h in self.meta["history"] if h["phase"] == "stage1"],
            )
            for name in (GENERATOR_FILE, REFERENCE_GENERATOR):
                (self.out_dir / name).unlink(missing_ok=True)
            self._restart_from_stage1_best("stage2" if self.cfg.stage2_iterations > 0 else "done")

    def _save_generator(self, name: str, stage: str, quality: float | None, alpha: float) -> Path:
        path = self.out_dir / name
        info = GeneratorInfo(
            spec=self.trainer.G_ema.spec,
            label_prior=self.prior,
            stage=stage,
            quality=quality,
            iterations=self.trainer.iteration,
            alpha=alpha,
            lpips_backbone=self.cfg.lpips_backbone,
        )
        save_generator(path, self.trainer.G_ema, info)
        return path

    # -------------------------------------------------------------- loop

    def _evaluate(self, phase: str, stats: dict[str, float]) -> float:
        quality = self.scorer(self.trainer.G_ema)
        entry = {"phase": phase, "iteration": self.trainer.iteration, "quality": quality, **stats}
        self.meta["history"].append(entry)
        log.info(
            "%s iteration %d: quality (Frechet distance) %.4f, ada p %.3f",
            phase,
            self.trainer.iteration,
            quality,
            stats.get("ada_p", 0.0),
        )
        return quality

    def _steps(
        self,
        phase: str,
        use_privacy: bool,
        max_iterations: int,
        on_eval: Callable[[float], bool],
        *,
        eval_every: int,
    ) -> None:
        """Run iterations of one phase until `max_iterations` or until on_eval returns False.

        The score is taken every `eval_every` iterations and after the last one; a
        phase resumed at (or past) its end is scored once so it always has a score.
        """
        cfg = self.cfg
        start = self.meta["phase_start"]
        if self.trainer.iteration - start >= max_iterations:
            on_eval(self._evaluate(phase, {"ada_p": self.trainer.augment.p}))
            return
        while self.trainer.iteration - start < max_iterations:
            t0 = time.perf_counter()
            stats = self.trainer.step(use_privacy)
            self.meta["train_seconds"] += time.perf_counter() - t0
            self.meta["train_steps"] += 1
            done = self.trainer.iteration - start
            if self.progress is not None:
                self.progress(phase, done, max_iterations, stats)
            keep_going = True
            if done % eval_every == 0 or done == max_iterations:
                keep_going = on_eval(self._evaluate(phase, stats))
            if not keep_going:
                break
            if done % cfg.checkpoint_every == 0:
                self.save()

    def run(self) -> TrainingResult:
        if self.meta["phase"] == "stage1":
            self._stage1()
        if self.meta["phase"] == "stage2":
            self._stage2()
        if self.meta["phase"] == "reference":
            self._reference()
        return self._result()

    def _stage1(self) -> None:
        cfg = self.cfg

        def on_eval(quality: float) -> bool:
            best = self.meta["best_quality"]
            if best is None or quality < best:
                self.meta["best_quality"] = quality
                self.meta["best_iteration"] = self.trainer.iteration
                atomic_torch_save(
                    {
                        "format": TRAINING_STATE_FORMAT,
                        "version": FORMAT_VERSION,
                        "meta": "{}",
                        "trainer": self.trainer.state_dict(),
                    },
                    self.out_dir / STAGE1_BEST_FILE,
                )
                self._save_generator(STAGE1_GENERATOR, "stage1", quality, 0.0)
            return self.trainer.iteration - self.meta["best_iteration"] < cfg.stage1_patience

        self._steps("stage1", False, cfg.iterations, on_eval, eval_every=cfg.quality_every)
        log.info(
            "stage 1 done: best quality %.4f at iteration %d",
            self.meta["best_quality"],
            self.meta["best_iteration"],
        )
        self.meta["stage1_quality"] = self.meta["best_quality"]
        self.meta["stage1_iterations"] = self.meta["best_iteration"]
        self._restart_from_stage1_best("stage2" if cfg.stage2_iterations > 0 else "done")

    def _restart_from_stage1_best(self, phase: str) -> None:
        best = safe_torch_load(self.out_dir / STAGE1_BEST_FILE, TRAINING_STATE_FORMAT)
        self.trainer.load_state_dict(best["trainer"])
        self.meta["phase"] = phase
        self.meta["phase_start"] = self.trainer.iteration
        self.save()

    def _stage2(self) -> None:
        cfg = self.cfg
        limit = cfg.stage2_degrade_factor * self.meta["stage1_quality"]

        def on_eval(quality: float) -> bool:
            if quality <= limit or self.meta["selected_iteration"] is None:
                if quality > limit:
                    log.warning(
                        "stage 2 quality %.4f already exceeds %.1f x stage 1 (%.4f) at the first evaluation: "
                        "keeping this snapshot; alpha (%.2f) is probably too large",
                        quality,
                        cfg.stage2_degrade_factor,
                        self.meta["stage1_quality"],
                        cfg.alpha,
                    )
                self.meta["selected_iteration"] = self.trainer.iteration - self.meta["phase_start"]
                self.meta["selected_quality"] = quality
                self._save_generator(GENERATOR_FILE, "stage2", quality, cfg.alpha)
            if quality > limit:
                self.meta["stage2_stop"] = "degraded"
                return False
            self.meta["stage2_stop"] = "max_iterations"
            return True

        every = cfg.stage2_quality_every or cfg.quality_every
        self._steps("stage2", True, cfg.stage2_iterations, on_eval, eval_every=every)
        log.info(
            "stage 2 done (%s): kept iteration %d of stage 2, quality %.4f (limit %.4f)",
            self.meta["stage2_stop"],
            self.meta["selected_iteration"],
            self.meta["selected_quality"],
            limit,
        )
        self._restart_from_stage1_best("reference" if cfg.train_reference else "done")

    def _reference(self) -> None:
        """Stage-1 best state continued without the privacy loss, same length as the kept stage 2."""
        length = int(self.meta["selected_iteration"])

        def on_eval(quality: float) -> bool:
            if self.trainer.iteration - self.meta["phase_start"] >= length:
                self.meta["reference_quality"] = quality
                self._save_generator(REFERENCE_GENERATOR, "reference_nopp", quality, 0.0)
            return True

        self._steps("reference", False, length, on_eval, eval_every=length)
        self.meta["phase"] = "done"
        self.save()

    def _result(self) -> TrainingResult:
        cfg = self.cfg
        stage2_done = cfg.stage2_iterations > 0 and self.meta["selected_iteration"] is not None
        reference = self.out_dir / REFERENCE_GENERATOR
        steps = self.meta["train_steps"]
        return TrainingResult(
            out_dir=self.out_dir,
            generator_path=self.out_dir / (GENERATOR_FILE if stage2_done else STAGE1_GENERATOR),
            stage1_path=self.out_dir / STAGE1_GENERATOR,
            reference_path=reference
            if stage2_done and cfg.train_reference and reference.is_file()
            else None,
            stage1_quality=float(self.meta["stage1_quality"]),
            stage1_iterations=int(self.meta["stage1_iterations"]),
            stage2_quality=self.meta["selected_quality"],
            stage2_iterations=int(self.meta["selected_iteration"] or 0),
            reference_quality=self.meta["reference_quality"],
            stage2_stop=self.meta["stage2_stop"],
            history=list(self.meta["history"]),
            seconds_per_iteration=self.meta["train_seconds"] / steps if steps else None,
        )


def train_generator(
    images_uint8: np.ndarray | Tensor,
    labels: np.ndarray | Tensor,
    num_classes: int,
    cfg: GenbufferSection,
    out_dir: str | Path,
    *,
    resume: bool = True,
    progress: ProgressFn | None = None,
    metric: PerceptualDistance | None = None,
) -> TrainingResult:
    """Train the privacy-preserving GAN on one site's images; returns where the generators are.

    images_uint8: (N, H, W) or (N, H, W, C) uint8, square; labels: (N,) ints in [0, num_classes).
    The LPIPS backbone is resolved first, so a missing weights file stops the run
    before any training. `metric` lets a caller pass an LPIPS network it already built.
    """
    out_dir = Path(out_dir)
    device = resolve_device(cfg.device)
    if metric is None:
        metric = build_perceptual_distance(
            cfg.lpips_backbone, cfg.lpips_weights, min_size=cfg.lpips_min_size
        )
    metric = metric.to(device)
    labels_t = (
        torch.as_tensor(np.asarray(labels) if not isinstance(labels, Tensor) else labels)
        .long()
        .flatten()
    )
    images = prepare_images(images_uint8, cfg.resolution, cfg.channels)
    if len(images) != len(labels_t):
        raise GenbufferError("bad_labels", f"{len(images)} images but {len(labels_t)} labels")
    if len(images) < 2:
        raise GenbufferError("too_few_images", "need at least 2 training images")
    if labels_t.min() < 0 or labels_t.max() >= num_classes:
        raise GenbufferError(
            "bad_labels",
            f"labels must lie in [0, {num_classes}), got {labels_t.min()}..{labels_t.max()}",
        )
    out_dir.mkdir(parents=True, exist_ok=True)

    state_path = out_dir / STATE_FILE
    resuming = resume and state_path.is_file()
    if not resuming:  # a fresh run: files of an earlier run must not be mistaken for this one's
        for name in (
            STATE_FILE,
            STAGE1_BEST_FILE,
            STAGE1_GENERATOR,
            GENERATOR_FILE,
            REFERENCE_GENERATOR,
            QUALITY_LOG,
            QUALITY_CLASSIFIER,
        ):
            (out_dir / name).unlink(missing_ok=True)
    if cfg.quality_features == "classifier" and num_classes > 1:
        features = quality_classifier_features(
            out_dir / QUALITY_CLASSIFIER,
            images,
            labels_t,
            num_classes,
            steps=cfg.quality_classifier_steps,
            seed=cfg.seed,
            device=device,
        )
    else:
        if cfg.quality_features == "classifier":
            log.info("one class only: the quality score uses the LPIPS backbone's features")
        features = metric.pooled_features
    trainer = GanTrainer(cfg, images, labels_t, num_classes, metric=metric, device=device)
    scorer = QualityScorer(
        features, images, labels_t, cfg.quality_samples, seed=cfg.seed, device=device
    )
    run = _TwoStageRun(trainer, scorer, cfg, out_dir, label_prior(labels_t, num_classes), progress)
    if resuming:
        run.load(state_path)
    log.info(
        "training the genbuffer GAN on %d images (%d classes, %dpx, %d channels) on %s",
        len(images),
        num_classes,
        cfg.resolution,
        images.shape[1],
        device,
    )
    return run.run()
