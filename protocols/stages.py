"""Protocols run as a chain of stages (Fed-MAE, Fed-BEiT): one driver.

A staged protocol declares its stages, each a `RoundLoop` with the rounds it
logs, the prefix of its message kinds and whether its checkpoints are
wrapped; `Staged.run` runs them in order:

    saved = the last checkpoint
    skip the stages before the one `saved` names (a restarted node resumes
        in the stage it was in; a wrapped checkpoint names its stage)
    for each remaining stage:
        its context: the node's own (an unwrapped stage), or a StageContext
            with its config, its kind prefix, and its rounds logged after the
            earlier stages' (round offset = their rounds)
        stage.loop.run_stage(context)     setup, the rounds, finish
    phase "done"

The stages themselves are ordinary round loops (FedAVGP2P's exchange over
another objective, or any classifier protocol for fine-tuning); nothing here
knows what they learn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pfl.config import SiteConfig
from protocols.base import Handler, PeerInfo, Protocol, Received, RoundContext
from protocols.rounds import RoundLoop

FINETUNE_STAGE = "finetune"
FINETUNE_KIND_PREFIX = "finetune."


@dataclass
class Stage:
    """One stage of a chained protocol."""

    name: str
    loop: RoundLoop
    rounds: int  # rounds it logs: later stages' rounds are logged after them
    prefix: str = ""  # put before its message kinds
    wrap: bool = True  # checkpoints as {protocol, stage, <stage>: ...}; False: the node's own
    # Its own site.yaml as the stage sees it (fine-tuning: model.pretrained_from),
    # built when the stage starts; None: the node's.
    config: Callable[[RoundContext], SiteConfig] | None = None


class Staged(Protocol):
    """A protocol made of stages (`stages`), run by one driver."""

    params: Any

    def __init__(self, params: Any) -> None:
        self.params = params
        self.name = params.name  # the one place a protocol's name is written is its params

    def stages(self, config: SiteConfig | None) -> list[Stage]:
        """The stages this node runs with `config`, in order; with None every
        stage it could run (what the message kinds are read from)."""
        raise NotImplementedError

    def message_kinds(self) -> frozenset[str]:
        """Every stage's kinds, each under its stage's prefix."""
        return frozenset(
            stage.prefix + kind
            for stage in self.stages(None)
            for kind in stage.loop.message_kinds()
        )

    def pushed_kinds(self) -> frozenset[str]:
        """Every stage's pushed kinds, each under its stage's prefix."""
        return frozenset(
            stage.prefix + kind for stage in self.stages(None) for kind in stage.loop.pushed_kinds()
        )

    async def run(self, ctx: RoundContext) -> None:
        stages = self.stages(ctx.config)
        saved = ctx.restore() or {}
        names = [s.name for s in stages]
        reached = saved.get("stage") if saved.get("protocol") == self.name else None
        start = names.index(reached) if reached in names else 0
        offset = sum(s.rounds for s in stages[:start])
        for stage in stages[start:]:
            if stage.wrap:
                config = stage.config(ctx) if stage.config is not None else ctx.config
                inner: RoundContext = StageContext(
                    ctx,
                    config,
                    protocol=self.name,
                    round_offset=offset,
                    stage=stage.name,
                    prefix=stage.prefix,
                )
            else:
                inner = ctx
            await stage.loop.run_stage(inner)
            offset += stage.rounds
        ctx.set_phase("done")


class StageContext(RoundContext):
    """The node's context as one stage of a chained run sees it (by default the
    fine-tuning protocol after pre-training): its own config (for fine-tuning,
    `model.pretrained_from` set), message kinds prefixed with `prefix`, rounds
    shown and logged after the earlier stages' (`round_offset`), checkpoints
    wrapped as `{protocol, stage, <stage>: ...}` so a restarted node resumes in
    the stage it was in."""

    def __init__(
        self,
        outer: RoundContext,
        config: SiteConfig,
        *,
        protocol: str,
        round_offset: int,
        stage: str = FINETUNE_STAGE,
        prefix: str = FINETUNE_KIND_PREFIX,
    ) -> None:
        self.outer = outer
        self.me = outer.me
        self.config = config
        self.protocol = protocol
        self.round_offset = round_offset
        self.stage = stage
        self.prefix = prefix

    @property  # type: ignore[override]
    def round(self) -> int:
        return self.outer.round - self.round_offset

    @round.setter
    def round(self, value: int) -> None:
        self.outer.round = value + self.round_offset

    def kind(self, kind: str) -> str:
        return self.prefix + kind

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.outer.set_phase(phase)

    def peers(self, alive_only: bool = True) -> list[PeerInfo]:
        return self.outer.peers(alive_only)

    def roster(self) -> list[str]:
        return self.outer.roster()

    async def send(self, peer: str, kind: str, payload: Any, round_no: int | None = None) -> None:
        await self.outer.send(
            peer, self.kind(kind), payload, self.round if round_no is None else round_no
        )

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        return await self.outer.request(peer, self.kind(kind), query, timeout)

    def serve(self, kind: str, handler: Handler) -> None:
        self.outer.serve(self.kind(kind), handler)

    def inbox(self, kind: str) -> asyncio.Queue[Received]:
        return self.outer.inbox(self.kind(kind))  # pushes were sent with this stage's rounds

    def publish(self, key: str, value: Any) -> None:
        self.outer.publish(key, value)

    async def run_blocking(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await self.outer.run_blocking(fn, *args, **kwargs)

    def checkpoint(self, state: dict[str, Any]) -> None:
        self.outer.checkpoint({"protocol": self.protocol, "stage": self.stage, self.stage: state})

    def restore(self) -> dict[str, Any] | None:
        saved = self.outer.restore()
        if saved and saved.get("protocol") == self.protocol and saved.get("stage") == self.stage:
            return saved[self.stage]
        return None

    def log_metrics(self, round_no: int, **values: float) -> None:
        self.outer.log_metrics(round_no + self.round_offset, **values)

    def record_choice(self, chosen: list[str]) -> None:
        self.outer.record_choice(chosen)

    def offered(self, kind: str) -> None:
        self.outer.offered(self.kind(kind))

    def reject(self, peer: str, reason: str) -> None:
        self.outer.reject(peer, reason)

    def sample_caps(self) -> dict[str, int]:
        return self.outer.sample_caps()

    def set_community(self, community: dict[str, Any]) -> None:
        self.outer.set_community(community)

    def set_training(self, training: dict[str, Any]) -> None:
        self.outer.set_training(training)

    def set_privacy_gate(self, decision: dict[str, Any]) -> None:
        self.outer.set_privacy_gate(decision)

    def pair_secret(self, peer: str, context: bytes) -> bytes:
        return self.outer.pair_secret(peer, context)

    def storage_dir(self) -> Path:
        return self.outer.storage_dir()

    def durable_file(self, name: str) -> Path | None:
        return self.outer.durable_file(name)

    async def sleep(self, seconds: float) -> None:
        await self.outer.sleep(seconds)

    async def after_training(self, seconds: float) -> None:
        """The node's own (its fault plan's slow_train drill)."""
        await self.outer.after_training(seconds)
