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

The folder's name in <tmp> is one any local account can create first. A
node therefore makes it 0700 and uses it only if it is a folder (not a link)
of its own user that no one else may write; otherwise it says so once and
runs without the registry (its own threads only on /status). Its entry is
written through a temporary file created O_EXCL under a name no one can
guess (p2pfl/files.py): a link planted at a name is never written through to
the file it names (STATE/status.token).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pfl.files import atomic_write_bytes

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


def private_dir_problem(path: Path) -> str | None:
    """Make `path` (0700) unless it exists, then what makes it unfit to hold
    this process's files: None for a folder of this user's that no one else
    may write; else why (a link, not a folder, another owner, writable by
    others), since whoever controls it controls what is written there."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(parents=True, mode=0o700)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != os.getuid():
        return f"it belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
    if info.st_mode & 0o022:
        return f"it has mode {stat.S_IMODE(info.st_mode):o}: others may write it"
    return None


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
    usable: bool = True  # False: the folder is not this user's alone; not used

    @property
    def path(self) -> Path:
        return self.directory / f"{os.getpid()}.json"

    def register(self) -> bool:
        """Write this node's entry; False (said once in the log) when the folder
        is not fit for it (`private_dir_problem`): the node runs without it."""
        problem = private_dir_problem(self.directory)
        if problem is not None:
            self.usable = False
            log.warning(
                "%s: not using the thread registry %s: %s — other nodes on this host are "
                "not counted; remove it, or set XDG_RUNTIME_DIR to a folder of this user's",
                self.name,
                self.directory,
                problem,
            )
            return False
        entry = {
            "pid": os.getpid(),
            "name": self.name,
            "threads": self.threads,
            "started": _process_started(os.getpid()) or time.time(),
        }
        atomic_write_bytes(self.path, json.dumps(entry).encode(), mode=0o600)
        return True

    def unregister(self) -> None:
        if self.usable:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def others(self) -> list[dict[str, Any]]:
        """The other live nodes registered on this host (stale files pruned);
        none when the folder is not this user's alone."""
        if not self.usable:
            return []
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
