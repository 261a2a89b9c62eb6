"""A hostile peer's gossip vectors, `recent` lists, state dicts and heartbeat
`round`, each fed to the function that reads it: refused with its reason (or
left out as documented), no exception escaping, big inputs in bounded time."""

from __future__ import annotations

import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from node.control import HeartbeatControl, validated
from p2pfl.secure.wire import WireError
from protocols import checks, selection
from protocols.base import PeerInfo

BAD_ITEMS: list[object] = [
    math.nan,
    math.inf,
    -math.inf,
    "1e5",
    True,
    {"a": 1},
    [0.5],
    None,
]


def peer(name: str, **meta: object) -> PeerInfo:
    return PeerInfo(name=name, state="alive", meta=dict(meta))


def ranked(h: selection.Heuristic, peers: list[PeerInfo], my_meta: dict) -> tuple[list, list]:
    refused: list[tuple[str, str]] = []
    order = h.select(
        "me",
        peers,
        1,
        round_no=1,
        seed=0,
        my_meta=my_meta,
        reject=lambda p, r: refused.append((p, r)),
    )
    return order, refused


@pytest.mark.parametrize("item", BAD_ITEMS)
def test_an_f1_vector_with_a_mistyped_or_non_finite_item_is_refused_malformed(item) -> None:
    h = selection.create("f1", n=0)
    peers = [peer("bad", f1=[0.5, item]), peer("good", f1=[0.1, 0.2])]
    order, refused = ranked(h, peers, {"f1": [0.9, 0.9]})
    assert order == ["good", "bad"]
    assert refused == [("bad", "gossip_f1_malformed")]


@pytest.mark.parametrize(
    ("vector", "reason"),
    [([-0.1, 0.5], "gossip_f1_range"), ([1e300, 0.5], "gossip_f1_range"), ([], None)],
)
def test_an_f1_vector_out_of_range_or_empty(vector, reason) -> None:
    h = selection.create("f1", n=0)
    order, refused = ranked(
        h, [peer("bad", f1=vector), peer("good", f1=[0.1, 0.2])], {"f1": [1, 1]}
    )
    assert order[0] == "good"
    if reason is None:  # an empty list: malformed
        assert refused == [("bad", "gossip_f1_malformed")]
    else:
        assert refused == [("bad", reason)]


@pytest.mark.parametrize("payload", ["1", {"x": 1}, 3, True, [[0.1], [0.2]]])
def test_f1_gossip_that_is_no_list_is_refused(payload) -> None:
    h = selection.create("f1", n=0)
    order, refused = ranked(
        h, [peer("bad", f1=payload), peer("good", f1=[0.1, 0.2])], {"f1": [1, 1]}
    )
    assert order == ["good", "bad"]
    assert refused and refused[0][0] == "bad"


@pytest.mark.parametrize("item", [*BAD_ITEMS, 1e7, -1e7])
def test_model_stats_hostile_items_are_refused(item) -> None:
    h = selection.create("cosine", n=0, vector="model_stats")
    peers = [peer("bad", model_stats=[1.0, item]), peer("good", model_stats=[1.0, 2.0])]
    order, refused = ranked(h, peers, {"model_stats": [1.0, 1.0]})
    assert order[0] == "good"
    assert [p for p, _ in refused] == ["bad"]
    assert refused[0][1] in ("gossip_stats_malformed", "gossip_stats_range")


def test_a_two_million_number_vector_of_the_wrong_length_is_left_out_quickly() -> None:
    """Another length than mine: left out unread (not refused), ranked unscored."""
    huge = [math.nan] * 2_000_000
    for key, h in (
        ("f1", selection.create("f1", n=0)),
        ("model_stats", selection.create("cosine", n=0, vector="model_stats")),
    ):
        start = time.perf_counter()
        order, refused = ranked(
            h, [peer("bad", **{key: huge}), peer("good", **{key: [0.1, 0.9]})], {key: [0.5, 0.5]}
        )
        assert time.perf_counter() - start < 0.2
        assert order == ["good", "bad"] and refused == []


@pytest.mark.parametrize(
    "recent",
    [
        "abc",
        {"a": 1},
        [1, 2],
        ["a", None],
        ["a", ["b"]],
        [True],
        [f"s{i}" for i in range(1025)],
    ],
)
def test_a_malformed_recent_is_refused_and_ranked_last(recent) -> None:
    h = selection.create("n_latest", n=1)
    order, refused = ranked(h, [peer("bad", recent=recent), peer("good", recent=["x"])], {})
    assert order == ["good", "bad"]
    assert refused == [("bad", "gossip_recent_malformed")]


def test_a_recent_of_repeated_names_is_read_as_a_set_and_a_huge_one_quickly() -> None:
    h = selection.create("n_latest", n=1)
    order, refused = ranked(h, [peer("rep", recent=["me"] * 1024), peer("good", recent=["me"])], {})
    assert refused == [] and sorted(order) == ["good", "rep"]
    start = time.perf_counter()
    order, refused = ranked(h, [peer("bad", recent=["x"] * 2_000_000), peer("good", recent=[])], {})
    assert time.perf_counter() - start < 0.2
    assert order == ["good", "bad"] and refused == [("bad", "gossip_recent_malformed")]


def reference() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(3), "bn.running_var": torch.ones(3)}


@pytest.mark.parametrize(
    ("var", "reason"),
    [
        ([1.0, math.nan, 1.0], "non_finite"),
        ([1.0, -math.inf, 1.0], "non_finite"),
        ([1.0, -1e-30, 1.0], "negative_variance"),
        ([-0.0, -0.0, 0.0], None),  # -0.0 is no negative variance
    ],
)
def test_a_running_var_with_nan_inf_negative_or_minus_zero(var, reason) -> None:
    state = {"w": torch.ones(3), "bn.running_var": torch.tensor(var)}
    problem = checks.incompatibility(state, reference(), variances=True)
    if reason is None:
        assert problem is None
    else:
        assert problem is not None and reason in problem


@pytest.mark.parametrize("state", ["w", [1, 2], None, {"w": torch.ones(3)}, {}])
def test_a_state_that_is_no_dict_or_lacks_keys_is_refused(state) -> None:
    assert checks.incompatibility(state, reference(), variances=True) in (
        "not_a_state_dict",
        "key_mismatch",
    )


def test_five_million_keys_are_refused_by_count_quickly() -> None:
    state = dict.fromkeys(range(5_000_000), 0)
    start = time.perf_counter()
    assert checks.incompatibility(state, reference()) == "key_mismatch"
    assert time.perf_counter() - start < 0.2


@pytest.mark.parametrize("value", [math.nan, math.inf, 2**31, -2, True, "1", 1.0, None, [1]])
def test_a_heartbeat_round_out_of_bounds_or_mistyped_is_refused(value) -> None:
    with pytest.raises(WireError) as info:
        validated(HeartbeatControl, {"round": value})
    assert "payload_schema" in str(info.value) or info.value.args[0] == "payload_schema"


@pytest.mark.parametrize("value", [-1, 0, 2**31 - 1])
def test_a_heartbeat_round_at_its_bounds_is_taken(value) -> None:
    assert validated(HeartbeatControl, {"round": value}).round == value


@pytest.mark.parametrize("extra", [0, 1, 2**63])
def test_a_heartbeat_header_at_the_limit_is_taken_and_one_byte_over_refused(
    tmp_path: Path, identities: Any, roster: Any, extra: int
) -> None:
    from test_heartbeat_size import receiver

    from node.inbound import HEARTBEAT
    from node.transport import Rejection

    _, inbound = receiver(tmp_path, identities, roster, [])
    limit = inbound.heartbeat_limit()
    header = SimpleNamespace(kind=HEARTBEAT, payload_len=limit + extra)
    if extra == 0:
        inbound.check_header(header)
        return
    with pytest.raises(Rejection) as refused:
        inbound.check_header(header)
    assert refused.value.reason == "heartbeat_oversize"
