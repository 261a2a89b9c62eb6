"""Read a data source from disk, at its native size.

Three sources, chosen by `data.source` in site.yaml:
- `digits`: scikit-learn's 8x8 digit scans, shipped as package data (no download);
- a MedMNIST-style `.npz`: `train_images` (N,H,W[,C]) uint8, `train_labels` (N,) or
  (N,1), optional `val_*`, `test_*`, `unlabeled_images`, `class_names`;
- an ImageFolder tree: `train/<class>/*.png`, optional `val/<class>/`,
  `test/<class>/`, `unlabeled/` (any images, any depth); the images may be DICOM
  files (`.dcm`, single-frame, see dicom.py).

`read_source` returns the native uint8 arrays (N,H,W,C) as `RawSplits`; every
problem with a source is a `DataError` naming the file and the fix.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from p2pfl.learning.data.errors import MAX_IMAGE_PIXELS, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".gif", ".webp", ".dcm")
SPLITS = ("train", "val", "test")
MAX_CLASSES = 10_000  # classes an .npz may have: class_names, or labels 0..K-1 without

UInt8Images = NDArray[np.uint8]
Labels = NDArray[np.int64]


@dataclass
class RawSplits:
    """A source as read from disk: uint8 images N,H,W,C at their native size."""

    source: str
    class_names: list[str]
    train_images: UInt8Images
    train_labels: Labels
    val_images: UInt8Images | None = None
    val_labels: Labels | None = None
    test_images: UInt8Images | None = None
    test_labels: Labels | None = None
    unlabeled_images: UInt8Images | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def split(self, name: str) -> tuple[UInt8Images, Labels] | None:
        images = getattr(self, f"{name}_images")
        labels = getattr(self, f"{name}_labels")
        return None if images is None else (images, labels)


# ---------------------------------------------------------------------- readers


def as_nhwc_uint8(images: np.ndarray, where: str) -> UInt8Images:
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[3] not in (1, 3, 4):
        raise DataError(
            "bad_shape",
            f"{where}: images must be N,H,W or N,H,W,C with C in 1,3,4, got shape {images.shape} "
            "— store them as uint8 arrays in MedMNIST layout",
        )
    if 0 in images.shape[1:3]:  # resizing one raised a RuntimeError (a traceback)
        raise DataError(
            "bad_shape", f"{where}: images of {images.shape[2]}x{images.shape[1]} pixels hold none"
        )
    if images.dtype == np.uint8:
        return images
    if not np.issubdtype(images.dtype, np.number) or images.dtype == np.bool_:
        raise DataError(
            "bad_dtype", f"{where}: images have dtype {images.dtype} — store uint8 pixels 0-255"
        )
    values = images.astype(np.float64)
    if not np.isfinite(values).all():  # NaN became pixel 0, silently
        raise DataError(
            "bad_values", f"{where}: images hold NaN or infinite values — store uint8 pixels 0-255"
        )
    if np.issubdtype(images.dtype, np.floating) and values.size and values.max() <= 1.0:
        values = values * 255.0
    return np.rint(values).clip(0, 255).astype(np.uint8)


def _as_labels(labels: np.ndarray, n_images: int, where: str) -> Labels:
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1:
        raise DataError(
            "bad_labels",
            f"{where}: labels must have shape (N,) or (N,1), got {labels.shape} "
            "(multi-label data sets are not supported)",
        )
    if len(labels) != n_images:
        raise DataError(
            "length_mismatch",
            f"{where}: {len(labels)} labels for {n_images} images — every image needs exactly one label",
        )
    if not np.issubdtype(labels.dtype, np.integer):
        if np.issubdtype(labels.dtype, np.floating) and np.all(np.mod(labels, 1) == 0):
            labels = labels.astype(np.int64)
        else:
            raise DataError(
                "bad_labels", f"{where}: labels must be integers 0..K-1, got dtype {labels.dtype}"
            )
    if len(labels) and labels.min() < 0:
        raise DataError(
            "bad_labels", f"{where}: negative label {labels.min()} — labels must be 0..K-1"
        )
    return labels.astype(np.int64)


def read_npz(path: str | Path) -> RawSplits:
    """A MedMNIST-style .npz (loaded without pickle)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            "missing_source", f"{path}: file not found — point data.source at an existing .npz"
        )
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(
            "corrupt_source",
            f"{path}: cannot read as .npz ({exc}) — regenerate the file (np.savez with uint8 arrays, no objects)",
        ) from None
    except MemoryError:  # a header may declare any shape: 9 TiB from a 300-byte file
        raise DataError(
            "corrupt_source",
            f"{path}: an array declares more bytes than this machine holds — "
            "regenerate the file, or split the data set",
        ) from None
    if "train_images" not in arrays or "train_labels" not in arrays:
        raise DataError(
            "missing_split",
            f"{path}: no train_images/train_labels (found {sorted(arrays)}) — "
            "a MedMNIST-style .npz needs train_images and train_labels",
        )
    raw: dict[str, np.ndarray | None] = {}
    for split in SPLITS:
        if f"{split}_images" not in arrays:
            if split != "train" and f"{split}_labels" in arrays:
                raise DataError("missing_split", f"{path}: {split}_labels without {split}_images")
            raw[f"{split}_images"] = raw[f"{split}_labels"] = None
            continue
        if f"{split}_labels" not in arrays:
            raise DataError(
                "missing_split", f"{path}: {split}_images without {split}_labels — add the labels"
            )
        images = as_nhwc_uint8(arrays[f"{split}_images"], f"{path}:{split}_images")
        raw[f"{split}_images"] = images
        raw[f"{split}_labels"] = _as_labels(
            arrays[f"{split}_labels"], len(images), f"{path}:{split}_labels"
        )
    unlabeled = arrays.get("unlabeled_images")
    raw["unlabeled_images"] = (
        None if unlabeled is None else as_nhwc_uint8(unlabeled, f"{path}:unlabeled_images")
    )
    _check_same_size(raw, str(path))
    if "class_names" in arrays:
        names = arrays["class_names"]
        if names.size > MAX_CLASSES:  # 10**8 empty names compress to 400 kB
            raise DataError(
                "bad_labels",
                f"{path}: {names.size} class names, more than {MAX_CLASSES} — fix class_names",
            )
        class_names = [str(c) for c in names.tolist()]
        seen: set[str] = set()
        twice = next((c for c in class_names if c in seen or seen.add(c)), None)
        if twice is not None:  # two outputs of one class
            raise DataError(
                "bad_labels", f"{path}: class_names holds {twice[:40]!r} twice — fix class_names"
            )
    else:
        top = max(
            int(raw[f"{s}_labels"].max())
            for s in SPLITS
            if raw[f"{s}_labels"] is not None and len(raw[f"{s}_labels"])
        )  # type: ignore[union-attr]
        if top >= MAX_CLASSES:  # one stray label of 10**9 was 10**9 class names
            raise DataError(
                "bad_labels",
                f"{path}: label {top} without class_names would make {top + 1} classes — "
                "fix the label, or add class_names to the .npz",
            )
        class_names = [str(c) for c in range(top + 1)]
    return _finish(RawSplits(source=str(path), class_names=class_names, **raw))  # type: ignore[arg-type]


def _check_same_size(raw: dict[str, np.ndarray | None], where: str) -> None:
    sizes = {k: v.shape[1:3] for k, v in raw.items() if k.endswith("_images") and v is not None}
    if len(set(sizes.values())) > 1:
        raise DataError(
            "mismatched_sizes",
            f"{where}: splits have different image sizes {sizes} — resize them to one size before use",
        )


def _finish(raw: RawSplits) -> RawSplits:
    if not raw.class_names:
        raise DataError(
            "no_classes",
            f"{raw.source}: no classes found — the training split needs labelled images",
        )
    if len(raw.train_labels) == 0:
        raise DataError(
            "empty_train",
            f"{raw.source}: the training split is empty — add labelled training images",
        )
    for split in SPLITS:
        pair = raw.split(split)
        if pair is not None and len(pair[1]) and pair[1].max() >= raw.num_classes:
            raise DataError(
                "bad_labels",
                f"{raw.source}: {split} label {int(pair[1].max())} but only {raw.num_classes} class names",
            )
    return raw


def read_digits() -> RawSplits:
    """The embedded digits set (package data, generated by make_digits.py)."""
    resource = resources.files("p2pfl.learning.data").joinpath("digits.npz")
    with resources.as_file(resource) as path:
        if not Path(path).is_file():
            raise DataError(
                "missing_source",
                f"{path}: embedded digits data missing — regenerate it with `python -m p2pfl.learning.data.make_digits`",
            )
        raw = read_npz(path)
    raw.source = "digits"
    return raw


def read_image_file(path: Path) -> np.ndarray:
    if path.suffix.lower() == ".dcm":
        from p2pfl.learning.data.dicom import read_dicom  # lazy: pydicom only when needed

        return read_dicom(path)
    import warnings

    from PIL import Image, UnidentifiedImageError

    too_large = DataError(
        "image_too_large",
        f"{path}: the image declares more than {MAX_IMAGE_PIXELS} pixels — "
        "downscale it or split it into tiles",
    )
    try:
        with warnings.catch_warnings():  # refused below, not warned about
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(path)  # the header only
    except Image.DecompressionBombError:
        raise too_large from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(
            "corrupt_image", f"{path}: cannot decode image ({exc}) — replace or remove the file"
        ) from None
    try:
        with image:
            if image.width * image.height > MAX_IMAGE_PIXELS:  # before a pixel is decoded
                raise too_large
            tags = getattr(image, "tag_v2", None)  # a TIFF's: libtiff allocates a whole tile
            if tags is not None and _product(tags.get(322), tags.get(323)) > MAX_IMAGE_PIXELS:
                raise too_large
            image.load()
            mode = image.mode
            if mode in ("I;16", "I;16B", "I;16L", "I", "F"):
                values = np.asarray(image, dtype=np.float64)
                if not np.isfinite(values).all():  # a float TIFF's NaN became pixel 0
                    raise DataError("bad_values", f"{path}: the image holds NaN or infinite values")
                top = 65535.0 if mode.startswith("I;16") else max(float(values.max()), 1.0)
                return np.rint(values / top * 255.0).clip(0, 255).astype(np.uint8)[..., None]
            if mode in ("1", "L", "LA"):
                return np.asarray(image.convert("L"), dtype=np.uint8)[..., None]
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except Image.DecompressionBombError:  # a later frame's header
        raise too_large from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(
            "corrupt_image", f"{path}: cannot decode image ({exc}) — replace or remove the file"
        ) from None


def _product(*values: object) -> int:
    """The product of header values that should be whole numbers (0 if one is not)."""
    product = 1
    for value in values:
        if not isinstance(value, int):
            return 0
        product *= value
    return product


def image_files(folder: Path, suffixes: tuple[str, ...] = IMAGE_SUFFIXES) -> list[Path]:
    """The files under `folder`, at any depth, whose suffix is one of `suffixes`,
    sorted. Walked without recursion: Path.rglob raised RecursionError on a tree
    1900 folders deep. A link to a folder is not followed (no loop), one to a
    file is; a folder that cannot be listed is passed over, as rglob did."""
    found: list[Path] = []
    stack = [folder]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as entries:
                for entry in entries:
                    path = current / entry.name
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(path)
                    elif path.suffix.lower() in suffixes and entry.is_file():
                        found.append(path)
        except OSError:
            continue
    return sorted(found)


def _stack(images: list[np.ndarray], files: list[Path], channels: int) -> UInt8Images:
    expected = images[0].shape[:2]
    for image, file in zip(images, files, strict=True):
        if image.shape[:2] != expected:
            raise DataError(
                "mismatched_sizes",
                f"{file}: image is {image.shape[1]}x{image.shape[0]} but {files[0]} is "
                f"{expected[1]}x{expected[0]} — resize all images of the tree to one size",
            )
    stacked = [
        img if img.shape[2] == channels else np.repeat(img, channels, axis=2) for img in images
    ]
    return np.stack(stacked).astype(np.uint8)


def read_image_folder(root: str | Path) -> RawSplits:
    """An ImageFolder tree; class names are the sorted sub-folders of train/."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(
            "missing_source",
            f"{root}: directory not found — point data.source at an ImageFolder tree",
        )
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise DataError(
            "missing_split",
            f"{root}: no train/ folder — an ImageFolder source needs train/<class>/*.png",
        )
    class_names = sorted(d.name for d in train_dir.iterdir() if d.is_dir() and image_files(d))
    if not class_names:
        raise DataError(
            "no_classes",
            f"{train_dir}: no class folders with images — put each class's images in train/<class>/",
        )
    files: dict[str, list[Path]] = {}
    labels: dict[str, list[int]] = {}
    for split in SPLITS:
        split_dir = root / split
        if not split_dir.is_dir():
            continue
        files[split], labels[split] = [], []
        for sub in sorted(d for d in split_dir.iterdir() if d.is_dir()):
            found = image_files(sub)
            if not found:
                continue
            if sub.name not in class_names:
                raise DataError(
                    "unknown_class",
                    f"{sub}: class {sub.name!r} is not among train/'s classes {class_names} — "
                    "rename the folder or add training images for it",
                )
            files[split] += found
            labels[split] += [class_names.index(sub.name)] * len(found)
    if (root / "unlabeled").is_dir():
        files["unlabeled"] = image_files(root / "unlabeled")
    decoded = {split: [read_image_file(f) for f in fs] for split, fs in files.items() if fs}
    all_images = [img for imgs in decoded.values() for img in imgs]
    all_files = [f for split in decoded for f in files[split]]
    channels = 3 if any(img.shape[2] == 3 for img in all_images) else 1
    _stack(all_images, all_files, channels)  # size check over the whole tree
    raw: dict[str, np.ndarray | None] = {}
    for split in (*SPLITS, "unlabeled"):
        if split not in decoded:
            raw[f"{split}_images"] = None
            if split != "unlabeled":
                raw[f"{split}_labels"] = None
            continue
        raw[f"{split}_images"] = _stack(decoded[split], files[split], channels)
        if split != "unlabeled":
            raw[f"{split}_labels"] = np.asarray(labels[split], dtype=np.int64)
    if raw["train_images"] is None:
        raise DataError("empty_train", f"{train_dir}: no training images found")
    return _finish(RawSplits(source=str(root), class_names=class_names, **raw))  # type: ignore[arg-type]


def read_source(source: str | Path) -> RawSplits:
    """'digits', a .npz file or an ImageFolder directory, at native size."""
    if str(source) == "digits":
        return read_digits()
    path = Path(source)
    if path.is_dir():
        return read_image_folder(path)
    if path.suffix.lower() == ".npz" or path.is_file():
        return read_npz(path)
    raise DataError(
        "missing_source",
        f"{path}: not found — data.source must be 'digits', an existing .npz file or an ImageFolder directory",
    )
