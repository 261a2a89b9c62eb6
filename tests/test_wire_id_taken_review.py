"""An id another sender used first (`id_taken`) must not cost the honest
sender its push (rv_net2 review). Ids are random, but a relay reads them in
the clear header, and an outbox sends a push again with its same id: a relay
run by a roster member (or its accomplice) saw alice's push to carol, answered
alice 502 (a drop, which a relay may do) and used the id first. Alice's link
then moved to carol's other, honest relay, as it should, but every copy of
the push now carries a taken id: carol refused it `id_taken` and alice gave
the push up, so one relay made carol unreachable for that push though her
other relay was fine. Now a push refused `id_taken` takes a fresh id (its
outbox record too) and is sent again. Fake relays and a real MessageServer
on 127.0.0.1 (the helpers of tests/test_upload_fairness.py).

And the answer ids: an answer named its request by a key in its payload,
which older requesters' strict schemas refused; its own id names it now,
keyed with the pair's secret so that no relay can take it first."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from fault_util import HttpReply
from relay_review_util import recording_server, serve_relay
from test_relay_failover_review import FAST, ask_bob_twice, outbound_of
from test_upload_fairness import codec, post

from node.relay_wire import RELAY_MESSAGE_PATH
from node.transport import MESSAGE_PATH, MessageServer
from node.transport_client import MessageClient
from p2pfl.config import TransportSection
from p2pfl.secure.wire import PREFIX_LEN, Header


def _msg_id(frame: bytes) -> bytes:
    n = int.from_bytes(frame[4:8], "big")
    return Header.unpack(frame[PREFIX_LEN : PREFIX_LEN + n]).msg_id


async def _push_to_carol(tmp_path, alice, relays, timeout_s, cleanups):
    """alice pushes a probe to carol through `relays`; the outcome (its
    reason, or "delivered") and the client, everything in `cleanups` closed."""
    client = MessageClient(TransportSection(request_timeout_s=timeout_s, **FAST), None)
    client.set_relayed_peer("carol", relays)
    out = outbound_of(tmp_path, alice, client)
    try:
        try:
            await out.send_push("carol", "probe", {"x": 1}, 0)
            got = "delivered"
        except Exception as exc:  # noqa: BLE001 - PeerUnavailable, reported
            got = getattr(exc, "reason", repr(exc))
    finally:
        await client.close()
        for cleanup in cleanups:
            await cleanup()
    return got, client


async def _use_its_id_first(port: int, bob, frame: bytes) -> tuple[bytes, HttpReply]:
    """A thieving relay's move: bob's heartbeat to carol (on `port`) under
    `frame`'s id, sent first; the id and carol's reply."""
    x = _msg_id(frame)
    return x, await post(port, bob.encode("heartbeat", "carol", {}, msg_id=x).to_bytes())


async def _push_past_a_thief(tmp_path, alice, thief, honest, server, timeout_s):
    """alice pushes to carol through relays answering `thief` then `honest`;
    the outcome, as `_push_to_carol` gives it, everything closed (carol's
    `server` too)."""
    bad, r1 = await serve_relay(thief)
    good, r2 = await serve_relay(honest)
    got, _ = await _push_to_carol(
        tmp_path, alice, [r1, r2], timeout_s, [bad.cleanup, good.cleanup, server.stop]
    )
    return got


async def test_a_push_whose_id_a_relay_used_first_is_delivered_through_the_other_relay(
    tmp_path, identities, roster
):
    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    carol = codec(identities, roster, "carol")
    processed: list[str] = []
    server, port = await recording_server(carol, processed)
    stolen: list[str] = []

    async def thief(request: web.Request) -> web.Response:
        x, reply = await _use_its_id_first(port, bob, await request.read())
        stolen.append(f"{x.hex()}:{reply.status}")
        return web.json_response({"reason": "relay_lost"}, status=502)

    async def honest(request: web.Request) -> web.Response:
        frame = await request.read()
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"http://127.0.0.1:{port}{MESSAGE_PATH}", data=frame) as r,
        ):
            return web.Response(status=r.status, body=await r.read(), headers=r.headers)

    got = await _push_past_a_thief(tmp_path, alice, thief, honest, server, 5.0)
    assert len(stolen) == 1 and stolen[0].endswith(":200"), stolen
    assert got == "delivered", (got, stolen, processed)
    assert len(processed) == 2 and processed[0] == stolen[0].split(":")[0], processed
    assert not list((tmp_path / "outbox").glob("*.out"))  # nothing left to send again


async def test_a_relays_own_id_taken_does_not_have_a_forwarded_push_sent_again(
    tmp_path, identities, roster
):
    """The other side of the fix: a push goes again under a fresh id only on
    carol's signed word. Attack: a relay forwards alice's push to carol (who
    takes it) and answers alice 409 `id_taken` itself; taken at its word, alice
    would send the push again under a fresh id and carol would process it
    twice. Alice refuses the unsigned answer (`ack_unverified`), sends nothing
    again, and her link leaves that relay."""
    alice = codec(identities, roster, "alice")
    carol = codec(identities, roster, "carol")
    processed: list[str] = []
    server, port = await recording_server(carol, processed)

    async def forger(request: web.Request) -> web.Response:
        assert (await post(port, await request.read())).status == 200  # forwarded, taken
        return web.json_response({"reason": "id_taken", "ack": "AAAA"}, status=409)

    bad, r1 = await serve_relay(forger)
    got, client = await _push_to_carol(
        tmp_path, alice, [r1, "127.0.0.1:9"], 5.0, [bad.cleanup, server.stop]
    )
    assert len(processed) == 1, processed  # once: never sent again under a fresh id
    assert got == "ack_unverified", got
    assert client.links["carol"].url.endswith("127.0.0.1:9" + RELAY_MESSAGE_PATH)


async def test_an_older_requesters_strict_schema_still_reads_a_nodes_answer(
    tmp_path, identities, roster
):
    """Honest breakage: a node named the request its answer answers with a
    key in the answer's payload (`_answers`, rv_net review). A node of the
    version before, mid rolling upgrade (docs/operations.md: one site at a
    time), reads secagg answers with schemas that refuse an unknown key
    (protocols/secagg_messages.py, extra="forbid"): it refused every upgraded
    contributor's answer `secagg_malformed`, and its secure sums failed. The
    answer's id names the request now; the payload is the handler's own."""
    from test_hostile_wire import incoming, make_inbound

    from protocols.secagg_messages import Advertised, parse

    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    inbound = make_inbound(tmp_path, bob, kinds=("secagg",), pushes=())
    keys = {"c_pk": b"c" * 32, "s_pk": b"s" * 32, "b_hash": b"b" * 32, "tags": {}}

    async def serve(sender: str, query: dict) -> dict:
        return keys

    inbound.handlers["secagg"] = serve
    asked = alice.encode("req:secagg", "bob", {"_wait_s": 0.0})
    status, chunks = await inbound.on_frame(incoming(bob, asked.to_bytes()))
    answer = alice.decode(b"".join(bytes(c) for c in chunks))  # as an older requester does
    assert status == 200 and parse(Advertised, answer.payload) is not None, answer.payload


async def test_a_withheld_answer_handed_to_the_next_request_is_refused_by_its_id(
    tmp_path, identities, roster
):
    """The binding the payload key gave, kept: a relay withholds bob's answer
    to alice's request (answering her 502) and hands it to her next request of
    the same round and kind; its id is the answer id of the first request,
    refused. The third request's own answer is taken."""
    from node.outbound import answer_id

    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    seen: list[bytes] = []

    def answer_to(request_id: bytes, w: int) -> bytes:
        rid = answer_id(bob, "alice", request_id)
        return bob.encode("resp:model", "alice", {"w": w}, round=6, msg_id=rid).to_bytes()

    async def relay(request: web.Request) -> web.Response:
        frame = await request.read()
        seen.append(_msg_id(frame))
        if len(seen) == 1:
            return web.json_response({"reason": "relay_lost"}, status=502)  # withheld
        body = answer_to(seen[0], 1) if len(seen) == 2 else answer_to(seen[-1], 3)
        return web.Response(body=body, content_type="application/octet-stream")

    got = await ask_bob_twice(tmp_path, alice, relay, 3.0)
    assert got == ["response does not match the request", {"w": 3}], (got, len(seen))


async def test_a_relay_stealing_every_id_it_carries_does_not_hold_the_link(
    tmp_path, identities, roster
):
    """The loop a fresh id opens: a relay that uses each id it carries first,
    then forwards the push, hands back carol's own signed `id_taken`; a signed
    409 does not move the link by itself, so alice sent every fresh id
    through the thief again until the push timed out. A signed `id_taken`
    counts as a refusal of the relay that carried it (the next relay, unless
    that one failed lately)."""
    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    carol = codec(identities, roster, "carol")
    processed: list[str] = []
    server, port = await recording_server(carol, processed)
    stolen: list[bytes] = []

    async def thief(request: web.Request) -> web.Response:
        frame = await request.read()
        x, _ = await _use_its_id_first(port, bob, frame)
        stolen.append(x)
        reply = await post(port, frame)  # carol's own answer: id_taken, signed
        return web.Response(status=reply.status, body=reply.body, content_type="application/json")

    async def honest(request: web.Request) -> web.Response:
        reply = await post(port, await request.read())
        return web.Response(status=reply.status, body=reply.body, content_type="application/json")

    got = await _push_past_a_thief(tmp_path, alice, thief, honest, server, 3.0)
    assert got == "delivered", (got, len(stolen))
    assert len(stolen) == 1 and len(processed) == 2, (len(stolen), processed)


def test_a_rekeyed_outbox_record_is_replaced_in_place(tmp_path):
    """A push's fresh id replaces its outbox record in one atomic write, filed
    under its first id: written as a new record and the old one then removed,
    a crash in between left both, both were sent again after the restart, and
    the receiver took the push under each id (the old one's `id_taken` gave it
    yet another)."""
    import os

    from node.queues import Outbox, OutboxEntry

    outbox = Outbox(tmp_path / "outbox")
    first, fresh = os.urandom(16), os.urandom(16)
    entry = OutboxEntry(first, "carol", "probe", 0, {"x": 1}, 1.0)
    outbox.add(entry)
    outbox.rekey(entry, fresh)
    assert [p.name for p in (tmp_path / "outbox").glob("*.out")] == [f"{first.hex()}.out"]
    (pending,) = outbox.pending()  # after a restart
    assert (pending.msg_id, pending.file) == (fresh, first)
    outbox.done(pending.file)
    assert not outbox.pending()


async def test_a_relay_stealing_every_request_id_does_not_hold_the_link(
    tmp_path, identities, roster
):
    """The same for requests: each attempt is a fresh request, and carol's
    signed `id_taken` moved neither the link nor ended the request, so a
    relay that used every request id first kept alice asking through itself
    until the request timed out. Now the next attempt goes through the other
    relay, and carol's answer is taken."""
    from test_hostile_wire import make_inbound

    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    carol = codec(identities, roster, "carol")
    inbound = make_inbound(tmp_path / "carol", carol)  # takes probe pushes, model requests

    async def serve(sender: str, query: dict) -> dict:
        return {"w": 7}

    inbound.handlers["model"] = serve
    server = MessageServer(carol, TransportSection(), inbound.on_frame, lambda r, s: None)
    port = await server.start("127.0.0.1", 0, None)
    stolen: list[bytes] = []

    async def relay_of(steal: bool):
        async def forward(request: web.Request) -> web.Response:
            frame = await request.read()
            if steal:
                x = _msg_id(frame)
                await post(port, bob.encode("probe", "carol", {}, msg_id=x).to_bytes())
                stolen.append(x)
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"http://127.0.0.1:{port}{MESSAGE_PATH}", data=frame) as r,
            ):
                return web.Response(status=r.status, body=await r.read(), headers=r.headers)

        return await serve_relay(forward)

    bad, r1 = await relay_of(True)
    good, r2 = await relay_of(False)
    client = MessageClient(TransportSection(request_timeout_s=3.0, **FAST), None)
    client.set_relayed_peer("carol", [r1, r2])
    out = outbound_of(tmp_path, alice, client)
    try:
        try:
            got = await out.request("carol", "model", {}, 2.0)
        except Exception as exc:  # noqa: BLE001 - PeerUnavailable, reported
            got = getattr(exc, "reason", repr(exc))
    finally:
        await client.close()
        await bad.cleanup()
        await good.cleanup()
        await server.stop()
    assert got == {"w": 7}, (got, len(stolen))
    assert len(stolen) == 1, len(stolen)
