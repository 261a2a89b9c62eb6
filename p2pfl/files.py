"""Crash-safe file writes (and durable appends), the one implementation every package uses.

A file written here is whole or absent after a crash: the bytes go to a
temporary file in the same folder, which is flushed and fsynced, renamed over
the target, and the folder itself is fsynced so the rename survives a power cut.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Chunk = bytes | bytearray | memoryview

# What a site keeps to itself (keys, logs, whatever was derived from its private
# images): readable by this account only, whatever the umask.
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(
    path: Path | str, data: Chunk | Iterable[Chunk], *, mode: int = 0o644
) -> Path:
    """Write `data` (one buffer or an iterable of chunks) to `path` atomically;
    the file is created with permission bits `mode` (0o600 for private keys).
    Parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    chunks = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    # O_NOFOLLOW: a link planted at the temporary name (by anyone who can write
    # the folder) is refused (ELOOP), never written through to its target
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb", closefd=False) as fh:
            for chunk in chunks:
                fh.write(chunk)
            fh.flush()
        os.fchmod(fd, mode)  # the umask may have narrowed what os.open created
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def create_exclusive(path: Path | str, data: Chunk, *, mode: int = 0o644) -> bool:
    """Create `path` holding `data`, whole, unless it exists: True when this
    call created it. Safe against a concurrent creator: the bytes go to a
    temporary file of this call's own and are linked into place (link(2)
    fails on an existing name), so two processes starting at once agree on
    one content instead of the later rename replacing what the earlier one
    already read."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        try:
            os.write(fd, bytes(data))
            os.fchmod(fd, mode)  # the umask may have narrowed what os.open created
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        fsync_dir(path.parent)
        return True
    finally:
        os.unlink(tmp)


def append_lines(path: Path | str, lines: Iterable[str]) -> None:
    """Append whole lines to a log and fsync: what returned survives a crash
    (a SIGKILL right after included)."""
    with open(path, "a", encoding="utf-8") as fh:
        for line in lines:
            fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_text(path: Path | str, text: str, *, mode: int = 0o644) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: Path | str, obj: Any, *, mode: int = 0o644) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2), mode=mode)


def atomic_torch_save(obj: Any, path: Path | str, *, mode: int = 0o644) -> Path:
    """`torch.save` to `path` atomically (read back with weights_only=True);
    `mode` PRIVATE_FILE for weights trained on a site's private data."""
    import torch  # the secure half imports this module too, without torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getbuffer(), mode=mode)


def atomic_savefig(figure: Any, path: Path | str, *, mode: int = 0o644, **kwargs: Any) -> Path:
    """A matplotlib figure's `savefig` to `path` atomically, with permission bits
    `mode`: rendered in memory first, because savefig onto a path creates the file
    with the umask's bits and a figure of private images must never exist, even for
    a moment, readable by other accounts. The format is the path's suffix."""
    path = Path(path)
    buffer = io.BytesIO()
    figure.savefig(buffer, format=path.suffix.lstrip(".") or "png", **kwargs)
    return atomic_write_bytes(path, buffer.getbuffer(), mode=mode)


def make_private_dir(path: Path | str) -> Path:
    """Create `path` (and its parents) and make it PRIVATE_DIR: a folder that
    already exists, made by `p2pfl-node provision` or an older version with the
    umask's bits (0755), is tightened too, so what goes in is this account's only.
    A folder this account does not own (a mount) is left as it is: the files in it
    are still created PRIVATE_FILE by their writers."""
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        path.chmod(PRIVATE_DIR)
    return path
