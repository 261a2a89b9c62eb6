"""Holes a hostile review found in the relay's front door (issue 31,
node/relay_admission.py), each with the attack that showed it. Real aiohttp
servers on 127.0.0.1 and real signed, encrypted frames (the helpers of
tests/test_relay.py); no timing bound tighter than a rate allows."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import aiohttp
import pytest
import test_relay
from test_relay import FED, RelaySite, codec, frame, relay, until
from test_relay_admission import a_burst_spent, timed_post

from node.relay_admission import Admission
from node.relay_wire import RELAY_MESSAGE_PATH
from p2pfl.config import RelaySettings
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec

ids = test_relay.ids  # the relay tests' shared fixtures (module scope)
roster = test_relay.roster


def without(roster: Roster, name: str) -> Roster:
    return Roster([c for c in roster.cards() if c.name != name], None, relays=roster.relays)


def rotated(roster: Roster, name: str, key: LocalIdentity, *, graceful: bool = False) -> Roster:
    """The roster with `name`'s card for another key: the old one revoked, or
    (graceful) still accepted as its previous key for a day."""
    card = roster.sites[name].card
    new = dataclasses.replace(key.card(card.address), via=card.via)
    if graceful:
        prev = {"previous_signing_key": card.signing_key, "previous_valid_until": time.time() + 1e5}
        new = dataclasses.replace(new, **prev)
    return Roster(
        [new if c.name == name else c for c in roster.cards()], None, relays=roster.relays
    )


@pytest.mark.parametrize("change", ["removed", "key_rotated"])
def test_frames_waiting_when_their_sender_is_revoked_are_not_forwarded(ids, roster, change):
    """Attack: a site over its rate parks frames in its queue, then the operator
    revokes it (SIGHUP: its card removed, or its key replaced). Before the fix,
    `forget` dropped the gate from the table while the frames still waited on
    it; each one, its turn come, skipped the roster (the sender is not checked
    again) and took a token from a *new* gate with a full burst, so all of them
    were forwarded after the revocation (and the revoked name had a gate again).
    Now a revoked gate lets no waiting frame through: each is refused 403
    `unknown_sender`, counted, and no gate for it is made again."""
    a = codec(ids, roster, "a")
    after = (
        without(roster, "a")
        if change == "removed"
        else rotated(roster, "a", LocalIdentity.generate("a"))
    )

    async def scenario() -> None:
        async with a_burst_spent(ids, roster, a) as (server, url, b, s):
            received = len(b.received)
            queued = [asyncio.create_task(timed_post(s, url, frame(a, "b"))) for _ in range(4)]
            await until(lambda: server.admission.gates["a"].waiting == 4, 30)
            server.set_roster(after)
            answers = await asyncio.gather(*queued)
            assert [x[:2] for x in answers] == [(403, "unknown_sender")] * 4, answers
            assert len(b.received) == received  # none reached b
            assert server.snapshot()["refusals"] == {"unknown_sender": 4}
            if change == "removed":
                assert "a" not in server.admission.gates

    asyncio.run(scenario())


@pytest.mark.parametrize("change", ["other_removed", "key_rotated_gracefully"])
def test_a_reload_that_keeps_a_sender_keeps_its_gate_and_its_waiting_frames(ids, roster, change):
    """The other side of the fix: a reload that leaves a's keys valid (another
    site removed; or a's key rotated with the old one as its previous key)
    keeps a's gate, spent bucket included: a's waiting frames are forwarded in
    their turn, and the reload gives a no fresh burst."""
    a = codec(ids, roster, "a")
    new_key = LocalIdentity.generate("a")
    after = (
        without(roster, "f")
        if change == "other_removed"
        else rotated(roster, "a", new_key, graceful=True)
    )

    async def scenario() -> None:
        async with a_burst_spent(ids, roster, a) as (server, url, _, s):
            gate = server.admission.gates["a"]
            queued = [asyncio.create_task(timed_post(s, url, frame(a, "b"))) for _ in range(3)]
            await until(lambda: gate.waiting == 3, 30)
            server.set_roster(after)
            assert server.admission.gates["a"] is gate
            answers = await asyncio.gather(*queued)
            assert [x[0] for x in answers] == [200] * 3, answers
            assert gate.delayed >= 3 and gate.bucket.tokens < 1.0

    asyncio.run(scenario())


def test_a_forger_is_refused_before_any_queue_with_one_verify_per_frame(ids, roster):
    """A stranger that signs with its own key and claims a's name while a's
    queue is full is refused 401 `bad_signature` at once (never 429, never held):
    it learns nothing of a's queue and holds none of a's places."""
    a = codec(ids, roster, "a")
    mallory = WireCodec(LocalIdentity.generate("a"), roster, FED, max_message_bytes=8 << 20)

    async def scenario() -> None:
        async with relay(roster, rate_limit_per_s=0.01) as (server, url):
            server.admission = Admission(server.settings, wait_s=60)
            limit = server.admission.queue_limit
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            connector = aiohttp.TCPConnector(limit=limit + 8)
            async with aiohttp.ClientSession(connector=connector) as s:
                for _ in range(10):
                    assert (await timed_post(s, url, frame(a, "b")))[0] == 200
                queued = [
                    asyncio.create_task(timed_post(s, url, frame(a, "b"))) for _ in range(limit)
                ]
                await until(lambda: server.admission.gates["a"].waiting == limit, 30)
                forged = [await timed_post(s, url, frame(mallory, "b")) for _ in range(5)]
                assert [x[:2] for x in forged] == [(401, "bad_signature")] * 5
                assert server.admission.gates["a"].waiting == limit
                for task in queued:
                    task.cancel()
                await asyncio.gather(*queued, return_exceptions=True)
                await until(lambda: server.admission.gates["a"].waiting == 0, 30)
                assert server.admission.gates["a"].active == 0
            await b.close()

    asyncio.run(scenario())


async def raw_post(url: str, body: bytes, *, send: int, then: str, hold_s: float) -> str:
    """One POST on a bare socket: the HTTP head and `send` bytes of `body`, then
    `then`: "close" (hang up after hold_s), "mute" (all sent, the answer never
    read, hang up after hold_s). What the relay sees of a hostile sender."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST {RELAY_MESSAGE_PATH} HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body[:send])
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    await asyncio.sleep(hold_s)
    writer.transport.abort()
    return then


def test_no_way_out_of_the_queue_leaks_a_place_or_a_slot(ids, roster):
    """Attack: one roster site mixes every way of leaving the relay mid-way, 60
    frames at once at 5 frames/s (a burst of 10), the recipient answering
    slowly (each forward holds its slot 0.3 s): POSTs cancelled by the client
    (hung up while queued, forwarding or answered), frames cut mid-payload
    while holding an active place, frames sent whole whose answer is never
    read, frames stalled until the relay's idle timeout, and plain ones. After
    it all, a's gate is back to nothing admitted, nothing waiting, its lock
    free; b holds no slot of a's; and a's next frame goes through at once."""
    a = codec(ids, roster, "a")

    async def slow(data: bytes) -> tuple[int, bytes]:
        await asyncio.sleep(0.3)
        return 200, b'{"ok": true}'

    async def scenario() -> None:
        async with relay(roster, rate_limit_per_s=5, read_idle_timeout_s=1) as (server, url):
            b = RelaySite(ids["b"], roster, answer=slow)
            await b.connect(url)
            big = [frame(a, "b", {"blob": "x" * 200_000}) for _ in range(60)]
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
                jobs: list[asyncio.Task[object]] = []
                for i, body in enumerate(big):
                    kind = i % 5
                    if kind == 0:  # cancelled by its client at some point
                        job = asyncio.create_task(timed_post(s, url, body))
                        asyncio.get_running_loop().call_later(0.05 * (i % 40), job.cancel)
                    elif kind == 1:  # hung up mid-payload
                        job = asyncio.create_task(
                            raw_post(url, body, send=len(body) // 2, then="close", hold_s=0.4)
                        )
                    elif kind == 2:  # whole, the answer never read
                        job = asyncio.create_task(
                            raw_post(url, body, send=len(body), then="mute", hold_s=1.5)
                        )
                    elif kind == 3:  # stalled mid-payload past the idle timeout
                        job = asyncio.create_task(
                            raw_post(url, body, send=len(body) // 3, then="close", hold_s=3.0)
                        )
                    else:
                        job = asyncio.create_task(timed_post(s, url, body))
                    jobs.append(job)
                await asyncio.gather(*jobs, return_exceptions=True)
                gate = server.admission.gates["a"]
                await until(lambda: gate.active == 0 and gate.waiting == 0, 30)
                assert not gate.lock.locked()
                link = server.links["b"]
                await until(lambda: link.pending == 0 and not link.by_sender, 30)
                await asyncio.sleep(1.0)  # a token for the next one
                last = await timed_post(s, url, frame(a, "b"))
                assert last[0] == 200, last
                assert gate.active == 0 and gate.waiting == 0
            snap = server.snapshot()
            print("leaks:", snap["refusals"], server.admission.row("a"))
            # the attack reached the places it aimed at: frames waited, were cut mid-payload
            assert gate.delayed > 0 and snap["refusals"].get("truncated", 0) > 0, snap
            await b.close()

    asyncio.run(scenario())


def test_a_newcomer_does_not_pass_a_frame_already_waiting_in_its_senders_queue():
    """Attack on the queue's order (one sender, one place: max_active 1): A
    waits for the place, B queues behind A. The place frees; A takes it,
    releases the queue's lock (B is woken, has not run yet) and is refused at
    once by the relay's checks (`_check`: not_connected, stale_timestamp... no
    await, its place freed). A newcomer C that the loop runs before B found the
    lock free and took the fast path ahead of B (it asked `lock.locked()`, not
    whether anything waits): repeated, newcomers pass the oldest frame until it
    is refused after RATE_WAIT_S. Now C queues behind B: first come, first served."""
    settings = RelaySettings(rate_limit_per_s=1000)

    async def scenario() -> list[str]:
        admission = Admission(settings, max_active=1, wait_s=30)
        order: list[str] = []
        first = await admission.enter("a")
        assert not isinstance(first, str)
        go = asyncio.Event()

        async def frame(name: str, *, after: asyncio.Event | None = None) -> None:
            if after is not None:
                await after.wait()
            turn = await admission.enter("a")
            assert not isinstance(turn, str)
            order.append(name)
            if name != "A":
                await asyncio.sleep(0)  # forwarded: answered later
            turn.leave()  # A: refused by the checks at once

        a_task = asyncio.create_task(frame("A"))
        await until(lambda: admission.gates["a"].waiting == 1, 5)
        b_task = asyncio.create_task(frame("B"))
        await until(lambda: admission.gates["a"].waiting == 2, 5)
        c_task = asyncio.create_task(frame("C", after=go))
        await asyncio.sleep(0)  # C waits for its bytes
        first.leave()  # A is woken: it runs next in the loop...
        go.set()  # ...and C's request arrives right behind it
        await asyncio.gather(a_task, b_task, c_task)
        gate = admission.gates["a"]
        assert gate.active == 0 and gate.waiting == 0 and not gate.lock.locked()
        return order

    assert asyncio.run(scenario()) == ["A", "B", "C"]


def test_a_waiter_that_times_out_leaves_the_queue_sound_for_the_next():
    """Frames that give up (RATE_WAIT_S, here 0.3 s) at the head of the queue
    (waiting for a place, the `freed` event cleared) and behind it (waiting
    for the lock) leave no trace: the lock is free, nothing counts as waiting
    or admitted, and the next frame takes the place as soon as it frees."""
    settings = RelaySettings(rate_limit_per_s=1000)

    async def scenario() -> None:
        admission = Admission(settings, max_active=1, wait_s=0.3)
        first = await admission.enter("a")
        assert not isinstance(first, str)
        gave_up = await asyncio.gather(*(admission.enter("a") for _ in range(3)))
        assert gave_up == ["rate_limited"] * 3
        gate = admission.gates["a"]
        assert gate.active == 1 and gate.waiting == 0 and not gate.lock.locked()
        later = asyncio.create_task(admission.enter("a"))
        await until(lambda: gate.waiting == 1, 5)
        first.leave()
        turn = await later
        assert turn is gate and gate.active == 1 and gate.waiting == 0
        turn.leave()
        assert gate.active == 0 and not gate.lock.locked()

    asyncio.run(scenario())
