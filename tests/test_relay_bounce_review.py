"""A relayed link is not sent off a relay that works by one honest refusal
(rv_net2 review). Every answer but a 200 moved a relayed link to the peer's
next relay (rv_net review: a refusal is unsigned, maybe the relay's own), so
one honest `not_ready` from the peer, through the relay that carried its
heartbeats, sent the next attempt to a relay that stalls, and the request
waited there until it timed out. Fake relays on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from relay_review_util import serve_relay
from test_relay_failover_review import FAST, fake_relay, outbound_of
from test_upload_fairness import codec

from node.outbound import answer_id
from node.transport_client import MessageClient
from p2pfl.config import TransportSection
from p2pfl.secure.wire import PREFIX_LEN, Header


def _header(frame: bytes) -> Header:
    n = int.from_bytes(frame[4:8], "big")
    return Header.unpack(frame[PREFIX_LEN : PREFIX_LEN + n])


def _answering(bob, asked: list[str], not_ready_first: bool):
    """A relay that passes heartbeats and hands back bob's answer to each
    request (his own `not_ready` to the first, if `not_ready_first`)."""

    async def good(request: web.Request) -> web.Response:
        header = _header(await request.read())
        if not header.kind.startswith("req:"):
            return web.json_response({"ok": True})  # a heartbeat, through
        asked.append("good")
        if not_ready_first and len(asked) == 1:
            return web.json_response({"reason": "not_ready"}, status=404)  # bob's own
        rid = answer_id(bob, "alice", header.msg_id)
        answer = bob.encode("resp:model", "alice", {"w": 1}, round=0, msg_id=rid)
        return web.Response(body=answer.to_bytes(), content_type="application/octet-stream")

    return good


def _stalling(asked: list[str], release: asyncio.Event):
    async def stall(request: web.Request) -> web.Response:
        await request.read()
        asked.append("stall")
        await release.wait()
        return web.json_response({"reason": "relay_lost"}, status=502)

    return stall


def _refusing_but_heartbeats(hits: list[str], status: int, reason: str):
    """A relay that passes heartbeats and refuses everything else
    `status` `reason`, noting "bad" in `hits` for each refusal."""

    async def selective(request: web.Request) -> web.Response:
        if _header(await request.read()).kind == "heartbeat":
            return web.json_response({"ok": True})
        hits.append("bad")
        return web.json_response({"reason": reason}, status=status)

    return selective


async def _bob_via(first, second, section: TransportSection):
    """Two fake relays of bob's, in that order, and a client that reaches him."""
    a, r1 = await serve_relay(first)
    b, r2 = await serve_relay(second)
    client = MessageClient(section, None)
    client.set_relayed_peer("bob", [r1, r2])
    return a, b, client


async def _ask_bob_past_a_staller(tmp_path, identities, roster, not_ready_first, before=None):
    """alice sends bob a heartbeat through his answering relay (`_answering`),
    calls `before(alice)` if given, then asks him for his model, his stalling
    relay next in line; his answer (or the reason for none) and the relays asked."""
    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    asked: list[str] = []
    release = asyncio.Event()

    g, s, client = await _bob_via(
        _answering(bob, asked, not_ready_first),
        _stalling(asked, release),
        TransportSection(request_timeout_s=5.0, **FAST),
    )
    out = outbound_of(tmp_path, alice, client)
    try:
        assert (await client.post("bob", alice.encode("heartbeat", "bob", {})))[0] == 200
        if before is not None:
            before(alice)
        try:
            got = await out.request("bob", "model", {}, 2.0)
        except Exception as exc:  # noqa: BLE001 - PeerUnavailable, reported
            got = getattr(exc, "reason", repr(exc))
    finally:
        release.set()
        await client.close()
        await g.cleanup()
        await s.cleanup()
    return got, asked


async def test_one_honest_not_ready_does_not_send_a_request_to_a_stalling_relay(
    tmp_path, identities, roster
):
    got, asked = await _ask_bob_past_a_staller(tmp_path, identities, roster, True)
    assert got == {"w": 1}, (got, asked)
    assert asked == ["good", "good"], asked


async def test_a_relay_passing_heartbeats_but_refusing_the_rest_is_left_soon(identities, roster):
    """The other side: a relay that forwards heartbeats (so it answered 200
    lately) and answers everything else 429 holds the link for STAY_REFUSALS
    answers at most; then the peer's next relay carries its messages."""
    from node.transport_client import STAY_REFUSALS

    alice = codec(identities, roster, "alice")
    hits: list[str] = []

    async def good(request: web.Request) -> web.Response:
        await request.read()
        hits.append("good")
        return web.json_response({"ok": True})

    selective = _refusing_but_heartbeats(hits, 429, "rate_limited")
    b, g, client = await _bob_via(selective, good, TransportSection(**{**FAST, "retries": 0}))
    answers = []
    try:
        assert (await client.post("bob", alice.encode("heartbeat", "bob", {})))[0] == 200
        for _ in range(STAY_REFUSALS + 1):
            try:
                answers.append((await client.post("bob", alice.encode("m", "bob", {})))[0])
            except Exception as exc:  # noqa: BLE001 - TransportError, reported
                answers.append(getattr(exc, "reason", repr(exc)))
    finally:
        await client.close()
        await b.cleanup()
        await g.cleanup()
    assert hits == ["bad"] * STAY_REFUSALS + ["good"], (hits, answers)


async def test_heartbeats_between_the_refusals_do_not_keep_the_link_on_that_relay(
    identities, roster
):
    """Read-back review: the heartbeat loop's 200s come between a node's other
    messages, and each reset the count of refusals, so a relay that forwards
    heartbeats but refuses the rest, one message between two heartbeats, held
    the link for good. The refusals count until the URL's next non-heartbeat
    200 (or a move); a heartbeat's 200 only says the relay works."""
    from node.transport_client import STAY_REFUSALS

    alice = codec(identities, roster, "alice")
    hits: list[str] = []

    async def good(request: web.Request) -> web.Response:
        if _header(await request.read()).kind != "heartbeat":
            hits.append("good")
        return web.json_response({"ok": True})

    selective = _refusing_but_heartbeats(hits, 403, "forbidden")
    b, g, client = await _bob_via(selective, good, TransportSection(**{**FAST, "retries": 0}))
    try:
        for _ in range(STAY_REFUSALS + 1):
            beat = alice.encode("heartbeat", "bob", {})
            assert (await client.post("bob", beat, probe=True))[0] == 200
            await client.post("bob", alice.encode("m", "bob", {}))
    finally:
        await client.close()
        await b.cleanup()
        await g.cleanup()
    assert hits == ["bad"] * STAY_REFUSALS + ["good"], hits


async def test_an_answer_refused_for_this_nodes_own_replay_state_does_not_move_the_link(
    tmp_path, identities, roster
):
    """Read-back review: an answer refused `before_restart` or
    `below_replay_floor` is bob's own, signed, and refused for this node's
    replay state (right after its restart, its marks ahead of bob's stamps):
    the request is asked again, as before. But every refused answer also moved
    the link (`answer_refused`, for a relay's forgery), so the next attempt
    went to a relay that stalls, and the request timed out there."""

    def floor_ahead(alice) -> None:  # the first answer is stamped at or below alice's replay floor
        alice.replay.floor_ms = int(time.time() * 1000) + 150

    got, asked = await _ask_bob_past_a_staller(tmp_path, identities, roster, False, floor_ahead)
    assert got == {"w": 1}, (got, asked)
    assert "stall" not in asked, asked


async def test_a_peer_removed_by_a_reload_while_asked_is_unavailable_not_a_wire_error(
    tmp_path, identities, roster
):
    """Read-back review: a request asks again after a failed attempt; a roster
    reload in between that removed the peer made the next attempt's answer id
    (`answer_id`, keyed with the pair's secret; and with encryption its
    encoding) raise WireError `unknown_sender` out of `request`, where every
    protocol expects PeerUnavailable."""
    from node.transport_client import TransportError
    from p2pfl.secure.identity import Roster

    alice = codec(identities, roster, "alice")
    client = MessageClient(TransportSection(request_timeout_s=5.0, **FAST), None)
    client.set_peer("bob", "127.0.0.1:9")
    out = outbound_of(tmp_path, alice, client)

    async def reloaded(peer, message, **_):  # type: ignore[no-untyped-def]
        alice.set_roster(Roster([c for c in roster.cards() if c.name != "bob"]))
        client.remove_peer("bob")
        raise TransportError(peer, "unreachable")

    client.post = reloaded  # type: ignore[method-assign]
    try:
        got = await out.request("bob", "model", {}, 2.0)
    except Exception as exc:  # noqa: BLE001 - reported
        got = type(exc).__name__
    finally:
        await client.close()
    assert got == "PeerUnavailable", got


async def test_forged_answers_to_concurrent_messages_move_the_link_once(
    tmp_path, identities, roster
):
    """Read-back review: a 200 whose acknowledgement does not verify moves the
    link off the relay that carried it (`answer_refused`), but it moved the
    link off the URL in use then: two pushes carried together by a relay that
    forges acknowledgements moved it to the good relay, then back to the forger."""
    alice = codec(identities, roster, "alice")
    forged: list[int] = []
    async with fake_relay(200, {"ok": True, "ack": "forged"}, forged) as r1:
        gate = asyncio.Event()

        async def good(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({"ok": True})

        g, r2 = await serve_relay(good)
        client = MessageClient(TransportSection(request_timeout_s=5.0, **FAST), None)
        client.set_relayed_peer("bob", [r1, r2])
        out = outbound_of(tmp_path, alice, client)
        real_post = client.post

        async def together(*args, **kwargs):  # type: ignore[no-untyped-def]
            answer = await real_post(*args, **kwargs)
            if len(forged) < 2:
                await gate.wait()  # both answered by the forger before either is checked
            gate.set()
            return answer

        client.post = together  # type: ignore[method-assign]
        try:
            got = await asyncio.gather(
                out.send_push("bob", "m", {}, 0),
                out.send_push("bob", "m", {}, 0),
                return_exceptions=True,
            )
            url = client.links["bob"].url
        finally:
            await client.close()
            await g.cleanup()
    assert [getattr(x, "reason", x) for x in got] == ["ack_unverified"] * 2, got
    assert url.startswith(f"http://{r2}"), (url, r1, r2)
