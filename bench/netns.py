"""Real Linux network namespaces for the relay tests and bench/network.py (issue 31).

`Netns(["a", "b", "r1"])` makes, for one run:
- a "switch" namespace `p2n-<rand>-switch` holding a bridge `p2b-<rand>`;
- one namespace `p2n-<rand>-<member>` per member, its `eth0` a veth whose other
  end is a port of that bridge, address 10.231.<k>.<i>/24 (k random per run),
  and `lo` up.
Nothing is created in the root namespace: no interface, no address, no route.
So traffic can only go between the namespaces of this run, and no other
process on the machine can reach them (nor they it).

A process runs in a member's namespace under `exec_prefix(name)`
(`ip netns exec NS`). As the root namespace has no leg on the bridge, the
test process reaches a node's status endpoint (bound to its own namespace's
127.0.0.1) by opening the TCP connection from inside that namespace:
`connect(name, host, port)` switches this *thread* into the namespace
(setns(2) on /proc/thread-self/ns/net: the network namespace is per thread),
creates and connects the socket, and switches back. A socket keeps the
namespace it was created in. `status_connect(name)` is that as the
bench/localfed.py `NodeProcess.status_connect` hook.

Links may be shaped with `tc ... tbf` on both ends of every veth (`rate_mbit`).
netem (delay, loss) is absent on this machine's kernel (`tc qdisc add ... netem`
answers "Specified qdisc kind is unknown"): only rate shaping is done.

Every namespace made is deleted in `__exit__`, and by an atexit hook if the
process ends another way; the processes still inside (started by the caller)
are killed by pid first, so the namespace really goes. A run killed with
SIGKILL leaves a marker (/run/p2pfl-netns/<rand>, its pid) that the next run's
`sweep_stale()` uses to delete namespaces whose owner is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bench.forkstart import enter_net_namespace
from bench.localfed import NodeProcess, RelayProcess
from node.provision import RelayPlan, SitePlan

NS_PREFIX = "p2n-"
MARKERS = Path("/run/p2pfl-netns")
SUBNET = "10.231"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


_AVAILABLE: tuple[bool, str] | None = None


def netns_available() -> tuple[bool, str]:
    """(True, "") where this process can make namespaces, a bridge and veths;
    else (False, what is missing), said in one line."""
    global _AVAILABLE
    if _AVAILABLE is not None:
        return _AVAILABLE
    if os.geteuid() != 0:
        _AVAILABLE = (False, "not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    elif shutil.which("ip") is None:
        _AVAILABLE = (False, "no `ip` command (iproute2)")
    elif not Path("/proc/thread-self/ns/net").exists():
        _AVAILABLE = (False, "no /proc/thread-self/ns/net (setns per thread)")
    else:
        try:
            with Netns(["probe"]):
                pass
            _AVAILABLE = (True, "")
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            _AVAILABLE = (False, f"cannot make a namespace with a bridge and a veth: {exc}")
    return _AVAILABLE


def skip_unless_netns() -> None:
    """pytest.skip with ONE loud line naming what is missing."""
    import pytest

    ok, why = netns_available()
    if not ok:
        pytest.skip(f"NETWORK NAMESPACE TESTS SKIPPED: {why}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose owner process is gone (a run
    ended by SIGKILL cannot clean up); the names deleted."""
    if not MARKERS.is_dir():
        return []
    deleted: list[str] = []
    listed = _ip("netns", "list", check=False).stdout.split()
    for marker in MARKERS.iterdir():
        try:
            pid = int(marker.read_text().strip())
        except (OSError, ValueError):
            continue
        if _pid_alive(pid):
            continue
        for ns in [n for n in listed if n.startswith(f"{NS_PREFIX}{marker.name}-")]:
            _kill_inside(ns)
            _ip("netns", "delete", ns, check=False)
            deleted.append(ns)
        marker.unlink(missing_ok=True)
    return deleted


def _kill_inside(ns: str) -> None:
    """SIGKILL the processes still in a namespace this run made (its own children)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


class Netns:
    """Namespaces on one private bridge: see the module docstring."""

    def __init__(self, members: Sequence[str], *, rate_mbit: float | None = None) -> None:
        if len(members) > 250 or len(set(members)) != len(members):
            raise ValueError("give at most 250 distinct member names")
        self.members = list(members)
        self.rate_mbit = rate_mbit
        self.tag = secrets.token_hex(2)
        self.subnet = f"{SUBNET}.{secrets.randbelow(256)}"
        self.bridge = f"p2b-{self.tag}"
        self.switch = f"{NS_PREFIX}{self.tag}-switch"
        self.names = {m: f"{NS_PREFIX}{self.tag}-{m}" for m in self.members}
        self.addresses = {m: f"{self.subnet}.{i + 1}" for i, m in enumerate(self.members)}
        self._made: list[str] = []
        self._root_ns = "/proc/thread-self/ns/net"

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Netns:
        atexit.register(self.cleanup)
        try:
            sweep_stale()
            MARKERS.mkdir(parents=True, exist_ok=True)
            (MARKERS / self.tag).write_text(str(os.getpid()))
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", self.bridge, "up")
            for i, member in enumerate(self.members):
                self._add_member(i, member)
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _add_member(self, i: int, member: str) -> None:
        ns, port = self.names[member], f"v{i}"
        self._add_ns(ns)
        # Made inside the switch namespace with its peer straight in the member's:
        # the root namespace never holds either end.
        _ip(
            "-n",
            self.switch,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        )
        _ip("-n", self.switch, "link", "set", port, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{self.addresses[member]}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        if self.rate_mbit:
            for where, dev in ((ns, "eth0"), (self.switch, port)):  # both directions
                self._shape(where, dev)

    def _shape(self, ns: str, dev: str) -> None:
        # tbf: the kernel here has no netem, so a link gets a rate, not a delay
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", f"{self.rate_mbit}mbit", "burst", "32kbit", "latency", "50ms"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"tc tbf on {ns}/{dev}: {proc.stderr.strip()}")

    def cleanup(self) -> None:
        """Delete every namespace this run made (the members' first: their
        processes are killed by pid, then the veths and the bridge go with them)."""
        for ns in reversed(self._made):
            _kill_inside(ns)
        deadline = time.monotonic() + 10
        while any(_ip("netns", "pids", ns, check=False).stdout.split() for ns in self._made):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for ns in reversed(self._made):
            _ip("netns", "delete", ns, check=False)
        self._made.clear()
        (MARKERS / self.tag).unlink(missing_ok=True)
        atexit.unregister(self.cleanup)

    def created(self) -> list[str]:
        """The namespaces of this run that `ip netns list` still shows."""
        listed = _ip("netns", "list", check=False).stdout.split()
        return [n for n in listed if n.startswith(f"{NS_PREFIX}{self.tag}-")]

    # ------------------------------------------------------------------ use

    def address(self, member: str) -> str:
        return self.addresses[member]

    def exec_prefix(self, member: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[member]]

    def path(self, member: str) -> str:
        """`member`'s namespace as a file (what `ip netns exec` and setns(2) open)."""
        return f"/run/netns/{self.names[member]}"

    @contextlib.contextmanager
    def inside(self, member: str) -> Iterator[None]:
        """This thread in `member`'s namespace for the block (sockets made in it stay there)."""
        own = os.open(self._root_ns, os.O_RDONLY)
        try:
            target = os.open(self.path(member), os.O_RDONLY)
            try:
                enter_net_namespace(target)
                try:
                    yield
                finally:
                    enter_net_namespace(own)  # raises rather than leave the thread elsewhere
            finally:
                os.close(target)
        finally:
            os.close(own)

    def connect(self, member: str, host: str, port: int, timeout: float = 2.0) -> socket.socket:
        """A TCP connection made from inside `member`'s namespace."""
        with self.inside(member):
            return socket.create_connection((host, port), timeout=timeout)

    def can_connect(self, member: str, host: str, port: int, timeout: float = 2.0) -> bool:
        try:
            self.connect(member, host, port, timeout).close()
        except OSError:
            return False
        return True

    def status_connect(self, member: str) -> Callable[[int, float], socket.socket]:
        """bench/localfed.py NodeProcess.status_connect: its 127.0.0.1 in `member`'s namespace."""
        return lambda port, timeout: self.connect(member, "127.0.0.1", port, timeout)


def processes(
    net: Netns,
    plans: Sequence[SitePlan],
    log_dir: Path,
    env: dict[str, str] | None = None,
    node_env: dict[str, dict[str, str]] | None = None,
) -> dict[str, NodeProcess]:
    """One process per plan (a RelayPlan runs a relay), each in its own
    namespace, its status endpoint reached from inside it; not started yet."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, NodeProcess] = {}
    for plan in plans:
        cls = RelayProcess if isinstance(plan, RelayPlan) else NodeProcess
        out[plan.name] = cls(
            plan,
            log_dir / f"{plan.name}.log",
            {**(env or {}), **(node_env or {}).get(plan.name, {})},
            prefix=net.exec_prefix(plan.name),
            netns=net.path(plan.name),
            status_connect=net.status_connect(plan.name),
        )
    return out
