"""`wire.encryption: true` is enforced: real node processes on 127.0.0.1 refuse
any payload that arrives in the clear (`encryption_required`, counted), and
encrypt everything they send, heartbeats (the gossiped metadata) included.

A third site is provisioned but not started: the test plays it with its real
keys, sending signed plaintext and listening on its port for what the nodes
send it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from test_daemon import FAST, metric_value

from bench.localfed import LocalFederation
from bench.peer import RawPeer
from node.provision import provision
from p2pfl.secure.identity import Roster
from p2pfl.secure.wire import WireCodec

pytestmark = pytest.mark.slow


class Capture:
    """An HTTP server on the played site's port that keeps what it is sent."""

    def __init__(self, port: int) -> None:
        frames = self.frames = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                n = int(self.headers.get("Content-Length", 0))
                if len(frames) < 200:
                    frames.append(self.rfile.read(n))
                else:
                    self.rfile.read(n)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Capture:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def test_encryption_on_refuses_plaintext_and_encrypts_heartbeats(tmp_path):
    fed_dir = tmp_path / "fed"
    probe = {"name": "probe", "rounds": 3, "payload_kb": 4, "round_timeout_s": 10}
    overrides = {**FAST, "wire": {"encryption": True}, "node": {"startup_wait_s": 5}}
    plans = provision(fed_dir, ["a", "b", "c"], protocol=probe, overrides=overrides)
    port_a = plans[0].port
    peer_c = RawPeer(fed_dir, "c", {"a": port_a})
    c = peer_c.codec
    with Capture(plans[2].port) as capture, LocalFederation(plans[:2], tmp_path / "logs") as fed:
        # a and b hear each other (encrypted heartbeats) and exchange encrypted probes.
        for name in "ab":
            fed[name].wait_for(lambda s: s["phase"] == "done", 90, "probe rounds done")
        for name in "ab":
            rejected = fed[name].status()["rejected"]
            assert rejected.get("encryption_required", 0) == 0, rejected
            lines = (fed_dir / name / "state" / "metrics.jsonl").read_text().splitlines()
            assert [json.loads(x)["received"] for x in lines] == [1, 1, 1], lines

        # Signed by a roster site, in the clear: refused before the payload is read.
        payload = {"round": 1, "from": "c", "tensor": torch.ones(4)}
        for kind, body in (
            ("probe", payload),
            ("heartbeat", {"round": 0, "phase": "x", "done": False, "bye": False, "meta": {}}),
            ("req:probe", {"_wait_s": 0.0}),
        ):
            answer = peer_c.post("a", c.encode(kind, "a", body).to_bytes())
            status, reply = answer.status, answer.json()
            assert (status, reply.get("reason")) == (403, "encryption_required"), (kind, reply)
        st = fed["a"].status()
        assert st["rejected"]["encryption_required"] == 3, st["rejected"]
        prom = fed["a"].get("/metrics")
        assert metric_value(prom, "p2pfl_rejected_total", reason="encryption_required") == 3
        # The same push encrypted to a is taken.
        assert peer_c.post("a", c.encode("probe", "a", payload, encrypt=True).to_bytes()).accepted
        assert fed["a"].get("/healthz").strip() == "ok"

    # What a and b sent c (heartbeats, every heartbeat_s): each sealed to c.
    strict = WireCodec(
        c.identity, Roster.load(fed_dir / "roster.yaml"), "local", require_encryption=True
    )
    assert len(capture.frames) >= 4, len(capture.frames)
    kinds = set()
    for frame in capture.frames:
        got = strict.decode(bytearray(frame))
        assert got.header.encrypted
        kinds.add((got.header.sender, got.header.kind))
        assert isinstance(got.payload, dict) and "phase" in got.payload
        assert b"phase" not in frame  # the gossip does not travel in the clear
    assert kinds >= {("a", "heartbeat"), ("b", "heartbeat")}, kinds
