"""The shard actor of the Ray engine (protocols/memory/ray_engine.py places
it): `Shard` runs its block of nodes on a `ShardNetwork` (ray_shard.py) with
the local simulator, on the actor's event loop. `ray.remote` wraps it at run
time, so this module imports without ray.

Its methods are of two kinds. `setup`, `add_proxies`, `run` and `post` (the
other shards' mail) run on the actor's default event loop, with the nodes.
The progress methods (`records_logged`, `new_records`, `rounds_logged`,
`round_ends`, `mail`, `peak_rss_mb`) only read, and the driver calls them in
the PROGRESS concurrency group: another thread with its own event loop, so
a read does not wait for the nodes' loop (their training, their exchanges).
It still waits in the actor's queue of incoming calls, which Ray works
through before any group: at 10,000 nodes over 2 shards on this 2-core
machine a call waited 2.6 s on average in one shard and 46 s (at most
608 s) in the other (Ray's `CoreWorker.HandlePushTaskActor` queueing
time), so progress lines came minutes apart. The time of each round does
not depend on it: it is the shard's own record (`round_ends`, the wall time
at which each round's last node logged it), read at the end. What these
methods read are a list and a dict that the nodes' loop appends to; each
read is one step under the GIL (a slice, a dict copy).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from p2pfl.config import SiteConfig, config_from_dict
from protocols.memory.ray_mail import WINDOW_S, Item
from protocols.memory.ray_shard import LocalSimulate, ShardNetwork

# The actor's concurrency group for progress reads (its own thread and loop).
PROGRESS = "progress"


class Shard:
    """One shard: its block of nodes, their mail to and from the other
    shards, and what the driver reads of them."""

    def __init__(
        self,
        index: int,
        network: dict[str, Any],
        gossip_s: float,
        window_s: float = WINDOW_S,
        train_workers: int = 1,
        *,
        hide_gpus: bool = True,
    ) -> None:
        if hide_gpus:  # no GPU from Ray: none for torch either (set before CUDA starts)
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        import torch

        torch.set_num_threads(1)  # one core per training worker
        # the nodes' training (ctx.run_blocking, unless inline) runs in a pool
        # of as many workers as the actor has CPUs from Ray (ray_engine.py)
        self.train_workers = train_workers
        self._pool: ThreadPoolExecutor | None = None
        self.base_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.network = ShardNetwork(index, window_s=window_s, **network)
        self.configs: list[SiteConfig] = []
        self.gossip_s = gossip_s
        self._sent: dict[str, tuple[int, str, float]] = {}

    def ping(self) -> int:
        return self.network.index

    def _use_pool(self) -> None:
        """The nodes' loop runs `asyncio.to_thread` work (training) in this
        shard's pool."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.train_workers, thread_name_prefix="train")
            asyncio.get_running_loop().set_default_executor(self._pool)

    async def resources(self) -> dict[str, Any]:
        """The training pool as the nodes' loop uses it, and the GPUs torch
        may see (on the nodes' loop, like `run`)."""
        import threading

        self._use_pool()
        name = await asyncio.to_thread(lambda: threading.current_thread().name)
        return {
            "train_workers": self._pool._max_workers if self._pool is not None else None,
            "to_thread_runs_in": name,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def setup(self, handles: list[Any], configs_json: list[str]) -> dict[str, str]:
        """Join this shard's nodes; name -> public agreement key (hex)."""
        self.network.handles = handles
        self.configs = [config_from_dict(json.loads(c), check_files=False) for c in configs_json]
        return {cfg.node.name: self.network.prejoin(cfg).hex() for cfg in self.configs}

    def add_proxies(self, owners: dict[str, tuple[int, str]]) -> None:
        """Every node of the other shards: name -> (shard, public key hex)."""
        for name, (shard, key) in owners.items():
            if shard != self.network.index:
                self.network.add_proxy(name, shard, bytes.fromhex(key))

    async def run(self, local: LocalSimulate, fail_fast: bool) -> str:
        """Run this shard's nodes to the end; the SimulationResult as JSON."""
        self._use_pool()
        gossip = asyncio.create_task(self._gossip())
        try:
            result = await local(self.configs, network=self.network, fail_fast=fail_fast)
        finally:
            # the pool stays: this shard still answers slower shards' requests
            # (some run in it) until the driver kills the actor, and its
            # threads end with the actor's process
            gossip.cancel()
        self._send_gossip()  # the last rounds' state, for shards still running
        await self.network.drain()
        return json.dumps(result.as_dict())

    async def _gossip(self) -> None:
        while True:
            await asyncio.sleep(self.gossip_s)
            self._send_gossip()

    def _send_gossip(self) -> None:
        infos = self.network.gossip(self._sent)
        if infos:
            size = sum(len(meta) for *_, meta in infos)
            for i in self.network.others():
                self.network.outbox(i).put(("infos", infos), size)

    async def post(self, source: int, items: list[Item]) -> None:
        """A batch of mail from shard `source` (ray_mail.py)."""
        self.network.post(source, items)

    async def kill(self, name: str) -> None:
        """Crash one of this shard's nodes (a test's fault injection; on the
        nodes' loop, which the broadcast's outboxes run on)."""
        self.network.kill(name)

    # ------------------------------------------------ progress (PROGRESS group)

    def records_logged(self) -> int:
        return len(self.network.records)

    def new_records(self, start: int) -> str:
        """Records logged since the `start`th, as JSON (for progress lines)."""
        return json.dumps(self.network.records[start:])

    def rounds_logged(self) -> dict[int, int]:
        """round -> how many of this shard's nodes logged it."""
        return {r: count for r, (count, _) in dict(self.network.round_ends).items()}

    def round_ends(self) -> list[tuple[int, int, float]]:
        """(round, records logged, wall time of the last) for every round."""
        return [(r, count, t) for r, (count, t) in dict(self.network.round_ends).items()]

    def mail(self) -> dict[str, int]:
        """Calls this shard made to the others, and the messages they carried."""
        return self.network.mail_figures()

    def peak_rss_mb(self) -> tuple[float, float]:
        """This actor process's peak resident memory, and what it held before
        its first node (torch imported)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, self.base_rss_mb


__all__ = ["PROGRESS", "Shard"]
