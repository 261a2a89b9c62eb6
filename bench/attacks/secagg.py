"""Issue #28's secure-aggregation holes as bench.attacks scenarios: a
malicious requester against the real `Contributor` and `secure_sum` code
(bench/secagg_adversary.py drives them in-process, with no network between,
as the hospital's review did). Each is judged by what the attacker could
actually do with what it received: a peeled input that equals a
contributor's true model is `succeeded`; refused and counted otherwise.

| scenario | hole | attack |
|---|---|---|
| secagg_u2_split | 28.1 | the victim told U2 = {a, b}, the others the full U2, then "b dropped" |
| secagg_session_reuse | 28.2 | one session id and range twice; the victim "dropped" in the second |
| secagg_story_search | 28.1/2 | hypothesis: any U1..U4 per contributor, thresholds, ids, ranges (--secagg-examples) |
| secagg_bad_share_index | 28.4 | a contributor reveals a negative index, then junk under index 1, to the requester |
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import secagg_adversary as adversary
from bench.attacks.kit import Options, inconclusive, verdict
from protocols.base import NotReady
from protocols.memory import InMemoryNetwork
from protocols.secagg import SECAGG_KIND, Contributor, SecAggError, secure_sum

SEARCH_EXAMPLES = 300  # the full search: python -m bench.secagg_adversary --examples 2000


def scripted(name: str, hole: str) -> dict[str, Any]:
    fed, plans = adversary.SCRIPTED[name]()
    result = asyncio.run(adversary.attack(fed, plans))
    counted = sorted({reason for site in fed.sites.values() for _, reason in site.rejections})
    evidence = {"breaches": result["breaches"], "double": result["double"], "counted": counted}
    if result["breaches"] or result["double"]:
        return verdict("succeeded", hole, "an individual input was peeled", **evidence)
    if not counted:
        return verdict("neutralised", hole, "nothing peeled, but no refusal counted", **evidence)
    return verdict("refused", hole, f"refused and counted: {', '.join(counted)}", **evidence)


def story_search(examples: int) -> dict[str, Any]:
    found = adversary.search(examples, seed=0)
    evidence = {"examples": found["examples"], "first_breach": found["first"]}
    if found["breaches"]:
        return verdict("succeeded", "28.1/2", "the search peeled an input", **evidence)
    return verdict(
        "refused", "28.1/2", f"no input peeled in {found['examples']} stories", **evidence
    )


def bad_share_index(contributors: int = 9) -> dict[str, Any]:
    """A requester and `contributors` real Contributors on the in-memory
    network; the last one reveals a negative index in one session and junk
    under index 1 in the next. The requester must neither hang nor fail with
    anything but SecAggError, and should still get both sums."""
    names = [f"s{i}" for i in range(contributors)]
    network = InMemoryNetwork()
    ctxs = {n: network.join(n) for n in [*names, "requester"]}
    gen = torch.Generator().manual_seed(0)
    states = {n: {"w": torch.randn(8, generator=gen)} for n in names}

    def source(name: str) -> Callable[[int, int, str], Any]:
        def model(wanted: int, newest: int, purpose: str) -> Any:
            if wanted > 9:
                raise NotReady("later")
            # each round's model is another model: a contributor's ledger
            # refuses one model in two sums of one requester (by its digest)
            return wanted, {"w": states[name]["w"] + wanted}, 1.0

        return model

    for n in names:
        ctxs[n].serve(SECAGG_KIND, Contributor(ctxs[n], source(n)).serve)
    requester = ctxs["requester"]
    honest_request = requester.request
    liar = names[-1]
    claim = {"idx": -5}

    async def lying(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        reply = await honest_request(peer, kind, query, timeout)
        if peer == liar and query.get("phase") == "unmask":
            junk = {v: {"idx": claim["idx"], "share": b"\x01" * 32} for v in reply["self_shares"]}
            return {"self_shares": junk, "key_shares": {}}
        return reply

    requester.request = lying  # type: ignore[method-assign]
    rows = {}
    for round_, idx in ((1, -5), (2, 1)):
        claim["idx"] = idx
        started = time.monotonic()
        try:
            result = asyncio.run(
                asyncio.wait_for(
                    secure_sum(
                        requester,
                        names,
                        round_no=round_,
                        max_round=round_,
                        reference={"w": torch.zeros(8)},
                        timeout=5.0,
                        # every weight is 1: W = 1 keeps the ring's resolution
                        # 2^-20 of each value, so "correct" can mean 1e-5
                        weight_scale=1.0,
                    ),
                    timeout=60,
                )
            )
            want = sum(states[n]["w"] + round_ for n in names) / len(names)
            ok = bool(torch.allclose(result.mean["w"], want, atol=1e-5))
            rows[f"index {idx}"] = {"sum": "correct" if ok else "wrong"}
        except SecAggError as exc:
            rows[f"index {idx}"] = {"sum": f"refused: {exc.reason}"}
        except TimeoutError:
            rows[f"index {idx}"] = {"sum": "hung"}
        except Exception as exc:  # noqa: BLE001 - what escaped is the finding
            rows[f"index {idx}"] = {"sum": f"crashed: {type(exc).__name__}: {exc}"[:200]}
        rows[f"index {idx}"]["seconds"] = round(time.monotonic() - started, 2)
    counted = sorted(
        {r["reason"] for r in network.rejections if r["node"] == "requester" and r["peer"] == liar}
    )
    evidence = {"sums": rows, "counted_against_liar": counted}
    if any(r["sum"] in {"hung", "wrong"} or r["sum"].startswith("crashed") for r in rows.values()):
        return verdict(
            "succeeded", "28.4", "the requester hung, crashed or summed wrong", **evidence
        )
    if not counted:
        return inconclusive("28.4", "no refusal counted against the liar", **evidence)
    return verdict("refused", "28.4", f"bad shares skipped and counted: {counted}", **evidence)


def run_review_secagg(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if "secagg_u2_split" in selected:
        out["secagg_u2_split"] = scripted("u2_split", "28.1")
    if "secagg_session_reuse" in selected:
        out["secagg_session_reuse"] = scripted("session_reuse", "28.2")
    if "secagg_story_search" in selected:
        out["secagg_story_search"] = story_search(SEARCH_EXAMPLES)
    if "secagg_bad_share_index" in selected:
        out["secagg_bad_share_index"] = bad_share_index()
    return out


SCENARIOS: dict[str, tuple[str, str]] = {
    "secagg_u2_split": ("28.1", "review_secagg"),
    "secagg_session_reuse": ("28.2", "review_secagg"),
    "secagg_story_search": ("28.1/2", "review_secagg"),
    "secagg_bad_share_index": ("28.4", "review_secagg"),
}
GROUPS: dict[str, Callable[[Options, set[str]], dict[str, dict[str, Any]]]] = {
    "review_secagg": run_review_secagg,
}
