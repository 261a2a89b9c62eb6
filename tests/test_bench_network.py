"""bench/network.py --smoke: digits, 3 sites (one behind a relay), 2 rounds,
one seed, both arms, every process in its own network namespace (issue 31),
with the relay SIGKILL drill by the relay's fault plan in the `behind` arm.
Skipped with one loud line where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.netns import skip_unless_netns

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_network_bench_smoke(tmp_path):
    skip_unless_netns()
    out = tmp_path / "net"
    proc = subprocess.run(
        # with the relay drill: r1's fault plan kills it on the first frame of round 2
        [
            sys.executable,
            "-m",
            "bench.network",
            "--smoke",
            "--kill-relay-at",
            "2",
            "--restart-after",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["runs_ok"] is True
    for arm in ("reachable", "behind"):
        assert summary["every_node_every_round"][arm] == {"0": True}
        assert summary["macro_f1_final"][arm]["0"] is not None
    # nobody is behind the relay in `reachable`; in `behind` every message to
    # and every model from site_2 went through it
    assert summary["relay_bytes"]["reachable"]["0"]["bytes_total"] == 0
    assert summary["relay_bytes"]["behind"]["0"]["messages"] > 0
    assert summary["relay_bytes"]["behind"]["0"]["reply_bytes"] > 0
    assert summary["rounds_lost"] == 0 and summary["processed_twice"] == 0
    # the relay died by its fault plan, as it was about to carry round 2, and came back
    (kill,) = summary["relay_kills"]["0"]
    assert kill["by_fault_plan"] is True and kill["frame_round"] == 2
    # the relay's counters at its death came from its kill event, not a late poll
    events = list((out / "seed0" / "behind").glob("r1_faults.json.events.jsonl"))
    (event,) = [json.loads(x) for x in events[0].read_text().splitlines()]
    assert event["state"]["forwarded"]["messages"] > 0
    assert kill["restarted_t"] >= kill["t"]
    results = json.loads((out / "results.json").read_text())
    assert results["seeds"][0]["behind"]["behind"] == ["site_2"]
    assert "--- seed 0 behind:" in proc.stderr
