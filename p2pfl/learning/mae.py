"""Masked autoencoder around a timm ViT encoder (Fed-MAE, Sec. III-C; He et al.'s MAE).

An image of P = HW / S^2 patches of S x S pixels is split into patches; a random
share gamma (the mask ratio) of them is masked (the set M, |M| = round(gamma P)),
the ViT encoder sees only the visible ones (V), and a light transformer decoder
gets the encoded visible tokens plus a learnable mask token at every masked
position (with position embeddings) and regresses the pixels of every patch.
The loss is the mean squared error over the masked patches only, against
per-patch normalised pixels (each patch's pixels minus their mean, over their
standard deviation).

The encoder is timm's ViT (`vit_tiny_patch16_224` at the data's size; any timm
`vit_*` model) built as the fine-tuning classifier will be, average pooling
over the patch tokens after the final norm, so its weights load one to one into
that classifier: `save_encoder` writes them, `create_pretrained_classifier`
builds the classifier (average-pooled features + linear head) around them.

The local training on this objective is `p2pfl.learning.mae_site.MAESite`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from p2pfl.files import atomic_torch_save
from p2pfl.learning.models import (
    ModelError,
    model_name_error,
    read_weights_file,
    timm_model,
    vit_patch_size,
)

log = logging.getLogger(__name__)

NORM_EPS = 1e-6  # added to a patch's variance before normalising (MAE's norm_pix_loss)


# ---------------------------------------------------------------------- patches and masks


def mae_patch_size(image_size: int, channels: int) -> int:
    """The ViT patch size for this image size (`vit_patch_size`: 28 -> 4, 224 -> 16),
    grown to the smallest divisor of the image size whose patches hold at least 4
    values: a per-patch normalised single pixel is always 0 (8x8 grey -> 2)."""
    patch = vit_patch_size(image_size)
    while patch * patch * channels < 4:
        patch = next(p for p in range(patch + 1, image_size + 1) if image_size % p == 0)
    return patch


def patchify(images: Tensor, patch: int) -> Tensor:
    """N,C,H,W -> N,L,S*S*C with L = (H/S)(W/S) patches in row-major order, each
    flattened as (row, column, channel)."""
    n, c, h, w = images.shape
    if h % patch or w % patch:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch}")
    gh, gw = h // patch, w // patch
    x = images.reshape(n, c, gh, patch, gw, patch)
    x = torch.einsum("nchpwq->nhwpqc", x)
    return x.reshape(n, gh * gw, patch * patch * c)


def unpatchify(patches: Tensor, patch: int, channels: int) -> Tensor:
    """Inverse of `patchify` for square images: N,L,S*S*C -> N,C,H,W."""
    n, num, _ = patches.shape
    side = math.isqrt(num)
    if side * side != num:
        raise ValueError(f"{num} patches do not form a square grid")
    x = patches.reshape(n, side, side, patch, patch, channels)
    x = torch.einsum("nhwpqc->nchpwq", x)
    return x.reshape(n, channels, side * patch, side * patch)


@dataclass
class MaskDraw:
    """One random masking of a batch: `keep` (N,V) indices of the visible patches,
    `mask` (N,L) 1.0 where masked, `restore` (N,L) the permutation that puts
    [visible, masked] tokens back in patch order."""

    keep: Tensor
    mask: Tensor
    restore: Tensor


def masked_count(num_patches: int, mask_ratio: float) -> int:
    """|M| = round(gamma P), with at least one patch masked and one visible."""
    return min(num_patches - 1, max(1, round(mask_ratio * num_patches)))


def random_masking(
    batch: int,
    num_patches: int,
    mask_ratio: float,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> MaskDraw:
    """Mask a uniformly random subset of |M| patches of every image (MAE's random
    masking, drawn on the CPU from `generator`)."""
    num_masked = masked_count(num_patches, mask_ratio)
    noise = torch.rand(batch, num_patches, generator=generator)
    shuffle = noise.argsort(dim=1)
    restore = shuffle.argsort(dim=1)
    keep = shuffle[:, : num_patches - num_masked]
    mask = torch.ones(batch, num_patches)
    mask[:, : num_patches - num_masked] = 0.0
    mask = mask.gather(1, restore)
    return MaskDraw(keep.to(device), mask.to(device), restore.to(device))


def normalised_patches(patches: Tensor, eps: float = NORM_EPS) -> Tensor:
    """Each patch's pixels minus their mean, over their standard deviation."""
    mean = patches.mean(dim=-1, keepdim=True)
    var = patches.var(dim=-1, keepdim=True)
    return (patches - mean) / (var + eps).sqrt()


def masked_patch_loss(pred: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Fed-MAE's MAE loss: the per-patch mean squared error between predicted and
    per-patch normalised pixels, averaged over the masked patches (mask = 1) only."""
    per_patch = (pred.float() - normalised_patches(target.float())).pow(2).mean(dim=-1)
    return (per_patch * mask).sum() / mask.sum().clamp_min(1.0)


def sincos_position_embedding(dim: int, grid: int, *, cls_token: bool = True) -> Tensor:
    """Fixed 2-D sine-cosine position embeddings (1, [1 +] grid^2, dim), a zero row
    first for the class token: half the channels encode the row, half the column."""
    if dim % 4:
        raise ValueError(f"sine-cosine position embedding needs dim % 4 == 0, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(
        torch.arange(grid, dtype=torch.float64),
        torch.arange(grid, dtype=torch.float64),
        indexing="ij",
    )

    def encode(pos: Tensor) -> Tensor:
        angles = pos.reshape(-1, 1) * omega[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    table = torch.cat([encode(rows), encode(cols)], dim=1).float()
    if cls_token:
        table = torch.cat([torch.zeros(1, dim), table], dim=0)
    return table[None]


# ---------------------------------------------------------------------- the model


def square_grid(encoder: nn.Module, method: str) -> int:
    """The side of a timm ViT's square patch grid; refused (`unsupported_vit`)
    without a class token, with register tokens, or on a non-square grid."""
    if (
        getattr(encoder, "cls_token", None) is None
        or getattr(encoder, "reg_token", None) is not None
    ):
        raise ModelError(
            "unsupported_vit",
            f"{method} needs a ViT with a class token and no register tokens (e.g. vit_tiny_patch16_224)",
        )
    grid = encoder.patch_embed.grid_size
    if grid[0] != grid[1]:
        raise ModelError(
            "unsupported_vit", f"{method} needs square images, got a {grid} patch grid"
        )
    return int(grid[0])


def with_positions(encoder: nn.Module, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(patch tokens + their position embeddings, class token + its own) as the
    timm ViT adds them."""
    pos = encoder.pos_embed
    if encoder.no_embed_class:
        return tokens + pos, encoder.cls_token
    return tokens + pos[:, 1:], encoder.cls_token + pos[:, :1]


@dataclass
class MAEOutput:
    loss: Tensor
    pred: Tensor  # N,L,S*S*C predictions of the normalised pixels of every patch
    mask: Tensor  # N,L, 1.0 where masked


class MaskedAutoencoder(nn.Module):
    """timm ViT encoder over the visible patches + light transformer decoder.

    `encoder` is a timm VisionTransformer with a class token and no register
    tokens, built without a head (num_classes=0). Its state dict is exactly the
    fine-tuning classifier's minus the head."""

    def __init__(
        self,
        encoder: nn.Module,
        *,
        patch_size: int,
        in_chans: int,
        mask_ratio: float = 0.6,
        decoder_dim: int = 128,
        decoder_depth: int = 2,
        decoder_heads: int = 4,
    ) -> None:
        super().__init__()
        from timm.models.vision_transformer import Block

        side = square_grid(encoder, "Fed-MAE")
        grid = (side, side)
        self.encoder = encoder
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.mask_ratio = mask_ratio
        self.num_patches = grid[0] * grid[1]
        embed_dim = encoder.embed_dim
        self.decoder_embed = nn.Linear(embed_dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        self.register_buffer(
            "decoder_pos_embed", sincos_position_embedding(decoder_dim, grid[0]), persistent=False
        )
        self.decoder_blocks = nn.Sequential(
            *[
                Block(decoder_dim, decoder_heads, mlp_ratio=4.0, qkv_bias=True)
                for _ in range(decoder_depth)
            ]
        )
        self.decoder_norm = nn.LayerNorm(decoder_dim)
        self.decoder_pred = nn.Linear(decoder_dim, patch_size * patch_size * in_chans)
        self._init_decoder()

    def _init_decoder(self) -> None:
        nn.init.normal_(self.mask_token, std=0.02)
        for module in [self.decoder_embed, self.decoder_blocks, self.decoder_pred]:
            for sub in module.modules():
                if isinstance(sub, nn.Linear):
                    nn.init.xavier_uniform_(sub.weight)
                    if sub.bias is not None:
                        nn.init.zeros_(sub.bias)

    def encode(self, images: Tensor, draw: MaskDraw) -> Tensor:
        """Encoder over [class token, visible patches] with their position embeddings."""
        enc = self.encoder
        tokens, cls = with_positions(enc, enc.patch_embed(images))
        dim = tokens.shape[-1]
        visible = tokens.gather(1, draw.keep[..., None].expand(-1, -1, dim))
        h = torch.cat([cls.expand(len(images), -1, -1), visible], dim=1)
        h = enc.norm_pre(enc.pos_drop(h))
        return enc.norm(enc.blocks(h))

    def decode(self, latent: Tensor, draw: MaskDraw) -> Tensor:
        """Decoder over all patches: encoded visible tokens and a mask token at every
        masked position, back in patch order; returns N,L,S*S*C predictions."""
        z = self.decoder_embed(latent)
        n, _, dim = z.shape
        masked = self.mask_token.expand(n, self.num_patches - (z.shape[1] - 1), -1)
        full = torch.cat([z[:, 1:], masked], dim=1)
        full = full.gather(1, draw.restore[..., None].expand(-1, -1, dim))
        full = torch.cat([z[:, :1], full], dim=1) + self.decoder_pos_embed.to(full.dtype)
        full = self.decoder_norm(self.decoder_blocks(full))
        return self.decoder_pred(full)[:, 1:]

    def forward(self, images: Tensor, generator: torch.Generator | None = None) -> MAEOutput:
        draw = random_masking(
            len(images),
            self.num_patches,
            self.mask_ratio,
            generator=generator,
            device=images.device,
        )
        pred = self.decode(self.encode(images, draw), draw)
        target = patchify(images, self.patch_size)
        return MAEOutput(masked_patch_loss(pred, target, draw.mask), pred, draw.mask)

    def encoder_state_dict(self) -> dict[str, Tensor]:
        """The encoder's weights (CPU clones), as the fine-tuning classifier names them."""
        return {k: v.detach().cpu().clone() for k, v in self.encoder.state_dict().items()}


def not_a_vit(name: str) -> tuple[str, str] | None:
    """(problem, fix) when `name` is not a timm ViT (`vit_*`), the only models
    Fed-MAE pre-trains and fine-tunes, else None."""
    import timm  # slow to import; only ViT sites need it

    if name.startswith("vit_") and timm.is_model(name):
        return None
    return (
        f"Fed-MAE and Fed-BEiT need a timm ViT, not {name!r}",
        "set model.name: vit_tiny_patch16_224 (or another timm vit_* model)",
    )


def build_vit(
    name: str,
    *,
    in_chans: int,
    num_classes: int,
    image_size: int,
    patch_size: int,
    depth: int | None,
) -> nn.Module:
    """timm ViT `name` at this image size with average pooling over the patch tokens
    after the final norm (`fc_norm=False` keeps the norm where the encoder has it)."""
    problem = not_a_vit(name)
    if problem is not None:
        raise model_name_error("mae_needs_vit", *problem)
    kwargs: dict[str, Any] = {
        "img_size": image_size,
        "patch_size": patch_size,
        "global_pool": "avg",
        "fc_norm": False,
    }
    if depth is not None:
        kwargs["depth"] = depth
    return timm_model(name, in_chans=in_chans, num_classes=num_classes, **kwargs)


def checked_patch_size(image_size: int, in_chans: int, patch_size: int | None) -> int:
    """`protocol.patch_size`, or the one `mae_patch_size` picks; refused
    (`bad_patch_size`) when it does not divide the image size."""
    patch = patch_size or mae_patch_size(image_size, in_chans)
    if image_size % patch:
        raise ModelError(
            "bad_patch_size",
            f"protocol.patch_size {patch} does not divide data.image_size {image_size} — "
            "pick a divisor or leave patch_size unset",
        )
    return patch


def pretraining_encoder(
    name: str, in_chans: int, image_size: int, patch: int, depth: int | None
) -> nn.Module:
    """The ViT a pre-training method trains: no head, built as the fine-tuning
    classifier will be (`build_vit`)."""
    return build_vit(
        name, in_chans=in_chans, num_classes=0, image_size=image_size, patch_size=patch, depth=depth
    )


def create_mae(
    name: str,
    *,
    in_chans: int,
    image_size: int,
    patch_size: int | None = None,
    encoder_depth: int | None = None,
    mask_ratio: float = 0.6,
    decoder_dim: int = 128,
    decoder_depth: int = 2,
    decoder_heads: int = 4,
) -> MaskedAutoencoder:
    """A masked autoencoder around timm ViT `name` (random weights)."""
    patch = checked_patch_size(image_size, in_chans, patch_size)
    encoder = pretraining_encoder(name, in_chans, image_size, patch, encoder_depth)
    return MaskedAutoencoder(
        encoder,
        patch_size=patch,
        in_chans=in_chans,
        mask_ratio=mask_ratio,
        decoder_dim=decoder_dim,
        decoder_depth=decoder_depth,
        decoder_heads=decoder_heads,
    )


# ---------------------------------------------------------------------- encoder export / import


class HasEncoder(Protocol):
    """A pre-trainer (MaskedAutoencoder, Fed-BEiT's BEiTPretrainer) around a ViT encoder."""

    def encoder_state_dict(self) -> dict[str, Tensor]: ...


def save_encoder(model: HasEncoder, path: str | Path) -> Path:
    """Write the encoder's weights (a torch state dict, readable with
    weights_only=True) atomically."""
    return atomic_torch_save(model.encoder_state_dict(), path)


def _encoder_geometry(state: dict[str, Tensor], path: Path) -> tuple[int, int, int, int]:
    """(depth, patch size, in_chans, image size) of a saved ViT encoder."""
    needed = ("patch_embed.proj.weight", "pos_embed", "cls_token", "blocks.0.attn.qkv.weight")
    if any(key not in state for key in needed):
        raise ModelError(
            "not_an_encoder",
            f"{path}: not a ViT encoder (no {', '.join(k for k in needed if k not in state)}) — "
            "point model.pretrained_from at the encoder a Fed-MAE run wrote",
        )
    blocks = {int(key.split(".")[1]) for key in state if key.startswith("blocks.")}
    depth = max(blocks) + 1
    _, in_chans, patch, _ = state["patch_embed.proj.weight"].shape
    tokens = state["pos_embed"].shape[1]
    grid = math.isqrt(tokens - 1)  # timm's default: one row for the class token
    if grid * grid != tokens - 1:  # position embeddings without a class-token row
        grid = math.isqrt(tokens)
    return depth, int(patch), int(in_chans), grid * int(patch)


def create_pretrained_classifier(
    name: str,
    path: str | Path,
    *,
    in_chans: int,
    num_classes: int,
    image_size: int,
) -> nn.Module:
    """Fed-MAE fine-tuning model: timm ViT `name` with the depth and patch size of
    the encoder saved at `path`, initialised from it, average-pooled patch tokens
    and a linear head (timm's initialisation)."""
    path = Path(path)
    state = read_weights_file(path)
    depth, patch, file_chans, file_size = _encoder_geometry(state, path)
    if (file_chans, file_size) != (in_chans, image_size):
        raise ModelError(
            "pretrained_mismatch",
            f"{path}: encoder was pre-trained on {file_chans}-channel {file_size}x{file_size} images, "
            f"this site uses {in_chans}-channel {image_size}x{image_size} — match data.channels and "
            "data.image_size to the pre-training run",
        )
    model = build_vit(
        name,
        in_chans=in_chans,
        num_classes=num_classes,
        image_size=image_size,
        patch_size=patch,
        depth=depth,
    )
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise ModelError(
            "weights_mismatch",
            f"{path}: encoder does not fit {name}: {str(exc).splitlines()[0]} — "
            "pre-train and fine-tune with the same model.name",
        ) from None
    stray = [k for k in missing if not k.startswith("head.")]
    if stray or unexpected:
        raise ModelError(
            "weights_mismatch",
            f"{path}: encoder does not fit {name} (missing {stray[:3]}, unexpected {list(unexpected)[:3]}) — "
            "pre-train and fine-tune with the same model.name",
        )
    log.info(
        "%s: %s (depth %d, patch %d) initialised from the pre-trained encoder",
        path,
        name,
        depth,
        patch,
    )
    return model
