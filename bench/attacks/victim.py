"""What the review scenarios (bench/attacks/review.py, review_load.py) watch
and send: a victim daemon read with its status token, a monitor of its
/healthz latency, RSS and descriptors, frames with attacker-chosen payload
bytes, and simultaneous raw deliveries. (The fake peer at a roster member's
address is bench/peer.py's.)"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import yaml
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from bench.attacks.federations import state_dir
from bench.attacks.kit import Counters
from bench.localfed import NodeProcess
from bench.peer import RawPeer, Reply
from node.provision import SitePlan
from node.transport import MESSAGE_PATH
from p2pfl.secure.wire import MAGIC, VERSION, Header, _payload_key

# The victims' wire.max_message_bytes. 4 MiB, not 1: a refused 1 MiB message alone moved
# the victim's RSS by 1.5 to 2.9 MiB, inside a 2 MiB bound.
MAX_MESSAGE = 4 << 20
RSS_BOUND = 2 * MAX_MESSAGE  # what one hostile message may cost a victim's memory
HEALTHZ_P99_MS = 100.0
HEALTHZ_TIMEOUT_S = 1.0  # a /healthz slower than this counts as no answer


# ---------------------------------------------------------------------- the victim


def status_token(plan: SitePlan) -> str | None:
    """The node's status token, if it has one: site.yaml, its token file, STATE/status.token."""
    try:
        section = (yaml.safe_load(plan.config_path.read_text()) or {}).get("status") or {}
    except (OSError, yaml.YAMLError):
        section = {}
    if section.get("token"):
        return str(section["token"])
    candidates = [state_dir(plan) / "status.token"]
    if section.get("token_file"):
        candidates.insert(0, plan.config_path.parent / str(section["token_file"]))
    for path in candidates:
        try:
            token = path.read_text().strip()
        except OSError:
            continue
        if token:
            return token
    return None


class Victim:
    """A daemon under attack: its status routes read with its token, its process watched."""

    def __init__(self, node: NodeProcess) -> None:
        self.node = node

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def pid(self) -> int:
        assert self.node.proc is not None
        return self.node.proc.pid

    def get(
        self, path: str, *, host: str | None = None, token: bool = True, timeout: float = 3.0
    ) -> tuple[int, bytes]:
        """(HTTP status, body); status 0 when nothing answered."""
        port = self.node.plan.status_port
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        secret = status_token(self.node.plan) if token else None
        if secret:
            req.add_header("Authorization", f"Bearer {secret}")
        if host:
            req.add_header("Host", host)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
        except (OSError, urllib.error.URLError):
            return 0, b""

    def status(self) -> dict[str, Any] | None:
        code, body = self.get("/status")
        try:
            return json.loads(body) if code == 200 else None
        except ValueError:
            return None

    def counters(self) -> Counters:
        """bench/attacks/kit.py's Counters, read with the token."""
        s = self.status() or {}
        received = ((s.get("messages") or {}).get("received") or {}).get("by_kind") or {}
        return Counters(
            dict(s.get("rejected") or {}), dict(s.get("rejected_by_peer") or {}), dict(received)
        )

    def wait_status(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status()
            if s is not None and predicate(s):
                return s
            if not self.node.running:
                raise RuntimeError(
                    f"{self.name} exited waiting for {what}: {self.node.log_tail(8)}"
                )
            time.sleep(0.2)
        raise TimeoutError(f"{self.name}: {what} not reached in {timeout:.0f} s")

    def healthy(self) -> bool:
        return self.node.running and self.get("/healthz", timeout=HEALTHZ_TIMEOUT_S)[0] == 200

    def restart(self, timeout: float) -> None:
        """SIGKILL (a frozen node ignores SIGTERM) and start again on the same state."""
        self.node.kill()
        self.node.start()
        self.wait_status(lambda s: True, timeout, "restart")


class Monitor:
    """Samples a victim while it is attacked: /healthz latency (one poller, so a
    blocked event loop shows as one slow answer per block), RSS and descriptors."""

    def __init__(self, victim: Victim) -> None:
        self.victim = victim
        self.proc = psutil.Process(victim.pid)
        self.health: list[tuple[float, float]] = []  # (sent at, ms; HEALTHZ_TIMEOUT_S*1000 if none)
        self.usage: list[tuple[float, int, int]] = []  # (at, rss bytes, fds)
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._poll, self._sample)]

    def _poll(self) -> None:
        while not self.stop_event.is_set():
            t = time.monotonic()
            code = self.victim.get("/healthz", timeout=HEALTHZ_TIMEOUT_S)[0]
            ms = (time.monotonic() - t) * 1000 if code == 200 else HEALTHZ_TIMEOUT_S * 1000
            self.health.append((t, ms))
            self.stop_event.wait(0.05)

    def _sample(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.usage.append(
                    (time.monotonic(), self.proc.memory_info().rss, self.proc.num_fds())
                )
            except psutil.Error:
                return
            self.stop_event.wait(0.02)

    def __enter__(self) -> Monitor:
        for t in self.threads:
            t.start()
        time.sleep(1.0)  # a quiet baseline
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(HEALTHZ_TIMEOUT_S + 1)

    def figures(self, t0: float, t1: float) -> dict[str, Any]:
        """The window [t0, t1] against the second before t0."""
        base = [u for u in self.usage if t0 - 1.0 <= u[0] < t0] or self.usage[:1]
        during = [u for u in self.usage if t0 <= u[0] <= t1] or base
        lat = [ms for t, ms in self.health if t0 <= t <= t1]
        rss0 = float(np.median([u[1] for u in base])) if base else 0.0
        fds0 = int(np.median([u[2] for u in base])) if base else 0
        return {
            "healthz_samples": len(lat),
            "healthz_p99_ms": round(float(np.percentile(lat, 99)), 1) if lat else None,
            "healthz_max_ms": round(max(lat), 1) if lat else None,
            "healthz_unanswered": sum(ms >= HEALTHZ_TIMEOUT_S * 1000 for ms in lat),
            "rss_base_mb": round(rss0 / 2**20, 1),
            "rss_growth_mb": round((max(u[1] for u in during) - rss0) / 2**20, 2)
            if during
            else None,
            "fds_base": fds0,
            "fds_growth": max(u[2] for u in during) - fds0 if during else None,
        }


def within_bounds(fig: dict[str, Any]) -> bool:
    """/healthz p99 under 100 ms and RSS grown by less than 2x max_message_bytes."""
    p99, rss = fig.get("healthz_p99_ms"), fig.get("rss_growth_mb")
    return (
        p99 is not None
        and p99 < HEALTHZ_P99_MS
        and rss is not None
        and rss * 2**20 < RSS_BOUND
        and not fig.get("healthz_unanswered")
    )


# ---------------------------------------------------------------------- raw frames and sockets


def raw_frame(
    peer: RawPeer,
    kind: str,
    to: str,
    payload: bytes,
    *,
    round_no: int = 0,
    encrypt: bool = False,
) -> tuple[bytes, str]:
    """A frame with payload bytes chosen by the attacker (WireCodec.encode only
    takes objects it can encode); signed with the member's key. (frame, id hex)"""
    codec = peer.codec
    head = Header(
        VERSION, codec.federation, kind, codec.identity.name, to, round_no, os.urandom(16),
        int(time.time() * 1000), 0, bytes(32), encrypt,
    )  # fmt: skip
    if encrypt:  # as wire.py seals it; a round past int64 as the u64 it is on the wire
        aad = (
            head.msg_id + kind.encode() + struct.pack(">Q" if round_no >= 2**63 else ">q", round_no)
        )
        key = _payload_key(codec.shared_secret(to), head)
        payload = ChaCha20Poly1305(key).encrypt(bytes(12), payload, aad)
    head = dataclasses.replace(
        head, payload_len=len(payload), payload_sha256=hashlib.sha256(payload).digest()
    )
    packed = head.pack()
    frame = MAGIC + struct.pack(">I", len(packed)) + packed + codec.identity.sign(packed) + payload
    return frame, head.id_hex


def parse_http(raw: bytes) -> Reply:
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return Reply(0, "no answer", raw[:200])
    try:
        reason = json.loads(body).get("reason")
    except (ValueError, AttributeError):
        reason = None
    return Reply(status, reason, body)


def simultaneous(port: int, frame: bytes, copies: int) -> list[Reply]:
    """`copies` connections each send the frame up to the end of its signature,
    then all send the payload at once: every header is checked before any
    payload is read (the widest window a network observer can open)."""
    (n,) = struct.unpack(">I", frame[4:8])
    split = 8 + n + 64
    head = (
        f"POST {MESSAGE_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(frame)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    socks = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in range(copies)]
    try:
        for s in socks:
            s.sendall(head + frame[:split])
        time.sleep(0.3)
        for s in socks:
            with contextlib.suppress(OSError):  # refused at the header: its answer waits
                s.sendall(frame[split:])
        out = []
        for s in socks:
            chunks = []
            try:
                while chunk := s.recv(65536):
                    chunks.append(chunk)
            except OSError:
                pass
            out.append(parse_http(b"".join(chunks)))
        return out
    finally:
        for s in socks:
            s.close()
