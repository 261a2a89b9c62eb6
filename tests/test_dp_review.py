"""training.dp against a hostile review (r1): what a private site's protocols
do with quantities the accountant does not cover."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node.cli import main
from node.provision import provision
from p2pfl.learning.data.partition import partition_dataset
from protocols.memory import InMemoryNetwork, simulate, simulation_configs


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out: Path = tmp_path_factory.mktemp("digits2")
    partition_dataset("digits", 2, "iid", out, seed=0)
    return [str(out / f"site_{i}.npz") for i in range(2)]


def test_fedsgdp2p_weighs_a_private_gradient_by_its_expected_batch_not_the_realised_one(
    two_sources: list[str], tmp_path: Path
) -> None:
    """A Poisson batch may be empty. Before the review a private FedSGDP2P site
    weighed its own (noised) gradient by the realised batch size: a count the
    accountant does not cover went into its model, and an empty batch, weight
    0, stopped the node on `bad_weights` (here both nodes, within 120 steps of
    expected batch 2: an empty one has probability 1 - 1e-7)."""
    cfgs = simulation_configs(
        two_sources,
        protocol={"name": "fedsgdp2p", "fraction": 1.0, "rounds": 1, "step_timeout_s": 0.5},
        data={"image_size": 8, "augment": "none"},
        model={"name": "small_cnn_gn"},
        training={
            "device": "cpu",
            "steps_per_round": 120,
            "dp": {"noise_multiplier": 1.0},
            "dp_recipe": {"batch_size": 2, "epochs": 1},
        },
        state_root=tmp_path / "state",
    )
    network = InMemoryNetwork(inline_train=True)
    result = asyncio.run(simulate(cfgs, network=network))
    assert result.errors == {}
    assert result.rounds_completed() == {"site0": 1, "site1": 1}
    for record in result.records:
        assert record["steps"] == 120 and record["dp_steps"] == 120.0
        assert record["neighbours"] > 0.9  # each took the other's gradient, at weight 2


@pytest.mark.parametrize("model", ["efficientnet_b0", "mobilenetv2_100"])
def test_check_refuses_timm_batchnorm_subclasses_under_dp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str
) -> None:
    """timm's BatchNormAct2d subclasses BatchNorm2d; Opacus's validator checks
    exact types, so before the review `check` said ok to training.dp on these
    models and `run` failed in GradSampleModule's traceback. Their running
    statistics would be computed on the training images without noise."""
    provision(
        tmp_path / "fed",
        ["a"],
        protocol={"name": "fedavgp2p", "rounds": 2},
        overrides={
            "model": {"name": model},
            "data": {"image_size": 32},
            "training": {"dp": {"noise_multiplier": 1.0}},
        },
    )
    assert main(["check", "--config", str(tmp_path / "fed" / "a" / "site.yaml")]) == 2
    err = capsys.readouterr().err
    assert "model.name: training.dp: Opacus cannot compute per-sample gradients" in err
    assert "BatchNormAct2d" in err and err.count("\n") == 1
