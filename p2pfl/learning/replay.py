"""Experience replay (FedER Eq. 6): local training that mixes in replayed images.

`train_replay` runs on any `Trainer`: `LocalSite.train_replay_epochs` is the
call protocols make (FedER, FedER-A, FedER-B), this is its body.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from p2pfl.learning.class_weights import median_frequency_weights
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.steps import steps_per_round
from p2pfl.learning.trainer import Trainer


def train_replay(
    site: Trainer,
    replay_x: Tensor,
    replay_y: Tensor,
    epochs: int | None = None,
    *,
    lam: float = 0.5,
    private: bool = True,
    class_weighted: bool = False,
) -> dict[str, float]:
    """Every step pairs a private batch with as many replayed images, loss =
    lam * CE(private) + (1 - lam) * CE(replayed). `private=False` trains on the
    replayed images alone (FedER-B). With nothing to replay this is
    `site.train_epochs`.

    The steps are those of `train_epochs` (training.steps_per_round when set,
    else the private epochs), so FedER does the same local work as the other
    protocols; replay alone takes `steps_per_round` over the buffer in whole
    batches. With `class_weighted` (the site trains with class weights) the
    private half uses the site's weights and the replayed half weights of its
    own class mix (none for a balanced buffer), so both halves count every
    class alike."""
    if len(replay_y) == 0 and private:
        return site.train_epochs(epochs)
    if len(replay_y) == 0:
        raise TrainingError("empty_replay", "synthetic-only training needs a non-empty buffer")
    epochs = site.training.epochs if epochs is None else epochs
    start = time.perf_counter()
    site.model.train()
    gen = torch.Generator().manual_seed(site.training.seed * 7_919 + site._shuffle_calls)
    size = site.training.batch_size
    losses: list[float] = []
    samples = 0
    replay_weight = None
    if class_weighted:
        counts = torch.bincount(replay_y.long(), minlength=site.data.num_classes)
        replay_weight = median_frequency_weights(counts.tolist()).to(site.device)

    def replay_batches() -> Iterator[tuple[Tensor, Tensor]]:
        order, pos = torch.randperm(len(replay_y), generator=gen), 0
        while True:
            if pos + size > len(order):
                order, pos = torch.randperm(len(replay_y), generator=gen), 0
            idx = order[pos : pos + size]
            pos += size
            yield replay_x[idx], replay_y[idx]

    if private:
        steps: Iterable[tuple[Tensor | None, Tensor | None]] = site.training_batches(epochs)
    else:
        count = steps_per_round(len(replay_y), site.training, epochs=epochs, whole_batches=True)
        steps = [(None, None)] * count
    for (x, y), (rx, ry) in zip(steps, replay_batches(), strict=False):
        if len(ry) < 2:
            continue
        site.optimizer.zero_grad(set_to_none=True)
        rx, ry = site._augment(rx), ry.to(site.device)
        if x is None:
            loss = site.loss(rx, ry, weight=replay_weight)
        else:
            x, y = site._augment(x), y.to(site.device)
            loss = lam * site.loss(x, y) + (1.0 - lam) * site.loss(rx, ry, weight=replay_weight)
        loss.backward()
        site.optimizer.step()
        losses.append(float(loss.detach()))
        samples += len(ry) + (0 if y is None else len(y))
    return site.record_fit(losses, samples, time.perf_counter() - start)
