"""What a site learns with default settings: class-balanced loss where its
labels are skewed, the learning-rate schedule over the rounds, and the best
model on its own validation split kept next to the latest one."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.baselines import centralized_fedavg, pooled, standalone
from p2pfl.config import TrainingSection
from p2pfl.learning.best import BestModel
from p2pfl.learning.data import site_data_from_arrays
from p2pfl.learning.data.partition import partition_dataset
from p2pfl.learning.evaluate import selection_score, split_report
from p2pfl.learning.models import create_model
from p2pfl.learning.optimizer import lr_factor
from p2pfl.learning.train import LocalSite
from protocols.memory import InMemoryNetwork, simulate, simulation_configs

SITES = ["site0", "site1", "site2"]


def site(labels: np.ndarray, training: TrainingSection) -> LocalSite:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(len(labels), 8, 8, 1), dtype=np.uint8)
    data = site_data_from_arrays((images, labels), class_names=["a", "b", "c"])
    torch.manual_seed(0)
    return LocalSite(
        create_model("small_cnn", in_chans=1, num_classes=3, image_size=8), data, training
    )


# ---------------------------------------------------------------------- class weighting


def test_auto_class_weighting_turns_on_only_for_a_skewed_site() -> None:
    balanced = site(np.arange(90) % 3, TrainingSection())
    skewed = site(np.array([0] * 80 + [1] * 10), TrainingSection())  # class c absent
    assert TrainingSection().class_weighted == "auto"
    assert balanced.class_weight is None
    assert balanced.class_weighting["applied"] is False
    assert balanced.class_weighting["imbalance"] == 1.0
    assert skewed.class_weight is not None
    assert skewed.class_weighting["applied"] is True
    assert skewed.class_weighting["imbalance"] == 8.0  # over the classes present
    assert skewed.class_weighting["weights"] == pytest.approx([45 / 80, 45 / 10, 0.0])
    # just under / over the documented threshold (1.5 by default)
    under = site(np.array([0] * 30 + [1] * 20), TrainingSection())
    over = site(np.array([0] * 31 + [1] * 20), TrainingSection())
    assert (under.class_weighting["applied"], over.class_weighting["applied"]) == (False, True)
    # explicit settings win over the rule
    assert (
        site(np.array([0] * 80 + [1] * 10), TrainingSection(class_weighted=False)).class_weight
        is None
    )
    forced = site(np.arange(90) % 3, TrainingSection(class_weighted=True))
    assert forced.class_weighting == {**forced.class_weighting, "mode": "true", "applied": True}
    stricter = TrainingSection(imbalance_threshold=10.0)
    assert site(np.array([0] * 80 + [1] * 10), stricter).class_weight is None


def test_class_weighted_accepts_auto_true_false_and_nothing_else() -> None:
    for value in ("auto", True, False):
        assert TrainingSection(class_weighted=value).class_weighted == value
    with pytest.raises(ValueError):
        TrainingSection(class_weighted="sometimes")
    with pytest.raises(ValueError):
        TrainingSection(imbalance_threshold=0.5)


# ---------------------------------------------------------------------- learning-rate schedule


def test_lr_schedules_over_the_rounds() -> None:
    cosine = TrainingSection()  # the default: cosine down to 0.1 x lr
    assert [round(lr_factor(cosine, r, 5), 4) for r in range(1, 6)] == [
        1.0,
        round(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 4),
        0.55,
        round(0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2, 4),
        0.1,
    ]
    assert lr_factor(cosine, 1, 1) == 1.0
    assert lr_factor(cosine, 12, 10) == pytest.approx(0.1)  # past the end: the last factor
    step = TrainingSection(lr_schedule="step", lr_step_rounds=2, lr_gamma=0.5)
    assert [lr_factor(step, r, 6) for r in range(1, 7)] == [1, 1, 0.5, 0.5, 0.25, 0.25]
    constant = TrainingSection(lr_schedule="constant")
    assert {lr_factor(constant, r, 10) for r in range(1, 11)} == {1.0}
    with pytest.raises(ValueError):
        lr_factor(cosine, 0, 10)


def test_the_rounds_lr_reaches_the_optimizer_and_survives_a_reset() -> None:
    s = site(np.arange(30) % 3, TrainingSection(lr=0.01))
    s.set_lr_factor(0.25)
    assert s.lr == pytest.approx(0.0025)
    assert [g["lr"] for g in s.optimizer.param_groups] == pytest.approx([0.0025])
    s.reset_optimizer()  # FedER and FedPerl rebuild Adam every round
    assert [g["lr"] for g in s.optimizer.param_groups] == pytest.approx([0.0025])


# ---------------------------------------------------------------------- best model


def test_the_best_model_is_chosen_on_validation_never_on_test() -> None:
    best = BestModel()
    assert best.observe(1, {"macro_f1": 0.9}) == {}  # no validation split: nothing chosen

    def val(score: float, test: float) -> dict[str, float]:
        return {"val_score": score, "val_macro_f1": score, "macro_f1": test}

    assert best.observe(1, val(0.5, 0.4), lambda: {"w": torch.ones(1)})
    # a better test score with a worse validation score does not move it
    figures = best.observe(2, val(0.45, 0.99), lambda: {})
    assert figures["best_round"] == 1 and figures["best_macro_f1"] == 0.4
    # a tie keeps the earlier round
    assert best.observe(3, val(0.5, 0.7))["best_round"] == 1
    figures = best.observe(4, val(0.6, 0.3), lambda: {"w": torch.zeros(1)})
    assert figures == {
        "best_round": 4.0,
        "best_val_macro_f1": 0.6,
        "best_val_score": 0.6,
        "best_macro_f1": 0.3,
    }
    restored = BestModel.restore(best.checkpoint())
    assert restored.figures() == best.figures() and torch.equal(restored.state["w"], torch.zeros(1))
    assert BestModel.restore(None).figures() == {}
    # a checkpoint written before training.select_by (no val_score) chose by macro-F1
    old = {k: v for k, v in best.checkpoint().items() if k != "val_score"}
    assert BestModel.restore(old).val_score == 0.6


def test_a_validation_split_of_one_class_cannot_choose_a_federated_round() -> None:
    """A val split holding one class scores any model that predicts that class
    as perfect: it cannot choose among the federated model's rounds, so every
    round replaces the last, whatever its score, and a restart keeps that rule.
    A model of the site's own (personal, alone) still chooses on it."""

    def val(score: float, test: float, classes: int) -> dict[str, float]:
        return {"val_score": score, "val_macro_f1": score, "macro_f1": test, "val_classes": classes}

    # two classes: the better score chooses, as ever
    best = BestModel(federated=True)
    assert best.observe(1, val(0.9, 0.4, 2))["best_round"] == 1
    assert best.observe(2, val(0.5, 0.8, 2))["best_round"] == 1
    assert not best.follows_latest
    lone = BestModel(federated=True)
    lone.observe(1, val(1.0, 0.4, 1), lambda: {"w": torch.ones(1)})
    figures = lone.observe(2, val(0.2, 0.8, 1), lambda: {"w": torch.zeros(1)})
    assert figures["best_round"] == 2 and figures["best_macro_f1"] == 0.8
    assert figures["best_follows_latest"] == 1.0 and lone.follows_latest
    assert torch.equal(lone.state["w"], torch.zeros(1))
    restored = BestModel.restore(lone.checkpoint(), federated=True)
    assert restored.follows_latest
    assert restored.observe(3, {"val_score": 0.1, "macro_f1": 0.7}, lambda: {})["best_round"] == 3
    # a val split that holds two classes again (new data after a restart) chooses
    assert restored.observe(4, val(0.6, 0.5, 2), lambda: {})["best_round"] == 4
    assert not restored.follows_latest
    assert restored.observe(5, val(0.3, 0.9, 2))["best_round"] == 4
    # a checkpoint of before the rule follows the scores
    old = {k: v for k, v in best.checkpoint().items() if k != "follows_latest"}
    assert not BestModel.restore(old, federated=True).follows_latest
    # the site's own model chooses on its one class
    own = BestModel()
    own.observe(1, val(1.0, 0.4, 1))
    assert own.observe(2, val(0.2, 0.8, 1))["best_round"] == 1 and not own.follows_latest


def test_the_balanced_loss_weighs_each_class_alike_and_lower_wins() -> None:
    """training.select_by balanced_loss: the mean over the classes present of
    each class's mean negative log-likelihood, computed by hand here; as a
    selection score it is negated, so that the lower loss wins."""
    proba = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    labels = torch.tensor([0, 0, 0, 1])
    report = split_report(proba, labels, 2, "val")
    class0 = -(math.log(0.9) + math.log(0.8) + math.log(0.6)) / 3
    class1 = -math.log(0.7)
    assert report["balanced_loss"] == pytest.approx((class0 + class1) / 2)
    assert report["loss"] == pytest.approx((3 * class0 + class1) / 4)
    assert selection_score(report, "balanced_loss") == pytest.approx(-(class0 + class1) / 2)
    assert selection_score(report, "macro_f1") == report["macro_f1"]
    with pytest.raises(ValueError, match="select_by"):
        selection_score(report, "accuracy")
    # a diverged model's NaN loss is no score: a NaN best would never be beaten
    with np.errstate(invalid="ignore"):  # the calibration bins of NaN probabilities
        diverged = split_report(torch.full((4, 2), float("nan")), labels, 2, "val")
    assert (
        math.isnan(diverged["balanced_loss"]) and selection_score(diverged, "balanced_loss") is None
    )
    assert (
        split_report(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), 2, "val")["balanced_loss"]
        is None
    )


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out: Path = tmp_path_factory.mktemp("digits3")
    partition_dataset("digits", 3, "dirichlet:0.5", out, seed=0)
    return [str(out / f"site_{i}.npz") for i in range(3)]


def configs(sources: list[str], rounds: int):
    return simulation_configs(
        sources,
        names=SITES,
        protocol={"name": "fedavgp2p", "rounds": rounds, "fraction": 0.5},
        data={"image_size": 8, "augment": "none"},
        training={"batch_size": 32, "lr": 3e-3, "device": "cpu", "max_steps_per_epoch": 4},
    )


def test_nodes_report_their_best_model_and_keep_it_across_a_restart(
    sources: list[str], tmp_path: Path
) -> None:
    network = InMemoryNetwork(inline_train=True, checkpoint_dir=tmp_path)
    result = asyncio.run(simulate(configs(sources, rounds=3), network=network))
    assert result.errors == {}
    for node in SITES:
        rows = sorted((r for r in result.records if r["node"] == node), key=lambda r: r["round"])
        # the cosine schedule of the default training section, over the protocol's 3 rounds
        assert [r["lr"] for r in rows] == pytest.approx([3e-3, 3e-3 * 0.55, 3e-3 * 0.1])
        for i, row in enumerate(rows):
            seen = rows[: i + 1]
            chosen = max(seen, key=lambda r: (r["val_macro_f1"], -r["round"]))
            assert row["best_round"] == chosen["round"]
            assert row["best_val_macro_f1"] == chosen["val_macro_f1"]
            assert row["best_macro_f1"] == chosen["macro_f1"]
        saved = network.saved_state(node)
        assert saved is not None and saved["best"]["round"] == rows[-1]["best_round"]
        assert set(saved["best"]["model"]) == set(saved["model"])
    before = {node: network.saved_state(node)["best"] for node in SITES}
    # a restart carries the best model on: round 4 either beats it on val or reports it
    again = InMemoryNetwork(inline_train=True, checkpoint_dir=tmp_path)
    resumed = asyncio.run(simulate(configs(sources, rounds=4), network=again))
    assert resumed.errors == {}
    for row in resumed.records:
        old = before[row["node"]]
        if row["val_macro_f1"] > old["val_macro_f1"]:
            assert row["best_round"] == 4
        else:
            assert (row["best_round"], row["best_macro_f1"]) == (
                old["round"],
                old["test"]["macro_f1"],
            )


def test_baselines_follow_the_same_rules_as_the_nodes(sources: list[str]) -> None:
    cfgs = configs(sources, rounds=2)
    for result in (standalone(cfgs), centralized_fedavg(cfgs), pooled(cfgs)):
        assert {r["node"] for r in result.records} == set(SITES)
        for r in result.records:
            assert 1 <= r["best_round"] <= r["round"], (result.name, r)
            assert 0.0 <= r["best_macro_f1"] <= 1.0
    central = pooled(cfgs)
    # one model trained on every site's data: one best round for all sites
    assert central.name == "pooled" and len(central.records) == 2 * len(SITES)
    assert len({r["best_round"] for r in central.records if r["round"] == 2}) == 1
