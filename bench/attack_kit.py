"""What every attack scenario shares (bench/attacks.py, bench/attacks_review.py,
bench/attack_harness.py): the options, verdicts, the raw attacker (`RawPeer`),
a victim's counters, small federations and the registry of scenarios.

The registry (`SCENARIOS`, `GROUPS`) is filled by bench/attacks.py with its
own scenarios and bench/attacks_review.py's, so the modules that define
scenarios import this one and never each other's runner.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.federation import read_metrics
from bench.localfed import LocalFederation, NodeProcess
from node.membership import HEARTBEAT
from node.outbound import REQUEST_PREFIX
from node.provision import SitePlan, deep_merge, provision
from node.transport import MESSAGE_PATH
from p2pfl.learning.data.partition import partition_dataset
from p2pfl.secure import tensors
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec, WireError

FEDERATION = "bench-attacks"
OUTCOMES = ("refused", "neutralised", "succeeded")
# Answers that say "not now", not "refused": an input answered so passed the
# wire checks and reached the node's handler.
NOT_A_DEFENCE = frozenset(
    {"not_ready", "no_handler", "handler_error", "rate_limited", "queue_full", "truncated"}
)
REPLAY_REASONS = ("replayed", "stale_timestamp")
FIXED_POINT_BITS = 20  # protocols/masking.py: masked entries are round(x * 2^20) mod 2^64
MASKED_WEIGHT_KEY = "$weight"

# Loopback timings: peers notice each other and failures within seconds.
TRANSPORT = {
    "heartbeat_s": 0.5,
    "suspect_after_s": 3.0,
    "dead_after_s": 6.0,
    "retries": 1,
    "backoff_base_s": 0.05,
    "breaker_reset_s": 2.0,
    "request_timeout_s": 30.0,
}
# FedER's generator, as small as it trains (tests/test_feder.py uses it too).
TINY_GAN = {
    "resolution": 16,
    "z_dim": 16,
    "w_dim": 16,
    "mapping_layers": 2,
    "channel_base": 128,
    "channel_max": 16,
    "batch_size": 8,
    "lpips_backbone": "random",
    "device": "cpu",
    "iterations": 12,
    "stage1_patience": 12,
    "stage2_iterations": 6,
    "quality_every": 6,
    "quality_samples": 16,
    "train_reference": False,
    "checkpoint_every": 6,
}

_T0 = time.monotonic()


def say(message: str) -> None:
    """Progress, on stderr (stdout's last line is the result)."""
    print(f"[attacks {time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Options:
    out: Path
    seed: int = 0
    bound: float = 0.05  # macro-F1 (0-1) a neutralised attack may cost the honest nodes
    timeout_s: float = 600.0  # per federation
    inflation_factor: float = 100.0
    inflation_share: float = 0.006
    inflation_nodes: int = 5
    sgd_scale: float = 1000.0
    feder_scale: float = 1000.0


# ---------------------------------------------------------------------- verdicts


def verdict(outcome: str, hole: str, why: str, **evidence: Any) -> dict[str, Any]:
    assert outcome in OUTCOMES, outcome
    return {"outcome": outcome, "hole": hole, "why": why, **evidence}


def inconclusive(hole: str, why: str, **evidence: Any) -> dict[str, Any]:
    """The attack could not be carried out: no defence shown, so not defended."""
    return verdict("succeeded", hole, why, inconclusive=True, **evidence)


def combine(parts: dict[str, str]) -> str:
    """One outcome for several inputs: succeeded if any did, refused if all were."""
    values = set(parts.values())
    if "succeeded" in values:
        return "succeeded"
    return "refused" if values == {"refused"} else "neutralised"


# ---------------------------------------------------------------------- the raw attacker


@dataclass
class Reply:
    status: int  # 0: no HTTP answer at all
    reason: str | None
    body: bytes

    @property
    def accepted(self) -> bool:
        return self.status == 200

    def brief(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason}


class RawPeer:
    """A roster member played by the bench: its own keys (or any identity it is
    handed, for forgeries), a WireCodec, plain HTTP POSTs to the victims' peer ports."""

    def __init__(
        self,
        fed_dir: Path,
        name: str,
        ports: dict[str, int],
        *,
        identity: LocalIdentity | None = None,
        federation: str = FEDERATION,
        encrypt: bool = False,
    ) -> None:
        if identity is None:
            keys = fed_dir / name / "state" / "keys"
            identity = LocalIdentity.load(name, keys / f"{name}.sign.pem", keys / f"{name}.kex.pem")
        self.name = identity.name
        self.codec = WireCodec(identity, Roster.load(fed_dir / "roster.yaml"), federation)
        self.ports = ports
        self.encrypt = encrypt  # as the victims' `wire.encryption`, unless a call says otherwise

    def frame(
        self, kind: str, to: str, payload: Any, *, round: int = 0, encrypt: bool | None = None
    ) -> bytes:
        """The bytes this member's daemon would send (same codec, same header)."""
        encrypt = self.encrypt if encrypt is None else encrypt
        return self.codec.encode(kind, to, payload, round=round, encrypt=encrypt).to_bytes()

    def post(self, to: str, frame: bytes, timeout: float = 30.0) -> Reply:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.ports[to]}{MESSAGE_PATH}", data=frame, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
                return Reply(resp.status, None, resp.read())
        except urllib.error.HTTPError as err:
            body = err.read()
            try:
                reason = json.loads(body).get("reason")
            except (ValueError, AttributeError):
                reason = None
            return Reply(err.code, reason, body)
        except (OSError, urllib.error.URLError) as exc:
            return Reply(0, f"unreachable: {exc}", b"")

    def request(
        self,
        to: str,
        kind: str,
        query: dict[str, Any],
        *,
        round: int = 0,
        encrypt: bool | None = None,
        wait_s: float = 5.0,
    ) -> tuple[Reply, Any]:
        """A `req:<kind>` as a daemon sends it; the verified, decoded answer or None."""
        frame = self.frame(
            REQUEST_PREFIX + kind, to, {**query, "_wait_s": wait_s}, round=round, encrypt=encrypt
        )
        reply = self.post(to, frame, timeout=wait_s + 30.0)
        if not reply.accepted:
            return reply, None
        try:
            delivered = self.codec.decode(bytearray(reply.body))
        except WireError as exc:
            return Reply(reply.status, f"unverifiable_answer: {exc.reason}", b""), None
        return reply, delivered.payload


def heartbeat_payload(
    round: int = 0, phase: str = "done", *, done: bool = True, bye: bool = True
) -> dict[str, Any]:
    """A heartbeat as node/membership.py sends it."""
    return {
        "round": round,
        "phase": phase,
        "done": done,
        "bye": bye,
        "meta": {},
        "edges": [],
        "choices": [],
    }


def probe_payload(sender: str, round: int) -> dict[str, Any]:
    """A push as protocols/probe.py makes it (a small tensor)."""
    return {"round": round, "from": sender, "tensor": torch.randn(256)}


# ---------------------------------------------------------------------- what a victim shows


@dataclass
class Counters:
    """A victim's /status counters at one moment."""

    rejected: dict[str, int] = field(default_factory=dict)
    by_peer: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)  # verified messages by kind

    @classmethod
    def of(cls, node: NodeProcess) -> Counters:
        status = node.status() or {}
        received = ((status.get("messages") or {}).get("received") or {}).get("by_kind") or {}
        return cls(
            dict(status.get("rejected") or {}),
            dict(status.get("rejected_by_peer") or {}),
            dict(received),
        )

    def rise(self, later: Counters) -> dict[str, int]:
        """Rejection reasons counted between this reading and `later`."""
        return {
            k: n - self.rejected.get(k, 0)
            for k, n in later.rejected.items()
            if n > self.rejected.get(k, 0)
        }


def refused_and_counted(reply: Reply, before: Counters, after: Counters) -> bool:
    """The victim refused this input (not merely 'not now') and counted the reason."""
    return (
        not reply.accepted
        and reply.status != 0
        and reply.reason is not None
        and reply.reason not in NOT_A_DEFENCE
        and after.rejected.get(reply.reason, 0) > before.rejected.get(reply.reason, 0)
    )


def send_and_watch(
    attacker: RawPeer, victim: NodeProcess, frame: bytes
) -> tuple[Reply, Counters, Counters]:
    before = Counters.of(victim)
    reply = attacker.post(victim.name, frame)
    time.sleep(0.1)  # the counter is bumped before the answer goes out; margin for /status
    return reply, before, Counters.of(victim)


def judge_input(reply: Reply, before: Counters, after: Counters) -> dict[str, Any]:
    """One input sent to a victim: refused (and counted) or it got through."""
    row = reply.brief() | {"counted": before.rise(after)}
    row["outcome"] = "refused" if refused_and_counted(reply, before, after) else "succeeded"
    return row


# ---------------------------------------------------------------------- federations


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


class Heartbeats:
    """A raw member that looks alive: a heartbeat to each daemon every half second
    (bounded), and a goodbye when stopped."""

    def __init__(self, member: RawPeer, to: list[str], round: int, *, max_s: float) -> None:
        self.member, self.to, self.round, self.max_s = member, to, round, max_s
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _beat(self, bye: bool) -> None:
        for name in self.to:
            payload = heartbeat_payload(self.round, "exchange", done=False, bye=bye)
            self.member.post(name, self.member.frame(HEARTBEAT, name, payload, round=self.round))

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            self._beat(bye=False)
            self.stop_event.wait(0.5)

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join(10)
        self._beat(bye=True)


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


def judge_damage(
    hole: str,
    reference: dict[str, Any],
    attacked: dict[str, Any],
    bound: float,
    rejected_from_attacker: int,
    reasons: dict[str, int],
    **evidence: Any,
) -> dict[str, Any]:
    """Learning attacks: the honest nodes' final macro-F1 against the same
    federation without the attack. Beyond `bound`: succeeded. Within it:
    refused if the victims counted the attacker's inputs as refused (a reason
    that rose against the reference run, other than a cap); neutralised if
    they took them, capped (`*_capped`) or not."""
    clean, hit = reference["final"], attacked["final"]
    evidence |= {
        "honest_macro_f1_reference": reference,
        "honest_macro_f1_attacked": attacked,
        "bound": bound,
        "rejected_from_attacker": rejected_from_attacker,
        "reasons_counted_by_victims": reasons,
    }
    if clean is None or hit is None:
        return inconclusive(hole, "no final macro-F1 to compare", **evidence)
    drop = round(clean - hit, 4)
    evidence["macro_f1_drop"] = drop
    if drop > bound:
        return verdict(
            "succeeded", hole, f"honest macro-F1 {drop:+.3f} below the clean run", **evidence
        )
    refusals = {r: n for r, n in reasons.items() if not r.endswith("_capped")}
    if rejected_from_attacker > 0 and refusals:
        return verdict(
            "refused",
            hole,
            f"the victims refused and counted the attacker's inputs: {refusals}",
            **evidence,
        )
    capped = {r: n for r, n in reasons.items() if r.endswith("_capped")}
    return verdict(
        "neutralised",
        hole,
        f"honest macro-F1 within {bound} of the clean run"
        + (f"; counted caps {capped}" if capped else ""),
        **evidence,
    )


def reason_rise(
    reference: dict[str, dict[str, Any]], attacked: dict[str, dict[str, Any]], attacker: str
) -> dict[str, int]:
    """Rejection reasons the honest nodes counted in the attacked run beyond the reference run."""
    totals: dict[str, int] = {}
    for statuses, sign in ((attacked, 1), (reference, -1)):
        for name, status in statuses.items():
            if name == attacker:
                continue
            for reason, n in (status.get("rejected") or {}).items():
                totals[reason] = totals.get(reason, 0) + sign * int(n)
    return {r: n for r, n in sorted(totals.items()) if n > 0}


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


# ---------------------------------------------------------------------- the registry

# name -> (hole, group), and group -> its runner: filled by bench/attacks.py.
SCENARIOS: dict[str, tuple[str, str]] = {}
GROUPS: dict[str, Callable[[Options, set[str]], dict[str, dict[str, Any]]]] = {}


def guarded(name: str, step: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One scenario's verdict; a failure of the harness is an inconclusive verdict."""
    try:
        return step()
    except Exception as exc:  # noqa: BLE001 - reported as the scenario's result
        say(f"  {name}: could not be carried out: {exc!r}")
        return inconclusive(SCENARIOS[name][0], f"harness error: {type(exc).__name__}: {exc}"[:600])
