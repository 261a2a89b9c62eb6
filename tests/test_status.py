"""The status endpoint over a real socket, backed by a real Telemetry."""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.status import create_status_app, start_status_server
from node.telemetry import Telemetry

TOKEN = "s3cret-status-token-0123456789"
NOW = 1_700_000_000.0

ServerFactory = Callable[..., Awaitable[str]]


def populated_telemetry() -> Telemetry:
    """Node "a" after a few rounds with peers b (alive), c (suspect), d (dead)."""
    telemetry = Telemetry("a", wall_clock=lambda: NOW)
    telemetry.set_peer("b", "alive", round_no=3, phase="train", last_seen=NOW - 1.5)
    telemetry.set_peer("c", "suspect", round_no=2, phase="exchange", last_seen=NOW - 9.0)
    telemetry.set_peer("d", "dead", round_no=1, phase="", last_seen=0.0)
    for _ in range(3):
        telemetry.record_sent("b", "model", 1000)
    telemetry.record_sent("c", "heartbeat", 40)
    telemetry.record_received("b", "model", 900)
    telemetry.record_received("b", "heartbeat", 50)
    telemetry.record_received("c", "heartbeat", 60)
    telemetry.merge_remote_edges(
        "b", [{"source": "b", "target": "c", "messages": 4, "bytes": 4096, "last": NOW}]
    )
    telemetry.record_rejection("bad_signature", "mallory")
    telemetry.record_rejection("bad_signature", "mallory")
    telemetry.record_rejection("replay", None)
    telemetry.record_choice("a", ["b", "c"])
    telemetry.record_choice("a", ["b"])
    telemetry.record_choice("b", ["a"])
    telemetry.log_metrics(0, train_loss=1.25, val_acc=0.5)
    telemetry.log_metrics(1, train_loss=0.75, val_acc=0.625)
    telemetry.log_metrics(2, train_loss=0.5, val_acc=0.75)
    telemetry.set_round(3)
    telemetry.set_phase("aggregate")
    telemetry.set_queue_depth("model", 2)
    telemetry.set_community({"cluster": 1, "members": ["a", "b"]})
    return telemetry


@pytest.fixture
async def serve() -> AsyncIterator[ServerFactory]:
    """serve(telemetry, token=None) -> base URL of a status server on 127.0.0.1:<free port>."""
    runners = []

    async def start(telemetry: Telemetry, token: str | None = None) -> str:
        app = create_status_app(telemetry, node_name="a", protocol_name="fedavgp2p", token=token)
        runner, port = await start_status_server(app, "127.0.0.1", 0)
        runners.append(runner)
        assert port > 0
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, dict(response.headers), await response.text()


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN/Infinity, as a browser's JSON.parse does."""

    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


# ---- routes ------------------------------------------------------------------


async def test_healthz_answers_ok(serve: ServerFactory) -> None:
    base = await serve(Telemetry("a"))
    status, _, body = await fetch(base + "/healthz")
    assert (status, body) == (200, "ok")


async def test_status_reports_round_phase_peers_metrics_rejections_and_traffic(
    serve: ServerFactory,
) -> None:
    base = await serve(populated_telemetry())
    status, headers, body = await fetch(base + "/status")
    assert status == 200
    assert headers["Content-Type"].startswith("application/json")
    doc = strict_json(body)

    assert (doc["node"], doc["protocol"], doc["round"], doc["phase"]) == (
        "a",
        "fedavgp2p",
        3,
        "aggregate",
    )
    assert doc["uptime_s"] >= 0
    peers = {peer["name"]: peer for peer in doc["peers"]}
    assert set(peers) == {"b", "c", "d"}
    assert peers["b"] == {
        "name": "b",
        "state": "alive",
        "round": 3,
        "phase": "train",
        "error": None,
        "last_seen": NOW - 1.5,
        "seen_ago_s": 1.5,
        "messages_out": 3,
        "messages_in": 2,
        "bytes_out": 3000,
        "bytes_in": 950,
    }
    assert peers["c"]["state"] == "suspect" and peers["c"]["seen_ago_s"] == 9.0
    assert peers["d"]["state"] == "dead" and peers["d"]["seen_ago_s"] is None

    assert doc["metrics"] == {"train_loss": 0.5, "val_acc": 0.75}
    assert doc["metrics_round"] == 2
    assert doc["rejected"] == {"bad_signature": 2, "replay": 1}
    assert doc["rejected_total"] == 3
    assert doc["rejected_by_peer"] == {}  # mallory is on no roster: a stranger's claim
    assert doc["rejected_by_stranger"] == {"mallory": 2}
    assert doc["messages"]["sent"] == {"total": 4, "by_kind": {"heartbeat": 1, "model": 3}}
    assert doc["messages"]["received"] == {"total": 3, "by_kind": {"heartbeat": 2, "model": 1}}
    assert doc["bytes"]["sent"] == {"total": 3040, "by_kind": {"heartbeat": 40, "model": 3000}}
    assert doc["bytes"]["received"]["total"] == 1010
    assert doc["queues"] == {"model": 2}
    assert doc["community"] == {"cluster": 1, "members": ["a", "b"]}


async def test_peers_graph_has_states_directed_edges_and_choice_counts(
    serve: ServerFactory,
) -> None:
    base = await serve(populated_telemetry())
    status, _, body = await fetch(base + "/peers")
    assert status == 200
    graph = strict_json(body)

    nodes = {node["id"]: node for node in graph["nodes"]}
    assert {name: node["state"] for name, node in nodes.items()} == {
        "a": "alive",
        "b": "alive",
        "c": "suspect",
        "d": "dead",
    }
    assert nodes["a"]["round"] == 3 and nodes["a"].get("self") is True
    edges = {(e["source"], e["target"]): (e["messages"], e["bytes"]) for e in graph["edges"]}
    assert edges == {
        ("a", "b"): (3, 3000),
        ("a", "c"): (1, 40),
        ("b", "a"): (2, 950),
        ("c", "a"): (1, 60),
        ("b", "c"): (4, 4096),  # learnt from b's gossip
    }
    assert all(e["last"] == NOW for e in graph["edges"])
    choices = {(c["chooser"], c["chosen"]): c["count"] for c in graph["choices"]}
    assert choices == {("a", "b"): 2, ("a", "c"): 1, ("b", "a"): 1}


async def test_history_gives_each_metric_per_round_and_nan_as_null(serve: ServerFactory) -> None:
    telemetry = populated_telemetry()
    telemetry.log_metrics(3, train_loss=math.nan, val_acc=math.inf)
    base = await serve(telemetry)
    status, _, body = await fetch(base + "/history")
    assert status == 200
    history = strict_json(body)  # a browser's JSON.parse would choke on NaN
    assert [(p["round"], p["value"]) for p in history["series"]["train_loss"]] == [
        (0, 1.25),
        (1, 0.75),
        (2, 0.5),
        (3, None),
    ]
    assert [p["value"] for p in history["series"]["val_acc"]] == [0.5, 0.625, 0.75, None]
    assert history["latest"] == {"train_loss": None, "val_acc": None}
    assert history["latest_round"] == 3


# ---- Prometheus ----------------------------------------------------------------

METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\\\|\\"|\\n)*)"')
SAMPLE = re.compile(rf"^({METRIC_NAME})(?:\{{(.*)\}})? (\S+)(?: (-?\d+))?$")
HELP = re.compile(rf"^# HELP ({METRIC_NAME}) (.*)$")
TYPE = re.compile(rf"^# TYPE ({METRIC_NAME}) (counter|gauge|histogram|summary|untyped)$")


def parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    position = 0
    while position < len(text):
        match = LABEL.match(text, position)
        assert match, f"bad label syntax at {text[position:]!r}"
        name, raw = match.groups()
        assert name not in labels, f"duplicate label {name}"
        labels[name] = re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], raw)
        position = match.end()
        if position < len(text):
            assert text[position] == ",", f"expected ',' at {text[position:]!r}"
            position += 1
    return labels


def parse_prometheus(text: str) -> dict[str, Any]:
    """Strict reader of exposition format 0.0.4 for what this node writes.

    Returns {family: {"type", "help", "samples": [(labels, value)]}}; fails on
    a sample before its family's TYPE, a family declared twice, bad syntax.
    """
    assert text.endswith("\n"), "exposition must end with a line feed"
    families: dict[str, dict[str, Any]] = {}
    current: str | None = None
    for line in text[:-1].split("\n"):
        if help_match := HELP.match(line):
            name = help_match[1]
            assert name not in families, f"family {name} declared twice"
            families[name] = {"help": help_match[2], "type": None, "samples": []}
            current = name
        elif type_match := TYPE.match(line):
            name = type_match[1]
            assert name == current and families[name]["type"] is None, f"TYPE {name} out of place"
            assert not families[name]["samples"], "TYPE must come before samples"
            families[name]["type"] = type_match[2]
        else:
            sample = SAMPLE.match(line)
            assert sample, f"not a sample line: {line!r}"
            name, label_text, value_text, _ = sample.groups()
            assert name == current, f"sample {name} outside its family block"
            assert families[name]["type"] is not None, f"sample {name} before its TYPE"
            assert value_text in ("NaN", "+Inf", "-Inf") or re.fullmatch(
                r"-?\d+(\.\d+)?([eE][-+]?\d+)?", value_text
            ), f"bad value {value_text!r}"
            families[name]["samples"].append((parse_labels(label_text or ""), float(value_text)))
    return families


def sample_value(families: dict[str, Any], family: str, **labels: str) -> float:
    matches = [
        value
        for sample_labels, value in families[family]["samples"]
        if all(sample_labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, f"{family}{labels}: {len(matches)} samples"
    return matches[0]


async def test_metrics_is_valid_prometheus_text_with_every_family(serve: ServerFactory) -> None:
    base = await serve(populated_telemetry())
    status, headers, body = await fetch(base + "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = parse_prometheus(body)

    expected_types = {
        "p2pfl_up": "gauge",
        "p2pfl_round": "gauge",
        "p2pfl_messages_total": "counter",
        "p2pfl_bytes_total": "counter",
        "p2pfl_rejected_total": "counter",
        "p2pfl_queue_depth": "gauge",
        "p2pfl_peer_up": "gauge",
        "p2pfl_metric": "gauge",
    }
    for family, kind in expected_types.items():
        assert families[family]["type"] == kind
        assert families[family]["help"]
    assert sample_value(families, "p2pfl_up", node="a") == 1
    assert sample_value(families, "p2pfl_round") == 3
    assert sample_value(families, "p2pfl_messages_total", direction="sent", kind="model") == 3
    assert (
        sample_value(families, "p2pfl_messages_total", direction="received", kind="heartbeat") == 2
    )
    assert sample_value(families, "p2pfl_bytes_total", direction="sent", kind="model") == 3000
    assert sample_value(families, "p2pfl_rejected_total", reason="bad_signature") == 2
    assert sample_value(families, "p2pfl_queue_depth", kind="model") == 2
    assert sample_value(families, "p2pfl_peer_up", peer="b") == 1
    assert sample_value(families, "p2pfl_peer_up", peer="c") == 0
    assert sample_value(families, "p2pfl_metric", name="val_acc") == 0.75

    # The Prometheus project's own parser reads it alike (counters under their
    # base name, samples with _total, as Prometheus stores them).
    official = {f.name: f for f in text_string_to_metric_families(body)}
    assert official["p2pfl_messages"].type == "counter"
    assert {s.name for s in official["p2pfl_messages"].samples} == {"p2pfl_messages_total"}
    assert {name: f.type for name, f in official.items()} == {
        name.removesuffix("_total") if kind == "counter" else name: kind
        for name, kind in {**expected_types, "p2pfl_uptime_seconds": "gauge"}.items()
    }
    (up,) = official["p2pfl_up"].samples
    assert up.labels == {"node": "a"} and up.value == 1


def test_prometheus_label_values_are_escaped_and_non_finite_values_spelled_out() -> None:
    telemetry = Telemetry("a")
    awkward = 'we"ird\\reason\nline2'
    telemetry.record_rejection(awkward, None)
    telemetry.log_metrics(0, loss=math.nan, ratio=-math.inf)
    text = telemetry.prometheus_text('node "a"')
    families = parse_prometheus(text)
    assert sample_value(families, "p2pfl_rejected_total", reason=awkward) == 1
    official = {f.name: f for f in text_string_to_metric_families(text)}
    (rejected,) = official["p2pfl_rejected"].samples
    assert rejected.labels == {"node": 'node "a"', "reason": awkward}
    assert families["p2pfl_up"]["samples"][0][0] == {"node": 'node "a"'}
    assert math.isnan(sample_value(families, "p2pfl_metric", name="loss"))
    assert sample_value(families, "p2pfl_metric", name="ratio") == -math.inf


# ---- access control ------------------------------------------------------------


async def test_token_guards_data_routes_but_not_healthz(serve: ServerFactory) -> None:
    base = await serve(populated_telemetry(), token=TOKEN)
    for route in ("/status", "/peers", "/metrics", "/history"):
        status, headers, body = await fetch(base + route)
        assert status == 401, route
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert "fedavgp2p" not in body and "mallory" not in body
        status, _, _ = await fetch(base + route, {"Authorization": "Bearer wrong-token-000000000"})
        assert status == 401, route
        status, _, _ = await fetch(base + route, {"Authorization": TOKEN})  # scheme missing
        assert status == 401, route
        status, _, _ = await fetch(base + route, {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, route
    status, _, body = await fetch(base + "/healthz")
    assert (status, body) == (200, "ok")
    # The page shell carries no data, so a browser can open it and send the token itself.
    status, _, body = await fetch(base + "/")
    assert status == 200 and "<title>p2pfl-node</title>" in body
    assert "mallory" not in body and "fedavgp2p" not in body


async def test_non_loopback_bind_without_token_is_refused() -> None:
    app = create_status_app(Telemetry("a"), node_name="a", protocol_name="fedavgp2p", token=None)
    with pytest.raises(ValueError, match="needs a bearer token"):
        await start_status_server(app, "0.0.0.0", 0)


# ---- dashboard -----------------------------------------------------------------


async def test_dashboard_is_self_contained_and_locked_to_its_origin(serve: ServerFactory) -> None:
    base = await serve(Telemetry("a"))
    status, headers, html = await fetch(base + "/")
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    # Nothing is loaded from anywhere: no src/href/url()/@import with a scheme or //host.
    external = re.findall(
        r"""(?:src|href|action)\s*=\s*["']?\s*(?:[a-z][a-z0-9+.-]*:|//)|url\(\s*["']?\s*(?:[a-z]+:|//)|@import""",
        html,
        flags=re.IGNORECASE,
    )
    assert external == []
    # The one URL-looking string is the SVG namespace name, which is never fetched.
    assert set(re.findall(r"https?://[^\s\"'<>)]+", html)) == {"http://www.w3.org/2000/svg"}
    assert "<script src" not in html and "<link" not in html
    for path in ('"status"', '"peers"', '"history"'):
        assert path in html  # polls the three data routes of its own origin


# ---- Telemetry on its own ------------------------------------------------------------


def test_remote_edges_are_limited_to_the_reporting_peer_and_validated() -> None:
    telemetry = Telemetry("a")
    telemetry.set_roster(["a", "b", "c", "d"])
    telemetry.record_received("b", "model", 100)
    kept = telemetry.merge_remote_edges(
        "b",
        [
            {"source": "b", "target": "c", "messages": 3, "bytes": 300, "last": 5.0},
            {"source": "c", "target": "d", "messages": 9, "bytes": 9, "last": 5.0},  # not b's edge
            {"source": "b", "target": "d", "messages": -1, "bytes": 9},  # negative count
            {"source": "b", "target": "d"},  # fields missing
            "not a dict",
        ],
    )
    assert kept == 1
    edges = {(e["source"], e["target"]): e for e in telemetry.peer_graph()["edges"]}
    assert set(edges) == {("b", "a"), ("b", "c")}
    assert (edges[("b", "c")]["messages"], edges[("b", "c")]["bytes"]) == (3, 300)
    # A newer report replaces the older one.
    telemetry.merge_remote_edges("b", [{"source": "b", "target": "d", "messages": 1, "bytes": 1}])
    assert {(e["source"], e["target"]) for e in telemetry.peer_graph()["edges"]} == {
        ("b", "a"),
        ("b", "d"),
    }
    telemetry.merge_remote_choices(
        "b",
        [{"chooser": "b", "chosen": "c", "count": 4}, {"chooser": "c", "chosen": "a", "count": 9}],
    )
    assert telemetry.peer_graph()["choices"] == [{"chooser": "b", "chosen": "c", "count": 4}]


def test_local_edges_round_trip_through_a_peers_merge() -> None:
    sender = Telemetry("a")
    sender.record_sent("c", "model", 10)
    sender.record_choice("a", ["c"])
    receiver = Telemetry("b")
    receiver.set_roster(["a", "b", "c"])
    assert receiver.merge_remote_edges("a", sender.local_edges()) == 1
    assert receiver.merge_remote_choices("a", sender.local_choices()) == 1
    graph = receiver.peer_graph()
    assert [(e["source"], e["target"], e["messages"]) for e in graph["edges"]] == [("a", "c", 1)]
    assert graph["choices"] == [{"chooser": "a", "chosen": "c", "count": 1}]


# ---- a roster peer's gossip about the graph (a review, 2026-12: 4098 invented
# nodes with bidi overrides and escapes, and this node's own edge shown as 10^18)


def spoofed_telemetry() -> Telemetry:
    telemetry = Telemetry("me")
    telemetry.set_roster(["me", "evil", "b", "c"])
    telemetry.set_peer("evil", "alive", 3, "train", NOW)
    telemetry.record_sent("evil", "resp:model", 1000)  # what this node really sent
    telemetry.record_received("b", "model", 500)
    edges: list[dict[str, Any]] = [
        {"source": "me", "target": "evil", "messages": 10**18, "bytes": 10**18, "last": 1e9},
        {"source": "b", "target": "me", "messages": 10**18, "bytes": 10**18},  # not evil's
        {"source": "evil", "target": "b", "messages": 2, "bytes": 20},  # a real roster edge
        {"source": "evil", "target": "b\u202e", "messages": 1, "bytes": 1},
    ]
    edges += [
        {"source": "evil", "target": f"hospital-{i:04d}\u202e\x1b[31m", "messages": 1, "bytes": 1}
        for i in range(4095)
    ]
    telemetry.merge_remote_edges("evil", edges)
    telemetry.merge_remote_choices(
        "evil",
        [
            {"chooser": "evil", "chosen": "c", "count": 3},
            {"chooser": "evil", "chosen": "St. Elsewhere <b>(fine)</b>\n", "count": 99},
            {"chooser": "evil", "chosen": "c\x1b", "count": 99},
        ],
    )
    return telemetry


def test_a_peer_cannot_invent_sites_or_put_control_characters_on_peers() -> None:
    graph = spoofed_telemetry().peer_graph()
    assert {n["id"] for n in graph["nodes"]} == {"me", "evil", "b", "c"}  # before: 4098
    assert len(json.dumps(graph)) < 2000  # before: about 725 KB
    assert {(e["source"], e["target"]) for e in graph["edges"]} == {
        ("me", "evil"),
        ("b", "me"),
        ("evil", "b"),
    }
    assert graph["choices"] == [{"chooser": "evil", "chosen": "c", "count": 3}]


def test_a_peer_cannot_replace_what_this_node_measured_on_its_own_edges() -> None:
    edges = {(e["source"], e["target"]): e for e in spoofed_telemetry().peer_graph()["edges"]}
    assert (edges[("me", "evil")]["messages"], edges[("me", "evil")]["bytes"]) == (1, 1000)
    assert edges[("b", "me")]["messages"] == 1  # before: 10^18 for me -> evil


def test_only_a_rosters_first_entries_of_a_peers_gossip_are_validated() -> None:
    """An honest peer has at most 2 x roster edges: a flood of 4096 entries is
    not validated one by one on the event loop."""
    from unittest import mock

    from node import telemetry_records

    telemetry = Telemetry("me")
    telemetry.set_roster(["me", "evil", "b", "c"])
    flood = [{"source": "evil", "target": "b", "messages": 1, "bytes": 1}] * 4096
    with mock.patch.object(
        telemetry_records.RemoteEdge,
        "model_validate",
        wraps=telemetry_records.RemoteEdge.model_validate,
    ) as validate:
        telemetry.merge_remote_edges("evil", flood)
    assert validate.call_count == 8


def test_malformed_or_impossible_gossiped_edges_and_choices_are_counted() -> None:
    """Review 6: malformed entries were dropped uncounted, and a claim of
    2^63 - 1 messages (or a `last` of 1e308) on an edge between two other
    sites replaced the honest end's count ("the larger count wins")."""
    telemetry = Telemetry("me")
    telemetry.set_roster(["me", "evil", "b", "c"])
    honest = {"source": "b", "target": "c", "messages": 10, "bytes": 100, "last": 1.0}
    telemetry.merge_remote_edges("b", [honest])
    hostile = [
        {"source": "evil", "target": "b", "messages": 2**63 - 1, "bytes": 1},
        {"source": "evil", "target": "c", "messages": 1, "bytes": 1, "last": 1e308},
        {"source": "evil", "target": "b", "messages": -1, "bytes": 1},
        {"source": "evil", "target": "b", "messages": float("nan"), "bytes": 1},
        "not an edge",
    ]
    assert telemetry.merge_remote_edges("evil", hostile) == 0
    assert telemetry.merge_remote_choices("evil", [{"chooser": "evil", "count": "x"}]) == 0
    status = telemetry.status_json("me", "probe")
    assert status["rejected"] == {"gossip_choices_malformed": 1, "gossip_edges_malformed": 1}
    assert status["rejected_by_peer"] == {"evil": 2}
    edges = {(e["source"], e["target"]): e for e in telemetry.peer_graph()["edges"]}
    assert edges[("b", "c")]["messages"] == 10


def test_a_site_the_roster_no_longer_lists_leaves_the_graph() -> None:
    telemetry = Telemetry("me")
    telemetry.set_roster(["me", "gone", "b"])
    telemetry.merge_remote_edges(
        "gone", [{"source": "gone", "target": "b", "messages": 1, "bytes": 1}]
    )
    telemetry.set_roster(["me", "b"])
    assert telemetry.peer_graph()["edges"] == []
    assert (
        telemetry.merge_remote_edges(
            "gone", [{"source": "gone", "target": "b", "messages": 1, "bytes": 1}]
        )
        == 0
    )


def test_claimed_senders_of_rejected_messages_are_kept_printable() -> None:
    telemetry = Telemetry("a")
    telemetry.record_rejection("bad_signature", "hospital-b\u202e\x1b[31m")
    assert telemetry.status_json("a", "x")["rejected_by_stranger"] == {"hospital-b??[31m": 1}


def test_metric_history_is_bounded_and_keeps_the_latest() -> None:
    telemetry = Telemetry("a", max_history=5)
    for round_index in range(8):
        telemetry.log_metrics(round_index, loss=1.0 / (round_index + 1))
    history = telemetry.metrics_history()
    assert [p["round"] for p in history["series"]["loss"]] == [3, 4, 5, 6, 7]
    assert history["latest"] == {"loss": 1.0 / 8}
    with pytest.raises(TypeError, match="must be a number"):
        telemetry.log_metrics(8, loss="low")  # type: ignore[arg-type]


def test_counters_stay_exact_under_concurrent_threads() -> None:
    telemetry = Telemetry("a")

    def hammer(peer: str) -> None:
        for _ in range(2000):
            telemetry.record_sent(peer, "model", 3)
            telemetry.record_rejection("replay", peer)

    threads = [threading.Thread(target=hammer, args=(f"p{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    doc = telemetry.status_json("a", "fedavgp2p")
    assert doc["messages"]["sent"]["total"] == 8000
    assert doc["bytes"]["sent"]["total"] == 24000
    assert doc["rejected"] == {"replay": 8000}


def test_unverified_senders_of_rejected_messages_cannot_grow_memory_without_bound() -> None:
    telemetry = Telemetry("a")
    for i in range(1000):
        telemetry.record_rejection("unknown_sender", f"forged-{i}")
    by_stranger = telemetry.status_json("a", "x")["rejected_by_stranger"]
    assert len(by_stranger) <= 257
    assert sum(by_stranger.values()) == 1000
    assert by_stranger["<other>"] == 1000 - 256


def test_strangers_made_up_names_never_crowd_out_a_roster_peers_refusals() -> None:
    """A review's flood: 300 made-up sender names (one unauthenticated frame
    each; the transport books the claimed name before the signature check)
    filled the one table of 256 names, and a roster peer's later refusals,
    its gossip ranges included, were booked under <other>."""
    telemetry = Telemetry("me")
    telemetry.set_roster(["me", "liar", "honest"])
    for i in range(300):
        telemetry.record_rejection("unknown_sender", f"stranger-{i:03d}")
    for _ in range(5):
        telemetry.record_rejection("gossip_f1_range", "liar")
    telemetry.record_rejection("tokenizer_bad_counts", "honest")
    doc = telemetry.status_json("me", "x")
    assert doc["rejected_by_peer"] == {"liar": 5, "honest": 1}
    strangers = doc["rejected_by_stranger"]
    assert len(strangers) == 257 and strangers["<other>"] == 300 - 256
    assert "liar" not in strangers and "honest" not in strangers
    assert doc["rejected"] == {
        "unknown_sender": 300,
        "gossip_f1_range": 5,
        "tokenizer_bad_counts": 1,
    }


def test_a_site_removed_from_the_roster_keeps_its_refusals_among_the_strangers() -> None:
    telemetry = Telemetry("me")
    telemetry.set_roster(["me", "b", "c"])
    telemetry.record_rejection("bad_signature", "b")
    telemetry.record_rejection("bad_signature", "c")
    telemetry.set_roster(["me", "c"])  # the federation removed b
    telemetry.record_rejection("unknown_sender", "b")
    doc = telemetry.status_json("me", "x")
    assert doc["rejected_by_peer"] == {"c": 1}  # bounded by the roster
    assert doc["rejected_by_stranger"] == {"b": 2}
    # a site added later is counted as a roster site from then on; what was
    # claimed in its name before stays a stranger's claim
    telemetry.record_rejection("unknown_sender", "d")
    telemetry.set_roster(["me", "c", "d"])
    telemetry.record_rejection("replay", "d")
    doc = telemetry.status_json("me", "x")
    assert doc["rejected_by_peer"] == {"c": 1, "d": 1}
    assert doc["rejected_by_stranger"] == {"b": 2, "d": 1}


def test_before_the_roster_is_set_known_peers_count_as_roster_sites() -> None:
    telemetry = Telemetry("a")
    telemetry.set_peer("b", "alive", round_no=1, phase="train", last_seen=NOW)
    telemetry.record_rejection("replay", "b")
    telemetry.record_rejection("replay", "zed")
    doc = telemetry.status_json("a", "x")
    assert (doc["rejected_by_peer"], doc["rejected_by_stranger"]) == ({"b": 1}, {"zed": 1})
