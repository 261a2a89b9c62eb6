"""One shard of the Ray engine (protocols/memory/ray_engine.py): `ShardNetwork`,
an `InMemoryNetwork` for a contiguous block of the nodes. The shard actor
(ray_actor.py) runs that block's protocols on it with the local simulator,
unchanged (the protocols still see only `RoundContext`).

Every shard knows every node: a node of another shard is a proxy
`MemoryNode` (no handlers, only its public agreement key), so membership
(`peers()`, `roster()`) is the local code's.

- A request or push for a node of another shard goes to that shard, which
  runs the local exchange there (the owner counts the reply's bytes, as one
  process would) and sends back the encoded reply. What one shard has for
  another (requests, replies, cancels, gossip, membership changes) travels
  in batches, one actor call per short window (`ray_mail.Outbox`), not one
  call per message (at 10,000 nodes Ray queued over 10,000 of those on one
  shard; batched, 2 shards made 426 calls for 119,543 messages in 3 rounds).
  Each request is answered in a task of its own and its reply leaves in
  the next batch, so a slow request never holds up another.
- A kept payload (`protocols.base.Kept`, a model kept for slower peers) is
  encoded and put into Ray's object store once, when another shard first
  asks for it; every reply to another shard carries a reference to that one
  copy, with a token that names it. A shard fetches and decodes it once for
  all of its nodes that hold it at the same time (a second asker waits on
  the first fetch), so each model crosses to a machine once, not once per
  requester, and the batches stay small (no model bytes in them).
  The owner holds the reference while the node keeps that payload (a
  protocol keeps a few rounds' models for slower peers: each has its own
  copy and token, put once) and drops it when the node lets the payload go;
  Ray's reference counting keeps the copy alive while a batch carrying it
  is in flight and while a requester holds it. A fetch ends within the
  request's time (its timeout and CALL_SLACK_S, the answer included): a copy
  that cannot be stored or fetched fails that request with a reason
  (`object_store`, `shard_dead`, `payload_lost`, `timeout`), whatever Ray
  raised, never a wait without end and never an error the protocols do not
  expect of a peer.
- Membership changes (kill, fail, partition, revive, silence, latency) are
  broadcast to every shard. A node's round, phase and published metadata are
  gossiped to the other shards every `gossip_s`, as the daemon's heartbeats
  carry them: heuristics that read them (H2, H3) see them as late as a real
  federation would.
- A shard that dies: the requests waiting on it fail at once (`shard_dead`)
  as soon as a call to it fails; the driver stops the run (`ShardDied`).
- Between shards travel only bytes from `p2pfl.secure.tensors.dumps`
  (models, queries, metadata), JSON (configs, results) and plain names and
  numbers, never a pickled object of ours.
- Progress (records, round-end times, memory) is read by the driver through
  the actor's own concurrency group (ray_actor.py). The round-end times are
  the shard's own (`InMemoryNetwork.round_ends`: the wall time each round's
  last record was logged), not when the driver saw them.

This module and ray_engine.py are the only ones that import ray, and only
inside functions: without ray installed, importing them works and running
the engine says how to install it (`import_ray`; ray_actor.py and
ray_mail.py never touch ray).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from p2pfl.config import SiteConfig
from p2pfl.secure.tensors import dumps, loads
from protocols.base import Kept, PeerUnavailable
from protocols.memory.network import REQUEST_SUFFIX, InMemoryContext, InMemoryNetwork
from protocols.memory.nodes import MemoryNode
from protocols.memory.ray_mail import WINDOW_S, Item, Outbox
from protocols.memory.results import SimulationResult

log = logging.getLogger(__name__)

RAY_MISSING = "the ray engine needs ray: pip install 'p2pfl-node[ray]'"
# Set in the task that answers another shard's request to the index of the
# asking shard, so `_reply` encodes for the trip (a context variable: every
# asyncio task has its own copy).
_ANSWERING: contextvars.ContextVar[int | None] = contextvars.ContextVar("answering", default=None)
# How long past the request's own timeout a requester waits for the owner
# shard's answer (which carries its own timeout) before giving up on it.
CALL_SLACK_S = 30.0
# How long a cancel that came before its request is remembered.
CANCEL_MEMORY_S = 2 * CALL_SLACK_S
LocalSimulate = Callable[..., Awaitable[SimulationResult]]


class RayMissing(RuntimeError):
    """ray is not installed (the `ray` extra)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayMissing(RAY_MISSING) from None
    return ray


async def awaited(ref: Any) -> Any:
    """An ObjectRef's value, as a coroutine (what `asyncio.wait_for` takes)."""
    return await ref


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

    def __init__(self, index: int, *, window_s: float = WINDOW_S, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index
        self.window_s = window_s
        self.handles: list[Any] = []
        self.owner: dict[str, int] = {}  # a node of another shard -> that shard
        self.own: list[str] = []  # this shard's nodes
        self.outboxes: dict[int, Outbox] = {}  # another shard -> what is going to it
        self._prejoined: dict[str, InMemoryContext] = {}
        # id of a kept payload asked for by another shard -> the token that
        # names it, its one copy in Ray's object store (a reference) and its
        # size; the entry goes when its node no longer keeps the payload
        self._kept: dict[int, tuple[str, Any, int]] = {}
        self._tokens = 0
        self._decoded: weakref.WeakValueDictionary[str, Kept] = weakref.WeakValueDictionary()
        self._fetching: dict[str, asyncio.Task[Kept]] = {}  # kept payloads being fetched
        self.fetches = 0  # kept payloads fetched from the object store (a figure)
        self.kept_replies = 0  # replies to other shards answered with a kept payload's copy
        self._ids = 0  # this shard's requests and pushes to other shards, numbered
        self._waiting: dict[int, tuple[int, str, asyncio.Future[Any]]] = {}  # id -> shard, peer
        self._answering: dict[tuple[int, int], asyncio.Task[None]] = {}  # (shard, id) -> task
        self._cancelled: dict[tuple[int, int], float] = {}  # cancels ahead of their request
        self._dead: set[int] = set()  # shards a call to which failed: they died

    # ------------------------------------------------------------- membership

    def prejoin(self, config: SiteConfig) -> bytes:
        """Register one of this shard's nodes before any shard runs, so the
        others find it (and its public key) from their first message."""
        name = config.node.name
        self._prejoined[name] = super().join(name, config)
        self.own.append(name)
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
        for i in self.others():
            self.outbox(i).put(("apply", op, name, value))

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
        for name in self.own:
            node = self._nodes[name]
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

    # ------------------------------------------------------------- mail

    def outbox(self, shard: int) -> Outbox:
        """What is going to another shard: one `post` call per batch."""
        box = self.outboxes.get(shard)
        if box is None:
            handle = self.handles[shard]

            def send(items: list[Item]) -> Any:
                return handle.post.remote(self.index, items)

            def failed(error: BaseException, items: list[Item]) -> None:
                self._post_failed(shard, error, items)

            box = self.outboxes[shard] = Outbox(send, failed, window_s=self.window_s)
        return box

    def others(self) -> list[int]:
        return [i for i in range(len(self.handles)) if i != self.index]

    def _post_failed(self, shard: int, error: BaseException, items: list[Item]) -> None:
        """A batch did not arrive. The shard died: every request waiting on it
        fails at once (`shard_dead`), and so does every later one. Another
        error (not expected): the requests and pushes that batch carried fail."""
        ray = import_ray()
        if isinstance(error, ray.exceptions.RayActorError):
            self._dead.add(shard)
            reason = "shard_dead"
            ids = [rid for rid, (owner, _, _) in self._waiting.items() if owner == shard]
        else:
            log.warning("shard %d: a batch to shard %d failed: %r", self.index, shard, error)
            reason = "shard_error"
            ids = [item[1] for item in items if item[0] in ("ask", "push")]
        for rid in ids:
            entry = self._waiting.get(rid)
            if entry is not None and not entry[2].done():
                entry[2].set_exception(PeerUnavailable(entry[1], reason))

    async def _ask(
        self, shard: int, peer: str, item: Callable[[int], Item], nbytes: int, wait_s: float
    ) -> tuple[str, Any]:
        """Send a request or push (`item(id)`) to its node's shard and wait
        for the reply: (status, body)."""
        if shard in self._dead:
            raise PeerUnavailable(peer, "shard_dead")
        self._ids += 1
        rid = self._ids
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (shard, peer, future)
        sent = item(rid)
        box = self.outbox(shard)
        box.put(sent, nbytes)
        try:
            return await asyncio.wait_for(future, wait_s)  # type: ignore[no-any-return]
        except TimeoutError:
            raise PeerUnavailable(peer, "timeout") from None
        except asyncio.CancelledError:
            # the requester gave up (its exchange found enough neighbours):
            # stop the owner's held request too, as a local one would stop
            if not box.withdraw(sent) and future.cancelled():
                box.put(("cancel", rid))
            raise
        finally:
            self._waiting.pop(rid, None)

    def post(self, source: int, items: list[Item]) -> None:
        """A batch from shard `source`: requests and pushes start a task each
        (answered in a later batch); replies wake their requesters; cancels
        stop a held request; gossip and membership changes apply here."""
        now = time.monotonic()
        while self._cancelled:  # forget cancels whose request never came
            key, at = next(iter(self._cancelled.items()))
            if now - at < CANCEL_MEMORY_S:
                break
            del self._cancelled[key]
        for item in items:
            op = item[0]
            if op == "reply":
                entry = self._waiting.get(item[1])
                if entry is not None and not entry[2].done():
                    entry[2].set_result((item[2], item[3]))
            elif op in ("ask", "push"):
                key = (source, item[1])
                if self._cancelled.pop(key, None) is None:
                    self._answering[key] = asyncio.create_task(self._answer_item(source, item))
            elif op == "cancel":
                task = self._answering.pop((source, item[1]), None)
                if task is not None:
                    task.cancel()
                else:  # it came before its request (or after its reply)
                    self._cancelled[(source, item[1])] = now
            elif op == "infos":
                self.update_infos(item[1])
            elif op == "apply":
                self.apply(item[1], item[2], item[3])
            else:
                raise ValueError(f"unknown item {op!r} from shard {source}")

    async def _answer_item(self, source: int, item: Item) -> None:
        """One request or push from shard `source`, answered; its reply goes
        back in that shard's next batch."""
        op, rid, *args = item
        try:
            if op == "ask":
                status, body = await self.answer(source, *args)
            else:
                status, body = await self.deliver(*args)
        except asyncio.CancelledError:
            return  # the requester gave up: no reply
        except Exception as exc:  # noqa: BLE001 - raised at the requester, as in one process
            status, body = "raise", f"shard {self.index}: {type(exc).__name__}: {exc}"
        finally:
            self._answering.pop((source, rid), None)
        size = 0
        if status == "ok" and op == "ask" and body[0] == "bytes":  # else ("ref", (token, [ref]))
            size = len(body[1])
        self.outbox(source).put(("reply", rid, status, body), size)

    async def drain(self) -> None:
        """Send every open batch now and wait until they have arrived."""
        for box in list(self.outboxes.values()):
            await box.drain()

    def mail_figures(self) -> dict[str, int]:
        """Calls made to other shards, and the items (messages) they carried."""
        boxes = list(self.outboxes.values())
        return {
            "calls": sum(b.batches for b in boxes),
            "items": sum(b.items_sent for b in boxes),
            "kept_put": self._tokens,
            "kept_replies": self.kept_replies,
            "kept_fetched": self.fetches,
        }

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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout + CALL_SLACK_S  # the answer and the fetch together
        status, body = await self._ask(
            shard,
            peer,
            lambda rid: ("ask", rid, sender, peer, kind, query_bytes, timeout),
            len(query_bytes),
            timeout + CALL_SLACK_S,
        )
        if status == "raise":
            raise RuntimeError(body)
        if status != "ok":
            raise PeerUnavailable(peer, status)
        return await self._decode(peer, body, max(0.0, deadline - loop.time()))

    async def _decode(self, peer: str, body: tuple[str, Any], wait_s: float) -> Any:
        """A reply's value: the bytes decoded; a kept payload is fetched from
        the object store (within `wait_s`) and decoded once for every node of
        this shard that holds it at the same time (the owner names each with
        a token)."""
        form, value = body
        if form == "bytes":
            return loads(value)
        token, (ref,) = value
        key = f"{peer}:{token}"
        kept = self._decoded.get(key)
        if kept is not None:
            return kept
        task = self._fetching.get(key)
        if task is None:
            fetch = self._fetch(peer, key, ref, wait_s)
            task = self._fetching[key] = asyncio.create_task(fetch, name=key)
            task.add_done_callback(self._fetched)
        try:
            # shielded: one asker that gives up does not stop the others' fetch
            return await asyncio.wait_for(asyncio.shield(task), wait_s)
        except TimeoutError:
            raise PeerUnavailable(peer, "timeout") from None

    def _fetched(self, task: asyncio.Task[Kept]) -> None:
        """A fetch ended: it is no longer under way, and its error is read
        here (asyncio would report one whose askers had all gone as never
        retrieved)."""
        self._fetching.pop(task.get_name(), None)  # named by its key
        if not task.cancelled():
            task.exception()

    async def _fetch(self, peer: str, key: str, ref: Any, wait_s: float) -> Kept:
        """One kept payload from the object store, within `wait_s` (after
        which nobody waits for it any more). Whatever Ray raises fails the
        requests waiting on it with a reason, as a lost peer would."""
        ray = import_ray()
        try:
            data = await asyncio.wait_for(awaited(ref), wait_s)
        except TimeoutError:
            raise PeerUnavailable(peer, "timeout") from None
        except ray.exceptions.OwnerDiedError:
            raise PeerUnavailable(peer, "shard_dead") from None
        except ray.exceptions.RayError as exc:  # lost, evicted, a node or the store failed
            log.warning(
                "shard %d: the kept model of %s could not be fetched: %r", self.index, peer, exc
            )
            raise PeerUnavailable(peer, "payload_lost") from None
        self.fetches += 1
        kept = Kept(loads(data))
        self._decoded[key] = kept
        return kept

    def _reply(self, dst: MemoryNode, payload: Any) -> tuple[int, Any]:  # type: ignore[override]
        """Answering another shard: the encoded reply; a kept one is put into
        the object store once and answered with a reference to that copy and
        the token that names it. Else the local network's reply."""
        source = _ANSWERING.get()
        if source is None:
            return InMemoryNetwork._reply(dst, payload)
        if not isinstance(payload, Kept):
            data = dumps(payload)
            return len(data), ("bytes", data)
        named = self._kept.get(id(payload))
        if named is None:
            data = dumps(payload)
            try:
                ref = import_ray().put(data)
            except Exception as exc:  # noqa: BLE001 - the store is full or gone: this reply fails
                log.warning("shard %d: %s's kept model not stored: %r", self.index, dst.name, exc)
                raise PeerUnavailable(dst.name, "object_store") from None
            self._tokens += 1
            named = self._kept[id(payload)] = (str(self._tokens), ref, len(data))
            # while its node keeps the payload (a protocol keeps a few rounds'
            # models for slower peers), every reply shares this one copy; when
            # the node lets it go, so does the shard, and Ray frees the copy
            # once no batch in flight and no requester holds it
            weakref.finalize(payload, self._kept.pop, id(payload), None)
        self.kept_replies += 1
        # the reference inside a list: Ray passes it on as it is (a reference
        # at the top of a call's arguments would be fetched by Ray itself)
        return named[2], ("ref", (named[0], [named[1]]))

    async def answer(
        self, source: int, sender: str, peer: str, kind: str, query_bytes: bytes, timeout: float
    ) -> tuple[str, Any]:
        """A request from shard `source`'s node for one of ours: the local
        exchange, hops and faults included, run in a task of its own."""

        async def exchange() -> Any:
            _ANSWERING.set(source)  # this task's context only
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
        status, error = await self._ask(
            shard,
            peer,
            lambda rid: ("push", rid, sender, peer, kind, body, round_no),
            len(body),
            self.send_timeout_s + CALL_SLACK_S,
        )
        if status == "raise":
            raise RuntimeError(error)
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


__all__ = [
    "CALL_SLACK_S",
    "RAY_MISSING",
    "LocalSimulate",
    "RayMissing",
    "ShardNetwork",
    "import_ray",
]
