"""One steps-per-round formula (`p2pfl.learning.steps.steps_per_round`), checked
against the loops whose steps it counts: `Trainer.training_batches` (the site's
own split) and replay-only training (the buffer, in whole batches).

Three formulas disagreed before (issue 29): LocalSite's counted a last batch of
one sample, which training skips; FedSGDP2P's counted batches of one sample
when batch_size was 1; replay-only training counted iterations that skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from p2pfl.config import TrainingSection
from p2pfl.learning.data import site_data_from_arrays
from p2pfl.learning.steps import steps_per_round
from p2pfl.learning.train import LocalSite
from p2pfl.learning.trainer import Trainer


def training(batch: int, epochs: int = 1, steps: int | None = None, cap: int | None = None):
    return TrainingSection(
        batch_size=batch, epochs=epochs, steps_per_round=steps, max_steps_per_epoch=cap
    )


def data(n: int):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(n, 4, 4, 1), dtype=np.uint8)
    return site_data_from_arrays((images, np.arange(n) % 2), class_names=["a", "b"])


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 2))


@pytest.mark.parametrize(
    ("n", "batch", "epochs", "steps", "cap", "expected"),
    [
        (64, 32, 1, None, None, 2),  # no remainder
        (65, 32, 1, None, None, 2),  # remainder 1: skipped (the old LocalSite count said 3)
        (66, 32, 1, None, None, 3),  # remainder 2: a step
        (65, 32, 3, None, None, 6),  # per epoch, times epochs
        (97, 32, 1, None, 4, 3),  # the cap reaches the 1-sample batch: still skipped
        (97, 32, 1, None, 3, 3),  # the cap stops before it
        (100, 32, 2, None, 2, 4),  # the cap cuts an epoch with a usable short batch
        (20, 32, 1, None, None, 1),  # fewer images than a batch: one step
        (1, 32, 1, None, None, 0),  # one image: nothing to train on
        (1, 32, 1, 5, None, 0),  # ... whatever steps_per_round says
        (3, 32, 1, 5, None, 5),  # steps_per_round cycles through reshuffled epochs
        (400, 16, 3, 7, 2, 7),  # steps_per_round wins over epochs and the cap
        (50, 1, 1, None, None, 0),  # batch_size 1: every batch skipped (FedSGDP2P said 50)
        (50, 1, 1, 4, None, 0),
    ],
)
def test_steps_per_round_at_the_remainders(n, batch, epochs, steps, cap, expected) -> None:
    t = training(batch, epochs, steps, cap)
    assert steps_per_round(n, t) == expected
    trainer = Trainer(tiny_model(), data(n), t, device="cpu")
    assert trainer.steps_per_round() == expected
    assert sum(1 for _ in trainer.training_batches(epochs)) == expected


@pytest.mark.parametrize(
    ("n", "batch", "epochs", "steps", "cap", "expected"),
    [
        (100, 32, 1, None, None, 3),  # whole batches: the remainder is reshuffled, not a step
        (64, 32, 2, None, None, 4),
        (20, 32, 1, None, None, 1),  # a buffer smaller than a batch: one batch of all of it
        (100, 32, 3, None, 2, 6),
        (100, 32, 1, 5, None, 5),
        (1, 32, 1, 5, None, 0),  # batches of one image are skipped
        (40, 1, 1, None, None, 0),
    ],
)
def test_replay_alone_takes_the_whole_batch_count(n, batch, epochs, steps, cap, expected) -> None:
    t = training(batch, epochs, steps, cap)
    assert steps_per_round(n, t, whole_batches=True) == expected
    site = LocalSite(tiny_model(), data(8), t, device="cpu")
    replay = data(n).train.tensors
    fit = site.train_replay_epochs(*replay, private=False)
    assert fit["steps"] == expected


def test_the_count_is_the_loops_over_a_grid() -> None:
    """Every n 1..24, batch 1..7, epochs 1..2, steps_per_round None/1/5 and
    max_steps_per_epoch None/1/3: the formula equals the batches
    training_batches yields."""
    wrong = []
    for n in range(1, 25):
        trainer = Trainer(tiny_model(), data(n), training(1), device="cpu")
        for batch in range(1, 8):
            for epochs in (1, 2):
                for steps in (None, 1, 5):
                    for cap in (None, 1, 3):
                        trainer.training = training(batch, epochs, steps, cap)
                        taken = sum(1 for _ in trainer.training_batches(epochs))
                        if steps_per_round(n, trainer.training) != taken:
                            wrong.append((n, batch, epochs, steps, cap, taken))
    assert wrong == []
