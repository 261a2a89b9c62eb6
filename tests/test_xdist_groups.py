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


class Item(SimpleNamespace):
    def get_closest_marker(self, name: str) -> object:
        return object() if name in self.marks else None


def test_an_exclusive_test_whose_file_does_not_spell_the_mark_stops_the_run(tmp_path):
    """make test's second phase collects only the files that spell
    `pytest.mark.exclusive` (Makefile EXCLUSIVE_FILES): a test marked through
    an alias would run in neither phase, so collection stops, naming its file."""
    spelled = tmp_path / "test_spelled.py"
    spelled.write_text("import pytest\n\npytestmark = pytest.mark.exclusive\n")
    aliased = tmp_path / "test_aliased.py"
    aliased.write_text("from marks import ALONE\n\npytestmark = ALONE\n")
    plain = tmp_path / "test_plain.py"
    plain.write_text("def test_x():\n    pass\n")
    items = [
        Item(path=spelled, marks={"exclusive"}),
        Item(path=plain, marks=set()),
    ]
    conftest._check_exclusive_files(items)  # spelled: the run goes on
    with pytest.raises(pytest.exit.Exception, match="test_aliased.py: marks tests exclusive") as e:
        conftest._check_exclusive_files([*items, Item(path=aliased, marks={"exclusive"})])
    assert e.value.returncode == 3 and "neither phase" in e.value.msg
