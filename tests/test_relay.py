"""The relay (issue 31, node/relay.py): who may connect, what it forwards and
refuses, its bounds, its status endpoint, and the `p2pfl-node relay` process
under a flood. Real aiohttp servers on 127.0.0.1, real Ed25519/X25519
identities, real frames from WireCodec; `RelaySite` below is a test peer that
plays a site's end of the connection (the production one is node/relay_tunnel.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from node.relay import RelayServer
from node.relay_handshake import fetch_challenge, open_relay_socket, proof_headers
from node.relay_status import create_relay_status_app
from node.relay_wire import (
    ABORT,
    END,
    REFUSAL_HEADER,
    RELAY_CHALLENGE_PATH,
    RELAY_CONNECT_PATH,
    RELAY_MESSAGE_PATH,
    pack_reply,
    unpack_forward,
)
from node.status import start_status_server
from node.transport import STATUS_FOR_REASON
from p2pfl.config import ConfigError, RelaySettings, load_relay_config
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import PREFIX_LEN, SIG_LEN, WireCodec, WireError

FED = "fed-relay"
ROOT = Path(__file__).resolve().parent.parent
BEHIND = ("b", "c")  # outbound-only, via r1
Answer = Callable[[bytes], Awaitable[tuple[int, bytes]]]


@pytest.fixture(scope="module")
def ids() -> dict[str, LocalIdentity]:
    # a, f: reachable; b, c: behind r1; d: behind r2 only; x: on no roster
    return {n: LocalIdentity.generate(n) for n in ("a", "b", "c", "d", "f", "x")}


def make_roster(ids: dict[str, LocalIdentity], path: Path | None = None) -> Roster:
    cards = [ids["a"].card("127.0.0.1:7001"), ids["f"].card("127.0.0.1:7002")]
    cards += [dataclasses.replace(ids[n].card(), address=None, via=("r1",)) for n in BEHIND]
    cards.append(dataclasses.replace(ids["d"].card(), address=None, via=("r2",)))
    return Roster(cards, path, relays={"r1": "127.0.0.1:7100", "r2": "127.0.0.1:7200"})


@pytest.fixture(scope="module")
def roster(ids: dict[str, LocalIdentity]) -> Roster:
    return make_roster(ids)


def codec(ids: dict[str, LocalIdentity], roster: Roster, name: str, fed: str = FED) -> WireCodec:
    return WireCodec(ids[name], roster, fed, max_message_bytes=8 << 20, require_encryption=True)


def frame(c: WireCodec, to: str, payload: Any = None, **kw: Any) -> bytes:
    kw.setdefault("encrypt", True)
    return c.encode("heartbeat", to, payload or {"round": 1}, **kw).to_bytes()


@contextlib.asynccontextmanager
async def relay(roster: Roster, **settings: Any) -> AsyncIterator[tuple[RelayServer, str]]:
    """RelayServer r1 on an ephemeral loopback port: (server, base URL)."""
    server = RelayServer(
        "r1", FED, roster, RelaySettings(**settings), max_message_bytes=8 << 20, clock_skew_s=60
    )
    app = web.Application()
    server.add_routes(app)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await server.close()
        await runner.cleanup()


class RelaySite:
    """A site's end of a relay connection (a test peer): the handshake, then
    every FORWARD answered by `answer` (default: the site's own WireCodec
    verifies and opens the frame, as its message endpoint would)."""

    def __init__(self, identity: LocalIdentity, roster: Roster, answer: Answer | None = None):
        self.identity = identity
        self.codec = WireCodec(identity, roster, FED, require_encryption=True)
        self.answer = answer or self.verify
        self.received: list[bytes] = []
        self.aborted: list[int] = []  # frames the relay gave up on mid-stream
        self.arrived = asyncio.Event()
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def verify(self, data: bytes) -> tuple[int, bytes]:
        c = self.codec
        try:
            n = c.header_length(data[:PREFIX_LEN])
            end = PREFIX_LEN + n
            header = c.verify_header(data[PREFIX_LEN:end], data[end : end + SIG_LEN])
            c.open_payload(header, data[end + SIG_LEN :])
        except WireError as exc:
            return STATUS_FOR_REASON[exc.reason], json.dumps({"reason": exc.reason}).encode()
        return 200, b'{"ok": true}'

    async def connect(
        self,
        url: str,
        *,
        claim: str | None = None,
        relay_name: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        **ws_options: Any,
    ) -> dict[str, Any]:
        """Fetch a challenge and upgrade as `claim` (default: itself), signing
        with its own key for relay `relay_name` (default: the challenge's):
        {"type": "ok"}, or {"type": "refused", "reason": the relay's reason}."""
        self._session = aiohttp.ClientSession()
        tls: ssl.SSLContext | bool = ssl_context or True
        challenge = await fetch_challenge(self._session, url, tls)
        assert challenge["type"] == "challenge" and challenge["relay"] == "r1"
        self.last_auth = proof_headers(
            self.identity,
            challenge["federation"],
            relay_name or challenge["relay"],
            challenge["nonce"],
            claim,
        )
        try:
            self.ws = await self._session.ws_connect(
                url + RELAY_CONNECT_PATH, headers=self.last_auth, ssl=tls, **ws_options
            )
        except aiohttp.WSServerHandshakeError as exc:
            assert exc.headers is not None
            return {"type": "refused", "reason": exc.headers[REFUSAL_HEADER], "status": exc.status}
        self._task = asyncio.create_task(self._serve())
        return {"type": "ok"}

    async def _serve(self) -> None:
        """Gather each frame's FORWARD pieces; answer it at END, drop it at ABORT."""
        assert self.ws is not None
        partial: dict[int, bytearray] = {}
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.BINARY:
                break
            stream_id, kind, piece = unpack_forward(msg.data)
            if kind == ABORT:
                partial.pop(stream_id, None)
                self.aborted.append(stream_id)
                continue
            partial.setdefault(stream_id, bytearray()).extend(piece)
            if kind == END:
                asyncio.create_task(self._one(stream_id, bytes(partial.pop(stream_id))))

    async def _one(self, stream_id: int, body: bytes) -> None:
        self.received.append(body)
        self.arrived.set()
        status, answer = await self.answer(bytes(body))
        assert self.ws is not None
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            await self.ws.send_bytes(pack_reply(stream_id, status, answer))

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, 5)
        if self._session is not None:
            await self._session.close()


async def post(
    url: str, body: bytes | Any, ssl_context: ssl.SSLContext | None = None
) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + RELAY_MESSAGE_PATH, data=body, ssl=ssl_context or True) as r,
    ):
        return r.status, await r.read()


def reason(body: bytes) -> str | None:
    try:
        return json.loads(body).get("reason")
    except ValueError:
        return None


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------------------- handshake


async def challenge_nonce(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + RELAY_CHALLENGE_PATH) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["nonce"])


async def upgrade(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[int, str | None]:
    """An upgrade request with these headers: (101, None) or (status, reason)."""
    try:
        ws = await session.ws_connect(url + RELAY_CONNECT_PATH, headers=headers)
    except aiohttp.WSServerHandshakeError as exc:
        assert exc.headers is not None
        return exc.status, exc.headers.get(REFUSAL_HEADER)
    await ws.close()
    return 101, None


def test_handshake_admits_roster_sites_via_this_relay_and_refuses_the_rest(ids, roster):
    async def scenario() -> None:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            assert await b.connect(url) == {"type": "ok"}
            await until(lambda: "b" in server.links)
            refused = {}
            for label, site, kw in (
                ("stranger", ids["x"], {}),  # not on the roster
                ("impostor", ids["a"], {"claim": "c"}),  # signs as c with a's key
                ("other relay's site", ids["d"], {}),  # via r2 only
                ("signed for r2", ids["c"], {"relay_name": "r2"}),  # another relay's signature
            ):
                peer = RelaySite(site, roster)
                refused[label] = await peer.connect(url, **kw)
                assert peer.ws is None, label  # no WebSocket: refused on the upgrade request
                await peer.close()
            assert refused == {
                "stranger": {"type": "refused", "reason": "unknown_site", "status": 403},
                "impostor": {"type": "refused", "reason": "bad_signature", "status": 401},
                "other relay's site": {
                    "type": "refused",
                    "reason": "not_via_this_relay",
                    "status": 403,
                },
                "signed for r2": {"type": "refused", "reason": "bad_signature", "status": 401},
            }
            # no proof at all, and a refusal's body: JSON with the reason
            upgrade_only = {"Upgrade": "websocket", "Connection": "Upgrade"}
            async with (
                aiohttp.ClientSession() as s,
                s.get(url + RELAY_CONNECT_PATH, headers=upgrade_only) as r,
            ):
                assert (r.status, (await r.json())["reason"]) == (400, "auth_malformed")
            assert set(server.links) == {"b"}  # none of them displaced b
            snap = server.snapshot()
            assert snap["sites"]["b"]["connected"] and not snap["sites"]["c"]["connected"]
            assert snap["refusals"] == {
                "auth_malformed": 1,
                "bad_signature": 2,
                "not_via_this_relay": 1,
                "unknown_site": 1,
            }
            assert server._handshakes == 0  # every challenge was used once
            await b.close()
            await until(lambda: not server.links)

    asyncio.run(scenario())


def test_a_replayed_proof_is_refused_and_the_site_keeps_its_connection(ids, roster):
    """Headers seen on the wire (b's whole upgrade request) replayed, while b is
    connected and after it left: the nonce was used, so `nonce_replayed`, and
    b's connection is not replaced."""

    async def scenario() -> None:
        async with relay(roster) as (server, url), aiohttp.ClientSession() as s:
            b = RelaySite(ids["b"], roster)
            assert await b.connect(url) == {"type": "ok"}
            link = server.links["b"]
            assert await upgrade(s, url, b.last_auth) == (401, "nonce_replayed")
            assert server.links["b"] is link and not link.closed
            await b.close()
            await until(lambda: not server.links)
            assert await upgrade(s, url, b.last_auth) == (401, "nonce_replayed")
            assert not server.links
            assert server.refusals == {"nonce_replayed": 2}

    asyncio.run(scenario())


def test_an_unused_challenge_expires_and_frees_its_slot(ids, roster):
    async def scenario() -> None:
        async with (
            relay(roster, auth_timeout_s=2.0, max_handshakes_per_host=1) as (server, url),
            aiohttp.ClientSession() as s,
        ):
            nonce = await challenge_nonce(s, url)
            async with s.get(url + RELAY_CHALLENGE_PATH) as r:  # the one slot is held
                assert (r.status, (await r.json())["reason"]) == (429, "too_many_handshakes")
            await until(lambda: server.refusals.get("auth_timeout") == 1, timeout=15)
            assert server._handshakes == 0
            late = proof_headers(ids["b"], FED, "r1", nonce)
            assert await upgrade(s, url, late) == (401, "nonce_expired")
            assert server.refusals == {
                "auth_timeout": 1,
                "nonce_expired": 1,
                "too_many_handshakes": 1,
            }
            b = RelaySite(ids["b"], roster)
            assert await b.connect(url) == {"type": "ok"}
            await b.close()

    asyncio.run(scenario())


def test_a_site_that_stops_answering_pings_is_disconnected(ids, roster):
    async def scenario() -> float:
        async with (  # a client that never answers a ping
            relay(roster, idle_timeout_s=0.6) as (server, url),
            aiohttp.ClientSession() as s,
        ):
            ws = await open_relay_socket(
                s, url, identity=ids["b"], relay="r1", federation=FED, autoping=False
            )
            started = time.monotonic()
            assert "b" in server.links
            await until(lambda: "b" not in server.links, timeout=10)
            await ws.close()
            return time.monotonic() - started

    assert asyncio.run(scenario()) < 8.0


def test_handshakes_in_progress_are_bounded(ids, roster):
    """Challenges outstanding are the handshake slots: max_handshakes_per_host
    of them for one host, then 429 (a full pool gives up its oldest instead:
    test_relay_handshake_review.py); a nonce is used once whatever the
    outcome, which frees its slot."""

    async def scenario() -> None:
        async with (
            relay(roster, max_handshakes_per_host=2) as (server, url),
            aiohttp.ClientSession() as s,
        ):
            nonces = [await challenge_nonce(s, url) for _ in range(2)]
            async with s.get(url + RELAY_CHALLENGE_PATH) as r:
                assert r.status == 429
            assert server.refusals == {"too_many_handshakes": 1}
            stranger = proof_headers(ids["x"], FED, "r1", nonces[0])
            assert await upgrade(s, url, stranger) == (403, "unknown_site")
            assert server._handshakes == 1
            b = RelaySite(ids["b"], roster)  # the freed slot serves a real site
            assert await b.connect(url) == {"type": "ok"}
            await b.close()

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- forwarding


def test_relayed_frames_arrive_byte_identical_and_the_sites_answer_comes_back(ids, roster):
    a = codec(ids, roster, "a")

    async def scenario() -> None:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            sent = frame(a, "b", {"round": 3, "w": list(range(100))})
            status, body = await post(url, sent)
            assert (status, json.loads(body)) == (200, {"ok": True})  # b's own acknowledgement
            assert b.received == [sent]  # byte for byte
            # the same frame again: b's codec refuses the replay, and the relay passes that on
            status, body = await post(url, sent)
            assert (status, reason(body)) == (409, "replayed")

            # a request answered with an encrypted frame: the requester gets it and opens it
            async def answer_with_frame(data: bytes) -> tuple[int, bytes]:
                return 200, frame(b.codec, "a", {"model": [1.0, 2.0]})

            b.answer = answer_with_frame
            status, body = await post(url, frame(a, "b"))
            assert status == 200
            n = a.header_length(body[:PREFIX_LEN])
            header = a.verify_header(
                body[PREFIX_LEN : PREFIX_LEN + n], body[PREFIX_LEN + n : PREFIX_LEN + n + SIG_LEN]
            )
            assert a.open_payload(header, body[PREFIX_LEN + n + SIG_LEN :]) == {"model": [1.0, 2.0]}

            # ... but an answer in the clear never leaves the relay
            async def answer_in_clear(data: bytes) -> tuple[int, bytes]:
                return 200, frame(b.codec, "a", {"model": [1.0]}, encrypt=False)

            b.answer = answer_in_clear
            status, body = await post(url, frame(a, "b"))
            assert (status, reason(body)) == (502, "plaintext_answer")
            snap = server.snapshot()
            assert snap["sites"]["b"]["messages_out"] == 4
            assert snap["sites"]["a"]["messages_in"] == 4
            assert snap["sites"]["b"]["bytes_out"] == snap["sites"]["a"]["bytes_in"] > len(sent)
            assert snap["refusals"] == {"plaintext_answer": 1}
            await b.close()

    asyncio.run(scenario())


def test_the_relay_refuses_what_it_must_not_forward(ids, roster):
    a = codec(ids, roster, "a")
    # x signs with a roster of its own that lists it; the relay's roster does not
    x = codec(
        ids, Roster([*roster.cards(), ids["x"].card("127.0.0.1:7009")], relays=roster.relays), "x"
    )
    other_fed = codec(ids, roster, "a", fed="another-federation")

    async def truncated(data: bytes) -> AsyncIterator[bytes]:
        yield data  # chunked: the body ends here, short of the payload the header announced

    async def scenario() -> dict[str, tuple[int, str | None]]:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            good = frame(a, "b")
            forged = bytearray(good)
            n = a.header_length(good[:PREFIX_LEN])
            forged[PREFIX_LEN + n + 5] ^= 1  # a signature byte
            tampered = bytearray(good)
            tampered[-1] ^= 1  # a payload byte
            cases = {
                "not connected": frame(a, "c"),
                "plaintext": frame(a, "b", encrypt=False),
                "forged signature": bytes(forged),
                "unknown sender": frame(x, "b"),
                "wrong federation": frame(other_fed, "b"),
                "stale": frame(a, "b", timestamp_ms=int(time.time() * 1000) - 3_600_000),
                "truncated": truncated(good[:-20]),
                "tampered payload": bytes(tampered),
                "not a frame": b"GET / HTTP/1.1\r\n\r\n" * 4,
            }
            out = {}
            for label, body in cases.items():
                status, answer = await post(url, body)
                out[label] = (status, reason(answer))
            assert b.received == []  # nothing reached the site
            # The relay streams a frame as it comes: the truncated and the tampered
            # one had begun to reach the site, which was told to drop them (ABORT).
            for _ in range(100):
                if len(b.aborted) >= 2:
                    break
                await asyncio.sleep(0.02)
            assert len(b.aborted) == 2
            assert sum(server.refusals.values()) == len(cases)
            await b.close()
            return out

    assert asyncio.run(scenario()) == {
        "not connected": (503, "not_connected"),
        "plaintext": (403, "encryption_required"),
        "forged signature": (401, "bad_signature"),
        "unknown sender": (403, "unknown_sender"),
        "wrong federation": (403, "wrong_federation"),
        "stale": (401, "stale_timestamp"),
        "truncated": (400, "truncated"),
        "tampered payload": (400, "digest_mismatch"),
        "not a frame": (400, "undecodable_header"),
    }


def test_a_relay_cannot_alter_a_frame_unnoticed(ids, roster):
    """End to end: a malicious relay that flips a byte of the payload, or of the
    header (say, the digest), is caught by the receiver's own codec."""
    a, b = codec(ids, roster, "a"), codec(ids, roster, "b")
    good = frame(a, "b", {"w": [0.5] * 64})
    n = b.header_length(good[:PREFIX_LEN])

    def receive(data: bytes) -> Any:
        header = b.verify_header(
            data[PREFIX_LEN : PREFIX_LEN + n], data[PREFIX_LEN + n : PREFIX_LEN + n + SIG_LEN]
        )
        try:
            return b.open_payload(header, data[PREFIX_LEN + n + SIG_LEN :])
        except WireError:
            b.release(header)  # as node/transport.py does: the sender may send it again
            raise

    payload_flip = bytearray(good)
    payload_flip[PREFIX_LEN + n + SIG_LEN + 3] ^= 0x40
    with pytest.raises(WireError) as caught:
        receive(bytes(payload_flip))
    assert caught.value.reason == "digest_mismatch"
    header_flip = bytearray(good)
    header_flip[PREFIX_LEN + n - 2] ^= 0x01  # inside the digest, the header's last field but one
    with pytest.raises(WireError) as caught:
        receive(bytes(header_flip))
    assert caught.value.reason in ("bad_signature", "undecodable_header")
    assert receive(good) == {"w": [0.5] * 64}  # the untouched frame: fine (and only once)


def test_a_site_disconnecting_or_silent_answers_relay_lost_without_hanging(ids, roster):
    a = codec(ids, roster, "a")
    never = asyncio.Event()

    async def hold(data: bytes) -> tuple[int, bytes]:
        await never.wait()
        return 200, b"{}"

    async def scenario() -> None:
        async with relay(roster, forward_timeout_s=0.5) as (server, url):
            b = RelaySite(ids["b"], roster, hold)
            await b.connect(url)
            waiting = asyncio.create_task(post(url, frame(a, "b")))
            await asyncio.wait_for(b.arrived.wait(), 5)
            await b.close()  # the site goes away while the POST waits
            status, body = await asyncio.wait_for(waiting, 5)
            assert (status, reason(body)) == (502, "relay_lost")
            # connected but never answering: cut at forward_timeout_s
            b2 = RelaySite(ids["b"], roster, hold)
            await b2.connect(url)
            started = time.monotonic()
            status, body = await asyncio.wait_for(post(url, frame(a, "b")), 5)
            assert (status, reason(body)) == (502, "relay_lost")
            assert time.monotonic() - started < 4.0
            # a newer connection of the same site replaces the older one: its waiting forward is lost
            waiting = asyncio.create_task(post(url, frame(a, "b")))
            await until(lambda: server.links["b"].pending == 1)
            b3 = RelaySite(ids["b"], roster)
            await b3.connect(url)
            status, body = await asyncio.wait_for(waiting, 5)
            assert (status, reason(body)) == (502, "relay_lost")
            assert (await post(url, frame(a, "b")))[0] == 200  # through the new connection
            assert server.links["b"].ws is not None and b2.ws is not None
            await until(lambda: b2.ws is not None and b2.ws.closed)
            for site in (b2, b3):
                await site.close()
            assert server.snapshot()["sites"]["b"]["connects"] == 3

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- bounds


def test_pending_queue_per_site_and_rate_per_sender_are_bounded(ids, roster):
    a, f = codec(ids, roster, "a"), codec(ids, roster, "f")
    release = asyncio.Event()

    async def hold(data: bytes) -> tuple[int, bytes]:
        await release.wait()
        return 200, b'{"ok": true}'

    async def scenario() -> None:
        async with relay(roster, max_pending_per_site=4, rate_limit_per_s=5) as (server, url):
            b = RelaySite(ids["b"], roster, hold)
            await b.connect(url)
            began = time.monotonic()  # a's bucket starts with its first frame
            held = [asyncio.create_task(post(url, frame(a, "b"))) for _ in range(2)]
            await until(lambda: server.links["b"].pending == 2)
            # one sender holds at most half of a site's slots ...
            status, body = await post(url, frame(a, "b"))
            assert (status, reason(body)) == (503, "queue_full")
            # ... so another sender still gets through, up to the site's limit
            held += [asyncio.create_task(post(url, frame(f, "b"))) for _ in range(2)]
            await until(lambda: server.links["b"].pending == 4)
            status, body = await post(url, frame(f, "b"))
            assert (status, reason(body)) == (503, "queue_full")
            release.set()
            assert [s for s, _ in await asyncio.gather(*held)] == [200] * 4
            # rate: 5 frames/s, a burst of 10, from one sender (a has used 3 tokens):
            # past it, a's frames wait their turn (node/relay_admission.py), never
            # faster than the rate, and none is refused
            statuses = [(await post(url, frame(a, "b")))[0] for _ in range(14)]
            assert statuses == [200] * 14, statuses
            tokens_taken = 3 + 14  # never more than the burst and the rate allow
            assert tokens_taken <= 10 + 5 * (time.monotonic() - began) + 1
            snap = server.snapshot()
            assert snap["refusals"] == {"queue_full": 2}
            assert snap["sites"]["a"]["messages_in"] == 2 + 14
            assert snap["sites"]["b"]["messages_out"] == 4 + 14
            assert snap["sites"]["b"]["pending"] == 0
            await b.close()

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- status


TOKEN = "relay-status-token-0123456789"


def test_status_endpoint_counts_per_site_and_guards_its_data(ids, roster):
    a = codec(ids, roster, "a")

    async def scenario() -> None:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            sent = [frame(a, "b") for _ in range(3)]
            for body in sent:
                assert (await post(url, body))[0] == 200
            assert (await post(url, frame(a, "b", encrypt=False)))[0] == 403
            app = create_relay_status_app(server, token=TOKEN)
            runner, port = await start_status_server(app, "127.0.0.1", 0)
            base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.get(base + "/healthz") as r:
                        assert (r.status, await r.text()) == (200, "ok")
                    for path in ("/status", "/metrics"):
                        async with s.get(base + path) as r:
                            assert r.status == 401, path
                    async with s.get(base + "/status", headers={**auth, "Host": "evil.test"}) as r:
                        assert r.status == 403 and (await r.json())["reason"] == "bad_host"
                    async with s.get(base + "/status", headers=auth) as r:
                        snap = await r.json()
                    async with s.get(base + "/metrics", headers=auth) as r:
                        assert r.status == 200 and "version=0.0.4" in r.headers["Content-Type"]
                        text = await r.text()
            finally:
                await runner.cleanup()
            await b.close()
        site = snap["sites"]["b"]
        assert snap["relay"] == "r1" and snap["federation"] == FED and snap["uptime_s"] >= 0
        assert site["connected"] and site["messages_out"] == 3 and site["pending"] == 0
        assert site["bytes_out"] == sum(map(len, sent)) == snap["sites"]["a"]["bytes_in"]
        assert snap["sites"]["c"] == {**snap["sites"]["c"], "connected": False, "messages_out": 0}
        assert snap["refusals"] == {"bad_host": 1, "encryption_required": 1}
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        key = (("direction", "out"), ("relay", "r1"), ("site", "b"))
        assert samples[("p2pfl_relay_messages_total", key)] == 3
        assert samples[("p2pfl_relay_bytes_total", key)] == sum(map(len, sent))
        assert samples[("p2pfl_relay_site_connected", (("relay", "r1"), ("site", "b")))] == 1
        refused = (("reason", "encryption_required"), ("relay", "r1"))
        assert samples[("p2pfl_relay_refusals_total", refused)] == 1

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- config


def write_relay_yaml(folder: Path, relay: dict[str, Any], **sections: Any) -> Path:
    doc = {"relay": relay, "federation": {"id": FED, "roster": "../roster.yaml"}, **sections}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "relay.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_relay_config_resolves_paths_and_explains_mistakes_in_one_line(ids, tmp_path):
    make_roster(ids).save(tmp_path / "roster.yaml")
    cfg = load_relay_config(write_relay_yaml(tmp_path / "r1", {"name": "r1"}))
    assert cfg.federation.roster == tmp_path / "r1" / "../roster.yaml"
    assert cfg.relay.listen == "0.0.0.0:7100" and cfg.status.port == 8100
    assert cfg.relay.max_pending_per_site == 64 and cfg.wire.max_message_bytes == 512 << 20
    mistakes = {
        "relay.max_pending": ({"name": "r1", "max_pending": 3}, {}),
        "relay.name": ({"listen": "0.0.0.0:7100"}, {}),
        "relay.listen": ({"name": "r1", "listen": "nowhere"}, {}),
        "wire.encryption": ({"name": "r1"}, {"wire": {"encryption": False}}),
        "transport.tls.cert": (
            {"name": "r1"},
            {"transport": {"tls": {"cert": "c.pem", "key": "k.pem", "ca": "ca.pem"}}},
        ),
    }
    for field, (relay_section, sections) in mistakes.items():
        path = write_relay_yaml(tmp_path / field, relay_section, **sections)
        with pytest.raises(ConfigError) as caught:
            load_relay_config(path)
        message = str(caught.value)
        assert caught.value.field == field and "\n" not in message, message
    # a relay the roster does not list cannot start
    from node.relay_status import RelayProcess

    cfg = load_relay_config(write_relay_yaml(tmp_path / "r9", {"name": "r9"}))
    with pytest.raises(ConfigError, match="relay.name"):
        RelayProcess(cfg, Roster.load(tmp_path / "roster.yaml"))


def test_relay_process_listens_with_tls_only_and_reloads_its_roster(ids, tmp_path):
    from test_tls import make_pki

    from node.provision import free_ports
    from node.relay_status import RelayProcess
    from node.tls import client_ssl_context

    make_pki(tmp_path, ["r1", "a", "b"])
    roster_path = tmp_path / "roster.yaml"
    roster = make_roster(ids, roster_path)
    roster.save(roster_path)
    (port,) = free_ports(1)
    tls = {"cert": "../r1.crt", "key": "../r1.key", "ca": "../ca.pem"}
    cfg = load_relay_config(
        write_relay_yaml(
            tmp_path / "r1",
            {"name": "r1", "listen": f"127.0.0.1:{port}"},
            transport={"tls": tls},
            status={"enabled": False},
        )
    )
    a = codec(ids, roster, "a")
    pem = {n: [str(tmp_path / f"{n}.{e}") for e in ("crt", "key")] for n in ("a", "b")}
    a_tls = client_ssl_context(*pem["a"], str(tmp_path / "ca.pem"))
    b_tls = client_ssl_context(*pem["b"], str(tmp_path / "ca.pem"))

    async def scenario() -> None:
        process = RelayProcess(cfg, Roster.load(roster_path))
        await process.start()
        url = f"https://127.0.0.1:{port}"
        try:
            b = RelaySite(ids["b"], roster)
            assert await b.connect(url, ssl_context=b_tls) == {"type": "ok"}
            assert (await post(url, frame(a, "b"), a_tls))[0] == 200
            with pytest.raises(aiohttp.ClientError):  # no plaintext fallback
                await post(f"http://127.0.0.1:{port}", frame(a, "b"))
            # b leaves the roster: a reload (SIGHUP) disconnects it
            kept = [c for c in roster.cards() if c.name != "b"]
            Roster(kept, roster_path, relays=roster.relays).save(roster_path)
            process.reload_roster()
            await until(lambda: "b" not in process.server.links)
            status, body = await post(url, frame(a, "b"), a_tls)
            assert (status, reason(body)) == (503, "not_connected")
            await b.close()
        finally:
            await process.stop()

    asyncio.run(scenario())


def test_a_relay_without_a_status_token_keeps_one_in_a_0600_file_and_logs_only_its_path(
    ids, tmp_path, caplog, capfd
):
    """Without status.token or token_file the relay printed a random token to
    stderr, where log collectors keep it. Now it is kept in status.token beside
    relay.yaml (created 0600, reused on the next start); only the path is logged."""
    import stat

    from node.provision import free_ports
    from node.relay_status import RelayProcess

    make_roster(ids).save(tmp_path / "roster.yaml")
    (port,) = free_ports(1)
    path = write_relay_yaml(
        tmp_path / "r1", {"name": "r1", "listen": f"127.0.0.1:{port}"}, status={"port": 0}
    )
    cfg = load_relay_config(path)
    token_file = tmp_path / "r1" / "status.token"

    async def scenario() -> tuple[str, list[int]]:
        process = RelayProcess(cfg, Roster.load(tmp_path / "roster.yaml"), path)
        await process.start()
        base = f"http://127.0.0.1:{process.status_port}/status"
        statuses = []
        try:
            async with aiohttp.ClientSession() as s:
                for token in (process.token, "not-" + process.token):
                    async with s.get(base, headers={"Authorization": f"Bearer {token}"}) as r:
                        statuses.append(r.status)
        finally:
            await process.stop()
        return process.token, statuses

    with caplog.at_level("INFO"):
        token, statuses = asyncio.run(scenario())
        again, _ = asyncio.run(scenario())
    assert statuses == [200, 401]
    assert token_file.read_text().strip() == token == again and len(token) >= 32
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    logged = "\n".join(r.getMessage() for r in caplog.records)
    printed = capfd.readouterr()
    assert str(token_file) in logged
    assert token not in logged + printed.out + printed.err
    # built from a config with no file to keep it beside: refused, not made up
    with pytest.raises(ConfigError, match="status.token"):
        RelayProcess(cfg, Roster.load(tmp_path / "roster.yaml"))


# ----------------------------------------------------------------------------- process + flood

FLOODER = r"""
import asyncio, collections, json, struct, sys
sys.path.insert(0, sys.argv[4])
from fault_util import KeepAliveConnection, http_post

async def main(port, frames_path, path):
    data, frames, pos = open(frames_path, "rb").read(), [], 0
    while pos < len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        frames.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    todo, counts = iter(frames), collections.Counter()

    async def worker():
        conn = KeepAliveConnection(port)
        for body in todo:
            try:
                counts[(await conn.exchange(http_post(port, body, path), 30)).status] += 1
            except Exception as exc:
                counts[type(exc).__name__] += 1
        conn.close()

    print("flooding", flush=True)
    await asyncio.gather(*(worker() for _ in range(16)))
    print(json.dumps(counts), flush=True)

asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
"""


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


@pytest.mark.exclusive  # compares latencies under load with unloaded ones: run alone
def test_relay_process_keeps_heartbeats_flowing_while_one_site_floods(ids, tmp_path):
    from node.provision import free_ports

    roster_path = tmp_path / "roster.yaml"
    roster = make_roster(ids, roster_path)
    roster.save(roster_path)
    port, status_port = free_ports(2)
    config = write_relay_yaml(
        tmp_path / "r1",
        # 50 frames/s per sender: the flood outruns it even on a loaded machine; a's
        # heartbeats (one per 50 ms at most) stay under it
        {"name": "r1", "listen": f"127.0.0.1:{port}", "rate_limit_per_s": 50},
        status={"port": status_port, "token": TOKEN},
    )
    url, status_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{status_port}"
    a, f = codec(ids, roster, "a"), codec(ids, roster, "f")
    flood = [frame(f, "b", {"round": 1}) for _ in range(400)]  # 7 s at its rate
    frames_path = tmp_path / "flood.bin"
    frames_path.write_bytes(b"".join(struct.pack(">I", len(x)) + x for x in flood))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "relay.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "node.cli", "relay", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        result = asyncio.run(_flood_scenario(ids, roster, a, url, status_url, frames_path, proc))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    relay_log = log_path.read_text()
    assert "RELAY r1: listening on http://127.0.0.1:" in relay_log
    assert "site b connected" in relay_log and "RELAY r1: stopped" in relay_log
    assert "Traceback" not in relay_log, relay_log[-3000:]
    counts, base, loaded, snap, flood_s = result
    bound = max(5 * p99(base), 0.5)
    print(
        json.dumps(
            {
                "baseline_p99_s": round(p99(base), 4),
                "flooded_p99_s": round(p99(loaded), 4),
                "bound_s": round(bound, 4),
                "heartbeats": [len(base), len(loaded)],
                "flood": counts,
                "flood_s": round(flood_s, 2),
            }
        )
    )
    assert sum(counts.values()) == len(flood) and set(counts) <= {"200", "429", "503"}, counts
    # the flooder was held to its rate (its frames waited their turn), never beyond it
    assert snap["sites"]["f"]["delayed"] > 0
    assert counts.get("200", 0) <= 50 + 50 * flood_s + 1
    assert snap["refusals"].get("rate_limited", 0) == counts.get("429", 0)
    assert snap["sites"]["b"]["messages_out"] == counts["200"] + len(base) + len(loaded)
    assert p99(loaded) <= bound


async def _flood_scenario(ids, roster, a, url, status_url, frames_path, proc):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + 60
        while True:  # the relay process is up once /healthz answers
            assert proc.poll() is None, "the relay exited"
            assert time.monotonic() < deadline, "the relay did not start"
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(status_url + "/healthz") as r:
                    if r.status == 200:
                        break
            await asyncio.sleep(0.1)
        b = RelaySite(ids["b"], roster)
        assert await b.connect(url) == {"type": "ok"}

        async def heartbeat() -> float:
            started = time.monotonic()
            async with s.post(url + RELAY_MESSAGE_PATH, data=frame(a, "b")) as r:
                assert r.status == 200, await r.text()
                await r.read()
            return time.monotonic() - started

        base = []
        for _ in range(40):
            base.append(await heartbeat())
            await asyncio.sleep(0.05)
        flooder = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            FLOODER,
            url.rsplit(":", 1)[1],
            str(frames_path),
            RELAY_MESSAGE_PATH,
            str(ROOT / "tests"),
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert flooder.stdout is not None
        assert (await asyncio.wait_for(flooder.stdout.readline(), 30)).strip() == b"flooding"
        loaded = []
        started = time.monotonic()
        done = asyncio.create_task(flooder.communicate())
        while not done.done() or len(loaded) < 30:
            assert time.monotonic() < started + 120, "the flood did not end"
            loaded.append(await heartbeat())
            await asyncio.sleep(0.05)
        out, _ = await done
        flood_s = time.monotonic() - started
        counts = json.loads(out.decode().strip().splitlines()[-1])
        async with s.get(status_url + "/status", headers=auth) as r:
            snap = await r.json()
        await b.close()
    return counts, base, loaded, snap, flood_s


def test_a_relays_fault_plan_kills_it_as_it_is_about_to_carry_its_round(
    ids, roster, tmp_path, monkeypatch
):
    """The relay drill's kill (node/faults.py, phase `forward`): the relay
    SIGKILLs itself on the first frame whose signed header says round R or
    later, before forwarding it; frames of earlier rounds pass; a restarted
    relay reading the same plan does not fire it again."""
    import signal

    import node.faults
    from node.faults import FaultPlan

    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(node.faults.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    plan_file = tmp_path / "faults.json"
    plan_file.write_text(json.dumps({"kill": [{"id": "r1-drill", "round": 5, "phase": "forward"}]}))
    a = codec(ids, roster, "a")

    async def scenario() -> None:
        async with relay(roster) as (server, url):
            server.faults = FaultPlan(plan_file)
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            early = a.encode("heartbeat", "b", {"round": 4}, round=4, encrypt=True).to_bytes()
            assert (await post(url, early))[0] == 200
            assert signals == []
            late = a.encode("heartbeat", "b", {"round": 7}, round=7, encrypt=True).to_bytes()
            await post(url, late)  # the first at or after round 5: the kill fires here
            assert signals == [(os.getpid(), signal.SIGKILL)]
            assert b.received[0] == early
            # a restarted relay with the same plan: already fired, carries on
            server.faults = FaultPlan(plan_file)
            again = a.encode("heartbeat", "b", {"round": 8}, round=8, encrypt=True).to_bytes()
            assert (await post(url, again))[0] == 200
            assert len(signals) == 1
            await b.close()

    asyncio.run(scenario())
    events = [
        json.loads(x) for x in (tmp_path / "faults.json.events.jsonl").read_text().splitlines()
    ]
    assert [(e["event"], e["round"], e["phase"]) for e in events] == [("kill", 7, "forward")]
    # what it had forwarded when it died (the round-4 frame), for the drill's byte count
    assert events[0]["state"]["forwarded"]["messages"] == 1
