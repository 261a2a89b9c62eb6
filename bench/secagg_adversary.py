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
from typing import Any

from bench.secagg_judge import double_contributions, try_unmask
from bench.secagg_sessions import Honest, PhasePlan, SessionPlan, run_session


async def attack(fed: Honest, plans: Sequence[SessionPlan]) -> dict[str, Any]:
    """Run every session of the plans against the federation (bench/secagg_sessions.py),
    then judge what the adversary received (bench/secagg_judge.py)."""
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
