"""Semi-supervised local training on a LocalSite: FixMatch, optionally with a peer.

One step (FedPerl journal Eq. 2-4, MICCAI Eq. 2-4):

    L = CE_w(y_L, f(alpha(x_L)))                                  supervised, class-weighted
      + beta * 1/|U| sum_u 1[max q_u >= tau] CE(argmax q_u, f(A(x_u)))   unlabeled
      + gamma * MSE(softmax f(alpha(x_u)), softmax f_a(alpha(x_u)))      consistency

alpha is the weak augmentation, A the strong one (RandAugment), f the local
model, f_a the anonymized peer (frozen). The pseudo-label distribution q_u is
the local softmax on the weak view (Eq. 3) or, with a peer, the mean of the
local and the peer's softmax (Eq. 4). q_u carries no gradient (frozen phi*);
the consistency term does carry the local model's gradient (the public
reference code computes it under no_grad, so it adds nothing there).

Labeled, weak and strong views go through the model in one forward pass in
train mode (BatchNorm sees the whole step), as in FixMatch.

An "epoch" walks the larger of the two streams once: max(ceil(L/B),
ceil(U/(mu*B))) steps, the smaller stream cycling (mu = unlabeled_ratio), capped
by training.max_steps_per_epoch.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.learning.class_weights import median_frequency_weights
from p2pfl.learning.data.augment import strong_augment_batch, weak_augment_batch
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.train import LocalSite


def pseudo_labels(
    local_probs: Tensor, tau: float, peer_probs: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(labels, mask). Eq. 3: q = local softmax; Eq. 4 (FedPerl): q = mean of the
    local and the anonymized peer's softmax. mask = max q >= tau."""
    q = local_probs if peer_probs is None else 0.5 * (local_probs + peer_probs)
    confidence, labels = q.max(dim=1)
    return labels, confidence >= tau


@dataclass
class StepLosses:
    total: Tensor
    supervised: Tensor
    unlabeled: Tensor
    consistency: Tensor
    mask_rate: float


def fixmatch_loss(
    model: nn.Module,
    x_labeled: Tensor,
    y_labeled: Tensor,
    u_weak: Tensor,
    u_strong: Tensor,
    *,
    tau: float,
    beta: float,
    weight: Tensor | None = None,
    peer_model: nn.Module | None = None,
    gamma: float = 0.0,
) -> StepLosses:
    """The loss of one step (module docstring); views already augmented and on
    the model's device. The model is used as it is (train mode for training)."""
    n_l, n_u = len(y_labeled), len(u_weak)
    logits = model(torch.cat([x_labeled, u_weak, u_strong])).float()
    logits_l, logits_w, logits_s = logits[:n_l], logits[n_l : n_l + n_u], logits[n_l + n_u :]
    supervised = F.cross_entropy(logits_l, y_labeled, weight=weight) if n_l else logits.sum() * 0.0
    zero = logits.sum() * 0.0
    if n_u == 0:
        return StepLosses(supervised, supervised, zero, zero, 0.0)
    local_probs = torch.softmax(logits_w, dim=1)
    peer_probs: Tensor | None = None
    if peer_model is not None:
        with torch.no_grad():
            peer_probs = torch.softmax(peer_model(u_weak).float(), dim=1)
    labels, mask = pseudo_labels(local_probs.detach(), tau, peer_probs)
    per_sample = F.cross_entropy(logits_s, labels, reduction="none")
    unlabeled = (per_sample * mask.float()).mean()
    consistency = zero
    if peer_probs is not None and gamma > 0:
        # L_CON = ||f(x; phi) - f_a(x; phi_a*)||^2: gradient into the local model only.
        consistency = F.mse_loss(local_probs, peer_probs)
    total = supervised + beta * unlabeled + gamma * consistency
    return StepLosses(total, supervised, unlabeled, consistency, float(mask.float().mean()))


def peer_model_from_state(site: LocalSite, state: dict[str, Tensor]) -> nn.Module:
    """A frozen copy of the site's architecture holding `state` (the anonymized
    peer), in eval mode on the site's device."""
    peer = copy.deepcopy(site.model)
    peer.load_state_dict(state)
    peer.eval()
    for param in peer.parameters():
        param.requires_grad_(False)
    return peer.to(site.device)


def _cycle_labeled(site: LocalSite) -> Iterator[tuple[Tensor, Tensor]]:
    """Labeled batches forever (a new shuffle on every pass)."""
    while True:
        yield from site.batches("train")


def _unlabeled_batches(site: LocalSite, batch_size: int) -> Iterator[Tensor]:
    """Shuffled unlabeled batches forever, a new order on every pass, drawn from
    torch's global generator (seeded by LocalSite.from_config, like the
    augmentations), so a run repeats exactly."""
    assert site.data.unlabeled is not None
    images = site.data.unlabeled.tensors[0]
    while True:
        order = torch.randperm(len(images))
        for start in range(0, len(order), batch_size):
            yield images[order[start : start + batch_size]]


def steps_per_epoch(
    site: LocalSite, unlabeled_ratio: int = 1, *, labeled_only: bool = False
) -> int:
    """max(ceil(L/B), ceil(U/(mu*B))) (ceil(L/B) when labeled_only), capped by
    training.max_steps_per_epoch."""
    batch = site.training.batch_size
    steps = math.ceil(len(site.data.train) / batch)
    if not labeled_only and site.data.unlabeled is not None:
        steps = max(steps, math.ceil(len(site.data.unlabeled) / (unlabeled_ratio * batch)))
    cap = site.training.max_steps_per_epoch
    return min(steps, cap) if cap is not None else steps


def fixmatch_epoch(
    site: LocalSite,
    tau: float = 0.6,
    beta: float = 0.5,
    unlabeled_ratio: int = 1,
    class_weighted: bool = True,
    peer_model: nn.Module | None = None,
    gamma: float = 0.0,
    *,
    epochs: int | None = None,
    steps: int | None = None,
    use_unlabeled: bool = True,
) -> dict[str, float]:
    """`epochs` (default training.epochs) FixMatch epochs of `steps` steps
    (default `steps_per_epoch`) on the site's labeled and unlabeled images, or
    exactly training.steps_per_round steps when that is set and neither is given.
    use_unlabeled=False trains on the labeled images only. Returns mean losses,
    the share of unlabeled images that got a pseudo-label ('mask_rate'),
    'steps' and 'seconds'."""
    if use_unlabeled and (site.data.unlabeled is None or len(site.data.unlabeled) == 0):
        raise TrainingError(
            "no_unlabeled",
            f"{site.data.source}: FixMatch needs unlabeled images — add an unlabeled/ folder, "
            "unlabeled_images to the .npz, or set data.label_fraction",
        )
    if site.is_siamese:
        raise TrainingError(
            "siamese_unsupported", "FixMatch needs a classifier, not a Siamese model"
        )
    if epochs is None and steps is None and site.training.steps_per_round is not None:
        epochs, steps = 1, site.training.steps_per_round  # equal work per site
    epochs = site.training.epochs if epochs is None else epochs
    start = time.perf_counter()
    batch = site.training.batch_size
    weight = (
        median_frequency_weights(site.data.class_counts("train")).to(site.device)
        if class_weighted
        else None
    )
    site.model.train()
    if peer_model is not None:
        peer_model.eval()
    sums = {"loss": 0.0, "supervised": 0.0, "unlabeled": 0.0, "consistency": 0.0, "mask_rate": 0.0}
    if steps is None:
        steps = steps_per_epoch(site, unlabeled_ratio, labeled_only=not use_unlabeled)
    n_steps, steps = steps, 0
    labeled_stream = _cycle_labeled(site)
    unlabeled_stream = _unlabeled_batches(site, unlabeled_ratio * batch) if use_unlabeled else None
    for _ in range(epochs):
        for _ in range(n_steps):
            x_l, y_l = next(labeled_stream)
            if unlabeled_stream is not None:
                u = next(unlabeled_stream)
                u = u.to(site.device)
                u_weak = weak_augment_batch(u)
                u_strong = strong_augment_batch(u)
            else:
                u_weak = u_strong = x_l[:0].to(site.device)
            if len(y_l) + 2 * len(u_weak) < 2:  # BatchNorm cannot train on a single sample
                continue
            x_l = weak_augment_batch(x_l.to(site.device))
            y_l = y_l.to(site.device)
            site.optimizer.zero_grad(set_to_none=True)
            with site.autocast():
                losses = fixmatch_loss(
                    site.model,
                    x_l,
                    y_l,
                    u_weak,
                    u_strong,
                    tau=tau,
                    beta=beta,
                    weight=weight,
                    peer_model=peer_model,
                    gamma=gamma,
                )
            losses.total.backward()
            site.optimizer.step()
            steps += 1
            sums["loss"] += float(losses.total.detach())
            sums["supervised"] += float(losses.supervised.detach())
            sums["unlabeled"] += float(losses.unlabeled.detach())
            sums["consistency"] += float(losses.consistency.detach())
            sums["mask_rate"] += losses.mask_rate
    out = {k: (v / steps if steps else float("nan")) for k, v in sums.items()}
    site.last_loss = out["loss"] if steps else None
    out["steps"] = float(steps)
    out["seconds"] = time.perf_counter() - start
    return out


def supervised_epoch(
    site: LocalSite,
    class_weighted: bool = True,
    *,
    unlabeled_ratio: int = 1,
    epochs: int | None = None,
) -> dict[str, float]:
    """Labeled images only (the local lower bound), for as many steps as a
    FixMatch epoch of the same site takes, so both get equal compute."""
    steps = site.training.steps_per_round if epochs is None else None
    return fixmatch_epoch(
        site,
        class_weighted=class_weighted,
        epochs=1 if steps is not None else epochs,
        steps=steps or steps_per_epoch(site, unlabeled_ratio),
        use_unlabeled=False,
    )
