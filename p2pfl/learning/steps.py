"""How many optimizer steps one round of local training takes: `steps_per_round`.

One formula for every place that needs the count before training: FedSGDP2P
publishes it (peers do not ask a site for a step it will not take), training.dp
plans its noise over rounds x this (through the DP recipe's own count), and
replay-only training (FedER-B) runs exactly this many steps. It counts the steps
the loops take, not the batches they draw: a batch of fewer than 2 samples is
skipped (BatchNorm cannot train on one sample), so it is no step.
"""

from __future__ import annotations

from p2pfl.config import TrainingSection


def steps_per_round(
    n: int,
    training: TrainingSection,
    *,
    epochs: int | None = None,
    whole_batches: bool = False,
) -> int:
    """The optimizer steps of one round over `n` images: training.steps_per_round
    when set, else `epochs` (default training.epochs) epochs of at most
    training.max_steps_per_epoch batches each; 0 when no batch has 2 samples.

    An epoch is cut as the loop that trains on it cuts it:
      * the site's own split (`Trainer.training_batches`): ceil(n / batch_size)
        batches in order, the last one short, and skipped when it holds 1 sample;
      * `whole_batches` (the replay buffer, `p2pfl.learning.replay`): max(1, n //
        batch_size) batches, each of min(batch_size, n) images (a reshuffle
        instead of a short batch).
    """
    size = training.batch_size
    if whole_batches:
        per_epoch = max(1, n // size)
        usable = min(size, n) >= 2
    else:
        per_epoch = n // size + (1 if n % size >= 2 else 0)
        usable = size >= 2 and n >= 2
    if not usable:
        return 0
    if training.steps_per_round is not None:
        return training.steps_per_round
    if training.max_steps_per_epoch is not None:
        per_epoch = min(per_epoch, training.max_steps_per_epoch)
    return (training.epochs if epochs is None else epochs) * per_epoch
