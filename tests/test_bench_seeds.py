"""bench.seeds pools bench.federation results that differ only in the seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import seeds


def write_run(out: Path, seed: int, finals: dict[str, float], *, lr: float = 5e-4) -> Path:
    grid = [
        {
            "heuristic": h,
            "macro_f1_mean_final": f,
            "macro_f1_mean_last3": f - 0.01,
            "gap_to_centralized": 0.9 - f,
            "gain_over_standalone": f - 0.7,
            "non_training_share": 0.1 + seed / 100,
        }
        for h, f in finals.items()
    ]
    result = {
        "config": {"protocol": "fedavgp2p", "seed": seed, "lr": lr, "out": str(out)},
        "summary": {
            "grid": grid,
            "centralized_macro_f1": 0.9,
            "centralized_macro_f1_last3": 0.89,
            "standalone_macro_f1_mean": 0.7,
            "standalone_macro_f1_mean_last3": 0.69,
        },
    }
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps(result))
    return out


def test_pools_each_method_over_seeds_and_prints_json_last(tmp_path, capsys) -> None:
    a = write_run(tmp_path / "s0", 0, {"random": 0.80, "cosine": 0.70})
    b = write_run(tmp_path / "s1", 1, {"random": 0.90, "cosine": 0.76})
    assert seeds.main([str(a), str(b), "--out", str(tmp_path / "pooled")]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    random = last["methods"]["fedavgp2p random"]
    assert random["final"]["mean"] == pytest.approx(0.85)
    assert random["final"]["std"] == pytest.approx(0.0707, abs=1e-4)
    assert random["final"]["per_seed"] == {"0": 0.8, "1": 0.9}
    assert random["non_training_share"]["max"] == pytest.approx(0.11)
    assert last["methods"]["fedavgp2p cosine"]["gap_to_centralized"]["mean"] == pytest.approx(0.17)
    assert last["methods"]["centralized"]["final"]["mean"] == pytest.approx(0.9)
    assert (tmp_path / "pooled" / "seeds.png").stat().st_size > 1000
    assert json.loads((tmp_path / "pooled" / "seeds.json").read_text())["standalone"]


def test_refuses_runs_that_differ_in_more_than_the_seed(tmp_path) -> None:
    a = write_run(tmp_path / "s0", 0, {"random": 0.8})
    b = write_run(tmp_path / "s1", 1, {"random": 0.9}, lr=1e-3)
    with pytest.raises(SystemExit, match="differs from seed 0 in lr"):
        seeds.main([str(a), str(b), "--out", str(tmp_path / "pooled")])
    with pytest.raises(SystemExit, match="no results.json"):
        seeds.main([str(tmp_path / "missing"), "--out", str(tmp_path / "pooled")])
