"""p2pfl/files.py: crash-safe writes keep their mode and never write through a
link planted at their temporary name."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from p2pfl.files import atomic_write_bytes, atomic_write_json, atomic_write_text


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
