"""A benchmark's `main(argv)`, run in the test process, where a test once ran
`python -m MODULE ARGS` (docs/testing.md, "Benchmarks run in the test
process"): what the bench starts stays a process of its own; only the bench's
own import is saved."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest


def last_json(
    capsys: pytest.CaptureFixture[str], args: list[str], codes: tuple[int, ...] = (0,)
) -> Any:
    """`args` is MODULE then its arguments: MODULE's `main` (None counts as 0)
    must return one of `codes`; the last line it printed, parsed."""
    main = importlib.import_module(args[0]).main
    capsys.readouterr()
    code = main(args[1:]) or 0
    captured = capsys.readouterr()
    assert code in codes, (captured.out[-2000:], captured.err[-2000:])
    return json.loads(captured.out.strip().splitlines()[-1])
