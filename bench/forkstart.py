"""Start node processes by forking a server that has already imported them.

Every `p2pfl-node` process spends about 3 CPU-seconds importing torch and the
daemon before it reads its config (`python -X importtime -m node.cli`): most of
a short test's cost, paid again for every node, restart and benchmark arm. With
`P2PFL_NODE_LAUNCH=fork` (the test suite sets it), `bench.localfed` starts nodes
from multiprocessing's fork server instead, which imports those modules once and
forks a child per node. The child is a real process of its own: its own pid,
session, log file, environment, sockets and state directory; it runs
`node.cli.main` exactly as `python -m node.cli` would, answers signals and
SIGKILL the same way, and exits with the same code.

Relays (`node.cli relay`) fork the same way, and so do processes in a network
namespace of bench/netns.py: the child enters the namespace (setns(2)) before
it opens a socket, where `ip netns exec` would have exec'd a fresh interpreter.
What stays on `exec`: the start-up benchmark (which measures the very import
this skips), and the tests of the command line itself.

The server process must not have run a torch operation (its OpenMP pool would
not survive the fork); it only imports. libgomp reads `OMP_NUM_THREADS` when it
loads, in the server, so each child sets torch's thread count from its own
environment, as its own import would have.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

LAUNCH_ENV = "P2PFL_NODE_LAUNCH"  # "fork": fork from the preloaded server; else exec

# What a node of any protocol imports on its way through its first rounds
# (found by listing sys.modules in a forked FedAVGP2P node at exit). Heavy
# imports only some nodes need (opacus, torchvision, the GAN) are left to those
# nodes: the server would pay them in every process that starts one.
PRELOAD = [
    "torch",
    # torch imports its compiler lazily, on the first optimizer built (Optimizer's
    # __init__ is wrapped by torch._compile._disable_dynamo): 2-3 CPU-seconds in
    # every node, measured with py-spy over bench.heterogeneous's eight nodes
    "torch._dynamo",
    "numpy",
    "psutil",
    "node.cli",
    "node.daemon",
    "node.evaluate",
    "node.export",
    "genbuffer.cli",
    "p2pfl.learning.data",
    "p2pfl.learning.export",
    "p2pfl.learning.train",
    "p2pfl.learning.sites",
    "p2pfl.learning.evaluate",
    "protocols.probe",
    "protocols.fedavgp2p",
    "protocols.fedsgdp2p",
    "protocols.ssfl",
    "protocols.fedperl",
    "protocols.fedmae",
    "protocols.fedbeit",
    "protocols.feder",
]

CLONE_NEWNET = 0x40000000

_context: Any = None
_started: list[Any] = []  # this process's forked children


def _kill_leftovers() -> None:
    """At exit, SIGKILL children still running: multiprocessing's own exit hook
    (registered earlier, so run after this one) would otherwise wait for them."""
    for proc in _started:
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)


def fork_requested() -> bool:
    return os.environ.get(LAUNCH_ENV, "") == "fork"


def _server() -> Any:
    """multiprocessing's fork-server context, its server started with PRELOAD
    imported (once per process; a module that fails to import is skipped)."""
    global _context
    if _context is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        # one thread in the server (OpenBLAS would start a pool): a fork copies
        # only the forking thread, so the server must have no other
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        atexit.register(_kill_leftovers)
        _context = ctx
    return _context


def enter_net_namespace(fd: int) -> None:
    """The calling thread into the network namespace `fd` refers to (setns(2));
    OSError with the reason where that is refused."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _child(
    argv: list[str],
    env: dict[str, str],
    log_path: str,
    cwd: str,
    netns: str | None,
    niceness: int = 0,
) -> None:
    """In the forked child: become the node process `python -m node.cli ARGV` would be
    (`ip netns exec NAME python -m node.cli ARGV` where `netns` names /run/netns/NAME:
    the child, one thread, enters it before anything opens a socket).
    It ends with the fork server (SIGTERM, Linux's parent-death signal), which
    ends with the process that started it: a test or benchmark killed mid-run
    leaves no node running on (they did, heartbeating, for an hour)."""
    # A forked child holds the server's "alive" pipe (multiprocessing passes it
    # so the server outlives its children): closed here, the server ends as soon
    # as the process that started it does, and the signal below ends the node.
    from multiprocessing import forkserver

    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    server = os.getppid()
    _die_with_parent()
    if os.getppid() != server:  # the server ended before the signal was armed
        os._exit(1)
    os.setsid()
    if niceness > 0:  # before any thread starts: every thread inherits it
        os.nice(niceness)
    os.chdir(cwd)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stderr
    if netns is not None:  # a failure is written to the node's log, and the child exits 1
        ns = os.open(netns, os.O_RDONLY)
        try:
            enter_net_namespace(ns)
        finally:
            os.close(ns)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python process
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = ["p2pfl-node", *argv]
    from node.cli import main

    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # multiprocessing's child exit skips them; Python's does not
    sys.exit(code)


def _die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGTERM) where Linux offers it; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG


class ForkedProcess:
    """The part of `subprocess.Popen` that bench.localfed and its users rely on
    (pid, poll, wait, returncode, send_signal, kill, terminate), for a child of
    the fork server."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        netns: str | None = None,
        niceness: int = 0,
    ) -> None:
        self.args = ["p2pfl-node", *argv]
        self._proc = _server().Process(
            target=_child,
            args=(list(argv), dict(env), str(log_path), os.getcwd(), netns, niceness),
            daemon=False,
        )
        self._proc.start()
        _started.append(self._proc)
        self.pid: int = int(self._proc.pid or 0)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
