"""Message ids are the sender's (rv_net review): an id is random and chosen by
its sender, and every relay and, without TLS, every on-path party reads it in
the clear header (and an outbox sends a push again with the same id). A roster
member that saw another sender's id must not be able to use it first, so that
the receiver answers the other sender's push `replayed` with its signed
acknowledgement and never processes it: the push would count delivered and
vanish, which a relay (node/relay.py) must never be able to do. Against the
real MessageServer on 127.0.0.1 (the helpers of tests/test_upload_fairness.py)."""

from __future__ import annotations

import json

from relay_review_util import recording_server
from test_upload_fairness import codec, post

from node.outbound import ack_of


async def test_another_senders_use_of_an_id_gets_no_acknowledgement_for_it(identities, roster):
    """Attack: bob (a roster site that relays, or a relay's accomplice) sees
    alice's push to carol go by with id X, drops it and sends carol a frame of
    his own with id X first. Before the fix carol answered alice's push (or its
    retry) 409 `replayed` with her signed acknowledgement: alice counted it
    delivered, carol never processed it. Now carol refuses it without an
    acknowledgement (409 `id_taken`): a failure alice sees, never a false
    delivery."""
    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    carol = codec(identities, roster, "carol")
    processed: list[str] = []
    server, port = await recording_server(carol, processed)
    try:
        pushed = alice.encode("probe", "carol", {"x": 1})
        x = pushed.header.msg_id
        first = await post(
            port, bob.encode("heartbeat", "carol", {"round": 1}, msg_id=x).to_bytes()
        )
        assert first.status == 200  # bob's own frame, taken
        reply = await post(port, pushed.to_bytes())
    finally:
        await server.stop()
    ack = ack_of(reply.body)
    assert not (ack and alice.verify_ack("carol", x, "replayed", ack)), "a false acknowledgement"
    assert not (ack and alice.verify_ack("carol", x, "ok", ack))
    assert (reply.status, reply.reason) == (409, "id_taken"), (reply.status, reply.body)
    assert processed == [x.hex()]  # bob's frame only: alice's was refused, not taken


async def test_a_senders_own_copy_is_still_acknowledged_replayed(identities, roster):
    """The honest case the acknowledgement is for: alice sends the same push
    again (its answer was lost); carol answers `replayed` with her signature."""
    alice = codec(identities, roster, "alice")
    carol = codec(identities, roster, "carol")
    processed: list[str] = []
    server, port = await recording_server(carol, processed)
    try:
        pushed = alice.encode("probe", "carol", {"x": 1})
        assert (await post(port, pushed.to_bytes())).status == 200
        reply = await post(port, pushed.to_bytes())
    finally:
        await server.stop()
    assert (reply.status, reply.reason) == (409, "replayed")
    assert alice.verify_ack(
        "carol", pushed.header.msg_id, "replayed", json.loads(reply.body)["ack"]
    )
    assert processed == [pushed.header.id_hex]


async def test_after_a_restart_a_journaled_id_is_still_its_senders(tmp_path, identities, roster):
    """The journal keeps who sent each push it lists: after a restart (the
    replay cache rebuilt from it), or once the cache dropped the id, alice's
    push with the id of bob's processed push is refused `id_taken`, never
    answered 200 as "a retry of something we already hold"."""
    from test_hostile_wire import incoming, make_inbound

    from node.transport import Rejection
    from p2pfl.secure.wire import WireError

    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    bobs = bob.encode("probe", "carol", {"x": 1})
    x = bobs.header.msg_id
    stolen = alice.encode("probe", "carol", {"x": 2}, msg_id=x).to_bytes()
    record = {"id": x.hex(), "kind": "probe", "from": "bob", "round": 0, "ts": 1, "t": 1.0}
    (tmp_path / "journal.jsonl").write_text(json.dumps(record) + "\n")
    restarted = codec(identities, roster, "carol")
    make_inbound(tmp_path, restarted).recover([])
    try:
        incoming(restarted, stolen)
        raise AssertionError("alice's push with bob's journaled id was taken")
    except WireError as exc:
        assert exc.reason == "id_taken", exc
    evicted = codec(identities, roster, "carol")  # the cache no longer holds it
    inbound = make_inbound(tmp_path, evicted)
    try:
        await inbound.on_frame(incoming(evicted, stolen))
        raise AssertionError("alice's push was answered as one carol holds")
    except Rejection as exc:
        assert exc.reason == "id_taken", exc
