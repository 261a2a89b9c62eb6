"""Provision a federation on this machine (loopback addresses): one key pair
per site, one roster, one site.yaml per site. As every site runs on this
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
from p2pfl.secure.identity import LocalIdentity, Roster


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
        "status": {"host": "127.0.0.1", "port": status_port},
    }


@dataclass
class SitePlan:
    name: str
    config_path: Path
    port: int
    status_port: int


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
        plans.append(SitePlan(name, path, ports[i], status_ports[i]))
    return plans
