"""A failed node is known at once and skipped; a quorum is waited for; no
partition leaves a site without training data.

The failure tests make the failed node cost the others a full round timeout
(60 s) per round if it were still chosen or waited for, so the bounds below
(a few seconds of work) can only hold if it is skipped at once.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.failed_site import empty_site
from node.peers import PeerTable
from p2pfl.config import TransportSection
from p2pfl.learning.data.partition import PartitionError, partition_dataset
from protocols.memory import InMemoryNetwork, simulate, simulation_configs

ROUND_TIMEOUT_S = 60
FAST_TRAINING = {"max_steps_per_epoch": 1, "batch_size": 16}
SMALL_DATA = {"image_size": 8, "augment": "none"}


def sites(tmp_path: Path, n: int) -> list[str]:
    partition_dataset("digits", n, "iid", tmp_path / "parts", seed=0)
    return [str(tmp_path / "parts" / f"site_{i}.npz") for i in range(n)]


# ---------------------------------------------------------------- the peer table


def beat(phase: str, **extra: Any) -> dict[str, Any]:
    return {"round": 1, "phase": phase, "done": False, "bye": False, **extra}


def test_a_heartbeat_saying_failed_marks_the_peer_failed_at_once() -> None:
    table = PeerTable("a", ["a", "b", "c"], TransportSection())
    table.heard("b", beat("train"))
    table.heard("c", beat("train"))
    assert [p.name for p in table.peers()] == ["b", "c"]
    table.heard("c", beat("failed", error="DataError"))
    assert [p.name for p in table.peers()] == ["b"]  # not chosen from the next beat on
    failed = {p.name: p for p in table.peers(alive_only=False)}["c"]
    assert failed.state == "failed" and table.records["c"].error == "DataError"
    table.heard("b", {**beat("done"), "done": True})
    assert table.all_done_or_gone()  # nobody waits for a failed peer to finish
    table.heard("c", beat("train"))  # restarted and running again
    assert [p.name for p in table.peers()] == ["b", "c"]


# ---------------------------------------------------------------- in memory


def test_in_memory_a_node_failed_at_start_is_skipped_at_once(tmp_path: Path) -> None:
    sources = sites(tmp_path, 4)
    sources[3] = str(empty_site(Path(sources[3]), tmp_path / "empty.npz"))
    configs = simulation_configs(
        sources,
        protocol={"name": "fedavgp2p", "rounds": 3, "fraction": 1.0, "round_timeout_s": 60},
        state_root=tmp_path / "state",
        data=SMALL_DATA,
        training=FAST_TRAINING,
    )
    network = InMemoryNetwork()
    started = time.monotonic()
    result = asyncio.run(simulate(configs, network=network))
    wall = time.monotonic() - started
    assert set(result.errors) == {"site3"} and "training split is empty" in result.errors["site3"]
    for name in ("site0", "site1", "site2"):
        rounds = sorted(r["round"] for r in result.records if r["node"] == name)
        assert rounds == [1, 2, 3]
        # it averaged with both survivors every round: the failed node took no slot
        assert all(r["neighbours"] == 2 for r in result.records if r["node"] == name)
    assert wall < ROUND_TIMEOUT_S / 2, f"the survivors waited for the failed node ({wall:.1f} s)"
    view = {p.name: p for p in network.join("observer").peers(alive_only=False)}
    assert view["site3"].state == "failed" and view["site3"].phase == "failed"


def test_in_memory_a_quorum_is_waited_for_and_resumes_by_itself(tmp_path: Path) -> None:
    configs = simulation_configs(
        sites(tmp_path, 3),
        protocol={"name": "fedavgp2p", "rounds": 2, "min_peers": 2, "round_timeout_s": 30},
        state_root=tmp_path / "state",
        data=SMALL_DATA,
        training=FAST_TRAINING,
    )
    network = InMemoryNetwork()
    for cfg in configs:
        network.join(cfg.node.name, cfg)
    network.partition("site2")  # unreachable: site0 and site1 see one peer, need two

    async def scenario() -> list[str]:
        run = asyncio.create_task(simulate(configs, network=network))
        deadline = time.monotonic() + 60
        phases: list[str] = []
        while time.monotonic() < deadline:
            phases = [network._nodes[n].phase for n in ("site0", "site1")]
            if phases == ["waiting_for_quorum"] * 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # still waiting a while later: no round without a quorum
        assert [network._nodes[n].phase for n in ("site0", "site1")] == ["waiting_for_quorum"] * 2
        assert network.round_of("site0") == 1
        network.partition("site2", on=False)  # back: everyone resumes by itself
        result = await asyncio.wait_for(run, 60)
        assert not result.errors
        return phases

    assert asyncio.run(scenario()) == ["waiting_for_quorum"] * 2


def test_a_quorum_larger_than_the_roster_is_refused_with_the_fix(tmp_path: Path) -> None:
    configs = simulation_configs(
        sites(tmp_path, 2),
        protocol={"name": "fedavgp2p", "rounds": 1, "min_peers": 3},
        state_root=tmp_path / "state",
        data=SMALL_DATA,
        training=FAST_TRAINING,
    )
    result = asyncio.run(simulate(configs))
    assert "protocol.min_peers" in result.errors["site0"]
    assert "at most 1" in result.errors["site0"]


# ---------------------------------------------------------------- partitions


def test_no_dirichlet_partition_leaves_a_site_empty(tmp_path: Path) -> None:
    with pytest.raises(PartitionError) as refused:
        partition_dataset("digits", 200, "dirichlet:0.5", tmp_path / "p", seed=0)
    message = str(refused.value)
    assert "at least 3" in message and "--min-per-site 1" in message and "\n" not in message
    summary = partition_dataset(
        "digits", 200, "dirichlet:0.5", tmp_path / "p", seed=0, min_per_site=1
    )
    assert min(row["labelled"] for row in summary["per_site"]) >= 1
    assert summary["smallest_site"] >= 1
    with pytest.raises(PartitionError, match="fewer sites"):
        partition_dataset("digits", 1000, "iid", tmp_path / "q", min_per_site=2)


def test_partition_cli_refuses_in_one_line(tmp_path: Path) -> None:
    """`p2pfl-node partition`: a partition that leaves a site without labelled
    images is refused with exit code 2 and one line on stderr naming the way
    out (the command itself, so its logging is what a user sees); with it
    taken, the split is written (node.cli's main, in this process)."""
    from node.cli import main

    cmd = ["partition", "--data", "digits", "--sites", "200", "--scheme", "dirichlet:0.5"]
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "p2pfl-node"), *cmd, "--out", str(tmp_path / "p")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--min-per-site" in proc.stderr
    assert main([*cmd, "--out", str(tmp_path / "p"), "--min-per-site", "1"]) == 0
    summary = json.loads((tmp_path / "p" / "partition.json").read_text())
    assert min(row["labelled"] for row in summary["per_site"]) >= 1


# ---------------------------------------------------------------- real processes


def real_node_overrides(startup_wait_s: float) -> dict[str, Any]:
    return {
        "transport": {"heartbeat_s": 0.5, "suspect_after_s": 3.0, "dead_after_s": 6.0},
        "node": {"exit_when_done": True, "startup_wait_s": startup_wait_s},
        "data": SMALL_DATA,
        "training": {**FAST_TRAINING, "threads": 1},
    }


@pytest.mark.slow
def test_real_nodes_skip_a_peer_whose_protocol_failed_and_show_why(tmp_path: Path) -> None:
    """Three real daemons (in the test process: tests/inproc_util.py; no node is
    killed here): c's heartbeat says it failed, a's /status shows why."""
    from inproc_util import InProcessFederation

    from node.provision import provision

    sources = sites(tmp_path, 3)
    sources[2] = str(empty_site(Path(sources[2]), tmp_path / "empty.npz"))
    plans = provision(
        tmp_path / "fed",
        ["a", "b", "c"],
        protocol={"name": "fedavgp2p", "rounds": 3, "fraction": 1.0, "round_timeout_s": 60},
        data_sources=sources,
        overrides=real_node_overrides(startup_wait_s=30),
    )
    with InProcessFederation(plans) as fed:
        seen = fed["a"].wait_for(
            lambda s: any(p["name"] == "c" and p["state"] == "failed" for p in s["peers"]),
            60,
            "c failed at a",
        )
        peer_c = next(p for p in seen["peers"] if p["name"] == "c")
        assert peer_c["error"] == "DataError" and peer_c["phase"] == "failed"
        codes = fed.wait_all_exit(ROUND_TIMEOUT_S)  # c stays until a and b are done
    assert codes == {"a": 0, "b": 0, "c": 1}, codes
    for plan in plans[:2]:
        rows = [
            json.loads(line)
            for line in (plan.config_path.parent / "state" / "metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        assert [r["round"] for r in rows] == [1, 2, 3]
        # the survivor, never c (the rows in the message: a run on a machine at
        # load 12 once had a round without it, not reproduced since)
        assert all(r["neighbours"] == 1 for r in rows), [
            {k: r.get(k) for k in ("round", "neighbours", "neighbours_wanted", "round_s")}
            for r in rows
        ]
        # a round that waited for c would last the 60 s round timeout
        assert max(r["round_s"] for r in rows) < ROUND_TIMEOUT_S / 3


@pytest.mark.slow
def test_real_nodes_wait_for_a_quorum_and_resume_when_it_is_back(tmp_path: Path) -> None:
    from bench.localfed import LocalFederation
    from node.provision import provision

    plans = provision(
        tmp_path / "fed",
        ["a", "b", "c"],
        protocol={"name": "fedavgp2p", "rounds": 2, "fraction": 1.0, "min_peers": 2},
        data_sources=sites(tmp_path, 3),
        overrides=real_node_overrides(startup_wait_s=1),
    )
    with LocalFederation(plans, tmp_path / "logs") as fed:
        fed["c"].kill()  # a and b see one peer each; the quorum is two
        for name in ("a", "b"):
            fed[name].wait_for(
                lambda s: s["phase"] == "waiting_for_quorum", 90, f"{name} waiting for a quorum"
            )
        time.sleep(2.0)
        assert fed["a"].status()["phase"] == "waiting_for_quorum"  # no round without it
        assert fed["a"].status()["round"] == 1
        fed["c"].start()
        codes = fed.wait_all_exit(120)
    assert codes == {"a": 0, "b": 0, "c": 0}, codes
    rows = (plans[0].config_path.parent / "state" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in rows] == [1, 2]
    assert all(json.loads(line)["neighbours"] == 2 for line in rows)
