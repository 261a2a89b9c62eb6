"""Hostile review of the relay's upgrade handshake (issue 31, node/relay_handshake.py).

Each test is an attack that worked on the handshake as first written, against
real aiohttp servers on 127.0.0.1, real Ed25519 identities and the real
Gatekeeper, RelayTunnel and relay status-token code:

- one IPv6 host (a /64: every address of it is its own) took every handshake
  slot, past `max_handshakes_per_host`, so no site could connect;
- max_handshakes / max_handshakes_per_host IPv4 addresses (8 by default),
  asking a challenge each every auth_timeout_s, kept every site from
  connecting (429 for all): a full pool now gives the slot of the host that
  holds most to whoever asks;
- each challenge asked for set its own timer for auth_timeout_s, and a
  stranger using (burning) each at once could ask again: timers grew with the
  rate of asking, unbounded by the slots; there is now one;
- a relay (or, without TLS, anyone on the path) redirected a site's challenge
  or upgrade request to another host: the site followed, to any address inside
  its own network, over plain HTTP even when it dialled HTTPS;
- a relay's cookies were kept by the site's tunnel for ever and sent back on
  every dial: a relay could grow the site's memory by Set-Cookie with new
  names each time it made the site dial again;
- a relay's challenge nonce of any printable or control text was signed by
  the site, a signing oracle under the relay-auth context;
- a `status.token` beside relay.yaml that someone else made world-readable, or
  replaced with a symbolic link, was read and served as the relay's token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import test_relay
from aiohttp import web
from test_relay import (
    FED,
    RelaySite,
    challenge_nonce,
    make_roster,
    relay,
    until,
    upgrade,
    write_relay_yaml,
)
from test_relay_attacks import fake_relay, honest_challenge, serve, tunnel

from node.relay_handshake import Gatekeeper, HandshakeRefused, open_relay_socket, proof_headers
from node.relay_wire import RELAY_CHALLENGE_PATH, RELAY_CONNECT_PATH
from node.transport import MESSAGE_PATH
from p2pfl.config import ConfigError, RelaySettings, load_relay_config
from p2pfl.secure.identity import LocalIdentity

ids = test_relay.ids  # the relay tests' shared fixtures (module scope)
roster = test_relay.roster


def test_the_addresses_of_one_ipv6_host_share_its_handshake_slots():
    """An IPv6 host is given a /64 and picks any address in it: counted per
    address, one host held max_handshakes_per_host slots per address, i.e. all
    of them. The addresses of one /64 (and an IPv4 address written as
    IPv4-mapped IPv6) now count as one host."""
    refusals: list[str] = []
    settings = RelaySettings(max_handshakes=64, max_handshakes_per_host=2)
    gate = Gatekeeper("r1", FED, settings, lambda reason, who: refusals.append(reason))
    one_host = [gate.issue(f"2001:db8:1:2::{i:x}") for i in range(1, 6)]
    assert [isinstance(n, str) for n in one_host] == [True, True, False, False, False]
    assert refusals == []  # a refused challenge is counted by the route, not here
    assert isinstance(gate.issue("2001:db8:1:3::1"), str)  # the next /64: another host
    ipv4 = [gate.issue(h) for h in ("192.0.2.7", "::ffff:192.0.2.7", "192.0.2.7")]
    assert [isinstance(n, str) for n in ipv4] == [True, True, False]
    assert isinstance(gate.issue("192.0.2.8"), str)  # IPv4: each address its own host
    assert gate.in_progress() == 6


def test_strangers_on_a_few_addresses_cannot_keep_every_site_from_connecting(ids, roster):
    """Two stranger addresses holding max_handshakes_per_host challenges each
    filled a pool of 4, and every site was refused 429 as long as they renewed
    them. A full pool now gives up the oldest challenge of the host that holds
    most (counted `handshake_evicted`): a site asking gets a slot, and the
    strangers asking again and again take their own slots, never the site's."""

    async def stranger(url: str, address: str) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(local_addr=(address, 0))
        return aiohttp.ClientSession(connector=connector)

    async def ask(session: aiohttp.ClientSession, url: str) -> int:
        async with session.get(url + RELAY_CHALLENGE_PATH) as r:
            return r.status

    async def scenario() -> None:
        async with (
            relay(roster, max_handshakes=4, max_handshakes_per_host=2) as (server, url),
            aiohttp.ClientSession() as site_session,
        ):
            strangers = [await stranger(url, f"127.0.0.{i}") for i in (2, 3)]
            try:
                assert [await ask(s, url) for s in strangers for _ in range(2)] == [200] * 4
                nonce = await challenge_nonce(site_session, url)  # the pool is full
                statuses = [await ask(s, url) for _ in range(10) for s in strangers]
                assert set(statuses) <= {200, 429}
                assert server.gate.in_progress() <= 4  # still bounded
                headers = proof_headers(ids["b"], FED, "r1", nonce)
                assert await upgrade(site_session, url, headers) == (101, None)
                assert server.refusals.get("handshake_evicted", 0) >= 1
                c = RelaySite(ids["c"], roster)  # and the next site connects too
                assert await c.connect(url) == {"type": "ok"}
                await c.close()
            finally:
                for s in strangers:
                    await s.close()

    asyncio.run(scenario())


def test_challenges_asked_and_burnt_at_once_set_no_timer_each(ids, roster):
    """A stranger that burns each nonce at once (a junk upgrade frees its slot)
    could ask for the next: every challenge had scheduled a call for
    auth_timeout_s later, so the relay's timers grew with the asking rate."""

    async def scenario() -> tuple[int, int, dict[str, int]]:
        async with (
            relay(roster, max_handshakes_per_host=1) as (server, url),
            aiohttp.ClientSession() as s,
        ):
            loop = asyncio.get_running_loop()

            def timers() -> int:  # live ones (a cancelled one waits in the heap a while)
                return sum(not t.cancelled() for t in loop._scheduled)  # type: ignore[attr-defined]

            before = timers()
            for _ in range(60):
                nonce = await challenge_nonce(s, url)
                junk = proof_headers(ids["x"], FED, "r1", nonce)
                assert await upgrade(s, url, junk) == (403, "unknown_site")
            after = timers()
            return before, after, dict(server.refusals)

    before, after, refusals = asyncio.run(scenario())
    assert refusals == {"unknown_site": 60}
    assert after - before < 10, f"{after - before} timers for 60 challenges"


def test_behind_a_proxy_a_stranger_asking_again_and_again_does_not_keep_a_site_out(ids, roster):
    """Behind a proxy (docs/operations.md) every client has the proxy's
    address, so one stranger held that host's slots and every site got 429.
    With max_handshakes_per_host = max_handshakes (the setting for a proxy) a
    full pool gives up its oldest challenge: the site's, just asked for,
    survives the stranger asking again."""

    async def scenario() -> None:
        async with (
            relay(roster, max_handshakes=4, max_handshakes_per_host=4) as (server, url),
            aiohttp.ClientSession() as stranger,
            aiohttp.ClientSession() as site,
        ):
            for _ in range(4):
                await challenge_nonce(stranger, url)
            nonce = await challenge_nonce(site, url)  # full: was 429
            for _ in range(3):
                await challenge_nonce(stranger, url)
            headers = proof_headers(ids["b"], FED, "r1", nonce)
            assert await upgrade(site, url, headers) == (101, None)
            assert server.refusals == {"handshake_evicted": 4}

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def elsewhere() -> AsyncIterator[tuple[str, list[str]]]:
    """Another host inside the site's network: (base URL, the paths it was asked)."""
    hits: list[str] = []

    async def anything(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        if request.path == RELAY_CHALLENGE_PATH:
            return await honest_challenge(request, len(hits))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()
        return ws

    app = web.Application()
    app.router.add_get("/{tail:.*}", anything)
    async with serve(app) as port:
        yield f"http://127.0.0.1:{port}", hits


def test_a_relay_cannot_redirect_a_sites_challenge_to_another_host(ids):
    """aiohttp follows redirects by default: a relay answering the challenge
    with a 307 made the site fetch (and trust) a challenge from any address."""

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        raise AssertionError("no upgrade after a redirected challenge")

    async def scenario() -> None:
        async with elsewhere() as (target, hits):

            async def redirect(request: web.Request, n: int) -> web.StreamResponse:
                raise web.HTTPTemporaryRedirect(target + RELAY_CHALLENGE_PATH)

            async with fake_relay(handler, redirect) as port, aiohttp.ClientSession() as s:
                with pytest.raises(HandshakeRefused, match="307"):
                    await open_relay_socket(
                        s, f"http://127.0.0.1:{port}", identity=ids["b"], relay="r1", federation=FED
                    )
            assert hits == [], "the site asked the host it was redirected to"

    asyncio.run(scenario())


def test_a_relay_cannot_redirect_a_sites_upgrade_to_another_host(ids):
    """A relay answering the upgrade request with a 307 made the site's tunnel
    open its WebSocket to any address (ws_connect follows redirects and has no
    option not to); the tunnel now talks to its relay's address only."""

    async def scenario() -> None:
        async with elsewhere() as (target, hits):
            connects: list[int] = []

            async def relay_connect(request: web.Request) -> web.StreamResponse:
                connects.append(1)
                raise web.HTTPTemporaryRedirect(target + RELAY_CONNECT_PATH)

            async def challenge(request: web.Request) -> web.StreamResponse:
                return await honest_challenge(request, 1)

            app = web.Application()
            app.router.add_get(RELAY_CHALLENGE_PATH, challenge)
            app.router.add_get(RELAY_CONNECT_PATH, relay_connect)
            async with serve(app) as port:
                t = tunnel(ids, port, "http://127.0.0.1:9" + MESSAGE_PATH, 1 << 20)
                t.start()
                try:
                    # a second upgrade (it dialled again) or the other host asked: either ends it
                    await until(lambda: len(connects) >= 2 or bool(hits), timeout=10)
                finally:
                    await t.stop()
            assert hits == [], "the tunnel followed the relay's redirect"
            assert t.connects == 0 and not t.connected
            assert "redirect" in t.last_error, t.last_error

    asyncio.run(scenario())


def test_a_relay_cannot_make_the_sites_tunnel_keep_cookies(ids):
    """Each challenge sets 20 new cookies and each connection is closed at
    once: the tunnel kept them all (aiohttp's session cookie jar) and sent
    them back on its next upgrade. It now keeps none."""
    sent_back: list[int] = []

    async def challenge(request: web.Request) -> web.StreamResponse:
        response = await honest_challenge(request, 1)
        for i in range(20):
            response.set_cookie(f"c{len(sent_back)}_{i}", "x" * 100)
        return response

    async def connect(request: web.Request) -> web.StreamResponse:
        sent_back.append(len(request.cookies))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.close()
        return ws

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get(RELAY_CHALLENGE_PATH, challenge)
        app.router.add_get(RELAY_CONNECT_PATH, connect)
        async with serve(app) as port:
            # by name: aiohttp keeps no cookie of an IP address
            t = tunnel(ids, port, "http://127.0.0.1:9" + MESSAGE_PATH, 1 << 20)
            t.address, t.url = f"localhost:{port}", f"http://localhost:{port}"
            t.start()
            try:
                await until(lambda: len(sent_back) >= 3, timeout=10)
            finally:
                await t.stop()

    asyncio.run(scenario())
    assert sent_back[:3] == [0, 0, 0], sent_back


@pytest.mark.parametrize(
    "nonce",
    [
        "ab" * 20 + "\nsomething else to sign",
        "AB" * 20,  # the relay issues lowercase hex only
        "not hex at all, but ascii!",
        "abc" * 11,  # odd length: no bytes
    ],
)
def test_a_site_signs_only_a_nonce_shaped_as_the_relays(ids, nonce):
    """The site signed any ASCII text of 16..256 characters a relay sent as its
    nonce (newlines included): a signing oracle for whoever answers the
    challenge (without TLS, anyone on the path). It now signs hex bytes only."""
    connects: list[int] = []

    async def challenge(request: web.Request, n: int) -> web.StreamResponse:
        return web.json_response(
            {"type": "challenge", "relay": "r1", "federation": FED, "nonce": nonce}
        )

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        connects.append(n)

    async def scenario() -> None:
        async with fake_relay(handler, challenge) as port, aiohttp.ClientSession() as s:
            with pytest.raises(HandshakeRefused, match="malformed challenge"):
                ws = await open_relay_socket(
                    s, f"http://127.0.0.1:{port}", identity=ids["b"], relay="r1", federation=FED
                )
                await ws.close()

    asyncio.run(scenario())
    assert connects == [], "the site sent a proof over the relay's text"


def _relay_yaml(ids: dict[str, LocalIdentity], tmp_path: Path) -> Path:
    make_roster(ids).save(tmp_path / "roster.yaml")
    return write_relay_yaml(tmp_path / "r1", {"name": "r1"}, status={"port": 0})


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_relay_refuses_a_status_token_file_others_may_read(ids, tmp_path, mode):
    """The relay's own status.token (made 0600) was read whatever its mode: one
    that someone made readable to others (or a copy restored 0644) was served as
    the bearer token. Such a file is now refused, with what to do."""
    from node.relay_status import relay_status_token

    path = _relay_yaml(ids, tmp_path)
    token_file = path.parent / "status.token"
    token_file.write_text("t" * 43 + "\n")
    token_file.chmod(mode)
    with pytest.raises(ConfigError, match="chmod 600") as caught:
        relay_status_token(load_relay_config(path), path)
    assert caught.value.field == "status" and "t" * 43 not in str(caught.value)
    token_file.chmod(0o600)  # the operator's fix: the same token is used
    assert relay_status_token(load_relay_config(path), path) == ("t" * 43, token_file)


def test_a_relay_refuses_a_status_token_path_that_is_a_symbolic_link(ids, tmp_path):
    """status.token beside relay.yaml replaced by a link (to a token whoever made
    the link knows, or to another secret) was followed and served."""
    from node.relay_status import relay_status_token

    path = _relay_yaml(ids, tmp_path)
    elsewhere_file = tmp_path / "planted.token"
    elsewhere_file.write_text("p" * 43 + "\n")
    elsewhere_file.chmod(0o600)
    os.symlink(elsewhere_file, path.parent / "status.token")
    with pytest.raises(ConfigError, match="link"):
        relay_status_token(load_relay_config(path), path)
