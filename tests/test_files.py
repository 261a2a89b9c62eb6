"""p2pfl/files.py: crash-safe writes keep their mode and never write through a
link planted at their temporary name."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from p2pfl.files import (
    atomic_savefig,
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    make_private_dir,
)


def test_a_write_is_whole_with_the_asked_mode_and_replaces_a_stale_temporary(tmp_path):
    target = tmp_path / "sub" / "key.pem"
    atomic_write_text(target, "old", mode=0o600)
    (target.parent / ".key.pem.tmp").write_bytes(b"half a write before a crash")
    previous = os.umask(0o077)
    try:
        atomic_write_bytes(target, [b"new ", memoryview(b"bytes")], mode=0o644)
    finally:
        os.umask(previous)
    assert target.read_bytes() == b"new bytes"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # not narrowed by the umask
    assert not (target.parent / ".key.pem.tmp").exists()
    atomic_write_json(target, {"a": 1}, mode=0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and '"a": 1' in target.read_text()


def test_a_link_planted_at_the_temporary_name_is_refused_not_written_through(tmp_path):
    secret = tmp_path / "elsewhere.txt"
    secret.write_text("not yours")
    os.chmod(secret, 0o600)
    folder = tmp_path / "state"
    folder.mkdir()
    (folder / ".status.token.tmp").symlink_to(secret)
    with pytest.raises(OSError) as caught:
        atomic_write_text(folder / "status.token", "token", mode=0o644)
    assert caught.value.errno == errno.ELOOP
    assert secret.read_text() == "not yours"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not (folder / "status.token").exists()


def test_private_folders_are_tightened_and_figures_and_weights_keep_their_mode(tmp_path):
    """What is derived from private images (a figure of them, weights trained on
    them) is written 0600 under the usual umask 022, into a folder made 0700 even
    when `p2pfl-node provision` left it 0755."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    previous = os.umask(0o022)
    try:
        private = make_private_dir(state / "genbuffer")
        make_private_dir(state)
        figure = Figure(figsize=(1, 1))
        FigureCanvasAgg(figure)
        atomic_savefig(figure, private / "grid.png", mode=0o600)
        atomic_torch_save({"w": 1}, private / "generator.pt", mode=0o600)
    finally:
        os.umask(previous)
    for folder in (state, private):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert sorted(p.name for p in private.iterdir()) == ["generator.pt", "grid.png"]
    for path in private.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert (private / "grid.png").read_bytes().startswith(b"\x89PNG")
