"""A push refused 503 `queue_full` (the receiver's inbox for its kind is full,
or the sender holds its share of it: node/inbound.py `sender_share`) is sent
again by the sender's outbox, with backoff and its same id, until its
deadline; the refusal is the receiver saying "later", so it counts neither
toward the peer's circuit breaker nor as a reason to leave a relay
(node/outbound.py, node/transport_client.py).

Review 4, R2: the client retried it 4 times within about 3 s, then the outbox
entry was deleted, and the 5 refusals opened the peer's circuit for
`transport.breaker_reset_s`, so one refused push also cut this node off from
the peer's other pushes and requests.

The sender and receiver are the daemon's own `node.daemon.Node`s on a
provisioned federation (a, b, c), never started; b's peer port is either its
real MessageServer or a stand-in at its address that answers what it is told."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
from aiohttp import web
from test_inbox_share import KIND, deliver, federation, sender, site

from node.daemon import Node
from node.outbound import SEND_AGAIN_PAUSE_S
from node.transport import MESSAGE_PATH
from p2pfl.secure.wire import PREFIX_LEN, Header
from protocols.base import PeerUnavailable

FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}
PAYLOAD = {"round": 1, "from": "c", "tensor": torch.ones(4)}


def msg_id_of(node: Node, frame: bytes) -> str:
    n = node.codec.header_length(frame[:PREFIX_LEN])
    return Header.unpack(frame[PREFIX_LEN : PREFIX_LEN + n]).id_hex


class StandIn:
    """b's peer port, answering each POST with `answer(attempt number)`:
    (status, reason). Notes each attempt's message id and how many entries
    the sender's outbox held when it came."""

    def __init__(self, c: Node, answer: Callable[[int], tuple[int, str]]) -> None:
        self.c = c
        self.answer = answer
        self.ids: list[str] = []
        self.outbox: list[int] = []
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        self.ids.append(msg_id_of(self.c, await request.read()))
        self.outbox.append(len(list(self.c.outbox.pending())))
        status, reason = self.answer(len(self.ids))
        return web.json_response({"reason": reason}, status=status)

    async def __aenter__(self) -> StandIn:
        app = web.Application()
        app.router.add_post(MESSAGE_PATH, self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(
            self.runner, "127.0.0.1", urlsplit(self.c.client.links["b"].url).port
        ).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        await self.c.client.close()


def sender_node(tmp_path: Any, **transport: Any) -> Node:
    c = Node(*site(federation(tmp_path, **FAST, **transport), "c"))
    if urlsplit(c.client.links["b"].url).scheme != "http":
        pytest.skip("the provisioned link is not plain http")
    return c


def test_a_push_over_its_share_is_sent_again_until_the_receiver_takes_it(tmp_path) -> None:
    """Through b's real transport: c holds its share of b's inbox, so c's next
    push is refused queue_full, again and again, its outbox entry kept and
    b's circuit closed; once b's protocol takes one of c's pushes, the same
    push (same id) is taken, acknowledged and its entry deleted."""
    fed = federation(tmp_path, **FAST)
    b, c = Node(*site(fed, "b")), Node(*site(fed, "c"))
    link = c.client.links["b"]
    if urlsplit(link.url).scheme != "http":
        pytest.skip("the provisioned link is not plain http")
    share = b.inbound.sender_share()
    flooder = sender(fed, "c")
    assert [deliver(b, flooder) for _ in range(share)] == [200] * share
    inbox = b.inboxes.get(KIND)
    seen: dict[str, Any] = {}

    async def main() -> None:
        host, port = b.cfg.node.listen.rsplit(":", 1)
        await b.server.start(host, int(port), None)
        try:
            sending = asyncio.ensure_future(c.outbound.send_push("b", KIND, PAYLOAD, 1))
            deadline = time.monotonic() + 20
            while b.telemetry._rejections.get("queue_full", 0) < share + 3:  # 3 of this push
                assert not sending.done(), f"the push ended while refused: {sending!r}"
                assert time.monotonic() < deadline, "b refused c's push fewer than 3 times"
                await asyncio.sleep(0.02)
            seen["pending"] = [e.msg_id.hex() for e in c.outbox.pending()]
            seen["breaker"] = (link.breaker.failures, c.client.breaker_open("b"))
            inbox.get_nowait()  # b's protocol takes one of c's pushes
            await asyncio.wait_for(sending, 20)
        finally:
            await c.client.close()
            await b.server.stop()

    try:
        asyncio.run(main())
    finally:
        b.trainer.shutdown(wait=False)
        c.trainer.shutdown(wait=False)
    assert len(seen["pending"]) == 1  # kept in the outbox while refused
    assert seen["breaker"] == (0, False)
    assert inbox._queue[-1].msg_id == seen["pending"][0]  # the same push, taken
    assert dict(inbox.queued_by) == {"c": share}
    assert list(c.outbox.pending()) == [] and not c.client.breaker_open("b")


def test_a_push_refused_queue_full_is_given_up_only_at_its_deadline(tmp_path) -> None:
    """Never taken: the push is sent again, same id, until request_timeout_s
    and only then given up (`queue_full`, its entry deleted); b's circuit
    stays closed and its link has no failure counted."""
    timeout = 2.0
    c = sender_node(tmp_path, request_timeout_s=timeout)
    link = c.client.links["b"]

    async def main() -> tuple[str, float, StandIn]:
        async with StandIn(c, lambda _: (503, "queue_full")) as b:
            started = time.monotonic()
            with pytest.raises(PeerUnavailable) as err:
                await c.outbound.send_push("b", KIND, PAYLOAD, 1)
            return err.value.reason, time.monotonic() - started, b

    try:
        reason, took, b = asyncio.run(main())
    finally:
        c.trainer.shutdown(wait=False)
    assert reason == "queue_full"
    assert took >= timeout - (SEND_AGAIN_PAUSE_S + FAST["backoff_max_s"]) - 0.1
    assert len(b.ids) >= 3 and len(set(b.ids)) == 1  # sent again, the same id
    assert set(b.outbox) == {1}  # its entry kept all along ...
    assert list(c.outbox.pending()) == []  # ... and deleted only at the deadline
    assert (link.breaker.failures, link.breaker.open_until) == (0, 0.0)


def test_a_push_refused_queue_full_is_delivered_when_the_receiver_takes_it(tmp_path) -> None:
    """More refusals than the client's own retries (4), then an answer: the
    push goes on being sent and its answer is read (here a 200 without b's
    signed acknowledgement: refused `ack_unverified`, as before the change)."""
    c = sender_node(tmp_path, request_timeout_s=10.0)
    refusals = c.cfg.transport.retries + 3

    async def main() -> tuple[str, StandIn]:
        answer = lambda n: (503, "queue_full") if n <= refusals else (200, "ok")  # noqa: E731
        async with StandIn(c, answer) as b:
            with pytest.raises(PeerUnavailable) as err:
                await c.outbound.send_push("b", KIND, PAYLOAD, 1)
            return err.value.reason, b

    try:
        reason, b = asyncio.run(main())
    finally:
        c.trainer.shutdown(wait=False)
    assert reason == "ack_unverified" and len(b.ids) == refusals + 1 and len(set(b.ids)) == 1
    assert c.client.links["b"].breaker.failures == 0


def test_any_other_503_is_still_a_failure_of_the_link(tmp_path) -> None:
    """Unchanged: a 503 other than queue_full (storage_error) is retried by the
    client `retries` times, each a breaker failure, and then the push fails
    (its entry deleted) without the outbox sending it again."""
    c = sender_node(tmp_path, request_timeout_s=10.0, breaker_failures=50)
    retries = c.cfg.transport.retries

    async def main() -> tuple[str, StandIn]:
        async with StandIn(c, lambda _: (503, "storage_error")) as b:
            with pytest.raises(PeerUnavailable) as err:
                await c.outbound.send_push("b", KIND, PAYLOAD, 1)
            return err.value.reason, b

    try:
        reason, b = asyncio.run(main())
    finally:
        c.trainer.shutdown(wait=False)
    assert reason == "storage_error" and len(b.ids) == 1 + retries
    assert c.client.links["b"].breaker.failures == 1 + retries
    assert list(c.outbox.pending()) == []
