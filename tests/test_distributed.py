"""Data-parallel local training (training.devices > 1) over torch.distributed.

Two gloo worker processes on CPU must follow the same loss curve as one process
with the same global batch: the single-process reference is the real
`LocalSite.train_epochs`. The model has no BatchNorm and no dropout, and
augmentation is off, because those are the parts that legitimately differ
between a sharded and an unsharded batch (see p2pfl/learning/distributed.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from p2pfl.config import DataSection, TrainingSection, config_from_dict
from p2pfl.learning.data import load_site_data
from p2pfl.learning.distributed import (
    RESULT_FILE,
    DataParallelSite,
    apply_result,
    create_site,
    load_result,
    train_data_parallel,
)
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.train import LocalSite

EPOCHS = 3
STEPS_PER_EPOCH = 6


def plain_cnn() -> nn.Module:
    """Conv + ReLU + linear: no BatchNorm, no dropout."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )


@pytest.fixture(scope="module")
def digits():
    return load_site_data(DataSection(source="digits", image_size=16, augment="none"), seed=0)


def make_site(digits) -> LocalSite:
    training = TrainingSection(
        epochs=1,
        batch_size=32,
        lr=3e-3,
        device="cpu",
        seed=3,
        max_steps_per_epoch=STEPS_PER_EPOCH,
    )
    return LocalSite(plain_cnn(), digits, training, augment="none", device="cpu")


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.slow
def test_two_gloo_processes_follow_the_single_process_loss_curve(digits):
    # Reference: the ordinary single-process loop, one epoch at a time.
    reference = make_site(digits)
    reference_epoch_losses = [reference.train_epochs(1)["loss"] for _ in range(EPOCHS)]

    # The data-parallel loop in this process, step by step (a one-worker group)...
    one = train_data_parallel(make_site(digits), devices=1, epochs=EPOCHS)
    # ...and sharded over two gloo worker processes (16 + 16 of every 32-image batch).
    site = make_site(digits)  # training.devices stays 1: the checks below train in-process
    two = train_data_parallel(site, devices=2, epochs=EPOCHS)

    assert one.steps == two.steps == EPOCHS * STEPS_PER_EPOCH
    assert one.samples == two.samples == EPOCHS * STEPS_PER_EPOCH * 32
    step_gap = max(abs(a - b) for a, b in zip(one.losses, two.losses, strict=True))
    assert step_gap < 1e-4, (one.losses, two.losses)
    # The curve goes down: training actually happened.
    assert two.losses[-1] < two.losses[0] - 0.5

    def epoch_means(losses: list[float]) -> list[float]:
        return [
            sum(losses[e * STEPS_PER_EPOCH : (e + 1) * STEPS_PER_EPOCH]) / STEPS_PER_EPOCH
            for e in range(EPOCHS)
        ]

    for ours, theirs in zip(epoch_means(two.losses), reference_epoch_losses, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)
    weight_gap = max_abs_diff(two.state, reference.state_dict())
    assert weight_gap < 1e-4

    # What the daemon's hook does with the result: the site ends where the single
    # process ended, with its optimizer state and batch order, so the next
    # (single-process) epoch continues the same curve.
    summary = apply_result(site, two, EPOCHS)
    assert summary["steps"] == EPOCHS * STEPS_PER_EPOCH
    assert summary["loss"] == pytest.approx(sum(reference_epoch_losses) / EPOCHS, abs=1e-4)
    assert max_abs_diff(site.state_dict(), reference.state_dict()) < 1e-4
    assert site.train_epochs(1)["loss"] == pytest.approx(
        reference.train_epochs(1)["loss"], abs=1e-4
    )
    print(
        "DDP-CURVE "
        + json.dumps(
            {
                "single_process_epoch_loss": reference_epoch_losses,
                "two_gloo_epoch_loss": epoch_means(two.losses),
                "max_step_loss_gap_vs_one_process": step_gap,
                "max_weight_gap_vs_train_epochs": weight_gap,
                "two_gloo_step_losses": two.losses,
                "two_gloo_seconds": two.seconds,
            }
        )
    )


def test_siamese_and_bad_device_counts_are_refused_with_a_reason(digits):
    from p2pfl.learning.models import SiameseNet

    siamese = LocalSite(
        SiameseNet(plain_cnn(), num_classes=10, embedding_dim=10),
        digits,
        TrainingSection(device="cpu", devices=2),
        device="cpu",
    )
    with pytest.raises(TrainingError) as err:
        train_data_parallel(siamese, devices=2, epochs=1)
    assert err.value.reason == "data_parallel_unsupported"
    with pytest.raises(TrainingError) as err:
        train_data_parallel(make_site(digits), devices=0, epochs=1)
    assert err.value.reason == "bad_devices"


def test_create_site_trains_data_parallel_only_when_asked(digits):
    raw = {
        "node": {"name": "a"},
        "federation": {"id": "f", "roster": "roster.yaml"},
        "protocol": {"name": "fedavgp2p"},
        "data": {"source": "digits", "image_size": 16, "augment": "none"},
        "training": {"device": "cpu"},
    }
    assert type(create_site(config_from_dict(raw, check_files=False), digits)) is LocalSite
    raw["training"]["devices"] = 2
    site = create_site(config_from_dict(raw, check_files=False), digits)
    assert isinstance(site, DataParallelSite) and site.training.devices == 2


@pytest.mark.slow
def test_torchrun_entry_trains_a_provisioned_site(tmp_path):
    """`torchrun --nproc-per-node 2 -m p2pfl.learning.distributed --config site.yaml` on CPU."""
    from node.provision import provision

    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 1},
        overrides={"training": {"max_steps_per_epoch": 3, "threads": 1, "device": "cpu"}},
    )
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this Python")
    out = tmp_path / "result"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--standalone",
            "-m",
            "p2pfl.learning.distributed",
            "--config",
            str(plans[0].config_path),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert summary["steps"] == 3
    result = load_result(out)
    assert (out / RESULT_FILE).exists() and result.steps == 3
    assert all(torch.isfinite(v.float()).all() for v in result.state.values())
    cfg = yaml.safe_load(plans[0].config_path.read_text())
    assert cfg["model"]["name"] == "small_cnn"
