"""Issue #28's scenarios that load a victim (bench/attacks/review.py runs
them): a NaN wait, a response bomb, junk kinds, a decode bomb, concurrent
replays and a flood of held requests, each judged by what the victim refused
and counted and by what it cost it (/healthz, RSS, descriptors)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import struct
import time
from typing import Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector

from bench.attacks.federations import state_dir
from bench.attacks.kit import (
    NOT_A_DEFENCE,
    inconclusive,
    judge_input,
    probe_payload,
    refused_and_counted,
    verdict,
)
from bench.attacks.victim import RSS_BOUND, Monitor, Victim, raw_frame, simultaneous, within_bounds
from bench.peer import Listener, RawPeer, heartbeat_payload
from node.membership import HEARTBEAT
from node.outbound import REQUEST_PREFIX
from node.provision import SitePlan
from node.transport import MESSAGE_PATH
from p2pfl.secure import tensors
from p2pfl.secure.wire import Header

BOMB_BYTES = 64 << 20  # the fake peer's answer
FUTURE_ROUND = 10**9  # a model no victim has: its request is held (NotReady)


def nan_wait(m: RawPeer, victim: Victim) -> dict[str, Any]:
    """Hole 3: one signed request whose `_wait_s` is NaN, for a model the victim
    has not made (so it would hold the request). The victim must answer it and
    keep answering /healthz within 1 s, during and after."""
    query = {"round": FUTURE_ROUND, "max_round": FUTURE_ROUND, "_wait_s": float("nan")}
    frame = m.frame(REQUEST_PREFIX + "model", victim.name, query)
    before = victim.counters()
    with Monitor(victim) as mon:
        t0 = time.monotonic()
        reply = m.post(victim.name, frame, timeout=5.0)
        time.sleep(3.0)
        t1 = time.monotonic()
    fig = mon.figures(t0, t1)
    after = victim.counters()
    row = judge_input(reply, before, after)
    evidence = {"input": row, "victim": fig, "alive_after": victim.node.running}
    if fig["healthz_unanswered"] or not victim.healthy():
        victim.node.kill()  # frozen: it would ignore SIGTERM
        return verdict("succeeded", "28.3", "the victim stopped answering /healthz", **evidence)
    if row["outcome"] == "refused":
        return verdict("refused", "28.3", f"refused {reply.status} {reply.reason}", **evidence)
    return verdict(
        "neutralised", "28.3", f"answered {reply.status} {reply.reason}, still live", **evidence
    )


def response_bomb(victim: Victim, port: int) -> dict[str, Any]:
    """Hole 5: the attacker holds roster member f's address and answers each of
    the victim's heartbeats with 64 MiB (chunked); the victim reads at most
    max_message_bytes (4 MiB) of an answer."""
    before = victim.counters()
    with Monitor(victim) as mon, Listener(port, BOMB_BYTES) as fake:
        t0 = time.monotonic()
        time.sleep(4.0)  # several heartbeats
        t1 = time.monotonic()
    fig = mon.figures(t0, t1)
    after = victim.counters()
    answers = list(fake.answers)
    evidence = {
        "answers": len(answers),
        "bytes_sent": [a["sent"] for a in answers],
        "cut_off": sum(a["cut_off"] for a in answers),
        "counted": before.rise(after),
        "counted_for_f": after.by_peer.get("f", 0) - before.by_peer.get("f", 0),
        "victim": fig,
        "rss_bound_mb": RSS_BOUND / 2**20,
    }
    if not answers:
        return inconclusive("28.5", "the victim sent nothing to f's address", **evidence)
    if not within_bounds(fig):
        return verdict(
            "succeeded", "28.5", f"RSS +{fig['rss_growth_mb']} MiB / p99 {fig['healthz_p99_ms']} ms",
            **evidence,
        )  # fmt: skip
    if evidence["cut_off"] == len(answers) and evidence["counted"]:
        return verdict("refused", "28.5", f"cut off and counted {evidence['counted']}", **evidence)
    return verdict("neutralised", "28.5", "memory bounded, no refusal counted", **evidence)


def unbounded_kinds(m: RawPeer, victim: Victim, plan: SitePlan, timeout: float) -> dict[str, Any]:
    """Hole 6: 50 signed pushes of 50 kinds nobody registered (inbox_size 4):
    each must be refused before it is spooled, and a restart re-queue none."""
    sent = [
        m.codec.encode(f"junk-{i:03d}", victim.name, {"round": 1, "i": i}, round=1)
        for i in range(50)
    ]
    before = victim.counters()
    replies = [m.post(victim.name, s.to_bytes()) for s in sent]
    time.sleep(0.2)
    after = victim.counters()
    rise = before.rise(after)
    spool = state_dir(plan) / "spool"
    ids = {s.header.id_hex for s in sent}
    spooled = sorted(p.stem for p in spool.glob("*.frame") if p.stem in ids)
    victim.restart(timeout)
    found = re.findall(r"\((\d+) spooled messages re-queued\)", victim.node.log_path.read_text())
    requeued = int(found[-1]) if found else None
    refused = [r for r in replies if r.status >= 400 and r.reason and r.reason not in NOT_A_DEFENCE]
    by_reason: dict[str, int] = {}
    for r in refused:
        by_reason[r.reason] = by_reason.get(r.reason, 0) + 1  # type: ignore[index]
    evidence = {
        "pushes": len(sent),
        "answers": {f"{r.status} {r.reason}": sum(1 for x in replies if x.brief() == r.brief())
                    for r in replies},
        "counted": rise,
        "spooled": len(spooled),
        "requeued_after_restart": requeued,
    }  # fmt: skip
    if spooled or requeued:
        return verdict(
            "succeeded", "28.6", f"{len(spooled)} spooled, {requeued} re-queued", **evidence
        )
    counted = all(rise.get(k, 0) >= n for k, n in by_reason.items())
    if len(refused) == len(sent) and counted:
        return verdict("refused", "28.6", f"all refused and counted: {rise}", **evidence)
    return verdict("neutralised", "28.6", "nothing spooled, not all refused", **evidence)


def decode_bomb(m: RawPeer, victim: Victim) -> dict[str, Any]:
    """Hole 7: a 1 MiB heartbeat whose payload is one
    array of ~1M empty arrays (one byte each on the wire, ~70 bytes each
    decoded). Refused with a reason, or decoded within the bounds."""
    head = heartbeat_payload()
    small = bytearray(tensors.dumps(head))
    assert small[0] == 0x80 | len(head)
    small[0] += 1  # one more key
    n = (1 << 20) - 1024  # ~1 MiB on the wire, within max_message_bytes
    payload = bytes(small) + tensors.dumps("pad") + b"\xdd" + struct.pack(">I", n) + b"\x90" * n
    frame, _ = raw_frame(m, HEARTBEAT, victim.name, payload)
    # The control: a harmless heartbeat as large (one bin); receiving it warms the
    # victim's allocator, so the bomb's RSS growth is what decoding it costs.
    harmless = {**head, "pad": bytes(n)}
    control = m.post(victim.name, m.frame(HEARTBEAT, victim.name, harmless)).brief()
    before = victim.counters()
    with Monitor(victim) as mon:
        t0 = time.monotonic()
        reply = m.post(victim.name, frame, timeout=60.0)
        t1 = time.monotonic() + 0.3
        time.sleep(0.5)
    after = victim.counters()
    fig = mon.figures(t0, t1)
    row = judge_input(reply, before, after)
    evidence = {"frame_bytes": len(frame), "elements": n, "input": row, "victim": fig}
    evidence["same_size_control"] = control
    if not within_bounds(fig):
        return verdict(
            "succeeded", "28.7", f"RSS +{fig['rss_growth_mb']} MiB, /healthz p99 "
            f"{fig['healthz_p99_ms']} ms (answered {reply.status} {reply.reason})", **evidence,
        )  # fmt: skip
    if row["outcome"] == "refused":
        return verdict("refused", "28.7", f"refused {reply.status} {reply.reason}", **evidence)
    return verdict("neutralised", "28.7", "decoded within the bounds", **evidence)


def concurrent_replay(m: RawPeer, victim: Victim, plan: SitePlan) -> dict[str, Any]:
    """Hole 8: three copies of one signed push (a network observer's capture),
    their headers all sent before any payload: one must be processed."""
    frame = m.frame("probe", victim.name, probe_payload("m", 1), round_no=1)
    msg_id = Header.unpack(frame[8 : 8 + struct.unpack(">I", frame[4:8])[0]]).id_hex
    before = victim.counters()
    replies = simultaneous(victim.node.plan.port, frame, 3)
    time.sleep(0.3)
    after = victim.counters()
    processed = after.received.get("probe", 0) - before.received.get("probe", 0)
    time.sleep(3.0)  # a probe round or two: the protocol consumes and journals
    journal = state_dir(plan) / "journal.jsonl"
    journaled = journal.read_text().count(msg_id) if journal.exists() else 0
    evidence = {
        "answers": [r.brief() for r in replies],
        "counted": before.rise(after),
        "opened_by_victim": processed,
        "journaled": journaled,
    }
    processed = max(processed, journaled)
    if processed == 0:
        return inconclusive("28.8", "the victim processed no copy", **evidence)
    if processed > 1:
        return verdict("succeeded", "28.8", f"processed {processed} times", **evidence)
    others = [r for r in replies if not r.accepted]
    if len(others) == len(replies) - 1 and all(
        refused_and_counted(r, before, after) for r in others
    ):
        return verdict("refused", "28.8", "once; the copies refused and counted", **evidence)
    return verdict("neutralised", "28.8", "processed once", **evidence)


def held_request_flood(m: RawPeer, victim: Victim) -> dict[str, Any]:
    """Held requests: one member opens 300 requests the victim holds (a model
    it has not made, 15 s wait), 100 a second (under the rate limit). Beyond a
    per-peer cap they must be refused and counted; /healthz answers; the
    victim's descriptors stay bounded."""
    n, rate, wait_s = 300, 100.0, 15.0
    ctl_reply, _ = m.request(
        victim.name, "model", {"round": FUTURE_ROUND, "max_round": FUTURE_ROUND}, wait_s=1.0
    )
    query = {"round": FUTURE_ROUND, "max_round": FUTURE_ROUND, "_wait_s": wait_s}
    frames = [m.frame(REQUEST_PREFIX + "model", victim.name, query) for _ in range(n)]
    url = f"http://127.0.0.1:{victim.node.plan.port}{MESSAGE_PATH}"
    rows: list[dict[str, Any]] = []

    async def one(session: ClientSession, i: int, start: float) -> None:
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        t = time.monotonic()
        row: dict[str, Any] = {"sent": t, "status": 0, "reason": None, "done": None}
        rows.append(row)
        try:
            async with session.post(url, data=frames[i]) as resp:
                body = await resp.read()
                row["status"] = resp.status
                with contextlib.suppress(ValueError, AttributeError):
                    row["reason"] = json.loads(body).get("reason")
        except Exception as exc:  # noqa: BLE001 - counted as no answer
            row["reason"] = f"error: {type(exc).__name__}"
        row["done"] = time.monotonic()

    async def flood() -> None:
        conn = TCPConnector(limit=0, force_close=True)
        async with ClientSession(connector=conn, timeout=ClientTimeout(total=wait_s + 5)) as s:
            start = time.monotonic()
            await asyncio.gather(*(one(s, i, start) for i in range(n)))

    before = victim.counters()
    with Monitor(victim) as mon:
        t0 = time.monotonic()
        asyncio.run(flood())
        t1 = time.monotonic()
    after = victim.counters()
    fig = mon.figures(t0, t1)
    held_peak = (
        max(
            sum(1 for r in rows if r["sent"] <= t and (r["done"] is None or r["done"] > t))
            for t, *_ in mon.usage
            if t0 <= t <= t1
        )
        if mon.usage
        else 0
    )
    quick = [r for r in rows if r["done"] and r["done"] - r["sent"] < wait_s / 3 and
             r["status"] >= 400 and r["reason"] not in ("not_ready", "no_handler")]  # fmt: skip
    reasons: dict[str, int] = {}
    for r in quick:
        reasons[str(r["reason"])] = reasons.get(str(r["reason"]), 0) + 1
    rise = before.rise(after)
    evidence = {
        "requests": n,
        "control": ctl_reply.brief(),
        "held_at_once": held_peak,
        "refused_quickly": reasons,
        "counted": rise,
        "victim": fig,
    }
    if ctl_reply.reason != "not_ready":
        return inconclusive("28.held", "the victim did not hold the control request", **evidence)
    if fig["healthz_unanswered"] or not victim.healthy():
        return verdict("succeeded", "28.held", "/healthz stopped answering", **evidence)
    if held_peak >= n or (fig["fds_growth"] or 0) >= 0.9 * n:
        return verdict("succeeded", "28.held", f"{held_peak} held at once: no cap", **evidence)
    if reasons and all(rise.get(k, 0) >= v for k, v in reasons.items()):
        return verdict("refused", "28.held", f"{held_peak} held; beyond: {reasons}", **evidence)
    return verdict("neutralised", "28.held", f"{held_peak} held at once; none counted", **evidence)
