"""The relay's front door per sender (issue 31, node/relay_admission.py): a
frame over its sender's rate waits its turn in that sender's own queue instead
of being refused at once; a frame that cannot get a token in time is refused
`rate_limited`, a sender with a full queue `too_many_connections`, each with
its counter in /status; and one sender's backlog never holds up another's
frame. Real aiohttp servers on 127.0.0.1 and real signed, encrypted frames;
bounds are lower bounds on time (a rate cannot be beaten, however loaded the
machine) or orderings, never a tight upper bound."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import test_relay
from test_relay import FED, RelaySite, codec, frame, reason, relay, until

from node.relay_admission import RATE_WAIT_S, Admission
from node.relay_wire import RELAY_MESSAGE_PATH
from p2pfl.config import RelaySettings
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec

ids = test_relay.ids  # the relay tests' shared fixtures (module scope)
roster = test_relay.roster


async def timed_post(
    session: aiohttp.ClientSession, url: str, body: bytes
) -> tuple[int, str | None, float, str | None]:
    """(status, reason, seconds, Connection header) of one POST through the relay."""
    started = time.monotonic()
    async with session.post(url + RELAY_MESSAGE_PATH, data=body) as r:
        data = await r.read()
        return r.status, reason(data), time.monotonic() - started, r.headers.get("Connection")


@contextlib.asynccontextmanager
async def a_burst_spent(
    ids: dict[str, LocalIdentity], roster: Roster, a: WireCodec, connections: int = 16
) -> AsyncIterator[tuple[Any, str, RelaySite, aiohttp.ClientSession]]:
    """A relay at 2 frames/s whose waits last 60 s, b connected to it, and a's
    burst of 10 spent: (server, url, b, a session of `connections` connections)."""
    async with relay(roster, rate_limit_per_s=2) as (server, url):
        server.admission = Admission(server.settings, wait_s=60)
        b = RelaySite(ids["b"], roster)
        await b.connect(url)
        connector = aiohttp.TCPConnector(limit=connections)
        async with aiohttp.ClientSession(connector=connector) as s:
            for _ in range(10):  # a's burst
                assert (await timed_post(s, url, frame(a, "b")))[0] == 200
            yield server, url, b, s
        await b.close()


def test_a_sender_over_its_rate_waits_its_turn_and_is_not_refused(ids, roster):
    """16 frames at once from a sender allowed 5/s (a burst of 10): none is
    refused; the 6 past the burst wait for tokens, so the last is answered no
    sooner than 6 / 5 s after the first (the rate cannot be beaten)."""
    a = codec(ids, roster, "a")

    async def scenario() -> None:
        async with relay(roster, rate_limit_per_s=5) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            frames = [frame(a, "b") for _ in range(16)]
            connector = aiohttp.TCPConnector(limit=16)
            async with aiohttp.ClientSession(connector=connector) as s:
                started = time.monotonic()
                answers = await asyncio.gather(*(timed_post(s, url, f) for f in frames))
                elapsed = time.monotonic() - started
            assert [x[0] for x in answers] == [200] * 16, answers
            assert elapsed >= 0.9 * 6 / 5, elapsed
            snap = server.snapshot()
            row = snap["sites"]["a"]
            assert row["messages_in"] == 16 and row["waiting"] == 0
            assert row["delayed"] >= 6 and row["waited_s"] > 0
            assert "rate_limited" not in snap["refusals"]
            await b.close()

    asyncio.run(scenario())


def test_a_flooders_burst_is_a_quarter_second_of_its_rate() -> None:
    """A sender's fresh gate at the default 200 frames/s lets at most a quarter
    second's frames through at once (50, plus what the rate refills while it
    asks), not a whole second's: a whole second's burst put twice the rate on
    the receiver in a flood's first second. At low rates the floor of 10 holds."""
    admission = Admission(RelaySettings())
    assert admission.rate == 200
    bucket = admission.gate("m").bucket
    started, taken = time.monotonic(), 0
    while bucket.take() and taken < 1000:
        taken += 1
    elapsed = time.monotonic() - started
    assert 50 <= taken <= 50 + 200 * elapsed + 1, (taken, elapsed)
    assert Admission(RelaySettings(rate_limit_per_s=5)).gate("m").bucket.burst == 10


def test_a_frame_that_cannot_get_a_token_in_time_is_refused_rate_limited_late(ids, roster):
    """At 1 frame/s with the burst spent, 8 more frames at once: tokens come
    about 1 s apart, so only the first few make it within RATE_WAIT_S; the
    others are refused 429 `rate_limited`, counted, and only after waiting (a
    flooder's connection stays busy meanwhile instead of sending its next one)."""
    a = codec(ids, roster, "a")

    async def scenario() -> None:
        async with relay(roster, rate_limit_per_s=1) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as s:
                burst = await asyncio.gather(
                    *(timed_post(s, url, frame(a, "b")) for _ in range(10))
                )
                assert [x[0] for x in burst] == [200] * 10
                late = await asyncio.gather(*(timed_post(s, url, frame(a, "b")) for _ in range(8)))
            refused = [x for x in late if x[0] != 200]
            assert all(x[:2] == (429, "rate_limited") for x in refused), late
            assert len(refused) >= 3, late
            assert all(x[2] >= 0.75 * RATE_WAIT_S for x in refused), late
            snap = server.snapshot()
            assert snap["refusals"]["rate_limited"] == len(refused)
            assert snap["sites"]["a"]["messages_in"] == 10 + 8 - len(refused)
            assert snap["sites"]["a"]["waiting"] == 0
            await b.close()

    asyncio.run(scenario())


def test_a_sender_with_a_full_queue_is_refused_too_many_connections_and_cut(ids, roster):
    """A sender whose queue holds `queue_limit` frames (4 x the 8 connections a
    node opens to one host) has its next frame refused at once, 429
    `too_many_connections`, counted, and that connection closed; another
    sender is not affected."""
    a, f = codec(ids, roster, "a"), codec(ids, roster, "f")

    async def scenario() -> None:
        # a's burst is its last: its queue stays full while the test looks
        async with relay(roster, rate_limit_per_s=0.01) as (server, url):
            server.admission = Admission(server.settings, wait_s=60)
            limit = server.admission.queue_limit
            assert limit == 32
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            connector = aiohttp.TCPConnector(limit=limit + 8)
            async with aiohttp.ClientSession(connector=connector) as s:
                for _ in range(10):  # the burst
                    assert (await timed_post(s, url, frame(a, "b")))[0] == 200
                queued = [
                    asyncio.create_task(timed_post(s, url, frame(a, "b"))) for _ in range(limit)
                ]
                await until(lambda: server.admission.gates["a"].waiting == limit, 30)
                extra = [await timed_post(s, url, frame(a, "b")) for _ in range(3)]
                assert [x[:2] for x in extra] == [(429, "too_many_connections")] * 3
                assert all(x[3] == "close" for x in extra), extra
                other = await timed_post(s, url, frame(f, "b"))
                assert other[0] == 200, other
                snap = server.snapshot()
                assert snap["refusals"]["too_many_connections"] == 3
                assert snap["sites"]["a"]["waiting"] == limit
                assert snap["sites"]["f"]["messages_in"] == 1
                for task in queued:
                    task.cancel()
                await asyncio.gather(*queued, return_exceptions=True)
            await b.close()

    asyncio.run(scenario())


def test_one_senders_backlog_does_not_hold_up_another_senders_frame(ids, roster):
    """Fairness: a's frames queue behind a's own rate only. While 20 of a's
    frames wait (at 2/s they need 10 s), f's frame to the same site goes
    through, and is answered while a's queue is still not empty."""
    a, f = codec(ids, roster, "a"), codec(ids, roster, "f")

    async def scenario() -> None:
        async with a_burst_spent(ids, roster, a, connections=40) as (server, url, _, s):
            backlog = [asyncio.create_task(timed_post(s, url, frame(a, "b"))) for _ in range(20)]
            await until(lambda: server.admission.gates["a"].waiting >= 15, 30)
            mine = await timed_post(s, url, frame(f, "b"))
            still_waiting = server.admission.gates["a"].waiting
            assert mine[0] == 200, mine
            assert still_waiting >= 5, still_waiting  # a's queue was still there
            for task in backlog:
                task.cancel()
            await asyncio.gather(*backlog, return_exceptions=True)

    asyncio.run(scenario())


def test_a_forger_claiming_a_throttled_sender_takes_none_of_its_tokens(ids, roster):
    """A frame that claims a's name with another key is refused 401
    bad_signature before a's queue: while a's tokens are spent it never waits
    there (a's gate delays none of it), takes no token, and a's next frame
    goes through."""
    a = codec(ids, roster, "a")
    mallory = WireCodec(LocalIdentity.generate("a"), roster, FED, max_message_bytes=8 << 20)

    async def scenario() -> None:
        async with relay(roster, rate_limit_per_s=4) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            async with aiohttp.ClientSession() as s:
                for _ in range(10):
                    assert (await timed_post(s, url, frame(a, "b")))[0] == 200
                delayed = server.admission.gates["a"].delayed
                forged = [await timed_post(s, url, frame(mallory, "b")) for _ in range(5)]
                assert [x[:2] for x in forged] == [(401, "bad_signature")] * 5
                assert server.admission.gates["a"].delayed == delayed  # none queued
                honest = await timed_post(s, url, frame(a, "b"))
                assert honest[0] == 200, honest
            snap = server.snapshot()
            assert snap["refusals"] == {"bad_signature": 5}
            assert snap["sites"]["a"]["messages_in"] == 11
            await b.close()

    asyncio.run(scenario())
