"""Data-parallel local training for sites with several GPUs (`training.devices > 1`).

The daemon keeps the network side in its own process; only the blocking local
epochs fan out to `devices` worker processes joined by torch.distributed (NCCL
on GPUs, gloo on CPU). Every worker walks the same seeded global batches as a
single-process `LocalSite.train_epochs` and takes one contiguous shard of each;
gradients are all-reduced so that one step equals one step on the whole global
batch (global batch = training.batch_size):

    g = (1 / B) * sum_r sum_{i in shard_r} grad l_i
      = mean_r [ (|shard_r| * R / B) * grad mean_{i in shard_r} l_i ]

(B global batch, R workers; DDP averages over R, hence the |shard_r| * R / B
scale on each worker's mean loss.) The equality holds for plain layers; with
BatchNorm each worker normalises with its own shard's statistics unless the
layers are SyncBatchNorm, which we switch to on GPUs (SyncBatchNorm has no CPU
kernel). Augmentation draws differ between workers and a single process.
Siamese (pairwise contrastive) models are not sharded: pairs across shards
would be lost.

Two ways in:
  * `DataParallelSite`, the LocalSite `create_site` (below) builds when
    training.devices > 1: its `train_epochs` is `train_epochs_data_parallel`,
    which spawns the workers, returns the same summary dict as
    `LocalSite.train_epochs` and leaves the trained weights and optimizer state
    in the site.
  * `torchrun --nproc-per-node N -m p2pfl.learning.distributed --config site.yaml`: the
    same worker loop under torchrun (benchmarks, checking a multi-GPU host).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from p2pfl.config import SiteConfig, TrainingSection, load_config
from p2pfl.files import atomic_torch_save
from p2pfl.learning.data import SiteData
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.models import SiameseNet
from p2pfl.learning.train import LocalSite

log = logging.getLogger(__name__)

RESULT_FILE = "data_parallel_result.pt"
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class DataParallelJob:
    """Everything a worker needs; sent to spawned workers (tensors via shared memory)."""

    model: nn.Module  # CPU copy of the site's model
    images: Tensor  # train split, float32 N,C,H,W
    labels: Tensor  # int64 N
    num_classes: int
    training: TrainingSection
    epochs: int
    augment: str
    shuffle_call: int  # LocalSite._shuffle_calls at the start: same batch order as one process
    optimizer_state: dict[str, Any] | None
    backend: str  # "nccl" or "gloo"
    device_type: str  # "cuda" or "cpu"
    init_method: str  # "tcp://127.0.0.1:PORT" or "env://" (torchrun)
    result_dir: str  # rank 0 writes RESULT_FILE here


@dataclass
class DataParallelResult:
    state: dict[str, Tensor]
    optimizer_state: dict[str, Any]
    losses: list[float] = field(default_factory=list)  # one per global step, global-batch mean
    samples: int = 0
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.losses)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_site(job: DataParallelJob, device: torch.device) -> LocalSite:
    """A LocalSite around the job's model and train split: same batches, loss and augment."""
    data = SiteData(
        train=TensorDataset(job.images, job.labels),
        val=None,
        test=None,
        unlabeled=None,
        num_classes=job.num_classes,
        channels=int(job.images.shape[1]),
        image_size=int(job.images.shape[-1]),
        class_names=[str(i) for i in range(job.num_classes)],
        train_uint8=np.zeros((0, 1, 1, 1), dtype=np.uint8),
        train_labels=np.zeros(0, dtype=np.int64),
        source="data-parallel worker",
    )
    site = LocalSite(job.model, data, job.training, augment=job.augment, device=device)
    if job.optimizer_state is not None:
        site.load_optimizer_state(job.optimizer_state)
    site._shuffle_calls = job.shuffle_call
    return site


def run_worker(rank: int, world_size: int, job: DataParallelJob) -> DataParallelResult | None:
    """One data-parallel worker. Rank 0 returns (and saves) the result; others return None."""
    if job.device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        job.backend,
        init_method=job.init_method,
        rank=rank,
        world_size=world_size,
        timeout=PROCESS_GROUP_TIMEOUT,
    )
    try:
        return _train_worker(rank, world_size, job, device)
    finally:
        dist.destroy_process_group()


def _train_worker(
    rank: int, world_size: int, job: DataParallelJob, device: torch.device
) -> DataParallelResult | None:
    start = time.perf_counter()
    # Spawned workers receive the model in shared memory: every worker needs its own
    # copy, or they would all step the same parameters.
    job.model = copy.deepcopy(job.model)
    if device.type == "cuda":
        job.model = nn.SyncBatchNorm.convert_sync_batchnorm(job.model)
    site = _worker_site(job, device)
    module = site.model
    site.model = DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None
    )
    cap = job.training.max_steps_per_epoch
    losses: list[float] = []
    samples = 0
    site.model.train()
    for _ in range(job.epochs):
        for step, (x, y) in enumerate(site.batches("train")):
            if cap is not None and step >= cap:
                break
            global_n = len(y)
            # As LocalSite.train_epochs: BatchNorm cannot train on one sample. A global
            # batch smaller than the worker count (only an epoch's last) is skipped too.
            if global_n < max(2, world_size):
                continue
            x_shard = torch.tensor_split(x, world_size)[rank]
            y_shard = torch.tensor_split(y, world_size)[rank]
            x_shard = site._augment(x_shard)  # on the worker's device
            y_shard = y_shard.to(device, non_blocking=True)
            site.optimizer.zero_grad(set_to_none=True)
            shard_mean = site.loss(x_shard, y_shard)
            # DDP averages gradients over workers: scale so the result is the global mean.
            (shard_mean * (len(y_shard) * world_size / global_n)).backward()
            site.optimizer.step()
            shard_sum = shard_mean.detach().float() * len(y_shard)
            dist.all_reduce(shard_sum, op=dist.ReduceOp.SUM)
            losses.append(float(shard_sum) / global_n)
            samples += global_n
    if rank != 0:
        return None
    site.model = module
    state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    result = DataParallelResult(
        state=state,
        optimizer_state=site.optimizer_state(),
        losses=losses,
        samples=samples,
        seconds=time.perf_counter() - start,
    )
    atomic_torch_save(  # the site's trained weights: 0600
        {
            "state": result.state,
            "optimizer": result.optimizer_state,
            "losses": result.losses,
            "samples": result.samples,
            "seconds": result.seconds,
        },
        Path(job.result_dir) / RESULT_FILE,
    )
    return result


def _limit_threads(training: TrainingSection, world_size: int) -> None:
    """CPU workers share the cores: training.threads each, or an equal share."""
    torch.set_num_threads(training.threads or max(1, (os.cpu_count() or 1) // world_size))


def _spawned_worker(rank: int, world_size: int, job: DataParallelJob) -> None:
    if job.device_type == "cpu":
        _limit_threads(job.training, world_size)
    run_worker(rank, world_size, job)


def load_result(result_dir: Path) -> DataParallelResult:
    saved = torch.load(Path(result_dir) / RESULT_FILE, map_location="cpu", weights_only=True)
    return DataParallelResult(
        state=saved["state"],
        optimizer_state=saved["optimizer"],
        losses=[float(v) for v in saved["losses"]],
        samples=int(saved["samples"]),
        seconds=float(saved["seconds"]),
    )


def train_data_parallel(
    site: LocalSite, devices: int, epochs: int | None = None
) -> DataParallelResult:
    """Train `site`'s model for `epochs` over `devices` worker processes; `site` is
    not modified (see `train_epochs_data_parallel`). devices == 1 runs the same loop
    in this process (a one-worker gloo group), the single-process reference."""
    if devices < 1:
        raise TrainingError("bad_devices", f"training.devices must be >= 1, got {devices}")
    if isinstance(site.model, SiameseNet):
        raise TrainingError(
            "data_parallel_unsupported",
            "Siamese (contrastive) training compares every pair in a batch and is not sharded — "
            "set training.devices: 1 for Siamese models",
        )
    cuda = site.device.type == "cuda"
    if cuda and devices > torch.cuda.device_count():
        raise TrainingError(
            "not_enough_devices",
            f"training.devices is {devices} but only {torch.cuda.device_count()} CUDA devices are visible "
            "— lower training.devices or check CUDA_VISIBLE_DEVICES",
        )
    images, labels = site.data.train.tensors
    with tempfile.TemporaryDirectory(prefix="p2pfl-ddp-") as result_dir:
        job = DataParallelJob(
            model=copy.deepcopy(site.model).cpu(),
            images=images,
            labels=labels,
            num_classes=site.num_classes,
            training=site.training,
            epochs=site.training.epochs if epochs is None else epochs,
            augment=site.augment,
            shuffle_call=site._shuffle_calls,
            optimizer_state=site.optimizer_state(),
            backend="nccl" if cuda else "gloo",
            device_type="cuda" if cuda else "cpu",
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            result_dir=result_dir,
        )
        log.info(
            "local training over %d %s worker(s), %s, %d epoch(s)",
            devices,
            job.device_type,
            job.backend,
            job.epochs,
        )
        if devices == 1:
            result = run_worker(0, 1, job)
            assert result is not None
            return result
        try:
            mp.start_processes(
                _spawned_worker,
                args=(devices, job),
                nprocs=devices,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as exc:
            raise TrainingError(
                "data_parallel_failed",
                f"a data-parallel training worker failed: {str(exc).strip().splitlines()[-1]}",
            ) from exc
        except mp.ProcessExitedException as exc:
            raise TrainingError(
                "data_parallel_failed",
                f"a data-parallel training worker died ({exc}) — out of memory?",
            ) from exc
        return load_result(Path(result_dir))


def train_epochs_data_parallel(site: LocalSite, epochs: int | None = None) -> dict[str, float]:
    """`LocalSite.train_epochs` over training.devices processes: same return value,
    the trained weights, optimizer state and batch-order counter left in `site`.
    The workers are started for every call (a few seconds of process start-up and
    imports), which is small next to an epoch on a multi-GPU site."""
    epochs = site.training.epochs if epochs is None else epochs
    start = time.perf_counter()
    summary = apply_result(site, train_data_parallel(site, site.training.devices, epochs), epochs)
    summary["seconds"] = time.perf_counter() - start  # worker start-up included
    return summary


def apply_result(site: LocalSite, result: DataParallelResult, epochs: int) -> dict[str, float]:
    """Put a data-parallel run's weights, optimizer state and batch-order counter into
    `site`, as if `site.train_epochs(epochs)` had run; return its summary dict."""
    site.load_state_dict(result.state)
    site.load_optimizer_state(result.optimizer_state)
    site._shuffle_calls += epochs
    return site.record_fit(result.losses, result.samples, result.seconds)


class DataParallelSite(LocalSite):
    """A LocalSite whose local epochs run over training.devices worker processes
    (`train_epochs_data_parallel`); with training.devices 1, and for everything
    else, it is a LocalSite."""

    def train_epochs(self, epochs: int | None = None) -> dict[str, float]:
        if self.training.devices > 1:
            return train_epochs_data_parallel(self, epochs)
        return super().train_epochs(epochs)


def create_site(
    cfg: SiteConfig, data: SiteData | None = None, *, common_initial: bool = False
) -> LocalSite:
    """The classifier site a site.yaml asks for: a `DataParallelSite` when
    training.devices > 1 (local epochs fan out over that many processes), else
    the single-process `LocalSite`; built by `LocalSite.from_config` (data
    loaded unless given; `common_initial`: the federation's common initial
    weights)."""
    site_class = DataParallelSite if cfg.training.devices > 1 else LocalSite
    return site_class.from_config(cfg, data, common_initial=common_initial)


# ----------------------------------------------------------------------------- torchrun


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun entry: every rank builds the site from site.yaml (same seeds, so the
    same model and data), trains its shard; rank 0 writes the result and one JSON line."""
    parser = argparse.ArgumentParser(
        prog="python -m p2pfl.learning.distributed",
        description="Data-parallel local training of one site (run under torchrun).",
    )
    parser.add_argument("--config", required=True, help="site.yaml")
    parser.add_argument("--epochs", type=int, default=None, help="default: training.epochs")
    parser.add_argument("--out", default=None, help="directory for the result file (rank 0)")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(args.config, check_files=False)
    site = LocalSite.from_config(cfg)
    cuda = site.device.type == "cuda"
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="p2pfl-ddp-"))
    out.mkdir(parents=True, exist_ok=True)
    images, labels = site.data.train.tensors
    job = DataParallelJob(
        model=site.model.cpu(),
        images=images,
        labels=labels,
        num_classes=site.num_classes,
        training=site.training,
        epochs=site.training.epochs if args.epochs is None else args.epochs,
        augment=site.augment,
        shuffle_call=0,
        optimizer_state=None,
        backend="nccl" if cuda else "gloo",
        device_type="cuda" if cuda else "cpu",
        init_method="env://" if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{_free_port()}",
        result_dir=str(out),
    )
    if not cuda:
        _limit_threads(site.training, world_size)
    result = run_worker(rank, world_size, job)
    if result is not None:
        summary = {
            "world_size": world_size,
            "backend": job.backend,
            "steps": result.steps,
            "samples": result.samples,
            "seconds": round(result.seconds, 3),
            "losses": [round(v, 6) for v in result.losses],
            "result": str(out / RESULT_FILE),
        }
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
