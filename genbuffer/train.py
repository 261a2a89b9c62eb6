"""Two-stage training of the privacy-preserving conditional GAN (FedER Sec. 3.2 and 4.2.2).

Stage 1 trains StyleGAN2-ADA with its usual losses (`trainer.GanTrainer`) until
the quality score (`quality.py`) has not improved for `stage1_patience`
iterations. Stage 2 starts from the best stage-1 state and adds the LPIPS
privacy term (Eq. 5) until the score exceeds `stage2_degrade_factor` times
stage 1's (FedER: FID x 2.5). For the privacy audit, the same best stage-1
state is also continued without the privacy term for as many iterations as
stage 2 kept ("both models start from the same w", FedER Sec. 4.4), with the
same data order and latents.

Everything runs on the GPU when there is one; `train_state.pt` in the output
folder is rewritten every `checkpoint_every` iterations and at every stage
boundary, and a new call with the same folder resumes from it.

The output folder is made 0700 and every file in it 0600: the generators, the
training state (the discriminator) and the quality classifier were all trained
on the site's private images.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from p2pfl.files import PRIVATE_FILE, atomic_torch_save, atomic_write_json, make_private_dir
from p2pfl.learning import devices
from p2pfl.learning.errors import TrainingError

from .checkpoint import (
    FORMAT_VERSION,
    TRAINING_STATE_FORMAT,
    GeneratorInfo,
    safe_torch_load,
    save_generator,
)
from .config import GenbufferSection
from .errors import CheckpointError, GenbufferError
from .privacy import PerceptualDistance, build_perceptual_distance
from .quality import QualityScorer, quality_classifier_features
from .trainer import GanTrainer, label_prior, prepare_images

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
    """The torch device `genbuffer.device` names; a missing GPU is a GenbufferError."""
    try:
        return devices.resolve_device(name, setting="genbuffer.device")
    except TrainingError as exc:
        raise GenbufferError(exc.reason, str(exc)) from None


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
        self._save_state(STATE_FILE, self.meta)
        atomic_write_json(self.out_dir / QUALITY_LOG, self.meta["history"], mode=PRIVATE_FILE)

    def _save_state(self, name: str, meta: dict[str, Any]) -> None:
        """The trainer's whole state (and `meta`) to `name` in the output folder."""
        atomic_torch_save(
            {
                "format": TRAINING_STATE_FORMAT,
                "version": FORMAT_VERSION,
                "meta": json.dumps(meta),
                "trainer": self.trainer.state_dict(),
            },
            self.out_dir / name,
            mode=PRIVATE_FILE,  # the discriminator has seen every private image
        )

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
                stage2_every=None,
                stage2_length=None,
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
                history = self.meta["history"]
                latest = {"quality": float(history[-1]["quality"])} if history else {}
                self.progress(phase, done, max_iterations, {**stats, **latest})
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
                self._save_state(STAGE1_BEST_FILE, {})
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

        every = self.meta.get("stage2_every") or cfg.stage2_quality_every or cfg.quality_every
        length = self.meta.get("stage2_length") or cfg.stage2_iterations

        def on_eval(quality: float) -> bool:
            if quality <= limit or self.meta["selected_iteration"] is None:
                if quality > limit and every == 1:
                    log.warning(
                        "stage 2 quality %.4f exceeds %.1f x stage 1 (%.4f) after one iteration: "
                        "keeping it; alpha (%.2f) is too large for this data",
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

        while True:
            self._steps("stage2", True, length, on_eval, eval_every=every)
            first_within = self.meta["selected_quality"] <= limit
            if first_within or every == 1:
                break
            # The first score already broke the limit: the snapshot kept would break the
            # paper's rule (the last one within 2.5 x stage 1). Redo stage 2 from the same
            # stage-1 state, scoring more often, over the span known to stay under it.
            length, every = every, max(1, every // 5)
            log.warning(
                "stage 2 quality %.4f exceeds %.1f x stage 1 (%.4f) at its first score: redoing "
                "stage 2 from the stage-1 best state, scored every %d iterations over %d",
                self.meta["selected_quality"],
                cfg.stage2_degrade_factor,
                self.meta["stage1_quality"],
                every,
                length,
            )
            self.meta.update(
                stage2_every=every,
                stage2_length=length,
                selected_iteration=None,
                selected_quality=None,
            )
            self._restart_from_stage1_best("stage2")
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
    make_private_dir(out_dir)

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
