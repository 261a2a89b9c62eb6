"""The mail between two shards of the Ray engine (ray_shard.py): what one
shard has for another shard is coalesced into one actor call per short
window, instead of one actor call per message.

Why: at 10,000 nodes over 2 shards every cross-shard pull was its own actor
call, and Ray queued over 10,000 calls on one shard (1,130 s for 2 rounds,
the driver's progress calls waiting behind them). A round of FedAVGP2P sends
about N x k x (W - 1) / W cross-shard requests and as many replies; an
`Outbox` per destination shard gathers them (and the gossip and membership
changes for that shard) for `window_s` and sends them in one call:
`post(source, items)` on the destination, which starts one task per request,
so one slow request (a peer still training: NotReady) never holds up the
others. Replies go back the same way, each as soon as it is ready, in the
next batch to the asking shard: a batch never waits for its slowest reply
(that could deadlock: a node's reply held until a peer that waits on that
node answers).

Measured (bench.scale, 2 shards, 3 rounds): 77 calls carried 12,228
messages at 1,000 nodes, 426 carried 119,543 at 10,000. At 10,000 nodes the
calls then still waited long in the receiving actor's queue (2.6 s and 46 s
on average in the two shards, at most 608 s) while Ray spilled 2.3 GB of
batches. Since the models travel through the object store (ray_shard.py) the
batches carry references only: 168 calls carried 126,250 messages at 10,000
nodes, and a call waited 0.22-0.28 s on average (at most 38 s). Not built: a
bound on the batches in flight per pair of shards (flow control).

This module knows nothing of Ray: an `Outbox` calls the `send` it is given
(ray_shard.py's actor call) and tells `failed` which items a failed call
carried. Items are tuples of plain values: names, numbers, the bytes of
`p2pfl.secure.tensors.dumps`, and references to kept models that
ray_shard.py put into Ray's object store (a model's bytes are never in a
batch: a reply carries a reference to its one copy).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

Item = tuple[Any, ...]
# How long an outbox gathers items before it sends them: short against a
# round (tens of seconds at scale), long against the event loop's turns
# (a node's inline training step holds it for ~10 ms at most).
WINDOW_S = 0.005
# A batch is sent at once past either bound (a ResNet-18 reply alone is
# 45 MB: it goes out on its own).
MAX_ITEMS = 1024
MAX_BYTES = 16 * 1024 * 1024


class Outbox:
    """Items for one other shard, sent together: the first item of a batch
    starts its window; the batch goes out when the window ends or when it
    reaches `max_items` or `max_bytes`. Each batch is one `send(items)`;
    the batches in flight are awaited, and a failed one is handed to
    `failed(error, items)` (for the requests it carried)."""

    def __init__(
        self,
        send: Callable[[list[Item]], Awaitable[Any]],
        failed: Callable[[BaseException, list[Item]], None],
        *,
        window_s: float = WINDOW_S,
        max_items: int = MAX_ITEMS,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self._send = send
        self._failed = failed
        self.window_s = window_s
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._items: list[Item] = []
        self._sizes: list[int] = []  # each item's bytes, beside it
        self._bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._in_flight: set[asyncio.Task[None]] = set()
        self.batches = 0  # sent so far (a figure: calls saved)
        self.items_sent = 0

    def put(self, item: Item, nbytes: int = 0) -> None:
        self._items.append(item)
        self._sizes.append(nbytes)
        self._bytes += nbytes
        if len(self._items) >= self.max_items or self._bytes >= self.max_bytes:
            self.send_now()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self.send_now)

    def withdraw(self, item: Item) -> bool:
        """Take back an item not yet sent (the very object put); False if it left."""
        for i, queued in enumerate(self._items):
            if queued is item:
                del self._items[i]
                self._bytes -= self._sizes.pop(i)  # its bytes leave the batch's count too
                return True
        return False

    def send_now(self) -> None:
        """Send the open batch (if any) now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        items, self._items, self._sizes, self._bytes = self._items, [], [], 0
        if not items:
            return
        self.batches += 1
        self.items_sent += len(items)
        task = asyncio.get_running_loop().create_task(self._deliver(items))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _deliver(self, items: list[Item]) -> None:
        try:
            await self._send(items)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the caller decides what a failed call means
            self._failed(exc, items)

    async def drain(self) -> None:
        """Send the open batch and wait until every batch sent has arrived."""
        self.send_now()
        if self._in_flight:
            await asyncio.gather(*list(self._in_flight), return_exceptions=True)


__all__ = ["MAX_BYTES", "MAX_ITEMS", "WINDOW_S", "Item", "Outbox"]
