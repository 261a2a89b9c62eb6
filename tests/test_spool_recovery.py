"""What a node reads back at a restart, attacked (persistence review, findings
4 and 8): a journal or metrics line torn by a crash must not swallow the
next entry, and a push spooled from a site the roster no longer lists must
not be delivered after a restart or a roster reload.

The receiver is the daemon's own `node.daemon.Node`, built on a provisioned
site and never started: a frame goes through `Inbound.on_frame` as the
transport hands it over, a restart is a second `Node` on the same state
directory followed by the recovery `Node.start` runs. The sender is a
`WireCodec` holding the peer site's real keys.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import stat
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from node.daemon import Node
from node.metricslog import read_metrics
from node.provision import provision
from node.queues import KEEP_CORRUPT
from node.transport import IncomingFrame
from p2pfl.config import load_config
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import PREFIX_LEN, SIG_LEN, Header, WireCodec, WireError

KIND = "probe"


def federation(tmp_path: Path, *, encryption: bool = False) -> Path:
    provision(
        tmp_path / "fed",
        ["a", "b", "c"],
        protocol={"name": "probe", "rounds": 1},
        overrides={"wire": {"encryption": encryption}},
    )
    return tmp_path / "fed"


def site(fed: Path, name: str) -> tuple[Any, Roster, LocalIdentity]:
    cfg = load_config(fed / name / "site.yaml")
    identity = LocalIdentity.load(name, cfg.signing_key_path, cfg.agreement_key_path)
    return cfg, Roster.load(cfg.federation.roster), identity


def start(fed: Path, name: str = "b") -> Node:
    """A node on the site's state directory, recovered as `Node.start` does."""
    node = Node(*site(fed, name))
    checkpoint = node.checkpoints.latest()
    node.inbound.recover(list(checkpoint.get("consumed", [])) if checkpoint else [])
    return node


def crash(node: Node) -> None:
    """What a SIGKILL leaves: the files as they are (only this process's handles closed)."""
    node._metrics_file.close()
    node.trainer.shutdown(wait=False)


def sender(fed: Path, name: str) -> WireCodec:
    cfg, roster, identity = site(fed, name)
    return WireCodec(identity, roster, cfg.federation.id, require_encryption=cfg.wire.encryption)


def push(codec: WireCodec, to: str, *, msg_id: bytes | None = None, ts: int | None = None) -> bytes:
    payload = {"round": 1, "from": codec.identity.name, "tensor": torch.ones(4)}
    return codec.encode(
        KIND,
        to,
        payload,
        round=1,
        encrypt=codec.require_encryption,
        msg_id=msg_id,
        timestamp_ms=ts,
    ).to_bytes()


def frame_id(frame: bytes) -> str:
    n = int.from_bytes(frame[4:PREFIX_LEN], "big")
    return Header.unpack(frame[PREFIX_LEN : PREFIX_LEN + n]).id_hex


def deliver(node: Node, frame: bytes) -> int | str:
    """The frame as the transport hands it to the node: its HTTP status, or
    the reason the wire checks refused it."""
    try:
        header, payload = node.codec.verify_frame(frame)
    except WireError as exc:
        return exc.reason
    incoming = IncomingFrame(
        header, bytearray(frame), len(frame) - len(payload), hashlib.sha256(payload).digest()
    )
    status, _ = asyncio.run(node.inbound.on_frame(incoming))
    return status


def queued(node: Node) -> list[str]:
    inbox = node.inboxes.get(KIND)
    return [r.sender for r in list(inbox._queue)]


def rejected(node: Node) -> dict[str, Any]:
    status = node.telemetry.status_json(node.name, "probe")
    return {
        "rejected": status["rejected"],
        "by_peer": status["rejected_by_peer"],  # roster sites
        "by_stranger": status["rejected_by_stranger"],  # names no roster holds (c, removed)
    }


def remove_from_roster(fed: Path, name: str) -> None:
    path = fed / "roster.yaml"
    roster = Roster.load(path)
    Roster([c for c in roster.cards() if c.name != name], path, roster.relays).save()


# --------------------------------------------------------------------------- finding 4


def test_a_torn_journal_line_loses_no_id_and_a_resend_is_not_processed_twice(tmp_path, caplog):
    """The review's scenario: b takes a push X, checkpoints it and is killed in
    the middle of appending X to the journal. At the restart recover() journals
    X again (the checkpoint names it) and deletes its spool file; the next
    checkpoint no longer names X. Glued onto the torn fragment, X's entry was
    unreadable on the next start: a resend of X (same id, fresh timestamp, as
    the outbox sends it) was queued and processed a second time."""
    fed = federation(tmp_path)
    a = sender(fed, "a")
    journal = fed / "b" / "state" / "journal.jsonl"

    first = start(fed)
    first.journal.append([{"id": "00" * 16, "kind": KIND, "ts": 1}])  # an earlier round's
    frame = push(a, "b")
    msg_id = frame_id(frame)
    assert deliver(first, frame) == 200 and queued(first) == ["a"]
    first.inboxes.get(KIND).get_nowait()  # the protocol takes it
    consumed = first.inbound.consumed_records(first.inboxes.take_consumed())
    first.checkpoints.save({"round": 1, "protocol": {}, "consumed": consumed})
    with open(journal, "a", encoding="utf-8") as fh:  # killed mid-append
        fh.write(json.dumps(consumed[0], separators=(",", ":"))[:25])
    crash(first)

    with caplog.at_level("WARNING", logger="p2pfl.files"):
        second = start(fed)  # re-journals X, deletes its spool file
    cut = [r.getMessage() for r in caplog.records if "torn last line" in r.getMessage()]
    assert len(cut) == 1 and "cut 25 bytes" in cut[0] and str(journal) in cut[0], cut
    assert msg_id in second.journal
    assert not (fed / "b" / "state" / "spool" / f"{msg_id}.frame").exists()
    second.save_checkpoint({"round": 2})  # the next round's: X is in the journal only now
    crash(second)

    lines = journal.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["00" * 16, msg_id]  # every line parses
    third = start(fed)
    assert msg_id in third.journal
    floor = third.codec.restart_floor.get("a", 0)
    resend = push(a, "b", msg_id=bytes.fromhex(msg_id), ts=max(floor + 1, int(time.time() * 1000)))
    assert deliver(third, resend) == "replayed"  # answered as delivered, not taken again
    assert queued(third) == []
    crash(third)


def test_a_torn_metrics_row_does_not_swallow_the_next_round(tmp_path):
    """The same for metrics.jsonl: glued onto a torn row, the next round's row
    (and with it its dp_epsilon) was unreadable."""
    fed = federation(tmp_path)
    metrics = fed / "b" / "state" / "metrics.jsonl"
    metrics.write_text('{"round": 1, "dp_epsilon": 0.5}\n{"round": 2, "dp_eps')
    node = start(fed)
    node.log_metrics(2, {"dp_epsilon": 0.75})
    crash(node)
    rows = read_metrics(metrics)
    assert [(r["round"], r["dp_epsilon"]) for r in rows] == [(1, 0.5), (2, 0.75)]
    assert all(json.loads(line) for line in metrics.read_text().splitlines())


# --------------------------------------------------------------------------- finding 8


@pytest.mark.parametrize("encryption", [False, True], ids=["clear", "encrypted"])
def test_a_push_spooled_from_a_site_removed_before_the_restart_is_not_delivered(
    tmp_path, encryption
):
    """c's push is verified, spooled and acknowledged; c is then removed from
    the roster (revoked) and b restarts. Without the re-check the push was
    delivered to the protocol (encryption off), or renamed .corrupt and kept
    for good (encryption on). Now it is deleted and counted; a's is delivered."""
    fed = federation(tmp_path, encryption=encryption)
    spool = fed / "b" / "state" / "spool"
    first = start(fed)
    assert deliver(first, push(sender(fed, "c"), "b")) == 200
    assert deliver(first, push(sender(fed, "a"), "b")) == 200
    assert sorted(queued(first)) == ["a", "c"] and len(list(spool.glob("*.frame"))) == 2
    crash(first)

    remove_from_roster(fed, "c")
    second = start(fed)
    assert queued(second) == ["a"]
    assert len(list(spool.glob("*.frame"))) == 1
    assert not list(spool.glob("*.corrupt"))
    seen = rejected(second)
    assert seen["rejected"] == {"unknown_sender": 1} and seen["by_stranger"] == {"c": 1}, seen
    crash(second)


def test_a_spooled_push_whose_signature_no_longer_verifies_is_not_delivered(tmp_path):
    """The same check covers a site whose card now carries another key (its
    old one compromised and rotated out): the spooled frame's signature is
    checked again against the roster of this start."""
    fed = federation(tmp_path)
    first = start(fed)
    assert deliver(first, push(sender(fed, "a"), "b")) == 200
    crash(first)
    path = fed / "roster.yaml"
    roster = Roster.load(path)
    fresh = LocalIdentity.generate("a").card(roster["a"].address)
    Roster([fresh if c.name == "a" else c for c in roster.cards()], path, roster.relays).save()
    second = start(fed)
    assert queued(second) == []
    assert rejected(second)["rejected"] == {"bad_signature": 1}
    assert not list((fed / "b" / "state" / "spool").iterdir())
    crash(second)


def test_a_roster_reload_drops_the_queued_pushes_of_a_removed_site(tmp_path):
    """SIGHUP with c removed: c's pushes still waiting in the inbox are taken
    out before the protocol sees them, their spool files deleted and counted;
    what the protocol already took stays taken."""
    fed = federation(tmp_path)
    node = start(fed)
    c, a = sender(fed, "c"), sender(fed, "a")
    assert deliver(node, push(c, "b")) == 200
    node.inboxes.get(KIND).get_nowait()  # consumed before the reload
    for frame in (push(c, "b"), push(a, "b"), push(c, "b")):
        assert deliver(node, frame) == 200
    assert queued(node) == ["c", "a", "c"]
    remove_from_roster(fed, "c")
    node.reload_roster()
    assert queued(node) == ["a"]
    assert node.inboxes.get(KIND).qsize() == 1 and len(node.inboxes.consumed) == 1
    assert len(list((fed / "b" / "state" / "spool").glob("*.frame"))) == 2  # a's and the taken
    seen = rejected(node)
    assert seen["rejected"] == {"unknown_sender": 2} and seen["by_stranger"] == {"c": 2}, seen
    assert deliver(node, push(c, "b")) == "unknown_sender"
    crash(node)


def test_unreadable_spool_and_outbox_leftovers_are_capped(tmp_path):
    """Frames moved aside (.corrupt) were never cleaned up: each start now keeps
    the newest KEEP_CORRUPT of each folder."""
    fed = federation(tmp_path)
    state = fed / "b" / "state"
    for folder in ("spool", "outbox"):
        (state / folder).mkdir(parents=True, exist_ok=True)
        for i in range(KEEP_CORRUPT + 5):
            path = state / folder / f"{i:032x}.corrupt"
            path.write_bytes(b"junk")
            os.utime(path, (1_000_000 + i, 1_000_000 + i))
    (state / "spool" / f"{'ff' * 16}.frame").write_bytes(b"not a frame")
    node = start(fed)
    spool = sorted(p.name for p in (state / "spool").glob("*.corrupt"))
    outbox = sorted(p.name for p in (state / "outbox").glob("*.corrupt"))
    assert len(outbox) == KEEP_CORRUPT and outbox[0] == f"{5:032x}.corrupt"  # the newest kept
    assert len(spool) == KEEP_CORRUPT + 1 and f"{'ff' * 16}.corrupt" in spool  # this start's
    assert not node.spool.has("ff" * 16)  # moved aside: a resend is taken afresh
    crash(node)


# --------------------------------------------------------------------------- second review


class Streaming:
    """A POST body as MessageServer reads it (aiohttp StreamReader's methods):
    the signed header at once, the payload only when `go` is set, as a peer
    that is still uploading."""

    def __init__(self, frame: bytes) -> None:
        n = int.from_bytes(frame[4:PREFIX_LEN], "big")
        self.head, self.payload = (
            frame[: PREFIX_LEN + n + SIG_LEN],
            frame[PREFIX_LEN + n + SIG_LEN :],
        )
        self.go = asyncio.Event()
        self.sent = False

    async def readexactly(self, n: int) -> bytes:
        part, self.head = self.head[:n], self.head[n:]
        return part

    async def readany(self) -> bytes:
        await self.go.wait()
        if self.sent:
            return b""
        self.sent = True
        return self.payload

    def at_eof(self) -> bool:
        return self.sent

    async def read(self, n: int = -1) -> bytes:
        return await self.readany()


@pytest.mark.parametrize("when", ["streaming", "spooling"])
def test_a_push_arriving_across_the_reload_that_removes_its_sender_is_refused(tmp_path, when):
    """Review 2, finding 2: the transport checks the sender before the payload
    streams in, and the reload's purge (drop_unlisted) runs once. A push of c
    whose payload was still arriving (or being written to the spool) when a
    SIGHUP removed c was acknowledged, spooled and queued for the protocol.
    Through the node's own MessageServer: now refused unknown_sender, counted,
    no ack, nothing spooled or queued."""
    fed = federation(tmp_path)
    node = start(fed)
    frame = push(sender(fed, "c"), "b")
    stream = Streaming(frame)

    def revoke() -> None:
        remove_from_roster(fed, "c")
        node.reload_roster()

    async def run() -> Any:
        loop = asyncio.get_running_loop()
        if when == "spooling":  # the reload lands while the frame is fsynced off the loop
            persist = node.spool.persist

            def slow_persist(msg_id: str, data: Any) -> Any:
                done = threading.Event()
                loop.call_soon_threadsafe(lambda: (revoke(), done.set()))
                assert done.wait(10)
                return persist(msg_id, data)

            node.spool.persist = slow_persist  # type: ignore[method-assign]
            stream.go.set()
            return await node.server.receive(stream, len(frame))
        receiving = asyncio.create_task(node.server.receive(stream, len(frame)))
        while not node.server._in_flight:  # header verified, payload not yet there
            await asyncio.sleep(0.001)
        revoke()
        stream.go.set()
        return await receiving

    response = asyncio.run(run())
    body = json.loads(response.body)
    assert response.status == 403 and body["reason"] == "unknown_sender", body
    assert "ack" not in body  # c is not told it was delivered
    assert queued(node) == []
    assert not list((fed / "b" / "state" / "spool").iterdir())
    seen = rejected(node)
    assert seen["rejected"] == {"unknown_sender": 1} and seen["by_stranger"] == {"c": 1}, seen
    crash(node)
    again = start(fed)  # and nothing of it comes back at a restart
    assert queued(again) == [] and rejected(again)["rejected"] == {}
    crash(again)


def rotate_card(fed: Path, name: str, previous_valid_until: float | None) -> None:
    """The roster's card of `name` with a new signing key; its old one stays as
    the previous key until `previous_valid_until` (`keygen --rotate
    --grace-hours`), or is dropped (None)."""
    path = fed / "roster.yaml"
    roster = Roster.load(path)
    old = roster[name].card
    new = LocalIdentity.generate(name).card(old.address)
    new = dataclasses.replace(new, agreement_key=old.agreement_key)
    if previous_valid_until is not None:
        new = dataclasses.replace(
            new,
            previous_signing_key=old.signing_key,
            previous_valid_until=previous_valid_until,
        )
    Roster([new if c.name == name else c for c in roster.cards()], path, roster.relays).save()


DAY = 86400.0


@pytest.mark.parametrize(
    ("case", "kept"),
    [
        ("grace_ended_in_the_spool", True),
        ("sender_clock_ahead", True),
        ("old_key_dropped", False),
        ("revoked_before_it_was_signed", False),
    ],
)
def test_a_spooled_push_is_judged_by_the_key_valid_when_it_was_signed(
    tmp_path, monkeypatch, case, kept
):
    """Review 2, finding 3: a signed the push with its previous key during the
    grace period of a rotation (docs/operations.md), b verified, spooled and
    acknowledged it; b restarted after the deadline and recover() checked the
    key at the clock of the restart: bad_signature, deleted, lost for good (a
    had its ack). Now the key is judged at the frame's signed timestamp (or
    its spool time, if earlier: a sender whose clock runs ahead). A card that
    no longer names the old key, or whose deadline came before the frame was
    signed (a compromised key, `--grace-hours 0`), still refuses it."""
    fed = federation(tmp_path)
    now = time.time()
    if case != "revoked_before_it_was_signed":  # b has the rotated card when the push comes
        rotate_card(fed, "a", now + (60 if case == "sender_clock_ahead" else 2 * DAY))
    first = start(fed)
    a_old_key = sender(fed, "a")  # a's node still signs with its old key
    ts = int((time.time() + (120 if case == "sender_clock_ahead" else 0)) * 1000)
    assert deliver(first, push(a_old_key, "b", ts=ts)) == 200
    crash(first)
    if case == "old_key_dropped":
        rotate_card(fed, "a", None)
    elif case == "revoked_before_it_was_signed":  # revoked at once, 10 s before it was signed
        rotate_card(fed, "a", ts / 1000 - 10)
    # b restarts three days later, long after any grace period
    later = SimpleNamespace(time=lambda: time.time() + 3 * DAY)
    monkeypatch.setattr("p2pfl.secure.identity.time", later)
    second = start(fed)
    spooled = list((fed / "b" / "state" / "spool").glob("*.frame"))
    if kept:
        assert queued(second) == ["a"] and len(spooled) == 1
        assert rejected(second)["rejected"] == {}
    else:
        assert queued(second) == [] and not spooled
        seen = rejected(second)
        assert seen["rejected"] == {"bad_signature": 1} and seen["by_peer"] == {"a": 1}, seen
    crash(second)


@pytest.mark.parametrize("encryption", [False, True], ids=["clear", "encrypted"])
def test_spooled_pushes_moved_aside_as_unreadable_are_counted(tmp_path, encryption):
    """Review 2, finding 6: an acknowledged push that a restart cannot read
    (its header torn, or its payload altered on disk) is moved aside .corrupt
    and never delivered, but only a log line said so. Now each is counted
    `spool_unreadable` on /status and /metrics, under its sender when its
    header verified; a readable push beside them is still delivered."""
    fed = federation(tmp_path, encryption=encryption)
    spool = fed / "b" / "state" / "spool"
    first = start(fed)
    frames = [push(sender(fed, "a"), "b"), push(sender(fed, "c"), "b")]
    for frame in frames:
        assert deliver(first, frame) == 200
    crash(first)
    altered = spool / f"{frame_id(frames[0])}.frame"
    data = bytearray(altered.read_bytes())
    data[-3] ^= 0xFF  # the payload: the signed header still verifies
    altered.write_bytes(bytes(data))
    (spool / f"{'ee' * 16}.frame").write_bytes(b"\x00" * 7)  # not even a header

    second = start(fed)
    assert queued(second) == ["c"]
    assert sorted(p.name for p in spool.glob("*.corrupt")) == sorted(
        [f"{'ee' * 16}.corrupt", f"{frame_id(frames[0])}.corrupt"]
    )
    seen = rejected(second)
    assert seen["rejected"] == {"spool_unreadable": 2} and seen["by_peer"] == {"a": 1}, seen
    metrics = second.telemetry.prometheus_text(second.name)
    assert 'p2pfl_rejected_total{node="b",reason="spool_unreadable"} 2.0' in metrics
    crash(second)


def test_an_upgraded_node_leaves_nothing_of_the_older_version_readable(tmp_path):
    """Review 2, finding 4, as the review ran it: the state directory of a
    version before the 0600 files (umask 022: 0755 folders, 0644 checkpoint,
    encoder, compression copy, spooled frame) and the upgraded node started on
    it. Nothing under the state directory keeps a group or other bit."""
    from node.queues import Checkpoints

    fed = federation(tmp_path)
    state = fed / "b" / "state"
    old = os.umask(0o022)
    try:
        for folder in ("checkpoints", "spool", "outbox", "compression"):
            (state / folder).mkdir(exist_ok=True)
            (state / folder).chmod(0o755)
        Checkpoints(state / "checkpoints").save({"round": 7, "protocol": {}, "consumed": []})
        frame = push(sender(fed, "a"), "b")
        written = {
            "checkpoints/ckpt-00000001.bin": None,
            f"spool/{frame_id(frame)}.frame": frame,
            "pretrained_encoder.pt": b"weights",
            "compression/copy.safetensors": b"a model copy",
        }
        for name, data in written.items():
            if data is not None:
                (state / name).write_bytes(data)
            (state / name).chmod(0o644)
    finally:
        os.umask(old)
    node = start(fed)
    assert queued(node) == ["a"]  # the spooled frame is still delivered
    crash(node)
    wide = {
        str(p.relative_to(state)): oct(stat.S_IMODE(p.lstat().st_mode))
        for p in state.rglob("*")
        if stat.S_IMODE(p.lstat().st_mode) & 0o077
    }
    assert wide == {}, wide
    assert all((state / name).exists() for name in written)
