"""The exchange: what a node offers its peers and what it collects from them.

Every protocol that averages with neighbours talks to them through one
interface, `Exchange`:

    start(ctx)                                  serve what peers will ask for
    offer(ctx, key, state, weight)              this node's update of `key`
                                                (a round, or a (round, step))
    collect(ctx, key, own, own_weight, ranking, k) -> Collected
                                                the neighbours' terms, each a
                                                state and its capped weight,
                                                checked before they are returned

Implementations:
- `PlainExchange` (here): models in the clear. The node keeps its last models
  for slower peers (`ServedModels`); a reply is checked against its pydantic
  schema (`ModelReply`), then `checks.admit` (keys, shapes, dtypes, finite,
  norm) and the claimed sample counts are capped (`checks.cap_claims`).
- `GradientExchange` (here): FedSGDP2P's per-step gradients, the same checks.
- `SecureExchange` (protocols/secure_exchange.py): only secure sums travel
  (protocols/secagg.py); the sum's mean is checked as a whole and its weight
  capped (`checks.cap_sum`).
- `CompressedExchange`, `CompressedGradientExchange`
  (protocols/compressed_exchange.py, `protocol.compression`): the same pulls,
  compressed with error feedback; a reply is decoded to a dense state (the
  hooks `query`, `decoded`, `adopt` here) before the same checks.

FedAVGP2P, SSFL, FedPerl, Fed-MAE and Fed-BEiT (models) and FedSGDP2P
(gradients) use it; compression or asynchronous merging are meant to be one
more implementation or option of this interface, not edits to each protocol.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from torch import Tensor

from p2pfl.text import shown
from protocols.base import Kept, NotReady, PeerUnavailable, RoundContext
from protocols.checks import admit, cap_claims

log = logging.getLogger(__name__)

T = TypeVar("T")

MODEL_KIND = "model"
GRAD_KIND = "grad"


# ---------------------------------------------------------------------- the interface


@dataclass
class Term:
    """One term of a merge: a neighbour's state (or a secure sum's mean), its
    weight after the caps, and what it merged (peer, the peer's round)."""

    state: dict[str, Tensor]
    weight: float
    merged: list[tuple[str, int]]


@dataclass
class Collected:
    """What `collect` brings back: the terms in merge order, the claims capped
    (names, or one entry per capped sum), and values for the round's log."""

    terms: list[Term] = field(default_factory=list)
    capped: list[str] = field(default_factory=list)
    log: dict[str, float] = field(default_factory=dict)


class Exchange(Protocol):
    """What a protocol needs from the exchange (see the module docstring)."""

    kind: str

    def start(self, ctx: RoundContext) -> None: ...

    def resumed(self, merged: list[Any]) -> None:
        """After a restart: the checkpoint's ledger of merged models
        (`[[round, [[peer, peer_round], ...]], ...]`)."""

    def offer(
        self, ctx: RoundContext, key: Any, state: dict[str, Tensor], weight: float
    ) -> None: ...

    async def collect(
        self,
        ctx: RoundContext,
        key: Any,
        own: dict[str, Tensor],
        own_weight: float,
        ranking: list[str],
        k: int,
    ) -> Collected: ...


# ---------------------------------------------------------------------- pulling


async def pull_concurrently(
    ranking: list[str],
    k: int,
    timeout: float,
    fetch: Callable[[str, float], Awaitable[T | None]],
) -> list[T]:
    """Ask the first k of `ranking` at once, each with `timeout`; each failure
    (fetch returns None) is replaced by the next candidate. No request is
    started or runs past 2 x timeout from the start, so one failed wave can be
    replaced but a dead federation costs a bounded wait. Returns the successful
    results in the order they arrived."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2 * timeout
    queue = list(ranking)
    pending: dict[asyncio.Task[T | None], str] = {}
    results: list[T] = []

    def launch() -> None:
        while queue and len(pending) + len(results) < k:
            remaining = min(timeout, deadline - loop.time())
            if remaining <= 0:
                return
            peer = queue.pop(0)
            pending[asyncio.create_task(fetch(peer, remaining))] = peer

    launch()
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.pop(task)
                result = task.result()
                if result is not None:
                    results.append(result)
            launch()
    finally:
        for task in pending:
            task.cancel()
    return results


# ---------------------------------------------------------------------- what a node serves


class ServedModels:
    """This node's models of its last `keep` rounds, served unchanged to every
    peer that asks (a slower peer still finds round r after this node moved on)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.models: OrderedDict[int, Kept] = OrderedDict()  # round -> model payload

    def put(self, round_no: int, state: dict[str, Tensor], num_train: int) -> None:
        kept = self.models.get(round_no)
        if kept is not None and kept["state"] is state and kept["num_train"] == num_train:
            return  # offered by a second exchange over the same store
        self.models[round_no] = Kept(round=round_no, state=state, num_train=num_train)
        while len(self.models) > self.keep:
            self.models.popitem(last=False)

    @property
    def latest(self) -> int:
        return max(self.models, default=-1)

    def model_of(self, wanted: int, newest: int) -> Kept | None:
        """The model of round `wanted`, or the nearest newer one up to `newest`;
        None if only newer ones are kept; NotReady while `wanted` is not trained."""
        for r in sorted(self.models):
            if wanted <= r <= newest:
                return self.models[r]
        if self.latest < wanted:
            raise NotReady(f"round {wanted} not trained yet (latest {self.latest})")
        return None


# ---------------------------------------------------------------------- reply schemas


class _Reply(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", arbitrary_types_allowed=True)


ROUND_LIMIT = 1 << 62  # no node reaches it: a claimed round at or past it is refused


class ModelReply(_Reply):
    """A neighbour's answer to 'your model of round r' (the state is checked by
    `checks.admit`, against this node's own model)."""

    round: StrictInt = Field(ge=0, lt=ROUND_LIMIT)
    num_train: StrictInt = Field(ge=1)
    state: Any


class GradientReply(_Reply):
    """A neighbour's answer to 'your gradient of (r, s)'."""

    round: StrictInt
    step: StrictInt
    batch_size: StrictInt = Field(ge=1)
    grad: Any


def wrong_round(ctx: RoundContext, round_no: int, peer: str, reply: dict[str, Any]) -> None:
    """A model reply whose round cannot be merged in round `round_no`: refused, counted."""
    log.warning("%s round %d: %s sent round %s", ctx.me, round_no, peer, shown(reply.get("round")))
    ctx.reject(peer, "model_wrong_round")


def schema_problem(schema: type[_Reply], reply: dict[str, Any]) -> tuple[Any, str | None]:
    """(the parsed reply, None), or (None, the first field that failed)."""
    try:
        return schema.model_validate(reply), None
    except ValidationError as exc:
        first = exc.errors()[0]["loc"]
        return None, str(first[0]) if first else "reply"


def _uncompressed(ctx: RoundContext, peer: str, reply: dict[str, Any], field: str) -> Any:
    """The reply's `field`, or None (counted as `compression_mismatch`) if the
    peer sent a compressed format to a node that uses none."""
    if reply.get("format") not in (None, "none"):
        log.warning(
            "%s: %s sent format %s, this node uses none", ctx.me, peer, shown(reply["format"])
        )
        ctx.reject(peer, "compression_mismatch")
        return None
    return reply[field]


# ---------------------------------------------------------------------- models in the clear


class PlainExchange:
    """Models in the clear: serve this node's kept models (`kind` "model") and
    pull the chosen neighbours' concurrently, replacing one that fails by the
    next in the ranking (DFU Alg. 3 line 6)."""

    kind = MODEL_KIND

    def __init__(
        self,
        store: ServedModels,
        *,
        max_staleness: int,
        timeout: float,
        max_norm_ratio: float | None,
        max_weight_ratio: float | None,
    ) -> None:
        self.store = store
        self.max_staleness = max_staleness
        self.timeout = timeout
        self.max_norm_ratio = max_norm_ratio
        self.max_weight_ratio = max_weight_ratio

    def start(self, ctx: RoundContext) -> None:
        ctx.serve(self.kind, self.serve)

    def resumed(self, merged: list[Any]) -> None:
        """Nothing to rebuild: a synchronous pull names the round it wants."""

    def offer(self, ctx: RoundContext, key: Any, state: dict[str, Tensor], weight: float) -> None:
        self.store.put(int(key), state, int(weight))
        ctx.offered(self.kind)

    async def serve(self, requester: str, query: dict[str, Any]) -> dict[str, Any]:
        """'Your model of round r': the one of round r, or the nearest newer one
        up to `max_round`; NotReady while this node has not finished r."""
        wanted = int(query.get("round", 0))
        found = self.store.model_of(wanted, int(query.get("max_round", wanted)))
        if found is None:
            return {"round": self.store.latest, "state": None, "num_train": 0, "reason": "too_new"}
        return found

    async def fetch(
        self,
        ctx: RoundContext,
        round_no: int,
        reference: dict[str, Tensor],
        peer: str,
        timeout: float,
    ) -> tuple[str, int, dict[str, Tensor], int] | None:
        """(peer, its model's round, the model, its claimed count), or None:
        unavailable, past the round, or refused (logged and counted)."""
        newest = round_no + self.max_staleness
        query = self.query(peer, round_no, newest)
        try:
            reply = await ctx.request(peer, self.kind, query, timeout)
        except PeerUnavailable as exc:
            log.info("%s round %d: no model from %s (%s)", ctx.me, round_no, peer, exc.reason)
            return None
        if not isinstance(reply, dict):
            log.warning("%s round %d: malformed reply from %s", ctx.me, round_no, peer)
            ctx.reject(peer, "model_malformed")
            return None
        if reply.get("state") is None:
            self.no_model(ctx, round_no, peer, reply)
            return None
        parsed, problem = schema_problem(ModelReply, reply)
        if problem == "round":
            wrong_round(ctx, round_no, peer, reply)
            return None
        if not self.round_fits(ctx, round_no, peer, reply):
            return None
        if parsed is None:
            claim = shown(reply.get("num_train"))
            log.warning("%s round %d: %s sent num_train %s", ctx.me, round_no, peer, claim)
            ctx.reject(peer, "model_bad_num_train")
            return None
        where = f" round {round_no}"
        state = await self.decoded(ctx, peer, reply, reference)
        if state is None or not admit(
            ctx, peer, "model", state, reference, max_norm_ratio=self.max_norm_ratio, where=where
        ):
            return None
        self.adopt(peer, reply, state)
        return peer, parsed.round, state, parsed.num_train

    def no_model(self, ctx: RoundContext, round_no: int, peer: str, reply: dict[str, Any]) -> None:
        """`peer` answered without a model: it has moved past the rounds asked."""
        past = shown(reply.get("round"))
        log.info("%s round %d: %s is past round %s", ctx.me, round_no, peer, past)

    def round_fits(
        self, ctx: RoundContext, round_no: int, peer: str, reply: dict[str, Any]
    ) -> bool:
        """Whether the reply's (integer) round may be merged in round `round_no`:
        from round_no to round_no + max_staleness; else refused and counted."""
        if round_no <= reply["round"] <= round_no + self.max_staleness:
            return True
        wrong_round(ctx, round_no, peer, reply)
        return False

    def query(self, peer: str, round_no: int, newest: int) -> dict[str, Any]:
        """What a pull of round `round_no` asks `peer` (CompressedExchange adds
        the reference it holds)."""
        return {"round": round_no, "max_round": newest}

    async def decoded(
        self, ctx: RoundContext, peer: str, reply: dict[str, Any], reference: dict[str, Tensor]
    ) -> Any:
        """The dense state a schema-checked reply carries, for `admit` (None:
        refused and counted here); in the clear, the reply's own, unless the
        peer compresses (`protocol.compression` is federation-wide)."""
        return _uncompressed(ctx, peer, reply, "state")

    def adopt(self, peer: str, reply: dict[str, Any], state: dict[str, Tensor]) -> None:
        """An admitted model arrived (CompressedExchange keeps it as the pair's
        reference)."""

    async def collect(
        self,
        ctx: RoundContext,
        key: Any,
        own: dict[str, Tensor],
        own_weight: float,
        ranking: list[str],
        k: int,
    ) -> Collected:
        """The first k of `ranking` that answer (sorted by name), each model
        weighted by its claimed sample count capped (roster, `max_weight_ratio`
        x the median claim)."""
        round_no = int(key)
        fetch = functools.partial(self.fetch, ctx, round_no, own)
        received = await pull_concurrently(ranking, k, self.timeout, fetch)
        received.sort(key=lambda item: item[0])
        claims = {ctx.me: own_weight}
        claims.update((peer, float(n)) for peer, _, _, n in received)
        weights, capped = cap_claims(
            ctx, claims, ratio=self.max_weight_ratio, where=f" round {round_no}"
        )
        return Collected(
            terms=[Term(state, weights[peer], [(peer, r)]) for peer, r, state, _ in received],
            capped=capped,
            log={
                "neighbours": len(received),
                "neighbours_wanted": k,
                "stale_models": sum(1 for _, r, _, _ in received if r != round_no),
            },
        )


# ---------------------------------------------------------------------- gradients


class GradientExchange:
    """FedSGDP2P's per-step gradients in the clear (`kind` "grad"), keyed by
    (round, step): the latest `keep` are served; a pull waits `timeout`."""

    kind = GRAD_KIND

    def __init__(
        self,
        *,
        keep: int,
        timeout: float,
        max_norm_ratio: float | None,
        max_weight_ratio: float | None,
        on_unavailable: Callable[[str], None] = lambda peer: None,
        on_refused: Callable[[str], None] = lambda peer: None,
    ) -> None:
        self.keep = keep
        self.timeout = timeout
        self.max_norm_ratio = max_norm_ratio
        self.max_weight_ratio = max_weight_ratio
        self.on_unavailable = on_unavailable  # FedSGDP2P's backoff of a silent neighbour
        self.on_refused = on_refused  # ... and of one whose gradient was refused
        self.served: OrderedDict[tuple[int, int], dict[str, Any]] = OrderedDict()
        self.latest: tuple[int, int] = (0, 0)

    def start(self, ctx: RoundContext) -> None:
        ctx.serve(self.kind, self.serve)

    def offer(self, ctx: RoundContext, key: Any, state: dict[str, Tensor], weight: float) -> None:
        round_no, step = key
        self.served[(round_no, step)] = {
            "round": round_no,
            "step": step,
            "grad": state,
            "batch_size": int(weight),
        }
        self.latest = (round_no, step)
        while len(self.served) > self.keep:
            self.served.popitem(last=False)
        ctx.offered(self.kind)

    async def serve(self, requester: str, query: dict[str, Any]) -> dict[str, Any]:
        """'Your gradient of (r, s)'; NotReady until this node has computed it."""
        key = (int(query.get("round", 0)), int(query.get("step", 0)))
        if key in self.served:
            return self.served[key]
        if key > self.latest:
            raise NotReady(f"step {key} not computed yet (latest {self.latest})")
        return {"round": key[0], "step": key[1], "grad": None, "batch_size": 0, "reason": "gone"}

    async def fetch(
        self,
        ctx: RoundContext,
        key: tuple[int, int],
        reference: dict[str, Tensor],
        peer: str,
        timeout: float,
    ) -> tuple[str, dict[str, Tensor], int] | None:
        round_no, step = key
        try:
            reply = await ctx.request(peer, self.kind, {"round": round_no, "step": step}, timeout)
        except PeerUnavailable as exc:
            log.info("%s %s: no gradient from %s (%s)", ctx.me, key, peer, exc.reason)
            self.on_unavailable(peer)
            return None
        result = await self.checked(ctx, key, reference, peer, reply)
        if result is None:
            # Refused (counted in `checked`), or "gone": asked again at once, a
            # neighbour that answers each step late with what is refused cost a
            # wait every step, never backed off as a silent one is (a review,
            # 2026-11-28). "Gone" too (a second review): an honest one comes
            # from a neighbour more than `keep` steps ahead, which will answer
            # the next steps alike, and a late {"grad": None} at every step
            # cost the same wait as a refused gradient, uncounted and never
            # backed off.
            self.on_refused(peer)
        return result

    async def checked(
        self,
        ctx: RoundContext,
        key: tuple[int, int],
        reference: dict[str, Tensor],
        peer: str,
        reply: Any,
    ) -> tuple[str, dict[str, Tensor], int] | None:
        """The reply's (peer, gradient, claimed batch size), or None: gone from
        the neighbour's memory, or refused (logged and counted)."""
        round_no, step = key
        if not isinstance(reply, dict):
            log.warning("%s %s: malformed gradient reply from %s", ctx.me, key, peer)
            ctx.reject(peer, "grad_malformed")
            return None
        if reply.get("grad") is None:  # the step is gone from the neighbour's memory
            return None
        parsed, problem = schema_problem(GradientReply, reply)
        if problem in ("round", "step") or (reply["round"], reply["step"]) != key:
            log.warning("%s %s: %s sent another step's gradient", ctx.me, key, peer)
            ctx.reject(peer, "grad_wrong_step")
            return None
        if parsed is None:
            batch = shown(reply.get("batch_size"))
            log.warning("%s %s: %s sent batch size %s", ctx.me, key, peer, batch)
            ctx.reject(peer, "grad_bad_batch_size")
            return None
        where = f" ({round_no}, {step})"
        grad = await self.decoded(ctx, peer, reply, reference)
        if grad is None or not admit(
            ctx, peer, "grad", grad, reference, max_norm_ratio=self.max_norm_ratio, where=where
        ):
            return None
        return peer, grad, parsed.batch_size

    async def decoded(
        self, ctx: RoundContext, peer: str, reply: dict[str, Any], reference: dict[str, Tensor]
    ) -> Any:
        """The dense gradient a schema-checked reply carries, for `admit` (None:
        refused and counted here); in the clear, the reply's own."""
        return _uncompressed(ctx, peer, reply, "grad")

    async def collect(
        self,
        ctx: RoundContext,
        key: Any,
        own: dict[str, Tensor],
        own_weight: float,
        ranking: list[str],
        k: int,
    ) -> Collected:
        """The first k of `ranking` that answer (sorted by name), each gradient
        weighted by its claimed batch size capped like a sample count; the
        caller logs one summary of the caps per round (`quiet`)."""
        round_no, step = key
        fetch = functools.partial(self.fetch, ctx, (round_no, step), own)
        received = await pull_concurrently(ranking, k, self.timeout, fetch)
        received.sort(key=lambda item: item[0])
        claims = {ctx.me: own_weight}
        claims.update((peer, float(n)) for peer, _, n in received)
        weights, capped = cap_claims(ctx, claims, ratio=self.max_weight_ratio, quiet=True)
        return Collected(
            terms=[Term(grad, weights[peer], [(peer, round_no)]) for peer, grad, _ in received],
            capped=capped,
        )
