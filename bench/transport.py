"""Transport throughput: a ResNet-18-sized state dict through the node's full path
(encode, sign, [encrypt], POST, verify while streaming, spool with fsync, decode,
queue) against a raw aiohttp POST of the same bytes between the same two
processes, in one run; plus the receiver's peak RSS growth.

    python -m bench.transport [--repeats 5] [--mb 46.8]

The sender is this process, the receiver a child process; both are real `Node`
objects from node/daemon.py (the receiver's protocol just drains its inbox and
checkpoints, which journals and deletes the spool files). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiohttp import web

from bench.wire import resnet18_like_state_dict
from node.daemon import Node
from node.provision import free_ports, provision
from p2pfl.config import load_config
from p2pfl.secure.identity import LocalIdentity, Roster
from protocols.base import Protocol, RoundContext


class Drain(Protocol):
    """Receiver side: take every model message and checkpoint (frees the spool)."""

    name = "drain"

    async def run(self, ctx: RoundContext) -> None:
        inbox = ctx.inbox("model")
        while True:
            msg = await inbox.get()
            ctx.round = msg.round
            del msg
            ctx.checkpoint({})


def load_node(config_path: Path) -> Node:
    cfg = load_config(config_path)
    roster = Roster.load(cfg.federation.roster)
    identity = LocalIdentity.load(cfg.node.name, cfg.signing_key_path, cfg.agreement_key_path)
    return Node(cfg, roster, identity, config_path=config_path)


# ----------------------------------------------------------------------------- receiver process


async def receiver_main(config_path: Path, raw_port: int) -> None:
    node = load_node(config_path)
    node.protocol = Drain()
    proc = psutil.Process()
    samples = {"peak_rss": proc.memory_info().rss}

    stop_sampling = threading.Event()

    def sample_rss() -> None:
        # A thread, not a task: it must see peaks while the event loop is busy.
        while not stop_sampling.wait(0.001):
            samples["peak_rss"] = max(samples["peak_rss"], proc.memory_info().rss)

    async def raw(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"n": len(body)})

    async def rss(request: web.Request) -> web.Response:
        out = {
            "rss": proc.memory_info().rss,
            "peak_rss": samples["peak_rss"],
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        if request.query.get("reset"):
            samples["peak_rss"] = proc.memory_info().rss
        return web.json_response(out)

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/raw", raw)
    app.router.add_get("/rss", rss)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", raw_port).start()
    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    await node.start()
    try:
        await asyncio.Event().wait()
    finally:
        stop_sampling.set()
        await node.stop()
        await runner.cleanup()


# ----------------------------------------------------------------------------- sender (this process)


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - loopback
        return json.loads(resp.read())


async def sender_main(args: argparse.Namespace, config_path: Path, raw_port: int) -> dict[str, Any]:
    node = load_node(config_path)
    node.protocol = Drain()  # the sender receives nothing; its protocol idles
    await node.start()
    sd = resnet18_like_state_dict(args.mb)
    payload = {"state": sd}
    raw_bytes = node.codec.encode("model", "b", payload).to_bytes()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    rss_url = f"http://127.0.0.1:{raw_port}/rss"
    try:
        deadline = time.monotonic() + 60
        while not any(p.name == "b" for p in node.peers.peers()):
            if time.monotonic() > deadline:
                raise RuntimeError("receiver never came up")
            await asyncio.sleep(0.2)

        async def node_path(round_: int, encrypt: bool) -> None:
            node.cfg.wire.encryption = encrypt
            await node.outbound.send_push("b", "model", payload, round_)

        async with aiohttp.ClientSession() as session:

            async def raw_post() -> None:
                async with session.post(f"http://127.0.0.1:{raw_port}/raw", data=raw_bytes) as resp:
                    assert resp.status == 200
                    await resp.read()

            # Warm up both paths (connections, page cache, allocator).
            await node_path(0, False)
            await raw_post()
            times: dict[str, list[float]] = {"node": [], "raw": [], "node_encrypted": []}
            growth: dict[str, list[int]] = {k: [] for k in times}
            base = get_json(rss_url)["rss"]
            for i in range(args.repeats):
                for label in ("node", "raw", "node_encrypted"):
                    before = get_json(rss_url + "?reset=1")["rss"]
                    t0 = time.perf_counter()
                    if label == "raw":
                        await raw_post()
                    else:
                        await node_path(1 + i, label == "node_encrypted")
                    times[label].append(time.perf_counter() - t0)
                    await asyncio.sleep(0.05)  # let the receiver finish draining before sampling
                    growth[label].append(get_json(rss_url)["peak_rss"] - before)
    finally:
        await node.stop()
    rate = {k: nbytes / 1e6 / statistics.median(v) for k, v in times.items()}
    return {
        "payload_mb": round(nbytes / 1e6, 2),
        "repeats": args.repeats,
        "node_path_mb_s": round(rate["node"], 1),
        "node_path_encrypted_mb_s": round(rate["node_encrypted"], 1),
        "raw_post_mb_s": round(rate["raw"], 1),
        "ratio": round(rate["node"] / rate["raw"], 3),
        "encrypted_ratio": round(rate["node_encrypted"] / rate["raw"], 3),
        "receiver_base_rss_mb": round(base / 1e6, 1),
        "receiver_peak_rss_growth_mb": round(max(growth["node"]) / 1e6, 1),
        "receiver_peak_rss_over_payload": round(max(growth["node"]) / nbytes, 2),
        "receiver_peak_rss_over_payload_encrypted": round(
            max(growth["node_encrypted"]) / nbytes, 2
        ),
        "receiver_peak_rss_over_payload_raw_post": round(max(growth["raw"]) / nbytes, 2),
        "spool": "fsync per message",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mb", type=float, default=46.8)
    parser.add_argument(
        "--role", choices=["sender", "receiver"], default="sender", help=argparse.SUPPRESS
    )
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--raw-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "receiver":
        asyncio.run(receiver_main(args.config, args.raw_port))
        return

    with tempfile.TemporaryDirectory(
        prefix="p2pfl-bench-transport-", dir=os.environ.get("P2PFL_BENCH_TMP")
    ) as tmp:
        plans = provision(
            Path(tmp),
            ["a", "b"],
            protocol={"name": "probe", "rounds": 0},
            overrides={
                "transport": {"heartbeat_s": 0.3},
                "wire": {"max_message_bytes": 1 << 30},
                "status": {"enabled": False},
                "node": {"startup_wait_s": 0},
            },
        )
        (raw_port,) = free_ports(1)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        receiver = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.transport",
                "--role",
                "receiver",
                "--config",
                str(plans[1].config_path),
                "--raw-port",
                str(raw_port),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(Path(tmp) / "receiver.log", "wb"),  # noqa: SIM115
        )
        try:
            result = asyncio.run(sender_main(args, plans[0].config_path, raw_port))
        finally:
            receiver.terminate()
            try:
                receiver.wait(15)
            except subprocess.TimeoutExpired:
                receiver.kill()
    print(
        f"payload {result['payload_mb']} MB: node path {result['node_path_mb_s']} MB/s "
        f"(encrypted {result['node_path_encrypted_mb_s']}), raw POST {result['raw_post_mb_s']} MB/s, "
        f"ratio {result['ratio']}; receiver peak RSS growth {result['receiver_peak_rss_growth_mb']} MB "
        f"= {result['receiver_peak_rss_over_payload']}x payload"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
