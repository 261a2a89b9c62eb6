"""Crash-safe file writes (and durable appends), the one implementation every package uses.

A file written here is whole or absent after a crash: the bytes go to a
temporary file in the same folder, which is flushed and fsynced, renamed over
the target, and the folder itself is fsynced so the rename survives a power cut.
"""

from __future__ import annotations

import io
import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Chunk = bytes | bytearray | memoryview


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


def atomic_torch_save(obj: Any, path: Path | str) -> Path:
    """`torch.save` to `path` atomically (read back with weights_only=True)."""
    import torch  # the secure half imports this module too, without torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getbuffer())
