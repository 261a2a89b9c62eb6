"""Requests held open through a relay do not starve their sender's other
messages (rv_net review). A request is held at its site until it can be
answered (a model not ready yet); through one relay, 8 of them (one per
outbound-only neighbour, or a secure sum's phase to 8 members) took all 8
connections of the sender's one pool to that relay, and all 8 of its places
at the relay, so every other message of the sender through that relay,
heartbeats included, waited until it timed out. Real relay and client on
127.0.0.1, real signed, encrypted frames (the helpers of tests/test_relay.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import test_relay
from test_relay import FED, RelaySite, relay

from node.transport_client import MessageClient
from p2pfl.config import TransportSection
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec

HELD = [f"c{i}" for i in range(8)]


def _m_and_relayed_c() -> tuple[dict[str, LocalIdentity], Roster, WireCodec]:
    """m (an address) and c (behind relay r1): their identities, the roster,
    and m's codec."""
    ids = {n: LocalIdentity.generate(n) for n in ("m", "c")}
    card_c = dataclasses.replace(ids["c"].card(), address=None, via=("r1",))
    roster = Roster([ids["m"].card("127.0.0.1:7001"), card_c], None, relays={"r1": "x:1"})
    return ids, roster, WireCodec(ids["m"], roster, FED, require_encryption=True)


def _held_until(ready: asyncio.Event):
    """A site's answer held until `ready`, then `not_ready` (its model is not
    ready yet)."""

    async def held(body: bytes) -> tuple[int, bytes]:
        await ready.wait()
        return 404, b'{"reason": "not_ready"}'

    return held


def test_eight_requests_held_through_a_relay_do_not_stall_a_heartbeat_to_another_site():
    ids = {n: LocalIdentity.generate(n) for n in ("a", "b", *HELD)}
    behind = [dataclasses.replace(ids[n].card(), address=None, via=("r1",)) for n in ("b", *HELD)]
    roster = Roster([ids["a"].card("127.0.0.1:7001"), *behind], None, relays={"r1": "x:1"})
    a = WireCodec(ids["a"], roster, FED, require_encryption=True)

    async def scenario() -> None:
        ready = asyncio.Event()
        held = _held_until(ready)  # its model is not ready yet
        async with relay(roster) as (server, url):
            sites = [RelaySite(ids["b"], roster)] + [RelaySite(ids[n], roster, held) for n in HELD]
            for site in sites:
                await site.connect(url)
            client = MessageClient(TransportSection(), None)
            for name in ("b", *HELD):
                client.set_relayed_peer(name, [url.removeprefix("http://")])
            pulls = [
                asyncio.create_task(
                    client.post(n, a.encode("req:model", n, {}, encrypt=True), retries=0, held=True)
                )
                for n in HELD
            ]
            try:
                await test_relay.until(lambda: sum(len(s.received) for s in sites[1:]) == 8)
                beat = a.encode("heartbeat", "b", {"round": 1}, encrypt=True)
                status, _ = await client.post("b", beat, timeout=4, retries=0)
                assert status == 200
            finally:
                ready.set()
                await asyncio.gather(*pulls, return_exceptions=True)
                await client.close()
                for site in sites:
                    await site.close()
            assert server.snapshot()["sites"]["a"]["active"] == 0  # no place leaked

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_flooder_has_no_more_frames_at_a_site_at_once_than_its_places():
    """Freed once sent, a frame's place no longer bounded how many of its
    sender's frames waited at their recipient: a flooder's 16 connections had
    16 frames at once ahead of an honest heartbeat there (8 before), which
    waited about twice as long (bench/attacks relay_flood). Its 9th frame now
    waits at the relay, in its place, until one of the 8 is answered, and the
    site still opens only growing stream ids (node/relay_tunnel.py drops a
    lower one)."""
    ids, roster, m = _m_and_relayed_c()

    async def scenario() -> None:
        ready = asyncio.Event()
        c = RelaySite(ids["c"], roster)

        async def slow(body: bytes) -> tuple[int, bytes]:  # a site busy with the flood
            await ready.wait()
            return await c.verify(body)

        c.answer = slow
        opened: list[int] = []
        one = c._one

        async def recorded(stream_id: int, body: bytes) -> None:
            opened.append(stream_id)
            await one(stream_id, body)

        c._one = recorded  # type: ignore[method-assign]
        async with relay(roster, rate_limit_per_s=100) as (server, url):
            await c.connect(url)
            frames = [m.encode("heartbeat", "c", {"round": i}, encrypt=True) for i in range(12)]
            posts = [asyncio.create_task(test_relay.post(url, f.to_bytes())) for f in frames]
            try:
                await test_relay.until(lambda: len(c.received) >= 8)
                await asyncio.sleep(0.3)
                assert len(c.received) == 8  # the other 4 wait at the relay
                ready.set()
                answers = await asyncio.gather(*posts)
                assert [status for status, _ in answers] == [200] * 12
                assert len(c.received) == 12 and opened == sorted(opened)
            finally:
                ready.set()
                await asyncio.gather(*posts, return_exceptions=True)
                await c.close()
            assert server.snapshot()["sites"]["m"]["active"] == 0  # no place leaked

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_frame_past_its_senders_frames_held_at_a_site_waits_no_longer_than_in_its_queue():
    """The 9th frame of a sender to a site that holds 8 of them waits in its
    place only as long as a frame waits in its sender's queue, then is refused
    503 queue_full and its place is free: held frames cannot keep the sender's
    places for longer than that."""
    ids, roster, m = _m_and_relayed_c()

    async def scenario() -> None:
        ready = asyncio.Event()
        c = RelaySite(ids["c"], roster, _held_until(ready))
        async with relay(roster) as (server, url):
            server.admission.wait_s = 0.3
            await c.connect(url)
            frames = [m.encode("req:model", "c", {}, encrypt=True) for _ in range(9)]
            posts = [asyncio.create_task(test_relay.post(url, f.to_bytes())) for f in frames]
            try:
                await test_relay.until(lambda: len(c.received) >= 8)
                done, _ = await asyncio.wait(posts, timeout=5, return_when="FIRST_COMPLETED")
                (status, body), *_ = [t.result() for t in done]
                assert (status, test_relay.reason(body)) == (503, "queue_full")
                assert len(c.received) == 8
                assert server.snapshot()["sites"]["m"]["active"] == 0  # its place is free
            finally:
                ready.set()
                await asyncio.gather(*posts, return_exceptions=True)
                await c.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_frames_waiting_for_their_turn_at_a_site_leave_nothing_behind():
    """A hostile review (rv2) of the wait for a turn at a site: a frame whose
    sender went away mid-wait (its handler cancelled), one refused after the
    wait, and one waiting when the site's connection failed each give back
    what they held: no count of the gate's frames at the site, no waiter's
    event, no place of the sender's, no slot of the site's. The one waiting
    when the connection failed answers at once (relay_lost), not after the
    wait."""
    ids, roster, m = _m_and_relayed_c()

    async def scenario() -> None:
        ready = asyncio.Event()
        c = RelaySite(ids["c"], roster, _held_until(ready))
        async with relay(roster, rate_limit_per_s=100) as (server, url):
            server.admission.wait_s = 30.0  # the cancelled ones are surely mid-wait
            await c.connect(url)
            link = server.links["c"]
            frames = [m.encode("req:model", "c", {}, encrypt=True) for _ in range(12)]
            posts = [asyncio.create_task(test_relay.post(url, f.to_bytes())) for f in frames[:8]]
            try:
                await test_relay.until(lambda: len(c.received) >= 8)
                # two more, whose senders go away while they wait for a turn
                gone = [
                    asyncio.create_task(test_relay.post(url, f.to_bytes())) for f in frames[8:10]
                ]
                await test_relay.until(lambda: link.pending == 10)
                for task in gone:
                    task.cancel()
                await asyncio.gather(*gone, return_exceptions=True)
                await test_relay.until(lambda: link.pending == 8)
                assert link.sent_by_gate == {"m": 8}
                assert server.admission.gates["m"].active == 0  # every place free again
                # one refused after its wait: its waiter's event stays until a frame is answered
                server.admission.wait_s = 0.3
                status, body = await test_relay.post(url, frames[10].to_bytes())
                assert (status, test_relay.reason(body)) == (503, "queue_full")
                assert link.pending == 8 and link.sent_by_gate == {"m": 8}
                # one waiting when the site's connection fails: answered at once
                server.admission.wait_s = 30.0
                last = asyncio.create_task(test_relay.post(url, frames[11].to_bytes()))
                await test_relay.until(lambda: link.pending == 9)
                began = asyncio.get_running_loop().time()
                await c.close()
                status, body = await asyncio.wait_for(last, 10)
                assert asyncio.get_running_loop().time() - began < 5
                assert (status, test_relay.reason(body)) == (502, "relay_lost")
                await asyncio.gather(*posts, return_exceptions=True)
                assert link.pending == 0 and link.pending_bytes == 0
                assert link.sent_by_gate == {} and link._room == {}
                assert link.by_sender == {} and link.bytes_by_sender == {}
                assert server.admission.gates["m"].active == 0
            finally:
                ready.set()
                await asyncio.gather(*posts, return_exceptions=True)
                await c.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
