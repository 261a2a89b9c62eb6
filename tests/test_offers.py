"""A request held open on a handler that says NotReady is answered as soon as
the protocol calls `ctx.offered(kind)`, not at its next poll: in memory and
through two real daemons (in-process, HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from node.daemon import Node
from node.provision import provision
from p2pfl.config import load_config
from p2pfl.secure.identity import LocalIdentity, Roster
from protocols.base import NotReady, Offers
from protocols.memory import InMemoryNetwork


async def test_offers_wake_the_watchers_of_one_kind_only() -> None:
    offers = Offers()
    model, grad = offers.watch("model"), offers.watch("grad")
    assert offers.watch("model") is model  # one event per kind until it fires
    offers.offered("model")
    assert model.is_set() and not grad.is_set()
    assert offers.watch("model") is not model  # the next watcher waits for the next offer
    start = time.perf_counter()
    await Offers.wait(grad, 0.05)  # nobody offers: gives up at the timeout
    assert 0.04 <= time.perf_counter() - start < 1.0
    offers.offered("nothing-watched")  # harmless


class _Slow:
    """A handler that is NotReady until `ready`."""

    def __init__(self) -> None:
        self.ready = False

    async def handler(self, requester: str, query: dict[str, Any]) -> Any:
        if not self.ready:
            raise NotReady("not yet")
        return {"value": 7}


async def _latencies(request, offer, poll_s: float, trials: int = 5) -> list[float]:
    """For each trial: make the thing ready (and offer it) while a request is
    held open on it; the seconds from the offer to the answer."""
    out = []
    for _ in range(trials):
        slow = _Slow()
        task = asyncio.create_task(request(slow))
        await asyncio.sleep(poll_s * 1.3)  # the request is waiting now, mid-poll
        slow.ready = True
        offered_at = time.perf_counter()
        offer(slow)
        assert await task == {"value": 7}
        out.append(time.perf_counter() - offered_at)
    return out


async def test_in_memory_request_is_answered_at_the_offer_not_the_poll() -> None:
    net = InMemoryNetwork(poll_interval_s=1.0)  # a poll would take up to a second
    a, b = net.join("a"), net.join("b")

    async def request(slow: _Slow) -> Any:
        b.serve("thing", slow.handler)
        return await a.request("b", "thing", {}, timeout=5.0)

    latencies = await _latencies(request, lambda slow: b.offered("thing"), poll_s=1.0, trials=3)
    assert max(latencies) < 0.1, latencies


@pytest.mark.slow
# judges 30 ms latencies: two of eight answers came 34 and 50 ms late beside
# three busy workers in a full run, so it runs alone in make test's second phase
@pytest.mark.exclusive
async def test_daemon_request_is_answered_at_the_offer_not_the_poll(tmp_path) -> None:
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "probe", "rounds": 1, "payload_kb": 1, "round_timeout_s": 2},
        overrides={"status": {"enabled": False}},
    )
    nodes = []
    for plan in plans:
        cfg = load_config(plan.config_path)
        identity = LocalIdentity.load(cfg.node.name, cfg.signing_key_path, cfg.agreement_key_path)
        nodes.append(Node(cfg, Roster.load(cfg.federation.roster), identity))
    a, b = nodes
    for node in nodes:
        await node.start()
    try:

        async def request(slow: _Slow) -> Any:
            b.ctx.serve("thing", slow.handler)
            return await a.ctx.request("b", "thing", {}, timeout=10.0)

        # The daemon re-asks a NotReady handler every 0.1 s; an offer answers at once.
        latencies = await _latencies(
            request, lambda slow: b.ctx.offered("thing"), poll_s=0.1, trials=8
        )
        # By polling alone, at least 7 of 8 answers within 30 ms of the change:
        # 8 x 0.3^7 x 0.7 + 0.3^8 = 0.13 % (all 5 of 5 was 0.24 %); one answer
        # late by a loaded scheduler (other xdist workers) is allowed.
        assert sorted(latencies)[-2] < 0.03, latencies
    finally:
        for node in nodes:
            await node.stop()
