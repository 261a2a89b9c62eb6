"""A drilled partition follows the node's own rounds, whatever peers claim.

node/inbound.py calls the fault plan for every request it is asked and
answers, with the requester's round from the frame header: a peer chooses
that number. Before the fix it moved the node's partition, so a drill's cut
flapped with whoever asked, and a peer past the cut was served the cut-off
node's model. Here a hostile requester claims every round it likes (inside
the cut, far past it, negative, the largest int64), many times and in any
order: only the node's own progress switches the partition, and each switch
is one event. (Kills on a request step still read the requester's round,
by design; the drills in test_faults.py fire them.)
"""

from __future__ import annotations

import json
from pathlib import Path

from node.faults import FaultPlan

CLAIMS = [3, 2, 5, 6, 10**6, -1, 0, 2**63 - 1, 4, 3, 3, 7]  # rounds a requester writes


def plan_with_cut(tmp_path: Path) -> tuple[FaultPlan, Path]:
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"partition": [{"from_round": 2, "to_round": 6}]}))
    return FaultPlan(path), path


def events(path: Path) -> list[str]:
    side = path.with_name(path.name + ".events.jsonl")
    if not side.exists():
        return []
    return [json.loads(line)["event"] for line in side.read_text().splitlines()]


def ask(plan: FaultPlan) -> list[bool]:
    """Every claim, as a request asked and answered; the isolation after each."""
    seen = []
    for claim in CLAIMS:
        for step in ("asked:model", "answered:model"):
            plan.on_progress(claim, step, own=False)
            seen.append(plan.isolated)
    plan.on_progress(CLAIMS[0], "acked", own=False)
    seen.append(plan.isolated)
    return seen


def test_a_requesters_round_never_cuts_or_heals_the_node(tmp_path):
    plan, path = plan_with_cut(tmp_path)
    plan.on_progress(1, "train")  # the node's own round 1: before the cut
    assert ask(plan) == [False] * (2 * len(CLAIMS) + 1)
    plan.on_progress(2, "train")  # its own round 2: cut off
    assert plan.isolated
    assert ask(plan) == [True] * (2 * len(CLAIMS) + 1)  # claims past the cut do not heal it
    plan.on_progress(6, "train")  # its own round 6: healed
    assert not plan.isolated
    assert ask(plan) == [False] * (2 * len(CLAIMS) + 1)
    assert events(path) == ["partition_start", "partition_end"]
