"""Pulling from several neighbours at once, with replacements for the ones that fail."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def pull_concurrently(
    ranking: list[str],
    k: int,
    timeout: float,
    fetch: Callable[[str, float], Awaitable[T | None]],
) -> list[T]:
    """Ask the first k of `ranking` at once, each with `timeout`; each failure
    (fetch returns None) is replaced by the next candidate. No request is
    started or runs past 2 x timeout from the start, so one failed wave can be
    replaced but a dead federation costs a bounded wait. Returns the successful
    results in the order they arrived."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2 * timeout
    queue = list(ranking)
    pending: dict[asyncio.Task[T | None], str] = {}
    results: list[T] = []

    def launch() -> None:
        while queue and len(pending) + len(results) < k:
            remaining = min(timeout, deadline - loop.time())
            if remaining <= 0:
                return
            peer = queue.pop(0)
            pending[asyncio.create_task(fetch(peer, remaining))] = peer

    launch()
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.pop(task)
                result = task.result()
                if result is not None:
                    results.append(result)
            launch()
    finally:
        for task in pending:
            task.cancel()
    return results
