"""A site's personal model beside the federated one, and the choice between them.

A hospital joins a federation for a better model for its own patients. One
averaged model serves no site of a label-skewed federation best, so every
classifier site also keeps a personal model and reports, exports and predicts
with whichever of the two does better on its own validation split. The test
split never chooses (docs/protocols.md#personalization). A validation split of
one class cannot choose among the federated model's rounds (p2pfl.learning.best).

- `finetune`: after the last round, the federated model (the best on
  validation, `p2pfl.learning.best`; its latest round where the val split
  holds one class) is fine-tuned on the site's train split
  for up to `finetune_epochs` epochs at training.lr x `finetune_lr_factor`;
  the epoch with the best validation score (training.select_by's figure,
  `p2pfl.learning.evaluate.selection_score`) is the personal model (FedAvg +
  local fine-tuning: Yu et al. 2020, "Salvaging federated learning by local
  adaptation"; Cheng et al. 2021, "Fine-tuning is fine in federated learning").
  With `local_candidate` (the default), the model the site would have
  trained alone is a candidate too: from the site's initial weights (those it
  is built with, before any training; `Personalization` must be constructed
  then), as many rounds of training.epochs epochs as the run, with the same
  learning-rate schedule and a fresh optimizer, its best round on validation
  (the training `bench.baselines.standalone` gives each site, from the same
  weights). The better of the two on validation is the personal model, so a
  site the federation did not help on its validation split keeps what it
  would have had alone (`personal_source` local). Not where the start is no
  site's own (a fine-tuning stage starts from the federation's pre-trained
  encoder) nor under training.recipe dp (whose training loop this module does
  not run): `alone_skipped` says why.
- `ditto` (Li et al. 2021, "Ditto: fair and robust federated learning through
  personalization", Alg. 1): every round, after the site's federated update, the
  personal model v takes as many steps on the site's loss plus
  lambda/2 ||v - w||^2, w the federated model the round started from. In a
  federation without a server, w is the node's model after the previous
  round's merge. Its best round on validation is kept.
- FedBN (Li et al. 2021, "FedBN: federated learning on non-IID features via
  local batch normalization"): `local_norm` keeps the BatchNorm weights and
  statistics the site's own through every merge (`norm_keys`).

Both models live in the checkpoint, so a restarted node resumes with its
personal model. The personal model shares the site's `nn.Module`: its weights
are swapped in for its steps and its evaluation, and swapped back after.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from p2pfl.config import TrainingSection
from p2pfl.learning.best import BestModel
from p2pfl.learning.evaluate import (
    SCORE_KEY,
    VAL_CLASSES_KEY,
    evaluate_site,
    select_by,
    selection_score,
)
from p2pfl.learning.optimizer import (
    build_optimizer,
    export_optimizer_state,
    import_optimizer_state,
    lr_factor,
)
from p2pfl.learning.sites import interned_initial
from p2pfl.learning.trainer import Trainer

log = logging.getLogger(__name__)

REPORTED_FIGURES = ("macro_f1", "accuracy", "balanced_accuracy", "auc")
WHICH = ("federated", "personal")


def resolve_method(training: TrainingSection) -> str:
    """training.personalization.method with `auto` resolved: finetune, or none
    under training.dp."""
    method = training.personalization.method
    if method == "auto":
        return "none" if training.dp is not None else "finetune"
    return method


def norm_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of the model's BatchNorm layers (weights, biases,
    running statistics): what FedBN keeps local."""
    keys: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            prefix = f"{name}." if name else ""
            keys += [prefix + k for k in module.state_dict()]
    return keys


def personalizable(site: Any) -> bool:
    """A classifier site this module can personalize (LocalSite, not a
    pre-training site nor a data-parallel wrapper)."""
    from p2pfl.learning.train import LocalSite

    return isinstance(site, LocalSite)


@contextlib.contextmanager
def swapped(site: Any, state: dict[str, Tensor]) -> Iterator[None]:
    """The site's module holds `state` inside the block, its own weights after."""
    own = site.state_dict()
    site.load_state_dict(state)
    try:
        yield
    finally:
        site.load_state_dict(own)


class Personalization:
    """One site's personal model, its best round on validation, and the final
    choice. `method` is resolved (`resolve_method`)."""

    def __init__(self, training: TrainingSection, site: Any, *, own_start: bool = True) -> None:
        """Construct it before the site trains: its weights now are the start
        of the local candidate. `own_start` False: they hold what a federation
        made (a fine-tuning stage's pre-trained encoder), so there is no model
        the site would have had alone."""
        self.section = training.personalization
        self.classifier = classifier = personalizable(site)  # not the probe's None, nor MAE
        self.method = resolve_method(training) if classifier else "none"
        val = site.data.val if classifier else None
        self.has_val = val is not None and len(val) > 0
        self.state: dict[str, Tensor] | None = None  # ditto: v, trained every round
        self.optimizer_saved: dict[str, Any] | None = None
        self.start_state: dict[str, Tensor] | None = None  # ditto: w of the round
        self.best = BestModel()  # the personal model's best on validation
        self.choice: dict[str, Any] | None = None
        self.finetune_epoch: int | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._keys = norm_keys(site.model) if self.section.local_norm and classifier else []
        # finetune's local candidate starts where the rounds start: the weights the
        # site is built with (a restart builds them again before loading its checkpoint)
        self.alone_skipped = _alone_skipped(self, training, own_start)
        self.initial: dict[str, Tensor] | None = (
            interned_initial(site.state_dict()) if self.alone_skipped is None else None
        )
        self.source: str | None = None  # which training made the personal model
        self.alone_val_score: float | None = None
        self.alone_round: int | None = None  # the round of training alone that was kept

    @property
    def active(self) -> bool:
        return self.method != "none"

    @property
    def ditto(self) -> bool:
        """A personal model trained every round (its steps follow the train phase)."""
        return self.method == "ditto"

    @property
    def local_norm(self) -> bool:
        """FedBN: BatchNorm entries to keep through every merge."""
        return bool(self._keys)

    # ------------------------------------------------------------------ FedBN

    def keep_norm(self, site: Any) -> dict[str, Tensor] | None:
        """local_norm: the site's BatchNorm entries before a merge."""
        if not self._keys:
            return None
        state = site.model.state_dict()
        return {k: state[k].detach().clone() for k in self._keys}

    def restore_norm(self, site: Any, kept: dict[str, Tensor] | None) -> None:
        """local_norm: put the site's own BatchNorm entries back after a merge."""
        if kept:
            site.load_state_dict(kept, strict=False)

    # ------------------------------------------------------------------ ditto

    def start_round(self, site: Any) -> None:
        """ditto: the federated model w the round's training starts from (called
        right before the train phase: FedER merges the relayed model first)."""
        if self.method == "ditto":
            self.start_state = site.state_dict()
            if self.state is None:  # v starts where the federation starts
                self.state = site.state_dict()

    def _personal_optimizer(self, site: Any, lr: float) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._optimizer = build_optimizer(site.model, site.training)
            if self.optimizer_saved is not None:
                import_optimizer_state(self._optimizer, self.optimizer_saved)
        return _at_lr(self._optimizer, lr)

    def after_fit(self, site: Any) -> dict[str, float]:
        """ditto: the personal model's steps of this round (as many as the
        site's federated update took), each on the site's loss plus
        lambda/2 ||v - w||^2. Returns {'personal_loss', 'personal_s'}."""
        if self.method != "ditto" or self.state is None or self.start_state is None:
            return {}
        start = time.perf_counter()
        lam = self.section.ditto_lambda
        with swapped(site, self.state):
            anchor = {
                name: self.start_state[name].to(site.device)
                for name, _ in site.model.named_parameters()
            }
            optimizer = self._personal_optimizer(site, site.lr)
            losses = self._steps(site, optimizer, lambda: _proximal(site.model, anchor, lam))
            self.state = site.state_dict()
        return {
            "personal_loss": float(sum(losses) / len(losses)) if losses else float("nan"),
            "personal_s": time.perf_counter() - start,
        }

    # ------------------------------------------------------------------ training

    def _steps(self, site: Any, optimizer: torch.optim.Optimizer, extra: Any = None) -> list[float]:
        """One round's (or one epoch's) local steps of the module as it is now."""
        site.model.train()
        losses: list[float] = []
        # logit_adjustment: federated trains only the federated model with balanced
        # softmax; a site's own models keep its class-weighted loss (FedRoD)
        weight: Any = (
            getattr(site, "site_class_weight", None)
            if getattr(site.training, "logit_adjustment", False) == "federated"
            else "site"
        )
        for x, y in Trainer.training_batches(site, site.training.epochs):
            x = site._augment(x)
            y = y.to(site.device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = site.loss(x, y, weight)
            if extra is not None:
                loss = loss + extra()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        optimizer.zero_grad(set_to_none=True)
        site.weights_changed()
        return losses

    def observe(self, round_no: int, site: Any) -> dict[str, float]:
        """ditto, at an evaluated round: the personal model's figures
        (personal_<figure>, personal_val_macro_f1), and its best so far."""
        if self.method != "ditto" or self.state is None:
            return {}
        with swapped(site, self.state):
            metrics = evaluate_site(site, REPORTED_FIGURES)
        metrics.pop("per_class_f1", None)
        self.best.observe(round_no, metrics, lambda: dict(self.state or {}))
        metrics.pop(VAL_CLASSES_KEY, None)  # the federated model's figure already
        return {f"personal_{k}": float(v) for k, v in metrics.items() if v is not None}

    def finetune(self, site: Any, start: dict[str, Tensor]) -> None:
        """finetune: from `start`, up to finetune_epochs epochs; after each, the
        validation figures, and the best epoch is the personal model (the test
        split is evaluated only for an epoch that is kept, to report it)."""
        lr = site.training.lr * self.section.finetune_lr_factor
        with swapped(site, start):
            optimizer = _at_lr(build_optimizer(site.model, site.training), lr)
            for epoch in range(1, self.section.finetune_epochs + 1):
                self._steps(site, optimizer)
                if _observe_epoch(site, self.best, epoch):
                    self.finetune_epoch = epoch

    def train_alone(self, site: Any, rounds: int) -> BestModel:
        """local_candidate: from the weights the rounds started from, `rounds`
        rounds of training.epochs epochs each on the site's train split, at the
        rounds' learning-rate schedule, with a fresh optimizer (what the site
        alone trains: `bench.baselines.standalone`); its best round on
        validation (the test split is evaluated only for a round that is kept)."""
        best = BestModel()
        assert self.initial is not None
        with swapped(site, self.initial):
            optimizer = build_optimizer(site.model, site.training)
            for r in range(1, rounds + 1):
                _at_lr(optimizer, site.training.lr * lr_factor(site.training, r, rounds))
                self._steps(site, optimizer)
                _observe_epoch(site, best, r)
        return best

    # ------------------------------------------------------------------ the choice

    def choose(self, site: Any, federated: BestModel, round_no: int = 0) -> dict[str, Any]:
        """After the last round: the personal model (fine-tuned now, or
        ditto's best), and which of the two the site reports: the better
        validation score (training.select_by's figure); the federated one on a
        tie or without a validation split. Fine-tuning starts from the
        federated model: its latest round where the val split holds one class
        (`BestModel.follows_latest`). Returns the figures logged with the
        last round: reported_personal (1.0 or 0.0), reported_<figure>,
        personal_<figure>, personal_val_macro_f1, personal_val_score."""
        if not self.classifier:  # nothing to choose between (probe, pre-training)
            return {}
        if not self.active or not self.has_val:
            self.choice = {"reported": "federated", "why": self._why_federated()}
        else:
            if self.method == "finetune":
                start = federated.state if federated.state is not None else site.state_dict()
                self.best = BestModel()
                self.finetune_epoch = None
                self.alone_val_score = None
                self.alone_round = None
                self.finetune(site, start)
                # the personal model is of the federated round it was tuned from
                # (export, the model card); the epoch is kept beside it
                self.best.round = federated.round if federated.round is not None else round_no
                self.source = "finetune"
                if self.initial is not None:  # as many rounds alone as the run's
                    self._against_alone(site, round_no or federated.round or 1)
            else:
                self.source = self.method
            personal_val, federated_val = self.best.val_score, federated.val_score
            better = personal_val is not None and (
                federated_val is None or personal_val > federated_val
            )
            by = select_by(site)
            self.choice = {
                "reported": "personal" if better else "federated",
                "why": (
                    f"validation {_figure(by, personal_val)} personal"
                    f"{' (trained alone)' if self.source == 'local' else ''} vs "
                    f"{_figure(by, federated_val)} federated"
                    if personal_val is not None
                    else "no personal model"
                ),
                "select_by": by,
                "personal_val_score": personal_val,
                "federated_val_score": federated_val,
                "personal_val_macro_f1": self.best.val_macro_f1,
                "federated_val_macro_f1": federated.val_macro_f1,
                "personal_round": self.best.round,
                "finetune_epoch": self.finetune_epoch if self.source == "finetune" else None,
                "personal_source": self.source,
                "alone_val_score": self.alone_val_score,
                "alone_round": self.alone_round,
                "alone_skipped": self.alone_skipped,
                "personal_test": dict(self.best.test),
            }
        self.choice["method"] = self.method
        self.choice["round"] = int(round_no)  # the last round it was made after
        self.choice["federated_test"] = dict(federated.test)
        log.info(
            "personalization (%s): reporting the %s model (%s)",
            self.method,
            self.choice["reported"],
            self.choice["why"],
        )
        return self.figures()

    def _against_alone(self, site: Any, rounds: int) -> None:
        """local_candidate: the site's model alone replaces the fine-tuned one
        as the personal model when its validation score is higher (the
        fine-tuned one on a tie)."""
        rounds = max(int(rounds), 1)
        alone = self.train_alone(site, rounds)
        self.alone_val_score = alone.val_score
        tuned = self.best.val_score
        if alone.val_score is not None and (tuned is None or alone.val_score > tuned):
            log.info(
                "personalization: the model trained alone (round %s of %s) leads the "
                "fine-tuned one on validation (%s vs %s): it is the personal model",
                alone.round,
                rounds,
                alone.val_score,
                tuned,
            )
            self.alone_round = alone.round
            alone.round = int(rounds)  # a model of the whole run (export, the model card)
            self.best = alone
            self.source = "local"
            self.finetune_epoch = None

    def _why_federated(self) -> str:
        if not self.active:
            return "personalization.method none"
        return "no validation split to choose on"

    def figures(self) -> dict[str, Any]:
        """The metrics-line figures of the choice ({} before it is made)."""
        if self.choice is None:
            return {}
        # metrics.jsonl holds numbers: 1.0 = the personal model is reported.
        out: dict[str, Any] = {"reported_personal": float(self.choice["reported"] == "personal")}
        if self.choice.get("personal_source") in ("finetune", "local"):
            out["personal_trained_alone"] = float(self.choice["personal_source"] == "local")
        personal = self.choice.get("personal_test") or {}
        federated = self.choice.get("federated_test") or {}
        reported = personal if self.choice["reported"] == "personal" else federated
        for key in REPORTED_FIGURES:
            if key in personal:
                out[f"personal_{key}"] = personal[key]
            if key in reported:
                out[f"reported_{key}"] = reported[key]
        for key in ("personal_val_macro_f1", "personal_val_score"):
            if self.choice.get(key) is not None:
                out[key] = self.choice[key]
        return out

    def summary(self) -> dict[str, Any]:
        """/status's training.personalization block."""
        return {
            "method": self.method,
            "local_norm": self.local_norm,
            "choice": self.choice,
            "personal_best": self.best.summary(),
        }

    # ------------------------------------------------------------------ checkpoint

    def checkpoint(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "state": self.state,
            "optimizer": export_optimizer_state(self._optimizer)
            if self._optimizer is not None
            else self.optimizer_saved,
            "best": self.best.checkpoint(),
            "choice": self.choice,
        }

    def restore(self, saved: dict[str, Any] | None, *, keep_best: bool = True) -> None:
        """The checkpoint's personal model; `keep_best` False: its best so far and
        the choice are dropped (their scores are of another training.select_by)."""
        if not saved or saved.get("method") != self.method:
            return
        self.state = saved.get("state")
        self.optimizer_saved = saved.get("optimizer")
        if keep_best:
            self.best = BestModel.restore(saved.get("best"))
            self.choice = saved.get("choice")


def _at_lr(optimizer: torch.optim.Optimizer, lr: float) -> torch.optim.Optimizer:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return optimizer


def _alone_skipped(
    personal: Personalization, training: TrainingSection, own_start: bool
) -> str | None:
    """Why the site has no local candidate (None: it has one)."""
    if personal.method != "finetune":
        return f"personalization.method {personal.method}"
    if not personal.section.local_candidate:
        return "personalization.local_candidate false"
    if not personal.has_val:
        return "no validation split to choose on"
    if training.recipe != "standard":
        return f"training.recipe {training.recipe}: its training loop is not this module's"
    if not own_start:
        return "the stage starts from the federation's pre-trained encoder, not the site's own"
    return None


def _observe_epoch(site: Any, best: BestModel, epoch: int) -> bool:
    """An epoch of fine-tuning or of training alone: its validation score, and
    `best` takes it when it leads (BestModel.observe's rule; the test split is
    evaluated only then, to report it). True when it was kept."""
    val = site.evaluate("val")
    score = selection_score(val, select_by(site))
    if score is None or (best.val_score is not None and not score > best.val_score):
        return False
    metrics = {
        "val_macro_f1": val["macro_f1"],
        "val_accuracy": val["accuracy"],
        SCORE_KEY: score,
    }
    test = site.evaluate_available(("test",)).get("test")
    if test is not None:
        metrics.update({key: test[key] for key in REPORTED_FIGURES})
    best.observe(epoch, metrics, site.state_dict)
    return best.round == epoch


def _proximal(model: nn.Module, anchor: dict[str, Tensor], lam: float) -> Tensor:
    """lambda/2 ||v - w||^2 over the model's parameters (Ditto's term)."""
    total = torch.zeros((), device=next(model.parameters()).device)
    for name, param in model.named_parameters():
        total = total + (param - anchor[name]).pow(2).sum()
    return 0.5 * lam * total


FIGURE_NAMES = {"macro_f1": "macro-F1", "balanced_loss": "balanced loss"}


def _figure(by: str, score: float | None) -> str:
    """A validation score as the figure it is ("balanced loss 0.3120")."""
    if score is None:
        return f"{FIGURE_NAMES[by]} n/a"
    return f"{FIGURE_NAMES[by]} {-score if by == 'balanced_loss' else score:.4f}"
