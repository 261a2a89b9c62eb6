"""A benchmark's copies of a source's images are this account's only, whatever
the umask: a review read bench.fedperl's site files and bench.failed_site's
empty-train copy of a 0600 source at 0644 under umask 022, open to every local
account (as partition's and dev_split's copies were before)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np

from bench import failed_site, fedperl


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def under_umask_022(fn, *args):  # type: ignore[no-untyped-def]
    old = os.umask(0o022)
    try:
        return fn(*args)
    finally:
        os.umask(old)


def test_fedperl_site_files_are_this_accounts_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sizes = {"train": 6000, "val": 300, "test": 600}
    arrays = {
        f"{s}_images": rng.integers(0, 255, (n, 4, 4), dtype=np.uint8) for s, n in sizes.items()
    }
    arrays |= {f"{s}_labels": (np.arange(n) % 2).reshape(-1, 1) for s, n in sizes.items()}
    np.savez(tmp_path / "src.npz", **arrays)
    (tmp_path / "src.npz").chmod(0o600)
    args = fedperl.parse_args(["--data", str(tmp_path / "src.npz")])
    paths = under_umask_022(fedperl.build_sites, args, 0, tmp_path / "sites")
    assert mode(tmp_path / "sites") == 0o700
    assert paths and all(mode(p) == 0o600 for p in paths)
    with np.load(paths[0]) as site:  # still a site file the bench reads
        assert len(site["train_images"]) and len(site["unlabeled_images"])


def test_failed_site_empty_copy_is_this_accounts_only(tmp_path: Path) -> None:
    like = tmp_path / "site_0.npz"
    np.savez(like, train_images=np.zeros((4, 4, 4), np.uint8), train_labels=np.zeros(4),
             val_images=np.ones((2, 4, 4), np.uint8), val_labels=np.zeros(2))  # fmt: skip
    like.chmod(0o600)
    empty = under_umask_022(failed_site.empty_site, like, tmp_path / "empty_train.npz")
    assert mode(empty) == 0o600
    with np.load(empty) as data:
        assert len(data["train_images"]) == 0 and len(data["val_images"]) == 2


def test_genbuffer_bench_quality_figure_is_this_accounts_only(tmp_path: Path) -> None:
    """bench.genbuffer's quality.png plots the GAN's quality score, a figure measured
    on the site's own images (no longer in heartbeats); the review read it, with the
    bench's buffer.bin (a generator's copies) and summary.json, at 0644. buffer.bin
    and summary.json are written by the same calls (`atomic_write_*`, 0600)."""
    from bench import genbuffer

    history = [{"phase": "stage1", "iteration": i, "quality": 10.0 / (i + 1)} for i in range(3)]
    under_umask_022(genbuffer.plot_quality, history, tmp_path / "quality.png")
    assert mode(tmp_path / "quality.png") == 0o600
