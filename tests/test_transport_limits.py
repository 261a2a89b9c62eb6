"""Uploads that announce a big payload and then stall: the receiver bounds both
the time it waits and the memory it reserves for them."""

from __future__ import annotations

import asyncio
import time

import torch
from fault_util import HttpReply, read_reply

from node.transport import MESSAGE_PATH, MessageServer
from p2pfl.config import TransportSection
from p2pfl.secure.wire import PREFIX_LEN, SIG_LEN, WireCodec


async def stalled_upload(port: int, frame: bytes, header_end: int) -> HttpReply | str:
    """Send the HTTP head and the frame's verified header, then nothing more."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            f"POST {MESSAGE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(frame)}\r\n\r\n"
        ).encode()
        writer.write(head + frame[:header_end])
        await writer.drain()
        return await asyncio.wait_for(read_reply(reader), 10)
    except TimeoutError:
        return "timeout"
    finally:
        writer.close()


def test_stalled_uploads_are_cut_off_and_their_reservations_bounded(identities, roster):
    alice = WireCodec(identities["alice"], roster, "f", max_message_bytes=8 << 20)
    bob = WireCodec(identities["bob"], roster, "f", max_message_bytes=8 << 20)
    carol = WireCodec(identities["carol"], roster, "f", max_message_bytes=8 << 20)
    cfg = TransportSection(read_idle_timeout_s=0.5, rate_limit_per_s=100)
    rejected: list[str] = []

    async def on_frame(frame):  # never reached: no upload completes
        raise AssertionError("a stalled upload was handed to the node")

    async def scenario() -> tuple[list[HttpReply | str], float, int]:
        server = MessageServer(alice, cfg, on_frame, lambda reason, _: rejected.append(reason))
        port = await server.start("127.0.0.1", 0, None)
        try:
            # Each announces 7 MiB: two fit the 16 MiB reservation budget (2 x 8 MiB),
            # from two senders (one sender's uploads in progress are capped at 8 MiB).
            frames = [
                s.encode("probe", "alice", {"t": torch.zeros(7 * (1 << 18) - 64)}).to_bytes()
                for s in (bob, carol, bob)
            ]
            header_end = [
                PREFIX_LEN + alice.header_length(f[:PREFIX_LEN]) + SIG_LEN for f in frames
            ]
            started = time.monotonic()
            first_two = [
                asyncio.create_task(stalled_upload(port, f, n))
                for f, n in zip(frames[:2], header_end[:2], strict=True)
            ]
            await asyncio.sleep(0.2)  # both are reading their payload now
            third = await stalled_upload(port, frames[2], header_end[2])
            replies = [third, *await asyncio.gather(*first_two)]
            return replies, time.monotonic() - started, server.reserved_bytes
        finally:
            await server.stop()

    replies, elapsed, reserved_after = asyncio.run(scenario())
    third, *stalled = replies
    assert isinstance(third, HttpReply) and third.status == 503, third  # over budget: refused
    for reply in stalled:
        assert isinstance(reply, HttpReply) and reply.status == 400, reply  # cut off when idle
    assert elapsed < 5.0  # cut after 0.5 s of silence, not left open
    assert sorted(rejected) == ["queue_full", "truncated", "truncated"]
    assert reserved_after == 0
