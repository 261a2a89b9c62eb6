"""The relay_flood scenario's machinery (bench/attacks/relay.py judges it): h's
relayed heartbeats timed one after the other, before, during and after a
flood that another process (`bench/relay_flooder.py`) sends m's frames with,
so the flooder's CPU is not this process's."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from node.relay_wire import RELAY_MESSAGE_PATH
from node.resources import freeze_startup_heap

FLOOD_FRAMES = 4000
FLOOD_S = 8.0
FLOOD_CONNECTIONS = 16
BASELINE_SAMPLES = 60  # before the flood, and as many after it
GAP_S = 0.025  # between two measured heartbeats


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


def p50(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


async def _beats(
    session: aiohttp.ClientSession,
    url: str,
    frames: list[bytes],
    until: Callable[[], bool],
    starts: list[float] | None = None,
) -> tuple[list[float], list[int]]:
    """Heartbeats through the relay one after the other (GAP_S apart) until
    `until()` or the frames run out: (latencies of the 200s, other statuses);
    `starts`, if given, gets each 200's start time (perf_counter)."""
    times: list[float] = []
    failed: list[int] = []
    while frames and not until():
        frame = frames.pop()
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=frame) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        if status == 200:
            times.append(time.perf_counter() - t0)
            if starts is not None:
                starts.append(t0)
        else:
            failed.append(status)
        await asyncio.sleep(GAP_S)
    return times, failed


async def flood_run(port: int, flood_path: Path, beats: list[bytes]) -> dict[str, Any]:
    # h stands for a site's daemon, which freezes its start-up heap once it
    # serves: so does this process, or a full collection over torch's objects
    # (120-170 ms here) lands in h's timings as a pause no daemon has
    freeze_startup_heap()
    try:
        return await _flood_run(port, flood_path, beats)
    finally:  # this process goes on (other scenarios, a test worker)
        gc.unfreeze()


async def _flood_run(port: int, flood_path: Path, beats: list[bytes]) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}{RELAY_MESSAGE_PATH}"
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        count = [0]

        def enough() -> bool:
            count[0] += 1
            return count[0] > BASELINE_SAMPLES

        before, failed_before = await _beats(session, url, beats, enough)
        flooder = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.relay_flooder",
            str(port), str(flood_path), str(FLOOD_CONNECTIONS), str(FLOOD_S),
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert flooder.stdout is not None
        line = await asyncio.wait_for(flooder.stdout.readline(), 60)
        if line.strip() != b"flooding":
            raise RuntimeError(f"the flooder did not start: {line!r}")
        done = asyncio.create_task(flooder.communicate())
        flood_began, starts = time.perf_counter(), []
        loaded, failed_loaded = await _beats(session, url, beats, done.done, starts)
        out, _ = await asyncio.wait_for(done, 60)
        count[0] = 0
        after, failed_after = await _beats(session, url, beats, enough)
    flood = json.loads(out.decode().strip().splitlines()[-1])
    # where in the flood the slow heartbeats were: the slowest of each second
    by_second: dict[int, float] = {}
    for t0, latency in zip(starts, loaded, strict=True):
        second = int(t0 - flood_began)
        by_second[second] = max(by_second.get(second, 0.0), latency)
    slowest = [round(by_second.get(i, 0.0) * 1e3, 1) for i in range(max(by_second, default=-1) + 1)]
    return {"unloaded": before + after, "loaded": loaded, "flood": flood,
            "failed": {"unloaded": failed_before + failed_after, "loaded": failed_loaded},
            "loaded_slowest_ms_per_s": slowest}  # fmt: skip
