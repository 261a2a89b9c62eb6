"""Shared fixtures: identities, rosters and codecs for a small federation."""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from browser_util import SKIP_ENV, chromium_binary, missing_browser_message  # noqa: E402

from p2pfl.secure.identity import LocalIdentity, Roster  # noqa: E402
from p2pfl.secure.wire import WireCodec  # noqa: E402

BROWSER_SKIPPED = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without Chromium (or with P2PFL_SKIP_BROWSER=1) the `browser` tests are
    skipped, and the run ends with one line that says so and how to fix it."""
    browser = [item for item in items if item.get_closest_marker("browser")]
    if not browser:
        return
    if os.environ.get(SKIP_ENV) == "1":
        reason = f"{SKIP_ENV}=1"
    elif chromium_binary() is None:
        reason = missing_browser_message()
    else:
        return
    for item in browser:
        item.add_marker(pytest.mark.skip(reason=reason))
    config.stash[BROWSER_SKIPPED] = len(browser)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    skipped = config.stash.get(BROWSER_SKIPPED, 0)
    if skipped:
        reason = f"{SKIP_ENV}=1" if os.environ.get(SKIP_ENV) == "1" else missing_browser_message()
        terminalreporter.write_line(
            f"BROWSER TESTS SKIPPED ({skipped}): {reason}", red=True, bold=True
        )


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
