"""bench.dev_split: the development copy's test split is the source's val
split, its val split a stratified draw from the source's train split, and no
image of the source's test split is in it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import dev_split


def source(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    # each image is its own index (as a uint8 pair), so membership can be traced
    arrays: dict[str, np.ndarray] = {}
    start = 0
    for split, labels in (
        ("train", [0] * 40 + [1] * 160),
        ("val", [0] * 10 + [1] * 10),
        ("test", [0] * 12 + [1] * 8),
    ):
        n = len(labels)
        ids = np.arange(start, start + n)
        start += n
        images = np.zeros((n, 4, 4), dtype=np.uint8)
        images[:, 0, 0], images[:, 0, 1] = ids // 256, ids % 256
        order = rng.permutation(n)
        arrays[f"{split}_images"] = images[order]
        arrays[f"{split}_labels"] = np.array(labels, dtype=np.uint8).reshape(-1, 1)[order]
    np.savez(path, **arrays)
    return arrays


def ids(images: np.ndarray) -> set[int]:
    return set((images[:, 0, 0].astype(int) * 256 + images[:, 0, 1]).tolist())


def test_the_copy_holds_no_test_image_and_draws_val_like_train(tmp_path, capsys) -> None:
    src = source(tmp_path / "src.npz")
    dev_split.main([str(tmp_path / "src.npz"), "--out", str(tmp_path / "dev.npz")])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with np.load(tmp_path / "dev.npz") as dev:
        copy = {k: dev[k] for k in dev.files}
    assert np.array_equal(copy["test_images"], src["val_images"])
    assert np.array_equal(copy["test_labels"], src["val_labels"])
    assert not ids(src["test_images"]) & set().union(
        *(ids(copy[f"{s}_images"]) for s in dev_split.SPLITS)
    )
    train, val = ids(copy["train_images"]), ids(copy["val_images"])
    assert not train & val and train | val == ids(src["train_images"])
    # as large as the source's val split, in train's class shares (20 % class 0)
    assert summary["class_counts"] == {"train": [36, 144], "val": [4, 16], "test": [10, 10]}


def test_a_source_without_a_val_split_is_refused_in_one_line(tmp_path) -> None:
    np.savez(tmp_path / "bare.npz", train_images=np.zeros((4, 2, 2)), train_labels=np.zeros(4))
    with pytest.raises(SystemExit, match="no val_images"):
        dev_split.main([str(tmp_path / "bare.npz"), "--out", str(tmp_path / "dev.npz")])
    with pytest.raises(SystemExit, match="no such file"):
        dev_split.main([str(tmp_path / "missing.npz"), "--out", str(tmp_path / "dev.npz")])


def test_the_copy_is_this_accounts_only_whatever_the_umask(tmp_path) -> None:
    """The copy holds the source's images: a review read a 0600 source's copy at
    0644 in a 0755 folder (umask 022), open to every local account. The copy is
    0600 and a folder made for it 0700 (one that exists keeps its mode)."""
    import os
    import stat

    source(tmp_path / "src.npz")
    (tmp_path / "src.npz").chmod(0o600)
    old = os.umask(0o022)
    try:
        dev_split.main(
            [str(tmp_path / "src.npz"), "--out", str(tmp_path / "dev" / "a" / "dev.npz")]
        )
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "dev" / "a" / "dev.npz").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "dev" / "a").stat().st_mode) == 0o700
