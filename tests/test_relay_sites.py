"""Sites behind relays (issue 31): the sending side's failover between relays,
the site's tunnel, and real node processes of which two accept no inbound
connection at all.

- MessageClient: a relayed peer's link holds one URL per relay; a dead relay
  or one the peer is not connected to (503 not_connected) moves the link to the
  next, which it then keeps using.
- RelayTunnel + RelayServer (node/relay.py) + a real MessageServer in one
  process: a frame POSTed to the relay reaches the site byte for byte, and the
  sender gets the site's own answer.
- Real daemons on loopback (bench/localfed.py, node/provision.py): 4 sites, 2
  of them `address: null` behind relays, wire.encryption on; probe, then
  FedAVGP2P with secure aggregation; two relays with one never started; a relay
  SIGKILLed mid-run and restarted: every node completes every round and the
  journals show nothing acknowledged lost and nothing processed twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import ssl
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from aiohttp import web
from test_tls import make_pki

from bench.localfed import LocalFederation, RelayProcess
from node.cli import main as cli_main
from node.provision import free_ports, provision
from node.queues import Checkpoints
from node.relay import RelayServer
from node.relay_tunnel import RelayTunnel
from node.relay_wire import RELAY_MESSAGE_PATH
from node.tls import client_ssl_context, server_ssl_context
from node.transport import MESSAGE_PATH, IncomingFrame, MessageServer
from node.transport_client import MessageClient, TransportError
from p2pfl.config import TransportSection
from p2pfl.config.relay import RelaySettings
from p2pfl.secure.identity import Roster
from p2pfl.secure.wire import WireCodec

FED = "fed-test"


def transport(**kw: Any) -> TransportSection:
    settings: dict[str, Any] = {
        "request_timeout_s": 5.0,
        "connect_timeout_s": 1.0,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
    }
    return TransportSection(**{**settings, **kw})


class Endpoint:
    """A live HTTP endpoint that counts what it is sent and answers `status`:
    what a relay answers when the peer is there (200) or not (503)."""

    def __init__(self, status: int, reason: str | None = None) -> None:
        self.status = status
        self.reason = reason
        self.bodies: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.read())
        body = {"reason": self.reason} if self.reason else {"ok": True}
        return web.json_response(body, status=self.status)

    async def __aenter__(self) -> Endpoint:
        app = web.Application()
        app.router.add_post(RELAY_MESSAGE_PATH, self.handle)
        app.router.add_post(MESSAGE_PATH, self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_a_dead_relay_first_fails_over_to_the_live_one_and_keeps_it(codecs):
    dead = free_ports(1)[0]  # nothing listens there
    message = codecs["alice"].encode("probe", "bob", {"x": 1}, round=1)
    client = MessageClient(transport(retries=2), None)
    try:
        async with Endpoint(200) as live:
            client.set_relayed_peer("bob", [f"127.0.0.1:{dead}", f"127.0.0.1:{live.port}"])
            link = client.links["bob"]
            assert link.relayed and link.url.endswith(f":{dead}{RELAY_MESSAGE_PATH}")
            status, _ = await client.post("bob", message)
            assert status == 200
            assert live.bodies == [message.to_bytes()], "the frame must arrive as it was sent"
            # the link now prefers the relay that worked: the next send goes there at once
            assert link.url.endswith(f":{live.port}{RELAY_MESSAGE_PATH}")
            again = codecs["alice"].encode("probe", "bob", {"x": 2}, round=1)
            status, _ = await client.post("bob", again, retries=0)
            assert status == 200 and len(live.bodies) == 2
            # the roster read again with the same relays: the working one stays in use
            client.set_relayed_peer("bob", [f"127.0.0.1:{dead}", f"127.0.0.1:{live.port}"])
            assert link.url.endswith(f":{live.port}{RELAY_MESSAGE_PATH}")
    finally:
        await client.close()


async def test_sends_failing_together_on_a_dead_relay_step_once_to_the_live_one(codecs):
    """Four sends at once, all failing on the dead relay: the link moves on once,
    not four times (which would have brought it back to the dead one)."""
    dead = free_ports(1)[0]
    client = MessageClient(transport(retries=2), None)
    try:
        async with Endpoint(200) as live:
            client.set_relayed_peer("bob", [f"127.0.0.1:{dead}", f"127.0.0.1:{live.port}"])
            messages = [codecs["alice"].encode("probe", "bob", {"i": i}, round=1) for i in range(4)]
            answers = await asyncio.gather(*(client.post("bob", m) for m in messages))
            assert [status for status, _ in answers] == [200] * 4
            assert len(live.bodies) == 4
            assert client.links["bob"].url.endswith(f":{live.port}{RELAY_MESSAGE_PATH}")
    finally:
        await client.close()


async def test_not_connected_on_one_relay_moves_to_the_next(codecs):
    message = codecs["alice"].encode("probe", "bob", {"x": 1}, round=1)
    client = MessageClient(transport(retries=1), None)
    try:
        async with Endpoint(503, "not_connected") as absent, Endpoint(200) as present:
            client.set_relayed_peer(
                "bob", [f"127.0.0.1:{absent.port}", f"127.0.0.1:{present.port}"]
            )
            status, _ = await client.post("bob", message)
            assert status == 200
            assert len(absent.bodies) == 1 and len(present.bodies) == 1
    finally:
        await client.close()


async def test_a_refusal_of_the_receiver_is_final_and_does_not_fail_over(codecs):
    """A 4xx is the final receiver's answer (passed through by the relay): the
    same frame through another relay would be refused the same way."""
    message = codecs["alice"].encode("probe", "bob", {"x": 1}, round=1)
    client = MessageClient(transport(retries=3), None)
    try:
        async with Endpoint(401, "bad_signature") as first, Endpoint(200) as second:
            client.set_relayed_peer("bob", [f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"])
            status, body = await client.post("bob", message)
            assert status == 401 and json.loads(body)["reason"] == "bad_signature"
            assert len(first.bodies) == 1 and not second.bodies
    finally:
        await client.close()


async def test_queue_full_is_handed_back_at_once_and_the_next_try_takes_the_next_relay(codecs):
    """Review 4, R2 and review 5: a 503 `queue_full` is the receiver's "later",
    or a relay's whose own slots for it are full: raised to the caller after
    one attempt (node/outbound.py sends a push again until its deadline), and
    the next attempt goes to the next relay, so a congested relay does not
    hold the link (review 5: every send stayed on it, 0 of 20 delivered while
    the other relay was idle). Not a breaker failure, and no success either:
    a breaker opened before stays open (a relay answering for a hung peer
    must not keep closing it)."""
    message = codecs["alice"].encode("probe", "bob", {"x": 1}, round=1)
    client = MessageClient(transport(retries=3, breaker_failures=3), None)
    try:
        async with Endpoint(503, "queue_full") as busy, Endpoint(200) as other:
            client.set_relayed_peer("bob", [f"127.0.0.1:{busy.port}", f"127.0.0.1:{other.port}"])
            link = client.links["bob"]
            link.breaker.failures = 2  # one more failure would open it
            with pytest.raises(TransportError) as err:
                await client.post("bob", message)
            assert (err.value.reason, err.value.status) == ("queue_full", 503)
            assert len(busy.bodies) == 1 and not other.bodies
            assert link.url.endswith(f":{other.port}{RELAY_MESSAGE_PATH}")
            assert link.breaker.failures == 2  # neither counted nor reset
            delivered = [(await client.post("bob", message))[0] for _ in range(5)]
            assert delivered == [200] * 5 and len(busy.bodies) == 1
    finally:
        await client.close()


async def test_queue_full_leaves_an_open_breaker_open(codecs):
    message = codecs["alice"].encode("probe", "bob", {"x": 1}, round=1)
    client = MessageClient(transport(retries=3, breaker_failures=1), None)
    try:
        async with Endpoint(503, "queue_full") as busy:
            client.set_relayed_peer("bob", [f"127.0.0.1:{busy.port}"])
            client.links["bob"].breaker.failure(time.monotonic(), 1, 60.0)
            assert client.breaker_open("bob")
            with pytest.raises(TransportError) as err:
                await client.post("bob", message, probe=True)  # heartbeats pass it
            assert err.value.reason == "queue_full"
            assert client.breaker_open("bob")  # still open
    finally:
        await client.close()


async def test_every_relay_down_is_a_transport_error_not_a_hang(codecs):
    ports = free_ports(2)
    message = codecs["alice"].encode("probe", "bob", {"x": 1}, round=1)
    client = MessageClient(transport(retries=3), None)
    try:
        client.set_relayed_peer("bob", [f"127.0.0.1:{p}" for p in ports])
        started = time.monotonic()
        with pytest.raises(TransportError) as err:
            await client.post("bob", message)
        assert err.value.reason == "unreachable"
        assert time.monotonic() - started < 5.0
    finally:
        await client.close()


# ---------------------------------------------------------------- a tunnel to a real relay, in process


def relayed_roster(identities, behind: str, relays: dict[str, str]) -> Roster:
    """The conftest sites, `behind` outbound-only through every relay in `relays`."""
    cards = []
    for i, ident in enumerate(identities.values()):
        card = ident.card(f"127.0.0.1:{7000 + i}")
        if ident.name == behind:
            card = dataclasses.replace(card, address=None, via=tuple(relays))
        cards.append(card)
    return Roster(cards, relays=relays)


class Site:
    """An outbound-only site in process: a real MessageServer on loopback that
    answers each verified frame with `answer(frame)`, and its RelayTunnels."""

    def __init__(
        self, identities, roster: Roster, name: str, answer: Any = None, pki: Path | None = None
    ) -> None:
        self.codec = WireCodec(identities[name], roster, FED, require_encryption=True)
        self.frames: list[bytes] = []
        self.answer = answer
        self.rejected: list[str] = []
        self.server = MessageServer(
            self.codec, transport(), self.on_frame, lambda r, _p: self.rejected.append(r)
        )
        self.identity = identities[name]
        self.roster = roster
        self.tunnels: list[RelayTunnel] = []
        self.pki = pki

    async def on_frame(self, frame: IncomingFrame) -> tuple[int, Any]:
        self.frames.append(bytes(frame.frame))
        return 200, (self.answer(frame) if self.answer else None)

    async def start(self) -> None:
        name = self.identity.name
        server_ssl = relay_ssl = None
        if self.pki is not None:  # mutual TLS everywhere, as with transport.tls
            server_ssl = server_tls(self.pki, name)
            relay_ssl = client_tls(self.pki, name)
        await self.server.start("127.0.0.1", 0, server_ssl)
        for relay in self.roster[name].card.via:
            tunnel = RelayTunnel(
                site=self.identity.name,
                relay=relay,
                address=self.roster.relays[relay],
                federation=FED,
                identity=self.identity,
                endpoint=self.server,
                cfg=transport(backoff_max_s=0.2),
                max_message_bytes=MAX,
                relay_ssl=relay_ssl,
            )
            tunnel.start()
            self.tunnels.append(tunnel)

    async def stop(self) -> None:
        for tunnel in self.tunnels:
            await tunnel.stop()
        await self.server.stop()


class Relay:
    """node/relay.py's RelayServer on its own aiohttp app at a fixed port."""

    def __init__(self, name: str, roster: Roster, port: int, pki: Path | None = None) -> None:
        self.server = RelayServer(
            name, FED, roster, RelaySettings(), max_message_bytes=MAX, clock_skew_s=300
        )
        self.port = port
        self.runner: web.AppRunner | None = None
        self.ssl = server_tls(pki, name) if pki is not None else None

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX)
        self.server.add_routes(app)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=self.ssl).start()

    async def stop(self) -> None:
        await self.server.close()
        if self.runner is not None:
            await self.runner.cleanup()


async def until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


MAX = 1 << 22


async def test_a_push_and_a_request_reach_a_site_behind_a_relay_and_its_answer_comes_back(
    identities,
):
    port = free_ports(1)[0]
    roster = relayed_roster(identities, "carol", {"r1": f"127.0.0.1:{port}"})
    alice = WireCodec(identities["alice"], roster, FED, require_encryption=True)

    def answer(frame: IncomingFrame) -> bytes | None:
        if frame.header.kind != "request":
            return None
        return site.codec.encode("response", "alice", {"got": 1}, round=1, encrypt=True).to_bytes()

    site = Site(identities, roster, "carol", answer)
    relay = Relay("r1", roster, port)
    client = MessageClient(transport(retries=2), None)
    await relay.start()
    await site.start()
    try:
        await until(lambda: site.tunnels[0].connected)
        client.set_relayed_peer("carol", [roster.relays["r1"]])
        push = alice.encode("probe", "carol", {"x": torch.arange(4)}, round=1, encrypt=True)
        status, body = await client.post("carol", push)
        ack = json.loads(body)
        assert status == 200 and ack["ok"] is True, (status, body)
        # carol's own signed acknowledgement of this push, not the relay's word
        assert alice.verify_ack("carol", push.header.msg_id, "ok", ack["ack"]), ack
        assert site.frames == [push.to_bytes()], "the relay must hand the frame on unchanged"
        # a request: the answer is the site's own encrypted frame, end to end
        ask = alice.encode("request", "carol", {"q": 1}, round=1, encrypt=True)
        status, body = await client.post("carol", ask)
        assert status == 200
        assert alice.decode(bytearray(body)).payload == {"got": 1}
        # the same frame again: the site refuses the replay itself (the relay keeps no state)
        status, body = await client.post("carol", push)
        assert status == 409 and json.loads(body)["reason"] == "replayed"
        assert site.tunnels[0].snapshot()["forwarded"] == 3
    finally:
        await client.close()
        await site.stop()
        await relay.stop()


def server_tls(pki: Path, name: str) -> ssl.SSLContext:
    return server_ssl_context(
        str(pki / f"{name}.crt"), str(pki / f"{name}.key"), str(pki / "ca.pem")
    )


def client_tls(pki: Path, name: str) -> ssl.SSLContext:
    return client_ssl_context(
        str(pki / f"{name}.crt"), str(pki / f"{name}.key"), str(pki / "ca.pem")
    )


async def test_with_mutual_tls_the_tunnel_and_the_senders_speak_only_tls(identities, tmp_path):
    """transport.tls: the relay listens with TLS, the tunnel dials it with the
    site's certificate, and hands frames to the site's own TLS endpoint."""
    make_pki(tmp_path, ["alice", "carol", "r1"])
    port = free_ports(1)[0]
    roster = relayed_roster(identities, "carol", {"r1": f"127.0.0.1:{port}"})
    alice = WireCodec(identities["alice"], roster, FED, require_encryption=True)
    site = Site(identities, roster, "carol", pki=tmp_path)
    relay = Relay("r1", roster, port, pki=tmp_path)
    client = MessageClient(transport(retries=1), client_tls(tmp_path, "alice"))
    plain = MessageClient(transport(retries=0), None)
    await relay.start()
    await site.start()
    try:
        await until(lambda: site.tunnels[0].connected)
        client.set_relayed_peer("carol", [roster.relays["r1"]])
        push = alice.encode("probe", "carol", {"x": 1}, round=1, encrypt=True)
        status, _ = await client.post("carol", push)
        assert status == 200 and site.frames == [push.to_bytes()]
        plain.set_relayed_peer("carol", [roster.relays["r1"]])  # no TLS: no answer at all
        with pytest.raises(TransportError):
            await plain.post("carol", alice.encode("probe", "carol", {}, round=1, encrypt=True))
        assert len(site.frames) == 1
    finally:
        await client.close()
        await plain.close()
        await site.stop()
        await relay.stop()


async def test_a_tunnel_dials_again_after_its_relay_dies_and_comes_back(identities):
    port = free_ports(1)[0]
    roster = relayed_roster(identities, "carol", {"r1": f"127.0.0.1:{port}"})
    alice = WireCodec(identities["alice"], roster, FED, require_encryption=True)
    site = Site(identities, roster, "carol")
    relay = Relay("r1", roster, port)
    await relay.start()
    await site.start()
    client = MessageClient(transport(retries=0), None)
    client.set_relayed_peer("carol", [roster.relays["r1"]])
    try:
        await until(lambda: site.tunnels[0].connected)
        await relay.stop()
        await until(lambda: not site.tunnels[0].connected)
        with pytest.raises(TransportError):
            await client.post("carol", alice.encode("probe", "carol", {}, round=1, encrypt=True))
        relay = Relay("r1", roster, port)
        await relay.start()
        await until(lambda: site.tunnels[0].connected)
        assert site.tunnels[0].connects == 2
        status, _ = await client.post(
            "carol", alice.encode("probe", "carol", {"y": 1}, round=1, encrypt=True)
        )
        assert status == 200 and len(site.frames) == 1
    finally:
        await client.close()
        await site.stop()
        await relay.stop()


async def test_a_site_with_two_relays_is_reached_through_the_live_one(identities):
    dead, live = free_ports(2)
    relays = {"r1": f"127.0.0.1:{dead}", "r2": f"127.0.0.1:{live}"}
    roster = relayed_roster(identities, "carol", relays)
    alice = WireCodec(identities["alice"], roster, FED, require_encryption=True)
    site = Site(identities, roster, "carol")
    relay = Relay("r2", roster, live)  # r1 never starts
    await relay.start()
    await site.start()
    client = MessageClient(transport(retries=2), None)
    try:
        await until(lambda: site.tunnels[1].connected)
        assert not site.tunnels[0].connected and site.tunnels[0].last_error
        client.set_relayed_peer("carol", [relays["r1"], relays["r2"]])
        for i in range(3):
            push = alice.encode("probe", "carol", {"i": i}, round=1, encrypt=True)
            status, _ = await client.post("carol", push)
            assert status == 200
        assert len(site.frames) == 3
        assert client.links["carol"].url.startswith(f"http://127.0.0.1:{live}/")
    finally:
        await client.close()
        await site.stop()
        await relay.stop()


# ---------------------------------------------------------------- real node processes


TRANSPORT = {
    "heartbeat_s": 0.3,
    "suspect_after_s": 1.5,
    "dead_after_s": 3.0,
    "retries": 1,
    "backoff_base_s": 0.05,
    "backoff_max_s": 1.0,  # a tunnel dials its restarted relay again within a second or so
    "breaker_reset_s": 2.0,
}
NAMES = ["a", "b", "c", "d"]
BEHIND = ["c", "d"]  # address null, via the relays; they listen on their own loopback only


def overrides() -> dict[str, Any]:
    """As tests/test_faults.py: digits at 8x8, no augmentation, no personal model."""
    return {
        "node": {"startup_wait_s": 30},
        "transport": TRANSPORT,
        "wire": {"encryption": True},
        "data": {"image_size": 8, "augment": "none"},
        "training": {
            "epochs": 1,
            "batch_size": 64,
            "threads": 1,
            "personalization": {"method": "none"},
        },
    }


def start_relay(plan: Any, log_dir: Path) -> RelayProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    relay = RelayProcess(plan, log_dir / f"{plan.name}.log").start()
    relay.wait_for(lambda s: s.get("relay") == plan.name, 60, "relay up")
    return relay


def wait_done(fed: LocalFederation, rounds: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    states: list[dict[str, Any] | None] = []
    while time.monotonic() < deadline:
        for node in fed.nodes.values():
            assert node.running, f"{node.name} exited: {node.log_tail()}"
        states = [n.status() for n in fed.nodes.values()]
        if all(s and s["phase"] == "done" and s["round"] == rounds for s in states):
            return
        time.sleep(0.5)
    raise TimeoutError(
        "federation did not finish: "
        + json.dumps({n: (s or {}).get("round") for n, s in zip(fed.nodes, states, strict=True)})
    )


def journal(fed_dir: Path, name: str) -> list[dict[str, Any]]:
    path = fed_dir / name / "state" / "journal.jsonl"
    return [json.loads(x) for x in path.read_text().split()] if path.exists() else []


DELIVERED = re.compile(
    r"^(\S+ \S+) INFO \S+: (\w+): probe ([0-9a-f]{32}) delivered to (\w+)", re.MULTILINE
)


def log_time(stamp: str) -> float:
    """A log line's local time (node/logsetup.py's asctime) as epoch seconds."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.slow
def test_probe_through_a_relay_sigkilled_mid_run_loses_nothing_and_processes_nothing_twice(
    tmp_path,
):
    """4 sites, c and d outbound-only behind r1. The relay is SIGKILLed once
    every node is past round 3 and started again 3 s later: every node
    completes every round, every site exchanges with every other (c and d
    through the relay, with each other through it at both ends), and nothing
    acknowledged is lost or processed twice (the journals, as in
    tests/test_faults.py)."""
    # During the outage c and d hear no one (every heartbeat to them comes through
    # the relay) and may run their last rounds alone; a and b, waiting
    # round_timeout_s for them each round, still push to them after the restart.
    rounds = 10
    probe = {
        "name": "probe",
        "rounds": rounds,
        "payload_kb": 4,
        "interval_s": 0.5,
        "round_timeout_s": 3.0,
    }
    fed_dir = tmp_path / "fed"
    plans = provision(
        fed_dir, NAMES, protocol=probe, overrides=overrides(), relays=["r1"], behind=BEHIND
    )
    roster = Roster.load(fed_dir / "roster.yaml")
    assert [roster[n].address for n in BEHIND] == [None, None]
    logs = tmp_path / "logs"
    relay = start_relay(plans.relays[0], logs)
    killed_at: dict[str, int] = {}
    restarted = float("inf")
    try:
        with LocalFederation(list(plans), logs) as fed:
            for name in BEHIND:
                fed[name].wait_for(
                    lambda s: s.get("relays", {}).get("r1", {}).get("connected"), 60, "tunnel up"
                )
            before = relay.status()
            assert before is not None and before["connected"] == BEHIND, before
            for node in fed.nodes.values():
                node.wait_for(lambda s: s["round"] >= 3, 120, "round 3")
            killed_at = {n: (fed[n].status() or {}).get("round", -1) for n in NAMES}
            relay.kill()  # SIGKILL: its connections and every frame in flight are gone
            time.sleep(3.0)
            relay = start_relay(plans.relays[0], logs)
            restarted = time.time()
            wait_done(fed, rounds, timeout=150)
            time.sleep(1.0)  # let outbox re-sends of the last round land
            tunnels = {n: fed[n].status()["relays"]["r1"] for n in BEHIND}
            through = relay.status()
    finally:
        relay.stop()

    assert all(t["connected"] and t["connects"] >= 2 for t in tunnels.values()), tunnels
    assert through is not None and through["connected"] == BEHIND
    delivered: dict[str, set[str]] = {n: set() for n in NAMES}  # receiver -> ids acked to a sender
    after = 0  # acknowledged through the restarted relay, by the relayed site itself
    for name in NAMES:
        for stamp, _, msg_id, to in DELIVERED.findall((logs / f"{name}.log").read_text()):
            delivered[to].add(msg_id)
            after += log_time(stamp) > restarted and {name, to} & set(BEHIND) != set()
    lost = duplicated = processed = 0
    pairs: set[tuple[str, str]] = set()
    for name in NAMES:
        entries = [j for j in journal(fed_dir, name) if j["kind"] == "probe"]
        ids = [j["id"] for j in entries]
        spooled = {p.stem for p in (fed_dir / name / "state" / "spool").glob("*.frame")}
        duplicated += len(ids) - len(set(ids))
        lost += len(delivered[name] - set(ids) - spooled)
        processed += len(ids)
        pairs |= {(j["from"], name) for j in entries}
    print(
        json.dumps(
            {
                "scenario": "relay_sigkill",
                "killed_at_round": killed_at,
                "acknowledged": sum(len(v) for v in delivered.values()),
                "processed": processed,
                "lost": lost,
                "processed_twice": duplicated,
                "relayed_acknowledged_after_restart": after,
                "relay_forwarded": through["forwarded"],
            }
        )
    )
    assert lost == 0 and duplicated == 0
    everyone = {(s, r) for s in NAMES for r in NAMES if s != r}
    assert pairs == everyone, sorted(everyone - pairs)
    assert after > 0, "no push to or from a relayed site was acknowledged after the restart"


@pytest.mark.slow
def test_fedavgp2p_with_secure_aggregation_through_two_relays_one_never_started(tmp_path):
    """The same four sites, now behind r1 and r2 of which only r2 runs: the
    senders fail over to r2, and FedAVGP2P with secure aggregation (every
    share and masked input end-to-end encrypted through the relay) completes
    every round at every node, each merging sums the relayed sites are in."""
    rounds = 3
    fedavg = {
        "name": "fedavgp2p",
        "rounds": rounds,
        "fraction": 1.0,
        "round_timeout_s": 20.0,
        "max_staleness": 1,
        "secure_aggregation": True,
    }
    fed_dir = tmp_path / "fed"
    plans = provision(
        fed_dir,
        NAMES,
        protocol=fedavg,
        overrides=overrides(),
        relays=["r1", "r2"],
        behind=BEHIND,
    )
    logs = tmp_path / "logs"
    relay = start_relay(plans.relays[1], logs)  # r1 never starts
    try:
        with LocalFederation(list(plans), logs) as fed:
            wait_done(fed, rounds, timeout=180)
            tunnels = {n: fed[n].status()["relays"] for n in BEHIND}
            through = relay.status()
    finally:
        relay.stop()
    assert all(t["r2"]["connected"] and not t["r1"]["connected"] for t in tunnels.values())
    assert through is not None and through["forwarded"]["messages"] > 0
    merged_from: dict[str, set[str]] = {}
    for name in NAMES:
        saved = Checkpoints(fed_dir / name / "state" / "checkpoints").latest()
        assert saved is not None, name
        ledger = saved["protocol"]["merged"]
        assert [r for r, _ in ledger] == list(range(1, rounds + 1)), (name, ledger)
        merged_from[name] = {peer for _, models in ledger for peer, _ in models}
    print(
        json.dumps(
            {
                "scenario": "secagg_two_relays_one_down",
                "merged_from": {k: sorted(v) for k, v in merged_from.items()},
                "relay_forwarded": through["forwarded"],
            }
        )
    )
    for name in NAMES:  # everyone merged sums with the relayed sites in them, and they with all
        assert set(BEHIND) - {name} <= merged_from[name], (name, merged_from)
    for name in BEHIND:
        assert merged_from[name] == set(NAMES) - {name}, (name, merged_from)


# ---------------------------------------------------------------- configuration


def test_relays_without_encryption_are_refused_by_check_and_run_in_one_line(tmp_path, capsys):
    """A relay must never see a payload in the clear: a roster with a site behind
    a relay, or a site that relays, needs wire.encryption: true at every site."""
    plans = provision(
        tmp_path / "fed", ["a", "b", "c"], protocol={"name": "probe"}, relays=["r1"], behind=["c"]
    )
    for plan in plans:
        assert cli_main(["check", "--config", str(plan.config_path)]) == 0
    capsys.readouterr()
    path = plans[0].config_path
    site = yaml.safe_load(path.read_text())
    site["wire"]["encryption"] = False
    path.write_text(yaml.safe_dump(site))
    for command in ("check", "run"):
        assert cli_main([command, "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{path}: wire.encryption: relays (sites behind one" in err
    site["relay"] = {"serve": True}
    path.write_text(yaml.safe_dump(site))
    assert cli_main(["check", "--config", str(path)]) == 2
    assert f"{path}: relay.serve: relays (sites behind one" in capsys.readouterr().err


@pytest.mark.slow
def test_a_reachable_site_that_relays_carries_a_site_behind_it(tmp_path):
    """relay.serve: true: site a is relay r1 on its own peer port (the roster's
    r1 has a's address) and c, behind r1, exchanges with a and b through it."""
    rounds = 3
    probe = {"name": "probe", "rounds": rounds, "payload_kb": 4, "interval_s": 0.3}
    fed_dir = tmp_path / "fed"
    plans = provision(
        fed_dir,
        ["a", "b", "c"],
        protocol=probe,
        overrides=overrides(),
        per_site={"a": {"relay": {"serve": True}}},
        relays=["r1"],
        behind=["c"],
    )
    roster = Roster.load(fed_dir / "roster.yaml")
    roster.relays["r1"] = roster["a"].address  # no relay process: a is the relay
    roster.save()
    with LocalFederation(list(plans), tmp_path / "logs") as fed:
        wait_done(fed, rounds, timeout=120)
        serving = fed["a"].status()["relays"]["r1"]
        tunnel = fed["c"].status()["relays"]["r1"]
    assert serving["serving"] and serving["connected"] == ["c"], serving
    assert serving["forwarded"]["messages"] > 0 and tunnel["connected"], (serving, tunnel)
    pairs = {(j["from"], n) for n in ("a", "b", "c") for j in journal(fed_dir, n)}
    assert {("a", "c"), ("b", "c"), ("c", "a"), ("c", "b")} <= pairs, pairs


def test_a_roster_reload_moves_a_sites_tunnels_to_the_relays_its_card_now_names(tmp_path):
    """SIGHUP (`SiteRelays.set_roster`): c, behind r1, is moved to r2 in a new
    roster; its tunnel to r1 closes and one to r2 connects, without a restart.
    Moving r2 to another address redials it there."""
    from node.relay_tunnel import SiteRelays
    from p2pfl.config import load_config
    from p2pfl.secure.identity import LocalIdentity

    fed_dir = tmp_path / "fed"
    plans = provision(
        fed_dir, ["a", "b", "c"], protocol={"name": "probe"}, relays=["r1", "r2"], behind=["c"]
    )
    cfg = load_config(plans[2].config_path)
    identity = LocalIdentity.load("c", cfg.signing_key_path, cfg.agreement_key_path)

    async def serve(name: str, roster: Roster) -> tuple[RelayServer, web.AppRunner, int]:
        server = RelayServer(
            name, cfg.federation.id, roster, RelaySettings(), max_message_bytes=MAX, clock_skew_s=60
        )
        app = web.Application()
        server.add_routes(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return server, runner, next(a[1] for a in runner.addresses if isinstance(a, tuple))

    def connected(server: RelayServer) -> list[str]:
        return list(server.snapshot()["connected"])

    async def until(check: Any, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        provisioned = Roster.load(fed_dir / "roster.yaml")  # c via r1 and r2: start with r1
        roster = Roster(
            [
                dataclasses.replace(c, via=("r1",)) if c.name == "c" else c
                for c in provisioned.cards()
            ],
            relays=provisioned.relays,
        )
        servers = {}
        for name in ("r1", "r2", "r2b"):
            servers[name] = await serve(name if name != "r2b" else "r2", roster)
        roster.relays["r1"] = f"127.0.0.1:{servers['r1'][2]}"
        roster.relays["r2"] = f"127.0.0.1:{servers['r2'][2]}"
        for server, _, _ in servers.values():
            server.set_roster(roster)
        published: list[dict[str, Any]] = []
        relays = SiteRelays(
            cfg=cfg, roster=roster, identity=identity, client_ssl=None, publish_to=published.append
        )
        try:
            endpoint = MessageServer(
                WireCodec(identity, roster, cfg.federation.id, require_encryption=True),
                transport(),
                lambda frame: None,  # type: ignore[arg-type, return-value]  # never reached
                lambda r, _p: None,
            )
            assert relays.start_tunnels(endpoint)
            await until(lambda: connected(servers["r1"][0]) == ["c"], "c connects to r1")
            moved = Roster(
                [
                    dataclasses.replace(c, via=("r2",)) if c.name == "c" else c
                    for c in roster.cards()
                ],
                relays=roster.relays,
            )
            for server, _, _ in servers.values():
                server.set_roster(moved)
            relays.set_roster(moved)
            await until(lambda: connected(servers["r2"][0]) == ["c"], "c connects to r2")
            await until(lambda: connected(servers["r1"][0]) == [], "c leaves r1")
            assert [t.relay for t in relays.tunnels] == ["r2"]
            assert set(published[-1]) == {"r2"}
            # r2 moves: the tunnel is redialled at its new address
            again = Roster(
                moved.cards(), relays={**moved.relays, "r2": f"127.0.0.1:{servers['r2b'][2]}"}
            )
            servers["r2b"][0].set_roster(again)
            relays.set_roster(again)
            await until(lambda: connected(servers["r2b"][0]) == ["c"], "c connects to r2 anew")
            await until(lambda: connected(servers["r2"][0]) == [], "c leaves r2's old address")
        finally:
            await relays.stop()
            for server, runner, _ in servers.values():
                await server.close()
                await runner.cleanup()

    asyncio.run(scenario())
