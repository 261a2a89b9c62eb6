"""Shared by the fault tests (flood, HTTP fuzzing) against a real node process.

- Raw HTTP/1.1 over asyncio streams, so a test controls every byte it sends and
  a flooding client stays cheap (no aiohttp client per request).
- A node's resident memory and CPU time, read from /proc.
- A scan of a node's log for unhandled errors.
- Run as a script, this file is the liveness monitor of the flood test, in its
  own process because the flooding client's event loop would otherwise delay
  the probe and blame the node for it: it polls /healthz on a fresh connection
  every few tens of milliseconds, samples the node's RSS and spool size, and
  probes an idle control server (the node's status app in a process of its own)
  to tell how much of any latency the machine's load alone adds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MAX_REPLY_HEAD = 64 * 1024
MAX_REPLY_BODY = 1024 * 1024


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def reason(self) -> str | None:
        """The `reason` of a JSON body (our handler's rejections), else None."""
        try:
            obj = json.loads(self.body)
        except (ValueError, UnicodeDecodeError):
            return None
        return obj.get("reason") if isinstance(obj, dict) else None

    @property
    def closes(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


class ReplyError(Exception):
    """The server's bytes are not an HTTP/1.1 response we can read."""


def http_post(port: int, body: bytes, path: str) -> bytes:
    """A well-formed keep-alive POST of `body` (the head and body as one buffer)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_reply(reader: asyncio.StreamReader, *, to_head: bool = False) -> HttpReply:
    """One HTTP/1.1 response: status line, headers, body (Content-Length, chunked or EOF).

    Any HTTP/x.y status line is read (aiohttp answers in the version it was asked
    in, HTTP/2.0 included). Interim 1xx responses (100 Continue) are skipped; a
    reply `to_head` (a HEAD request) has no body whatever its Content-Length says."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise ReplyError("response head too long") from exc
        lines = head.decode("latin-1").split("\r\n")
        match = re.fullmatch(r"HTTP/\d\.\d (\d{3})(?: .*)?", lines[0])
        if match is None:
            raise ReplyError(f"bad status line {lines[0][:80]!r}")
        if not match.group(1).startswith("1"):
            break
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if to_head:
        body = b""
    elif "content-length" in headers:
        body = await reader.readexactly(min(int(headers["content-length"]), MAX_REPLY_BODY))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = await _read_chunked(reader)
    else:
        body = await reader.read(MAX_REPLY_BODY)
    return HttpReply(int(match.group(1)), headers, body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while sum(map(len, parts)) <= MAX_REPLY_BODY:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            break
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
    return b"".join(parts)


class KeepAliveConnection:
    """One persistent HTTP/1.1 connection to 127.0.0.1:port, reopened when the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def exchange(self, request: bytes, timeout: float) -> HttpReply:
        """Send one whole request and read its response; raises OSError, TimeoutError, ReplyError."""
        try:
            async with asyncio.timeout(timeout):
                if self.writer is None:
                    self.reader, self.writer = await asyncio.open_connection(
                        "127.0.0.1", self.port, limit=MAX_REPLY_HEAD
                    )
                assert self.reader is not None
                self.writer.write(request)
                await self.writer.drain()
                reply = await read_reply(self.reader)
        except (OSError, TimeoutError, ReplyError, asyncio.IncompleteReadError):
            self.close()
            raise
        if reply.closes:
            self.close()
        return reply

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def one_shot(
    port: int,
    request: bytes | list[bytes],
    timeout: float,
    *,
    cut_at: int | None = None,
    pause_s: float = 0.01,
) -> HttpReply | str:
    """`request` on a fresh connection; the reply, or what happened instead.

    A list of parts is sent with a pause between them, so the server reads them
    separately (an error in a later part then reaches the handler mid-read, not
    the HTTP parser up front). With `cut_at` only that many bytes are sent and
    the connection is closed (a client dying mid-request); the outcome is then
    "cut". Otherwise it is the reply or one of "timeout", "refused", "reset",
    "closed", "unreadable", "error".
    """
    parts = [request] if isinstance(request, bytes) else request
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=MAX_REPLY_HEAD)
            if cut_at is not None:
                writer.write(b"".join(parts)[:cut_at])
                await writer.drain()
                await asyncio.sleep(pause_s)
                return "cut"
            for i, part in enumerate(parts):
                if i:
                    await asyncio.sleep(pause_s)
                writer.write(part)
                await writer.drain()
            return await read_reply(reader, to_head=parts[0].startswith(b"HEAD "))
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except ConnectionResetError:
        return "reset"
    except (asyncio.IncompleteReadError, BrokenPipeError):
        return "closed"
    except ReplyError:
        return "unreadable"
    except OSError:
        return "error"
    finally:
        if writer is not None:
            writer.close()


def rss_kb(pid: int) -> int:
    """VmRSS of a live process in KiB (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a live process has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# An ERROR record of aiohttp's server for a request its HTTP parser refused (answered 400).
PARSER_REFUSAL = re.compile(
    r"ERROR aiohttp\.server: Error handling request.*?\naiohttp\.http_exceptions\.\w+: 400",
    re.S,
)
UNHANDLED = re.compile(r"Traceback|Unhandled exception|ERROR.*Error handling request")
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", re.M)


def log_records(path: Path) -> list[str]:
    """The records of a text-format node log (a record runs to the next timestamp)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    starts = [m.start() for m in RECORD_START.finditer(text)] + [len(text)]
    return [text[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def error_records(path: Path) -> tuple[list[str], int]:
    """A log's records of unhandled errors, apart from aiohttp's parser refusals (counted)."""
    unhandled, parser_refusals = [], 0
    for record in log_records(path):
        if PARSER_REFUSAL.search(record):
            parser_refusals += 1
        elif UNHANDLED.search(record):
            unhandled.append(f"{path.name}: {record[:600]}")
    return unhandled, parser_refusals


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# --------------------------------------------------------------------------- monitor


@dataclass
class MonitorSummary:
    """What the separate-process monitor saw within one time window.

    `control_ms` are the latencies of the same /healthz route served by an idle
    process on this machine: what the machine's own load adds to any answer."""

    healthz_ms: list[float] = field(default_factory=list)
    failures: int = 0
    control_ms: list[float] = field(default_factory=list)
    rss_kb: list[int] = field(default_factory=list)
    spool_files: list[int] = field(default_factory=list)

    @property
    def healthz_p99_ms(self) -> float:
        return percentile(self.healthz_ms, 99) if self.healthz_ms else math.inf

    @property
    def control_p99_ms(self) -> float:
        return percentile(self.control_ms, 99) if self.control_ms else math.inf

    def figures(self, prefix: str = "") -> dict[str, float | int]:
        ms = self.healthz_ms or [math.nan]
        control = self.control_ms or [math.nan]
        return {
            f"{prefix}healthz_samples": len(self.healthz_ms),
            f"{prefix}healthz_failures": self.failures,
            f"{prefix}healthz_p50_ms": round(percentile(ms, 50), 2),
            f"{prefix}healthz_p99_ms": round(percentile(ms, 99), 2),
            f"{prefix}healthz_max_ms": round(max(ms), 2),
            f"{prefix}control_p50_ms": round(percentile(control, 50), 2),
            f"{prefix}control_p99_ms": round(percentile(control, 99), 2),
        }


class Monitor:
    """The monitor and its idle control server, each a child process.

    `stop()` ends both, `window()` then reads the samples of a time window."""

    def __init__(
        self,
        status_port: int,
        pid: int,
        spool: Path,
        out: Path,
        *,
        control_port: int,
        interval_s: float = 0.025,
        max_s: float = 120.0,
    ) -> None:
        self.out = out
        self.stop_file = out.with_suffix(".stop")
        self.control = subprocess.Popen(
            [sys.executable, __file__, "control", f"--port={control_port}", f"--max-s={max_s}"]
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "monitor",
                f"--port={status_port}",
                f"--control-port={control_port}",
                f"--pid={pid}",
                f"--spool={spool}",
                f"--out={out}",
                f"--stop-file={self.stop_file}",
                f"--interval={interval_s}",
                f"--max-s={max_s}",
            ]
        )
        self.samples: list[dict[str, float | int | bool]] = []

    def wait_started(self, timeout: float = 20.0) -> None:
        """Until the monitor has written a sample with both servers answering."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.out.exists():
                lines = self.out.read_text().splitlines()
                if any(json.loads(x).get("control_ok") for x in lines[:-1]):
                    return
            time.sleep(0.05)
        raise TimeoutError("the /healthz monitor or its control server did not start")

    def stop(self) -> None:
        self.stop_file.touch()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.control.terminate()
        try:
            self.control.wait(10)
        except subprocess.TimeoutExpired:
            self.control.kill()
            self.control.wait(5)
        self.samples = []
        for line in self.out.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by a kill
                self.samples.append(json.loads(line))

    def window(self, start: float, end: float) -> MonitorSummary:
        """Samples taken between two wall-clock times (time.time())."""
        summary = MonitorSummary()
        for sample in self.samples:
            if not start <= sample["t"] <= end:
                continue
            if sample["ok"]:
                summary.healthz_ms.append(float(sample["healthz_ms"]))
            else:
                summary.failures += 1
            if sample["control_ok"]:
                summary.control_ms.append(float(sample["control_ms"]))
            if "rss_kb" in sample:
                summary.rss_kb.append(int(sample["rss_kb"]))
                summary.spool_files.append(int(sample["spool_files"]))
        return summary


def _probe_healthz(port: int, timeout: float) -> tuple[float, bool]:
    """One GET /healthz on a fresh connection, as a liveness probe makes it."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        ok = resp.status == 200 and resp.read() == b"ok"
    except OSError:
        ok = False
    finally:
        conn.close()
    return (time.perf_counter() - start) * 1000, ok


def _monitor_main(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.max_s
    with open(args.out, "w", buffering=1) as out:
        n = 0
        while time.monotonic() < deadline and not args.stop_file.exists():
            tick, started = time.monotonic(), time.time()
            ms, ok = _probe_healthz(args.port, timeout=2.0)
            control_ms, control_ok = _probe_healthz(args.control_port, timeout=2.0)
            sample: dict[str, float | int | bool] = {
                "t": started,
                "healthz_ms": ms,
                "ok": ok,
                "control_ms": control_ms,
                "control_ok": control_ok,
            }
            if n % 10 == 0:
                sample["rss_kb"] = rss_kb(args.pid)
                sample["spool_files"] = sum(1 for _ in args.spool.glob("*.frame"))
            out.write(json.dumps(sample) + "\n")
            n += 1
            time.sleep(max(0.0, args.interval - (time.monotonic() - tick)))
    return 0


def _control_main(args: argparse.Namespace) -> int:
    """The node's own status app, serving nothing but probes, for `max_s` at most."""
    from aiohttp import web

    from node.status import create_status_app
    from node.telemetry import Telemetry

    async def serve() -> None:
        app = create_status_app(
            Telemetry("control"), node_name="control", protocol_name="none", token=None
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        try:
            await asyncio.sleep(args.max_s)
        finally:
            await runner.cleanup()

    asyncio.run(serve())
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="fault-test helpers run as their own process")
    modes = parser.add_subparsers(dest="mode", required=True)
    monitor = modes.add_parser("monitor", help="poll /healthz and sample a node's RSS and spool")
    monitor.add_argument("--port", type=int, required=True)
    monitor.add_argument("--control-port", type=int, required=True)
    monitor.add_argument("--pid", type=int, required=True)
    monitor.add_argument("--spool", type=Path, required=True)
    monitor.add_argument("--out", type=Path, required=True)
    monitor.add_argument("--stop-file", type=Path, required=True)
    monitor.add_argument("--interval", type=float, default=0.025)
    monitor.add_argument("--max-s", type=float, default=120.0)
    control = modes.add_parser("control", help="serve an idle node status app")
    control.add_argument("--port", type=int, required=True)
    control.add_argument("--max-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    return _monitor_main(args) if args.mode == "monitor" else _control_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
