"""Differentially private local training with Opacus (`training.dp`).

DP-SGD (Abadi et al. 2016) as Opacus implements it: per-sample gradients
(`GradSampleModule`'s hooks on the site's own model, so parameter names and
state dicts stay those of the model), each clipped to `max_grad_norm`, summed,
Gaussian noise of std `noise_multiplier x max_grad_norm` added, divided by the
batch size (`DPOptimizer`), and Opacus's RDP accountant advanced by one step of
sample rate batch_size / train images per optimizer step. With
`target_epsilon`, the noise multiplier is the one Opacus computes for the
whole run (the protocol's rounds x the steps of a round) at `delta`.

Batches are Poisson-sampled (each image joins a step with probability q =
expected batch / train images), the subsampling the RDP accountant's bound is
proved for, and the site trains with the recipe of `p2pfl.learning.dp_recipe`
(large batches, augmentation multiplicity, class balance after clipping, EMA).
The Gaussian noise and the Poisson draws come from generators seeded from the
operating system's entropy (`secret_generator`), never from training.seed: an
adversary who knows a site.yaml (its seed is usually the default 0) must not
be able to regenerate the noise and subtract it, or know which images a step
sampled. The noise is drawn as Opacus's `secure_mode` draws it (a sum of four
Gaussians, against the floating-point attack of Mironov 2012 / Haney et al.),
from that generator; it is not a cryptographic generator (a stated limit,
docs/threat-model.md). A private run therefore does not repeat exactly.

Everything a site shares afterwards (models, FedSGDP2P's noised gradients) is
post-processing, so ε is the site's guarantee for its training images against
anyone who sees what it sent, peers included.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from p2pfl.config.sections import DPSection
from p2pfl.config.site import dp_unsupported_setting
from p2pfl.files import atomic_write_json
from p2pfl.learning.errors import TrainingError

DEFAULT_DELTA = 1e-5
# STATE/dp_ledger.json (protocols/rounds.py keeps it): every private step, before it is used
LEDGER = "dp_ledger.json"


# set in a ledger when the site trains without training.dp: what it sent then has no ε
UNPRIVATE = "trained_without_dp"


class LedgerUnprivate(ValueError):
    """The ledger's site trained without training.dp after its private steps."""


def unprivate_marker(path: Path) -> Path:
    """STATE/dp_ledger.unprivate beside the ledger `path`: the mark of
    `mark_unprivate` that a ledger restored from a backup, or rewritten, keeps."""
    return path.with_suffix(".unprivate")


def read_ledger(path: Path) -> list[tuple[float, float, int]]:
    """The (noise multiplier, sample rate, steps) a privacy ledger records;
    OSError or ValueError when it cannot be read, LedgerUnprivate when the
    site trained without training.dp since (`mark_unprivate`)."""
    if unprivate_marker(path).exists():
        raw: Any = {UNPRIVATE: True}
    else:
        try:
            raw = json.loads(path.read_text())
            saved = raw["history"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a privacy ledger ({type(exc).__name__}: {exc})") from None
    if raw.get(UNPRIVATE):
        raise LedgerUnprivate(
            "the site trained without training.dp after these private steps, and a model it "
            "sent then is covered by no ε"
        )
    return checked_history(saved)


def mark_unprivate(path: Path | None, *, private_checkpoint: bool = False) -> None:
    """A start without training.dp where a privacy ledger is (`path`): the
    ledger says so before anything is trained, so no later start under
    training.dp, nor `export`, states an ε that leaves out a model trained in
    the clear (review r1: a run without training.dp, killed after it served a
    round's model and before its checkpoint, left the private checkpoint
    before it to resume, and the ε reported then covered every model sent)."""
    if path is None or not (path.exists() or private_checkpoint):
        return
    # a missing ledger beside a checkpoint of private steps (`private_checkpoint`) is
    # marked too: before a third review the run in the clear left no mark, and the
    # ledger restored from a backup (as dp_ledger_missing asks) then read as private
    # beside it too: before review r1b an unreadable ledger was left unmarked, and
    # the copy restored from a backup (as dp_ledger_unreadable asks) read as private
    atomic_write_json(unprivate_marker(path), {UNPRIVATE: True, "ledger": path.name})
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        raw = None
    if not isinstance(raw, dict) or raw.get(UNPRIVATE):
        return  # unreadable: refused as such under training.dp already
    atomic_write_json(path, {**raw, UNPRIVATE: True})


def checked_history(saved: Any) -> list[tuple[float, float, int]]:
    """A privacy history as a ledger or a checkpoint's `dp_history` records it:
    (noise multiplier, sample rate, steps) each; ValueError when it is not one."""
    try:
        history = [(float(s), float(q), int(n)) for s, q, n in saved]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not a privacy history ({type(exc).__name__}: {exc})") from None
    if not all(math.isfinite(s) and s >= 0 and 0 <= q <= 1 and n >= 0 for s, q, n in history):
        raise ValueError("a step's noise multiplier, sample rate or count is out of range")
    return history


def history_prefix(
    history: list[tuple[float, float, int]], steps: int
) -> list[tuple[float, float, int]]:
    """The first `steps` private steps `history` records, at the price each was
    paid at (what a model of an earlier round was trained with); ValueError
    when it records fewer."""
    out, left = [], steps
    for sigma, q, n in history:
        if left <= 0:
            break
        take = min(n, left)
        out.append((sigma, q, take))
        left -= take
    if left > 0:
        raise ValueError(f"the history records {steps - left} of {steps} steps")
    return out


def ledger_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """ε at `delta` of every step `history` records (0 before the first)."""
    from opacus.accountants import RDPAccountant

    spent = [(s, q, n) for s, q, n in history if n > 0]
    if not spent:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = spent
    return float(accountant.get_epsilon(delta=delta))


def unsupported_layers(model: nn.Module) -> list[str]:
    """What Opacus cannot train privately in `model`, one line each: what its
    ModuleValidator refuses (BatchNorm, ...), every layer that keeps running
    statistics (a subclass of BatchNorm, as timm's BatchNormAct2d, which the
    validator's exact-type check passes: review r1), and what GradSampleModule
    itself would refuse when it is attached (a trainable layer with buffers)."""
    from opacus import GradSampleModule
    from opacus.validators import ModuleValidator

    errors = [*ModuleValidator.validate(model, strict=False)]
    errors += [
        f"{name or type(model).__name__} ({type(module).__name__}) keeps running statistics "
        "of the training images, which no noise covers"
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
    ]
    errors += GradSampleModule.validate(model, strict=False)
    # Opacus explains at length; the first sentence names the layer and the problem
    return [str(e).split(". ")[0].strip() for e in errors]


def refuse_unsupported(model: nn.Module, model_name: str) -> None:
    problems = unsupported_layers(model)
    if problems:
        fix = (
            "use model.name: small_cnn_ws (the same CNN with GroupNorm and weight "
            "standardization, the DP recipe's model)"
            if model_name == "small_cnn"
            else "use a model without BatchNorm (GroupNorm), e.g. small_cnn_ws"
        )
        raise TrainingError(
            "dp_unsupported_model",
            f"training.dp: Opacus cannot compute per-sample gradients of {model_name} "
            f"({problems[0]}); {fix}",
        )


def secret_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on `device` seeded with 64 bits from os.urandom: its
    draws cannot be reproduced from anything in the site's configuration."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
    return generator


def refuse_dp_setting(protocol: str, *, siamese: bool, devices: int) -> None:
    """TrainingError when training.dp cannot run this way (the config's own
    guard, `p2pfl.config.site.dp_unsupported_setting`, for a site built without
    a site.yaml)."""
    problem = dp_unsupported_setting(protocol, siamese=siamese, devices=devices)
    if problem is not None:
        raise TrainingError("dp_unsupported", f"training.dp: {problem[0]} — {problem[1]}")


class DPTraining:
    """The privacy side of a LocalSite: noise, clipping, the accountant."""

    def __init__(
        self,
        section: DPSection,
        *,
        n_train: int,
        batch_size: int,
        total_steps: int,
        sample_rate: float | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """`batch_size` is the expected batch of a step and `sample_rate` its
        Poisson sampling rate (default batch_size / n_train); `device` is the
        model's (the noise is drawn there)."""
        from opacus.accountants import RDPAccountant
        from opacus.accountants.utils import get_noise_multiplier

        if n_train < 1:
            raise TrainingError("dp_no_data", "training.dp: the site has no training images")
        self.section = section
        self.delta = section.delta if section.delta is not None else DEFAULT_DELTA
        self.sample_rate = (
            min(1.0, batch_size / n_train) if sample_rate is None else float(sample_rate)
        )
        self.max_grad_norm = section.max_grad_norm
        self.batch_size = batch_size
        self.total_steps = max(1, total_steps)
        if section.noise_multiplier is not None:
            self.noise_multiplier = float(section.noise_multiplier)
        else:
            assert section.target_epsilon is not None
            try:
                self.noise_multiplier = float(
                    get_noise_multiplier(
                        target_epsilon=section.target_epsilon,
                        target_delta=self.delta,
                        sample_rate=self.sample_rate,
                        steps=self.total_steps,
                        accountant="rdp",
                    )
                )
            except ValueError as exc:  # Opacus: "The privacy budget is too low."
                raise TrainingError(
                    "dp_budget_too_low",
                    f"training.dp.target_epsilon {section.target_epsilon:g} cannot be met over "
                    f"{self.total_steps} steps at sample rate {self.sample_rate:.4f} ({exc}) — "
                    "raise target_epsilon or train fewer rounds",
                ) from None
        self.accountant = RDPAccountant()
        self.noise_generator = secret_generator(device)
        self.sampling_generator = secret_generator("cpu")

    @property
    def steps(self) -> int:
        """Private steps taken so far (the accountant's history)."""
        return sum(int(n) for _, _, n in self.accountant.history)

    def attach(self, model: nn.Module) -> None:
        """Per-sample gradient hooks on `model` itself (its state dict is unchanged)."""
        import warnings

        from opacus import GradSampleModule

        # The first layer's input needs no gradient; torch says so on every backward.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self._hooks = GradSampleModule(model, batch_first=True, loss_reduction="mean")

    def wrap(self, optimizer: Optimizer) -> Optimizer:
        from opacus.optimizers import DPOptimizer

        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        self._optimizer = DPOptimizer(
            optimizer,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=self.batch_size,
            loss_reduction="mean",
            generator=self.noise_generator,
            secure_mode=True,
        )
        return self._optimizer

    _optimizer: Any = None  # the DPOptimizer `wrap` made last (its noise follows `replan`)

    def step_taken(self) -> None:
        """Account for one private optimizer step, durably (the ledger) before
        anything computed from it can leave the site."""
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        if self.ledger is not None:
            atomic_write_json(self.ledger, {"history": self.history()})

    ledger: Path | None = None

    def history(self) -> list[list[float]]:
        """Every (noise multiplier, sample rate, steps) spent, as the accountant keeps them."""
        return [[float(sigma), float(q), int(n)] for sigma, q, n in self.accountant.history]

    def keep_ledger(self, path: Path | None) -> None:
        """Write the spending to `path` at every step, and take over what a
        ledger already there records: steps a crash interrupted after their
        results may have been sent are spent too."""
        self.ledger = path
        if path is None or not path.exists():
            return
        try:
            history = read_ledger(path)
        except LedgerUnprivate as exc:
            raise TrainingError(
                "dp_ledger_unprivate",
                f"training.dp: {path}: {exc} — start from a fresh state directory to train "
                "privately",
            ) from None
        except (OSError, ValueError) as exc:
            raise TrainingError(
                "dp_ledger_unreadable",
                f"training.dp: the privacy ledger {path} cannot be read ({exc}); the spent budget "
                "is unknown, so the node does not train on — restore the file or start a fresh state",
            ) from None
        self.restore(history)

    def restore(self, history: list[tuple[float, float, int]] | list[list[float]]) -> None:
        """After a resume: every step already taken, at the noise and sample rate
        it was taken with (a changed site.yaml does not re-price the past)."""
        from opacus.accountants import RDPAccountant

        spent = [(float(s), float(q), int(n)) for s, q, n in history if int(n) > 0]
        if sum(n for _, _, n in spent) < self.steps:
            return  # the ledger is ahead of this record
        self.accountant = RDPAccountant()
        self.accountant.history = spent

    def replan(self, remaining: int) -> None:
        """target_epsilon, at a start: the noise for the `remaining` steps the
        run has left (those of the rounds after the checkpoint's, not the
        planned steps less those spent: a round trained again after a crash
        is spent twice) priced on top of every step already spent, so the
        target is still met by the last planned round. Before review r1 the
        plan ignored what was spent: a node killed between a round's training
        and its checkpoint trains that round again, and ended above its target
        (2.19 for a target of 2). Unchanged where the current noise already
        meets the target; TrainingError when the spent budget leaves no room."""
        target = self.section.target_epsilon
        if target is None or self.steps == 0 or remaining <= 0:
            return
        spent = list(self.accountant.history)

        def epsilon_at(sigma: float) -> float:
            return ledger_epsilon([*spent, (sigma, self.sample_rate, remaining)], self.delta)

        if epsilon_at(self.noise_multiplier) <= target:
            return
        low, high = self.noise_multiplier, max(2.0 * self.noise_multiplier, 1.0)
        while epsilon_at(high) > target:
            if high > 1e4:
                raise TrainingError(
                    "dp_budget_spent",
                    f"training.dp.target_epsilon {target:g}: the {self.steps} private steps "
                    f"already spent (ε {self.epsilon:.3f}) leave no room for the run's "
                    f"{remaining} remaining steps — raise target_epsilon or train fewer rounds",
                )
            low, high = high, 2.0 * high
        while epsilon_at(high) < target - 0.01 and high - low > 1e-6 * high:
            mid = (low + high) / 2
            low, high = (low, mid) if epsilon_at(mid) <= target else (mid, high)
        self.noise_multiplier = high
        if self._optimizer is not None:
            self._optimizer.noise_multiplier = high

    @property
    def epsilon(self) -> float:
        """ε spent so far at δ (0 before the first step)."""
        if self.steps == 0:
            return 0.0
        return float(self.accountant.get_epsilon(delta=self.delta))

    def summary(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self.max_grad_norm,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "target_epsilon": self.section.target_epsilon,
            "planned_steps": self.total_steps,
            "accountant": "rdp (opacus)",
            "sampling": "poisson",
        }
