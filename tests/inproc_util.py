"""Real daemons inside the test process: `InProcessFederation` is a drop-in for
`bench.localfed.LocalFederation` in tests that never kill, signal or restart a
node and do not read its process's log or memory.

Each node is the daemon's own `node.daemon.Node`, with its real transport (HTTP
on 127.0.0.1, spool, journal), its status server and its protocol, started the
way `node.daemon.serve` starts it; only the process around it is shared. That
saves a Python-plus-torch start-up per node (a few CPU seconds each on a loaded
2-core machine). The nodes run on one event loop in a background thread, so the
synchronous test code reads `/status` over HTTP exactly as it does for
processes (`fed["a"].wait_for(...)`, `fed["a"].status()`).

An exit code is what `node.daemon.serve` would return: 1 when the protocol
failed, else 0. What is per process stays per process: the host's thread
registry (node/resources.py) holds one entry for all these nodes, torch's
thread count is the test process's, and the nodes log to the test's logging.
Tests of those use LocalFederation.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from bench.localfed import NodeProcess
from node.daemon import Node
from node.provision import SitePlan
from p2pfl.config import load_config
from p2pfl.secure.identity import LocalIdentity, Roster

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


class InProcessNode(NodeProcess):
    """One node of an InProcessFederation; `get`, `status` and `wait_for` are
    NodeProcess's own (HTTP to the node's status port)."""

    node: Node | None = None
    stopped: bool = False

    @property
    def running(self) -> bool:
        return self.node is not None and not self.stopped

    @property
    def exit_code(self) -> int | None:
        if self.node is None:
            return None
        return 1 if self.node.protocol_failed else 0

    def start(self) -> InProcessNode:  # pragma: no cover - guard
        raise NotImplementedError("an in-process node is started by its InProcessFederation")

    def signal(self, sig: int) -> None:  # pragma: no cover - guard
        raise NotImplementedError("an in-process node cannot be signalled: use LocalFederation")

    def log_tail(self, n: int = 30) -> str:
        return "(in-process node: its log is the test's log)"


class InProcessFederation:
    """`with InProcessFederation(plans) as fed:` starts every node, in order;
    leaving stops them (gracefully, as SIGTERM would)."""

    def __init__(self, plans: list[SitePlan]) -> None:
        self.nodes = {p.name: InProcessNode(p, Path(os.devnull)) for p in plans}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="in-process-federation", daemon=True
        )

    def __getitem__(self, name: str) -> InProcessNode:
        return self.nodes[name]

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> InProcessFederation:
        self._thread.start()
        try:
            self._call(self._start_all(), START_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT_S)
            if not self._thread.is_alive():
                self._loop.close()

    async def _start_all(self) -> None:
        for proc in self.nodes.values():
            cfg = load_config(proc.plan.config_path)
            Path(cfg.node.state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
            identity = LocalIdentity.load(
                cfg.node.name, cfg.signing_key_path, cfg.agreement_key_path
            )
            node = Node(
                cfg,
                Roster.load(cfg.federation.roster),
                identity,
                config_path=proc.plan.config_path,
            )
            await node.start()
            proc.node = node

    async def _stop(self, proc: InProcessNode) -> None:
        if proc.node is not None and not proc.stopped:
            proc.stopped = True
            await proc.node.stop()

    def stop_all(self, grace_s: float = STOP_TIMEOUT_S) -> dict[str, int | None]:
        async def stop_each() -> None:
            for proc in self.nodes.values():
                await self._stop(proc)

        if self._thread.is_alive():
            self._call(stop_each(), grace_s)
        return {name: proc.exit_code for name, proc in self.nodes.items()}

    def wait_all_exit(self, timeout: float) -> dict[str, int | None]:
        """What `exit_when_done` does in a process: each node's protocol ends and
        every peer is done or gone, then the node stops. A node still running
        at the timeout is stopped and reported as None, as LocalFederation does."""

        async def finish(proc: InProcessNode) -> None:
            assert proc.node is not None
            await proc.node.wait_until_finished()
            await self._stop(proc)

        async def finish_all() -> dict[str, bool]:
            tasks = {n: asyncio.create_task(finish(p)) for n, p in self.nodes.items()}
            await asyncio.wait(tasks.values(), timeout=timeout)
            for task in tasks.values():
                task.cancel()  # a node still running at the timeout: stop_all stops it
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            return {n: not t.cancelled() and t.exception() is None for n, t in tasks.items()}

        finished = self._call(finish_all(), timeout + STOP_TIMEOUT_S)
        self.stop_all()
        return {
            name: proc.exit_code if finished[name] else None for name, proc in self.nodes.items()
        }
