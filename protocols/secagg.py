"""Secure aggregation without a server, tolerant of dropouts (Bonawitz et al., CCS 2017, Fig. 4;
SecAgg+ by Bell et al., CCS 2020, keeps the same rounds over a sparser graph).

In the paper a server collects masked inputs; here the node that wants the sum
(the requester R) plays the server for one request, and it is the only party
that learns the result: the weighted sum sum_u w_u x_u and the total weight
sum_u w_u of the contributors that stayed to the end, never an individual x_u.

The paper's rounds, as the requester runs them (`secure_sum`) and each
contributor answers them (`Contributor`), one request per round:

  Round 0  AdvertiseKeys      R -> U : the session (id, contributors U, model round)
                              u -> R : an ephemeral X25519 public key pk_u (the paper's
                                       s_u^PK), with one tag per other contributor v:
                                       HMAC(k_uv^auth, pk_u), k_uv^auth derived from the
                                       roster's long-term X25519 keys of u and v. The tags
                                       replace the paper's signatures: R cannot swap a key.
           (U1 = who answered)
  Round 1  ShareKeys          R -> u : every pk_v of U1 with v's tag for u; u checks each tag
                              u -> R : for each v in U1 \\ {u}, ChaCha20-Poly1305 under
                                       k_uv^enc (also from the roster keys) of v's Shamir
                                       shares of sk_u (the mask key) and of b_u (the
                                       self-mask seed), threshold t
           (U2 = who answered)
  Round 2  MaskedInputCollection
                              R -> u : U2 and the ciphertexts addressed to u
                              u -> R : y_u = fixed(w_u x_u) + PRG(b_u)
                                             + sum_{v in U2, u < v} PRG(s_uv)
                                             - sum_{v in U2, u > v} PRG(s_uv)      (mod 2^64)
                                       where s_uv = HKDF(X25519(sk_u, pk_v)) = s_vu
           (U3 = who answered; at least MIN_SUM)
  Round 3  ConsistencyCheck   R -> u : U3
                              u -> R : one tag per v in U3 \\ {u}: HMAC(k_uv^auth, U3), its
                                       word to v that U3 is the set it was told (the paper's
                                       signature on U3); a contributor gives it once
           (U4 = who answered; at least t)
  Round 4  Unmasking          R -> u : U4 and the tags of every other member of U4
                              u -> R : after checking that every member of U4 vouched for
                                       the same U3: its shares of b_v for every v in U3 \\ {u}
                                       and of sk_v for every v in U2 \\ U3 — never both for
                                       one v: it answers Unmasking once per session
           R reconstructs each b_v (v in U3) and sk_v (v in U2 \\ U3) from t shares and
           removes PRG(b_v) and the dropped contributors' pair masks:
             sum_{u in U3} y_u - sum_{u in U3} PRG(b_u) - sum_{d dropped, u in U3} +-PRG(s_ud)
             = sum_{u in U3} fixed(w_u x_u)                                       (mod 2^64)
  Why both are safe against a requester that lies about who dropped: getting
  x_v needs b_v's shares from t contributors told "v stayed" and the mask keys
  of v's partners from t contributors told "they dropped". Honest contributors
  vouch for one U3 only (Round 3), so the two groups are disjoint, and each
  needs t + 1 or t members among the n = |U| contributors: with t a majority of
  the other n - 1 (the least t this code accepts), 2t + 1 > n.

Rules every contributor enforces (the requester is not trusted):
  - it is in U and R is not; U is at least MIN_SUM roster members;
  - a session id is answered once per round of the protocol, in order;
  - ONE MASKED INPUT PER (requester, model version): once a contributor has
    masked its model of round m for R, it refuses any other session of R over
    that model, so R can never obtain two sums over different subsets of the
    same models (the subset-difference attack). A contributor that drops out
    after masking is handled inside the session; one that drops out before
    anybody masked can be left out of a fresh session (`SecAggError.unmasked`);
  - t >= a majority of the other contributors of U (and >= its own configured
    `secagg_threshold`), and it deals shares only to at least t holders;
  - Round 3 needs |U3| >= max(MIN_SUM, t + 1): a "sum" of one contribution is
    that model, and fewer could not be unmasked;
  - Unmasking only with every other member of U4 (at least t) vouching for U3.

Arithmetic: fixed point (protocols/masking.py: scale 2^20, uint64 with
wraparound), so every mask cancels exactly. Masks are ChaCha20 keystreams
(`masking.mask_stream`); the tags, seeds, Shamir shares, sealing, masked
input and unmasking are protocols/secagg_primitives.py's.

What this does not give: the requester cannot check any single contribution
(norm, finiteness) — contributors clip their own model and weight before
masking (`clip_state`), and the requester checks the mean it obtains. A
requester that colludes with all but one contributor learns the last one's
model; choose a minimum of contributors accordingly (docs/threat-model.md).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets as random_source
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor

from p2pfl.learning.state import averaged_keys
from p2pfl.secure import tensors
from protocols.base import PeerUnavailable, RoundContext
from protocols.masking import WEIGHT_KEY
from protocols.secagg_primitives import (
    SECRET_BYTES,
    SecAggError,
    auth_tag,
    clip_state,
    combine_shares,
    consistency_tag,
    mask_seed,
    masked_input,
    seal,
    share_secret,
    unmask_sum,
    unseal,
)

log = logging.getLogger(__name__)

SECAGG_KIND = "secagg"
MIN_SUM = 2  # a sum over fewer contributions is an individual model
MAX_CONTRIBUTORS = 64
# Refusals an honest requester meets too (I am past its round): not counted against it.
BENIGN_REFUSALS = frozenset({"too_new"})
MAX_OPEN_SESSIONS = 16  # per requester: what a flood of Round 0 requests can make me hold
PHASES = ("advertise", "share", "mask", "consistency", "unmask")


# ---------------------------------------------------------------------- the session


class SessionRequest(BaseModel):
    """What every phase's query carries; validated at the edge."""

    model_config = ConfigDict(extra="forbid")

    session: str = Field(pattern=r"^[0-9a-f]{32}$")
    phase: str
    contributors: list[str] = Field(min_length=MIN_SUM, max_length=MAX_CONTRIBUTORS)
    round: int = Field(ge=0)
    max_round: int = Field(ge=0)
    purpose: str = Field(pattern=r"^[a-z_]{1,32}$")
    body: dict[str, Any] = Field(default_factory=dict)


def session_context(requester: str, request: SessionRequest) -> bytes:
    """What binds every key of one session: the requester, the session id, the
    contributors U, the model rounds and the purpose. Fresh per session, so no
    two sessions share a key, a mask or a share."""
    return "|".join(
        (
            "p2pfl-secagg-v1",
            requester,
            request.session,
            ",".join(sorted(request.contributors)),
            str(request.round),
            str(request.max_round),
            request.purpose,
        )
    ).encode()


def majority(others: int) -> int:
    """The least threshold t over `others` share holders such that two disjoint
    groups of t holders cannot exist: floor(others / 2) + 1 (at least 1)."""
    return max(1, others // 2 + 1)


def threshold_for(holders: int, configured: int | None) -> int:
    """t for `holders` other contributors: a majority, or the configured t if
    higher, never more than there are holders."""
    return min(holders, max(majority(holders), configured or 0))


# ---------------------------------------------------------------------- contributor side

# (round, state, weight) of the model a contributor gives for rounds [wanted, newest]
# to a sum of the given purpose; raises NotReady while not trained yet, returns
# None if it only has newer ones.
ModelSource = Callable[[int, int, str], tuple[int, dict[str, Tensor], float] | None]


@dataclass
class _Session:
    requester: str
    request: SessionRequest
    context: bytes
    model_round: int
    state: dict[str, Tensor]
    weight: float
    private: X25519PrivateKey
    public: bytes
    self_seed: bytes
    phase: str = "advertise"  # the last phase answered
    u1: list[str] = field(default_factory=list)
    u2: list[str] = field(default_factory=list)
    u3: list[str] = field(default_factory=list)
    public_keys: dict[str, bytes] = field(default_factory=dict)
    threshold: int = 0
    held: dict[str, tuple[int, bytes, bytes]] = field(default_factory=dict)  # v -> (idx, sk, b)


class Contributor:
    """Answers the four rounds for the requesters that ask this node.

    `ctx.pair_secret` gives the roster-derived pair keys; `source` the model to
    contribute; `min_threshold` is this node's `protocol.secagg_threshold`;
    `clip_norm` its `protocol.secagg_clip_norm`; `max_weight` the cap on its own
    weight (its roster card's max_samples) if any."""

    def __init__(
        self,
        ctx: RoundContext,
        source: ModelSource,
        *,
        min_threshold: int | None = None,
        clip_norm: float | None = None,
        max_weight: float | None = None,
        keep_rounds: int = 3,
    ) -> None:
        self.ctx = ctx
        self.source = source
        self.min_threshold = min_threshold
        self.clip_norm = clip_norm
        self.max_weight = max_weight
        self.keep_rounds = keep_rounds
        self.sessions: dict[tuple[str, str], _Session] = {}
        self.contributed: dict[tuple[str, int], str] = {}  # (requester, model round) -> session

    async def serve(self, requester: str, query: dict[str, Any]) -> dict[str, Any]:
        """The `secagg` handler: the phase's answer or {"refused": reason}."""
        try:
            request = SessionRequest.model_validate(query)
        except ValidationError:
            self.ctx.reject(requester, "secagg_bad_request")
            return {"refused": "bad_request"}
        try:
            if request.phase == "advertise":
                return await self._advertise(requester, request)
            session = self.sessions.get((requester, request.session))
            if session is None:
                return {"refused": "unknown_session"}
            if request.model_dump(exclude={"phase", "body"}) != session.request.model_dump(
                exclude={"phase", "body"}
            ):
                return {"refused": "session_mismatch"}
            if request.phase == "share":
                return self._share(session, request.body)
            if request.phase == "mask":
                return await self._mask(session, request.body)
            if request.phase == "consistency":
                return self._consistency(session, request.body)
            if request.phase == "unmask":
                return self._unmask(session, request.body)
            return {"refused": "bad_phase"}
        except SecAggError as exc:
            log.info(
                "%s: secagg %s from %s refused: %s", self.ctx.me, request.phase, requester, exc
            )
            if exc.reason not in BENIGN_REFUSALS:
                self.ctx.reject(requester, f"secagg_{exc.reason}")  # counted like any refusal
            return {"refused": exc.reason}

    # Round 0: AdvertiseKeys
    async def _advertise(self, requester: str, request: SessionRequest) -> dict[str, Any]:
        me = self.ctx.me
        group = set(request.contributors)
        if len(group) != len(request.contributors):
            raise SecAggError("bad_contributors", "a contributor is listed twice")
        if me not in group:
            raise SecAggError("not_a_contributor")
        if requester in group:
            raise SecAggError("requester_is_contributor")
        if not group <= set(self.ctx.roster()):
            raise SecAggError("unknown_contributor")
        if (requester, request.session) in self.sessions:
            raise SecAggError("session_reused")
        if sum(1 for r, _ in self.sessions if r == requester) >= MAX_OPEN_SESSIONS:
            raise SecAggError("too_many_sessions", f"{requester} has {MAX_OPEN_SESSIONS} open")
        if request.max_round < request.round:
            raise SecAggError("bad_request", "max_round < round")
        # NotReady (the request is held open) until that round is trained
        model = self.source(request.round, request.max_round, request.purpose)
        if model is None:
            raise SecAggError("too_new")
        model_round, state, weight = model
        if (requester, model_round) in self.contributed:
            # The same model to the same requester twice would let it subtract two sums.
            raise SecAggError("already_contributed", f"model of round {model_round}")
        self._forget_before(model_round - self.keep_rounds)
        if self.max_weight is not None:
            weight = min(weight, self.max_weight)
        private = X25519PrivateKey.generate()
        public = private.public_key().public_bytes_raw()
        context = session_context(requester, request)
        session = _Session(
            requester=requester,
            request=request,
            context=context,
            model_round=model_round,
            state=clip_state(state, self.clip_norm),
            weight=float(weight),
            private=private,
            public=public,
            self_seed=random_source.token_bytes(SECRET_BYTES),
        )
        self.sessions[(requester, request.session)] = session
        tags = {
            v: auth_tag(self._pair_key(v, context, b"auth"), me, public)
            for v in request.contributors
            if v != me
        }
        return {"pk": public, "tags": tags}

    # Round 1: ShareKeys
    def _share(self, session: _Session, body: dict[str, Any]) -> dict[str, Any]:
        me = self.ctx.me
        self._step(session, "advertise", "share")
        keys = body.get("keys")
        threshold = body.get("threshold")
        if (
            not isinstance(keys, dict)
            or not isinstance(threshold, int)
            or not all(isinstance(k, dict) for k in keys.values())
        ):
            raise SecAggError("bad_request", "share needs keys and a threshold")
        u1 = sorted(keys)
        if me not in keys or not set(u1) <= set(session.request.contributors) or len(u1) < MIN_SUM:
            raise SecAggError("bad_contributors", f"U1 {u1}")
        if keys[me].get("pk") != session.public:
            raise SecAggError("bad_public_key", "my own key was replaced")
        holders = len(u1) - 1
        least = threshold_for(len(session.request.contributors) - 1, self.min_threshold)
        if not least <= threshold <= holders:
            raise SecAggError(
                "bad_threshold", f"t={threshold} with {holders} holders (t must be >= {least})"
            )
        for v in u1:
            if v == me:
                continue
            entry = keys[v]
            pk, tag = entry.get("pk"), entry.get("tag")
            if not isinstance(pk, bytes) or len(pk) != 32 or not isinstance(tag, bytes):
                raise SecAggError("bad_public_key", f"from {v}")
            expected = auth_tag(self._pair_key(v, session.context, b"auth"), v, pk)
            if not hmac.compare_digest(tag, expected):
                raise SecAggError("bad_key_tag", f"the key of {v} is not {v}'s")
            session.public_keys[v] = pk
        session.u1, session.threshold = u1, threshold
        holders_list = [v for v in u1 if v != me]
        sk_shares = share_secret(session.private.private_bytes_raw(), threshold, holders)
        b_shares = share_secret(session.self_seed, threshold, holders)
        sealed: dict[str, bytes] = {}
        for v, (idx, sk_share), (_, b_share) in zip(holders_list, sk_shares, b_shares, strict=True):
            plain = tensors.dumps({"from": me, "to": v, "idx": idx, "sk": sk_share, "b": b_share})
            key = self._pair_key(v, session.context, b"enc|" + me.encode() + b">" + v.encode())
            sealed[v] = seal(key, plain, session.context)
        return {"shares": sealed}

    # Round 2: MaskedInputCollection
    async def _mask(self, session: _Session, body: dict[str, Any]) -> dict[str, Any]:
        me = self.ctx.me
        self._step(session, "share", "mask")
        ledger = (session.requester, session.model_round)
        if ledger in self.contributed:
            raise SecAggError("already_contributed", f"model of round {session.model_round}")
        u2, sealed = body.get("u2"), body.get("shares")
        if not isinstance(u2, list) or not isinstance(sealed, dict):
            raise SecAggError("bad_request", "mask needs U2 and the shares")
        u2 = sorted(set(u2))
        if me not in u2 or not set(u2) <= set(session.u1) or len(u2) < MIN_SUM:
            raise SecAggError("bad_contributors", f"U2 {u2}")
        for v in u2:
            if v == me:
                continue
            ciphertext = sealed.get(v)
            if not isinstance(ciphertext, bytes):
                raise SecAggError("bad_share", f"no share from {v}")
            key = self._pair_key(v, session.context, b"enc|" + v.encode() + b">" + me.encode())
            try:
                share = tensors.decode(unseal(key, ciphertext, session.context))
            except tensors.CodecError:
                raise SecAggError("bad_share", f"share from {v} undecodable") from None
            if (
                not isinstance(share, dict)
                or share.get("from") != v
                or share.get("to") != me
                or not isinstance(share.get("idx"), int)
                or not isinstance(share.get("sk"), bytes)
                or not isinstance(share.get("b"), bytes)
            ):
                raise SecAggError("bad_share", f"share from {v} malformed")
            session.held[v] = (share["idx"], share["sk"], share["b"])
        session.u2 = u2
        # From here on this model is in one sum of this requester's, and in no other.
        self.contributed[ledger] = session.request.session
        pair_seeds = {
            v: mask_seed(session.private, session.public_keys[v], session.context, me, v)
            for v in u2
            if v != me
        }
        masked = await asyncio.to_thread(
            masked_input,
            session.state,
            session.weight,
            me=me,
            self_seed=session.self_seed,
            pair_seeds=pair_seeds,
        )
        session.state = {}  # masked: the plain model is not needed any more
        return {"masked": masked, "model_round": session.model_round}

    # Round 3: ConsistencyCheck
    def _consistency(self, session: _Session, body: dict[str, Any]) -> dict[str, Any]:
        me = self.ctx.me
        self._step(session, "mask", "consistency")  # once: I vouch for one U3 only
        u3 = body.get("u3")
        if not isinstance(u3, list) or not all(isinstance(v, str) for v in u3):
            raise SecAggError("bad_request", "consistency needs U3")
        u3 = sorted(set(u3))
        if (
            me not in u3
            or not set(u3) <= set(session.u2)
            or len(u3) < max(MIN_SUM, session.threshold + 1)
        ):
            raise SecAggError("bad_contributors", f"U3 {u3}")
        session.u3 = u3
        return {
            "tags": {
                v: consistency_tag(self._pair_key(v, session.context, b"auth"), me, u3)
                for v in u3
                if v != me
            }
        }

    # Round 4: Unmasking
    def _unmask(self, session: _Session, body: dict[str, Any]) -> dict[str, Any]:
        me = self.ctx.me
        self._step(session, "consistency", "unmask")  # once: never both shares for one contributor
        u4, tags = body.get("u4"), body.get("tags")
        if not isinstance(u4, list) or not isinstance(tags, dict):
            raise SecAggError("bad_request", "unmask needs U4 and their tags")
        u4 = sorted(set(u4))
        u3 = session.u3
        if me not in u4 or not set(u4) <= set(u3) or len(u4) < session.threshold:
            raise SecAggError("bad_contributors", f"U4 {u4}")
        for v in u4:
            if v == me:
                continue
            tag = tags.get(v)
            expected = consistency_tag(self._pair_key(v, session.context, b"auth"), v, u3)
            if not isinstance(tag, bytes) or not hmac.compare_digest(tag, expected):
                raise SecAggError("inconsistent", f"{v} did not vouch for U3 {u3}")
        self_shares = {
            v: {"idx": session.held[v][0], "share": session.held[v][2]} for v in u3 if v != me
        }
        key_shares = {
            v: {"idx": session.held[v][0], "share": session.held[v][1]}
            for v in session.u2
            if v not in u3
        }
        del self.sessions[(session.requester, session.request.session)]
        return {"self_shares": self_shares, "key_shares": key_shares}

    # helpers
    def _step(self, session: _Session, expected: str, phase: str) -> None:
        if session.phase != expected:
            raise SecAggError("out_of_order", f"{phase} after {session.phase}")
        session.phase = phase

    def _pair_key(self, peer: str, context: bytes, label: bytes) -> bytes:
        try:
            return self.ctx.pair_secret(peer, context + b"|" + label)
        except PeerUnavailable:
            raise SecAggError("unknown_contributor", peer) from None

    def _forget_before(self, round: int) -> None:
        self.contributed = {k: s for k, s in self.contributed.items() if k[1] >= round}
        self.sessions = {k: s for k, s in self.sessions.items() if s.model_round >= round}


# ---------------------------------------------------------------------- requester side


@dataclass
class SecureSum:
    """What a requester obtains: the weighted mean of the contributors in U3,
    their total weight, who they are and the rounds of their models."""

    mean: dict[str, Tensor]
    total_weight: float
    contributors: list[str]
    rounds: dict[str, int]
    dropped: list[str]  # masked in Round 2 by U2 but gone before their input arrived
    nbytes: int = 0


async def secure_sum(
    ctx: RoundContext,
    contributors: Sequence[str],
    *,
    round: int,
    max_round: int,
    reference: Mapping[str, Tensor],
    timeout: float,
    purpose: str = "model",
    threshold: int | None = None,
) -> SecureSum:
    """Run the four rounds with `contributors` as U and return the sum of
    U3's weighted models (as a weighted mean and its total weight). Raises
    SecAggError when too few stay for a sum (reason `too_few`) or a share set
    is short (`too_few_shares`)."""
    me = ctx.me
    u = sorted(set(contributors))
    if len(u) < MIN_SUM:
        raise SecAggError("too_few", f"{len(u)} contributors")
    base = {
        "session": random_source.token_hex(16),
        "contributors": u,
        "round": round,
        "max_round": max_round,
        "purpose": purpose,
    }

    async def ask(peer: str, phase: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            reply = await ctx.request(
                peer, SECAGG_KIND, {**base, "phase": phase, "body": body}, timeout
            )
        except PeerUnavailable as exc:
            log.info("%s: secagg %s: no answer from %s (%s)", me, phase, peer, exc.reason)
            return None
        if not isinstance(reply, dict) or "refused" in reply:
            reason = reply.get("refused") if isinstance(reply, dict) else "malformed"
            log.warning("%s: secagg %s refused by %s: %s", me, phase, peer, reason)
            return None
        return reply

    async def everyone(
        peers: list[str], phase: str, body: Callable[[str], dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        replies = await asyncio.gather(*(ask(p, phase, body(p)) for p in peers))
        return {p: r for p, r in zip(peers, replies, strict=True) if r is not None}

    # Round 0: AdvertiseKeys
    advertised = await everyone(u, "advertise", lambda p: {})
    keys: dict[str, dict[str, Any]] = {}
    for peer, reply in advertised.items():
        pk, tags = reply.get("pk"), reply.get("tags")
        if isinstance(pk, bytes) and len(pk) == 32 and isinstance(tags, dict):
            keys[peer] = {"pk": pk, "tags": tags}
        else:
            ctx.reject(peer, "secagg_malformed")
    u1 = sorted(keys)
    t = threshold_for(len(u) - 1, threshold)
    if len(u1) < max(MIN_SUM, t + 1):
        raise SecAggError("too_few", f"{len(u1)} of {len(u)} advertised keys (t={t})", unmasked=u1)

    # Round 1: ShareKeys
    shared = await everyone(u1, "share", lambda peer: share_keys_body(keys, u1, t, peer))
    ciphertexts = bytes_for_the_others(shared, "shares", u1)
    for peer in set(shared) - set(ciphertexts):
        ctx.reject(peer, "secagg_malformed")
    u2 = sorted(ciphertexts)
    if len(u2) < max(MIN_SUM, t + 1):
        raise SecAggError(
            "too_few", f"{len(u2)} of {len(u1)} shared their keys (t={t})", unmasked=u2
        )

    # Round 2: MaskedInputCollection
    masked_replies = await everyone(
        u2, "mask", lambda p: {"u2": u2, "shares": {v: ciphertexts[v][p] for v in u2 if v != p}}
    )
    expected = {k: tuple(reference[k].shape) for k in averaged_keys(reference)}
    expected[WEIGHT_KEY] = (1,)
    inputs: dict[str, dict[str, Tensor]] = {}
    rounds: dict[str, int] = {}
    for peer, reply in masked_replies.items():
        masked, model_round = reply.get("masked"), reply.get("model_round")
        if (
            isinstance(masked, dict)
            and set(masked) == set(expected)
            and all(
                isinstance(masked[k], Tensor)
                and masked[k].dtype == torch.int64
                and tuple(masked[k].shape) == shape
                for k, shape in expected.items()
            )
            and isinstance(model_round, int)
            and round <= model_round <= max_round
        ):
            inputs[peer] = masked
            rounds[peer] = model_round
        else:
            ctx.reject(peer, "secagg_malformed")
    u3 = sorted(inputs)
    if len(u3) < max(MIN_SUM, t + 1):
        raise SecAggError("too_few", f"{len(u3)} of {len(u2)} masked inputs (t={t})")
    dropped = [v for v in u2 if v not in inputs]

    # Round 3: ConsistencyCheck
    vouched = await everyone(u3, "consistency", lambda p: {"u3": u3})
    consistency = bytes_for_the_others(vouched, "tags", u3)
    u4 = sorted(consistency)
    if len(u4) < t:
        raise SecAggError("too_few", f"{len(u4)} of {len(u3)} vouched for U3 (t={t})")

    # Round 4: Unmasking
    revealed = await everyone(
        u4, "unmask", lambda p: {"u4": u4, "tags": {v: consistency[v][p] for v in u4 if v != p}}
    )
    self_shares: dict[str, list[tuple[int, bytes]]] = {v: [] for v in u3}
    key_shares: dict[str, list[tuple[int, bytes]]] = {v: [] for v in dropped}
    for peer, reply in revealed.items():
        for name, bucket, wanted in (
            ("self_shares", self_shares, [v for v in u3 if v != peer]),
            ("key_shares", key_shares, dropped),
        ):
            given = reply.get(name)
            if not isinstance(given, dict):
                continue
            for v in wanted:
                item = given.get(v)
                if (
                    isinstance(item, dict)
                    and isinstance(item.get("idx"), int)
                    and isinstance(item.get("share"), bytes)
                ):
                    bucket[v].append((item["idx"], item["share"]))
    short = [v for bucket in (self_shares, key_shares) for v, s in bucket.items() if len(s) < t]
    if short:
        raise SecAggError("too_few_shares", f"fewer than t={t} shares for {short}")
    mean, total = await ctx.train(
        unmask_sum,
        inputs,
        {v: combine_shares(s[:t]) for v, s in self_shares.items()},
        {v: combine_shares(s[:t]) for v, s in key_shares.items()},
        {v: keys[v]["pk"] for v in u1},
        session_context(me, SessionRequest(**base, phase="unmask")),
        reference,
    )
    return SecureSum(mean, total, u3, rounds, dropped)


def bytes_for_the_others(
    replies: Mapping[str, Mapping[str, Any]], name: str, members: Sequence[str]
) -> dict[str, dict[str, bytes]]:
    """The replies whose `name` maps every other member to bytes (the sealed
    shares of Round 1, the tags of Round 3), by who sent them."""
    out: dict[str, dict[str, bytes]] = {}
    for peer, reply in replies.items():
        given = reply.get(name)
        if isinstance(given, dict) and all(
            isinstance(given.get(v), bytes) for v in members if v != peer
        ):
            out[peer] = given
    return out


def share_keys_body(
    keys: Mapping[str, Mapping[str, Any]], u1: Sequence[str], threshold: int, peer: str
) -> dict[str, Any]:
    """Round 1's query to `peer`: the threshold and every key of U1 with the
    tag its owner made for `peer` (from the Round 0 answers `keys`)."""
    return {
        "threshold": threshold,
        "keys": {
            v: {"pk": keys[v]["pk"], "tag": b"" if v == peer else keys[v]["tags"].get(peer, b"")}
            for v in u1
        },
    }
