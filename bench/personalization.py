"""Personalization methods compared in one run, on the same splits (issue 30).

    python -m bench.personalization --data digits|PATH.npz --nodes 5 --rounds 10 \\
        --partition dirichlet:0.5 --seed 0 --protocols fedavgp2p,fedsgdp2p --out DIR

The data set is partitioned once (bench.federation's `partition`); then, for
every protocol and every method, one federation runs in this process over the
in-memory network (the nodes' own protocol code), with the same partition
files, seed, rounds, steps and augmentation; only the training section's
method fields differ (`METHODS`):

- none: the federated model alone (personalization.method none);
- finetune: the default, the federated model fine-tuned on the site's train
  split after the last round (FedAvg + local fine-tuning);
- ditto: a personal model trained every round beside the federated one (Li et
  al. 2021);
- fedbn: method none, BatchNorm kept local through every merge (local_norm;
  Li et al. 2021); a protocol that merges no models refuses it, and its row is
  reported as not applicable with the node's own reason;
- label_skew: method none, balanced softmax with the site's class prior
  (training.logit_adjustment; Ren et al. 2020, as FedLC for label skew).

The standalone baseline (bench/baselines.py `standalone`: every site alone,
its best model on validation) runs once on the same partition. Every site's
figure is the model its node reports (p2pfl.learning.personal: chosen on
validation, never on test), scored on the site's own test split, and its gain
is that minus the same site alone (bench.federation.stats.site_gain_table).

Writes DIR/results.json and DIR/personalization_gain.png, prints one progress
line per round, the table (method x protocol: mean reported macro-F1, mean
balanced accuracy, mean gain over standalone, share of sites that gained,
lowest site gain), and one JSON object (the summary) as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.baselines import standalone
from bench.federation.baselines import per_site_last
from bench.federation.inmemory import run_in_memory
from bench.federation.outcome import Report, stdout_line
from bench.federation.specs import (
    RunSpec,
    in_process_configs,
    one_torch_thread,
    partition,
    site_names,
    spec_from_options,
)
from bench.federation.stats import last_records, site_gain_table
from p2pfl.config import protocol_names
from p2pfl.files import atomic_write_text
from p2pfl.learning.data.partition import PartitionError
from p2pfl.learning.data.sources import DataError

# method -> the training: fields it sets (everything else is the run's own)
METHODS: dict[str, dict[str, Any]] = {
    "none": {"personalization": {"method": "none"}},
    "finetune": {"personalization": {"method": "finetune"}},
    "ditto": {"personalization": {"method": "ditto"}},
    "fedbn": {"personalization": {"method": "none", "local_norm": True}},
    "label_skew": {"personalization": {"method": "none"}, "logit_adjustment": True},
}
DEFAULT_PROTOCOLS = ("fedavgp2p", "fedsgdp2p")
PLOT_NAME = "personalization_gain.png"


def refusal(errors: dict[str, str], training: dict[str, Any]) -> str | None:
    """The nodes' reason when they refused one of the fields the method sets
    (a ConfigError naming training.<field> at the start, e.g. local_norm in a
    protocol without an aggregate phase): the method does not apply there."""
    fields = [f"training.{key}" for key in training]
    for message in errors.values():
        if message.startswith("ConfigError:") and any(f in message for f in fields):
            return message.removeprefix("ConfigError:").strip()
    return None


def cell_summary(table: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row's figures from a site gain table (stats.site_gain_table)."""
    sites = table["sites"]
    gains = [s["gain_macro_f1"] for s in sites if s["gain_macro_f1"] is not None]
    personal = [
        r["reported_personal"] for r in last_records(rows).values() if "reported_personal" in r
    ]
    return {
        "macro_f1_mean": _mean([s["macro_f1"] for s in sites]),
        "balanced_accuracy_mean": _mean([s["balanced_accuracy"] for s in sites]),
        "auc_mean": _mean([s["auc"] for s in sites]),
        "mean_gain_macro_f1": table["mean_gain_macro_f1"],
        "share_gained": table["share_gained"],
        "sites_gained": table["sites_gained"],
        "sites_compared": table["sites_compared"],
        "min_gain_macro_f1": round(min(gains), 4) if gains else None,
        "share_within_tolerance": table["share_within_tolerance"],
        "mean_gain_macro_f1_without_apart": table["mean_gain_macro_f1_without_apart"],
        "sites_apart": table["sites_apart"],
        "sites_reporting_personal": int(sum(personal)),
    }


def _mean(values: Sequence[float | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return round(statistics.fmean(present), 4) if present else None


def run_personalization(
    base: RunSpec,
    protocols: Sequence[str],
    methods: Sequence[str],
    out: Path,
    *,
    report: Report = stdout_line,
) -> dict[str, Any]:
    """Partition once, the standalone baseline once, then every (protocol,
    method) federation; write results.json and the plot; return results."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    one_torch_thread()
    sources, split = partition(base, out / "data")
    report(
        f"partitioned {base.data} ({split['scheme']}, label skew {split['label_skew']:.3f}) "
        f"into {base.nodes} sites under {out / 'data'}"
    )
    names = site_names(base.nodes)
    report(f"standalone: every site alone, {base.rounds} rounds (in process)")
    alone_result = standalone(
        in_process_configs(base, sources, out / "standalone_state"), rounds=base.rounds
    )
    alone = per_site_last(alone_result.records)
    report(f"standalone: done in {alone_result.wall_s:.1f} s")
    cells: list[dict[str, Any]] = []
    for protocol in protocols:
        spec = replace(base, protocol=protocol, in_memory=True)
        for method in methods:
            report(
                f"--- {protocol} / {method}: {spec.nodes} nodes, {spec.rounds} rounds (in memory)"
            )
            t0 = time.perf_counter()
            outcome = run_in_memory(
                spec,
                sources,
                out / "fed" / protocol / method / "state",
                report=report,
                training=METHODS[method],
            )
            rows, errors, timed_out = outcome.rows, outcome.errors, outcome.timed_out
            cell: dict[str, Any] = {
                "protocol": protocol,
                "method": method,
                "training": METHODS[method],
                "wall_s": round(time.perf_counter() - t0, 2),
            }
            reason = refusal(errors, METHODS[method])
            if reason is not None:
                cell.update(status="not_applicable", reason=reason)
                report(f"--- {protocol} / {method}: not applicable: {reason}")
            elif errors or timed_out:
                why = (
                    "timed out" if timed_out else "; ".join(f"{n}: {e}" for n, e in errors.items())
                )
                cell.update(status="failed", reason=why, rounds=rows)
                report(f"--- {protocol} / {method}: FAILED: {why}")
            else:
                table = site_gain_table(names, last_records(rows), alone, split)
                cell.update(
                    status="ok", summary=cell_summary(table, rows), sites=table, rounds=rows
                )
                s = cell["summary"]
                report(
                    f"--- {protocol} / {method}: done in {cell['wall_s']:.1f} s, reported "
                    f"macro-F1 {_text(s['macro_f1_mean'])}, gain {_text(s['mean_gain_macro_f1'], '+')}"
                )
            cells.append(cell)
    plot = write_gain_plot(out / PLOT_NAME, cells, protocols, methods, names)
    standalone_figures = {
        "per_site": alone,
        "macro_f1_mean": _mean([s.get("best_macro_f1") for s in alone.values()]),
        "balanced_accuracy_mean": _mean([s.get("best_balanced_accuracy") for s in alone.values()]),
        "wall_s": round(alone_result.wall_s, 2),
    }
    summary = {
        "data": base.data,
        "nodes": base.nodes,
        "rounds": base.rounds,
        "partition": base.partition,
        "seed": base.seed,
        "protocols": list(protocols),
        "methods": list(methods),
        "standalone_macro_f1_mean": standalone_figures["macro_f1_mean"],
        "cells": {
            f"{c['protocol']}/{c['method']}": c.get("summary") or {c["status"]: c.get("reason")}
            for c in cells
        },
        "ok": all(c["status"] != "failed" for c in cells),
        "wall_s": round(time.perf_counter() - started, 1),
        "results": str(out / "results.json"),
    }
    results = {
        "config": {**asdict(base), "protocols": list(protocols), "methods": list(methods)},
        "partition": split,
        "standalone": standalone_figures,
        "cells": cells,
        "plots": {"gain": str(plot)},
        "summary": summary,
    }
    atomic_write_text(
        out / "results.json", json.dumps(results, indent=2, allow_nan=False, default=str)
    )
    return results


def _text(value: float | None, sign: str = "") -> str:
    return "-" if value is None else f"{value:{sign}.3f}"


def table_lines(results: dict[str, Any]) -> list[str]:
    """The readable table: one line per (method, protocol)."""
    head = (
        f"{'method':<11} {'protocol':<10} {'macro-F1':>8} {'bal.acc':>7} {'gain':>7} "
        f"{'gained':>6} {'min gain':>8} {'personal':>8}"
    )
    alone = results["standalone"]
    lines = [
        "per-site reported model vs the same site alone (each site's own test split):",
        head,
        "-" * len(head),
        f"{'standalone':<11} {'-':<10} {_text(alone['macro_f1_mean']):>8} "
        f"{_text(alone['balanced_accuracy_mean']):>7}",
    ]
    for method in results["summary"]["methods"]:
        for cell in (c for c in results["cells"] if c["method"] == method):
            start = f"{method:<11} {cell['protocol']:<10} "
            if cell["status"] != "ok":
                label = "n/a" if cell["status"] == "not_applicable" else "FAILED"
                lines.append(f"{start}{label:>8}  {cell['reason']}")
                continue
            s = cell["summary"]
            gained = f"{s['sites_gained']}/{s['sites_compared']}"
            lines.append(
                f"{start}{_text(s['macro_f1_mean']):>8} {_text(s['balanced_accuracy_mean']):>7} "
                f"{_text(s['mean_gain_macro_f1'], '+'):>7} {gained:>6} "
                f"{_text(s['min_gain_macro_f1'], '+'):>8} "
                f"{str(s['sites_reporting_personal']) + '/' + str(s['sites_compared']):>8}"
            )
    apart = {
        n for c in results["cells"] if c["status"] == "ok" for n in c["summary"]["sites_apart"]
    }
    if apart:
        lines.append(
            f"sites under the per-class test minimum (their gains are noisy): {sorted(apart)}"
        )
    lines.append("personal: sites whose validation split chose the personal model")
    return lines


def write_gain_plot(
    path: Path,
    cells: Sequence[dict[str, Any]],
    protocols: Sequence[str],
    methods: Sequence[str],
    names: Sequence[str],
) -> Path:
    """Per-site gain in macro-F1 over the site alone: one panel per protocol,
    one group of bars per site, one bar per method (none where not applicable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(protocols), figsize=(5.5 * len(protocols), 4.0), sharey=True, squeeze=False
    )
    width = 0.8 / max(1, len(methods))
    for ax, protocol in zip(axes[0], protocols, strict=True):
        for k, method in enumerate(methods):
            cell = next(c for c in cells if c["protocol"] == protocol and c["method"] == method)
            if cell["status"] != "ok":  # a legend entry only, hatched
                ax.bar(
                    [0],
                    [0.0],
                    width=0,
                    color="white",
                    edgecolor=f"C{k}",
                    hatch="//",
                    label=f"{method}: {'n/a' if cell['status'] == 'not_applicable' else 'failed'}",
                )
                continue
            gains = {s["node"]: s["gain_macro_f1"] for s in cell["sites"]["sites"]}
            xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(names))]
            ys = [gains.get(n) if gains.get(n) is not None else math.nan for n in names]
            ax.bar(xs, ys, width=width, color=f"C{k}", label=method)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(names)), [n.removeprefix("site_") for n in names])
        ax.set_xlabel("site")
        ax.set_title(protocol)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    axes[0][0].set_ylabel("macro-F1 gain over the site alone")
    fig.suptitle("per-site gain of the reported model, by personalization method")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _names(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {unknown or text!r}: use a comma list of {', '.join(known)}"
            )
        return list(dict.fromkeys(names))

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.personalization", description=__doc__.splitlines()[0]
    )

    def spec_option(flag: str, field: str | None = None, **kwargs: Any) -> None:
        name = field or flag.removeprefix("--").replace("-", "_")
        parser.add_argument(flag, default=getattr(RunSpec, name), **kwargs)

    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument(
        "--protocols",
        type=_names(protocol_names(), "protocol(s)"),
        default=list(DEFAULT_PROTOCOLS),
        help="comma list (default fedavgp2p,fedsgdp2p)",
    )
    parser.add_argument(
        "--methods",
        type=_names(list(METHODS), "method(s)"),
        default=list(METHODS),
        help=f"comma list (default all: {','.join(METHODS)})",
    )
    spec_option("--rounds", type=int)
    spec_option("--data", help="'digits' (embedded), a MedMNIST-style .npz or an ImageFolder")
    spec_option("--partition", help="iid, dirichlet:ALPHA, shards:K or quantity:ALPHA")
    spec_option("--test-split", choices=("local", "global"))
    spec_option("--min-test-per-class", type=int)
    spec_option("--seed", type=int)
    spec_option("--epochs", type=int)
    spec_option("--batch-size", type=int)
    spec_option("--lr", type=float)
    spec_option("--model")
    spec_option("--image-size", type=int)
    spec_option("--augment", choices=("none", "weak", "strong"))
    spec_option("--max-steps-per-epoch", type=int)
    spec_option("--steps-per-round", type=int)
    spec_option("--timeout", "timeout_s", type=float, help="bound of each federation run (s)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--verbose", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # a node's refusal is reported in the table, not as a traceback
        logging.getLogger("protocols.memory.simulate").setLevel(logging.CRITICAL)
    if args.nodes < 2:
        sys.stderr.write(f"bench.personalization: --nodes must be at least 2, got {args.nodes}\n")
        return 2
    base = spec_from_options(args, timeout_s=args.timeout, in_memory=True)
    try:
        results = run_personalization(base, args.protocols, args.methods, args.out)
    except (PartitionError, DataError) as exc:  # refused before any node starts
        sys.stderr.write(f"bench.personalization: {exc}\n")
        return 2
    for line in table_lines(results):
        stdout_line(line)
    stdout_line(f"plot: {results['plots']['gain']}")
    stdout_line(f"results: {results['summary']['results']}")
    stdout_line(json.dumps(results["summary"], allow_nan=False, default=str))
    return 0 if results["summary"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
