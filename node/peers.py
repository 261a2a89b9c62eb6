"""The peer table: the roster is the allow-list; signed heartbeats (sent and
received by node/membership.py) say who is alive.

Each node sends every roster peer a heartbeat every `transport.heartbeat_s`
carrying its round, phase, the metadata its protocol published and its traffic
edges. A peer heard from within `suspect_after_s` is alive, within
`dead_after_s` suspect, otherwise dead; a goodbye heartbeat marks it dead at
once, and a heartbeat whose phase is "failed" (its protocol stopped with an
error; the node still answers for what it has) marks it failed at once: a
failed peer is not chosen, not waited for and not counted in a quorum. A node that starts late learns everyone's round and metadata from the
first heartbeats it receives (and it answers with its own at once).

The strings a heartbeat carries are kept as short printable lines
(p2pfl/text.py): `phase` at most MAX_PHASE_CHARS, `error` MAX_ERROR_CHARS.
/status serialises them on every dashboard poll and the log names them: a
64 MiB phase stalled /status for 1.5 s, and a newline in `error` forged a line
of node.log.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from p2pfl.config import TransportSection
from p2pfl.text import one_line
from protocols.base import FAILED, PeerInfo

MAX_PHASE_CHARS = 64  # the longest phase a protocol sets is about half that
MAX_ERROR_CHARS = 80  # an error's kind (DataError), not its message


@dataclass
class PeerRecord:
    info: PeerInfo
    heard_monotonic: float = 0.0
    said_goodbye: bool = False
    done: bool = False
    error: str = ""  # the kind of error a failed peer reported (e.g. DataError)


class PeerTable:
    def __init__(self, me: str, names: list[str], cfg: TransportSection) -> None:
        self.me = me
        self.cfg = cfg
        self.records: dict[str, PeerRecord] = {}
        self.set_roster(names)

    def set_roster(self, names: list[str]) -> None:
        wanted = {n for n in names if n != self.me}
        for name in list(self.records):
            if name not in wanted:
                del self.records[name]
        for name in wanted:
            self.records.setdefault(name, PeerRecord(PeerInfo(name=name)))

    def heard(self, name: str, heartbeat: dict[str, Any]) -> None:
        record = self.records.get(name)
        if record is None:
            return
        info = record.info
        round_ = heartbeat.get("round")
        info.round = round_ if isinstance(round_, int) else info.round
        phase = heartbeat.get("phase")
        info.phase = one_line(phase, MAX_PHASE_CHARS) if isinstance(phase, str) else info.phase
        meta = heartbeat.get("meta")
        if isinstance(meta, dict):
            info.meta = meta
        info.last_seen = time.time()
        record.heard_monotonic = time.monotonic()
        record.said_goodbye = bool(heartbeat.get("bye", False))
        record.done = bool(heartbeat.get("done", False))
        error = heartbeat.get("error")
        record.error = one_line(error, MAX_ERROR_CHARS) if isinstance(error, str) else ""

    def state_of(self, record: PeerRecord, now: float) -> str:
        if record.heard_monotonic == 0.0:
            return "unknown"
        if record.said_goodbye:
            return "dead"
        age = now - record.heard_monotonic
        if age <= self.cfg.suspect_after_s:
            return "failed" if record.info.phase == FAILED else "alive"
        if age <= self.cfg.dead_after_s:
            return "suspect"
        return "dead"

    def refresh(self) -> None:
        now = time.monotonic()
        for record in self.records.values():
            record.info.state = self.state_of(record, now)

    def peers(self, alive_only: bool = True) -> list[PeerInfo]:
        self.refresh()
        infos = [r.info for r in self.records.values()]
        if alive_only:
            infos = [i for i in infos if i.state == "alive"]
        return sorted(infos, key=lambda i: i.name)

    def all_done_or_gone(self) -> bool:
        self.refresh()
        return all(r.done or r.info.state in ("dead", FAILED) for r in self.records.values())
