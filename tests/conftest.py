"""Shared fixtures: identities, rosters and codecs for a small federation."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import socket
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# nodes start forked from a server that imported torch once (bench/forkstart.py);
# P2PFL_NODE_LAUNCH=exec runs the suite with a fresh interpreter per node instead
os.environ.setdefault("P2PFL_NODE_LAUNCH", "fork")

from browser_util import SKIP_ENV, chromium_binary, missing_browser_message  # noqa: E402

import node.provision  # noqa: E402
from p2pfl.secure.identity import LocalIdentity, Roster  # noqa: E402
from p2pfl.secure.wire import WireCodec  # noqa: E402

BROWSER_SKIPPED = pytest.StashKey[int]()

# ------------------------------------------------------------ ports under xdist
# `free_ports` asks the kernel for ephemeral ports and closes them; the node
# process binds them a few seconds later. In one process that is safe, but with
# xdist workers another worker's `free_ports` (or any outgoing connection) can
# be handed the same just-closed port in that window, and one node then fails
# to bind. So each worker hands out ports from its own block below Linux's
# ephemeral range (32768+), which neither the kernel nor another worker uses;
# the block starts at a random offset so that two test sessions on one machine
# rarely walk the same ports, and a port is skipped if anything holds it.
WORKER_BLOCK = 1000
FIRST_BLOCK_PORT = 20000
MAX_WORKERS = 12  # 20000 + 12 * 1000 stays below 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _worker_ports() -> itertools.cycle[int] | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    if not worker.startswith("gw"):
        return None
    index = int(worker[2:]) % MAX_WORKERS
    block = list(range(WORKER_BLOCK))
    offset = random.SystemRandom().randrange(WORKER_BLOCK)
    first = FIRST_BLOCK_PORT + index * WORKER_BLOCK
    return itertools.cycle([first + (offset + i) % WORKER_BLOCK for i in block])


_PORTS = _worker_ports()


def _free_ports_of_this_worker(n: int) -> list[int]:
    """n distinct loopback ports from this worker's block, each free right now."""
    assert _PORTS is not None
    out: list[int] = []
    if n <= 0:
        return out
    for _ in range(WORKER_BLOCK):
        port = next(_PORTS)
        if port not in out and _bindable(port):
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError(f"fewer than {n} free ports left in this worker's block")


if _PORTS is not None:
    # provision() looks free_ports up at call time; tests that import the name
    # are imported after this file, so they get this version too.
    node.provision.free_ports = _free_ports_of_this_worker  # type: ignore[assignment]


# ------------------------------------------------------ timing-sensitive tests
# Tests that judge wall-clock times, latencies or liveness under load, or drill
# faults against short heartbeat and round timeouts. Under `--dist loadgroup`
# they all go to one xdist group, "timing": one worker runs them one after the
# other, so none of them is loaded by another of them (the other workers' tests
# still run beside them, as other users' jobs would). They are collected first
# so that the group, the longest single queue, starts at once. Entries are node
# ids or their prefixes (a file, or a file::test); docs/testing.md says why each.
# Timing-sensitive tests run one at a time within their group; three groups,
# so that their sum (the fault drills alone take minutes) is not one worker's
# critical path. The fault drills, the load tests and the rest.
TIMING_GROUPS = {
    "tests/test_faults.py": "timing_drills",
    "tests/test_exactly_once.py": "timing_drills",
    "tests/test_secagg_nodes.py": "timing_drills",
    "tests/test_flood.py": "timing_load",
    "tests/test_soak.py": "timing_load",
    "tests/test_fuzz_http.py": "timing_load",
    "tests/test_offers.py": "timing_load",
    "tests/test_transport_limits.py": "timing_load",
    "tests/test_upload_fairness.py": "timing_load",
}
TIMING_SENSITIVE = (
    "tests/test_flood.py",  # 1000 msg/s flood: rate, /healthz p99, RSS bounds
    "tests/test_soak.py::test_four_nodes_keep_descriptors_and_memory_flat",  # RSS/fd slopes
    "tests/test_faults.py",  # SIGKILL/partition/slow-peer drills, 1.5 s suspect, 3 s rounds
    "tests/test_exactly_once.py",  # a kill at a chosen instant
    "tests/test_replay_restart.py::test_messages_accepted_before_a_restart",  # time bound after a kill
    "tests/test_replay_restart.py::test_a_push_right_after_the_receiver_restarts",
    "tests/test_failed_peers.py::test_in_memory_a_node_failed_at_start",  # wall < 30 s
    "tests/test_failed_peers.py::test_real_nodes",  # round_s bound, a kill
    "tests/test_secagg_nodes.py",  # a contributor killed mid-round
    "tests/test_offers.py",  # answer latency < 30 ms
    "tests/test_hostile_wire.py::test_a_running_node_stays_live",  # /healthz p99, RSS
    "tests/test_hostile_wire.py::test_an_oversized_response",  # cut within 1 s
    "tests/test_transport_limits.py",  # cut within 5 s
    "tests/test_upload_fairness.py",  # cut within 5 s, fairness under a stall
    "tests/test_fuzz_http.py",  # liveness of one node under 10,000 requests
    "tests/test_fedavgp2p.py::test_a_silent_neighbour",  # replaced after a 0.x s timeout
    "tests/test_fedsgdp2p.py::test_a_silent_neighbour",  # its cost < steps x 0.1 s
    "tests/test_bench_federation.py::test_a_failed_node_ends_the_benchmark",  # < 120 s
    "tests/test_bench_smoke.py::test_failed_site_benchmark",  # round-time ratio
)


def _timing_sensitive_id(nodeid: str) -> bool:
    """A file entry takes the whole file; a file::name entry every test whose
    name starts so (its parameters too)."""
    return any(
        nodeid.startswith(entry if "::" in entry else entry + "::") for entry in TIMING_SENSITIVE
    )


def _timing_sensitive(item: pytest.Item) -> bool:
    return _timing_sensitive_id(item.nodeid)


def _group_timing_tests(items: list[pytest.Item]) -> None:
    timing = [item for item in items if _timing_sensitive(item)]
    for item in timing:
        group = TIMING_GROUPS.get(item.nodeid.split("::")[0], "timing_bounds")
        item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a serial run keeps the files' order
        chosen = {id(item) for item in timing}
        items[:] = timing + [item for item in items if id(item) not in chosen]


# `make test`'s second phase collects only the files that spell this (Makefile
# EXCLUSIVE_FILES): an exclusive test marked any other way would run in neither phase.
EXCLUSIVE_SPELLING = "pytest.mark.exclusive"


def _check_exclusive_files(items: list[pytest.Item]) -> None:
    files = {item.path for item in items if item.get_closest_marker("exclusive")}
    unseen = sorted(
        str(path) for path in files if EXCLUSIVE_SPELLING not in path.read_text(errors="replace")
    )
    if unseen:
        pytest.exit(
            f"{', '.join(unseen)}: marks tests exclusive without spelling "
            f"`{EXCLUSIVE_SPELLING}`, which make test's second phase selects files by: "
            "they would run in neither phase",
            returncode=3,
        )


@pytest.hookimpl(tryfirst=True)  # before xdist's, which turns the marks into groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Timing-sensitive tests go to one xdist group, collected first (above);
    every exclusive test's file spells its mark (`_check_exclusive_files`).
    Without Chromium (or with P2PFL_SKIP_BROWSER=1) the `browser` tests are
    skipped, and the run ends with one line that says so and how to fix it."""
    _group_timing_tests(items)
    _check_exclusive_files(items)
    browser = [item for item in items if item.get_closest_marker("browser")]
    if not browser:
        return
    if os.environ.get(SKIP_ENV) == "1":
        reason = f"{SKIP_ENV}=1"
    elif chromium_binary() is None:
        reason = missing_browser_message()
    else:
        return
    for item in browser:
        item.add_marker(pytest.mark.skip(reason=reason))
    config.stash[BROWSER_SKIPPED] = len(browser)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """On the xdist controller, as each worker reports its collection: under
    `--dist loadgroup` every timing-sensitive test must carry its group in its
    node id (pytest-xdist sends a group to one worker by that suffix). pytest
    9.2's node ids made xdist 3.8 drop it silently (pytest-xdist#1386), and a
    group mark added after xdist's own hook is dropped too: timing-sensitive
    tests then ran side by side and every worker rebuilt the shared fixtures.
    Stop at once, saying why, rather than run so."""
    if getattr(node.config.option, "dist", None) != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if "@" not in nodeid and _timing_sensitive_id(nodeid)]
    if lost:
        pytest.exit(
            f"--dist loadgroup is not grouping ({len(lost)} timing-sensitive tests without "
            f"their group, e.g. {lost[0]}): either this pytest and pytest-xdist do not work "
            "together (pytest-xdist#1386: install the versions pyproject.toml's dev extra "
            "pins) or a group mark was added after xdist's collection hook",
            returncode=3,
        )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    skipped = config.stash.get(BROWSER_SKIPPED, 0)
    if skipped:
        reason = f"{SKIP_ENV}=1" if os.environ.get(SKIP_ENV) == "1" else missing_browser_message()
        terminalreporter.write_line(
            f"BROWSER TESTS SKIPPED ({skipped}): {reason}", red=True, bold=True
        )


@pytest.fixture(scope="session")
def identities() -> dict[str, LocalIdentity]:
    return {name: LocalIdentity.generate(name) for name in ("alice", "bob", "carol")}


@pytest.fixture(scope="session")
def roster(identities: dict[str, LocalIdentity]) -> Roster:
    return Roster(
        [ident.card(f"127.0.0.1:{7000 + i}") for i, ident in enumerate(identities.values())]
    )


@pytest.fixture
def codecs(identities: dict[str, LocalIdentity], roster: Roster) -> dict[str, WireCodec]:
    return {name: WireCodec(ident, roster, "fed-test") for name, ident in identities.items()}


# ---------------------------------------------------------------------- CPU per test
# P2PFL_TEST_CPU_LOG=FILE: each test's CPU seconds appended as JSON lines. Wall
# time depends on the load; CPU time is what a 2-core run cannot escape
# (docs/testing.md). Where a cgroup v1 `cpuacct` hierarchy is writable (root),
# each pytest process moves itself into a cgroup of its own at start, so the
# figure counts everything it started since: forked node processes (whose parent
# is the fork server), subprocesses and Ray's workers. Elsewhere it counts this
# process and the children it reaped.
CPU_LOG = os.environ.get("P2PFL_TEST_CPU_LOG")
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_cgroup: list[Path] = []


def _join_cpu_cgroup() -> None:
    """Move this process into a fresh cpuacct cgroup (best effort), removing
    the empty ones that ended runs left (rmdir refuses a group still in use)."""
    for stale in CPUACCT.glob("p2pfl-test-*"):
        if not Path(f"/proc/{stale.name.rsplit('-', 1)[-1]}").exists():  # its pytest ended
            with contextlib.suppress(OSError):
                stale.rmdir()
    group = CPUACCT / f"p2pfl-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return
    _cgroup.append(group)


def _leave_cpu_cgroup() -> None:
    for group in _cgroup:
        with contextlib.suppress(OSError):
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()  # refused while a process it started still runs


def _cpu_seconds() -> float:
    if _cgroup:
        return int((_cgroup[0] / "cpuacct.usage").read_text()) / 1e9
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_sessionstart(session: pytest.Session) -> None:
    if CPU_LOG:
        _join_cpu_cgroup()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _leave_cpu_cgroup()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if not CPU_LOG:
        yield
        return
    import json
    import time

    cpu0, wall0 = _cpu_seconds(), time.monotonic()
    yield
    record = {
        "test": item.nodeid,
        "cpu_s": round(_cpu_seconds() - cpu0, 2),
        "wall_s": round(time.monotonic() - wall0, 2),
    }
    with open(CPU_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")
