"""What one federation run produces, whichever way its nodes ran: `RunOutcome`
with one row per node per round (`bench_row`: the keys of results.json's
`rounds`), and the `Report` callback that the runners write progress lines to."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.federation.specs import RunSpec

ROW_KEYS = (
    "node",
    "round",
    "macro_f1",
    "accuracy",
    "messages_sent",
    "bytes_sent",
    "train_s",
    "round_s",
)
EXTRA_ROW_KEYS = (
    "exchange_s",
    "aggregate_s",
    "personalize_s",
    "train_loss",
    "val_macro_f1",
    "val_balanced_loss",
    "val_score",  # what chooses (training.select_by's figure, higher wins)
    "val_classes",  # fewer than two: the federated best follows the latest round
    "best_round",
    "best_follows_latest",
    "best_val_macro_f1",
    "best_val_score",
    "best_macro_f1",
    "best_accuracy",
    "best_balanced_accuracy",
    "best_auc",
    "balanced_accuracy",
    "auc",
    # personalization (p2pfl.learning.personal): the last round's choice
    "reported_personal",
    "personal_trained_alone",
    "reported_macro_f1",
    "reported_accuracy",
    "reported_balanced_accuracy",
    "reported_auc",
    "personal_macro_f1",
    "personal_accuracy",
    "personal_balanced_accuracy",
    "personal_auc",
    "personal_val_macro_f1",
    "personal_val_score",
    "personal_loss",
    "personal_s",
    "dp_epsilon",
    "dp_steps",
    "dp_noise_multiplier",
    "dp_sample_rate",
    "lr",
    "neighbours",
    "neighbours_wanted",
    "stale_models",
    "steps",
    "timeouts",
    "secagg_dropped",
    "t",
)
POLL_INTERVAL_S = 0.5

Report = Callable[[str], None]


def stdout_line(line: str) -> None:
    """The default `Report`: one line on stdout, flushed."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@dataclass
class RunOutcome:
    """What one federation run produced (rows: one per node per round)."""

    mode: str
    rows: list[dict[str, Any]]
    wall_s: float
    peak_rss_mb: dict[str, float]
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False
    traffic_source: str = "metrics"
    dashboards: dict[str, str] = field(default_factory=dict)
    failure: tuple[str, str] | None = None  # (node, one-line error): the run was ended at once


def _finite(value: Any) -> Any:
    """NaN/inf (a loss with no step) become None so results.json stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def bench_row(record: dict[str, Any], spec: RunSpec) -> dict[str, Any]:
    """One results.json row from one metrics record of a node."""
    row = {key: _finite(record.get(key)) for key in ROW_KEYS}
    row.update({key: _finite(record[key]) for key in EXTRA_ROW_KEYS if key in record})
    row["heuristic"] = spec.heuristic
    row["fraction"] = spec.fraction
    return row
