"""Regenerate p2pfl/learning/data/digits.npz from scikit-learn's `load_digits`.

    python -m p2pfl.learning.data.make_digits            # writes next to this file

The 1,797 8x8 scans (values 0-16) are scaled to uint8 0-255 and split with a
fixed seed, stratified by class, into train/val/test (70/10/20), stored with
MedMNIST-style keys (`train_images` N x 8 x 8 uint8, `train_labels` N int64, ...)
plus `class_names`. scikit-learn is needed only to run this script.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SEED = 20240601
VAL_FRACTION = 0.10
TEST_FRACTION = 0.20


def build_digits_arrays(seed: int = SEED) -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits  # dev-only dependency

    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    split_of = np.empty(len(labels), dtype="<U5")
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        n_test = round(TEST_FRACTION * len(idx))
        n_val = round(VAL_FRACTION * len(idx))
        split_of[idx[:n_test]] = "test"
        split_of[idx[n_test : n_test + n_val]] = "val"
        split_of[idx[n_test + n_val :]] = "train"
    arrays: dict[str, np.ndarray] = {"class_names": np.array([str(c) for c in range(10)])}
    for split in ("train", "val", "test"):
        idx = rng.permutation(np.flatnonzero(split_of == split))
        arrays[f"{split}_images"] = images[idx]
        arrays[f"{split}_labels"] = labels[idx]
    return arrays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("digits.npz"))
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    np.savez_compressed(args.out, **build_digits_arrays(args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
