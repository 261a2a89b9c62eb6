"""An emulated uplink: a token bucket on the bytes this node sends
(`transport.link_mbit`).

Hospitals are linked by tens of Mbit/s, not loopback (issue 32). The real way
to give a site such a link is the kernel's: a network namespace per site with
`tc qdisc ... tbf rate 20mbit` on its interface, which would come with the
relay work; real `p2pfl-node` processes on one machine do not have that yet.
This module is the emulation used until then: every payload byte the node
writes out, requests it posts (node/transport_client.py) and replies it
serves (node/transport.py), first takes tokens from ONE bucket per node, as
one uplink carries both. What it leaves out, compared with tc: TCP/IP and TLS
framing bytes are not counted, the few bytes of a JSON acknowledgement or
refusal are not shaped, the receiving side (downlink) is not shaped, and
there is no propagation delay.

The bucket refills at `rate` bytes/s up to `burst` bytes. A writer takes its
slice's bytes even when that drives the bucket negative, then sleeps until
the debt is paid, holding a lock: writers are served first come, first
served, slice by slice, so concurrent transfers share the link fairly, and a
late wake-up (a loaded machine) leaves credit for the next slice (up to
`burst`) instead of lowering the long-run rate.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any

# Bytes written per token take: small enough that concurrent transfers
# interleave finely (32 KiB is 13 ms at 20 Mbit/s), big enough to cost little.
SLICE_BYTES = 32 * 1024
# What the bucket may hold: a short burst, as tc tbf's `burst`.
MIN_BURST_BYTES = 64 * 1024
BURST_SECONDS = 0.05


class Uplink:
    """A token bucket of `mbit` Mbit/s (10**6 bit/s) on outgoing bytes."""

    def __init__(self, mbit: float, burst_bytes: int | None = None) -> None:
        if not mbit > 0:
            raise ValueError(f"link rate must be > 0 Mbit/s, got {mbit}")
        self.mbit = mbit
        self.rate = mbit * 1e6 / 8  # bytes per second
        self.burst = float(
            burst_bytes
            if burst_bytes is not None
            else max(MIN_BURST_BYTES, self.rate * BURST_SECONDS)
        )
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.bytes_sent = 0  # through this link, since it was made
        self.waited_s = 0.0  # spent waiting for tokens, all writers together
        self._lock: asyncio.Lock | None = None

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    async def take(self, nbytes: int) -> None:
        """Wait until `nbytes` may go out at the link's rate."""
        if nbytes <= 0:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            self._refill()
            self.tokens -= nbytes
            self.bytes_sent += nbytes
            if self.tokens < 0:
                wait = -self.tokens / self.rate
                self.waited_s += wait
                await asyncio.sleep(wait)

    async def slices(self, chunks: Iterable[bytes | memoryview]) -> AsyncIterator[memoryview]:
        """The chunks as slices of at most SLICE_BYTES, each let through at the rate."""
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            for start in range(0, len(view), SLICE_BYTES):
                piece = view[start : start + SLICE_BYTES]
                await self.take(len(piece))
                yield piece


# One uplink per node: the client and the server of a node are both built from
# the node's `transport:` section (the same object), so it keys the link.
_links: dict[int, tuple[weakref.ref[Any], Uplink]] = {}


def uplink_for(transport: Any) -> Uplink | None:
    """The node's uplink for its `transport:` section (None: `link_mbit` unset,
    unshaped). The same section object always gives the same Uplink, so a
    node's requests and replies share one bucket."""
    mbit = getattr(transport, "link_mbit", None)
    if mbit is None:
        return None
    key = id(transport)
    held = _links.get(key)
    if held is not None and held[0]() is transport and held[1].mbit == mbit:
        return held[1]
    link = Uplink(mbit)
    _links[key] = (weakref.ref(transport, lambda _ref, k=key: _links.pop(k, None)), link)
    return link
