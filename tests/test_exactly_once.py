"""Exactly-once without a window: the ids a checkpoint covers are written inside
it, so a node killed after its checkpoint is on disk and before the journal
is appended processes nothing twice (node/queues.py).

A real node process on 127.0.0.1 with a fault plan that SIGKILLs it at that
exact point (`checkpointed`, node/faults.py); the test plays its peer with the
peer's real keys and counts, through the probe protocol, how often each push
was processed.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_daemon import FAST
from test_faults import events, write_plan
from test_replay_restart import send_until_taken

from bench.localfed import LocalFederation
from bench.peer import Heartbeats, RawPeer
from node.provision import provision
from node.queues import Checkpoints

pytestmark = pytest.mark.slow


def test_a_kill_between_checkpoint_and_journal_processes_nothing_twice(tmp_path):
    fed_dir = tmp_path / "fed"
    probe = {"name": "probe", "rounds": 2, "payload_kb": 4, "round_timeout_s": 8}
    plans = provision(fed_dir, ["a", "b"], protocol=probe, overrides=FAST)
    plan_b = plans[1]
    state = fed_dir / "b" / "state"
    faults = write_plan(
        tmp_path / "faults" / "b.json",
        {"kill": [{"id": "between", "round": 1, "phase": "checkpointed"}]},
    )
    peer_a = RawPeer(fed_dir, "a", {"b": plan_b.port})
    a = peer_a.codec
    fed = LocalFederation([plan_b], tmp_path / "logs")
    node_b = fed["b"]
    node_b.env = {"P2PFL_FAULTS": str(faults)}
    beats = Heartbeats(
        peer_a, ["b"], 0, max_s=120, interval_s=0.3, phase="test", goodbye=False, post_timeout_s=2
    )
    with fed, beats:
        node_b.wait_for(lambda s: s["round"] == 1, 60, "round 1 started")
        first = a.encode("probe", "b", {"round": 1, "from": "a", "tensor": torch.ones(8)}, round=1)
        assert peer_a.post("b", first.to_bytes()).accepted
        # b takes the probe, ends round 1, writes its checkpoint and dies there.
        assert node_b.wait(60) == -9, node_b.log_tail()
        assert [e["id"] for e in events(faults) if e["event"] == "kill"] == ["between"]

        # The moment the kill was aimed at: the checkpoint counts the probe...
        saved = Checkpoints(state / "checkpoints").latest()
        assert saved is not None and saved["protocol"]["received"] == {"a": 1}
        assert [c["id"] for c in saved["consumed"]] == [first.header.id_hex]
        # ... the journal does not name it, and its spool file is still there.
        journal = state / "journal.jsonl"
        journaled = journal.read_text().split() if journal.exists() else []
        assert not any(first.header.id_hex in line for line in journaled)
        assert (state / "spool" / f"{first.header.id_hex}.frame").exists()

        node_b.start()
        node_b.wait_for(lambda s: s["round"] >= 1, 60, "restarted")
        second = {"round": 2, "from": "a", "tensor": torch.ones(8)}
        status, body, _ = send_until_taken(a, plan_b.port, "probe", "b", second, round_no=2)
        assert status == 200, body
        node_b.wait_for(lambda s: s["phase"] == "done", 60, "b done")

    ids = [json.loads(x)["id"] for x in (state / "journal.jsonl").read_text().splitlines()]
    assert ids.count(first.header.id_hex) == 1, ids
    assert len(ids) == len(set(ids)) == 2, ids
    rounds = [json.loads(x) for x in (state / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    # Two distinct probes, each processed once: not three.
    assert rounds[-1]["received_total"] == 2, rounds
    log_text = node_b.log_path.read_text()
    assert "0 spooled messages re-queued" in log_text
    assert "journaling 1 ids the last checkpoint consumed" in log_text
    assert not list((state / "spool").glob("*.frame"))
    print(
        json.dumps(
            {
                "scenario": "kill_between_checkpoint_and_journal",
                "pushes": 2,
                "processed": rounds[-1]["received_total"],
                "journaled": len(ids),
            }
        )
    )
