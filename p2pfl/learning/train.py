"""A site's classifier and its local training: `LocalSite`.

`LocalSite` is the `Trainer` (p2pfl.learning.trainer: model, optimizer, data,
device, the local training loop, state) of a classifier. What a classifier
adds is here: the class-weighted loss, evaluation and its inference batch
size, the Siamese variant of the DFU paper (twin encoder + contrastive loss,
nearest-prototype classification: callers do not need to know which). The
rest is composed in from small helpers: training.recipe dp and training.dp
(`p2pfl.learning.dp_recipe`, `dp`), experience replay (`replay`) and gradients
as messages (`gradients`). Every method is plain blocking PyTorch work;
protocols call them off the event loop with `await ctx.run_blocking(site.method, ...)`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.config import SiameseSection, SiteConfig, TrainingSection
from p2pfl.learning.class_weights import (
    class_weighting,
    log_class_prior,
    median_frequency_weights,
)
from p2pfl.learning.data import SiteData
from p2pfl.learning.dp import DPTraining
from p2pfl.learning.dp_recipe import RecipeTrainer
from p2pfl.learning.evaluate import (
    CALIBRATION_IMAGES,
    EVAL_CHUNK_DEFAULT,
    fastest_batch_size,
    predict_proba,
    split_report,
)
from p2pfl.learning.gradients import gradients_by_name, set_gradients
from p2pfl.learning.models import SiameseNet, contrastive_loss
from p2pfl.learning.replay import train_replay
from p2pfl.learning.sites import build_site, classifier
from p2pfl.learning.sites import seed_everything as seed_everything  # re-exported: old path
from p2pfl.learning.trainer import Trainer


class LocalSite(Trainer):
    """One site's classifier + optimizer + data + device.

    Build it from a site.yaml with `p2pfl.learning.distributed.create_site(cfg)`
    (which picks data-parallel training when asked), `LocalSite.from_config`, or
    directly from a model, a `SiteData` and a `TrainingSection`. `augment` is
    'none', 'weak' or 'strong' (training batches only). Pass `siamese` when
    `model` is a `SiameseNet`.
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
        in a refusal (`RecipeTrainer.make_private`)."""
        if training.recipe == "dp":  # the recipe's optimizer: SGD at dp_recipe.lr
            training = training.model_copy(update={"optimizer": "sgd", "lr": training.dp_recipe.lr})
        super().__init__(model, data, training, augment=augment, device=device)
        self.siamese = siamese if isinstance(model, SiameseNet) else None
        if isinstance(model, SiameseNet) and self.siamese is None:
            self.siamese = SiameseSection(
                enabled=True, margin=model.margin, embedding_dim=model.embedding_dim
            )
        self.class_weighting = class_weighting(data.class_counts("train"), training)
        self.class_weight = (
            median_frequency_weights(data.class_counts("train")).to(self.device)
            if self.class_weighting["applied"]
            else None
        )
        # the site's own loss weights, kept for the personal models when only the
        # federated model trains with balanced softmax (logit_adjustment: federated)
        self.site_class_weight = self.class_weight
        self.log_prior = (
            log_class_prior(data.class_counts("train"), data.num_classes).to(self.device)
            if training.logit_adjustment
            else None
        )
        if self.log_prior is not None:  # balanced softmax replaces the class weights
            self.class_weighting = {
                **self.class_weighting,
                "applied": False,
                "mode": "logit_adjustment",
            }
            self.class_weight = None
        self._prototypes_stale = True
        self._eval_chunk: int | None = None
        self.recipe = RecipeTrainer(self, self.class_weight) if training.recipe == "dp" else None
        if training.dp is not None:
            assert self.recipe is not None  # TrainingSection: training.dp trains with its recipe
            self.recipe.make_private(
                training.dp,
                rounds=rounds,
                model_name=model_name or type(model).__name__,
                protocol=dp_protocol,
                siamese=self.siamese is not None,
            )

    @property
    def dp(self) -> DPTraining | None:
        """training.dp's noise, clipping and accountant (None: not private)."""
        return self.recipe.dp if self.recipe is not None else None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(
        cls, cfg: SiteConfig, data: SiteData | None = None, *, common_initial: bool = False
    ) -> LocalSite:
        """Seed, load the site's data (unless given), build the model (from the
        federation's common initial weights with `common_initial`, else from
        training.seed), wire the optimizer (`p2pfl.learning.sites.build_site`)."""
        return build_site(
            cls,
            cfg,
            classifier(cfg, common_initial=common_initial),
            data=data,
            siamese=cfg.model.siamese if cfg.model.siamese.enabled else None,
            rounds=int(getattr(cfg.protocol, "rounds", 1) or 1),
            model_name=cfg.model.name,
            dp_protocol=cfg.protocol.name,
        )

    def reset_optimizer(self) -> None:
        """Fresh optimizer state (FedER and FedPerl rebuild Adam every round), at
        the current round's learning rate; private again under training.dp."""
        super().reset_optimizer()
        if self.dp is not None:
            self.optimizer = self.dp.wrap(self.optimizer)

    # ------------------------------------------------------------------ properties

    def class_weight_vector(self) -> Tensor | None:
        """The site's class weights (training.class_weighted), or None."""
        return self.class_weight

    @property
    def is_siamese(self) -> bool:
        return isinstance(self.model, SiameseNet)

    def weights_changed(self) -> None:
        self._prototypes_stale = True

    # ------------------------------------------------------------------ training

    def loss(self, x: Tensor, y: Tensor, weight: Tensor | None | str = "site") -> Tensor:
        """Training loss of one batch already on the device: cross-entropy (with the
        site's class weights unless `weight` gives others), or the contrastive loss
        (DFU paper Eq. 1) over all pairs of the batch for Siamese."""
        with self.autocast():
            if isinstance(self.model, SiameseNet):
                embeddings = self.model.embed(x)
                return contrastive_loss(embeddings.float(), y, margin=self.model.margin)
            logits = self.model(x).float()
            if self.log_prior is not None and isinstance(weight, str):
                # balanced softmax: the site's prior, in training only; a caller's own
                # weights (FedER's replayed images) are another class mix: kept below
                return F.cross_entropy(logits + self.log_prior, y)
            w = self.class_weight if isinstance(weight, str) else weight
            return F.cross_entropy(logits, y, weight=w)

    def training_batches(self, epochs: int) -> Iterator[tuple[Tensor, Tensor]]:
        """`Trainer.training_batches`, or under training.recipe dp its Poisson
        batches (its own steps per round, dp_recipe.epochs)."""
        if self.recipe is not None:
            yield from self.recipe.batches()
            return
        yield from super().training_batches(epochs)

    def steps_per_round(self) -> int:
        """The optimizer steps `training_batches` takes in a round (the recipe's
        under training.recipe dp)."""
        if self.recipe is not None:
            return self.recipe.steps_per_round()
        return super().steps_per_round()

    def train_epochs(self, epochs: int | None = None) -> dict[str, float]:
        """Local training for `epochs` (default training.epochs) epochs, in this
        process (`p2pfl.learning.distributed.DataParallelSite` spreads them over
        training.devices processes); under training.recipe dp one round of the
        recipe (`p2pfl.learning.dp_recipe`).

        Returns {'loss': mean batch loss, 'steps', 'samples', 'seconds'}."""
        if self.recipe is None:
            return super().train_epochs(epochs)
        start = time.perf_counter()
        self.model.train()
        losses, count = self.recipe.train_round()
        return self.record_fit(losses, count, time.perf_counter() - start)

    def train_replay_epochs(
        self,
        replay_x: Tensor,
        replay_y: Tensor,
        epochs: int | None = None,
        *,
        lam: float = 0.5,
        private: bool = True,
    ) -> dict[str, float]:
        """Experience replay (FedER Eq. 6), `p2pfl.learning.replay.train_replay`:
        lam * CE(private batch) + (1 - lam) * CE(as many replayed images), or
        the replayed images alone with `private=False` (FedER-B)."""
        return train_replay(
            self,
            replay_x,
            replay_y,
            epochs,
            lam=lam,
            private=private,
            class_weighted=self.class_weight is not None,
        )

    # ------------------------------------------------------------------ gradients

    def compute_gradient(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Gradient of the batch loss w.r.t. every trainable parameter, by name, on CPU
        (float32); under training.dp DP-SGD's (clipped, noised, averaged). The
        model is in train mode, so BatchNorm statistics move as in an ordinary
        step. The loss is kept in `self.last_loss`."""
        self.model.train()
        if self.recipe is not None:  # training.recipe dp: its views, weights and clipping
            self.recipe.gradient(x, y)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss(x.to(self.device), y.to(self.device))
            loss.backward()
            self.last_loss = float(loss.detach())
        grads = gradients_by_name(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    def apply_gradient(self, grads: dict[str, Tensor]) -> None:
        """One optimizer step with the given gradients (e.g. the mean of peers' gradients)."""
        set_gradients(self.model, grads)
        if self.dp is not None:  # already private (each site noised its own): a plain step
            self.optimizer.original_optimizer.step()  # type: ignore[attr-defined]
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights_changed()

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
