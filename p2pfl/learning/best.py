"""The best model so far on the site's own validation split, kept next to the
latest one.

A federation's model can peak some rounds before the last and fall back
(neighbours pulled in a late round, a learning rate still too high). A node
therefore keeps, besides the model it trains on, the model of the round whose
validation score was the highest so far, with that round's test figures, and
reports both. The score is training.select_by's figure of the val split
(`p2pfl.learning.evaluate.selection_score`: macro-F1, or the negated
class-balanced loss). Only the site's own validation split chooses; its test
split never does. The earliest round wins a tie.

A validation split that holds fewer than CHOOSING_CLASSES classes cannot
choose among a federated model's rounds: its macro-F1 is 1.0 for any model
that predicts its one class, so the "best" round is one that predicts nothing
else (on the development copy such sites' best federated rounds scored 0.43
and 0.54 macro-F1 on the global test set, pooled training 0.90). The node's
federated model (`BestModel(federated=True)`) therefore follows the latest
round there (`follows_latest`). A model for the site's own patients (the
personal model, a site alone) still chooses on that split: it does represent
them.

`BestModel.observe` is called after each evaluation with the round's metrics
(those of `p2pfl.learning.evaluate.evaluate_site`). The node protocols (the
round skeleton) and the in-process baselines use the same rule, so a
benchmark's figures compare like with like.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from p2pfl.learning.evaluate import SCORE_KEY, VAL_CLASSES_KEY

CHOOSE_BY = SCORE_KEY
# The fewest classes a validation split must hold for its score to choose.
CHOOSING_CLASSES = 2
# A round's test figures kept with the best model, reported as best_<key>.
REPORTED = ("macro_f1", "accuracy", "balanced_accuracy", "auc", "ece")


@dataclass
class BestModel:
    """The best-on-validation model so far: its round, validation score (what
    chose it) and macro-F1, test figures and (when a state function was given)
    its weights."""

    round: int | None = None
    val_macro_f1: float | None = None  # shown beside the score
    val_score: float | None = None  # what chose it (higher wins)
    test: dict[str, float] = field(default_factory=dict)
    state: dict[str, Tensor] | None = None
    # the federation's model: a val split of fewer than CHOOSING_CLASSES
    # classes cannot choose among its rounds, and it follows the latest
    federated: bool = False
    follows_latest: bool = False

    def observe(
        self,
        round_no: int,
        metrics: dict[str, Any],
        state: Callable[[], dict[str, Tensor]] | None = None,
    ) -> dict[str, float]:
        """Take round `round`'s model as the best when its validation score beats
        the best so far (`state()` gives its weights; called only then). Returns
        the figures to log with the round: best_round, best_val_macro_f1,
        best_val_score and best_<test figure>; {} when the site has no
        validation split. For the federated model, a val split of fewer than
        CHOOSING_CLASSES classes cannot choose: every round replaces the last
        (`follows_latest`)."""
        value = metrics.get(CHOOSE_BY)
        classes = metrics.get(VAL_CLASSES_KEY)
        if self.federated and classes is not None:  # (a new val split may hold more)
            self.follows_latest = int(classes) < CHOOSING_CLASSES
        if value is None:
            return {}
        if self.follows_latest or self.val_score is None or float(value) > self.val_score:
            self.round = int(round_no)
            self.val_score = float(value)
            f1 = metrics.get("val_macro_f1")
            self.val_macro_f1 = None if f1 is None else float(f1)
            self.test = {k: float(metrics[k]) for k in REPORTED if metrics.get(k) is not None}
            self.state = state() if state is not None else None
        return self.figures()

    def figures(self) -> dict[str, float]:
        """best_round, best_val_macro_f1, best_val_score, best_<test figure>
        ({} before any)."""
        if self.round is None or self.val_score is None:
            return {}
        return {
            "best_round": float(self.round),
            **({"best_follows_latest": 1.0} if self.follows_latest else {}),
            **({"best_val_macro_f1": self.val_macro_f1} if self.val_macro_f1 is not None else {}),
            "best_val_score": self.val_score,
            **{f"best_{k}": v for k, v in self.test.items()},
        }

    def summary(self) -> dict[str, Any] | None:
        """What /status shows: the best round, its validation score and
        macro-F1, and its test figures."""
        if self.round is None:
            return None
        return {
            "round": self.round,
            "val_macro_f1": self.val_macro_f1,
            "val_score": self.val_score,
            "follows_latest": self.follows_latest,
            "test": dict(self.test),
        }

    def checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint's `best` entry (weights included), or None before any."""
        if self.round is None:
            return None
        return {
            "round": self.round,
            "val_macro_f1": self.val_macro_f1,
            "val_score": self.val_score,
            "follows_latest": self.follows_latest,
            "test": dict(self.test),
            "model": self.state,
        }

    @classmethod
    def restore(cls, saved: dict[str, Any] | None, *, federated: bool = False) -> BestModel:
        """The BestModel a checkpoint's `best` entry describes (empty for None);
        `federated` as the constructor's."""
        f1 = (saved or {}).get("val_macro_f1")
        score = (saved or {}).get("val_score")
        if score is None:  # a checkpoint of before training.select_by: macro-F1 chose
            score = f1
        if score is None:
            return cls(federated=federated)
        return cls(
            federated=federated,
            round=int(saved["round"]),
            val_macro_f1=None if f1 is None else float(f1),
            val_score=float(score),
            test={str(k): float(v) for k, v in dict(saved.get("test") or {}).items()},
            state=saved.get("model"),
            follows_latest=bool(saved.get("follows_latest", False)),
        )
