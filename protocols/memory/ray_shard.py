"""One shard of the Ray engine (protocols/memory/ray_engine.py): `ShardNetwork`,
an `InMemoryNetwork` for a contiguous block of the nodes, and `Shard`, the
async Ray actor that runs that block's protocols on its own event loop with
the local simulator, unchanged (the protocols still see only `RoundContext`).

Every shard knows every node: a node of another shard is a proxy
`MemoryNode` (no handlers, only its public agreement key), so membership
(`peers()`, `roster()`) is the local code's.

- A request or push for a node of another shard becomes an actor call to that
  shard, which runs the local exchange there (the owner counts the reply's
  bytes, as one process would) and returns the encoded reply. A kept payload
  (`protocols.base.Kept`, a model kept for slower peers) comes with a token
  that names it, so a shard decodes it once for all of its nodes that hold it
  at the same time.
  It travels as bytes in each reply, not through Ray's object store: with a
  reference to a `ray.put` copy in the reply, a 1,000-node run had a node
  wait forever on one (most likely freed when its owner replaced it by the
  next round's model before the requester fetched it; not diagnosed further).
- Membership changes (kill, fail, partition, revive, silence, latency) are
  broadcast to every shard. A node's round, phase and published metadata are
  gossiped to the other shards every `gossip_s`, as the daemon's heartbeats
  carry them: heuristics that read them (H2, H3) see them as late as a real
  federation would.
- Between shards travel only bytes from `p2pfl.secure.tensors.dumps`
  (models, queries, metadata), JSON (configs, results) and plain names and
  numbers, never a pickled object of ours.

This module and ray_engine.py are the only ones that import ray, and only
inside functions: without ray installed, importing them works and running
the engine says how to install it (`import_ray`).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import resource
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from p2pfl.config import SiteConfig, config_from_dict
from p2pfl.secure.tensors import dumps, loads
from protocols.base import Kept, PeerUnavailable
from protocols.memory.network import REQUEST_SUFFIX, InMemoryContext, InMemoryNetwork
from protocols.memory.nodes import MemoryNode
from protocols.memory.results import SimulationResult

RAY_MISSING = "the ray engine needs ray: pip install 'p2pfl-node[ray]'"
# Set in the task that answers another shard's request, so `_reply` encodes for
# the trip (a context variable: every asyncio task has its own copy).
_ANSWERING: contextvars.ContextVar[bool] = contextvars.ContextVar("answering", default=False)
# How long past the request's own timeout a requester waits for the owner
# shard's answer (which carries its own timeout) before giving up on it.
CALL_SLACK_S = 30.0
LocalSimulate = Callable[..., Awaitable[SimulationResult]]


class RayMissing(RuntimeError):
    """ray is not installed (the `ray` extra)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayMissing(RAY_MISSING) from None
    return ray


class _PublicKeyOnly:
    """What a shard holds of another shard's node's X25519 key: the public
    half, which is all `pair_secret` needs of a peer."""

    def __init__(self, raw: bytes) -> None:
        self._key = X25519PublicKey.from_public_bytes(raw)

    def public_key(self) -> X25519PublicKey:
        return self._key


def _public_bytes(node: MemoryNode) -> bytes:
    return node.agreement.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class ShardNetwork(InMemoryNetwork):
    """One shard's InMemoryNetwork: its own nodes, and a proxy for every node
    of the other shards; requests and pushes to a proxy go to its shard."""

    def __init__(self, index: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index
        self.handles: list[Any] = []
        self.owner: dict[str, int] = {}  # a node of another shard -> that shard
        self._prejoined: dict[str, InMemoryContext] = {}
        self._kept: dict[str, tuple[Kept, str]] = {}  # node -> its kept reply and its token
        self._tokens = 0
        self._decoded: weakref.WeakValueDictionary[str, Kept] = weakref.WeakValueDictionary()

    # ------------------------------------------------------------- membership

    def prejoin(self, config: SiteConfig) -> bytes:
        """Register one of this shard's nodes before any shard runs, so the
        others find it (and its public key) from their first message."""
        name = config.node.name
        self._prejoined[name] = super().join(name, config)
        return _public_bytes(self._nodes[name])

    def join(self, name: str, config: SiteConfig | None = None) -> InMemoryContext:
        """The context `prejoin` made (nothing it received is dropped), else a join."""
        ctx = self._prejoined.pop(name, None)
        return ctx if ctx is not None else super().join(name, config)

    def add_proxy(self, name: str, shard: int, public_key: bytes) -> None:
        self.owner[name] = shard
        self._nodes[name] = MemoryNode(
            name=name,
            config=None,
            agreement=_PublicKeyOnly(public_key),  # type: ignore[arg-type]
        )
        self._reachable = None

    def _broadcast(self, op: str, name: str, value: Any) -> None:
        for i, handle in enumerate(self.handles):
            if i != self.index:
                handle.apply.remote(op, name, value)

    def apply(self, op: str, name: str, value: Any) -> None:
        """A membership change another shard broadcast, applied here only."""
        if op == "kill":
            super().kill(name)
        elif op == "revive":
            super().revive(name)
        elif op == "partition":
            super().partition(name, bool(value))
        elif op == "silence":
            super().silence(name, bool(value))
        elif op == "latency":
            super().set_latency(name, float(value))
        elif op == "failed":
            super().mark_failed(name, type(str(value), (Exception,), {})())
        else:
            raise ValueError(f"unknown membership change {op!r}")

    def kill(self, name: str) -> None:
        super().kill(name)
        self._broadcast("kill", name, None)

    def revive(self, name: str) -> None:
        super().revive(name)
        self._broadcast("revive", name, None)

    def partition(self, name: str, on: bool = True) -> None:
        super().partition(name, on)
        self._broadcast("partition", name, on)

    def silence(self, name: str, on: bool = True) -> None:
        super().silence(name, on)
        self._broadcast("silence", name, on)

    def set_latency(self, name: str, seconds: float) -> None:
        super().set_latency(name, seconds)
        self._broadcast("latency", name, seconds)

    def mark_failed(self, name: str, error: BaseException) -> None:
        super().mark_failed(name, error)
        self._broadcast("failed", name, type(error).__name__)

    def gossip(self, sent: dict[str, tuple[int, str, float]]) -> list[tuple[str, int, str, bytes]]:
        """This shard's nodes whose round, phase or metadata changed since
        `sent` (updated): (name, round, phase, encoded metadata)."""
        out: list[tuple[str, int, str, bytes]] = []
        for name, node in self._nodes.items():
            if name in self.owner:
                continue
            mark = (node.round, node.phase, node.last_seen)
            if sent.get(name) != mark:
                sent[name] = mark
                out.append((name, node.round, node.phase, dumps(node.meta)))
        return out

    def update_infos(self, infos: list[tuple[str, int, str, bytes]]) -> None:
        now = time.monotonic()
        for name, round_no, phase, meta in infos:
            node = self._nodes.get(name)
            if node is None or name not in self.owner:
                continue
            node.round, node.phase = round_no, phase
            node.meta.clear()
            node.meta.update(loads(meta))
            node.last_seen = now

    # ------------------------------------------------------------- transport

    async def request(
        self, sender: str, peer: str, kind: str, query: dict[str, Any], timeout: float
    ) -> Any:
        shard = self.owner.get(peer)
        if shard is None:
            return await super().request(sender, peer, kind, query, timeout)
        src = self._node(sender)
        query_bytes = dumps(query)
        src.traffic.add(kind + REQUEST_SUFFIX, len(query_bytes))
        if not src.alive:
            raise PeerUnavailable(peer, "sender_dead")
        call = self.handles[shard].answer.remote(sender, peer, kind, query_bytes, timeout)
        status, body = await self._call(peer, call, timeout)
        if status != "ok":
            raise PeerUnavailable(peer, status)
        return await self._decode(peer, body)

    async def _call(self, peer: str, call: Any, timeout: float) -> Any:
        ray = import_ray()
        try:
            return await asyncio.wait_for(call, timeout + CALL_SLACK_S)
        except TimeoutError:
            raise PeerUnavailable(peer, "timeout") from None
        except ray.exceptions.RayActorError:
            raise PeerUnavailable(peer, "shard_dead") from None
        except asyncio.CancelledError:
            # the requester gave up (its exchange found enough neighbours):
            # stop the owner's held request too, as a local one would stop
            ray.cancel(call)
            raise

    async def _decode(self, peer: str, body: tuple[str, Any]) -> Any:
        """A reply's value: the bytes decoded; a kept payload is decoded once
        for every node of this shard that holds it at the same time (the
        owner names each kept payload with a token)."""
        form, value = body
        if form == "bytes":
            return loads(value)
        token, data = value
        key = f"{peer}:{token}"
        kept = self._decoded.get(key)
        if kept is None:
            kept = Kept(loads(data))
            self._decoded[key] = kept
        return kept

    def _reply(self, dst: MemoryNode, payload: Any) -> tuple[int, Any]:  # type: ignore[override]
        """Answering another shard: the encoded reply (a kept one with the
        token that names it); else the local network's reply."""
        if not _ANSWERING.get():
            return InMemoryNetwork._reply(dst, payload)
        data = dumps(payload)  # encoded per reply: kept bytes would cost ~1 model per node
        if isinstance(payload, Kept):
            named = self._kept.get(dst.name)
            if named is None or named[0] is not payload:
                self._tokens += 1
                named = (payload, str(self._tokens))
                self._kept[dst.name] = named
            return len(data), ("kept", (named[1], data))
        return len(data), ("bytes", data)

    async def answer(
        self, sender: str, peer: str, kind: str, query_bytes: bytes, timeout: float
    ) -> tuple[str, Any]:
        """A request from another shard's node for one of ours: the local
        exchange, hops and faults included, run in a task of its own."""

        async def exchange() -> Any:
            _ANSWERING.set(True)  # this task's context only
            return await self._exchange(self._node(sender), self._node(peer), kind, query_bytes)

        try:
            return "ok", await asyncio.wait_for(asyncio.create_task(exchange()), timeout)
        except TimeoutError:
            return "timeout", None
        except PeerUnavailable as exc:
            return exc.reason, None

    async def send(self, sender: str, peer: str, kind: str, payload: Any, round_no: int) -> None:
        shard = self.owner.get(peer)
        if shard is None:
            return await super().send(sender, peer, kind, payload, round_no)
        src = self._node(sender)
        body = dumps(payload)
        src.traffic.add(kind, len(body))
        if not src.alive:
            raise PeerUnavailable(peer, "sender_dead")
        call = self.handles[shard].deliver.remote(sender, peer, kind, body, round_no)
        status, _ = await self._call(peer, call, self.send_timeout_s)
        if status != "ok":
            raise PeerUnavailable(peer, status)

    async def deliver(
        self, sender: str, peer: str, kind: str, body: bytes, round_no: int
    ) -> tuple[str, None]:
        """A push from another shard's node: the local send (what it counts
        against the sender's proxy is never reported: its own shard counted it)."""
        try:
            await InMemoryNetwork.send(self, sender, peer, kind, loads(body), round_no)
        except PeerUnavailable as exc:
            return exc.reason, None
        return "ok", None


# ---------------------------------------------------------------- the shard actor


class Shard:
    """One shard: its block of nodes on a `ShardNetwork`, run by the local
    simulator on this actor's event loop (`ray.remote` wraps it at run time,
    so this module imports without ray)."""

    def __init__(self, index: int, network: dict[str, Any], gossip_s: float) -> None:
        import torch

        torch.set_num_threads(1)  # the shard's nodes share its one core
        self.base_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.network = ShardNetwork(index, **network)
        self.configs: list[SiteConfig] = []
        self.gossip_s = gossip_s
        self._sent: dict[str, tuple[int, str, float]] = {}

    def ping(self) -> int:
        return self.network.index

    def setup(self, handles: list[Any], configs_json: list[str]) -> dict[str, str]:
        """Join this shard's nodes; name -> public agreement key (hex)."""
        self.network.handles = handles
        self.configs = [config_from_dict(json.loads(c), check_files=False) for c in configs_json]
        return {cfg.node.name: self.network.prejoin(cfg).hex() for cfg in self.configs}

    def add_proxies(self, owners: dict[str, tuple[int, str]]) -> None:
        """Every node of the other shards: name -> (shard, public key hex)."""
        for name, (shard, key) in owners.items():
            if shard != self.network.index:
                self.network.add_proxy(name, shard, bytes.fromhex(key))

    async def run(self, local: LocalSimulate, fail_fast: bool) -> str:
        """Run this shard's nodes to the end; the SimulationResult as JSON."""
        gossip = asyncio.create_task(self._gossip())
        try:
            result = await local(self.configs, network=self.network, fail_fast=fail_fast)
        finally:
            gossip.cancel()
        await self._send_gossip()  # the last rounds' state, for shards still running
        return json.dumps(result.as_dict())

    async def _gossip(self) -> None:
        while True:
            await asyncio.sleep(self.gossip_s)
            await self._send_gossip()

    async def _send_gossip(self) -> None:
        infos = self.network.gossip(self._sent)
        if infos:
            for i, handle in enumerate(self.network.handles):
                if i != self.network.index:
                    handle.update_infos.remote(infos)

    def update_infos(self, infos: list[tuple[str, int, str, bytes]]) -> None:
        self.network.update_infos(infos)

    def apply(self, op: str, name: str, value: Any) -> None:
        self.network.apply(op, name, value)

    async def answer(
        self, sender: str, peer: str, kind: str, query_bytes: bytes, timeout: float
    ) -> tuple[str, Any]:
        return await self.network.answer(sender, peer, kind, query_bytes, timeout)

    async def deliver(
        self, sender: str, peer: str, kind: str, body: bytes, round_no: int
    ) -> tuple[str, None]:
        return await self.network.deliver(sender, peer, kind, body, round_no)

    def records_logged(self) -> int:
        return len(self.network.records)

    def new_records(self, start: int) -> str:
        """Records logged since the `start`th, as JSON (for progress lines)."""
        return json.dumps(self.network.records[start:])

    def rounds_logged(self) -> dict[int, int]:
        """round -> how many of this shard's nodes logged it (progress)."""
        counts: dict[int, int] = {}
        for record in self.network.records:
            counts[record["round"]] = counts.get(record["round"], 0) + 1
        return counts

    def peak_rss_mb(self) -> tuple[float, float]:
        """This actor process's peak resident memory, and what it held before
        its first node (torch imported)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, self.base_rss_mb

    def kill(self, name: str) -> None:
        """Crash one of this shard's nodes (a test's fault injection)."""
        self.network.kill(name)


__all__ = [
    "CALL_SLACK_S",
    "RAY_MISSING",
    "LocalSimulate",
    "RayMissing",
    "Shard",
    "ShardNetwork",
    "import_ray",
]
