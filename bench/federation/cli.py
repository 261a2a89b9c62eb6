"""N-node federation benchmark: real `p2pfl-node` processes on loopback (or, with
`--in-memory`, N nodes in this process over the in-memory network; the same
protocol code either way), compared with baselines measured in the same run.
With `--engine ray [--shards K] [--address auto|HOST:PORT]` the in-memory
nodes run sharded over Ray actors (protocols/memory/ray_engine.py).

    python -m bench.federation --nodes 5 --protocol fedavgp2p --heuristic random \\
        --fraction 0.5 --rounds 10 --data PATH.npz|digits --partition dirichlet:0.5 \\
        [--test-split local|global] --out DIR
    python -m bench.federation ... --grid [--heuristics random,f1] [--fractions 0.25,1.0]

What it does:
1. splits the data set's train split among the N sites (`partition_dataset`,
   files under DIR/data; val follows each site's class shares; test does too
   with `--test-split local` (the default), while with `--test-split global`
   every site's test split is the whole source test split, as in the DFU
   paper, which scores every client on the common test data);
2. for each (heuristic, c) asked for: provisions keys, roster and site.yaml
   under DIR/fed/<heuristic>_c<c>/ (a previous run's node state there is
   removed), starts one process per site with `node.exit_when_done: true`,
   prints one line per node per round as the nodes report on /status, waits
   for every process to exit (bounded by --timeout; the processes are always
   stopped), then reads every node's state/metrics.jsonl;
3. runs the baselines in this process (bench/baselines.py) on the SAME
   partition files with the same model, epochs, batch size, lr, seed and
   number of rounds: standalone (every site alone) and centralized FedAvg,
   plus centralized FedSGD (every site's gradient every step) for fedsgdp2p;
4. writes DIR/results.json and the plots, prints the per-site gain table (each
   site's reported model against the same site alone; sites whose test split
   is under --min-test-per-class images of a class are reported apart), and
   prints the `summary` object of results.json as the last stdout line (one
   JSON object).

What each figure of the summary means: bench/federation/stats.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.federation.benchmark import json_default, run_benchmark
from bench.federation.outcome import stdout_line
from bench.federation.specs import RunSpec, spec_from_options
from p2pfl.config import protocol_names
from p2pfl.learning.data.partition import PartitionError
from p2pfl.learning.data.sources import DataError
from protocols.memory.ray_engine import ShardsDoNotFit, check_shard_resources
from protocols.memory.ray_shard import RayMissing, import_ray

HEURISTICS = ("random", "n_latest", "f1", "cosine")
GRID_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in HEURISTICS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown heuristic(s) {unknown}: use {', '.join(HEURISTICS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.federation", description=__doc__.splitlines()[0]
    )

    def spec_option(flag: str, field: str | None = None, **kwargs: Any) -> None:
        """An option that sets a RunSpec field (named like it unless `field`
        says otherwise, see spec_from_args): RunSpec's default is its default."""
        name = field or flag.removeprefix("--").replace("-", "_")
        parser.add_argument(flag, default=getattr(RunSpec, name), **kwargs)

    parser.add_argument("--nodes", type=int, default=5)
    spec_option("--protocol", choices=protocol_names())
    spec_option("--heuristic", choices=HEURISTICS)
    spec_option("--fraction", type=float, help="c: share of the other nodes each node pulls from")
    parser.add_argument(
        "--grid",
        action="store_true",
        help="every heuristic x c (defaults: all four heuristics, c in 0.25,0.5,0.75,1.0)",
    )
    parser.add_argument(
        "--heuristics", type=_names, default=None, help="comma list, e.g. random,n_latest,f1,cosine"
    )
    parser.add_argument(
        "--fractions", type=_floats, default=None, help="comma list, e.g. 0.25,0.5,0.75,1.0"
    )
    spec_option("--rounds", type=int)
    spec_option(
        "--data", help="'digits' (embedded), a MedMNIST-style .npz or an ImageFolder directory"
    )
    spec_option("--partition", help="iid, dirichlet:ALPHA, shards:K or quantity:ALPHA")
    spec_option(
        "--test-split",
        choices=("local", "global"),
        help="local: each site's test follows its train class shares; "
        "global: every site is scored on the whole test split (DFU paper)",
    )
    spec_option("--label-fraction", type=float)
    spec_option(
        "--cpu-shares",
        choices=("data", "equal"),
        help="processes on one machine: equal (default): every node at nice 0; data: each "
        "node's nice value makes its share of the cores follow its share of the training "
        "images (round time 0.94x over seeds 0-4 of the reference job, not significant)",
    )
    spec_option(
        "--dp-target-epsilon",
        type=float,
        help="differentially private local training (Opacus) spending at most this ε "
        "over the run (needs a model without BatchNorm: --model small_cnn_gn)",
    )
    spec_option("--dp-max-grad-norm", type=float, help="DP-SGD's per-sample clipping norm")
    spec_option(
        "--dp-noise-multiplier",
        type=float,
        help="training.dp.noise_multiplier instead of a target ε (0: the recipe's clipping "
        "without noise, no privacy)",
    )
    spec_option(
        "--min-per-site",
        type=int,
        help="the fewest training images a site may get (partition's --min-per-site)",
    )
    spec_option(
        "--min-test-per-class",
        type=int,
        help="a site whose test split holds fewer images of a class it trains on is "
        "reported apart in the per-site gain table (partition's --min-test-per-class)",
    )
    parser.add_argument("--out", type=Path, required=True)
    spec_option("--epochs", type=int)
    spec_option("--batch-size", type=int)
    spec_option("--lr", type=float)
    spec_option("--model")
    spec_option("--image-size", type=int)
    spec_option(
        "--augment",
        choices=("none", "weak", "strong"),
        help="data.augment of every site (training batches only)",
    )
    spec_option("--seed", type=int)
    spec_option("--max-steps-per-epoch", type=int)
    spec_option(
        "--steps-per-round",
        type=int,
        help="local steps per round instead of epochs (equal work per site)",
    )
    spec_option(
        "--class-weighted",
        type=_class_weighted,
        nargs="?",
        const=True,
        help="training.class_weighted of every method: auto (the default: weighted where a "
        "site's labels are skewed), true (also: the bare flag) or false",
    )
    spec_option(
        "--lr-schedule",
        choices=("cosine", "step", "constant"),
        help="training.lr_schedule of every method (default cosine)",
    )
    spec_option(
        "--round-timeout",
        "round_timeout_s",
        type=float,
        help="protocol.round_timeout_s (default: the protocol's)",
    )
    spec_option(
        "--timeout",
        "timeout_s",
        type=float,
        help="overall bound of one run in seconds; the nodes are always stopped",
    )
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="run the nodes in this process over the in-memory network",
    )
    spec_option(
        "--inline-train",
        action="store_true",
        help="in memory: train on the event loop instead of worker threads, so every "
        "result repeats exactly (and the ray engine's equal the local one's)",
    )
    spec_option(
        "--engine",
        choices=("local", "ray"),
        help="in memory: local (this process) or ray (the nodes sharded over Ray actors, "
        "protocols/memory/ray_engine.py; implies --in-memory)",
    )
    spec_option("--shards", type=int, help="--engine ray: how many shard actors")
    spec_option(
        "--shard-cpus",
        type=float,
        help="--engine ray: CPUs per shard actor; its training pool has one worker per whole CPU",
    )
    spec_option(
        "--shard-gpus",
        type=float,
        help="--engine ray: GPUs per shard actor (a fraction shares one GPU)",
    )
    spec_option(
        "--address",
        "ray_address",
        help="--engine ray: a running Ray cluster (auto, or HOST:PORT); default: a "
        "Ray started on this machine for the run",
    )

    def section_option(section: str, example: str) -> None:
        """--SECTION-option KEY=VALUE (repeatable): another SECTION: field of every node."""
        parser.add_argument(
            f"--{section}-option",
            dest=f"{section.replace('-', '_')}_options",
            type=_protocol_option,
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"another {section}: field for every node, VALUE read as YAML ({example}); "
            "repeatable",
        )

    section_option("protocol", "e.g. aggregation=median")
    spec_option(
        "--recipe",
        choices=("standard", "dp"),
        help="training.recipe of every node (dp: training.dp's recipe, also without DP)",
    )
    section_option("dp-recipe", "e.g. lr=1.0: a training.dp_recipe field")
    section_option("training", "e.g. select_by=balanced_loss; nodes and baselines alike")
    spec_option(
        "--lpips-backbone",
        choices=("alex", "vgg", "squeeze", "random"),
        help="genbuffer.lpips_backbone of every node (FedER's generators and privacy gate)",
    )
    spec_option(
        "--lpips-weights",
        metavar="FILE",
        help="genbuffer.lpips_weights of every node: an lpips.LPIPS state dict or torchvision's "
        "backbone file (e.g. ../shared/weights/lpips_alex_v0.1_full_state.pth)",
    )
    section_option(
        "genbuffer", "e.g. iterations=800: FedER's GAN trains 50,000 iterations by default"
    )
    parser.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--compute-limit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time one epoch of every site for the compute-limit figures (epoch_s, "
        "critical_path_ratio); --no-compute-limit skips it",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.9,
        help="macro-F1 threshold of the rounds-to-threshold figures (DFU: 0.9)",
    )
    parser.add_argument("--verbose", action="store_true")
    return parser


def _class_weighted(text: str) -> bool | str:
    value = text.strip().lower()
    if value in ("auto", "true", "false"):
        return {"true": True, "false": False}.get(value, "auto")
    raise argparse.ArgumentTypeError(f"{text!r}: use auto, true or false")


def _protocol_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. aggregation=median")
    return key.strip(), yaml.safe_load(value)


def grid_cells(args: argparse.Namespace) -> list[tuple[str, float]]:
    if args.grid:
        heuristics = args.heuristics or list(HEURISTICS)
        fractions = args.fractions or list(GRID_FRACTIONS)
    else:
        heuristics = args.heuristics or [args.heuristic]
        fractions = args.fractions or [args.fraction]
    for c in fractions:
        if not 0.0 < c <= 1.0:
            raise SystemExit(f"bench.federation: --fraction(s) must be in (0, 1], got {c}")
    return [(h, c) for h in heuristics for c in fractions]


# training: fields a flag of its own sets (shared_sections): --training-option
# may not set them too, or one would silently win over the other
FLAGGED_TRAINING = {
    "epochs": "--epochs",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "seed": "--seed",
    "class_weighted": "--class-weighted",
    "lr_schedule": "--lr-schedule",
    "max_steps_per_epoch": "--max-steps-per-epoch",
    "steps_per_round": "--steps-per-round",
    "recipe": "--recipe",
    "dp_recipe": "--dp-recipe-option",
    "dp": "--dp-target-epsilon, --dp-noise-multiplier and --dp-max-grad-norm",
    "threads": "nothing (benchmark nodes train on 1 thread each)",
}


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    for key, _ in args.training_options:
        if key in FLAGGED_TRAINING:
            raise SystemExit(
                f"bench.federation: --training-option {key}=... is set by "
                f"{FLAGGED_TRAINING[key]}: use that instead"
            )
    if args.nodes < 2:
        raise SystemExit(f"bench.federation: --nodes must be at least 2, got {args.nodes}")
    if args.engine == "ray" and args.shards < 1:
        raise SystemExit(f"bench.federation: --shards must be at least 1, got {args.shards}")
    if args.engine == "ray":
        try:
            check_shard_resources(args.shard_cpus, args.shard_gpus)
        except ValueError as exc:
            raise SystemExit(f"bench.federation: --shard-cpus/--shard-gpus: {exc}") from None
    return spec_from_options(
        args,
        in_memory=args.in_memory or args.engine == "ray",
        ray_address=args.address,
        round_timeout_s=args.round_timeout,
        timeout_s=args.timeout,
        protocol_options=tuple(args.protocol_options),
        genbuffer_options=tuple(args.genbuffer_options),
        dp_recipe_options=tuple(args.dp_recipe_options),
        training_options=tuple(args.training_options),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    spec = spec_from_args(args)
    try:
        if spec.engine == "ray":
            import_ray()  # missing: one line, before the data are partitioned
        bench = run_benchmark(
            spec,
            grid_cells(args),
            args.out,
            baselines=args.baselines,
            compute_limit=args.compute_limit,
            threshold=args.threshold,
        )
    except (PartitionError, DataError, RayMissing, ShardsDoNotFit) as exc:  # no node started
        sys.stderr.write(f"bench.federation: {exc}\n")
        return 2
    except ConnectionError as exc:
        if spec.engine != "ray":
            raise
        first = next((line for line in str(exc).splitlines() if line.strip()), repr(exc))
        sys.stderr.write(f"bench.federation: no Ray cluster at {spec.ray_address}: {first}\n")
        return 2
    for name, path in bench.results["plots"].items():
        stdout_line(f"plot {name}: {path}")
    stdout_line(f"results: {bench.path}")
    stdout_line(json.dumps(bench.results["summary"], allow_nan=False, default=json_default))
    return 0 if bench.ok else 1
