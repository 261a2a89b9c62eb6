"""Secure aggregation without a server, tolerant of dropouts, against a
requester that deviates (Bonawitz et al., CCS 2017, Fig. 4 with the active-
adversary checks of its Sec. 6; SecAgg+ by Bell et al., CCS 2020, keeps the
same rounds over a sparser graph).

In the paper a server collects masked inputs; here the node that wants the sum
(the requester R) plays the server for one request, and it is the only party
that learns the result: the weighted sum sum_u w_u x_u and the total weight
sum_u w_u of the contributors that stayed to the end, never an individual x_u.
R is not trusted: it relays every message between contributors and may tell
each one a different story. Contributors authenticate to each other with
k_uv^auth, a key only u and v derive from their roster X25519 keys and the
session context (the paper's signatures, as MACs only the pair can make).

The rounds, as the requester runs them (`secure_sum`) and each contributor
answers them (`Contributor`), one request per round:

  Round 0  AdvertiseKeys      R -> U : the session (id, contributors U, model rounds, purpose)
                              u -> R : two ephemeral X25519 public keys made for this session
                                       alone, c_u (sealing) and s_u (masking), and H(b_u), a
                                       commitment to its self-mask seed; one tag per other v:
                                       HMAC(k_uv^auth, c_u, s_u, H(b_u)). R cannot swap a key.
           (U1 = who answered)
  Round 1  ShareKeys          R -> u : every key of U1 with its owner's tag for u; u checks each
                              u -> R : for each v in U1 \\ {u}: v's Shamir shares (index 1..|U1|-1)
                                       of s_u's private key and of b_u, threshold t, sealed with
                                       ChaCha20-Poly1305 under HKDF(X25519(c_u, c_v), context,
                                       u>v) and a random nonce: a key new every session and gone
                                       with it (forward secrecy), never reused with a nonce;
                                       and, to R, a hash commitment to each share
           (U2 = who answered)
  Round 2  MaskedInputCollection
                              R -> u : U2 and the ciphertexts addressed to u
                              u -> R : y_u = fixed(w_u/W x_u) + PRG(b_u)
                                             + sum_{v in U2, u < v} PRG(s_uv)
                                             - sum_{v in U2, u > v} PRG(s_uv)      (mod 2^32)
                                       with s_uv = HKDF(X25519(s_u, s_v)); and for each v in
                                       U2 \\ {u} its view tag HMAC(k_uv^auth, "u2", t, U1, U2)
           (U3 = who answered; at least max(MIN_SUM, t + 1))
  Round 3  ConsistencyCheck   R -> u : U3 and the view tag every other member of U3 made for u
                              u -> R : only if each of them saw u's own t, U1 and U2: one tag per
                                       v in U3 \\ {u}, HMAC(k_uv^auth, "u3", t, U1, U2, U3); given once
           (U4 = who answered; at least t)
  Round 4  Unmasking          R -> u : U4 and the tags of every other member of U4
                              u -> R : only if every member of U4 vouched for u's own t, U1, U2 and
                                       U3: its shares of b_v for every v in U3 \\ {u} and of s_v
                                       for every v in U2 \\ U3; once per session
           R keeps the revealed shares that match their dealer's commitments (the index
           is the holder's place in U1, never the revealer's word), rebuilds each b_v
           (v in U3) and s_v (v in U2 \\ U3) from t of them, checks them against H(b_v)
           and the public s_v, and removes PRG(b_v) and the dropped contributors' pair
           masks:
             sum_{u in U3} y_u - sum_{u in U3} PRG(b_u) - sum_{d dropped, u in U3} +-PRG(s_ud)
             = sum_{u in U3} fixed(w_u/W x_u)                                     (mod 2^32)

Why R learns no individual input, even telling each contributor another story:
  To peel one input y_a R needs b_a and, for every partner v in the U2 that a
  masked with, s_a or s_v. (1) b_a and s_a both: b_a's shares come from
  holders told "a stayed", s_a's from holders told "a dropped"; an honest
  holder answers Unmasking once, for one view, so the honest ones of the two
  groups are disjoint among a's h = |U1_a| - 1 <= n - 1 holders, each group t
  strong; c holders colluding with R give shares for both, so R needs
  2t - c <= h. t > 2h/3 (Bonawitz et al., Sec. 6; every contributor refuses
  less, `least_threshold`) makes that c >= 2t - h, more than a third of the
  holders (`colluders_tolerated`). A majority, the bound of the first
  versions, left ONE colluding contributor enough in a sum of 4 (a review's
  attack, tests/test_secagg_collusion.py). (2) b_a and every s_v:
  a holder reveals b_a only if a is in its U3 and a's view tag says a masked
  with the holder's own U2. So all of a's partners v are in that U2, and at
  least one other member w of U3 is among them (|U3| >= 2); its input is in
  the sum, so R needs s_w from holders told "w dropped" and b_w's shares, by
  (1) impossible again. This is the hole the review found in the first version
  (each contributor checked only its own U2): the victim told "U2 = {a, b}",
  the others the full set and then "b dropped", gave R b_a and s_b, so a's
  input, masked with b alone, came out. (3) Two sums over the same model, or a
  session replayed: a contributor masks a model at most once per requester
  (the ledger), refuses a session id it has seen (`session_reused`), and every
  key of a session is new, so nothing of one session decrypts another (the
  first version derived the sealing keys from the roster keys and the session
  id R chose, with a zero nonce: a reused id reused the keystream).
  `bench/secagg_adversary.py` attacks all of this with real Contributors
  (tests/test_secagg_adversary.py).

Rules every contributor enforces (the requester is not trusted):
  - it is in U and R is not; U is at least MIN_SUM roster members;
  - a session id is answered once per round of the protocol, in order, and
    never opened twice (the last MAX_SEEN_SESSIONS ids per requester);
  - ONE MASKED INPUT PER (requester, model): once a contributor has masked a
    model for R, it refuses any other session of R over that model (its
    digest, whatever round it is served as, within the rounds it keeps). A contributor that drops out after masking is handled inside
    the session; one that drops out before anybody masked can be left out of
    a fresh session (`SecAggError.unmasked`);
  - t >= floor(2h/3) + 1 for the h = |U| - 1 other contributors of U (and >=
    its own configured `secagg_threshold`), and it deals shares only to at
    least t holders; so a sum survives h - t dropouts after masking (none in
    a sum of 4, one in a sum of 5 or 6);
  - |U2| and |U3| >= max(MIN_SUM, t + 1): a "sum" of one contribution is that
    model, and fewer could not be unmasked;
  - Consistency only with every other member of U3 vouching for its U1, U2, t;
    Unmasking only with every other member of U4 (at least t) vouching for the
    same U1, U2, U3 and t;
  - an asynchronous sum (purpose FRESHEST_PURPOSE, protocol.asynchronous; not
    in the paper, which has one round per sum): its latest model only, not
    more than its own staleness_bound behind R's round t (`at_round`, in the
    context), weighted by (t - tau + 1)^-a; a model already in one of R's sums
    is refused as `not_newer` (benign: R asks every round), and R's earlier
    asynchronous sessions it has not masked in end with R's new one.
Every message is checked against protocols/secagg_messages.py's schemas first;
Round 0's checks of the request, its model and the weight it is masked with are
protocols/secagg_admission.py's.

Arithmetic: fixed point (protocols/masking.py: scale 2^20, uint32 with
wraparound, int32 on the wire: the bytes of a float32 model), so every mask
cancels exactly. Weights are in the session's unit W (`weight_scale`, bound
into the context): a contributor caps its weight at W, raises it to W / 2^12
if lighter (up to its roster card: no W rounds a model out), and masks w/W and
w/W * x, every entry within (2^31 - 1) // n in fixed point at w/W = 1, n the
roster's other sites, or it refuses (`out_of_range`, before it deals a
share: one answer whatever W and |U|), so the sum of U3 never wraps.

Narrow rings: with protocol.compression fp16 / int8, the entries of 1,024
values or more (not the smaller ones, not the weight) are masked in a 16- /
8-bit ring instead (`ring` and `steps` of the request, bound into the
context; an int8 federation also answers 16-bit calibration sums): each
w/W * x in the requester's step, stochastically rounded, mod 2^16 / 2^8. That
sum does wrap; the requester decodes it against its own model
(protocols/masking.py `from_narrow`, docs/protocols.md). The masks cancel as
in the formulas above with 2^16 / 2^8 in place of 2^32, and nothing is
refused as out of range (a non-finite value still is).

Masks are ChaCha20 keystreams (`masking.mask_stream`); the tags, seeds,
Shamir shares, sealing, masked input and unmasking are
protocols/secagg_primitives.py's; a contributor's dealing of its shares and its
checks of the ones it holds are protocols/secagg_shares.py's. Dealing, masking,
combining and unmasking run off the event loop.

What this does not give: the requester cannot check any single contribution
(norm, finiteness) — contributors clip their own model and weight before
masking (`clip_state`), and the requester checks the mean it obtains. A
requester that colludes with all but one contributor learns the last one's
model, and t colluding holders rebuild a contributor's secrets; choose a
minimum of contributors accordingly (docs/threat-model.md). Without
wire.encryption an observer would see the revealed shares and masked inputs,
so configuration refuses secure aggregation without it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets as random_source
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from protocols.base import PeerUnavailable, RoundContext
from protocols.masking import RING_BITS
from protocols.secagg_admission import (
    check_contributors,
    check_model,
    check_terms,
    session_weight,
)
from protocols.secagg_ledger import ContributionLedger
from protocols.secagg_messages import (
    FRESHEST_PURPOSE,
    MAX_CONTRIBUTORS,
    MIN_SUM,
    MIN_WEIGHT_SHARE,
    SECAGG_KIND,
    ConsistencyBody,
    MaskBody,
    SessionRequest,
    ShareBody,
    UnmaskBody,
    parse,
    session_context,
    threshold_for,
)
from protocols.secagg_primitives import (
    SECRET_BYTES,
    SecAggError,
    auth_tag,
    clip_state,
    fits_ring,
    mask_seed,
    masked_input,
    seed_commitment,
    view_tag,
)
from protocols.secagg_requester import SecureSum, secure_sum, share_keys_body
from protocols.secagg_session import ModelSource, Session
from protocols.secagg_shares import deal_shares, open_shares

log = logging.getLogger(__name__)

__all__ = [
    "MAX_CONTRIBUTORS",
    "ModelSource",
    "MIN_SUM",
    "MIN_WEIGHT_SHARE",
    "SECAGG_KIND",
    "Contributor",
    "SecAggError",
    "SecureSum",
    "SessionRequest",
    "secure_sum",
    "session_context",
    "share_keys_body",
    "threshold_for",
]

# Refusals an honest requester meets too: I am past its round (too_new), or, in an
# asynchronous sum, my freshest model is already in one of its sums (not_newer).
BENIGN_REFUSALS = frozenset({"too_new", "not_newer", "too_stale", "no_weight"})
MAX_OPEN_SESSIONS = 16  # per requester: what a flood of Round 0 requests can make me hold
MAX_SEEN_SESSIONS = 4096  # per requester: session ids remembered so none is opened twice
PHASES = ("advertise", "share", "mask", "consistency", "unmask")


# ---------------------------------------------------------------------- contributor side


def masked_already(purpose: str, model_round: int) -> SecAggError:
    """The refusal of a model already in one of the requester's sums (the same
    model twice would let it subtract two sums): counted, but benign in an
    asynchronous sum, where an honest requester asks again every round."""
    reason = "not_newer" if purpose == FRESHEST_PURPOSE else "already_contributed"
    return SecAggError(reason, f"model of round {model_round}")


class Contributor:
    """Answers the four rounds for the requesters that ask this node.

    `ctx.pair_secret` gives the roster-derived pair keys; `source` the model to
    contribute; `min_threshold` is this node's `protocol.secagg_threshold`;
    `clip_norm` its `protocol.secagg_clip_norm`; `max_weight` the cap on its own
    weight (its roster card's max_samples) if any; `staleness_exponent` (a node
    with protocol.asynchronous) answers FRESHEST_PURPOSE sums: its freshest
    model not yet in one of the requester's sums, its weight times
    (t - tau + 1)^-a for the requester's round t (`at_round`); `ring` the
    ring of protocol.compression (32 bits for none, 16 for fp16, 8 for int8),
    federation-wide: a request for another is refused."""

    def __init__(
        self,
        ctx: RoundContext,
        source: ModelSource,
        *,
        min_threshold: int | None = None,
        min_sum: int = MIN_SUM,
        clip_norm: float | None = None,
        max_weight: float | None = None,
        keep_rounds: int = 3,
        ledger_path: Path | None = None,
        staleness_exponent: float | None = None,
        staleness_bound: int | None = None,
        ring: int = RING_BITS,
        kept: Callable[[], dict[int, dict[str, Any]]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.kept = kept  # round -> model, every model `source` may still give
        self.ring = ring  # protocol.compression's ring: 32, 16 (fp16) or 8 (int8) bits
        self.staleness_exponent = staleness_exponent
        self.staleness_bound = staleness_bound
        self.source = source
        self.min_threshold = min_threshold
        self.min_sum = max(MIN_SUM, int(min_sum))  # protocol.secagg_min_contributors
        self.clip_norm = clip_norm
        self.max_weight = max_weight
        self.keep_rounds = keep_rounds
        self.sessions: dict[tuple[str, str], Session] = {}
        self.seen: dict[str, OrderedDict[str, None]] = {}  # requester -> session ids opened
        # (requester, model round) -> the model masked for it; outlives a restart
        self.ledger = ContributionLedger(ledger_path, ctx.me)
        # id(model) -> (model, its clipping): one per kept model, for every session and
        # request in flight over it (one per session, or the last model's only, held 16)
        self.clips: OrderedDict[int, tuple[dict[str, Any], asyncio.Future[Any]]] = OrderedDict()

    async def serve(self, requester: str, query: dict[str, Any]) -> dict[str, Any]:
        """The `secagg` handler: the phase's answer or {"refused": reason}."""
        request = parse(SessionRequest, query)
        if request is None:
            self.ctx.reject(requester, "secagg_bad_request")
            return {"refused": "bad_request"}
        try:
            if request.phase == "advertise":
                return await self._advertise(requester, request)
            session = self.sessions.get((requester, request.session))
            if session is None:
                raise SecAggError("unknown_session")
            # every field as in Round 0 (a narrow ring's steps travel in Round 0 only:
            # they are bound into the session's context)
            if request.model_dump(exclude={"phase", "body", "steps"}) != session.request.model_dump(
                exclude={"phase", "body", "steps"}
            ) or request.steps not in (None, session.request.steps):
                raise SecAggError("session_mismatch")
            if request.phase == "share":
                return await self._share(session, request.body)
            if request.phase == "mask":
                return await self._mask(session, request.body)
            if request.phase == "consistency":
                return self._consistency(session, request.body)
            return self._unmask(session, request.body)
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
        group = check_contributors(request, requester, me, self.ctx.roster(), self.min_sum)
        if self.ledger.error is not None:
            raise SecAggError("ledger_unreadable", self.ledger.error)
        seen = self.seen.setdefault(requester, OrderedDict())
        if request.session in seen:
            raise SecAggError("session_reused", "a session id is never opened twice")
        asynchronous = self.staleness_exponent is not None and self.staleness_bound is not None
        check_terms(request, asynchronous=asynchronous, max_weight=self.max_weight, ring=self.ring)
        # NotReady (the request is held open) until that round is trained
        model = self.source(request.round, request.max_round, request.purpose)
        if model is None:
            raise SecAggError("too_new")
        model_round, state, weight = model
        check_model(request, model_round, state, self.staleness_bound)
        # Taken before the first await: a concurrent copy of this request is refused.
        seen[request.session] = None
        while len(seen) > MAX_SEEN_SESSIONS:
            seen.popitem(last=False)
        digest = await self.ledger.digest(model_round, state)
        if self.ledger.refuses(requester, model_round, digest):
            raise masked_already(request.purpose, model_round)
        weight = session_weight(
            request,
            model_round,
            weight,
            max_weight=self.max_weight,
            staleness_exponent=self.staleness_exponent,
        )
        clipped = await self._clipped(state)
        # Fits at full weight in the largest sum of this roster, or no sum: one answer
        # to every request. Against the request's w/W and size, a requester searching
        # W over these refusals read w x max|x| to five digits (a review, 2026-11-28).
        most = min(max(len(self.ctx.roster()) - 1, len(group)), MAX_CONTRIBUTORS)
        if not await asyncio.to_thread(fits_ring, clipped, 1.0, most, ring=request.ring):
            raise SecAggError("out_of_range", f"an entry of my model does not fit a sum of {most}")
        await self._forget_before(model_round - self.keep_rounds)
        if request.purpose == FRESHEST_PURPOSE:
            # A new asynchronous session from this requester supersedes its earlier
            # ones I have not masked in: it retries with other contributors when one
            # had nothing new, and those sessions would never end (nothing of mine is
            # in them; a masked one is kept to the end).
            self.sessions = {
                key: old
                for key, old in self.sessions.items()
                if not (
                    key[0] == requester
                    and old.request.purpose == FRESHEST_PURPOSE
                    and old.phase in ("advertise", "share")
                )
            }
        # counted and inserted with no await between: a flood cannot slip past it
        if sum(1 for r, _ in self.sessions if r == requester) >= MAX_OPEN_SESSIONS:
            raise SecAggError("too_many_sessions", f"{requester} has {MAX_OPEN_SESSIONS} open")
        context = session_context(requester, request)
        session = Session(
            requester=requester,
            request=request,
            context=context,
            model_round=model_round,
            digest=digest,
            state=clipped,
            weight=weight,
            c_private=X25519PrivateKey.generate(),
            s_private=X25519PrivateKey.generate(),
            self_seed=random_source.token_bytes(SECRET_BYTES),
        )
        self.sessions[(requester, request.session)] = session
        c_pk, s_pk = session.public(session.c_private), session.public(session.s_private)
        b_hash = seed_commitment(session.self_seed, context)
        tags = {
            v: auth_tag(self._pair_key(v, context), me, c_pk, s_pk, b_hash)
            for v in request.contributors
            if v != me
        }
        return {"c_pk": c_pk, "s_pk": s_pk, "b_hash": b_hash, "tags": tags}

    # Round 1: ShareKeys
    async def _share(self, session: Session, raw: dict[str, Any]) -> dict[str, Any]:
        me = self.ctx.me
        self._step(session, "advertise", "share")
        body = parse(ShareBody, raw)
        if body is None:
            raise SecAggError("bad_request", "share needs keys and a threshold")
        u1 = sorted(body.keys)
        if me not in body.keys or not set(u1) <= set(session.request.contributors):
            raise SecAggError("bad_contributors", f"U1 {u1}")
        mine = body.keys[me]
        if (mine.c_pk, mine.s_pk) != (
            session.public(session.c_private),
            session.public(session.s_private),
        ):
            raise SecAggError("bad_public_key", "my own key was replaced")
        holders = [v for v in u1 if v != me]
        least = threshold_for(len(session.request.contributors) - 1, self.min_threshold)
        if not least <= body.threshold <= len(holders):
            raise SecAggError(
                "bad_threshold",
                f"t={body.threshold} with {len(holders)} holders (t must be >= {least})",
            )
        for v in holders:
            entry = body.keys[v]
            expected = auth_tag(
                self._pair_key(v, session.context), v, entry.c_pk, entry.s_pk, entry.b_hash
            )
            if not hmac.compare_digest(entry.tag, expected):
                raise SecAggError("bad_key_tag", f"the key of {v} is not {v}'s")
            session.keys[v] = (entry.c_pk, entry.s_pk)
        session.u1, session.threshold = u1, body.threshold
        return await asyncio.to_thread(deal_shares, session, me, holders)

    # Round 2: MaskedInputCollection
    async def _mask(self, session: Session, raw: dict[str, Any]) -> dict[str, Any]:
        me = self.ctx.me
        self._step(session, "share", "mask")
        if self.ledger.refuses(session.requester, session.model_round, session.digest):
            raise masked_already(session.request.purpose, session.model_round)
        body = parse(MaskBody, raw)
        if body is None:
            raise SecAggError("bad_request", "mask needs U2 and the shares")
        u2 = sorted(set(body.u2))
        if (
            me not in u2
            or not set(u2) <= set(session.u1)
            or len(u2) < max(self.min_sum, session.threshold + 1)
        ):
            raise SecAggError("bad_contributors", f"U2 {u2}")
        open_shares(session, me, u2, body)
        session.u2 = u2
        # From here on this model is in one sum of this requester's, and in no other.
        self.ledger.record(session.requester, session.model_round, session.digest)
        pair_seeds = {
            v: mask_seed(session.s_private, session.keys[v][1], session.context, me, v)
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
            weight_scale=session.request.weight_scale,
            contributors=len(session.request.contributors),
            ring=session.request.ring,
            steps=session.request.steps,
        )
        session.state = {}  # masked: the plain model is not needed any more
        t = session.threshold
        views = {
            v: view_tag(self._pair_key(v, session.context), me, "u2", t, session.u1, u2)
            for v in u2
            if v != me
        }
        return {"masked": masked, "model_round": session.model_round, "view_tags": views}

    # Round 3: ConsistencyCheck
    def _consistency(self, session: Session, raw: dict[str, Any]) -> dict[str, Any]:
        me = self.ctx.me
        self._step(session, "mask", "consistency")  # once: I vouch for one U3 only
        body = parse(ConsistencyBody, raw)
        if body is None:
            raise SecAggError("bad_request", "consistency needs U3 and its members' views")
        u3 = sorted(set(body.u3))
        t, u1, u2 = session.threshold, session.u1, session.u2
        if me not in u3 or not set(u3) <= set(u2) or len(u3) < max(self.min_sum, t + 1):
            raise SecAggError("bad_contributors", f"U3 {u3}")
        for v in u3:
            if v == me:
                continue
            expected = view_tag(self._pair_key(v, session.context), v, "u2", t, u1, u2)
            if not hmac.compare_digest(body.view_tags.get(v, b""), expected):
                raise SecAggError("inconsistent", f"{v} did not mask with my U1, U2 and t")
        session.u3 = u3
        return {
            "tags": {
                v: view_tag(self._pair_key(v, session.context), me, "u3", t, u1, u2, u3)
                for v in u3
                if v != me
            }
        }

    # Round 4: Unmasking
    def _unmask(self, session: Session, raw: dict[str, Any]) -> dict[str, Any]:
        me = self.ctx.me
        self._step(session, "consistency", "unmask")  # once: never both shares for one contributor
        body = parse(UnmaskBody, raw)
        if body is None:
            raise SecAggError("bad_request", "unmask needs U4 and their tags")
        u4 = sorted(set(body.u4))
        t, u1, u2, u3 = session.threshold, session.u1, session.u2, session.u3
        if me not in u4 or not set(u4) <= set(u3) or len(u4) < t:
            raise SecAggError("bad_contributors", f"U4 {u4}")
        for v in u4:
            if v == me:
                continue
            expected = view_tag(self._pair_key(v, session.context), v, "u3", t, u1, u2, u3)
            if not hmac.compare_digest(body.tags.get(v, b""), expected):
                raise SecAggError("inconsistent", f"{v} did not vouch for my U1, U2, U3 and t")
        self_shares = {
            v: {"idx": session.held[v][0], "share": session.held[v][2]} for v in u3 if v != me
        }
        key_shares = {
            v: {"idx": session.held[v][0], "share": session.held[v][1]} for v in u2 if v not in u3
        }
        del self.sessions[(session.requester, session.request.session)]  # its keys with it
        return {"self_shares": self_shares, "key_shares": key_shares}

    # helpers
    def _step(self, session: Session, expected: str, phase: str) -> None:
        if session.phase != expected:
            raise SecAggError("out_of_order", f"{phase} after {session.phase}")
        session.phase = phase

    def _pair_key(self, peer: str, context: bytes) -> bytes:
        """k_uv^auth: only this node and `peer` can derive it (their roster keys)."""
        try:
            return self.ctx.pair_secret(peer, context + b"|auth")
        except PeerUnavailable:
            raise SecAggError("unknown_contributor", peer) from None

    async def _clipped(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` clipped once for all who ask (the last keep_rounds + 1 kept)."""
        key = id(state)
        hit = self.clips.get(key)
        if hit is None or hit[0] is not state:
            job = asyncio.ensure_future(asyncio.to_thread(clip_state, state, self.clip_norm))
            hit = self.clips[key] = (state, job)
            while len(self.clips) > self.keep_rounds + 1:
                self.clips.popitem(last=False)
        self.clips.move_to_end(key)
        try:
            return await asyncio.shield(hit[1])
        except Exception:
            if self.clips.get(key) is hit:  # not kept: the next request tries again
                del self.clips[key]
            raise

    async def _forget_before(self, round_no: int) -> None:
        kept = self.kept() if self.kept is not None else {}
        served = frozenset([await self.ledger.digest(r, state) for r, state in kept.items()])
        self.ledger.forget_before(round_no, served)
        self.sessions = {k: s for k, s in self.sessions.items() if s.model_round >= round_no}
