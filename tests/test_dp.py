"""training.dp: DP-SGD with Opacus, its accounting, and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from node.cli import main
from node.provision import provision
from p2pfl.config.sections import DataSection, DPRecipeSection, DPSection, TrainingSection
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
    """A private digits site taking `steps` steps a round (one capped pass)."""
    training.setdefault("dp_recipe", DPRecipeSection(epochs=1))
    section = TrainingSection(dp=dp, max_steps_per_epoch=steps, **training)
    torch.manual_seed(0)
    model = create_model("small_cnn_ws", in_chans=1, num_classes=10, image_size=28)
    return LocalSite(model, digits, section, rounds=rounds, model_name="small_cnn_ws")


def opacus_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    return accountant.get_epsilon(delta=delta)


def recipe_q(digits) -> float:
    """The Poisson sampling rate of the recipe's default expected batch."""
    n_train = len(digits.train)
    return min(DPRecipeSection().batch_size, n_train) / n_train


def test_the_epsilon_a_site_reports_is_opacus_accountants_for_its_steps(digits):
    site = private_site(digits, DPSection(noise_multiplier=1.1, delta=1e-5))
    assert site.dp is not None and site.dp.epsilon == 0.0
    fit = site.train_epochs()
    assert fit["steps"] == 4 == site.dp.steps
    q = recipe_q(digits)
    assert site.dp.sample_rate == pytest.approx(q)
    assert site.dp.summary()["sampling"] == "poisson"
    assert site.dp.epsilon == pytest.approx(opacus_epsilon(1.1, q, 4, 1e-5), rel=1e-12)
    site.train_epochs()  # a second round: the spending adds up
    assert site.dp.epsilon == pytest.approx(opacus_epsilon(1.1, q, 8, 1e-5), rel=1e-12)
    # FedSGDP2P's per-step gradients are private steps too
    x, y = next(site.training_batches(1))
    site.compute_gradient(x, y)
    assert site.dp.steps == 9
    # a resumed node restores what it spent
    spent = site.dp.epsilon
    history = site.dp.history()
    site.dp.restore(history)
    assert site.dp.epsilon == pytest.approx(spent, rel=1e-12)


def test_a_target_epsilon_is_met_by_the_end_of_the_planned_rounds(digits):
    rounds, steps = 3, 4
    site = private_site(digits, DPSection(target_epsilon=2.0), rounds=rounds, steps=steps)
    expected_sigma = get_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sample_rate=recipe_q(digits), steps=rounds * steps
    )
    assert site.dp.noise_multiplier == pytest.approx(expected_sigma)
    for _ in range(rounds):
        site.train_epochs()
    assert site.dp.steps == rounds * steps
    assert 1.8 < site.dp.epsilon <= 2.0 + 1e-9


def test_batches_are_poisson_samples_of_the_expected_size(digits):
    """Every image joins a step independently with probability q: batch sizes
    vary around q x n, each image's frequency is about q, and a run repeats."""
    site = private_site(digits, DPSection(noise_multiplier=1.0))
    assert site.recipe is not None
    sizes, hits = [], torch.zeros(len(digits.train))
    images = digits.train.tensors[0].flatten(1)
    index = {bytes(row.numpy().tobytes()): i for i, row in enumerate(images)}
    for _ in range(200):
        x, _ = site.recipe.poisson_batch()
        sizes.append(len(x))
        for row in x.flatten(1):
            hits[index[bytes(row.numpy().tobytes())]] += 1
    q = recipe_q(digits)
    mean = sum(sizes) / len(sizes)
    assert abs(mean - q * len(digits.train)) < 6  # sd of the mean of 200 draws is ~1.0
    assert len(set(sizes)) > 10  # not fixed-size batches
    assert abs(float(hits.mean()) / 200 - q) < 0.01


def _step_delta(site: LocalSite, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The change of the weights by one SGD step on batch (x, y): lr x the
    gradient the private optimizer hands to SGD (read as the gradient, in
    float64, because a change of 1e-7 to a weight of 1.0 is below float32's
    resolution), after checking that the step applies exactly that."""
    before = torch.cat([p.detach().flatten().double() for p in site.model.parameters()])
    site.optimizer.zero_grad(set_to_none=True)
    site.recipe.accumulate(x, y)
    assert site.optimizer.pre_step()  # clip, noise, scale: p.grad is the step's gradient
    grad = torch.cat([p.grad.flatten().double() for p in site.model.parameters()])
    site.optimizer.original_optimizer.step()
    after = torch.cat([p.detach().flatten().double() for p in site.model.parameters()])
    lr = site.optimizer.param_groups[0]["lr"]
    assert torch.allclose(after - before, -lr * grad, atol=2e-7)
    return -lr * grad


def test_one_image_moves_a_step_by_at_most_lr_clip_over_the_batch(digits):
    """The sensitivity the noise is calibrated to: adding one image, however
    large its loss and whatever its class weight or its augmented views, changes
    a noise-free step by at most lr x C / expected batch. Attacked with a
    mislabelled, saturated image in a small physical batch (virtual steps)."""
    clip, lr = 0.5, 1.0
    training = {
        "augmult": 3,
        "physical_batch_size": 5,
        "lr": lr,
        "ema_decay": 0.0,
        "batch_size": 64,
    }
    x, y = next(digits_batches(digits, 12))
    odd_x = torch.full_like(x[:1], 40.0)
    odd_y = (y[:1] + 1) % 10
    deltas = []
    for xs, ys in ((x, y), (torch.cat([x, odd_x]), torch.cat([y, odd_y]))):
        torch.manual_seed(0)
        site = private_site(
            digits,
            DPSection(noise_multiplier=0.0, max_grad_norm=clip),
            dp_recipe=DPRecipeSection(**training),
            class_weighted=True,
        )
        deltas.append(_step_delta(site, xs, ys))
    shift = float((deltas[1] - deltas[0]).norm())
    assert 0 < shift <= lr * clip / 64 * (1 + 1e-4)


def test_class_weights_survive_clipping(digits):
    """With every per-sample gradient clipped, a class-weighted loss would give
    each image the same norm C; the recipe's weights after clipping keep a
    minority image worth more than a majority one (and never more than C)."""
    x, y = next(digits_batches(digits, 400))
    keep = (y == 0) | (y == 1)
    x, y = x[keep], y[keep]
    skewed = [i for i, label in enumerate(y.tolist()) if label == 0][:5] + [
        i for i, label in enumerate(y.tolist()) if label == 1
    ][:40]
    site = private_site(
        digits,
        DPSection(noise_multiplier=0.0, max_grad_norm=1e-3),
        dp_recipe=DPRecipeSection(lr=1.0, ema_decay=0.0, augmult=1, batch_size=64),
        class_weighted=True,
    )
    site.recipe.class_scale = torch.tensor([1.0, 5 / 40] + [1.0] * 8)
    xs, ys = x[skewed], y[skewed]
    norms = {}
    for label in (0, 1):
        torch.manual_seed(0)
        state = {k: v.clone() for k, v in site.state_dict().items()}
        one = xs[ys == label][:1]
        norms[label] = float(_step_delta(site, one, ys[ys == label][:1]).norm())
        site.load_state_dict(state)
    assert norms[0] == pytest.approx(1e-3 / 64, rel=1e-3)  # clipped to C, weight 1
    assert norms[1] == pytest.approx(1e-3 / 64 * 5 / 40, rel=1e-3)  # then scaled by 5/40


def test_noise_is_added_to_the_private_gradient(digits):
    x, y = next(digits_batches(digits, 64))
    plain = private_site(digits, DPSection(noise_multiplier=0.0))
    noisy = private_site(digits, DPSection(noise_multiplier=2.0))
    noisy.load_state_dict(plain.state_dict())
    torch.manual_seed(0)
    g0 = plain.compute_gradient(x, y)
    torch.manual_seed(0)
    g1 = noisy.compute_gradient(x, y)
    differences = [float((g0[k] - g1[k]).abs().max()) for k in g0]
    assert max(differences) > 1e-3  # noise of std 2 x 1.0 / 256 per coordinate
    total = float(torch.cat([v.flatten() for v in g0.values()]).norm())
    assert total <= 1.0 * len(y) / 256 * (1 + 1e-4)  # the sum of clipped gradients / B


def test_the_non_private_recipe_trains_the_same_steps_without_noise(digits):
    """training.recipe: dp alone: the same Poisson sampling and steps as the
    private recipe (its draws seeded, the private ones secret), no clipping,
    no noise, no accountant."""
    section = TrainingSection(
        recipe="dp", max_steps_per_epoch=3, dp_recipe=DPRecipeSection(epochs=1)
    )
    model = create_model("small_cnn_ws", in_chans=1, num_classes=10, image_size=28)
    site = LocalSite(model, digits, section, model_name="small_cnn_ws")
    assert site.dp is None and site.recipe is not None
    assert site.optimizer.__class__.__name__ == "SGD"
    private = private_site(digits, DPSection(noise_multiplier=1.0), steps=3)
    assert site.steps_per_round() == private.steps_per_round() == 3
    assert site.recipe.sample_rate == private.recipe.sample_rate
    fit = site.train_epochs()
    assert fit["steps"] == 3 and math.isfinite(fit["loss"])


def digits_batches(digits, size: int):
    images, labels = digits.train.tensors
    yield images[:size], labels[:size]


def test_batchnorm_is_refused_with_the_fix(digits):
    model = create_model("small_cnn", in_chans=1, num_classes=10, image_size=28)
    section = TrainingSection(dp=DPSection(noise_multiplier=1.0))
    with pytest.raises(TrainingError) as caught:
        LocalSite(model, digits, section, rounds=3, model_name="small_cnn")
    assert caught.value.reason == "dp_unsupported_model"
    assert "BatchNorm" in str(caught.value) and "small_cnn_ws" in str(caught.value)
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


@pytest.mark.parametrize("model", ["small_cnn_gn", "scatternet_linear"])
def test_check_accepts_the_groupnorm_cnn(tmp_path: Path, capsys, model):
    provision(
        tmp_path / "fed",
        ["a"],
        protocol={"name": "fedsgdp2p", "rounds": 2},
        overrides={"model": {"name": model}, "training": {"dp": {"target_epsilon": 8}}},
    )
    assert main(["check", "--config", str(tmp_path / "fed" / "a" / "site.yaml")]) == 0
    out = capsys.readouterr().out
    assert "# ok" in out
    # check shows the recipe training.dp trains with
    assert "# training recipe in effect: recipe: dp (De et al. 2022); sampling: poisson" in out
    assert "epochs_per_round: 4" in out and "class_balance: after_clipping" in out


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


def test_per_sample_gradients_of_the_weight_standardized_cnn_are_exact():
    """Opacus has no rule for WSConv2d and takes its per-sample gradients with
    functorch, through the standardization: they must equal the gradients of
    each image alone, or clipping would bound the wrong vector."""
    torch.manual_seed(0)
    model = create_model("small_cnn_ws", in_chans=1, num_classes=2, image_size=28)
    assert_per_sample_gradients_exact(model, torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 1, 0]))


def assert_per_sample_gradients_exact(model: torch.nn.Module, x, y) -> None:
    """Opacus's per-sample gradients of `model` on the batch (x, y) equal the
    gradient of each image alone."""
    import warnings

    from opacus import GradSampleModule

    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    hooked = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    torch.nn.functional.cross_entropy(hooked(x), y).backward()
    per_sample = {n: p.grad_sample.clone() for n, p in model.named_parameters()}
    hooked._close()
    for i in range(len(y)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            assert torch.allclose(p.grad, per_sample[name][i], atol=1e-5), name


def test_the_noise_and_the_sampling_cannot_be_regenerated_from_the_site_yaml(digits):
    """An adversary who knows a site's configuration (training.seed included,
    usually the default) and its code rebuilds the site and replays the same
    random state: the noise it draws must not be the noise the site added, or
    it could subtract it from what the site sent. Before issue 33 both came
    from torch's global generator, which the site seeds with training.seed:
    the two gradients below were equal."""
    x, y = next(digits_batches(digits, 64))
    grads, batches = [], []
    for _ in range(2):
        torch.manual_seed(0)  # the state the attacker can reproduce
        site = private_site(digits, DPSection(noise_multiplier=1.0))
        torch.manual_seed(0)
        grads.append(site.compute_gradient(x, y))
        batches.append(site.recipe.poisson_batch()[1])
    gap = max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0])
    assert gap > 1e-3  # noise of std 1 x 1.0 / 256 per coordinate differs
    assert not torch.equal(batches[0], batches[1])  # nor can it tell which images a step took
    # the non-private recipe still repeats with its seed
    plain = [
        LocalSite(
            create_model("small_cnn_ws", in_chans=1, num_classes=10, image_size=28),
            digits,
            TrainingSection(recipe="dp"),
            model_name="small_cnn_ws",
        ).recipe.poisson_batch()[1]
        for _ in range(2)
    ]
    assert torch.equal(plain[0], plain[1])


# ---------------------------------------------------------------------- red-team findings (issue 33)


def test_a_resume_keeps_the_price_each_step_was_paid_at(digits, tmp_path):
    """A site.yaml changed between two starts (here a ten times smaller noise
    target) must not re-price the steps already taken: before, the resumed
    accountant charged them at the new σ and reported ε 0.70 for 5.9 spent.
    The ledger is written at every step, so steps a crash interrupted after
    their results left are counted too."""
    ledger = tmp_path / "dp_ledger.json"
    first = private_site(digits, DPSection(target_epsilon=8.0))
    first.dp.keep_ledger(ledger)
    first.train_epochs()
    spent = first.dp.epsilon
    assert json.loads(ledger.read_text())["history"][0][2] == first.dp.steps == 4
    again = private_site(digits, DPSection(target_epsilon=1.0))  # σ planned for ε 1
    assert again.dp.noise_multiplier > 2 * first.dp.noise_multiplier
    again.dp.keep_ledger(ledger)  # what the node does at start
    assert again.dp.epsilon == pytest.approx(spent, rel=1e-12)
    again.dp.restore(first.dp.history()[:0])  # an older checkpoint does not undo the ledger
    assert again.dp.epsilon == pytest.approx(spent, rel=1e-12)
    again.train_epochs()
    assert again.dp.epsilon > spent


def test_a_dp_site_refuses_to_resume_a_model_trained_without_dp(digits):
    """Before, a checkpoint written without training.dp resumed with ε 0 and a
    model card claiming DP-SGD for a model trained in the clear."""
    from p2pfl.config.protocols import FedAvgP2PParams
    from protocols.fedavgp2p import FedAvgP2P

    class Ctx:
        me = "a"

        def durable_file(self, name):
            return None

        def restore(self):
            return {"protocol": "fedavgp2p", "round": 5, "model": {}, "dp_steps": None}

    site = private_site(digits, DPSection(target_epsilon=8.0))
    with pytest.raises(TrainingError) as caught:
        FedAvgP2P(FedAvgP2PParams(name="fedavgp2p", rounds=10)).resume(Ctx(), site)
    assert caught.value.reason == "dp_resume_unprivate"


def test_an_empty_poisson_batch_is_a_noise_only_step(digits):
    """With a tiny expected batch some Poisson batches are empty: the step
    still happens (and is counted), it does not crash in GroupNorm."""
    site = private_site(
        digits, DPSection(noise_multiplier=1.0), dp_recipe=DPRecipeSection(batch_size=2, epochs=1)
    )
    empty = (digits.train.tensors[0][:0], digits.train.tensors[1][:0])
    site.optimizer.zero_grad(set_to_none=True)
    assert math.isnan(site.recipe.accumulate(*empty))
    site.optimizer.step()
    site.dp.step_taken()
    assert site.dp.steps == 1


def test_a_target_epsilon_too_small_to_plan_is_refused_in_one_line(digits):
    with pytest.raises(TrainingError) as caught:
        private_site(digits, DPSection(target_epsilon=1e-6))
    assert caught.value.reason == "dp_budget_too_low"
    assert "raise target_epsilon" in str(caught.value) and "\n" not in str(caught.value)


def test_scatternet_trains_privately_and_exchanges_only_what_trains(digits):
    """scatternet_linear (Tramèr & Boneh 2021): the fixed scattering's filters
    stay out of the state dict (peers exchange and average only GroupNorm and
    the linear layer), Opacus's per-sample gradients equal each image's own,
    and a private step moves only the trained weights."""
    torch.manual_seed(0)
    model = create_model("scatternet_linear", in_chans=1, num_classes=10, image_size=28)
    assert sorted(model.state_dict()) == [
        "classifier.bias",
        "classifier.weight",
        "norm.bias",
        "norm.weight",
    ]
    x, y = torch.randn(3, 1, 28, 28), torch.tensor([0, 4, 9])
    assert_per_sample_gradients_exact(model, x, y)

    # Private training (noise 0: only the clipped gradients move the weights)
    # trains GroupNorm and the linear layer and leaves the scattering as built.
    site = LocalSite(
        create_model("scatternet_linear", in_chans=1, num_classes=10, image_size=28),
        digits,
        TrainingSection(
            dp=DPSection(noise_multiplier=0.0),
            max_steps_per_epoch=2,
            dp_recipe=DPRecipeSection(epochs=1),
        ),
        rounds=2,
        model_name="scatternet_linear",
    )
    filters = {k: v.clone() for k, v in site.model.scattering.named_buffers()}
    features = site.model._scatter(x)
    before = {k: v.clone() for k, v in site.state_dict().items()}
    site.train_epochs()
    after = site.state_dict()
    assert after.keys() == before.keys()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(v, filters[k]) for k, v in site.model.scattering.named_buffers())
    assert torch.equal(site.model._scatter(x), features)
