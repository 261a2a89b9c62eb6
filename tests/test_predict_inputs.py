"""`p2pfl-node predict` on hostile inputs: file names, folders and packages.

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
