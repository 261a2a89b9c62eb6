"""Fed-MAE: the masked autoencoder, encoder export into the classifier, and the
peer-to-peer pre-training (+ chained fine-tuning) on an in-memory federation."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from p2pfl.config import FedBEiTParams, FedMAEParams, ModelSection, SiteConfig
from p2pfl.learning.data import load_site_data
from p2pfl.learning.data.partition import partition_dataset
from p2pfl.learning.mae import (
    MaskDraw,
    create_mae,
    mae_patch_size,
    masked_count,
    masked_patch_loss,
    patchify,
    random_masking,
    save_encoder,
    unpatchify,
)
from p2pfl.learning.models import ModelError
from p2pfl.learning.site_model import create_site_model
from protocols.fedmae import RECONSTRUCTION_PNG, build_mae_site
from protocols.memory import InMemoryNetwork, SimulationResult, simulate, simulation_configs

VIT = "vit_tiny_patch16_224"
SITES = ["site0", "site1"]
TINY_MAE = {"encoder_depth": 1, "decoder_dim": 32, "decoder_depth": 1}


# ---------------------------------------------------------------------- patches and masks


@pytest.mark.parametrize(
    ("channels", "size", "patch"), [(1, 28, 4), (3, 16, 2), (1, 8, 2), (4, 12, 3)]
)
def test_patchify_then_unpatchify_gives_the_images_back(
    channels: int, size: int, patch: int
) -> None:
    images = torch.randn(3, channels, size, size)
    patches = patchify(images, patch)
    assert patches.shape == (3, (size // patch) ** 2, patch * patch * channels)
    # patch 0 is the top-left block, patch 1 the block to its right
    top_left = images[0, :, :patch, :patch].permute(1, 2, 0).reshape(-1)
    right = images[0, :, :patch, patch : 2 * patch].permute(1, 2, 0).reshape(-1)
    assert torch.equal(patches[0, 0], top_left)
    assert torch.equal(patches[0, 1], right)
    assert torch.equal(unpatchify(patches, patch, channels), images)


def test_patch_size_leaves_at_least_four_values_per_patch() -> None:
    assert mae_patch_size(28, 1) == 4
    assert mae_patch_size(224, 3) == 16
    assert mae_patch_size(8, 1) == 2  # a 1-pixel grey patch normalises to nothing


@pytest.mark.parametrize(("num_patches", "ratio"), [(49, 0.6), (16, 0.75), (196, 0.4), (4, 0.99)])
def test_random_masking_masks_the_configured_share_of_every_image(
    num_patches: int, ratio: float
) -> None:
    draw = random_masking(32, num_patches, ratio, generator=torch.Generator().manual_seed(0))
    expected = min(num_patches - 1, max(1, round(ratio * num_patches)))
    assert masked_count(num_patches, ratio) == expected
    assert draw.mask.shape == (32, num_patches)
    assert torch.all(draw.mask.sum(dim=1) == expected)
    assert draw.keep.shape == (32, num_patches - expected)
    for row in range(32):
        visible = set(draw.keep[row].tolist())
        assert visible == set(torch.nonzero(draw.mask[row] == 0).flatten().tolist())
        # restore undoes the [visible, masked] ordering
        order = torch.cat([draw.keep[row], torch.nonzero(draw.mask[row] == 1).flatten()])
        assert sorted(order.tolist()) == list(range(num_patches))
    assert len({tuple(m.tolist()) for m in draw.mask}) > 1  # each image its own mask


def test_mask_ratio_is_the_share_the_model_hides() -> None:
    model = create_mae(VIT, in_chans=1, image_size=28, mask_ratio=0.6, **TINY_MAE)
    out = model(torch.randn(4, 1, 28, 28), generator=torch.Generator().manual_seed(1))
    assert model.num_patches == 49
    assert torch.all(out.mask.sum(dim=1) == 29)  # round(0.6 * 49)
    assert out.pred.shape == (4, 49, 16)


# ---------------------------------------------------------------------- the loss


def test_loss_counts_only_the_masked_patches() -> None:
    torch.manual_seed(0)
    target = torch.randn(2, 16, 12)
    mask = torch.zeros(2, 16)
    mask[:, ::3] = 1.0
    pred = torch.randn(2, 16, 12, requires_grad=True)
    loss = masked_patch_loss(pred, target, mask)
    loss.backward()
    assert pred.grad is not None
    visible = mask == 0
    assert torch.all(pred.grad[visible] == 0)
    assert torch.all(pred.grad[~visible].abs().sum(dim=-1) > 0)

    # anything predicted for a visible patch leaves the loss unchanged ...
    other = pred.detach().clone()
    other[visible] = 100.0
    assert torch.allclose(masked_patch_loss(other, target, mask), loss.detach())
    # ... a masked patch predicted exactly right lowers it
    better = pred.detach().clone()
    centred = target - target.mean(-1, keepdim=True)
    normalised = centred / (target.var(-1, keepdim=True) + 1e-6).sqrt()
    better[~visible] = normalised[~visible]
    assert masked_patch_loss(better, target, mask) < 1e-6 < float(loss.detach())


def test_loss_targets_per_patch_normalised_pixels() -> None:
    torch.manual_seed(0)
    target = torch.randn(2, 9, 16)
    pred = torch.randn(2, 9, 16)
    mask = torch.ones(2, 9)
    scale = torch.rand(2, 9, 1) * 5 + 0.5
    shift = torch.randn(2, 9, 1) * 3
    # brighter or higher-contrast patches are the same target
    assert torch.allclose(
        masked_patch_loss(pred, target * scale + shift, mask),
        masked_patch_loss(pred, target, mask),
        atol=1e-4,
    )


# ---------------------------------------------------------------------- encoder -> classifier


def all_visible(batch: int, num_patches: int) -> MaskDraw:
    order = torch.arange(num_patches).expand(batch, -1)
    return MaskDraw(order, torch.zeros(batch, num_patches), order)


def test_pretrained_encoder_initialises_the_classifier(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mae = create_mae(VIT, in_chans=1, image_size=16, encoder_depth=2, decoder_dim=32)
    with torch.no_grad():  # make the weights unmistakably "trained"
        for param in mae.encoder.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    path = save_encoder(mae, tmp_path / "encoder.pt")

    cfg = ModelSection(name=VIT, pretrained_from=path)
    classifier = create_site_model(cfg, in_chans=1, num_classes=3, image_size=16)
    state = classifier.state_dict()
    encoder_state = mae.encoder.state_dict()
    for key, value in encoder_state.items():
        assert torch.equal(state[key], value), key
    assert set(state) - set(encoder_state) == {"head.weight", "head.bias"}
    assert state["head.weight"].shape == (3, 192)

    # the classifier's features are the average of the encoder's patch tokens
    images = torch.randn(5, 1, 16, 16)
    mae.eval()
    classifier.eval()
    with torch.no_grad():
        tokens = mae.encode(images, all_visible(5, mae.num_patches))
        features = classifier.forward_head(classifier.forward_features(images), pre_logits=True)
        logits = classifier(images)
    assert torch.allclose(features, tokens[:, 1:].mean(dim=1), atol=1e-5)
    assert logits.shape == (5, 3)


def test_pretrained_from_refuses_what_does_not_fit(tmp_path: Path) -> None:
    mae = create_mae(VIT, in_chans=1, image_size=16, **TINY_MAE)
    path = save_encoder(mae, tmp_path / "encoder.pt")
    with pytest.raises(ModelError) as wrong_size:
        create_site_model(
            ModelSection(name=VIT, pretrained_from=path), in_chans=1, num_classes=2, image_size=28
        )
    assert wrong_size.value.reason == "pretrained_mismatch"
    with pytest.raises(ModelError) as not_vit:
        create_site_model(
            ModelSection(name="resnet18", pretrained_from=path),
            in_chans=1,
            num_classes=2,
            image_size=16,
        )
    assert not_vit.value.reason == "mae_needs_vit"
    with pytest.raises(ModelError) as missing:
        create_site_model(
            ModelSection(name=VIT, pretrained_from=tmp_path / "nope.pt"),
            in_chans=1,
            num_classes=2,
            image_size=16,
        )
    assert missing.value.reason == "weights_not_found"
    cnn = create_site_model(
        ModelSection(name="small_cnn"), in_chans=1, num_classes=2, image_size=16
    )
    torch.save(cnn.state_dict(), tmp_path / "cnn.pt")
    with pytest.raises(ModelError) as not_encoder:
        create_site_model(
            ModelSection(name=VIT, pretrained_from=tmp_path / "cnn.pt"),
            in_chans=1,
            num_classes=2,
            image_size=16,
        )
    assert not_encoder.value.reason == "not_an_encoder"


def test_fedmae_params_validate_the_chained_protocol() -> None:
    params = FedMAEParams(name="fedmae", finetune={"name": "fedavgp2p", "rounds": 3})
    assert params.finetune is not None and params.finetune.rounds == 3
    with pytest.raises(ValidationError):
        FedMAEParams(name="fedmae", finetune={"name": "nonsense"})
    with pytest.raises(ValidationError):
        FedMAEParams(name="fedmae", decoder_dim=30, decoder_heads=4)


# ---------------------------------------------------------------------- P2P pre-training


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The embedded digits split between 2 sites, 20% of the labels kept."""
    out = tmp_path_factory.mktemp("digits2")
    partition_dataset("digits", 2, "iid", out, label_fraction=0.2, seed=0)
    return [str(out / f"site_{i}.npz") for i in range(2)]


def configs(sources: list[str], state_root: Path, **protocol: Any) -> list[SiteConfig]:
    return simulation_configs(
        sources,
        names=SITES,
        protocol={"name": "fedmae", "rounds": 3, "fraction": 1.0, **TINY_MAE, **protocol},
        state_root=state_root,
        model={"name": VIT},
        data={"image_size": 8, "augment": "none"},
        training={"epochs": 1, "batch_size": 32, "lr": 3e-3, "device": "cpu"},
    )


def run(cfgs: list[SiteConfig], network: InMemoryNetwork | None = None) -> SimulationResult:
    return asyncio.run(simulate(cfgs, network=network or InMemoryNetwork(inline_train=True)))


@pytest.mark.slow
def test_two_nodes_pretrain_together_and_lower_the_reconstruction_loss(
    sources: list[str], tmp_path: Path
) -> None:
    cfgs = configs(sources, tmp_path / "state", rounds=3)
    assert isinstance(cfgs[0].protocol, FedMAEParams)
    site = build_mae_site(cfgs[0], cfgs[0].protocol)
    initial = site.evaluate("test")["recon_loss"]
    # every local image is used, labelled or not
    data = load_site_data(cfgs[0].data)
    assert data.unlabeled is not None and len(data.unlabeled) > len(data.train)
    assert site.num_train == len(data.train) + len(data.unlabeled)

    result = run(cfgs)
    assert result.errors == {}
    assert result.rounds_completed() == dict.fromkeys(SITES, 3)
    for node in SITES:
        losses = result.metric("recon_loss", node)
        assert losses[3] < losses[1] < initial
        assert losses[3] < 0.85 * initial
        assert result.metric("neighbours", node)[3] == 1  # they did exchange
    assert result.messages_sent("model") == 6  # one autoencoder per node per round

    for cfg in cfgs:
        state_dir = Path(cfg.node.state_dir)
        encoder = torch.load(state_dir / "pretrained_encoder.pt", weights_only=True)
        assert "blocks.0.attn.qkv.weight" in encoder and not any(
            k.startswith("decoder") for k in encoder
        )
        with Image.open(state_dir / RECONSTRUCTION_PNG) as grid:
            assert grid.width > 200 and grid.height > grid.width  # 3 columns, 8 rows


@pytest.mark.slow
def test_chained_finetuning_runs_after_pretraining_and_resumes_in_its_stage(
    sources: list[str], tmp_path: Path
) -> None:
    finetune = {"name": "fedavgp2p", "rounds": 2, "fraction": 1.0}
    network = InMemoryNetwork(inline_train=True, checkpoint_dir=tmp_path / "ckpt")
    first = run(configs(sources, tmp_path / "state", rounds=2, finetune=finetune), network)
    assert first.errors == {}
    for node in SITES:
        assert sorted(first.metric("recon_loss", node)) == [1, 2]
        assert sorted(first.metric("macro_f1", node)) == [3, 4]  # after pre-training
    # fine-tuned classifiers travel under their own kind, autoencoders under "model"
    assert first.messages_sent("finetune.model") == 4
    assert first.messages_sent("model") == 4
    saved = network.saved_state("site0")
    assert saved is not None and saved["stage"] == "finetune"
    classifier = saved["finetune"]["model"]
    encoder = torch.load(tmp_path / "state" / "site0" / "pretrained_encoder.pt", weights_only=True)
    assert set(classifier) == set(encoder) | {"head.weight", "head.bias"}

    # a restarted federation goes on fine-tuning; it does not pre-train again
    again = InMemoryNetwork(inline_train=True, checkpoint_dir=tmp_path / "ckpt")
    second = run(
        configs(sources, tmp_path / "state", rounds=2, finetune={**finetune, "rounds": 3}), again
    )
    assert second.errors == {}
    assert sorted({r["round"] for r in second.records}) == [5]
    assert all("recon_loss" not in r for r in second.records)
    assert second.messages_sent("model") == 0


@pytest.mark.slow
@pytest.mark.parametrize("stated", [True, False], ids=["stated in both", "inherited"])
def test_secure_aggregation_covers_pretraining_and_the_chained_finetuning(
    tmp_path: Path, stated: bool
) -> None:
    """Three sites (a secure sum needs two others): with secure_aggregation no
    plain model travels in either stage, only secure-sum messages, whether the
    fine-tuning section repeats the flag or not (it inherits it: a review found
    the fine-tuned model served in the clear when it did not)."""
    out = tmp_path / "digits3"
    partition_dataset("digits", 3, "iid", out, label_fraction=0.2, seed=0)
    sources = [str(out / f"site_{i}.npz") for i in range(3)]
    names = ["site0", "site1", "site2"]
    finetune = {"name": "fedavgp2p", "rounds": 1, "fraction": 1.0}
    if stated:
        finetune["secure_aggregation"] = True
    cfgs = simulation_configs(
        sources,
        names=names,
        protocol={
            "name": "fedmae",
            "rounds": 1,
            "fraction": 1.0,
            "secure_aggregation": True,
            "finetune": finetune,
            **TINY_MAE,
        },
        state_root=tmp_path / "state",
        model={"name": VIT},
        data={"image_size": 8, "augment": "none"},
        training={
            "epochs": 1,
            "batch_size": 32,
            "lr": 3e-3,
            "device": "cpu",
            "max_steps_per_epoch": 2,
        },
    )
    result = run(cfgs)
    assert result.errors == {}
    assert result.messages_sent("model") == 0
    assert result.messages_sent("finetune.model") == 0
    assert result.messages_sent("secagg") == 3 * 2 * 5  # nodes x contributors x phases
    assert result.messages_sent("finetune.secagg") == 3 * 2 * 5
    for node in names:
        assert result.metric("neighbours", node) == {1: 2, 2: 2}


@pytest.mark.parametrize("protocol", ["fedmae", "fedbeit"])
@pytest.mark.parametrize(
    ("finetune", "refusal"),
    [
        ({"name": "fedsgdp2p", "rounds": 1}, "per-step gradients in the clear"),
        (
            {"name": "fedavgp2p", "rounds": 1, "secure_aggregation": False},
            "says secure_aggregation: false",
        ),
    ],
    ids=["fedsgdp2p", "explicitly off"],
)
def test_a_fine_tuning_stage_secure_aggregation_cannot_cover_is_refused(
    protocol: str, finetune: dict, refusal: str
) -> None:
    """secure_aggregation covers both stages: a fine-tuning stage that would
    serve gradients or models in the clear is a configuration error, in one
    line, for `check` and `run` alike (both validate the site config)."""
    params = FedMAEParams if protocol == "fedmae" else FedBEiTParams
    with pytest.raises(ValidationError, match=refusal):
        params(name=protocol, rounds=1, secure_aggregation=True, finetune=finetune)
    inherited = params(name=protocol, rounds=1, secure_aggregation=True, finetune={"name": "ssfl"})
    assert inherited.finetune is not None and inherited.finetune.secure_aggregation is True
    plain = params(name=protocol, rounds=1, finetune={"name": "fedsgdp2p"})  # no secagg: fine
    assert plain.finetune is not None


@pytest.mark.parametrize("flag", [1, "true", "yes", "on"])
def test_any_true_secure_aggregation_reaches_the_fine_tuning(flag: Any) -> None:
    """A second review: the inheritance acted on the Python value True only,
    before pydantic read 1 or "yes" as true, and params changed in code
    (`model_copy`) skip validation; the stage itself holds the rule too."""
    from protocols.fedmae import FedMAE, FedMAEError

    params = FedMAEParams(
        name="fedmae", rounds=1, secure_aggregation=flag, finetune={"name": "fedavgp2p"}
    )
    assert params.finetune is not None and params.finetune.secure_aggregation is True
    with pytest.raises(ValidationError, match="per-step gradients"):
        FedMAEParams(
            name="fedmae", rounds=1, secure_aggregation=flag, finetune={"name": "fedsgdp2p"}
        )
    plain = FedMAEParams(name="fedmae", rounds=1, finetune={"name": "fedavgp2p"})
    copied = plain.model_copy(update={"secure_aggregation": True})  # no validation
    stages = FedMAE(copied).stages(None)
    assert stages[-1].loop.params.secure_aggregation is True
    sgd = FedMAEParams(name="fedmae", rounds=1, finetune={"name": "fedsgdp2p"})
    with pytest.raises(FedMAEError, match="in the clear"):
        FedMAE(sgd.model_copy(update={"secure_aggregation": True})).stages(None)
