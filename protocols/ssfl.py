"""SSFL-P2P: semi-supervised federated learning without a server (FedPerl with T = 0;
Bdair et al., MICCAI 2021, and the journal version). Every node, every round r:

  1. fit: FixMatch on its labeled + unlabeled images (Eq. 2-3, p2pfl/learning/semisup.py),
     Adam rebuilt every round as in the reference code
  2. offer the model it just trained to FedAVGP2P neighbours (FedPerl also
     publishes its feature vector F_m, p2pfl.learning.state.feature_vector)
  3. FedAVGP2P: pull k = round(c * (N - 1)) neighbours' round-r models and take
     the mean weighted by their image counts (labeled + unlabeled, Eq. 1's w_j;
     claims capped as in FedAVGP2P), or a robust variant (`protocol.aggregation`:
     median, trimmed_mean, norm_clip; the default mean is Eq. 1)
  4. evaluate (macro-F1, ECE on test; accuracy on val), gossip what is read, log,
     checkpoint

FedPerl (protocols/fedperl.py) adds peer learning between 2 and 3.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from p2pfl.config import ConfigError, SSFLParams
from p2pfl.learning.class_weights import class_weighting
from p2pfl.learning.evaluate import CALIBRATION_KEYS, evaluate_site
from p2pfl.learning.semisup import fixmatch_epoch, peer_model_from_state
from p2pfl.learning.state import feature_vector
from p2pfl.learning.train import LocalSite
from protocols import communities, selection
from protocols.base import RoundContext
from protocols.fedavgp2p import FedAvgP2P
from protocols.rounds import Round, RoundLoop


def num_images(site: LocalSite) -> int:
    """N_j of Eq. 1: labeled + unlabeled training images."""
    unlabeled = site.data.unlabeled
    return site.num_train + (0 if unlabeled is None else len(unlabeled))


class SSFL(FedAvgP2P):
    """FixMatch locally + FedAVGP2P between rounds (the SSFL-P2P baseline)."""

    params: SSFLParams  # type: ignore[assignment]
    # Published only where read (FedPerl.gossip_read): SSFL itself reads neither.
    gossip_gated = RoundLoop.gossip_gated | {communities.FEATURES_KEY, communities.VAL_ACCURACY_KEY}

    def __init__(self, params: SSFLParams) -> None:
        super().__init__(params)  # type: ignore[arg-type]
        self.peer_state: dict[str, Tensor] | None = None  # FedPerl: peer for the next fit
        self.gamma = 0.0  # weight of L_CON (FedPerl only)

    def sample_weight(self, site: Any) -> int:
        return num_images(site)

    async def setup(self, ctx: RoundContext) -> Any:
        if ctx.config.training.logit_adjustment:
            raise ConfigError(
                "site.yaml",
                "training.logit_adjustment",
                f"{self.name}'s FixMatch loss does not apply balanced softmax (it weights its "
                "supervised term by protocol.class_weighted)",
                "leave logit_adjustment out for this protocol",
            )
        site = await super().setup(ctx)
        # FixMatch weights its supervised loss by protocol.class_weighted (the
        # reference code's choice), not training.class_weighted: /status says so.
        training = ctx.config.training.model_copy(
            update={"class_weighted": self.params.class_weighted}
        )
        site.class_weighting = class_weighting(site.data.class_counts("train"), training)
        return site

    # ------------------------------------------------------------------ 1. local FixMatch

    def local_fixmatch(
        self, site: LocalSite, peer_state: dict[str, Tensor] | None
    ) -> dict[str, float]:
        """One round of local FixMatch (Eq. 2), with the anonymized peer if any."""
        p = self.params
        peer = peer_model_from_state(site, peer_state) if peer_state is not None else None
        return fixmatch_epoch(
            site,
            tau=p.tau,
            beta=p.beta,
            unlabeled_ratio=p.unlabeled_ratio,
            class_weighted=p.class_weighted,
            peer_model=peer,
            gamma=self.gamma if peer is not None else 0.0,
        )

    async def fit(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        # Local FixMatch; with the anonymized peer after warm-up (FedPerl Eq. 4, L_CON).
        site.reset_optimizer()  # Adam rebuilt every round, as in the reference code
        used_peer = self.peer_state is not None
        fit = await ctx.run_blocking(self.local_fixmatch, site, self.peer_state)
        rnd.log.update(
            train_loss=fit["loss"],
            supervised_loss=fit["supervised"],
            unlabeled_loss=fit["unlabeled"],
            consistency_loss=fit["consistency"],
            mask_rate=fit["mask_rate"],
            peer_learning=float(used_peer),
        )
        self.offer(ctx, site, rnd)

    # ------------------------------------------------------------------ 2-3. exchange

    async def exchange(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        assert rnd.own is not None
        # 2. Feature vector of the freshly trained model (journal Sec. 2.3.1),
        # for FedPerl's communities (SSFL, T = 0, reads none: nothing published).
        if communities.FEATURES_KEY in self.gossip_read(ctx):
            self.publish(
                ctx,
                communities.FEATURES_KEY,
                {"round": rnd.number, "vector": feature_vector(rnd.own)},
            )
        # 2a-b. FedPerl: communities and the anonymized peer for round r + 1.
        rnd.log.update(await self.peer_learning(ctx, site, rnd.number, rnd.own))
        # 3. FedAVGP2P between rounds: the global knowledge.
        await super().exchange(ctx, site, rnd)

    async def peer_learning(
        self, ctx: RoundContext, site: LocalSite, round_no: int, own: dict[str, Tensor]
    ) -> dict[str, float]:
        """T = 0: no peers."""
        return {}

    # ------------------------------------------------------------------ 4. evaluate

    async def evaluate_round(self, ctx: RoundContext, site: Any) -> dict[str, Any]:
        """Macro-F1 and ECE on test, accuracy on val; gossip what is read: per-class
        F1 or model statistics (the heuristic), the val accuracy (FedPerl's
        validation policies)."""
        metrics = await ctx.run_blocking(evaluate_site, site, CALIBRATION_KEYS)
        stats: list[float] = []  # computed only where the heuristic reads it
        if selection.MODEL_STATS_KEY in self.gossip_read(ctx):
            stats = await ctx.run_blocking(site.model_stats_vector)
        self.update_gossip(ctx, metrics.pop("per_class_f1"), stats)
        read = self.gossip_read(ctx)
        # As F1: only after a round that merged a peer's model (a review, rv_sa:
        # under secure aggregation a node whose sums failed gossiped its own
        # model's accuracy); the last merged model's stays, and my gate reads it.
        if (
            metrics.get("val_accuracy") is not None
            and communities.VAL_ACCURACY_KEY in read
            and self.merged_last_round()
        ):
            self.publish(ctx, communities.VAL_ACCURACY_KEY, float(metrics["val_accuracy"]))
        return {name: float(v) for name, v in metrics.items() if v is not None}
