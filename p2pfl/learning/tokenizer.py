"""A discrete image tokenizer for Fed-BEiT: a VQ-VAE with an EMA codebook.

BEiT predicts, for every masked patch, the visual token a tokenizer gives that
patch. The paper uses DALL-E's pretrained dVAE, whose weights a hospital
network cannot download; here the federation trains its own tokenizer first
(protocols/fedbeit.py, stage "tokenizer"), or a site supplies one
(`model.tokenizer_from`).

The tokenizer works on the ViT's patch grid: an image of H x W pixels in
patches of S x S gives (H/S) x (W/S) tokens, one per patch, each an index into
a codebook of K vectors of dimension d.

- Encoder: a convolution with kernel = stride = S (one vector per patch), two
  residual 3x3 convolution blocks (each token sees its neighbours), a 1x1
  convolution to d.
- Quantiser (van den Oord et al., VQ-VAE, Appendix A.1's EMA update): each
  vector is replaced by its nearest code (Euclidean); the codebook is not
  learnt by gradient but as exponential moving averages (decay `decay`) of the
  vectors assigned to each code and of their count; the encoder is pulled
  towards its codes by the commitment loss beta ||z_e - sg(z_q)||^2; gradients
  pass the quantiser straight through.
- Dead codes: after every training step, a code whose moving count is below
  `restart_share` of the uniform share (count < restart_share x total / K) is
  moved onto a random encoder output of the batch. On the first step this is a
  data-dependent initialisation of every unused code.
- Decoder: a 1x1 convolution from d, two residual blocks, a transposed
  convolution with kernel = stride = S back to pixels.
- Loss: mean squared error of the reconstruction (the data's normalised
  pixels) + beta x commitment.

The codebook's use is reported as its perplexity (exp of the entropy of the
token distribution; K when every code is used equally) and the share of codes
used at least once. `save_tokenizer` writes the state dict (plain tensors,
readable with weights_only=True); `load_tokenizer` rebuilds the geometry from
the tensors' shapes and loads strictly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.files import atomic_torch_save
from p2pfl.learning.models import ModelError, read_weights_file

RESIDUAL_BLOCKS = 2
# A merged codebook counter below this share of the mean count, or below
# MIN_COUNT, is refused (reset_implausible_counts). An honest one stays above
# restart_share (0.03) of the mean, and above restart_share x (1 - decay) x
# tokens per step / codebook_size: 7e-6 for one 196-patch image a step and
# 8192 codes.
VANISHING_COUNT = 1e-6
MIN_COUNT = 1e-9


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.gelu(self.conv1(F.gelu(x))))


@dataclass
class TokenizerOutput:
    loss: Tensor  # reconstruction MSE + beta x commitment
    recon_loss: Tensor  # reconstruction MSE alone
    reconstruction: Tensor  # N,C,H,W
    tokens: Tensor  # N,L code indices, patches in row-major order


class VQTokenizer(nn.Module):
    """VQ-VAE on the patch grid with an EMA codebook (see the module docstring)."""

    def __init__(
        self,
        *,
        in_chans: int,
        patch_size: int,
        codebook_size: int = 256,
        code_dim: int = 32,
        hidden: int = 64,
        decay: float = 0.99,
        commitment: float = 0.25,
        restart_share: float = 0.03,
    ) -> None:
        super().__init__()
        if codebook_size < 2:
            raise ValueError(f"codebook_size must be at least 2, got {codebook_size}")
        self.in_chans = in_chans
        self.patch_size = patch_size
        self.codebook_size = codebook_size
        self.code_dim = code_dim
        self.decay = decay
        self.commitment = commitment
        self.restart_share = restart_share
        self.encoder = nn.Sequential(
            nn.Conv2d(in_chans, hidden, patch_size, stride=patch_size),
            *[_Residual(hidden) for _ in range(RESIDUAL_BLOCKS)],
            nn.GELU(),
            nn.Conv2d(hidden, code_dim, 1),
        )
        self.decoder = nn.Sequential(
            nn.Conv2d(code_dim, hidden, 1),
            *[_Residual(hidden) for _ in range(RESIDUAL_BLOCKS)],
            nn.GELU(),
            nn.ConvTranspose2d(hidden, in_chans, patch_size, stride=patch_size),
        )
        # The codebook and its moving averages are buffers: learnt by EMA, not
        # by the optimizer, and averaged between peers like any weight.
        self.register_buffer("codebook", torch.randn(codebook_size, code_dim))
        self.register_buffer("ema_count", torch.zeros(codebook_size))
        self.register_buffer("ema_sum", torch.zeros(codebook_size, code_dim))
        self.restart_generator: torch.Generator | None = None

    # ------------------------------------------------------------------ encode / decode

    def encode_vectors(self, images: Tensor) -> Tensor:
        """N,C,H,W -> N,L,d encoder outputs, one per patch (row-major)."""
        z = self.encoder(images)
        return z.flatten(2).transpose(1, 2)

    def nearest(self, z: Tensor) -> Tensor:
        """Index of the nearest code of every vector (..., d) -> (...)."""
        flat = z.reshape(-1, self.code_dim).float()
        book = self.codebook.float()
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ book.t() + book.pow(2).sum(1)[None]
        return dist.argmin(dim=1).reshape(z.shape[:-1])

    @torch.no_grad()
    def tokens(self, images: Tensor) -> Tensor:
        """N,L visual tokens of the images (the BEiT targets)."""
        return self.nearest(self.encode_vectors(images))

    def decode_tokens(self, tokens: Tensor) -> Tensor:
        """N,L indices -> N,C,H,W images."""
        n, length = tokens.shape
        side = math.isqrt(length)
        z = self.codebook[tokens].reshape(n, side, side, self.code_dim).permute(0, 3, 1, 2)
        return self.decoder(z)

    def forward(self, images: Tensor) -> TokenizerOutput:
        z = self.encode_vectors(images)
        idx = self.nearest(z.detach())
        quantised = self.codebook[idx]
        if self.training:
            self._ema_update(z.detach(), idx)
        commit = F.mse_loss(z, quantised.detach())
        z_q = z + (quantised - z).detach()  # straight-through
        n, length, _ = z_q.shape
        side = math.isqrt(length)
        recon = self.decoder(z_q.transpose(1, 2).reshape(n, self.code_dim, side, side))
        recon_loss = F.mse_loss(recon, images)
        return TokenizerOutput(recon_loss + self.commitment * commit, recon_loss, recon, idx)

    # ------------------------------------------------------------------ codebook upkeep

    @torch.no_grad()
    def _ema_update(self, z: Tensor, idx: Tensor) -> None:
        flat = z.reshape(-1, self.code_dim).float()
        ids = idx.reshape(-1)
        counts = torch.bincount(ids, minlength=self.codebook_size).float()
        sums = torch.zeros_like(self.ema_sum).index_add_(0, ids, flat)
        self.ema_count.mul_(self.decay).add_(counts, alpha=1 - self.decay)
        self.ema_sum.mul_(self.decay).add_(sums, alpha=1 - self.decay)
        # Dead before dividing: a count below the restart threshold is never a
        # divisor. The threshold is at least what this step's own tokens give
        # (an honest total is never less), so a merged count a peer drove to
        # 3e-17, negative, or a negative total cannot make a code of 4e19.
        total = float(self.ema_count.clamp_min(0).sum())
        floor = 0.5 * (1 - self.decay) * ids.numel()  # under this step's share of any honest total
        threshold = self.restart_share * max(total, floor) / self.codebook_size
        dead = ~(self.ema_count >= threshold)  # NaN included
        used = ~dead & (self.ema_count > 0)
        self.codebook[used] = self.ema_sum[used] / self.ema_count[used, None]
        n_dead = int(dead.sum())
        if n_dead:
            pick = torch.randint(
                len(flat), (n_dead,), generator=self.restart_generator, device="cpu"
            ).to(flat.device)
            fresh = flat[pick]
            share = total / self.codebook_size
            self.codebook[dead] = fresh
            self.ema_sum[dead] = fresh * share
            self.ema_count[dead] = share

    @torch.no_grad()
    def reset_implausible_counts(self) -> int:
        """Set to 0 every codebook counter no honest tokenizer, or average of
        honest ones, holds: negative, not finite, or positive but below
        VANISHING_COUNT x the mean count or MIN_COUNT (an honest count stays above about
        restart_share x the mean, and above MIN_COUNT). A peer's model
        within the norm bound and the weight cap could leave such counters
        after the merge (tests/test_tokenizer_counts.py); at 0 the code is dead
        and restarted at the next training step. Returns how many were reset."""
        counts = self.ema_count
        mean = float(counts.clamp_min(0).mean()) if counts.numel() else 0.0
        vanishing = (counts > 0) & (counts < max(VANISHING_COUNT * mean, MIN_COUNT))
        bad = ~torch.isfinite(counts) | (counts < 0) | vanishing
        n_bad = int(bad.sum())
        if n_bad:
            counts[bad] = 0.0
            self.ema_sum[bad] = 0.0
        return n_bad


def codebook_usage(tokens: Tensor, codebook_size: int) -> dict[str, float]:
    """Perplexity (exp of the entropy of the token histogram; K when uniform) and
    the share of the K codes used at least once, over `tokens`."""
    counts = torch.bincount(tokens.reshape(-1).cpu(), minlength=codebook_size).double()
    p = counts / counts.sum().clamp_min(1.0)
    entropy = -(p[p > 0] * p[p > 0].log()).sum()
    return {
        "perplexity": float(entropy.exp()),
        "codes_used": float((counts > 0).double().mean()),
    }


# ---------------------------------------------------------------------- files


def save_tokenizer(model: VQTokenizer, path: str | Path) -> Path:
    """The tokenizer's state dict (plain tensors), written atomically."""
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return atomic_torch_save(state, path)


_REQUIRED = ("encoder.0.weight", "encoder.4.weight", "decoder.0.weight", "codebook")


def load_tokenizer(path: str | Path, *, in_chans: int, image_size: int) -> VQTokenizer:
    """A tokenizer file (this module's `save_tokenizer`, or one written the same
    way), its geometry read from the tensors, loaded strictly with
    weights_only=True; refused with a one-line reason when it is not one or
    does not fit this site's images."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(
            "tokenizer_not_found",
            f"{path}: tokenizer file not found — fix model.tokenizer_from, or remove it to "
            "let the federation train its own tokenizer",
        )
    state = read_weights_file(path)
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ModelError(
            "not_a_tokenizer",
            f"{path}: not a Fed-BEiT tokenizer (missing {', '.join(missing)}) — point "
            "model.tokenizer_from at the tokenizer.pt a Fed-BEiT run wrote",
        )
    hidden, file_chans, patch, _ = state["encoder.0.weight"].shape
    codebook_size, code_dim = state["codebook"].shape
    if file_chans != in_chans or image_size % patch:
        raise ModelError(
            "tokenizer_mismatch",
            f"{path}: tokenizer was trained on {file_chans}-channel images in {patch}-pixel "
            f"patches; this site has {in_chans}-channel {image_size}x{image_size} images — "
            "use a tokenizer trained on images like these",
        )
    model = VQTokenizer(
        in_chans=int(file_chans),
        patch_size=int(patch),
        codebook_size=int(codebook_size),
        code_dim=int(code_dim),
        hidden=int(hidden),
    )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelError(
            "tokenizer_mismatch",
            f"{path}: tokenizer weights do not fit: {str(exc).splitlines()[0]}",
        ) from None
    return model
