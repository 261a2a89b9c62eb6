"""Forked node processes (bench/forkstart.py) end when the process that started
them is killed: a test or benchmark SIGKILLed mid-run leaves no node running."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from bench.forkstart import ForkedProcess
    from node.provision import provision

    root = Path(sys.argv[1])
    probe = {"name": "probe", "rounds": 1_000_000, "payload_kb": 1, "interval_s": 0.5}
    (plan,) = provision(root / "fed", ["a"], protocol=probe)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    node = ForkedProcess(["run", "--config", str(plan.config_path)], env, root / "a.log")
    deadline = time.monotonic() + 60
    log = root / "a.log"
    while time.monotonic() < deadline and not (log.exists() and b"listening" in log.read_bytes()):
        time.sleep(0.1)
    print(node.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as a test killed mid-run
    """
)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_forked_node_ends_when_its_starter_is_killed(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == -9, done.stderr[-2000:]
    pid = int(done.stdout.split()[0])
    log = (tmp_path / "a.log").read_text()
    assert "listening" in log, log[-2000:]
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, 9)
        pytest.fail(f"node {pid} outlived the process that started it")
