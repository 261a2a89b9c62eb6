"""Shared fixtures: identities, rosters and codecs for a small federation."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from p2pfl.secure.identity import LocalIdentity, Roster  # noqa: E402
from p2pfl.secure.wire import WireCodec  # noqa: E402


@pytest.fixture(scope="session")
def identities() -> dict[str, LocalIdentity]:
    return {name: LocalIdentity.generate(name) for name in ("alice", "bob", "carol")}


@pytest.fixture(scope="session")
def roster(identities: dict[str, LocalIdentity]) -> Roster:
    return Roster(
        [ident.card(f"127.0.0.1:{7000 + i}") for i, ident in enumerate(identities.values())]
    )


@pytest.fixture
def codecs(identities: dict[str, LocalIdentity], roster: Roster) -> dict[str, WireCodec]:
    return {name: WireCodec(ident, roster, "fed-test") for name, ident in identities.items()}
