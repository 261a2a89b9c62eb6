"""Data loaders, partitioners and augmentations."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from p2pfl.config import DataSection
from p2pfl.learning.data import (
    DataError,
    convert_images,
    load_site_data,
    read_source,
    to_float_tensor,
    to_uint8_images,
)
from p2pfl.learning.data.augment import augment_batch, strong_augment_batch, weak_augment_batch
from p2pfl.learning.data.partition import (
    PartitionError,
    add_partition_arguments,
    parse_scheme,
    partition_dataset,
    run_partition,
)


def _write_npz(
    path: Path, n_train: int = 60, size: int = 12, classes: int = 3, **extra: np.ndarray
) -> Path:
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, size, size), dtype=np.uint8),
        "train_labels": (np.arange(n_train) % classes).reshape(-1, 1),  # MedMNIST keeps (n, 1)
        "test_images": rng.integers(0, 256, (15, size, size), dtype=np.uint8),
        "test_labels": (np.arange(15) % classes).reshape(-1, 1),
    }
    arrays.update(extra)
    np.savez(path, **arrays)
    return path


def _write_png_tree(root: Path, size: int = 10, mode: str = "L") -> Path:
    rng = np.random.default_rng(1)
    layout = {"train": {"cat": 6, "dog": 4}, "test": {"cat": 2, "dog": 3}}
    for split, classes in layout.items():
        for cls, count in classes.items():
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(count):
                shape = (size, size) if mode == "L" else (size, size, 3)
                Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(
                    folder / f"{i}.png"
                )
    (root / "unlabeled").mkdir()
    for i in range(5):
        shape = (size, size) if mode == "L" else (size, size, 3)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(
            root / "unlabeled" / f"u{i}.png"
        )
    return root


# ---------------------------------------------------------------------- loaders


def test_digits_loads_embedded_with_expected_shapes() -> None:
    data = load_site_data(DataSection(source="digits", image_size=8, channels=1), seed=0)
    assert data.num_classes == 10
    assert data.class_names == [str(i) for i in range(10)]
    assert len(data.train) + len(data.val) + len(data.test) == 1797
    x, y = data.train.tensors
    assert x.shape == (len(data.train), 1, 8, 8) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    assert (
        data.train_uint8.shape == (len(data.train), 8, 8, 1) and data.train_uint8.dtype == np.uint8
    )
    # the uint8 arrays and the float tensors are the same images
    assert np.array_equal(to_uint8_images(x), data.train_uint8)


def test_npz_round_trip_resize_channels_and_val_split(tmp_path: Path) -> None:
    path = _write_npz(tmp_path / "set.npz", n_train=60, size=12)
    raw = read_source(str(path))
    assert raw.train_images.shape == (60, 12, 12, 1) and raw.train_labels.shape == (60,)
    data = load_site_data(
        DataSection(source=str(path), image_size=16, channels=3, val_fraction=0.2), seed=3
    )
    assert data.train.tensors[0].shape[1:] == (3, 16, 16)
    assert data.channels == 3 and data.image_size == 16
    # no val split in the file: 20 % of every class is split off train
    assert data.class_counts("val") == [4, 4, 4]
    assert data.class_counts("train") == [16, 16, 16]
    assert len(data.test) == 15
    # grayscale -> RGB repeats the channel
    rgb = data.train_uint8
    assert np.array_equal(rgb[..., 0], rgb[..., 1]) and np.array_equal(rgb[..., 1], rgb[..., 2])


def test_convert_images_rgb_to_gray_and_shrink() -> None:
    red = np.zeros((2, 32, 32, 3), np.uint8)
    red[..., 0] = 200
    gray = convert_images(red, 8, 1)
    assert gray.shape == (2, 8, 8, 1)
    assert int(gray[0, 0, 0, 0]) == round(0.299 * 200)
    back = to_uint8_images(to_float_tensor(gray))
    assert np.array_equal(back, gray)


def test_label_fraction_moves_the_rest_to_unlabeled(tmp_path: Path) -> None:
    path = _write_npz(
        tmp_path / "set.npz", n_train=60, size=8, unlabeled_images=np.zeros((7, 8, 8), np.uint8)
    )
    cfg = DataSection(source=str(path), image_size=8, val_fraction=0.0, label_fraction=0.25)
    data = load_site_data(cfg, seed=0)
    assert data.val is None
    assert data.class_counts("train") == [5, 5, 5]  # 25 % of 20 per class
    assert len(data.unlabeled) == 7 + 45  # file's own unlabeled pool + the unlabelled 75 %
    assert data.unlabeled.tensors[0].shape == (52, 1, 8, 8)
    assert data.unlabeled_uint8.shape == (52, 8, 8, 1)


def test_image_folder_tree(tmp_path: Path) -> None:
    root = _write_png_tree(tmp_path / "tree", size=10)
    data = load_site_data(
        DataSection(source=str(root), image_size=10, channels=1, val_fraction=0.0), seed=0
    )
    assert data.class_names == ["cat", "dog"]
    assert data.class_counts("train") == [6, 4]
    assert data.class_counts("test") == [2, 3]
    assert len(data.unlabeled) == 5
    # pixel values survive the PNG round trip exactly
    first = np.asarray(Image.open(root / "train" / "cat" / "0.png"))
    assert np.array_equal(data.train_uint8[0, ..., 0], first)


def test_image_folder_rgb_to_gray(tmp_path: Path) -> None:
    root = _write_png_tree(tmp_path / "tree", size=12, mode="RGB")
    data = load_site_data(DataSection(source=str(root), image_size=8, channels=1), seed=0)
    assert data.train.tensors[0].shape[1:] == (1, 8, 8)


def test_two_channels_are_refused_by_the_config() -> None:
    """data.channels allowed 1 to 4, but images have 1, 3 or 4: `check` passed
    `channels: 2` and the node stopped at its first image with convert_images'
    ValueError, a traceback. The config refuses it."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="images have 1"):
        DataSection(channels=2)
    assert [DataSection(channels=c).channels for c in (1, 3, 4)] == [1, 3, 4]


def test_one_stray_label_does_not_make_millions_of_classes(tmp_path: Path) -> None:
    """An .npz without class_names names its classes 0..max label: one stray
    label of 10**7 made 10**7 + 1 class names (1.2 GB, 3 s; 10**9 would not
    fit in memory) before anything checked it. Past 10 000 unnamed classes
    it is a DataError naming the label."""
    path = tmp_path / "stray.npz"
    np.savez(
        path, train_images=np.zeros((4, 8, 8), np.uint8), train_labels=np.array([0, 1, 2, 10**7])
    )
    with pytest.raises(DataError, match="label 10000000 without class_names") as err:
        read_source(str(path))
    assert err.value.reason == "bad_labels"


def test_class_names_are_few_enough_and_distinct(tmp_path: Path) -> None:
    """The 10 000-class limit held only without class_names: an .npz of 400 kB
    whose class_names were 10**8 empty strings (compressed ~1000-fold) made a
    model of 10**8 outputs at a node's start, and duplicate names made a model
    with two outputs for one class (and a predictions CSV with two columns of
    one name). Both are a DataError now, before any class is built."""
    images, labels = np.zeros((4, 8, 8), np.uint8), np.array([0, 1, 0, 1])
    many = tmp_path / "many.npz"
    np.savez_compressed(
        many, train_images=images, train_labels=labels, class_names=np.full(10_001, "", "<U1")
    )
    with pytest.raises(DataError, match="10001 class names") as err:
        read_source(str(many))
    assert err.value.reason == "bad_labels"
    twice = tmp_path / "twice.npz"
    np.savez(twice, train_images=images, train_labels=labels, class_names=np.array(["a", "a"]))
    with pytest.raises(DataError, match="'a' twice") as err:
        read_source(str(twice))
    assert err.value.reason == "bad_labels"
    fine = tmp_path / "fine.npz"
    np.savez(fine, train_images=images, train_labels=labels, class_names=np.array(["-", "a"]))
    assert read_source(str(fine)).class_names == ["-", "a"]


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found") as err:
        read_source(str(tmp_path / "nope.npz"))
    assert err.value.reason == "missing_source"

    corrupt = tmp_path / "bad.npz"
    corrupt.write_bytes(b"not a zip at all")
    with pytest.raises(DataError, match="bad.npz") as err:
        read_source(str(corrupt))
    assert err.value.reason == "corrupt_source"

    np.savez(
        tmp_path / "short.npz", train_images=np.zeros((4, 8, 8), np.uint8), train_labels=np.zeros(3)
    )
    with pytest.raises(DataError, match="3 labels for 4 images") as err:
        read_source(str(tmp_path / "short.npz"))
    assert err.value.reason == "length_mismatch"

    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(DataError, match="no class folders") as err:
        read_source(str(tmp_path / "empty"))
    assert err.value.reason == "no_classes"

    root = _write_png_tree(tmp_path / "tree", size=10)
    Image.fromarray(np.zeros((11, 10), np.uint8)).save(root / "train" / "dog" / "odd.png")
    with pytest.raises(DataError, match="odd.png") as err:
        read_source(str(root))
    assert err.value.reason == "mismatched_sizes"

    (root / "train" / "dog" / "odd.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(DataError, match="odd.png") as err:
        read_source(str(root))
    assert err.value.reason == "corrupt_image"


def _png_declaring(path: Path, width: int, height: int, rows: int) -> Path:
    """A greyscale PNG whose header declares width x height but whose data holds
    `rows` rows of zeros: a few hundred bytes for any declared size."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    data = zlib.compress(b"\0" * (width + 1) * rows)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )
    return path


@pytest.mark.parametrize(
    ("width", "height"),
    [(60_000, 60_000), (10_000, 10_000)],
    ids=["over-pillows-error-limit", "between-pillows-warning-and-error"],
)
def test_an_image_declaring_too_many_pixels_is_a_data_error(
    tmp_path: Path, width: int, height: int
) -> None:
    """A 600-byte PNG declaring 60000 x 60000 raised Pillow's
    DecompressionBombError, which is no DataError: `predict` died with a
    traceback on the first such file of a folder, and a node's data folder
    with one failed without the one-line, file-withheld DataError. One of
    10000 x 10000 (Pillow only warns) was decoded whole, 100 MB and more per
    file. Both are refused, from the header, as image_too_large."""
    import warnings

    root = _write_png_tree(tmp_path / "tree", size=10)
    bomb = _png_declaring(root / "train" / "dog" / "bomb.png", width, height, rows=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning on stderr either
        with pytest.raises(DataError) as err:
            read_source(str(root))
    assert err.value.reason == "image_too_large"
    assert str(err.value).startswith(str(bomb)) and "\n" not in str(err.value)


def test_a_tiff_declaring_a_huge_tile_is_refused_before_decoding(tmp_path: Path) -> None:
    """The pixel limit counted width x height only: a 200-byte TIFF of 10 x 10
    pixels declaring one 32768 x 32768 tile had libtiff allocate the tile, 1 GB,
    before it failed (corrupt_image). A tile or strip larger than the limit is
    refused from the header as image_too_large; an honest tiled TIFF reads."""
    import struct
    import zlib

    from p2pfl.learning.data.sources import read_image_file

    def tiff(path: Path, tile: int, pixels: bytes) -> Path:
        data = zlib.compress(pixels)
        entries = [(256, 3, 10), (257, 3, 10), (258, 3, 8), (259, 3, 8), (262, 3, 1)]
        entries += [(277, 3, 1), (322, 4, tile), (323, 4, tile), (324, 4, 8)]
        entries += [(325, 4, len(data))]
        out = b"II*\0" + struct.pack("<I", 8 + len(data)) + data
        out += struct.pack("<H", len(entries))
        for tag, kind, value in entries:
            packed = struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value)
            out += struct.pack("<HHI", tag, kind, 1) + packed
        path.write_bytes(out + struct.pack("<I", 0))
        return path

    honest = read_image_file(tiff(tmp_path / "honest.tif", 16, bytes(range(256))))
    assert honest.shape == (10, 10, 1) and honest[0, 1, 0] == 1 and honest[1, 0, 0] == 16
    with pytest.raises(DataError) as err:
        read_image_file(tiff(tmp_path / "bomb.tif", 32768, b"\0" * 64))
    assert err.value.reason == "image_too_large", err.value


# ---------------------------------------------------------------------- partition


def _site_counts(out: Path, sites: int) -> np.ndarray:
    counts = []
    for i in range(sites):
        with np.load(out / f"site_{i}.npz") as f:
            counts.append(np.bincount(f["train_labels"], minlength=10))
    return np.array(counts)


def test_partition_counts_add_up_and_files_written(tmp_path: Path) -> None:
    summary = partition_dataset("digits", 4, "dirichlet:0.5", tmp_path / "p", seed=0)
    raw = read_source("digits")
    counts = _site_counts(tmp_path / "p", 4)
    assert np.array_equal(counts.sum(0), np.bincount(raw.train_labels))
    on_disk = json.loads((tmp_path / "p" / "partition.json").read_text())
    assert on_disk["per_site"][2]["train"] == counts[2].tolist() == summary["per_site"][2]["train"]
    png = (tmp_path / "p" / "partition.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    # val and test are fully distributed and follow each site's train classes
    for split in ("val", "test"):
        per_site = np.array([row[split] for row in summary["per_site"]])
        assert np.array_equal(per_site.sum(0), np.bincount(getattr(raw, f"{split}_labels")))
        assert np.all(per_site[counts == 0] == 0)
    # each site file is itself a loadable data source
    site = load_site_data(
        DataSection(source=str(tmp_path / "p" / "site_1.npz"), image_size=8), seed=0
    )
    assert site.num_classes == 10 and len(site.train) == counts[1].sum()


def test_partition_copies_are_this_accounts_only_whatever_the_umask(tmp_path: Path) -> None:
    """site_<i>.npz holds copies of the source's images: a review read a 0600
    source's copies at 0644 in a 0755 folder (umask 022), open to every local account."""
    import os
    import stat

    source = _write_npz(tmp_path / "private.npz")
    source.chmod(0o600)
    old = os.umask(0o022)
    try:
        partition_dataset(str(source), 2, "iid", tmp_path / "parts", seed=0)
    finally:
        os.umask(old)
    out = tmp_path / "parts"
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    written = sorted(p.name for p in out.iterdir())
    assert written == ["partition.json", "partition.png", "site_0.npz", "site_1.npz"]
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    assert len(np.load(out / "site_1.npz")["train_images"]) == 30


def test_repartitioning_into_fewer_sites_leaves_no_site_of_the_earlier_draw(
    tmp_path: Path,
) -> None:
    """A folder partitioned into 5 sites, then into 3 (another seed), kept
    site_3.npz and site_4.npz of the first draw beside partition.json's 3
    sites: `provision --site-data` for 5 sites took them, and their images
    are also in the new sites' train and test splits. They are removed; the
    operator's own files stay."""
    out = tmp_path / "p"
    partition_dataset("digits", 5, "iid", out, seed=0)
    (out / "site_notes.npz.txt").write_text("mine\n")
    summary = partition_dataset("digits", 3, "iid", out, seed=7)
    assert summary["sites"] == 3
    assert sorted(p.name for p in out.glob("site_*")) == [
        "site_0.npz",
        "site_1.npz",
        "site_2.npz",
        "site_notes.npz.txt",
    ]


def test_repartitioning_a_site_file_into_its_own_folder_keeps_it(tmp_path: Path) -> None:
    """The earlier draw's sites past the new count were removed whatever they
    were: `partition --data p/site_4.npz --out p --sites 2` (one site's data
    split further, in place) deleted site_4.npz, the very source it had just
    read, and a folder named site_9.npz stopped the run with IsADirectoryError.
    The source and anything but a file are left alone."""
    out = tmp_path / "p"
    partition_dataset("digits", 5, "iid", out, seed=0)
    source = (out / "site_4.npz").read_bytes()
    (out / "site_9.npz").mkdir()
    partition_dataset(str(out / "site_4.npz"), 2, "iid", out, seed=1)
    assert (out / "site_4.npz").read_bytes() == source
    assert (out / "site_9.npz").is_dir()
    assert not (out / "site_2.npz").exists() and not (out / "site_3.npz").exists()


def test_partition_out_that_cannot_be_a_folder_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`partition --out FILE` (or a path through a file) raised FileExistsError,
    a traceback once the whole source had been read; it is one line, exit 2."""
    parser = add_partition_arguments(argparse.ArgumentParser())
    (tmp_path / "plain").write_text("a file\n")
    for out in (tmp_path / "plain", tmp_path / "plain" / "parts"):
        args = parser.parse_args(["--data", "digits", "--sites", "2", "--out", str(out)])
        assert run_partition(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"p2pfl-node partition: --out {out}") and err.count("\n") == 1


def test_global_test_gives_every_site_the_whole_test_split(tmp_path: Path) -> None:
    raw = read_source("digits")
    assert raw.test_images is not None and raw.val_labels is not None
    local = partition_dataset("digits", 3, "dirichlet:0.5", tmp_path / "local", seed=0)
    summary = partition_dataset(
        "digits", 3, "dirichlet:0.5", tmp_path / "global", seed=0, test="global"
    )
    assert (
        summary["test"] == "global"
        and "whole source test split" in (summary["val_test_assignment"])
    )
    on_disk = json.loads((tmp_path / "global" / "partition.json").read_text())
    assert on_disk["val_test_assignment"] == summary["val_test_assignment"]
    assert local["test"] == "local"
    counts = _site_counts(tmp_path / "global", 3)
    for site, row in enumerate(summary["per_site"]):
        with (
            np.load(tmp_path / "global" / row["file"]) as f,
            np.load(tmp_path / "local" / row["file"]) as g,
        ):
            # test: the same images and labels as the source, for every site
            assert np.array_equal(f["test_images"], raw.test_images)
            assert np.array_equal(f["test_labels"], raw.test_labels)
            # val (and train) stay local: identical to the default partition
            for key in ("train_labels", "val_images", "val_labels"):
                assert np.array_equal(f[key], g[key])
        assert row["test"] == np.bincount(raw.test_labels, minlength=10).tolist()
        assert np.all(np.array(row["val"])[counts[site] == 0] == 0)
    val = np.array([row["val"] for row in summary["per_site"]])
    assert np.array_equal(val.sum(0), np.bincount(raw.val_labels, minlength=10))
    with pytest.raises(PartitionError, match="--test must be local or global"):
        partition_dataset("digits", 3, "iid", tmp_path / "bad", test="central")


def test_dirichlet_skew_grows_as_alpha_shrinks(tmp_path: Path) -> None:
    skews = [
        partition_dataset("digits", 5, f"dirichlet:{alpha}", tmp_path / str(alpha), seed=2)[
            "label_skew"
        ]
        for alpha in (100.0, 1.0, 0.1)
    ]
    assert skews[0] < skews[1] < skews[2]
    assert skews[0] < 0.1 and skews[2] > 0.4


def test_shards_and_quantity_schemes(tmp_path: Path) -> None:
    partition_dataset("digits", 5, "shards:2", tmp_path / "s", seed=0)
    counts = _site_counts(tmp_path / "s", 5)
    # two label-sorted shards per site: at most a handful of classes each
    assert all((row > 0).sum() <= 4 for row in counts)
    assert counts.sum() == len(read_source("digits").train_labels)

    summary = partition_dataset("digits", 4, "quantity:0.3", tmp_path / "q", seed=0)
    sizes = [sum(row["train"]) for row in summary["per_site"]]
    assert max(sizes) > 3 * min(sizes) and min(sizes) >= 10
    assert summary["label_skew"] < 0.25  # labels stay close to iid


def test_partition_label_fraction(tmp_path: Path) -> None:
    summary = partition_dataset("digits", 3, "iid", tmp_path / "p", label_fraction=0.2, seed=0)
    for row in summary["per_site"]:
        with np.load(tmp_path / "p" / row["file"]) as f:
            total = len(f["train_labels"]) + len(f["unlabeled_images"])
            assert len(f["train_labels"]) == row["labelled"]
            assert abs(row["labelled"] - 0.2 * total) <= 10  # stratified rounding, >= 1 per class


def test_bad_scheme_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("dirichlet", "dirichlet:-1", "shards:0", "banana", "iid:3"):
        with pytest.raises(PartitionError, match="dirichlet:ALPHA"):
            parse_scheme(bad)
    parser = add_partition_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--data", "digits", "--sites", "2", "--scheme", "nope", "--out", str(tmp_path)]
    )
    assert run_partition(args) == 2
    assert "bad partition scheme 'nope'" in capsys.readouterr().err
    args = parser.parse_args(
        ["--data", "digits", "--sites", "2", "--scheme", "iid", "--out", str(tmp_path / "ok")]
    )
    assert run_partition(args) == 0
    assert (tmp_path / "ok" / "site_1.npz").is_file()
    assert parser.parse_args(["--data", "digits", "--sites", "2", "--out", "x"]).test == "local"
    args = parser.parse_args(
        ["--data", "digits", "--sites", "2", "--test", "global", "--out", str(tmp_path / "g")]
    )
    assert run_partition(args) == 0
    assert json.loads((tmp_path / "g" / "partition.json").read_text())["test"] == "global"


# ---------------------------------------------------------------------- augment


@pytest.mark.parametrize(("channels", "size"), [(1, 8), (1, 28), (3, 8), (3, 28)])
def test_augmentations_keep_shape_and_range(channels: int, size: int) -> None:
    torch.manual_seed(0)
    x = to_float_tensor(
        np.random.default_rng(0).integers(0, 256, (6, size, size, channels), dtype=np.uint8)
    )
    for out in (weak_augment_batch(x), strong_augment_batch(x), augment_batch(x, "strong")):
        assert out.shape == x.shape and out.dtype == torch.float32
        assert float(out.min()) >= -1.0 - 1e-6 and float(out.max()) <= 1.0 + 1e-6
        assert not torch.equal(out, x)
    assert augment_batch(x, "none") is x
    with pytest.raises(ValueError, match="unknown augmentation"):
        augment_batch(x, "medium")  # type: ignore[arg-type]
