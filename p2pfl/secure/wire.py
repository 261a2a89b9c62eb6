"""Signed envelopes: what travels between nodes.

Frame:  b"P2FL" | u32 header length (big-endian) | header | Ed25519 signature (64) | payload

The header is a msgpack map in fixed key order (v, fed, kind, from, to, round,
id, ts, len, sha256, enc); the signature covers the header bytes, and the header
carries the payload's length and SHA-256, so a receiver can verify everything
but the payload before reading it, then hash the payload while it streams in.

Encryption (optional): X25519(sender, recipient) -> HKDF-SHA256(salt = message
id) -> a key used once -> ChaCha20-Poly1305. The digest covers the ciphertext,
so tampering is caught before decryption; the header stays clear and signed.

Checks, in order, each a `WireError` reason: oversize, undecodable_header,
unsupported_version, wrong_federation, unknown_sender, wrong_recipient,
bad_signature, stale_timestamp, id_taken, replayed, below_replay_floor,
before_restart, encryption_required,
digest_mismatch, decryption_failed, payload_schema. Nothing else escapes
`WireCodec`.

Replay: within a run the replay cache refuses an id seen before (`replayed`)
and, once full, everything stamped at or before the ids it had to drop
(`below_replay_floor`: not an id the node holds, so not acknowledged as one;
the sender sends it again freshly stamped, as after `before_restart`. A
roster member stamping ahead of the clock raised that floor for every sender,
and an honest sender's fresh push was refused `replayed` with the signed
acknowledgement, counted delivered and lost: wire review). Across a
restart the cache is empty, so the node hands the codec a floor per sender
(`restart_floor`, the high-water marks node/queues.py `ReplayMarks` persisted
ahead of time): a message from S stamped at or below floor[S] may have been
accepted before the restart and is refused `before_restart`. A sender told
`before_restart` sends again with a fresh timestamp (node/outbound.py), so a
fresh message refused only for its stamp is delayed, never lost.

Ids are the sender's: the replay cache notes which sender used each id, and
an id another sender used first is refused `id_taken`, never `replayed`. Ids
are random, but a relay, and without TLS anyone on the path, reads them in
the clear header (and an outbox sends a push again with its same id): a roster
member that saw another's id and used it first had the receiver answer that
other sender's push `replayed`, with the signed acknowledgement below, and
never process it (rv_net review).

Acknowledgements: a receiver that took a push (or had already taken it:
`replayed`) answers with its signature over `ack_message` (federation,
receiver, sender, message id, outcome), and the sender counts the push
delivered only if that signature verifies with the receiver's roster key. So
no relay or on-path party can acknowledge a push it dropped (issue 31's
hostile review: the JSON `{"ok": true}` alone could be forged).

`require_encryption` (wire.encryption: true) refuses a payload sent in the
clear, `encryption_required`, before a byte of it is read: pushes, requests,
heartbeats and the answers to this node's own requests alike.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2pfl.secure import tensors
from p2pfl.secure.identity import LocalIdentity, Roster

VERSION = 1
MAGIC = b"P2FL"
PREFIX_LEN = 8  # magic + header length
SIG_LEN = 64
MAX_HEADER = 2048
TAG_LEN = 16
HEADER_KEYS = ("v", "fed", "kind", "from", "to", "round", "id", "ts", "len", "sha256", "enc")
# The integers a header may carry: anything outside is refused `undecodable_header`
# before it reaches arithmetic or struct packing (a round of 2**63 once escaped as
# struct.error from the encryption's associated data).
HEADER_RANGES = {
    "v": (0, 255),
    "round": (-(2**31), 2**31 - 1),
    "ts": (0, 2**53),  # milliseconds since 1970: year 285,000
    "len": (0, 2**40),
}

REASONS = (
    "oversize",
    "undecodable_header",
    "unsupported_version",
    "wrong_federation",
    "unknown_sender",
    "wrong_recipient",
    "bad_signature",
    "stale_timestamp",
    "id_taken",
    "replayed",
    "below_replay_floor",
    "before_restart",
    "encryption_required",
    "digest_mismatch",
    "decryption_failed",
    "payload_schema",
)


class WireError(Exception):
    """A rejected message. `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Header:
    version: int
    federation: str
    kind: str
    sender: str
    recipient: str
    round: int
    msg_id: bytes
    timestamp_ms: int
    payload_len: int
    payload_sha256: bytes
    encrypted: bool

    def pack(self) -> bytes:
        values = (
            self.version,
            self.federation,
            self.kind,
            self.sender,
            self.recipient,
            self.round,
            self.msg_id,
            self.timestamp_ms,
            self.payload_len,
            self.payload_sha256,
            self.encrypted,
        )
        return tensors.dumps(dict(zip(HEADER_KEYS, values, strict=True)))

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Header:
        try:
            # no tensor map: a relay reads headers from anyone and never imports torch (issue 31)
            obj = tensors.decode(bytes(raw), tensors=False)
        except tensors.CodecError as exc:
            raise WireError("undecodable_header", exc.reason) from None
        if not isinstance(obj, dict) or tuple(obj) != HEADER_KEYS:
            raise WireError("undecodable_header", "header keys missing or out of order")
        types = (int, str, str, str, str, int, bytes, int, int, bytes, bool)
        for key, typ in zip(HEADER_KEYS, types, strict=True):
            value = obj[key]
            if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                raise WireError("undecodable_header", f"header field {key!r} has the wrong type")
        if len(obj["id"]) != 16 or len(obj["sha256"]) != 32:
            raise WireError("undecodable_header", "bad id or digest")
        for key, (low, high) in HEADER_RANGES.items():
            if not low <= obj[key] <= high:
                raise WireError("undecodable_header", f"header field {key!r} out of range")
        return cls(*(obj[k] for k in HEADER_KEYS))

    @property
    def id_hex(self) -> str:
        return self.msg_id.hex()


@dataclass
class OutgoingMessage:
    header: Header
    chunks: list[bytes | memoryview]  # frame prefix, header, signature, payload pieces
    # the URL whose answer it got last (node/transport_client.py: a relay's, for
    # `answer_refused` and `carrier_suspect` to move the link off that relay)
    carried_by: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def to_bytes(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class Delivered:
    header: Header
    payload: Any
    nbytes: int


class ReplayCache:
    """Message ids seen recently. Bounded: when full, the oldest id is dropped and
    every message stamped at or before it is refused, so an evicted id can never
    be replayed (under a flood the window only narrows)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[bytes, int] = OrderedDict()
        self._senders: dict[bytes, str] = {}  # who used each id ("": not known)
        self.floor_ms = 0

    def seen(self, msg_id: bytes, timestamp_ms: int) -> bool:
        return msg_id in self._ids or timestamp_ms <= self.floor_ms

    def holds(self, msg_id: bytes) -> bool:
        """Whether this id itself is held (a replay, or a copy in progress), not
        merely stamped at or below the floor."""
        return msg_id in self._ids

    def taken_by_another(self, msg_id: bytes, sender: str) -> bool:
        """Whether a held id was used by another sender than `sender` (one whose
        sender is not known, from an older journal, counts as `sender`'s)."""
        used_by = self._senders.get(msg_id, "")
        return msg_id in self._ids and used_by not in ("", sender)

    def reserve(self, msg_id: bytes, timestamp_ms: int, sender: str = "") -> bool:
        """Check-and-insert in one step (no await in between): True if the id was
        free and is now taken, False if seen (or at or below the floor)."""
        if self.seen(msg_id, timestamp_ms):
            return False
        self.add(msg_id, timestamp_ms, sender)
        return True

    def release(self, msg_id: bytes) -> None:
        """Free an id reserved by a message that then had no effect (see WireCodec.release)."""
        self._ids.pop(msg_id, None)
        self._senders.pop(msg_id, None)

    def add(self, msg_id: bytes, timestamp_ms: int, sender: str = "") -> None:
        self._ids[msg_id] = timestamp_ms
        if sender:
            self._senders[msg_id] = sender
        while len(self._ids) > self.capacity:
            old, ts = self._ids.popitem(last=False)
            self._senders.pop(old, None)
            self.floor_ms = max(self.floor_ms, ts)

    def __len__(self) -> int:
        return len(self._ids)


def _payload_key(shared: bytes, header: Header) -> bytes:
    info = (
        b"p2pfl-payload-v1|"
        + "|".join((header.federation, header.sender, header.recipient)).encode()
    )
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=header.msg_id, info=info).derive(shared)


def _aad(header: Header) -> bytes:
    return header.msg_id + header.kind.encode() + struct.pack(">q", header.round)


_NONCE = bytes(12)  # every key is used for exactly one message


ACK_CONTEXT = b"p2pfl-ack/v1\n"
# `id_taken`: the receiver's signed word that it holds another sender's message
# under that id, so the sender's was not taken under it and may go again under
# a fresh one (node/outbound.py); unsigned, a relay that forwarded the push
# could say so and have it processed twice (rv_net2 review).
ACK_OUTCOMES = ("ok", "replayed", "id_taken")


def ack_message(federation: str, receiver: str, sender: str, msg_id: bytes, outcome: str) -> bytes:
    """What a receiver signs to acknowledge message `msg_id` from `sender`."""
    fields = (federation, receiver, sender, msg_id.hex(), outcome)
    return ACK_CONTEXT + "\n".join(fields).encode("utf-8")


class WireCodec:
    """Encode/sign/encrypt and verify/decrypt/decode for one node."""

    def __init__(
        self,
        identity: LocalIdentity,
        roster: Roster,
        federation: str,
        *,
        max_message_bytes: int = 512 * 1024 * 1024,
        clock_skew_s: float = 300.0,
        replay_cache_size: int = 100_000,
        require_encryption: bool = False,
    ) -> None:
        self.identity = identity
        self.roster = roster
        self.federation = federation
        self.max_message_bytes = max_message_bytes
        self.clock_skew_ms = int(clock_skew_s * 1000)
        self.replay = ReplayCache(replay_cache_size)
        self.require_encryption = require_encryption
        # sender -> timestamp (ms) at or below which its messages may have been
        # accepted before this node restarted, and a floor for every sender;
        # set once at start.
        self.restart_floor: dict[str, int] = {}
        self.restart_floor_all = 0
        self._shared: dict[str, bytes] = {}

    # ------------------------------------------------------------------ send
    def encode(
        self,
        kind: str,
        recipient: str,
        payload: Any,
        *,
        round: int = 0,
        encrypt: bool = False,
        msg_id: bytes | None = None,
        timestamp_ms: int | None = None,
    ) -> OutgoingMessage:
        encoded = tensors.encode(payload)
        msg_id = msg_id or os.urandom(16)
        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        pieces: list[bytes | memoryview] = encoded.chunks
        # The header as signed, less what only the finished payload tells
        # (its length and digest); encryption authenticates this same header.
        unsealed = Header(
            VERSION,
            self.federation,
            kind,
            self.identity.name,
            recipient,
            round,
            msg_id,
            ts,
            0,
            bytes(32),
            encrypt,
        )
        if encrypt:
            key = _payload_key(self._secret(recipient), unsealed)
            plain = encoded.to_bytes() if len(encoded.chunks) != 1 else encoded.chunks[0]
            sealed = bytearray(len(plain) + TAG_LEN)
            ChaCha20Poly1305(key).encrypt_into(_NONCE, plain, _aad(unsealed), sealed)
            pieces = [sealed]
        digest = hashlib.sha256()
        for piece in pieces:
            digest.update(piece)
        header = dataclasses.replace(
            unsealed, payload_len=sum(len(p) for p in pieces), payload_sha256=digest.digest()
        )
        header_bytes = header.pack()
        prefix = MAGIC + struct.pack(">I", len(header_bytes))
        return OutgoingMessage(
            header, [prefix, header_bytes, self.identity.sign(header_bytes), *pieces]
        )

    def sign_ack(self, header: Header, outcome: str) -> str:
        """This node's signed word (base64) that it took (`ok`), had already
        taken (`replayed`), or holds another sender's message under the id of
        (`id_taken`) the verified message `header` describes."""
        assert outcome in ACK_OUTCOMES, outcome
        data = ack_message(
            self.federation, self.identity.name, header.sender, header.msg_id, outcome
        )
        return base64.b64encode(self.identity.sign(data)).decode("ascii")

    def verify_ack(self, peer: str, msg_id: bytes, outcome: str, signature: Any) -> bool:
        """Whether `signature` is `peer`'s acknowledgement of our message `msg_id`."""
        if outcome not in ACK_OUTCOMES or not isinstance(signature, str) or len(signature) > 200:
            return False
        if peer not in self.roster:
            return False
        try:
            raw = base64.b64decode(signature, validate=True)
        except (binascii.Error, ValueError):
            return False
        data = ack_message(self.federation, peer, self.identity.name, msg_id, outcome)
        return self.roster[peer].verify(raw, data)

    def set_roster(self, roster: Roster) -> None:
        """A reloaded roster: secrets derived from keys it may have changed are dropped."""
        self.roster = roster
        self._shared.clear()

    def shared_secret(self, peer: str) -> bytes:
        """The X25519 shared secret with a roster peer (cached)."""
        return self._secret(peer)

    def _secret(self, peer: str) -> bytes:
        if peer not in self._shared:
            if peer not in self.roster:
                raise WireError("unknown_sender", f"{peer!r} is not in the roster")
            agreement = self.roster[peer].agreement_key
            assert agreement is not None
            self._shared[peer] = self.identity.shared_secret(agreement)
        return self._shared[peer]

    # ------------------------------------------------------------------ receive
    def header_length(self, prefix: bytes | memoryview) -> int:
        """Bytes of header + signature that follow the 8-byte prefix."""
        if len(prefix) < PREFIX_LEN or bytes(prefix[:4]) != MAGIC:
            raise WireError("undecodable_header", "missing P2FL frame magic")
        (n,) = struct.unpack(">I", prefix[4:8])
        if not 0 < n <= MAX_HEADER:
            raise WireError("undecodable_header", f"header length {n} out of range")
        return n

    def verify_header(
        self,
        header_bytes: bytes | memoryview,
        signature: bytes | memoryview,
        *,
        total_len: int | None = None,
        header: Header | None = None,
    ) -> Header:
        """Checks 2-11 (everything but the payload). On success the message id is
        reserved in the replay cache at once (check-and-insert, no await in
        between), so a copy arriving while this one's payload still streams in
        is refused `replayed` (which the transport answers `in_progress` while
        it still receives or handles the first copy: node/transport.py); a
        caller that then refuses the message for a reason the honest sender
        retries, or loses the connection before acting on it, calls `release`.
        `header`: these header_bytes already unpacked (saves decoding them twice)."""
        if header is None:
            header = Header.unpack(header_bytes)
        if header.payload_len + PREFIX_LEN + len(header_bytes) + SIG_LEN > self.max_message_bytes:
            raise WireError("oversize", f"payload of {header.payload_len} bytes exceeds the limit")
        self.verify_origin(header, header_bytes, signature)
        now_ms = int(time.time() * 1000)
        if abs(now_ms - header.timestamp_ms) > self.clock_skew_ms:
            raise WireError(
                "stale_timestamp",
                f"{(now_ms - header.timestamp_ms) / 1000:.0f} s off this node's clock",
            )
        if self.replay.taken_by_another(header.msg_id, header.sender):
            # not this sender's message: no `replayed` (whose acknowledgement
            # tells the sender its own message was taken)
            raise WireError("id_taken", f"{header.id_hex} was used by another sender")
        if self.replay.holds(header.msg_id):
            raise WireError("replayed", header.id_hex)
        if self.replay.seen(header.msg_id, header.timestamp_ms):
            # At or below the floor of evicted ids, but not an id held: maybe a
            # replay of an evicted one, maybe a fresh message stamped behind a
            # sender that stamps ahead. Refused without the `replayed`
            # acknowledgement (which counts as delivered); the sender stamps it
            # again, and a push this node did take is then answered from its
            # spool or journal (node/inbound.py).
            raise WireError(
                "below_replay_floor",
                f"stamped {self.replay.floor_ms - header.timestamp_ms} ms at or before the "
                "replay cache's floor; send it again with a fresh timestamp",
            )
        floor = max(self.restart_floor.get(header.sender, 0), self.restart_floor_all)
        if header.timestamp_ms <= floor:
            raise WireError(
                "before_restart",
                f"stamped {floor - header.timestamp_ms} ms at or before this node's restart "
                "floor for the sender; send it again with a fresh timestamp",
            )
        if self.require_encryption and not header.encrypted:
            raise WireError("encryption_required", "this node accepts encrypted payloads only")
        if (
            total_len is not None
            and total_len != PREFIX_LEN + len(header_bytes) + SIG_LEN + header.payload_len
        ):
            raise WireError("digest_mismatch", "frame length does not match the header")
        if not self.replay.reserve(header.msg_id, header.timestamp_ms, header.sender):
            raise WireError("replayed", header.id_hex)
        return header

    def verify_origin(
        self,
        header: Header,
        header_bytes: bytes | memoryview,
        signature: bytes | memoryview,
        *,
        now: float | None = None,
    ) -> None:
        """Checks 3-7: the version, this federation, a sender the roster lists
        now, this node as the recipient and the sender's signature over the
        header (no replay state is touched). What a frame spooled before a
        restart or a roster reload must still pass to be delivered
        (node/inbound.py): its timestamp and id were checked when it came.
        `now` (unix seconds, default the clock): the moment at which a key with
        a deadline (a card's previous signing key) must still have been valid;
        a spooled frame gives the moment it was signed, so a grace period that
        ended while it waited in the spool does not turn it away. A key the
        roster no longer names verifies nothing, whatever `now`."""
        if header.version != VERSION:
            raise WireError(
                "unsupported_version", f"version {header.version}, this node speaks {VERSION}"
            )
        if header.federation != self.federation:
            raise WireError("wrong_federation", f"{header.federation!r}")
        if header.sender not in self.roster:
            raise WireError("unknown_sender", f"{header.sender!r} is not in the roster")
        if header.recipient != self.identity.name:
            raise WireError("wrong_recipient", f"addressed to {header.recipient!r}")
        if not self.roster[header.sender].verify(bytes(signature), bytes(header_bytes), now):
            raise WireError("bad_signature", f"from {header.sender!r}")

    def release(self, header: Header) -> None:
        """Give back the replay reservation of a message that had no effect and that
        its honest sender may send again: its payload never fully arrived
        (`truncated`), arrived other than the signed header says
        (`digest_mismatch`: whoever can see a header must not be able to burn its
        id with junk bytes), or the node could not take it yet (`queue_full`,
        `rate_limited`, `storage_error`, ...: node/transport.py RELEASE_REASONS).
        Never after the message was acted on,
        and never for a frame whose signature failed (it reserved nothing)."""
        self.replay.release(header.msg_id)

    def open_payload(
        self,
        header: Header,
        payload: bytearray | bytes | memoryview,
        *,
        digest: bytes | None = None,
        require_finite: bool = False,
    ) -> Any:
        """Checks 12-14 on the payload bytes; `digest` if the caller hashed while streaming.
        The id was reserved by `verify_header`; this touches no shared state, so
        it may run in a worker thread (large payloads are decoded off the loop)."""
        if len(payload) != header.payload_len:
            raise WireError("digest_mismatch", "payload length differs from the header")
        if digest is None:
            digest = hashlib.sha256(payload).digest()
        if digest != header.payload_sha256:
            raise WireError("digest_mismatch", "payload SHA-256 differs from the signed header")
        if header.encrypted:
            if len(payload) < TAG_LEN:
                raise WireError("decryption_failed", "ciphertext too short")
            key = _payload_key(self._secret(header.sender), header)
            plain = bytearray(len(payload) - TAG_LEN)
            try:
                ChaCha20Poly1305(key).decrypt_into(_NONCE, payload, _aad(header), plain)
            except (InvalidTag, ValueError):
                raise WireError("decryption_failed", "authentication tag mismatch") from None
            payload = plain
        try:
            obj = tensors.decode(payload)
            if require_finite:
                tensors.check_finite(obj)
        except tensors.CodecError as exc:
            raise WireError(
                "payload_schema", exc.reason + (f" ({exc.detail})" if exc.detail else "")
            ) from None
        return obj

    def verify_frame(self, frame: bytes | bytearray | memoryview) -> tuple[Header, memoryview]:
        """decode's first half: the verified header of a whole frame held in
        memory (its id reserved) and a view of its payload, not yet opened. A
        caller may then open a large payload in a worker thread (`open_payload`
        touches no shared state) and `release` the header on `digest_mismatch`."""
        if len(frame) > self.max_message_bytes:
            raise WireError("oversize", f"{len(frame)} bytes exceeds the limit")
        view = memoryview(frame)
        n = self.header_length(view[:PREFIX_LEN])
        if len(view) < PREFIX_LEN + n + SIG_LEN:
            raise WireError("undecodable_header", "frame shorter than its header")
        header_bytes = view[PREFIX_LEN : PREFIX_LEN + n]
        signature = view[PREFIX_LEN + n : PREFIX_LEN + n + SIG_LEN]
        header = self.verify_header(header_bytes, signature, total_len=len(view))
        return header, view[PREFIX_LEN + n + SIG_LEN :]

    def decode(
        self, frame: bytes | bytearray | memoryview, *, require_finite: bool = False
    ) -> Delivered:
        """Verify and decode a whole frame held in memory."""
        header, payload = self.verify_frame(frame)
        try:
            obj = self.open_payload(header, payload, require_finite=require_finite)
        except WireError as exc:
            if exc.reason == "digest_mismatch":
                self.release(header)
            raise
        return Delivered(header, obj, len(frame))
