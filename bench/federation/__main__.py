"""`python -m bench.federation ARGS`: the benchmark's command line (cli.py)."""

import signal
import sys
from types import FrameType

from bench.federation.cli import main


def _stop(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a `timeout`, a scheduler) unwinds like Ctrl-C: the federation's
    context managers stop every node process before the benchmark exits; before,
    the nodes were left running, orphaned."""
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _stop)
sys.exit(main())
