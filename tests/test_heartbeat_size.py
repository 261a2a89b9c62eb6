"""A heartbeat's own size bound (node/membership.py `heartbeat_limit`).

A review of 2026-11-28: only wire.max_message_bytes (512 MiB) bounded a
heartbeat, decoded in a thread that holds the interpreter lock and then kept
as the peer's metadata until its next one. The largest honest heartbeat (every
gossiped field at its largest honest size) must still be taken; a larger one
is refused `heartbeat_oversize` from its signed header, its payload unread.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fault_util import read_reply
from test_hostile_wire import codec, incoming, make_inbound

from node.membership import HEARTBEAT, Membership, Progress, heartbeat_limit
from node.telemetry import Telemetry
from node.transport import MESSAGE_PATH, MessageServer, Rejection
from p2pfl.config import TransportSection
from p2pfl.secure import tensors
from p2pfl.secure.wire import PREFIX_LEN, SIG_LEN

WIDEST_INT = 2**62  # 9 bytes of msgpack, as the largest counts are
NUMBER = 0.123456789  # a float64: 9 bytes of msgpack


def site_names(n: int, me: str = "") -> list[str]:
    """`n` roster names of the longest kind (64 characters), `me` among them if given."""
    names = [f"s{i:063d}" for i in range(n)]
    return [me, *names[1:]] if me else names


def largest_honest_heartbeat(names: list[str], me: str, recent_n: int) -> dict[str, Any]:
    """What Membership._payload sends at its largest: every other site an edge
    each way and a choice, with the widest counts; phase and error at their
    caps; per-class F1 of 1,000 classes; model statistics and FedPerl's
    feature vector of 2,000 numbers each (the registered models gossip at
    most 534); `recent` of selection.n longest names."""
    telemetry = Telemetry(me)
    telemetry.set_roster(names)
    others = [name for name in names if name != me]
    for peer in others:
        telemetry.record_sent(peer, "model", WIDEST_INT)
        telemetry.record_received(peer, "model", WIDEST_INT)
    telemetry.record_choice(me, others)
    for stats in telemetry._edges.values():
        stats.messages = WIDEST_INT
    for key in telemetry._choices:
        telemetry._choices[key] = WIDEST_INT
    published = {
        "f1": [NUMBER] * 1000,
        "model_stats": [NUMBER] * 2000,
        "fedperl_features": {"round": 2**31 - 1, "vector": [NUMBER] * 2000},
        "recent": (others * (recent_n // max(1, len(others)) + 1))[:recent_n],
        "val_accuracy": NUMBER,
        "sgd_steps": 2**31 - 1,
    }
    node = SimpleNamespace(
        progress=lambda: Progress(2**31 - 1, "p" * 64, False, "E" * 80),
        published=published,
        telemetry=telemetry,
    )
    return Membership._payload(node)  # type: ignore[arg-type]


@pytest.mark.parametrize(("roster_size", "recent_n"), [(3, 1), (300, 1000), (5000, 5)])
def test_the_largest_honest_heartbeat_fits_the_bound(roster_size: int, recent_n: int) -> None:
    names = site_names(roster_size)
    beat = largest_honest_heartbeat(names, names[0], recent_n)
    assert len(beat["edges"]) == 2 * (roster_size - 1)
    size = len(tensors.dumps(beat)) + 16  # + the encryption's tag
    assert size <= heartbeat_limit(roster_size, recent_n)


def receiver(tmp_path: Path, identities: Any, roster: Any, heard: list[Any]) -> Any:
    """alice's Inbound (selection.n 1) with a membership that records what it hears."""
    alice = codec(identities, roster, "alice")
    inbound = make_inbound(tmp_path, alice)
    inbound.cfg.selection = SimpleNamespace(n=1)  # type: ignore[attr-defined]
    inbound.telemetry.set_roster(roster.names())
    inbound.membership = SimpleNamespace(heard=lambda sender, beat: heard.append(sender))  # type: ignore[assignment]
    return alice, inbound


async def test_an_oversized_heartbeat_is_refused_unread_and_counted(
    tmp_path: Path, identities: Any, roster: Any
) -> None:
    heard: list[Any] = []
    alice, inbound = receiver(tmp_path, identities, roster, heard)
    bob = codec(identities, roster, "bob")
    limit = inbound.heartbeat_limit()
    assert limit == heartbeat_limit(3, 1)
    opened: list[Any] = []
    original = alice.open_payload
    alice.open_payload = lambda *a, **kw: opened.append(a) or original(*a, **kw)  # type: ignore[method-assign]
    server = MessageServer(
        alice, TransportSection(), inbound.on_frame, inbound.on_reject,
        check_header=inbound.check_header,
    )  # fmt: skip
    port = await server.start("127.0.0.1", 0, None)
    try:
        # the largest honest heartbeat of this roster: taken
        honest = largest_honest_heartbeat(["alice", "bob", "carol"], "bob", 1)
        frame = bob.encode(HEARTBEAT, "alice", honest).to_bytes()
        reply = await post(port, frame, len(frame))
        assert reply.status == 200 and heard == ["bob"]
        # a real heartbeat one byte over: only its header is sent, and refused
        fat = {"round": 1, "meta": {"f1": bytes(limit)}}
        frame = bob.encode(HEARTBEAT, "alice", fat).to_bytes()
        split = PREFIX_LEN + alice.header_length(frame[:PREFIX_LEN]) + SIG_LEN
        assert len(frame) - split > limit
        reply = await post(port, frame, split)
        assert (reply.status, reply.reason) == (413, "heartbeat_oversize")
    finally:
        await server.stop()
    assert heard == ["bob"] and len(opened) == 1  # the honest one only
    status = inbound.telemetry.status_json("alice", "probe")
    assert status["rejected"] == {"heartbeat_oversize": 1}
    assert status["rejected_by_peer"] == {"bob": 1}
    # the node's own check refuses it too, unopened, whatever path brought it
    frame = bob.encode(HEARTBEAT, "alice", fat).to_bytes()
    with pytest.raises(Rejection) as refused:
        await inbound.on_frame(incoming(alice, frame))
    assert refused.value.reason == "heartbeat_oversize" and len(opened) == 1


async def post(port: int, frame: bytes, send: int) -> Any:
    """POST `frame` announced whole, but only its first `send` bytes sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = f"POST {MESSAGE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(frame)}\r\n\r\n"
        writer.write(head.encode() + frame[:send])
        await writer.drain()
        return await asyncio.wait_for(read_reply(reader), 10)
    finally:
        writer.close()


def test_after_a_roster_reload_to_fewer_sites_the_heartbeat_still_fits() -> None:
    """A heartbeat reported every edge and choice the node ever had, of sites
    a reload removed too (peers drop those): 5,000 sites cut to 3 left 10,000
    edges, 2 MB, refused by the peers' bound as if the node were hostile."""
    names = site_names(5000)
    beat = largest_honest_heartbeat(names, names[0], 1)
    telemetry = Telemetry(names[0])
    telemetry.set_roster(names)
    for peer in names[1:]:
        telemetry.record_sent(peer, "model", 1)
        telemetry.record_choice(names[0], [peer])
    telemetry.set_roster(names[:3])
    edges, choices = telemetry.local_edges(), telemetry.local_choices()
    assert [(e["source"], e["target"]) for e in edges] == [(names[0], n) for n in names[1:3]]
    assert [c["chosen"] for c in choices] == names[1:3]
    beat.update(edges=edges, choices=choices)
    assert len(tensors.dumps(beat)) + 16 <= heartbeat_limit(3, 1)
