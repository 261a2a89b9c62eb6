"""Uploads in progress under a hostile peer or observer (issue 28, red-team review
of the wire fixes): in-process versions of /tmp/redteam/a3_reserve_pin.py and
a4_release_burn.py, against the real MessageServer and Outbound.

A. One roster member must not pin the whole upload reservation: its uploads in
   progress are capped at one max_message_bytes (half the pool), and a payload
   trickled slower than transport.min_upload_bytes_per_s is cut off.
B. A push is counted delivered only once the receiver acted on its id: a copy
   still arriving (an observer's, re-sent from the captured header) is refused
   `in_progress` and the sender sends again; a connection lost while the node
   handles a frame gives its id back."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from fault_util import HttpReply, read_reply

from node.outbound import Outbound
from node.queues import Outbox, OutboxEntry
from node.telemetry import Telemetry
from node.transport import MESSAGE_PATH, IncomingFrame, MessageServer, Rejection
from node.transport_client import MessageClient
from p2pfl.config import TransportSection
from p2pfl.secure.wire import PREFIX_LEN, SIG_LEN, WireCodec

FED = "fed-test"
MAX = 1 << 20


def codec(identities, roster, name: str, **kw: Any) -> WireCodec:
    return WireCodec(identities[name], roster, FED, **kw)


def header_end(receiver: WireCodec, frame: bytes) -> int:
    return PREFIX_LEN + receiver.header_length(frame[:PREFIX_LEN]) + SIG_LEN


async def open_upload(port: int, frame: bytes, first: int) -> tuple[Any, Any]:
    """POST `frame` with its true Content-Length, sending only its first `first` bytes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {MESSAGE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(frame)}\r\n\r\n"
    writer.write(head.encode() + frame[:first])
    await writer.drain()
    return reader, writer


async def post(port: int, frame: bytes) -> HttpReply:
    reader, writer = await open_upload(port, frame, len(frame))
    try:
        return await asyncio.wait_for(read_reply(reader), 10)
    finally:
        writer.close()


def recorder(receiver: WireCodec, processed: list[str]) -> Any:
    async def on_frame(frame: IncomingFrame) -> tuple[int, Any]:
        receiver.open_payload(frame.header, frame.payload, digest=frame.digest)  # as Inbound does
        processed.append(frame.header.id_hex)
        return 200, None

    return on_frame


# ---------------------------------------------------------------- A: the reservation


async def test_one_peer_stalling_big_uploads_cannot_lock_the_others_out(identities, roster):
    alice = codec(identities, roster, "alice", max_message_bytes=MAX)
    carol = codec(identities, roster, "carol", max_message_bytes=MAX)
    bob = codec(identities, roster, "bob", max_message_bytes=MAX)
    processed: list[str] = []
    rejected: list[tuple[str, str | None]] = []
    cfg = TransportSection(read_idle_timeout_s=10.0)  # carol's stall is not cut during the test
    server = MessageServer(
        alice, cfg, recorder(alice, processed), lambda r, s: rejected.append((r, s))
    )
    port = await server.start("127.0.0.1", 0, None)
    pins = []
    try:
        # Two signed headers announcing near max-size payloads; then nothing.
        for _ in range(2):
            frame = carol.encode("probe", "alice", {"x": bytes(MAX - 4096)}).to_bytes()
            pins.append(await open_upload(port, frame, header_end(alice, frame)))
        await asyncio.sleep(0.2)
        carols = server.reserved_bytes
        assert carols > MAX // 2, carols  # her first upload holds its reservation
        try:
            second = await asyncio.wait_for(read_reply(pins[1][0]), 2.0)
        except TimeoutError:
            second = None  # reserved as well: the pool is hers
        honest = bob.encode("probe", "alice", {"x": torch.zeros(100_000)}).to_bytes()
        reply = await post(port, honest)
        still_pinned = server.reserved_bytes
    finally:
        for _, writer in pins:
            writer.close()
        await asyncio.sleep(0.1)
        await server.stop()
    assert (reply.status, reply.reason) == (200, None), (reply.status, reply.reason)
    assert processed and still_pinned == carols  # carol still held her share meanwhile
    assert second is not None and (second.status, second.reason) == (429, "too_many_uploads")
    assert ("too_many_uploads", "carol") in rejected


async def test_an_upload_trickled_below_the_minimum_rate_is_cut_off(identities, roster):
    alice = codec(identities, roster, "alice")
    carol = codec(identities, roster, "carol")
    rejected: list[str] = []
    # A payload of 32 KiB at the default 64 KiB/s: due within 2 s + 0.5 s. One
    # byte every 0.2 s never trips the 2 s idle timeout, only the rate.
    cfg = TransportSection(read_idle_timeout_s=2.0)
    server = MessageServer(alice, cfg, recorder(alice, []), lambda r, _: rejected.append(r))
    port = await server.start("127.0.0.1", 0, None)
    frame = carol.encode("probe", "alice", {"x": bytes(32 * 1024)}).to_bytes()
    pos = header_end(alice, frame)
    reader, writer = await open_upload(port, frame, pos)
    started = time.monotonic()
    try:
        reply_task = asyncio.create_task(read_reply(reader))
        while not reply_task.done() and time.monotonic() - started < 6.0:
            writer.write(frame[pos : pos + 1])
            pos += 1
            await asyncio.sleep(0.2)
        assert reply_task.done(), "a trickled upload was still being read after 6 s"
        reply = reply_task.result()
        reserved = server.reserved_bytes
    finally:
        writer.close()
        await server.stop()
    assert (reply.status, reply.reason) == (408, "upload_too_slow"), (reply.status, reply.reason)
    assert time.monotonic() - started < 5.0
    assert rejected == ["upload_too_slow"] and reserved == 0


# ---------------------------------------------------------------- B: delivered means acted on


def outbound(tmp_path: Path, sender: WireCodec, port: int) -> Outbound:
    tcfg = TransportSection(request_timeout_s=10.0, backoff_base_s=0.05, backoff_max_s=0.2)
    client = MessageClient(tcfg, None)
    client.set_peer("alice", f"127.0.0.1:{port}")
    return Outbound(
        name=sender.identity.name,
        cfg=SimpleNamespace(transport=tcfg, wire=SimpleNamespace(encryption=False)),  # type: ignore[arg-type]
        codec=sender,
        client=client,
        outbox=Outbox(tmp_path / "outbox"),
        peers=None,  # type: ignore[arg-type]
        telemetry=Telemetry(sender.identity.name),
        marks=None,  # type: ignore[arg-type]
        current_round=lambda: 0,
    )


async def test_a_push_an_observer_holds_in_progress_is_sent_again_not_counted_delivered(
    tmp_path, identities, roster
):
    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    processed: list[str] = []
    rejected: list[str] = []
    take = recorder(alice, processed)
    refused_once: list[bool] = []

    async def on_frame(frame: IncomingFrame) -> tuple[int, Any]:
        if not refused_once:
            refused_once.append(True)
            raise Rejection("queue_full", "inbox full")  # its id is given back
        return await take(frame)

    cfg = TransportSection(read_idle_timeout_s=10.0)
    server = MessageServer(alice, cfg, on_frame, lambda r, _: rejected.append(r))
    port = await server.start("127.0.0.1", 0, None)
    out = outbound(tmp_path, bob, port)
    entry = OutboxEntry(b"\x01" * 16, "alice", "probe", 0, {"x": bytes(200_000)}, time.time())
    captured = bob.encode("probe", "alice", entry.payload, msg_id=entry.msg_id).to_bytes()
    split = header_end(alice, captured)
    try:
        # 1. bob's push is refused once for a reason that releases its id
        first = await post(port, captured)
        assert (first.status, first.reason) == (503, "queue_full")
        # 2. the observer re-sends the captured header and holds the id
        _, spy = await open_upload(port, captured, split + 10)
        await asyncio.sleep(0.2)
        # 3. bob sends the push again (same id, fresh stamp) while the observer holds it
        delivery = asyncio.create_task(out._deliver(entry))
        await asyncio.sleep(0.5)
        early = delivery.done()
        # 4. the observer's copy ends in junk: digest_mismatch, the id is free again
        spy.write(b"\xff" * (len(captured) - split - 10))  # junk, not the signed bytes
        await spy.drain()
        await asyncio.wait_for(delivery, 10)
        replay = await post(port, captured)  # the completed id: a replay
    finally:
        spy.close()
        await out.client.close()
        await server.stop()
    assert not early, "bob counted his push delivered while alice had not acted on it"
    assert processed == [entry.msg_id.hex()]
    assert "in_progress" in rejected and "digest_mismatch" in rejected
    assert (replay.status, replay.reason) == (409, "replayed") and rejected[-1] == "replayed"


async def test_a_frame_whose_connection_drops_while_handled_can_be_sent_again(identities, roster):
    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    processed: list[str] = []
    take = recorder(alice, processed)
    slow = asyncio.Event()
    calls: list[int] = []

    async def on_frame(frame: IncomingFrame) -> tuple[int, Any]:
        calls.append(1)
        if len(calls) == 1:
            await slow.wait()  # e.g. a slow spool write; the sender gives up meanwhile
        return await take(frame)

    server = MessageServer(alice, TransportSection(), on_frame, lambda r, _: None)
    port = await server.start("127.0.0.1", 0, None)
    frame = bob.encode("probe", "alice", {"x": torch.zeros(1000)}).to_bytes()
    try:
        _, writer = await open_upload(port, frame, len(frame))
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.02)
        writer.close()  # the connection breaks while alice handles the frame
        for _ in range(50):  # until alice noticed (in_progress meanwhile), as a sender would
            await asyncio.sleep(0.1)
            retry = await post(port, frame)
            if retry.reason != "in_progress":
                break
    finally:
        slow.set()
        await server.stop()
    assert (retry.status, retry.reason) == (200, None), (retry.status, retry.reason)
    assert len(processed) == 1  # the retry; the dropped copy was never acted on


async def test_a_push_whose_sender_hangs_up_during_the_spool_write_is_still_queued(
    tmp_path: Path,
) -> None:
    """The second red-team pass: the spool write ran on in its thread after the
    connection dropped, so the push sat on disk but not in its queue, and the
    resend was answered 200 from the spool: gone until a restart. Now it is
    spooled and queued together; a copy arriving meanwhile is `in_progress`."""
    from test_hostile_wire import make_inbound

    from p2pfl.secure.identity import LocalIdentity, Roster

    ids = {n: LocalIdentity.generate(n) for n in ("alice", "bob")}
    roster = Roster([i.card(f"127.0.0.1:{7000 + k}") for k, i in enumerate(ids.values())])
    alice = WireCodec(ids["alice"], roster, "fed")
    bob = WireCodec(ids["bob"], roster, "fed")
    inbound = make_inbound(tmp_path, alice)
    real = inbound.spool.persist

    writing, release = threading.Event(), threading.Event()

    def slow_persist(msg_id: str, frame: Any) -> Any:
        writing.set()
        release.wait(10)  # a slow fsync on a loaded disk, as long as the test needs
        return real(msg_id, frame)

    async def until(condition: Any) -> None:  # events, not sleeps: a loaded machine
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert condition()

    inbound.spool.persist = slow_persist  # type: ignore[method-assign]
    server = MessageServer(alice, TransportSection(), inbound.on_frame, lambda r, s: None)
    port = await server.start("127.0.0.1", 0, None)
    msg_id = b"\x07" * 16
    frame = bob.encode("probe", "alice", {"x": b"hello"}, msg_id=msg_id).to_bytes()
    head = f"POST {MESSAGE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(frame)}\r\n\r\n"
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head.encode() + frame)
        await writer.drain()
        await until(writing.is_set)
        writer.close()  # the sender hangs up while the node writes the spool
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head.encode() + frame)  # its resend, at once
        await writer.drain()
        early = await asyncio.wait_for(read_reply(reader), 10)
        writer.close()
        assert (early.status, early.reason) == (409, "in_progress")
        release.set()  # the write finishes
        queue = inbound.inboxes.get("probe")
        await until(lambda: inbound.spool.has(msg_id.hex()) and queue.qsize() == 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head.encode() + frame)
        await writer.drain()
        late = await asyncio.wait_for(read_reply(reader), 10)
        writer.close()
        assert late.status in (200, 409) and queue.qsize() == 1  # held once, queued once
    finally:
        await server.stop()
