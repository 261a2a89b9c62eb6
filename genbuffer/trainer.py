"""One iteration of the conditional StyleGAN2-ADA: G, D, the EMA generator, their
optimisers and the adaptive augmentation (`GanTrainer`), and the image and
label preparation it needs.

Losses (per iteration, one G step then one D step):
    L_G = softplus(-D(A(G(z, c)), c))                      non-saturating form of FedER Eq. 2
    L_G-PP = L_G - alpha * L_PP(real batch, G(z, c))        FedER Eq. 3-5 (stage 2)
    L_D = softplus(D(A(fake))) + softplus(-D(A(real)))      FedER Eq. 1 (logistic form)
          + every r1_interval steps: r1_interval * gamma/2 * ||grad_x D(A(x))||^2  (lazy R1)
where A is the adaptive augmentation. The stages around it are in `train.py`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .ada import AdaController, AdaptiveAugment
from .config import GenbufferSection
from .discriminator import Discriminator, DiscriminatorSpec
from .errors import GenbufferError
from .privacy import PerceptualDistance, privacy_loss, privacy_preserving_generator_loss
from .stylegan2 import Generator, GeneratorSpec


def prepare_images(
    images_uint8: np.ndarray | Tensor, resolution: int, channels: int | None = None
) -> Tensor:
    """uint8 (N, H, W) or (N, H, W, C) -> float (N, C, resolution, resolution) in [-1, 1]."""
    x = torch.as_tensor(
        np.asarray(images_uint8) if not isinstance(images_uint8, Tensor) else images_uint8
    )
    if x.dtype != torch.uint8:
        raise GenbufferError("bad_images", f"training images must be uint8, got {x.dtype}")
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[1] != x.shape[2]:
        raise GenbufferError(
            "bad_images", f"expected square images shaped (N, H, W[, C]), got {tuple(x.shape)}"
        )
    if channels is not None and x.shape[3] != channels:
        raise GenbufferError(
            "channels_mismatch",
            f"genbuffer.channels is {channels} but the images have {x.shape[3]} — remove genbuffer.channels or fix it",
        )
    x = x.permute(0, 3, 1, 2).float() / 127.5 - 1.0
    if x.shape[-1] != resolution:
        x = F.interpolate(
            x, size=(resolution, resolution), mode="bilinear", align_corners=False, antialias=True
        )
    return x.clamp(-1, 1).contiguous()


def label_prior(labels: Tensor, num_classes: int) -> list[float]:
    """Each class's share of `labels`: the class prior a trained generator is saved with."""
    counts = torch.bincount(labels.long(), minlength=num_classes).double()
    return (counts / counts.sum()).tolist()


def r1_penalty(real_logits: Tensor, real_inputs: Tensor) -> Tensor:
    """Per-sample ||grad_x D(x)||^2 (R1, Mescheder et al. 2018), differentiable for the D update."""
    (grad,) = torch.autograd.grad(real_logits.sum(), real_inputs, create_graph=True)
    return grad.square().sum(dim=(1, 2, 3))


def build_specs(
    cfg: GenbufferSection, num_classes: int, channels: int
) -> tuple[GeneratorSpec, DiscriminatorSpec]:
    shared = {
        "num_classes": num_classes,
        "resolution": cfg.resolution,
        "channels": channels,
        "channel_base": cfg.channel_base,
        "channel_max": cfg.channel_max,
    }
    g = GeneratorSpec(**shared, z_dim=cfg.z_dim, w_dim=cfg.w_dim, mapping_layers=cfg.mapping_layers)
    d = DiscriminatorSpec(**shared, cmap_dim=cfg.w_dim, mapping_layers=min(2, cfg.mapping_layers))
    return g, d


def training_dtype(cfg: GenbufferSection, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of GAN training: None for fp32 (genbuffer.precision)."""
    if cfg.precision == "fp32":
        return None
    if cfg.precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


class GanTrainer:
    """G, D, the EMA generator, their optimisers and ADA; `step()` is one training iteration."""

    def __init__(
        self,
        cfg: GenbufferSection,
        images: Tensor,
        labels: Tensor,
        num_classes: int,
        *,
        metric: PerceptualDistance | None,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.images = images.to(device)
        self.labels = labels.long().to(device)
        self.num_classes = num_classes
        self.metric = metric
        torch.manual_seed(cfg.seed)
        g_spec, d_spec = build_specs(cfg, num_classes, images.shape[1])
        self.dtype = training_dtype(cfg, device)
        memory = (
            torch.channels_last
            if cfg.channels_last == "on" or (cfg.channels_last == "auto" and device.type == "cuda")
            else torch.contiguous_format
        )
        self.G = Generator(g_spec).to(device, memory_format=memory)
        self.D = Discriminator(d_spec).to(device, memory_format=memory)
        self.images = self.images.contiguous(memory_format=memory)
        self.G_ema = copy.deepcopy(self.G).eval().requires_grad_(False)
        betas = tuple(cfg.adam_betas)
        self.opt_g = torch.optim.Adam(self.G.parameters(), lr=cfg.lr, betas=betas)  # type: ignore[arg-type]
        self.opt_d = torch.optim.Adam(self.D.parameters(), lr=cfg.lr, betas=betas)  # type: ignore[arg-type]
        self.augment = AdaptiveAugment(0.0)
        self.ada = AdaController(
            batch_size=cfg.batch_size,
            target=cfg.ada_target,
            interval=cfg.ada_interval,
            speed_images=cfg.ada_speed_images,
        )
        self.r1_gamma = cfg.effective_r1_gamma()
        self.iteration = 0
        self.images_seen = 0
        self.data_rng = torch.Generator().manual_seed(cfg.seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._cursor = 0

    # ------------------------------------------------------------------ batches

    def _next_batch(self) -> tuple[Tensor, Tensor]:
        n, b = len(self.images), self.cfg.batch_size
        if n < b:  # tiny data sets: sample with replacement
            idx = torch.randint(0, n, (b,), generator=self.data_rng)
        else:
            if self._cursor + b > len(self._order):
                self._order = torch.randperm(n, generator=self.data_rng)
                self._cursor = 0
            idx = self._order[self._cursor : self._cursor + b]
            self._cursor += b
        idx = idx.to(self.device)
        return self.images[idx], self.labels[idx]

    def _fake_labels(self, batch: int) -> Tensor:
        """Conditioning labels for generated images, drawn from the training label distribution."""
        return self.labels[torch.randint(0, len(self.labels), (batch,), device=self.device)]

    # ------------------------------------------------------------------ one iteration

    def _autocast(self) -> Any:
        """bf16 autocast when configured (genbuffer.precision), else a no-op context."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def step(self, use_privacy: bool) -> dict[str, float]:
        cfg = self.cfg
        real, real_labels = self._next_batch()
        batch = real.shape[0]
        stats: dict[str, float] = {}

        # Generator: L_G, or L_G-PP in stage 2 (FedER Eq. 5).
        self.G.requires_grad_(True)
        self.D.requires_grad_(False)
        z = torch.randn(batch, self.G.z_dim, device=self.device)
        fake_labels = self._fake_labels(batch)
        with self._autocast():
            ws = self.G.mixed_ws(z, fake_labels, cfg.style_mixing_prob, update_w_avg=True)
            fake = self.G.synthesis(ws)
            loss_g = F.softplus(-self.D(self.augment(fake), fake_labels).float()).mean()
            loss = loss_g
            if use_privacy:
                if self.metric is None:
                    raise GenbufferError("no_lpips", "the privacy loss needs an LPIPS metric")
                loss_pp = privacy_loss(self.metric, real, fake, cfg.pp_normalization).float()
                loss = privacy_preserving_generator_loss(loss_g, loss_pp, cfg.alpha)  # Eq. 3, 5
                stats["loss_pp"] = float(loss_pp.detach())
        self.opt_g.zero_grad(set_to_none=True)
        loss.backward()
        self.opt_g.step()
        stats["loss_g"] = float(loss_g.detach())

        # Discriminator: logistic loss (FedER Eq. 1) + lazy R1 on real images.
        self.G.requires_grad_(False)
        self.D.requires_grad_(True)
        do_r1 = self.r1_gamma > 0 and self.iteration % cfg.r1_interval == 0
        real_in = real.detach().requires_grad_(do_r1)
        with self._autocast():
            fake_logits = self.D(self.augment(fake.detach()), fake_labels).float()
            real_logits = self.D(self.augment(real_in), real_labels).float()
        loss_d = F.softplus(fake_logits).mean() + F.softplus(-real_logits).mean()
        if do_r1:
            penalty = r1_penalty(real_logits, real_in).mean()
            loss_d = loss_d + penalty * (self.r1_gamma / 2) * cfg.r1_interval
            stats["r1"] = float(penalty.detach())
        self.opt_d.zero_grad(set_to_none=True)
        loss_d.backward()
        self.opt_d.step()
        stats["loss_d"] = float(loss_d.detach())

        if cfg.augment:
            self.augment.p = self.ada.observe(real_logits)
        stats["ada_p"] = self.augment.p
        self.images_seen += batch
        self._update_ema(batch)
        self.iteration += 1
        return stats

    @torch.no_grad()
    def _update_ema(self, batch: int) -> None:
        half_life = float(self.cfg.ema_half_life_images)
        if self.cfg.ema_rampup is not None:
            half_life = min(half_life, self.images_seen * self.cfg.ema_rampup)
        beta = 0.5 ** (batch / max(half_life, 1e-8))
        for p_ema, p in zip(self.G_ema.parameters(), self.G.parameters(), strict=True):
            p_ema.copy_(p.detach().lerp(p_ema, beta))
        for b_ema, b in zip(self.G_ema.buffers(), self.G.buffers(), strict=True):
            b_ema.copy_(b)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "G": self.G.state_dict(),
            "D": self.D.state_dict(),
            "G_ema": self.G_ema.state_dict(),
            "opt_g": self.opt_g.state_dict(),
            "opt_d": self.opt_d.state_dict(),
            "ada": self.ada.state_dict(),
            "augment_p": self.augment.p,
            "iteration": self.iteration,
            "images_seen": self.images_seen,
            "data_rng": self.data_rng.get_state(),
            "order": self._order.clone(),
            "cursor": self._cursor,
            "torch_rng": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return copy.deepcopy(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.G.load_state_dict(state["G"])
        self.D.load_state_dict(state["D"])
        self.G_ema.load_state_dict(state["G_ema"])
        self.opt_g.load_state_dict(state["opt_g"])
        self.opt_d.load_state_dict(state["opt_d"])
        self.ada.load_state_dict(state["ada"])
        self.augment.p = float(state["augment_p"])
        self.iteration = int(state["iteration"])
        self.images_seen = int(state["images_seen"])
        self.data_rng.set_state(state["data_rng"])
        self._order = state["order"].clone()
        self._cursor = int(state["cursor"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
