"""Hostile review of the relay (issue 31): each test is an attack that worked on
the code before its fix (or, marked xfail strict, one that still works and is
reported), against real aiohttp servers on 127.0.0.1, real Ed25519/X25519
identities and real frames from WireCodec.

- a client on no roster held a relay's handshake slot forever by sending pings
  (each ping restarted aiohttp's per-receive timeout): `max_handshakes` such
  connections kept every outbound-only site from connecting;
- a deeply nested JSON auth message raised RecursionError out of the relay's
  handshake (an unhandled exception, no refusal, nothing counted);
- a relay that sent a challenge whose nonce the site cannot encode (a lone
  surrogate) or a deeply nested one killed the site's tunnel task for good: the
  site never dialled that relay again;
- a relay flooding a site with FORWARDs made the site hold 64 frames of up to
  max_message_bytes each in memory (65 x 512 MiB by default);
- one sender trickling two payloads held a recipient's whole byte budget at the
  relay, so every other sender got `queue_full`;
- the relay allocated (and zeroed) a frame's whole payload_len the moment its
  header was checked, before one payload byte arrived;
- a relay answers the sender of a push in the receiver's place: the
  acknowledgement is unsigned JSON, so a relay can drop a push and forge its
  ack (xfail: the fix is in node/transport.py and node/transport_client.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import struct
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from test_relay import FED, RelaySite, codec, frame, relay, until

from node.relay_tunnel import RelayTunnel
from node.relay_wire import (
    RELAY_CONNECT_PATH,
    RELAY_MESSAGE_PATH,
    auth_message,
    pack_forward,
    unpack_reply,
)
from node.transport import MESSAGE_PATH
from node.transport_client import MessageClient, TransportError
from p2pfl.config import TransportSection
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec

WsHandler = Callable[[web.WebSocketResponse, int], Awaitable[None]]


@pytest.fixture(scope="module")
def ids() -> dict[str, LocalIdentity]:
    return {n: LocalIdentity.generate(n) for n in ("a", "b", "c", "d", "f", "x")}


@pytest.fixture(scope="module")
def roster(ids: dict[str, LocalIdentity]) -> Roster:
    from test_relay import make_roster

    return make_roster(ids)


def fast_transport() -> TransportSection:
    return TransportSection(
        request_timeout_s=5.0,
        connect_timeout_s=1.0,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        retries=0,
    )


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[int]:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield next(a[1] for a in runner.addresses if isinstance(a, tuple))
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def fake_relay(handler: WsHandler, max_msg_size: int = 64 << 20) -> AsyncIterator[int]:
    """A hostile relay: `handler(ws, n)` plays the n-th connection (from 1)."""
    count = 0

    async def connect(request: web.Request) -> web.WebSocketResponse:
        nonlocal count
        count += 1
        ws = web.WebSocketResponse(max_msg_size=max_msg_size)
        await ws.prepare(request)
        with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError):
            await handler(ws, count)
        return ws

    app = web.Application()
    app.router.add_get(RELAY_CONNECT_PATH, connect)
    async with serve(app) as port:
        yield port


def tunnel(ids: dict[str, LocalIdentity], port: int, local_url: str, max_bytes: int) -> RelayTunnel:
    return RelayTunnel(
        site="b",
        relay="r1",
        address=f"127.0.0.1:{port}",
        federation=FED,
        identity=ids["b"],
        local_url=local_url,
        cfg=fast_transport(),
        max_message_bytes=max_bytes,
    )


async def honest_handshake(ws: web.WebSocketResponse) -> None:
    await ws.send_json({"type": "challenge", "relay": "r1", "federation": FED, "nonce": "ab" * 32})
    await ws.receive(timeout=5)  # the site's signature (not checked: we are the hostile side)
    await ws.send_json({"type": "ok"})


# ----------------------------------------------------------------------------- relay: pre-auth


def test_a_pinging_client_cannot_hold_a_handshake_slot_past_the_auth_timeout(ids, roster):
    """A stranger that answers the challenge with pings only is cut at auth_timeout_s
    (before: each ping restarted the timeout and the slot was held for ever)."""

    async def scenario() -> None:
        async with (
            relay(roster, auth_timeout_s=0.5, max_handshakes=1) as (server, url),
            aiohttp.ClientSession() as s,
            s.ws_connect(url + RELAY_CONNECT_PATH, autoping=False) as ws,
        ):
            assert (await ws.receive_json(timeout=5))["type"] == "challenge"

            async def keep_pinging() -> None:
                while True:
                    await ws.ping()
                    await asyncio.sleep(0.1)

            pinger = asyncio.create_task(keep_pinging())
            try:
                await until(lambda: server._handshakes == 0, timeout=6)
            finally:
                pinger.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError, RuntimeError):
                    await pinger
            assert server.refusals.get("auth_timeout") == 1
            b = RelaySite(ids["b"], roster)  # the one slot is free for a real site
            assert await b.connect(url) == {"type": "ok"}
            await b.close()

    asyncio.run(scenario())


def test_a_deeply_nested_or_huge_auth_message_is_refused_and_counted(ids, roster):
    """Pre-auth JSON is bounded: no RecursionError out of the handler, no large
    parse on the event loop; each is refused `auth_malformed` and counted."""

    async def scenario() -> None:
        async with relay(roster) as (server, url), aiohttp.ClientSession() as s:
            for text in ("[" * 200_000, json.dumps({"type": "auth", "pad": "x" * (1 << 20)})):
                async with s.ws_connect(url + RELAY_CONNECT_PATH) as ws:
                    await ws.receive_json(timeout=5)
                    await ws.send_str(text)
                    answer = await ws.receive(timeout=5)
                    assert answer.type == aiohttp.WSMsgType.TEXT, answer
                    assert json.loads(answer.data) == {
                        "type": "refused",
                        "reason": "auth_malformed",
                    }
            assert server.refusals == {"auth_malformed": 2}
            # a well-formed offer padded past the bound is refused too, signature or not
            async with s.ws_connect(url + RELAY_CONNECT_PATH) as ws:
                nonce = (await ws.receive_json(timeout=5))["nonce"]
                signature = ids["b"].sign(auth_message(FED, "r1", "b", nonce))
                offer = {"type": "auth", "site": "b", "signature": base64.b64encode(signature)}
                offer["signature"] = offer["signature"].decode()
                await ws.send_str(json.dumps({**offer, "pad": " " * 8192}))
                assert (await ws.receive_json(timeout=5))["reason"] == "auth_malformed"
            assert not server.links

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- site: hostile relay


def test_a_relay_sending_an_unusable_challenge_does_not_kill_the_sites_tunnel(ids):
    """A lone-surrogate nonce (UnicodeEncodeError when signed) and a deeply nested
    challenge (RecursionError) each ended the tunnel's task: the site never dialled
    that relay again. Now each is one failed connection and the tunnel dials again."""
    poison = [
        json.dumps({"type": "challenge", "relay": "r1", "federation": FED, "nonce": "\ud800" * 20}),
        "[" * 200_000,
    ]

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        if n <= len(poison):
            await ws.send_str(poison[n - 1])
            await ws.receive(timeout=5)
        else:
            await honest_handshake(ws)
            await ws.receive(timeout=30)

    async def scenario() -> None:
        async with fake_relay(handler) as port:
            t = tunnel(ids, port, "http://127.0.0.1:9" + MESSAGE_PATH, 1 << 20)
            t.start()
            try:
                await until(lambda: t.connected, timeout=10)
            finally:
                await t.stop()
            assert t.connects == 1

    asyncio.run(scenario())


def test_a_forward_flood_from_a_relay_holds_bounded_bytes_at_the_site(ids):
    """A relay may send FORWARDs as fast as it likes; the site holds at most two
    max_message_bytes of frames waiting for its own endpoint (as its transport
    reserves for uploads), not 64 frames of max_message_bytes each."""
    max_bytes = 1 << 20
    n_frames = 12
    held: list[int] = []
    peak = 0
    release = asyncio.Event()

    async def endpoint(request: web.Request) -> web.Response:
        nonlocal peak
        body = await request.read()
        held.append(len(body))
        peak = max(peak, sum(held))
        await release.wait()
        held.remove(len(body))
        return web.json_response({"ok": True})

    replies: list[int] = []

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        await honest_handshake(ws)
        for stream_id in range(n_frames):
            await ws.send_bytes(pack_forward(stream_id, b"\0" * (max_bytes - 64)))
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                replies.append(unpack_reply(msg.data)[1])

    async def scenario() -> None:
        nonlocal release
        release = asyncio.Event()
        app = web.Application(client_max_size=4 * max_bytes)
        app.router.add_post(MESSAGE_PATH, endpoint)
        async with serve(app) as local, fake_relay(handler) as port:
            t = tunnel(ids, port, f"http://127.0.0.1:{local}{MESSAGE_PATH}", max_bytes)
            t.start()
            try:
                await until(lambda: len(held) >= 2, timeout=10)
                await asyncio.sleep(1.0)  # time to take more, if it would
                assert peak <= 2 * max_bytes, f"{len(held)} frames held, {peak} bytes"
                release.set()
                await until(lambda: len(replies) == n_frames, timeout=20)
            finally:
                release.set()
                await t.stop()
            assert replies == [200] * n_frames

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- relay: queues


async def trickle(url: str, data: bytes, sent: int, stop: asyncio.Event) -> int:
    """POST `data` but send only its first `sent` bytes, then stall until `stop`."""

    async def body() -> AsyncIterator[bytes]:
        yield data[:sent]
        await stop.wait()

    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with aiohttp.ClientSession() as s, s.post(url + RELAY_MESSAGE_PATH, data=body()) as r:
            await r.read()
            return r.status
    return 0


def test_one_sender_trickling_payloads_cannot_take_a_recipients_whole_byte_budget(ids, roster):
    """Two frames of one sender, each stalled mid-payload, held all the bytes the
    relay keeps for b: every other sender's frame to b was `queue_full`. A sender
    now holds at most half of a recipient's bytes (beyond its first frame)."""
    a, f = codec(ids, roster, "a"), codec(ids, roster, "f")
    blob = 400_000

    async def scenario() -> None:
        async with relay(roster, max_pending_bytes_per_site=1 << 20) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            stop = asyncio.Event()
            big = [frame(a, "b", {"blob": os.urandom(blob)}) for _ in range(2)]
            stalled = [asyncio.create_task(trickle(url, x, len(x) // 2, stop)) for x in big]
            try:
                await until(lambda: server.links["b"].pending_bytes >= len(big[0]), timeout=10)
                await asyncio.sleep(0.3)
                honest = frame(f, "b", {"blob": os.urandom(blob)})
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(url + RELAY_MESSAGE_PATH, data=honest) as r,
                ):
                    status, body = r.status, await r.read()
                assert status == 200, body
            finally:
                stop.set()
                await asyncio.gather(*stalled, return_exceptions=True)
                await b.close()
            assert server.refusals.get("queue_full", 0) <= 1  # the trickler's second frame

    asyncio.run(scenario())


def test_the_relay_holds_payload_memory_as_bytes_arrive_not_from_the_header(ids, roster):
    """A signed header claiming 7 MiB made the relay allocate and zero 7 MiB at
    once: headers alone (a few hundred bytes each) bought max_pending_bytes_per_site
    per recipient. Now a frame's memory grows with the bytes actually received."""
    a = codec(ids, roster, "a")
    big = frame(a, "b", {"blob": os.urandom(7 << 20)})

    async def scenario() -> int:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            stop = asyncio.Event()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                task = asyncio.create_task(trickle(url, big, 4096, stop))
                await until(lambda: server.links["b"].pending == 1, timeout=10)
                await asyncio.sleep(0.3)
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
                stop.set()
                await asyncio.gather(task, return_exceptions=True)
                await b.close()
            return grown

    grown = asyncio.run(scenario())
    assert grown < 2 << 20, f"{grown} bytes held for 4 KiB received"


# ----------------------------------------------------------------------------- sender: forged ack


def test_a_relay_cannot_forge_the_final_receivers_acknowledgement(ids, roster, tmp_path):
    """A relay that drops a push and answers `{"ok": true}` itself (or a 409
    `replayed`) made the sender count it delivered: acknowledgements were
    unsigned JSON. Now the receiver signs its acknowledgement over the message
    id (p2pfl/secure/wire.py `sign_ack`) and Outbound counts a push delivered
    only if that signature verifies: a forged one is `ack_unverified`, counted."""
    from types import SimpleNamespace

    from node.outbound import Outbound
    from node.queues import Outbox
    from node.telemetry import Telemetry
    from protocols.base import PeerUnavailable

    a = codec(ids, roster, "a")
    b = codec(ids, roster, "b")
    swallowed: list[bytes] = []
    forged: list[dict[str, Any]] = []

    async def forge(request: web.Request) -> web.Response:
        swallowed.append(await request.read())  # dropped, never forwarded
        body, status = forged[len(swallowed) - 1]
        return web.json_response(body, status=status)

    async def scenario() -> list[str]:
        app = web.Application(client_max_size=8 << 20)
        app.router.add_post(RELAY_MESSAGE_PATH, forge)
        outcomes: list[str] = []
        async with serve(app) as port:
            tcfg = fast_transport()
            client = MessageClient(tcfg, None)
            client.set_relayed_peer("b", [f"127.0.0.1:{port}"])
            telemetry = Telemetry("a")
            out = Outbound(
                name="a",
                cfg=SimpleNamespace(transport=tcfg, wire=SimpleNamespace(encryption=True)),  # type: ignore[arg-type]
                codec=a,
                client=client,
                outbox=Outbox(tmp_path / "outbox"),
                peers=None,  # type: ignore[arg-type]
                telemetry=telemetry,
                marks=None,  # type: ignore[arg-type]
                current_round=lambda: 0,
            )
            try:
                for _ in forged:
                    try:
                        await out.send_push("b", "probe", {"round": 1}, 1)
                        outcomes.append("delivered")
                    except PeerUnavailable as exc:
                        outcomes.append(exc.reason)
            finally:
                await client.close()
            rejected = telemetry.status_json("a", "probe")["rejected"]
            outcomes.append(str(rejected.get("ack_unverified", 0)))
        return outcomes

    # b's real signature, but over another message (an ack the relay saw before)
    other = a.encode("probe", "b", {"round": 0}, encrypt=True).header
    replayed_sig = b.sign_ack(other, "ok")
    forged.extend(
        [
            ({"ok": True}, 200),  # the bare ack
            ({"ok": True, "ack": "x" * 88}, 200),  # junk signature
            ({"ok": True, "ack": replayed_sig}, 200),  # b's ack of another id
            ({"reason": "replayed", "ack": replayed_sig}, 409),  # "already had it"
        ]
    )
    outcomes = asyncio.run(scenario())
    assert len(swallowed) == 4, "every push went to the relay"
    assert outcomes[:4] == ["ack_unverified"] * 4, outcomes
    assert outcomes[4] == "4", outcomes  # each counted


# ----------------------------------------------------------------------------- relay: slow peers


def new_settings(**kw: Any) -> dict[str, Any]:
    """Settings this review added to RelaySettings, passed only where they exist
    (so each test fails on the code before its fix by its assertion, not a TypeError)."""
    from p2pfl.config import RelaySettings

    return {k: v for k, v in kw.items() if k in RelaySettings.model_fields}


def test_a_payload_trickled_below_the_minimum_rate_is_cut_off(ids, roster):
    """A byte now and then kept a relayed upload (its slot and bytes) alive for
    ever; now it must arrive within read_idle_timeout_s + its size at
    min_upload_bytes_per_s, as uploads to a site must (node/transport.py)."""
    a = codec(ids, roster, "a")
    data = frame(a, "b", {"blob": os.urandom(200_000)})

    async def scenario() -> None:
        settings = new_settings(min_upload_bytes_per_s=100_000.0)
        async with relay(roster, read_idle_timeout_s=1.0, **settings) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)

            async def body() -> AsyncIterator[bytes]:
                yield data[:4096]
                for i in range(4096, len(data), 50):
                    await asyncio.sleep(0.2)  # 250 bytes/s: never idle, never done
                    yield data[i : i + 50]

            async with aiohttp.ClientSession() as s:
                post = s.post(url + RELAY_MESSAGE_PATH, data=body())
                r = await asyncio.wait_for(post, 30)
                status, answer = r.status, await r.read()
                r.release()
            assert (status, json.loads(answer)["reason"]) == (408, "upload_too_slow")
            assert server.links["b"].pending == 0 and server.links["b"].pending_bytes == 0
            await b.close()

    asyncio.run(scenario())


def test_an_answer_its_sender_does_not_read_is_not_held_for_ever(ids, roster):
    """A sender that never reads the answers to its requests pinned each answer
    (up to max_message_bytes) in the relay's memory for as long as it kept the
    connection open. Now an answer must be taken within read_idle_timeout_s + its
    size at min_upload_bytes_per_s, else the connection is aborted."""
    a = codec(ids, roster, "a")
    size = 7 << 20
    answered = asyncio.Event()

    async def big_answer(data: bytes) -> tuple[int, bytes]:
        answered.set()
        return 200, b"x" * size

    async def scenario() -> int:
        nonlocal answered
        answered = asyncio.Event()
        settings = new_settings(min_upload_bytes_per_s=float(4 << 20))
        async with relay(roster, read_idle_timeout_s=1.0, **settings) as (server, url):
            b = RelaySite(ids["b"], roster, big_answer)
            await b.connect(url)
            port = int(url.rsplit(":", 1)[1])
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # hold little ourselves
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            body = frame(a, "b")
            head = (
                f"POST {RELAY_MESSAGE_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Length: {len(body)}\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
            await asyncio.wait_for(answered.wait(), 10)
            # not read: the relay gives up on it once past its deadline (about 3 s)
            await until(lambda: "answer_too_slow" in server.refusals, timeout=30)
            got = 0
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                while chunk := await asyncio.wait_for(reader.read(1 << 16), 5):
                    got += len(chunk)
            writer.close()
            await b.close()
            return got

    got = asyncio.run(scenario())
    assert got < size, f"the relay kept all {got} bytes of the unread answer"


def test_a_site_answering_with_an_informational_status_gets_its_sender_a_refusal(ids, roster):
    """A site's REPLY with status 1xx was written as the HTTP answer: the sender's
    client took it as an interim answer and hung until its own timeout."""
    a = codec(ids, roster, "a")

    async def interim(data: bytes) -> tuple[int, bytes]:
        return 100, b'{"ok": true}'

    async def scenario() -> tuple[int, bytes] | str:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster, interim)
            await b.connect(url)
            try:
                async with (
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=8)) as s,
                    s.post(url + RELAY_MESSAGE_PATH, data=frame(a, "b")) as r,
                ):
                    return r.status, await r.read()
            except TimeoutError:
                return "timeout"
            finally:
                await b.close()

    outcome = asyncio.run(scenario())
    assert outcome != "timeout", "the sender hung on a 1xx answer"
    status, body = outcome
    assert (status, json.loads(body)["reason"]) == (502, "reply_malformed")


# ----------------------------------------------------------------------------- relay: handshake pool


def test_one_host_cannot_take_every_handshake_slot(ids, roster):
    """Without TLS anyone may open the relay's WebSocket: `max_handshakes` idle
    connections from one host (each renewed every auth_timeout_s) refused every
    site `too_many_handshakes`. A host now has at most max_handshakes_per_host."""

    async def scenario() -> None:
        settings = new_settings(max_handshakes_per_host=2)
        async with (
            relay(roster, max_handshakes=4, **settings) as (server, url),
            aiohttp.ClientSession() as s,
        ):
            held = []
            for _ in range(4):
                with contextlib.suppress(aiohttp.WSServerHandshakeError):
                    held.append(await s.ws_connect(url + RELAY_CONNECT_PATH))
            b = RelaySite(ids["b"], roster)  # from another address of this host
            connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            b._session = aiohttp.ClientSession(connector=connector)
            try:
                b.ws = await b._session.ws_connect(url + RELAY_CONNECT_PATH)
                challenge = await b.ws.receive_json(timeout=10)
                signed = auth_message(FED, "r1", "b", challenge["nonce"])
                offer = {"type": "auth", "site": "b", "signature": ""}
                offer["signature"] = base64.b64encode(ids["b"].sign(signed)).decode()
                await b.ws.send_json(offer)
                assert await b.ws.receive_json(timeout=10) == {"type": "ok"}
            finally:
                for ws in held:
                    await ws.close()
                await b.close()
            assert len(held) == 2

    asyncio.run(scenario())


def test_a_relay_that_only_pings_during_the_handshake_is_dialled_again(ids, monkeypatch):
    """A relay that never sends its challenge but pings the site kept the tunnel in
    its handshake for ever (each ping restarted the receive timeout): the tunnel
    now gives the whole handshake one deadline and dials again."""
    import node.relay_tunnel

    monkeypatch.setattr(node.relay_tunnel, "AUTH_TIMEOUT_S", 0.5)
    dials: list[int] = []

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        dials.append(n)
        for _ in range(100):  # 10 s of pings, no challenge
            await ws.ping()
            await asyncio.sleep(0.1)

    async def scenario() -> None:
        async with fake_relay(handler) as port:
            t = tunnel(ids, port, "http://127.0.0.1:9" + MESSAGE_PATH, 1 << 20)
            t.start()
            try:
                await until(lambda: len(dials) >= 2, timeout=8)
            finally:
                await t.stop()

    asyncio.run(scenario())


@pytest.mark.xfail(
    strict=True,
    reason="open: aiohttp fixes a WebSocket's max_msg_size at prepare(), so before the "
    "handshake a stranger's message is buffered up to max_message_bytes (512 MiB by default) "
    "per connection awaiting authentication; bounded by max_handshakes(_per_host) and "
    "auth_timeout_s, not by the few hundred bytes an offer needs. Fix: authenticate on the "
    "upgrade request (node/relay_wire.py: a nonce from a first GET, the signature in a header) "
    "or a handshake-sized reader swapped after auth (node/relay.py)",
)
def test_a_stranger_cannot_make_the_relay_buffer_a_large_message_before_authenticating(ids, roster):
    async def scenario() -> int:
        async with (
            relay(roster) as (server, url),
            aiohttp.ClientSession() as s,
            s.ws_connect(url + RELAY_CONNECT_PATH) as ws,
        ):
            await ws.receive_json(timeout=5)
            tracemalloc.start()
            try:
                await ws.send_str("x" * (6 << 20))
                answer = await ws.receive_json(timeout=10)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert answer == {"type": "refused", "reason": "auth_malformed"}
            return peak

    peak = asyncio.run(scenario())
    # the client's own 6 MiB string counts too: the relay may add little to it
    assert peak < (6 << 20) * 1.5 + (1 << 20), f"peak {peak} bytes for a refused offer"


def test_a_relay_answering_500_does_not_keep_senders_from_the_sites_other_relay(ids, roster):
    a = codec(ids, roster, "a")
    hits = {"broken": 0, "good": 0}

    def endpoint(name: str, status: int) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            await request.read()
            hits[name] += 1
            return web.json_response({"ok": True} if status == 200 else {}, status=status)

        app = web.Application(client_max_size=8 << 20)
        app.router.add_post(RELAY_MESSAGE_PATH, handle)
        return app

    async def scenario() -> tuple[int, bytes] | str:
        async with serve(endpoint("broken", 500)) as bad, serve(endpoint("good", 200)) as good:
            client = MessageClient(fast_transport(), None)
            client.set_relayed_peer("b", [f"127.0.0.1:{bad}", f"127.0.0.1:{good}"])
            message = a.encode("heartbeat", "b", {"round": 1}, encrypt=True)
            try:
                return await client.post("b", message, retries=3)
            except TransportError as exc:
                return exc.reason
            finally:
                await client.close()

    outcome = asyncio.run(scenario())
    assert outcome == (200, b'{"ok": true}'), (outcome, hits)


def test_a_client_vanishing_mid_handshake_is_counted_not_a_logged_traceback(ids, roster, caplog):
    """A stranger that sends the upgrade request and resets the connection made
    the relay's handler raise (writing the challenge to a closed transport): one
    ERROR traceback in the relay's log per connection, from anyone, uncounted."""

    async def scenario() -> None:
        async with relay(roster) as (server, url):
            port = int(url.rsplit(":", 1)[1])
            upgrade = (
                f"GET {RELAY_CONNECT_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
            for i in range(10):
                with socket.socket() as s:
                    s.connect(("127.0.0.1", port))
                    s.sendall(upgrade)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                await asyncio.sleep(0.01 * (i % 3))
            await until(lambda: server._handshakes == 0 and sum(server.refusals.values()) == 10)
            assert server.refusals == {"handshake_lost": 10}

    with caplog.at_level("WARNING"):
        asyncio.run(scenario())
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, errors[0].getMessage()


def test_a_stranger_cannot_learn_which_sites_are_connected(ids, roster):
    """`not_connected` was answered before the signature check: a frame signed
    by no roster key told a stranger whether a site was connected. Now a frame
    whose signature fails is `bad_signature` whether or not its recipient is
    connected, and only a roster member learns `not_connected`."""
    a = codec(ids, roster, "a")
    forger = LocalIdentity.generate("a")  # claims a's name, holds another key
    mallory = WireCodec(forger, roster, FED, max_message_bytes=8 << 20)

    async def scenario() -> dict[str, tuple[int, str]]:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            out = {}
            async with aiohttp.ClientSession() as s:
                for label, sender, to in [
                    ("forged, connected", mallory, "b"),
                    ("forged, not connected", mallory, "c"),
                    ("signed, not connected", a, "c"),
                ]:
                    body = frame(sender, to, {"x": 1})
                    async with s.post(url + RELAY_MESSAGE_PATH, data=body) as r:
                        out[label] = (r.status, (await r.json())["reason"])
            await b.close()
            return out

    assert asyncio.run(scenario()) == {
        "forged, connected": (401, "bad_signature"),
        "forged, not connected": (401, "bad_signature"),
        "signed, not connected": (503, "not_connected"),
    }


def test_an_acknowledgement_signature_of_any_shape_but_the_receivers_is_refused(ids, roster):
    """What an answer's `ack` may hold: only b's signature over this id and this
    outcome verifies; huge, non-string, non-base64 values, the other outcome,
    another claimed signer or an unknown outcome are refused without decoding."""
    a, b = codec(ids, roster, "a"), codec(ids, roster, "b")
    header = a.encode("probe", "b", {"round": 1}, encrypt=True).header
    good = b.sign_ack(header, "ok")
    assert a.verify_ack("b", header.msg_id, "ok", good)
    for bad in (
        "A" * 1_000_000,
        12345,
        None,
        ["x"],
        {"ack": good},
        "!!not base64!!",
        "",
        good[:-4],
    ):
        assert not a.verify_ack("b", header.msg_id, "ok", bad), repr(bad)[:40]
    assert not a.verify_ack("b", header.msg_id, "replayed", good)  # another outcome
    assert not a.verify_ack("c", header.msg_id, "ok", good)  # another signer
    assert not a.verify_ack("zz", header.msg_id, "ok", good)  # not on the roster
    assert not a.verify_ack("b", header.msg_id, "delivered", good)  # no such outcome
    assert not a.verify_ack("b", bytes(16), "ok", good)  # another id
