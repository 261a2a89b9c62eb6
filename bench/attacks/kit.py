"""What every attack scenario shares: the options, verdicts, what a victim's
counters show, progress output and the registry of scenarios.

The registry (`SCENARIOS`, `GROUPS`) is filled by bench/attacks/runner.py
from the scenario modules, so a module that defines scenarios imports this
one and never another's runner.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.localfed import NodeProcess
from bench.peer import RawPeer, Reply

FEDERATION = "bench-attacks"
OUTCOMES = ("refused", "neutralised", "succeeded")
# Answers that say "not now", not "refused": an input answered so passed the
# wire checks and reached the node's handler.
NOT_A_DEFENCE = frozenset(
    {"not_ready", "no_handler", "handler_error", "rate_limited", "queue_full", "truncated"}
)
REPLAY_REASONS = ("replayed", "stale_timestamp")
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


# ---------------------------------------------------------------------- what a victim shows


def probe_payload(sender: str, round_no: int) -> dict[str, Any]:
    """A push as protocols/probe.py makes it (a small tensor)."""
    return {"round": round_no, "from": sender, "tensor": torch.randn(256)}


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


# ---------------------------------------------------------------------- the registry


# name -> (hole, group), and group -> its runner: filled by bench/attacks/runner.py.
SCENARIOS: dict[str, tuple[str, str]] = {}
GROUPS: dict[str, Callable[[Options, set[str]], dict[str, dict[str, Any]]]] = {}


def guarded(name: str, step: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One scenario's verdict; a failure of the harness is an inconclusive verdict."""
    try:
        return step()
    except Exception as exc:  # noqa: BLE001 - reported as the scenario's result
        say(f"  {name}: could not be carried out: {exc!r}")
        return inconclusive(SCENARIOS[name][0], f"harness error: {type(exc).__name__}: {exc}"[:600])
