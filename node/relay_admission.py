"""A relay's front door, per sender (issue 31): a frame over its sender's rate
waits its turn, reads paused, instead of being refused at once.

Why (measured with `python -m bench.attacks --scenarios relay_flood`): one
roster site POSTing as fast as 16 keep-alive connections allow, each refused
at once with 429 `rate_limited`, sends its next frame at once. Each refusal
costs the relay an HTTP request parsed, a header read and an answer written,
about what it costs the flooder to send it, so the two processes turn the
refusals over as fast as two shared cores let them, and every other site's
frame waits behind them in the relay's event loop. Holding the request
instead costs the relay no CPU: it reads no further and answers nothing yet,
so the sender's connection stays busy and its next frame is not sent (the
backpressure TCP gives a reader that stops reading). However many connections
it opens, up to its queue, a sender then gets exactly its rate.

Per sender of a verified frame (node/relay.py: the header's cheap checks and
the sender's signature ran first, so only a frame its sender signed ever waits
in that sender's queue):
- nothing of it waits, fewer than `HONEST_CONNECTIONS` of its frames are in
  the relay's hands (admitted, not yet sent on whole: a frame sent and waiting
  for its answer, a request its site holds open, no longer counts; node/relay.py
  `_forward`) and its token bucket holds a token: on at once, no await;
- yet at most `HONEST_CONNECTIONS` of a gate's frames are at one site at once
  (sent down, their answers awaited: node/relay_handshake.py
  `SiteLink.send_turn`); one more waits for one of them to be answered, in its
  place here, `RATE_WAIT_S` at most, then is refused 503 `queue_full`. An
  honest node never waits for that (at most 8 connections to a peer's relay,
  a pool per outbound-only peer); freed once sent with no such
  bound, a flooder's 16 connections had 16 frames at once ahead of an honest
  heartbeat at their recipient, not 8, which waited about twice as long
  (bench/attacks/relay.py relay_flood);
- otherwise the frame joins the sender's FIFO queue; the head of the queue
  waits for one of its frames to be sent on and for a token, then the
  relay's remaining checks run and the frame takes the token
  (node/relay.py `_check`);
- a frame still waiting after `RATE_WAIT_S` is refused 429 `rate_limited`;
- a sender with `queue_limit` frames waiting already is refused 429
  `too_many_connections`, and that connection is closed;
- a roster reload that removes the sender, or drops a signing key of its card
  (`forget`), revokes its gate: its frames still waiting, verified under the
  old card, are refused `unknown_sender` (they used to go on, each taking a
  token from a new gate's fresh burst); a card whose keys all still verify
  (unchanged, or rotated with the old key as its previous one) keeps its gate.
An honest node uploads at most 8 frames to one relay at once
(node/transport_client.py RELAY_UPLOADS; a request's place is free once its
last byte is written, so requests held open at their sites hold none), so it
has more than 8 frames being sent on at a relay only for the moment between
its last byte and the relay's streaming it on, and never waits long (with a
pool per outbound-only peer and no such cap, a heartbeat broadcast to 100 of
them was refused `too_many_connections` past the queue: read-back review;
before, one pool and answered frames counted: 8
requests held open by 8 sites kept every other frame of their sender,
heartbeats included, waiting until refused: rv_net review); a flooder with more
connections has its surplus held (each costs a socket and no CPU, but what
aiohttp read of it before pausing stays in memory: up to twice its 256 KiB
read_bufsize plus one 256 KiB recv; in the issue-31 review, tracemalloc
measured 0.77 MB per waiting 3 MB frame, 24.5 MB for a full queue of 32), and
the queue holds 4 times that many by default.

Each sender waits in its own queue, served as its own tokens come: one site's
backlog never sits in front of another site's frame. A stranger that claims a
roster member's name is refused `bad_signature` before the queue, so it can
neither take that member's places nor its tokens. Verifying a flooder's frames
costs an Ed25519 check each (tens of microseconds) only for the frames the
relay reads: with reads paused, at most its active and queued frames, plus
one per fresh connection beyond them (refused `too_many_connections` and
closed). Such a connection churn is no worse than a stranger's: in the review,
16 connect-send-close loops from another process turned over 3,340
`too_many_connections` in 5 s against 3,070 `bad_signature` from a forger,
the relay's process at 2.1 s of CPU either way (one run each, 2 loaded cores).

A copy of a frame the relay forwarded already (`Forwarded`: its sender's id,
remembered while its timestamp is within the clock skew) waits in a gate of
its own, per sender and recipient (`repeat_key`), not in its sender's: the
relay keeps no replay state, and a frame's signature holds for every copy, so
whoever holds one (its recipient, another relay, an observer without TLS) could
replay it from 40 connections and keep its sender's 8 places and queue of 32
full, refusing every frame the sender sent anyone else through the relay
(`too_many_connections`, rate_limited; a review). An honest retry of the same
id still goes on, from that pair's gate; replays only ever reach the frame's
own recipient, which refuses them `replayed`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from node.transport import TokenBucket
from p2pfl.config import RelaySettings
from p2pfl.secure.identity import RosterSite

# The longest a frame waits for its sender's next token before 429 rate_limited.
RATE_WAIT_S = 2.0
# Connections an honest node opens to one relay at most (node/transport_client.py).
HONEST_CONNECTIONS = 8
# A sender's burst: a quarter of a second of its rate (at least 10 frames). A
# burst of a whole second's (200 frames at the default 200/s) let a flooder put
# twice its rate on the receiver in the flood's first second, and the other
# sites' relayed heartbeats waited behind it: p99 1.89-2.29x unloaded in 5 runs
# of `python -m bench.attacks --scenarios relay_flood`, 0.99-1.65x with this
# burst, paired in the same window. An honest site loses nothing by it: it has
# at most HONEST_CONNECTIONS frames at the relay at once, and a frame past the
# burst waits for its token instead of being refused.
BURST_S = 0.25
TOO_MANY_CONNECTIONS = "too_many_connections"
# A frame whose sender's card a roster reload removed or changed while it waited.
REVOKED = "unknown_sender"
# The most ids of one sender's forwarded frames remembered (`Forwarded`): more
# than an honest sender forwards within the clock skew; past it the oldest go
# (a copy of one then waits in its sender's gate again, as before).
MAX_REMEMBERED = 65536
# Between a sender and a recipient in the key of a gate of copies (`repeat_key`):
# no roster name holds it (p2pfl/secure/identity.py NAME_PATTERN).
_PAIR = ">"


def repeat_key(sender: str, recipient: str) -> str:
    """The gate that copies of `sender`'s frames to `recipient` wait in."""
    return f"{sender}{_PAIR}{recipient}"


class Forwarded:
    """The ids of the frames a relay forwarded, per sender, each until its
    timestamp is past the clock skew (a copy is refused `stale_timestamp`
    then, before any gate), at most MAX_REMEMBERED per sender."""

    def __init__(self, skew_ms: int, limit: int = MAX_REMEMBERED) -> None:
        self.skew_ms = skew_ms
        self.limit = limit
        self._ids: dict[str, dict[bytes, int]] = {}  # sender -> id -> valid until (epoch ms)

    def seen(self, sender: str, msg_id: bytes) -> bool:
        ids = self._ids.get(sender)
        return ids is not None and msg_id in ids

    def add(self, sender: str, msg_id: bytes, timestamp_ms: int) -> None:
        ids = self._ids.setdefault(sender, {})
        now = int(time.time() * 1000)
        while ids:  # the oldest first: expired, or past the limit
            oldest = next(iter(ids))
            if ids[oldest] > now and len(ids) < self.limit:
                break
            del ids[oldest]
        ids.pop(msg_id, None)
        ids[msg_id] = timestamp_ms + self.skew_ms

    def forget(self, senders: Mapping[str, RosterSite]) -> None:
        """A reloaded roster: the ids of senders it no longer lists go."""
        for sender in [s for s in self._ids if s not in senders]:
            del self._ids[sender]


@dataclass
class SenderGate:
    """One sender's token bucket and the queue of its frames waiting for it."""

    bucket: TokenBucket
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # FIFO: the queue
    freed: asyncio.Event = field(default_factory=asyncio.Event)  # one of its frames left
    active: int = 0  # frames admitted and not yet answered
    waiting: int = 0  # frames in the queue now
    delayed: int = 0  # frames that waited and then went on
    waited_s: float = 0.0  # their waits, summed
    revoked: bool = False  # its sender's card was removed or changed: none goes on

    def leave(self) -> None:
        """A frame `enter` admitted is sent on, answered or refused: its place is free."""
        self.active -= 1
        self.freed.set()

    def once(self) -> Callable[[], None]:
        """`leave`, for one frame: only its first call leaves."""
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                self.leave()

        return leave


class Admission:
    """Every sender's gate (see the module docstring)."""

    def __init__(
        self,
        settings: RelaySettings,
        *,
        wait_s: float = RATE_WAIT_S,
        max_active: int = HONEST_CONNECTIONS,
    ) -> None:
        self.rate = settings.rate_limit_per_s
        self.burst = max(10.0, self.rate * BURST_S)
        self.wait_s = wait_s
        self.max_active = max_active
        self.queue_limit = max(4 * HONEST_CONNECTIONS, settings.max_pending_per_site // 2)
        self.gates: dict[str, SenderGate] = {}

    def gate(self, sender: str) -> SenderGate:
        gate = self.gates.get(sender)
        if gate is None:
            gate = self.gates[sender] = SenderGate(TokenBucket(self.rate, self.burst))
        return gate

    async def enter(self, sender: str) -> SenderGate | str:
        """Wait for `sender`'s turn (or, for a `repeat_key`, its pair's): its gate when its frame may go on to the
        checks (its token is ready and stays so until the caller's next await;
        the caller then owes the gate a `leave()` once the frame is answered or
        refused), else the refusal's reason."""
        gate = self.gate(sender)
        # Nothing waits (not `lock.locked()`: a woken waiter has not taken the lock yet).
        if not gate.waiting and gate.active < self.max_active and gate.bucket.ready():
            gate.active += 1
            return gate  # nothing waits: no await at all
        if gate.waiting >= self.queue_limit:
            return TOO_MANY_CONNECTIONS
        gate.waiting += 1
        began = time.monotonic()
        try:
            async with asyncio.timeout(self.wait_s), gate.lock:
                bucket = gate.bucket
                while not gate.revoked and (gate.active >= self.max_active or not bucket.ready()):
                    if gate.active >= self.max_active:
                        gate.freed.clear()
                        await gate.freed.wait()
                    else:
                        await asyncio.sleep(max(1e-3, (1.0 - bucket.tokens) / bucket.rate))
                if gate.revoked:  # verified against a card that is gone: not forwarded
                    return REVOKED
                gate.active += 1
            # The lock is released, and nothing awaits until the caller's checks
            # take the token: the next frame in the queue runs only after them.
        except TimeoutError:
            return "rate_limited"
        finally:
            gate.waiting -= 1
        gate.delayed += 1
        gate.waited_s += time.monotonic() - began
        return gate

    def why(self, reason: str) -> str:
        """The detail of a refusal `enter` answered."""
        if reason == REVOKED:
            return "its card was removed or changed while the frame waited"
        return f"over {self.rate:g} frames/s"

    def take(self, sender: str) -> bool:
        """A verified frame takes its sender's token (False: none left)."""
        return self.gate(sender).bucket.take()

    def forget(self, old: Mapping[str, RosterSite], new: Mapping[str, RosterSite]) -> None:
        """A reloaded roster (`old` and `new`: Roster.sites): the gate of a sender
        no longer listed, or with a signing key the new card no longer accepts (a
        revoked key), goes and is revoked: its frames waiting, verified under the
        old card, are refused `REVOKED` instead of going on to a new gate's burst
        (admitted ones finish, as they did before the reload). A sender whose keys
        all still verify (unchanged, or rotated with the old key as its previous
        one) keeps its gate, spent bucket and queue included."""
        for key, gate in list(self.gates.items()):
            name = key.partition(_PAIR)[0]  # a gate of copies: its sender's
            was, now = old.get(name), new.get(name)
            if was is None or now is None or not _keys(was) <= _keys(now):
                del self.gates[key]
                gate.revoked = True
                gate.freed.set()  # the head of its queue, waiting for a slot, sees it

    def row(self, sender: str) -> dict[str, float | int]:
        """/status figures of a sender's gate."""
        gate = self.gates.get(sender) or SenderGate(TokenBucket(self.rate, self.burst))
        return {
            "active": gate.active,
            "waiting": gate.waiting,
            "delayed": gate.delayed,
            "waited_s": round(gate.waited_s, 3),
        }


def _keys(site: RosterSite) -> set[str]:
    """The signing keys a roster entry accepts (its previous one too, while valid)."""
    card = site.card
    return {k for k in (card.signing_key, card.previous_signing_key) if k}
