"""The inference batch size is timed once per process for each model, forward,
image shape and thread count (p2pfl/learning/evaluate.py `fastest_batch_size`)."""

from __future__ import annotations

import pytest
import torch

from p2pfl.learning import evaluate
from p2pfl.learning.evaluate import CALIBRATION_IMAGES, EVAL_CHUNKS, fastest_batch_size
from p2pfl.learning.models import SmallCNN


class Counted:
    """`forward` with the number of images it was given."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.images = 0
        self.__name__ = "forward"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.images += len(x)
        return self.model(x)


@pytest.fixture(autouse=True)
def no_earlier_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(evaluate, "_FASTEST", {})


def test_a_second_site_of_the_same_model_is_not_timed_again() -> None:
    torch.manual_seed(0)
    images = torch.randn(CALIBRATION_IMAGES, 1, 16, 16)
    first = SmallCNN(num_classes=3)
    first.train()
    forward = Counted(first)
    size = fastest_batch_size(first, forward, images)
    assert size in EVAL_CHUNKS
    assert forward.images == 2 * len(EVAL_CHUNKS) * CALIBRATION_IMAGES  # twice over each size
    assert first.training  # left in the mode it was in

    second = SmallCNN(num_classes=3)  # another site's model: other weights, same shapes
    again = Counted(second)
    assert fastest_batch_size(second, again, images) == size
    assert again.images == 0


@pytest.mark.parametrize(
    "change",
    ["image_shape", "classes", "threads"],
)
def test_what_decides_the_answer_is_timed_again(change: str) -> None:
    images = torch.randn(CALIBRATION_IMAGES, 1, 16, 16)
    model = SmallCNN(num_classes=3)
    fastest_batch_size(model, Counted(model), images)
    threads = torch.get_num_threads()
    other_model, other_images = model, images
    if change == "image_shape":
        other_images = torch.randn(CALIBRATION_IMAGES, 1, 20, 20)
    elif change == "classes":
        other_model = SmallCNN(num_classes=4)  # another classifier's shape
    else:
        torch.set_num_threads(threads + 1)
    try:
        forward = Counted(other_model)
        fastest_batch_size(other_model, forward, other_images)
    finally:
        torch.set_num_threads(threads)
    assert forward.images == 2 * len(EVAL_CHUNKS) * CALIBRATION_IMAGES
