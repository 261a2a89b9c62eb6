"""The federation bench/secagg_adversary.py attacks, and how it runs one
session: real `Contributor` objects (the code every node runs) behind an
in-process RoundContext, their true models, the plan of what the adversarial
requester tells each of them, and everything a session gave it (`Knowledge`),
which bench/secagg_judge.py then tries to peel (bench/secagg_adversary.py
`attack` runs both)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from torch import Tensor

from protocols import secagg
from protocols.base import NotReady
from protocols.masking import pair_secret_from_shared

REQUESTER = "mallory"
ENTRIES = 6  # floats per model: enough to tell a breach from chance
WEIGHT_SCALE = 16.0  # the sessions' weight unit W: every weight (3 + i) is below it


class Site:
    """The RoundContext a Contributor needs, without a network: roster,
    long-term X25519 pair secrets, and a rejection counter."""

    def __init__(self, me: str, names: Sequence[str], keys: dict[str, X25519PrivateKey]) -> None:
        self.me = me
        self._names = sorted([*names, REQUESTER])
        self._keys = keys
        self.rejections: list[tuple[str, str]] = []

    def roster(self) -> list[str]:
        return list(self._names)

    def reject(self, peer: str, reason: str) -> None:
        self.rejections.append((peer, reason))

    def pair_secret(self, peer: str, context: bytes) -> bytes:
        shared = self._keys[self.me].exchange(self._keys[peer].public_key())
        return pair_secret_from_shared(shared, self.me, peer, context)

    async def run_blocking(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)


class Clock:
    """Training progress: a site serves the models of rounds now-1 and now,
    and answers a range with the oldest one it still serves (as FedAVGP2P's
    store does), so the same range can mean another model later."""

    def __init__(self) -> None:
        self.now = 2


@dataclass
class Honest:
    """The federation under attack: real Contributors and their true models."""

    names: list[str]
    clock: Clock = field(default_factory=Clock)
    contributors: dict[str, secagg.Contributor] = field(default_factory=dict)
    sites: dict[str, Site] = field(default_factory=dict)
    models: dict[tuple[str, int], Tensor] = field(default_factory=dict)  # (name, round) -> w * x
    weights: dict[str, float] = field(default_factory=dict)

    @classmethod
    def make(cls, n: int, seed: int = 0) -> Honest:
        names = [chr(ord("a") + i) for i in range(n)]
        fed = cls(names)
        keys = {m: X25519PrivateKey.generate() for m in [*names, REQUESTER]}
        gen = torch.Generator().manual_seed(seed)
        for i, name in enumerate(names):
            fed.weights[name] = float(3 + i)
            site = Site(name, names, keys)
            fed.sites[name] = site
            fed.contributors[name] = secagg.Contributor(site, fed.source(name))  # type: ignore[arg-type]
            for r in range(0, 8):
                fed.models[(name, r)] = torch.randn(ENTRIES, generator=gen, dtype=torch.float64)
        return fed

    def source(self, name: str) -> secagg.ModelSource:
        def model(wanted: int, newest: int, purpose: str) -> tuple[int, dict[str, Tensor], float]:
            if wanted > self.clock.now:
                raise NotReady(f"round {wanted}")
            served = [r for r in (self.clock.now - 1, self.clock.now) if wanted <= r <= newest]
            if not served:
                return None  # type: ignore[return-value]
            r = served[0]
            return r, {"w": self.models[(name, r)].clone()}, self.weights[name]

        return model

    def truth(self, name: str, model_round: int) -> np.ndarray:
        """What `name` masks for a model round: w/W * x, W the sessions' weight unit."""
        share = min(self.weights[name], WEIGHT_SCALE) / WEIGHT_SCALE
        return (self.models[(name, model_round)] * share).numpy()


# ---------------------------------------------------------------------- the adversary's plan


@dataclass
class PhasePlan:
    """The set a phase tells each contributor: `common`, or `other` for the
    contributors in `split`. Contributors not in the set they are told are not asked."""

    common: frozenset[str]
    other: frozenset[str] = frozenset()
    split: frozenset[str] = frozenset()

    def view(self, member: str) -> list[str]:
        return sorted(self.other if member in self.split else self.common)


@dataclass
class SessionPlan:
    session: str
    round: int
    max_round: int
    contributors: list[str]
    threshold_bump: int  # t = least + bump, capped at the holders
    u1: PhasePlan
    u2: PhasePlan
    u3: PhasePlan
    u4: PhasePlan
    advance: bool = False  # training moves on after this session


@dataclass
class Knowledge:
    """Everything one session gave the adversary."""

    plan: SessionPlan
    requests: dict[str, secagg.SessionRequest] = field(default_factory=dict)
    adverts: dict[str, dict[str, Any]] = field(default_factory=dict)
    thresholds: dict[str, int] = field(default_factory=dict)  # dealer -> t it was told
    sealed: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (dealer, holder) -> blob
    masked: dict[str, dict[str, Any]] = field(default_factory=dict)
    told_u2: dict[str, list[str]] = field(default_factory=dict)
    revealed: dict[str, dict[str, Any]] = field(default_factory=dict)  # holder -> unmask reply
    refusals: list[tuple[str, str, str]] = field(default_factory=list)


def base_query(plan: SessionPlan, phase: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "session": plan.session,
        "phase": phase,
        "contributors": plan.contributors,
        "round": plan.round,
        "max_round": plan.max_round,
        "purpose": "model",
        "weight_scale": WEIGHT_SCALE,
        "body": body,
    }


async def run_session(fed: Honest, plan: SessionPlan) -> Knowledge:
    """Drive every contributor through the phases with the plan's views,
    forwarding what the others answered; record what comes back."""
    k = Knowledge(plan)

    async def ask(member: str, phase: str, body: dict[str, Any]) -> dict[str, Any] | None:
        query = base_query(plan, phase, body)
        try:
            reply = await fed.contributors[member].serve(REQUESTER, query)
        except NotReady:
            k.refusals.append((member, phase, "not_ready"))
            return None
        if not isinstance(reply, dict) or "refused" in reply:
            k.refusals.append((member, phase, str(reply.get("refused"))))
            return None
        k.requests[member] = secagg.SessionRequest.model_validate({**query, "body": {}})
        return reply

    members = [m for m in plan.contributors if m in fed.contributors]
    for m in members:
        reply = await ask(m, "advertise", {})
        if reply is not None:
            k.adverts[m] = reply
    least = secagg.threshold_for(len(plan.contributors) - 1, None)
    # Round 1: each told its U1, with the keys and tags the others made for it
    shares: dict[str, dict[str, bytes]] = {}
    commitments: dict[str, dict[str, Any]] = {}
    for m in k.adverts:
        u1 = [v for v in plan.u1.view(m) if v in k.adverts]
        if m not in u1:
            continue
        t = min(len(u1) - 1, least + plan.threshold_bump)
        keys = {
            v: {
                **{f: x for f, x in k.adverts[v].items() if f != "tags"},
                "tag": b"" if v == m else k.adverts[v]["tags"].get(m, b""),
            }
            for v in u1
        }
        reply = await ask(m, "share", {"keys": keys, "threshold": t})
        if reply is not None and isinstance(reply.get("shares"), dict):
            shares[m] = reply["shares"]
            commitments[m] = reply.get("commitments") or {}
            k.thresholds[m] = t
            for holder, blob in reply["shares"].items():
                k.sealed[(m, holder)] = blob
    # Round 2: U2 and the ciphertexts for each
    for m in shares:
        u2 = [v for v in plan.u2.view(m) if v in shares]
        if m not in u2:
            continue
        body = {
            "u2": u2,
            "shares": {v: shares[v].get(m, b"") for v in u2 if v != m},
            "commitments": {
                v: commitments[v][m] for v in u2 if v != m and m in commitments.get(v, {})
            },
        }
        reply = await ask(m, "mask", body)
        if reply is not None and isinstance(reply.get("masked"), dict):
            k.masked[m] = reply
            k.told_u2[m] = u2
    # Round 3: U3, with whatever each survivor said about its own view
    vouched: dict[str, dict[str, bytes]] = {}
    for m in k.masked:
        u3 = [v for v in plan.u3.view(m) if v in k.masked]
        if m not in u3:
            continue
        body: dict[str, Any] = {"u3": u3}
        views = {
            v: k.masked[v]["view_tags"].get(m, b"")
            for v in u3
            if v != m and isinstance(k.masked[v].get("view_tags"), dict)
        }
        if views:
            body["view_tags"] = views
        reply = await ask(m, "consistency", body)
        if reply is not None and isinstance(reply.get("tags"), dict):
            vouched[m] = reply["tags"]
    # Round 4: U4 and the tags; every reveal is kept
    for m in vouched:
        u4 = [v for v in plan.u4.view(m) if v in vouched]
        if m not in u4:
            continue
        body = {"u4": u4, "tags": {v: vouched[v].get(m, b"") for v in u4 if v != m}}
        reply = await ask(m, "unmask", body)
        if reply is not None:
            k.revealed[m] = reply
    if plan.advance:
        fed.clock.now += 1
    return k
