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
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from node.daemon import Node
from node.inbound import SENDER_SHARE_MIN
from node.provision import provision
from node.transport import IncomingFrame, Rejection
from p2pfl.config import load_config
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec
from protocols.base import Received

KIND = "probe"
INBOX = 16  # with a, b, c: two others, a share of 8 each


def federation(tmp_path: Path, **transport: Any) -> Path:
    provision(
        tmp_path / "fed",
        ["a", "b", "c"],
        protocol={"name": "probe", "rounds": 1},
        overrides={"transport": {"inbox_size": INBOX, **transport}},
    )
    return tmp_path / "fed"


def site(fed: Path, name: str) -> tuple[Any, Roster, LocalIdentity]:
    cfg = load_config(fed / name / "site.yaml")
    identity = LocalIdentity.load(name, cfg.signing_key_path, cfg.agreement_key_path)
    return cfg, Roster.load(cfg.federation.roster), identity


def sender(fed: Path, name: str) -> WireCodec:
    cfg, roster, identity = site(fed, name)
    return WireCodec(identity, roster, cfg.federation.id, require_encryption=cfg.wire.encryption)


def push(node: Node, codec: WireCodec) -> IncomingFrame:
    """One fresh push from `codec`'s site to b, as the transport hands it over."""
    payload = {"round": 1, "from": codec.identity.name, "tensor": torch.ones(4)}
    frame = codec.encode(KIND, "b", payload, round=1, encrypt=codec.require_encryption).to_bytes()
    header, body = node.codec.verify_frame(frame)
    return IncomingFrame(
        header, bytearray(frame), len(frame) - len(body), hashlib.sha256(body).digest()
    )


def deliver(node: Node, codec: WireCodec) -> int | str:
    """One fresh push from `codec`'s site to b: the HTTP status, or the
    reason it was refused."""
    incoming = push(node, codec)
    header = incoming.header
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


# ------------------------------------------------------------------ review 4


def hold_spool(node: Node) -> threading.Event:
    """b's spool writes wait until the returned event is set: the fsync of a
    large frame, lasting as long as the test needs."""
    go = threading.Event()
    write = node.spool.persist

    def persist(msg_id: str, frame: bytearray | bytes) -> Path:
        assert go.wait(10), "the test never let the spool write go on"
        return write(msg_id, frame)

    node.spool.persist = persist  # type: ignore[method-assign]
    return go


async def until(check: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


def test_a_sender_that_hangs_up_keeps_its_place_until_its_push_is_queued(tmp_path) -> None:
    """R1: c sends its share and hangs up on each push while it is being
    spooled (the transport cancels the handler; the spooling goes on). Its
    places stay held until its pushes are queued: its next push is refused,
    an honest push still gets in and is queued, and nothing is left reserved.
    Before, the hang-up gave each place back at once: c got a second share in
    (16 of 16 places) and a's push, spooled meanwhile, hit a full queue."""
    fed = federation(tmp_path)
    node = Node(*site(fed, "b"))
    go = hold_spool(node)
    flooder, honest = sender(fed, "c"), sender(fed, "a")
    inbox = node.inboxes.get(KIND)
    share = node.inbound.sender_share()
    outcome: dict[str, Any] = {}

    async def main() -> None:
        # c's held spool writes must not take every worker thread the default
        # executor has (6 on 2 cores): a's push needs one for the replay marks
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4 * share))
        handlers = [
            asyncio.ensure_future(node.inbound.on_frame(push(node, flooder))) for _ in range(share)
        ]
        await until(lambda: len(node.inbound._keeping) == share, "c's pushes not being spooled")
        for handler in handlers:
            handler.cancel()  # c hangs up on every connection
        await asyncio.gather(*handlers, return_exceptions=True)
        outcome["held"] = (inbox.reserved, dict(inbox.reserved_by), inbox.qsize())
        more = asyncio.ensure_future(node.inbound.on_frame(push(node, flooder)))
        await asyncio.wait({more}, timeout=5)
        a = asyncio.ensure_future(node.inbound.on_frame(push(node, honest)))
        await until(lambda: any(r == "a" for r in inbox.reserved_by), "a's push not admitted")
        go.set()
        outcome["honest"] = await a
        try:
            outcome["more"] = await more
        except Rejection as exc:
            outcome["more"] = exc.reason
        await until(lambda: not node.inbound._keeping, "spooling never ended")

    try:
        asyncio.run(main())
    finally:
        go.set()
        node.trainer.shutdown(wait=False)
    assert outcome["held"] == (share, {"c": share}, 0)  # held, though nobody waits for them
    assert outcome["more"] == "queue_full"
    assert outcome["honest"] == (200, None)
    assert queued(node).count("c") == share and queued(node).count("a") == 1
    assert dict(inbox.queued_by) == {"c": share, "a": 1}
    assert (inbox.reserved, dict(inbox.reserved_by)) == (0, {})
    assert sorted(p.stem for p in node.spool.pending()) == sorted(r.msg_id for r in inbox._queue)


def test_a_push_spooled_when_its_inbox_is_full_is_removed_and_refused(tmp_path) -> None:
    """R1: should a push find its inbox full once spooled (not expected while
    every push holds its place until queued; forced here by filling the queue
    behind the reservations' back), it is refused `queue_full`, its spool file
    removed: never acknowledged, and its resend is taken afresh, not answered
    200 from a spooled copy the protocol never sees."""
    fed = federation(tmp_path)
    node = Node(*site(fed, "b"))
    go = hold_spool(node)
    inbox = node.inboxes.get(KIND)
    incoming = push(node, sender(fed, "a"))
    msg_id = incoming.header.id_hex
    outcome: dict[str, Any] = {}

    async def main() -> None:
        a = asyncio.ensure_future(node.inbound.on_frame(incoming))
        await until(lambda: msg_id in node.inbound._keeping, "a's push not being spooled")
        for i in range(INBOX):
            inbox.put_nowait(Received("c", KIND, 1, None, f"{i:032x}"))
        go.set()
        try:
            outcome["first"] = await a
        except Rejection as exc:
            outcome["first"] = exc.reason
        outcome["after"] = (
            node.spool.has(msg_id),
            node.spool.path(msg_id).exists(),
            msg_id in node.inbound._keeping,
            msg_id in node.inbound._spool_ts,
            inbox.reserved,
            dict(inbox.reserved_by),
        )
        inbox.get_nowait()  # the protocol takes one: room again
        outcome["resend"] = await node.inbound.on_frame(incoming)

    try:
        asyncio.run(main())
    finally:
        go.set()
        node.trainer.shutdown(wait=False)
    assert outcome["first"] == "queue_full"
    assert outcome["after"] == (False, False, False, False, 0, {})
    assert outcome["resend"] == (200, None)
    assert queued(node)[-1] == "a" and node.spool.has(msg_id)  # taken afresh, and queued


def test_a_push_refused_before_it_is_queued_gives_its_place_back_once(tmp_path) -> None:
    """R1: every way a reserved push ends without being queued gives its place
    back, exactly once: a hang-up before the spooling began (while the payload
    is opened), a spool write that fails, a sender removed from the roster
    meanwhile, and a spooling task cancelled before it ran."""
    fed = federation(tmp_path)
    node = Node(*site(fed, "b"))
    inbox = node.inboxes.get(KIND)
    flooder = sender(fed, "c")
    counts: list[tuple[int, dict[str, int]]] = []

    def count() -> None:
        counts.append((inbox.reserved, dict(inbox.reserved_by)))

    async def main() -> None:
        opening = asyncio.Event()
        open_ = node.inbound._open

        async def slow_open(incoming: IncomingFrame) -> Any:
            opening.set()
            await asyncio.sleep(10)
            return await open_(incoming)

        node.inbound._open = slow_open  # type: ignore[method-assign]
        handler = asyncio.ensure_future(node.inbound.on_frame(push(node, flooder)))
        await opening.wait()
        assert inbox.reserved_by == {"c": 1}
        handler.cancel()  # c hangs up while its payload is opened
        await asyncio.gather(handler, return_exceptions=True)
        count()
        node.inbound._open = open_  # type: ignore[method-assign]

        def broken(msg_id: str, frame: bytearray | bytes) -> Path:
            raise OSError(28, "No space left on device")

        write = node.spool.persist
        node.spool.persist = broken  # type: ignore[method-assign]
        with pytest.raises(OSError):
            await node.inbound.on_frame(push(node, flooder))
        count()
        # _keep gives it back itself, in the step that fails (not one callback later)
        slot = inbox.reserve("c")
        with pytest.raises(OSError):
            await node.inbound._keep(push(node, flooder), None, inbox, slot)
        assert not slot.held
        count()
        node.spool.persist = write  # type: ignore[method-assign]

        incoming = push(node, flooder)
        roster = node.codec.roster
        names = roster.names

        def gone() -> Any:  # c removed from the roster while its push is spooled
            node.codec.roster = type(
                "R", (), {"names": names, "__contains__": lambda s, n: n != "c"}
            )()

        gone_after = asyncio.get_running_loop().call_soon
        with pytest.raises(Rejection) as err:
            gone_after(gone)
            await node.inbound.on_frame(incoming)
        node.codec.roster = roster
        assert err.value.reason == "unknown_sender" and not node.spool.has(incoming.header.id_hex)
        count()

        slot = inbox.reserve("c")
        never_ran = asyncio.get_running_loop().create_future()
        never_ran.cancel()
        node.inbound._kept("0" * 32, slot, never_ran)
        count()
        slot.release()  # a second release is a no-op
        count()

    try:
        asyncio.run(main())
    finally:
        node.trainer.shutdown(wait=False)
    assert counts == [(0, {})] * 6
    assert inbox.qsize() == 0 and not list(node.spool.pending())


def test_a_restart_keeps_at_most_a_senders_share_of_its_spooled_pushes(tmp_path) -> None:
    """R3: a's push, acknowledged, then 20 newer ones from c, all spooled (the
    protocol consumed c's and no checkpoint followed). The restart keeps c's
    newest 8 (its share) and a's, and deletes and counts c's 12 older ones.
    Before, it kept the newest 16 whoever sent them: c held the whole inbox
    and a's acknowledged push was deleted, never delivered."""
    fed = federation(tmp_path)
    node = Node(*site(fed, "b"))
    share = node.inbound.sender_share()
    flooder, honest = sender(fed, "c"), sender(fed, "a")
    t0 = time.time() - 100
    ids: list[str] = []
    for i, codec in enumerate([honest] + [flooder] * (INBOX + 4)):
        incoming = push(node, codec)
        path = node.spool.persist(incoming.header.id_hex, incoming.frame)
        os.utime(path, (t0 + i, t0 + i))  # spooled in this order
        ids.append(incoming.header.id_hex)
    node.trainer.shutdown(wait=False)

    again = Node(*site(fed, "b"))  # the restart
    again.inbound.accept_kinds({KIND}, pushes={KIND})
    try:
        assert again.inbound.recover([]) == share + 1
        inbox = again.inboxes.get(KIND)
        assert dict(inbox.queued_by) == {"a": 1, "c": share}
        assert [r.msg_id for r in inbox._queue] == [ids[0]] + ids[-share:]  # oldest first
        assert again.spool.has(ids[0])
        assert sorted(p.stem for p in again.spool.pending()) == sorted([ids[0]] + ids[-share:])
        counted = again.telemetry._rejections_by_peer
        assert again.telemetry._rejections == {"queue_full": INBOX + 4 - share}
        assert counted == {"c": INBOX + 4 - share}
    finally:
        again.trainer.shutdown(wait=False)


def test_no_one_sender_holds_more_than_half_of_a_small_inbox(tmp_path) -> None:
    """Review 6: with `transport.inbox_size` 8 the floor of 8 was the whole
    inbox, so one member filled it alone."""
    provision(
        tmp_path / "fed",
        ["a", "b", "c", "d", "e"],
        protocol={"name": "probe", "rounds": 1},
        overrides={"transport": {"inbox_size": 8}},
    )
    fed = tmp_path / "fed"
    node = Node(*site(fed, "b"))
    assert node.inbound.sender_share() == 4
    flooder, honest = sender(fed, "c"), sender(fed, "a")
    assert [deliver(node, flooder) for _ in range(6)] == [200] * 4 + ["queue_full"] * 2
    assert deliver(node, honest) == 200
    node.trainer.shutdown(wait=False)
