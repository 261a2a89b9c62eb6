"""The local trainer every site is built on: `Trainer`.

A `Trainer` owns a model, its optimizer, the site's data and the device, and
does what every local objective shares: seeded batches, augmentation on the
device, the learning-rate schedule's factor, the local training loop, state
and optimizer state. The objective (`loss`) and what `evaluate` reports are the
subclass's: `p2pfl.learning.train.LocalSite` (classification, with class
weighting, DP, replay and gradient exchange composed in) and the
self-supervised sites of `p2pfl.learning.mae_site` and `beit_site`, which need
none of those. Every method is plain blocking PyTorch work; protocols call
them off the event loop with `await ctx.run_blocking(site.method, ...)`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from p2pfl.config import TrainingSection
from p2pfl.learning.data import SiteData
from p2pfl.learning.data.augment import strong_augment_batch, weak_augment_batch
from p2pfl.learning.devices import resolve_device
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.optimizer import (
    build_optimizer,
    export_optimizer_state,
    import_optimizer_state,
)
from p2pfl.learning.state import feature_vector
from p2pfl.learning.steps import steps_per_round

SPLITS = ("train", "val", "test")
AUGMENTS = ("none", "weak", "strong")


class Trainer:
    """One site's model + optimizer + data + device, and the local training loop.

    `augment` is 'none', 'weak' or 'strong' (training batches only). Subclasses
    give the objective (`loss`) and the report (`evaluate`)."""

    def __init__(
        self,
        model: nn.Module,
        data: SiteData,
        training: TrainingSection,
        *,
        augment: str = "none",
        device: str | torch.device | None = None,
    ) -> None:
        if augment not in AUGMENTS:
            raise ValueError(f"augment must be 'none', 'weak' or 'strong', got {augment!r}")
        self.training = training
        self.data = data
        self.augment = augment
        self.device = resolve_device(training.device) if device is None else torch.device(device)
        self.model = model.to(self.device)
        self.use_amp = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.lr_factor = 1.0  # training.lr_schedule's factor of the current round
        self.optimizer = build_optimizer(self.model, self.training)
        self.last_loss: float | None = None
        self._shuffle_calls = 0

    # ------------------------------------------------------------------ optimizer

    def reset_optimizer(self) -> None:
        """Fresh optimizer state (FedER and FedPerl rebuild Adam every round), at
        the current round's learning rate."""
        self.optimizer = build_optimizer(self.model, self.training, self.lr_factor)

    def set_lr_factor(self, factor: float) -> None:
        """Train at training.lr x `factor` from now on (the round's step of
        training.lr_schedule, see `p2pfl.learning.optimizer.lr_factor`)."""
        self.lr_factor = float(factor)
        for group in self.optimizer.param_groups:
            group["lr"] = self.training.lr * self.lr_factor

    @property
    def lr(self) -> float:
        """The learning rate local training uses now."""
        return self.training.lr * self.lr_factor

    # ------------------------------------------------------------------ properties

    @property
    def num_train(self) -> int:
        """Training samples: the weight of this site in a weighted average."""
        return len(self.data.train)

    @property
    def num_classes(self) -> int:
        return self.data.num_classes

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast on CUDA (when supported), a no-op elsewhere."""
        if self.use_amp:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ batches

    def _split_tensors(self, split: str) -> tuple[Tensor, Tensor]:
        if split not in SPLITS:
            raise TrainingError(
                "unknown_split", f"unknown split {split!r}: use one of {', '.join(SPLITS)}"
            )
        dataset = getattr(self.data, split)
        if dataset is None or len(dataset) == 0:
            raise TrainingError(
                "missing_split",
                f"this site has no {split!r} split (source {self.data.source!r}) — "
                f"add {split}_images/{split}_labels (npz) or a {split}/ folder, "
                "or evaluate another split",
            )
        images, labels = dataset.tensors
        return images, labels

    def batches(
        self, split: str = "train", *, shuffle: bool | None = None, batch_size: int | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """(x, y) CPU batches of a split. Train batches are shuffled with a seeded
        generator whose seed advances on every call, so epochs differ but a run
        repeats exactly."""
        images, labels = self._split_tensors(split)
        shuffle = (split == "train") if shuffle is None else shuffle
        size = batch_size or self.training.batch_size
        if shuffle:
            gen = torch.Generator().manual_seed(
                self.training.seed * 1_000_003 + self._shuffle_calls
            )
            self._shuffle_calls += 1
            order = torch.randperm(len(labels), generator=gen)
        else:
            order = torch.arange(len(labels))
        for start in range(0, len(order), size):
            idx = order[start : start + size]
            yield images[idx], labels[idx]

    def _augment(self, x: Tensor) -> Tensor:
        """The training view of a batch, on the site's device (augmented there:
        p2pfl.learning.data.augment works on the whole batch at once)."""
        x = x.to(self.device, non_blocking=True)
        if self.augment == "weak":
            return weak_augment_batch(x)
        if self.augment == "strong":
            return strong_augment_batch(x)
        return x

    # ------------------------------------------------------------------ objective

    def loss(self, x: Tensor, y: Tensor, weight: Tensor | None | str = "site") -> Tensor:
        """Training loss of one batch already on the device. `weight`: class
        weights of a classification loss ('site': the site's own); objectives
        without classes ignore it."""
        raise NotImplementedError

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        """The report of one split (a missing split raises TrainingError)."""
        raise NotImplementedError

    def evaluate_available(
        self, splits: tuple[str, ...] = ("val", "test")
    ) -> dict[str, dict[str, Any]]:
        """evaluate() of each of `splits` this site has; a missing split is left out."""
        reports: dict[str, dict[str, Any]] = {}
        for split in splits:
            try:
                reports[split] = self.evaluate(split)
            except TrainingError as exc:
                if exc.reason != "missing_split":
                    raise
        return reports

    # ------------------------------------------------------------------ training

    def training_batches(self, epochs: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The batches of one round of local training: `epochs` epochs (each capped
        at max_steps_per_epoch), or exactly `steps_per_round` steps cycling through
        reshuffled epochs, so every site does the same work whatever its size.
        Batches of one sample are skipped (BatchNorm cannot train on them)."""
        steps = self.training.steps_per_round
        if steps is not None:
            done = 0
            while done < steps:
                yielded = False
                for x, y in self.batches("train"):
                    if len(y) < 2:
                        continue
                    yield x, y
                    yielded = True
                    done += 1
                    if done >= steps:
                        return
                if not yielded:
                    return
            return
        cap = self.training.max_steps_per_epoch
        for _ in range(epochs):
            for step, (x, y) in enumerate(self.batches("train")):
                if cap is not None and step >= cap:
                    break
                if len(y) >= 2:
                    yield x, y

    def steps_per_round(self) -> int:
        """The optimizer steps `training_batches(training.epochs)` takes in a
        round (`p2pfl.learning.steps.steps_per_round`)."""
        return steps_per_round(len(self.data.train), self.training)

    def train_epochs(self, epochs: int | None = None) -> dict[str, float]:
        """Local training for `epochs` (default training.epochs) epochs, in this
        process. Returns {'loss': mean batch loss, 'steps', 'samples', 'seconds'}."""
        start = time.perf_counter()
        self.model.train()
        epochs = self.training.epochs if epochs is None else epochs
        losses: list[float] = []
        samples = 0
        for x, y in self.training_batches(epochs):
            x = self._augment(x)
            y = y.to(self.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss(x, y)
            loss.backward()
            self.optimizer.step()
            losses.append(float(loss.detach()))
            samples += len(y)
        return self.record_fit(losses, samples, time.perf_counter() - start)

    def record_fit(self, losses: list[float], samples: int, seconds: float) -> dict[str, float]:
        """After local training: `last_loss` is the mean batch loss; returns the
        summary every training method gives: {'loss', 'steps', 'samples',
        'seconds'}. The gradients are dropped: the next step zeroes them anyway,
        and between rounds they would hold a model's worth of memory per site
        (thousands of simulated sites)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.weights_changed()
        self.last_loss = float(np.mean(losses)) if losses else None
        return {
            "loss": self.last_loss if self.last_loss is not None else float("nan"),
            "steps": len(losses),
            "samples": samples,
            "seconds": seconds,
        }

    def weights_changed(self) -> None:
        """Called after the weights changed (training, a step, a load): what is
        derived from them is stale (LocalSite: the Siamese prototypes)."""

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Tensor]:
        """CPU clones of the model's state (parameters and buffers)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Tensor], strict: bool = True) -> None:
        try:
            self.model.load_state_dict(state, strict=strict)
        except RuntimeError as exc:
            raise TrainingError(
                "state_mismatch",
                f"model state does not fit this site's model: {str(exc).splitlines()[0]} "
                "— all sites must use the same model.name, channels and image_size",
            ) from None
        self.weights_changed()

    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer state in a codec-friendly form (`export_optimizer_state`)."""
        return export_optimizer_state(self.optimizer)

    def load_optimizer_state(self, saved: dict[str, Any]) -> None:
        import_optimizer_state(self.optimizer, saved)

    def model_stats_vector(self) -> list[float]:
        """FedPerl's feature vector of the model (`p2pfl.learning.state.feature_vector`)."""
        return feature_vector(self.model.state_dict())
