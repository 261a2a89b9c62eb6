"""Metrics (scikit-learn as oracle) and LocalSite training/evaluation."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from p2pfl.config import (
    DataSection,
    ModelSection,
    SiameseSection,
    TrainingSection,
    config_from_dict,
)
from p2pfl.learning import metrics
from p2pfl.learning.data import SiteData, load_site_data, site_data_from_arrays, to_uint8_images
from p2pfl.learning.devices import resolve_device
from p2pfl.learning.errors import TrainingError
from p2pfl.learning.models import create_model
from p2pfl.learning.site_model import create_site_model
from p2pfl.learning.state import DESCRIBED_ALONE
from p2pfl.learning.train import LocalSite, seed_everything
from p2pfl.secure.tensors import dumps, loads

# ---------------------------------------------------------------------- metrics


def _random_case(k: int, n: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    logits = rng.normal(size=(n, k))
    logits[np.arange(n), y] += 1.0  # informative but imperfect
    proba = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return y, proba


@pytest.mark.parametrize("k", [2, 3, 7])
def test_metrics_match_sklearn(k: int) -> None:
    y, proba = _random_case(k, seed=k)
    pred = proba.argmax(1)
    report = metrics.classification_report(y, proba)
    assert report["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert report["balanced_accuracy"] == pytest.approx(skm.balanced_accuracy_score(y, pred))
    assert report["macro_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro"))
    assert report["per_class_f1"] == pytest.approx(
        skm.f1_score(y, pred, average=None, labels=list(range(k))).tolist()
    )
    oracle_auc = (
        skm.roc_auc_score(y, proba[:, 1])
        if k == 2
        else skm.roc_auc_score(y, proba, multi_class="ovr")
    )
    assert report["auc"] == pytest.approx(oracle_auc)


def test_auc_with_ties_and_absent_classes() -> None:
    y = np.array([0, 0, 1, 1, 1, 0])
    score = np.array([0.2, 0.5, 0.5, 0.9, 0.5, 0.1])
    assert metrics.binary_auc(y == 1, score) == pytest.approx(skm.roc_auc_score(y, score))
    assert metrics.binary_auc(np.zeros(4, bool), np.arange(4)) is None
    # a class absent from y_true: macro-F1 averages only classes that occur, F1 vector keeps K entries
    proba = np.array([[0.9, 0.05, 0.05], [0.1, 0.8, 0.1], [0.7, 0.2, 0.1]])
    report = metrics.classification_report(np.array([0, 1, 0]), proba)
    assert report["per_class_f1"] == [1.0, 1.0, 0.0] and report["macro_f1"] == 1.0


def test_calibration_errors_hand_computed() -> None:
    # top-class confidences: 0.95 (right), 0.95 (wrong), 0.55 (right), 0.55 (wrong); 15 bins of width 1/15
    proba = np.array([[0.95, 0.05], [0.05, 0.95], [0.55, 0.45], [0.45, 0.55]])
    y = np.array([0, 0, 0, 0])
    # bin of 0.95: acc 0.5, conf 0.95 -> gap 0.45, weight 2/4
    # bin of 0.55: holds samples 2 (right) and 3 (conf 0.55, wrong): acc 0.5, conf 0.55 -> gap 0.05, weight 2/4
    ece, mce = metrics.calibration_errors(y, proba)
    assert ece == pytest.approx(0.5 * 0.45 + 0.5 * 0.05)
    assert mce == pytest.approx(0.45)
    perfect = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert metrics.expected_calibration_error(np.array([0, 1]), perfect) == pytest.approx(0.0)


# ---------------------------------------------------------------------- LocalSite


@pytest.fixture(scope="module")
def digits_site_data() -> SiteData:
    """One site of about 400 digits at 8 px (the size of the embedded scans)."""
    full = load_site_data(DataSection(source="digits", image_size=8, channels=1), seed=0)
    return site_data_from_arrays(
        (full.train_uint8[:400], full.train_labels[:400]),
        class_names=full.class_names,
        val=(to_uint8_images(full.val.tensors[0]), full.val.tensors[1].numpy()),
        source="digits[:400]",
    )


def _site(data: SiteData, **training: object) -> LocalSite:
    seed_everything(0)
    model = create_model("small_cnn", in_chans=1, num_classes=10, image_size=8)
    return LocalSite(model, data, TrainingSection(**training), augment="weak", device="cpu")


def test_training_raises_macro_f1_well_above_chance(digits_site_data: SiteData) -> None:
    site = _site(digits_site_data, lr=3e-3)
    before = site.evaluate("val")
    history = [site.train_epochs(1) for _ in range(4)]
    after = site.evaluate("val")
    assert site.num_train == 400
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[0]["steps"] == 13 and history[0]["samples"] == 400
    assert before["macro_f1"] < 0.25
    assert after["macro_f1"] > 0.5  # chance is 0.1
    assert after["n"] == len(digits_site_data.val) and len(after["per_class_f1"]) == 10
    with pytest.raises(TrainingError, match="no 'test' split") as err:
        site.evaluate("test")
    assert err.value.reason == "missing_split"


def test_max_steps_per_epoch_is_honoured(digits_site_data: SiteData) -> None:
    site = _site(digits_site_data, max_steps_per_epoch=3)
    assert site.train_epochs(2)["steps"] == 6


def test_gradient_exchange_equals_an_optimizer_step(digits_site_data: SiteData) -> None:
    site_a = _site(digits_site_data, optimizer="sgd", lr=0.1)
    site_b = _site(digits_site_data, optimizer="sgd", lr=0.1)
    site_b.load_state_dict(site_a.state_dict())
    x, y = next(site_a.batches("train"))
    grads = site_a.compute_gradient(x, y)
    assert set(grads) == {n for n, p in site_a.model.named_parameters() if p.requires_grad}
    assert all(g.device.type == "cpu" for g in grads.values())
    site_a.apply_gradient(grads)
    # the ordinary way on the twin
    site_b.model.train()
    site_b.optimizer.zero_grad()
    site_b.loss(x, y).backward()
    site_b.optimizer.step()
    for key, value in site_b.state_dict().items():
        assert torch.allclose(site_a.state_dict()[key], value, atol=1e-6), key
    with pytest.raises(TrainingError, match="gradient names"):
        site_a.apply_gradient({"nope": torch.zeros(1)})


def test_state_and_optimizer_round_trip(digits_site_data: SiteData) -> None:
    site = _site(digits_site_data, max_steps_per_epoch=3)
    site.train_epochs(1)
    state = site.state_dict()
    state["classifier.bias"] += 1.0  # a copy: the model is untouched
    assert not torch.equal(site.model.classifier.bias.detach(), state["classifier.bias"])
    other = _site(digits_site_data, max_steps_per_epoch=3)
    other.load_state_dict(loads(dumps(site.state_dict())))
    other.load_optimizer_state(loads(dumps(site.optimizer_state())))
    x = digits_site_data.val.tensors[0][:20]
    assert torch.equal(site.predict_proba(x), other.predict_proba(x))
    # same state + same optimizer moments + same batch -> same next step
    xb, yb = digits_site_data.train.tensors[0][:32], digits_site_data.train.tensors[1][:32]
    site.apply_gradient(site.compute_gradient(xb, yb))
    other.apply_gradient(other.compute_gradient(xb, yb))
    for key, value in site.state_dict().items():
        assert torch.allclose(other.state_dict()[key], value, atol=1e-6), key
    with pytest.raises(TrainingError, match="does not fit"):
        other.load_state_dict({"classifier.weight": torch.zeros(3, 3)})


def test_model_stats_vector(digits_site_data: SiteData) -> None:
    site = _site(digits_site_data)
    state = site.model.state_dict()
    keys = [k for k in state if not k.endswith("num_batches_tracked")]
    alone = [k for k in keys if state[k].numel() >= DESCRIBED_ALONE]
    stats = site.model_stats_vector()
    assert len(stats) == 2 * len(alone) + (2 if len(alone) < len(keys) else 0)
    weight = state["features.0.weight"].float()
    assert stats[0] == pytest.approx(float(weight.mean()))
    assert stats[1] == pytest.approx(float(weight.std(unbiased=True)))


def test_predict_proba_rows_sum_to_one(digits_site_data: SiteData) -> None:
    site = _site(digits_site_data)
    proba = site.predict_proba(digits_site_data.val.tensors[0][:7])
    assert proba.shape == (7, 10) and proba.dtype == torch.float32
    assert torch.allclose(proba.sum(1), torch.ones(7), atol=1e-5)


def test_siamese_variant_trains_and_beats_chance(digits_site_data: SiteData) -> None:
    seed_everything(0)
    cfg = ModelSection(
        name="small_cnn", siamese=SiameseSection(enabled=True, embedding_dim=16, margin=1.0)
    )
    model = create_site_model(cfg, in_chans=1, num_classes=10, image_size=8)
    site = LocalSite(
        model, digits_site_data, TrainingSection(lr=3e-3), augment="weak", device="cpu"
    )
    assert site.is_siamese
    before = site.evaluate("val")["macro_f1"]
    losses = [site.train_epochs(1)["loss"] for _ in range(4)]
    after = site.evaluate("val")
    assert losses[-1] < losses[0]
    assert after["macro_f1"] > max(0.5, before)
    x, y = next(site.batches("train"))
    grads = site.compute_gradient(x, y)
    assert all(name.startswith("encoder.") for name in grads)


def test_from_config_and_device() -> None:
    raw = {
        "node": {"name": "a"},
        "federation": {"id": "f", "roster": "roster.yaml"},
        "protocol": {"name": "fedavgp2p"},
        "data": {"source": "digits", "image_size": 8, "label_fraction": 0.5},
        "model": {"siamese": {"enabled": True, "embedding_dim": 8}},
        "training": {"device": "cpu", "max_steps_per_epoch": 2},
    }
    site = LocalSite.from_config(config_from_dict(raw, check_files=False))
    assert site.is_siamese and site.num_train == len(site.data.train)
    assert len(site.data.unlabeled) == pytest.approx(site.num_train, abs=10)
    assert site.train_epochs()["steps"] == 2
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(TrainingError, match="no CUDA device"):
            resolve_device("cuda")


def test_timm_backbone_trains_one_step_through_local_site(digits_site_data: SiteData) -> None:
    seed_everything(0)
    model = create_model("resnet18", in_chans=1, num_classes=10, image_size=8)
    site = LocalSite(
        copy.deepcopy(model),
        digits_site_data,
        TrainingSection(max_steps_per_epoch=1, batch_size=4),
        device="cpu",
    )
    result = site.train_epochs(1)
    assert result["steps"] == 1 and np.isfinite(result["loss"])
