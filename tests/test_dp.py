"""training.dp: DP-SGD with Opacus, its accounting, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from node.cli import main
from node.provision import provision
from p2pfl.config.sections import DataSection, DPSection, TrainingSection
from p2pfl.learning.data import load_site_data
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.models import create_model
from p2pfl.learning.train import LocalSite


@pytest.fixture(scope="module")
def digits():
    return load_site_data(DataSection())


def private_site(
    digits, dp: DPSection, *, rounds: int = 3, steps: int = 4, **training
) -> LocalSite:
    section = TrainingSection(dp=dp, max_steps_per_epoch=steps, optimizer="sgd", **training)
    model = create_model("small_cnn_gn", in_chans=1, num_classes=10, image_size=28)
    return LocalSite(model, digits, section, rounds=rounds, model_name="small_cnn_gn")


def opacus_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    return accountant.get_epsilon(delta=delta)


def test_the_epsilon_a_site_reports_is_opacus_accountants_for_its_steps(digits):
    site = private_site(digits, DPSection(noise_multiplier=1.1, delta=1e-5))
    assert site.dp is not None and site.dp.epsilon == 0.0
    fit = site.train_epochs()
    assert fit["steps"] == 4 == site.dp.steps
    n_train = len(digits.train)
    q = 32 / n_train
    assert site.dp.sample_rate == pytest.approx(q)
    assert site.dp.epsilon == pytest.approx(opacus_epsilon(1.1, q, 4, 1e-5), rel=1e-12)
    site.train_epochs()  # a second round: the spending adds up
    assert site.dp.epsilon == pytest.approx(opacus_epsilon(1.1, q, 8, 1e-5), rel=1e-12)
    # FedSGDP2P's per-step gradients are private steps too
    x, y = next(site.batches("train"))
    site.compute_gradient(x, y)
    assert site.dp.steps == 9
    # a resumed node restores what it spent
    spent = site.dp.epsilon
    site.dp.restore(9)
    assert site.dp.epsilon == pytest.approx(spent, rel=1e-12)


def test_a_target_epsilon_is_met_by_the_end_of_the_planned_rounds(digits):
    rounds, steps = 3, 4
    site = private_site(digits, DPSection(target_epsilon=2.0), rounds=rounds, steps=steps)
    q = 32 / len(digits.train)
    expected_sigma = get_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sample_rate=q, steps=rounds * steps
    )
    assert site.dp.noise_multiplier == pytest.approx(expected_sigma)
    for _ in range(rounds):
        site.train_epochs()
    assert site.dp.steps == rounds * steps
    assert 1.8 < site.dp.epsilon <= 2.0 + 1e-9


def test_each_sample_is_clipped_and_noise_is_added(digits):
    """Without noise an SGD step moves the weights by at most lr x max_grad_norm
    (the mean of per-sample gradients clipped to that norm), however large the
    loss; with noise the same batch gives a different step."""
    torch.manual_seed(0)
    clip = 1e-3
    site = private_site(
        digits, DPSection(noise_multiplier=0.0, max_grad_norm=clip), steps=1, lr=1.0
    )
    before = torch.cat([p.detach().flatten().clone() for p in site.model.parameters()])
    site.train_epochs()
    after = torch.cat([p.detach().flatten() for p in site.model.parameters()])
    moved = float((after - before).norm())
    assert 0 < moved <= 1.0 * clip * (1 + 1e-4)

    x, y = next(site.batches("train"))
    plain = private_site(digits, DPSection(noise_multiplier=0.0), steps=1)
    noisy = private_site(digits, DPSection(noise_multiplier=2.0), steps=1)
    noisy.load_state_dict(plain.state_dict())
    g0 = plain.compute_gradient(x, y)
    g1 = noisy.compute_gradient(x, y)
    differences = [float((g0[k] - g1[k]).abs().max()) for k in g0]
    assert max(differences) > 1e-3  # noise of std 2 x 1.0 / 32 per coordinate
    per_sample_bound = max(float(v.norm()) for v in g0.values())
    assert per_sample_bound <= 1.0 + 1e-4  # the mean of clipped gradients


def test_batchnorm_is_refused_with_the_fix(digits):
    model = create_model("small_cnn", in_chans=1, num_classes=10, image_size=28)
    section = TrainingSection(dp=DPSection(noise_multiplier=1.0))
    with pytest.raises(TrainingError) as caught:
        LocalSite(model, digits, section, rounds=3, model_name="small_cnn")
    assert caught.value.reason == "dp_unsupported_model"
    assert "BatchNorm" in str(caught.value) and "small_cnn_gn" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_exactly_one_noise_setting_is_required():
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        DPSection(noise_multiplier=1.0, target_epsilon=3.0)
    with pytest.raises(ValueError, match="exactly one"):
        DPSection()


@pytest.mark.parametrize(
    ("protocol", "model", "words"),
    [
        ("fedavgp2p", "small_cnn", "model.name: training.dp: Opacus cannot compute"),
        ("feder", "small_cnn_gn", "training.dp: differential privacy is supported for"),
    ],
)
def test_check_refuses_what_dp_cannot_train(tmp_path: Path, capsys, protocol, model, words):
    provision(
        tmp_path / "fed",
        ["a"],
        protocol={"name": protocol, "rounds": 2},
        overrides={"model": {"name": model}, "training": {"dp": {"noise_multiplier": 1.0}}},
    )
    assert main(["check", "--config", str(tmp_path / "fed" / "a" / "site.yaml")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_check_accepts_the_groupnorm_cnn(tmp_path: Path, capsys):
    provision(
        tmp_path / "fed",
        ["a"],
        protocol={"name": "fedsgdp2p", "rounds": 2},
        overrides={"model": {"name": "small_cnn_gn"}, "training": {"dp": {"target_epsilon": 8}}},
    )
    assert main(["check", "--config", str(tmp_path / "fed" / "a" / "site.yaml")]) == 0
    assert "# ok" in capsys.readouterr().out


def test_a_private_site_without_the_runs_rounds_is_refused(digits):
    """A budget planned for one round would be spent again in every later round:
    the ε reported as the target would not be the ε spent."""
    model = create_model("small_cnn_gn", in_chans=1, num_classes=10, image_size=28)
    section = TrainingSection(dp=DPSection(target_epsilon=3.0))
    with pytest.raises(TrainingError) as caught:
        LocalSite(model, digits, section, model_name="small_cnn_gn")
    assert caught.value.reason == "dp_unplanned"


@pytest.mark.parametrize("protocol", ["fedmae", "fedbeit"])
@pytest.mark.parametrize("command", ["check", "run"])
def test_self_supervised_protocols_refuse_dp_in_check_and_run(
    tmp_path: Path, capsys, protocol, command
):
    """The one DP guard: `run` refuses what `check` refuses, in one line, before
    a node starts. Before it, `run` of Fed-BEiT trained its tokenizer under a
    budget planned for one round (ε 3 spent in the first of 20 rounds) and
    Fed-MAE stopped on Opacus's traceback."""
    provision(
        tmp_path / "fed",
        ["a"],
        protocol={"name": protocol, "rounds": 20},
        overrides={
            "model": {"name": "vit_tiny_patch16_224"},
            "training": {"dp": {"target_epsilon": 3}},
        },
    )
    assert main([command, "--config", str(tmp_path / "fed" / "a" / "site.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"differential privacy is supported for fedavgp2p and fedsgdp2p, not {protocol}" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "fed" / "a" / "state" / "metrics.jsonl").exists()


def test_pretraining_sites_refuse_dp_without_a_site_yaml(digits):
    """The second line of the guard: a pre-training site built directly."""
    from p2pfl.learning.beit_site import TokenizerSite
    from p2pfl.learning.tokenizer import VQTokenizer

    tokenizer = VQTokenizer(in_chans=1, patch_size=4, codebook_size=16)
    with pytest.raises(TrainingError) as caught:
        TokenizerSite(tokenizer, digits, TrainingSection(dp=DPSection(target_epsilon=3.0)))
    assert caught.value.reason == "dp_unsupported"
