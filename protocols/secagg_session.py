"""One secure-aggregation session as a contributor holds it (protocols/secagg.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from torch import Tensor

from protocols.secagg_messages import SessionRequest

# (round, state, weight) of the model a contributor gives for rounds [wanted, newest]
# to a sum of the given purpose; raises NotReady while not trained yet, returns
# None if it only has newer ones.
ModelSource = Callable[[int, int, str], tuple[int, dict[str, Tensor], float] | None]


@dataclass
class Session:
    requester: str
    request: SessionRequest
    context: bytes
    model_round: int
    digest: str  # of the model, as the ledger knows it
    state: dict[str, Tensor]
    weight: float
    c_private: X25519PrivateKey  # seals my shares; this session only
    s_private: X25519PrivateKey  # agrees my pair masks; this session only
    self_seed: bytes
    phase: str = "advertise"  # the last phase answered
    u1: list[str] = field(default_factory=list)
    u2: list[str] = field(default_factory=list)
    u3: list[str] = field(default_factory=list)
    keys: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # v -> (c_pk, s_pk)
    threshold: int = 0
    held: dict[str, tuple[int, bytes, bytes]] = field(default_factory=dict)  # v -> (idx, sk, b)

    def public(self, which: X25519PrivateKey) -> bytes:
        return which.public_key().public_bytes_raw()
