"""The suite's grouping guard: under `--dist loadgroup`, a worker whose grouped
tests lost their group suffix (pytest 9.2 with pytest-xdist 3.8,
pytest-xdist#1386) stops the run instead of running timing-sensitive tests side
by side and rebuilding shared fixtures on every worker."""

from __future__ import annotations

from types import SimpleNamespace

import conftest
import pytest


class Item(SimpleNamespace):
    def get_closest_marker(self, name: str) -> object | None:
        return self.marks.get(name)


def session(*items: Item, loadgroup: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(option=SimpleNamespace(loadgroup=loadgroup)), items=list(items)
    )


GROUPED = {"xdist_group": pytest.mark.xdist_group("g").mark}


def test_a_grouped_test_without_its_group_suffix_stops_a_loadgroup_worker(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    lost = Item(nodeid="tests/test_a.py::test_x", marks=GROUPED)
    kept = Item(nodeid="tests/test_a.py::test_y@g", marks=GROUPED)
    plain = Item(nodeid="tests/test_b.py::test_z", marks={})
    with pytest.raises(pytest.UsageError, match=r"not grouping \(1 grouped tests.*test_x"):
        conftest.pytest_collection_finish(session(lost, kept, plain))
    conftest.pytest_collection_finish(session(kept, plain))  # suffixes present: runs


def test_the_guard_is_quiet_outside_a_loadgroup_worker(monkeypatch):
    lost = Item(nodeid="tests/test_a.py::test_x", marks=GROUPED)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    conftest.pytest_collection_finish(session(lost))  # a serial run has no suffixes
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    conftest.pytest_collection_finish(session(lost, loadgroup=False))  # --dist load
