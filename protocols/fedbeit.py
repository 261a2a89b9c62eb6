"""Fed-BEiT without a server: a federation-trained tokenizer, masked visual-token
pre-training over FedAVGP2P, then fine-tuning.

Stage 1, the tokenizer (`protocol.tokenizer_rounds` rounds; skipped when
`model.tokenizer_from` names a trained one). BEiT's targets are the visual
tokens of DALL-E's pretrained dVAE, which cannot be downloaded here; the
federation trains its own discrete tokenizer instead, a VQ-VAE with an EMA
codebook on the ViT's patch grid (p2pfl.learning.tokenizer), with FedAVGP2P:
local epochs of the VQ-VAE loss over every local image, k neighbours'
tokenizers pulled and averaged. Its last round averages with *every* alive
peer, so the federation ends with one tokenizer: a token means the same
patch content at every site, which averaging the token heads needs. Message
kinds carry the prefix `tokenizer.`. Logged: reconstruction error, codebook
perplexity and the share of codes in use. Written: `tokenizer.pt` and
`beit_tokens.png` (images | token maps | decoded tokens).

Stage 2, pre-training (`protocol.rounds` rounds; Fed-MAE paper Sec. III-C,
BEiT): each node, each round, local epochs of masked-token prediction over
every local image (blockwise masks of at most `mask_ratio` of the patches, a
frozen tokenizer gives the targets, cross-entropy on the masked patches only),
then FedAVGP2P's exchange of the whole pre-trainer (encoder, mask embedding,
token head). Logged: token cross-entropy and accuracy on val and test (fixed
masks). Written: the encoder (`protocol.encoder_out`).

Stage 3, fine-tuning (`protocol.finetune`), as in Fed-MAE: the chained
protocol builds its ViT classifier from the encoder one to one.

Rounds are logged one after the other (tokenizer 1..T, pre-training
T+1..T+R, fine-tuning after), each stage's checkpoints are wrapped with its
name, and a restarted node resumes in the stage it was in.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from p2pfl.config import FedBEiTParams, SiteConfig
from p2pfl.learning.beit import BEiTPretrainer, create_beit
from p2pfl.learning.beit_site import BEiTSite, TokenizerSite, save_token_maps
from p2pfl.learning.data import SiteData
from p2pfl.learning.export import sha256_of
from p2pfl.learning.mae import checked_patch_size, save_encoder
from p2pfl.learning.mae_site import first_split_images
from p2pfl.learning.models import ModelError
from p2pfl.learning.sites import Architecture, build_site
from p2pfl.learning.tokenizer import VQTokenizer, load_tokenizer, save_tokenizer
from protocols.base import RoundContext
from protocols.fedavgp2p import FedAvgP2P
from protocols.fedmae import PRETRAIN_STAGE, FedMAEError, finetune_stage, split_metrics
from protocols.rounds import Round
from protocols.stages import Stage, Staged

log = logging.getLogger(__name__)

TOKENIZER_STAGE = "tokenizer"
TOKENIZER_KIND_PREFIX = "tokenizer."
TOKEN_MAPS_PNG = "beit_tokens.png"
GRID_IMAGES = 8


# ---------------------------------------------------------------------- the local sites


def build_tokenizer_site(config: SiteConfig, params: FedBEiTParams) -> TokenizerSite:
    """The node's TokenizerSite (every local image), starting from the tokenizer
    every node draws alike from `federation.seed` (p2pfl.learning.sites.build_site)."""

    def architecture(data: SiteData) -> Architecture:
        patch = checked_patch_size(data.image_size, data.channels, params.patch_size)

        def build() -> VQTokenizer:
            return VQTokenizer(
                in_chans=data.channels,
                patch_size=patch,
                codebook_size=params.codebook_size,
                code_dim=params.code_dim,
                hidden=params.tokenizer_hidden,
            )

        key = (
            f"tokenizer|{data.channels}|{patch}|{params.codebook_size}|{params.code_dim}|"
            f"{params.tokenizer_hidden}|{config.federation.seed}"
        )
        return Architecture(build, key=key)

    training = config.training
    if params.tokenizer_lr is not None:
        training = training.model_copy(update={"lr": params.tokenizer_lr})
    return build_site(
        TokenizerSite, config, architecture, training=training, seed=config.training.seed
    )


def build_beit_site(config: SiteConfig, params: FedBEiTParams, tokenizer_path: Path) -> BEiTSite:
    """The node's BEiTSite: the pre-trainer every node draws alike from
    `federation.seed` (its token head as wide as the tokenizer's codebook), and
    the tokenizer at `tokenizer_path`, frozen."""

    def architecture(data: SiteData) -> Architecture:
        tokenizer = load_tokenizer(
            tokenizer_path, in_chans=data.channels, image_size=data.image_size
        )
        if params.patch_size is not None and params.patch_size != tokenizer.patch_size:
            raise ModelError(
                "tokenizer_mismatch",
                f"{tokenizer_path}: the tokenizer works on {tokenizer.patch_size}-pixel "
                f"patches, protocol.patch_size is {params.patch_size} — make them equal or "
                "unset patch_size",
            )

        def build() -> BEiTPretrainer:
            return create_beit(
                config.model.name,
                in_chans=data.channels,
                image_size=data.image_size,
                codebook_size=tokenizer.codebook_size,
                patch_size=tokenizer.patch_size,
                encoder_depth=params.encoder_depth,
                mask_ratio=params.mask_ratio,
                min_block=params.min_block_patches,
            )

        key = (
            f"beit|{config.model.name}|{tokenizer.codebook_size}|{tokenizer.patch_size}|"
            f"{params.encoder_depth}|{data.channels}|{data.image_size}|{config.federation.seed}"
        )
        return Architecture(build, key=key, site_args={"tokenizer": tokenizer})

    return build_site(BEiTSite, config, architecture, seed=config.training.seed)


def evaluate_tokenizer(site: TokenizerSite) -> dict[str, float]:
    return split_metrics(
        site,
        {
            "tokenizer_recon_loss": "tokenizer_recon_loss",
            "perplexity": "codebook_perplexity",
            "codes_used": "codebook_used",
        },
    )


def evaluate_tokens(site: BEiTSite) -> dict[str, float]:
    return split_metrics(site, {"token_loss": "token_loss", "token_accuracy": "token_accuracy"})


# ---------------------------------------------------------------------- stage 1


class TokenizerStage(FedAvgP2P):
    """FedAVGP2P's rounds over the tokenizer; the last round averages with every
    alive peer (one tokenizer for the federation)."""

    params: FedBEiTParams  # type: ignore[assignment]

    def __init__(self, params: FedBEiTParams) -> None:
        super().__init__(params.model_copy(update={"rounds": params.tokenizer_rounds}))  # type: ignore[arg-type]
        self.beit = params

    def neighbours_wanted(self, ctx: RoundContext, round_no: int) -> int:
        if round_no == self.params.rounds:
            return len(ctx.roster()) - 1
        return super().neighbours_wanted(ctx, round_no)

    async def aggregate(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        """FedAVGP2P's merge, then the codebook counters the merge left that no
        honest tokenizer holds (negative, vanishing: a crafted peer model within
        the norm bound) are reset, logged and counted as `tokenizer_bad_counts`
        against each peer merged this round (a merge, or a secure sum, cannot
        tell whose model did it)."""
        await super().aggregate(ctx, site, rnd)
        reset = await ctx.run_blocking(site.tokenizer.reset_implausible_counts)
        if reset:
            peers = sorted({peer for peer, _ in rnd.merged})
            log.warning(
                "%s round %d: the merged tokenizer held %d codebook counters no honest "
                "tokenizer holds (negative or vanishing); reset them (merged: %s)",
                ctx.me,
                rnd.number,
                reset,
                ", ".join(peers),
            )
            for peer in peers:
                ctx.reject(peer, "tokenizer_bad_counts")

    async def setup(self, ctx: RoundContext) -> Any:
        site = await ctx.run_blocking(build_tokenizer_site, ctx.config, self.beit)
        self.start_exchange(ctx)
        return site

    async def evaluate_round(self, ctx: RoundContext, site: Any) -> dict[str, Any]:
        metrics = await ctx.run_blocking(evaluate_tokenizer, site)
        self.update_gossip(ctx, None, await ctx.run_blocking(site.model_stats_vector))
        return metrics

    def evaluates(self, round_no: int) -> bool:
        return True  # every round: the tokenizer stage is short and its last round matters

    async def finish(self, ctx: RoundContext, site: Any) -> None:
        ctx.set_phase("export")
        path = await ctx.run_blocking(
            save_tokenizer, site.tokenizer, ctx.artifact(self.beit.tokenizer_out)
        )
        grid = await ctx.run_blocking(
            save_token_maps,
            site.tokenizer,
            first_split_images(site, GRID_IMAGES),
            ctx.artifact(TOKEN_MAPS_PNG),
            title=f"{ctx.me}: tokenizer after {self.params.rounds} rounds "
            f"({site.tokenizer.codebook_size} codes)",
        )
        log.info(
            "%s: tokenizer -> %s (sha256 %s, the same on every node), token maps -> %s",
            ctx.me,
            path,
            sha256_of(path)[:12],
            grid,
        )


# ---------------------------------------------------------------------- the protocol


class BEiTPretraining(FedAvgP2P):
    """Stage 2: FedAVGP2P's rounds over BEiT's masked-token objective (serving,
    pulling, averaging, resume and gossip are FedAVGP2P's)."""

    params: FedBEiTParams  # type: ignore[assignment]

    async def setup(self, ctx: RoundContext) -> Any:
        tokenizer = tokenizer_path(ctx, self.params)
        if not tokenizer.is_file():
            raise FedMAEError(
                "missing_tokenizer",
                f"{tokenizer}: the tokenizer is gone — restore it, set model.tokenizer_from, "
                "or delete the checkpoints to train it again",
            )
        site = await ctx.run_blocking(build_beit_site, ctx.config, self.params, tokenizer)
        self.start_exchange(ctx)
        return site

    async def evaluate_round(self, ctx: RoundContext, site: Any) -> dict[str, Any]:
        metrics = await ctx.run_blocking(evaluate_tokens, site)
        self.update_gossip(ctx, None, await ctx.run_blocking(site.model_stats_vector))
        return metrics

    async def finish(self, ctx: RoundContext, site: Any) -> None:
        ctx.set_phase("export")
        path = await ctx.run_blocking(
            save_encoder, site.beit, ctx.artifact(self.params.encoder_out)
        )
        log.info("%s: Fed-BEiT encoder -> %s", ctx.me, path)


def tokenizer_path(ctx: RoundContext, params: FedBEiTParams) -> Path:
    supplied = ctx.config.model.tokenizer_from
    return Path(supplied) if supplied is not None else ctx.artifact(params.tokenizer_out)


class FedBEiT(Staged):
    """1. the tokenizer (unless supplied), 2. masked-token pre-training, 3. the
    chained fine-tuning protocol (as Fed-MAE's); a restarted node resumes in
    the stage it was in."""

    params: FedBEiTParams

    def stages(self, config: SiteConfig | None) -> list[Stage]:
        p = self.params
        supplied = config is not None and config.model.tokenizer_from is not None
        tokenizer = Stage(
            TOKENIZER_STAGE, TokenizerStage(p), p.tokenizer_rounds, prefix=TOKENIZER_KIND_PREFIX
        )
        pretrain = Stage(PRETRAIN_STAGE, BEiTPretraining(p), int(p.rounds))
        first = [] if supplied or not p.tokenizer_rounds else [tokenizer]
        return [*first, pretrain, *finetune_stage(p.finetune, p.encoder_out, p)]
