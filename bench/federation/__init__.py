"""The N-node federation benchmark as a library, and its command line.

- specs.py: RunSpec (what one run is), the site names, the site.yaml sections
  the nodes and the baselines share, the partition of the data set;
- outcome.py: RunOutcome and its rows (one per node per round), the progress
  `Report` callback;
- processes.py: real `p2pfl-node` processes on loopback, followed on /status;
- inmemory.py: every node in this process over the in-memory network;
- baselines.py: standalone and centralized baselines on the same partition;
- stats.py: the figures of the summary (and what each one means);
- report.py: the plots;
- benchmark.py: run_benchmark, the whole benchmark, writing results.json;
- cli.py and __main__.py: `python -m bench.federation`.
"""

from bench.federation.benchmark import BenchmarkResult, run_benchmark
from bench.federation.outcome import ROW_KEYS, Report, RunOutcome, stdout_line
from bench.federation.processes import read_metrics
from bench.federation.specs import (
    RunSpec,
    node_overrides,
    partition,
    protocol_section,
    site_names,
    spec_from_options,
)
from bench.federation.stats import mean_by_round

__all__ = [
    "ROW_KEYS",
    "BenchmarkResult",
    "Report",
    "RunOutcome",
    "RunSpec",
    "mean_by_round",
    "node_overrides",
    "partition",
    "protocol_section",
    "read_metrics",
    "run_benchmark",
    "site_names",
    "spec_from_options",
    "stdout_line",
]
