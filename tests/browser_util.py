"""Drive headless Chromium from tests: dump a page's DOM, take a screenshot.

Chromium is the Debian package `chromium` (/usr/bin/chromium), or the binary
P2PFL_CHROMIUM names. `make test` installs it where it can
(scripts/ensure-chromium.sh); where it is missing, conftest.py skips the
browser tests with one loud line saying how to install it. P2PFL_SKIP_BROWSER=1
skips them even when Chromium is there.

Both the async helpers (use them when the page is served by an aiohttp app in
the test's own event loop) and the sync ones (when the server is another
process) run Chromium as a subprocess with a throwaway profile.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
SKIP_ENV = "P2PFL_SKIP_BROWSER"
BINARY_ENV = "P2PFL_CHROMIUM"
INSTALL_HINT = "sudo apt-get update && sudo apt-get install -y chromium"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class ChromiumRun:
    returncode: int
    stdout: str
    stderr: str


def chromium_binary() -> str | None:
    """Path of the Chromium binary the browser tests use: the one P2PFL_CHROMIUM
    names when it is set, else the first of CHROMIUM_CANDIDATES found; None
    when there is none."""
    named = os.environ.get(BINARY_ENV)
    for candidate in (named,) if named else CHROMIUM_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def missing_browser_message() -> str:
    named = os.environ.get(BINARY_ENV)
    what = f"{BINARY_ENV}={named!r}" if named else "headless Chromium (Debian package `chromium`)"
    return f"{what} not found: install it with `{INSTALL_HINT}` and rerun `make test`"


def find_chromium() -> str:
    """Path of a Chromium binary; fails the test (or skips with P2PFL_SKIP_BROWSER=1)
    when there is none (conftest.py skips browser tests before they get here)."""
    found = chromium_binary()
    if found:
        return found
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(missing_browser_message())
    pytest.fail(missing_browser_message())


def chromium_command(
    binary: str,
    url: str,
    profile_dir: Path,
    *,
    dump_dom: bool = False,
    screenshot: Path | None = None,
    window_size: tuple[int, int] = (1280, 900),
    virtual_time_ms: int = 5000,
) -> list[str]:
    command = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--hide-scrollbars",
        f"--user-data-dir={profile_dir}",
        f"--virtual-time-budget={virtual_time_ms}",
        f"--window-size={window_size[0]},{window_size[1]}",
    ]
    if dump_dom:
        command.append("--dump-dom")
    if screenshot is not None:
        command.append(f"--screenshot={screenshot}")
    command.append(url)
    return command


def _checked(run: ChromiumRun, what: str) -> ChromiumRun:
    if run.returncode != 0:
        raise AssertionError(
            f"chromium {what} exited with {run.returncode}; stderr tail:\n{run.stderr[-2000:]}"
        )
    return run


async def _run_async(command: list[str], timeout_s: float) -> ChromiumRun:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"chromium did not finish within {timeout_s} s") from None
    return ChromiumRun(
        process.returncode or 0, stdout.decode(errors="replace"), stderr.decode(errors="replace")
    )


def _run_sync(command: list[str], timeout_s: float) -> ChromiumRun:
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"chromium did not finish within {timeout_s} s") from None
    return ChromiumRun(
        done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    )


async def dump_dom(url: str, *, virtual_time_ms: int = 5000, timeout_s: float = 90.0) -> str:
    """The page's DOM after its scripts ran for `virtual_time_ms` of virtual time."""
    binary = find_chromium()
    with tempfile.TemporaryDirectory(prefix="p2pfl-chromium-") as profile:
        command = chromium_command(
            binary, url, Path(profile), dump_dom=True, virtual_time_ms=virtual_time_ms
        )
        return _checked(await _run_async(command, timeout_s), "--dump-dom").stdout


async def screenshot(
    url: str,
    path: Path,
    *,
    window_size: tuple[int, int] = (1280, 900),
    virtual_time_ms: int = 5000,
    timeout_s: float = 90.0,
) -> Path:
    """A PNG of the page at `path`; raises AssertionError if none was written."""
    binary = find_chromium()
    with tempfile.TemporaryDirectory(prefix="p2pfl-chromium-") as profile:
        command = chromium_command(
            binary,
            url,
            Path(profile),
            screenshot=path,
            window_size=window_size,
            virtual_time_ms=virtual_time_ms,
        )
        _checked(await _run_async(command, timeout_s), "--screenshot")
    return _require_png(path)


def dump_dom_sync(url: str, *, virtual_time_ms: int = 5000, timeout_s: float = 90.0) -> str:
    """`dump_dom` for a page served by another process."""
    binary = find_chromium()
    with tempfile.TemporaryDirectory(prefix="p2pfl-chromium-") as profile:
        command = chromium_command(
            binary, url, Path(profile), dump_dom=True, virtual_time_ms=virtual_time_ms
        )
        return _checked(_run_sync(command, timeout_s), "--dump-dom").stdout


def screenshot_sync(
    url: str,
    path: Path,
    *,
    window_size: tuple[int, int] = (1280, 900),
    virtual_time_ms: int = 5000,
    timeout_s: float = 90.0,
) -> Path:
    """`screenshot` for a page served by another process."""
    binary = find_chromium()
    with tempfile.TemporaryDirectory(prefix="p2pfl-chromium-") as profile:
        command = chromium_command(
            binary,
            url,
            Path(profile),
            screenshot=path,
            window_size=window_size,
            virtual_time_ms=virtual_time_ms,
        )
        _checked(_run_sync(command, timeout_s), "--screenshot")
    return _require_png(path)


def _require_png(path: Path) -> Path:
    if not path.exists():
        raise AssertionError(f"chromium wrote no screenshot at {path}")
    if path.read_bytes()[:8] != PNG_SIGNATURE:
        raise AssertionError(f"{path} is not a PNG")
    return path


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    header = path.read_bytes()[:24]
    if header[:8] != PNG_SIGNATURE or header[12:16] != b"IHDR":
        raise AssertionError(f"{path} is not a PNG")
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")
