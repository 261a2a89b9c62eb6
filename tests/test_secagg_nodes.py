"""Secure aggregation between real node processes on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import secagg


@pytest.mark.slow
def test_a_contributor_killed_after_the_others_masked_leaves_the_survivors_sum(
    tmp_path: Path,
) -> None:
    """6 real nodes, c = 1: site_5 dies when the first Round 2 request of round 2
    reaches it (the others masked with it, its input never comes). Every other
    node's sum of round 2 completes over the 4 survivors, with site_5 unmasked
    out of it (or, where site_5 was gone before masking, without it), and the
    federation finishes. (With 5 nodes a sum of 4 has t = 3 of 3 holders: no
    room for a dropout, `least_threshold`.)"""
    code = secagg.main(
        [
            "--dropout",
            "--data",
            "digits",
            "--rounds",
            "3",
            "--steps-per-round",
            "5",
            "--seeds",
            "0",
            "--timeout",
            "300",
            "--out",
            str(tmp_path),
        ]
    )
    result = json.loads((tmp_path / "results.json").read_text())
    assert code == 0, result
    drill = result["drill"]
    assert {name: d["neighbours"] for name, d in drill.items()} == dict.fromkeys(
        ("site_0", "site_1", "site_2", "site_3", "site_4"), 4
    )
    # The request that killed site_5 belonged to a sum that had masked with it: that
    # one (at least) unmasked site_5 out; a slower node found it gone before masking.
    assert result["dropped_seen"] >= 1
    assert result["survivors_finished_round"] == dict.fromkeys(
        ("site_0", "site_1", "site_2", "site_3", "site_4"), 3
    )
