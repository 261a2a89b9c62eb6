"""export and predict: a trained federation's model, packaged, run on new files.

One federation of two real daemons (digits, FedAVGP2P, 2 rounds) is trained
once for the module, in the test process (tests/inproc_util.py: the daemons'
own Node, transport and status server, without a process each); every test
exports or predicts from its state directories. Under xdist the module's tests
share one worker (its xdist_group), so the federation is trained once.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from inproc_util import InProcessFederation
from PIL import Image
from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

from node.cli import main
from node.evaluate import latest_model
from node.provision import provision
from p2pfl.config.site import load_config
from p2pfl.learning.data.sources import read_source
from p2pfl.learning.train import LocalSite

FAST = {
    "transport": {
        "heartbeat_s": 0.3,
        "suspect_after_s": 1.5,
        "dead_after_s": 3.0,
        "retries": 0,
        "backoff_base_s": 0.05,
    },
    "training": {"max_steps_per_epoch": 4, "threads": 1},
    "data": {"augment": "none"},
}


pytestmark = pytest.mark.xdist_group("export_federation")  # one trained federation

DP_STATUS: dict[str, Any] = {}  # what the nodes showed when they were done (the fixture fills it)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """site.yaml of node a after a two-node federation finished. Site a trains
    under differential privacy (training.dp, a site's own choice), site b not;
    both run the GroupNorm CNN that Opacus can train."""
    root = tmp_path_factory.mktemp("export")
    plans = provision(
        root / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 2, "fraction": 1.0},
        overrides={**FAST, "model": {"name": "small_cnn_gn"}},
        per_site={
            "a": {
                "training": {
                    **FAST["training"],
                    "dp": {"target_epsilon": 4.0},
                    "dp_recipe": {"epochs": 1},
                }
            }
        },
    )
    with InProcessFederation(plans) as fed:
        for name in ("a", "b"):
            fed[name].wait_for(lambda s: s["phase"] == "done", 120, "two rounds done")
        DP_STATUS["status"] = fed["a"].status()
        DP_STATUS["metrics"] = fed["a"].get("/metrics")
        DP_STATUS["status_b"] = fed["b"].status()
    return root / "fed" / "a" / "site.yaml"


def test_the_privacy_a_site_spent_is_in_metrics_status_and_prometheus(trained):
    rows = [
        json.loads(line)
        for line in (trained.parent / "state" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in rows] == [1, 2]
    assert 0 < rows[0]["dp_epsilon"] < rows[1]["dp_epsilon"] <= 4.0  # within the target
    dp = DP_STATUS["status"]["training"]["dp"]
    assert dp["epsilon"] == pytest.approx(rows[1]["dp_epsilon"])
    assert dp["steps"] == rows[1]["dp_steps"] == 8  # 2 rounds x 4 steps
    assert rows[0]["dp_delta"] == rows[1]["dp_delta"] == 1e-5  # what each row's ε is at
    assert dp["target_epsilon"] == 4.0 and dp["delta"] == 1e-5
    recipe = DP_STATUS["status"]["training"]["recipe"]  # the recipe in effect, on /status
    assert recipe["sampling"] == "poisson" and recipe["sample_rate"] == pytest.approx(
        rows[1]["dp_sample_rate"]
    )
    assert (
        f'p2pfl_metric{{name="dp_epsilon",node="a"}} {rows[1]["dp_epsilon"]}'
        in (DP_STATUS["metrics"])
    )
    assert DP_STATUS["status_b"]["training"]["dp"] is None  # site b chose no DP


def write_dicom(path: Path, pixels: np.ndarray, photometric: str, **attributes: object) -> None:
    """A single-frame DICOM file with a patient's name and id in its header."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), Dataset(), file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.PatientName, ds.PatientID = "Doe^Jane", "SECRET123"
    ds.set_pixel_data(pixels, photometric, pixels.dtype.itemsize * 8, generate_instance_uid=False)
    for keyword, value in attributes.items():
        setattr(ds, keyword, value)
    ds.save_as(path, enforce_file_format=True)


def node_classes(config: Path, which: str) -> tuple[np.ndarray, np.ndarray]:
    """The node's own evaluation of its test split: (probabilities, labels)."""
    cfg = load_config(config, check_files=False)
    site = LocalSite.from_config(cfg)
    site.load_state_dict(latest_model(cfg, config, which))
    x, y = site.data.test.tensors
    return site.predict_proba(x).numpy(), y.numpy()


def raw_test_images(config: Path) -> np.ndarray:
    """The site's test images as they are on disk (uint8 N,H,W,C, native size)."""
    cfg = load_config(config, check_files=False)
    split = read_source(cfg.data.source).split("test")
    assert split is not None
    return split[0]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def last_json(text: str) -> dict[str, Any]:
    return json.loads(text.strip().splitlines()[-1])


def test_every_format_round_trips_to_the_nodes_own_classes(trained, tmp_path, capsys):
    out = tmp_path / "pkg"
    code = main(
        ["export", "--config", str(trained), "--which", "best", "--out", str(out)]
        + ["--format", "safetensors", "onnx", "torchscript"]
    )
    assert code == 0
    summary = last_json(capsys.readouterr().out)
    assert sorted(summary["formats"]) == ["onnx", "safetensors", "torchscript"]
    assert all(gap <= 1e-4 for gap in summary["max_abs_diff"].values())
    meta = json.loads((out / "model.json").read_text())
    assert meta["input"]["image_size"] == 28 and meta["input"]["channels"] == 1
    assert meta["classes"] == [str(i) for i in range(10)]

    proba, labels = node_classes(trained, "best")
    images = raw_test_images(trained)
    np.savez(tmp_path / "test.npz", images=images)
    results = {}
    for runtime in ("torch", "onnx"):
        target = tmp_path / f"{runtime}.csv"
        code = main(
            ["predict", "--model", str(out), str(tmp_path / "test.npz")]
            + ["--csv", str(target), "--runtime", runtime, "--batch-size", "50"]
        )
        assert code == 0
        rows = read_csv(target)
        assert [r["file"] for r in rows] == [
            f"{tmp_path / 'test.npz'}[{i}]" for i in range(len(images))
        ]
        results[runtime] = np.array([[float(r[c]) for c in meta["classes"]] for r in rows])
        predicted = [r["prediction"] for r in rows]
        assert predicted == [meta["classes"][i] for i in proba.argmax(1)]  # the node's classes
    assert np.abs(results["onnx"] - results["torch"]).max() <= 1e-4
    assert np.abs(results["torch"] - proba).max() <= 1e-5  # same preprocessing, same model
    assert len(labels) == len(images)

    card = json.loads((out / "model_card.json").read_text())
    # `best` is the model the site chose on validation; a trains under DP, so
    # it keeps no personal model and reports its federated one
    assert card["site"] == "a" and card["model"]["which"] == "best (federated)"
    assert card["training"]["protocol"] == "fedavgp2p" and card["training"]["rounds"] == 2
    cfg = load_config(trained, check_files=False)
    site = LocalSite.from_config(cfg)
    train_labels = site.data.train.tensors[1].numpy()
    assert card["data"]["images_per_class"]["train"] == {
        str(c): int((train_labels == c).sum()) for c in range(10)
    }
    macro = card["evaluation_this_site"]["macro_f1"]
    from p2pfl.learning.metrics import classification_report

    report = classification_report(labels, proba, 10)
    assert macro == pytest.approx(report["macro_f1"]) and card["evaluation_this_site"]["ece"] >= 0
    assert card["privacy"]["secure_aggregation"] is False
    dp = card["privacy"]["differential_privacy"]
    rows = [
        json.loads(line)
        for line in (trained.parent / "state" / "metrics.jsonl").read_text().splitlines()
    ]
    model_round = card["model"]["round"]
    assert dp["epsilon"] == pytest.approx(rows[model_round - 1]["dp_epsilon"])
    assert dp["epsilon_site_total"] == pytest.approx(rows[-1]["dp_epsilon"])
    assert dp["recipe"]["sampling"].startswith("poisson") and dp["recipe"]["epochs_per_round"] == 1
    assert dp["sample_rate"] == pytest.approx(rows[-1]["dp_sample_rate"])
    assert dp["delta"] == 1e-5 and dp["target_epsilon"] == 4.0
    text = (out / "model_card.md").read_text()
    assert f"ε = {dp['epsilon']:.2f} at δ = 1e-05" in text and f"macro-F1 {macro:.3f}" in text


def test_predict_reads_a_mixed_folder_and_names_the_unreadable_file(trained, tmp_path, capsys):
    out = tmp_path / "pkg"
    assert (
        main(["export", "--config", str(trained), "--out", str(out), "--format", "safetensors"])
        == 0
    )
    site_b = trained.parent.parent / "b" / "site.yaml"
    b_out = tmp_path / "b"
    assert (
        main(["export", "--config", str(site_b), "--out", str(b_out), "--format", "safetensors"])
        == 0
    )
    card_b = (b_out / "model_card.md").read_text()
    assert "differential privacy: none (no ε guarantee)" in card_b
    capsys.readouterr()
    images = raw_test_images(trained)[:6]
    folder = tmp_path / "scans"
    (folder / "sub").mkdir(parents=True)
    for i, image in enumerate(images):
        Image.fromarray(image[..., 0]).save(folder / ("sub" if i % 2 else ".") / f"img{i}.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    # image 0 as DICOM three ways, which all decode to the same pixels: 8-bit
    # MONOCHROME2; MONOCHROME1 (stored inverted); 16-bit with rescale slope and
    # intercept (stored = 4 x pixel + 100, rescaled back by 0.25 and -25)
    first = images[0][..., 0]
    assert first.min() == 0 and first.max() == 255  # so no VOI stretch changes it
    write_dicom(folder / "m2.dcm", first, "MONOCHROME2")
    write_dicom(folder / "m1.dcm", (255 - first).astype(np.uint8), "MONOCHROME1")
    stored = (first.astype(np.uint16) * 4 + 100).astype(np.uint16)
    write_dicom(
        folder / "rescaled.dcm", stored, "MONOCHROME2", RescaleSlope=0.25, RescaleIntercept=-25
    )
    code = main(["predict", "--model", str(out), str(folder), "--csv", str(tmp_path / "r.csv")])
    err = capsys.readouterr().err
    assert code == 1  # documented: some files unreadable, the rest predicted
    rows = read_csv(tmp_path / "r.csv")
    assert len(rows) == 9
    by_file = {Path(r["file"]).name: [r[c] for c in [str(i) for i in range(10)]] for r in rows}
    assert by_file["m2.dcm"] == by_file["m1.dcm"] == by_file["rescaled.dcm"] == by_file["img0.png"]
    assert "Doe" not in err and "SECRET" not in (tmp_path / "r.csv").read_text()
    assert f"predict: {folder / 'broken.png'}: cannot decode image" in err
    summary = last_json(err)
    assert summary["predicted"] == 9 and summary["unreadable"] == 1
    assert summary["unreadable_files"] == [str(folder / "broken.png")]
    # the same classes as the npz route (PNG is lossless)
    proba, _ = node_classes(trained, "best")
    by_name = {Path(r["file"]).name: r["prediction"] for r in rows}
    assert by_name["m2.dcm"] == by_name["img0.png"]
    assert [by_name[f"img{i}.png"] for i in range(6)] == [str(c) for c in proba[:6].argmax(1)]


def test_a_changed_model_file_is_refused(trained, tmp_path, capsys):
    out = tmp_path / "pkg"
    assert (
        main(["export", "--config", str(trained), "--out", str(out), "--format", "safetensors"])
        == 0
    )
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    image = tmp_path / "x.png"
    Image.fromarray(raw_test_images(trained)[0][..., 0]).save(image)
    assert main(["predict", "--model", str(out), str(image)]) == 2
    err = capsys.readouterr().err
    assert "SHA-256 differs" in err and err.count("\n") == 1


def test_export_without_a_checkpoint_says_so_in_one_line(tmp_path, capsys):
    (plan,) = provision(tmp_path / "fed", ["solo"], protocol={"name": "fedavgp2p", "rounds": 1})
    config = tmp_path / "fed" / "solo" / "site.yaml"
    assert main(["export", "--config", str(config), "--out", str(tmp_path / "pkg")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint with a model" in err and err.count("\n") == 1
    assert not (tmp_path / "pkg" / "model.json").exists()


SIGMA, RATE = 1.1, 0.05
TRAINED = "trained"  # dp_site's default: the checkpoint's history is SIGMA, RATE for its steps


def dp_site(
    tmp_path: Path, round_no: int = 2, steps: int = 8, history: Any = TRAINED
) -> tuple[Path, Path]:
    """A provisioned DP site with a checkpoint of its initial model, no
    training run: (its site.yaml, its state directory). The checkpoint is what
    RoundLoop.checkpoint_state writes after round `round_no` of a private run,
    `steps` private steps in (its dp_steps and dp_history); `history` another
    dp_history, None for a round trained without training.dp."""
    from node.queues import Checkpoints

    provision(
        tmp_path / "fed",
        ["solo"],
        protocol={"name": "fedavgp2p", "rounds": 10},
        overrides={**FAST, "model": {"name": "small_cnn_gn"}},
        per_site={"solo": {"training": {**FAST["training"], "dp": {"target_epsilon": 4.0}}}},
    )
    config = tmp_path / "fed" / "solo" / "site.yaml"
    site = LocalSite.from_config(load_config(config))
    state = tmp_path / "fed" / "solo" / "state"
    if history == TRAINED:
        history = [[SIGMA, RATE, steps]]
    protocol = {
        "protocol": "fedavgp2p",
        "round": round_no,
        "model": site.state_dict(),
        "dp_steps": None if history is None else sum(n for _, _, n in history),
        "dp_history": history,
    }
    Checkpoints(state / "checkpoints").save({"round": round_no, "protocol": protocol})
    return config, state


def export_latest(config: Path, out: Path) -> int:
    args = ["--config", str(config), "--out", str(out), "--format", "safetensors"]
    return main(["export", *args, "--which", "latest"])


def epsilon(steps: int, delta: float | None = None) -> float:
    from p2pfl.learning.dp import DEFAULT_DELTA, ledger_epsilon

    return ledger_epsilon([(SIGMA, RATE, steps)], DEFAULT_DELTA if delta is None else delta)


def write_spent(
    state: Path, ledger_steps: int, metrics_steps: list[int], delta: float | None = None
) -> None:
    """The ledger of `ledger_steps` steps and one metrics row per round, as
    RoundLoop writes them, of a run at `delta` (default δ)."""
    from p2pfl.learning.dp import DEFAULT_DELTA

    delta = DEFAULT_DELTA if delta is None else delta
    (state / "dp_ledger.json").write_text(json.dumps({"history": [[SIGMA, RATE, ledger_steps]]}))
    rows = [
        {"round": r + 1, "dp_epsilon": epsilon(n, delta), "dp_delta": delta, "dp_steps": float(n)}
        | {"dp_noise_multiplier": SIGMA, "dp_sample_rate": RATE}
        for r, n in enumerate(metrics_steps)
    ]
    (state / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def card_dp(out: Path) -> dict[str, Any]:
    return json.loads((out / "model_card.json").read_text())["privacy"]["differential_privacy"]


def test_the_card_states_the_ledgers_epsilon_when_the_node_died_before_the_rounds_row(
    tmp_path, capsys
):
    """Review finding 2: the ledger is fsynced at every private step, before
    the round's model is offered; metrics.jsonl gets the round's row and the
    checkpoint comes only at the end of the round. A node killed between the
    two leaves a ledger of 2 rounds (8 steps), and the row and checkpoint of
    round 1: the card said ε(4 steps) spent by the site in all, though round
    2's model had left it. The exported model is round 1's: ε(4) for it."""
    config, state = dp_site(tmp_path, round_no=1, steps=4)
    write_spent(state, 8, [4])
    out = tmp_path / "pkg"
    assert export_latest(config, out) == 0
    capsys.readouterr()
    dp = card_dp(out)
    assert epsilon(4) < epsilon(8)
    assert dp["epsilon_site_total"] == pytest.approx(epsilon(8))
    assert dp["epsilon"] == pytest.approx(epsilon(4))
    card = (out / "model_card.md").read_text()
    assert f"ε = {epsilon(8):.2f} spent by the site in all" in card, card


def test_the_card_takes_the_larger_of_ledger_and_metrics(tmp_path):
    """A ledger behind the metrics (restored from an older backup): the
    metrics' figure for the total; the exported model is still priced by its
    own steps."""
    from node.export import dp_spent

    config, state = dp_site(tmp_path, round_no=1, steps=4)
    write_spent(state, 4, [4, 8])
    saved = {"round": 1, "dp_steps": 4, "dp_history": [[SIGMA, RATE, 4]]}
    dp = dp_spent(load_config(config), 1, saved)
    assert dp is not None
    assert dp["epsilon"] == pytest.approx(epsilon(4))  # the exported model's round
    assert dp["epsilon_site_total"] == pytest.approx(epsilon(8))


def test_a_checkpoint_trained_partly_without_dp_gets_no_dp_card(tmp_path, capsys):
    """Review 2, finding 1: rounds 1-5 under training.dp, then training.dp
    taken out and rounds 6-10 trained in the clear on the same checkpoint,
    then training.dp put back. The node refuses to resume it
    (dp_resume_unprivate), but export read only the ledger and metrics and
    wrote "DP-SGD, ε = 2.00 for this model". Now refused in one line, before
    any file is written, because the checkpoint records no private step."""
    config, state = dp_site(tmp_path, round_no=10, history=None)
    write_spent(state, 20, [4, 8, 12, 16, 20])
    with open(state / "metrics.jsonl", "a") as fh:  # the clear rounds: no dp_* keys
        for r in range(6, 11):
            fh.write(json.dumps({"round": r, "macro_f1": 0.5}) + "\n")
    out = tmp_path / "pkg"
    assert export_latest(config, out) == 2
    err = capsys.readouterr().err
    assert "checkpoint of round 10 was trained without it" in err, err
    assert "no privacy guarantee" in err and err.count("\n") == 1, err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    "history", ["junk", [[1.1, 0.05]], [[float("nan"), 0.05, 4]]], ids=["text", "pair", "nan"]
)
def test_a_checkpoint_whose_privacy_history_is_unreadable_refuses_in_one_line(
    tmp_path, capsys, history
):
    config, state = dp_site(tmp_path, history=[[SIGMA, RATE, 8]])
    from node.export import dp_spent
    from p2pfl.learning.export import ExportError

    write_spent(state, 8, [4, 8])
    with pytest.raises(ExportError) as caught:
        dp_spent(load_config(config), 2, {"round": 2, "dp_steps": 8, "dp_history": history})
    assert "privacy history of the checkpoint of round 2 cannot be read" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_checkpoints_own_history_counts_in_the_sites_total(tmp_path, capsys):
    """Review 2, finding 1: the checkpoint's dp_history was never read. A
    ledger restored from an older backup (4 steps) and a metrics.jsonl lost
    with the old disk made the card state ε(4) for a model of 12 steps."""
    config, state = dp_site(tmp_path, round_no=3, steps=12)
    write_spent(state, 4, [])
    out = tmp_path / "pkg"
    assert export_latest(config, out) == 0
    capsys.readouterr()
    dp = card_dp(out)
    assert dp["epsilon_site_total"] == pytest.approx(epsilon(12))
    assert dp["epsilon"] == pytest.approx(epsilon(12))


@pytest.mark.parametrize("run_delta", [1e-3, 1e-7], ids=["larger", "smaller"])
def test_the_models_epsilon_is_at_the_delta_the_card_names(tmp_path, capsys, run_delta):
    """Review 2, finding 5: the model's ε was its round's metrics row, computed
    at the δ of the run that wrote it, but labelled with the δ of the
    site.yaml given to export (train at δ = 1e-3, export at 1e-5: the card said
    0.90 where the model's ε is 1.67). Now both figures are computed from the
    privacy history at the card's δ, for the steps each covers."""
    import yaml

    from node.export import dp_spent

    config, state = dp_site(tmp_path, round_no=3, steps=12)
    write_spent(state, 12, [4, 8, 12], delta=run_delta)
    doc = yaml.safe_load(config.read_text())
    doc["training"]["dp"]["delta"] = 1e-5  # changed after the run, before the export
    config.write_text(yaml.safe_dump(doc))
    saved = {"round": 3, "dp_steps": 12, "dp_history": [[SIGMA, RATE, 12]]}
    dp = dp_spent(load_config(config), 2, saved)  # the best model, of round 2
    assert dp is not None and dp["delta"] == 1e-5
    assert dp["epsilon"] == pytest.approx(epsilon(8, 1e-5))
    assert dp["epsilon_site_total"] == pytest.approx(epsilon(12, 1e-5))
    out = tmp_path / "pkg"
    assert export_latest(config, out) == 0  # the latest model, of round 3
    capsys.readouterr()
    assert card_dp(out)["epsilon"] == pytest.approx(epsilon(12, 1e-5))
    assert f"ε = {epsilon(12, 1e-5):.2f} at δ = 1e-05" in (out / "model_card.md").read_text()


def test_a_model_of_an_earlier_round_is_priced_at_the_noise_of_its_own_steps(tmp_path):
    """A site.yaml changed between two starts: 4 steps at σ 1.1, then 8 at
    σ 3.0. The model of round 1 was trained with the first 4 only."""
    from node.export import dp_spent
    from p2pfl.learning.dp import DEFAULT_DELTA, ledger_epsilon

    history = [[SIGMA, RATE, 4], [3.0, RATE, 8]]
    config, state = dp_site(tmp_path, round_no=3, history=history)
    (state / "dp_ledger.json").write_text(json.dumps({"history": history}))
    rows = [
        {"round": r, "dp_epsilon": 0.1, "dp_delta": DEFAULT_DELTA, "dp_steps": n}
        for r, n in ((1, 4), (2, 8), (3, 12))
    ]
    (state / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    saved = {"round": 3, "dp_steps": 12, "dp_history": history}
    first = dp_spent(load_config(config), 1, saved)
    second = dp_spent(load_config(config), 2, saved)
    assert first is not None and second is not None
    assert first["epsilon"] == pytest.approx(epsilon(4))
    expected = ledger_epsilon([(SIGMA, RATE, 4), (3.0, RATE, 4)], DEFAULT_DELTA)
    assert second["epsilon"] == pytest.approx(expected)
    assert first["epsilon_site_total"] == pytest.approx(
        ledger_epsilon([(SIGMA, RATE, 4), (3.0, RATE, 8)], DEFAULT_DELTA)
    )


@pytest.mark.parametrize(
    ("ledger", "said"),
    [
        ("{", "cannot be read"),
        ('{"history": [[1.1, "x", 8]]}', "cannot be read"),
        (None, "missing"),
    ],
    ids=["torn", "wrong", "missing"],
)
def test_an_unreadable_privacy_ledger_refuses_the_export_in_one_line(
    tmp_path, capsys, ledger, said
):
    """Without the ledger the ε the site spent is unknown: no card, and no
    package either (refused before any file is written)."""
    config, state = dp_site(tmp_path)
    write_spent(state, 8, [4])
    if ledger is None:
        (state / "dp_ledger.json").unlink()
    else:
        (state / "dp_ledger.json").write_text(ledger)
    out = tmp_path / "pkg"
    assert export_latest(config, out) == 2
    err = capsys.readouterr().err
    assert "privacy ledger" in err and said in err and err.count("\n") == 1, err
    assert not out.exists() or not any(out.iterdir())


def test_predict_without_a_package_says_so(tmp_path, capsys):
    assert main(["predict", "--model", str(tmp_path), str(tmp_path)]) == 2
    assert "no model.json" in capsys.readouterr().err


def test_scatternet_refuses_torchscript_in_one_line_and_leaves_no_file(tmp_path):
    """TorchScript cannot trace kymatio's Python autograd Function in
    scatternet_linear's scattering: that format is refused with the formats
    that work before any file is written, so no half package; safetensors
    reads back as torch runs it. (Its ONNX export works but takes minutes on a
    CPU, so the suite does not run it: docs/export.md.)"""
    import torch

    from p2pfl.learning.export import Architecture, ExportError, write_package

    torch.manual_seed(0)
    arch = Architecture("scatternet_linear", 1, 2, 28)
    state = arch.build().state_dict()
    check = torch.rand(4, 1, 28, 28) * 2 - 1
    done = write_package(tmp_path / "a", state, arch, ["no", "yes"], ["safetensors"], check)
    assert done["files"]["safetensors"]["max_abs_diff"] == 0.0
    with pytest.raises(ExportError, match="--format safetensors onnx") as refused:
        write_package(
            tmp_path / "b", state, arch, ["no", "yes"], ["safetensors", "torchscript"], check
        )
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "b").exists()  # refused before anything was written


def test_the_onnx_files_sha256_covers_its_weights(tmp_path):
    """torch's exporter writes the weights beside model.onnx, in model.onnx.data,
    which model.json did not hash: a review multiplied every weight there by -3
    and `predict --runtime onnx` took the package (probabilities off by 0.4).
    The weights are now inside model.onnx, and nothing else is written."""
    import torch

    from p2pfl.learning.export import Architecture, ExportError, Predictor, write_package

    torch.manual_seed(0)
    arch = Architecture("small_cnn", 1, 2, 16)
    check = torch.rand(4, 1, 16, 16)
    write_package(tmp_path, arch.build().state_dict(), arch, ["a", "b"], ["onnx"], check)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "model.onnx"]
    Predictor(tmp_path, "onnx")  # reads back
    model = tmp_path / "model.onnx"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the weights, which are most of the file
    model.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="SHA-256 differs"):
        Predictor(tmp_path, "onnx")


def test_predict_refuses_an_onnx_whose_weights_are_in_an_unhashed_file(tmp_path):
    """A package exported before the weights went inside model.onnx keeps them
    in model.onnx.data, which model.json does not hash: a review multiplied
    every weight there by -3 and `predict --runtime onnx` still took it. Such a
    model.onnx is refused, and the bytes hashed are the bytes onnxruntime runs."""
    import json

    import numpy as np
    import onnx
    import torch

    from p2pfl.learning.export import Architecture, ExportError, Predictor, sha256_of, write_package

    torch.manual_seed(0)
    arch = Architecture("small_cnn", 1, 2, 16)
    write_package(
        tmp_path, arch.build().state_dict(), arch, ["a", "b"], ["onnx"], torch.rand(4, 1, 16, 16)
    )
    model = tmp_path / "model.onnx"
    # what the exporter wrote before: the weights beside model.onnx, model.json hashing model.onnx
    onnx.save_model(
        onnx.load(str(model)), str(model), save_as_external_data=True, location="model.onnx.data"
    )
    meta = json.loads((tmp_path / "model.json").read_text())
    meta["files"]["onnx"]["sha256"] = sha256_of(model)
    (tmp_path / "model.json").write_text(json.dumps(meta))
    weights = tmp_path / "model.onnx.data"
    weights.write_bytes((np.frombuffer(weights.read_bytes(), dtype=np.float32) * -3).tobytes())
    with pytest.raises(ExportError, match="weights are in another file"):
        Predictor(tmp_path, "onnx")


def test_export_replaces_an_earlier_package_only_and_never_writes_through_a_link(tmp_path):
    """--out used to be written into whatever it held: a link at model.json had
    the unrelated file it pointed to overwritten with the description, an
    earlier export's model.pt stayed beside a model.json that no longer named
    it (shipped with the package, another model's code), and under umask 000
    model.json was created 0777 through the link, model.onnx 0666. Now a folder
    holding other files, or a path through a file, is refused, unchanged; an earlier package is replaced
    (links at its names replaced, not followed, its other formats removed); the
    files are 0644 whatever the umask, as the card is."""
    import os
    import stat

    import torch

    from p2pfl.learning.export import Architecture, ExportError, Predictor, write_package

    torch.manual_seed(0)
    arch = Architecture("small_cnn", 1, 2, 16)
    state, check = arch.build().state_dict(), torch.rand(4, 1, 16, 16)

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "notes.txt").write_text("the operator's own\n")
    with pytest.raises(ExportError, match="notes.txt") as refused:
        write_package(mixed, state, arch, ["a", "b"], ["safetensors"], check)
    assert "\n" not in str(refused.value)
    assert sorted(p.name for p in mixed.iterdir()) == ["notes.txt"]
    for through_a_file in (mixed / "notes.txt", mixed / "notes.txt" / "package"):
        with pytest.raises(ExportError, match="--out"):  # FileExistsError, a traceback, before
            write_package(through_a_file, state, arch, ["a", "b"], ["safetensors"], check)

    out = tmp_path / "package"
    out.mkdir()
    victim = tmp_path / "victim.json"
    victim.write_text("unrelated\n")
    (out / "model.json").symlink_to(victim)
    (out / "model.pt").write_bytes(b"an earlier export's TorchScript")
    (out / ".export-killed").mkdir()  # the scratch folder of an export that was killed
    previous = os.umask(0)
    try:
        write_package(out, state, arch, ["a", "b"], ["safetensors"], check)
    finally:
        os.umask(previous)
    assert victim.read_text() == "unrelated\n"
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.safetensors"]
    for path in out.iterdir():
        assert not path.is_symlink()
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, (path, oct(path.stat().st_mode))
    Predictor(out, "torch")


def test_a_failed_re_export_keeps_the_earlier_package(tmp_path, monkeypatch):
    """An export into a folder holding an earlier package removed that
    package's model.json before writing a file of its own, so an export that
    then failed (an ONNX read back outside tolerance, onnxruntime missing, a
    full disk, a kill) left a folder `predict` refused: the site's working
    package lost to a failed attempt. The new files are now all written and
    checked first; the earlier package is replaced only after that."""
    import torch

    from p2pfl.learning import export as export_module
    from p2pfl.learning.export import Architecture, ExportError, Predictor, write_package

    torch.manual_seed(0)
    arch = Architecture("small_cnn", 1, 2, 16)
    state, check = arch.build().state_dict(), torch.rand(4, 1, 16, 16)
    out = tmp_path / "package"
    write_package(out, state, arch, ["a", "b"], ["safetensors"], check)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fails(*args, **kwargs):
        raise ExportError("onnx: read back, its probabilities differ (a review's stand-in)")

    monkeypatch.setitem(export_module._WRITERS, "onnx", fails)
    retrained = Architecture("small_cnn", 1, 2, 16).build().state_dict()
    with pytest.raises(ExportError, match="a review's stand-in"):
        write_package(out, retrained, arch, ["a", "b"], ["safetensors", "onnx"], check)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    Predictor(out, "torch")


def test_evaluates_json_is_written_whole_and_never_through_a_link(trained, tmp_path, capsys):
    """`evaluate --json` wrote with Path.write_text: through a link at the name
    (a review had an unrelated file overwritten), with the umask's mode (0644:
    every figure of every site's test split, for any local account) and in
    place (a crash left half a file). It is written atomically, 0600, a link
    at the name replaced."""
    import os
    import stat

    victim = tmp_path / "unrelated.txt"
    victim.write_text("unrelated\n")
    out = tmp_path / "eval.json"
    out.symlink_to(victim)
    previous = os.umask(0o022)
    try:
        code = main(
            ["evaluate", "--federation-dir", str(trained.parent.parent), "--json", str(out)]
        )
    finally:
        os.umask(previous)
    assert code == 0
    capsys.readouterr()
    assert victim.read_text() == "unrelated\n"
    assert not out.is_symlink() and stat.S_IMODE(out.stat().st_mode) == 0o600
    assert sorted(json.loads(out.read_text())["matrix"]) == ["a", "b"]


def test_the_weights_run_are_the_bytes_hashed_not_a_second_read(tmp_path, monkeypatch):
    """model.safetensors was hashed, then read again from disk to load: a local
    writer who swapped the file in between had weights run that no hash checked
    (a review, rv_io2, 2026-11-28). The swap is made here at the moment the
    package's bytes are hashed; the predictor must run the weights it hashed."""
    import hashlib

    import torch

    import p2pfl.learning.export as export
    from p2pfl.learning.export import Architecture, Predictor, write_package

    torch.manual_seed(0)
    arch = Architecture("small_cnn", 1, 2, 16)
    state, check = arch.build().state_dict(), torch.rand(4, 1, 16, 16)
    write_package(tmp_path, state, arch, ["a", "b"], ["safetensors"], check)
    weights = tmp_path / "model.safetensors"
    other = tmp_path.parent / "other"
    write_package(
        other, {k: v + 1.0 for k, v in state.items()}, arch, ["a", "b"], ["safetensors"], check
    )

    class Racing:
        """hashlib, with a writer swapping the file as soon as it is hashed."""

        @staticmethod
        def sha256(*args):  # type: ignore[no-untyped-def]
            digest = hashlib.sha256(*args)
            weights.write_bytes((other / "model.safetensors").read_bytes())
            return digest

        @staticmethod
        def file_digest(handle, name):  # type: ignore[no-untyped-def]
            digest = hashlib.file_digest(handle, name)
            weights.write_bytes((other / "model.safetensors").read_bytes())
            return digest

    monkeypatch.setattr(export, "hashlib", Racing)
    predictor = Predictor(tmp_path, "torch")
    expected = arch.build()
    expected.load_state_dict(state)
    x = torch.rand(3, 1, 16, 16)
    with torch.no_grad():
        want = torch.softmax(expected.eval()(x), dim=1)
    assert np.allclose(predictor.predict_proba(x), want.numpy(), atol=1e-5)
