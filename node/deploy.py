"""Running sites as services: the compose file of a provisioned federation, signing
key rotation, and the container health check.

The container layout (deploy/Dockerfile, deploy/k8s, the compose file) is the
same everywhere: the daemon listens on 0.0.0.0:7000 for peers and 0.0.0.0:8000
for status (bearer token always required; /healthz needs none and answers any
Host, so probes that send the pod's IP work), keeps its
state in /var/lib/p2pfl/state and reads its configuration from /etc/p2pfl.

    python -m node.deploy healthcheck [--url URL]    exit 0 when /healthz answers "ok"
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from node.status import STATUS_TOKEN_FILE, load_or_create_token
from p2pfl.errors import UserError
from p2pfl.files import PUBLIC_FILE, atomic_write_bytes, atomic_write_text
from p2pfl.secure.identity import (
    ADDRESS_PLACEHOLDER,
    Card,
    LocalIdentity,
    Roster,
    b64,
    grace_message,
    load_card,
)

log = logging.getLogger(__name__)

CONTAINER_PEER_PORT = 7000
CONTAINER_STATUS_PORT = 8000
CONTAINER_STATE_DIR = "/var/lib/p2pfl/state"
CONTAINER_CONFIG_DIR = "/etc/p2pfl"
CONTAINER_DATA_DIR = "/data"
CONTAINER_UID = 10001  # the image's p2pfl user (deploy/Dockerfile)
DEFAULT_IMAGE = "p2pfl-node:cpu"
HEALTHZ_URL = f"http://127.0.0.1:{CONTAINER_STATUS_PORT}/healthz"
COMPOSE_DIR = "compose"  # under the provision directory: roster + per-site site.yaml


# ----------------------------------------------------------------------------- compose


def _project_name(federation: str) -> str:
    """A compose project name: lower-case letters, digits, '-' and '_'."""
    cleaned = re.sub(r"[^a-z0-9_-]+", "-", federation.lower()).strip("-_")
    return f"p2pfl-{cleaned or 'federation'}"


def compose_site_config(
    local: dict[str, Any], name: str, data_mounts: dict[str, str]
) -> dict[str, Any]:
    """The container variant of a provisioned site.yaml: every address and path is
    the one seen inside the site's container."""
    cfg = {key: (dict(value) if isinstance(value, dict) else value) for key, value in local.items()}
    cfg["node"] = {
        **cfg.get("node", {}),
        "listen": f"0.0.0.0:{CONTAINER_PEER_PORT}",
        "advertise": f"{name}:{CONTAINER_PEER_PORT}",
        "state_dir": CONTAINER_STATE_DIR,
    }
    cfg.pop("identity", None)  # default: STATE/keys/<name>.{sign,kex}.pem
    cfg["federation"] = {
        **cfg.get("federation", {}),
        "roster": f"{CONTAINER_CONFIG_DIR}/roster.yaml",
    }
    cfg["status"] = {
        key: value for key, value in cfg.get("status", {}).items() if key not in ("token",)
    } | {
        "host": "0.0.0.0",
        "port": CONTAINER_STATUS_PORT,
        "token_file": f"{CONTAINER_STATE_DIR}/{STATUS_TOKEN_FILE}",
    }
    source = cfg.get("data", {}).get("source", "digits")
    if source != "digits":
        cfg["data"] = {**cfg["data"], "source": data_mounts[source]}
    # Several containers share this machine's cores: one torch thread each unless set.
    training = cfg.get("training", {})
    cfg["training"] = {**training, "threads": training.get("threads") or 1}
    return cfg


def write_compose(
    out: Path,
    names: Sequence[str],
    ports: Sequence[int],
    status_ports: Sequence[int],
    *,
    image: str = DEFAULT_IMAGE,
    uid: int | None = None,
    gid: int | None = None,
) -> Path:
    """`out/compose.yaml` for a federation provisioned in `out` (one service per site).

    Inside the compose network a site is reached by its service name, so the
    containers use their own roster, `out/compose/roster.yaml`, whose addresses
    are `<name>:7000`, and their own site files, `out/compose/<name>.site.yaml`
    (listen 0.0.0.0, container paths); `out/roster.yaml` and `out/<name>/site.yaml`
    stay as they are for plain processes on this machine. Each service bind-mounts
    its site's state directory (keys, spool, checkpoints, metrics) and publishes
    its peer and status ports on 127.0.0.1 at the same numbers as the plain
    processes. The containers run as the user who provisioned (the owner of the
    0600 keys), or as the image's user 10001 when that is root.
    """
    out = Path(out)
    if not (len(names) == len(ports) == len(status_ports)):
        raise ValueError("names, ports and status_ports must have the same length")
    roster = Roster.load(out / "roster.yaml")
    missing = [n for n in names if n not in roster]
    if missing:
        raise UserError(
            f"{out / 'roster.yaml'}: no entry for {', '.join(missing)} — provision again"
        )
    compose_dir = out / COMPOSE_DIR
    compose_dir.mkdir(parents=True, exist_ok=True)
    in_containers = [
        replace(c, address=f"{c.name}:{CONTAINER_PEER_PORT}" if c.name in names else c.address)
        for c in roster.cards()
    ]
    Roster(in_containers).save(compose_dir / "roster.yaml")

    if uid is None or gid is None:
        uid, gid = (os.getuid(), os.getgid()) if hasattr(os, "getuid") else (0, 0)
    if uid == 0:
        uid = gid = CONTAINER_UID
        log.warning(
            "provisioned as root: the containers run as uid %d; run `chown -R %d:%d %s/*/state` before `docker compose up`",
            CONTAINER_UID,
            CONTAINER_UID,
            CONTAINER_UID,
            out,
        )

    services: dict[str, Any] = {}
    for name, port, status_port in zip(names, ports, status_ports, strict=True):
        site_dir = out / name
        local = yaml.safe_load((site_dir / "site.yaml").read_text(encoding="utf-8"))
        state = site_dir / "state"
        for suffix in ("sign", "kex"):
            key = state / "keys" / f"{name}.{suffix}.pem"
            if not key.exists():
                raise UserError(f"{key}: missing — provision again or run `p2pfl-node keygen`")
        load_or_create_token(state / STATUS_TOKEN_FILE)  # provision wrote it; older dirs

        volumes: list[dict[str, Any]] = [
            {"type": "bind", "source": f"./{name}/state", "target": CONTAINER_STATE_DIR},
            {
                "type": "bind",
                "source": f"./{COMPOSE_DIR}",
                "target": CONTAINER_CONFIG_DIR,
                "read_only": True,
            },
        ]
        data_mounts: dict[str, str] = {}
        source = local.get("data", {}).get("source", "digits")
        if source != "digits":
            host = Path(source) if Path(source).is_absolute() else (site_dir / source).resolve()
            target = f"{CONTAINER_DATA_DIR}/{host.name}"
            data_mounts[source] = target
            volumes.append(
                {"type": "bind", "source": str(host), "target": target, "read_only": True}
            )
        site_cfg = compose_site_config(local, name, data_mounts)
        (compose_dir / f"{name}.site.yaml").write_text(
            yaml.safe_dump(site_cfg, sort_keys=False), encoding="utf-8"
        )
        services[name] = {
            "image": f"${{P2PFL_IMAGE:-{image}}}",
            "user": f"{uid}:{gid}",
            "hostname": name,
            "command": ["--config", f"{CONTAINER_CONFIG_DIR}/{name}.site.yaml"],
            "ports": [
                f"127.0.0.1:{port}:{CONTAINER_PEER_PORT}",
                f"127.0.0.1:{status_port}:{CONTAINER_STATUS_PORT}",
            ],
            "volumes": volumes,
            # HOME belongs to the image's user; caches go to the container's /tmp.
            "environment": {
                "OMP_NUM_THREADS": "1",
                "XDG_CACHE_HOME": "/tmp/cache",
                "MPLCONFIGDIR": "/tmp/matplotlib",
            },
            "healthcheck": {
                "test": ["CMD", "python", "-m", "node.deploy", "healthcheck", "--url", HEALTHZ_URL],
                "interval": "30s",
                "timeout": "5s",
                "start_period": "60s",
                "retries": 3,
            },
            "restart": "unless-stopped",
            "stop_signal": "SIGTERM",
            "stop_grace_period": "30s",
        }
    federation = str(
        yaml.safe_load((out / names[0] / "site.yaml").read_text())
        .get("federation", {})
        .get("id", "local")
    )
    document = {"name": _project_name(federation), "services": services}
    header = (
        "# Written by `p2pfl-node provision --compose`. One service per site; see docs/operations.md.\n"
        "#   docker build -f deploy/Dockerfile -t p2pfl-node:cpu .   (from the repository)\n"
        "#   docker compose up -d          start every site\n"
        "#   docker compose kill -s SIGHUP reload compose/roster.yaml in every site\n"
        "# Status token of site NAME: NAME/state/status.token\n"
    )
    path = out / "compose.yaml"
    path.write_text(header + yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- key rotation


@dataclass(frozen=True)
class RotatedKey:
    card: Card  # new signing key + previous_signing_key/previous_valid_until
    card_path: Path
    signing_key: Path
    retired_key: Path


MAX_GRACE_HOURS = 24 * 366 * 10  # ten years: longer is no grace period


def rotate_signing_key(
    name: str,
    keys_dir: Path,
    *,
    grace_hours: float,
    address: str | None = None,
    now: float | None = None,
) -> RotatedKey:
    """Replace NAME's Ed25519 signing key in `keys_dir`; keep the old one in
    `keys_dir/retired/`. The new card names the old key as `previous_signing_key`,
    valid until now + grace_hours, so peers that load it accept both keys meanwhile.
    The X25519 agreement key is kept: peers encrypt to it, and a card has no grace
    slot for it."""
    # nan, inf or a deadline past a float's range: before, the key was replaced
    # and the card written with a deadline every roster refuses (a third review)
    if not (0 <= grace_hours <= MAX_GRACE_HOURS):
        raise UserError(
            f"--grace-hours {grace_hours}: must be a number of hours from 0 to {MAX_GRACE_HOURS}"
        )
    keys_dir = Path(keys_dir)
    sign_path = keys_dir / f"{name}.sign.pem"
    kex_path = keys_dir / f"{name}.kex.pem"
    current = LocalIdentity.load(name, sign_path, kex_path)
    card_path = keys_dir / f"{name}.card.yaml"
    published = load_card(card_path) if card_path.exists() else None
    if address is None:
        address = published.address if published is not None else ADDRESS_PLACEHOLDER
    # The grace key is the one peers trust: the card's. It differs from the key
    # on disk only when a rotation crashed between writing the new key and the
    # new card; rotating from the unpublished key then left the published one
    # without its grace period (a key review).
    previous = published.signing_key if published is not None else b64(current.signing_public)
    now = time.time() if now is None else now
    retired_dir = keys_dir / "retired"
    retired_dir.mkdir(mode=0o700, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    retired = retired_dir / f"{name}.sign.{stamp}.pem"
    # copy first (a crash leaves the old key in place), 0600 from the start
    atomic_write_bytes(retired, sign_path.read_bytes(), mode=0o600)
    rotated = LocalIdentity.generate(name)
    rotated.agreement = current.agreement
    rotated.save(keys_dir)
    card = Card(
        name,
        address,
        b64(rotated.signing_public),
        b64(rotated.agreement_public),
        previous_signing_key=previous,
        previous_valid_until=round(now + grace_hours * 3600.0, 3),
    )
    # the deadline, signed by the new key the peers confirm by its fingerprint
    card = replace(card, grace_signature=b64(rotated.sign(grace_message(card))))
    text = yaml.safe_dump(card.to_dict(), sort_keys=False)
    atomic_write_text(card_path, text, mode=PUBLIC_FILE)  # public: the card peers get
    return RotatedKey(card, card_path, sign_path, retired)


def run_rotate(args: argparse.Namespace) -> int:
    """`p2pfl-node keygen --rotate --name NAME --out DIR [--grace-hours H]`."""
    rotated = rotate_signing_key(
        args.name, Path(args.out), grace_hours=args.grace_hours, address=args.address
    )
    until = time.strftime(
        "%Y-%m-%d %H:%M:%S UTC", time.gmtime(rotated.card.previous_valid_until or 0)
    )
    print(
        f"# new signing key {rotated.signing_key}; the old one is kept in {rotated.retired_key}",
        file=sys.stderr,
    )
    print(
        f"# fingerprint (read it to each peer by phone): {rotated.card.fingerprint()}",
        file=sys.stderr,
    )
    print(
        f"# peers accept both keys until {until}. Send this card (also in {rotated.card_path}) "
        "to every site; each runs `p2pfl-node roster add CARD` and reloads (SIGHUP). "
        "Then add it to your own roster and restart your node.",
        file=sys.stderr,
    )
    print(yaml.safe_dump(rotated.card.to_dict(), sort_keys=False), end="")
    return 0


# ----------------------------------------------------------------------------- health check


def healthcheck(url: str = HEALTHZ_URL, timeout: float = 5.0) -> bool:
    """True when the status endpoint's /healthz answers 200 "ok"."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - the node's own status port
            return resp.status == 200 and resp.read().strip() == b"ok"
    except (OSError, urllib.error.URLError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.deploy")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("healthcheck", help="exit 0 when the node's /healthz answers ok")
    p.add_argument("--url", default=os.environ.get("P2PFL_HEALTHZ_URL", HEALTHZ_URL))
    p.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    healthy = healthcheck(args.url, args.timeout)
    if not healthy:
        print(f"unhealthy: no 'ok' from {args.url}", file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
