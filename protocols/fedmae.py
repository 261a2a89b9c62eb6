"""Fed-MAE without a server: masked-autoencoder pre-training over FedAVGP2P, then fine-tuning.

Stage 1, self-supervised pre-training (Fed-MAE Sec. III-C, Alg. 1 left). Every
node, every round r:
  1. fit: E local epochs of the MAE loss (masked patches, per-patch normalised
     pixels) over every local image, labelled or not, on its encoder E_k and
     decoder D_k                                       (p2pfl.learning.mae.MAESite)
  2-5. FedAVGP2P's exchange where the paper has a server: offer the round-r
     autoencoder, choose k neighbours with the configured heuristic, pull
     theirs concurrently, sample-count-weighted mean of E_k, D_k and theirs
     (or a robust variant, `protocol.aggregation`)
  6. reconstruction loss on val and test (fixed masks), gossip model
     statistics, log, checkpoint.
When the last round is done the node writes its encoder E*_k
(`protocol.encoder_out` under its state dir) and a reconstruction grid
(`mae_reconstruction.png`: masked input | reconstruction | original).

Stage 2, supervised fine-tuning (Sec. III-D), when `protocol.finetune` holds a
protocol section: that protocol runs in the same node with
`model.pretrained_from` set to the encoder just written, so its classifier
(average-pooled features + linear head) starts from E*_k. Its message kinds get
the prefix `finetune.`, so a node still pre-training and one already
fine-tuning never mistake each other's models; its rounds are logged after the
pre-training ones (pre-training 1..R, fine-tuning R+1..R+F); its checkpoints
are wrapped, so a restarted node resumes in the stage it was in.

Unlike the paper there is no global model: each node ends pre-training with its
own neighbour-averaged autoencoder and fine-tunes from its own encoder.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

import protocols
from p2pfl.config import FedMAEParams, SiteConfig
from p2pfl.config.protocols import secure_finetune_update
from p2pfl.learning.data import SiteData
from p2pfl.learning.mae import MaskedAutoencoder, create_mae, save_encoder
from p2pfl.learning.mae_site import MAESite, save_reconstruction_grid
from p2pfl.learning.sites import Architecture, build_site
from p2pfl.learning.train import LocalSite
from protocols.base import RoundContext
from protocols.fedavgp2p import FedAvgP2P
from protocols.rounds import RoundLoop
from protocols.stages import FINETUNE_KIND_PREFIX, FINETUNE_STAGE, Stage, Staged

log = logging.getLogger(__name__)

PRETRAIN_STAGE = "pretrain"
RECONSTRUCTION_PNG = "mae_reconstruction.png"
GRID_IMAGES = 8


class FedMAEError(Exception):
    """A Fed-MAE run that cannot go on; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------- the local site


def _mae_kwargs(params: FedMAEParams) -> dict[str, Any]:
    return {
        "patch_size": params.patch_size,
        "encoder_depth": params.encoder_depth,
        "mask_ratio": params.mask_ratio,
        "decoder_dim": params.decoder_dim,
        "decoder_depth": params.decoder_depth,
        "decoder_heads": params.decoder_heads,
    }


def build_mae_site(config: SiteConfig, params: FedMAEParams) -> MAESite:
    """The node's MAESite (every local image), starting from the autoencoder every
    node draws alike from `federation.seed` (p2pfl.learning.sites.build_site)."""

    def architecture(data: SiteData) -> Architecture:
        def build() -> MaskedAutoencoder:
            return create_mae(
                config.model.name,
                in_chans=data.channels,
                image_size=data.image_size,
                **_mae_kwargs(params),
            )

        key = (
            f"mae|{config.model.name}|{sorted(_mae_kwargs(params).items())}|{data.channels}|"
            f"{data.image_size}|{config.federation.seed}"
        )
        return Architecture(build, key=key)

    return build_site(MAESite, config, architecture, seed=config.training.seed)


def split_metrics(site: LocalSite, names: dict[str, str]) -> dict[str, float]:
    """`site.evaluate` on val and test (those the site has), each reported value
    `key` logged as `names[key]` for test and `val_<names[key]>` for val."""
    return {
        (name if split == "test" else f"val_{name}"): report[key]
        for split, report in site.evaluate_available(("val", "test")).items()
        for key, name in names.items()
    }


def evaluate_reconstruction(site: MAESite) -> dict[str, float]:
    """Reconstruction loss on test (`recon_loss`) and val (`val_recon_loss`)."""
    return split_metrics(site, {"recon_loss": "recon_loss"})


# ---------------------------------------------------------------------- the protocol


class MAEPretraining(FedAvgP2P):
    """Stage 1: FedAVGP2P's rounds over the MAE objective (serving, pulling,
    averaging, resume and gossip are FedAVGP2P's)."""

    params: FedMAEParams  # type: ignore[assignment]

    async def setup(self, ctx: RoundContext) -> Any:
        """FedAVGP2P's rounds over the MAE loss: E local epochs over every local
        image, k neighbours' autoencoders pulled and averaged (Fed-MAE Alg. 1,
        w_{t+1} = sum_k n_k / n w_{t,k}, over the neighbourhood)."""
        site = await ctx.run_blocking(build_mae_site, ctx.config, self.params)
        self.start_exchange(ctx)
        return site

    async def evaluate_round(self, ctx: RoundContext, site: Any) -> dict[str, Any]:
        """Reconstruction loss on val; the gossip carries model statistics only
        (there are no per-class F1 scores before fine-tuning)."""
        metrics = await ctx.run_blocking(evaluate_reconstruction, site)
        self.update_gossip(ctx, None, await ctx.run_blocking(site.model_stats_vector))
        return metrics

    async def finish(self, ctx: RoundContext, site: Any) -> None:
        """E*_k for fine-tuning, and a look at what the autoencoder learnt."""
        p = self.params
        ctx.set_phase("export")
        path = await ctx.run_blocking(save_encoder, site.mae, ctx.artifact(p.encoder_out))
        grid = await ctx.run_blocking(
            save_reconstruction_grid,
            site.mae,
            site.sample_images(GRID_IMAGES),
            ctx.artifact(RECONSTRUCTION_PNG),
            title=f"{ctx.me}: Fed-MAE after {p.rounds} rounds (mask {p.mask_ratio:.0%})",
        )
        log.info("%s: pre-trained encoder -> %s, reconstructions -> %s", ctx.me, path, grid)


class FedMAE(Staged):
    """Pre-training (the node's own checkpoints, unprefixed kinds), then the
    chained fine-tuning protocol."""

    params: FedMAEParams

    def stages(self, config: SiteConfig | None) -> list[Stage]:
        p = self.params
        pretrain = Stage(PRETRAIN_STAGE, MAEPretraining(p), int(p.rounds), wrap=False)
        return [pretrain, *finetune_stage(p.finetune, p.encoder_out, p)]


def finetune_stage(finetune: Any, encoder_out: str, parent: Any = None) -> list[Stage]:
    """Stage 2 (none without `protocol.finetune`): that protocol, run from the
    encoder the pre-training stage wrote (`model.pretrained_from`). With the
    pre-training's (`parent`'s) secure aggregation, the stage's own, and its
    collusion bounds where the section leaves them unset
    (`secure_finetune_update`): configuration makes the section inherit them,
    and this holds it for params made in code too (`model_copy`, assignment),
    which skip that validation."""
    if finetune is None:
        return []
    if getattr(parent, "secure_aggregation", False):
        if "secure_aggregation" not in type(finetune).model_fields:
            raise FedMAEError(
                "insecure_finetune",
                f"secure_aggregation covers the fine-tuning stage, and {finetune.name} serves "
                "its exchanges in the clear",
            )
        # Validated, not `model_copy`'d: a section made in code must pass what a
        # secure one passes in configuration (a copy ran asynchronous secure sums
        # that weigh a stale model 10,201x less: a review, 2026-11-28).
        try:
            update = secure_finetune_update(parent, finetune)
            finetune = type(finetune).model_validate({**finetune.model_dump(), **update})
        except ValidationError as exc:
            problem = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise FedMAEError("insecure_finetune", f"{finetune.name}: {problem}") from None
        except ValueError as exc:
            raise FedMAEError("insecure_finetune", str(exc)) from None

    def config(ctx: RoundContext) -> SiteConfig:
        encoder = ctx.artifact(encoder_out)
        if not encoder.is_file():
            raise FedMAEError(
                "missing_encoder",
                f"{encoder}: the pre-trained encoder is gone — restore it or delete the "
                "checkpoints to pre-train again",
            )
        log.info("%s: fine-tuning with %s from %s", ctx.me, finetune.name, encoder)
        return ctx.config.model_copy(
            update={
                "model": ctx.config.model.model_copy(update={"pretrained_from": encoder}),
                "protocol": finetune,
            }
        )

    loop = protocols.from_params(finetune)
    assert isinstance(loop, RoundLoop)
    return [
        Stage(
            FINETUNE_STAGE,
            loop,
            int(finetune.rounds),
            prefix=FINETUNE_KIND_PREFIX,
            config=config,
        )
    ]
