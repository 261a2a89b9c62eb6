"""A short soak of real node processes: descriptors and memory must not grow
with the rounds (the full figure is `python -m bench.soak --nodes 6 --rounds 300`)."""

from __future__ import annotations

import json

import pytest

from bench.soak import run_soak, slope

pytestmark = pytest.mark.slow


def test_slope_of_a_line_and_of_too_few_points():
    assert slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert slope([(0, 1.0), (0, 2.0), (1, 3.0)]) is None


def test_four_nodes_keep_descriptors_and_memory_flat(tmp_path):
    # Each node's connection pool fills during the first ~60 rounds (bench.soak,
    # 4 nodes x 300 rounds: 16 descriptors at the start, 21-22 at round 70,
    # 22-23 from round ~140 on), so the fit starts at round 60.
    summary = run_soak(tmp_path / "soak", nodes=4, rounds=120, warmup=0.5, timeout_s=300)
    print(json.dumps(summary))
    assert set(summary["rounds_completed"].values()) == {120}
    assert set(summary["exit_codes"].values()) == {0}
    per_node = json.loads((tmp_path / "soak" / "soak.json").read_text())["per_node"]
    for name, node in per_node.items():
        # A leak of one descriptor or connection per round would be +60 here.
        assert node["fds_end"] - node["fds_after_warmup"] <= 3, (name, node)
        # One or two connections opened or closed near the end of a 60-round fit
        # read as up to ~5 per 100 rounds; a leak every 10th round would be 10.
        assert abs(node["fds_per_100_rounds"]) < 10, (name, node)
        # Memory: a model-sized leak per round (~100 KB here) would be > 10 MB / 100 rounds.
        assert node["rss_mb_per_100_rounds"] < 10, (name, node)
    assert (tmp_path / "soak" / "soak.png").exists()
