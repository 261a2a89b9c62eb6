"""The compute limit of a federation's round, measured in the same run.

A round cannot take less than the local training it holds: one epoch over
every site's data, spread over the machine's cores. `epoch_seconds` times
exactly that, in this process with one torch thread (as each node trains),
with the nodes' model, batch size, augmentation and optimizer: every site's
`train_epochs()`, the median of TIMED_EPOCHS timings, summed (the first epoch
of each site is a warm-up and is not counted; one timing alone moved the same
seed's sum from 1.51 to 1.96 s between two runs). The summary then gives

    compute_limit_s = epoch_s / cores
    compute_limit_ratio = round_s_mean / compute_limit_s

1.0 means the federation's rounds run at the speed of the hardware; what is
above it is exchange, aggregation, evaluation, waiting on the slowest site and
contention (5 processes on 2 cores).

Each node trains on one thread, so a site holding most of the data cannot
spread its epoch over the cores: its epoch alone (`largest_site_epoch_s`) is a
floor too, and the critical path of a round is the larger of the two:

    critical_path_s = max(epoch_s / cores, largest_site_epoch_s)
    critical_path_ratio = round_s_mean / critical_path_s
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.federation.specs import RunSpec, in_process_configs, one_torch_thread
from node.resources import available_cores
from protocols.site import build_site

TIMED_EPOCHS = 3


def epoch_seconds(spec: RunSpec, sources: Sequence[Path], state_root: Path) -> list[float]:
    """Each site's local epoch (or round of steps), one thread, the median of
    TIMED_EPOCHS timings: their sum is one epoch over every site's data."""
    one_torch_thread()
    seconds = []
    for cfg in in_process_configs(spec, sources, state_root):
        site = build_site(cfg)
        site.train_epochs()  # warm-up: first-call costs are not a round's
        timings = []
        for _ in range(TIMED_EPOCHS):
            start = time.perf_counter()
            site.train_epochs()
            timings.append(time.perf_counter() - start)
        seconds.append(statistics.median(timings))
    return seconds


def _ratio(numerator: float | None, denominator: float) -> float | None:
    return None if not numerator or denominator <= 0 else round(numerator / denominator, 4)


def limit_figures(
    summary: dict[str, Any], site_epochs: Sequence[float], cores: int | None = None
) -> dict[str, Any]:
    """epoch_s, cores, compute_limit_s/_ratio and critical_path_s/_ratio for a summary."""
    cores = available_cores() if cores is None else cores
    epoch_s = round(sum(site_epochs), 4)  # the ratios are computed from the figures reported
    largest = round(max(site_epochs, default=0.0), 4)
    limit = epoch_s / cores
    critical = max(limit, largest)
    round_s = summary.get("round_s_mean")
    return {
        "epoch_s": epoch_s,
        "cores": cores,
        "compute_limit_s": round(limit, 6),
        "compute_limit_ratio": _ratio(round_s, limit),
        "largest_site_epoch_s": largest,
        "critical_path_s": round(critical, 6),
        "critical_path_ratio": _ratio(round_s, critical),
    }
