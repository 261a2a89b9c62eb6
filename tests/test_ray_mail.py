"""The Ray engine's mail between shards (protocols/memory/ray_mail.py), without
Ray: what is put in an outbox within its window leaves in one call, in order;
a full batch leaves at once; an item not yet sent can be taken back; a call
that fails hands its items to the shard (which fails their requests)."""

from __future__ import annotations

import asyncio
from typing import Any

from protocols.memory.ray_mail import Item, Outbox


class Wire:
    """Records each call an outbox makes; fails them while `broken`."""

    def __init__(self) -> None:
        self.calls: list[list[Item]] = []
        self.failed: list[tuple[str, list[Item]]] = []
        self.broken = False

    async def send(self, items: list[Item]) -> None:
        await asyncio.sleep(0)  # an actor call answers later
        if self.broken:
            raise ConnectionError("shard gone")
        self.calls.append(items)

    def on_failed(self, error: BaseException, items: list[Item]) -> None:
        self.failed.append((type(error).__name__, items))


def run(check: Any) -> None:
    asyncio.run(check())


def test_what_comes_within_the_window_leaves_in_one_call_in_order() -> None:
    wire = Wire()

    async def check() -> None:
        box = Outbox(wire.send, wire.on_failed, window_s=0.05)
        for i in range(5):
            box.put(("ask", i))
        assert wire.calls == []  # still gathering
        await asyncio.sleep(0.2)
        box.put(("ask", 5))
        await box.drain()

    run(check)
    assert wire.calls == [[("ask", i) for i in range(5)], [("ask", 5)]]
    assert wire.failed == []


def test_a_full_batch_leaves_at_once() -> None:
    wire = Wire()

    async def check() -> None:
        box = Outbox(wire.send, wire.on_failed, window_s=60, max_items=3, max_bytes=100)
        for i in range(7):
            box.put(("ask", i))
        box.put(("reply", 7), nbytes=500)  # over max_bytes on its own
        await asyncio.sleep(0.01)
        assert [len(c) for c in wire.calls] == [3, 3, 2]
        assert (box.batches, box.items_sent) == (3, 8)
        await box.drain()

    run(check)


def test_an_item_not_yet_sent_is_taken_back() -> None:
    wire = Wire()

    async def check() -> None:
        box = Outbox(wire.send, wire.on_failed, window_s=60)
        kept, other = ("ask", 1), ("ask", 2)
        box.put(kept)
        box.put(other)
        assert box.withdraw(other) and not box.withdraw(("ask", 2))  # the very object only
        await box.drain()
        assert not box.withdraw(kept)  # it left

    run(check)
    assert wire.calls == [[("ask", 1)]]


def test_a_failed_call_hands_its_items_back() -> None:
    wire = Wire()

    async def check() -> None:
        box = Outbox(wire.send, wire.on_failed, window_s=0.01)
        wire.broken = True
        box.put(("ask", 1))
        box.put(("push", 2))
        await asyncio.sleep(0.1)
        wire.broken = False
        box.put(("ask", 3))
        await box.drain()

    run(check)
    assert wire.failed == [("ConnectionError", [("ask", 1), ("push", 2)])]
    assert wire.calls == [[("ask", 3)]]


def test_a_withdrawn_items_bytes_leave_the_batchs_count() -> None:
    """A withdrawn item's bytes no longer fill the batch: 60 + 60 bytes with
    the first withdrawn stay under a 100-byte batch, sent at drain, as one."""
    wire = Wire()

    async def check() -> None:
        box = Outbox(wire.send, wire.on_failed, window_s=60, max_bytes=100)
        first, second = ("push", 1), ("push", 2)
        box.put(first, 60)
        assert box.withdraw(first)
        box.put(second, 60)
        await asyncio.sleep(0.01)
        assert wire.calls == []  # not sent for a size it no longer has
        await box.drain()
        assert wire.calls == [[second]]

    run(check)
