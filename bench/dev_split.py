"""A development copy of a MedMNIST-style .npz, for choosing a setting without
ever scoring on the real test split:

    python -m bench.dev_split ../shared/data/pneumoniamnist.npz --out runs/dev/pneumonia_dev.npz

The copy's test split is the source's val split (drawn like the test split,
not like train: PneumoniaMNIST's train split is 10 % class 0, its val and test
splits 26 % and 38 %); its val split is a stratified sample of the source's
train split, as large as the source's val split; its train split is the rest
of the source's train split. The source's test images are not in the copy.

A benchmark run on the copy (`--data runs/dev/pneumonia_dev.npz`) compares
candidate settings; the one chosen is then run once on the real data and
reported for every seed. The last line is one JSON object (the counts).
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np

from p2pfl.files import atomic_write_bytes, make_private_dirs

SPLITS = ("train", "val", "test")


def dev_copy(source: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """The copy's arrays (module doc): train minus a stratified val, val, and
    the source's val as test."""
    for split in ("train", "val"):
        for kind in ("images", "labels"):
            if f"{split}_{kind}" not in source:
                raise SystemExit(f"the source has no {split}_{kind} array: a MedMNIST-style "
                                 ".npz with train and val splits is needed")  # fmt: skip
    labels = source["train_labels"].reshape(len(source["train_labels"]), -1)[:, 0]
    n_val = len(source["val_labels"])
    if n_val >= len(labels):
        raise SystemExit(f"the source's val split ({n_val}) is not smaller than its train split")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    # each class's share of the new val split follows train's (largest remainders)
    exact = counts / counts.sum() * n_val
    take = np.floor(exact).astype(int)
    for i in np.argsort(exact - take)[::-1][: n_val - int(take.sum())]:
        take[i] += 1
    val_idx = np.concatenate(
        [
            rng.choice(np.flatnonzero(labels == c), size=k, replace=False)
            for c, k in zip(classes, take, strict=True)
        ]
    )
    val_idx.sort()
    keep = np.ones(len(labels), dtype=bool)
    keep[val_idx] = False
    return {
        "train_images": source["train_images"][keep],
        "train_labels": source["train_labels"][keep],
        "val_images": source["train_images"][val_idx],
        "val_labels": source["train_labels"][val_idx],
        "test_images": source["val_images"],
        "test_labels": source["val_labels"],
    }


def counts(arrays: dict[str, np.ndarray]) -> dict[str, list[int]]:
    return {
        split: np.bincount(arrays[f"{split}_labels"].ravel().astype(np.int64)).tolist()
        for split in SPLITS
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.dev_split", description=__doc__.splitlines()[0]
    )
    parser.add_argument("source", type=Path, help="a MedMNIST-style .npz (train, val, test)")
    parser.add_argument("--out", type=Path, required=True, help="the development copy (.npz)")
    parser.add_argument("--seed", type=int, default=0, help="the new val split's draw")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        raise SystemExit(f"no such file: {args.source}")
    with np.load(args.source) as data:
        source = {key: data[key] for key in data.files}
    copy = dev_copy(source, args.seed)
    # the source's images: this account's only, whatever the umask (a review read a
    # 0600 source's copy at 0644); a folder that exists keeps its mode
    make_private_dirs(args.out.parent)
    packed = io.BytesIO()
    np.savez_compressed(packed, **copy)
    atomic_write_bytes(args.out, packed.getbuffer())
    print(json.dumps({"source": str(args.source), "out": str(args.out), "seed": args.seed,
                      "class_counts": counts(copy)}))  # fmt: skip


if __name__ == "__main__":
    main()
