"""The benchmark scripts run and end with one JSON object (tiny sizes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def last_json(args: list[str], timeout: float = 240) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_wire_benchmark_reports_its_figures():
    result = last_json(["bench.wire", "--mb", "2", "--repeats", "2"])
    assert {
        "payload_mb",
        "roundtrip_mb_s",
        "memcpy_mb_s",
        "ratio_vs_memcpy",
        "encrypted_roundtrip_mb_s",
    } <= set(result)
    assert result["roundtrip_mb_s"] > 0 and result["ratio_vs_memcpy"] > 0


@pytest.mark.slow
def test_transport_benchmark_reports_its_figures():
    result = last_json(["bench.transport", "--mb", "4", "--repeats", "1"])
    assert {
        "payload_mb",
        "node_path_mb_s",
        "raw_post_mb_s",
        "ratio",
        "receiver_peak_rss_over_payload",
    } <= set(result)
    assert result["node_path_mb_s"] > 0 and result["raw_post_mb_s"] > 0


def test_augment_benchmark_reports_the_overhead_of_each_view():
    result = last_json(["bench.augment", "--steps", "5", "--batch-size", "8"])
    for view in ("weak", "strong", "weak_torchvision", "strong_torchvision"):
        assert result[f"{view}_ms"] > 0
        assert result[f"{view}_overhead"] == pytest.approx(
            result[f"{view}_ms"] / result["step_ms"], rel=0.01
        )
    assert isinstance(result["pass"], bool)


@pytest.mark.slow
def test_startup_benchmark_reports_when_every_node_runs_round_one(tmp_path):
    result = last_json(
        ["bench.startup", "--nodes", "2", "--repeats", "1", "--out", str(tmp_path)], timeout=180
    )
    assert len(result["first_round_s"]) == 1 and result["first_round_s"][0] > 0
    steps = result["breakdown_median_node"]
    assert 0 < steps["node_created"] <= steps["listening"] <= steps["first_round"]
    assert isinstance(result["pass"], bool)
