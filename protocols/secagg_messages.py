"""The messages of secure aggregation (protocols/secagg.py), as pydantic schemas
with finite bounds: every field a requester or contributor receives is checked
here before any of it is used (types strict, sizes and numbers bounded), so a
malformed message is one refusal with a reason, never an exception deeper in.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from p2pfl.config.secagg_guarantees import secagg_least_threshold
from p2pfl.config.secagg_ring import SECAGG_MAX_CONTRIBUTORS, SECAGG_MIN_SUM, SECAGG_RING_BITS

SECAGG_KIND = "secagg"
MIN_SUM = SECAGG_MIN_SUM  # a sum over fewer contributions is an individual model
MAX_CONTRIBUTORS = SECAGG_MAX_CONTRIBUTORS  # what check's ring bound counts with too
MAX_WEIGHT_SCALE = 2.0**40
# The least w/W a contributor masks (2^8 of the ring's 2^20 units): a lighter
# weight is raised to it (up to its roster card), so that no W, however large,
# rounds a card-less contributor's model out of a sum; one whose card keeps it
# under the floor refuses such a W instead (`weight_scale_too_large`), or the
# card-less would stay in a sum that rounds it out (a review's attack).
MIN_WEIGHT_SHARE = 2.0**-12
# The purpose of an asynchronous sum (protocol.asynchronous): each contributor
# masks its freshest model not yet in one of the requester's sums, weighted by
# its staleness against the requester's round `at_round` (protocols/secagg.py).
FRESHEST_PURPOSE = "freshest"
KEY_BYTES = 32
TAG_BYTES = 32

Name = Annotated[str, Field(min_length=1, max_length=128)]
EntryName = Annotated[str, Field(min_length=1, max_length=1024)]  # a state-dict key
Step = Annotated[float, Field(ge=2.0**-64, le=2.0**64, allow_inf_nan=False)]
MAX_STEPS = 16384  # state-dict entries one narrow-ring session may name
Key = Annotated[bytes, Field(min_length=KEY_BYTES, max_length=KEY_BYTES)]
Tag = Annotated[bytes, Field(max_length=TAG_BYTES)]  # b"" where a member has none for itself
Members = Annotated[list[Name], Field(min_length=1, max_length=MAX_CONTRIBUTORS)]
Sealed = Annotated[bytes, Field(max_length=1024)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SessionRequest(BaseModel):
    """What every phase's query carries; validated at the edge."""

    model_config = ConfigDict(extra="forbid", strict=True)

    session: str = Field(pattern=r"^[0-9a-f]{32}$")
    phase: str = Field(pattern=r"^(advertise|share|mask|consistency|unmask)$")
    contributors: list[Name] = Field(min_length=MIN_SUM, max_length=MAX_CONTRIBUTORS)
    round: int = Field(ge=0, le=2**31)
    max_round: int = Field(ge=0, le=2**31)
    purpose: str = Field(pattern=r"^[a-z_.]{1,64}$")
    # W, the session's weight unit: each contributor masks w/W (w capped at W)
    # as its weight and w/W * x as its model, so every weight is at most 1 in
    # the ring. One W per session (it is in the context every key is bound to).
    weight_scale: float = Field(1.0, gt=0, le=MAX_WEIGHT_SCALE, allow_inf_nan=False)
    # FRESHEST_PURPOSE only: the requester's round t, against which each
    # contributor weighs its model of round tau by (t - tau + 1)^-a
    at_round: int | None = Field(None, ge=0, le=2**31)
    # The ring the contributors mask in: 32 bits (fixed point), or 16 / 8 bits
    # for protocol.compression fp16 / int8, where each averaged entry is a count
    # of its quantization step in `steps` (the requester's, one per entry; in
    # the context, so every contributor quantizes alike or their tags fail)
    ring: int = Field(SECAGG_RING_BITS, ge=8, le=32, multiple_of=8)
    steps: dict[EntryName, Step] | None = Field(None, max_length=MAX_STEPS)
    body: dict[str, Any] = Field(default_factory=dict)


class KeyEntry(_Strict):
    """One contributor's Round 0 keys as relayed to another: the ephemeral
    encryption key c_pk, mask key s_pk, the commitment to its self-mask seed,
    and its tag for the receiver (HMAC under their roster pair key)."""

    c_pk: Key
    s_pk: Key
    b_hash: Key
    tag: Tag


class Advertised(_Strict):
    c_pk: Key
    s_pk: Key
    b_hash: Key
    tags: dict[Name, Tag] = Field(max_length=MAX_CONTRIBUTORS)


class ShareBody(_Strict):
    keys: dict[Name, KeyEntry] = Field(min_length=MIN_SUM, max_length=MAX_CONTRIBUTORS)
    threshold: int = Field(ge=1, le=MAX_CONTRIBUTORS)


class Committed(_Strict):
    """A dealer's commitments to the two shares it sealed for one holder."""

    sk: Key
    b: Key


class LedgerRow(_Strict):
    """One row of a contributor's ledger file: it masked the model of
    `round` (whose digest is `model`) into a sum for `requester`."""

    requester: Name
    round: int = Field(ge=0, le=2**31)
    model: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    # True: `model` is the digest of the summed entries only (since 2026-11-28);
    # absent in a ledger written before, whose digests covered every entry
    summed: bool = False


class Shared(_Strict):
    shares: dict[Name, Sealed] = Field(max_length=MAX_CONTRIBUTORS)
    commitments: dict[Name, Committed] = Field(max_length=MAX_CONTRIBUTORS)


class MaskBody(_Strict):
    u2: Members
    shares: dict[Name, Sealed] = Field(max_length=MAX_CONTRIBUTORS)
    # what each dealer committed to for the shares it sealed for me (Round 1)
    commitments: dict[Name, Committed] = Field(default_factory=dict, max_length=MAX_CONTRIBUTORS)


class ConsistencyBody(_Strict):
    u3: Members
    view_tags: dict[Name, Tag] = Field(default_factory=dict, max_length=MAX_CONTRIBUTORS)


class Vouched(_Strict):
    tags: dict[Name, Tag] = Field(max_length=MAX_CONTRIBUTORS)


class UnmaskBody(_Strict):
    u4: Members
    tags: dict[Name, Tag] = Field(max_length=MAX_CONTRIBUTORS)


class Share(_Strict):
    """A Shamir share as a holder keeps or reveals it: index 1..n, 32 bytes."""

    idx: int = Field(ge=1, le=MAX_CONTRIBUTORS)
    share: Key


class SealedShare(_Strict):
    """The plaintext of one sealed share, dealer to holder."""

    sender: Name = Field(alias="from")
    to: Name
    idx: int = Field(ge=1, le=MAX_CONTRIBUTORS)
    sk: Key
    b: Key


class Revealed(_Strict):
    self_shares: dict[Name, Share] = Field(max_length=MAX_CONTRIBUTORS)
    key_shares: dict[Name, Share] = Field(max_length=MAX_CONTRIBUTORS)


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], data: Any) -> M | None:
    """`data` as `model`, or None if it does not fit the schema."""
    try:
        return model.model_validate(data)
    except ValidationError:
        return None


def session_context(requester: str, request: SessionRequest) -> bytes:
    """What binds every key of one session: the requester, the session id, the
    contributors U, the model rounds, the purpose (which names the stage) and
    the weight unit W (and an asynchronous sum's round t, `at_round`): a
    contributor told another W than the others derives
    other pair keys, so their tags fail in Round 1 (a requester cannot shrink
    everyone's weight but one victim's to peel its model out of the sum)."""
    return "|".join(
        (
            "p2pfl-secagg-v3",
            requester,
            request.session,
            ",".join(sorted(request.contributors)),
            str(request.round),
            str(request.max_round),
            request.purpose,
            repr(float(request.weight_scale)),
            # an asynchronous sum's round: every contributor weighs its staleness
            # against the same t, or their tags fail (absent: the context as before)
            *(() if request.at_round is None else (f"at={request.at_round}",)),
            # a narrow ring and its steps: a requester cannot quantize one
            # victim finely and everyone else to nothing (absent: 32 bits, as before)
            *(() if request.ring == SECAGG_RING_BITS else (f"ring={request.ring}",)),
            *(() if request.steps is None else (f"steps={steps_digest(request.steps)}",)),
        )
    ).encode()


def steps_digest(steps: dict[str, float]) -> str:
    """SHA-256 over the steps, in key order, each as its exact float64."""
    digest = hashlib.sha256()
    for key in sorted(steps):
        name = key.encode()
        digest.update(struct.pack("<I", len(name)) + name + struct.pack("<d", float(steps[key])))
    return digest.hexdigest()


def least_threshold(others: int) -> int:
    """The least Shamir threshold t over `others` share holders:
    floor(2 x others / 3) + 1, the bound of Bonawitz et al. 2017 (Sec. 6,
    App. A) against a requester that deviates: t > 2n/3.

    Such a requester may tell one group of holders "v stayed" and another "v
    dropped": the first reveals shares of v's self-mask seed b_v, the second of
    its mask key s_v, and with t of each it peels v's input. An honest holder
    answers Unmasking once, for one story; a contributor colluding with the
    requester answers both. So the split needs c >= 2t - others colluding
    contributors among the holders (`colluders_tolerated`); with this t that is
    more than a third of them. The bound before it, a majority, let the
    requester and ONE colluding contributor peel a model out of a sum of 4
    (found by a review, tests/test_secagg_collusion.py)."""
    return secagg_least_threshold(others)


def colluders_tolerated(others: int, t: int) -> int:
    """The most contributors that may collude with the requester, with t over
    `others` holders, before the two-story split above peels an input: 2t - others - 1."""
    return max(0, 2 * t - others - 1)


def threshold_for(holders: int, configured: int | None) -> int:
    """t for `holders` other contributors: `least_threshold`, or the configured
    t if higher, never more than there are holders."""
    return min(holders, max(least_threshold(holders), configured or 0))
