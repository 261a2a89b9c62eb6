"""Bandwidth benchmark (issue 32, item 4): FedAVGP2P over links of 20 Mbit/s
per site, for every `protocol.compression` with and without secure
aggregation, in one run.

    python -m bench.bandwidth --data ../shared/data/pneumoniamnist.npz --out runs/i32/bandwidth
    python -m bench.bandwidth --data digits --nodes 2 --rounds 1 --seeds 0 \\
        --models small_cnn --formats none,int8 --secure off --out /tmp/bw   # a smoke run

Real `p2pfl-node` processes on loopback (bench.federation.processes), so the
bytes are the nodes' own counters and the link is in their transport. Every
site's uplink is shaped to `--link-mbit` (20) by `transport.link_mbit`, a token
bucket on the bytes the node sends, requests and replies (node/link.py). That
is an emulation: the real thing is a network namespace per site with `tc
qdisc tbf`, which needs the relay work and root; it is not available to
these processes yet. The downlink is not shaped, and framing bytes and
propagation delay are not emulated.

Models: `small_cnn`, the reference job (bench.federation's defaults: one
epoch per round, weak augmentation, each site's own test split), and
`resnet18` (45 MB of float32), run short: `--resnet18-rounds` (3) rounds of
`--resnet18-steps` (10) local steps, over `--resnet18-seeds` (the first seed
by default): a CPU-only machine trains it slowly, and what it measures is the
exchange. Every arm encrypts the wire (secure aggregation requires it), so
that the secure flag is the only difference between a pair.

Arms: model x format (`--formats`, none, fp16, int8, topk:0.1) x secure
aggregation (`--secure`, off and on). Each arm's site.yaml goes through the
real `p2pfl-node check` first; an arm it refuses is not run and is listed
with the refusal's first line (`refused`). Per seed the data is partitioned
once; the arms run one after the other, in reverse order for odd seeds.

Reported per arm and seed (results.json), and as means over seeds:
- bytes per round: each node's protocol bytes sent (metrics.jsonl
  `bytes_sent`, heartbeats left out, requests and replies) at its last round,
  over that round; per site (mean over nodes) and for the federation (sum);
- round time: `round_s` of every node and round, mean; exchange time beside
  it; and the mean over the rounds before the last (`round_s_before_last`).
  Personalization's fine-tuning after the last round is not in `round_s`
  (the node logs it apart as `personalize_s`), so the two agree but for
  noise;
- final macro-F1: each node's last evaluated round, mean over nodes;
- link floor: a site's bytes per round over the link rate, the least time its
  uplink needs per round (a check that the link was in the way).
The last stdout line is one JSON object with the ratios the issue's
acceptance asks for (`ratios`, `targets`), each a mean over seeds of the
per-seed ratio; plots in OUT/bandwidth.png and OUT/f1_per_seed.png.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bandwidth_report import (
    TARGETS,
    acceptance,
    mean,
    model_summary,
    plot,
    ratio,
    rounded,
    run_figures,
)
from bench.federation.outcome import stdout_line
from bench.federation.processes import run_processes
from bench.federation.specs import (
    RunSpec,
    node_overrides,
    partition,
    protocol_section,
    site_names,
)
from bench.plots import final_per_seed
from node.provision import provision
from p2pfl.files import atomic_write_text

# mean, ratio and rounded stay importable from here (bench.heterogeneous and
# bench.network use them); TARGETS is the acceptance this benchmark reports.
__all__ = [
    "TARGETS",
    "Arm",
    "arm_spec",
    "check_refusal",
    "main",
    "mean",
    "parse_args",
    "ratio",
    "rounded",
    "seed_list",
]

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared/data/pneumoniamnist.npz"
FORMATS = ("none", "fp16", "int8", "topk:0.1")
MODELS = ("small_cnn", "resnet18")


@dataclass(frozen=True)
class Arm:
    """One federation of the grid: a model, a compression, secure aggregation on or off."""

    model: str
    compression: str
    secure: bool

    @property
    def label(self) -> str:
        return f"{self.compression}{'+secagg' if self.secure else ''}"

    @property
    def slug(self) -> str:
        return f"{self.model}_{self.compression.replace(':', '')}_{'secure' if self.secure else 'plain'}"


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def seed_list(text: str) -> list[int]:
    try:
        return [int(x) for x in csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of integers, got {text!r}"
        ) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.bandwidth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", default=str(DEFAULT_DATA), help="'digits' or a MedMNIST .npz")
    p.add_argument("--out", type=Path, default=Path("runs/bandwidth"))
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=10, help="rounds of the reference job")
    p.add_argument("--seeds", type=seed_list, default=[0, 1, 2])
    p.add_argument("--models", type=csv, default=list(MODELS), help="comma list of model names")
    p.add_argument("--formats", type=csv, default=list(FORMATS), help="comma list")
    p.add_argument(
        "--secure",
        type=csv,
        default=["off", "on"],
        help="secure aggregation arms: off, on or off,on (default)",
    )
    p.add_argument(
        "--link-mbit", type=float, default=20.0, help="every site's uplink; 0: unshaped loopback"
    )
    p.add_argument("--partition", default="dirichlet:0.5")
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--steps-per-round", type=int, default=None, help="small CNN: default one epoch")
    p.add_argument("--resnet18-rounds", type=int, default=3)
    p.add_argument("--resnet18-steps", type=int, default=10, help="local steps per round")
    p.add_argument(
        "--resnet18-seeds", type=seed_list, default=None, help="default: the first of --seeds"
    )
    p.add_argument("--round-timeout", type=float, default=600.0, help="protocol.round_timeout_s")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="transport.request_timeout_s: a 45 MB reply takes 18 s alone at 20 Mbit/s",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="per federation run, seconds")
    args = p.parse_args(argv)
    for option, values, known in (("--secure", args.secure, ("off", "on")),):
        if not values or any(v not in known for v in values):
            p.error(f"{option}: use {' or '.join(known)}, comma-separated")
    if args.nodes < 2 or args.rounds < 1 or not args.seeds or not args.formats or not args.models:
        p.error("give at least 2 nodes, 1 round, one seed, one format and one model")
    if args.resnet18_seeds is None:
        args.resnet18_seeds = args.seeds[:1]
    return args


def transport_options(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    options: list[tuple[str, Any]] = [("request_timeout_s", args.request_timeout)]
    if args.link_mbit > 0:
        options.append(("link_mbit", args.link_mbit))
    return tuple(options)


def arm_spec(args: argparse.Namespace, arm: Arm, seed: int) -> RunSpec:
    resnet = arm.model == "resnet18"
    return RunSpec(
        nodes=args.nodes,
        protocol="fedavgp2p",
        fraction=args.fraction,
        rounds=args.resnet18_rounds if resnet else args.rounds,
        data=args.data,
        partition=args.partition,
        model=arm.model,
        seed=seed,
        steps_per_round=args.resnet18_steps if resnet else args.steps_per_round,
        round_timeout_s=args.round_timeout,
        timeout_s=args.timeout,
        encryption=True,  # secure aggregation requires it: both arms of a pair encrypt
        # `none` is the default: left unset, so the arm's site.yaml is the plain one
        protocol_options=(
            *((("compression", arm.compression),) if arm.compression != "none" else ()),
            ("secure_aggregation", arm.secure),
        ),
        transport_options=transport_options(args),
    )


def check_refusal(spec: RunSpec, sources: Sequence[Path], scratch: Path) -> str | None:
    """Why `p2pfl-node check` refuses this arm's site.yaml (its first line), or None."""
    from node.cli import main as node_cli  # the real command, in this process

    try:
        plans = provision(
            scratch,
            site_names(spec.nodes),
            protocol=protocol_section(spec),
            data_sources=[str(s.resolve()) for s in sources],
            federation="bench-check",
            seed=spec.seed,
            overrides=node_overrides(spec),
        )
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError too
        return one_line(str(exc))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = node_cli(["check", "--config", str(plans[0].config_path)])
    return None if code == 0 else one_line(err.getvalue() or f"exit code {code}")


def one_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines)[:400] if lines else "(no reason given)"


def one_seed(
    args: argparse.Namespace, model: str, seed: int, verdicts: dict[str, str | None]
) -> dict[str, Any]:
    """Every arm of `model` for one seed, on one partition: label -> figures.
    `verdicts`: label -> check's refusal (None: accepted), filled on first sight."""
    out = args.out / model / f"seed{seed}"
    arms = [Arm(model, fmt, secure == "on") for secure in args.secure for fmt in args.formats]
    if seed % 2:
        arms.reverse()
    sources, _ = partition(arm_spec(args, arms[0], seed), out / "data")
    figures: dict[str, Any] = {}
    for arm in arms:
        spec = arm_spec(args, arm, seed)
        if arm.label not in verdicts:
            verdicts[arm.label] = check_refusal(spec, sources, out / "check" / arm.slug)
            if verdicts[arm.label] is not None:
                stdout_line(f"--- {model} {arm.label}: refused by check: {verdicts[arm.label]}")
        if verdicts[arm.label] is not None:
            continue
        stdout_line(
            f"--- {model} seed {seed}: {arm.label} ({spec.nodes} nodes, {spec.rounds} rounds)"
        )
        outcome = run_processes(spec, out / arm.slug, sources)
        figures[arm.label] = run_figures(outcome, spec.rounds, args.link_mbit)
        f = figures[arm.label]
        stdout_line(
            f"--- {model} seed {seed} {arm.label}: macro-F1 {f['macro_f1_final']}, "
            f"{f['bytes_per_round_site']} B/round/site, round {f['round_s_mean']} s "
            f"(link floor {f['link_floor_s']} s), wall {f['wall_s']} s"
        )
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict[str, Any] = {"per_seed": {}, "refused": []}
    models: dict[str, Any] = {}
    ok = True
    for model in args.models:
        seeds = args.resnet18_seeds if model == "resnet18" else args.seeds
        verdicts: dict[str, str | None] = {}
        per_seed: dict[int, dict[str, Any]] = {}
        for seed in seeds:
            per_seed[seed] = one_seed(args, model, seed, verdicts)
            results["per_seed"][model] = per_seed
            atomic_write_text(args.out / "results.json", json.dumps(results, indent=2) + "\n")
        labels = [
            Arm(model, fmt, secure == "on").label for secure in args.secure for fmt in args.formats
        ]
        models[model] = model_summary(per_seed, [k for k in labels if verdicts.get(k) is None])
        results["refused"] += [
            {"model": model, "arm": k, "reason": v} for k, v in verdicts.items() if v is not None
        ]
        ok = ok and all(
            not f["errors"] and not f["timed_out"] for s in per_seed.values() for f in s.values()
        )
    figures = {model: s["arms"] for model, s in models.items()}
    plots = {"bandwidth": str(plot(models, args.out / "bandwidth.png", args.link_mbit))}
    f1 = {
        f"{model} {label}": {
            seed: f[label]["macro_f1_final"]
            for seed, f in results["per_seed"][model].items()
            if label in f and f[label]["macro_f1_final"] is not None
        }
        for model, s in models.items()
        for label in s["arms"]
    }
    if any(f1.values()):
        plots["f1_per_seed"] = str(final_per_seed(f1, args.out / "f1_per_seed.png"))
    summary = {
        "bench": "bandwidth",
        "link_mbit": args.link_mbit or None,
        "link": "token bucket in the transport (emulation; tc tbf not available here)"
        if args.link_mbit
        else "unshaped loopback",
        "nodes": args.nodes,
        "fraction": args.fraction,
        "partition": args.partition,
        "data": args.data,
        "rounds": {
            m: args.resnet18_rounds if m == "resnet18" else args.rounds for m in args.models
        },
        "seeds": {m: args.resnet18_seeds if m == "resnet18" else args.seeds for m in args.models},
        "arms": figures,
        "ratios": {m: s["ratios"] for m, s in models.items()},
        "targets": acceptance(models, FORMATS),
        "refused": results["refused"],
        "plots": plots,
        "wall_s": round(time.perf_counter() - started, 1),
        "ok": ok,
    }
    results["summary"] = summary
    atomic_write_text(args.out / "results.json", json.dumps(results, indent=2) + "\n")
    for name, path in plots.items():
        stdout_line(f"plot {name}: {path}")
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
