"""training.steps_per_round and training.class_weighted."""

from __future__ import annotations

import numpy as np
import torch

from p2pfl.config import TrainingSection
from p2pfl.learning.class_weights import median_frequency_weights
from p2pfl.learning.data import site_data_from_arrays
from p2pfl.learning.models import create_model
from p2pfl.learning.train import LocalSite


def site(n: int, training: TrainingSection, minority_every: int = 0) -> LocalSite:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(n, 8, 8, 1), dtype=np.uint8)
    labels = (
        (np.arange(n) % minority_every == 0).astype(int) if minority_every else np.arange(n) % 2
    )
    data = site_data_from_arrays((images, labels), class_names=["a", "b"])
    torch.manual_seed(0)
    return LocalSite(
        create_model("small_cnn", in_chans=1, num_classes=2, image_size=8), data, training
    )


def test_steps_per_round_gives_every_site_the_same_work():
    small = site(40, TrainingSection(batch_size=16, steps_per_round=7))
    large = site(400, TrainingSection(batch_size=16, steps_per_round=7))
    assert small.train_epochs()["steps"] == 7  # cycles through reshuffled epochs
    assert large.train_epochs()["steps"] == 7  # stops mid-epoch
    assert site(400, TrainingSection(batch_size=16, epochs=1)).train_epochs()["steps"] == 25


def test_class_weighted_loss_uses_median_frequency_weights():
    weights = median_frequency_weights([90, 10, 0])
    assert torch.allclose(weights, torch.tensor([50 / 90, 50 / 10, 0.0]))
    plain = site(100, TrainingSection(batch_size=16, class_weighted=False), minority_every=10)
    weighted = site(100, TrainingSection(batch_size=16, class_weighted=True), minority_every=10)
    assert plain.class_weight is None
    counts = weighted.data.class_counts("train")
    assert torch.allclose(weighted.class_weight, median_frequency_weights(counts))
    x, y = next(weighted.batches("train", shuffle=False))
    assert not torch.isclose(plain.loss(x, y), weighted.loss(x, y))
