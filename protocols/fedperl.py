"""FedPerl without a server (Bdair et al., MICCAI 2021; journal version).

FedPerl is SSFL-P2P (protocols/ssfl.py: local FixMatch, feature vector,
FedAVGP2P between rounds) plus, between its steps 2 and 3, from round
`warmup_rounds` on:
  2a. communities: cosine similarity of the gossiped feature vectors (columns
      min-max normalised across nodes), the top-T peers, then the policy
      (static, validation, gated validation, gated similarity)
  2b. anonymized peer f_a = mean of the T peers' round-r models (MICCAI Eq. 4's
      phi_a). In the papers a server builds it; here the T peers' models are
      summed by secure aggregation (protocols/secagg.py) with this node as the
      requester: it learns their mean and nothing else. A peer that drops out
      after masking is handled inside the sum (at least two must stay);
      nobody is asked twice for one model, so no two sums over different
      subsets of the same models exist. Otherwise no peer this round.
  and in round r + 1's fit: pseudo-labels from the mean of the local and the
  anonymized peer's softmax (Eq. 4) plus gamma * MSE(local, peer) (L_CON).

Without `protocol.secure_aggregation` the anonymized peer is the plain mean of
the T models (Eq. 4), but the FedAVGP2P step serves plain models to any peer.
With it, the whole round shows no individual model to another node: the
community's secure sum, weighted by image counts (a small departure from
Eq. 4's plain mean, so that it can also be the FedAVGP2P term), is both the
anonymized peer and part of the round's average, and the remaining FedAVGP2P
neighbours (k minus the community, at least two if any) are a second secure
sum over other peers. The two sums are over disjoint sets: each contributor is
asked once per model.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

from torch import Tensor

from p2pfl.config import FedPerlParams
from p2pfl.learning.train import LocalSite
from protocols import communities, selection
from protocols.base import RoundContext
from protocols.checks import incompatibility
from protocols.exchange import Collected
from protocols.rounds import Round
from protocols.secagg import SecureSum
from protocols.secure_exchange import SecureExchange, secure_exchange_for
from protocols.similarity import is_echo, vector_problem
from protocols.ssfl import SSFL

log = logging.getLogger(__name__)

ANON_PURPOSE = "anon"  # a sum for the anonymized peer only: every model weighs 1 (Eq. 4)
VAL_ACCURACY_POLICIES = ("validation", "gated_validation")  # the policies that read it


# ---------------------------------------------------------------------- FedPerl


class FedPerl(SSFL):
    """SSFL-P2P + communities + anonymized peer learning (T >= 1)."""

    params: FedPerlParams  # type: ignore[assignment]
    # The community (top T, chosen, similarities) was gossiped, and no node,
    # dashboard or bench read it: gated and never read (`gossip_read`), it is
    # not published, nor republished from a checkpoint of before.
    gossip_gated = SSFL.gossip_gated | {communities.COMMUNITY_KEY}
    purpose_weights: ClassVar[dict[str, float]] = {
        ANON_PURPOSE: 1.0
    }  # Eq. 4: the plain mean of the T models

    def __init__(self, params: FedPerlParams) -> None:
        super().__init__(params)  # type: ignore[arg-type]
        # The anonymized peers of others are served in either mode.
        self.anonymizer: SecureExchange = (
            self.exchanger
            if isinstance(self.exchanger, SecureExchange)
            else secure_exchange_for(params, self.store, self.purpose_weights)
        )
        self.gamma = params.gamma
        self.community_sum: SecureSum | None = None  # secure mode: also a FedAVGP2P term
        self.community_asked: list[str] = []  # who was asked for this round's anonymized peer

    def gossip_read(self, ctx: RoundContext) -> frozenset[str]:
        """Every FedPerl node reads the feature vectors; the validation
        policies read the validation accuracy too."""
        read = {communities.FEATURES_KEY}
        if self.params.policy in VAL_ACCURACY_POLICIES:
            read.add(communities.VAL_ACCURACY_KEY)
        return super().gossip_read(ctx) | read

    # ------------------------------------------------------------------ requester side

    def similarities(self, ctx: RoundContext) -> dict[str, float]:
        """My row of W from the feature vectors gossiped by the alive peers.

        A vector is a peer's claim about itself, sent to each node apart: one
        that is not a list of numbers, has a non-finite entry or one beyond
        1e6 (`gossip_features_range`: a finite 1e308 overflowed the
        normalisation into NaN rows, and the node stopped training), or
        equals mine within float tolerance (`gossip_echo`: sent back to each
        node, its own vector made the sender everyone's most similar peer) is
        refused and counted, once per round."""
        vectors: dict[str, list[float]] = {}
        mine = self.gossip.get(communities.FEATURES_KEY)
        own: list[float] = []
        if isinstance(mine, dict):
            own = list(mine.get("vector") or [])
            vectors[ctx.me] = own
        if not own:
            # No row of mine, no similarities: peers' vectors are not read
            # (nor could their length be checked against mine).
            return {}
        for peer in ctx.peers():
            entry = peer.meta.get(communities.FEATURES_KEY)
            if not isinstance(entry, dict) or entry.get("vector") is None:
                continue  # not published (yet)
            problem = None
            theirs: list[float] = []
            vector = entry["vector"]
            # Its type and length before a number of it is read: each round read
            # every number of a peer's vector first, on the event loop (20
            # million: about 1.6 s), and took numbers sent as text ("1e5").
            if not isinstance(vector, list):
                problem = "gossip_features_malformed"
            elif len(vector) != len(own):
                # the same model everywhere: another length is no honest vector,
                # and the most common length decides the matrix (communities.py),
                # so longer vectors from colluders would leave this node out
                problem = "gossip_features_length"
            elif not all(isinstance(x, int | float) and not isinstance(x, bool) for x in vector):
                problem = "gossip_features_malformed"
            else:
                theirs = [float(x) for x in vector]
            if problem is None and vector_problem(theirs) is not None:
                problem = "gossip_features_range"
            # Kept here though selection dropped its F1 echo refusal: there
            # honest vectors collide (per-class F1 takes few values; merged
            # models are shared), so it refused honest twins. A feature vector
            # is the mean and std of each entry of the model a site has just
            # trained on its own images, before merging; two honest sites'
            # never agree to 1e-9, so this refuses no honest peer. It stops
            # only the exact echo: a copy off by 1e-6 passes (the stated limit,
            # docs/threat-model.md).
            if problem is None and is_echo(theirs, own):
                problem = "gossip_echo"
            if problem is not None:
                log.warning("%s: feature vector of %s refused (%s)", ctx.me, peer.name, problem)
                ctx.reject(peer.name, problem)
                continue
            vectors[peer.name] = theirs
        matrix = communities.similarity_matrix(vectors)
        if ctx.me not in matrix.names:
            return {}
        return matrix.row(ctx.me)

    def choose_peers(
        self, ctx: RoundContext, round_no: int, similarities: dict[str, float]
    ) -> tuple[list[str], list[str]]:
        """(top-T by similarity, the ones the policy keeps). Too few peers with a
        vector: the rest are drawn at random (the reference's 'no history')."""
        p = self.params
        ranked = communities.top_t(similarities, p.top_t, exclude=ctx.me)
        if len(ranked) < p.top_t:
            others = sorted(x.name for x in ctx.peers() if x.name not in ranked)
            rng = selection.seeded_rng(ctx.config.federation.seed, ctx.me, round_no, step=17)
            rng.shuffle(others)
            ranked += others[: p.top_t - len(ranked)]
        inputs = communities.PolicyInputs(
            similarities=similarities,
            my_val_accuracy=self.gossip.get(communities.VAL_ACCURACY_KEY),
            peer_val_accuracy=self.peer_val_accuracies(ctx)
            if p.policy in VAL_ACCURACY_POLICIES
            else {},
        )
        return ranked, communities.apply_policy(p.policy, ranked, inputs, p.rho)

    def peer_val_accuracies(self, ctx: RoundContext) -> dict[str, float]:
        """The validation accuracies the peers gossip, for the policies that
        read them. An accuracy is in [0, 1]: any other number (a peer's claim
        of 1e9 passed every gate) is refused, counted as
        `gossip_val_accuracy_range`, and the peer counts as one without a
        figure (it passes no gate)."""
        out: dict[str, float] = {}
        for peer in ctx.peers():
            value = peer.meta.get(communities.VAL_ACCURACY_KEY)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                ok = False
            else:
                ok = math.isfinite(float(value)) and 0.0 <= float(value) <= 1.0
            if not ok:
                log.warning("%s: validation accuracy of %s refused", ctx.me, peer.name)
                ctx.reject(peer.name, "gossip_val_accuracy_range")
                continue
            out[peer.name] = float(value)
        return out

    async def peer_learning(
        self, ctx: RoundContext, site: LocalSite, round_no: int, own: dict[str, Tensor]
    ) -> dict[str, float]:
        p = self.params
        self.peer_state = None
        similarities = self.similarities(ctx)
        ranked, chosen = self.choose_peers(ctx, round_no, similarities)
        community = {
            "round": round_no,
            "top_t": ranked,
            "chosen": chosen,
            "similarity": {name: round_sim(similarities.get(name)) for name in ranked},
            "policy": p.policy,
        }
        ctx.set_community(community)  # /status only: no node reads it from the gossip
        self.community_sum, self.community_asked = None, []
        if round_no < max(p.warmup_rounds, 1) or round_no >= p.rounds:
            return {"anon_contributors": 0.0}  # warm-up (or nothing left to train)
        ctx.record_choice(chosen)
        self.community_asked = list(chosen)
        # Secure mode: the community's sum doubles as a FedAVGP2P term, so it is
        # weighted by image counts like every other; otherwise Eq. 4's plain mean.
        purpose = "model" if self.secure else ANON_PURPOSE
        result = await self.anonymizer.sum_of(
            ctx, round_no, own, sorted(chosen), purpose=purpose, stream="community"
        )
        if result is not None:
            problem = incompatibility(result.mean, own, max_norm_ratio=p.max_norm_ratio)
            if problem is not None:
                log.warning("%s round %d: anonymized peer rejected (%s)", ctx.me, round_no, problem)
                for peer in result.contributors:
                    ctx.reject(peer, f"sum_{problem}")
                result = None
        if result is None:
            return {"anon_contributors": 0.0}
        self.peer_state = result.mean
        if self.secure:
            self.community_sum = result
        sims = [similarities[x] for x in result.contributors if x in similarities]
        return {
            "anon_contributors": float(len(result.contributors)),
            "anon_dropped": float(len(result.dropped)),
            "anon_variances_raised": float(result.variances_raised),
            "community_similarity": float(sum(sims) / len(sims)) if sims else 0.0,
        }

    async def collect(self, ctx: RoundContext, site: Any, rnd: Round, k: int) -> Collected:
        """Secure mode: the community's sum, plus one over the next k - T
        neighbours that are not in the community (two at least, a sum of one
        being a model): disjoint sets, so each model is asked for once."""
        if not self.secure:
            return await super().collect(ctx, site, rnd, k)
        assert rnd.own is not None
        sums = [self.community_sum] if self.community_sum is not None else []
        want = max(0, k - len(self.community_asked))
        if want == 1:
            want = 2
        if want:
            exclude = set(self.community_asked)
            others = self.rank_neighbours(ctx, rnd.number, want, exclude=exclude)
            result = await self.anonymizer.sum_of(
                ctx, rnd.number, rnd.own, others[:want], purpose="model", stream="others"
            )
            if result is not None:
                sums.append(result)
        own_weight = float(self.sample_weight(site))
        return self.anonymizer.collected(ctx, rnd.number, sums, rnd.own, own_weight, k)

    # ------------------------------------------------------------------ contributor side

    def start_exchange(self, ctx: RoundContext) -> None:
        super().start_exchange(ctx)
        self.anonymizer.start(ctx)  # the anonymized peers of others, in either mode

    def offer(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        super().offer(ctx, site, rnd)
        if self.anonymizer is not self.exchanger:
            assert rnd.own is not None
            self.anonymizer.offer(ctx, rnd.number, rnd.own, self.sample_weight(site))

    def record_neighbours(self, ctx: RoundContext, used: list[str]) -> None:
        """FedPerl records its community choices (journal Fig. 3) instead."""

    # ------------------------------------------------------------------ checkpoint

    def checkpoint_state(self, round_no: int, site: Any) -> dict[str, Any]:
        return {**super().checkpoint_state(round_no, site), "peer_state": self.peer_state}

    def load_extra(self, saved: dict[str, Any]) -> None:
        state = saved.get("peer_state")
        self.peer_state = state if isinstance(state, dict) else None


def round_sim(value: float | None) -> float | None:
    """A similarity as /status shows it: None where there is
    none, or where it is not a finite number (JSON has no NaN: /status refused
    a community holding one, and the node stopped training)."""
    if value is None or not math.isfinite(float(value)):
        return None
    return round(float(value), 4)
