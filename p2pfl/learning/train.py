"""Local training and evaluation of one site's model.

`LocalSite` owns a model, its optimizer, the site's data and the device. Every
method is plain blocking PyTorch work; protocols call them off the event loop
with `await ctx.train(site.method, ...)`. The same object trains a plain
classifier and the Siamese variant of the DFU paper (twin encoder + contrastive
loss, nearest-prototype classification): callers do not need to know which.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.config import SiameseSection, SiteConfig, TrainingSection
from p2pfl.learning.class_weights import class_weighting, median_frequency_weights
from p2pfl.learning.data import SiteData, load_site_data
from p2pfl.learning.data.augment import strong_augment_batch, weak_augment_batch
from p2pfl.learning.devices import resolve_device
from p2pfl.learning.dp import DPTraining, refuse_dp_setting, refuse_unsupported
from p2pfl.learning.dp_recipe import RecipeTrainer
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.evaluate import (
    CALIBRATION_IMAGES,
    EVAL_CHUNK_DEFAULT,
    fastest_batch_size,
    predict_proba,
    split_report,
)
from p2pfl.learning.models import SiameseNet, contrastive_loss
from p2pfl.learning.optimizer import (
    build_optimizer,
    export_optimizer_state,
    import_optimizer_state,
)
from p2pfl.learning.site_model import create_site_model
from p2pfl.learning.state import feature_vector

SPLITS = ("train", "val", "test")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


class LocalSite:
    """One site's model + optimizer + data + device.

    Build it from a site.yaml with `p2pfl.learning.sites.create_site(cfg)` (which
    picks data-parallel training when asked), or directly from a model, a
    `SiteData` and a `TrainingSection`. `augment` is 'none', 'weak' or 'strong'
    (training batches only). Pass `siamese` when `model` is a `SiameseNet`.
    """

    def __init__(
        self,
        model: nn.Module,
        data: SiteData,
        training: TrainingSection,
        *,
        augment: str = "none",
        siamese: SiameseSection | None = None,
        device: str | torch.device | None = None,
        rounds: int | None = None,
        model_name: str | None = None,
        dp_protocol: str = "fedavgp2p",
    ) -> None:
        """`rounds` (the protocol's, the whole run), `dp_protocol` (whose local
        training this is) and `model_name` serve training.dp: the steps a target ε
        is planned over, the protocol that must plan DP-SGD, and the model named
        in a refusal. A private site without `rounds` is refused: a plan for fewer
        rounds than the run would spend more than the ε it reports as its target."""
        if augment not in ("none", "weak", "strong"):
            raise ValueError(f"augment must be 'none', 'weak' or 'strong', got {augment!r}")
        self.training = training
        self.data = data
        self.augment = augment
        self.device = resolve_device(training.device) if device is None else torch.device(device)
        self.model = model.to(self.device)
        self.siamese = siamese if isinstance(model, SiameseNet) else None
        if isinstance(model, SiameseNet) and self.siamese is None:
            self.siamese = SiameseSection(
                enabled=True, margin=model.margin, embedding_dim=model.embedding_dim
            )
        self.use_amp = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        if training.recipe == "dp":  # the recipe's optimizer: SGD at dp_recipe.lr
            training = training.model_copy(update={"optimizer": "sgd", "lr": training.dp_recipe.lr})
            self.training = training
        self.lr_factor = 1.0  # training.lr_schedule's factor of the current round
        self.optimizer = build_optimizer(self.model, self.training)
        self.class_weighting = class_weighting(data.class_counts("train"), training)
        self.class_weight = (
            median_frequency_weights(data.class_counts("train")).to(self.device)
            if self.class_weighting["applied"]
            else None
        )
        self.last_loss: float | None = None
        self._shuffle_calls = 0
        self._prototypes_stale = True
        self._eval_chunk: int | None = None
        self.dp: DPTraining | None = None
        self.recipe = RecipeTrainer(self) if training.recipe == "dp" else None
        if training.dp is not None:
            refuse_dp_setting(
                dp_protocol, siamese=self.siamese is not None, devices=training.devices
            )
            if rounds is None:
                raise TrainingError(
                    "dp_unplanned",
                    "training.dp: the site was built without the run's rounds, so no privacy "
                    "budget can be planned — build it with rounds=protocol.rounds",
                )
            self._make_private(training, rounds, model_name or type(model).__name__)

    def _make_private(self, training: TrainingSection, rounds: int, model_name: str) -> None:
        """training.dp: Opacus's per-sample gradients on this model, its DPOptimizer
        around the optimizer, its accountant (`p2pfl.learning.dp`)."""
        assert training.dp is not None and self.recipe is not None
        refuse_unsupported(self.model, model_name)
        self.dp = DPTraining(
            training.dp,
            n_train=len(self.data.train),
            batch_size=self.recipe.batch_size,
            sample_rate=self.recipe.sample_rate,
            total_steps=max(1, rounds) * self.steps_per_round(),
            device=self.device,
        )
        self.dp.attach(self.model)
        self.optimizer = self.dp.wrap(self.optimizer)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg: SiteConfig, data: SiteData | None = None) -> LocalSite:
        """Seed, load the site's data (unless given), build the model, wire the optimizer."""
        seed_everything(cfg.training.seed)
        if data is None:
            data = load_site_data(cfg.data, seed=cfg.federation.seed + cfg.training.seed)
        model = create_site_model(
            cfg.model,
            in_chans=data.channels,
            num_classes=data.num_classes,
            image_size=data.image_size,
        )
        return cls(
            model,
            data,
            cfg.training,
            augment=cfg.data.augment,
            siamese=cfg.model.siamese if cfg.model.siamese.enabled else None,
            rounds=int(getattr(cfg.protocol, "rounds", 1) or 1),
            model_name=cfg.model.name,
            dp_protocol=cfg.protocol.name,
        )

    def reset_optimizer(self) -> None:
        """Fresh optimizer state (FedER and FedPerl rebuild Adam every round), at
        the current round's learning rate."""
        self.optimizer = build_optimizer(self.model, self.training, self.lr_factor)
        if self.dp is not None:
            self.optimizer = self.dp.wrap(self.optimizer)

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
        """Labelled training samples: the weight of this site in a weighted average."""
        return len(self.data.train)

    def class_weight_vector(self) -> Tensor | None:
        """The site's class weights (training.class_weighted), or None."""
        return self.class_weight

    @property
    def num_classes(self) -> int:
        return self.data.num_classes

    @property
    def is_siamese(self) -> bool:
        return isinstance(self.model, SiameseNet)

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

    # ------------------------------------------------------------------ losses

    def loss(self, x: Tensor, y: Tensor, weight: Tensor | None | str = "site") -> Tensor:
        """Training loss of one batch already on the device: cross-entropy (with the
        site's class weights unless `weight` gives others), or the contrastive loss
        (DFU paper Eq. 1) over all pairs of the batch for Siamese."""
        with self.autocast():
            if isinstance(self.model, SiameseNet):
                embeddings = self.model.embed(x)
                return contrastive_loss(embeddings.float(), y, margin=self.model.margin)
            logits = self.model(x)
            w = self.class_weight if isinstance(weight, str) else weight
            return F.cross_entropy(logits.float(), y, weight=w)

    def _augment(self, x: Tensor) -> Tensor:
        """The training view of a batch, on the site's device (augmented there:
        p2pfl.learning.data.augment works on the whole batch at once)."""
        x = x.to(self.device, non_blocking=True)
        if self.augment == "weak":
            return weak_augment_batch(x)
        if self.augment == "strong":
            return strong_augment_batch(x)
        return x

    # ------------------------------------------------------------------ training

    def training_batches(self, epochs: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The batches of one round of local training: `epochs` epochs (each capped
        at max_steps_per_epoch), or exactly `steps_per_round` steps cycling through
        reshuffled epochs, so every site does the same work whatever its size.
        Batches of one sample are skipped (BatchNorm cannot train on them)."""
        if self.recipe is not None:  # training.recipe dp: Poisson batches
            yield from self.recipe.batches()  # its own steps per round (dp_recipe.epochs)
            return
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
        """The optimizer steps `training_batches` takes in a round, at most (a
        last batch of one sample, which it skips, is counted)."""
        if self.recipe is not None:
            return self.recipe.steps_per_round()
        training = self.training
        if training.steps_per_round is not None:
            return training.steps_per_round
        per_epoch = -(-len(self.data.train) // training.batch_size)
        if training.max_steps_per_epoch is not None:
            per_epoch = min(per_epoch, training.max_steps_per_epoch)
        return per_epoch * training.epochs

    def train_epochs(self, epochs: int | None = None) -> dict[str, float]:
        """Local training for `epochs` (default training.epochs) epochs, in this
        process (`p2pfl.learning.distributed.DataParallelSite` spreads them over
        training.devices processes).

        Returns {'loss': mean batch loss, 'steps', 'samples', 'seconds'}."""
        start = time.perf_counter()
        self.model.train()
        if self.recipe is not None:  # training.recipe dp (p2pfl.learning.dp_recipe)
            losses, count = self.recipe.train_round()
            return self.record_fit(losses, count, time.perf_counter() - start)
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
            if self.dp is not None:
                self.dp.step_taken()
            losses.append(float(loss.detach()))
            samples += len(y)
        return self.record_fit(losses, samples, time.perf_counter() - start)

    def record_fit(self, losses: list[float], samples: int, seconds: float) -> dict[str, float]:
        """After local training: the prototypes are stale, `last_loss` is the mean
        batch loss; returns the summary every training method gives: {'loss',
        'steps', 'samples', 'seconds'}. The gradients are dropped: the next step
        zeroes them anyway, and between rounds they would hold a model's worth of
        memory per site (thousands of simulated sites)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._prototypes_stale = True
        self.last_loss = float(np.mean(losses)) if losses else None
        return {
            "loss": self.last_loss if self.last_loss is not None else float("nan"),
            "steps": len(losses),
            "samples": samples,
            "seconds": seconds,
        }

    def train_replay_epochs(
        self,
        replay_x: Tensor,
        replay_y: Tensor,
        epochs: int | None = None,
        *,
        lam: float = 0.5,
        private: bool = True,
    ) -> dict[str, float]:
        """Experience replay (FedER Eq. 6): every step pairs a private batch with as
        many replayed images, loss = lam * CE(private) + (1 - lam) * CE(replayed).
        `private=False` trains on the replayed images alone (FedER-B). With nothing
        to replay this is `train_epochs`.

        The steps are those of `train_epochs` (training.steps_per_round when set,
        else the private epochs), so FedER does the same local work as the other
        protocols. Under class weighting the private half uses the site's weights
        and the replayed half weights of its own class mix (none for a balanced
        buffer), so both halves count every class alike."""
        if len(replay_y) == 0 and private:
            return self.train_epochs(epochs)
        if len(replay_y) == 0:
            raise TrainingError("empty_replay", "synthetic-only training needs a non-empty buffer")
        epochs = self.training.epochs if epochs is None else epochs
        start = time.perf_counter()
        self.model.train()
        gen = torch.Generator().manual_seed(self.training.seed * 7_919 + self._shuffle_calls)
        size = self.training.batch_size
        losses: list[float] = []
        samples = 0
        replay_weight = None
        if self.class_weight is not None:
            counts = torch.bincount(replay_y.long(), minlength=self.data.num_classes)
            replay_weight = median_frequency_weights(counts.tolist()).to(self.device)

        def replay_batches() -> Iterator[tuple[Tensor, Tensor]]:
            order, pos = torch.randperm(len(replay_y), generator=gen), 0
            while True:
                if pos + size > len(order):
                    order, pos = torch.randperm(len(replay_y), generator=gen), 0
                idx = order[pos : pos + size]
                pos += size
                yield replay_x[idx], replay_y[idx]

        if private:
            steps: Iterable[tuple[Tensor | None, Tensor | None]] = self.training_batches(epochs)
        else:
            per_epoch = max(1, len(replay_y) // size)
            if self.training.steps_per_round is not None:
                count = self.training.steps_per_round
            else:
                cap = self.training.max_steps_per_epoch
                count = epochs * (min(per_epoch, cap) if cap is not None else per_epoch)
            steps = [(None, None)] * count
        for (x, y), (rx, ry) in zip(steps, replay_batches(), strict=False):
            if len(ry) < 2:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            rx, ry = self._augment(rx), ry.to(self.device)
            if x is None:
                loss = self.loss(rx, ry, weight=replay_weight)
            else:
                x, y = self._augment(x), y.to(self.device)
                loss = lam * self.loss(x, y) + (1.0 - lam) * self.loss(rx, ry, weight=replay_weight)
            loss.backward()
            self.optimizer.step()
            losses.append(float(loss.detach()))
            samples += len(ry) + (0 if y is None else len(y))
        return self.record_fit(losses, samples, time.perf_counter() - start)

    def compute_gradient(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Gradient of the batch loss w.r.t. every trainable parameter, by name, on CPU
        (float32). The model is in train mode, so BatchNorm statistics move as in an
        ordinary step. The loss is kept in `self.last_loss`."""
        self.model.train()
        if self.recipe is not None:  # training.recipe dp: its views, weights and clipping
            self.recipe.gradient(x, y)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss(x.to(self.device), y.to(self.device))
            loss.backward()
            self.last_loss = float(loss.detach())
        if self.recipe is None and self.dp is not None:
            # DP-SGD's gradient: per-sample clipped, noised, averaged (no step)
            self.optimizer.pre_step()  # type: ignore[attr-defined]
            self.dp.step_taken()
        grads: dict[str, Tensor] = {}
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            grads[name] = grad.detach().float().cpu().clone()
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    def apply_gradient(self, grads: dict[str, Tensor]) -> None:
        """One optimizer step with the given gradients (e.g. the mean of peers' gradients)."""
        params = dict(self.model.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and n not in grads]
        unknown = [n for n in grads if n not in params]
        if missing or unknown:
            raise TrainingError(
                "gradient_mismatch",
                f"gradient names do not match the model: missing {missing[:3]}, unknown {unknown[:3]} "
                "— all sites must use the same model.name and data shape",
            )
        for name, param in params.items():
            if not param.requires_grad:
                continue
            grad = grads[name]
            if tuple(grad.shape) != tuple(param.shape):
                raise TrainingError(
                    "gradient_mismatch",
                    f"gradient {name} has shape {tuple(grad.shape)}, model has {tuple(param.shape)}",
                )
            param.grad = grad.to(device=param.device, dtype=param.dtype)
        if self.dp is not None:  # already private (each site noised its own): a plain step
            self.optimizer.original_optimizer.step()  # type: ignore[attr-defined]
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._prototypes_stale = True

    # ------------------------------------------------------------------ inference

    def _refresh_prototypes(self) -> None:
        """Siamese: class prototypes from this site's labelled training set, with
        the current encoder (after any change of the weights)."""
        if isinstance(self.model, SiameseNet) and self._prototypes_stale:
            batches = self.batches("train", shuffle=False, batch_size=256)
            self.model.fit_prototypes(batches, device=self.device, autocast=self.autocast)
            self._prototypes_stale = False

    def predict_proba(self, x: Tensor) -> Tensor:
        """Class probabilities (CPU float32, shape N x num_classes) in eval mode.
        Siamese: softmax over negative distances to the class prototypes."""
        self._refresh_prototypes()
        return predict_proba(
            self.model,
            x,
            device=self.device,
            batch_size=self.eval_chunk(x),
            autocast=self.autocast,
            num_classes=self.num_classes,
        )

    def eval_chunk(self, x: Tensor) -> int:
        """The inference batch size `calibrate_eval_batch` chose (calibrating on
        `x` if that has not happened yet), or 512 while there were too few
        images to time."""
        if self._eval_chunk is None:
            self.calibrate_eval_batch(x)
        return self._eval_chunk or EVAL_CHUNK_DEFAULT

    def calibrate_eval_batch(self, x: Tensor | None = None) -> int | None:
        """Choose the inference batch size once (`fastest_batch_size` on CPU, on
        CALIBRATION_IMAGES images of `x`, else of the first split that has as
        many; on a GPU, 512). A node calls this while it starts, so the timing
        is not part of a round. Returns the size, or None when there were too
        few images (the default is used meanwhile)."""
        if self.device.type != "cpu":
            self._eval_chunk = EVAL_CHUNK_DEFAULT
            return self._eval_chunk
        if x is None:
            for split in ("test", "val", "train"):
                dataset = getattr(self.data, split)
                if dataset is not None and len(dataset) >= CALIBRATION_IMAGES:
                    x = dataset.tensors[0]
                    break
        if x is None or len(x) < CALIBRATION_IMAGES:
            return None
        forward = self.model.embed if isinstance(self.model, SiameseNet) else self.model
        self._eval_chunk = fastest_batch_size(self.model, forward, x[:CALIBRATION_IMAGES])
        return self._eval_chunk

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        """classification_report on a split plus 'loss' (NLL of the predicted
        probabilities), 'split' and 'n'. A missing split raises TrainingError."""
        images, labels = self._split_tensors(split)
        return split_report(self.predict_proba(images), labels, self.num_classes, split)

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
        self._prototypes_stale = True

    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer state in a codec-friendly form (`export_optimizer_state`)."""
        return export_optimizer_state(self.optimizer)

    def load_optimizer_state(self, saved: dict[str, Any]) -> None:
        import_optimizer_state(self.optimizer, saved)

    def model_stats_vector(self) -> list[float]:
        """FedPerl's feature vector of the model (`p2pfl.learning.state.feature_vector`)."""
        return feature_vector(self.model.state_dict())
