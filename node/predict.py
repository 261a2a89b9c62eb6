"""`p2pfl-node predict`: run an exported model on image files.

    p2pfl-node predict --model DIR IMAGES...|FOLDER [--csv OUT] [--batch-size N]
                       [--runtime auto|torch|onnx]

Inputs: PNG, JPEG (and the other formats of ImageFolder sources), DICOM
(`.dcm`, read as data sources read it: modality and VOI LUT, MONOCHROME1
inverted) and `.npz` files (every image of `images`, else of `test_images`,
`val_images`, `train_images` or `unlabeled_images`, named FILE.npz[i]); a folder
is searched recursively. Each image gets exactly the training preprocessing.

Output: CSV with `file`, `prediction` (the class name), then one probability
column per class, to --csv or stdout (a file name that is not UTF-8 as its
bytes on disk; a class or file name a spreadsheet would run as a formula with a
leading apostrophe). A file that cannot be read is named on stderr with its reason
(unprintable characters escaped: one line each), counted, and skipped. Exit
status: 0 every file predicted; 1 some files unreadable (the rest predicted);
2 nothing predicted or a bad model directory / argument.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from p2pfl.errors import UserError
from p2pfl.files import atomic_write_bytes
from p2pfl.learning.data.sources import (
    IMAGE_SUFFIXES,
    DataError,
    as_nhwc_uint8,
    image_files,
    read_image_file,
)
from p2pfl.learning.export import Predictor

NPZ_KEYS = ("images", "test_images", "val_images", "train_images", "unlabeled_images")


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="a directory from `export`")
    parser.add_argument("inputs", nargs="+", type=Path, help="image files, .npz files, folders")
    parser.add_argument("--csv", type=Path, help="write the results here (default: stdout)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--runtime", default="auto", choices=["auto", "torch", "onnx"])


def input_files(inputs: list[Path]) -> tuple[list[Path], list[tuple[str, str]]]:
    """(files to read, [(input, reason)] for inputs that are no file or folder)."""
    suffixes = (*IMAGE_SUFFIXES, ".npz")
    files: list[Path] = []
    missing: list[tuple[str, str]] = []
    for path in inputs:
        if path.is_dir():
            files += image_files(path, suffixes)
        elif path.is_file():
            files.append(path)
        elif path.exists():  # a FIFO, a device: never opened (a FIFO would block)
            missing.append((str(path), "not a regular file or a folder"))
        else:
            missing.append((str(path), "no such file or folder"))
    return files, missing


def images_of(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, uint8 H,W,C) for each image a file holds; DataError if unreadable."""
    if path.suffix.lower() != ".npz":
        yield str(path), read_image_file(path)
        return
    try:
        with np.load(path, allow_pickle=False) as arrays:
            key = next((k for k in NPZ_KEYS if k in arrays.files), None)
            if key is None:
                raise DataError("no_images", f"{path}: no array named {' or '.join(NPZ_KEYS)}")
            raw = np.asarray(arrays[key])
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        # BadZipFile is no OSError: a truncated .npz stopped the run with a traceback
        raise DataError("corrupt_npz", f"{path}: cannot read .npz ({exc})") from None
    except MemoryError:  # a header may declare any shape: 9 TiB from a 300-byte file
        raise DataError(
            "corrupt_npz", f"{path}: its array declares more bytes than this machine holds"
        ) from None
    images = as_nhwc_uint8(raw, f"{path}: {key}")  # as a data source's images are read
    for i, image in enumerate(images):
        yield f"{path}[{i}]", image


def one_line(text: str) -> str:
    """`text` with each unprintable character (newline, control, the surrogate of
    a byte that is not UTF-8) escaped: a file named with a newline forged a
    second stderr line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def as_cell(text: str) -> str:
    """A class or file name as the CSV shows it: one that a spreadsheet would run
    as a formula (starting with = + - @, a tab or a carriage return) gets a
    leading apostrophe. Class names come from model.json, which a package from
    another site writes: "=HYPERLINK(...)" was written as it stood, a formula in
    every row of the clinic's predictions.csv; a file named so (predicted from
    its own folder) was, after a first review, still written as it stood."""
    return "'" + text if text.startswith(("=", "+", "-", "@", "\t", "\r")) else text


def check_destination(csv_path: Path) -> None:
    """Refuse, before a scan is read, a --csv that cannot be written: a folder, or
    one whose folder cannot be made or written (found only once every image was
    predicted, a traceback that lost the run)."""
    if csv_path.is_dir():
        raise UserError(f"predict: --csv {csv_path}: is a folder — name a file")
    try:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"predict: --csv {csv_path}: cannot make its folder ({exc.strerror})"
        ) from None
    if not os.access(csv_path.parent, os.W_OK | os.X_OK):
        raise UserError(f"predict: --csv {csv_path}: its folder is not writable")


def run_predict(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise UserError("predict: --batch-size must be at least 1")
    if args.csv:
        check_destination(args.csv)
    predictor = Predictor(args.model, args.runtime)
    classes = [as_cell(c) for c in predictor.classes]
    # two columns of one name: a reader keyed by name took one class's
    # probability for the other's ("a" twice, or "=x" beside "'=x")
    seen: set[str] = set()
    twice = next((c for c in classes if c in seen or seen.add(c)), None)
    if twice is not None:
        raise UserError(
            f"predict: {args.model}: model.json names the class column {one_line(twice[:80])!r} "
            "twice — a package names each class once"
        )
    files, failures = input_files(args.inputs)
    for name, reason in failures:
        print(f"predict: {one_line(name)}: {reason}", file=sys.stderr)
    from tqdm import tqdm

    rows: list[list[str]] = []
    names: list[str] = []
    batch: list[torch.Tensor] = []

    def flush() -> None:
        if not batch:
            return
        proba = predictor.predict_proba(torch.cat(batch))
        for name, p in zip(names, proba, strict=True):
            rows.append(
                [as_cell(name), classes[int(np.argmax(p))], *(f"{float(v):.6f}" for v in p)]
            )
        batch.clear()
        names.clear()

    for path in tqdm(files, desc="predict", unit="file", disable=None, file=sys.stderr):
        try:
            for name, image in images_of(path):
                batch.append(predictor.preprocess(image))
                names.append(name)
                if len(batch) >= args.batch_size:
                    flush()
        except DataError as exc:
            failures.append((str(path), str(exc)))
            print(f"predict: {one_line(str(exc))}", file=sys.stderr)
    flush()
    header = ["file", "prediction", *classes]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    # a file name's bytes that are not UTF-8 (os.fsdecode's surrogates) go out as
    # they are on disk: strict UTF-8 raised on the first, and every row was lost
    table = buffer.getvalue().encode("utf-8", "surrogateescape")
    if args.csv:
        try:
            atomic_write_bytes(args.csv, table)
        except OSError as exc:
            raise UserError(
                f"predict: --csv {args.csv}: cannot write it ({exc.strerror})"
            ) from None
    else:
        sys.stdout.flush()
        sys.stdout.buffer.write(table)
        sys.stdout.buffer.flush()
    summary = {
        "predicted": len(rows),
        "unreadable": len(failures),
        "unreadable_files": [name for name, _ in failures],
        "runtime": predictor.runtime,
        "csv": str(args.csv) if args.csv else None,
    }
    print(json.dumps(summary), file=sys.stderr)
    if not rows:
        return 2
    return 1 if failures else 0
