"""bench.federation: the N-node benchmark writes results.json in the documented
schema, prints its summary as the last stdout line, draws its plots, and always
stops the node processes it started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bench.federation import ROW_KEYS, cli

NUMBER_OR_NULL = {"type": ["number", "null"]}
ROW_SCHEMA = {
    "type": "object",
    "required": list(ROW_KEYS),
    "properties": {
        "node": {"type": "string"},
        "round": {"type": "integer", "minimum": 1},
        "macro_f1": {"type": "number", "minimum": 0, "maximum": 1},
        "accuracy": {"type": "number", "minimum": 0, "maximum": 1},
        "messages_sent": {"type": "integer", "minimum": 0},
        "bytes_sent": {"type": "integer", "minimum": 0},
        "train_s": {"type": "number", "minimum": 0},
        "round_s": {"type": "number", "minimum": 0},
    },
}
SUMMARY_REQUIRED = [
    "protocol",
    "nodes",
    "rounds",
    "macro_f1_mean_first",
    "macro_f1_mean_final",
    "standalone_macro_f1_mean",
    "centralized_macro_f1",
    "non_training_share",
    "bytes_sent_total",
]
RESULTS_SCHEMA = {
    "type": "object",
    "required": ["config", "rounds", "baselines", "summary"],
    "properties": {
        "config": {"type": "object", "required": ["nodes", "protocol", "rounds", "data"]},
        "rounds": {"type": "array", "items": ROW_SCHEMA},
        "baselines": {
            "type": "object",
            "required": ["standalone", "centralized"],
            "properties": {
                "standalone": {"type": "object", "required": ["macro_f1_mean"]},
                "centralized": {"type": "object", "required": ["macro_f1"]},
            },
        },
        "summary": {
            "type": "object",
            "required": SUMMARY_REQUIRED,
            "properties": {
                "protocol": {"type": "string"},
                "nodes": {"type": "integer"},
                "rounds": {"type": "integer"},
                "macro_f1_mean_first": {"type": "number"},
                "macro_f1_mean_final": {"type": "number"},
                "standalone_macro_f1_mean": {"type": "number"},
                "centralized_macro_f1": {"type": "number"},
                "non_training_share": {"type": "number", "minimum": 0, "maximum": 1},
                "bytes_sent_total": {"type": "integer", "minimum": 1},
                "wall_s": {"type": "number"},
                "peak_rss_mb_max": NUMBER_OR_NULL,
            },
        },
    },
}
TINY = ["--data", "digits", "--image-size", "8", "--max-steps-per-epoch", "2", "--seed", "1"]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = cli.main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(lines[-1])


def test_test_split_option_reaches_the_run_spec() -> None:
    parser = cli.build_parser()
    assert cli.spec_from_args(parser.parse_args(["--out", "x"])).test_split == "local"
    args = parser.parse_args(["--out", "x", "--test-split", "global"])
    assert cli.spec_from_args(args).test_split == "global"
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x", "--test-split", "central"])


def test_in_memory_run_writes_the_documented_results_and_prints_the_summary_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    argv = ["--in-memory", "--nodes", "3", "--rounds", "2", "--partition", "iid", *TINY]
    code, last_line = run_cli([*argv, "--out", str(out)], capsys)
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    jsonschema.validate(results, RESULTS_SCHEMA)
    assert last_line == results["summary"]
    assert results["config"]["test_split"] == "local"
    summary = results["summary"]
    assert (summary["protocol"], summary["nodes"], summary["rounds"]) == ("fedavgp2p", 3, 2)
    assert summary["mode"] == "in_memory" and summary["peak_rss_mb_max"] > 0
    # every node reported every round, and the nodes really exchanged models
    assert sorted((r["node"], r["round"]) for r in results["rounds"]) == [
        (f"site_{i}", r) for i in range(3) for r in (1, 2)
    ]
    assert summary["messages_sent_total"] >= 3 * 2
    # baselines ran on the same partition for the same number of rounds
    assert set(results["baselines"]["standalone"]["macro_f1_by_node"]) == {
        "site_0",
        "site_1",
        "site_2",
    }
    assert len(results["baselines"]["centralized"]["macro_f1_mean_by_round"]) == 2
    assert len(results["baselines"]["pooled"]["macro_f1_mean_by_round"]) == 2
    # the reported (best on validation) models, and the compute limit of a round
    assert 0.0 <= summary["best_macro_f1_mean_final"] <= 1.0
    assert summary["gap_to_pooled_best"] == pytest.approx(
        summary["pooled_best_macro_f1"] - summary["best_macro_f1_mean_final"], abs=1e-3
    )
    assert summary["epoch_s"] > 0 and summary["cores"] >= 1
    assert summary["compute_limit_ratio"] == pytest.approx(
        summary["round_s_mean"] / (summary["epoch_s"] / summary["cores"]), rel=1e-3
    )
    assert 0 < summary["largest_site_epoch_s"] <= summary["epoch_s"]
    # the end-of-run personalization, once per node, timed apart from the rounds
    assert [r["round"] for r in results["rounds"] if r.get("personalize_s")] == [2, 2, 2]
    assert summary["personalize_s_mean"] > 0
    assert summary["critical_path_s"] == pytest.approx(
        max(summary["epoch_s"] / summary["cores"], summary["largest_site_epoch_s"]), rel=1e-3
    )
    assert sorted(p.name for p in (out / "data").glob("site_*.npz")) == [
        "site_0.npz",
        "site_1.npz",
        "site_2.npz",
    ]
    for path in results["plots"].values():
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grid_compares_heuristics_and_fractions_in_one_results_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "grid"
    argv = ["--in-memory", "--nodes", "3", "--rounds", "1", "--grid", "--no-baselines"]
    argv += ["--heuristics", "random,f1", "--fractions", "0.5,1.0", *TINY, "--out", str(out)]
    code, summary = run_cli(argv, capsys)
    assert code == 0
    cells = {(c["heuristic"], c["fraction"]): c for c in summary["grid"]}
    assert set(cells) == {("random", 0.5), ("random", 1.0), ("f1", 0.5), ("f1", 1.0)}
    # c = 1 pulls from both other nodes, c = 0.5 from one: more messages (DFU Fig. 7)
    for heuristic in ("random", "f1"):
        assert (
            cells[(heuristic, 1.0)]["messages_sent_total"]
            > cells[(heuristic, 0.5)]["messages_sent_total"]
        )
    assert summary["standalone_macro_f1_mean"] is None
    assert (out / "messages_vs_fraction.png").exists()
    assert (out / "f1_per_round_c0.5.png").exists() and (out / "f1_per_round_c1.png").exists()


def test_a_grid_without_the_compute_limit_reports_no_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--no-compute-limit with two heuristics: each cell has no limit ratio
    (None), where the grid's summary raised KeyError (found 2026-11-26)."""
    argv = ["--in-memory", "--nodes", "3", "--rounds", "1", "--no-baselines", "--no-compute-limit"]
    argv += ["--heuristics", "random,f1", *TINY, "--out", str(tmp_path / "grid")]
    code, summary = run_cli(argv, capsys)
    assert code == 0
    assert [c["compute_limit_ratio"] for c in summary["grid"]] == [None, None]


@pytest.mark.slow
def test_real_node_processes_run_to_the_end_and_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "procs"
    # two processes: each one's start, run, report and exit is what is checked
    argv = ["--nodes", "2", "--rounds", "1", "--partition", "iid", "--no-baselines", *TINY]
    code, summary = run_cli([*argv, "--timeout", "120", "--out", str(out)], capsys)
    assert code == 0, summary["errors"]
    assert summary["mode"] == "processes" and not summary["timed_out"]
    results = json.loads((out / "results.json").read_text())
    assert {r["node"] for r in results["rounds"]} == {"site_0", "site_1"}
    assert all(r["messages_sent"] is not None for r in results["rounds"])
    assert results["runs"][0]["exit_codes"] == {"site_0": 0, "site_1": 0}
    assert all(rss > 50 for rss in summary["peak_rss_mb"].values())
    assert 0.0 <= summary["non_training_share"] <= 1.0


@pytest.mark.slow
def test_overall_timeout_stops_every_node_and_still_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "late"
    # far more rounds than 4 s can hold, however fast the machine (50 tiny rounds could)
    argv = ["--nodes", "2", "--rounds", "5000", "--partition", "iid", "--no-baselines", *TINY]
    code, summary = run_cli([*argv, "--timeout", "4", "--out", str(out)], capsys)
    assert code == 1
    assert summary["timed_out"] is True
    results = json.loads((out / "results.json").read_text())
    exit_codes = results["runs"][0]["exit_codes"]
    assert set(exit_codes) == {"site_0", "site_1"}
    assert all(code is not None for code in exit_codes.values())  # nobody left running


@pytest.mark.parametrize("mode", ["in_memory", pytest.param("processes", marks=pytest.mark.slow)])
def test_a_failed_node_ends_the_benchmark_at_once_with_its_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """As a new user would: --protocol feder without LPIPS weights. The first node
    that fails ends the run with its one-line error and a non-zero exit, long
    before the overall timeout (600 s here)."""
    import time

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "no-torch-home"))  # nothing cached
    out = tmp_path / "feder"
    argv = ["--protocol", "feder", "--nodes", "2", "--rounds", "2", "--partition", "iid", *TINY]
    argv += ["--timeout", "600", "--out", str(out)] + (
        ["--in-memory"] if mode == "in_memory" else []
    )
    started = time.monotonic()
    code = cli.main(argv)
    assert time.monotonic() - started < 120
    printed = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(printed[-1])
    assert code == 1
    assert summary["failed"] is True and summary["failed_node"] in ("site_0", "site_1")
    assert summary["error"].startswith("LpipsBackboneMissing: LPIPS needs ImageNet 'alex' weights")
    assert "lpips_weights" in summary["error"] and "\n" not in summary["error"]
    assert any(line.startswith(f"{summary['failed_node']} failed: Lpips") for line in printed)
    assert json.loads((out / "results.json").read_text())["summary"] == summary


def test_lpips_options_reach_every_nodes_genbuffer_section(tmp_path: Path) -> None:
    from bench.federation.specs import in_process_configs, node_overrides

    weights = tmp_path / "lpips.pth"
    args = cli.build_parser().parse_args(
        ["--nodes", "2", "--protocol", "feder", "--lpips-backbone", "squeeze"]
        + ["--lpips-weights", str(weights), "--genbuffer-option", "iterations=800"]
        + ["--out", str(tmp_path)]
    )
    spec = cli.spec_from_args(args)
    assert node_overrides(spec)["genbuffer"] == {
        "iterations": 800,
        "lpips_backbone": "squeeze",
        "lpips_weights": str(weights.resolve()),
    }
    sources = [tmp_path / "a.npz", tmp_path / "b.npz"]
    for config in in_process_configs(spec, sources, tmp_path / "state"):
        assert config.genbuffer.lpips_backbone == "squeeze"
        assert config.genbuffer.lpips_weights == weights.resolve()


def test_training_options_reach_the_nodes_and_the_baselines_alike(tmp_path: Path) -> None:
    """--training-option sets a training: field of every node and of the
    baselines' sites (the same sections), so a compared setting stays fair."""
    from bench.federation.specs import in_process_configs, node_overrides, shared_sections

    args = cli.build_parser().parse_args(
        ["--nodes", "2", "--training-option", "select_by=macro_f1", "--out", str(tmp_path)]
    )
    spec = cli.spec_from_args(args)
    assert shared_sections(spec)["training"]["select_by"] == "macro_f1"
    assert node_overrides(spec)["training"]["select_by"] == "macro_f1"
    sources = [tmp_path / "a.npz", tmp_path / "b.npz"]
    for config in in_process_configs(spec, sources, tmp_path / "state"):
        assert config.training.select_by == "macro_f1"
    default = cli.spec_from_args(cli.build_parser().parse_args(["--out", str(tmp_path)]))
    assert "select_by" not in shared_sections(default)["training"]  # the site's default
    # a field a flag of its own sets is refused, not silently overridden
    clash = cli.build_parser().parse_args(["--training-option", "lr=0.1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--lr"):
        cli.spec_from_args(clash)


def test_each_sites_epoch_is_the_median_of_three_timings(monkeypatch, tmp_path: Path) -> None:
    """One timing of a site's epoch moved a seed's sum by a quarter between two
    runs: the compute limit takes the median of TIMED_EPOCHS timings, after a
    warm-up that is not counted (a fake clock: each epoch takes what it is told)."""
    from bench.federation import limit

    clock = [0.0]
    durations = iter([9.0, 1.0, 5.0, 2.0, 9.0, 3.0, 3.0, 0.5])  # warm-up, then 3 timed, per site

    class Site:
        def train_epochs(self) -> None:
            clock[0] += next(durations)

    monkeypatch.setattr(limit.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(limit, "build_site", lambda cfg: Site())
    monkeypatch.setattr(limit, "in_process_configs", lambda spec, sources, root: ["a", "b"])
    monkeypatch.setattr(limit, "one_torch_thread", lambda: None)
    assert limit.TIMED_EPOCHS == 3
    assert limit.epoch_seconds(None, [], tmp_path) == [2.0, 3.0]  # not 1.0, 5.0 or 3.0 alone
