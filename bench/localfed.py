"""Run a federation of real node processes on this machine (loopback only).

Used by `make demo`, the benchmarks and the tests: provision the sites with
node/provision.py, start each node as its own `p2pfl-node` process, watch them
through their status endpoints, stop them (SIGTERM, then SIGKILL after a grace
period). Every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.forkstart import ForkedProcess, fork_requested
from node.provision import SitePlan

# Opens a TCP connection to (loopback port, timeout) where the process listens:
# bench/netns.py gives one that connects inside the process's namespace.
StatusConnect = Callable[[int, float], socket.socket]


@dataclass
class NodeProcess:
    plan: SitePlan
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | ForkedProcess | None = None
    # run the command under this prefix (`ip netns exec NS`: bench/netns.py)
    prefix: list[str] = field(default_factory=list)
    # with the fork launch, the namespace that prefix enters (/run/netns/NS):
    # the forked child enters it itself
    netns: str | None = None
    status_connect: StatusConnect | None = None  # None: this machine's 127.0.0.1
    niceness: int = 0  # the process's nice value (bench.federation.processes.cpu_niceness)

    @property
    def name(self) -> str:
        return self.plan.name

    def command(self) -> list[str]:
        return [
            *self.prefix,
            sys.executable,
            "-m",
            "node.cli",
            "--config",
            str(self.plan.config_path),
        ]

    def start(self) -> NodeProcess:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        command = self.command()
        bare = command[len(self.prefix) :]
        if (
            fork_requested()
            and (not self.prefix or self.netns is not None)
            and bare[1:3] == ["-m", "node.cli"]
        ):
            # the same `node.cli` run, forked from a server that imported it once
            self.proc = ForkedProcess(bare[3:], env, self.log_path, self.netns, self.niceness)
            return self
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        niceness = self.niceness
        self.proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=(lambda: os.nice(niceness)) if niceness > 0 else None,  # noqa: PLW1509
        )
        log.close()
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def stop(self, grace_s: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def get(self, path: str, timeout: float = 2.0) -> Any:
        """GET a status route; JSON decoded when it is JSON. Raises OSError when down."""
        url = f"http://127.0.0.1:{self.plan.status_port}{path}"
        token = self.plan.status_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if self.status_connect is not None:
            return self._get_over(self.status_connect, path, headers, timeout)
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 - loopback status endpoint
            body = resp.read()
            if resp.headers.get_content_type() == "application/json":
                return json.loads(body)
            return body.decode()

    def _get_over(
        self, connect: StatusConnect, path: str, headers: dict[str, str], timeout: float
    ) -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", self.plan.status_port, timeout=timeout)
        conn.sock = connect(self.plan.status_port, timeout)
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise OSError(f"GET {path}: HTTP {resp.status}")
            if resp.getheader("Content-Type", "").startswith("application/json"):
                return json.loads(body)
            return body.decode()
        except http.client.HTTPException as exc:
            raise OSError(f"GET {path}: {exc}") from exc
        finally:
            conn.close()

    def status(self) -> dict[str, Any] | None:
        try:
            return self.get("/status")
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str = "condition"
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            last = self.status()
            if last is not None and predicate(last):
                return last
            if not self.running:
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode if self.proc else '?'}) while waiting for {what}; log: {self.log_tail()}"
                )
            time.sleep(0.2)
        raise TimeoutError(
            f"{self.name}: {what} not reached in {timeout:.0f} s; last status: {json.dumps(last)[:600]}"
        )

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class RelayProcess(NodeProcess):
    """A relay (`p2pfl-node relay --config RELAY/relay.yaml`, node/relay.py),
    started, watched and stopped as a node is; its plan is a RelayPlan."""

    def command(self) -> list[str]:
        return [
            *self.prefix,
            sys.executable,
            "-m",
            "node.cli",
            "relay",
            "--config",
            str(self.plan.config_path),
        ]


class LocalFederation:
    """Context manager: start every node, always stop them all."""

    def __init__(
        self,
        plans: list[SitePlan],
        log_dir: Path,
        env: dict[str, str] | None = None,
        node_env: dict[str, dict[str, str]] | None = None,
        niceness: dict[str, int] | None = None,
    ) -> None:
        """`env`: for every node; `node_env`: per node name, on top (a fault
        plan); `niceness`: per node name, its nice value (0 by default)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        self.nodes = {
            p.name: NodeProcess(
                p,
                log_dir / f"{p.name}.log",
                {**(env or {}), **(node_env or {}).get(p.name, {})},
                niceness=(niceness or {}).get(p.name, 0),
            )
            for p in plans
        }

    def __enter__(self) -> LocalFederation:
        for node in self.nodes.values():
            node.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def stop_all(self, grace_s: float = 15.0) -> dict[str, int | None]:
        for node in self.nodes.values():
            node.signal(signal.SIGTERM)
        return {name: node.stop(grace_s) for name, node in self.nodes.items()}

    def __getitem__(self, name: str) -> NodeProcess:
        return self.nodes[name]

    def wait_all_exit(self, timeout: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        return {
            name: node.wait(max(0.1, deadline - time.monotonic()))
            for name, node in self.nodes.items()
        }
