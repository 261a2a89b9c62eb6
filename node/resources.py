"""CPU threads of the nodes on one host: no oversubscription by default.

Several nodes on one machine (a local federation, a benchmark, a small site
running two federations) each start torch with as many intra-op threads as
the machine has cores; together they oversubscribe it, and local training runs
many times slower (60x was measured on a 2-core machine). `p2pfl-node
provision` therefore writes `training.threads` so that sites x threads <=
cores, and every node checks at run time:

- each node registers {pid, name, threads, started} in a small file in a
  per-user directory (`registry_dir()`: $XDG_RUNTIME_DIR/p2pfl-node, else
  <tmp>/p2pfl-node-<uid>), removed when it stops; files of processes that are
  gone (or whose pid now belongs to another process) are ignored and pruned;
- `HostThreads.check()` sums the training threads of the live nodes on the
  host and compares them with the CPUs this process may run on; the node
  checks every few seconds (a peer started later counts too), says so ONCE in
  its log when the sum exceeds the cores (or its own threads alone do), and
  shows the figures on /status under `resources`.

A registry file holds no secret: a pid, a site name and a thread count.
Nodes of other users, or in other containers, are not seen (each container
has its own cores budget to check against).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHECK_EVERY_S = 5.0


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads_per_site(sites_on_host: int, cores: int | None = None) -> int:
    """training.threads for each of `sites_on_host` nodes sharing this machine:
    sites x threads <= cores (at least 1)."""
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, sites_on_host))


def registry_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "p2pfl-node"
    return Path(tempfile.gettempdir()) / f"p2pfl-node-{os.getuid()}"


def _process_started(pid: int) -> float | None:
    """The start time of process `pid` (None when it is gone)."""
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - gone, or not ours to see
        return None


@dataclass
class HostThreads:
    """This node's entry in the host registry, and the check against the cores."""

    name: str
    threads: int
    directory: Path
    cores: int
    warned: bool = False

    @property
    def path(self) -> Path:
        return self.directory / f"{os.getpid()}.json"

    def register(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        entry = {
            "pid": os.getpid(),
            "name": self.name,
            "threads": self.threads,
            "started": _process_started(os.getpid()) or time.time(),
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry))
        tmp.replace(self.path)

    def unregister(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()

    def others(self) -> list[dict[str, Any]]:
        """The other live nodes registered on this host (stale files pruned)."""
        found = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                entry = json.loads(path.read_text())
                pid, threads = int(entry["pid"]), int(entry["threads"])
                started = float(entry["started"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, or not ours: skip
            if pid == os.getpid():
                continue
            actual = _process_started(pid)
            if actual is None or abs(actual - started) > 1.0:  # gone, or the pid was reused
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            found.append({"pid": pid, "name": str(entry.get("name", "?")), "threads": threads})
        return found

    def check(self) -> dict[str, Any]:
        """The /status `resources` block; logs the oversubscription once."""
        others = self.others()
        total = self.threads + sum(o["threads"] for o in others)
        oversubscribed = total > self.cores
        report = {
            "cores": self.cores,
            "threads": self.threads,
            "nodes_on_host": 1 + len(others),
            "threads_on_host": total,
            "other_nodes": [
                f"{o['name']} (pid {o['pid']}, {o['threads']} threads)" for o in others
            ],
            "oversubscribed": oversubscribed,
        }
        if oversubscribed and not self.warned:
            self.warned = True
            log.warning(
                "%s: CPU oversubscribed: %d node(s) on this host train with %d threads in all "
                "on %d cores (this node: %d; others: %s) — local training slows down many "
                "times; set training.threads so that sites x threads <= cores "
                "(`p2pfl-node provision` does), or OMP_NUM_THREADS",
                self.name,
                1 + len(others),
                total,
                self.cores,
                self.threads,
                ", ".join(report["other_nodes"]) or "none",
            )
        return report


def freeze_startup_heap() -> int:
    """Collect once, then move every object still alive into the collector's
    permanent generation (`gc.freeze`), so that a full collection later scans
    only what the process allocated since. A daemon calls it once it serves
    (torch's modules, the roster) and again at its protocol's first training
    phase (node/context.py: the model, the data, the optimizer and the
    torch._dynamo the first optimizer imports exist only then); a relay once
    it serves. A node with torch loaded holds about 350,000
    objects; a full collection over them paused its event loop for 100-350 ms
    on this project's 2-core machine, which every message in flight waited
    for. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
