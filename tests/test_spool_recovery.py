"""What a node reads back at a restart, attacked (persistence review, finding
4): a journal or metrics line torn by a crash must not swallow the next
entry.

The receiver is the daemon's own `node.daemon.Node`, built on a provisioned
site and never started: a frame goes through `Inbound.on_frame` as the
transport hands it over, a restart is a second `Node` on the same state
directory followed by the recovery `Node.start` runs. The sender is a
`WireCodec` holding the peer site's real keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from node.daemon import Node
from node.metricslog import read_metrics
from node.provision import provision
from node.transport import IncomingFrame
from p2pfl.config import load_config
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import PREFIX_LEN, Header, WireCodec, WireError

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
