"""The benchmark scripts run and end with one JSON object (tiny sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_main import last_json


def test_wire_benchmark_reports_its_figures(capsys):
    result = last_json(capsys, ["bench.wire", "--mb", "2", "--repeats", "2"])
    assert {
        "payload_mb",
        "roundtrip_mb_s",
        "memcpy_mb_s",
        "ratio_vs_memcpy",
        "encrypted_roundtrip_mb_s",
    } <= set(result)
    assert result["roundtrip_mb_s"] > 0 and result["ratio_vs_memcpy"] > 0


@pytest.mark.slow
def test_transport_benchmark_reports_its_figures(capsys):
    result = last_json(capsys, ["bench.transport", "--mb", "4", "--repeats", "1"])
    assert {
        "payload_mb",
        "node_path_mb_s",
        "raw_post_mb_s",
        "ratio",
        "receiver_peak_rss_over_payload",
    } <= set(result)
    assert result["node_path_mb_s"] > 0 and result["raw_post_mb_s"] > 0


def test_augment_benchmark_reports_the_overhead_of_each_view(capsys):
    result = last_json(capsys, ["bench.augment", "--steps", "5", "--batch-size", "8"])
    for view in ("weak", "strong", "weak_torchvision", "strong_torchvision"):
        assert result[f"{view}_ms"] > 0
        assert result[f"{view}_overhead"] == pytest.approx(
            result[f"{view}_ms"] / result["step_ms"], rel=0.01
        )
    assert isinstance(result["pass"], bool)


@pytest.mark.slow
def test_startup_benchmark_reports_when_every_node_runs_round_one(tmp_path, capsys):
    result = last_json(
        capsys, ["bench.startup", "--nodes", "2", "--repeats", "1", "--out", str(tmp_path)]
    )
    assert len(result["first_round_s"]) == 1 and result["first_round_s"][0] > 0
    steps = result["breakdown_median_node"]
    assert 0 < steps["node_created"] <= steps["listening"] <= steps["first_round"]
    assert isinstance(result["pass"], bool)


def test_scale_benchmark_runs_each_size_in_its_own_process(tmp_path, capsys):
    result = last_json(
        capsys,
        [
            "bench.scale",
            "--nodes",
            "6,10",
            "--rounds",
            "2",
            "--per-site",
            "4",
            "--baseline-nodes",
            "6",
            "--out",
            str(tmp_path),
        ],
    )
    assert result["ok"] and result["completed_10"] and result["completed_6_defaults"]
    assert result["round_s_10"] > 0 and result["peak_rss_mb_10"] > 100
    assert "marginal_kb_per_node_10" in result and "peak_rss_ratio_vs_defaults" in result
    saved = json.loads((tmp_path / "scale.json").read_text())
    assert [r["nodes"] for r in saved["runs"]] == [6, 10, 6]
    assert (tmp_path / "scale.png").stat().st_size > 1000


@pytest.mark.slow
def test_failed_site_benchmark_compares_survivors_alone_with_them_beside_a_failed_site(
    tmp_path, capsys
):
    result = last_json(
        capsys,
        [
            "bench.failed_site",
            "--seeds",
            "0",
            "--rounds",
            "2",
            "--survivors",
            "1",  # 3 processes: the survivor alone, then beside the failed site
            "--out",
            str(tmp_path),
        ],
        codes=(0, 1),  # 1: the ratio missed its target, which a loaded machine may cause
    )
    assert result["survivors"] == 1
    assert result["survivors_finished"] and result["round_ratio"] is not None
    # the failed site is the survivor's only peer: had it been waited for, a
    # round would last its 60 s timeout
    assert result["round_s_with_failed"] < 30


@pytest.mark.slow
# three bench.federation processes (torch, Opacus, the compute-limit epochs and
# plots of each): minutes of wall time beside other workers on 2 cores, spent
# waiting for a core (its threads' run-queue wait adds up to its wall time), not
# in sleeps or timeouts
@pytest.mark.timeout(900)
def test_dp_utility_benchmark_compares_each_epsilon_with_the_same_recipe_without_dp(
    tmp_path, capsys
):
    """Every private arm beside the like-for-like non-private recipe and the
    standard training, each with the recipe it ran, ε as Opacus's accountant.
    One pass per round (--recipe-option epochs=1, the recipe's default is 4)
    over 8x8 digits (--image-size 8): the accounting and the table depend
    neither on how long the arms train nor on how large their images are."""
    result = last_json(
        capsys,
        [
            "bench.dp_utility",
            "--data",
            "digits",
            "--nodes",
            "2",
            "--rounds",
            "1",
            "--epsilons",
            "8",
            "--seeds",
            "0",
            "--recipe-option",
            "epochs=1",
            "--image-size",
            "8",
            "--out",
            str(tmp_path),
        ],  # fmt: skip
    )
    assert list(result["table"]) == ["8", "∞ recipe", "∞ standard"]
    for arm in ("eps_8_s0", "eps_inf_recipe_s0", "eps_inf_standard_s0"):  # every arm ran at 8x8
        assert (
            json.loads((tmp_path / arm / "results.json").read_text())["config"]["image_size"] == 8
        )
    assert result["table"]["8"]["recipe"]["sampling"].startswith("poisson")
    # the option reached both recipe arms: the private one and its like-for-like baseline
    assert result["table"]["8"]["recipe"]["epochs_per_round"] == 1
    assert result["table"]["∞ recipe"]["recipe"]["epochs_per_round"] == 1
    # and the nodes ran it: one expected pass is 1 / sample rate Poisson steps a round
    rows = json.loads((tmp_path / "dp_utility.json").read_text())["rows"]
    private = next(r for r in rows if r["label"] == "8")
    assert private["steps"] == [max(1, round(1 / q)) for q in private["sample_rate"]]
    assert result["table"]["∞ standard"]["recipe"]["recipe"] == "standard"
    assert "points_below_non_dp_recipe" in result["table"]["8"]
    assert result["epsilon_reported_vs_opacus_max_gap"] < 1e-9 and result["within_target"]
    assert (tmp_path / "dp_utility.png").stat().st_size > 0


def test_dp_utility_pools_one_models_runs_and_names_it(tmp_path):
    """--pool labels the table with the model its rows trained, and refuses
    rows of different models instead of averaging them into one table."""
    from bench.dp_utility import main as dp_main

    def run(folder: str, model: str, f1: float) -> Path:
        row = {
            "label": "∞ standard",
            "model": model,
            "epsilon_target": None,
            "macro_f1_final": f1,
            "recipe": {},
        }
        path = tmp_path / folder
        path.mkdir()
        (path / "dp_utility.json").write_text(json.dumps({"rows": [row]}))
        return path

    a, b = run("a", "scatternet_linear", 0.7), run("b", "scatternet_linear", 0.8)
    assert dp_main(["--pool", str(a), str(b), "--out", str(tmp_path / "new" / "out")]) == 0
    summary = json.loads((tmp_path / "new" / "out" / "dp_utility.json").read_text())["summary"]
    assert summary["model"] == "scatternet_linear"
    assert summary["table"]["∞ standard"]["macro_f1_per_seed"] == [0.7, 0.8]
    c = run("c", "small_cnn_ws", 0.6)
    with pytest.raises(SystemExit, match="different models"):
        dp_main(["--pool", str(a), str(c), "--out", str(tmp_path / "mixed")])
