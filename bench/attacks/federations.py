"""The small daemon federations the attack scenarios run: digits split among
the sites, provisioned with loopback timings, started, waited for and read
back (checkpoints, merge ledgers, metrics)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from bench.attacks.kit import FEDERATION, TRANSPORT, say
from bench.federation import read_metrics
from bench.localfed import LocalFederation, NodeProcess
from bench.peer import RawPeer, heartbeat_payload
from node.membership import HEARTBEAT
from node.provision import SitePlan, deep_merge, provision
from p2pfl.learning.data.partition import partition_dataset
from p2pfl.secure import tensors


def site_data(
    folder: Path, sites: int, seed: int, label_fraction: float | None = None
) -> list[Path]:
    """digits split iid among `sites`; every site scored on the whole test split."""
    summary = partition_dataset(
        "digits", sites, "iid", folder, label_fraction=label_fraction, seed=seed, test="global"
    )
    return [folder / row["file"] for row in summary["per_site"]]


def overrides(**extra: Any) -> dict[str, Any]:
    base = {
        "node": {"startup_wait_s": 30.0, "exit_when_done": False},
        "transport": TRANSPORT,
        "training": {"epochs": 1, "batch_size": 32, "lr": 3e-3, "threads": 1},
        "data": {"image_size": 16, "augment": "none"},
    }
    return deep_merge(base, extra)


def provisioned(
    folder: Path,
    names: list[str],
    protocol: dict[str, Any],
    seed: int,
    *,
    federation: str = FEDERATION,
    label_fraction: float | None = None,
    **extra: Any,
) -> tuple[list[SitePlan], dict[str, int]]:
    """A bench federation in `folder`: digits split among `names` (data/),
    provisioned (fed/) with `protocol` and the bench's overrides plus `extra`;
    the plans and every site's peer port."""
    sources = site_data(folder / "data", len(names), seed, label_fraction=label_fraction)
    plans = provision(
        folder / "fed",
        names,
        protocol=protocol,
        data_sources=[str(src) for src in sources],
        federation=federation,
        seed=seed,
        overrides=overrides(**extra),
    )
    return plans, {p.name: p.port for p in plans}


def fresh(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def write_plan(path: Path, plan: dict[str, Any]) -> Path:
    path.write_text(json.dumps(plan))
    return path


def poison_events(plan_path: Path | None) -> list[dict[str, Any]]:
    if plan_path is None:
        return []
    p = plan_path.with_name(plan_path.name + ".events.jsonl")
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def state_dir(plan: SitePlan) -> Path:
    return plan.config_path.parent / "state"


def checkpoints(plan: SitePlan) -> list[dict[str, Any]]:
    """Every checkpoint the node still keeps (the latest 3), oldest first."""
    out = []
    for path in sorted((state_dir(plan) / "checkpoints").glob("ckpt-*.bin")):
        try:
            out.append(tensors.decode(bytearray(path.read_bytes()))["state"])
        except (tensors.CodecError, KeyError, OSError):
            continue
    return out


def ledger(plan: SitePlan) -> dict[int, set[str]]:
    """Round -> the peers whose models the node merged in that round."""
    saved = checkpoints(plan)
    if not saved:
        return {}
    merged = saved[-1].get("protocol", {}).get("merged", [])
    return {int(r): {str(p) for p, _ in models} for r, models in merged}


def wait_done(fed: LocalFederation, rounds: int, timeout: float) -> dict[str, dict[str, Any]]:
    """Until every daemon's protocol is done with `rounds`; their last statuses."""
    deadline = time.monotonic() + timeout
    out = {}
    for name, node in fed.nodes.items():
        status = node.wait_for(
            lambda s: s.get("phase") in ("done", "failed"),
            max(1.0, deadline - time.monotonic()),
            f"protocol done ({rounds} rounds)",
        )
        if status["phase"] == "failed" or status.get("round", 0) < rounds:
            raise RuntimeError(f"{name} ended at round {status.get('round')}: {node.log_tail(8)}")
        out[name] = status
    return out


def wait_up(nodes: Iterable[NodeProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for node in nodes:
        node.wait_for(lambda s: True, max(1.0, deadline - time.monotonic()), "status endpoint up")


def farewell(
    members: list[RawPeer], fed: LocalFederation, *, encrypt: bool, timeout: float
) -> None:
    """Roster members without a daemon say goodbye (phase done), so the daemons
    start at once instead of waiting startup_wait_s for them."""
    wait_up(fed.nodes.values(), timeout)
    for member in members:
        for name in fed.nodes:
            frame = member.frame(HEARTBEAT, name, heartbeat_payload(), encrypt=encrypt)
            reply = member.post(name, frame)
            if not reply.accepted:
                say(
                    f"  {member.name}'s goodbye to {name} refused ({reply.reason}); it waits for it"
                )


def honest_macro_f1(plans: list[SitePlan], honest: Iterable[str]) -> dict[str, Any]:
    """Per round, the honest nodes' mean test macro-F1; `final` is the last round's."""
    by_round: dict[int, list[float]] = {}
    names = set(honest)
    for plan in plans:
        if plan.name not in names:
            continue
        for row in read_metrics(state_dir(plan) / "metrics.jsonl"):
            if isinstance(row.get("macro_f1"), int | float):
                by_round.setdefault(int(row["round"]), []).append(float(row["macro_f1"]))
    curve = {r: round(sum(v) / len(v), 4) for r, v in sorted(by_round.items())}
    return {"per_round": curve, "final": curve[max(curve)] if curve else None}


def run_federation(
    label: str,
    plans: list[SitePlan],
    folder: Path,
    *,
    rounds: int,
    timeout: float,
    env: dict[str, dict[str, str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Start every site, wait until all are done, read their statuses, stop them."""
    fed = LocalFederation(plans, folder / "logs")
    for name, extra in (env or {}).items():
        fed[name].env = extra
    started = time.monotonic()
    say(f"  {label}: {len(plans)} daemons, {rounds} rounds")
    with fed:
        statuses = wait_done(fed, rounds, timeout)
    say(f"  {label}: done in {time.monotonic() - started:.0f} s")
    return statuses


def poisoned_relay(plan: SitePlan, scale: float) -> dict[str, Any]:
    """A FedER relay (protocols/feder.py send_relay's payload): the common initial
    model of the federation x `scale` and a small valid synthetic buffer."""
    from genbuffer.buffer import buffer_content_hash
    from p2pfl.config import load_config
    from protocols.site import build_site

    site = build_site(load_config(plan.config_path))
    model = {k: (v * scale if v.is_floating_point() else v) for k, v in site.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (16, 1, 16, 16), dtype=torch.uint8, generator=g)
    labels = torch.arange(16, dtype=torch.int64) % 10
    digest = buffer_content_hash(images, labels)
    return {
        "round": 1,
        "buffer_hash": digest,
        "buffer": {"images": images, "labels": labels, "content_hash": digest},
        "model": model,
        "num_train": site.num_train,
    }
