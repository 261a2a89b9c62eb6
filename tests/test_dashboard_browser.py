"""The dashboard in headless Chromium: the peer graph and curves really render."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from browser_util import dump_dom, png_size, screenshot
from PIL import Image

from node.status import create_status_app, start_status_server
from node.telemetry import Telemetry

pytestmark = pytest.mark.browser

TOKEN = "dashboard-test-token-0123456789"
PEERS = ("a", "b", "c", "d")
ALIVE_GREEN = (0x1F, 0x9D, 0x55)
DEAD_RED = (0xC2, 0x41, 0x0C)


class DomSummary(HTMLParser):
    """What a person would see: peers drawn inside an SVG, charts, rows, the title."""

    def __init__(self) -> None:
        super().__init__()
        self.svg_depth = 0
        self.peers_in_svg: set[str] = set()
        self.metric_charts: set[str] = set()
        self.peer_rows: set[str] = set()
        self.title = ""
        self.in_title = False
        self.auth_banner_shown = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "svg":
            self.svg_depth += 1
            if attributes.get("data-metric"):
                self.metric_charts.add(attributes["data-metric"] or "")
        if self.svg_depth and attributes.get("data-peer"):
            self.peers_in_svg.add(attributes["data-peer"] or "")
        if tag == "tr" and attributes.get("data-peer-row"):
            self.peer_rows.add(attributes["data-peer-row"] or "")
        if attributes.get("id") == "auth-banner" and "show" in (attributes.get("class") or ""):
            self.auth_banner_shown = True
        self.in_title = tag == "title" and not self.svg_depth

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.svg_depth -= 1
        self.in_title = False

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title += data


def summarize(dom: str) -> DomSummary:
    summary = DomSummary()
    summary.feed(dom)
    return summary


def four_node_telemetry() -> Telemetry:
    now = time.time()
    telemetry = Telemetry("a")
    telemetry.set_peer("b", "alive", round_no=4, phase="train", last_seen=now - 1)
    telemetry.set_peer("c", "suspect", round_no=3, phase="exchange", last_seen=now - 8)
    telemetry.set_peer("d", "dead", round_no=2, phase="", last_seen=now - 60)
    for _ in range(5):
        telemetry.record_sent("b", "model", 250_000)
        telemetry.record_received("b", "model", 250_000)
    telemetry.record_sent("c", "model", 250_000)
    telemetry.record_received("d", "heartbeat", 120)
    telemetry.merge_remote_edges(
        "b", [{"source": "b", "target": "c", "messages": 6, "bytes": 900_000, "last": now}]
    )
    telemetry.merge_remote_edges(
        "c", [{"source": "c", "target": "d", "messages": 2, "bytes": 2_000, "last": now}]
    )
    telemetry.record_rejection("bad_signature", "mallory")
    for round_index in range(5):
        telemetry.record_choice("a", ["b", "c"])
        telemetry.log_metrics(
            round_index, train_loss=1.0 / (round_index + 1), val_acc=0.5 + 0.08 * round_index
        )
    telemetry.set_round(4)
    telemetry.set_phase("aggregate")
    return telemetry


@pytest.fixture
async def dashboard_url() -> AsyncIterator[str]:
    app = create_status_app(
        four_node_telemetry(), node_name="a", protocol_name="fedavgp2p", token=TOKEN
    )
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}/"
    await runner.cleanup()


async def test_dashboard_draws_every_peer_and_metric_with_the_token_from_the_url(
    dashboard_url: str,
) -> None:
    summary = summarize(await dump_dom(dashboard_url + f"#token={TOKEN}"))
    assert summary.peers_in_svg == set(PEERS)
    assert summary.peer_rows == {"b", "c", "d"}
    assert summary.metric_charts == {"train_loss", "val_acc"}
    assert not summary.auth_banner_shown
    for part in ("a", "fedavgp2p", "round 4", "aggregate"):
        assert part in summary.title


async def test_dashboard_without_token_asks_for_it_and_shows_no_data(dashboard_url: str) -> None:
    summary = summarize(await dump_dom(dashboard_url))
    assert summary.auth_banner_shown
    assert summary.peers_in_svg == set()
    assert summary.peer_rows == set()


async def test_dashboard_screenshot_shows_the_coloured_graph(
    dashboard_url: str, tmp_path: Path
) -> None:
    path = await screenshot(dashboard_url + f"#token={TOKEN}", tmp_path / "dashboard.png")
    assert png_size(path) == (1280, 900)
    assert path.stat().st_size > 20_000
    with Image.open(path) as image:
        pixels = image.convert("RGB")
        colours = pixels.getcolors(maxcolors=1_000_000) or []
    assert len(colours) > 200, "a blank or nearly blank page"
    present = {colour for _, colour in colours}
    # Node discs are filled with the state colours: b is alive, d is dead.
    assert ALIVE_GREEN in present and DEAD_RED in present


async def dashboard_dom(telemetry: Telemetry, protocol: str) -> str:
    """The dashboard of node a (this telemetry) as the browser rendered it."""
    app = create_status_app(telemetry, node_name="a", protocol_name=protocol, token=TOKEN)
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    try:
        return await dump_dom(f"http://127.0.0.1:{port}/#token={TOKEN}")
    finally:
        await runner.cleanup()


async def test_dashboard_shows_why_a_buffer_was_refused() -> None:
    from genbuffer.gate import GateDecision, gate_status

    telemetry = four_node_telemetry()
    decision = GateDecision(
        released=False,
        reason="privacy gate REFUSED: 12.5% of 48 site images have a synthetic image closer "
        "than LPIPS 0.0105 (auto; the limit is 5.0%) — the buffer was not shared",
        exposed_fraction=0.125,
        max_fraction=0.05,
        distance=0.0105,
        distance_source="auto",
        real_images=48,
        buffer_images=64,
        nearest_synthetic={"min": 0.0019, "p05": 0.0035, "median": 0.0353},
        real_spacing={"min": 0.0078, "p05": 0.0096, "median": 0.0210},
        lpips_backbone="alex",
        buffer_hash="ab" * 32,
        seconds=1.2,
        decided_at=time.time(),
        files={"grid": "/srv/site/state/genbuffer/privacy_gate.png"},
    )
    telemetry.set_privacy_gate(gate_status(decision))
    dom = await dashboard_dom(telemetry, "feder")
    assert 'id="gate-verdict">REFUSED<' in dom
    assert "12.5% of 48 site images" in dom and "12.5 %" in dom and "5.0 %" in dom
    assert "/srv/site/state/genbuffer/privacy_gate.png" in dom


async def test_dashboard_shows_a_failed_peer_and_why() -> None:
    telemetry = four_node_telemetry()
    telemetry.set_peer(
        "d", "failed", round_no=0, phase="failed", last_seen=time.time(), error="DataError"
    )
    dom = await dashboard_dom(telemetry, "fedavgp2p")
    assert 'class="pill failed">failed<' in dom
    assert "failed (DataError)" in dom
    assert "1 failed" in dom  # the peers tile counts it


async def test_dashboard_shows_roster_sites_and_strangers_apart_in_the_rejections() -> None:
    telemetry = four_node_telemetry()  # mallory is on no roster; b is
    telemetry.record_rejection("gossip_f1_range", "b")
    dom = await dashboard_dom(telemetry, "fedavgp2p")
    assert "Roster sites named as sender (claimed, unverified): b (1)" in dom
    assert "Names on no roster (claimed, unverified): mallory (1)" in dom


async def test_dashboard_shows_the_privacy_a_site_spent() -> None:
    telemetry = four_node_telemetry()
    dom = await dashboard_dom(telemetry, "fedavgp2p")
    assert 'id="t-dp">–<' in dom and "differential privacy off" in dom
    dp = {
        "epsilon": 2.4978,
        "delta": 1e-5,
        "noise_multiplier": 1.1894,
        "max_grad_norm": 1.0,
        "steps": 40,
        "target_epsilon": 3.0,
    }
    recipe = {"sample_rate": 0.2724, "expected_batch_size": 256, "augmult": 4}
    telemetry.set_training(
        {"class_weighting": None, "lr": 1e-3, "best": None, "dp": dp, "recipe": recipe}
    )
    dom = await dashboard_dom(telemetry, "fedavgp2p")
    assert 'id="t-dp">ε 2.50<' in dom
    assert "δ 0.00001, σ 1.19, clip 1, 40 steps (target ε 3)" in dom
    assert "Poisson q 0.272, batch 256, augmult 4" in dom  # the recipe in effect


async def test_dashboard_shows_which_model_the_site_reports() -> None:
    telemetry = four_node_telemetry()
    block = {"method": "finetune", "local_norm": False, "choice": None, "personal_best": None}
    telemetry.set_training(
        {"class_weighting": None, "lr": 1e-3, "best": None, "dp": None, "personalization": block}
    )
    dom = await dashboard_dom(telemetry, "fedavgp2p")
    assert 'id="t-personal">–<' in dom and "personalization finetune" in dom
    block["choice"] = {
        "method": "finetune",
        "reported": "personal",
        "why": "validation macro-F1 personal 0.8123 vs federated 0.7500",
        "personal_test": {"macro_f1": 0.8012},
        "federated_test": {"macro_f1": 0.7391},
    }
    telemetry.set_training(
        {"class_weighting": None, "lr": 1e-3, "best": None, "dp": None, "personalization": block}
    )
    dom = await dashboard_dom(telemetry, "fedavgp2p")
    assert 'id="t-personal">personal · F1 0.801<' in dom
    assert "finetune: validation macro-F1 personal 0.8123 vs federated 0.7500" in dom
