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

import asyncio
import logging
from pathlib import Path
from typing import Any

import protocols
from p2pfl.config import FedMAEParams, SiteConfig
from p2pfl.learning.data import SiteData, load_site_data
from p2pfl.learning.mae import MaskedAutoencoder, create_mae, save_encoder
from p2pfl.learning.mae_site import MAESite, save_reconstruction_grid
from p2pfl.learning.train import LocalSite, seed_everything
from protocols.base import Handler, PeerInfo, Received, RoundContext
from protocols.fedavgp2p import (
    FedAvgP2P,
)
from protocols.site import common_initial_model

log = logging.getLogger(__name__)

PRETRAIN_STAGE = "pretrain"
FINETUNE_STAGE = "finetune"
FINETUNE_KIND_PREFIX = "finetune."
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


def pretraining_data(config: SiteConfig) -> SiteData:
    """The site's data, torch seeded from training.seed first (as every site build)."""
    seed_everything(config.training.seed)
    return load_site_data(config.data, seed=config.federation.seed + config.training.seed)


def build_mae_site(config: SiteConfig, params: FedMAEParams) -> MAESite:
    """The node's MAESite (every local image), starting from the autoencoder every
    node draws alike from `federation.seed`."""
    data = pretraining_data(config)

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
    model = common_initial_model(key, config.federation.seed, build)
    return MAESite(
        model, data, config.training, augment=config.data.augment, seed=config.training.seed
    )


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


class FedMAE(FedAvgP2P):
    """FedAVGP2P's round over the MAE objective (serving, pulling, averaging,
    resume and gossip are FedAVGP2P's), then the chained fine-tuning protocol."""

    params: FedMAEParams  # type: ignore[assignment]

    def __init__(self, params: FedMAEParams) -> None:
        super().__init__(params)  # type: ignore[arg-type]  # the exchange reads fraction and max_staleness

    def message_kinds(self) -> frozenset[str]:
        """Pre-training's kinds, and the fine-tuning protocol's under `finetune.`."""
        kinds = super().message_kinds()
        if self.params.finetune is None:
            return kinds
        inner = protocols.from_params(self.params.finetune).message_kinds()
        return kinds | {FINETUNE_KIND_PREFIX + k for k in inner}

    async def run(self, ctx: RoundContext) -> None:
        saved = ctx.restore() or {}
        finetuning = saved.get("protocol") == self.name and saved.get("stage") == FINETUNE_STAGE
        if not finetuning:  # a node restarted while fine-tuning does not pre-train again
            await self.run_stage(ctx)
        if self.params.finetune is not None:
            await self.finetune(ctx)
        ctx.set_phase("done")

    # ------------------------------------------------------------------ stage 1

    async def setup(self, ctx: RoundContext) -> Any:
        """FedAVGP2P's rounds over the MAE loss: E local epochs over every local
        image, k neighbours' autoencoders pulled and averaged (Fed-MAE Alg. 1,
        w_{t+1} = sum_k n_k / n w_{t,k}, over the neighbourhood)."""
        site = await ctx.train(build_mae_site, ctx.config, self.params)
        self.start_exchange(ctx)
        return site

    async def evaluate_round(self, ctx: RoundContext, site: Any) -> dict[str, Any]:
        """Reconstruction loss on val; the gossip carries model statistics only
        (there are no per-class F1 scores before fine-tuning)."""
        metrics = await ctx.train(evaluate_reconstruction, site)
        self.update_gossip(ctx, None, await ctx.train(site.model_stats_vector))
        return metrics

    async def finish(self, ctx: RoundContext, site: Any) -> None:
        """E*_k for fine-tuning, and a look at what the autoencoder learnt."""
        p = self.params
        ctx.set_phase("export")
        path = await ctx.train(save_encoder, site.mae, ctx.artifact(p.encoder_out))
        grid = await ctx.train(
            save_reconstruction_grid,
            site.mae,
            site.sample_images(GRID_IMAGES),
            ctx.artifact(RECONSTRUCTION_PNG),
            title=f"{ctx.me}: Fed-MAE after {p.rounds} rounds (mask {p.mask_ratio:.0%})",
        )
        log.info("%s: pre-trained encoder -> %s, reconstructions -> %s", ctx.me, path, grid)

    # ------------------------------------------------------------------ stage 2

    async def finetune(self, ctx: RoundContext) -> None:
        p = self.params
        assert p.finetune is not None
        encoder = ctx.artifact(p.encoder_out)
        if not encoder.is_file():
            raise FedMAEError(
                "missing_encoder",
                f"{encoder}: the pre-trained encoder is gone — restore it or delete the "
                "checkpoints to pre-train again",
            )
        config = ctx.config.model_copy(
            update={
                "model": ctx.config.model.model_copy(update={"pretrained_from": encoder}),
                "protocol": p.finetune,
            }
        )
        log.info("%s: fine-tuning with %s from %s", ctx.me, p.finetune.name, encoder)
        await protocols.from_params(p.finetune).run(
            StageContext(
                ctx, config, protocol=self.name, round_offset=self.pretraining_rounds(ctx.config)
            )
        )

    def pretraining_rounds(self, config: SiteConfig) -> int:
        """Rounds logged before fine-tuning's (Fed-BEiT adds its tokenizer's)."""
        return int(self.params.rounds)


class StageContext(RoundContext):
    """The node's context as one stage of a chained run sees it (by default the
    fine-tuning protocol after pre-training): its own config (for fine-tuning,
    `model.pretrained_from` set), message kinds prefixed with `prefix`, rounds
    shown and logged after the earlier stages' (`round_offset`), checkpoints
    wrapped as `{protocol, stage, <stage>: ...}` so a restarted node resumes in
    the stage it was in."""

    def __init__(
        self,
        outer: RoundContext,
        config: SiteConfig,
        *,
        protocol: str,
        round_offset: int,
        stage: str = FINETUNE_STAGE,
        prefix: str = FINETUNE_KIND_PREFIX,
    ) -> None:
        self.outer = outer
        self.me = outer.me
        self.config = config
        self.protocol = protocol
        self.round_offset = round_offset
        self.stage = stage
        self.prefix = prefix

    @property  # type: ignore[override]
    def round(self) -> int:
        return self.outer.round - self.round_offset

    @round.setter
    def round(self, value: int) -> None:
        self.outer.round = value + self.round_offset

    def kind(self, kind: str) -> str:
        return self.prefix + kind

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.outer.set_phase(phase)

    def peers(self, alive_only: bool = True) -> list[PeerInfo]:
        return self.outer.peers(alive_only)

    def roster(self) -> list[str]:
        return self.outer.roster()

    async def send(self, peer: str, kind: str, payload: Any, round: int | None = None) -> None:
        await self.outer.send(
            peer, self.kind(kind), payload, self.round if round is None else round
        )

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        return await self.outer.request(peer, self.kind(kind), query, timeout)

    def serve(self, kind: str, handler: Handler) -> None:
        self.outer.serve(self.kind(kind), handler)

    def inbox(self, kind: str) -> asyncio.Queue[Received]:
        return self.outer.inbox(self.kind(kind))  # pushes were sent with this stage's rounds

    def publish(self, key: str, value: Any) -> None:
        self.outer.publish(key, value)

    async def train(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await self.outer.train(fn, *args, **kwargs)

    def checkpoint(self, state: dict[str, Any]) -> None:
        self.outer.checkpoint({"protocol": self.protocol, "stage": self.stage, self.stage: state})

    def restore(self) -> dict[str, Any] | None:
        saved = self.outer.restore()
        if saved and saved.get("protocol") == self.protocol and saved.get("stage") == self.stage:
            return saved[self.stage]
        return None

    def log_metrics(self, round: int, **values: float) -> None:
        self.outer.log_metrics(round + self.round_offset, **values)

    def record_choice(self, chosen: list[str]) -> None:
        self.outer.record_choice(chosen)

    def offered(self, kind: str) -> None:
        self.outer.offered(self.kind(kind))

    def reject(self, peer: str, reason: str) -> None:
        self.outer.reject(peer, reason)

    def sample_caps(self) -> dict[str, int]:
        return self.outer.sample_caps()

    def set_community(self, community: dict[str, Any]) -> None:
        self.outer.set_community(community)

    def set_training(self, training: dict[str, Any]) -> None:
        self.outer.set_training(training)

    def set_privacy_gate(self, decision: dict[str, Any]) -> None:
        self.outer.set_privacy_gate(decision)

    def pair_secret(self, peer: str, context: bytes) -> bytes:
        return self.outer.pair_secret(peer, context)

    def storage_dir(self) -> Path:
        return self.outer.storage_dir()

    def durable_file(self, name: str) -> Path | None:
        return self.outer.durable_file(name)

    async def sleep(self, seconds: float) -> None:
        await self.outer.sleep(seconds)
