"""Crash-safe message queues: the spool, the journal, the inboxes, the outbox,
the checkpoints and the replay marks, each a class here (node/inbound.py and
node/daemon.py drive them).

Each received push is delivered to the protocol once, tied to checkpoints:
  1. A verified push is written to `spool/` (p2pfl.files.atomic_write_bytes:
     temp file, fsync, rename, fsync dir) before the sender gets its 200.
  2. It goes to a bounded per-kind inbox. When the protocol takes it, it is
     noted as consumed.
  3. When the protocol next checkpoints, the checkpoint is written with the
     ids consumed since the last one inside it (`consumed`: id, kind, sender,
     round, timestamp), in the same atomic write as the protocol state: the
     state and the ids it covers are on disk together or not at all. Then the
     ids are appended to `journal.jsonl` (fsynced) and their spool files are
     deleted. The journal is derived from the checkpoints (and kept as the
     audit log of every processed id). A last line torn by a crash is cut
     at the next open (p2pfl/files.py `open_append`), so what is appended
     after a restart is never glued onto it.
  4. After a crash the node restores its last checkpoint, appends the ids that
     checkpoint names to the journal where a crash between the two writes left
     them out, counts every journaled id as already seen (their spool files
     are deleted, not re-queued), and re-queues every other spooled frame:
     what was consumed after the checkpoint is consumed again on top of the
     rolled-back state, so it counts once. There is no window: a crash before
     the checkpoint's rename keeps the old state and re-queues; a crash after
     it keeps the new state and the ids with it (the fault plan's
     `checkpointed` kill drills exactly that moment).
A sender that retries after our crash is told it was delivered, never
delivered twice: a 409 `replayed` from the replay cache (seeded with the
journal at start; the sender takes it as delivered), or a 200 when the id is
still spooled or journaled.

Outgoing pushes are written to `outbox/` before the first attempt and removed
once the peer acknowledged them; after a restart pending ones are sent again
with their original message id, so the receiver's dedupe still applies.

Replay across restarts (`ReplayMarks`, `replay_marks.json`): the replay cache
lives in memory, and the journal holds only consumed pushes, so a heartbeat,
request or not yet checkpointed push captured within the clock-skew window
could otherwise be replayed once the node restarted. Before a message stamped
`ts` by sender S has any effect, `replay_marks.json` holds a mark[S] >= ts;
after a restart every message from S stamped at or below mark[S] is refused
`before_restart` (p2pfl/secure/wire.py). The marks are written ahead of time:
each write sets mark[S] to S's predicted clock (our clock plus the offset its
newest message showed) plus `wire.replay_margin_s`, for every sender heard in
this run, in one atomic file write (temp file, fsync, rename), started in the
background once a message comes within half a margin of its mark. So a steady
stream of messages never waits on the disk, the file is written about once
per half margin whatever the number of peers, and only the first message of a
sender after a start (or one stamped beyond its prediction: a sender whose
clock jumped ahead) waits for a write (a few ms, off the event loop).

The cost is after a restart: a sender's fresh messages are refused
`before_restart` until its clock passes its mark, at most one margin after
the crash (less the time the restart took). Senders expect this: a push is
sent again with a fresh timestamp and the same id (node/outbound.py), a
request is asked again, a heartbeat is simply the next one; nothing is lost.
A sender whose clock steps back by d seconds is refused for up to d plus the
margin after our restart (its messages are not otherwise held against it: in a
run the replay cache goes by message ids); a step forward moves its mark
forward with it. Either is bounded by `wire.clock_skew_s`: anything stamped
more than that before our clock is `stale_timestamp` anyway, and marks that
old are dropped. A marks file that cannot be read (not absent: unreadable)
fails closed: every sender is refused for a clock-skew window plus a margin.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pfl.files import (
    append_lines,
    atomic_write_bytes,
    atomic_write_json,
    cut_torn_tail,
    make_private_dir,
)
from p2pfl.secure import tensors
from protocols.base import Received

log = logging.getLogger(__name__)


def unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


# Unreadable spool or outbox files are moved aside (`.corrupt`) for a person to
# look at; only the newest few are kept, so a disk fault or a hostile copy
# cannot fill the state directory with them over many restarts.
KEEP_CORRUPT = 16


def _open_dir(directory: Path) -> Path:
    """Create the folder or make it 0700, drop the temp files a crash left half-written
    in it and all but the newest KEEP_CORRUPT files moved aside."""
    make_private_dir(directory)  # 0755 when an older version made it
    for stale in directory.glob(".*.tmp"):
        stale.unlink(missing_ok=True)
    aside = sorted(directory.glob("*.corrupt"), key=lambda p: p.stat().st_mtime)
    if len(aside) > KEEP_CORRUPT:
        unlink_all(aside[:-KEEP_CORRUPT])
        log.warning(
            "%s: deleted %d older unreadable files moved aside (the newest %d kept)",
            directory,
            len(aside) - KEEP_CORRUPT,
            KEEP_CORRUPT,
        )
    return directory


class Spool:
    """Verified, acknowledged, not yet checkpointed frames."""

    def __init__(self, directory: Path) -> None:
        self.dir = _open_dir(directory)
        # The ids on disk, kept in memory: `has` is asked for every push, on the
        # event loop, and a stat there would wait on the directory's lock.
        self._ids = {p.stem for p in self.dir.glob("*.frame")}
        # who sent each spooled push (node/inbound.py: an id is its sender's, also
        # once the replay cache dropped it; `recover` tells those read at start)
        self._senders: dict[str, str] = {}

    def path(self, msg_id: str) -> Path:
        return self.dir / f"{msg_id}.frame"

    def has(self, msg_id: str) -> bool:
        return msg_id in self._ids

    def sender(self, msg_id: str) -> str:
        """Who sent the spooled push of this id ("" if not known)."""
        return self._senders.get(msg_id, "")

    def sent_by(self, msg_id: str, sender: str) -> None:
        """`sender` sent the spooled push of this id (node/inbound.py)."""
        if msg_id in self._ids:
            self._senders[msg_id] = sender

    def persist(self, msg_id: str, frame: bytearray | bytes) -> Path:
        path = self.path(msg_id)
        atomic_write_bytes(path, frame)
        self._ids.add(msg_id)
        return path

    def remove(self, msg_id: str) -> None:
        self._ids.discard(msg_id)
        self._senders.pop(msg_id, None)
        self.path(msg_id).unlink(missing_ok=True)

    def set_aside(self, msg_id: str) -> None:
        """An unreadable frame: renamed `.corrupt` (the newest KEEP_CORRUPT are
        kept across starts) and no longer held: a resend is taken afresh."""
        self._ids.discard(msg_id)
        self._senders.pop(msg_id, None)
        path = self.path(msg_id)
        path.rename(path.with_suffix(".corrupt"))

    def forget(self, msg_ids: list[str]) -> list[Path]:
        """Drop ids from the spool at once and return their files, for the caller
        to delete off the event loop (an unlink right after an fsync can take
        milliseconds). Only for journaled ids: a restart deletes leftovers."""
        for msg_id in msg_ids:
            self._ids.discard(msg_id)
            self._senders.pop(msg_id, None)
        return [self.path(m) for m in msg_ids]

    def pending(self) -> list[Path]:
        return sorted(self.dir.glob("*.frame"), key=lambda p: p.stat().st_mtime)


class Journal:
    """Append-only log of processed (checkpointed) message ids; bounded in memory."""

    def __init__(self, path: Path, remember: int = 200_000) -> None:
        self.path = path
        self.remember = remember
        self.ids: OrderedDict[str, int] = OrderedDict()
        self._senders: dict[str, str] = {}  # id -> its sender (ids are the sender's)
        # A torn last line after a crash is cut now, before anything is appended:
        # glued onto it, the next id would be lost from the journal for good.
        cut_torn_tail(path)
        if path.exists():
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        entry = json.loads(line)
                        self._remember(entry["id"], int(entry.get("ts", 0)), entry.get("from"))
                    except (ValueError, KeyError, TypeError):
                        log.warning("%s: unreadable journal line skipped", path)
                        continue

    def _remember(self, msg_id: str, ts: int, sender: Any = None) -> None:
        self.ids[msg_id] = ts
        if isinstance(sender, str) and sender:
            self._senders[msg_id] = sender
        while len(self.ids) > self.remember:
            old, _ = self.ids.popitem(last=False)
            self._senders.pop(old, None)

    def sender(self, msg_id: str) -> str:
        """Who sent the push of this id ("" if not known)."""
        return self._senders.get(msg_id, "")

    def __contains__(self, msg_id: object) -> bool:
        return msg_id in self.ids

    def append(self, entries: list[dict[str, Any]]) -> None:
        if not entries:
            return
        append_lines(self.path, (json.dumps(e, separators=(",", ":")) for e in entries))
        for entry in entries:
            self._remember(entry["id"], int(entry.get("ts", 0)), entry.get("from"))


class Reservation:
    """A place held in a TrackedQueue for one push while it is spooled. It is
    given back once, however many paths call `release`: the step that queues
    the push (it becomes the push's place in the queue there, with no await
    between), an error path of that spooling, or the handler if the spooling
    never began. Released when the sender hung up instead, the place counted
    nowhere while the push was still being written, and a sender that hung up
    on every push held more than its share (review 4, R1)."""

    __slots__ = ("queue", "sender", "held")

    def __init__(self, queue: TrackedQueue, sender: str) -> None:
        self.queue = queue
        self.sender = sender
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.queue.unreserve(self.sender)


class TrackedQueue(asyncio.Queue):  # type: ignore[type-arg]
    """An inbox that notes which messages the protocol has taken, and how
    many each sender holds in it (queued, or reserved while being spooled)."""

    def __init__(self, kind: str, maxsize: int, consumed: list[Received]) -> None:
        super().__init__(maxsize=maxsize)
        self.kind = kind
        self.reserved = 0
        self._consumed = consumed
        self.queued_by: Counter[str] = Counter()
        self.reserved_by: Counter[str] = Counter()

    def has_room(self, sender: str | None = None, share: int | None = None) -> bool:
        """Room for one more: in the queue, and (given `sender` and `share`)
        within that sender's share of it."""
        if self.maxsize > 0 and self.qsize() + self.reserved >= self.maxsize:
            return False
        if sender is None or share is None:
            return True
        return self.queued_by[sender] + self.reserved_by[sender] < share

    def reserve(self, sender: str) -> Reservation:
        """Hold a place for a push of `sender` being spooled; given back by the
        returned Reservation's `release`, in the step that queues the push."""
        self.reserved += 1
        self.reserved_by[sender] += 1
        return Reservation(self, sender)

    def unreserve(self, sender: str) -> None:
        self.reserved -= 1
        self.reserved_by[sender] -= 1
        if self.reserved_by[sender] <= 0:
            del self.reserved_by[sender]

    def _put(self, item: Received) -> None:  # called by put() and put_nowait()
        super()._put(item)
        self.queued_by[item.sender] += 1

    def _taken(self, item: Received) -> None:
        self.queued_by[item.sender] -= 1
        if self.queued_by[item.sender] <= 0:
            del self.queued_by[item.sender]

    def _get(self) -> Received:  # called by get() and get_nowait()
        item = super()._get()
        self._taken(item)
        self._consumed.append(item)
        return item

    def discard(self, drop: Callable[[Received], bool]) -> list[Received]:
        """Take the queued items `drop` picks out of the inbox, unconsumed (the
        protocol never sees them); returns them."""
        items: deque[Received] = self._queue  # asyncio.Queue's own store
        gone = [item for item in items if drop(item)]
        if gone:
            kept = [item for item in items if not drop(item)]
            items.clear()
            items.extend(kept)
            for item in gone:
                self._taken(item)
                self.task_done()
        return gone


@dataclass
class Inboxes:
    maxsize: int

    def __post_init__(self) -> None:
        self.queues: dict[str, TrackedQueue] = {}
        self.consumed: list[Received] = []

    def get(self, kind: str) -> TrackedQueue:
        queue = self.queues.get(kind)
        if queue is None:
            queue = self.queues[kind] = TrackedQueue(kind, self.maxsize, self.consumed)
        return queue

    def depths(self) -> dict[str, int]:
        return {kind: q.qsize() for kind, q in self.queues.items()}

    def take_consumed(self) -> list[Received]:
        taken = list(self.consumed)
        self.consumed.clear()
        return taken


@dataclass
class OutboxEntry:
    msg_id: bytes
    peer: str
    kind: str
    round: int
    payload: Any
    created: float
    # the id its record is filed under: its first (`Outbox.rekey` keeps it)
    file_id: bytes | None = None

    @property
    def file(self) -> bytes:
        return self.file_id or self.msg_id


class Outbox:
    """Pushes not yet acknowledged by their peer."""

    def __init__(self, directory: Path) -> None:
        self.dir = _open_dir(directory)

    def add(self, entry: OutboxEntry) -> None:
        record = {
            "id": entry.msg_id,
            "peer": entry.peer,
            "kind": entry.kind,
            "round": entry.round,
            "created": entry.created,
            "payload": entry.payload,
        }
        atomic_write_bytes(self.dir / f"{entry.file.hex()}.out", tensors.encode(record).chunks)

    def rekey(self, entry: OutboxEntry, msg_id: bytes) -> None:
        """`entry` under the fresh id `msg_id` from now on (its peer refused the
        old one `id_taken`: node/outbound.py). Its record is replaced in place,
        filed under its first id: a crash leaves the old id or the new one,
        never both (two records, both sent again, one processed twice)."""
        entry.file_id = entry.file
        entry.msg_id = msg_id
        self.add(entry)

    def done(self, file: bytes) -> None:
        """The record filed under `file` (an entry's `file`) goes."""
        (self.dir / f"{file.hex()}.out").unlink(missing_ok=True)

    def pending(self) -> list[OutboxEntry]:
        out = []
        for path in sorted(self.dir.glob("*.out"), key=lambda p: p.stat().st_mtime):
            try:
                rec = tensors.decode(bytearray(path.read_bytes()), bounded=False)
                out.append(
                    OutboxEntry(
                        rec["id"],
                        rec["peer"],
                        rec["kind"],
                        int(rec["round"]),
                        rec["payload"],
                        float(rec["created"]),
                        bytes.fromhex(path.stem),
                    )
                )
            except (tensors.CodecError, KeyError, TypeError, ValueError, OSError) as exc:
                log.warning("outbox entry %s unreadable (%s); moved aside", path.name, exc)
                path.rename(path.with_suffix(".corrupt"))
        return out


class Checkpoints:
    """Per-round protocol state; keeps the latest few; a torn file is skipped."""

    def __init__(self, directory: Path, keep: int = 3) -> None:
        self.dir = directory
        self.keep = keep
        make_private_dir(self.dir)  # 0755 when an older version made it
        self._seq = max((self._number(p) for p in self.dir.glob("ckpt-*.bin")), default=0)

    @staticmethod
    def _number(path: Path) -> int:
        try:
            return int(path.stem.split("-")[1])
        except (IndexError, ValueError):
            return 0

    def save(self, state: dict[str, Any]) -> Path:
        self._seq += 1
        path = self.dir / f"ckpt-{self._seq:08d}.bin"
        atomic_write_bytes(path, tensors.encode({"saved": time.time(), "state": state}).chunks)
        for old in sorted(self.dir.glob("ckpt-*.bin"), key=self._number)[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> dict[str, Any] | None:
        for path in sorted(self.dir.glob("ckpt-*.bin"), key=self._number, reverse=True):
            try:
                record = tensors.decode(bytearray(path.read_bytes()), bounded=False)
                return record["state"]
            except (tensors.CodecError, KeyError, TypeError, OSError) as exc:
                log.warning("checkpoint %s unreadable (%s); trying an older one", path.name, exc)
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)


class ReplayMarks:
    """Per-sender high-water marks of accepted timestamps, on disk before they
    are needed (the module docstring says how and why). `floor` and
    `floor_all` are what the previous run left: the codec's restart floor."""

    VERSION = 1

    def __init__(self, path: Path, margin_s: float, clock_skew_s: float) -> None:
        self.path = path
        self.margin_ms = int(margin_s * 1000)
        self.skew_ms = int(clock_skew_s * 1000)
        self.floor, self.floor_all = self._load()
        self.durable: dict[str, int] = dict(self.floor)  # what the file holds now
        self._latest: dict[str, int] = {}  # the newest stamp each sender sent in this run
        self._offset: dict[str, int] = {}  # its clock minus ours, from that message (ms)
        self._writing: asyncio.Future[None] | None = None
        self.writes = 0  # file writes in this run
        self.waits = 0  # messages that had to wait for one

    def _load(self) -> tuple[dict[str, int], int]:
        if not self.path.exists():
            return {}, 0
        now = _now_ms()
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            marks = raw["marks"]
            floor_all = raw.get("all", 0)
            if raw.get("v") != self.VERSION or not isinstance(marks, dict):
                raise ValueError("not a replay marks file")
            if not all(
                isinstance(k, str) and type(v) is int for k, v in [*marks.items(), ("", floor_all)]
            ):
                raise ValueError("marks must map names to integers")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # Fail closed: anything stamped up to a skew window ahead of our
            # clock may have been accepted before.
            log.error(
                "replay marks %s unreadable (%s): refusing every sender's messages stamped "
                "before %.0f s from now",
                self.path,
                exc,
                (self.skew_ms + self.margin_ms) / 1000,
            )
            return {}, now + self.skew_ms + self.margin_ms
        # A mark more than a skew window behind our clock guards nothing that
        # stale_timestamp does not refuse already.
        keep = {k: v for k, v in marks.items() if v >= now - self.skew_ms}
        return keep, floor_all if floor_all >= now - self.skew_ms else 0

    async def cover(self, sender: str, ts: int) -> None:
        """Return once the file holds a mark of `sender` at or above `ts` (the
        message stamped `ts` may then be accepted). Raises OSError when the
        marks cannot be written."""
        if ts > self._latest.get(sender, -1):
            self._latest[sender] = ts
            self._offset[sender] = ts - _now_ms()
        if ts > self.mark(sender) - self.margin_ms // 2:
            if ts > self.mark(sender):
                self.waits += 1
                while ts > self.mark(sender):
                    await asyncio.shield(self._write())
            elif self._writing is None:
                self._write().add_done_callback(_log_failure)  # ahead of time, in the background

    def mark(self, sender: str) -> int:
        """The sender's mark on disk now (the floor a restart would start from)."""
        return max(self.durable.get(sender, 0), self.floor_all)

    def _write(self) -> asyncio.Future[None]:
        """The write in flight, or a new one with every sender's next mark."""
        if self._writing is None:
            self._writing = asyncio.ensure_future(self._write_marks())
        return self._writing

    async def _write_marks(self) -> None:
        try:
            now = _now_ms()
            marks = dict(self.durable)
            for sender, latest in self._latest.items():
                ahead = max(latest, now + self._offset[sender]) + self.margin_ms
                marks[sender] = max(marks.get(sender, 0), ahead)
            marks = {k: v for k, v in marks.items() if v >= now - self.skew_ms}
            record = {"v": self.VERSION, "marks": marks, "all": self.floor_all}
            await asyncio.to_thread(atomic_write_json, self.path, record)
            self.durable = marks
            self.writes += 1
        finally:
            self._writing = None


def _log_failure(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("replay marks not written ahead of time: %s", future.exception())
