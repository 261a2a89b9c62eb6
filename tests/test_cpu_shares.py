"""Benchmark nodes on one machine share its cores by their share of the work
(bench/federation/processes.py `cpu_niceness`, `cpu_shares: data`): each
process is started with a nice value, every thread of it included."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from bench.federation.processes import cpu_niceness
from bench.localfed import LocalFederation
from node.provision import provision


def site_file(path: Path, n_train: int) -> Path:
    np.savez(
        path,
        train_images=np.zeros((n_train, 8, 8, 1), np.uint8),
        train_labels=np.zeros(n_train, np.int64),
    )
    return path


def test_nice_values_follow_each_sites_share_of_the_training_images(tmp_path: Path) -> None:
    counts = {"big": 1600, "same": 1600, "quarter": 400, "tiny": 1, "empty": 0}
    sources = [site_file(tmp_path / f"{k}.npz", n) for k, n in counts.items()]
    nice = cpu_niceness(sources, list(counts))
    # CFS weighs nice n about 1.25^-n: a quarter of the images, log_1.25(4) = 6.2
    assert nice == {"big": 0, "same": 0, "quarter": 6, "tiny": 19, "empty": 19}
    # sources that are not one partitioned file per site: equal shares
    assert cpu_niceness(sources[:2], ["a", "b", "c"]) == {}
    (tmp_path / "not.npz").write_bytes(b"garbage")
    assert cpu_niceness([tmp_path / "not.npz"], ["a"]) == {}


def thread_niceness(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}


@pytest.mark.parametrize("launch", ["fork", "exec"])
def test_a_node_process_and_every_thread_of_it_run_at_the_nice_value_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launch: str
) -> None:
    monkeypatch.setenv("P2PFL_NODE_LAUNCH", launch)
    probe = {"name": "probe", "rounds": 1_000_000, "payload_kb": 1, "interval_s": 0.5}
    plans = provision(tmp_path / "fed", ["a", "b"], protocol=probe)
    with LocalFederation(plans, tmp_path / "logs", niceness={"a": 7}) as fed:
        deadline = time.monotonic() + 90
        logs = [tmp_path / "logs" / f"{n}.log" for n in ("a", "b")]
        while time.monotonic() < deadline and not all(
            p.exists() and b"listening" in p.read_bytes() for p in logs
        ):
            time.sleep(0.1)
        assert all(b"listening" in p.read_bytes() for p in logs), logs[0].read_text()[-2000:]
        base = os.getpriority(os.PRIO_PROCESS, 0)  # this test's own (0 unless run under nice)
        a, b = fed["a"].proc, fed["b"].proc
        assert a is not None and b is not None
        assert thread_niceness(a.pid) == {min(19, base + 7)}
        assert thread_niceness(b.pid) == {base}
