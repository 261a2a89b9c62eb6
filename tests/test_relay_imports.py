"""The relay process never imports torch (issue 31's closing note: torch came
in through the wire codec, ~4 s of a relay's start-up, 10 s on a loaded
machine, most of the relay-kill drill's cost). A relay reads only the signed
clear header, a msgpack map without tensors, so the codec loads torch and
numpy on its first tensor (p2pfl/secure/tensor_format.py).

Each check runs in a fresh interpreter (this one has imported torch long ago)
on a federation written by node/provision.py: the relay starts from its
relay.yaml, answers /healthz, and verifies real frames signed with a site's
provisioned key, and only then is sys.modules inspected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.provision import free_ports, provision
from p2pfl.secure import tensors

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numpy")

# Frames from site a to c (outbound-only, via r1, not connected): the relay decodes
# each header and checks its signature (node/relay.py's order of checks), then refuses
# the frame with a forged signature (bad_signature) and the good one because c has no
# connection (not_connected, only ever answered after the signature). A header that
# smuggles in a tensor map is refused before torch could be imported to decode it.
RELAY_PROCESS = """
import asyncio, json, struct, sys
from pathlib import Path

import aiohttp

from node.relay_status import RelayProcess
from node.relay_wire import RELAY_MESSAGE_PATH
from p2pfl.config import load_relay_config
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import MAGIC, PREFIX_LEN, SIG_LEN, WireCodec

fed = Path(sys.argv[1])
cfg = load_relay_config(fed / "r1" / "relay.yaml")
roster = Roster.load(fed / "roster.yaml")
keys = fed / "a" / "state" / "keys"
a = LocalIdentity.load("a", keys / "a.sign.pem", keys / "a.kex.pem")
codec = WireCodec(a, roster, cfg.federation.id, max_message_bytes=1 << 20)


async def main() -> dict:
    relay = RelayProcess(cfg, roster, fed / "r1" / "relay.yaml")
    await relay.start()
    out = {}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{relay.status_port}/healthz") as r:
                out["healthz"] = r.status
            good = codec.encode("heartbeat", "c", {"round": 1}, encrypt=True).to_bytes()
            forged = bytearray(good)
            forged[PREFIX_LEN + codec.header_length(good[:PREFIX_LEN]) + 5] ^= 1
            header = bytes.fromhex(sys.argv[2])
            tensor_header = MAGIC + struct.pack(">I", len(header)) + header + bytes(SIG_LEN)
            for label, body in (
                ("good", good), ("forged", bytes(forged)), ("tensor header", tensor_header)
            ):
                url = f"http://127.0.0.1:{relay.port}{RELAY_MESSAGE_PATH}"
                async with s.post(url, data=body) as r:
                    out[label] = [r.status, json.loads(await r.read()).get("reason")]
        out["refusals"] = dict(relay.server.refusals)
    finally:
        await relay.stop()
    out["loaded"] = sorted(m for m in ("torch", "numpy") if m in sys.modules)
    return out


print(json.dumps(asyncio.run(main())))
"""

# `p2pfl-node relay --config ...` itself (node.cli.main), stopped by SIGTERM once
# /healthz answers: everything the command imports, argument parsing included.
RELAY_COMMAND = """
import json, os, signal, sys, threading, time, urllib.request

import node.cli

status_port, config = int(sys.argv[1]), sys.argv[2]


def probe() -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/healthz", timeout=2):
                break
        except OSError:
            time.sleep(0.05)
    loaded = sorted(m for m in ("torch", "numpy") if m in sys.modules)
    print(json.dumps({"loaded": loaded}), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


threading.Thread(target=probe, daemon=True).start()
sys.exit(node.cli.main(["relay", "--config", config]))
"""


# {"v": {"$t": "float32", "shape": [1], "pad": b"", "data": 4 zero bytes}} in msgpack, by
# hand: a header-sized map whose field is a tensor, which no real header has.
TENSOR_HEADER = (
    b"\x81\xa1v\x84\xa2$t\xa7float32\xa5shape\x91\x01\xa3pad\xc4\x00\xa4data\xc4\x04" + bytes(4)
)


def test_a_header_may_not_carry_a_tensor():
    from p2pfl.secure.wire import Header, WireError

    assert tensors.decode(TENSOR_HEADER)["v"].tolist() == [0.0]
    with pytest.raises(tensors.CodecError) as caught:
        tensors.decode(TENSOR_HEADER, tensors=False)
    assert caught.value.reason == "tensor_not_allowed"
    with pytest.raises(WireError) as refused:
        Header.unpack(TENSOR_HEADER)
    assert (refused.value.reason, refused.value.detail) == (
        "undecodable_header",
        "tensor_not_allowed",
    )


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """Sites a, b, c (c behind relay r1) and r1's relay.yaml: (directory, r1's status port)."""
    out = tmp_path_factory.mktemp("fed")
    ports = free_ports(8)
    provision(
        out,
        ["a", "b", "c"],
        protocol={"name": "fedavgp2p", "rounds": 1},
        ports=ports[:3],
        status_ports=ports[3:6],
        relays=["r1"],
        behind=["c"],
        relay_ports=ports[6:7],
        relay_status_ports=ports[7:8],
    )
    return out, ports[7]


def run_python(code: str, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("P2PFL_NODE_LAUNCH", None)
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_relay_verifies_frames_without_importing_torch_or_numpy(fed):
    out = run_python(RELAY_PROCESS, str(fed[0]), TENSOR_HEADER.hex())
    assert out["healthz"] == 200
    assert out["good"] == [503, "not_connected"]
    assert out["forged"] == [401, "bad_signature"]
    assert out["tensor header"] == [400, "undecodable_header"]
    assert out["refusals"] == {"not_connected": 1, "bad_signature": 1, "undecodable_header": 1}
    assert out["loaded"] == []


def test_the_relay_command_runs_without_importing_torch(fed):
    directory, status_port = fed
    out = run_python(RELAY_COMMAND, str(status_port), str(directory / "r1" / "relay.yaml"))
    assert "torch" not in out["loaded"]
