"""`make test` on a machine without Chromium: the browser tests are skipped with
one loud line naming the missing browser and the command that installs it;
the install script does nothing it was told not to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_without_chromium_browser_tests_skip_with_one_loud_line() -> None:
    env = {**os.environ, "P2PFL_CHROMIUM": "/nonexistent/chromium"}
    env.pop("P2PFL_SKIP_BROWSER", None)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "browser"]
        + ["tests/test_dashboard_browser.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    loud = [line for line in out.stdout.splitlines() if "BROWSER TESTS SKIPPED" in line]
    assert len(loud) == 1, out.stdout
    assert "/nonexistent/chromium" in loud[0] and "apt-get install -y chromium" in loud[0]
    assert " skipped" in out.stdout and "passed" not in out.stdout and "failed" not in out.stdout


def test_the_install_script_stays_put_when_told_to() -> None:
    for extra in ({"P2PFL_NO_BROWSER_INSTALL": "1"}, {"P2PFL_CHROMIUM": "/nonexistent/chromium"}):
        env = {"PATH": "/nonexistent", "HOME": os.environ.get("HOME", "/tmp"), **extra}
        out = subprocess.run(
            ["/bin/sh", str(ROOT / "scripts" / "ensure-chromium.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0 and out.stdout == "" and out.stderr == "", (extra, out)
