"""The privacy gate: a buffer that copies the site's images never leaves the site.

Attacked with a generator that memorised its training images (trained until its
samples are copies of them): its buffer is refused, the refusal is written to the
state directory and shown on /status, and nothing is sent. A generator trained
with the privacy loss passes. The LPIPS backbone is the explicitly configured
random one (the ImageNet weights are not shipped with the tests); a copy is at
distance ~0 in any feature space, which is what the gate has to catch.

Memorising takes ~18 CPU-s a generator, so each memoriser is trained once per
module (fixtures below) and the module's tests share one xdist worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from genbuffer.audit import MEMBERSHIP_GRID, MEMBERSHIP_JSON
from genbuffer.buffer import buffer_from_bytes, sample_buffer
from genbuffer.checkpoint import GeneratorInfo, load_generator, save_generator
from genbuffer.gate import GATE_GRID, GATE_HISTOGRAM, GATE_JSON, check_buffer, read_decision
from genbuffer.privacy import build_perceptual_distance
from genbuffer.stylegan2 import Generator, GeneratorSpec
from genbuffer.train import train_generator
from genbuffer.trainer import prepare_images
from p2pfl.learning.data.partition import partition_dataset
from protocols.memory import InMemoryNetwork, simulate, simulation_configs
from tests.test_genbuffer import TINY, tiny_section


def memorising_generator(
    images_u8: np.ndarray, labels: np.ndarray, num_classes: int = 2, steps: int = 300
) -> Generator:
    """A generator driven until its samples are copies of its training images: each
    output is pulled to its nearest training image of the same class, and each
    training image pulls its nearest output (so no image is left uncopied).
    300 steps at lr 0.02 reach the loss of 600 at lr 0.01 (0.008) in half the CPU;
    on the digits memoriser both expose 6 of 48 images (200 steps at lr 0.01: 5)."""
    torch.manual_seed(0)
    spec = GeneratorSpec(
        num_classes=num_classes, resolution=16, channels=images_u8.shape[-1], **TINY
    )
    generator = Generator(spec)
    real = prepare_images(images_u8, 16)
    y = torch.as_tensor(labels).long()
    present = y.unique()
    optimizer = torch.optim.Adam(generator.parameters(), lr=0.02)
    for _ in range(steps):
        cls = present.repeat_interleave(max(1, 64 // len(present)))
        out = generator(torch.randn(len(cls), spec.z_dim), cls, noise_mode="const")
        d = (out[:, None] - real[None]).square().flatten(2).mean(2)  # (outputs, N)
        d = d.masked_fill(cls[:, None] != y[None, :], float("inf"))
        loss = d.min(dim=1).values.mean() + d.min(dim=0).values.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return generator.eval()


def digits16(n: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """The first n scikit-learn digits as uint8 (N, 16, 16, 1) images and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.as_tensor(digits.images[:n] * (255 / 16), dtype=torch.float32)[:, None]
    x = torch.nn.functional.interpolate(x, size=16, mode="bilinear", align_corners=False)
    return x.clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy(), digits.target[:n]


def save(generator: Generator, path: Path) -> Path:
    prior = [1 / generator.num_classes] * generator.num_classes
    info = GeneratorInfo(spec=generator.spec, label_prior=prior, stage="test")
    save_generator(path, generator, info)
    return path


pytestmark = pytest.mark.xdist_group("privacy_gate_memorisers")  # each memoriser trained once


@pytest.fixture(scope="module")
def metric():
    return build_perceptual_distance("random")


@pytest.fixture(scope="module")
def digits_memoriser() -> Generator:
    """Memorised: trained far past convergence on six of the first 48 digits."""
    images, labels = digits16(48)
    return memorising_generator(images[:6], labels[:6], num_classes=10)


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 iid digit sites: small sites of ~40 training images (read-only for the tests)."""
    out = tmp_path_factory.mktemp("parts")
    partition_dataset("digits", 30, "iid", out, seed=0)
    return out


@pytest.fixture(scope="module")
def site0(parts: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, Path]:
    """A generator that memorised 8 of site 0's training images at 16 px:
    (the partition folder, those 8 images, the generator's file)."""
    from p2pfl.learning.data import load_site_data

    root = tmp_path_factory.mktemp("site0")
    (config,) = simulation_configs(
        [str(parts / "site_0.npz")],
        protocol={"name": "feder", "rounds": 1},
        state_root=root / "state",
        data={"image_size": 16, "augment": "none"},
    )
    data = load_site_data(config.data, seed=0)
    images, labels = data.train_uint8[:8], np.asarray(data.train_labels)[:8]
    memoriser = memorising_generator(images, labels, num_classes=10)
    return parts, images.copy(), save(memoriser, root / "memoriser.pt")


def memorised_site0(site0: tuple[Path, np.ndarray, Path], train_uint8: np.ndarray) -> Path:
    """The shared memoriser's file, after checking that this test's site 0 loads
    the very images it memorised (the same partition, split and resize)."""
    _, images, path = site0
    assert np.array_equal(train_uint8[:8], images), "site 0 loaded other images"
    return path


def test_a_memorising_generator_is_refused_and_a_privacy_trained_one_passes(
    tmp_path, metric, digits_memoriser
):
    images, labels = digits16(48)
    section = tiny_section()
    # Memorised: trained far past convergence on six of the site's images.
    buffer = sample_buffer(digits_memoriser, 64, seed=1)
    refused = check_buffer(buffer, images, metric, section, tmp_path / "memorised")
    assert not refused.released
    assert refused.exposed_fraction >= 5 / 48 > section.gate_max_fraction, refused
    assert refused.nearest_synthetic["min"] < refused.real_spacing["min"]
    assert "REFUSED" in refused.reason and "not shared" in refused.reason
    saved = json.loads((tmp_path / "memorised" / GATE_JSON).read_text())
    assert saved["released"] is False and len(saved["nearest_synthetic_distances"]) == 48
    for name in (GATE_GRID, GATE_HISTOGRAM):
        assert (tmp_path / "memorised" / name).stat().st_size > 1000

    # Privacy-trained: the two-stage training with the LPIPS privacy loss, on all 48 images.
    cfg = tiny_section(
        iterations=20,
        stage1_patience=20,
        stage2_iterations=10,
        quality_every=10,
        train_reference=False,
        checkpoint_every=10,
    )
    result = train_generator(images, labels, 10, cfg, tmp_path / "gan", metric=metric)
    trained, info = load_generator(result.generator_path)
    assert info.stage == "stage2" and info.alpha > 0
    passed = check_buffer(
        sample_buffer(trained, 64, seed=1), images, metric, section, tmp_path / "trained"
    )
    assert passed.released, passed.reason
    assert passed.exposed_fraction <= section.gate_max_fraction
    assert read_decision(tmp_path / "trained")["released"] is True


def test_the_gate_distance_and_limit_are_honoured(tmp_path, metric, digits_memoriser):
    images, _ = digits16(24)  # the memoriser's six images are among them
    buffer = sample_buffer(digits_memoriser, 32, seed=2)
    # A configured distance of ~0 exposes nobody; a limit of 100 % releases anything.
    tiny_d = check_buffer(buffer, images, metric, tiny_section(gate_distance=1e-12), tmp_path / "a")
    assert tiny_d.released and tiny_d.exposed_fraction == 0.0
    assert tiny_d.distance_source == "configured"
    lax = check_buffer(buffer, images, metric, tiny_section(gate_max_fraction=1.0), tmp_path / "b")
    assert lax.released and lax.exposed_fraction > 0
    auto = check_buffer(buffer, images, metric, tiny_section(gate_images=10), tmp_path / "c")
    assert auto.real_images == 10 and auto.distance_source == "auto"
    assert auto.distance == pytest.approx(0.5 * auto.real_spacing["median"], rel=1e-4)


def _feder_configs(tmp_path: Path, parts: Path) -> list:
    """Two in-memory FedER sites on the first two of the 30 sites in `parts`."""
    configs = simulation_configs(
        [str(parts / f"site_{i}.npz") for i in range(2)],
        protocol={"name": "feder", "rounds": 1, "buffer_size": 64, "round_timeout_s": 5},
        state_root=tmp_path / "state",
        data={"image_size": 16, "augment": "none"},
        training={"epochs": 1, "batch_size": 16},
        genbuffer={"lpips_backbone": "random", "device": "cpu"},
    )
    for i, config in enumerate(configs):
        config.protocol.generator = str(tmp_path / f"g{i}.pt")
    return configs


@pytest.mark.slow
def test_a_feder_node_does_not_share_a_refused_buffer(tmp_path, site0):
    """In memory: the memorising site stops before its first send and says why; its
    peer's gate releases an untrained generator's noise."""
    from p2pfl.learning.data import load_site_data

    configs = _feder_configs(tmp_path, site0[0])
    data = load_site_data(configs[0].data, seed=0)
    # site 0's generator memorised 8 of its images
    memoriser = memorised_site0(site0, data.train_uint8)
    configs[0].protocol.generator = str(memoriser)
    torch.manual_seed(1)
    save(Generator(load_generator(memoriser)[0].spec), Path(configs[1].protocol.generator))

    network = InMemoryNetwork()
    result = asyncio.run(simulate(configs, network=network))
    name0, name1 = configs[0].node.name, configs[1].node.name
    assert "privacy gate REFUSED" in result.errors.get(name0, ""), result.errors
    assert name1 not in result.errors, result.errors
    gate0, gate1 = network.privacy_gate[name0], network.privacy_gate[name1]
    assert gate0["enabled"] and gate0["released"] is False, gate0
    assert gate0["exposed_fraction"] > gate0["max_fraction"]
    assert gate1["released"] is True and gate1["exposed_fraction"] == 0.0, gate1
    assert read_decision(Path(configs[0].node.state_dir) / "genbuffer")["released"] is False
    # nothing of site 0 reached site 1: it finished its round without a relay
    rounds = [r for r in result.records if r["node"] == name1 and r["round"] == 1]
    assert rounds and rounds[0]["received"] == 0, rounds


@pytest.mark.slow
def test_the_refusal_is_visible_on_status_of_a_real_node(tmp_path, site0):
    """Two real daemons on 127.0.0.1 (in the test process: tests/inproc_util.py):
    the memorising site's /status says the buffer was refused and why; the node
    stays up serving it, then ends with a failed protocol (exit status 1)."""
    from inproc_util import InProcessFederation

    from node.provision import provision

    parts = site0[0]
    generators = {"a": site0[2], "b": tmp_path / "gb.pt"}
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "feder", "rounds": 1, "buffer_size": 64, "round_timeout_s": 5},
        data_sources=[str(parts / f"site_{i}.npz") for i in range(2)],
        overrides={
            "transport": {"heartbeat_s": 0.3},
            "data": {"image_size": 16, "augment": "none"},
            "node": {"exit_when_done": True},
            "genbuffer": {"lpips_backbone": "random", "device": "cpu"},
        },
        per_site={n: {"protocol": {"generator": str(p)}} for n, p in generators.items()},
    )
    from p2pfl.config import load_config
    from p2pfl.learning.data import load_site_data

    data = load_site_data(load_config(plans[0].config_path).data, seed=0)
    memoriser = memorised_site0(site0, data.train_uint8)
    torch.manual_seed(1)
    save(Generator(load_generator(memoriser)[0].spec), generators["b"])
    with InProcessFederation(plans) as fed:
        status = fed["a"].wait_for(
            lambda s: bool(s.get("privacy_gate")), 120, "the privacy gate's decision"
        )
        gate = status["privacy_gate"]
        assert gate["released"] is False and "REFUSED" in gate["reason"], gate
        assert gate["exposed_fraction"] > gate["max_fraction"]
        assert gate["files"]["grid"].endswith("privacy_gate.png")
        failed = fed["a"].wait_for(lambda s: s["phase"] == "failed", 30, "phase failed")
        assert failed["privacy_gate"] == gate
        codes = fed.wait_all_exit(120)
    assert codes == {"a": 1, "b": 0}, codes


def test_genbuffer_sample_writes_no_refused_buffer(tmp_path, capsys, site0):
    """`p2pfl-node genbuffer sample` runs the same gate: a memorising generator's
    buffer is not written, and the reason is one line with exit status 2."""
    import argparse

    from genbuffer.cli import add_genbuffer_parser

    parts = site0[0]
    config = tmp_path / "site.yaml"
    config.write_text(
        f"seed: 0\ndata: {{source: {parts / 'site_0.npz'}, image_size: 16}}\n"
        "genbuffer: {lpips_backbone: random, out_dir: gan}\n",
        encoding="utf-8",
    )
    from genbuffer.config import load_genbuffer_config
    from p2pfl.learning.data import load_site_data

    data = load_site_data(load_genbuffer_config(config).data, seed=0)
    generator = memorised_site0(site0, data.train_uint8)
    parser = argparse.ArgumentParser(prog="p2pfl-node")
    add_genbuffer_parser(parser.add_subparsers(dest="command"), "the GAN")
    argv = ["genbuffer", "sample", "--config", str(config), "--checkpoint", str(generator)]
    args = parser.parse_args([*argv, "--size", "64"])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "privacy gate REFUSED" in err, err
    assert not (tmp_path / "gan" / "buffer.bin").exists()
    assert read_decision(tmp_path / "gan")["released"] is False


def _provisioned_site(tmp_path: Path, parts: Path) -> Path:
    """Site 0's site.yaml as `p2pfl-node provision` writes it, before the node ever
    ran, its state dir opened to 0755 as an older provision left it (today's
    makes it 0700): genbuffer must tighten it itself."""
    from node.provision import provision

    (plan,) = provision(
        tmp_path / "fed",
        ["a"],
        protocol={"name": "feder", "rounds": 1},
        data_sources=[str(parts / "site_0.npz")],
        overrides={
            "data": {"image_size": 16, "augment": "none"},
            # a holdout of this small site's images, so the membership test runs too
            "genbuffer": {"lpips_backbone": "random", "device": "cpu", "holdout_min_images": 4},
        },
    )
    state = plan.config_path.parent / "state"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700  # provision's own
    state.chmod(0o755)
    return plan.config_path


def _sample(config: Path, generator: Path, out: Path) -> int:
    from genbuffer.cli import add_genbuffer_parser

    parser = argparse.ArgumentParser(prog="p2pfl-node")
    add_genbuffer_parser(parser.add_subparsers(dest="command"), "the GAN")
    argv = ["--config", str(config), "--checkpoint", str(generator), "--out", str(out)]
    args = parser.parse_args(["genbuffer", "sample", *argv, "--size", "64"])
    return args.func(args)


def _assert_private(state: Path) -> list[str]:
    """The state dir and its genbuffer folder are 0700 and every file in the state
    dir is 0600; returns the genbuffer folder's file names."""
    for folder in (state, state / "genbuffer"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    modes = {str(p): stat.S_IMODE(p.stat().st_mode) for p in state.rglob("*") if p.is_file()}
    assert modes == dict.fromkeys(modes, 0o600), modes
    return sorted(p.name for p in (state / "genbuffer").iterdir())


def test_genbuffer_sample_shares_the_buffer_alone_and_keeps_the_evidence_private(
    tmp_path, capsys, parts
):
    """Attack: `genbuffer sample --out OUTGOING/buffer.bin` on a freshly provisioned
    site, umask 022. OUTGOING, the folder the buffer is shared from, must receive the
    buffer and nothing else: the gate's and the membership test's grids show the
    site's own patients' images and their JSON a distance per image. Those stay in
    STATE/genbuffer, 0600, and the state dir is tightened to 0700 as run_node would."""
    previous = os.umask(0o022)
    try:
        config = _provisioned_site(tmp_path, parts)
        torch.manual_seed(1)  # an untrained generator's noise: the gate releases it
        spec = GeneratorSpec(num_classes=10, resolution=16, channels=1, **TINY)
        generator = save(Generator(spec), tmp_path / "generator.pt")
        outgoing = tmp_path / "outgoing"
        outgoing.mkdir()
        assert _sample(config, generator, outgoing / "buffer.bin") == 0
    finally:
        os.umask(previous)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gate = printed["privacy_gate"]
    assert gate["enabled"] and gate["released"] is True, gate
    assert [p.name for p in outgoing.iterdir()] == ["buffer.bin"]
    buffer = buffer_from_bytes((outgoing / "buffer.bin").read_bytes(), num_classes=10)
    assert buffer["content_hash"] == printed["content_hash"]
    state = config.parent / "state"
    kept = _assert_private(state)
    assert {GATE_JSON, GATE_GRID, GATE_HISTOGRAM, "buffer_preview.png"} <= set(kept), kept
    assert gate["membership"]["available"], gate["membership"]
    assert {MEMBERSHIP_JSON, MEMBERSHIP_GRID} <= set(kept), kept
    evidence = [*gate["files"].values(), *gate["membership"]["files"].values()]
    assert all(Path(p).parent == state / "genbuffer" for p in evidence), evidence
    # what is printed is the summary: no per-image distances
    assert "nearest_synthetic_distances" not in gate
    assert "member_distances" not in gate["membership"]


def test_genbuffer_sample_leaves_nothing_to_share_when_the_gate_refuses(tmp_path, capsys, site0):
    """Attack: the refused buffer's evidence used to be written beside --out before
    the refusal was raised. Now OUTGOING stays empty, and the evidence of the
    refusal is in the private folder only, 0600."""
    from genbuffer.config import load_genbuffer_config
    from p2pfl.learning.data import load_site_data

    previous = os.umask(0o022)
    try:
        config = _provisioned_site(tmp_path, site0[0])
        loaded = load_genbuffer_config(config)
        generator = memorised_site0(
            site0, load_site_data(loaded.data, seed=loaded.seed).train_uint8
        )
        outgoing = tmp_path / "outgoing"
        outgoing.mkdir()
        assert _sample(config, generator, outgoing / "buffer.bin") == 2
    finally:
        os.umask(previous)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "privacy gate REFUSED" in err, err
    assert list(outgoing.iterdir()) == []
    state = config.parent / "state"
    assert str(state / "genbuffer" / GATE_JSON) in err  # where the operator finds why
    assert read_decision(state / "genbuffer")["released"] is False
    kept = _assert_private(state)
    assert {GATE_JSON, GATE_GRID, MEMBERSHIP_GRID} <= set(kept), kept
    assert "buffer.bin" not in kept and "buffer_preview.png" not in kept


def test_switching_the_gate_off_is_explicit_and_loud(tmp_path, caplog, parts):
    import logging

    from genbuffer.gate import gate_status
    from protocols.feder_buffers import make_buffer
    from protocols.site import build_site

    configs = _feder_configs(tmp_path, parts)
    config = configs[0]
    torch.manual_seed(0)
    spec = GeneratorSpec(num_classes=10, resolution=16, channels=1, **TINY)
    save(Generator(spec), Path(config.protocol.generator))
    site = build_site(config)
    assert config.genbuffer.privacy_gate is True  # on unless configured otherwise
    section = config.genbuffer.model_copy(update={"privacy_gate": False})
    with caplog.at_level(logging.WARNING, logger="protocols.feder"):
        buffer, decision = make_buffer(config.protocol, site, section, tmp_path / "gb", seed=0)
    assert decision is None and len(buffer["labels"]) == 64
    assert any("PRIVACY GATE OFF" in r.getMessage() for r in caplog.records)
    status = gate_status(decision)
    assert status["enabled"] is False and "PRIVACY GATE OFF" in status["reason"]
    assert not (tmp_path / "gb" / GATE_JSON).exists()
    # switched on, the same buffer is checked and the evidence written
    _, decision = make_buffer(config.protocol, site, config.genbuffer, tmp_path / "gb", seed=0)
    assert decision is not None and (tmp_path / "gb" / GATE_JSON).is_file()


@pytest.mark.slow
def test_a_restart_with_the_gate_on_checks_the_buffer_the_checkpoint_kept(tmp_path, site0):
    """A review ran site 0 with `genbuffer.privacy_gate: false` (its buffer made by
    a memoriser, checkpointed), then restarted it with the gate on: the resumed
    node ran no gate and went on relaying, its ungated buffer still the one it
    shares. Now the checkpoint's buffer goes through the gate again: refused, the
    node stops before round 2's relay, /status says why, and the buffer is not
    served to a peer that asks for it by hash."""
    from genbuffer.gate import PrivacyGateRefused
    from p2pfl.learning.data import load_site_data
    from protocols.base import NotReady
    from protocols.feder import FedER
    from protocols.feder_relays import RELAY_KIND

    def config(rounds: int, gate: bool):
        (c,) = simulation_configs(
            [str(site0[0] / "site_0.npz")],
            names=["victim"],
            protocol={
                "name": "feder",
                "rounds": rounds,
                "buffer_size": 64,
                "initial_epochs": 0,
                "round_timeout_s": 1.0,
            },
            state_root=tmp_path / "state",
            data={"image_size": 16, "augment": "none"},
            training={"epochs": 1, "batch_size": 16},
            genbuffer={"lpips_backbone": "random", "device": "cpu", "privacy_gate": gate},
        )
        c.protocol.generator = str(
            memorised_site0(site0, load_site_data(c.data, seed=0).train_uint8)
        )
        return c

    network = InMemoryNetwork(inline_train=True)
    peer = network.join("peer")
    first = config(1, gate=False)
    asyncio.run(FedER(first.protocol).run(network.join("victim", first)))
    kept = network.saved_state("victim")["own_buffer"]["content_hash"]
    assert network.privacy_gate["victim"]["enabled"] is False
    assert [m.round for m in _drain(peer.inbox(RELAY_KIND))] == [1]

    again = config(2, gate=True)
    resumed = FedER(again.protocol)
    with pytest.raises(PrivacyGateRefused):
        asyncio.run(resumed.run(network.join("victim", again)))
    with pytest.raises(NotReady):  # a failed node still serves: not this buffer
        asyncio.run(resumed.serve_buffer("peer", {"hash": kept}))
    gate = network.privacy_gate["victim"]
    assert gate["enabled"] is True and gate["released"] is False, gate
    assert gate["buffer_hash"] == kept
    assert read_decision(Path(again.node.state_dir) / "genbuffer")["buffer_hash"] == kept
    assert _drain(peer.inbox(RELAY_KIND)) == []  # no round-2 relay left the site


def _drain(queue: asyncio.Queue) -> list:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out
