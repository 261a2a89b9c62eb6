"""What a simulation measured: per node per round records, neighbour choices,
traffic and errors, with the summaries the benchmarks report (mean by round,
rounds to a threshold, messages until a round, who chose whom)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def mean_by_round(records: Sequence[dict[str, Any]], metric: str = "macro_f1") -> dict[int, float]:
    """round -> mean of `metric` over the records (nodes) that logged it that round."""
    by_round: dict[int, list[float]] = {}
    for r in records:
        if r.get(metric) is not None:
            by_round.setdefault(r["round"], []).append(float(r[metric]))
    return {k: statistics.fmean(v) for k, v in sorted(by_round.items())}


def first_round_reaching(by_round: dict[int, float], threshold: float) -> int | None:
    """The first round whose value reaches `threshold`, None if none does."""
    return next((r for r, value in by_round.items() if value >= threshold), None)


@dataclass
class SimulationResult:
    """What `simulate` measured. `records` holds one dict per node per round
    (node, round, macro_f1, accuracy, messages_sent, bytes_sent, train_s,
    round_s, ...; traffic figures are cumulative since the start)."""

    records: list[dict[str, Any]]
    choices: list[dict[str, Any]]
    traffic: dict[str, dict[str, Any]]
    errors: dict[str, str]
    wall_s: float

    def nodes(self) -> list[str]:
        return sorted(self.traffic)

    def first_failure(self) -> tuple[str, str] | None:
        """(node, one-line reason) of a node that failed, not one stopped or killed."""
        for name, error in sorted(self.errors.items()):
            if not error.startswith(("stopped:", "killed")):
                return name, error.splitlines()[0] if error else "failed"
        return None

    def first_error(self) -> str | None:
        """'node: reason' of a node that failed (see first_failure), or None."""
        failure = self.first_failure()
        return None if failure is None else f"{failure[0]}: {failure[1]}"

    def metric(self, name: str, node: str) -> dict[int, float]:
        """round -> value of one metric for one node (rounds that logged it)."""
        return {
            r["round"]: r[name]
            for r in self.records
            if r["node"] == node and r.get(name) is not None
        }

    def mean_by_round(self, name: str = "macro_f1") -> dict[int, float]:
        """round -> mean over the nodes that logged the metric that round."""
        return mean_by_round(self.records, name)

    def rounds_completed(self) -> dict[str, int]:
        done: dict[str, int] = dict.fromkeys(self.traffic, 0)
        for r in self.records:
            done[r["node"]] = max(done.get(r["node"], 0), r["round"])
        return done

    def messages_sent(self, kind: str | None = None) -> int:
        """Messages sent by all nodes, or only those of one kind ('model' = models sent)."""
        if kind is None:
            return sum(t["messages_sent"] for t in self.traffic.values())
        return sum(t["by_kind"].get(kind, {}).get("messages", 0) for t in self.traffic.values())

    def bytes_sent(self, kind: str | None = None) -> int:
        if kind is None:
            return sum(t["bytes_sent"] for t in self.traffic.values())
        return sum(t["by_kind"].get(kind, {}).get("bytes", 0) for t in self.traffic.values())

    def rounds_to_threshold(self, threshold: float, metric: str = "macro_f1") -> int | None:
        """First round whose mean over the nodes reaches `threshold` (DFU Table 2)."""
        return first_round_reaching(self.mean_by_round(metric), threshold)

    def messages_until(self, round_no: int, field: str = "messages_sent") -> int:
        """Messages (or bytes, field="bytes_sent") all nodes had sent when each
        logged `round` (DFU Fig. 7 counts them up to the threshold round)."""
        return sum(int(r[field]) for r in self.records if r["round"] == round_no and field in r)

    def choice_counts(self) -> dict[str, dict[str, int]]:
        """chooser -> chosen -> how many rounds (who-chose-whom)."""
        counts: dict[str, dict[str, int]] = {}
        for c in self.choices:
            row = counts.setdefault(c["node"], {})
            for peer in c["chosen"]:
                row[peer] = row.get(peer, 0) + 1
        return counts

    def as_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "choices": self.choices,
            "traffic": self.traffic,
            "errors": self.errors,
            "wall_s": self.wall_s,
        }
