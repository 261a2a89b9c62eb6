"""A node's start-up: it imports only what its configuration needs, and
/status says how long each start-up step took."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.localfed import LocalFederation
from node.provision import provision

HEAVY = ("torchvision", "timm", "matplotlib", "sklearn", "scipy", "lpips", "PIL")

PROBE = """
import json, sys
from p2pfl.config.site import load_config
from protocols.site import build_site
import node.daemon, protocols.fedavgp2p
site = build_site(load_config(sys.argv[1], check_files=False))
site.train_epochs()
site.evaluate("test")
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


def test_a_default_node_imports_no_torchvision_timm_or_plotting(tmp_path: Path) -> None:
    """Default site: small CNN, weak augmentation. Building it, training a round
    and evaluating import none of the heavy optional libraries."""
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 1},
        overrides={"training": {"max_steps_per_epoch": 2}},
    )
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), str(plans[0].config_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.slow
def test_status_reports_the_start_up_milestones(tmp_path: Path) -> None:
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 1},
        overrides={"training": {"max_steps_per_epoch": 2, "threads": 1}},
    )
    with LocalFederation(plans, tmp_path / "logs") as fed:
        st = fed["a"].wait_for(lambda s: "first_round" in s["startup"], 120, "round 1 started")
    startup = st["startup"]
    order = [startup[k] for k in ("node_created", "listening", "peers_ready", "first_round")]
    assert order == sorted(order) and order[0] > 0, startup
    assert startup["launched_at"] <= st["started_at"]
