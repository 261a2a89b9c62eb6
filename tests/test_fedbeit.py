"""Fed-BEiT: blockwise masking, the masked-token loss, the tokenizer, encoder
export into the classifier, and the peer-to-peer tokenizer + pre-training
(+ chained fine-tuning) on an in-memory federation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import ndimage

from bench.localfed import LocalFederation
from node.provision import provision
from p2pfl.config import DataSection, FedBEiTParams, SiteConfig
from p2pfl.learning.beit import blockwise_mask, create_beit, mask_blocks, min_block_patches
from p2pfl.learning.data import load_site_data
from p2pfl.learning.data.partition import partition_dataset
from p2pfl.learning.mae import create_pretrained_classifier, save_encoder
from p2pfl.learning.models import ModelError
from p2pfl.learning.tokenizer import VQTokenizer, codebook_usage, load_tokenizer, save_tokenizer
from protocols.fedbeit import TOKEN_MAPS_PNG, TokenizerStage, build_beit_site
from protocols.memory import InMemoryNetwork, SimulationResult, simulate, simulation_configs

VIT = "vit_tiny_patch16_224"
SITES = ["site0", "site1"]
TINY = {"encoder_depth": 1, "codebook_size": 32, "code_dim": 8, "tokenizer_hidden": 16}


# ---------------------------------------------------------------------- blockwise masking


@pytest.mark.parametrize("grid", [4, 7, 14])
def test_blockwise_masking_masks_at_most_the_ratio_and_close_to_it(grid: int) -> None:
    rng = np.random.default_rng(0)
    target = round(0.4 * grid * grid)
    counts = [int(blockwise_mask(grid, grid, 0.4, rng).sum()) for _ in range(300)]
    assert max(counts) <= target  # "at most 40 %", as BEiT
    assert np.mean(counts) >= 0.9 * target
    assert min(counts) >= 1


def test_blocks_have_beits_minimum_size_and_aspect_ratio() -> None:
    """Every block: at least 16 patches on BEiT's 14 x 14 grid (4 on 7 x 7), aspect
    ratio in [0.3, 1/0.3], never as wide or tall as the grid; the mask is the
    union of the blocks."""
    assert min_block_patches(196) == 16 and min_block_patches(49) == 4
    rng = np.random.default_rng(1)
    shapes = set()
    for grid, smallest in ((14, 16), (7, 4)):
        for _ in range(200):
            mask, blocks = mask_blocks(grid, grid, 0.4, rng)
            union = np.zeros_like(mask)
            for top, left, h, w in blocks:
                assert h * w >= smallest
                assert 0.3 - 1e-9 <= h / w <= 1 / 0.3 + 1e-9
                assert h < grid and w < grid
                assert top + h <= grid and left + w <= grid
                union[top : top + h, left : left + w] = True
                shapes.add((h > w) - (h < w))
            assert np.array_equal(union, mask)
    assert shapes == {-1, 0, 1}  # tall, square and wide blocks


def test_masks_are_made_of_blocks_not_scattered_patches() -> None:
    rng = np.random.default_rng(2)
    sizes = []
    for _ in range(200):
        labels, n = ndimage.label(blockwise_mask(14, 14, 0.4, rng))
        sizes += [int((labels == i).sum()) for i in range(1, n + 1)]
    assert min(sizes) >= 16  # every connected masked region holds a whole block


# ---------------------------------------------------------------------- the masked-token loss


def test_loss_counts_only_the_masked_patches() -> None:
    """Zero gradient on the visible patches' representations, and the loss does
    not change when the visible patches' tokens do."""
    torch.manual_seed(0)
    model = create_beit(VIT, in_chans=1, image_size=28, codebook_size=64, encoder_depth=1)
    images = torch.randn(4, 1, 28, 28)
    tokens = torch.randint(0, 64, (4, 49))
    mask = torch.from_numpy(
        np.stack(
            [blockwise_mask(7, 7, 0.4, np.random.default_rng(i)).reshape(-1) for i in range(4)]
        )
    )
    captured: dict[str, torch.Tensor] = {}

    def keep(_module: Any, _inputs: Any, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.retain_grad()
            captured["h"] = out

    model.encoder.norm.register_forward_hook(keep)
    out = model(images, tokens, mask)
    out.loss.backward()
    grad = captured["h"].grad[:, 1:]  # patch positions (the class token is first)
    assert torch.all(grad[~mask] == 0)
    assert grad[mask].abs().sum(dim=-1).min() > 0

    other = tokens.clone()
    other[~mask] = (other[~mask] + 1) % 64
    with torch.no_grad():
        assert torch.allclose(model(images, other, mask).loss, out.loss.detach())
        changed = tokens.clone()
        changed[mask] = (changed[mask] + 1) % 64
        assert not torch.allclose(model(images, changed, mask).loss, out.loss.detach())


def test_masked_patches_are_hidden_from_the_encoder() -> None:
    """What is under a masked patch does not reach the representations."""
    torch.manual_seed(0)
    model = create_beit(VIT, in_chans=1, image_size=28, codebook_size=16, encoder_depth=1).eval()
    mask = torch.from_numpy(blockwise_mask(7, 7, 0.4, np.random.default_rng(0)).reshape(1, -1))
    a = torch.randn(1, 1, 28, 28)
    b = a.clone()
    pixel_mask = mask.reshape(1, 1, 7, 7).repeat_interleave(4, 2).repeat_interleave(4, 3)
    b[pixel_mask] = torch.randn(int(pixel_mask.sum()))
    with torch.no_grad():
        assert torch.allclose(
            model.patch_representations(a, mask), model.patch_representations(b, mask), atol=1e-6
        )


# ---------------------------------------------------------------------- the tokenizer


def digits_images() -> torch.Tensor:
    data = load_site_data(DataSection(source="digits", image_size=8))
    return data.train.tensors[0]


def test_tokenizer_learns_to_reconstruct_from_its_tokens_and_uses_its_codebook() -> None:
    torch.manual_seed(0)
    images = digits_images()
    model = VQTokenizer(in_chans=1, patch_size=2, codebook_size=64, code_dim=8, hidden=32)
    model.restart_generator = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(0)

    def round_trip_error() -> float:
        with torch.no_grad():
            return float((model.decode_tokens(model.tokens(images)) - images).pow(2).mean())

    errors = [round_trip_error()]
    for step in range(1, 301):
        batch = images[torch.randint(len(images), (64,), generator=gen)]
        loss = model.train()(batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            model.eval()
            errors.append(round_trip_error())
    assert errors[1] < 0.7 * errors[0]
    assert errors[3] < errors[1]
    usage = codebook_usage(model.tokens(images), 64)
    assert usage["codes_used"] > 0.5  # dead codes were restarted
    assert usage["perplexity"] > 16


def test_codebook_usage_is_k_when_uniform_and_one_when_collapsed() -> None:
    assert codebook_usage(torch.arange(8).repeat(5), 8) == {
        "perplexity": pytest.approx(8.0),
        "codes_used": 1.0,
    }
    assert codebook_usage(torch.zeros(40, dtype=torch.int64), 8) == {
        "perplexity": pytest.approx(1.0),
        "codes_used": 0.125,
    }


def test_tokenizer_file_round_trips_and_bad_files_are_refused(tmp_path: Path) -> None:
    model = VQTokenizer(in_chans=1, patch_size=4, codebook_size=40, code_dim=6, hidden=12)
    path = save_tokenizer(model, tmp_path / "tok.pt")
    loaded = load_tokenizer(path, in_chans=1, image_size=28)
    assert (loaded.codebook_size, loaded.code_dim, loaded.patch_size) == (40, 6, 4)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)

    with pytest.raises(ModelError) as missing:
        load_tokenizer(tmp_path / "nope.pt", in_chans=1, image_size=28)
    assert missing.value.reason == "tokenizer_not_found"
    assert "model.tokenizer_from" in str(missing.value)

    beit = create_beit(VIT, in_chans=1, image_size=28, codebook_size=8, encoder_depth=1)
    encoder = save_encoder(beit, tmp_path / "encoder.pt")
    with pytest.raises(ModelError) as wrong:
        load_tokenizer(encoder, in_chans=1, image_size=28)
    assert wrong.value.reason == "not_a_tokenizer"
    assert "codebook" in str(wrong.value)

    with pytest.raises(ModelError) as other_images:
        load_tokenizer(path, in_chans=3, image_size=28)
    assert other_images.value.reason == "tokenizer_mismatch"

    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(ModelError) as corrupt:
        load_tokenizer(tmp_path / "garbage.pt", in_chans=1, image_size=28)
    assert corrupt.value.reason == "corrupt_weights"


# ---------------------------------------------------------------------- encoder export


def test_beit_encoder_loads_one_to_one_into_the_classifier(tmp_path: Path) -> None:
    torch.manual_seed(0)
    beit = create_beit(VIT, in_chans=1, image_size=28, codebook_size=32, encoder_depth=2)
    path = save_encoder(beit, tmp_path / "encoder.pt")
    saved = torch.load(path, weights_only=True)
    assert not any(k.startswith(("token_head", "mask_token")) for k in saved)
    classifier = create_pretrained_classifier(VIT, path, in_chans=1, num_classes=2, image_size=28)
    state = classifier.state_dict()
    assert set(state) == set(saved) | {"head.weight", "head.bias"}
    for key, value in saved.items():
        assert torch.equal(state[key], value), key


# ---------------------------------------------------------------------- the federation


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("digits2")
    partition_dataset("digits", 2, "iid", out, label_fraction=0.2, seed=0)
    return [str(out / f"site_{i}.npz") for i in range(2)]


def configs(
    sources: list[str], state_root: Path, model: dict[str, Any] | None = None, **protocol: Any
) -> list[SiteConfig]:
    return simulation_configs(
        sources,
        names=SITES,
        protocol={
            "name": "fedbeit",
            "rounds": 3,
            "tokenizer_rounds": 3,
            "fraction": 1.0,
            **TINY,
            **protocol,
        },
        state_root=state_root,
        model={"name": VIT, **(model or {})},
        data={"image_size": 8, "augment": "none"},
        training={"epochs": 1, "batch_size": 32, "lr": 3e-3, "device": "cpu"},
    )


def run(cfgs: list[SiteConfig], network: InMemoryNetwork | None = None) -> SimulationResult:
    return asyncio.run(simulate(cfgs, network=network or InMemoryNetwork(inline_train=True)))


@pytest.mark.slow
def test_two_nodes_train_one_tokenizer_then_lower_the_token_cross_entropy(
    sources: list[str], tmp_path: Path
) -> None:
    finetune = {"name": "fedavgp2p", "rounds": 1, "fraction": 1.0}
    network = InMemoryNetwork(inline_train=True, checkpoint_dir=tmp_path / "ckpt")
    cfgs = configs(sources, tmp_path / "state", rounds=4, finetune=finetune)
    result = run(cfgs, network)
    assert result.errors == {}
    for node in SITES:
        tokenizer = result.metric("tokenizer_recon_loss", node)
        assert sorted(tokenizer) == [1, 2, 3]
        assert tokenizer[3] < tokenizer[1]
        assert result.metric("codebook_used", node)[3] > 0.4
        tokens = result.metric("token_loss", node)
        assert sorted(tokens) == [4, 5, 6, 7]  # after the tokenizer's rounds
        assert tokens[7] < tokens[4] < np.log(32)  # below guessing among 32 codes
        assert sorted(result.metric("macro_f1", node)) == [8]
        assert all(n == 1 for n in result.metric("neighbours", node).values())
    assert result.messages_sent("tokenizer.model") == 6
    assert result.messages_sent("model") == 8
    assert result.messages_sent("finetune.model") == 2

    # the last tokenizer round averaged both: one tokenizer for the federation
    a, b = (
        torch.load(tmp_path / "state" / node / "tokenizer.pt", weights_only=True) for node in SITES
    )
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
    with Image.open(tmp_path / "state" / "site0" / TOKEN_MAPS_PNG) as grid:
        assert grid.height > grid.width > 200  # 3 columns, 8 rows

    # pre-training starts above what it ends at (the first round already trained)
    cfg = cfgs[0]
    assert isinstance(cfg.protocol, FedBEiTParams)
    fresh = build_beit_site(cfg, cfg.protocol, tmp_path / "state" / "site0" / "tokenizer.pt")
    assert fresh.evaluate("test")["token_loss"] > result.metric("token_loss", "site0")[7]

    # a restarted federation resumes fine-tuning: no tokenizer, no pre-training
    again = InMemoryNetwork(inline_train=True, checkpoint_dir=tmp_path / "ckpt")
    second = run(
        configs(sources, tmp_path / "state", rounds=4, finetune={**finetune, "rounds": 2}), again
    )
    assert second.errors == {}
    assert sorted({r["round"] for r in second.records}) == [9]
    assert second.messages_sent("tokenizer.model") == 0 and second.messages_sent("model") == 0


def test_the_last_tokenizer_round_averages_with_every_peer() -> None:
    params = FedBEiTParams(name="fedbeit", rounds=5, tokenizer_rounds=3, fraction=0.5)
    stage = TokenizerStage(params)
    ctx = SimpleNamespace(roster=lambda: [f"n{i}" for i in range(9)])
    assert stage.params.rounds == 3
    assert [stage.neighbours_wanted(ctx, r) for r in (1, 2, 3)] == [4, 4, 8]  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_supplied_tokenizer_skips_the_tokenizer_stage(sources: list[str], tmp_path: Path) -> None:
    tokenizer = save_tokenizer(
        VQTokenizer(in_chans=1, patch_size=2, codebook_size=24, code_dim=8, hidden=16),
        tmp_path / "site_tokenizer.pt",
    )
    cfgs = configs(sources, tmp_path / "state", model={"tokenizer_from": str(tokenizer)}, rounds=2)
    result = run(cfgs)
    assert result.errors == {}
    assert result.messages_sent("tokenizer.model") == 0
    for node in SITES:
        assert sorted(result.metric("token_loss", node)) == [1, 2]  # no tokenizer rounds
        assert not (tmp_path / "state" / node / "tokenizer.pt").exists()


def test_a_missing_supplied_tokenizer_stops_the_node_with_the_fix(
    sources: list[str], tmp_path: Path
) -> None:
    cfgs = configs(
        sources, tmp_path / "state", model={"tokenizer_from": str(tmp_path / "gone.pt")}, rounds=1
    )
    result = run(cfgs)
    assert set(result.errors) == set(SITES)
    message = str(result.first_error())
    assert "gone.pt" in message and "model.tokenizer_from" in message


@pytest.mark.slow
def test_secure_aggregation_covers_the_tokenizer_and_the_pretraining(tmp_path: Path) -> None:
    """Three sites (a secure sum needs two others): with secure_aggregation no
    plain tokenizer or pre-trainer travels, only secure-sum messages; the last
    tokenizer round's secure sum covers every peer, so the tokenizers agree."""
    out = tmp_path / "digits3"
    partition_dataset("digits", 3, "iid", out, label_fraction=0.2, seed=0)
    sources = [str(out / f"site_{i}.npz") for i in range(3)]
    names = ["site0", "site1", "site2"]
    cfgs = simulation_configs(
        sources,
        names=names,
        protocol={
            "name": "fedbeit",
            "rounds": 1,
            "tokenizer_rounds": 2,
            "fraction": 1.0,
            "secure_aggregation": True,
            **TINY,
        },
        state_root=tmp_path / "state",
        model={"name": VIT},
        data={"image_size": 8, "augment": "none"},
        training={"batch_size": 32, "lr": 3e-3, "device": "cpu", "steps_per_round": 2},
    )
    result = run(cfgs)
    assert result.errors == {}
    assert result.messages_sent("model") == 0
    assert result.messages_sent("tokenizer.model") == 0
    per_round = 3 * 2 * 5  # nodes x contributors x phases
    assert result.messages_sent("tokenizer.secagg") == 2 * per_round
    assert result.messages_sent("secagg") == per_round
    for node in names:
        assert result.metric("neighbours", node) == {1: 2, 2: 2, 3: 2}
    first = torch.load(tmp_path / "state" / "site0" / "tokenizer.pt", weights_only=True)
    for node in names[1:]:
        other = torch.load(tmp_path / "state" / node / "tokenizer.pt", weights_only=True)
        for key in first:
            assert torch.allclose(first[key], other[key], atol=1e-5), key


@pytest.mark.slow
def test_real_nodes_run_every_stage_over_the_transport(tmp_path: Path) -> None:
    """Two p2pfl-node processes on loopback: tokenizer, pre-training and the
    chained fine-tuning, each stage's models signed, sent and verified by the
    daemons; every round of every stage logged; one tokenizer for both."""
    fast = {
        "transport": {"heartbeat_s": 0.3, "suspect_after_s": 1.5, "dead_after_s": 3.0},
        "training": {"max_steps_per_epoch": 2, "threads": 1},
        "data": {"augment": "none", "image_size": 8},
        "model": {"name": VIT},
    }
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={
            "name": "fedbeit",
            "tokenizer_rounds": 2,
            "rounds": 2,
            "fraction": 1.0,
            **TINY,
            "finetune": {"name": "fedavgp2p", "rounds": 1, "fraction": 1.0},
        },
        overrides=fast,
    )
    with LocalFederation(plans, tmp_path / "logs") as fed:
        for name in ("a", "b"):
            fed[name].wait_for(lambda s: s["phase"] == "done", 240, "every stage done")
    tokenizers = []
    for name in ("a", "b"):
        state = tmp_path / "fed" / name / "state"
        rows = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]
        assert "codebook_perplexity" in rows[1] and "token_loss" in rows[3]
        assert "macro_f1" in rows[4]
        assert all(r.get("neighbours") == 1 for r in rows)
        tokenizers.append(torch.load(state / "tokenizer.pt", weights_only=True))
        assert (state / "pretrained_encoder.pt").is_file() and (state / TOKEN_MAPS_PNG).is_file()
    for key in tokenizers[0]:
        assert torch.allclose(tokenizers[0][key], tokenizers[1][key], atol=1e-6), key
