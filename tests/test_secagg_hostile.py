"""Secure aggregation read by a hostile peer: every field of every phase NaN,
inf, negative, huge, empty, repeated or of the wrong type, in both directions
(a requester's queries to a contributor, a contributor's answers to the
requester), and the same request sent concurrently. Each must be refused with
a reason and counted, never raise, hang or change what an honest run gives."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_secagg import CONTRIBUTORS, REQUESTER, Federation, relayed

from protocols.secagg import SecAggError

HOSTILE = st.one_of(
    st.sampled_from(
        # the largest integers msgpack carries: anything wider cannot be sent
        [float("nan"), float("inf"), -float("inf"), -1, 0, 2**31, 2**63, 2**64 - 1, -(2**63)]
    ),
    st.sampled_from(["", "x" * 200, "alice", REQUESTER, "nobody", True, None]),
    st.sampled_from([b"", b"\x00" * 31, b"\x00" * 32, b"\xff" * 2000]),
    st.sampled_from([[], ["alice"] * 3, CONTRIBUTORS * 20, {}, {"alice": {}}]),
    st.lists(st.sampled_from(CONTRIBUTORS + ["", "eve"]), max_size=6),
)
PHASE_FIELDS = {
    "share": ["keys", "threshold"],
    "mask": ["u2", "shares", "commitments"],
    "consistency": ["u3", "view_tags"],
    "unmask": ["u4", "tags"],
}
SESSION = "9a" * 16


async def honest_until(fed: Federation, phase: str) -> dict[str, dict[str, Any]]:
    """Run alice's session honestly up to (not including) `phase`; the
    bodies an honest requester would send her at each phase."""
    members = CONTRIBUTORS
    adv = {m: await fed.raw(m, "advertise", SESSION, members, {}) for m in members}
    bodies: dict[str, dict[str, Any]] = {}
    dealt = {}
    for m in members:
        keys = {v: relayed(adv[v], m, owner=v) for v in members}
        body = {"keys": keys, "threshold": 3}
        if m == "alice":
            bodies["share"] = body
            if phase == "share":
                continue
        dealt[m] = await fed.raw(m, "share", SESSION, members, body)
    if phase == "share":
        return bodies
    views = {}
    for m in members:
        others = [v for v in members if v != m]
        body = {
            "u2": members,
            "shares": {v: dealt[v]["shares"][m] for v in others},
            "commitments": {v: dealt[v]["commitments"][m] for v in others},
        }
        if m == "alice":
            bodies["mask"] = body
            if phase == "mask":
                continue
        views[m] = (await fed.raw(m, "mask", SESSION, members, body))["view_tags"]
    if phase == "mask":
        return bodies
    tags = {}
    for m in members:
        body = {"u3": members, "view_tags": {v: views[v][m] for v in members if v != m}}
        if m == "alice":
            bodies["consistency"] = body
            if phase == "consistency":
                continue
        tags[m] = (await fed.raw(m, "consistency", SESSION, members, body))["tags"]
    bodies["unmask"] = {
        "u4": members,
        "tags": {v: tags[v]["alice"] for v in members if v != "alice"},
    }
    return bodies


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    phase=st.sampled_from(sorted(PHASE_FIELDS)),
    field_index=st.integers(0, 2),
    value=HOSTILE,
    nested=st.booleans(),
)
def test_a_contributor_refuses_every_hostile_field_with_a_reason(
    phase: str, field_index: int, value: Any, nested: bool
) -> None:
    fed = Federation()

    async def attack() -> Any:
        body = (await honest_until(fed, phase))[phase]
        fields = PHASE_FIELDS[phase]
        name = fields[field_index % len(fields)]
        if nested and isinstance(body.get(name), dict) and body[name]:
            body[name][next(iter(body[name]))] = value  # one member's entry
        else:
            body[name] = value
        return await asyncio.wait_for(fed.raw("alice", phase, SESSION, CONTRIBUTORS, body), 10)

    before = len(fed.network.rejections)
    reply = asyncio.run(attack())
    assert isinstance(reply, dict)
    if "refused" in reply:
        assert isinstance(reply["refused"], str) and reply["refused"]
        counted = [r for r in fed.network.rejections[before:] if r["node"] == "alice"]
        assert counted and all(r["reason"].startswith("secagg_") for r in counted), counted


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    phase=st.sampled_from(["advertise", "share", "mask", "consistency", "unmask"]),
    value=HOSTILE,
    where=st.sampled_from(["whole", "field"]),
)
def test_a_requester_survives_every_hostile_answer(phase: str, value: Any, where: str) -> None:
    """erin answers one phase with junk: the requester never raises anything
    but SecAggError, never hangs, and if it gets a sum, it is the right one."""
    fed = Federation()
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request

    async def lying(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        reply = await original(peer, kind, query, timeout)
        if peer == "erin" and query["phase"] == phase:
            if where == "whole" or not isinstance(reply, dict) or not reply:
                return value
            reply = dict(reply)
            reply[sorted(reply)[0]] = value
        return reply

    ctx.request = lying  # type: ignore[method-assign]
    try:
        result = asyncio.run(asyncio.wait_for(fed.ask(CONTRIBUTORS), 20))
    except SecAggError:
        return
    for key, want in fed.expected(result.contributors).items():
        assert torch.allclose(result.mean[key].double(), want, atol=1e-5), key


@pytest.mark.parametrize("phase", ["advertise", "share", "mask", "consistency", "unmask"])
def test_the_same_request_sent_twice_at_once_is_answered_once(phase: str) -> None:
    """Two copies of one phase's query at the same moment (a replay racing its
    original): at most one answer; the other is refused."""
    fed = Federation()

    async def race() -> list[Any]:
        bodies = {} if phase == "advertise" else await honest_until(fed, phase)
        body = bodies.get(phase, {})
        return await asyncio.gather(
            *(fed.raw("alice", phase, SESSION, CONTRIBUTORS, body) for _ in range(2))
        )

    replies = asyncio.run(race())
    answered = [r for r in replies if isinstance(r, dict) and "refused" not in r]
    assert len(answered) == 1, replies
    refused = [r["refused"] for r in replies if "refused" in r]
    # unmasking ends the session: its copy finds none
    assert refused and refused[0] in {"session_reused", "out_of_order", "unknown_session"}
    counted = {r["reason"] for r in fed.network.rejections if r["node"] == "alice"}
    assert f"secagg_{refused[0]}" in counted


SESSION_FIELDS = ["contributors", "weight_scale", "round", "max_round", "purpose", "ring", "steps"]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(field=st.sampled_from(SESSION_FIELDS), value=HOSTILE)
def test_every_hostile_session_field_is_refused_with_a_reason_and_opens_nothing(
    field: str, value: Any
) -> None:
    """The session's own fields of Round 0, which this node reads before any
    key: the weight unit (a review's W = 2^40 isolated a card-less site), the
    contributor list and its size (secagg_min_contributors: a sum of two with
    one accomplice gives the other's model). alice has a roster card and
    answers sums of 3 or more. Whatever the value: an answer or a counted
    refusal with a reason, and no session left open after a refusal."""
    fed = Federation()
    alice = fed.contributors["alice"]
    alice.max_weight, alice.min_sum = 20.0, 3
    query = {
        "session": SESSION,
        "phase": "advertise",
        "contributors": CONTRIBUTORS,
        "round": 3,
        "max_round": 3,
        "purpose": "model",
        "body": {},
        field: value,
    }
    reply = asyncio.run(
        asyncio.wait_for(fed.ctxs[REQUESTER].request("alice", "secagg", query, 2.0), 10)
    )
    assert isinstance(reply, dict)
    if "refused" in reply:
        assert isinstance(reply["refused"], str) and reply["refused"]
        counted = [r for r in fed.network.rejections if r["node"] == "alice"]
        assert counted and all(r["reason"].startswith("secagg_") for r in counted), counted
        assert not alice.sessions


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"weight_scale": 20.0 * 4096 * 2}, "weight_scale_too_large"),
        ({"weight_scale": float("nan")}, "bad_request"),
        ({"weight_scale": -1.0}, "bad_request"),
        ({"weight_scale": 2.0**41}, "bad_request"),
        ({"contributors": ["alice", "bob"]}, "sum_too_small"),
        ({"contributors": ["alice", "alice", "bob"]}, "bad_contributors"),
        ({"contributors": []}, "bad_request"),
    ],
    ids=[
        "W past 2^12 x card",
        "W NaN",
        "W negative",
        "W past 2^40",
        "a sum of 2",
        "repeated",
        "empty",
    ],
)
def test_each_session_field_this_node_checks_is_refused_by_name_even_twice_at_once(
    change: dict[str, Any], reason: str
) -> None:
    """Named refusals, each sent twice at the same moment: both refused with
    the reason, both counted, nothing opened."""
    fed = Federation()
    alice = fed.contributors["alice"]
    alice.max_weight, alice.min_sum = 20.0, 3
    query = {
        "session": SESSION,
        "phase": "advertise",
        "contributors": CONTRIBUTORS,
        "round": 3,
        "max_round": 3,
        "purpose": "model",
        "body": {},
        **change,
    }

    async def twice() -> list[Any]:
        ask = fed.ctxs[REQUESTER].request
        return await asyncio.gather(*(ask("alice", "secagg", dict(query), 2.0) for _ in range(2)))

    replies = asyncio.run(twice())
    assert replies == [{"refused": reason}] * 2
    counted = [r["reason"] for r in fed.network.rejections if r["node"] == "alice"]
    assert counted == [f"secagg_{reason}"] * 2
    assert not alice.sessions
