"""Attack bench, issue 31: the relay (node/relay.py) and the sites behind it.

Listed in the registry (bench/attacks/kit.py) by bench/attacks/runner.py, so it runs as

    python -m bench.attacks --scenarios relay_unknown_client,relay_flood,...

One federation, group `relay`, started when one of its scenarios is selected:
two real daemons (probe protocol, `wire.encryption: true`): `a` reachable and
`c` outbound-only (`address: null`, `via: [r1, r2]`, listening on its own
loopback only); `r1` a real relay process (`p2pfl-node relay`, its provisioned
limits); `r2` a malicious relay in this process (`TamperingRelay`: the real
RelayServer, which flips one payload byte of what `h` sends after its own
checks passed); `m` a compromised roster member and `h` an honest one, both
played raw (bench/peer.py RawPeer with their own keys); `x` a stranger with a
fresh key pair on no roster.

Each scenario is judged from the relay's or the receiver's own answers and
counters (`/status` of r1 and of c): `refused` when the input was refused with
a reason and that reason's counter rose; the flood is `neutralised` when h's
relayed heartbeats to c kept their p99 within 2x the unloaded p99 measured in
the same run (before and after the flood), else `succeeded`, with both figures.

| scenario | attack | defended when |
|---|---|---|
| relay_unknown_client | x asks for the relay's WebSocket with its own proof, and POSTs a frame through it | unknown_site, unknown_sender, counted by r1 |
| relay_identity_claim | m asks for r1's WebSocket as c, signing r1's challenge with its own key | bad_signature counted by r1; c stays connected, same connection |
| relay_altered_message | r2 flips one payload byte of h's encrypted heartbeat to c | c answers digest_mismatch and counts it; the untouched frame is then taken, so the altered one was not processed |
| relay_plaintext | m sends c a signed heartbeat in the clear through r1 | 403 encryption_required counted by r1; r1 forwarded nothing of m's, c counted nothing from m |
| relay_flood | m floods r1 with heartbeats to c (bounded count and time, 16 connections, another process) | h's relayed heartbeat p99 under the flood <= 2x unloaded |
"""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench.attacks.federations import fresh, overrides, site_data
from bench.attacks.kit import Options, combine, guarded, inconclusive, say, verdict
from bench.attacks.relay_flood import (
    BASELINE_SAMPLES,
    FLOOD_FRAMES,
    FLOOD_S,
    GAP_S,
    flood_run,
    p50,
    p99,
)
from bench.attacks.victim import Victim
from bench.localfed import LocalFederation, RelayProcess
from bench.peer import RawPeer, Reply, heartbeat_payload, post_frame
from node.membership import HEARTBEAT
from node.provision import provision
from node.relay import RelayServer
from node.relay_handshake import HandshakeRefused, open_relay_socket
from node.relay_wire import RELAY_MESSAGE_PATH
from p2pfl.config import load_relay_config
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import Header, WireCodec

FEDERATION = "bench-relay"
HOLE = "31"
SITES = ["a", "c", "m", "h"]  # daemons: a and c; m and h are played raw
DAEMONS = ["a", "c"]
BEHIND = ["c"]
RELAYS = ["r1", "r2"]  # r1: the relay process; r2: TamperingRelay in this process
PROBE = {"name": "probe", "rounds": 1_000_000, "payload_kb": 1, "round_timeout_s": 2.0,
         "interval_s": 0.5}  # fmt: skip
P99_FACTOR = 2.0  # the bound: the relayed heartbeat p99 under a flood


# ---------------------------------------------------------------------- relays


class TamperingRelay(RelayServer):
    """A malicious relay: the real RelayServer, which flips one payload byte of
    every frame whose sender is in `targets` as it streams the frame down, after
    its own checks passed (so the altered bytes go down the recipient's
    connection, and END follows them)."""

    targets: frozenset[str] = frozenset()
    flipped = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streams: dict[
            int, str
        ] = {}  # stream id -> "head" until its head went, then "payload"

    async def _stream(
        self,
        link: Any,
        stream: aiohttp.StreamReader,
        stream_id: int,
        head: bytes,
        header: Header,
        answered: asyncio.Future[Any],
    ) -> tuple[str, str] | None:
        if header.sender in self.targets and header.payload_len:
            self._streams[stream_id] = "head"
        try:
            return await super()._stream(link, stream, stream_id, head, header, answered)
        finally:
            self._streams.pop(stream_id, None)

    async def _send_piece(self, link: Any, stream_id: int, kind: int, piece: Any) -> bool:
        state = self._streams.get(stream_id)
        if state == "head":
            self._streams[stream_id] = "payload"
        elif state == "payload" and len(piece):
            altered = bytearray(piece)
            altered[min(3, len(altered) - 1)] ^= 0x40
            piece = altered
            self.flipped += 1
            del self._streams[stream_id]  # one byte per frame
        return await super()._send_piece(link, stream_id, kind, piece)


class RelayThread:
    """A RelayServer on 127.0.0.1:`port`, served by its own event loop thread."""

    def __init__(self, server: RelayServer, port: int) -> None:
        self.server, self.port = server, port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None

    async def _start(self) -> None:
        app = web.Application()
        self.server.add_routes(app)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        await self.server.close()
        if self.runner is not None:
            await self.runner.cleanup()

    def __enter__(self) -> RelayThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def post_via(port: int, frame: bytes, timeout: float = 30.0) -> Reply:
    """`frame` POSTed to the relay at `port` (RELAY_MESSAGE_PATH); its answer,
    status 0 if none."""
    return post_frame(port, frame, timeout, path=RELAY_MESSAGE_PATH)


async def _handshake(port: int, identity: LocalIdentity, claim: str) -> dict[str, Any]:
    """Fetch r1's challenge and ask for its WebSocket as `claim`, signed with
    `identity`'s key (node/relay_handshake.py); {"type": "ok"} or the refusal."""
    async with aiohttp.ClientSession() as session:
        try:
            ws = await open_relay_socket(
                session, f"http://127.0.0.1:{port}", identity=identity, relay="r1",
                federation=FEDERATION, claim=claim,
            )  # fmt: skip
        except HandshakeRefused as exc:
            return {"type": "refused", "reason": str(exc)}
        await ws.close()
        return {"type": "ok"}


def handshake(port: int, identity: LocalIdentity, claim: str) -> dict[str, Any]:
    return asyncio.run(_handshake(port, identity, claim))


def refusals(relay: RelayProcess) -> dict[str, int]:
    return dict((relay.status() or {}).get("refusals") or {})


def site_row(relay: RelayProcess, name: str) -> dict[str, Any]:
    return dict(((relay.status() or {}).get("sites") or {}).get(name) or {})


def rose(before: dict[str, int], after: dict[str, int], reason: str | None) -> int:
    return after.get(reason or "", 0) - before.get(reason or "", 0)


def relay_judged(answer: Reply, before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """One input to the relay: refused with a reason the relay counted, or not."""
    row = answer.brief() | {"counted": rose(before, after, answer.reason)}
    row["outcome"] = "refused" if answer.status >= 400 and row["counted"] > 0 else "succeeded"
    return row


# ---------------------------------------------------------------------- scenarios


def unknown_client(r1: RelayProcess, port: int, roster: Roster) -> dict[str, Any]:
    """x, on no roster, connects to r1 and then POSTs a frame through it."""
    stranger = LocalIdentity.generate("x")
    before = refusals(r1)
    answer = handshake(port, stranger, "x")
    time.sleep(0.2)
    middle = refusals(r1)
    connect = {"answer": answer, "counted": rose(before, middle, answer.get("reason"))}
    connect["outcome"] = (
        "refused" if answer.get("type") == "refused" and connect["counted"] > 0 else "succeeded"
    )
    codec = WireCodec(stranger, roster, FEDERATION)
    frame = codec.encode(HEARTBEAT, "c", heartbeat_payload(), encrypt=True).to_bytes()
    reply = post_via(port, frame)
    time.sleep(0.2)
    post = relay_judged(reply, middle, refusals(r1))
    outcome = combine({"connect": connect["outcome"], "post": post["outcome"]})
    why = f"connect: {answer.get('reason') or answer.get('type')}; post: {reply.status} {reply.reason}"
    return verdict(outcome, HOLE, why, connect=connect, post=post)


def identity_claim(r1: RelayProcess, port: int, m: LocalIdentity, c: Victim) -> dict[str, Any]:
    """m answers r1's challenge as c, with its own signature."""
    before, site_before = refusals(r1), site_row(r1, "c")
    tunnel_before = ((c.status() or {}).get("relays") or {}).get("r1") or {}
    answer = handshake(port, m, "c")
    time.sleep(0.5)
    after, site_after = refusals(r1), site_row(r1, "c")
    tunnel_after = ((c.status() or {}).get("relays") or {}).get("r1") or {}
    counted = rose(before, after, answer.get("reason"))
    keys = ("connected", "since", "connects")
    undisturbed = bool(site_after.get("connected")) and all(
        site_before.get(k) == site_after.get(k) for k in keys
    )
    evidence = {
        "answer": answer,
        "counted": counted,
        "relay_sees_c": {"before": {k: site_before.get(k) for k in keys},
                         "after": {k: site_after.get(k) for k in keys}},
        "c_tunnel": {"before": {k: tunnel_before.get(k) for k in ("connected", "connects")},
                     "after": {k: tunnel_after.get(k) for k in ("connected", "connects")}},
    }  # fmt: skip
    if not site_before.get("connected"):
        return inconclusive(HOLE, "c was not connected to r1 before the claim", **evidence)
    if answer.get("type") == "ok":
        return verdict("succeeded", HOLE, "r1 accepted m as c", **evidence)
    if not undisturbed:
        return verdict("succeeded", HOLE, "the claim disturbed c's own connection", **evidence)
    if counted <= 0:
        return verdict("neutralised", HOLE, "refused but not counted", **evidence)
    return verdict("refused", HOLE, f"{answer.get('reason')}; c stayed connected", **evidence)


def plaintext(r1: RelayProcess, port: int, m: RawPeer, c: Victim) -> dict[str, Any]:
    """m sends c a correctly signed heartbeat in the clear through r1 (after an
    encrypted one, the control that the path itself carries m's frames)."""
    beat = heartbeat_payload(0, "exchange", done=False, bye=False)
    control = post_via(port, m.frame(HEARTBEAT, "c", beat, encrypt=True))
    time.sleep(0.2)
    before, m_before, c_before = refusals(r1), site_row(r1, "m"), c.counters()
    reply = post_via(port, m.frame(HEARTBEAT, "c", beat, encrypt=False))
    time.sleep(0.3)
    after, m_after, c_after = refusals(r1), site_row(r1, "m"), c.counters()
    row = relay_judged(reply, before, after)
    forwarded = m_after.get("messages_in", 0) - m_before.get("messages_in", 0)
    seen_by_c = c_after.by_peer.get("m", 0) - c_before.by_peer.get("m", 0)
    evidence = {"control": control.brief(), "plaintext": row,
                "forwarded_from_m": forwarded, "c_rejections_from_m": seen_by_c}  # fmt: skip
    if not control.accepted:
        return inconclusive(HOLE, f"the encrypted control was not carried: {control.reason}",
                            **evidence)  # fmt: skip
    if row["outcome"] != "refused" or forwarded or seen_by_c:
        return verdict("succeeded", HOLE, f"{reply.status} {reply.reason}", **evidence)
    return verdict("refused", HOLE, f"{reply.status} {reply.reason}; c never saw it", **evidence)


def altered(
    r2: TamperingRelay, r2_port: int, r1_port: int, h: RawPeer, c: Victim
) -> dict[str, Any]:
    """r2 flips one payload byte of h's encrypted heartbeat to c; then the same,
    untouched frame goes through r1: taken, had the altered copy not been processed."""
    frame = h.frame(HEARTBEAT, "c", heartbeat_payload(0, "exchange", done=False, bye=False),
                    encrypt=True)  # fmt: skip
    before, flips = c.counters(), r2.flipped
    reply = post_via(r2_port, frame)
    time.sleep(0.2)
    after = c.counters()
    counted = rose(before.rejected, after.rejected, reply.reason)
    original = post_via(r1_port, frame)
    evidence = {"altered": reply.brief() | {"counted_by_c": counted},
                "flipped_by_r2": r2.flipped - flips, "original_through_r1": original.brief()}  # fmt: skip
    if r2.flipped == flips:
        return inconclusive(HOLE, "r2 altered nothing", **evidence)
    if reply.accepted or original.reason == "replayed":
        return verdict("succeeded", HOLE, "c processed the altered frame", **evidence)
    if counted <= 0 or reply.reason != "digest_mismatch":
        return verdict("neutralised", HOLE, f"{reply.status} {reply.reason}, not counted as "
                       "digest_mismatch", **evidence)  # fmt: skip
    if not original.accepted:
        return inconclusive(HOLE, f"the untouched frame was refused: {original.reason}",
                            **evidence)  # fmt: skip
    return verdict("refused", HOLE, "digest_mismatch counted by c; the untouched copy was taken "
                   "after it", **evidence)  # fmt: skip


def flood(r1: RelayProcess, port: int, m: RawPeer, h: RawPeer, folder: Path) -> dict[str, Any]:
    """m floods r1 with encrypted heartbeats to c from another process while h's
    relayed heartbeats to c are timed, before, during and after the flood."""
    beat = heartbeat_payload(0, "exchange", done=False, bye=False)
    frames = [m.frame(HEARTBEAT, "c", beat, encrypt=True) for _ in range(FLOOD_FRAMES)]
    flood_path = folder / "flood.bin"
    flood_path.write_bytes(b"".join(struct.pack(">I", len(f)) + f for f in frames))
    count = 2 * BASELINE_SAMPLES + int(FLOOD_S / GAP_S) + 200
    beats = [h.frame(HEARTBEAT, "c", beat, encrypt=True) for _ in range(count)]
    before, m_before = refusals(r1), site_row(r1, "m")
    run = asyncio.run(flood_run(port, flood_path, beats))
    after, m_after = refusals(r1), site_row(r1, "m")
    base, loaded = run["unloaded"], run["loaded"]
    evidence = {
        "unloaded_p99_ms": round(p99(base) * 1e3, 2) if base else None,
        "flooded_p99_ms": round(p99(loaded) * 1e3, 2) if loaded else None,
        "unloaded_p50_ms": round(p50(base) * 1e3, 2) if base else None,
        "flooded_p50_ms": round(p50(loaded) * 1e3, 2) if loaded else None,
        "bound": f"{P99_FACTOR:g}x unloaded p99",
        "heartbeats": {"unloaded": len(base), "flooded": len(loaded)},
        "heartbeats_failed": run["failed"],
        "flooded_slowest_ms_per_s": run["loaded_slowest_ms_per_s"],  # from the flooder's start
        "flood": run["flood"],
        "relay_refusals": {
            k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)
        },
        "relay_forwarded_from_m": m_after.get("messages_in", 0) - m_before.get("messages_in", 0),
        # m's frames that waited for its rate at r1's front door (node/relay_admission.py)
        "relay_delayed_from_m": m_after.get("delayed", 0) - m_before.get("delayed", 0),
        "loadavg_1m": round(os.getloadavg()[0], 2),  # this machine's load (shared CPUs)
    }
    if len(base) < BASELINE_SAMPLES or run["flood"].get("sent", 0) < 100 or len(loaded) < 10:
        return inconclusive(HOLE, "the flood or the unloaded measure was not carried out",
                            **evidence)  # fmt: skip
    if run["failed"]["loaded"]:
        why = f"{len(run['failed']['loaded'])} relayed heartbeats failed under the flood"
        return verdict("succeeded", HOLE, why, **evidence)
    ratio = p99(loaded) / p99(base)
    evidence["p99_ratio"] = round(ratio, 2)
    outcome = "neutralised" if ratio <= P99_FACTOR else "succeeded"
    why = (f"relayed heartbeat p99 {evidence['flooded_p99_ms']} ms under the flood vs "
           f"{evidence['unloaded_p99_ms']} ms unloaded ({ratio:.2f}x, bound {P99_FACTOR:g}x)")  # fmt: skip
    return verdict(outcome, HOLE, why, **evidence)


# ---------------------------------------------------------------------- the federation


def run_relay_group(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    folder = fresh(opts.out / "relay")
    sources = site_data(folder / "data", len(SITES), opts.seed)
    fed_dir = folder / "fed"
    plans = provision(
        fed_dir, SITES, protocol=PROBE, data_sources=[str(s) for s in sources],
        federation=FEDERATION, seed=opts.seed, overrides=overrides(node={"startup_wait_s": 0.5}),
        relays=RELAYS, behind=BEHIND,
    )  # fmt: skip
    roster = Roster.load(fed_dir / "roster.yaml")
    ports = {p.name: p.port for p in plans}
    m = RawPeer(fed_dir, "m", ports, federation=FEDERATION, encrypt=True)
    h = RawPeer(fed_dir, "h", ports, federation=FEDERATION, encrypt=True)
    r1_plan, r2_plan = plans.relays
    r2_cfg = load_relay_config(r2_plan.config_path)
    r2 = TamperingRelay(
        "r2", FEDERATION, roster, r2_cfg.relay,
        max_message_bytes=r2_cfg.wire.max_message_bytes, clock_skew_s=r2_cfg.wire.clock_skew_s,
    )  # fmt: skip
    r2.targets = frozenset({"h"})
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    r1 = RelayProcess(r1_plan, logs / "r1.log").start()
    try:
        r1.wait_for(lambda s: s.get("relay") == "r1", opts.timeout_s, "r1 up")
        with (
            RelayThread(r2, r2_plan.port),
            LocalFederation([p for p in plans if p.name in DAEMONS], logs) as fed,
        ):
            c = Victim(fed["c"])
            c.wait_status(
                lambda s: all(((s.get("relays") or {}).get(r) or {}).get("connected")
                              for r in RELAYS),
                opts.timeout_s, "c connected to r1 and r2",
            )  # fmt: skip
            port = r1_plan.port
            steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
                ("relay_unknown_client", lambda: unknown_client(r1, port, roster)),
                ("relay_identity_claim", lambda: identity_claim(r1, port, m.codec.identity, c)),
                ("relay_plaintext", lambda: plaintext(r1, port, m, c)),
                ("relay_altered_message", lambda: altered(r2, r2_plan.port, port, h, c)),
                ("relay_flood", lambda: flood(r1, port, m, h, folder)),  # last: the heaviest
            ]
            results = {}
            for name, step in steps:
                if name in selected:
                    say(f"relay: {name}")
                    results[name] = guarded(name, step)
            return results
    finally:
        r1.stop()


SCENARIOS: dict[str, tuple[str, str]] = {  # name -> (issue, group)
    "relay_unknown_client": (HOLE, "relay"),
    "relay_identity_claim": (HOLE, "relay"),
    "relay_altered_message": (HOLE, "relay"),
    "relay_plaintext": (HOLE, "relay"),
    "relay_flood": (HOLE, "relay"),
}
GROUPS: dict[str, Callable[[Options, set[str]], dict[str, dict[str, Any]]]] = {
    "relay": run_relay_group,
}
