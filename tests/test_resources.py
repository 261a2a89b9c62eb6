"""No CPU oversubscription by default: provision writes training.threads so the
sites fit the cores, and a node says when the nodes on its host do not."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from bench.localfed import LocalFederation
from node.provision import provision
from node.resources import HostThreads, available_cores, threads_per_site


def test_provision_fits_the_sites_to_the_cores(tmp_path: Path) -> None:
    assert threads_per_site(3, cores=8) == 2 and threads_per_site(5, cores=2) == 1
    plans = provision(tmp_path, ["a", "b", "c"], protocol={"name": "probe", "rounds": 1})
    threads = [yaml.safe_load(p.config_path.read_text())["training"]["threads"] for p in plans]
    assert threads == [threads_per_site(3)] * 3
    assert sum(threads) <= max(available_cores(), 3)  # at least one thread each


def test_the_registry_ignores_gone_and_reused_pids(tmp_path: Path) -> None:
    me = HostThreads("a", 2, tmp_path, cores=4)
    me.register()
    (tmp_path / "999999.json").write_text(
        json.dumps({"pid": 999999, "name": "gone", "threads": 8, "started": 1.0})
    )
    (tmp_path / f"{os.getppid()}.json").write_text(  # a live pid, started at another time
        json.dumps({"pid": os.getppid(), "name": "reused", "threads": 8, "started": 1.0})
    )
    (tmp_path / "garbage.json").write_text("{not json")
    report = me.check()
    assert report == {
        "cores": 4,
        "threads": 2,
        "nodes_on_host": 1,
        "threads_on_host": 2,
        "other_nodes": [],
        "oversubscribed": False,
    }
    assert not (tmp_path / "999999.json").exists()  # pruned
    me.unregister()
    assert not me.path.exists()


def _hostile_registry(tmp_path: Path, kind: str) -> Path:
    """A registry folder another local account controls, as /tmp/p2pfl-node-<uid>
    can be (any account may create that name first)."""
    if kind == "owned_by_another_user":
        if os.geteuid() != 0:
            pytest.skip("making a folder of another user's needs root")
        import pwd

        folder = tmp_path / "theirs"
        folder.mkdir(mode=0o755)
        nobody = pwd.getpwnam("nobody")
        os.chown(folder, nobody.pw_uid, nobody.pw_gid)
        return folder
    if kind == "world_writable":
        folder = tmp_path / "open"
        folder.mkdir()
        folder.chmod(0o777)  # no sticky bit: fs.protected_symlinks does not apply
        return folder
    (tmp_path / "target").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    return tmp_path / "link"


@pytest.mark.parametrize("kind", ["world_writable", "owned_by_another_user", "a_symbolic_link"])
def test_a_registry_folder_others_control_is_not_used_nor_written_through(
    tmp_path: Path, kind: str, caplog
) -> None:
    """The review's attack: links planted in the registry folder at the names
    a node writes made it overwrite a file of the attacker's choosing (its
    status token). Such a folder is refused, said once, and the node goes on
    without it: no file written, none read, none removed."""
    victim = tmp_path / "status.token"
    victim.write_text("SECRET-TOKEN-kept-0600\n")
    victim.chmod(0o600)
    folder = _hostile_registry(tmp_path, kind)
    real = folder.resolve()
    for name in (f"{os.getpid()}.tmp", f".{os.getpid()}.json.tmp", f"{os.getpid()}.json"):
        os.symlink(victim, real / name)
    (real / f"{os.getppid()}.json").write_text(  # an entry the check must not read
        json.dumps({"pid": os.getppid(), "name": "planted", "threads": 64, "started": 1.0})
    )
    before = sorted(p.name for p in real.iterdir())
    me = HostThreads("a", 2, folder, cores=4)
    with caplog.at_level("WARNING", logger="node.resources"):
        assert me.register() is False
        report = me.check()
        me.unregister()
    assert victim.read_text() == "SECRET-TOKEN-kept-0600\n"
    assert sorted(p.name for p in real.iterdir()) == before
    assert report["nodes_on_host"] == 1 and report["threads_on_host"] == 2
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "not using the thread registry" in warning and str(folder) in warning


def test_the_registry_folder_is_made_private_and_its_entry_written_without_following_links(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "p2pfl-node-test"
    me = HostThreads("a", 2, folder, cores=4)
    assert me.register() is True
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(me.path.stat().st_mode) == 0o600
    me.unregister()
    # a link at a temporary name (made by this user's own mistake, or before the
    # folder was checked) is never written through: the write makes its own
    victim = tmp_path / "victim"
    victim.write_text("kept")
    (folder / f".{os.getpid()}.json.tmp").symlink_to(victim)
    assert me.register() is True
    assert victim.read_text() == "kept"
    me.unregister()


def _federation(tmp_path: Path, threads: int | None):
    overrides = {"node": {"startup_wait_s": 10}}
    if threads is not None:
        overrides["training"] = {"threads": threads}
    return provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "probe", "rounds": 200, "interval_s": 0.2},
        overrides=overrides,
    )


@pytest.mark.slow
@pytest.mark.parametrize("oversubscribed", [True, False])
def test_a_node_says_once_when_the_host_is_oversubscribed(tmp_path: Path, oversubscribed: bool):
    runtime = tmp_path / "runtime"  # a registry of this test's nodes only
    runtime.mkdir()
    plans = _federation(tmp_path, available_cores() if oversubscribed else None)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    with LocalFederation(plans, tmp_path / "logs", env=env) as fed:
        for name in ("a", "b"):  # each has seen the other's registration at least once
            st = fed[name].wait_for(
                lambda s: s["resources"].get("nodes_on_host") == 2, 60, "both nodes registered"
            )
            assert st["resources"]["oversubscribed"] is oversubscribed, st["resources"]
            assert st["resources"]["cores"] == available_cores()
        fed["a"].wait_for(lambda s: s["round"] >= 3, 60, "a few rounds")
        log_text = (tmp_path / "logs" / "a.log").read_text()
    assert log_text.count("CPU oversubscribed") == (1 if oversubscribed else 0), log_text
    assert list(runtime.glob("p2pfl-node/*.json")) == []  # both unregistered on stop


def test_the_start_up_heap_is_frozen_so_a_full_collection_skips_it() -> None:
    """freeze_startup_heap (called by the daemon and the relay once they
    serve): torch's objects move to the permanent generation, so a full
    collection no longer scans them (in another process, so this one's heap
    stays as it is)."""
    import subprocess
    import sys

    code = (
        "import gc, json, torch\n"
        "from node.resources import freeze_startup_heap\n"
        "before = len(gc.get_objects(2))\n"
        "frozen = freeze_startup_heap()\n"
        "print(json.dumps({'before': before, 'frozen': frozen, 'after': len(gc.get_objects(2))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["frozen"] >= figures["before"] > 50_000, figures
    assert figures["after"] < figures["frozen"] / 100, figures


def test_a_node_freezes_its_heap_again_at_its_first_training_phase(monkeypatch) -> None:
    """The model, the data and the optimizer (and torch._dynamo) exist only
    once the protocol trains: the daemon's context freezes the heap again at
    the first train (or FedER generator) phase, and only then."""
    from node import context

    frozen: list[str] = []
    monkeypatch.setattr(context, "freeze_startup_heap", lambda: frozen.append("x") or 1)

    class Stub:
        def set_phase(self, phase: str) -> None: ...

        def on_progress(self) -> None: ...

    ctx = object.__new__(context.NodeContext)
    ctx._telemetry, ctx._state, ctx._heap_frozen = Stub(), Stub(), False
    for phase in ("waiting_for_peers", "start"):
        ctx.set_phase(phase)
    assert frozen == []
    for phase in ("train", "exchange", "train", "generator"):
        ctx.set_phase(phase)
    assert frozen == ["x"] and ctx.phase == "generator"
