"""The suite's grouping guard: under `--dist loadgroup`, the xdist controller
stops the run, saying why, when a worker's timing-sensitive tests come without
their group suffix (pytest 9.2 with pytest-xdist 3.8, pytest-xdist#1386, or a
group mark added after xdist's hook) instead of running them side by side."""

from __future__ import annotations

from types import SimpleNamespace

import conftest
import pytest


def worker(dist: str = "loadgroup") -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(option=SimpleNamespace(dist=dist)))


TIMED = "tests/test_faults.py::test_partition_heals_and_a_slow_peer_never_blocks_a_round"
PLAIN = "tests/test_wire.py::test_roundtrip"


def test_a_timing_test_without_its_group_suffix_stops_the_run_saying_why():
    with pytest.raises(pytest.exit.Exception, match=r"not grouping \(1 timing-sensitive") as e:
        conftest.pytest_xdist_node_collection_finished(worker(), [TIMED, PLAIN])
    assert e.value.returncode == 3 and "pytest-xdist#1386" in e.value.msg
    # with its suffix, and a plain test without one: the run goes on
    conftest.pytest_xdist_node_collection_finished(worker(), [TIMED + "@timing_drills", PLAIN])


def test_the_guard_is_quiet_outside_loadgroup():
    conftest.pytest_xdist_node_collection_finished(worker("load"), [TIMED, PLAIN])


def test_this_runs_timing_tests_are_grouped(request):
    """Under xdist with loadgroup, the marks the suite adds reach xdist: a
    timing-sensitive test of this very run carries its group."""
    items = [i for i in request.session.items if conftest._timing_sensitive(i)]
    if not items:
        pytest.skip("no timing-sensitive test in this run")
    assert all(i.get_closest_marker("xdist_group") for i in items)
    if getattr(request.config.option, "loadgroup", False):  # a loadgroup worker
        assert all("@" in i.nodeid for i in items), [i.nodeid for i in items][:3]
