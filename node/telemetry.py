"""What a node has seen: traffic, rejections, neighbour choices, peers, metrics.

One `Telemetry` per node, owned by the Node object (no module-level state). It
is written from the event loop and from training threads, so every mutation and
every snapshot happens under one lock. Readers get plain dicts (JSON-ready:
non-finite floats become None) for /status, /peers and /history, and
Prometheus text (prometheus-client, format 0.0.4: node/prometheus.py) for /metrics.
The records it keeps, and the schema of what peers gossip about the graph, are
in node/telemetry_records.py.

Times: `last_seen` given to `set_peer` and every `last` in an edge are wall-clock
epoch seconds (`time.time()`), so a browser can show "seen 3 s ago".
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from node.prometheus import Exposition
from node.telemetry_records import (
    MAX_NAME_CHARS,
    EdgeStats,
    MetricPoint,
    PeerGauge,
    RemoteChoice,
    RemoteEdge,
    TrafficCounter,
    edge_dict,
    valid_entries,
)
from p2pfl.text import one_line

# The phases of a round: the first of them marks the first round's start.
ROUND_PHASES = ("train", "exchange", "aggregate")


def process_launch_time(wall_clock: Callable[[], float] = time.time) -> float:
    """When this process was launched (epoch seconds; now where unknown)."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - a missing /proc only loses the start-up breakdown
        return wall_clock()


SENT = "sent"
RECEIVED = "received"

# A refused message's claimed sender is counted per roster site when it names
# one (at most one entry per site), and otherwise under its claimed name in a
# table of its own, at most this many names, the rest under _OTHER_PEER: one
# shared table of 256 let a stranger's 256 made-up names push every later
# refusal of a roster peer into _OTHER_PEER (a review).
_MAX_STRANGER_NAMES = 256
_OTHER_PEER = "<other>"


def _clean_name(name: str) -> str | None:
    """A site name as a peer's gossip gave it, if it is one a roster could
    hold and /peers may show as it is: printable ASCII, at most MAX_NAME_CHARS
    (None otherwise: a right-to-left override or an escape in a shown name)."""
    return name if one_line(name, MAX_NAME_CHARS) == name else None


def _json_copy(value: dict[str, Any]) -> dict[str, Any]:
    """A detached, JSON-clean copy of a protocol's /status block (fails here, not in /status)."""
    return json.loads(json.dumps(value, default=str, allow_nan=False))


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Telemetry:
    """Counters, gauges and metric history of one node; safe across threads."""

    def __init__(
        self,
        me: str,
        *,
        max_history: int = 10_000,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.me = me
        self._wall_clock = wall_clock
        self._started_monotonic = time.monotonic()
        self._started_at = wall_clock()
        self._lock = threading.Lock()

        self._round = 0
        self._phase = "starting"
        self._traffic_by_kind: dict[tuple[str, str], TrafficCounter] = {}
        self._traffic_by_peer: dict[tuple[str, str], TrafficCounter] = {}
        self._edges: dict[tuple[str, str], EdgeStats] = {}
        self._remote_edges: dict[str, dict[tuple[str, str], EdgeStats]] = {}
        self._rejections: dict[str, int] = {}
        self._rejections_by_peer: dict[str, int] = {}  # roster sites only
        self._rejections_by_stranger: dict[str, int] = {}  # names no roster holds
        self._choices: dict[tuple[str, str], int] = {}
        self._remote_choices: dict[str, dict[tuple[str, str], int]] = {}
        self._roster: frozenset[str] | None = None  # set_roster; None: me and known peers
        self._queue_depths: dict[str, int] = {}
        self._peers: dict[str, PeerGauge] = {}
        self._community: dict[str, Any] = {}
        self._training: dict[str, Any] = {}
        self._privacy_gate: dict[str, Any] = {}
        self._error: str | None = None
        self._launched_at = process_launch_time(wall_clock)
        self._startup: dict[str, float] = {}
        self._resources: dict[str, Any] = {}
        self._relays: dict[str, Any] = {}
        self._history: deque[MetricPoint] = deque(maxlen=max_history)
        self._latest_metrics: dict[str, float] = {}
        self._latest_metrics_round: int | None = None

    # ---- traffic -----------------------------------------------------------

    def record_sent(self, peer: str, kind: str, nbytes: int) -> None:
        """One message of `nbytes` pushed or answered to `peer` (edge me -> peer)."""
        self._record_traffic(SENT, peer, kind, nbytes, edge=(self.me, peer))

    def record_received(self, peer: str, kind: str, nbytes: int) -> None:
        """One verified message of `nbytes` from `peer` (edge peer -> me)."""
        self._record_traffic(RECEIVED, peer, kind, nbytes, edge=(peer, self.me))

    def _record_traffic(
        self, direction: str, peer: str, kind: str, nbytes: int, edge: tuple[str, str]
    ) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        now = self._wall_clock()
        with self._lock:
            self._traffic_by_kind.setdefault((direction, kind), TrafficCounter()).add(nbytes)
            self._traffic_by_peer.setdefault((direction, peer), TrafficCounter()).add(nbytes)
            stats = self._edges.setdefault(edge, EdgeStats())
            stats.messages += 1
            stats.bytes += nbytes
            stats.last = now

    def record_rejection(self, reason: str, peer: str | None = None) -> None:
        """A message refused with a reason code; `peer` is the sender it claimed,
        if any. A name on the roster is counted for that site
        (`rejected_by_peer`, one entry per site: a refused frame's name is
        unverified, so a stranger can still get a roster site blamed, as
        /status and the dashboard say). Any other name is a stranger's claim:
        counted apart (`rejected_by_stranger`, printable ASCII, at most
        _MAX_STRANGER_NAMES names and the rest under <other>), so made-up
        names never crowd out a roster site's refusals."""
        with self._lock:
            self._rejections[reason] = self._rejections.get(reason, 0) + 1
            if peer is None:
                return
            if peer in self._names_locked() and _clean_name(peer) is not None:
                self._rejections_by_peer[peer] = self._rejections_by_peer.get(peer, 0) + 1
            else:
                self._count_stranger(peer, 1)

    def _count_stranger(self, peer: str, count: int) -> None:
        """Under the lock: `count` refusals claimed by `peer`, a name no roster holds."""
        if len(peer) > MAX_NAME_CHARS:
            peer = _OTHER_PEER
        peer = one_line(peer, MAX_NAME_CHARS)
        table = self._rejections_by_stranger
        if peer not in table and len(table) >= _MAX_STRANGER_NAMES:
            peer = _OTHER_PEER
        table[peer] = table.get(peer, 0) + count

    def record_choice(self, chooser: str, chosen: list[str]) -> None:
        """`chooser` picked `chosen` as neighbours this round (who-chose-whom matrix)."""
        with self._lock:
            for name in chosen:
                key = (chooser, name)
                self._choices[key] = self._choices.get(key, 0) + 1

    # ---- what peers tell us about the rest of the graph ---------------------

    def local_edges(self) -> list[dict[str, Any]]:
        """Edges this node took part in, in the shape `merge_remote_edges`
        accepts: only those between roster sites. A peer drops the others, and
        after a roster reload to fewer sites they made an honest heartbeat
        larger than its bound (node/membership.py `heartbeat_limit`). All of
        them until a roster is set."""
        with self._lock:
            names = self._roster
            return [
                edge_dict(key, stats)
                for key, stats in sorted(self._edges.items())
                if names is None or (key[0] in names and key[1] in names)
            ]

    def local_choices(self) -> list[dict[str, Any]]:
        """This node's own choices of roster sites, in the shape
        `merge_remote_choices` accepts (only those: as for `local_edges`)."""
        with self._lock:
            names = self._roster
            return [
                {"chooser": chooser, "chosen": chosen, "count": count}
                for (chooser, chosen), count in sorted(self._choices.items())
                if chooser == self.me and (names is None or chosen in names)
            ]

    def set_roster(self, names: list[str]) -> None:
        """The federation's sites (this one included): the only names a peer's
        gossiped edges and choices may name. Until it is set, the known names
        are this node's and those of the peers `set_peer` was given."""
        with self._lock:
            self._roster = frozenset(names) | {self.me}
            for peer in list(self._remote_edges):
                if peer not in self._roster:
                    del self._remote_edges[peer]
            for peer in list(self._remote_choices):
                if peer not in self._roster:
                    del self._remote_choices[peer]
            # A site no longer listed keeps its count, now among the strangers.
            for peer in list(self._rejections_by_peer):
                if peer not in self._roster:
                    self._count_stranger(peer, self._rejections_by_peer.pop(peer))

    def _known_names(self) -> frozenset[str]:
        with self._lock:
            return self._names_locked()

    def _names_locked(self) -> frozenset[str]:
        """Under the lock: the roster, or until it is set this node and the
        peers `set_peer` was given."""
        if self._roster is not None:
            return self._roster
        return frozenset(self._peers) | {self.me}

    def merge_remote_edges(self, peer_name: str, edges: list[dict[str, Any]]) -> int:
        """Replace what `peer_name` last reported about its own edges.

        Counts are cumulative, so a new report replaces the old one. A peer
        speaks only for edges it is an end of whose other end is a roster site
        (a printable name) other than this node: this node's own edges are
        what it measured itself, never a peer's word (a peer claimed 10^18
        messages on one). Other or malformed entries are dropped, and only the
        first 2 x roster entries are looked at (an honest peer has at most
        that many edges). Returns how many edges were kept.
        """
        known = self._known_names()
        kept: dict[tuple[str, str], EdgeStats] = {}
        if peer_name not in known or peer_name == self.me:
            return 0
        valid, dropped = valid_entries(RemoteEdge, edges, peer_name, "edge", 2 * len(known))
        if dropped:
            self.record_rejection("gossip_edges_malformed", peer_name)
        for edge in valid:
            ends = (edge.source, edge.target)
            other = edge.target if edge.source == peer_name else edge.source
            if peer_name not in ends or other == peer_name or other == self.me:
                continue
            if other not in known or _clean_name(other) is None:
                continue
            kept[ends] = EdgeStats(edge.messages, edge.bytes, edge.last)
        with self._lock:
            self._remote_edges[peer_name] = kept
        return len(kept)

    def merge_remote_choices(self, peer_name: str, choices: list[dict[str, Any]]) -> int:
        """Replace `peer_name`'s reported choices: only those it made itself, of
        roster sites (printable names) other than itself; at most the first
        roster-many entries are looked at."""
        known = self._known_names()
        kept: dict[tuple[str, str], int] = {}
        if peer_name not in known or peer_name == self.me:
            return 0
        valid, dropped = valid_entries(RemoteChoice, choices, peer_name, "choice", len(known))
        if dropped:
            self.record_rejection("gossip_choices_malformed", peer_name)
        for choice in valid:
            chosen = choice.chosen
            if choice.chooser != peer_name or chosen == peer_name:
                continue
            if chosen not in known or _clean_name(chosen) is None:
                continue
            kept[(peer_name, chosen)] = choice.count
        with self._lock:
            self._remote_choices[peer_name] = kept
        return len(kept)

    # ---- gauges --------------------------------------------------------------

    def set_queue_depth(self, kind: str, n: int) -> None:
        with self._lock:
            self._queue_depths[kind] = n

    def set_round(self, round_no: int) -> None:
        with self._lock:
            self._round = round_no

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self._phase = phase
        if phase == "waiting_for_peers":
            self.mark_startup("listening")
        elif phase == "start":
            self.mark_startup("peers_ready")
        elif phase in ROUND_PHASES:
            self.mark_startup("first_round")

    def set_resources(self, resources: dict[str, Any]) -> None:
        """Cores and training threads of the nodes on this host (node/resources.py)."""
        detached = json.loads(json.dumps(resources, default=str))
        with self._lock:
            self._resources = detached

    def set_relays(self, relays: dict[str, Any]) -> None:
        """The relays this site connects through or serves as (issue 31), on /status."""
        detached = _json_copy(relays)
        with self._lock:
            self._relays = detached

    def mark_startup(self, milestone: str) -> None:
        """Seconds from the process's launch to a start-up milestone (the first
        time it is reached): node_created (imports, config, keys), listening
        (transport and status up), peers_ready (every peer seen, or
        startup_wait_s over), first_round (the site is built; round 1 runs).
        /status shows them under `startup`."""
        with self._lock:
            if milestone not in self._startup:
                self._startup[milestone] = round(self._wall_clock() - self._launched_at, 3)

    def set_peer(
        self,
        name: str,
        state: str,
        round_no: int = -1,
        phase: str = "",
        last_seen: float = 0.0,
        error: str = "",
    ) -> None:
        """A peer's heartbeat view; `last_seen` in epoch seconds (0 = never);
        `error`: the kind of error that stopped a failed peer's protocol."""
        with self._lock:
            self._peers[name] = PeerGauge(
                state=state, round=round_no, phase=phase, last_seen=last_seen, error=error
            )

    def set_community(self, community: dict[str, Any]) -> None:
        """Free-form, JSON-serialisable protocol state shown on /status (replaces the last)."""
        detached = _json_copy(community)
        with self._lock:
            self._community = detached

    def set_training(self, training: dict[str, Any]) -> None:
        """How the node trains (class weighting, lr, best model), shown on /status."""
        detached = _json_copy(training)
        with self._lock:
            self._training = detached

    def set_error(self, error: str | None) -> None:
        """Why the protocol failed, one line (None while it has not), shown on /status."""
        with self._lock:
            self._error = None if error is None else error.splitlines()[0][:2000]

    def set_privacy_gate(self, decision: dict[str, Any]) -> None:
        """The privacy gate's last decision about this node's synthetic buffer, shown on /status."""
        detached = _json_copy(decision)
        with self._lock:
            self._privacy_gate = detached

    # ---- metrics -------------------------------------------------------------

    def log_metrics(self, round_no: int, **values: float) -> None:
        """Train/eval metrics of a round; history is bounded, the latest kept apart."""
        numbers: dict[str, float] = {}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}")
            numbers[name] = float(value)
        point = MetricPoint(round=round_no, time=self._wall_clock(), values=numbers)
        with self._lock:
            self._history.append(point)
            self._latest_metrics.update(numbers)
            self._latest_metrics_round = round_no

    # ---- readers -------------------------------------------------------------

    def status_json(self, node_name: str, protocol: str) -> dict[str, Any]:
        """The /status document."""
        now = self._wall_clock()
        with self._lock:
            peers = [
                self._peer_entry(name, gauge, now) for name, gauge in sorted(self._peers.items())
            ]
            return {
                "node": node_name,
                "protocol": protocol,
                "round": self._round,
                "phase": self._phase,
                "error": self._error,
                "uptime_s": round(time.monotonic() - self._started_monotonic, 3),
                "started_at": self._started_at,
                "time": now,
                "peers": peers,
                "metrics": {k: _finite_or_none(v) for k, v in self._latest_metrics.items()},
                "metrics_round": self._latest_metrics_round,
                "rejected": dict(sorted(self._rejections.items())),
                "rejected_total": sum(self._rejections.values()),
                "rejected_by_peer": dict(sorted(self._rejections_by_peer.items())),
                "rejected_by_stranger": dict(sorted(self._rejections_by_stranger.items())),
                "messages": self._traffic_summary("messages"),
                "bytes": self._traffic_summary("bytes"),
                "queues": dict(sorted(self._queue_depths.items())),
                "community": self._community,
                "training": self._training,
                "privacy_gate": self._privacy_gate,
                "startup": {"launched_at": self._launched_at, **self._startup},
                "resources": self._resources,
                "relays": self._relays,
            }

    def _peer_entry(self, name: str, gauge: PeerGauge, now: float) -> dict[str, Any]:
        sent = self._traffic_by_peer.get((SENT, name), TrafficCounter())
        received = self._traffic_by_peer.get((RECEIVED, name), TrafficCounter())
        return {
            "name": name,
            "state": gauge.state,
            "round": gauge.round,
            "phase": gauge.phase,
            "error": gauge.error or None,
            "last_seen": gauge.last_seen,
            "seen_ago_s": round(now - gauge.last_seen, 3) if gauge.last_seen > 0 else None,
            "messages_out": sent.messages,
            "messages_in": received.messages,
            "bytes_out": sent.bytes,
            "bytes_in": received.bytes,
        }

    def _traffic_summary(self, field_name: str) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        for direction in (SENT, RECEIVED):
            by_kind = {
                kind: getattr(counter, field_name)
                for (d, kind), counter in sorted(self._traffic_by_kind.items())
                if d == direction
            }
            summary[direction] = {"total": sum(by_kind.values()), "by_kind": by_kind}
        return summary

    def peer_graph(self) -> dict[str, Any]:
        """The /peers document: nodes, directed edges, who-chose-whom counts.

        This node's edges are what it measured. An edge between two other
        sites is what they report (each only of edges it is an end of); seen
        by both ends, the larger count wins (the receiver may have refused
        some of what the sender sent). Every name is a roster site's.
        """
        with self._lock:
            edges: dict[tuple[str, str], EdgeStats] = {
                key: EdgeStats(stats.messages, stats.bytes, stats.last)
                for key, stats in self._edges.items()
            }
            for reported in self._remote_edges.values():
                for key, stats in reported.items():
                    if self.me in key:
                        continue  # never a peer's word on this node's own edges
                    best = edges.get(key)
                    if best is None:
                        edges[key] = EdgeStats(stats.messages, stats.bytes, stats.last)
                    else:
                        best.messages = max(best.messages, stats.messages)
                        best.bytes = max(best.bytes, stats.bytes)
                        best.last = max(best.last, stats.last)
            choices = dict(self._choices)
            for reported_choices in self._remote_choices.values():
                for key, count in reported_choices.items():
                    choices[key] = max(choices.get(key, 0), count)

            nodes: dict[str, dict[str, Any]] = {
                self.me: {"id": self.me, "state": "alive", "round": self._round, "self": True}
            }
            for name, gauge in self._peers.items():
                if name != self.me:
                    nodes[name] = {"id": name, "state": gauge.state, "round": gauge.round}
            for source, target in [*edges, *choices]:
                for name in (source, target):
                    nodes.setdefault(name, {"id": name, "state": "unknown", "round": -1})
            return {
                "me": self.me,
                "nodes": [nodes[name] for name in sorted(nodes)],
                "edges": [edge_dict(key, stats) for key, stats in sorted(edges.items())],
                "choices": [
                    {"chooser": chooser, "chosen": chosen, "count": count}
                    for (chooser, chosen), count in sorted(choices.items())
                ],
            }

    def metrics_history(self) -> dict[str, Any]:
        """The /history document: per metric, the (round, value) points in log order."""
        with self._lock:
            points = list(self._history)
            latest = {k: _finite_or_none(v) for k, v in self._latest_metrics.items()}
            latest_round = self._latest_metrics_round
        series: dict[str, list[dict[str, Any]]] = {}
        for point in points:
            for name, value in point.values.items():
                series.setdefault(name, []).append(
                    {"round": point.round, "value": _finite_or_none(value), "time": point.time}
                )
        return {"series": series, "latest": latest, "latest_round": latest_round}

    def prometheus_text(self, node_name: str) -> str:
        """Exposition format 0.0.4; every sample carries a `node` label."""
        out = Exposition({"node": node_name})
        with self._lock:
            out.gauge("p2pfl_up", "1 while the node daemon runs.", [], [({}, 1)])
            out.gauge(
                "p2pfl_uptime_seconds",
                "Seconds since the node started.",
                [],
                [({}, round(time.monotonic() - self._started_monotonic, 3))],
            )
            out.gauge("p2pfl_round", "Federated round this node is in.", [], [({}, self._round)])
            for family, field_name, help_text in (
                ("p2pfl_messages_total", "messages", "Messages sent or received, by kind."),
                ("p2pfl_bytes_total", "bytes", "Message bytes sent or received, by kind."),
            ):
                out.counter(
                    family,
                    help_text,
                    ["direction", "kind"],
                    [
                        ({"direction": direction, "kind": kind}, getattr(counter, field_name))
                        for (direction, kind), counter in sorted(self._traffic_by_kind.items())
                    ],
                )
            out.counter(
                "p2pfl_rejected_total",
                "Messages refused, by reason code.",
                ["reason"],
                [({"reason": reason}, n) for reason, n in sorted(self._rejections.items())],
            )
            out.gauge(
                "p2pfl_queue_depth",
                "Messages waiting in each inbox, by kind.",
                ["kind"],
                [({"kind": kind}, n) for kind, n in sorted(self._queue_depths.items())],
            )
            out.gauge(
                "p2pfl_peer_up",
                "1 if the peer answers heartbeats (alive), else 0.",
                ["peer"],
                [
                    ({"peer": name}, 1 if gauge.state == "alive" else 0)
                    for name, gauge in sorted(self._peers.items())
                ],
            )
            out.gauge(
                "p2pfl_metric",
                "Latest value of each train/eval metric the protocol logged.",
                ["name"],
                [({"name": name}, v) for name, v in sorted(self._latest_metrics.items())],
            )
        return out.render()
