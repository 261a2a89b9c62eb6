"""Provision a federation on this machine (loopback addresses): one key pair
per site, one roster, one site.yaml per site, and a random status token per site
(SITE/state/status.token, 0600, named by the site.yaml's status.token_file). As every site runs on this
machine, each site.yaml gets `training.threads` = cores // sites (at least 1),
so the nodes together do not oversubscribe the CPU (node/resources.py).

Relays (issue 31): `relays=["r1"]` adds the roster's `relays:` and a
RELAY/relay.yaml per relay (node/relay.py's format); the sites in `behind` are
outbound-only: their card has `address: null` and `via:` every relay, and they
listen on their own 127.0.0.1 only (their relay tunnel reaches them there).
With any relay, every site gets `wire.encryption: true`: a relay must never
carry plaintext. `hosts` (name -> IP address) places a reachable site or a
relay on another address than 127.0.0.1 (bench/netns.py: one network
namespace each); it listens on that address and the roster names it there.

Used by `p2pfl-node provision`, and by the tests and benchmarks, which then
start one node process per site with bench/localfed.py.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from node.resources import threads_per_site
from node.status import STATUS_TOKEN_FILE, load_or_create_token
from p2pfl.files import make_private_dir
from p2pfl.secure.identity import LocalIdentity, Roster

# Where each provisioned site keeps its status token, relative to its site.yaml.
STATUS_TOKEN_PATH = f"state/{STATUS_TOKEN_FILE}"
LOOPBACK = "127.0.0.1"


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

    def dashboard_url(self, with_token: bool = True) -> str:
        """The site's dashboard on this machine, with its token in the URL
        fragment (`with_token`; printed only to a terminal: node/cli.py)."""
        from node.status import dashboard_url

        token = self.status_token() if with_token else None
        return dashboard_url("127.0.0.1", self.status_port, token)


@dataclass
class RelayPlan(SitePlan):
    """A relay's relay.yaml, peer port and status port (bench/localfed.py
    RelayProcess runs it); the same fields as a site's, so the same watchers
    read its /status."""


class Plans(list[SitePlan]):
    """provision's sites (a list, as before relays existed) and its relays."""

    def __init__(self, sites: list[SitePlan], relays: list[RelayPlan]) -> None:
        super().__init__(sites)
        self.relays = relays


def relay_config(name: str, *, federation: str, listen: str, status_port: int) -> dict[str, Any]:
    """RELAY/relay.yaml as node/relay.py reads it (docs in the issue 31 design);
    the limits are its defaults, written out so an operator sees what to tune."""
    return {
        "relay": {
            "name": name,
            "listen": listen,
            "max_pending_per_site": 64,
            "max_pending_bytes_per_site": 1 << 30,
            "rate_limit_per_s": 200,
            "idle_timeout_s": 60,
            "forward_timeout_s": 600,
        },
        "federation": {"id": federation, "roster": "../roster.yaml"},
        "status": {
            "enabled": True,
            "host": LOOPBACK,
            "port": status_port,
            "token_file": STATUS_TOKEN_PATH,
        },
        "logging": {"level": "INFO", "format": "text"},
    }


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
    relays: list[str] | None = None,
    behind: Collection[str] = (),
    relay_ports: list[int] | None = None,
    relay_status_ports: list[int] | None = None,
    hosts: dict[str, str] | None = None,
    relay_overrides: dict[str, Any] | None = None,
) -> Plans:
    """Keys, one roster and one site.yaml per site under `out`; with `relays`,
    one RELAY/relay.yaml each and the `behind` sites outbound-only (module
    docstring). Raises ValueError on names that cannot make a valid roster."""
    relays = list(relays or [])
    hosts = hosts or {}
    _check_names(names, relays, behind)
    out.mkdir(parents=True, exist_ok=True)
    ports = ports or free_ports(len(names))
    status_ports = status_ports or free_ports(len(names))
    relay_ports = relay_ports or (free_ports(len(relays)) if relays else [])
    relay_status_ports = relay_status_ports or (free_ports(len(relays)) if relays else [])
    sources = [data_sources] * len(names) if isinstance(data_sources, str) else list(data_sources)
    relay_addresses = {
        r: f"{hosts.get(r, LOOPBACK)}:{p}" for r, p in zip(relays, relay_ports, strict=True)
    }
    cards = []
    for name, port in zip(names, ports, strict=True):
        identity = LocalIdentity.generate(name)
        # The state dir and its keys folder are this account's alone from the
        # start (0700): `genbuffer` may write private images there before the
        # node's first run, which used to be what tightened it (a review).
        make_private_dir(out / name / "state")
        make_private_dir(out / name / "state" / "keys")
        identity.save(out / name / "state" / "keys")
        card = identity.card(f"{hosts.get(name, LOOPBACK)}:{port}")
        if name in behind:  # outbound-only: reached through any of the relays
            card = dataclasses.replace(card, address=None, via=tuple(relays))
        cards.append(card)
    Roster(cards, relays=relay_addresses).save(out / "roster.yaml")
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
        # behind a relay: its own loopback only (no inbound connection at all)
        cfg["node"]["listen"] = (
            f"{LOOPBACK if name in behind else hosts.get(name, LOOPBACK)}:{ports[i]}"
        )
        if relays:  # a relay must never see plaintext (the sites refuse to start otherwise)
            cfg["wire"] = {"encryption": True}
        cfg = deep_merge(cfg, overrides or {})
        cfg = deep_merge(cfg, (per_site or {}).get(name, {}))
        path = out / name / "site.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        token_file = _status_token_file(path, cfg.get("status") or {})
        plans.append(SitePlan(name, path, ports[i], status_ports[i], token_file))
    relay_plans = []
    for relay, port, status_port in zip(relays, relay_ports, relay_status_ports, strict=True):
        cfg = relay_config(
            relay,
            federation=federation,
            listen=relay_addresses[relay],
            status_port=status_port,
        )
        cfg = deep_merge(cfg, relay_overrides or {})
        path = out / relay / "relay.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        token_file = _status_token_file(path, cfg.get("status") or {})
        relay_plans.append(RelayPlan(relay, path, port, status_port, token_file))
    return Plans(plans, relay_plans)


def _check_names(names: list[str], relays: list[str], behind: Collection[str]) -> None:
    """The roster's own rules, said before any key is written."""
    clash = sorted(set(names) & set(relays))
    if clash:
        raise ValueError(f"{clash[0]!r} names both a site and a relay: rename one")
    if len(set(relays)) != len(relays):
        raise ValueError(f"relay names must be distinct, got {relays}")
    unknown = sorted(set(behind) - set(names))
    if unknown:
        raise ValueError(f"behind site {unknown[0]!r} is not one of the sites {names}")
    if behind and not relays:
        raise ValueError("sites behind a firewall need at least one relay to be reached through")


def _status_token_file(site_yaml: Path, status: dict[str, Any]) -> Path | None:
    """Write the site's status token (0600) where its site.yaml's status.token_file
    points, unless the overrides gave a token or no file; the file it is in."""
    if status.get("token") or not status.get("token_file"):
        return None
    path = Path(status["token_file"])
    path = path if path.is_absolute() else site_yaml.parent / path
    if not os.path.lexists(path):  # one already there is the operator's (a mounted secret)
        load_or_create_token(path)
    return path
