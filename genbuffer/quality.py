"""Quality score for early stopping: a Frechet distance between real and synthetic features.

FedER (Sec. 4.2.2) stops on FID, which needs the Inception network; a site
without internet does not have it. We compute the same Frechet distance
(Heusel et al. 2017) on features of a network the site has offline:

- "classifier" (default): the pooled features (64 numbers) of a small CNN
  (p2pfl's small_cnn) trained for a few hundred steps to classify the site's
  own training images. It is a domain-specific FID: it measures what the buffer
  is for (class evidence), and it is independent of the LPIPS network. That
  independence matters: the privacy loss maximises distances in the LPIPS
  features, so a score in those same features would count every step of stage 2
  as a loss of quality and the degrade-factor stop would fire at once (FedER,
  too, scores with Inception and protects with VGG). The network is trained once
  per output folder and saved (`quality_classifier.pt`), so scores before and
  after a resume are comparable.
- "lpips": the spatial means of the five channel-normalised feature maps of the
  LPIPS backbone (1152 numbers for AlexNet), the only choice for one class.

Values are not comparable with published FIDs. Lower is better.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.files import PRIVATE_FILE, atomic_torch_save
from p2pfl.learning.models import create_model

from .checkpoint import FORMAT_VERSION, safe_torch_load
from .errors import CheckpointError
from .stylegan2 import Generator

log = logging.getLogger(__name__)

FeatureFn = Callable[[Tensor], Tensor]
QUALITY_CLASSIFIER_FORMAT = "p2pfl-genbuffer-quality-classifier"


def frechet_distance(features_a: Tensor, features_b: Tensor) -> float:
    """||mu_a - mu_b||^2 + tr(S_a) + tr(S_b) - 2 tr((S_a S_b)^(1/2)) for two (N, D) feature sets."""
    a = features_a.detach().double().cpu()
    b = features_b.detach().double().cpu()
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = torch.cov(a.t()), torch.cov(b.t())
    # tr((S_a S_b)^(1/2)) = sum of sqrt eigenvalues of S_a^(1/2) S_b S_a^(1/2) (symmetric PSD).
    eigval_a, eigvec_a = torch.linalg.eigh(cov_a)
    sqrt_a = (eigvec_a * eigval_a.clamp(min=0).sqrt()) @ eigvec_a.t()
    middle = sqrt_a @ cov_b @ sqrt_a
    trace_sqrt = torch.linalg.eigvalsh((middle + middle.t()) / 2).clamp(min=0).sqrt().sum()
    value = (mu_a - mu_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * trace_sqrt
    return float(value.clamp(min=0))


def train_quality_classifier(
    images: Tensor, labels: Tensor, num_classes: int, *, steps: int, seed: int, device: torch.device
) -> nn.Module:
    """small_cnn on the real images (flips, class-weighted cross-entropy, Adam 1e-3, batch 64)."""
    rng = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = create_model(
            "small_cnn",
            in_chans=images.shape[1],
            num_classes=num_classes,
            image_size=images.shape[-1],
        ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    counts = torch.bincount(labels.cpu(), minlength=num_classes).float().clamp(min=1)
    weights = (counts.sum() / (num_classes * counts)).to(device)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(images), (min(64, len(images)),), generator=rng)
        x = images[idx.to(images.device)].to(device)
        flip = (torch.rand(len(idx), generator=rng) < 0.5).to(device)
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        loss = F.cross_entropy(model(x), labels[idx.to(labels.device)].to(device), weight=weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval().requires_grad_(False)


def quality_classifier_features(
    path: Path,
    images: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    steps: int,
    seed: int,
    device: torch.device,
) -> FeatureFn:
    """Load the folder's quality classifier, or train and save it; returns its feature function."""
    if path.is_file():
        obj = safe_torch_load(path, QUALITY_CLASSIFIER_FORMAT)
        model = create_model(
            "small_cnn",
            in_chans=images.shape[1],
            num_classes=num_classes,
            image_size=images.shape[-1],
        )
        try:
            model.load_state_dict(obj["state_dict"])
        except (KeyError, RuntimeError) as exc:
            raise CheckpointError(
                "checkpoint_mismatch",
                f"{path} does not fit this data ({exc}) — train again with --restart",
            ) from None
        model = model.to(device).eval().requires_grad_(False)
    else:
        log.info("training the quality-score classifier (%d steps) on the real images", steps)
        model = train_quality_classifier(
            images, labels, num_classes, steps=steps, seed=seed, device=device
        )
        atomic_torch_save(
            {
                "format": QUALITY_CLASSIFIER_FORMAT,
                "version": FORMAT_VERSION,
                "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            },
            path,
            mode=PRIVATE_FILE,  # trained on the site's images
        )
    forward_features = model.forward_features  # type: ignore[operator]

    @torch.no_grad()
    def features(x: Tensor) -> Tensor:
        return forward_features(x.clamp(-1, 1))

    return features


@torch.no_grad()
def _features_in_batches(
    features: FeatureFn, images: Tensor, device: torch.device, batch_size: int = 256
) -> Tensor:
    return torch.cat(
        [
            features(images[i : i + batch_size].to(device)).cpu()
            for i in range(0, len(images), batch_size)
        ]
    )


class QualityScorer:
    """Frechet distance of a generator's samples to a fixed set of real images (lower is better).

    The synthetic images use fixed latents and labels drawn from the real label
    distribution, so scores of different checkpoints compare like with like.
    """

    def __init__(
        self,
        features: FeatureFn,
        real_images: Tensor,
        real_labels: Tensor,
        num_samples: int,
        seed: int,
        device: torch.device,
    ) -> None:
        self.features = features
        self.device = device
        self.reference = _features_in_batches(features, real_images, device)
        picks = np.random.default_rng(seed).integers(0, len(real_labels), size=num_samples)
        self.labels = real_labels.cpu()[torch.from_numpy(picks)]
        self.seed = seed

    @torch.no_grad()
    def synthetic_features(self, generator: Generator, batch_size: int = 128) -> Tensor:
        rng = torch.Generator().manual_seed(self.seed)
        feats = []
        for start in range(0, len(self.labels), batch_size):
            chunk = self.labels[start : start + batch_size].to(self.device)
            z = torch.randn(len(chunk), generator.z_dim, generator=rng).to(self.device)
            images = generator(z, chunk, noise_mode="random", rng=rng).clamp(-1, 1)
            feats.append(self.features(images).cpu())
        return torch.cat(feats)

    def __call__(self, generator: Generator) -> float:
        was_training = generator.training
        generator.eval()
        feats = self.synthetic_features(generator)
        generator.train(was_training)
        return frechet_distance(self.reference, feats)
