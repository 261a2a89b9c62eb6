"""FedPerl without a server (Bdair et al., MICCAI 2021; journal version).

FedPerl is SSFL-P2P (protocols/ssfl.py: local FixMatch, feature vector,
FedAVGP2P between rounds) plus, between its steps 2 and 3, from round
`warmup_rounds` on:
  2a. communities: cosine similarity of the gossiped feature vectors (columns
      min-max normalised across nodes), the top-T peers, then the policy
      (static, validation, gated validation, gated similarity)
  2b. anonymized peer f_a = mean of the T peers' round-r models (MICCAI Eq. 4's
      phi_a), delivered by the peers themselves with pairwise additive masks
      (protocols/masking.py): each answers with a masked contribution, the
      requester sums them and can only learn the mean. A contributor that fails
      is dropped and the request retried with a fresh id over the remaining
      ones (at least 2); otherwise no peer this round. Never an unmasked model.
  and in round r + 1's fit: pseudo-labels from the mean of the local and the
  anonymized peer's softmax (Eq. 4) plus gamma * MSE(local, peer) (L_CON).

Contributor-side rules of an "anon_model" request (the requester is not trusted
to choose its contributors honestly): I must be a contributor, the requester
must not be; at least two distinct roster members; a request id is answered
once; for one requester and round, a later request is answered only if its
contributor set is a strict subset of the one answered before (an honest
retry), so a requester cannot collect overlapping subset sums.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor

from p2pfl.config import FedPerlParams
from p2pfl.learning.train import LocalSite
from protocols import communities, masking, selection
from protocols.base import NotReady, PeerUnavailable, RoundContext
from protocols.checks import incompatibility
from protocols.rounds import Round
from protocols.ssfl import SSFL

log = logging.getLogger(__name__)

ANON_KIND = "anon_model"
MIN_CONTRIBUTORS = 2  # one contributor's "average" would be its own model


# ---------------------------------------------------------------------- FedPerl


class AnonymizedPeerRequest(BaseModel):
    """What a requester sends each contributor (validated at the edge)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    contributors: list[str] = Field(min_length=MIN_CONTRIBUTORS, max_length=64)
    round: int = Field(ge=0)
    max_round: int = Field(ge=0)


class FedPerl(SSFL):
    """SSFL-P2P + communities + anonymized peer learning (T >= 1)."""

    params: FedPerlParams  # type: ignore[assignment]

    def __init__(self, params: FedPerlParams) -> None:
        super().__init__(params)  # type: ignore[arg-type]
        self.gamma = params.gamma
        self.answered_ids: dict[tuple[str, str], int] = {}  # (requester, request id) -> round
        self.answered_sets: dict[tuple[str, int], frozenset[str]] = {}  # (requester, round) -> set

    # ------------------------------------------------------------------ requester side

    def similarities(self, ctx: RoundContext) -> dict[str, float]:
        """My row of W from the feature vectors gossiped by the alive peers."""
        vectors: dict[str, list[float]] = {}
        mine = self.gossip.get(communities.FEATURES_KEY)
        if isinstance(mine, dict):
            vectors[ctx.me] = list(mine.get("vector") or [])
        for peer in ctx.peers():
            entry = peer.meta.get(communities.FEATURES_KEY)
            if isinstance(entry, dict) and isinstance(entry.get("vector"), list):
                try:
                    vectors[peer.name] = [float(x) for x in entry["vector"]]
                except (TypeError, ValueError):
                    log.warning("%s: unusable feature vector from %s", ctx.me, peer.name)
        matrix = communities.similarity_matrix(vectors)
        if ctx.me not in matrix.names:
            return {}
        return matrix.row(ctx.me)

    def choose_peers(
        self, ctx: RoundContext, round: int, similarities: dict[str, float]
    ) -> tuple[list[str], list[str]]:
        """(top-T by similarity, the ones the policy keeps). Too few peers with a
        vector: the rest are drawn at random (the reference's 'no history')."""
        p = self.params
        ranked = communities.top_t(similarities, p.top_t, exclude=ctx.me)
        if len(ranked) < p.top_t:
            others = sorted(x.name for x in ctx.peers() if x.name not in ranked)
            rng = selection.seeded_rng(ctx.config.federation.seed, ctx.me, round, step=17)
            rng.shuffle(others)
            ranked += others[: p.top_t - len(ranked)]
        inputs = communities.PolicyInputs(
            similarities=similarities,
            my_val_accuracy=self.gossip.get(communities.VAL_ACCURACY_KEY),
            peer_val_accuracy={
                x.name: float(x.meta[communities.VAL_ACCURACY_KEY])
                for x in ctx.peers()
                if isinstance(x.meta.get(communities.VAL_ACCURACY_KEY), int | float)
            },
        )
        return ranked, communities.apply_policy(p.policy, ranked, inputs, p.rho)

    async def peer_learning(
        self, ctx: RoundContext, site: LocalSite, round: int, own: dict[str, Tensor]
    ) -> dict[str, float]:
        p = self.params
        self.peer_state = None
        similarities = self.similarities(ctx)
        ranked, chosen = self.choose_peers(ctx, round, similarities)
        community = {
            "round": round,
            "top_t": ranked,
            "chosen": chosen,
            "similarity": {name: round_sim(similarities.get(name)) for name in ranked},
            "policy": p.policy,
        }
        self.publish(ctx, communities.COMMUNITY_KEY, community)
        ctx.set_community(community)
        if round < max(p.warmup_rounds, 1) or round >= p.rounds:
            return {"anon_contributors": 0.0}  # warm-up (or nothing left to train)
        ctx.record_choice(chosen)
        state, contributors, attempts = await self.anonymized_peer(ctx, round, chosen, own)
        self.peer_state = state
        sims = [similarities[x] for x in contributors if x in similarities]
        return {
            "anon_contributors": float(len(contributors)),
            "anon_attempts": float(attempts),
            "community_similarity": float(sum(sims) / len(sims)) if sims else 0.0,
        }

    async def anonymized_peer(
        self, ctx: RoundContext, round: int, chosen: list[str], reference: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor] | None, list[str], int]:
        """(mean of the contributors' models, contributors, attempts): masked
        contributions summed here; a failed contributor is dropped and the rest
        asked again under a fresh request id while at least two remain."""
        contributors = sorted(set(chosen))
        attempts = 0
        while len(contributors) >= MIN_CONTRIBUTORS:
            attempts += 1
            request = AnonymizedPeerRequest(
                request_id=secrets.token_hex(16),
                contributors=contributors,
                round=round,
                max_round=round + self.params.max_staleness,
            )
            replies = await asyncio.gather(
                *(self.fetch_masked(ctx, peer, request, reference) for peer in contributors)
            )
            answered = [peer for peer, reply in zip(contributors, replies, strict=True) if reply]
            if len(answered) == len(contributors):
                try:
                    mean, _ = await ctx.train(
                        masking.unmask_mean, [r for r in replies if r], reference
                    )
                except masking.MaskingError as exc:
                    log.warning(
                        "%s round %d: anonymized peer unusable (%s)", ctx.me, round, exc.reason
                    )
                    return None, [], attempts
                problem = incompatibility(mean, reference)
                if problem is None:
                    return mean, contributors, attempts
                log.warning("%s round %d: anonymized peer rejected (%s)", ctx.me, round, problem)
                return None, [], attempts
            log.info(
                "%s round %d: %s did not contribute; retrying with %s",
                ctx.me,
                round,
                sorted(set(contributors) - set(answered)),
                answered,
            )
            contributors = answered
        return None, [], attempts

    async def fetch_masked(
        self,
        ctx: RoundContext,
        peer: str,
        request: AnonymizedPeerRequest,
        reference: dict[str, Tensor],
    ) -> dict[str, Tensor] | None:
        try:
            reply = await ctx.request(
                peer, ANON_KIND, request.model_dump(), self.params.round_timeout_s
            )
        except PeerUnavailable as exc:
            log.info("%s: no masked contribution from %s (%s)", ctx.me, peer, exc.reason)
            return None
        if not isinstance(reply, dict) or reply.get("request_id") != request.request_id:
            log.warning(
                "%s: malformed or refused anonymized contribution from %s: %r",
                ctx.me,
                peer,
                reply.get("refused") if isinstance(reply, dict) else type(reply),
            )
            return None
        masked = reply.get("masked")
        return masked if isinstance(masked, dict) else None

    # ------------------------------------------------------------------ contributor side

    def start_exchange(self, ctx: RoundContext) -> None:
        super().start_exchange(ctx)
        self.serve_anonymized_peer(ctx)

    def serve_anonymized_peer(self, ctx: RoundContext) -> None:
        """Answer the requests for masked contributions to an anonymized peer."""
        ctx.serve(ANON_KIND, functools.partial(self.serve_anonymized, ctx))

    def offer(self, ctx: RoundContext, site: Any, rnd: Round) -> None:
        super().offer(ctx, site, rnd)
        ctx.offered(ANON_KIND)

    async def serve_anonymized(
        self, ctx: RoundContext, requester: str, query: dict[str, Any]
    ) -> dict[str, Any]:
        """My masked contribution to `requester`'s anonymized peer, or
        {"refused": reason}. NotReady while my model of that round is not trained."""
        try:
            request = AnonymizedPeerRequest.model_validate(query)
        except ValidationError:
            return {"refused": "bad_request"}
        contributors = request.contributors
        group = frozenset(contributors)
        if len(group) != len(contributors) or len(group) < MIN_CONTRIBUTORS:
            return {"refused": "bad_contributors"}
        if ctx.me not in group:
            return {"refused": "not_a_contributor"}
        if requester in group:
            return {"refused": "requester_is_contributor"}  # it would hold a pair secret
        if not group <= set(ctx.roster()):
            return {"refused": "unknown_contributor"}
        if (requester, request.request_id) in self.answered_ids:
            return {"refused": "request_id_reused"}
        previous = self.answered_sets.get((requester, request.round))
        if previous is not None and not group < previous:
            return {"refused": "not_a_retry"}
        model = self.model_for(request.round, request.max_round)  # NotReady until trained
        if model is None:
            return {"refused": "too_new"}
        round, state = model
        # Record before the (off-loop) masking so a concurrent duplicate is refused too.
        self.answered_ids[(requester, request.request_id)] = request.round
        self.answered_sets[(requester, request.round)] = group
        self.forget_answers_before(request.round - self.params.max_staleness - 2)
        context = masking.request_context(requester, request.request_id, request.round)
        pair_secrets = {p: ctx.pair_secret(p, context) for p in contributors if p != ctx.me}
        masked = await ctx.train(
            functools.partial(
                masking.masked_contribution,
                state,
                me=ctx.me,
                contributors=contributors,
                secrets=pair_secrets,
            )
        )
        return {"request_id": request.request_id, "round": round, "masked": masked}

    def model_for(self, wanted: int, newest: int) -> tuple[int, dict[str, Tensor]] | None:
        """My trained model of round `wanted` (or a newer one up to `newest`)."""
        for r in sorted(self.served):
            if wanted <= r <= newest:
                return r, self.served[r]["state"]
        latest = max(self.served, default=-1)
        if latest < wanted:
            raise NotReady(f"round {wanted} not trained yet (latest {latest})")
        return None

    def forget_answers_before(self, round: int) -> None:
        self.answered_ids = {k: r for k, r in self.answered_ids.items() if r >= round}
        self.answered_sets = {k: s for k, s in self.answered_sets.items() if k[1] >= round}

    def record_neighbours(self, ctx: RoundContext, used: list[str]) -> None:
        """FedPerl records its community choices (journal Fig. 3) instead."""

    # ------------------------------------------------------------------ checkpoint

    def checkpoint_state(self, round: int, site: Any) -> dict[str, Any]:
        return {**super().checkpoint_state(round, site), "peer_state": self.peer_state}

    def load_extra(self, saved: dict[str, Any]) -> None:
        state = saved.get("peer_state")
        self.peer_state = state if isinstance(state, dict) else None


def round_sim(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)
