"""Signed envelopes: round trips, one test per rejection reason, and fuzzing."""

from __future__ import annotations

import contextlib
import struct
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import (
    MAGIC,
    PREFIX_LEN,
    REASONS,
    SIG_LEN,
    Header,
    ReplayCache,
    WireCodec,
    WireError,
)

FUZZ_RANDOM = 3000
FUZZ_MUTATED = 3000


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "conv.weight": torch.randn(8, 1, 3, 3, generator=g),
        "bn.running_mean": torch.zeros(8),
        "bn.num_batches_tracked": torch.tensor(5),
        "fc.weight": torch.randn(10, 32, generator=g).half(),
    }


def frame_parts(frame: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    (n,) = struct.unpack(">I", frame[4:8])
    return (
        frame[:PREFIX_LEN],
        frame[PREFIX_LEN : PREFIX_LEN + n],
        frame[PREFIX_LEN + n : PREFIX_LEN + n + SIG_LEN],
        frame[PREFIX_LEN + n + SIG_LEN :],
    )


def reframe(header: bytes, sig: bytes, payload: bytes) -> bytes:
    return MAGIC + struct.pack(">I", len(header)) + header + sig + payload


@pytest.mark.parametrize("encrypt", [False, True])
def test_state_dict_round_trip(codecs, encrypt):
    msg = codecs["alice"].encode(
        "model", "bob", {"state": state_dict(), "n": 412}, round=7, encrypt=encrypt
    )
    got = codecs["bob"].decode(bytearray(msg.to_bytes()), require_finite=True)
    assert got.header.sender == "alice" and got.header.kind == "model" and got.header.round == 7
    assert got.header.encrypted is encrypt
    for k, v in state_dict().items():
        assert torch.equal(got.payload["state"][k], v) and got.payload["state"][k].dtype == v.dtype
    assert got.payload["n"] == 412


def test_encrypted_payload_hides_the_plaintext(codecs):
    secret = b"patient-0042-chest-xray" * 10
    clear = codecs["alice"].encode("meta", "bob", {"x": secret}).to_bytes()
    sealed = codecs["alice"].encode("meta", "bob", {"x": secret}, encrypt=True).to_bytes()
    assert secret in clear and secret not in sealed
    # Carol (in the roster, but not the recipient) cannot read it either.
    with pytest.raises(WireError) as err:
        codecs["carol"].decode(sealed)
    assert err.value.reason == "wrong_recipient"


header_fields = st.fixed_dictionaries(
    {
        "kind": st.text(min_size=1, max_size=20),
        "round": st.integers(-(2**31), 2**31 - 1),
        "payload": st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**40), 2**40)
            | st.floats(allow_nan=False)
            | st.text(max_size=20),
            lambda c: (
                st.lists(c, max_size=4)
                | st.dictionaries(st.text(max_size=6).filter(lambda k: k != "$t"), c, max_size=4)
            ),
            max_leaves=12,
        ),
        "encrypt": st.booleans(),
    }
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(header_fields)
def test_header_and_metadata_round_trip(codecs, fields):
    msg = codecs["alice"].encode(
        fields["kind"], "bob", fields["payload"], round=fields["round"], encrypt=fields["encrypt"]
    )
    got = codecs["bob"].decode(msg.to_bytes())
    assert got.header.kind == fields["kind"] and got.header.round == fields["round"]
    assert got.payload == fields["payload"]
    assert Header.unpack(frame_parts(msg.to_bytes())[1]) == got.header


# --------------------------------------------------------------------------- one test per reason


def reject(codec: WireCodec, frame: bytes, reason: str, **kw) -> None:
    with pytest.raises(WireError) as err:
        codec.decode(frame, **kw)
    assert err.value.reason == reason, err.value


def tamper_header(codecs, **changes) -> bytes:
    """A frame whose header was changed and re-signed by alice."""
    msg = codecs["alice"].encode("model", "bob", {"state": state_dict()})
    fields = {**msg.header.__dict__, **changes}
    header = Header(**fields).pack()
    _, _, _, payload = frame_parts(msg.to_bytes())
    return reframe(header, codecs["alice"].identity.sign(header), payload)


def test_reason_oversize(identities, roster, codecs):
    small = WireCodec(identities["bob"], roster, "fed-test", max_message_bytes=512)
    reject(
        small,
        codecs["alice"].encode("model", "bob", {"state": state_dict()}).to_bytes(),
        "oversize",
    )


def test_reason_undecodable_header(codecs):
    reject(codecs["bob"], b"GARBAGE!" + bytes(100), "undecodable_header")
    frame = codecs["alice"].encode("m", "bob", {}).to_bytes()
    reject(
        codecs["bob"], frame[:PREFIX_LEN] + b"\xc1" + frame[PREFIX_LEN + 1 :], "undecodable_header"
    )


def test_reason_unsupported_version(codecs):
    reject(codecs["bob"], tamper_header(codecs, version=99), "unsupported_version")


def test_reason_wrong_federation(identities, roster, codecs):
    other = WireCodec(identities["alice"], roster, "another-federation")
    reject(codecs["bob"], other.encode("m", "bob", {}).to_bytes(), "wrong_federation")


def test_reason_unknown_sender(identities, roster):
    mallory = LocalIdentity.generate("mallory")
    sender = WireCodec(mallory, Roster([*roster.cards(), mallory.card("127.0.0.1:9")]), "fed-test")
    receiver = WireCodec(identities["bob"], roster, "fed-test")
    reject(
        receiver,
        sender.encode("model", "bob", {"state": state_dict()}).to_bytes(),
        "unknown_sender",
    )


def test_reason_wrong_recipient(codecs):
    reject(codecs["carol"], codecs["alice"].encode("m", "bob", {}).to_bytes(), "wrong_recipient")


def test_reason_bad_signature(identities, roster, codecs):
    # A header changed after signing, and a message signed by an impostor's key under alice's name.
    frame = codecs["alice"].encode("m", "bob", {"x": 1}, round=1).to_bytes()
    _, header, sig, payload = frame_parts(frame)
    forged = Header(**{**Header.unpack(header).__dict__, "round": 2}).pack()
    reject(codecs["bob"], reframe(forged, sig, payload), "bad_signature")
    impostor = WireCodec(
        LocalIdentity("alice", LocalIdentity.generate("x").signing, identities["alice"].agreement),
        roster,
        "fed-test",
    )
    reject(codecs["bob"], impostor.encode("m", "bob", {}).to_bytes(), "bad_signature")


def test_reason_stale_timestamp(codecs):
    old = int(time.time() * 1000) - 3_600_000
    reject(
        codecs["bob"],
        codecs["alice"].encode("m", "bob", {}, timestamp_ms=old).to_bytes(),
        "stale_timestamp",
    )
    future = int(time.time() * 1000) + 3_600_000
    reject(
        codecs["bob"],
        codecs["alice"].encode("m", "bob", {}, timestamp_ms=future).to_bytes(),
        "stale_timestamp",
    )


def test_reason_replayed(codecs):
    frame = codecs["alice"].encode("model", "bob", {"state": state_dict()}).to_bytes()
    codecs["bob"].decode(frame)
    reject(codecs["bob"], frame, "replayed")


def test_reason_id_taken(codecs):
    # An id another sender used first: refused, never `replayed` (whose signed
    # acknowledgement would tell this sender its own message was taken).
    first = codecs["carol"].encode("model", "bob", {"state": state_dict()})
    codecs["bob"].decode(first.to_bytes())
    frame = codecs["alice"].encode("model", "bob", {}, msg_id=first.header.msg_id).to_bytes()
    reject(codecs["bob"], frame, "id_taken")


def test_reason_below_replay_floor(codecs):
    # The replay cache evicted an id stamped `now`: anything stamped at or before
    # it that the cache does not hold may be a replay of it (refused, but not
    # acknowledged as `replayed`: it may as well be a fresh message).
    now = int(time.time() * 1000)
    bob = codecs["bob"]
    bob.replay.floor_ms = now
    reject(
        bob,
        codecs["alice"].encode("heartbeat", "bob", {}, timestamp_ms=now).to_bytes(),
        "below_replay_floor",
    )


def test_reason_before_restart(codecs):
    # The node's restart floor for alice (node/queues.py ReplayMarks): anything
    # she stamped at or before it may have been accepted before the restart.
    now = int(time.time() * 1000)
    bob = codecs["bob"]
    bob.restart_floor = {"alice": now}
    reject(
        bob,
        codecs["alice"].encode("heartbeat", "bob", {}, timestamp_ms=now).to_bytes(),
        "before_restart",
    )
    reject(
        bob,
        codecs["alice"].encode("m", "bob", {}, timestamp_ms=now - 1000).to_bytes(),
        "before_restart",
    )
    assert bob.decode(
        codecs["alice"].encode("m", "bob", {"x": 1}, timestamp_ms=now + 1).to_bytes()
    ).payload == {"x": 1}
    # A floor for every sender not listed (an unreadable marks file fails closed).
    # It holds for listed senders too, whatever their own floor.
    bob.restart_floor_all = now + 60_000
    for sender in ("carol", "alice"):
        reject(
            bob,
            codecs[sender].encode("m", "bob", {}, timestamp_ms=now + 30_000).to_bytes(),
            "before_restart",
        )
    assert bob.decode(codecs["alice"].encode("m", "bob", {}, timestamp_ms=now + 60_001).to_bytes())


def test_reason_encryption_required(identities, roster, codecs):
    strict = WireCodec(identities["bob"], roster, "fed-test", require_encryption=True)
    for kind in ("model", "heartbeat", "req:model", "resp:model"):
        plain = codecs["alice"].encode(kind, "bob", {"meta": {"f1": [0.9, 0.1]}})
        reject(strict, plain.to_bytes(), "encryption_required")
        sealed = codecs["alice"].encode(kind, "bob", {"meta": {"f1": [0.9, 0.1]}}, encrypt=True)
        assert strict.decode(sealed.to_bytes()).payload == {"meta": {"f1": [0.9, 0.1]}}
    # Refused from the header alone, before a payload byte is read (as the transport does).
    plain = codecs["alice"].encode("model", "bob", {"state": state_dict()}).to_bytes()
    _, header, sig, _ = frame_parts(plain)
    with pytest.raises(WireError) as err:
        strict.verify_header(header, sig)
    assert err.value.reason == "encryption_required"


def test_replay_cache_is_bounded_and_never_forgets_unsafely():
    cache = ReplayCache(capacity=3)
    for i in range(5):
        cache.add(bytes([i]) * 16, timestamp_ms=1000 + i)
    assert len(cache) == 3
    assert cache.seen(bytes([0]) * 16, 1000)  # evicted, but refused by the floor
    assert not cache.seen(bytes([9]) * 16, 2000)


def test_reason_digest_mismatch(codecs):
    frame = bytearray(codecs["alice"].encode("model", "bob", {"state": state_dict()}).to_bytes())
    frame[-5] ^= 0x01
    reject(codecs["bob"], bytes(frame), "digest_mismatch")
    reject(
        codecs["bob"],
        codecs["alice"].encode("m", "bob", {"x": 1}).to_bytes()[:-1],
        "digest_mismatch",
    )


def test_reason_decryption_failed(identities, roster, codecs):
    # Re-signed header with a correct digest over a ciphertext made for someone else.
    sealed_for_carol = codecs["alice"].encode("m", "carol", {"x": 1}, encrypt=True)
    _, header, _, payload = frame_parts(sealed_for_carol.to_bytes())
    fields = {**Header.unpack(header).__dict__, "recipient": "bob"}
    header2 = Header(**fields).pack()
    reject(
        codecs["bob"],
        reframe(header2, identities["alice"].sign(header2), payload),
        "decryption_failed",
    )


def test_reason_payload_schema(codecs):
    import msgpack

    bad = msgpack.packb(
        {"state": {"w": {"$t": "complex64", "shape": [1], "pad": b"", "data": bytes(8)}}}
    )
    msg = codecs["alice"].encode("model", "bob", {})
    frame = frame_parts(tamper_payload(codecs, msg, bad))
    reject(codecs["bob"], reframe(frame[1], frame[2], frame[3]), "payload_schema")
    nan = codecs["alice"].encode(
        "model", "bob", {"state": {"w": torch.tensor([1.0, float("nan")])}}
    )
    reject(codecs["bob"], nan.to_bytes(), "payload_schema", require_finite=True)


def tamper_payload(codecs, msg, payload: bytes) -> bytes:
    import hashlib

    fields = {
        **msg.header.__dict__,
        "payload_len": len(payload),
        "payload_sha256": hashlib.sha256(payload).digest(),
    }
    header = Header(**fields).pack()
    return reframe(header, codecs["alice"].identity.sign(header), payload)


def test_every_reason_has_a_test():
    tested = {
        name.removeprefix("test_reason_") for name in globals() if name.startswith("test_reason_")
    }
    assert tested == set(REASONS)


# --------------------------------------------------------------------------- fuzzing


@settings(
    max_examples=FUZZ_RANDOM,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.binary(max_size=400))
def test_fuzz_random_frames_only_raise_wire_error(codecs, data):
    with contextlib.suppress(WireError):
        codecs["bob"].decode(data)
    with contextlib.suppress(WireError):
        codecs["bob"].decode(MAGIC + data)


@settings(
    max_examples=FUZZ_MUTATED,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_fuzz_mutated_frames_only_raise_wire_error(codecs, data):
    encrypt = data.draw(st.booleans())
    frame = bytearray(
        codecs["alice"]
        .encode("model", "bob", {"state": state_dict(), "r": 1}, encrypt=encrypt)
        .to_bytes()
    )
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["flip", "truncate", "insert", "set"]))
        pos = data.draw(st.integers(0, len(frame) - 1)) if frame else 0
        if op == "flip" and frame:
            frame[pos] ^= data.draw(st.integers(1, 255))
        elif op == "truncate":
            del frame[pos:]
        elif op == "insert":
            frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        elif frame:
            frame[pos] = data.draw(st.integers(0, 255))
    try:
        codecs["bob"].decode(bytes(frame), require_finite=True)
    except WireError as exc:
        assert exc.reason in REASONS
