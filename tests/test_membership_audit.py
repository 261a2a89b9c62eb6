"""The membership-inference audit of synthetic buffers (genbuffer/audit.py) and the
privacy gate that uses it.

The images are scikit-learn's digits at 16 px (no ../shared); the LPIPS backbone is
the explicitly configured random one. A buffer that copies the members (with +-2
grey levels of noise) must give an AUC near 1 and be refused; a buffer of other
digits, independent of the members, must give an AUC near 0.5, as must the control
(two halves of the holdout). With 225 members and 75 held-out images the AUC's
standard error under no leakage is sqrt((m + h + 1) / (12 m h)) = 0.039, so the
bounds below (0.5 +- 0.15) are almost 4 standard errors wide; the data and every
random choice are seeded, so the figures do not change from run to run.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

from genbuffer.audit import (
    MEMBERSHIP_GRID,
    MEMBERSHIP_HISTOGRAM,
    MEMBERSHIP_JSON,
    distance_auc,
    holdout_split,
    membership_audit,
    stratified_halves,
    stratified_pick,
)
from genbuffer.buffer import buffer_content_hash
from genbuffer.gate import GATE_GRID, check_buffer, gate_status
from genbuffer.privacy import build_perceptual_distance
from genbuffer.progress import TrainingProgress
from node.status import create_status_app, start_status_server
from node.telemetry import Telemetry
from p2pfl.learning.data.partition import partition_dataset
from tests.test_genbuffer import tiny_section
from tests.test_privacy_gate import _feder_configs, digits16


@pytest.fixture(scope="module")
def metric():
    return build_perceptual_distance("random")


@pytest.fixture(scope="module")
def site():
    """300 digits: 225 members and 75 held out (25 % of each class), and 300 other digits."""
    images, labels = digits16(600)
    members, holdout = holdout_split(labels[:300], 0.25, 20, seed=0)
    return images[:300], labels[:300], members, holdout, images[300:], labels[300:]


def as_buffer(images_u8: np.ndarray, labels: np.ndarray, noise: int = 0) -> dict:
    x = torch.as_tensor(images_u8).permute(0, 3, 1, 2).float()
    if noise:
        x = x + torch.randint(
            -noise, noise + 1, x.shape, generator=torch.Generator().manual_seed(0)
        )
    images = x.clamp(0, 255).to(torch.uint8)
    y = torch.as_tensor(labels).long()
    return {"images": images, "labels": y, "content_hash": buffer_content_hash(images, y)}


def test_the_holdout_is_stratified_disjoint_deterministic_and_needs_enough_images():
    labels = np.repeat(np.arange(3), [40, 100, 10])
    members, holdout = holdout_split(labels, 0.2, 20, seed=7)
    assert len(np.intersect1d(members, holdout)) == 0
    assert sorted(np.concatenate([members, holdout]).tolist()) == list(range(150))
    assert np.bincount(labels[holdout], minlength=3).tolist() == [8, 20, 2]
    again = holdout_split(labels, 0.2, 20, seed=7)
    assert np.array_equal(again[0], members) and np.array_equal(again[1], holdout)
    assert not np.array_equal(holdout_split(labels, 0.2, 20, seed=8)[1], holdout)
    # too few images to hold out 20 of them: no holdout, everything trains the GAN
    members, holdout = holdout_split(labels[:60], 0.2, 20, seed=7)
    assert len(holdout) == 0 and len(members) == 60
    # a class of one image keeps it
    assert 149 in holdout_split(np.r_[np.zeros(149), 1], 0.5, 1, seed=0)[0]


def test_the_control_halves_and_the_picks_keep_the_class_mix():
    labels = np.repeat(np.arange(3), [41, 100, 9])
    rng = np.random.default_rng(3)
    for _ in range(20):
        first, second = stratified_halves(labels, len(labels), rng)
        assert sorted(np.r_[first, second].tolist()) == list(range(150))
        assert abs(len(first) - len(second)) <= 1
        diff = np.bincount(labels[first], minlength=3) - np.bincount(labels[second], minlength=3)
        assert np.abs(diff).max() <= 1, diff
    first, second = stratified_halves(None, 7, rng)
    assert sorted(np.r_[first, second].tolist()) == list(range(7)) and len(first) == 3
    with pytest.raises(ValueError, match="labels for"):
        stratified_halves(labels[:10], 11, rng)
    picks = stratified_pick(labels, 30, rng)
    assert len(picks) == 30 and len(np.unique(picks)) == 30
    assert np.bincount(labels[picks], minlength=3).tolist() == [8, 20, 2]
    assert len(stratified_pick(labels, 500, rng)) == 150


def test_the_control_reads_no_membership_into_classes_at_different_distances(tmp_path, metric):
    """A holdout whose two classes sit far apart from the synthetic set: a halving with
    more of the near class in one half reads as 'membership' in the control. Over 40
    seeded halvings (data and seeds fixed, so the figures do not move), stratified by
    class the control's spread is half the unstratified one (0.023 against 0.044), and
    1 control in 40 leaves 0.5 +- 0.05 against 14."""
    labels = np.repeat([0, 1], [60, 140])
    rng = np.random.default_rng(0)
    d = np.where(labels == 0, 0.1, 0.9) + rng.normal(0, 0.01, len(labels))
    stratified, plain = [], []
    for seed in range(40):
        r = np.random.default_rng(seed)
        a, b = stratified_halves(labels, len(d), r)
        stratified.append(distance_auc(d[a], d[b]))
        a, b = stratified_halves(None, len(d), r)
        plain.append(distance_auc(d[a], d[b]))
    stratified, plain = np.array(stratified), np.array(plain)
    assert stratified.std() < 0.6 * plain.std(), (stratified.std(), plain.std())
    assert (abs(stratified - 0.5) > 0.05).sum() <= 2, stratified
    assert (abs(plain - 0.5) > 0.05).sum() >= 8, plain


def test_the_audit_stratifies_its_control_when_it_has_the_holdout_labels(tmp_path, metric, site):
    images, labels, members, holdout, others, other_labels = site
    section = tiny_section()
    decision = check_buffer(
        as_buffer(others, other_labels),
        images[members],
        metric,
        section,
        tmp_path,
        holdout_uint8=images[holdout],
        real_labels=labels[members],
        holdout_labels=labels[holdout],
    )
    m = decision.membership
    assert m["available"] and m["holdout"] == 75
    assert abs(m["control_auc"] - 0.5) < 0.15, m
    assert m["control_null_range"][0] < 0.5 < m["control_null_range"][1], m
    with pytest.raises(ValueError, match="labels for"):
        check_buffer(
            as_buffer(others, other_labels),
            images[members],
            metric,
            section,
            tmp_path / "bad",
            holdout_uint8=images[holdout],
            holdout_labels=labels[holdout][:-1],
        )
    x = torch.rand(4, 1, 16, 16) * 2 - 1
    with pytest.raises(ValueError, match="labels for"):
        membership_audit(
            x, x, x, metric, tmp_path / "m", near_copy_distance=0.1, holdout_labels=np.zeros(3)
        )


def test_distance_auc_is_the_rank_statistic():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    a, b = rng.random(50).round(2), rng.random(70).round(2)  # ties included
    expected = roc_auc_score(np.r_[np.ones(50), np.zeros(70)], -np.r_[a, b])
    assert distance_auc(a, b) == pytest.approx(expected)
    assert distance_auc(np.zeros(5), np.ones(5)) == 1.0


def test_a_buffer_copying_the_members_is_found_and_refused(tmp_path, metric, site):
    images, labels, members, holdout, _, _ = site
    copies = as_buffer(images[members], labels[members], noise=2)
    decision = check_buffer(
        copies,
        images[members],
        metric,
        tiny_section(),
        tmp_path,
        holdout_uint8=images[holdout],
    )
    m = decision.membership
    assert m["available"] and m["members"] == 225 and m["holdout"] == 75
    assert m["auc"] > 0.95 and m["auc_interval"][0] > 0.9, m
    assert m["dcr_ratio"] > 2 and m["near_copy_excess"] > 0.5, m
    assert not decision.released and "auc" in decision.refused_by, decision.reason
    assert "near_copy_excess" in decision.refused_by
    assert abs(m["control_auc"] - 0.5) < 0.15, m
    for name in (MEMBERSHIP_JSON, MEMBERSHIP_HISTOGRAM, MEMBERSHIP_GRID):
        assert (tmp_path / name).stat().st_size > 1000


def test_a_buffer_independent_of_the_members_gives_chance(tmp_path, metric, site):
    images, labels, members, holdout, others, other_labels = site
    decision = check_buffer(
        as_buffer(others, other_labels),
        images[members],
        metric,
        tiny_section(),
        tmp_path,
        holdout_uint8=images[holdout],
    )
    m = decision.membership
    assert abs(m["auc"] - 0.5) < 0.15, m
    assert m["auc_interval"][0] < 0.5 < m["auc_interval"][1], m
    assert abs(m["control_auc"] - 0.5) < 0.15, m
    assert m["control_null_range"][0] < 0.5 < m["control_null_range"][1], m
    assert 0.7 < m["dcr_ratio"] < 1.4, m
    assert "auc" not in decision.refused_by and "near_copy_excess" not in decision.refused_by


def test_without_a_holdout_the_gate_uses_the_distance_rule_and_says_so(tmp_path, metric, site):
    images, labels, members, _, others, other_labels = site
    decision = check_buffer(
        as_buffer(others, other_labels), images[members], metric, tiny_section(), tmp_path
    )
    assert decision.membership["available"] is False
    assert "distance rule only" in decision.membership["reason"]
    assert "no membership test" in decision.reason
    assert not (tmp_path / MEMBERSHIP_JSON).exists()


async def test_the_membership_figures_are_on_status_and_the_grids_are_not_served(
    tmp_path, metric, site
):
    images, labels, members, holdout, _, _ = site
    decision = check_buffer(
        as_buffer(images[members], labels[members], noise=2),
        images[members],
        metric,
        tiny_section(),
        tmp_path,
        holdout_uint8=images[holdout],
    )
    telemetry = Telemetry("a")
    telemetry.set_privacy_gate(gate_status(decision))
    app = create_status_app(telemetry, node_name="a", protocol_name="feder", token=None)
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/status") as response:
                status = await response.json()
            gate = status["privacy_gate"]
            assert gate["membership"]["auc"] == decision.membership["auc"]
            assert gate["refused_by"] == decision.refused_by
            assert "member_distances" not in gate["membership"]
            for path in (gate["files"]["grid"], gate["membership"]["files"]["grid"]):
                assert Path(path).is_file()
                for url in (path, "/" + Path(path).name, "/" + GATE_GRID, "/" + MEMBERSHIP_GRID):
                    async with session.get(f"http://127.0.0.1:{port}/{url.lstrip('/')}") as r:
                        assert r.status == 404, url
    finally:
        await runner.cleanup()


async def test_gan_training_progress_reaches_the_status_phase(tmp_path, monkeypatch):
    """FedER's make_buffer trains the GAN on the members only and reports its progress;
    the node shows the last line as its phase on /status."""
    import genbuffer.train
    from p2pfl.learning.data import load_site_data
    from protocols.feder_buffers import make_buffer
    from protocols.site import build_site

    parts = tmp_path / "parts"
    partition_dataset("digits", 30, "iid", parts, seed=0)  # small sites: ~40 training images
    config = _feder_configs(tmp_path, parts)[0]
    config.protocol.generator = None  # train it
    section = tiny_section(
        iterations=4,
        stage1_patience=4,
        stage2_iterations=2,
        quality_every=2,
        checkpoint_every=2,
        holdout_fraction=0.25,
        holdout_min_images=4,
    )
    seen: list[np.ndarray] = []
    real_train = genbuffer.train.train_generator

    def recording_train(images, *args, **kwargs):  # the real training, its input recorded
        seen.append(np.asarray(images).copy())
        return real_train(images, *args, **kwargs)

    monkeypatch.setattr(genbuffer.train, "train_generator", recording_train)
    telemetry = Telemetry("a")
    phases: list[str] = []

    def on_phase(line: str) -> None:
        phases.append(line)
        telemetry.set_phase(line)

    site = build_site(config)
    buffer, decision = make_buffer(
        config.protocol, site, section, tmp_path / "gb", 0, TrainingProgress(on_phase, every_s=0)
    )
    data = load_site_data(config.data, seed=0)
    members, holdout = holdout_split(np.asarray(data.train_labels), 0.25, 4, section.seed)
    assert len(holdout) >= 4 and len(seen) == 1
    assert np.array_equal(seen[0], data.train_uint8[members])  # the holdout never trains it
    assert decision is not None and decision.membership["holdout"] == len(holdout)
    assert phases[0].startswith("generator: stage1 1/4")
    assert any(p.startswith("generator: stage2 2/2") for p in phases), phases
    assert all("ETA" in p for p in phases)
    # the phase goes to every roster member in heartbeats: never the quality score,
    # a figure measured on the site's own images (a review saw "quality 0.41" there)
    assert not any("quality" in p for p in phases), phases

    app = create_status_app(telemetry, node_name="a", protocol_name="feder", token=None)
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/status") as response,
        ):
            status = await response.json()
        assert status["phase"] == phases[-1] and status["phase"].startswith("generator: ")
    finally:
        await runner.cleanup()


@pytest.mark.browser
async def test_the_dashboard_shows_the_membership_test_and_the_training_progress(
    tmp_path, metric, site
):
    from browser_util import dump_dom

    images, labels, members, holdout, _, _ = site
    decision = check_buffer(
        as_buffer(images[members], labels[members], noise=2),
        images[members],
        metric,
        tiny_section(),
        tmp_path,
        holdout_uint8=images[holdout],
    )
    telemetry = Telemetry("a")
    telemetry.set_privacy_gate(gate_status(decision))
    line = "generator: stage1 400/1600, ETA 1m05s"
    telemetry.set_phase(line)
    token = "membership-test-token-0123456789"
    app = create_status_app(telemetry, node_name="a", protocol_name="feder", token=token)
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    try:
        dom = await dump_dom(f"http://127.0.0.1:{port}/#token={token}")
    finally:
        await runner.cleanup()
    assert 'id="gate-verdict">REFUSED<' in dom
    assert "Attack AUC, members vs holdout" in dom
    assert f"{decision.membership['auc']:.3f}" in dom
    assert "auc, near_copy_excess" in dom
    assert line in dom
