"""Reading a node's `STATE/metrics.jsonl` (one JSON object per round, written
by the daemon): benchmarks collect it, `export` reads the privacy spent."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rounds recorded in `path`, in order ([] when there is no file); a
    line that is not a round's JSON object (a torn last line after a crash) is
    skipped with a warning."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s: unreadable metrics line skipped", path)
            continue
        if isinstance(record, dict) and isinstance(record.get("round"), int):
            rows.append(record)
    return rows
