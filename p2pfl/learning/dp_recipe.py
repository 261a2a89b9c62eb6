"""The training recipe of training.dp: DP-SGD that learns (training.recipe: dp).

Plain DP-SGD at the site's ordinary settings (batch 32, Adam, class-weighted
loss) learned nothing on the reference job: clipping every per-sample gradient
to the same norm undoes a class-weighted loss, so every site predicted its
majority class. The recipe follows De et al. 2022, "Unlocking high-accuracy
differentially private image classification through scale" (Sec. 3); its
ingredients come from the paper, and its numbers (lr 1, 4 expected passes per
round, 1 view, no EMA) were chosen on the validation split of the reference
job's seed 0 at ε = 3 among lr 0.5-2, passes 1-4, 1-4 views, with and without
EMA (`bench.dp_utility`'s docs give the grid; the options stay, off by
default where validation did not pick them):

- **Large expected batches, Poisson-sampled.** Each image joins a step's batch
  independently with probability q = batch_size / train images, which is the
  subsampling Opacus's RDP accountant assumes, so the reported ε holds as
  stated. The noise on the mean gradient is σ·C / batch_size: a large batch
  divides it. A logical batch runs as physical chunks (Opacus's virtual steps:
  `signal_skip_step`), so memory does not grow with it.
- **Augmentation multiplicity** (Sec. 3.3): an image's gradient is the mean of
  its gradients over `augmult` augmented views, taken *before* clipping, so it
  is still one image's contribution and the sensitivity is unchanged.
- **Class balance after clipping.** Each clipped per-sample gradient is
  multiplied by its class's weight (the site's median-frequency weights scaled
  so the largest is 1). No contribution exceeds the clipping norm C, so the
  Gaussian noise of std σ·C keeps its guarantee, and the minority classes keep
  their weight (a weighted loss before clipping loses it).
- **GroupNorm with weight standardization** (Sec. 3.2): model.name small_cnn_ws
  (its one-channel stem is not standardized: a zero-mean filter cannot see an
  X-ray's brightness).
- **SGD for the noise**: plain SGD (no momentum, as the paper), a learning rate
  for a mean clipped gradient of norm at most C (`lr`), times the run's
  learning-rate schedule, over `epochs` expected passes per round.
- **An EMA of the parameters** (Sec. 3.4): here over the steps of a round, bias
  corrected so the round's start does not count, and the EMA becomes the
  round's model (what the site evaluates and shares). The federation's merge
  restarts it every round. It is post-processing of private iterates: no
  privacy cost. FedSGDP2P, whose sites apply one shared gradient in lockstep,
  does not use it.

Without training.dp (training.recipe: dp alone) the same batches, views,
weights, EMA and optimizer run without clipping or noise. The like-for-like
non-private baseline of `bench.dp_utility` is instead the recipe with its
clipping and no noise (training.dp.noise_multiplier: 0, ε = ∞): its learning
rate is one for clipped gradients.

Measured (issue 33, `bench.dp_utility`, seeds 0-2): the recipe learns where
the plain DP-SGD did not (ε = 8: 0.514 mean macro-F1 against 0.337, the
majority class, before), but not yet well enough: its own noise-free run
reaches 0.594 where the site's standard training reaches 0.772, and ε = 8 is
8.0 points below that noise-free run (target 5). Small sites (fewer images
than the expected batch) take full-batch steps, 4 per round. With the
fixed-feature model `scatternet_linear` (Tramèr & Boneh 2021) instead, the
same recipe gives 0.496 / 0.462 / 0.528 at ε = 1 / 3 / 8 against 0.541
without noise (docs/protocols.md, "Differential privacy").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from p2pfl.learning.dp import DPTraining, refuse_dp_setting, refuse_unsupported
from p2pfl.learning.errors import TrainingError

if TYPE_CHECKING:
    from p2pfl.config.sections import DPSection, TrainingSection
    from p2pfl.learning.trainer import Trainer


def recipe_settings(training: TrainingSection) -> dict[str, Any] | None:
    """The recipe a site.yaml trains with (None: the standard one), as `check`
    prints it and the model card records it; the rates that depend on the
    site's images are in its metrics (dp_sample_rate, dp_noise_multiplier)."""
    if training.recipe != "dp":
        return None
    r = training.dp_recipe
    settings: dict[str, Any] = {
        "recipe": "dp (De et al. 2022)",
        "sampling": "poisson, rate expected_batch_size / train images",
        "expected_batch_size": r.batch_size,
        "physical_batch_size": r.physical_batch_size,
        "epochs_per_round": r.epochs,
        "augmult": r.augmult,
        "optimizer": f"sgd, lr {r.lr:g} x training.lr_schedule",
        "ema_decay": r.ema_decay,
        "class_balance": r.class_balance,
    }
    if training.dp is not None:
        settings["max_grad_norm"] = training.dp.max_grad_norm
        settings["noise"] = (
            f"target_epsilon {training.dp.target_epsilon:g} over the run"
            if training.dp.target_epsilon is not None
            else f"noise_multiplier {training.dp.noise_multiplier:g}"
        )
    return settings


class RecipeTrainer:
    """Training.recipe dp for one site (`LocalSite`): its batches, steps and
    gradients, and with training.dp its privacy (`make_private`, then `dp`).
    `class_weight` is the site's class weights (None: unweighted)."""

    def __init__(self, site: Trainer, class_weight: Tensor | None) -> None:
        self.site = site
        self.section = site.training.dp_recipe
        n = len(site.data.train)
        self.n_train = n
        self.batch_size = max(1, min(self.section.batch_size, n))
        self.sample_rate = self.batch_size / n if n else 1.0
        if self.section.class_balance == "after_clipping" and class_weight is not None:
            self.class_scale: Tensor | None = (class_weight / class_weight.max()).to(site.device)
        else:
            self.class_scale = None
        self.draws = 0  # Poisson draws so far (the non-private recipe's batch t repeats)
        self.dp: DPTraining | None = None  # training.dp, once `make_private` ran

    def make_private(
        self,
        section: DPSection,
        *,
        rounds: int | None,
        model_name: str,
        protocol: str,
        siamese: bool,
    ) -> DPTraining:
        """training.dp: refuse a setting no plan covers, plan the noise over the
        run (`rounds` x steps_per_round), put Opacus's per-sample gradient hooks
        on the site's model and its DPOptimizer around the site's optimizer. A
        site without `rounds` is refused: a plan for fewer rounds than the run
        would spend more than the ε it reports as its target."""
        site = self.site
        refuse_dp_setting(protocol, siamese=siamese, devices=site.training.devices)
        if rounds is None:
            raise TrainingError(
                "dp_unplanned",
                "training.dp: the site was built without the run's rounds, so no privacy "
                "budget can be planned — build it with rounds=protocol.rounds",
            )
        refuse_unsupported(site.model, model_name)
        self.dp = DPTraining(
            section,
            n_train=len(site.data.train),
            batch_size=self.batch_size,
            sample_rate=self.sample_rate,
            total_steps=max(1, rounds) * self.steps_per_round(),
            device=site.device,
        )
        self.dp.attach(site.model)
        site.optimizer = self.dp.wrap(site.optimizer)
        return self.dp

    # ------------------------------------------------------------------ batches

    def steps_per_round(self) -> int:
        """training.steps_per_round, else dp_recipe.epochs expected passes over
        the site's images (epochs / q steps, at least 1), each pass capped at
        max_steps_per_epoch."""
        training = self.site.training
        if training.steps_per_round is not None:
            return training.steps_per_round
        per_epoch = max(1, round(1.0 / self.sample_rate)) if self.n_train else 0
        if training.max_steps_per_epoch is not None:
            per_epoch = min(per_epoch, training.max_steps_per_epoch)
        return per_epoch * self.epochs

    @property
    def epochs(self) -> int:
        """Expected passes over the site's images per round."""
        return self.section.epochs

    def poisson_batch(self) -> tuple[Tensor, Tensor]:
        """One logical batch: every training image independently with probability
        q (it may be empty, or larger than batch_size). Under training.dp the
        draws are secret (`dp.secret_generator`: which images a step used is
        part of what the guarantee hides); without it they repeat with the seed."""
        images, labels = self.site.data.train.tensors
        if self.dp is not None:
            gen = self.dp.sampling_generator
        else:
            gen = torch.Generator().manual_seed(
                self.site.training.seed * 1_000_003 + 500_009 + self.draws
            )
        self.draws += 1
        chosen = torch.nonzero(torch.rand(len(labels), generator=gen) < self.sample_rate)[:, 0]
        return images[chosen], labels[chosen]

    def batches(self, steps: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        for _ in range(self.steps_per_round() if steps is None else steps):
            yield self.poisson_batch()

    # ------------------------------------------------------------------ one step

    def _views(self, x: Tensor) -> Tensor:
        """augmult augmented views of every image: (augmult x len(x), ...), view-major."""
        return torch.cat([self.site._augment(x) for _ in range(self.section.augmult)])

    def _scale(self, y: Tensor) -> Tensor:
        if self.class_scale is None:
            return torch.ones(len(y), device=self.site.device)
        return self.class_scale[y]

    def accumulate(self, x: Tensor, y: Tensor) -> float:
        """Gradient of one logical batch into the optimizer: with training.dp,
        per-sample gradients (mean over views), clipped to C, scaled by class,
        summed, noised and divided by the expected batch size when the optimizer
        steps; without it, the same weighted mean as an ordinary gradient.
        Returns the batch's mean loss (nan for an empty batch)."""
        site, dp = self.site, self.dp
        views = self.section.augmult
        chunks = list(torch.split(torch.arange(len(y)), self.section.physical_batch_size))
        losses: list[float] = []
        if len(y) == 0:  # an empty Poisson batch: the step still happens (noise only)
            if dp is not None:
                for p in site.model.parameters():
                    if p.requires_grad:
                        p.grad_sample = torch.zeros((0, *p.shape), device=p.device)
            return math.nan
        for i, idx in enumerate(chunks):
            xb, yb = x[idx].to(site.device), y[idx].to(site.device)
            with site.autocast():
                logits = site.model(self._views(xb)).float()
            per_view = F.cross_entropy(logits, yb.repeat(views), reduction="none")
            losses.append(float(per_view.detach().mean()))
            scale = self._scale(yb)
            if dp is None:
                per_image = per_view.view(views, len(yb)).mean(0)
                (per_image * scale).sum().div(self.batch_size).backward()
                continue
            per_view.mean().backward()  # Opacus: grad_sample = each view's own gradient
            self._clip_and_scale(len(yb), scale)
            if i < len(chunks) - 1:  # a virtual step: clip and sum, no noise yet
                site.optimizer.signal_skip_step(True)  # type: ignore[attr-defined]
                site.optimizer.step()
                site.optimizer.zero_grad(set_to_none=True)
        return float(sum(losses) / len(losses))

    def _clip_and_scale(self, count: int, scale: Tensor) -> None:
        """Each image's gradient (the mean of its views'), clipped to C and times
        its class scale (<= 1): Opacus's own clipping then leaves it unchanged,
        and adds the noise for C."""
        dp = self.dp
        assert dp is not None
        params = [p for p in self.site.model.parameters() if p.requires_grad]
        views = self.section.augmult
        per_image = [  # in float32: bf16 norms could let an image past C
            p.grad_sample.float().view(views, count, *p.shape).mean(0)  # type: ignore[attr-defined]
            for p in params
        ]
        norms = torch.stack([g.reshape(count, -1).norm(dim=1) for g in per_image], 1).norm(dim=1)
        factor = (dp.max_grad_norm / (norms + 1e-6)).clamp(max=1.0) * scale
        # Opacus clips at C / (norm + 1e-6); stay a hair inside so it multiplies by 1
        factor = factor * (1.0 - 1e-5)
        for p, g in zip(params, per_image, strict=True):
            p.grad_sample = torch.einsum("i,i...->i...", factor.to(g.dtype), g)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ a round

    def train_round(self) -> tuple[list[float], int]:
        """One round of local training (FedAVGP2P): steps_per_round Poisson batches,
        then the round's EMA becomes the model. Returns (batch losses, images)."""
        site = self.site
        steps = self.steps_per_round()
        ema = _RoundEMA(site.model, self.section.ema_decay)
        losses: list[float] = []
        samples = 0
        for x, y in self.batches(steps):
            site.optimizer.zero_grad(set_to_none=True)
            loss = self.accumulate(x, y)
            site.optimizer.step()
            if self.dp is not None:
                self.dp.step_taken()
            ema.update(site.model)
            if not math.isnan(loss):
                losses.append(loss)
            samples += len(y)
        ema.apply(site.model)
        return losses, samples

    def gradient(self, x: Tensor, y: Tensor) -> None:
        """FedSGDP2P's step gradient into p.grad: with training.dp clipped,
        scaled, noised and averaged (Opacus's pre_step), no optimizer step."""
        site = self.site
        site.optimizer.zero_grad(set_to_none=True)
        site.last_loss = self.accumulate(x, y)
        if self.dp is not None:
            site.optimizer.pre_step()  # type: ignore[attr-defined]
            self.dp.step_taken()

    def summary(self) -> dict[str, Any]:
        """The recipe in effect, for `check`, metrics and the model card."""
        s = self.section
        return {
            "recipe": "dp (De et al. 2022)",
            "expected_batch_size": self.batch_size,
            "sampling": "poisson",
            "sample_rate": round(self.sample_rate, 6),
            "physical_batch_size": s.physical_batch_size,
            "augmult": s.augmult,
            "optimizer": "sgd",
            "lr": s.lr,
            "ema_decay": s.ema_decay,
            "class_balance": s.class_balance
            if self.class_scale is not None
            else f"{s.class_balance} (no class weights at this site)",
            "steps_per_round": self.steps_per_round(),
        }


class _RoundEMA:
    """Bias-corrected EMA of the parameters over one round's steps (the start of
    the round excluded): after t steps, sum_k (1-d) d^(t-k) θ_k / (1 - d^t)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.steps = 0
        self.avg = (
            {n: torch.zeros_like(p) for n, p in model.named_parameters()} if decay > 0 else {}
        )

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        if self.decay <= 0:
            return
        self.steps += 1
        for name, p in model.named_parameters():
            self.avg[name].mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)

    @torch.no_grad()
    def apply(self, model: torch.nn.Module) -> None:
        if self.decay <= 0 or self.steps == 0:
            return
        correction = 1.0 - self.decay**self.steps
        for name, p in model.named_parameters():
            p.copy_(self.avg[name] / correction)
