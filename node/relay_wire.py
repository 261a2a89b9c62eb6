"""What a relay and the sites behind it say to each other (issue 31).

A site that accepts no inbound connection (its roster card has `address: null`
and `via: [relay, ...]`) keeps one outbound WebSocket to each of its relays. A
peer sends such a site a message by POSTing the very frame it would have sent
directly to the relay's `RELAY_MESSAGE_PATH`; the relay forwards it down the
site's WebSocket and answers the POST with the site's own answer. The frame is
signed and encrypted end to end (node/transport.py, p2pfl/secure/wire.py): the
relay reads only its clear, signed header to route it.

WebSocket messages, after the handshake (relay protocol `RELAY_PROTOCOL`,
named in the challenge; a site and a relay of different protocols refuse each
other at the handshake, in one line):
- the relay streams each frame down as `FORWARD` pieces, binary messages
  u64 stream id (big-endian) | u8 kind | bytes, as the frame's bytes reach it
  (cut-through: it never holds a whole frame, so a large frame costs the
  relay's time once, overlapped with the sender's upload and the site's
  reading, and a small frame is not stuck behind a large one). Kinds:
  `DATA`, more of the frame (the first piece of an id the site has not seen
  opens a stream; ids only grow on a connection); `END`, its last bytes, sent
  only once the relay has checked the payload's length and signed SHA-256;
  `ABORT`, the frame will not complete (the sender's upload failed or did not
  match its header): the site drops what it has.
- the site answers each stream with a binary `REPLY`: u64 stream id | u16 HTTP
  status | the body its own message endpoint answered (an acknowledgement, a
  refusal with its reason, or the encrypted frame that answers a request). It
  may answer before END (a refusal on the header): the relay then stops
  sending that frame.

Handshake (node/relay_handshake.py), all of it before the relay accepts a
WebSocket: the site GETs `RELAY_CHALLENGE_PATH` and gets
`{"type": "challenge", "relay": R, "federation": F, "protocol": RELAY_PROTOCOL,
"nonce": HEX, "expires_in_s": T}`;
it then asks for the WebSocket upgrade at `RELAY_CONNECT_PATH` with three
headers: `SITE_HEADER: S`, `NONCE_HEADER: HEX` and `SIGNATURE_HEADER: BASE64`,
its Ed25519 signature (the key of its roster card) over
`auth_message(F, R, S, nonce)`. The relay checks them before it accepts the
upgrade (101), so a stranger never gets a WebSocket, nor a reader larger than
an HTTP request line: a refusal is an HTTP 4xx whose JSON body and
`REFUSAL_HEADER` name the reason (AUTH_STATUS_FOR_REASON). A nonce is the
relay's own (an HMAC under a key made at its start), valid for auth_timeout_s
and for one upgrade only; the message names the relay and the federation, so
a signature cannot be replayed later, to another relay, or twice.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from p2pfl.secure.wire import MAX_HEADER, PREFIX_LEN, Header, WireError

RELAY_CHALLENGE_PATH = "/p2pfl/v1/relay/challenge"
RELAY_CONNECT_PATH = "/p2pfl/v1/relay/connect"
RELAY_MESSAGE_PATH = "/p2pfl/v1/relay/message"
# The relay protocol's version (the challenge names it): 3 streams frames in pieces.
RELAY_PROTOCOL = 3
AUTH_CONTEXT = b"p2pfl-relay-auth/v3\n"
AUTH_TIMEOUT_S = 10.0
# The proof a site sends with its upgrade request, and the reason of a refused one.
SITE_HEADER = "X-P2PFL-Relay-Site"
NONCE_HEADER = "X-P2PFL-Relay-Nonce"
SIGNATURE_HEADER = "X-P2PFL-Relay-Signature"
REFUSAL_HEADER = "X-P2PFL-Relay-Refusal"
MAX_CHALLENGE_BYTES = 4096  # the largest challenge a site reads (an honest one: about 250)

_FORWARD = struct.Struct(">QB")
# FORWARD kinds
DATA = 0
END = 1
ABORT = 2
FORWARD_KINDS = frozenset((DATA, END, ABORT))
FORWARD_HEAD = _FORWARD.size
_REPLY = struct.Struct(">QH")

# Refusals a relay answers (HTTP status), beside the transport's own
# (node/transport.py STATUS_FOR_REASON) which it reuses where they mean the same.
RELAY_STATUS_FOR_REASON = {
    "not_connected": 503,  # the recipient has no connection to this relay: try its next relay
    "relay_lost": 502,  # the recipient's connection dropped before it answered: send again
    "plaintext_answer": 502,  # the recipient answered a frame in the clear: not forwarded
}
# Handshake refusals: the upgrade is answered with this HTTP status, no WebSocket.
AUTH_STATUS_FOR_REASON = {
    "auth_malformed": 400,  # a proof header missing, repeated, too long or not decodable
    "bad_nonce": 401,  # not a nonce of this relay process (another relay's, a restarted one's)
    "nonce_expired": 401,  # issued more than auth_timeout_s ago
    "nonce_replayed": 401,  # this nonce was used for an upgrade already
    "unknown_site": 403,  # the site is not on the roster
    "bad_signature": 401,  # not the site's signature over auth_message(...) of this nonce
    "not_via_this_relay": 403,  # the site's card does not name this relay in `via`
    "too_many_handshakes": 429,  # max_handshakes_per_host challenges outstanding for this host
}
# A challenge that no upgrade used within auth_timeout_s: counted, nothing to answer.
AUTH_TIMEOUT = "auth_timeout"
# A challenge given up, unused, to make room (max_handshakes outstanding): counted.
HANDSHAKE_EVICTED = "handshake_evicted"


class RelayWireError(ValueError):
    """A WebSocket message of the relay protocol that does not parse."""


def auth_message(federation: str, relay: str, site: str, nonce_hex: str) -> bytes:
    """The bytes a site signs to prove its identity to relay `relay`."""
    return AUTH_CONTEXT + "\n".join((federation, relay, site, nonce_hex)).encode("utf-8")


def pack_forward(stream_id: int, kind: int, piece: bytes | memoryview = b"") -> bytes:
    """One FORWARD piece: `kind` DATA, END or ABORT."""
    return _FORWARD.pack(stream_id, kind) + piece


def unpack_forward(data: bytes) -> tuple[int, int, memoryview]:
    """(stream id, kind, the piece's bytes, a view into `data`)."""
    if len(data) < _FORWARD.size:
        raise RelayWireError("forward message shorter than its stream id and kind")
    stream_id, kind = _FORWARD.unpack_from(data)
    if kind not in FORWARD_KINDS:
        raise RelayWireError(f"forward kind {kind} is not DATA, END or ABORT")
    return stream_id, kind, memoryview(data)[_FORWARD.size :]


def pack_reply(stream_id: int, status: int, body: bytes) -> bytes:
    return _REPLY.pack(stream_id, status) + body


def unpack_reply(data: bytes) -> tuple[int, int, bytes]:
    if len(data) < _REPLY.size:
        raise RelayWireError("reply message shorter than its stream id and status")
    stream_id, status = _REPLY.unpack_from(data)
    if not 100 <= status <= 599:
        raise RelayWireError(f"reply status {status} is not an HTTP status")
    return stream_id, status, bytes(data[_REPLY.size :])


def encrypted_frame(body: bytes) -> bool:
    """Is this P2FL frame (a site's answer) marked encrypted? A header that does
    not parse counts as not: the relay cannot tell, so it does not forward it."""
    if len(body) < PREFIX_LEN:
        return False
    (header_len,) = struct.unpack(">I", body[4:8])
    if not 0 < header_len <= MAX_HEADER or len(body) < PREFIX_LEN + header_len:
        return False
    try:
        return Header.unpack(body[PREFIX_LEN : PREFIX_LEN + header_len]).encrypted
    except WireError:
        return False


async def send_message(ws: Any, data: bytes) -> None:
    """`ws.send_bytes(data)` on a relay connection, safe from another task's
    cancellation. aiohttp writes an (uncompressed: both ends turn compression
    off) message to the transport before it waits for the drain, and every
    sender on one connection waits on one shared drain future, which a
    cancelled waiter cancels for all of them. So a CancelledError this task
    was not sent (`cancelling()` is 0) means: written, the drain not waited
    for. It is not passed on: the sender that dropped its own connection must
    not cut another's forward."""
    task = asyncio.current_task()
    try:
        await ws.send_bytes(data)
    except asyncio.CancelledError:
        if task is None or task.cancelling():
            raise
