"""A roster member played by a test or a benchmark, not by a daemon: the one
fake peer of tests/test_daemon.py and the attack bench (bench/attacks/).

It holds the member's real keys (or any identity it is handed, for
forgeries) and speaks the real wire format: `frame` builds the bytes the
member's daemon would send, `post` delivers bytes (any bytes) to a daemon's
peer port, `request` sends a `req:<kind>` and verifies the answer,
`Heartbeats` keeps it alive in the daemons' eyes, and `listen` holds its own
address with an HTTP server (a member that answers, or answers too much).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from node.membership import HEARTBEAT
from node.outbound import REQUEST_PREFIX
from node.transport import MESSAGE_PATH
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec, WireError


@dataclass
class Reply:
    status: int  # 0: no HTTP answer at all
    reason: str | None
    body: bytes

    @property
    def accepted(self) -> bool:
        return self.status == 200

    def brief(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason}

    def json(self) -> dict[str, Any]:
        """The answer's JSON body ({} when empty): a daemon's refusals are JSON."""
        return json.loads(self.body or b"{}")

    def answer(self) -> tuple[int, dict[str, Any]]:
        """(status, JSON body): what a test compares."""
        return self.status, self.json()


def post_frame(port: int, frame: bytes, timeout: float = 30.0, path: str = MESSAGE_PATH) -> Reply:
    """`frame` (any bytes) to the peer port `port` on loopback (at `path`: a
    relay's RELAY_MESSAGE_PATH too); its answer, status 0 if none."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=frame, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
            return Reply(resp.status, None, resp.read())
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            reason = json.loads(body).get("reason")
        except (ValueError, AttributeError):
            reason = None
        return Reply(err.code, reason, body)
    except (OSError, urllib.error.URLError) as exc:
        return Reply(0, f"unreachable: {exc}", b"")


class RawPeer:
    """A roster member without a daemon: its own keys (from `fed_dir/NAME/state/keys`,
    where node/provision.py puts them, unless `identity` is given), a WireCodec
    for `federation`, plain HTTP POSTs to the daemons' peer ports (`ports`:
    name -> port)."""

    def __init__(
        self,
        fed_dir: Path,
        name: str,
        ports: dict[str, int],
        *,
        identity: LocalIdentity | None = None,
        federation: str = "local",
        encrypt: bool = False,
    ) -> None:
        if identity is None:
            keys = fed_dir / name / "state" / "keys"
            identity = LocalIdentity.load(name, keys / f"{name}.sign.pem", keys / f"{name}.kex.pem")
        self.name = identity.name
        self.codec = WireCodec(identity, Roster.load(fed_dir / "roster.yaml"), federation)
        self.ports = ports
        self.encrypt = encrypt  # as the daemons' `wire.encryption`, unless a call says otherwise

    def frame(
        self, kind: str, to: str, payload: Any, *, round_no: int = 0, encrypt: bool | None = None
    ) -> bytes:
        """The bytes this member's daemon would send (same codec, same header)."""
        encrypt = self.encrypt if encrypt is None else encrypt
        return self.codec.encode(kind, to, payload, round=round_no, encrypt=encrypt).to_bytes()

    def post(self, to: str, frame: bytes, timeout: float = 30.0) -> Reply:
        """`frame` (any bytes) to `to`'s peer port; its answer, status 0 if none."""
        return post_frame(self.ports[to], frame, timeout)

    def request(
        self,
        to: str,
        kind: str,
        query: dict[str, Any],
        *,
        round_no: int = 0,
        encrypt: bool | None = None,
        wait_s: float = 5.0,
    ) -> tuple[Reply, Any]:
        """A `req:<kind>` as a daemon sends it; the verified, decoded answer or None."""
        frame = self.frame(
            REQUEST_PREFIX + kind,
            to,
            {**query, "_wait_s": wait_s},
            round_no=round_no,
            encrypt=encrypt,
        )
        reply = self.post(to, frame, timeout=wait_s + 30.0)
        if not reply.accepted:
            return reply, None
        try:
            delivered = self.codec.decode(bytearray(reply.body))
        except WireError as exc:
            return Reply(reply.status, f"unverifiable_answer: {exc.reason}", b""), None
        return reply, delivered.payload

    def listen(self, body_bytes: int = 0) -> Listener:
        """A server at this member's own port (enter it to start): the daemons'
        messages to the member reach the test instead of a daemon."""
        return Listener(self.ports[self.name], body_bytes)


def heartbeat_payload(
    round_no: int = 0, phase: str = "done", *, done: bool = True, bye: bool = True
) -> dict[str, Any]:
    """A heartbeat as node/membership.py sends it."""
    return {
        "round": round_no,
        "phase": phase,
        "done": done,
        "bye": bye,
        "meta": {},
        "edges": [],
        "choices": [],
    }


class Heartbeats:
    """A member that looks alive: a heartbeat to each of `to` every `interval_s`
    (in `phase`, not done), bounded by `max_s` even if never stopped; with
    `goodbye`, a last heartbeat saying so when stopped."""

    def __init__(
        self,
        member: RawPeer,
        to: list[str],
        round_no: int,
        *,
        max_s: float,
        interval_s: float = 0.5,
        phase: str = "exchange",
        goodbye: bool = True,
        post_timeout_s: float = 30.0,
    ) -> None:
        self.member, self.to, self.round, self.max_s = member, to, round_no, max_s
        self.interval_s, self.phase, self.goodbye = interval_s, phase, goodbye
        self.post_timeout_s = post_timeout_s
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _beat(self, bye: bool) -> None:
        for name in self.to:
            payload = heartbeat_payload(self.round, self.phase, done=False, bye=bye)
            frame = self.member.frame(HEARTBEAT, name, payload, round_no=self.round)
            self.member.post(name, frame, timeout=self.post_timeout_s)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            self._beat(bye=False)
            self.stop_event.wait(self.interval_s)

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join(10)
        if self.goodbye:
            self._beat(bye=True)


class Listener:
    """An aiohttp server at a member's address, in its own thread: it answers
    every POST with `body_bytes` streamed (0: a plain acknowledgement), and
    records how much of each answer went out (`answers`)."""

    def __init__(self, port: int, body_bytes: int = 0) -> None:
        self.port, self.body_bytes = port, body_bytes
        self.answers: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        if not self.body_bytes:
            return web.json_response({"ok": True})
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        row = {"sent": 0, "cut_off": False}
        self.answers.append(row)
        chunk = bytes(1 << 20)
        try:
            while row["sent"] < self.body_bytes:
                await resp.write(chunk)
                row["sent"] += len(chunk)
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            row["cut_off"] = True
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post(MESSAGE_PATH, self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> Listener:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError(f"fake peer could not listen on {self.port}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
