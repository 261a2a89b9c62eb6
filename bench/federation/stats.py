"""The figures of results.json's `summary`, from a run's rows and the baselines.

Figures (keys of `summary`):
- macro_f1_mean_first / _final: test macro-F1 (each node on its own test
  split: its share with `--test-split local`, the common test set with
  `global`), mean over the nodes, at the first round and at each node's last
  logged round; macro_f1_mean_last3: the mean of the last three rounds' means
  (one round can swing by several points);
- best_macro_f1_mean_final: the same for the node's federated model that is
  best so far on its own validation split (p2pfl.learning.best: the latest
  where that split holds one class), at each
  node's last logged round; best_macro_f1_min_final its lowest node;
- reported_macro_f1_mean_final / _min_final: the model each node reports,
  its personal or its federated model as its validation split chose (None
  without personalization); personal_macro_f1_mean_final / _min_final: the
  personal model's; gain_over_standalone_reported: reported (else best) minus
  standalone's best;
- site_gain: the per-site gain table's figures (site_gain_table below; the
  rows are in results.json's `site_gains`);
- standalone_macro_f1_mean, centralized_macro_f1, pooled_macro_f1: the same
  figure for the baselines at their last round (centralized: the global model
  evaluated on each site's test split, mean over sites; with `--test-split
  global` that is one figure, the common test set; pooled: one model trained
  on all sites' data); gain_over_standalone = final - standalone,
  gap_to_centralized = centralized - final, gap_to_pooled = pooled - final
  (positive: below it); the same with best_ / _best for the reported (best
  on validation) models of the nodes and of each baseline;
  for fedsgdp2p also centralized_fedsgd_macro_f1 (_last3) and
  gap_to_centralized_fedsgd, its own centralized counterpart;
- non_training_share = 1 - sum(train_s) / sum(round_s) over every logged
  round of every node: the share of a round's wall time a node spends outside
  local training (waiting for and pulling neighbours' models, aggregation,
  evaluation, gossip). round_s runs from the start of the round's training to
  the metrics line (the checkpoint written after it is not in it;
  non_training_share_wall, from the wall-clock gaps between a node's metrics
  lines, counts it). exchange_share and aggregate_share split out the first
  two parts;
- messages_sent_total / bytes_sent_total: protocol traffic (requests,
  responses and pushes; heartbeats are not counted) of all nodes over the run;
- rounds_to_threshold: first round whose mean macro-F1 over the nodes reaches
  --threshold (DFU Table 2), messages_to_threshold: messages all nodes had sent
  by then (DFU Fig. 7);
- epoch_s, cores, compute_limit_s, compute_limit_ratio: one epoch over every
  site's data on one thread, timed in the same run, over the cores, and the
  mean round time over that limit; largest_site_epoch_s, critical_path_s,
  critical_path_ratio: the same against the larger of that and the largest
  site's epoch, which one thread cannot spread (bench/federation/limit.py);
  round_s is a round's wall time without the end-of-run personalization
  (fine-tuning and the validation choice, once per run), which is
  personalize_s_mean;
- wall_s, peak_rss_mb (per node for processes, polled with psutil; with
  --in-memory, the peak of this whole process so far (getrusage), read before
  the baselines run).
With several (heuristic, c) runs, `summary.grid` holds each run's figures;
macro_f1_mean_first/_final are then the lowest over the runs, and
non_training_share and the traffic totals pool every run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bench.federation.baselines import baseline_by_round
from bench.federation.outcome import RunOutcome
from bench.federation.specs import RunSpec, site_names
from protocols.memory.results import mean_by_round


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def per_node_final(rows: Sequence[dict[str, Any]], key: str = "macro_f1") -> dict[str, float]:
    last: dict[str, tuple[int, float]] = {}
    for r in rows:
        if r.get(key) is not None and r["round"] >= last.get(r["node"], (-1, 0.0))[0]:
            last[r["node"]] = (r["round"], float(r[key]))
    return {node: value for node, (_, value) in sorted(last.items())}


def traffic_totals(rows: Sequence[dict[str, Any]]) -> tuple[int | None, int | None]:
    """Sum over nodes of each node's last cumulative (messages, bytes)."""
    messages, nbytes = per_node_final(rows, "messages_sent"), per_node_final(rows, "bytes_sent")
    if not messages:
        return None, None
    return int(sum(messages.values())), int(sum(nbytes.values()))


def time_shares(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Where a round's time goes, pooled over every row (see the module doc)."""
    total = sum(float(r.get("round_s") or 0.0) for r in rows)
    train = sum(float(r.get("train_s") or 0.0) for r in rows)
    shares = {
        "non_training_share": None if total <= 0 else 1.0 - train / total,
        "exchange_share": _share(sum(float(r.get("exchange_s") or 0.0) for r in rows), total),
        "aggregate_share": _share(sum(float(r.get("aggregate_s") or 0.0) for r in rows), total),
        "non_training_share_wall": wall_non_training_share(rows),
    }
    return {k: None if v is None else round(v, 4) for k, v in shares.items()}


def wall_non_training_share(rows: Sequence[dict[str, Any]]) -> float | None:
    """1 - train_s / (time between a node's consecutive metrics lines), rounds
    2.. only: unlike round_s this also counts what happens after the metrics
    line (the checkpoint). Needs the lines' wall-clock `t` (real processes)."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("t") is not None:
            by_node.setdefault(r["node"], []).append(r)
    train = wall = 0.0
    for node_rows in by_node.values():
        node_rows.sort(key=lambda r: r["round"])
        for before, after in zip(node_rows, node_rows[1:], strict=False):
            if after["round"] == before["round"] + 1 and after.get("train_s") is not None:
                train += float(after["train_s"])
                wall += float(after["t"]) - float(before["t"])
    return None if wall <= 0 else 1.0 - train / wall


def summarize_run(spec: RunSpec, outcome: RunOutcome, threshold: float) -> dict[str, Any]:
    rows = outcome.rows
    by_round = mean_by_round(rows)
    final = per_node_final(rows)
    best = per_node_final(rows, "best_macro_f1")
    first_round = min(by_round, default=None)
    first = [
        float(r["macro_f1"])
        for r in rows
        if r["round"] == first_round and r.get("macro_f1") is not None
    ]
    messages, nbytes = traffic_totals(rows)
    reached = next((r for r, v in by_round.items() if v >= threshold), None)
    messages_to_threshold = None
    if reached is not None and messages is not None:
        messages_to_threshold = sum(
            int(r["messages_sent"])
            for r in rows
            if r["round"] == reached and r.get("messages_sent") is not None
        )
    completed = {name: 0 for name in site_names(spec.nodes)}
    for r in rows:
        completed[r["node"]] = max(completed.get(r["node"], 0), r["round"])
    round_s = [float(r["round_s"]) for r in rows if r.get("round_s") is not None]
    train_s = [float(r["train_s"]) for r in rows if r.get("train_s") is not None]
    # the end-of-run personalization (protocols/rounds.py), out of round_s since 2026-11-26
    personalize_s = [float(r["personalize_s"]) for r in rows if r.get("personalize_s") is not None]
    rounds_done = min(completed.values(), default=0)
    return {
        "protocol": spec.protocol,
        "heuristic": spec.heuristic,
        "fraction": spec.fraction,
        "nodes": spec.nodes,
        "rounds": spec.rounds,
        "rounds_completed_min": rounds_done,
        "mode": outcome.mode,
        "macro_f1_mean_first": _round(_mean(first)),
        "macro_f1_mean_final": _round(_mean(list(final.values()))),
        "macro_f1_mean_last3": _round(mean_of_last(by_round)),
        "macro_f1_min_final": _round(min(final.values(), default=None)),
        "macro_f1_max_final": _round(max(final.values(), default=None)),
        "best_macro_f1_mean_final": _round(_mean(list(best.values()))),
        "best_macro_f1_min_final": _round(min(best.values(), default=None)),
        **final_figures(rows, "reported_macro_f1"),
        **final_figures(rows, "personal_macro_f1"),
        **time_shares(rows),
        "train_s_mean": _round(_mean(train_s), 3),
        "round_s_mean": _round(_mean(round_s), 3),
        "personalize_s_mean": _round(_mean(personalize_s), 3),
        "messages_sent_total": messages,
        "bytes_sent_total": nbytes,
        "messages_per_round": None
        if messages is None or not rounds_done
        else round(messages / rounds_done, 1),
        "traffic_source": outcome.traffic_source,
        "threshold": threshold,
        "rounds_to_threshold": reached,
        "messages_to_threshold": messages_to_threshold,
        "wall_s": round(outcome.wall_s, 2),
        "peak_rss_mb": outcome.peak_rss_mb,
        "peak_rss_mb_max": max(outcome.peak_rss_mb.values(), default=None),
        "timed_out": outcome.timed_out,
        "errors": outcome.errors,
    }


def final_figures(rows: Sequence[dict[str, Any]], key: str) -> dict[str, float | None]:
    """<key>_mean_final and <key>_min_final over the nodes' last logged values."""
    values = list(per_node_final(rows, key).values())
    return {
        f"{key}_mean_final": _round(_mean(values)),
        f"{key}_min_final": _round(min(values, default=None)),
    }


def mean_of_last(by_round: dict[int, float], k: int = 3) -> float | None:
    """Mean of the last k rounds' means: less at the mercy of one noisy round
    than the final value alone."""
    rounds = sorted(by_round)[-k:]
    return statistics.fmean(by_round[r] for r in rounds) if rounds else None


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def with_baselines(summary: dict[str, Any], baselines: dict[str, Any] | None) -> dict[str, Any]:
    alone = baselines["standalone"]["macro_f1_mean"] if baselines else None
    central = baselines["centralized"]["macro_f1"] if baselines else None
    final = summary.get("macro_f1_mean_final")
    best = summary.get("best_macro_f1_mean_final")
    last3: dict[str, float | None] = {"standalone": None, "centralized": None}
    for name in last3:
        if baselines:
            last3[name] = mean_of_last(baseline_by_round(baselines[name]))
    return {
        **summary,
        "standalone_macro_f1_mean": _round(alone),
        "centralized_macro_f1": _round(central),
        "standalone_macro_f1_mean_last3": _round(last3["standalone"]),
        "centralized_macro_f1_last3": _round(last3["centralized"]),
        "gain_over_standalone": None if alone is None or final is None else round(final - alone, 4),
        "gap_to_centralized": None
        if central is None or final is None
        else round(central - final, 4),
        **reported_figures(baselines, final, best, summary.get("reported_macro_f1_mean_final")),
        **fedsgd_figures(baselines, final),
    }


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 4)


def reported_figures(
    baselines: dict[str, Any] | None,
    final: float | None,
    best: float | None,
    summary_reported: float | None = None,
) -> dict[str, Any]:
    """The pooled baseline, and every comparison again with the models the nodes
    and the baselines report (their best on validation); gain_over_standalone_reported
    compares the model each node reports (personal or federated, chosen on
    validation: `summary_reported`; else its best federated one) with the
    sites alone."""
    if not baselines:
        return {}
    alone_best = baselines["standalone"].get("best_macro_f1")
    central_best = baselines["centralized"].get("best_macro_f1")
    union = baselines.get("pooled") or {}
    return {
        "pooled_macro_f1": _round(union.get("macro_f1")),
        "gap_to_pooled": _difference(union.get("macro_f1"), final),
        "standalone_best_macro_f1_mean": _round(alone_best),
        "centralized_best_macro_f1": _round(central_best),
        "pooled_best_macro_f1": _round(union.get("best_macro_f1")),
        "gain_over_standalone_best": _difference(best, alone_best),
        "gain_over_standalone_reported": _difference(
            summary_reported if summary_reported is not None else best, alone_best
        ),
        "gap_to_centralized_best": _difference(central_best, best),
        "gap_to_pooled_best": _difference(union.get("best_macro_f1"), best),
    }


def fedsgd_figures(baselines: dict[str, Any] | None, final: float | None) -> dict[str, Any]:
    """The centralized FedSGD keys of the summary, when that baseline ran."""
    if not baselines or "centralized_fedsgd" not in baselines:
        return {}
    sgd = baselines["centralized_fedsgd"]
    return {
        "centralized_fedsgd_macro_f1": _round(sgd["macro_f1"]),
        "centralized_fedsgd_macro_f1_last3": _round(mean_of_last(baseline_by_round(sgd))),
        "gap_to_centralized_fedsgd": None
        if final is None or sgd["macro_f1"] is None
        else round(sgd["macro_f1"] - final, 4),
    }


def grid_summary(
    base: RunSpec,
    outcomes: Sequence[RunOutcome],
    summaries: Sequence[dict[str, Any]],
    reference: dict[str, Any] | None,
) -> dict[str, Any]:
    """Several runs: the lowest macro-F1 over the runs, traffic and time shares pooled."""
    all_rows = [row for o in outcomes for row in o.rows]
    finals = [m["macro_f1_mean_final"] for m in summaries if m["macro_f1_mean_final"] is not None]
    firsts = [m["macro_f1_mean_first"] for m in summaries if m["macro_f1_mean_first"] is not None]
    messages = [m["messages_sent_total"] for m in summaries if m["messages_sent_total"] is not None]
    nbytes = [m["bytes_sent_total"] for m in summaries if m["bytes_sent_total"] is not None]
    keep = (
        "heuristic",
        "fraction",
        "round_s_mean",
        "compute_limit_ratio",
        "critical_path_ratio",
        "macro_f1_mean_first",
        "macro_f1_mean_final",
        "macro_f1_mean_last3",
        "non_training_share",
        "non_training_share_wall",
        "exchange_share",
        "messages_sent_total",
        "bytes_sent_total",
        "rounds_to_threshold",
        "messages_to_threshold",
        "wall_s",
        "peak_rss_mb_max",
        "rounds_completed_min",
        "errors",
    )
    summary = {
        "protocol": base.protocol,
        "nodes": base.nodes,
        "rounds": base.rounds,
        "mode": summaries[0]["mode"],
        "macro_f1_mean_first": min(firsts, default=None),
        "macro_f1_mean_final": min(finals, default=None),
        **time_shares(all_rows),
        "messages_sent_total": sum(messages) if messages else None,
        "bytes_sent_total": sum(nbytes) if nbytes else None,
        "threshold": summaries[0]["threshold"],
        "grid": [{k: m.get(k) for k in keep} for m in summaries],  # None: not measured
    }
    out = with_baselines(summary, reference)
    for cell in out["grid"]:
        cell.update(
            {
                k: v
                for k, v in with_baselines(cell, reference).items()
                if k in ("gain_over_standalone", "gap_to_centralized")
            }
        )
    return out


# ---------------------------------------------------------------- per-site gain

SITE_METRICS = ("macro_f1", "balanced_accuracy", "auc")
GAIN_TOLERANCE = 0.02  # issue 30: "not worse than standalone by more than 2 points"


def last_records(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """node -> its row of the last round it logged."""
    last: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["round"] >= last.get(r["node"], {"round": -1})["round"]:
            last[r["node"]] = r
    return last


def reported_model(record: dict[str, Any]) -> tuple[str, dict[str, float | None]]:
    """(which model, its test figures) a node reports, from its last metrics
    line: `reported_*` where the node chose between its personal and its
    federated model on its validation split (`reported_personal` 1 or 0, or
    `reported`, names the choice),
    else `best_*` (the best model on validation so far), else the latest
    model's figures."""
    chosen = record.get("reported") or "reported"
    if record.get("reported_personal") is not None:  # a metrics line holds numbers only
        chosen = "personal" if float(record["reported_personal"]) else "federated"
        if chosen == "personal" and _number(record.get("personal_trained_alone")) == 1.0:
            chosen = "alone"  # the personal model is the one the site trained alone
    for prefix, name in (("reported_", chosen), ("best_", "best")):
        if record.get(f"{prefix}macro_f1") is not None:
            return str(name), {k: _number(record.get(prefix + k)) for k in SITE_METRICS}
    if record.get("macro_f1") is None:
        return "none", dict.fromkeys(SITE_METRICS)
    return "latest", {k: _number(record.get(k)) for k in SITE_METRICS}


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def site_gain_table(
    names: Sequence[str],
    federation: dict[str, dict[str, Any]],
    standalone: dict[str, dict[str, Any]],
    partition: dict[str, Any],
) -> dict[str, Any]:
    """Did each site gain from joining? One row per site: its train size and
    skew (majority-class share), its test split per class and whether that
    meets partition.json's minimum, the figures of the model it reports
    (`reported_model` of `federation[name]`, its last metrics line; and, as
    personal_* and federated_*, both models of a node that personalizes) and of the
    same site alone (`standalone[name]`: the standalone baseline's last record,
    its reported model, the best on validation), and reported minus standalone.
    The summary figures (`gain_summary`) are computed over every site and again
    without the sites whose test split is under the minimum."""
    per_site = {f"site_{row['site']}": row for row in partition["per_site"]}
    rows: list[dict[str, Any]] = []
    for name in names:
        part = per_site.get(name, {})
        train = [int(n) for n in part.get("train", [])]
        test = [int(n) for n in part.get("test", [])]
        record = federation.get(name, {})
        model, fed = reported_model(record)
        _, alone = reported_model(standalone.get(name, {}))
        row: dict[str, Any] = {
            "node": name,
            "train_size": int(part.get("labelled", sum(train))),
            "majority_share": _round(max(train) / sum(train)) if sum(train) else None,
            "classes": sum(1 for n in train if n),
            "test_size": sum(test),
            "test_per_class": test,
            "below_test_minimum": bool(part.get("test_short_classes")),
            "test_short_classes": part.get("test_short_classes", {}),
            "reported_model": model,
        }
        for key in SITE_METRICS:
            row[key] = _round(fed[key])
            row[f"standalone_{key}"] = _round(alone[key])
            row[f"gain_{key}"] = _difference(fed[key], alone[key])
        for key in SITE_METRICS:  # both of a personalizing node's models, when it logs them
            row[f"personal_{key}"] = _round(_number(record.get(f"personal_{key}")))
            federated = record.get(f"best_{key}", record.get(key))
            row[f"federated_{key}"] = _round(_number(federated))
        rows.append(row)
    return {
        "min_test_per_class": partition.get("min_test_per_class"),
        "sites": rows,
        **gain_summary(rows),
    }


def gain_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over the sites with both figures: how many gained (reported macro-F1
    above standalone's), the share that is not worse by more than
    GAIN_TOLERANCE, and the mean gain per metric; `*_without_apart` the same
    without the sites under the test minimum (listed in `sites_apart`), and
    how many sites report the model they trained alone (`sites_reporting_alone`)."""
    apart = [r["node"] for r in rows if r["below_test_minimum"]]
    out: dict[str, Any] = {"sites_apart": apart}
    kept = [r for r in rows if not r["below_test_minimum"]]
    for suffix, subset in (("", rows), ("_without_apart", kept)):
        gains = [r["gain_macro_f1"] for r in subset if r["gain_macro_f1"] is not None]
        out[f"sites_compared{suffix}"] = len(gains)
        out[f"sites_gained{suffix}"] = sum(1 for g in gains if g > 0)
        # a site that reports the model it trained alone gains nothing from the
        # federation, whatever its figure: counted, so no share hides it
        out[f"sites_reporting_alone{suffix}"] = sum(
            1 for r in subset if r.get("reported_model") == "alone"
        )
        out[f"share_gained{suffix}"] = _round(_share(sum(1 for g in gains if g > 0), len(gains)))
        out[f"share_within_tolerance{suffix}"] = _round(
            _share(sum(1 for g in gains if g >= -GAIN_TOLERANCE), len(gains))
        )
        for key in SITE_METRICS:
            values = [r[f"gain_{key}"] for r in subset if r[f"gain_{key}"] is not None]
            out[f"mean_gain_{key}{suffix}"] = _round(_mean(values))
    out["tolerance"] = GAIN_TOLERANCE
    return out


def add_global_test(
    table: dict[str, Any], nodes: dict[str, Any] | None, reference: dict[str, Any]
) -> None:
    """Add the global test set's figures to a gain table (in place): per site
    `global_<metric>` of the node's model and `standalone_global_<metric>` of
    the site alone, `gain_global_macro_f1`; in the summary the global test's
    size, pooled training's macro-F1 there, and the mean gain and sites gained
    (`global_missing` says why the nodes' figures are absent)."""
    models = (nodes or {}).get("models") or {}
    alone = reference.get("standalone") or {}
    for row in table["sites"]:
        mine, theirs = models.get(row["node"]) or {}, alone.get(row["node"]) or {}
        for key in SITE_METRICS:
            row[f"global_{key}"] = mine.get(key)
            row[f"standalone_global_{key}"] = theirs.get(key)
        row["gain_global_macro_f1"] = _difference(
            row["global_macro_f1"], row["standalone_global_macro_f1"]
        )
    gains = [
        r["gain_global_macro_f1"] for r in table["sites"] if r["gain_global_macro_f1"] is not None
    ]
    table["global_test_n"] = reference.get("n")
    table["global_pooled_macro_f1"] = (reference.get("pooled") or {}).get("macro_f1")
    table["global_macro_f1_mean"] = _round(
        _mean([r["global_macro_f1"] for r in table["sites"] if r["global_macro_f1"] is not None])
    )
    table["global_standalone_macro_f1_mean"] = reference.get("standalone_macro_f1_mean")
    table["global_mean_gain_macro_f1"] = _round(_mean(gains))
    table["global_sites_gained"] = sum(1 for g in gains if g > 0)
    table["global_sites_compared"] = len(gains)
    # The federated models (each node's best on validation, before any
    # personalization) on the global test set, against pooled training.
    federated = (nodes or {}).get("federated_models") or {}
    for row in table["sites"]:
        row["global_federated_macro_f1"] = (federated.get(row["node"]) or {}).get("macro_f1")
    values = [r["global_federated_macro_f1"] for r in table["sites"]]
    table["global_federated_macro_f1_mean"] = _round(_mean([v for v in values if v is not None]))
    table["global_federated_gap_to_pooled"] = _difference(
        table["global_pooled_macro_f1"], table["global_federated_macro_f1_mean"]
    )
    if not models:
        table["global_missing"] = (nodes or {}).get("missing", "no node model was scored")
