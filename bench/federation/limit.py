"""The compute limit of a federation's round, measured in the same run.

A round cannot take less than the local training it holds: one epoch over
every site's data, spread over the machine's cores. `epoch_seconds` times
exactly that, in this process with one torch thread (as each node trains),
with the nodes' model, batch size, augmentation and optimizer: every site's
`train_epochs()` once, summed (the first epoch of each site is a warm-up and
is not counted). The summary then gives

    compute_limit_s = epoch_s / cores
    compute_limit_ratio = round_s_mean / compute_limit_s

1.0 means the federation's rounds run at the speed of the hardware; what is
above it is exchange, aggregation, evaluation, waiting on the slowest site and
contention (5 processes on 2 cores).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.federation.specs import RunSpec, in_process_configs, one_torch_thread
from node.resources import available_cores
from protocols.site import build_site


def epoch_seconds(spec: RunSpec, sources: Sequence[Path], state_root: Path) -> float:
    """One local epoch (or round of steps) over every site's data, one thread."""
    one_torch_thread()
    total = 0.0
    for cfg in in_process_configs(spec, sources, state_root):
        site = build_site(cfg)
        site.train_epochs()  # warm-up: first-call costs are not a round's
        start = time.perf_counter()
        site.train_epochs()
        total += time.perf_counter() - start
    return total


def limit_figures(
    summary: dict[str, Any], epoch_s: float, cores: int | None = None
) -> dict[str, Any]:
    """epoch_s, cores, compute_limit_s and compute_limit_ratio for a summary."""
    cores = available_cores() if cores is None else cores
    epoch_s = round(epoch_s, 4)  # the ratio is computed from the figures reported
    limit = epoch_s / cores
    round_s = summary.get("round_s_mean")
    return {
        "epoch_s": epoch_s,
        "cores": cores,
        "compute_limit_s": round(limit, 4),
        "compute_limit_ratio": None if not round_s or limit <= 0 else round(round_s / limit, 4),
    }
