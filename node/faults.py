"""Fault injection for drills and the fault tests (never from site.yaml).

A node started with `P2PFL_FAULTS=/path/faults.json` in its environment reads
that file at start and again whenever it changes, at each round or phase
change. Nothing else turns faults on, so a production config cannot enable
them by accident, and a node with a fault plan says so loudly in its log.

    {
      "kill":      [{"id": "k1", "round": 3, "phase": "train", "delay_s": 0.2}],
      "partition": [{"from_round": 3, "to_round": 6}],
      "latency_s": 1.5,
      "slow_train": 4,
      "poison":    {"kind": "model", "mode": "scaled_random", "scale": 5.0, "from_round": 1}
    }

- kill: SIGKILL this process `delay_s` after it enters `phase` of `round`
  (phases: train, exchange, aggregate = right after the neighbours' models
  were received, evaluate, acked = right after acknowledging a push of
  that round or a later one, checkpointed = right after the checkpoint
  of `round` is written, before the ids it consumed are journaled,
  asked:KIND[:STEP] = on receiving a request of that kind (and `phase` in
  its query) from a peer in `round`, before answering it, and
  answered:KIND[:STEP] = right after answering one; e.g. asked:secagg:mask is
  a secure-aggregation contributor gone after the others masked with it,
  before its own masked input). Each kill
  fires once: its id is appended to `<file>.fired` before the signal, so a
  restarted node does not fire it again. A relay (`p2pfl-node relay`) reads
  the same plan, for kills only: its one phase is `forward`, on the first
  frame it is about to carry whose signed header says `round` or later.
- partition: while this node's round is in [from_round, to_round) it is cut
  off both ways: every outgoing post fails, every incoming connection is
  closed without an answer. It heals by itself.
- latency_s: every answer to a peer (acknowledgement or request response,
  not heartbeats) is delayed this long: a slow peer (a finite number >= 0).
- slow_train: a site FACTOR x slower (a number in [1, 1000]; 1 = off): after each
  local training (the round's train phase) the node waits (FACTOR - 1) x
  that training's duration, off the event loop (it keeps answering peers and
  heartbeats meanwhile). Its model is offered when the real training ends,
  so within a round its neighbours may get it before the wait is over; its
  own rounds (exchange, evaluation, next training) all start later, so its
  pace is FACTOR x slower in training, and a synchronous federation waits for
  its next model. Each wait is an event `slow_train`. The round skeleton
  calls it (protocols/rounds.py, `after_training` of the node's context).
- poison: replace what this node serves for requests of `kind` (from
  `from_round` on) — the attacks of a compromised peer: `nan`, `inf`,
  `shape`, `dtype`, `huge_norm` (x 1e6), `scaled_random` (random tensors with
  `scale` times each tensor's norm), `forged` (signed with a key not in the
  roster), `replayed` (the first answer it ever gave, byte for byte), or
  `cycle` (each of those in turn); and `inflated_count`, the answer with its
  claimed sample count (a model's `num_train`, a gradient's `batch_size`)
  multiplied by `scale` and its tensors untouched: a site that claims more
  data than it holds, to weigh more in its neighbours' means (not in `cycle`,
  whose attacks a receiver must all refuse).

Every event is appended to `<file>.events.jsonl` with a wall-clock time, so a
test can line it up with the nodes' metrics.

The daemon calls the plan at a few fixed places (round and phase changes, each
acknowledged push, each answer); what a plan does to a running node (cutting
its links, answering like a compromised peer) is here too, not in the daemon.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pfl.files import append_lines
from p2pfl.secure.identity import LocalIdentity
from p2pfl.secure.wire import Header, WireCodec

if TYPE_CHECKING:
    from torch import Tensor

    from node.transport import MessageServer
    from node.transport_client import MessageClient

log = logging.getLogger(__name__)

ENV = "P2PFL_FAULTS"
CYCLE_MODES = ("nan", "inf", "shape", "dtype", "huge_norm", "scaled_random", "forged", "replayed")
POISON_MODES = (*CYCLE_MODES, "inflated_count")
COUNT_KEYS = ("num_train", "batch_size")  # what `inflated_count` multiplies
WIRE_MODES = ("forged", "replayed")  # done by the daemon on the encoded answer
# slow_train's largest FACTOR: beyond it a slip of the operator's keyboard (1e9)
# would park the node in one training's wait for years, not slow it down.
MAX_SLOW_TRAIN = 1000.0


class FaultPlan:
    """The faults configured for this process; all methods are cheap no-ops without a plan."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._mtime: float | None = None
        self.kills: list[dict[str, Any]] = []
        self.partitions: list[tuple[int, int]] = []
        self.latency_s = 0.0
        self.slow_train = 1.0
        self.poison: dict[str, Any] | None = None
        self.fired: set[str] = set()
        self.isolated = False
        self._poison_count = 0
        self._first_reply: dict[str, list[bytes | memoryview]] = {}  # per requester, for `replayed`
        if path is not None:
            self.reload(force=True)

    @classmethod
    def from_env(cls) -> FaultPlan:
        value = os.environ.get(ENV, "").strip()
        return cls(Path(value) if value else None)

    @property
    def active(self) -> bool:
        return self.path is not None

    # ------------------------------------------------------------------ the file
    def reload(self, force: bool = False) -> None:
        """Re-read the plan when the file changed. A bad file is logged, not fatal."""
        if self.path is None:
            return
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return
        if not force and mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            # Everything is read before anything is set: a bad file changes nothing.
            raw = json.loads(self.path.read_text())
            kills = [dict(k) for k in raw.get("kill", [])]
            partitions = [
                (int(p["from_round"]), int(p["to_round"])) for p in raw.get("partition", [])
            ]
            latency_s = float(raw.get("latency_s", 0.0))
            if not 0.0 <= latency_s < math.inf:  # NaN in asyncio's timer heap breaks its order
                raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s!r}")
            slow_train = parse_slow_train(raw.get("slow_train", 1.0))
            poison = raw.get("poison")
            if poison is not None and poison.get("mode") not in (*POISON_MODES, "cycle"):
                raise ValueError(f"poison.mode must be one of {POISON_MODES + ('cycle',)}")
            self.kills, self.partitions, self.latency_s = kills, partitions, latency_s
            self.poison = dict(poison) if poison else None
            self.slow_train = slow_train
        except (OSError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as exc:
            # ArithmeticError: float(10**400), int(1e999) (JSON allows both)
            log.error("FAULT INJECTION: cannot read %s (%s); plan unchanged", self.path, exc)
            return
        fired_path = self._sidecar(".fired")
        if fired_path.exists():
            self.fired = set(fired_path.read_text().split())
        log.warning(
            "FAULT INJECTION ACTIVE (%s): kill=%s partition=%s latency_s=%s slow_train=%s "
            "poison=%s",
            self.path,
            [k for k in self.kills if str(k.get("id")) not in self.fired],
            self.partitions,
            self.latency_s,
            self.slow_train,
            self.poison,
        )

    def _sidecar(self, suffix: str) -> Path:
        assert self.path is not None
        return self.path.with_name(self.path.name + suffix)

    def event(self, name: str, **fields: Any) -> None:
        if self.path is None:
            return
        line = json.dumps({"t": round(time.time(), 3), "event": name, **fields})
        append_lines(self._sidecar(".events.jsonl"), [line])

    # ------------------------------------------------------------------ hooks
    def on_progress(
        self,
        round_no: int,
        phase: str,
        *,
        own: bool = True,
        state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """Called by the node at every round and phase change (`own`), and for
        each request it is asked or answers (`own=False`: `round_no` is then
        the requester's round, which may trigger a kill but never moves this
        node's partition: that follows its own rounds only). `state()`, if
        given, goes into a kill's event: what the process had counted when it
        died (a relay's forwarded counters; nothing else can read them then)."""
        if self.path is None:
            return
        self.reload()
        isolated = any(a <= round_no < b for a, b in self.partitions) if own else self.isolated
        if isolated != self.isolated:
            self.isolated = isolated
            self.event("partition_start" if isolated else "partition_end", round=round_no)
            log.warning(
                "FAULT INJECTION: partition %s at round %d",
                "on" if isolated else "healed",
                round_no,
            )
        for kill in self.kills:
            kid = str(kill.get("id", f"{kill.get('round')}-{kill.get('phase')}"))
            if kid in self.fired or kill.get("phase") != phase:
                continue
            at = int(kill.get("round", -1))
            # A push's round is the sender's: after a restart this node may only
            # ever see later rounds, so an `acked` kill takes the first at or after;
            # so does a relay's `forward` (the first frame it carries of that round
            # or later: it has no round of its own).
            if round_no != at and not (phase in ("acked", "forward") and round_no > at):
                continue
            self.fired.add(kid)
            append_lines(self._sidecar(".fired"), [kid])
            delay = float(kill.get("delay_s", 0.0))
            extra = {"state": state()} if state is not None else {}
            self.event("kill", id=kid, round=round_no, phase=phase, delay_s=delay, **extra)
            log.warning("FAULT INJECTION: SIGKILL in %.2f s (round %d, %s)", delay, round_no, phase)
            if delay <= 0:
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                asyncio.get_running_loop().call_later(delay, os.kill, os.getpid(), signal.SIGKILL)

    async def after_training(self, round_no: int, train_s: float) -> float:
        """The slow_train drill: wait (FACTOR - 1) x `train_s`, the duration of
        the local training that just ended, without blocking the event loop;
        returns the seconds waited (0 without the drill)."""
        if self.path is None:
            return 0.0
        self.reload()
        extra = (self.slow_train - 1.0) * max(0.0, train_s)
        if extra <= 0:
            return 0.0
        self.event(
            "slow_train",
            round=round_no,
            factor=self.slow_train,
            train_s=round(train_s, 4),
            wait_s=round(extra, 4),
        )
        await asyncio.sleep(extra)
        return extra

    def poison_mode(self, kind: str, round_no: int) -> str | None:
        """The attack to apply to this answer of `kind`, or None."""
        p = self.poison
        if p is None or p.get("kind", "model") != kind or round_no < int(p.get("from_round", 0)):
            return None
        mode = str(p["mode"])
        if mode == "cycle":
            mode = CYCLE_MODES[self._poison_count % len(CYCLE_MODES)]
        self._poison_count += 1
        return mode

    def poison_payload(self, payload: Any, mode: str) -> Any:
        """Corrupt every tensor map in the payload (a served model's `state`)."""
        if mode in WIRE_MODES or not isinstance(payload, dict):
            return payload
        scale = float((self.poison or {}).get("scale", 5.0))
        from torch import Tensor  # a poisoning node only

        out = dict(payload)
        if mode == "inflated_count":
            for key in COUNT_KEYS:
                if isinstance(out.get(key), int) and not isinstance(out[key], bool):
                    out[key] = max(1, round(out[key] * scale))
            return out
        for key, value in payload.items():
            if (
                isinstance(value, dict)
                and value
                and all(isinstance(v, Tensor) for v in value.values())
            ):
                out[key] = {k: _poison_tensor(t, mode, scale, k) for k, t in value.items()}
        return out

    # ------------------------------------------------------------------ on a running node
    def partition(self, server: MessageServer, client: MessageClient) -> None:
        """Cut the node's links both ways while the plan isolates it; heal them after."""
        server.isolated = self.isolated
        for link in client.links.values():
            link.blocked = self.isolated

    def poisoned_reply(
        self,
        codec: WireCodec,
        request: Header,
        kind: str,
        reply_kind: str,
        payload: Any,
        *,
        encrypt: bool,
    ) -> list[bytes | memoryview] | None:
        """The frame a compromised peer would answer this request of `kind` with,
        or None when the plan poisons nothing here (answer honestly)."""
        attack = self.poison_mode(kind, request.round)
        if attack is None:
            return None
        self.event("poison", mode=attack, to=request.sender, round=request.round)
        if attack == "replayed":
            if request.sender in self._first_reply:
                return self._first_reply[request.sender]
            attack = "nan"  # nothing to replay yet
        if attack == "forged":
            codec = WireCodec(
                LocalIdentity.generate(codec.identity.name), codec.roster, codec.federation
            )
        if attack not in WIRE_MODES:
            payload = self.poison_payload(payload, attack)
        reply = codec.encode(
            reply_kind,
            request.sender,
            payload,
            round=request.round,
            encrypt=encrypt and attack != "forged",
        )
        self.remember_reply(request.sender, reply.chunks)
        return reply.chunks

    def remember_reply(self, requester: str, chunks: list[bytes | memoryview]) -> None:
        """Keep the first answer each requester got, byte for byte, to replay it later."""
        if requester not in self._first_reply:
            self._first_reply[requester] = [bytes(c) for c in chunks]


def parse_slow_train(value: Any) -> float:
    """The plan's `slow_train` FACTOR: a finite number in [1, MAX_SLOW_TRAIN];
    ValueError (the plan is then left unchanged, logged) for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"slow_train must be a number >= 1, got {value!r}")
    # compared before float(): float(10**400) raises OverflowError
    if value > MAX_SLOW_TRAIN:
        raise ValueError(f"slow_train must be a number <= {MAX_SLOW_TRAIN:g}, got {value!r}"[:200])
    factor = float(value)
    if not math.isfinite(factor) or factor < 1.0:
        raise ValueError(
            f"slow_train must be a finite number >= 1 (a site FACTOR x slower), got {value!r}"
        )
    return factor


def _poison_tensor(t: Tensor, mode: str, scale: float, name: str = "") -> Tensor:
    import torch  # only a poisoning node gets here: a relay's plan never imports torch

    if not t.is_floating_point():
        return t
    if mode == "nan":
        return torch.full_like(t, float("nan"))
    if mode == "inf":
        return torch.full_like(t, float("inf"))
    if mode == "shape":
        return torch.zeros(t.numel() + 1, dtype=t.dtype)
    if mode == "dtype":
        return t.to(torch.float64)
    if mode == "huge_norm":
        return t * 1e6
    if mode == "scaled_random":
        noise = torch.randn_like(t)
        if name.endswith("running_var"):  # a negative variance is refused (checks.admit)
            noise = noise.abs()
        return noise * (scale * float(t.norm()) / max(float(noise.norm()), 1e-12))
    raise ValueError(f"unknown poison mode {mode}")
