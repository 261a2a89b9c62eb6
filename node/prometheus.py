"""Prometheus text exposition (format 0.0.4), as /metrics serves it: each
family's HELP and TYPE lines, then its samples, with label values escaped and
non-finite values spelled as Prometheus spells them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def _prom_number(value: float) -> str:
    """A sample value as Prometheus text writes it (NaN, +Inf, -Inf, ints without .0)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _prom_label_value(value: str) -> str:
    # Exposition format 0.0.4: backslash, double quote and line feed are escaped.
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _prom_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


class ExpositionWriter:
    """Builds one exposition: each family's HELP and TYPE, then its samples."""

    def __init__(self, common_labels: dict[str, str]) -> None:
        self._common = common_labels
        self._lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float]],
    ) -> None:
        self._lines.append(f"# HELP {name} {_prom_help(help_text)}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            merged = {**self._common, **labels}
            label_text = ",".join(
                f'{key}="{_prom_label_value(val)}"' for key, val in merged.items()
            )
            self._lines.append(f"{name}{{{label_text}}} {_prom_number(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"
