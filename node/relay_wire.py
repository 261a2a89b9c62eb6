"""What a relay and the sites behind it say to each other (issue 31).

A site that accepts no inbound connection (its roster card has `address: null`
and `via: [relay, ...]`) keeps one outbound WebSocket to each of its relays. A
peer sends such a site a message by POSTing the very frame it would have sent
directly to the relay's `RELAY_MESSAGE_PATH`; the relay forwards it down the
site's WebSocket and answers the POST with the site's own answer. The frame is
signed and encrypted end to end (node/transport.py, p2pfl/secure/wire.py): the
relay reads only its clear, signed header to route it.

WebSocket messages, after the handshake:
- the relay sends a binary `FORWARD`: u64 stream id (big-endian) | the frame;
- the site answers each with a binary `REPLY`: u64 stream id | u16 HTTP status |
  the body its own message endpoint answered (an acknowledgement, a refusal
  with its reason, or the encrypted frame that answers a request).

Handshake (text messages, JSON): the relay sends
`{"type": "challenge", "relay": R, "federation": F, "nonce": HEX}`; the site
answers `{"type": "auth", "site": S, "signature": BASE64}`, its Ed25519
signature (the key of its roster card) over `auth_message(F, R, S, nonce)`;
the relay answers `{"type": "ok"}` or `{"type": "refused", "reason": CODE}` and
closes. The nonce is fresh per connection, and the message names the relay and
the federation, so a signature cannot be replayed to another relay or later.
"""

from __future__ import annotations

import struct

RELAY_CONNECT_PATH = "/p2pfl/v1/relay/connect"
RELAY_MESSAGE_PATH = "/p2pfl/v1/relay/message"
AUTH_CONTEXT = b"p2pfl-relay-auth/v1\n"
NONCE_BYTES = 32
AUTH_TIMEOUT_S = 10.0

_FORWARD = struct.Struct(">Q")
_REPLY = struct.Struct(">QH")

# Refusals a relay answers (HTTP status), beside the transport's own
# (node/transport.py STATUS_FOR_REASON) which it reuses where they mean the same.
RELAY_STATUS_FOR_REASON = {
    "not_connected": 503,  # the recipient has no connection to this relay: try its next relay
    "relay_lost": 502,  # the recipient's connection dropped before it answered: send again
    "plaintext_answer": 502,  # the recipient answered a frame in the clear: not forwarded
}
# Handshake refusals (the WebSocket is closed after them).
AUTH_REASONS = (
    "auth_timeout",
    "auth_malformed",
    "unknown_site",
    "not_via_this_relay",
    "bad_signature",
)


class RelayWireError(ValueError):
    """A WebSocket message of the relay protocol that does not parse."""


def auth_message(federation: str, relay: str, site: str, nonce_hex: str) -> bytes:
    """The bytes a site signs to prove its identity to relay `relay`."""
    return AUTH_CONTEXT + "\n".join((federation, relay, site, nonce_hex)).encode("utf-8")


def pack_forward(stream_id: int, frame: bytes | memoryview) -> bytes:
    return _FORWARD.pack(stream_id) + bytes(frame)


def unpack_forward(data: bytes) -> tuple[int, memoryview]:
    if len(data) < _FORWARD.size:
        raise RelayWireError("forward message shorter than its stream id")
    (stream_id,) = _FORWARD.unpack_from(data)
    return stream_id, memoryview(data)[_FORWARD.size :]


def pack_reply(stream_id: int, status: int, body: bytes) -> bytes:
    return _REPLY.pack(stream_id, status) + body


def unpack_reply(data: bytes) -> tuple[int, int, bytes]:
    if len(data) < _REPLY.size:
        raise RelayWireError("reply message shorter than its stream id and status")
    stream_id, status = _REPLY.unpack_from(data)
    if not 100 <= status <= 599:
        raise RelayWireError(f"reply status {status} is not an HTTP status")
    return stream_id, status, bytes(data[_REPLY.size :])
