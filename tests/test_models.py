"""Model factory, weights loading and the Siamese variant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2pfl.config import ModelSection, SiameseSection
from p2pfl.learning.models import (
    ModelError,
    SiameseNet,
    contrastive_loss,
    create_model,
    list_models,
    vit_patch_size,
)
from p2pfl.learning.site_model import create_site_model


@pytest.mark.parametrize("name", list_models())
def test_every_model_builds_and_runs_at_28px_one_channel(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name, in_chans=1, num_classes=3, image_size=28)
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 3)
    assert torch.isfinite(out).all()


def test_small_cnn_handles_8px_rgb_and_vit_patch_choice() -> None:
    model = create_model("small_cnn", in_chans=3, num_classes=10, image_size=8)
    assert model(torch.randn(4, 3, 8, 8)).shape == (4, 10)
    assert (vit_patch_size(224), vit_patch_size(28), vit_patch_size(8)) == (16, 4, 1)


def test_xavier_init_changes_weights() -> None:
    torch.manual_seed(0)
    default = create_model("small_cnn", in_chans=1, num_classes=4, image_size=8)
    torch.manual_seed(0)
    xavier = create_model("small_cnn", in_chans=1, num_classes=4, image_size=8, init="xavier")
    assert not torch.equal(default.classifier.weight, xavier.classifier.weight)
    assert torch.count_nonzero(xavier.classifier.bias) == 0
    # Xavier-uniform bound for the 64 -> 4 classifier
    bound = (6.0 / (64 + 4)) ** 0.5
    assert float(xavier.classifier.weight.detach().abs().max()) <= bound


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_local_weights_load(tmp_path: Path, suffix: str) -> None:
    torch.manual_seed(1)
    source = create_model("small_cnn", in_chans=1, num_classes=2, image_size=8)
    path = tmp_path / f"w{suffix}"
    if suffix == ".pt":
        torch.save({"state_dict": source.state_dict()}, path)
    else:
        safetensors_torch = pytest.importorskip("safetensors.torch")
        safetensors_torch.save_file(
            {k: v.contiguous() for k, v in source.state_dict().items()}, str(path)
        )
    torch.manual_seed(2)
    loaded = create_model("small_cnn", in_chans=1, num_classes=2, image_size=8, weights=path)
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_weights_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="missing.pt") as err:
        create_model(
            "small_cnn", in_chans=1, num_classes=2, image_size=8, weights=tmp_path / "missing.pt"
        )
    assert err.value.reason == "weights_not_found"
    other = create_model("small_cnn", in_chans=1, num_classes=5, image_size=8)
    torch.save(other.state_dict(), tmp_path / "five.pt")
    with pytest.raises(ModelError, match="five.pt") as err:
        create_model(
            "small_cnn", in_chans=1, num_classes=2, image_size=8, weights=tmp_path / "five.pt"
        )
    assert err.value.reason == "weights_mismatch"


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(
        ModelError,
        match="known models are small_cnn, small_cnn_gn, small_cnn_ws, scatternet_linear, "
        "efficientnet_b0",
    ) as err:
        create_model("resnet9000", in_chans=1, num_classes=2, image_size=28)
    assert err.value.reason == "unknown_model"


def test_contrastive_loss_matches_eq1() -> None:
    e = torch.tensor([[0.0, 0.0], [0.3, 0.4], [3.0, 0.0]])  # d01 = 0.5, d02 = 3, d12 = 2.73
    y = torch.tensor([0, 0, 1])
    # similar pair (0,1): 1/2 * 0.25; dissimilar pairs are beyond margin 1 -> 0
    assert contrastive_loss(e, y, margin=1.0).item() == pytest.approx(0.125, abs=1e-6)
    # margin 4: dissimilar pairs (0,2) and (1,2) contribute 1/2 (4 - d)^2 averaged
    d12 = ((3.0 - 0.3) ** 2 + 0.4**2) ** 0.5
    expected = 0.125 + 0.5 * ((4 - 3.0) ** 2 + (4 - d12) ** 2) / 2
    assert contrastive_loss(e, y, margin=4.0).item() == pytest.approx(expected, abs=1e-5)


def test_siamese_site_model_classifies_by_nearest_prototype() -> None:
    cfg = ModelSection(
        name="small_cnn", siamese=SiameseSection(enabled=True, embedding_dim=8, margin=1.0)
    )
    model = create_site_model(cfg, in_chans=1, num_classes=3, image_size=8)
    assert isinstance(model, SiameseNet)
    assert "prototypes" not in model.state_dict()  # prototypes stay local
    model.eval()
    x = torch.randn(6, 1, 8, 8)
    with torch.no_grad():
        emb = model.embed(x)
        assert torch.allclose(emb.norm(dim=1), torch.ones(6), atol=1e-5)
        model.set_prototypes(emb[:2], torch.tensor([0, 2]))  # class 1 has no prototype
        proba = torch.softmax(model(x), dim=1)
    assert proba[:2].argmax(1).tolist() == [0, 2]
    assert float(proba[:, 1].max()) < 1e-6
