"""bench.federation --engine ray: the in-memory nodes sharded over Ray actors
give every node the same figures each round as the local engine for a
deterministic configuration (same command line, same seed); a missing ray
is one line with the install command, before anything is partitioned."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.federation import cli
from protocols.memory.ray_shard import RAY_MISSING

# 4 nodes, 2 rounds, inline training and no augmentation: every value repeats
SMALL = [
    "--nodes",
    "4",
    "--rounds",
    "2",
    "--data",
    "digits",
    "--augment",
    "none",
    "--inline-train",
    "--seed",
    "0",
    "--no-baselines",
    "--no-compute-limit",
]


@pytest.fixture(scope="module")
def ray_here() -> Iterator[Any]:
    """One Ray of two CPUs for the module (one per shard); the benchmark joins
    it and leaves it running for its owner."""
    ray = pytest.importorskip("ray")
    # address="local": a Ray of its own, even when a cluster runs on this machine
    # (else ray.init joins that one, refusing num_cpus)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def untimed(results: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """Every row's values but its timings and the traffic its node had sent
    when it logged (what its peers had pulled from it by then depends on timing)."""
    timed = {"messages_sent", "bytes_sent", "t"}
    return {
        (row["node"], row["round"]): {
            k: v for k, v in row.items() if not k.endswith("_s") and k not in timed
        }
        for row in results["rounds"]
    }


@pytest.mark.slow
@pytest.mark.xdist_group("ray_local")  # its own Ray: may run beside test_ray_engine.py's cluster
# 30 s alone, 131 s beside a 3-worker run, over 300 s in a full run beside
# other helpers' work (load average 10): Ray's workers and shard actors each
# start an interpreter and import torch on the shared cores
@pytest.mark.timeout(900)
def test_engine_ray_gives_every_node_the_local_engines_figures(
    ray_here: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run([*SMALL, "--in-memory", "--out", str(tmp_path / "local")], capsys)
    assert code == 0, err
    local_summary = json.loads(out[-1])
    code, out, err = run(
        [*SMALL, "--engine", "ray", "--shards", "2", "--out", str(tmp_path / "ray")], capsys
    )
    assert code == 0, err
    ray_summary = json.loads(out[-1])
    assert ray_here.is_initialized()  # joined, not started: left to its owner
    # progress lines while it ran, read from the shards
    assert any("round 2/2: 4 nodes, macro-F1 mean" in line for line in out), out
    assert (local_summary["mode"], ray_summary["mode"]) == ("in_memory", "in_memory_ray")
    assert ray_summary["errors"] == {} and ray_summary["rounds_completed_min"] == 2
    local = json.loads((tmp_path / "local" / "results.json").read_text())
    sharded = json.loads((tmp_path / "ray" / "results.json").read_text())
    assert sharded["config"]["engine"] == "ray" and sharded["config"]["shards"] == 2
    assert len(untimed(local)) == 4 * 2
    assert untimed(sharded) == untimed(local)  # exactly: every node, every round
    for key in ("macro_f1_mean_first", "macro_f1_mean_final", "reported_macro_f1_mean_final"):
        assert ray_summary[key] == local_summary[key], key
    # the nodes differ: equal figures are not one constant
    assert len({row["macro_f1"] for row in local["rounds"]}) > 1


def test_engine_ray_without_ray_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out_dir = tmp_path / "run"
    code, _, err = run([*SMALL, "--engine", "ray", "--out", str(out_dir)], capsys)
    assert code == 2
    assert err == f"bench.federation: {RAY_MISSING}\n"
    assert "pip install 'p2pfl-node[ray]'" in err
    assert not (out_dir / "data").exists()  # refused before the data were partitioned


def test_engine_ray_needs_a_shard(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--shards must be at least 1"):
        cli.main([*SMALL, "--engine", "ray", "--shards", "0", "--out", str(tmp_path)])
