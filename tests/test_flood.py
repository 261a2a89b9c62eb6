"""A real node under a message flood stays live, fair and bounded (issue #10, item 3).

One test-played peer holding a valid roster key sends 1000 small signed pushes a
second for 30 s; another sends garbage (random bytes, truncated frames, an
unknown sender) at the same time. A separate process polls /healthz and samples
the node's RSS and spool. The node must keep answering /healthz quickly, let the
flooder through at no more than its configured rate, keep its inbox and memory
bounded, count every rejection by reason, and still be alive afterwards.

`make test` runs a 5 s flood (SHORT_FLOOD_S); the issue's 30 s flood is marked
`bench` and runs in `make bench-tests`. Both are judged by the same tests and
bounds. Set P2PFL_FLOOD_S to change the long one's length while working on it.
The figures are printed as one JSON line (run pytest with -s).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from fault_util import (
    HttpReply,
    KeepAliveConnection,
    Monitor,
    MonitorSummary,
    ReplyError,
    cpu_seconds,
    error_records,
    http_post,
    rss_kb,
)
from test_daemon import metric_value

from bench.localfed import LocalFederation
from bench.peer import RawPeer
from node.provision import free_ports, provision
from node.transport import MESSAGE_PATH, STATUS_FOR_REASON
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec

# Its /healthz bound is an absolute latency: `make test` runs it alone, after the
# parallel phase, so other workers' load cannot decide it (docs/testing.md).
pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

FLOOD_RATE = 1000  # signed messages per second from one roster peer
FLOOD_S = float(os.environ.get("P2PFL_FLOOD_S", "30"))  # the bench-marked flood
SHORT_FLOOD_S = 5.0  # the flood in `make test`: same senders, rates and bounds
GARBAGE_RATE = 250  # requests per second from the garbage sender
RATE_LIMIT = 200.0  # transport.rate_limit_per_s of the node under test (long flood)
# The short flood runs beside other tests' workers: its client may get a fraction
# of a core, so the node's limit is lower and a flood of > 2 x the limit stays one.
SHORT_RATE_LIMIT = 50.0
INBOX = 64  # transport.inbox_size: small, so the flood also fills it
HEALTHZ_P99_MS = 100.0
RSS_GROWTH_MB = 150.0
FLOOD_WORKERS = 48  # concurrent keep-alive connections of the flooder
GARBAGE_WORKERS = 8
REQUEST_TIMEOUT_S = 5.0


@dataclass
class Tally:
    """What one paced sender saw: replies by (status, reason), transport errors, timing."""

    replies: Counter[tuple[int, str]] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    unsent: int = 0
    first_send: float = 0.0  # loop time
    last_send: float = 0.0
    last_reply: float = 0.0

    def count(self, reply: HttpReply) -> None:
        self.replies[(reply.status, reply.reason or "-")] += 1

    def by_reason(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for (status, reason), n in self.replies.items():
            out["accepted" if status == 200 else reason] += n
        return dict(sorted(out.items()))

    @property
    def send_rate(self) -> float:
        span = self.last_send - self.first_send
        return self.sent / span if span > 0 else 0.0


async def paced_send(
    port: int, requests: list[bytes], rate: float, workers: int, tally: Tally, max_s: float
) -> None:
    """Send `requests` at `rate` per second over `workers` keep-alive connections.

    Request i is due at start + i / rate; a worker that falls behind sends at once,
    so the schedule catches up when the server lets it. Stops after `max_s` even
    if requests are left (counted as unsent)."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    tally.first_send = start
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        conn = KeepAliveConnection(port)
        try:
            while next_index < len(requests):
                i = next_index
                next_index += 1
                if loop.time() - start > max_s:
                    tally.unsent += 1
                    continue
                await asyncio.sleep(max(0.0, start + i / rate - loop.time()))
                tally.sent += 1
                tally.last_send = loop.time()
                try:
                    reply = await conn.exchange(requests[i], REQUEST_TIMEOUT_S)
                except (OSError, TimeoutError, ReplyError, asyncio.IncompleteReadError) as exc:
                    tally.errors[type(exc).__name__] += 1
                    continue
                tally.count(reply)
                tally.last_reply = loop.time()
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(workers)))


async def flood_and_garbage(
    port: int, flood: list[bytes], garbage: list[bytes], flood_s: float
) -> tuple[Tally, Tally, float, float]:
    """Both senders at once; returns their tallies and the flood's wall-clock window."""
    flooder, vandal = Tally(), Tally()
    started = time.time()
    await asyncio.gather(
        paced_send(port, flood, FLOOD_RATE, FLOOD_WORKERS, flooder, flood_s + 10),
        paced_send(port, garbage, GARBAGE_RATE, GARBAGE_WORKERS, vandal, flood_s + 10),
    )
    return flooder, vandal, started, time.time()


def flood_requests(codec: WireCodec, port: int, n: int) -> list[bytes]:
    """n small signed pushes, each with its own id; stamped now (well within clock_skew_s)."""
    return [
        http_post(
            port,
            codec.encode(
                "probe", "a", {"round": 0, "from": codec.identity.name, "tensor": torch.zeros(16)}
            ).to_bytes(),
            MESSAGE_PATH,
        )
        for _ in range(n)
    ]


def garbage_requests(
    rng: random.Random, roster_peer: WireCodec, outsider: WireCodec, port: int, n: int
) -> tuple[list[bytes], Counter[str]]:
    """Random bytes, truncated frames (honest Content-Length) and frames from an
    unknown sender, in turn; also returns how many of each kind."""
    truncated_src = [
        roster_peer.encode("probe", "a", {"round": 0, "tensor": torch.zeros(64)}).to_bytes()
        for _ in range(64)
    ]
    unknown = [
        outsider.encode("probe", "a", {"round": 0, "tensor": torch.zeros(16)}).to_bytes()
        for _ in range(64)
    ]
    kinds: Counter[str] = Counter()
    out = []
    for i in range(n):
        kind = ("random", "truncated", "unknown_sender")[i % 3]
        kinds[kind] += 1
        if kind == "random":
            body = rng.randbytes(rng.randint(1, 512))
        elif kind == "truncated":
            frame = truncated_src[i % len(truncated_src)]
            body = frame[: rng.randint(1, len(frame) - 1)]
        else:
            body = unknown[i % len(unknown)]
        out.append(http_post(port, body, MESSAGE_PATH))
    return out, kinds


@dataclass
class FloodRun:
    """Everything one flood measured; the tests below judge it."""

    flooder: Tally
    vandal: Tally
    garbage_kinds: Counter[str]
    during: MonitorSummary
    rss_before_kb: int
    rss_after_kb: int
    alive_after: bool
    healthz_after: str
    status: dict[str, Any]
    prom: str
    log_problems: list[str]  # unhandled errors in the node's logs
    figures: dict[str, Any] = field(default_factory=dict)  # the printed JSON line

    @property
    def span_s(self) -> float:
        """From the flood's first send to its last reply."""
        return self.flooder.last_reply - self.flooder.first_send

    @property
    def passed_limiter(self) -> int:
        """Flood messages the rate limiter let through (accepted, or then refused queue_full)."""
        return sum(n for (st, _), n in self.flooder.replies.items() if st in (200, 503))


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((SHORT_FLOOD_S, SHORT_RATE_LIMIT), id="short"),
        pytest.param((FLOOD_S, RATE_LIMIT), id="long", marks=pytest.mark.bench),
    ],
)
def flood_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FloodRun:
    flood_s, rate_limit = request.param
    tmp_path = tmp_path_factory.mktemp("flood")
    probe = {
        "name": "probe",
        "rounds": 1_000_000,
        "payload_kb": 1,
        "round_timeout_s": 2,
        "interval_s": 0.5,
    }
    plans = provision(
        tmp_path / "fed",
        ["a", "b", "c"],
        protocol=probe,
        overrides={
            "node": {"startup_wait_s": 0.5},
            "transport": {"rate_limit_per_s": rate_limit, "inbox_size": INBOX, "retries": 0},
        },
    )
    plan = plans[0]
    state = tmp_path / "fed" / "a" / "state"
    mallory = LocalIdentity.generate("mallory")
    roster = Roster.load(tmp_path / "fed" / "roster.yaml")
    outsider = WireCodec(mallory, Roster([*roster.cards(), mallory.card("127.0.0.1:1")]), "local")
    seed = int(os.environ.get("P2PFL_FLOOD_SEED", random.randrange(2**32)))
    print(f"flood seed {seed}")
    rng = random.Random(seed)
    fed = LocalFederation([plan], tmp_path / "logs")
    node = fed["a"]
    with fed:
        # Signing is the client's bottleneck: sign everything while the node starts.
        flood = flood_requests(
            RawPeer(tmp_path / "fed", "b", {}).codec, plan.port, int(FLOOD_RATE * flood_s)
        )
        garbage, garbage_kinds = garbage_requests(
            rng,
            RawPeer(tmp_path / "fed", "c", {}).codec,
            outsider,
            plan.port,
            int(GARBAGE_RATE * flood_s),
        )
        node.wait_for(lambda s: s["round"] >= 1, 60, "node a running its protocol")
        assert node.proc is not None
        pid = node.proc.pid
        monitor = Monitor(
            plan.status_port,
            pid,
            state / "spool",
            tmp_path / "monitor.jsonl",
            control_port=free_ports(1)[0],
        )
        try:
            monitor.wait_started()
            time.sleep(1.0)  # a quiet baseline
            rss_before = rss_kb(pid)
            cpu_node, cpu_client = cpu_seconds(pid), time.process_time()
            flooder, vandal, started, ended = asyncio.run(
                flood_and_garbage(plan.port, flood, garbage, flood_s)
            )
            cpu_node, cpu_client = cpu_seconds(pid) - cpu_node, time.process_time() - cpu_client
            time.sleep(1.0)  # let the node settle, then look at it
            rss_after = rss_kb(pid)
            alive_after = node.running
            healthz_after = node.get("/healthz").strip()
            status = node.status()
            prom = node.get("/metrics")
        finally:
            monitor.stop()
    assert status is not None
    during = monitor.window(started, ended)
    run = FloodRun(
        flooder,
        vandal,
        garbage_kinds,
        during,
        rss_before,
        rss_after,
        alive_after,
        healthz_after,
        status,
        prom,
        [*error_records(state / "node.log")[0], *error_records(node.log_path)[0]],
    )
    run.figures = {
        "seed": seed,
        "flood_planned_s": flood_s,
        "flood_s": round(run.span_s, 2),
        "flood_sent": flooder.sent,
        "flood_unsent": flooder.unsent,
        "flood_rate_per_s": round(flooder.send_rate, 1),
        "flood_replies": flooder.by_reason(),
        "flood_errors": dict(flooder.errors),
        "garbage_sent": vandal.sent,
        "garbage_rate_per_s": round(vandal.send_rate, 1),
        "garbage_kinds": dict(garbage_kinds),
        "garbage_replies": vandal.by_reason(),
        "garbage_errors": dict(vandal.errors),
        "rate_limit_per_s": rate_limit,
        "passed_limiter": run.passed_limiter,
        "limiter_bound": round(rate_limit * run.span_s + max(10.0, rate_limit)),
        **monitor.window(started - 1.0, started).figures("baseline_"),
        **during.figures(),
        "spool_files_max": max(during.spool_files or [0]),
        "inbox_size": INBOX,
        "rss_before_mb": round(rss_before / 1024, 1),
        "rss_peak_mb": round(max(during.rss_kb or [0]) / 1024, 1),
        "rss_after_mb": round(rss_after / 1024, 1),
        "node_cpu_share": round(cpu_node / (ended - started), 2),
        "client_cpu_share": round(cpu_client / (ended - started), 2),
        "node_rejected": status["rejected"],
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(run.figures))
    return run


def test_flood_is_rate_limited_bounded_and_counted(flood_run: FloodRun) -> None:
    run, figures = flood_run, flood_run.figures
    flooder, vandal = run.flooder, run.vandal
    # Alive and answering, during and after.
    assert run.alive_after and run.healthz_after == "ok", figures
    assert run.during.failures == 0, figures
    # The flood really was one: every message sent was answered, far above the
    # limit. (A client starved of CPU may not send all it planned in the time:
    # the rate it reached is what makes it a flood.)
    assert not flooder.errors and not vandal.errors, figures
    assert flooder.sent >= 0.4 * (flooder.sent + flooder.unsent), figures
    assert flooder.send_rate > 2 * figures["rate_limit_per_s"], figures
    # Per-peer rate limit: no more than rate x time + burst past the limiter, and the
    # limiter does not starve the peer either; everything else refused as such.
    assert run.passed_limiter <= figures["limiter_bound"], figures
    assert run.passed_limiter >= 0.7 * figures["rate_limit_per_s"] * run.span_s, figures
    assert set(flooder.replies) <= {(200, "-"), (429, "rate_limited"), (503, "queue_full")}, figures
    # Garbage is refused with its reason, never accepted.
    assert {reason for _, reason in vandal.replies} <= {
        "undecodable_header",
        "truncated",
        "digest_mismatch",
        "unknown_sender",
    }, figures
    assert all(STATUS_FOR_REASON[reason] == st for st, reason in vandal.replies), figures
    strangers = vandal.by_reason().get("unknown_sender", 0)
    if vandal.unsent == 0:  # every stranger's message was refused as such
        assert strangers == run.garbage_kinds["unknown_sender"], figures
    else:  # a CPU-starved sender sent part of its plan
        assert 0 < strangers <= run.garbage_kinds["unknown_sender"], figures
    # Inbox and memory bounded.
    assert figures["spool_files_max"] <= INBOX, figures
    peak_kb = max(run.during.rss_kb or [0])
    assert (peak_kb - run.rss_before_kb) / 1024 < RSS_GROWTH_MB, figures
    assert (run.rss_after_kb - run.rss_before_kb) / 1024 < RSS_GROWTH_MB, figures
    # Every refusal the senders saw is counted by reason, in /status and /metrics.
    seen: Counter[str] = Counter()
    for tally in (flooder, vandal):
        for (st, reason), n in tally.replies.items():
            if st != 200:
                seen[reason] += n
    for reason, n in seen.items():
        assert run.status["rejected"].get(reason) == n, (reason, n, run.status["rejected"])
        assert metric_value(run.prom, "p2pfl_rejected_total", reason=reason) == n, reason
    assert run.status["rejected_by_peer"].get("b") == sum(
        n for (st, _), n in flooder.replies.items() if st != 200
    )
    assert not run.log_problems, run.log_problems[:5]


def test_healthz_stays_fast_during_a_flood(flood_run: FloodRun) -> None:
    during = flood_run.during
    if during.healthz_p99_ms >= HEALTHZ_P99_MS and during.control_p99_ms >= HEALTHZ_P99_MS / 2:
        pytest.skip(
            f"inconclusive: /healthz p99 {during.healthz_p99_ms:.0f} ms, but an idle server on "
            f"this machine had p99 {during.control_p99_ms:.0f} ms too (load {os.getloadavg()})"
        )
    # Fast: under the bound, or (other tests' workers sharing the cores) within
    # 4 x what an idle server on this machine answers in at the same time.
    bound = max(HEALTHZ_P99_MS, 4 * during.control_p99_ms)
    assert during.healthz_p99_ms < bound, flood_run.figures
