"""Provision a federation on this machine (loopback addresses): one key pair
per site, one roster, one site.yaml per site, and a random status token per site
(SITE/state/status.token, 0600, named by the site.yaml's status.token_file). As every site runs on this
machine, each site.yaml gets `training.threads` = cores // sites (at least 1),
so the nodes together do not oversubscribe the CPU (node/resources.py).

Used by `p2pfl-node provision`, and by the tests and benchmarks, which then
start one node process per site with bench/localfed.py.
"""

from __future__ import annotations

import copy
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from node.resources import threads_per_site
from node.status import STATUS_TOKEN_FILE, load_or_create_token
from p2pfl.secure.identity import LocalIdentity, Roster

# Where each provisioned site keeps its status token, relative to its site.yaml.
STATUS_TOKEN_PATH = f"state/{STATUS_TOKEN_FILE}"


def free_ports(n: int) -> list[int]:
    """n distinct currently-free loopback TCP ports."""
    sockets, ports = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def site_config(
    name: str,
    *,
    federation: str,
    port: int,
    status_port: int,
    protocol: dict[str, Any],
    data_source: str,
    seed: int = 0,
    threads: int = 1,
) -> dict[str, Any]:
    return {
        "node": {"name": name, "listen": f"127.0.0.1:{port}", "state_dir": "state"},
        "federation": {"id": federation, "roster": "../roster.yaml", "seed": seed},
        "data": {"source": data_source},
        "model": {"name": "small_cnn"},
        "training": {"epochs": 1, "batch_size": 32, "lr": 0.001, "seed": seed, "threads": threads},
        "protocol": protocol,
        "selection": {"name": "random"},
        "status": {"host": "127.0.0.1", "port": status_port, "token_file": STATUS_TOKEN_PATH},
    }


@dataclass
class SitePlan:
    name: str
    config_path: Path
    port: int
    status_port: int
    token_file: Path | None = None  # the status token (provision writes one per site)

    def status_token(self) -> str | None:
        return self.token_file.read_text(encoding="utf-8").strip() if self.token_file else None

    def dashboard_url(self) -> str:
        """The site's dashboard on this machine, with its token in the URL fragment."""
        from node.status import dashboard_url

        return dashboard_url("127.0.0.1", self.status_port, self.status_token())


def provision(
    out: Path,
    names: list[str],
    *,
    protocol: dict[str, Any],
    data_sources: list[str] | str = "digits",
    ports: list[int] | None = None,
    status_ports: list[int] | None = None,
    federation: str = "local",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    per_site: dict[str, dict[str, Any]] | None = None,
) -> list[SitePlan]:
    """Keys, one roster and one site.yaml per site under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    ports = ports or free_ports(len(names))
    status_ports = status_ports or free_ports(len(names))
    sources = [data_sources] * len(names) if isinstance(data_sources, str) else list(data_sources)
    cards = []
    for name, port in zip(names, ports, strict=True):
        identity = LocalIdentity.generate(name)
        identity.save(out / name / "state" / "keys")
        cards.append(identity.card(f"127.0.0.1:{port}"))
    Roster(cards).save(out / "roster.yaml")
    plans = []
    for i, name in enumerate(names):
        cfg = site_config(
            name,
            federation=federation,
            port=ports[i],
            status_port=status_ports[i],
            protocol=protocol,
            data_source=sources[i],
            seed=seed,
            threads=threads_per_site(len(names)),  # every site runs on this machine
        )
        cfg = deep_merge(cfg, overrides or {})
        cfg = deep_merge(cfg, (per_site or {}).get(name, {}))
        path = out / name / "site.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        token_file = _status_token_file(path, cfg.get("status") or {})
        plans.append(SitePlan(name, path, ports[i], status_ports[i], token_file))
    return plans


def _status_token_file(site_yaml: Path, status: dict[str, Any]) -> Path | None:
    """Write the site's status token (0600) where its site.yaml's status.token_file
    points, unless the overrides gave a token or no file; the file it is in."""
    if status.get("token") or not status.get("token_file"):
        return None
    path = Path(status["token_file"])
    path = path if path.is_absolute() else site_yaml.parent / path
    load_or_create_token(path)
    return path
