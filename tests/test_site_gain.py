"""Issue 30, "an evaluation that can tell": the partition flags every site
whose test split is under the per-class minimum, and bench.federation's
per-site gain table (each site's reported model minus the same site alone)
counts the sites that gained, sets the flagged sites apart, prints and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.federation.report import gain_table_lines, write_gain_plot
from bench.federation.stats import add_global_test, reported_model, site_gain_table
from p2pfl.learning.data.partition import PartitionError, partition_dataset


def _two_class_source(path: Path, test_counts: tuple[int, int]) -> str:
    """A MedMNIST-style .npz: 20 training images of each class (4x4 grey), and
    `test_counts` test images of classes "normal" and "rare"."""
    rng = np.random.default_rng(0)

    def images(n: int) -> np.ndarray:
        return rng.integers(0, 256, size=(n, 4, 4), dtype=np.uint8)

    test_labels = np.repeat([0, 1], test_counts)
    np.savez(
        path,
        train_images=images(40),
        train_labels=np.repeat([0, 1], 20),
        val_images=images(10),
        val_labels=np.repeat([0, 1], 5),
        test_images=images(len(test_labels)),
        test_labels=test_labels,
        class_names=np.array(["normal", "rare"]),
    )
    return str(path)


def test_partition_flags_the_site_whose_test_split_is_under_the_minimum(tmp_path: Path) -> None:
    # shards:1 over 2 sites: one site trains only on "normal", the other only on
    # "rare"; the 5 "rare" test images all go to the site that trains on it
    source = _two_class_source(tmp_path / "src.npz", (30, 5))
    summary = partition_dataset(source, 2, "shards:1", tmp_path / "local", min_test_per_class=20)
    by_class = {tuple(row["train"]): row for row in summary["per_site"]}
    normal, rare = by_class[(20, 0)], by_class[(0, 20)]
    assert normal["test"] == [30, 0] and normal["test_short_classes"] == {}
    assert normal["test_minimum_met"]  # the 0 "rare" images do not count: it has no rare class
    assert rare["test"] == [0, 5] and rare["test_short_classes"] == {"rare": 5}
    assert not rare["test_minimum_met"]
    assert summary["min_test_per_class"] == 20
    assert summary["sites_below_test_minimum"] == [rare["site"]]
    on_disk = json.loads((tmp_path / "local" / "partition.json").read_text())
    assert on_disk["sites_below_test_minimum"] == [rare["site"]]

    # a minimum the rare class meets flags nobody; the same files otherwise
    met = partition_dataset(source, 2, "shards:1", tmp_path / "five", min_test_per_class=5)
    assert met["sites_below_test_minimum"] == []
    assert [r["train"] for r in met["per_site"]] == [r["train"] for r in summary["per_site"]]


def test_a_global_test_split_is_checked_too_and_a_bad_minimum_is_refused(tmp_path: Path) -> None:
    source = _two_class_source(tmp_path / "src.npz", (30, 5))
    summary = partition_dataset(source, 2, "shards:1", tmp_path / "g", test="global")
    by_class = {tuple(row["train"]): row for row in summary["per_site"]}
    assert by_class[(0, 20)]["test_short_classes"] == {"rare": 5}
    assert by_class[(20, 0)]["test_short_classes"] == {}
    for bad in (-1, 2.5, True):
        with pytest.raises(PartitionError, match="min-test-per-class"):
            partition_dataset(source, 2, "iid", tmp_path / "bad", min_test_per_class=bad)  # type: ignore[arg-type]


def test_the_reported_model_is_the_validation_choice_then_the_best_then_the_latest() -> None:
    latest = {"macro_f1": 0.5, "balanced_accuracy": 0.55, "auc": 0.6}
    best = {**latest, "best_macro_f1": 0.7, "best_balanced_accuracy": 0.72, "best_auc": None}
    chosen = {
        **best,
        "reported": "personal",
        "reported_macro_f1": 0.9,
        "reported_balanced_accuracy": 0.91,
        "reported_auc": 0.95,
    }
    assert reported_model(latest) == (
        "latest",
        {"macro_f1": 0.5, "balanced_accuracy": 0.55, "auc": 0.6},
    )
    assert reported_model(best) == (
        "best",
        {"macro_f1": 0.7, "balanced_accuracy": 0.72, "auc": None},
    )
    assert reported_model(chosen) == (
        "personal",
        {"macro_f1": 0.9, "balanced_accuracy": 0.91, "auc": 0.95},
    )
    assert reported_model({})[0] == "none"
    as_logged = {k: v for k, v in chosen.items() if k != "reported"}  # a daemon logs numbers
    assert reported_model({**as_logged, "reported_personal": 0.0})[0] == "federated"
    assert reported_model({**as_logged, "reported_personal": 1.0})[0] == "personal"
    # a personal model the site trained alone is named so (the table counts it)
    alone = {**as_logged, "reported_personal": 1.0, "personal_trained_alone": 1.0}
    assert reported_model(alone)[0] == "alone"
    assert reported_model({**alone, "personal_trained_alone": 0.0})[0] == "personal"


def _constructed_inputs() -> tuple[Any, ...]:
    """Four sites: site_0 and site_1 gain, site_2 loses 1 point (inside the
    2-point tolerance), site_3 loses 10 points but its test split is under the
    minimum (reported apart)."""
    partition = {
        "min_test_per_class": 20,
        "per_site": [
            {"site": 0, "train": [80, 20], "test": [40, 20], "labelled": 100},
            {"site": 1, "train": [10, 30], "test": [25, 30], "labelled": 40},
            {"site": 2, "train": [50, 50], "test": [30, 30], "labelled": 100},
            {
                "site": 3,
                "train": [9, 1],
                "test": [22, 3],
                "labelled": 10,
                "test_short_classes": {"1": 3},
            },
        ],
    }
    federation = {
        "site_0": {"reported": "personal", "reported_macro_f1": 0.80, "reported_auc": 0.9},
        "site_1": {"best_macro_f1": 0.70, "best_balanced_accuracy": 0.75, "best_auc": 0.8},
        "site_2": {"best_macro_f1": 0.59, "best_balanced_accuracy": 0.60, "best_auc": 0.7},
        "site_3": {"macro_f1": 0.40, "balanced_accuracy": 0.5, "auc": 0.5},
    }
    standalone = {
        "site_0": {"best_macro_f1": 0.75, "best_auc": 0.85},
        "site_1": {"best_macro_f1": 0.60, "best_balanced_accuracy": 0.70, "best_auc": 0.7},
        "site_2": {"best_macro_f1": 0.60, "best_balanced_accuracy": 0.62, "best_auc": 0.8},
        "site_3": {"best_macro_f1": 0.50, "best_balanced_accuracy": 0.5, "best_auc": 0.6},
    }
    return federation, standalone, partition


def _constructed() -> dict[str, Any]:
    names = [f"site_{i}" for i in range(4)]
    return site_gain_table(names, *_constructed_inputs())


def _inputs_with_alone(site: str) -> tuple[Any, ...]:
    """_constructed's inputs, with `site` reporting the model it trained alone."""
    args = _constructed_inputs()
    federation = {k: dict(v) for k, v in args[0].items()}
    federation[site] = {
        "reported_personal": 1.0,
        "personal_trained_alone": 1.0,
        "reported_macro_f1": federation[site]["best_macro_f1"],
    }
    return (federation, *args[1:])


def test_gain_table_counts_the_gainers_and_sets_the_flagged_sites_apart() -> None:
    table = _constructed()
    rows = {r["node"]: r for r in table["sites"]}
    assert [rows[n]["gain_macro_f1"] for n in rows] == [0.05, 0.1, -0.01, -0.1]
    assert rows["site_0"]["reported_model"] == "personal"
    assert rows["site_0"]["gain_balanced_accuracy"] is None  # neither side logged it
    assert rows["site_0"]["majority_share"] == 0.8 and rows["site_3"]["majority_share"] == 0.9
    assert rows["site_1"]["test_size"] == 55 and rows["site_1"]["test_per_class"] == [25, 30]
    assert [r["below_test_minimum"] for r in table["sites"]] == [False, False, False, True]
    assert table["sites_apart"] == ["site_3"]

    assert (table["sites_compared"], table["sites_gained"]) == (4, 2)
    assert table["sites_reporting_alone"] == 0
    assert table["share_gained"] == 0.5
    assert table["share_within_tolerance"] == 0.75  # site_2 (-1 point) is within 2 points
    assert table["mean_gain_macro_f1"] == pytest.approx((0.05 + 0.1 - 0.01 - 0.1) / 4, abs=1e-4)
    assert table["mean_gain_balanced_accuracy"] == pytest.approx((0.05 - 0.02 + 0.0) / 3, abs=1e-4)

    assert (table["sites_compared_without_apart"], table["sites_gained_without_apart"]) == (3, 2)
    assert table["share_gained_without_apart"] == 0.6667
    assert table["share_within_tolerance_without_apart"] == 1.0
    assert table["mean_gain_macro_f1_without_apart"] == pytest.approx(
        (0.05 + 0.1 - 0.01) / 3, abs=1e-4
    )


def test_gain_table_prints_every_site_and_draws_a_non_empty_plot(tmp_path: Path) -> None:
    table = _constructed()
    lines = gain_table_lines(table, "fedavgp2p random c=0.5")
    text = "\n".join(lines)
    for name in ("site_0", "site_1", "site_2", "site_3 *"):
        assert name in text
    assert "+0.100" in text and "-0.010" in text
    assert "all sites: 2 of 4 gained (50%), 75% not worse" in text
    assert "without the sites apart: 2 of 3 gained (67%)" in text
    assert "site_3: class 1: 3" in text
    assert "trained alone" not in text
    # a site that reports the model it trained alone is counted, not hidden in a share
    again = site_gain_table([r["node"] for r in table["sites"]], *_inputs_with_alone("site_2"))
    assert again["sites_reporting_alone"] == 1 and again["sites_reporting_alone_without_apart"] == 1
    assert (
        "all sites: 2 of 4 gained (50%), 75% not worse than alone by more than 2 points; "
        "1 of 4 report the model they trained alone"
        in "\n".join(gain_table_lines(again, "fedavgp2p random c=0.5"))
    )

    path = write_gain_plot(tmp_path, "site_gain", table, "constructed")
    assert path == tmp_path / "site_gain.png"
    assert path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_global_test_figures_join_the_table_and_say_why_when_the_nodes_are_missing() -> None:
    reference = {
        "n": 300,
        "standalone": {f"site_{i}": {"macro_f1": 0.5 + 0.1 * i} for i in range(4)},
        "standalone_macro_f1_mean": 0.65,
        "pooled": {"macro_f1": 0.9},
    }
    table = _constructed()
    nodes = {"models": {f"site_{i}": {"macro_f1": 0.7} for i in range(4)}, "which": {}}
    add_global_test(table, nodes, reference)
    assert [r["gain_global_macro_f1"] for r in table["sites"]] == [0.2, 0.1, 0.0, -0.1]
    assert (table["global_sites_gained"], table["global_sites_compared"]) == (2, 4)
    assert table["global_mean_gain_macro_f1"] == pytest.approx(0.05, abs=1e-4)
    assert "global_missing" not in table
    line = gain_table_lines(table, "run")[-1]
    assert line.startswith("global test set (300 images): standalone macro-F1 mean 0.650")
    assert "pooled 0.900" in line and "2 of 4 sites gained" in line

    in_memory = _constructed()
    add_global_test(in_memory, {"missing": "in-memory nodes keep no checkpoints"}, reference)
    assert in_memory["global_sites_compared"] == 0
    assert (
        "not scored (in-memory nodes keep no checkpoints)" in gain_table_lines(in_memory, "r")[-1]
    )


def test_a_personalizing_node_shows_both_models() -> None:
    table = _constructed()
    assert "personal" not in gain_table_lines(table, "run")[1]
    rows = {r["node"]: r for r in table["sites"]}
    assert (
        rows["site_1"]["federated_macro_f1"] == 0.7 and rows["site_1"]["personal_macro_f1"] is None
    )
    partition = {"per_site": [{"site": 0, "train": [5, 5], "test": [20, 20], "labelled": 10}]}
    record = {
        "reported": "personal",
        "reported_macro_f1": 0.8,
        "personal_macro_f1": 0.8,
        "best_macro_f1": 0.6,
        "macro_f1": 0.55,
    }
    one = site_gain_table(
        ["site_0"], {"site_0": record}, {"site_0": {"best_macro_f1": 0.7}}, partition
    )
    lines = gain_table_lines(one, "run")
    assert lines[1].endswith("personal federated")
    assert lines[2].split()[-2:] == ["0.800", "0.600"]  # personal, federated (best on val)
    assert one["sites"][0]["gain_macro_f1"] == 0.1
