"""Copies of a frame at the relay (issue 31, node/relay_admission.py
`Forwarded`): the relay keeps no replay state and a frame's signature holds
for every copy, so whoever holds a frame (its recipient, another relay, an
observer without TLS) can send it again. Such copies must not take its
sender's places at the relay. Real aiohttp servers on 127.0.0.1 and real
signed, encrypted frames (the helpers of tests/test_relay.py)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import test_relay
from test_relay import RelaySite, codec, frame, post, reason, relay

from node.relay_wire import RELAY_MESSAGE_PATH

ids = test_relay.ids  # the relay tests' shared fixtures (module scope)
roster = test_relay.roster


def test_a_recipient_replaying_a_senders_frame_does_not_cut_the_sender_off(ids, roster):
    """Attack: c, a roster site behind the relay, sends the relay one frame a
    sent it, again and again, from 40 connections. Before the fix each copy
    passed the signature check and waited in a's own queue (8 places, 32
    waiting): every frame a sent anyone else through the relay was refused 429
    `too_many_connections` (5 of 5 to b; 3 of 5 at the default 200 frames/s).
    Now a copy of a frame the relay forwarded already waits in the gate of a's
    copies to c: a's frames to b go on at once."""
    a = codec(ids, roster, "a")

    async def scenario() -> None:
        async with relay(roster, rate_limit_per_s=5) as (server, url):
            b, c = RelaySite(ids["b"], roster), RelaySite(ids["c"], roster)
            await b.connect(url)
            await c.connect(url)
            captured = frame(a, "c")
            assert (await post(url, captured))[0] == 200  # a's frame reaches c
            stop = asyncio.Event()

            async def replay(s: aiohttp.ClientSession) -> None:
                while not stop.is_set():
                    async with s.post(url + RELAY_MESSAGE_PATH, data=captured) as r:
                        await r.read()

            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=40)) as s:
                flood = [asyncio.create_task(replay(s)) for _ in range(40)]
                await asyncio.sleep(0.5)  # its copies hold every place they can
                answers = []
                for _ in range(5):
                    status, body = await post(url, frame(a, "b"))
                    answers.append((status, reason(body)))
                stop.set()
                await asyncio.wait_for(asyncio.gather(*flood, return_exceptions=True), 10)
            assert answers == [(200, None)] * 5, answers
            assert len(b.received) == 5
            refusals = server.snapshot()["refusals"]  # the copies were held to a's rate to c
            assert refusals.get("too_many_connections", 0) + refusals.get("rate_limited", 0) > 0
            await b.close()
            await c.close()

    asyncio.run(scenario())


def test_an_honest_retry_of_the_same_frame_is_still_forwarded(ids, roster):
    """A sender sends the very same frame again (its answer was lost): the
    relay forwards the copy, and the recipient answers it (here 409 `replayed`,
    its own replay cache), as on a direct link."""
    a = codec(ids, roster, "a")

    async def scenario() -> None:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            sent = frame(a, "b")
            assert (await post(url, sent))[0] == 200
            status, body = await post(url, sent)
            assert (status, reason(body)) == (409, "replayed")
            assert b.received == [sent, sent]
            await b.close()

    asyncio.run(scenario())


def test_an_old_copy_is_refused_stale_before_it_waits_in_its_senders_queue(ids, roster):
    """A copy of a frame older than the clock skew (60 s here) is refused
    `stale_timestamp` from its signed header alone, before it takes a place in
    its sender's queue: before, it waited its turn there first."""
    a = codec(ids, roster, "a")

    async def scenario() -> None:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            old = frame(a, "b", timestamp_ms=int((time.time() - 120) * 1000))
            status, body = await post(url, old)
            assert (status, reason(body)) == (401, "stale_timestamp")
            assert "a" not in server.admission.gates  # it never reached a's gate
            assert b.received == []
            await b.close()

    asyncio.run(scenario())


def test_forwarded_ids_are_bounded_and_expire() -> None:
    """What the relay remembers per sender: at most its limit, the oldest
    dropped first, and none past its timestamp + the clock skew."""
    from node.relay_admission import Forwarded

    now = int(time.time() * 1000)
    record = Forwarded(skew_ms=60_000, limit=3)
    for i in range(5):
        record.add("a", bytes([i]) * 16, now)
    assert [record.seen("a", bytes([i]) * 16) for i in range(5)] == [False, False, True, True, True]
    record = Forwarded(skew_ms=60_000)
    record.add("a", b"\xff" * 16, now - 120_000)  # valid until a minute ago
    record.add("a", b"\xfe" * 16, now)
    assert not record.seen("a", b"\xff" * 16)  # expired: gone
    assert record.seen("a", b"\xfe" * 16) and not record.seen("b", b"\xfe" * 16)
    record.forget({})  # a roster that no longer lists a
    assert not record.seen("a", b"\xfe" * 16)
