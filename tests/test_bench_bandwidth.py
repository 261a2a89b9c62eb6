"""bench.bandwidth and bench.heterogeneous (issue 32, item 4) at tiny sizes:
real `p2pfl-node` processes on digits, one seed; each run ends with one JSON
object whose figures come from the nodes' own counters, metrics and
checkpoints. And the real `p2pfl-node check` decides which arms run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_main import last_json

from bench.bandwidth import Arm, arm_spec, check_refusal, parse_args
from bench.federation.specs import partition


def test_check_refuses_topk_with_secure_aggregation_and_passes_plain(tmp_path: Path) -> None:
    args = parse_args(["--data", "digits", "--nodes", "3", "--out", str(tmp_path)])
    plain = arm_spec(args, Arm("small_cnn", "none", False), 0)
    assert dict(plain.transport_options)["link_mbit"] == 20.0
    sources, _ = partition(plain, tmp_path / "data")
    assert check_refusal(plain, sources, tmp_path / "plain") is None
    topk = arm_spec(args, Arm("small_cnn", "topk:0.1", True), 0)
    reason = check_refusal(topk, sources, tmp_path / "topk")
    assert reason is not None and "topk" in reason and "secure_aggregation" in reason, reason


@pytest.mark.slow
@pytest.mark.timeout(900)  # real processes: minutes on a loaded 2-core machine
def test_bandwidth_benchmark_measures_bytes_over_a_shaped_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = last_json(
        capsys,
        [
            "bench.bandwidth",
            "--data",
            "digits",
            "--nodes",
            "2",
            "--rounds",
            "1",
            "--seeds",
            "0",
            "--models",
            "small_cnn",
            "--formats",
            "none,int8",
            "--secure",
            "off",
            "--steps-per-round",
            "4",
            "--out",
            str(tmp_path),
        ],
    )
    assert result["ok"] and result["link_mbit"] == 20.0
    arms = result["arms"]["small_cnn"]
    assert set(arms) == {"none", "int8"}
    for figures in arms.values():
        assert figures["bytes_per_round_site"] > 0 and figures["round_s_mean"] > 0
        # the least time the site's 20 Mbit/s uplink needed for its bytes
        assert figures["link_floor_s"] == pytest.approx(
            figures["bytes_per_round_site"] * 8 / 20e6, rel=1e-3, abs=1e-4
        )
    # int8 sends a fraction of float32's bytes (the first exchange may carry a keyframe)
    ratio = result["ratios"]["small_cnn"]["int8/none bytes"]["mean"]
    assert 0 < ratio < 0.5, ratio
    assert ratio == pytest.approx(
        arms["int8"]["bytes_per_round_site"] / arms["none"]["bytes_per_round_site"], rel=1e-3
    )
    assert Path(result["plots"]["bandwidth"]).is_file()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"]["arms"] == result["arms"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_heterogeneous_benchmark_runs_its_three_arms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = last_json(
        capsys,
        [
            "bench.heterogeneous",
            "--data",
            "digits",
            "--nodes",
            "3",
            "--rounds",
            "2",
            "--fraction",
            "1.0",
            "--steps-per-round",
            "4",
            "--slow-factor",
            "2",
            "--seeds",
            "0",
            "--out",
            str(tmp_path),
        ],
    )
    assert result["runs_ok"] and result["slow_site"] == "site_2"
    assert set(result["fast_round_s"]) == {"sync", "async", "without_slow"}
    assert all(v is not None and v > 0 for v in result["fast_round_s"].values())
    # c = 1: each fast site merges the slow site's model in every synchronous
    # round, as its checkpoint's ledger records
    assert result["slow_models_merged_sync_per_seed"] == [2 * 2]
    assert result["slow_models_merged_async_per_seed"][0] >= 0
    seed = json.loads((tmp_path / "results.json").read_text())["seeds"][0]
    assert seed["without_slow"]["rounds_completed"] == {"site_0": 2, "site_1": 2}
    assert seed["sync"]["slow_site_rounds"] == 2
    assert Path(result["plot"]).is_file()


@pytest.mark.parametrize(("fraction", "nodes"), [(0.5, 5), (0.25, 5), (1.0, 5), (0.5, 3), (0.3, 8)])
def test_without_the_slow_site_each_site_pulls_from_as_many_neighbours(
    fraction: float, nodes: int
) -> None:
    from bench.heterogeneous import without_slow_fraction
    from protocols.selection import neighbour_count

    fewer = without_slow_fraction(fraction, nodes)
    assert 0 < fewer <= 1
    wanted = neighbour_count(fraction, nodes - 1)
    assert neighbour_count(fewer, nodes - 2) == min(wanted, nodes - 2)  # all, if fewer remain


def test_heterogeneous_secure_runs_every_arm_with_secure_aggregation() -> None:
    from bench.federation.specs import protocol_section
    from bench.heterogeneous import asynchronous, base_spec, parse_args

    plain = base_spec(parse_args(["--data", "digits"]), 0)
    assert not plain.encryption and "secure_aggregation" not in protocol_section(plain)
    secure = base_spec(parse_args(["--data", "digits", "--secure"]), 0)
    assert secure.encryption and protocol_section(secure)["secure_aggregation"] is True
    both = protocol_section(asynchronous(secure))
    assert both["secure_aggregation"] is True and both["asynchronous"] is True
    assert protocol_section(asynchronous(plain))["asynchronous"] is True
