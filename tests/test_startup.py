"""A node's start-up: it imports only what its configuration needs, and
/status says how long each start-up step took."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import urllib.error
import urllib.request
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
    """Also: site a's site.yaml names no status token, so its node makes one
    (STATE/status.token, 0600), asks for it on loopback too, and logs the
    dashboard's URL and where the token is: its stderr is a file here, as
    under systemd or docker, so the token itself is not printed."""
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 1},
        overrides={"training": {"max_steps_per_epoch": 2, "threads": 1}},
        per_site={"a": {"status": {"token_file": None}}},
    )
    token_file = plans[0].config_path.parent / "state" / "status.token"
    assert plans[0].token_file is None and not token_file.exists()
    plans[0].token_file = token_file  # written by a's node when it starts
    with LocalFederation(plans, tmp_path / "logs") as fed:
        st = fed["a"].wait_for(lambda s: "first_round" in s["startup"], 120, "round 1 started")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{plans[0].status_port}/status", timeout=5)  # noqa: S310 - loopback
        assert refused.value.code == 401
        log = fed["a"].log_path.read_text(errors="replace")
    token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token) >= 32
    assert f"dashboard http://127.0.0.1:{plans[0].status_port}/ (token in {token_file}" in log
    assert token not in log  # stderr: not a terminal
    node_log = plans[0].config_path.parent / "state" / "node.log"
    assert token not in node_log.read_text(errors="replace")  # the red team read it there
    assert stat.S_IMODE(node_log.stat().st_mode) == 0o600
    startup = st["startup"]
    order = [startup[k] for k in ("node_created", "listening", "peers_ready", "first_round")]
    assert order == sorted(order) and order[0] > 0, startup
    assert startup["launched_at"] <= st["started_at"]
