"""The one surface a protocol sees: `Protocol.run(ctx)` with a `RoundContext`.

A protocol never touches sockets, file paths or retries. The node daemon
(node/) implements RoundContext over aiohttp; the in-memory network (protocols/memory*)
implements it for fast tests and simulations of many nodes. The same protocol
code runs on both.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from p2pfl.config import SiteConfig
from p2pfl.files import make_private_dirs
from p2pfl.text import MAX_REASON_CHARS, one_line

# The phase of a node whose protocol stopped with an error: its peers see it
# (heartbeats, or the in-memory network) and stop choosing and waiting for it.
FAILED = "failed"


class PeerUnavailable(Exception):
    """A peer did not answer (dead, partitioned, breaker open, or timed out).

    The reason is often the peer's or a relay's own words (a refusal's JSON
    `reason`), and protocols log it: kept to one printable line
    (p2pfl/text.py), so it can neither write log lines of its own nor copy
    megabytes into one."""

    def __init__(self, peer: str, reason: str) -> None:
        reason = one_line(str(reason), MAX_REASON_CHARS)
        super().__init__(f"{peer}: {reason}")
        self.peer = peer
        self.reason = reason


class Kept(dict):  # type: ignore[type-arg]
    """A payload a protocol keeps and serves unchanged to every peer that asks
    (a kept model of a round). Never modified once made, by its maker or by
    those who receive it, so the in-memory network encodes it once and hands
    every requester the object itself; on the wire it is a plain map."""


class NotReady(Exception):
    """Raised by a serve() handler: the asked-for thing does not exist (yet)."""


@dataclass
class PeerInfo:
    """A peer as seen through heartbeats."""

    name: str
    state: str = "unknown"  # alive | suspect | dead | failed | unknown
    round: int = -1
    phase: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # what the peer publish()ed
    last_seen: float = 0.0

    @property
    def alive(self) -> bool:
        return self.state == "alive"


@dataclass
class Received:
    """A verified push taken from an inbox."""

    sender: str
    kind: str
    round: int
    payload: Any
    msg_id: str = ""


# serve() handler: (requester, query) -> payload; raise NotReady if not available.
Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]


class Offers:
    """Wakes the requests a node holds open on a kind (its handler said
    NotReady) as soon as the protocol says it has something new to offer
    (`RoundContext.offered`), instead of at their next poll. Requests still
    re-ask at their poll interval, so a protocol that never calls `offered`
    is only slower, never stuck."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def watch(self, kind: str) -> asyncio.Event:
        """The event the next `offered(kind)` sets; take it *before* asking the
        handler, so an offer made in between is not missed."""
        return self._events.setdefault(kind, asyncio.Event())

    def offered(self, kind: str) -> None:
        event = self._events.pop(kind, None)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        """Wake every held request (the node failed: they need a new answer)."""
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    @staticmethod
    async def wait(event: asyncio.Event, timeout: float) -> None:
        """Until `event` is set or `timeout` seconds passed, whichever is first
        (a timeout that is not a positive number, NaN included, waits not at all)."""
        if not timeout > 0 or event.is_set():
            return
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            pass


class RoundContext(ABC):
    """What the node (or a simulator) gives a protocol."""

    me: str
    config: SiteConfig
    round: int = 0

    @abstractmethod
    def peers(self, alive_only: bool = True) -> list[PeerInfo]:
        """Other sites (never me), with their gossiped metadata."""

    @abstractmethod
    def roster(self) -> list[str]:
        """Every site of the federation, me included, sorted."""

    @abstractmethod
    async def send(self, peer: str, kind: str, payload: Any, round_no: int | None = None) -> None:
        """Push; returns once the peer acknowledged it. Raises PeerUnavailable."""

    @abstractmethod
    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        """Pull; the peer's serve(kind) handler answers. Raises PeerUnavailable."""

    @abstractmethod
    def serve(self, kind: str, handler: Handler) -> None:
        """Answer request()s of that kind."""

    def offered(self, kind: str) -> None:  # noqa: B027 - optional hook, no-op by default
        """What the `kind` handler answers has changed (a new round's model, a
        step's gradient): requests waiting on it are re-asked now, not at their
        next poll. Call it right after making the new thing available."""

    @abstractmethod
    def inbox(self, kind: str) -> asyncio.Queue[Received]:
        """Verified pushes of that kind."""

    @abstractmethod
    def publish(self, key: str, value: Any) -> None:
        """Small metadata gossiped to every peer in heartbeats."""

    @abstractmethod
    async def run_blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run blocking torch work off the event loop."""

    @abstractmethod
    def checkpoint(self, state: dict[str, Any]) -> None:
        """Crash-safe per-round state (tensors allowed)."""

    @abstractmethod
    def restore(self) -> dict[str, Any] | None:
        """The last checkpoint, or None on a fresh start."""

    @abstractmethod
    def log_metrics(self, round_no: int, **values: float) -> None:
        """To metrics.jsonl, /status and /metrics."""

    def artifact(self, name: str) -> Path:
        """Where the protocol keeps a named artifact of this node (a trained
        generator's folder, a pre-trained encoder file): a path under the node's
        own storage (its state directory) whose parent folder exists. Protocols
        build no paths themselves."""
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ValueError(f"artifact name {name!r} must be a relative path inside the node")
        path = self.storage_dir() / relative
        # each folder it makes 0700, as the state directory's (a nested encoder_out)
        make_private_dirs(path.parent)
        return path

    def storage_dir(self) -> Path:
        """The folder this node keeps its files in: its state directory."""
        return Path(self.config.node.state_dir)

    def durable_file(self, name: str) -> Path | None:
        """A file that must outlive a restart as the checkpoints do (the
        secure-aggregation ledger): in the state directory; None where the node
        keeps nothing across restarts (a simulated node without a checkpoint_dir)."""
        return self.artifact(name)

    def set_phase(self, phase: str) -> None:
        """What the node is doing now (train, exchange, aggregate, evaluate, done)."""
        self.phase = phase

    def pair_secret(self, peer: str, context: bytes) -> bytes:
        """32 bytes only this node and `peer` can derive: HKDF-SHA256 over our
        X25519 shared secret, salted with `context` (see
        protocols.masking.pair_secret_from_shared). Used for pairwise masking."""
        raise NotImplementedError(f"{type(self).__name__} does not provide pair secrets")

    def set_community(self, community: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """This node's community (chosen peers, similarities, policy) for /status."""

    def set_training(self, training: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """How this node trains (class weighting, learning rate, best model) for /status."""

    def set_privacy_gate(self, decision: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """The privacy gate's decision about this node's synthetic buffer, for /status."""

    def record_choice(self, chosen: list[str]) -> None:  # noqa: B027 - optional hook, no-op by default
        """Who this node chose as neighbours this round (for /peers)."""

    def reject(self, peer: str, reason: str) -> None:  # noqa: B027 - optional hook, no-op by default
        """Count an input from `peer` the protocol refused (a poisoned model, ...) under
        `reason`, as the transport counts the messages it refuses (/status, /metrics)."""

    def sample_caps(self) -> dict[str, int]:
        """The most training samples each site may claim, as the federation admin
        wrote them in the roster (`max_samples` of a card); sites without one
        are absent. A claimed count is capped there (protocols.checks)."""
        return {}

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def after_training(self, seconds: float) -> None:  # noqa: B027 - optional hook
        """A round's local training just ended, after `seconds`: a node's fault
        plan (node/faults.py, the slow_train drill) waits here; a no-op elsewhere."""


class Protocol(ABC):
    name: str  # set from the params' `name`, the one place a protocol's name is written
    # The message kinds the protocol pushes, serves or requests (exact names), and
    # the stage prefixes it puts before them (protocols/stages.py StageContext).
    # A node accepts only these (and heartbeats): node/inbound.py.
    kinds: ClassVar[tuple[str, ...]] = ()
    kind_prefixes: ClassVar[tuple[str, ...]] = ()
    # The kinds among `kinds` that arrive as pushes, which the protocol reads
    # from an inbox (ctx.inbox); the others it only serves and requests. A push
    # of any other kind is refused before it is spooled: a "model" pushed to
    # FedAVGP2P was spooled, queued in an inbox nobody reads and never deleted.
    push_kinds: ClassVar[tuple[str, ...]] = ()

    def message_kinds(self) -> frozenset[str]:
        """Every kind this protocol's messages may carry: a finite set, so an
        unknown kind from the network cannot open a queue of its own."""
        return frozenset(self.kinds) | {p + k for p in self.kind_prefixes for k in self.kinds}

    def pushed_kinds(self) -> frozenset[str]:
        """The kinds of `message_kinds` a node takes as pushes (`push_kinds`)."""
        pushed = self.push_kinds
        return frozenset(pushed) | {p + k for p in self.kind_prefixes for k in pushed}

    @abstractmethod
    async def run(self, ctx: RoundContext) -> None:
        """The whole federated loop for this node."""
