"""One sender cannot fill a node's inbox (node/inbound.py `sender_share`).

A protocol reads some inboxes only between its trainings (FedER reads relays
after a round's training), so a member that pushed `transport.inbox_size`
messages of such a kind filled it, and its honest peers' pushes of that kind
were refused `queue_full` until the protocol caught up (the second FedER
review: the ring predecessor's relay then went to the next member, which
refused it, and two nodes lost the round). Now each sender holds at most an
equal share of a kind's inbox among the other roster members (at least
SENDER_SHARE_MIN); past it its pushes are refused `queue_full` (503, which a
sender's outbox retries), and everyone else's still get in.

The receiver is the daemon's own `node.daemon.Node` on a provisioned site,
never started; frames go through `Inbound.on_frame` as the transport hands
them over, signed with the sending site's real keys."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import torch

from node.daemon import Node
from node.inbound import SENDER_SHARE_MIN
from node.provision import provision
from node.transport import IncomingFrame, Rejection
from p2pfl.config import load_config
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec

KIND = "probe"
INBOX = 16  # with a, b, c: two others, a share of 8 each


def federation(tmp_path: Path) -> Path:
    provision(
        tmp_path / "fed",
        ["a", "b", "c"],
        protocol={"name": "probe", "rounds": 1},
        overrides={"transport": {"inbox_size": INBOX}},
    )
    return tmp_path / "fed"


def site(fed: Path, name: str) -> tuple[Any, Roster, LocalIdentity]:
    cfg = load_config(fed / name / "site.yaml")
    identity = LocalIdentity.load(name, cfg.signing_key_path, cfg.agreement_key_path)
    return cfg, Roster.load(cfg.federation.roster), identity


def sender(fed: Path, name: str) -> WireCodec:
    cfg, roster, identity = site(fed, name)
    return WireCodec(identity, roster, cfg.federation.id, require_encryption=cfg.wire.encryption)


def deliver(node: Node, codec: WireCodec) -> int | str:
    """One fresh push from `codec`'s site to b: the HTTP status, or the
    reason it was refused."""
    payload = {"round": 1, "from": codec.identity.name, "tensor": torch.ones(4)}
    frame = codec.encode(KIND, "b", payload, round=1, encrypt=codec.require_encryption).to_bytes()
    header, body = node.codec.verify_frame(frame)
    incoming = IncomingFrame(
        header, bytearray(frame), len(frame) - len(body), hashlib.sha256(body).digest()
    )
    try:
        status, _ = asyncio.run(node.inbound.on_frame(incoming))
    except Rejection as exc:
        node.telemetry.record_rejection(exc.reason, header.sender)
        return exc.reason
    return status


def queued(node: Node) -> list[str]:
    return [r.sender for r in list(node.inboxes.get(KIND)._queue)]


def test_one_sender_holds_its_share_of_an_inbox_and_the_others_still_get_in(tmp_path) -> None:
    fed = federation(tmp_path)
    node = Node(*site(fed, "b"))
    assert node.inbound.sender_share() == max(SENDER_SHARE_MIN, INBOX // 2) == 8
    flooder, honest = sender(fed, "c"), sender(fed, "a")
    answers = [deliver(node, flooder) for _ in range(INBOX + 4)]
    assert answers == [200] * 8 + ["queue_full"] * (INBOX + 4 - 8)
    assert [deliver(node, honest) for _ in range(3)] == [200, 200, 200]
    assert queued(node) == ["c"] * 8 + ["a"] * 3
    # once the protocol takes c's pushes, c has room again
    inbox = node.inboxes.get(KIND)
    inbox.get_nowait()
    inbox.get_nowait()
    assert [deliver(node, flooder) for _ in range(3)] == [200, 200, "queue_full"]
    # and pushes taken out unread (a roster reload) free their places too
    inbox.discard(lambda r: r.sender == "c")
    assert inbox.queued_by == {"a": 3}
    assert deliver(node, flooder) == 200
    node.trainer.shutdown(wait=False)


def test_without_the_share_one_sender_fills_the_inbox(tmp_path) -> None:
    """The control: the same flood with the share as large as the inbox."""
    fed = federation(tmp_path)
    node = Node(*site(fed, "b"))
    node.inbound.sender_share = lambda: INBOX  # type: ignore[method-assign]
    flooder, honest = sender(fed, "c"), sender(fed, "a")
    assert [deliver(node, flooder) for _ in range(INBOX)] == [200] * INBOX
    assert deliver(node, honest) == "queue_full"
    node.trainer.shutdown(wait=False)
