"""The emulated uplink (`transport.link_mbit`, node/link.py; issue 32 item 4):
bytes a node sends, requests and replies alike, go out at the link's rate
through the real MessageClient and MessageServer on loopback.

Timing is judged by bytes over time: a shaped transfer can never be faster
than its rate allows (a load-proof lower bound on its time), the same
transfer unshaped is much faster, and the throughput stays within ±25 % of
the rate for a few MB."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import ValidationError

from node.link import Uplink, uplink_for
from node.transport import IncomingFrame, MessageServer
from node.transport_client import MessageClient
from p2pfl.config import TransportSection
from p2pfl.secure.wire import WireCodec

FED = "fed-test"
MBIT = 16.0  # 2,000,000 bytes/s
PAYLOAD = 4_000_000  # a few MB: 2 s at MBIT


def within_rate(nbytes: int, seconds: float, link: Uplink) -> None:
    """At most the rate (a 10 % margin for the bucket's burst and the clock),
    and at least 75 % of it."""
    assert seconds >= 0.9 * (nbytes - link.burst) / link.rate, (nbytes, seconds)
    throughput = nbytes / seconds
    assert 0.75 * link.rate <= throughput <= 1.25 * link.rate, (throughput, link.rate)


@pytest.mark.exclusive  # at least 75 % of the rate: a throughput floor, run alone
async def test_the_bucket_lets_bytes_through_at_its_rate() -> None:
    link = Uplink(MBIT)
    chunks = [bytes(1_000_000), memoryview(bytes(1_500_000)), bytes(1_500_000)]
    started = time.monotonic()
    sent = 0
    async for piece in link.slices(chunks):
        sent += len(piece)
    elapsed = time.monotonic() - started
    assert sent == sum(len(c) for c in chunks) == link.bytes_sent
    within_rate(sent, elapsed, link)


async def _exchange(cfg: TransportSection, identities: Any, roster: Any) -> tuple[float, float]:
    """(seconds for bob's request of PAYLOAD bytes to reach alice, seconds for
    alice's reply of PAYLOAD bytes to reach bob), through the real transport;
    each side built from `cfg`, as a node builds both from its transport: section."""
    alice = WireCodec(identities["alice"], roster, FED)
    bob = WireCodec(identities["bob"], roster, FED)
    arrived: list[float] = []
    reply = alice.encode("probe-reply", "bob", {"x": bytes(PAYLOAD)})

    async def on_frame(frame: IncomingFrame) -> tuple[int, Any]:
        opened = alice.open_payload(frame.header, frame.payload, digest=frame.digest)
        assert len(opened["x"]) == PAYLOAD
        arrived.append(time.monotonic())
        return 200, reply.chunks

    server = MessageServer(alice, cfg, on_frame, lambda r, _: None)
    port = await server.start("127.0.0.1", 0, None)
    # bob's node: its own transport section, so its own uplink
    client = MessageClient(cfg.model_copy(), None)
    client.set_peer("alice", f"127.0.0.1:{port}")
    try:
        request = bob.encode("probe", "alice", {"x": bytes(PAYLOAD)})
        started = time.monotonic()
        status, body = await client.post("alice", request, timeout=60.0, retries=0)
        done = time.monotonic()
    finally:
        await client.close()
        await server.stop()
    assert status == 200 and len(body) == reply.nbytes
    return arrived[0] - started, done - arrived[0]


@pytest.mark.exclusive  # at least 75 % of the rate: a throughput floor, run alone
async def test_requests_and_replies_go_out_at_the_link_rate(identities, roster) -> None:
    shaped = TransportSection(link_mbit=MBIT, request_timeout_s=60.0)
    up, down = await _exchange(shaped, identities, roster)
    link = Uplink(MBIT)  # the same rate and burst as each side's
    within_rate(PAYLOAD, up, link)  # bob's uplink carried the request
    within_rate(PAYLOAD, down, link)  # alice's uplink carried the reply
    free_up, free_down = await _exchange(TransportSection(), identities, roster)
    # unshaped loopback: far faster than the link, even on a loaded machine
    assert free_up < up / 3 and free_down < down / 3, (free_up, free_down, up, down)


def test_a_nodes_client_and_server_share_one_uplink() -> None:
    cfg = TransportSection(link_mbit=20.0)
    assert uplink_for(cfg) is uplink_for(cfg)
    assert uplink_for(cfg) is not uplink_for(cfg.model_copy())  # another node, another link
    assert uplink_for(TransportSection()) is None  # unset: unshaped
    link = uplink_for(cfg)
    assert link is not None and link.rate == 2_500_000


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (0, "greater than 0"),
        (-20, "greater than 0"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        ("fast", "valid number"),
        (0.5, "upload_too_slow"),  # 62,500 bytes/s < min_upload_bytes_per_s
    ],
)
def test_bad_link_rates_are_refused_by_the_config(value: Any, why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        TransportSection(link_mbit=value)
    assert TransportSection(link_mbit=20).link_mbit == 20.0
