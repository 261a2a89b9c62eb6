"""What one federation run is: `RunSpec`, the site names, and the site.yaml
sections (protocol, model, training, selection, data) that the nodes and the
baselines share; the data set's partition among the sites."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pfl.config import ProtocolParams, SiteConfig, protocol_names
from p2pfl.learning.data.partition import MIN_TEST_PER_CLASS, partition_dataset
from protocols.memory import simulation_configs


@dataclass(frozen=True)
class RunSpec:
    """One federation run: everything the nodes and the baselines share."""

    nodes: int
    protocol: str = "fedavgp2p"
    heuristic: str = "random"
    fraction: float = 0.5
    rounds: int = 10
    data: str = "digits"
    partition: str = "dirichlet:0.5"
    test_split: str = "local"  # local | global (partition_dataset's `test`)
    epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-3
    model: str = "small_cnn"
    image_size: int = 28
    augment: str = "weak"
    seed: int = 0
    max_steps_per_epoch: int | None = None
    steps_per_round: int | None = None
    class_weighted: bool | str = "auto"  # training.class_weighted: True, False or "auto"
    lr_schedule: str = "cosine"
    label_fraction: float | None = None
    min_per_site: int | None = None  # partition_dataset's min_per_site
    min_test_per_class: int = (
        MIN_TEST_PER_CLASS  # partition_dataset's: sites under it reported apart
    )
    dp_target_epsilon: float | None = None  # training.dp.target_epsilon (None: no DP)
    dp_max_grad_norm: float = 1.0  # training.dp.max_grad_norm
    dp_noise_multiplier: float | None = None  # training.dp.noise_multiplier (0: clipping only)
    recipe: str = "standard"  # training.recipe (training.dp sets dp)
    dp_recipe_options: tuple[tuple[str, Any], ...] = ()  # training.dp_recipe fields
    training_options: tuple[tuple[str, Any], ...] = ()  # other training: fields
    round_timeout_s: float | None = None
    startup_wait_s: float = 60.0
    timeout_s: float = 1800.0
    in_memory: bool = False
    inline_train: bool = False  # in memory: train on the event loop (results repeat exactly)
    engine: str = "local"  # in memory: local (this process) | ray (protocols/memory/ray_engine.py)
    shards: int = 2  # engine ray: shard actors
    shard_cpus: float = 1.0  # engine ray: CPUs per shard actor (its training pool's workers)
    shard_gpus: float = 0.0  # engine ray: GPUs per shard actor (a fraction shares one)
    ray_address: str | None = None  # engine ray: auto | HOST:PORT; None: a local Ray started
    protocol_options: tuple[tuple[str, Any], ...] = ()
    lpips_backbone: str | None = None  # genbuffer.lpips_backbone of every node (FedER)
    lpips_weights: str | None = None  # genbuffer.lpips_weights of every node (FedER)
    genbuffer_options: tuple[tuple[str, Any], ...] = ()  # other genbuffer: fields (FedER)
    encryption: bool = False  # wire.encryption (always on with secure aggregation)
    cpu_shares: str = "equal"  # processes: equal (all nice 0) | data (nice by training images)
    transport_options: tuple[tuple[str, Any], ...] = ()  # other transport: fields

    @property
    def label(self) -> str:
        return f"{self.heuristic} c={self.fraction:g}"

    @property
    def slug(self) -> str:
        return f"{self.heuristic}_c{self.fraction:g}"


def spec_from_options(args: argparse.Namespace, **renamed: Any) -> RunSpec:
    """A RunSpec from a benchmark's parsed options: every option named like a
    RunSpec field (`--batch-size` -> batch_size) is taken as it is; `renamed`
    gives the fields whose option has another name (`timeout_s=args.timeout`)."""
    names = {f.name for f in dataclasses.fields(RunSpec)}
    same_named = {k: v for k, v in vars(args).items() if k in names}
    return RunSpec(**{**same_named, **renamed})


def site_names(nodes: int) -> list[str]:
    return [f"site_{i}" for i in range(nodes)]


def _params_class(protocol: str) -> type[Any]:
    for cls in ProtocolParams.__args__:  # type: ignore[attr-defined]
        if protocol in cls.model_fields["name"].annotation.__args__:
            return cls
    raise ValueError(f"unknown protocol {protocol!r}: use one of {', '.join(protocol_names())}")


def protocol_section(spec: RunSpec) -> dict[str, Any]:
    """The `protocol:` section every node gets."""
    fields = _params_class(spec.protocol).model_fields
    section: dict[str, Any] = {"name": spec.protocol, "rounds": spec.rounds}
    if "fraction" in fields:
        section["fraction"] = spec.fraction
    if spec.round_timeout_s is not None:
        section["round_timeout_s"] = spec.round_timeout_s
    section.update(dict(spec.protocol_options))
    return section


def shared_sections(spec: RunSpec) -> dict[str, dict[str, Any]]:
    """site.yaml sections the nodes and the baselines share (data.source is per site)."""
    training: dict[str, Any] = {
        "epochs": spec.epochs,
        "batch_size": spec.batch_size,
        "lr": spec.lr,
        "seed": spec.seed,
        "class_weighted": spec.class_weighted,
        "lr_schedule": spec.lr_schedule,
    }
    if spec.max_steps_per_epoch is not None:
        training["max_steps_per_epoch"] = spec.max_steps_per_epoch
    if spec.steps_per_round is not None:
        training["steps_per_round"] = spec.steps_per_round
    if spec.recipe != "standard":
        training["recipe"] = spec.recipe
    if spec.dp_recipe_options:
        training["dp_recipe"] = dict(spec.dp_recipe_options)
    training.update(dict(spec.training_options))
    if spec.dp_target_epsilon is not None:
        training["dp"] = {
            "target_epsilon": spec.dp_target_epsilon,
            "max_grad_norm": spec.dp_max_grad_norm,
        }
    elif spec.dp_noise_multiplier is not None:
        training["dp"] = {
            "noise_multiplier": spec.dp_noise_multiplier,
            "max_grad_norm": spec.dp_max_grad_norm,
        }
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": spec.model},
        "training": training,
        "selection": {"name": spec.heuristic},
        "data": {"image_size": spec.image_size, "augment": spec.augment},
    }
    genbuffer: dict[str, Any] = dict(spec.genbuffer_options)
    if spec.lpips_backbone is not None:
        genbuffer["lpips_backbone"] = spec.lpips_backbone
    if spec.lpips_weights is not None:
        genbuffer["lpips_weights"] = str(Path(spec.lpips_weights).resolve())
    if genbuffer:
        sections["genbuffer"] = genbuffer
    return sections


def node_overrides(spec: RunSpec) -> dict[str, Any]:
    """Everything a benchmark node's site.yaml sets beyond `provision`'s defaults."""
    sections = shared_sections(spec)
    sections["training"] = {**sections["training"], "threads": 1}
    protocol = protocol_section(spec)
    secure = protocol.get("secure_aggregation") or (protocol.get("finetune") or {}).get(
        "secure_aggregation"
    )
    if secure or spec.encryption:  # secure aggregation is refused without payload encryption
        sections["wire"] = {"encryption": True}
    return {
        **sections,
        "node": {"exit_when_done": True, "startup_wait_s": spec.startup_wait_s},
        "transport": {
            "heartbeat_s": 1.0,
            "suspect_after_s": 5.0,
            "dead_after_s": 15.0,
            **dict(spec.transport_options),
        },
    }


def partition(spec: RunSpec, data_dir: Path) -> tuple[list[Path], dict[str, Any]]:
    """site_<i>.npz for every node under data_dir, and the partition summary."""
    summary = partition_dataset(
        spec.data,
        spec.nodes,
        spec.partition,
        data_dir,
        label_fraction=spec.label_fraction,
        seed=spec.seed,
        test=spec.test_split,
        min_per_site=spec.min_per_site,
        min_test_per_class=spec.min_test_per_class,
    )
    return [data_dir / row["file"] for row in summary["per_site"]], summary


def one_torch_thread() -> None:
    """Work done in this process (baselines, in-memory nodes) uses one torch
    thread: several threads contend on a shared machine and beside the nodes."""
    import torch

    torch.set_num_threads(1)


def in_process_configs(
    spec: RunSpec,
    sources: Sequence[Path],
    state_root: Path,
    training: dict[str, Any] | None = None,
) -> list[SiteConfig]:
    """Site configs of the nodes run in this process (in-memory nodes,
    baselines); `training` adds fields to every site's training: section
    (bench.personalization's methods), validated as a site.yaml is."""
    sections = shared_sections(spec)
    if training:
        sections["training"] = {**sections["training"], **training}
    return simulation_configs(
        [str(s) for s in sources],
        protocol=protocol_section(spec),
        names=site_names(spec.nodes),
        federation_id="bench",
        seed=spec.seed,
        state_root=state_root,
        **sections,
    )
