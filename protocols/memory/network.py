"""The in-memory network: many nodes, one process, one event loop.

`InMemoryNetwork` is the hub; `InMemoryContext` is one node's `RoundContext`
over it. The same protocol code that runs in the daemon runs here, with real
asyncio queues and timeouts, so fast tests and simulations of many sites
exercise what the daemon does: a pull waits while the peer's handler says
`NotReady`, a dead or partitioned peer raises `PeerUnavailable`, a silent one
costs the full timeout. Every payload goes through `p2pfl.secure.tensors.dumps` and
`loads` (what would not survive the wire fails here too) and its bytes are
counted against the node that sent it (`Traffic`). What the hub keeps of each
node (`MemoryNode`, `Traffic`) is in nodes.py.

Faults tests can inject:
  network.kill(name)                 the node stops: its task is cancelled, every
                                     message to or from it fails at once
  network.partition(name, on=True)   cut off both ways; looks dead to the others
  network.silence(name, on=True)     looks alive, never answers (costs timeouts)
  network.set_latency(name, s)       one-way delay of every message to/from it

A node whose protocol raised is marked failed (`simulate` does it): its peers
see it as failed at once, as a daemon's heartbeat would tell them.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2pfl.config import SiteConfig
from p2pfl.files import atomic_write_bytes
from p2pfl.secure.tensors import dumps, loads
from protocols.base import (
    FAILED,
    Handler,
    Kept,
    NotReady,
    PeerInfo,
    PeerUnavailable,
    Received,
    RoundContext,
)
from protocols.masking import pair_secret_from_shared
from protocols.memory.nodes import MemoryNode, Traffic, new_inbox

log = logging.getLogger(__name__)

REQUEST_SUFFIX = ".request"


class InMemoryNetwork:
    """The hub every InMemoryContext talks through.

    inline_train: run `ctx.run_blocking` work on the event loop instead of a worker
    thread, so interleaving (and thus every result) repeats exactly.
    checkpoint_dir: also write each node's checkpoint to DIR/<name>.ckpt; a node
        that joined without a config keeps its artifacts under DIR/<name>/.
    poll_interval_s: how often a pull re-asks a handler that said NotReady.
    sample_caps: the roster's max_samples by site (what `RoundContext.sample_caps`
        gives every node); change it any time.
    keep_checkpoints: keep each node's last checkpoint in memory (for restarts
        and `saved_state`); a simulation that never restarts a node can say
        False and save a model-and-optimizer's worth of memory per node.

    Membership costs O(N) per change, not per call: every node's PeerInfo is
    kept and updated in place (round, phase, published metadata), and the list
    of reachable nodes is rebuilt only when a node joins, fails, is killed,
    revived or partitioned; `peers()` filters that list.
    """

    def __init__(
        self,
        *,
        inline_train: bool = False,
        checkpoint_dir: str | Path | None = None,
        poll_interval_s: float = 0.01,
        send_timeout_s: float = 60.0,
        sample_caps: dict[str, int] | None = None,
        keep_checkpoints: bool = True,
    ) -> None:
        self.inline_train = inline_train
        self.keep_checkpoints = keep_checkpoints or checkpoint_dir is not None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.poll_interval_s = poll_interval_s
        self.send_timeout_s = send_timeout_s
        self.sample_caps: dict[str, int] = dict(sample_caps or {})
        self._nodes: dict[str, MemoryNode] = {}
        self._reachable: list[PeerInfo] | None = None  # alive, not partitioned; by name
        self._alive: list[PeerInfo] = []  # of those, the ones whose protocol runs
        self._alive_names: list[str] = []
        self._names: list[str] | None = None
        self.records: list[dict[str, Any]] = []
        self.choices: list[dict[str, Any]] = []
        self.training: dict[str, dict[str, Any]] = {}  # node -> its /status training block
        self.privacy_gate: dict[str, dict[str, Any]] = {}  # node -> its /status privacy_gate block
        self.rejections: list[dict[str, Any]] = []  # inputs a protocol refused
        # round -> (records logged for it, wall time of the last): when each
        # round ended, as logged, whenever a benchmark reads it (`logged`)
        self.round_ends: dict[int, tuple[int, float]] = {}

    # ------------------------------------------------------------------ membership

    def join(self, name: str, config: SiteConfig | None = None) -> InMemoryContext:
        """Register a node, or give a known one a fresh context (a restarted
        process): its checkpoint, traffic counters and injected faults stay,
        its handlers and inboxes start empty. A killed node needs `revive`."""
        node = self._nodes.get(name)
        if node is None:
            node = MemoryNode(name=name, config=config)
            self._nodes[name] = node
        else:
            node.handlers.clear()
            node.inboxes.clear()
            node.task = None
            node.config = config or node.config
            node.failed = ""  # a restarted process runs its protocol again
            node.info.state = "alive"
        node.last_seen = time.monotonic()
        self._reachable = None
        if self.checkpoint_dir is not None and node.checkpoint is None:
            path = self.checkpoint_dir / f"{name}.ckpt"
            if path.exists():
                node.checkpoint = path.read_bytes()
        return InMemoryContext(self, node)

    def names(self) -> list[str]:
        if self._names is None or len(self._names) != len(self._nodes):
            self._names = sorted(self._nodes)
        return list(self._names)

    def _node(self, name: str) -> MemoryNode:
        node = self._nodes.get(name)
        if node is None:
            raise PeerUnavailable(name, "unknown_peer")
        return node

    # ------------------------------------------------------------------ faults

    def kill(self, name: str) -> None:
        """Crash a node: it stops running and every message to/from it fails."""
        node = self._node(name)
        node.alive = False
        self._reachable = None
        if node.task is not None and not node.task.done():
            node.task.cancel()
        log.info("network: %s killed", name)

    def mark_failed(self, name: str, error: BaseException) -> None:
        """The node's protocol stopped with `error`: like a daemon's heartbeat
        saying so, its peers see it as failed at once (not chosen, not waited
        for); it still answers for what it had offered."""
        node = self._node(name)
        node.failed = type(error).__name__
        node.phase = node.info.state = FAILED
        self._reachable = None
        node.offers.wake_all()

    def revive(self, name: str) -> None:
        """Let a killed node come back (it resumes from its checkpoint when run again)."""
        self._node(name).alive = True
        self._reachable = None

    def partition(self, name: str, on: bool = True) -> None:
        self._node(name).partitioned = on
        self._reachable = None

    def reachable(self) -> list[PeerInfo]:
        """Every node alive and not partitioned (failed ones included, with
        state "failed"), by name; rebuilt only after a membership change."""
        if self._reachable is None:
            self._reachable = [
                node.info
                for name, node in sorted(self._nodes.items())
                if node.alive and not node.partitioned
            ]
            self._alive = [info for info in self._reachable if info.state == "alive"]
            self._alive_names = [info.name for info in self._alive]
        return self._reachable

    def alive_except(self, me: str) -> list[PeerInfo]:
        """The alive (not failed) reachable nodes but `me`, by name: two slices
        of the shared list, not a pass over it."""
        self.reachable()
        i = bisect.bisect_left(self._alive_names, me)
        if i < len(self._alive_names) and self._alive_names[i] == me:
            return self._alive[:i] + self._alive[i + 1 :]
        return list(self._alive)

    def silence(self, name: str, on: bool = True) -> None:
        """The node keeps running and looks alive but answers nothing."""
        self._node(name).silent = on

    def set_latency(self, name: str, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"latency must be >= 0, got {seconds}")
        self._node(name).latency_s = seconds

    def can_reach(self, src: str, dst: str) -> bool:
        a, b = self._nodes.get(src), self._nodes.get(dst)
        return (
            a is not None
            and b is not None
            and a.alive
            and b.alive
            and not (a.partitioned or b.partitioned)
        )

    # ------------------------------------------------------------------ observation

    def traffic(self, name: str) -> Traffic:
        return self._node(name).traffic

    def round_of(self, name: str) -> int:
        return self._node(name).round

    def logged(self, round_no: int) -> None:
        """A node logged its record of `round_no`: counted, and the time kept
        (`time.time()`, so the shards of the Ray engine, other processes,
        merge theirs): a round ended when its last node logged it, whenever
        a benchmark reads it (bench.scale's time per round)."""
        count, _ = self.round_ends.get(round_no, (0, 0.0))
        self.round_ends[round_no] = (count + 1, time.time())

    def saved_state(self, name: str) -> dict[str, Any] | None:
        """A node's last checkpoint, decoded (None if it never wrote one)."""
        node = self._node(name)
        return None if node.checkpoint is None else loads(node.checkpoint)

    async def wait_for_round(self, name: str, round_no: int) -> None:
        """Until the node has entered `round` (tests use it to inject faults mid-run)."""
        node = self._node(name)
        if node.round >= round_no:
            return
        event = node.round_events.setdefault(round_no, asyncio.Event())
        await event.wait()

    # ------------------------------------------------------------------ transport

    def _check_path(self, src: MemoryNode, dst: MemoryNode) -> None:
        if not src.alive:
            raise PeerUnavailable(dst.name, "sender_dead")
        if not dst.alive:
            raise PeerUnavailable(dst.name, "dead")
        if src.partitioned or dst.partitioned:
            raise PeerUnavailable(dst.name, "unreachable")

    async def _hop(self, src: MemoryNode, dst: MemoryNode) -> None:
        delay = src.latency_s + dst.latency_s
        if delay > 0:
            await asyncio.sleep(delay)
        self._check_path(src, dst)

    async def request(
        self, sender: str, peer: str, kind: str, query: dict[str, Any], timeout: float
    ) -> Any:
        src, dst = self._node(sender), self._node(peer)
        query_bytes = dumps(query)
        src.traffic.add(kind + REQUEST_SUFFIX, len(query_bytes))
        try:
            return await asyncio.wait_for(self._exchange(src, dst, kind, query_bytes), timeout)
        except TimeoutError:
            raise PeerUnavailable(peer, "timeout") from None

    async def _exchange(
        self, src: MemoryNode, dst: MemoryNode, kind: str, query_bytes: bytes
    ) -> Any:
        # One request message; while the handler says NotReady the peer holds it
        # open and re-asks (the requester's timeout bounds the wait).
        await self._hop(src, dst)
        while True:
            self._check_path(src, dst)
            changed = dst.offers.watch(kind)
            handler = dst.handlers.get(kind)
            if not dst.silent and handler is not None:
                try:
                    payload = await handler(src.name, loads(query_bytes))
                except NotReady:
                    if dst.failed:
                        raise PeerUnavailable(dst.name, "peer_failed") from None
                except Exception as exc:  # noqa: BLE001 - a peer's failing handler is that peer's fault
                    log.warning("%s: %r handler failed for %s: %r", dst.name, kind, src.name, exc)
                    raise PeerUnavailable(dst.name, "handler_error") from exc
                else:
                    size, decoded = self._reply(dst, payload)
                    dst.traffic.add(kind, size)
                    await self._hop(dst, src)
                    return decoded
            elif dst.failed and not dst.silent:
                raise PeerUnavailable(dst.name, "peer_failed")
            await dst.offers.wait(changed, self.poll_interval_s)

    @staticmethod
    def _reply(dst: MemoryNode, payload: Any) -> tuple[int, Any]:
        """(encoded size, what the requester gets): the payload through the
        codec. A Kept payload (a model kept for slower peers) is encoded once,
        which checks it can travel and counts its bytes, and every requester
        gets the kept object itself: nobody modifies it, so a model pulled by
        k neighbours costs one copy, not k."""
        cached = dst.kept_reply
        if cached is not None and cached[0] is payload:
            return cached[1], payload
        reply = dumps(payload)
        if isinstance(payload, Kept):
            dst.kept_reply = (payload, len(reply))
            return len(reply), payload
        return len(reply), loads(reply)

    async def send(self, sender: str, peer: str, kind: str, payload: Any, round_no: int) -> None:
        src, dst = self._node(sender), self._node(peer)
        body = dumps(payload)
        src.traffic.add(kind, len(body))
        await self._hop(src, dst)
        if dst.silent:
            await asyncio.sleep(self.send_timeout_s)
            raise PeerUnavailable(peer, "timeout")
        queue = dst.inboxes.setdefault(kind, new_inbox(dst))
        try:
            queue.put_nowait(Received(src.name, kind, round_no, loads(body), uuid.uuid4().hex))
        except asyncio.QueueFull:
            raise PeerUnavailable(peer, "inbox_full") from None


class InMemoryContext(RoundContext):
    """One node's view of an InMemoryNetwork."""

    def __init__(self, network: InMemoryNetwork, node: MemoryNode) -> None:
        self.network = network
        self._node = node
        self.me = node.name
        if node.config is not None:
            self.config = node.config

    # round and phase are visible to the other nodes through peers()
    @property  # type: ignore[override]
    def round(self) -> int:
        return self._node.round

    @round.setter
    def round(self, value: int) -> None:
        self._node.round = value
        for r, event in list(self._node.round_events.items()):
            if r <= value:
                event.set()
                del self._node.round_events[r]

    def set_phase(self, phase: str) -> None:
        self._node.phase = phase
        self.phase = phase

    def peers(self, alive_only: bool = True) -> list[PeerInfo]:
        """The other nodes as the network sees them now. The alive ones come
        from the network's shared list (O(N) per call, no copies: read-only,
        like everything a peer published); with alive_only=False every node,
        as fresh PeerInfo objects."""
        if alive_only:
            if not self._node.alive or self._node.partitioned:
                return []
            return self.network.alive_except(self.me)
        out: list[PeerInfo] = []
        for name in self.network.names():
            if name == self.me:
                continue
            other = self.network._nodes[name]
            if not self.network.can_reach(self.me, name):
                state = "dead"
            else:
                state = FAILED if other.failed else "alive"
            out.append(
                PeerInfo(
                    name=name,
                    state=state,
                    round=other.round,
                    phase=other.phase,
                    meta=dict(other.meta),
                    last_seen=other.last_seen,
                )
            )
        return out

    def roster(self) -> list[str]:
        return self.network.names()

    async def send(self, peer: str, kind: str, payload: Any, round_no: int | None = None) -> None:
        await self.network.send(
            self.me, peer, kind, payload, self.round if round_no is None else round_no
        )

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        return await self.network.request(self.me, peer, kind, query, timeout)

    def serve(self, kind: str, handler: Handler) -> None:
        self._node.handlers[kind] = handler
        self._node.offers.offered(kind)

    def offered(self, kind: str) -> None:
        self._node.offers.offered(kind)

    def inbox(self, kind: str) -> asyncio.Queue[Received]:
        return self._node.inboxes.setdefault(kind, new_inbox(self._node))

    def publish(self, key: str, value: Any) -> None:
        self._node.meta[key] = loads(dumps(value))
        self._node.last_seen = time.monotonic()

    async def run_blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.network.inline_train:
            return fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)

    def checkpoint(self, state: dict[str, Any]) -> None:
        if not self._node.alive:
            # Killed while it ran without yielding (its cancellation is pending):
            # a crashed process writes nothing more.
            raise asyncio.CancelledError(f"{self.me} was killed")
        if not self.network.keep_checkpoints:
            return  # a simulation that never restarts a node
        data = dumps(state)
        self._node.checkpoint = data
        directory = self.network.checkpoint_dir
        if directory is not None:
            atomic_write_bytes(directory / f"{self.me}.ckpt", data)

    def restore(self) -> dict[str, Any] | None:
        return None if self._node.checkpoint is None else loads(self._node.checkpoint)

    def durable_file(self, name: str) -> Path | None:
        """Beside the checkpoints (checkpoint_dir/<name>/), or None when the
        network keeps none: a simulation leaves no state behind it."""
        if self.network.checkpoint_dir is None:
            return None
        path = self.network.checkpoint_dir / self.me / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def storage_dir(self) -> Path:
        """The node's state_dir when it joined with a config (what
        `simulation_configs` gives every site); checkpoint_dir/<name>/ when it
        joined without one. A node with neither has no storage."""
        if self._node.config is not None:
            return super().storage_dir()
        if self.network.checkpoint_dir is None:
            raise RuntimeError(
                f"{self.me} joined without a config and the network has no checkpoint_dir, "
                "so it has nowhere to keep files — join with a SiteConfig or give "
                "InMemoryNetwork a checkpoint_dir"
            )
        return self.network.checkpoint_dir / self.me

    def log_metrics(self, round_no: int, **values: float) -> None:
        """Records carry this node's cumulative traffic at the time of logging."""
        record: dict[str, Any] = {"node": self.me, "round": round_no, **values}
        record.setdefault("messages_sent", self._node.traffic.messages_sent)
        record.setdefault("bytes_sent", self._node.traffic.bytes_sent)
        self.network.records.append(record)
        self.network.logged(round_no)

    def pair_secret(self, peer: str, context: bytes) -> bytes:
        """HKDF over a real X25519 agreement between this node's key and the
        peer's (each simulated node gets its own key pair when it joins)."""
        other = self.network._node(peer)
        shared = self._node.agreement.exchange(other.agreement.public_key())
        return pair_secret_from_shared(shared, self.me, peer, context)

    def set_training(self, training: dict[str, Any]) -> None:
        self.network.training[self.me] = dict(training)

    def set_privacy_gate(self, decision: dict[str, Any]) -> None:
        self.network.privacy_gate[self.me] = dict(decision)

    def record_choice(self, chosen: list[str]) -> None:
        self.network.choices.append({"node": self.me, "round": self.round, "chosen": list(chosen)})

    def reject(self, peer: str, reason: str) -> None:
        self.network.rejections.append(
            {"node": self.me, "round": self.round, "peer": peer, "reason": reason}
        )

    def sample_caps(self) -> dict[str, int]:
        return dict(self.network.sample_caps)
