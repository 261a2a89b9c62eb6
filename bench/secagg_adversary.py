"""An adversarial requester for secure aggregation (protocols/secagg.py), and
its judge: did it obtain any honest contributor's individual input?

The requester of a secure sum plays the paper's server (Bonawitz et al. 2017),
so it is the party to distrust. This adversary drives real `Contributor`
objects (the code every node runs) directly, with no network in between, and
may send any contributor any session id, any U1/U2/U3/U4, any threshold and
any dropout claim, in any order, over several sessions. It forwards only what
the contributors gave it (it holds no roster key), in whatever combination it
likes.

It is judged by trying, not by inspecting the protocol (bench/secagg_judge.py): with everything it
received it rebuilds every secret it can (Shamir combination of any t
revealed shares, for every t; a keystream-reuse decryption of sealed shares
across sessions, whose plaintext layout it knows) and, for every masked input
it holds, tries to peel the self mask and every pair mask off. A peeled input
that equals the contributor's true weighted model (to the fixed-point step) is
a breach. Two sums over different subsets of the same models would be one too;
each contributor's ledger is checked for that directly (`MaskedInput.round`).

    python -m bench.secagg_adversary --examples 2000      # hypothesis-driven search
    python -m bench.secagg_adversary --attack u2_split    # the review's hole 1, scripted
    python -m bench.secagg_adversary --attack session_reuse

The last stdout line is one JSON object: {"examples": N, "breaches": K, ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from torch import Tensor

from bench.secagg_judge import REQUESTER, double_contributions, try_unmask
from protocols import secagg
from protocols.base import NotReady
from protocols.masking import pair_secret_from_shared

ENTRIES = 6  # floats per model: enough to tell a breach from chance


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

    async def train(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
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
        return (self.models[(name, model_round)] * self.weights[name]).numpy()


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


async def attack(fed: Honest, plans: Sequence[SessionPlan]) -> dict[str, Any]:
    known = [await run_session(fed, plan) for plan in plans]
    breaches, progress = try_unmask(fed, known)
    return {
        "breaches": breaches,
        "progress": progress,
        "double": double_contributions(fed, known),
        "refusals": [r for k in known for r in k.refusals],
        "sums": sum(1 for k in known for _ in [0] if k.revealed),
    }


# ---------------------------------------------------------------------- scripted attacks


def everyone(names: Sequence[str]) -> PhasePlan:
    return PhasePlan(frozenset(names))


def u2_split(n: int = 4) -> tuple[Honest, list[SessionPlan]]:
    """The review's hole 1: the victim a is told U2 = {a, b}; the others the
    full U2, then U3 without b. They reveal a's self-mask shares (a stayed)
    and b's mask key (b dropped): a's input, masked only against b, peels."""
    fed = Honest.make(n)
    names = fed.names
    a, b, rest = names[0], names[1], names[2:]
    plan = SessionPlan(
        session="11" * 16,
        round=fed.clock.now,
        max_round=fed.clock.now,
        contributors=names,
        threshold_bump=0,
        u1=everyone(names),
        u2=PhasePlan(frozenset(names), frozenset({a, b}), frozenset({a})),
        u3=everyone([a, *rest]),
        u4=everyone(rest),
    )
    return fed, [plan]


def session_reuse(n: int = 4) -> tuple[Honest, list[SessionPlan]]:
    """The review's hole 2: one session id, one range, twice. In the first the
    victim stays (its self-mask shares are revealed: known plaintext for the
    sealed shares); training moves on, so the second masks a newer model under
    the same keys; the victim is then said to have dropped (its mask key's
    shares are revealed) and its self-mask shares are decrypted by keystream."""
    fed = Honest.make(n)
    names = fed.names
    first = SessionPlan(
        session="22" * 16,
        round=fed.clock.now - 1,
        max_round=fed.clock.now + 1,
        contributors=names,
        threshold_bump=0,
        u1=everyone(names),
        u2=everyone(names),
        u3=everyone(names),
        u4=everyone(names),
        advance=True,
    )
    second = dataclasses.replace(
        first, u3=everyone(names[1:]), u4=everyone(names[1:]), advance=False
    )
    return fed, [first, second]


SCRIPTED = {"u2_split": u2_split, "session_reuse": session_reuse}


def run_scripted(name: str) -> dict[str, Any]:
    fed, plans = SCRIPTED[name]()
    result = asyncio.run(attack(fed, plans))
    return {
        "attack": name,
        "breaches": result["breaches"],
        "double": result["double"],
        "refusals": sorted({r[2] for r in result["refusals"]}),
    }


# ---------------------------------------------------------------------- the search


def plan_strategy(split_views: bool = True) -> Any:
    """A hypothesis strategy for (n, plans). Each phase's set is the previous
    phase's minus a few members (a dropout claim); with some chance a second,
    smaller set is told to some contributors (a split view). Thresholds,
    session ids from a pool of two (so reuse is tried), model ranges, and
    whether training moves on between sessions are drawn too."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: Any) -> tuple[int, list[SessionPlan]]:
        n = draw(st.sampled_from([4, 5, 4, 3]))  # 4 is the least with a dropout to claim
        names = [chr(ord("a") + i) for i in range(n)]

        def minus(of: frozenset[str], least: int, most: int) -> frozenset[str]:
            if not of:
                return of
            gone = draw(
                st.lists(st.sampled_from(sorted(of)), unique=True, min_size=least, max_size=most)
            )
            return of - frozenset(gone)

        def phase(
            of: frozenset[str], drop_one_in: int, after: PhasePlan | None = None
        ) -> PhasePlan:
            # a dropout claim in one phase out of `drop_one_in` (most often after
            # masking, where the paper's dropouts matter), a split view in one of
            # three. A liar keeps its story straight: after a split view, the
            # member it claims dropped is, half the time, one the split told
            # someone about (a partner of the members told the other view).
            common = of
            if draw(st.integers(1, drop_one_in)) == 1:
                partners = (after.other - after.split) & of if after and after.split else None
                if partners and draw(st.booleans()):
                    common = of - {draw(st.sampled_from(sorted(partners)))}
                else:
                    common = minus(of, 1, 1)
            if not split_views or draw(st.integers(0, 2)) != 2:
                return PhasePlan(common)
            other = minus(of, 1, n - 2)
            told = draw(st.lists(st.sampled_from(names), unique=True, min_size=1, max_size=2))
            return PhasePlan(common, other, frozenset(told))

        plans = []
        for _ in range(draw(st.integers(1, 2))):
            wanted = draw(st.integers(1, 2))
            u1 = phase(frozenset(names), 8)
            u2 = phase(u1.common, 4)
            u3 = phase(u2.common, 2, after=u2)
            plans.append(
                SessionPlan(
                    session=draw(st.sampled_from(["ab" * 16, "cd" * 16])),
                    round=wanted,
                    max_round=wanted + draw(st.integers(0, 1)),
                    contributors=names,
                    threshold_bump=draw(st.integers(0, 1)),
                    u1=u1,
                    u2=u2,
                    u3=u3,
                    u4=phase(u3.common, 4),
                    advance=draw(st.booleans()),
                )
            )
        return n, plans

    return build()


def search(examples: int, seed: int = 0, split_views: bool = True) -> dict[str, Any]:
    """Run the hypothesis search; stop at the first breach (hypothesis shrinks it)."""
    from hypothesis import HealthCheck, given, settings, target
    from hypothesis import seed as hseed

    found: list[dict[str, Any]] = []
    ran = [0]

    @hseed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    @given(plan_strategy(split_views))
    def one(case: tuple[int, list[SessionPlan]]) -> None:
        n, plans = case
        ran[0] += 1
        result = asyncio.run(attack(Honest.make(n, seed=ran[0]), plans))
        target(result["progress"], label="secrets held towards one input")
        if result["breaches"] or result["double"]:
            found.append({"n": n, "plans": [describe(p) for p in plans], **result})
            raise AssertionError("breach")

    with contextlib.suppress(AssertionError):
        one()
    return {"examples": ran[0], "breaches": len(found), "first": found[-1] if found else None}


def describe(plan: SessionPlan) -> dict[str, Any]:
    def show(p: PhasePlan) -> dict[str, Any]:
        return {"common": sorted(p.common), "other": sorted(p.other), "told_other": sorted(p.split)}

    return {
        "session": plan.session[:8],
        "range": [plan.round, plan.max_round],
        "t_bump": plan.threshold_bump,
        "u1": show(plan.u1),
        "u2": show(plan.u2),
        "u3": show(plan.u3),
        "u4": show(plan.u4),
        "advance": plan.advance,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--one-story",
        action="store_true",
        help="tell every contributor the same sets (no split views): the search for reuse",
    )
    p.add_argument("--attack", choices=sorted(SCRIPTED), action="append", default=[])
    args = p.parse_args(argv)
    started = time.monotonic()
    out: dict[str, Any] = {}
    if args.attack:
        out["scripted"] = {name: run_scripted(name) for name in args.attack}
        for name, row in out["scripted"].items():
            print(
                f"{name}: {len(row['breaches'])} breach(es), refusals {row['refusals']}",
                file=sys.stderr,
            )
    else:
        out.update(search(args.examples, args.seed, split_views=not args.one_story))
    out["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
