"""Split one data set into per-site data sets (`p2pfl-node partition`).

The source's train split is divided among the sites by a scheme:
- `iid`: a seeded shuffle cut into near-equal parts;
- `dirichlet:ALPHA`: label skew; for every class, its samples are shared out with
  proportions drawn from Dir(ALPHA, ..., ALPHA) (smaller ALPHA = more skew);
  the whole draw is repeated (up to 100 times, as flwr-datasets'
  DirichletPartitioner does) until every site has at least the minimum per
  site, else the partition is refused with an error naming the minimum and
  the fix: no site is ever left without training data;
- `shards:K`: sort by label, cut into sites * K shards, give each site K random
  shards (McMahan et al.'s pathological non-IID split);
- `quantity:ALPHA`: quantity skew; beyond a floor of the minimum per site,
  site sizes follow Dir(ALPHA) proportions; labels are iid.

The minimum per site (`--min-per-site`) is by default min(10, N / (2 * sites)),
at least 1; it is met by construction for iid, shards and quantity splits.

Val follows the train split (a choice): each class's val samples are shared
among the sites in proportion to each site's share of that class in train
(largest-remainder rounding, so all samples are used). A site's local val thus
has the same label distribution as its train set, which is what each
institution would see in practice and what the heuristics' gossiped per-class
F1 measures. The test split is assigned by `test`:
- `local` (default): test is shared out like val, so each site is scored on its
  own (skewed) label distribution;
- `global`: every site's test split is the whole source test split (the same
  images for every site), as in the DFU paper, which distributes only the
  training data and scores every client on the common test data. Per-site test
  flatters a standalone site, whose model matches its own skew; a common test
  set measures what federating buys on the population.
The test option changes nothing else: train, val and unlabeled files are the
same for a given seed either way. partition.json's `val_test_assignment` says
which was used.

A test split with two images of a class cannot grade it. Sites whose test
split holds fewer than `min_test_per_class` (default 20) images of a class they
train on are listed in partition.json (`sites_below_test_minimum`; per site
`test_short_classes`) for benchmarks to report apart: flagged, not mended, as
moving test images would change the other sites' class shares.

Each site gets `site_<i>.npz` (MedMNIST keys, plus `class_names`), and the
directory gets `partition.json` (per-site class counts) and `partition.png`
(a stacked bar chart of the classes per site). An earlier partition's
`site_<i>.npz` past this one's sites is removed.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from p2pfl.files import atomic_savefig, atomic_write_bytes, atomic_write_text, make_private_dirs
from p2pfl.learning.data.loaders import stratified_split
from p2pfl.learning.data.sources import DataError, RawSplits, read_source

log = logging.getLogger(__name__)

TEST_ASSIGNMENTS = ("local", "global")
MIN_TEST_PER_CLASS = 20

SCHEME_HELP = "iid, dirichlet:ALPHA (ALPHA > 0), shards:K (K >= 1) or quantity:ALPHA (ALPHA > 0)"

Indices = NDArray[np.int64]


class PartitionError(ValueError):
    """A partition request that cannot be carried out; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Scheme:
    kind: str  # iid | dirichlet | shards | quantity
    alpha: float = 0.0
    shards: int = 0

    def __str__(self) -> str:
        if self.kind == "iid":
            return "iid"
        if self.kind == "shards":
            return f"shards:{self.shards}"
        return f"{self.kind}:{self.alpha:g}"


def parse_scheme(text: str) -> Scheme:
    """'iid' | 'dirichlet:0.5' | 'shards:2' | 'quantity:1.0' -> Scheme."""
    kind, _, arg = text.strip().partition(":")
    kind = kind.lower()
    if kind == "iid" and not arg:
        return Scheme("iid")
    try:
        if kind in ("dirichlet", "quantity"):
            alpha = float(arg)
            if alpha > 0 and np.isfinite(alpha):
                return Scheme(kind, alpha=alpha)
        elif kind == "shards":
            shards = int(arg)
            if shards >= 1:
                return Scheme("shards", shards=shards)
    except ValueError:
        pass
    raise PartitionError("bad_scheme", f"bad partition scheme {text!r}: use {SCHEME_HELP}")


# ---------------------------------------------------------------------- schemes


def split_iid(labels: NDArray[np.int64], sites: int, rng: np.random.Generator) -> list[Indices]:
    return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), sites)]


MAX_DRAWS = 100


def default_min_per_site(samples: int, sites: int) -> int:
    """min(10, N / (2 * sites)), at least 1: a site can always train."""
    return max(1, min(10, samples // (2 * sites)))


def split_dirichlet(
    labels: NDArray[np.int64],
    sites: int,
    alpha: float,
    rng: np.random.Generator,
    min_per_site: int | None = None,
) -> list[Indices]:
    """Per class, proportions ~ Dir(alpha) over the sites; the whole draw is
    repeated until every site has `min_per_site` samples (MAX_DRAWS at most)."""
    min_size = default_min_per_site(len(labels), sites) if min_per_site is None else min_per_site
    smallest = 0
    for _attempt in range(MAX_DRAWS):
        buckets: list[list[int]] = [[] for _ in range(sites)]
        for cls in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == cls))
            proportions = rng.dirichlet(np.full(sites, alpha))
            cuts = (np.cumsum(proportions) * len(idx)).astype(np.int64)[:-1]
            for site, chunk in enumerate(np.split(idx, cuts)):
                buckets[site].extend(chunk.tolist())
        parts = [np.sort(np.asarray(b, dtype=np.int64)) for b in buckets]
        smallest = min(len(p) for p in parts)
        if smallest >= min_size:
            return parts
    fixes = ["a larger alpha", "fewer sites"]
    if min_size > 1:
        fixes.insert(0, "--min-per-site 1 (the least a site can train on)")
    raise PartitionError(
        "site_too_small",
        f"dirichlet:{alpha:g} over {sites} sites: none of {MAX_DRAWS} draws gave every site "
        f"at least {min_size} of the {len(labels)} training samples (the last left one with "
        f"{smallest}); use {', '.join(fixes[:-1])} or {fixes[-1]}",
    )


def split_shards(
    labels: NDArray[np.int64], sites: int, shards: int, rng: np.random.Generator
) -> list[Indices]:
    total = sites * shards
    if total > len(labels):
        raise PartitionError(
            "too_few_samples",
            f"shards:{shards} with {sites} sites needs {total} shards but train has only {len(labels)} samples "
            "— use fewer shards or sites",
        )
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, total)
    assignment = rng.permutation(total).reshape(sites, shards)
    return [np.sort(np.concatenate([pieces[i] for i in row])) for row in assignment]


def split_quantity(
    labels: NDArray[np.int64],
    sites: int,
    alpha: float,
    rng: np.random.Generator,
    min_per_site: int | None = None,
) -> list[Indices]:
    """Site sizes: the minimum per site each, plus a Dir(alpha) share of the
    rest; labels iid."""
    n = len(labels)
    base = default_min_per_site(n, sites) if min_per_site is None else min_per_site
    spare = n - base * sites
    proportions = rng.dirichlet(np.full(sites, alpha))
    extra = np.floor(proportions * spare).astype(np.int64)
    extra[np.argsort(-(proportions * spare - extra), kind="stable")[: spare - extra.sum()]] += 1
    cuts = np.cumsum(base + extra)[:-1]
    return [np.sort(part) for part in np.split(rng.permutation(n), cuts)]


def split_train(
    labels: NDArray[np.int64],
    sites: int,
    scheme: Scheme,
    seed: int,
    min_per_site: int | None = None,
) -> list[Indices]:
    """The train split's indices of every site; no site gets fewer than
    `min_per_site` (default: `default_min_per_site`) or the split is refused."""
    if sites < 1:
        raise PartitionError("bad_sites", f"--sites must be at least 1, got {sites}")
    if min_per_site is not None and min_per_site < 1:
        raise PartitionError(
            "bad_min_per_site", f"--min-per-site must be at least 1, got {min_per_site}"
        )
    needed = sites * (1 if min_per_site is None else min_per_site)
    if needed > len(labels):
        raise PartitionError(
            "too_few_samples",
            f"{sites} sites with at least {needed // sites} training samples each need {needed} "
            f"but the train split has only {len(labels)} — use fewer sites",
        )
    rng = np.random.default_rng(seed)
    if scheme.kind == "iid":
        return split_iid(labels, sites, rng)
    if scheme.kind == "dirichlet":
        return split_dirichlet(labels, sites, scheme.alpha, rng, min_per_site)
    if scheme.kind == "shards":
        parts = split_shards(labels, sites, scheme.shards, rng)
        smallest = min(len(p) for p in parts)
        if min_per_site is not None and smallest < min_per_site:
            raise PartitionError(
                "site_too_small",
                f"shards:{scheme.shards} over {sites} sites gives a site only {smallest} training "
                f"samples, fewer than --min-per-site {min_per_site} — use more shards or fewer sites",
            )
        return parts
    return split_quantity(labels, sites, scheme.alpha, rng, min_per_site)


def follow_class_shares(
    labels: NDArray[np.int64], train_counts: NDArray[np.int64], rng: np.random.Generator
) -> list[Indices]:
    """Share an evaluation split among sites so each class goes to the sites in
    proportion to their train counts of it (largest remainder). A class no site
    trained on is shared out evenly."""
    sites, num_classes = train_counts.shape
    buckets: list[list[int]] = [[] for _ in range(sites)]
    for cls in range(num_classes):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        if len(idx) == 0:
            continue
        weights = train_counts[:, cls].astype(np.float64)
        if weights.sum() == 0:
            weights = np.ones(sites)
        exact = weights / weights.sum() * len(idx)
        counts = np.floor(exact).astype(np.int64)
        counts[np.argsort(-(exact - counts), kind="stable")[: len(idx) - counts.sum()]] += 1
        for site, chunk in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
            buckets[site].extend(chunk.tolist())
    return [np.sort(np.asarray(b, dtype=np.int64)) for b in buckets]


def label_skew(counts: NDArray[np.int64]) -> float:
    """Mean over sites of the total-variation distance between the site's class
    distribution and the pooled one (0 = iid, up to 1 = disjoint labels)."""
    pooled = counts.sum(0) / max(counts.sum(), 1)
    per_site = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    return float(np.mean(0.5 * np.abs(per_site - pooled).sum(1)))


# ---------------------------------------------------------------------- output


def _plot_distribution(
    counts: NDArray[np.int64], class_names: list[str], title: str, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites, num_classes = counts.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * sites + 2), 3.5))
    bottom = np.zeros(sites)
    colours = plt.get_cmap("tab20" if num_classes > 10 else "tab10")
    for cls in range(num_classes):
        ax.bar(
            range(sites),
            counts[:, cls],
            bottom=bottom,
            color=colours(cls % colours.N),
            label=class_names[cls],
        )
        bottom += counts[:, cls]
    ax.set_xticks(
        range(sites), [f"site_{i}" for i in range(sites)], rotation=45 if sites > 8 else 0
    )
    ax.set_ylabel("train images (labelled + unlabeled)")
    ax.set_title(title)
    if num_classes <= 20:
        ax.legend(title="class", fontsize="small", bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=100)
    plt.close(fig)


def _counts(labels: NDArray[np.int64], num_classes: int) -> list[int]:
    return np.bincount(labels, minlength=num_classes).tolist()


def partition_dataset(
    source: str,
    sites: int,
    scheme: str,
    out: Path,
    label_fraction: float | None = None,
    seed: int = 0,
    test: str = "local",
    min_per_site: int | None = None,
    min_test_per_class: int = MIN_TEST_PER_CLASS,
) -> dict[str, Any]:
    """Write site_<i>.npz, partition.json and partition.png into `out`; return the
    summary that partition.json holds. `test` is "local" (test follows the
    train class shares, like val) or "global" (every site gets the whole test
    split). `min_per_site`: no site gets fewer training samples (default
    min(10, N / (2 * sites)), at least 1); a split that cannot meet it is refused.
    `min_test_per_class`: see the module doc."""
    parsed = parse_scheme(scheme)
    if type(min_test_per_class) is not int or min_test_per_class < 0:
        raise PartitionError("bad_min_test", "--min-test-per-class must be a whole number >= 0")
    if test not in TEST_ASSIGNMENTS:
        raise PartitionError("bad_test", f"--test must be local or global, got {test!r}")
    if label_fraction is not None and not 0.0 < label_fraction <= 1.0:
        raise PartitionError(
            "bad_label_fraction", f"--label-fraction must be in (0, 1], got {label_fraction}"
        )
    raw: RawSplits = read_source(source)
    num_classes = raw.num_classes
    train_parts = split_train(raw.train_labels, sites, parsed, seed, min_per_site)
    train_counts = np.array(
        [_counts(raw.train_labels[p], num_classes) for p in train_parts], dtype=np.int64
    )
    rng = np.random.default_rng(seed + 1)
    eval_parts: dict[str, list[Indices]] = {}
    for split in ("val", "test"):
        pair = raw.split(split)
        if pair is None:
            continue
        # drawn even for a global test split, so that the rng stream (and with it
        # the train, val and unlabeled files) does not depend on `test`
        eval_parts[split] = follow_class_shares(pair[1], train_counts, rng)
        if split == "test" and test == "global":
            eval_parts[split] = [np.arange(len(pair[1]), dtype=np.int64)] * sites
    # copies of the source's images (and their labels): this account's only, whatever
    # the umask or the source's own mode (a review read a 0600 source's copies at 0644);
    # a folder that exists (`--out .`) keeps its mode, the files are 0600 all the same
    try:
        out = make_private_dirs(out)  # each folder it makes 0700, its parents too
    except OSError as exc:  # a file at the name or on its path: a traceback before
        raise PartitionError(
            "bad_out", f"--out {out}: cannot be made a folder ({exc.strerror}) — name a folder"
        ) from None
    site_rows: list[dict[str, Any]] = []
    for site, train_idx in enumerate(train_parts):
        arrays: dict[str, np.ndarray] = {"class_names": np.array(raw.class_names)}
        images, labels = raw.train_images[train_idx], raw.train_labels[train_idx]
        unlabeled_count = 0
        if label_fraction is not None and label_fraction < 1.0 and len(labels):
            rest, kept = stratified_split(labels, label_fraction, rng, min_per_class=1)
            arrays["unlabeled_images"] = images[rest]
            unlabeled_count = len(rest)
            images, labels = images[kept], labels[kept]
        arrays["train_images"], arrays["train_labels"] = images, labels
        row: dict[str, Any] = {
            "site": site,
            "file": f"site_{site}.npz",
            "train": _counts(labels, num_classes),
        }
        for split, parts in eval_parts.items():
            pair = raw.split(split)
            assert pair is not None
            arrays[f"{split}_images"] = pair[0][parts[site]]
            arrays[f"{split}_labels"] = pair[1][parts[site]]
            row[split] = _counts(pair[1][parts[site]], num_classes)
        if raw.unlabeled_images is not None:  # the source's own unlabeled pool, shared iid
            pool = np.array_split(
                np.random.default_rng(seed + 2).permutation(len(raw.unlabeled_images)), sites
            )[site]
            arrays["unlabeled_images"] = np.concatenate(
                [
                    arrays.get("unlabeled_images", raw.unlabeled_images[:0]),
                    raw.unlabeled_images[pool],
                ]
            )
            unlabeled_count += len(pool)
        row["unlabeled"] = unlabeled_count
        row["labelled"] = int(len(labels))
        if "test" in row:
            short = {  # the classes it trains on with too few test images (module doc)
                name: int(t)
                for name, n, t in zip(raw.class_names, row["train"], row["test"], strict=True)
                if n and t < min_test_per_class
            }
            row.update(test_short_classes=short, test_minimum_met=not short)
        packed = io.BytesIO()
        np.savez_compressed(packed, **arrays)
        atomic_write_bytes(out / f"site_{site}.npz", packed.getbuffer())
        site_rows.append(row)
    summary: dict[str, Any] = {
        "source": raw.source,
        "scheme": str(parsed),
        "sites": sites,
        "seed": seed,
        "label_fraction": label_fraction,
        "class_names": raw.class_names,
        "image_shape": list(raw.train_images.shape[1:]),
        "label_skew": label_skew(train_counts),
        "smallest_site": int(min(len(p) for p in train_parts)),
        "test": test,
        "val_test_assignment": (
            "val and test follow each site's train class shares"
            if test == "local"
            else "val follows each site's train class shares; test is the whole source test split for every site"
        ),
        "min_test_per_class": min_test_per_class,
        "sites_below_test_minimum": [r["site"] for r in site_rows if r.get("test_short_classes")],
        "per_site": site_rows,
        "chart": "partition.png",
    }
    # an earlier partition's sites past this one's are not this partition's: a
    # 5-site federation provisioned from a folder re-partitioned into 3 took
    # sites 3 and 4 of the earlier draw, whose images the new sites hold too
    # (never the source just read, split further in its own folder, nor anything
    # but a file: a review's source was deleted, a folder raised IsADirectoryError)
    source_path = Path(source)
    for stale in out.glob("site_*.npz"):
        number = stale.name[len("site_") : -len(".npz")]
        if not (number.isdigit() and int(number) >= sites):
            continue
        if stale.is_dir() and not stale.is_symlink():
            continue
        try:
            is_source = source_path.exists() and stale.samefile(source_path)
        except OSError:  # a dangling link
            is_source = False
        if not is_source:
            stale.unlink()
    atomic_write_text(out / "partition.json", json.dumps(summary, indent=2) + "\n")
    _plot_distribution(
        train_counts,
        raw.class_names,
        f"{raw.source}: {parsed} over {sites} sites",
        out / "partition.png",
    )
    log.info("partitioned %s into %d sites (%s) under %s", raw.source, sites, parsed, out)
    return summary


# ---------------------------------------------------------------------- CLI


def add_partition_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `p2pfl-node partition`."""
    parser.add_argument(
        "--data", required=True, help="'digits', a MedMNIST-style .npz or an ImageFolder directory"
    )
    parser.add_argument("--sites", type=int, required=True, help="number of sites")
    parser.add_argument("--scheme", default="iid", help=SCHEME_HELP)
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for site_<i>.npz, partition.json/png"
    )
    parser.add_argument(
        "--label-fraction",
        type=float,
        default=None,
        help="keep labels for this share of each site's train set; the rest goes to unlabeled_images",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-per-site",
        type=int,
        default=None,
        help="the fewest training samples any site may get (default min(10, N / (2 * sites)), "
        "at least 1); a dirichlet split that cannot meet it in 100 draws is refused",
    )
    parser.add_argument(
        "--min-test-per-class",
        type=int,
        default=MIN_TEST_PER_CLASS,
        help=f"flag sites with fewer test images of a class they train on (default {MIN_TEST_PER_CLASS})",
    )
    parser.add_argument(
        "--test",
        choices=TEST_ASSIGNMENTS,
        default="local",
        help="local: each site's test follows its train class shares; "
        "global: every site gets the whole test split (the DFU paper's evaluation)",
    )
    return parser


def run_partition(args: argparse.Namespace) -> int:
    """Run `partition` from parsed arguments: 0 on success, 2 (one line on stderr)
    on a mistake a person can fix."""
    try:
        summary = partition_dataset(
            args.data,
            args.sites,
            args.scheme,
            args.out,
            label_fraction=args.label_fraction,
            seed=args.seed,
            test=args.test,
            min_per_site=args.min_per_site,
            min_test_per_class=args.min_test_per_class,
        )
    except (DataError, PartitionError) as exc:
        sys.stderr.write(f"p2pfl-node partition: {exc}\n")
        return 2
    sizes = ", ".join(str(row["labelled"]) for row in summary["per_site"])
    sys.stdout.write(
        f"wrote {summary['sites']} sites ({summary['scheme']}, label skew {summary['label_skew']:.3f}; "
        f"labelled train sizes {sizes}) to {args.out}\n"
    )
    if below := summary["sites_below_test_minimum"]:
        n = summary["min_test_per_class"]
        sys.stdout.write(f"sites {below}: under {n} test images of a class they train on\n")
    return 0
