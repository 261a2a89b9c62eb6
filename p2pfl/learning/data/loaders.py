"""Turn a site's data source into training tensors.

`load_site_data` reads `data.source` (p2pfl.learning.data.sources), resizes the
images to `data.image_size`, converts them to `data.channels`, splits off a
validation set when the source has none, applies `data.label_fraction`, and
returns a `SiteData` whose tensors are float32 N,C,H,W in [-1, 1]
((x/255 - 0.5) / 0.5).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from torch import Tensor
from torch.utils.data import TensorDataset

from p2pfl.config import DataSection
from p2pfl.learning.data.sources import DataError, Labels, UInt8Images, read_source

log = logging.getLogger(__name__)

MEAN, STD = 0.5, 0.5


@dataclass
class SiteData:
    """One site's data, ready for training.

    `train`/`val`/`test` are TensorDatasets of (float32 N,C,H,W image, int64 label);
    `unlabeled` is a TensorDataset of images only. The uint8 N,H,W,C arrays behind
    train and unlabeled (after resizing/channel conversion) are kept for genbuffer."""

    train: TensorDataset
    val: TensorDataset | None
    test: TensorDataset | None
    unlabeled: TensorDataset | None
    num_classes: int
    channels: int
    image_size: int
    class_names: list[str]
    train_uint8: UInt8Images
    train_labels: Labels
    unlabeled_uint8: UInt8Images | None = None
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def class_counts(self, split: str = "train") -> list[int]:
        dataset = getattr(self, split)
        if dataset is None:
            return [0] * self.num_classes
        labels = dataset.tensors[1].numpy()
        return np.bincount(labels, minlength=self.num_classes).tolist()


# ---------------------------------------------------------------------- conversions


def to_float_tensor(images: UInt8Images) -> Tensor:
    """uint8 N,H,W,C -> float32 N,C,H,W normalised to [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    return x.sub_(MEAN).div_(STD)


def to_uint8_images(x: Tensor) -> UInt8Images:
    """Inverse of `to_float_tensor`: float N,C,H,W in [-1, 1] -> uint8 N,H,W,C."""
    pixels = (x.detach().float().cpu() * STD + MEAN).mul(255.0).round().clamp(0, 255)
    return pixels.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def convert_images(images: UInt8Images, image_size: int, channels: int) -> UInt8Images:
    """Resize uint8 N,H,W,C to image_size x image_size (bilinear, antialiased when
    shrinking) and convert to `channels` (1: luminance, 3: RGB, 4: RGB + opaque alpha)."""
    if images.ndim != 4:
        raise ValueError(f"expected N,H,W,C images, got shape {images.shape}")
    x = images
    c_in = x.shape[3]
    if c_in != channels:
        rgb = x[..., :3] if c_in >= 3 else np.repeat(x[..., :1], 3, axis=3)
        if channels == 1:
            if c_in == 1:
                x = x[..., :1]
            else:  # ITU-R BT.601 luma
                luma = rgb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
                x = np.rint(luma).clip(0, 255).astype(np.uint8)[..., None]
        elif channels == 3:
            x = rgb
        elif channels == 4:
            x = np.concatenate([rgb, np.full(rgb.shape[:3] + (1,), 255, np.uint8)], axis=3)
        else:
            raise ValueError(f"channels must be 1, 3 or 4, got {channels}")
    if x.shape[1] != image_size or x.shape[2] != image_size:
        t = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).float()
        shrinking = image_size < max(x.shape[1], x.shape[2])
        t = F.interpolate(
            t,
            size=(image_size, image_size),
            mode="bilinear",
            align_corners=False,
            antialias=shrinking,
        )
        x = t.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
    return np.ascontiguousarray(x, dtype=np.uint8)


# ---------------------------------------------------------------------- splitting


def stratified_split(
    labels: Labels, fraction: float, rng: np.random.Generator, *, min_per_class: int = 0
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Indices (rest, taken): `fraction` of every class (rounded, at least
    `min_per_class` where the class has that many) goes to `taken`."""
    taken: list[NDArray[np.int64]] = []
    rest: list[NDArray[np.int64]] = []
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        n_take = min(len(idx), max(min_per_class, int(round(fraction * len(idx)))))
        taken.append(idx[:n_take])
        rest.append(idx[n_take:])
    empty = np.zeros(0, dtype=np.int64)
    return (
        np.sort(np.concatenate(rest)) if rest else empty,
        np.sort(np.concatenate(taken)) if taken else empty,
    )


# ---------------------------------------------------------------------- site data


def site_data_from_arrays(
    train: tuple[UInt8Images, Labels],
    *,
    class_names: list[str],
    val: tuple[UInt8Images, Labels] | None = None,
    test: tuple[UInt8Images, Labels] | None = None,
    unlabeled: UInt8Images | None = None,
    source: str = "arrays",
) -> SiteData:
    """SiteData from uint8 N,H,W,C arrays that already have the wanted size and
    channels (simulations build many sites this way)."""
    images, labels = train
    if images.ndim != 4:
        raise ValueError(f"images must be N,H,W,C, got {images.shape}")

    def labelled(pair: tuple[UInt8Images, Labels] | None) -> TensorDataset | None:
        if pair is None or len(pair[1]) == 0:
            return None
        return TensorDataset(to_float_tensor(pair[0]), torch.as_tensor(pair[1], dtype=torch.int64))

    train_set = labelled(train)
    if train_set is None:
        raise DataError("empty_train", f"{source}: the training split is empty")
    unlabeled_set = None
    if unlabeled is not None and len(unlabeled):
        unlabeled_set = TensorDataset(to_float_tensor(unlabeled))
    return SiteData(
        train=train_set,
        val=labelled(val),
        test=labelled(test),
        unlabeled=unlabeled_set,
        num_classes=len(class_names),
        channels=int(images.shape[3]),
        image_size=int(images.shape[1]),
        class_names=list(class_names),
        train_uint8=images,
        train_labels=np.asarray(labels, dtype=np.int64),
        unlabeled_uint8=unlabeled if unlabeled is not None and len(unlabeled) else None,
        source=source,
    )


def load_site_data(cfg: DataSection, seed: int = 0) -> SiteData:
    """Read `cfg.source`, resize/convert, split off val (stratified, seeded) when the
    source has none, keep labels for `cfg.label_fraction` of train (stratified) and
    move the rest to `unlabeled`."""
    raw = read_source(cfg.source)
    rng = np.random.default_rng(seed)

    def prepared(split: str) -> tuple[UInt8Images, Labels] | None:
        pair = raw.split(split)
        if pair is None:
            return None
        return convert_images(pair[0], cfg.image_size, cfg.channels), pair[1]

    train = prepared("train")
    assert train is not None  # read_source guarantees a train split
    val, test = prepared("val"), prepared("test")
    notes: list[str] = []
    if val is None and cfg.val_fraction > 0:
        rest, taken = stratified_split(train[1], cfg.val_fraction, rng)
        val = (train[0][taken], train[1][taken])
        train = (train[0][rest], train[1][rest])
        notes.append(
            f"val split: {len(taken)} images taken from train (val_fraction={cfg.val_fraction})"
        )
    unlabeled_parts: list[UInt8Images] = []
    if raw.unlabeled_images is not None:
        unlabeled_parts.append(convert_images(raw.unlabeled_images, cfg.image_size, cfg.channels))
    if cfg.label_fraction is not None and cfg.label_fraction < 1.0:
        rest, kept = stratified_split(train[1], cfg.label_fraction, rng, min_per_class=1)
        unlabeled_parts.append(train[0][rest])
        train = (train[0][kept], train[1][kept])
        notes.append(
            f"label_fraction={cfg.label_fraction}: {len(kept)} labelled, {len(rest)} moved to unlabeled"
        )
    unlabeled = np.concatenate(unlabeled_parts) if unlabeled_parts else None
    data = site_data_from_arrays(
        train,
        class_names=raw.class_names,
        val=val,
        test=test,
        unlabeled=unlabeled,
        source=raw.source,
    )
    data.notes = notes
    for note in notes:
        log.info("%s: %s", raw.source, note)
    return data
