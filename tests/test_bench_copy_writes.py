"""bench.copy_writes: the bytes a compressed exchange writes for its pairs'
copies against the layout that rewrote every copy, in the same run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import copy_writes


def test_copy_writes_counts_both_layouts_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert copy_writes.main(["--nodes", "2", "--rounds", "3", "--out", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["bench"] == "copy_writes" and summary["saves"] == 2 * 3
    # the first save writes every copy it holds, as the old layout did (each
    # in its own file, plus the index); later saves only the new ones
    detail = json.loads((tmp_path / "copy_writes.json").read_text())
    first_written, first_legacy = detail["per_save"][0]
    assert first_legacy > 0 and abs(first_written - first_legacy) < 0.05 * first_legacy
    assert (
        summary["bytes_written_per_node_round"]
        < summary["bytes_rewriting_every_copy_per_node_round"]
    )
    assert 0 < summary["ratio"] < 1
    assert summary["index_files_written"] == summary["saves"]
    assert summary["copy_files_written"] >= summary["saves"]
    assert (tmp_path / "copy_writes.png").stat().st_size > 0
    # the wrappers are gone: the exchange writes as it did before the run
    from p2pfl.files import atomic_write_bytes
    from protocols import compressed_exchange

    assert compressed_exchange.atomic_write_bytes is atomic_write_bytes
    assert compressed_exchange.CompressedExchange.write.__qualname__ == "CompressedExchange.write"


def test_copy_writes_refuses_what_keeps_no_copies() -> None:
    with pytest.raises(SystemExit):
        copy_writes.parse_args(["--compression", "none"])
    with pytest.raises(SystemExit):
        copy_writes.parse_args(["--nodes", "1"])
