"""Crash-safe file writes (and durable appends), the one implementation every package uses.

A file written here is whole or absent after a crash: the bytes go to a
temporary file in the same folder, which is flushed and fsynced, renamed over
the target, and the folder itself is fsynced so the rename survives a power cut.

Every file is created PRIVATE_FILE (0600) unless its caller asks for another
mode: what a node keeps (checkpoints, spool, outbox, journal, metrics, the DP
ledger, encoders) holds its model or what was derived from its private images,
and the 0700 state directory alone cannot be relied on (a mount the node does
not own stays as it is: `make_private_dir`). What the operator asks to share
(an export, a public card) says PUBLIC_FILE where it is written.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Chunk = bytes | bytearray | memoryview

# What a site keeps to itself (keys, logs, whatever was derived from its private
# images): readable by this account only, whatever the umask.
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
# What the operator asked to share (an export, a public card): readable by anyone.
PUBLIC_FILE = 0o644

log = logging.getLogger(__name__)

# The temporary file of an atomic write: `.NAME.PID.8HEX.tmp` (`_temporary`).
_TEMPORARY = re.compile(r"\..+\.([0-9]+)\.[0-9a-f]{8}\.tmp")
_STARTED = time.time()  # a temporary file older than this is no live write of this process
_SWEPT: set[str] = set()  # folders whose stale temporaries this process has removed


def _temporary(path: Path) -> Path:
    """A fresh temporary name beside `path`, first removing (once per folder and
    process) what writes killed before this process started left there: nothing
    else deletes them, and a node in a crash loop (kill -9 during a 45 MB
    checkpoint) would otherwise fill the disk with one per crash."""
    folder = str(path.parent)
    if folder not in _SWEPT:
        _SWEPT.add(folder)
        remove_stale_temporaries(path.parent)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _alive(pid: int) -> bool:
    """Whether `pid` is another live process (one whose write may be under way;
    this process's own is judged by time, as a container's node is pid 1 at
    every start)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # another account's, or a number no pid can be: keep it
    return True


def remove_stale_temporaries(folder: Path | str) -> int:
    """Delete the temporary files of this module's atomic writes in `folder`
    (its exact name pattern) that are regular files of this account last
    written before this process started by a process no longer alive (the
    pid in the name); returns how many. A concurrent write of another live
    process, a file of another account, a link or a name of another pattern
    is left alone."""
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        match = _TEMPORARY.fullmatch(name)
        if match is None or _alive(int(match[1])):
            continue
        entry = os.path.join(folder, name)
        try:
            info = os.lstat(entry)
            if (
                stat.S_ISREG(info.st_mode)
                and info.st_uid == os.getuid()
                and info.st_mtime < _STARTED
            ):
                os.unlink(entry)
                removed += 1
        except OSError:
            continue  # gone meanwhile, or not ours to delete
    if removed:
        log.warning(
            "%s: removed %d temporary files that writes interrupted by a crash left",
            folder,
            removed,
        )
    return removed


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(
    path: Path | str, data: Chunk | Iterable[Chunk], *, mode: int = PRIVATE_FILE
) -> Path:
    """Write `data` (one buffer or an iterable of chunks) to `path` atomically;
    the file is created with permission bits `mode` (PRIVATE_FILE unless the
    caller says otherwise), whatever the umask. Parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    chunks = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    # O_EXCL (and a name no one can guess): the temporary file is always this call's
    # own. A file or link planted at a fixed name by anyone who can write the folder
    # (an existing --out keeps its mode) was opened and written: a review's other
    # account owned the site copy that was renamed over the target, and read it.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
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
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing half-written is left behind
        raise
    fsync_dir(path.parent)
    return path


def create_exclusive(path: Path | str, data: Chunk, *, mode: int = PRIVATE_FILE) -> bool:
    """Create `path` holding `data`, whole, unless it exists: True when this
    call created it. Safe against a concurrent creator: the bytes go to a
    temporary file of this call's own and are linked into place (link(2)
    fails on an existing name), so two processes starting at once agree on
    one content instead of the later rename replacing what the earlier one
    already read."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
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


TAIL_BLOCK = 64 * 1024  # how far back a torn line is looked for at a time


def _cut_torn_tail(fd: int, path: Path | str) -> int:
    """Cut a log back to its last newline, durably; returns the bytes cut.

    A crash (SIGKILL between the write(2) calls of a long append, a power
    cut) can leave the last line without its newline. Readers skip such a
    line, but the next append would be glued onto it and skipped with it on
    every later read: the first entry written after the restart would be lost
    (review finding 4). So the fragment goes before anything is appended."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return 0
    keep, end = 0, size
    while end > 0:
        start = max(0, end - TAIL_BLOCK)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        end = start
    fragment = os.pread(fd, min(size - keep, 120), keep)
    os.ftruncate(fd, keep)
    os.fsync(fd)
    log.warning(
        "%s: cut %d bytes of a torn last line (a crash during an append): %r%s",
        path,
        size - keep,
        fragment,
        "..." if size - keep > len(fragment) else "",
    )
    return size - keep


def cut_torn_tail(path: Path | str) -> int:
    """`_cut_torn_tail` on the log at `path` (0 when there is none)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return 0
    try:
        return _cut_torn_tail(fd, path)
    finally:
        os.close(fd)


def open_append(path: Path | str, *, mode: int = PRIVATE_FILE) -> io.TextIOWrapper:
    """A log of whole lines opened for appending: created with permission bits
    `mode` whatever the umask (a file an older version left wider is
    narrowed), and cut back to its last newline first, so what is appended
    starts a line of its own (`_cut_torn_tail`)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, mode)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
        _cut_torn_tail(fd, path)
        return open(fd, "a", encoding="utf-8", closefd=True)  # noqa: SIM115 - the caller's
    except BaseException:
        os.close(fd)
        raise


def append_lines(path: Path | str, lines: Iterable[str], *, mode: int = PRIVATE_FILE) -> None:
    """Append whole lines to a log and fsync: what returned survives a crash
    (a SIGKILL right after included). The file is created `mode`; a torn last
    line a crash left is cut first (`open_append`)."""
    with open_append(path, mode=mode) as fh:
        for line in lines:
            fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_text(path: Path | str, text: str, *, mode: int = PRIVATE_FILE) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: Path | str, obj: Any, *, mode: int = PRIVATE_FILE) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2), mode=mode)


def atomic_torch_save(obj: Any, path: Path | str, *, mode: int = PRIVATE_FILE) -> Path:
    """`torch.save` to `path` atomically (read back with weights_only=True);
    `mode` PRIVATE_FILE for weights trained on a site's private data."""
    import torch  # the secure half imports this module too, without torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getbuffer(), mode=mode)


def atomic_savez(
    path: Path | str, arrays: dict[str, Any], *, compressed: bool = True, mode: int = PRIVATE_FILE
) -> Path:
    """`np.savez(_compressed)` of `arrays` to `path` atomically, PRIVATE_FILE unless
    the caller says otherwise: a site's images copied anywhere are as private as
    their source, whatever the umask (np.savez creates the file with its mode)."""
    import numpy as np

    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    return atomic_write_bytes(path, buffer.getbuffer(), mode=mode)


def atomic_savefig(
    figure: Any, path: Path | str, *, mode: int = PRIVATE_FILE, **kwargs: Any
) -> Path:
    """A matplotlib figure's `savefig` to `path` atomically, with permission bits
    `mode`: rendered in memory first, because savefig onto a path creates the file
    with the umask's bits and a figure of private images must never exist, even for
    a moment, readable by other accounts. The format is the path's suffix."""
    path = Path(path)
    buffer = io.BytesIO()
    figure.savefig(buffer, format=path.suffix.lstrip(".") or "png", **kwargs)
    return atomic_write_bytes(path, buffer.getbuffer(), mode=mode)


_WARNED_DIRS: set[str] = set()  # make_private_dir warns once per folder and process


def make_private_dirs(path: Path | str) -> Path:
    """Create `path` and whichever of its parents are missing, each PRIVATE_DIR
    whatever the umask; a folder that exists keeps its mode. `Path.mkdir(mode,
    parents=True)` gives `mode` to the last folder only and the parents the
    umask's bits: `partition --out new/deeper/parts` left `new` and `new/deeper`
    0755 under umask 022, and a protocol's nested artifact folder in the state
    directory too (a claims review, 2026-11-28)."""
    path = Path(path)
    missing: list[Path] = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue  # made meanwhile by another process: keeps its mode
        folder.chmod(PRIVATE_DIR)  # the umask may have taken more than group and other bits
    return path


def make_private_dir(path: Path | str) -> Path:
    """Create `path` (and its parents) and make it PRIVATE_DIR: a folder that
    already exists, made by `p2pfl-node provision` or an older version with the
    umask's bits (0755), is tightened too, so what goes in is this account's only.
    A folder this account cannot tighten (a mount it does not own, such as a
    Kubernetes volume root under fsGroup) is left as it is, with a WARNING once
    naming it and its mode: other accounts may list it. The files written
    through this module are created PRIVATE_FILE all the same."""
    path = make_private_dirs(path)
    why = ""
    try:
        path.chmod(PRIVATE_DIR)
    except OSError as exc:
        why = exc.strerror or str(exc)
    try:
        info = path.stat()
    except OSError:
        return path
    if stat.S_IMODE(info.st_mode) & 0o077 and str(path) not in _WARNED_DIRS:
        _WARNED_DIRS.add(str(path))
        log.warning(
            "%s is mode %04o (owner uid %d) and cannot be made %04o%s: other accounts may "
            "list or enter it; the files this node writes in it are created %04o",
            path,
            stat.S_IMODE(info.st_mode),
            info.st_uid,
            PRIVATE_DIR,
            f" ({why})" if why else "",
            PRIVATE_FILE,
        )
    return path


def make_private_tree(path: Path | str) -> Path:
    """`make_private_dir(path)`, then everything under it this account's only,
    once: each folder with group or other bits becomes PRIVATE_DIR and each
    regular file loses its group and other bits (`mode & ~0o077`). For a state
    directory written by a version before the files were created PRIVATE_FILE
    (0644 checkpoints, encoders, spooled frames in 0755 folders): a file is
    otherwise narrowed only when it is rewritten, and the last checkpoints of a
    finished run never are. Links are neither followed nor changed. What cannot
    be changed (a mount or a file this account does not own) is named in one
    WARNING line, with its mode and owner."""
    root = make_private_dir(path)
    stuck: list[str] = []

    def unreadable(exc: OSError) -> None:
        stuck.append(f"{exc.filename} (cannot be listed: {exc.strerror or exc})")

    for folder, dirs, files in os.walk(root, onerror=unreadable):
        for name in dirs + files:
            entry = os.path.join(folder, name)
            try:
                info = os.lstat(entry)
            except OSError:
                continue  # gone meanwhile
            mode = stat.S_IMODE(info.st_mode)
            if not mode & 0o077:
                continue
            if stat.S_ISDIR(info.st_mode):
                wanted = PRIVATE_DIR
            elif stat.S_ISREG(info.st_mode):
                wanted = mode & ~0o077
            else:
                continue  # a link (not followed), a socket or a pipe
            try:
                os.chmod(entry, wanted)  # lstat said it is no link
            except OSError as exc:
                stuck.append(f"{entry} ({mode:04o}, uid {info.st_uid}: {exc.strerror or exc})")
    if stuck:
        shown = "; ".join(stuck[:5]) + (f"; and {len(stuck) - 5} more" if len(stuck) > 5 else "")
        log.warning(
            "%s: %d entries cannot be made this account's only, other accounts may read "
            "or list them: %s",
            root,
            len(stuck),
            shown,
        )
    return root
