"""The deploy artifacts as a key review attacked them (static: rendered with
`kubectl kustomize`, parsed, never applied): what a site that follows the
comments and docs ends up publishing, and the weak settings an example ships."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from p2pfl.config import config_from_dict
from tests.test_deploy import DEPLOY, by_kind, k8s_example, kustomize  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parents[1]
LOAD_BALANCER_PATCH = """
  - target: {kind: Service, name: p2pfl-node}
    patch: |-
      - op: replace
        path: /spec/type
        value: LoadBalancer
"""


def test_the_documented_load_balancer_patch_publishes_the_peer_port_only(k8s_example):  # noqa: F811
    # Before: one Service carried both ports, so the LoadBalancer patch its
    # comment recommends for peers in other institutions put the status API
    # (/healthz open, the rest token-guarded) on the load balancer too, kept
    # off only where the CNI enforces the NetworkPolicy.
    comment = (DEPLOY / "k8s" / "base" / "service.yaml").read_text()
    assert "patch this Service (and only\n# this one) to `type: LoadBalancer`" in comment
    site = k8s_example / "a"
    with (site / "kustomization.yaml").open("a") as fh:
        fh.write(LOAD_BALANCER_PATCH)
    services = {s["metadata"]["name"]: s["spec"] for s in by_kind(kustomize(site), "Service")}
    published = [s for s in services.values() if s.get("type") == "LoadBalancer"]
    assert [[p["port"] for p in s["ports"]] for s in published] == [[7000]]
    status = [s for s in services.values() if any(p["port"] == 8000 for p in s["ports"])]
    assert [s.get("type", "ClusterIP") for s in status] == ["ClusterIP"]


@pytest.mark.parametrize("site", ["a", "b", "c"])
def test_the_example_sites_a_site_copies_encrypt_their_payloads(site):
    # Before: the example overlays (whose peers.yaml shows a peer in another
    # institution) left wire.encryption at its default, off: models in clear.
    raw = yaml.safe_load((DEPLOY / "k8s" / "example" / site / "site.yaml").read_text())
    cfg = config_from_dict(raw, f"{site}/site.yaml", check_files=False)
    assert cfg.wire.encryption is True


def test_the_k8s_docs_write_the_status_token_readable_by_its_owner_only(tmp_path):
    # Before: `head -c 32 /dev/urandom | base64 > $s/keys/status.token` under
    # the usual umask 022 left the token 0644 on the admin's machine.
    ops = (REPO / "docs" / "operations.md").read_text()
    lines = [ln.strip() for ln in ops.splitlines() if "> $s/keys/status.token" in ln]
    assert lines and all(line.startswith("(umask 077;") for line in lines), lines
    if shutil.which("sh"):
        (tmp_path / "a" / "keys").mkdir(parents=True)
        cmd = lines[0].replace("$s", "a")
        subprocess.run(["sh", "-c", f"umask 022; {cmd}"], cwd=tmp_path, check=True)
        assert (tmp_path / "a" / "keys" / "status.token").stat().st_mode & 0o077 == 0
