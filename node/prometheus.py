"""/metrics through prometheus-client: the families a node exposes are built
from one snapshot of its telemetry per scrape and rendered by the client
library (HELP and TYPE lines, label escaping, NaN/±Inf), in the text format
0.0.4 that every Prometheus version reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import CollectorRegistry

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

Samples = Iterable[tuple[dict[str, str], float]]


class Exposition:
    """One scrape: families added in order, each sample labelled with the
    common labels (the node's name) and its own, then `render()`."""

    def __init__(self, common_labels: dict[str, str]) -> None:
        self._common = common_labels
        self._families: list[Metric] = []

    def _add(
        self,
        family: type[GaugeMetricFamily] | type[CounterMetricFamily],
        name: str,
        help_text: str,
        label_names: list[str],
        samples: Samples,
    ) -> None:
        names = [*self._common, *label_names]
        metric = family(name, help_text, labels=names)
        for labels, value in samples:
            merged = {**self._common, **labels}
            metric.add_metric([merged[n] for n in names], float(value))
        self._families.append(metric)

    def gauge(self, name: str, help_text: str, label_names: list[str], samples: Samples) -> None:
        self._add(GaugeMetricFamily, name, help_text, label_names, samples)

    def counter(self, name: str, help_text: str, label_names: list[str], samples: Samples) -> None:
        """`name` ends in _total, as its samples do (the client keeps it)."""
        self._add(CounterMetricFamily, name, help_text, label_names, samples)

    def collect(self) -> Iterator[Metric]:
        yield from self._families

    def render(self) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry).decode("utf-8")
