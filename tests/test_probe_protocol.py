"""The probe protocol's own bookkeeping against a hostile roster member."""

from __future__ import annotations

from p2pfl.config.protocols import ProbeParams
from protocols.base import Received
from protocols.probe import EARLY_ROUNDS, Probe


def test_probes_of_rounds_past_the_last_are_not_kept() -> None:
    """A review (rv_proto, 2026-11-28): probes of later rounds are kept for the
    round they name, so a node one round behind catches up; a member pushing
    probes of rounds 11, 12, ..., 2^31 - 1 to a 10-round probe grew that memory
    by an entry a push, none of which any round would read."""
    probe = Probe(ProbeParams(name="probe", rounds=10))
    got: set[str] = set()
    for r in range(2, 5000):
        probe.take(Received(sender="evil", kind="probe", round=r, payload={}), 1, got)
    probe.take(Received(sender="evil", kind="probe", round=2**31 - 1, payload={}), 1, got)
    assert sorted(probe.early) == list(range(2, 11))  # the rounds it will still run
    assert probe.received == {"evil": 4999}
    # a probe of this round is taken as before
    probe.take(Received(sender="good", kind="probe", round=1, payload={}), 1, got)
    assert got == {"good"}


def test_probes_of_rounds_far_ahead_of_a_long_probe_are_not_kept() -> None:
    """A second review (rv_proto2, 2026-11-28): capped at the last round, a
    probe of 1,000,000 rounds (the length the hostile-wire test runs) still
    kept an entry for every later round a member pushed; now the next
    EARLY_ROUNDS rounds only, and a peer one round ahead is still caught up."""
    probe = Probe(ProbeParams(name="probe", rounds=1_000_000))
    got: set[str] = set()
    for r in range(2, 5000):
        probe.take(Received(sender="evil", kind="probe", round=r, payload={}), 1, got)
    assert sorted(probe.early) == list(range(2, 2 + EARLY_ROUNDS))
    probe.take(Received(sender="good", kind="probe", round=2, payload={}), 1, got)
    assert probe.early[2] == {"evil", "good"}
