"""Transport throughput: a ResNet-18-sized state dict through the node's full path
(encode, sign, [encrypt], POST, verify while streaming, spool with fsync, decode,
queue) against a raw aiohttp POST of the same bytes between the same two
processes, in one run; plus the receiver's peak RSS growth.

    python -m bench.transport [--repeats 5] [--mb 46.8] [--via-relay]

`--via-relay` (issue 31) measures instead the same sender, payload and repeats
sent, encrypted (a relay carries ciphertext only), to two receivers in one run:
`b` reachable and `c` outbound-only behind a relay process (`p2pfl-node relay`):
MB/s direct vs through the relay and their ratio, and the latency of a
heartbeat (p50, p99) sent as a node sends it, direct vs relayed;
`relayed_extra_hops_p50` is (relayed p50 - direct p50) / direct p50, the direct
exchanges' worth of latency the relay adds (<= 1: at most one extra hop).
`relay_forwarded_bytes` is what the relay's /status counted while the pushes
ran (the sites' own heartbeats through it included).

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
import torch
from aiohttp import web

from bench.localfed import RelayProcess
from bench.peer import heartbeat_payload
from bench.wire import resnet18_like_state_dict
from node.daemon import Node
from node.membership import HEARTBEAT
from node.provision import free_ports, provision
from node.transport_client import ACK_LIMIT
from p2pfl.config import load_config
from p2pfl.secure.identity import LocalIdentity, Roster
from protocols.base import PeerUnavailable, Protocol, RoundContext


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


# ----------------------------------------------------------------------------- --via-relay


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, -(-int(q) * len(ordered) // 100) - 1)]


async def relay_sender_main(
    args: argparse.Namespace, config_path: Path, relay_status: Any
) -> dict[str, Any]:
    """a sends the same pushes to b (direct) and c (through the relay),
    alternating, then heartbeats to both; `relay_status()` is the relay's /status."""
    node = load_node(config_path)
    node.protocol = Drain()
    await node.start()
    sd = resnet18_like_state_dict(args.mb)
    if sum(t.numel() * t.element_size() for t in sd.values()) > args.mb * 1e6 * 1.01:
        # below ResNet-18's own size (a smoke test): one tensor of the size asked
        sd = {"pad": torch.randn(int(args.mb * 1e6) // 4)}
    payload = {"state": sd}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    receivers = {"direct": "b", "relayed": "c"}
    try:
        deadline = time.monotonic() + 120
        while {p.name for p in node.peers.peers()} < set(receivers.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("a receiver never came up")
            await asyncio.sleep(0.2)
        for peer in receivers.values():  # warm up: connections, page cache, the tunnel
            # c is heard (its heartbeats come to a directly) before its tunnel is up:
            # a's sends to it may fail meanwhile and open its breaker; wait that out.
            while True:
                try:
                    await node.outbound.send_push(peer, "model", payload, 0)
                    break
                except PeerUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        before = relay_status()["forwarded"]
        times: dict[str, list[float]] = {k: [] for k in receivers}
        for i in range(args.repeats):
            order = list(receivers.items())
            for label, peer in order if i % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                await node.outbound.send_push(peer, "model", payload, 1 + i)
                times[label].append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)  # the receiver drains before the next
        after = relay_status()["forwarded"]
        beats: dict[str, list[float]] = {k: [] for k in receivers}
        beat = heartbeat_payload(1, "exchange", done=False, bye=False)
        for _ in range(args.heartbeats):
            for label, peer in receivers.items():  # as node/membership.py sends one
                message = node.codec.encode(HEARTBEAT, peer, beat, round=1, encrypt=True)
                t0 = time.perf_counter()
                status, _ = await node.client.post(
                    peer, message, timeout=10.0, retries=0, probe=True, answer_limit=ACK_LIMIT
                )
                beats[label].append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"heartbeat to {peer}: HTTP {status}")
                await asyncio.sleep(0.01)
    finally:
        await node.stop()
    rate = {k: nbytes / 1e6 / statistics.median(v) for k, v in times.items()}
    ms = {
        f"heartbeat_{k}_{q}_ms": round(percentile(v, n) * 1e3, 2)
        for k, v in beats.items()
        for q, n in (("p50", 50), ("p99", 99))
    }
    direct_p50 = percentile(beats["direct"], 50)
    return {
        "payload_mb": round(nbytes / 1e6, 2),
        "repeats": args.repeats,
        "encrypted": True,
        "direct_mb_s": round(rate["direct"], 1),
        "relayed_mb_s": round(rate["relayed"], 1),
        "relayed_over_direct": round(rate["relayed"] / rate["direct"], 3),
        "target_ratio": 0.8,
        "heartbeats": args.heartbeats,
        **ms,
        # how many direct exchanges the relay adds to a small request's median
        "relayed_extra_hops_p50": round(
            (percentile(beats["relayed"], 50) - direct_p50) / direct_p50, 2
        ),
        "relay_forwarded_bytes": after["bytes"] - before["bytes"],
        "relay_forwarded_messages": after["messages"] - before["messages"],
    }


def via_relay(args: argparse.Namespace) -> dict[str, Any]:
    """Provision a, b (reachable) and c (behind relay r1); start r1 and the two
    receivers as processes; a sends from this process."""
    with tempfile.TemporaryDirectory(
        prefix="p2pfl-bench-transport-relay-", dir=os.environ.get("P2PFL_BENCH_TMP")
    ) as tmp:
        plans = provision(
            Path(tmp),
            ["a", "b", "c"],
            protocol={"name": "probe", "rounds": 0},
            overrides={
                "transport": {"heartbeat_s": 0.3},
                "wire": {"max_message_bytes": 1 << 30},
                "status": {"enabled": False},
                "node": {"startup_wait_s": 0},
            },
            relays=["r1"],
            behind=["c"],
            relay_overrides={"wire": {"max_message_bytes": 1 << 30}},
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        relay = RelayProcess(plans.relays[0], Path(tmp) / "r1.log").start()
        receivers = []
        try:
            relay.wait_for(lambda s: s.get("relay") == "r1", 60, "relay up")
            for plan in plans[1:]:
                (raw_port,) = free_ports(1)
                command = [sys.executable, "-m", "bench.transport", "--role", "receiver",
                           "--config", str(plan.config_path), "--raw-port", str(raw_port)]  # fmt: skip
                log = open(Path(tmp) / f"{plan.name}.log", "wb")  # noqa: SIM115
                receivers.append(
                    subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
                )
                log.close()

            def relay_status() -> dict[str, Any]:
                status = relay.status()
                if status is None:
                    raise RuntimeError(f"the relay does not answer: {relay.log_tail()}")
                return status

            return asyncio.run(relay_sender_main(args, plans[0].config_path, relay_status))
        finally:
            for receiver in receivers:
                receiver.terminate()
            for receiver in receivers:
                try:
                    receiver.wait(15)
                except subprocess.TimeoutExpired:
                    receiver.kill()
            relay.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mb", type=float, default=46.8)
    parser.add_argument(
        "--via-relay",
        action="store_true",
        help="direct vs through a relay process to an outbound-only receiver (issue 31)",
    )
    parser.add_argument(
        "--heartbeats", type=int, default=200, help="--via-relay: heartbeats timed per receiver"
    )
    parser.add_argument(
        "--role", choices=["sender", "receiver"], default="sender", help=argparse.SUPPRESS
    )
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--raw-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "receiver":
        asyncio.run(receiver_main(args.config, args.raw_port))
        return
    if args.via_relay:
        out = via_relay(args)
        print(
            f"payload {out['payload_mb']} MB, encrypted: direct {out['direct_mb_s']} MB/s, "
            f"via relay {out['relayed_mb_s']} MB/s, ratio {out['relayed_over_direct']} "
            f"(target {out['target_ratio']}); heartbeat p50/p99 direct "
            f"{out['heartbeat_direct_p50_ms']}/{out['heartbeat_direct_p99_ms']} ms, relayed "
            f"{out['heartbeat_relayed_p50_ms']}/{out['heartbeat_relayed_p99_ms']} ms"
        )
        print(json.dumps(out))
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
