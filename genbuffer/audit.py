"""Membership-inference audit of a synthetic buffer: are the GAN's training images
nearer to the synthetic set than held-out images of the same site are?

Each site keeps a holdout of its own training images out of GAN training
(`holdout_split`: `genbuffer.holdout_fraction` of every class, seeded by
`genbuffer.seed`). For every real image x the audit takes

    nearest(x) = min over synthetic s of d_L(x, s)        (LPIPS, FedER Eq. 4)

and compares members (the images the GAN trained on) with non-members (the
holdout). The attacker's score is -nearest(x): a member should be closer.

    auc             AUC of that score, members vs holdout (0.5: the attack cannot
                    tell them apart; 1: every member is closer than every holdout
                    image); a seeded bootstrap (members and holdout resampled
                    apart) gives its 95 % interval. This is the AUC of the best
                    threshold attack on the distance: every threshold is one point
                    of the ROC curve. `best_threshold` is the distance with the
                    best balanced accuracy (chosen on the same images: optimistic).
    dcr_ratio       median nearest(x) over the holdout / median over the members
                    (distance to the closest record). 1: no difference; > 1: the
                    members sit closer to the synthetic images than unseen images
                    of the same site do, which is leakage (< 1 is not).
    synthetic_closer_to_members
                    as SDMetrics' DCROverfittingProtection: for each synthetic
                    image, is its closest real image a member or a holdout image
                    (members subsampled to the holdout's size)? 0.5 without leakage.
    near copies     share of members and of holdout images with nearest(x) below
                    the near-copy distance (the gate's distance), and the excess
                    members - holdout: a site whose images are simply alike has
                    near copies in both, memorisation only among the members.
    control         the same AUC between two random halves of the holdout, which
                    the GAN never saw: it must be about 0.5. One seeded split is
                    reported, with the spread of 200 such splits (the attack's
                    null distribution for this holdout size), because such audits
                    can report a split bias as membership ("Membership Inference
                    or Data-Split Bias?", 2025). Given the holdout's labels, each
                    halving is stratified by class (`stratified_halves`): the
                    classes sit at different distances from the synthetic set,
                    so an unstratified halving with more of one class in one half
                    reads as membership in the control.

Files in `out_dir`: membership_audit.json (figures and per-image distances),
membership_audit_hist.png and membership_audit_grid.png (closest member and
holdout images beside their nearest synthetic image). The grid holds private
images and the JSON a distance per private image: `out_dir` is the site's
private genbuffer folder (gate.py), made 0700, the files 0600, never served.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from p2pfl.files import PRIVATE_FILE, atomic_savefig, atomic_write_json, make_private_dir

if TYPE_CHECKING:
    from .config import GenbufferSection
    from .privacy import PerceptualDistance

log = logging.getLogger(__name__)

MEMBERSHIP_JSON = "membership_audit.json"
MEMBERSHIP_HISTOGRAM = "membership_audit_hist.png"
MEMBERSHIP_GRID = "membership_audit_grid.png"
_CHUNK = 128
BOOTSTRAP = 1000
CONTROL_REPEATS = 200


# ---------------------------------------------------------------------- the holdout


def holdout_split(
    labels: np.ndarray, fraction: float, min_images: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(members, holdout) indices into `labels`, both sorted and disjoint.

    Stratified: round(fraction x n_c) images of each class c (at most n_c - 1, so
    every class keeps a member), chosen by a generator seeded with `seed` alone,
    so the node and the genbuffer CLI hold out the same images. When the holdout
    would have fewer than `min_images` images, there is none: the membership test
    would be too noisy to decide on (see GenbufferSection.holdout_min_images).
    """
    labels = np.asarray(labels).reshape(-1)
    everything = np.arange(len(labels))
    if fraction <= 0:
        return everything, everything[:0]
    rng = np.random.default_rng(seed)
    held: list[np.ndarray] = []
    for c in np.unique(labels):
        of_class = np.flatnonzero(labels == c)
        take = min(int(round(fraction * len(of_class))), len(of_class) - 1)
        if take > 0:
            held.append(rng.permutation(of_class)[:take])
    holdout = np.sort(np.concatenate(held)) if held else everything[:0]
    if len(holdout) < min_images:
        return everything, everything[:0]
    return np.setdiff1d(everything, holdout), holdout


def stratified_pick(labels: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` sorted indices into `labels` (all of them when fewer), chosen at random
    within each class in proportion to its size (largest remainders), so the picks keep
    the class mix."""
    labels = np.asarray(labels).reshape(-1)
    n = len(labels)
    if count >= n:
        return np.arange(n)
    classes, sizes = np.unique(labels, return_counts=True)
    quota = count * sizes / n
    take = np.floor(quota).astype(np.int64)
    order = np.argsort(-(quota - take), kind="stable")
    take[order[: count - int(take.sum())]] += 1
    picks = [
        rng.permutation(np.flatnonzero(labels == c))[:k]
        for c, k in zip(classes, take, strict=True)
        if k > 0
    ]
    return np.sort(np.concatenate(picks))


def stratified_halves(
    labels: np.ndarray | None, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Two disjoint halves of range(n) that cover it. Given labels, each class is split
    in half at random and a class's odd image goes to the half that is smaller so far,
    so the halves differ by at most one image and hold the same class mix up to one
    image per class. Without labels, one random permutation cut at n // 2."""
    if labels is None:
        perm = rng.permutation(n)
        return perm[: n // 2], perm[n // 2 :]
    labels = np.asarray(labels).reshape(-1)
    if len(labels) != n:
        raise ValueError(f"{len(labels)} labels for {n} holdout images")
    first: list[np.ndarray] = []
    second: list[np.ndarray] = []
    sizes = [0, 0]
    for c in np.unique(labels):
        of_class = rng.permutation(np.flatnonzero(labels == c))
        cut = len(of_class) // 2
        if len(of_class) % 2 and sizes[0] <= sizes[1]:
            cut += 1
        first.append(of_class[:cut])
        second.append(of_class[cut:])
        sizes[0] += cut
        sizes[1] += len(of_class) - cut
    return np.concatenate(first), np.concatenate(second)


# ---------------------------------------------------------------------- distances


def embed(metric: PerceptualDistance, images: Tensor) -> Tensor:
    """LPIPS embeddings on the CPU: d_L(a, b) = ||embed(a) - embed(b)||^2 (privacy.py)."""
    device = next(metric.parameters()).device
    with torch.no_grad():
        return torch.cat(
            [
                metric.embed(images[i : i + _CHUNK].to(device)).cpu()
                for i in range(0, len(images), _CHUNK)
            ]
        )


def nearest(a: Tensor, b: Tensor, exclude_self: bool = False) -> tuple[Tensor, Tensor]:
    """For each row of a: the smallest squared distance to a row of b, and its index."""
    b_sq = b.square().sum(1)
    dists, index = [], []
    for start in range(0, len(a), _CHUNK):
        block = a[start : start + _CHUNK]
        d = (block.square().sum(1)[:, None] + b_sq[None, :] - 2 * block @ b.t()).clamp(min=0)
        if exclude_self:
            rows = torch.arange(len(block))
            d[rows, rows + start] = float("inf")
        best = d.min(dim=1)
        dists.append(best.values)
        index.append(best.indices)
    return torch.cat(dists), torch.cat(index)


# ---------------------------------------------------------------------- statistics


def distance_auc(members: np.ndarray, others: np.ndarray) -> float:
    """P(a member is nearer than a non-member) + half the ties: the AUC of score = -distance."""
    others = np.sort(np.asarray(others, dtype=np.float64))
    members = np.asarray(members, dtype=np.float64)
    farther = len(others) - np.searchsorted(others, members, side="right")
    ties = np.searchsorted(others, members, side="right") - np.searchsorted(
        others, members, side="left"
    )
    return float((farther + 0.5 * ties).sum() / (len(members) * len(others)))


def bootstrap_interval(
    members: np.ndarray, others: np.ndarray, seed: int, reps: int = BOOTSTRAP
) -> tuple[float, float]:
    """95 % percentile interval of distance_auc, members and non-members resampled apart."""
    rng = np.random.default_rng(seed)
    values = [
        distance_auc(
            members[rng.integers(0, len(members), len(members))],
            others[rng.integers(0, len(others), len(others))],
        )
        for _ in range(reps)
    ]
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


def best_threshold(members: np.ndarray, others: np.ndarray) -> tuple[float, float]:
    """(distance, balanced accuracy) of the best rule "member when nearest < distance"."""
    candidates = np.unique(np.concatenate([members, others]))
    thresholds = np.concatenate([candidates, [np.inf]])
    tpr = np.searchsorted(np.sort(members), thresholds, side="left") / len(members)
    fpr = np.searchsorted(np.sort(others), thresholds, side="left") / len(others)
    balanced = 0.5 * (tpr + 1.0 - fpr)
    best = int(np.argmax(balanced))
    return float(thresholds[best]), float(balanced[best])


# ---------------------------------------------------------------------- the audit


@dataclass
class MembershipAudit:
    """The membership test's figures (no per-image lists: those stay in the JSON file)."""

    available: bool
    reason: str
    members: int = 0
    holdout: int = 0
    buffer_images: int = 0
    auc: float | None = None
    auc_interval: list[float] = field(default_factory=list)  # 95 % bootstrap
    best_threshold: float | None = None
    best_balanced_accuracy: float | None = None
    dcr_members_median: float | None = None
    dcr_holdout_median: float | None = None
    dcr_ratio: float | None = None  # holdout / members; > 1 = leakage
    synthetic_closer_to_members: float | None = None  # 0.5 = none
    near_copy_distance: float | None = None
    near_copy_members: float | None = None
    near_copy_holdout: float | None = None
    near_copy_excess: float | None = None  # members - holdout
    control_auc: float | None = None
    control_interval: list[float] = field(default_factory=list)
    control_null_range: list[float] = field(default_factory=list)  # 2.5-97.5 % of 200 splits
    lpips_backbone: str = ""
    files: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def no_holdout(reason: str) -> MembershipAudit:
    return MembershipAudit(available=False, reason=reason)


def membership_audit(
    synthetic: Tensor,
    members: Tensor,
    holdout: Tensor,
    metric: PerceptualDistance,
    out_dir: str | Path,
    *,
    near_copy_distance: float,
    seed: int = 0,
    grid_count: int = 8,
    holdout_labels: np.ndarray | None = None,
) -> MembershipAudit:
    """The test on [-1, 1] images of the same shape; writes its files to `out_dir`
    (made 0700, the files 0600: they show and measure private images).
    holdout_labels (one per holdout image) stratify the control's halvings by class."""
    from .projection import write_grid

    if len(holdout) < 2 or len(members) < 1 or len(synthetic) < 1:
        raise ValueError(
            f"the membership audit needs members ({len(members)}), at least 2 holdout images "
            f"({len(holdout)}) and a synthetic image ({len(synthetic)})"
        )
    out_dir = make_private_dir(out_dir)
    e_syn, e_mem, e_hold = embed(metric, synthetic), embed(metric, members), embed(metric, holdout)
    d_mem_t, i_mem = nearest(e_mem, e_syn)
    d_hold_t, i_hold = nearest(e_hold, e_syn)
    d_mem, d_hold = d_mem_t.double().numpy(), d_hold_t.double().numpy()

    auc = distance_auc(d_mem, d_hold)
    interval = bootstrap_interval(d_mem, d_hold, seed)
    threshold, balanced = best_threshold(d_mem, d_hold)
    med_mem, med_hold = float(np.median(d_mem)), float(np.median(d_hold))
    rng = np.random.default_rng(seed + 1)
    # SDMetrics-style: equal-size reference sets, closest record of each synthetic image.
    sub = rng.choice(len(members), size=min(len(members), len(holdout)), replace=False)
    to_mem, _ = nearest(e_syn, e_mem[torch.as_tensor(sub)])
    to_hold, _ = nearest(e_syn, e_hold[: len(sub)])
    closer = float((to_mem < to_hold).double().mean() + 0.5 * (to_mem == to_hold).double().mean())
    # Control: two random halves of the holdout (class-stratified given its labels),
    # which the GAN never saw.
    first, second = stratified_halves(holdout_labels, len(d_hold), rng)
    a, b = d_hold[first], d_hold[second]
    control = distance_auc(a, b)
    control_interval = bootstrap_interval(a, b, seed + 2)
    null = []
    for _ in range(CONTROL_REPEATS):
        p, q = stratified_halves(holdout_labels, len(d_hold), rng)
        null.append(distance_auc(d_hold[p], d_hold[q]))
    near_mem = float((d_mem < near_copy_distance).mean())
    near_hold = float((d_hold < near_copy_distance).mean())
    files = {
        "json": str(out_dir / MEMBERSHIP_JSON),
        "histogram": str(out_dir / MEMBERSHIP_HISTOGRAM),
        "grid": str(out_dir / MEMBERSHIP_GRID),
    }
    r6 = lambda v: round(float(v), 6)  # noqa: E731
    result = MembershipAudit(
        available=True,
        reason=(
            f"membership test: AUC {auc:.3f} [{interval[0]:.3f}, {interval[1]:.3f}] members vs "
            f"holdout, control {control:.3f}, DCR ratio {med_hold / max(med_mem, 1e-12):.3f}"
        ),
        members=len(members),
        holdout=len(holdout),
        buffer_images=len(synthetic),
        auc=r6(auc),
        auc_interval=[r6(v) for v in interval],
        best_threshold=r6(threshold) if np.isfinite(threshold) else None,
        best_balanced_accuracy=r6(balanced),
        dcr_members_median=r6(med_mem),
        dcr_holdout_median=r6(med_hold),
        dcr_ratio=r6(med_hold / med_mem) if med_mem > 0 else None,
        synthetic_closer_to_members=r6(closer),
        near_copy_distance=r6(near_copy_distance),
        near_copy_members=r6(near_mem),
        near_copy_holdout=r6(near_hold),
        near_copy_excess=r6(near_mem - near_hold),
        control_auc=r6(control),
        control_interval=[r6(v) for v in control_interval],
        control_null_range=[r6(v) for v in np.percentile(null, [2.5, 97.5])],
        lpips_backbone=metric.backbone,
        files=files,
    )
    _write_histogram(d_mem, d_hold, near_copy_distance, out_dir / MEMBERSHIP_HISTOGRAM, result)
    k = min(grid_count, len(members), len(holdout))
    closest_mem = np.argsort(d_mem, kind="stable")[:k]
    closest_hold = np.argsort(d_hold, kind="stable")[:k]
    write_grid(
        [
            members[closest_mem],
            synthetic[i_mem[closest_mem]],
            holdout[closest_hold],
            synthetic[i_hold[closest_hold]],
        ],
        out_dir / MEMBERSHIP_GRID,
    )
    atomic_write_json(
        out_dir / MEMBERSHIP_JSON,
        {
            **result.to_json(),
            "member_distances": [r6(v) for v in d_mem],
            "holdout_distances": [r6(v) for v in d_hold],
        },
        mode=PRIVATE_FILE,
    )
    log.info("%s", result.reason)
    return result


def audit_buffer(
    buffer: dict[str, Any],
    members_uint8: np.ndarray,
    holdout_uint8: np.ndarray,
    metric: PerceptualDistance,
    section: GenbufferSection,
    out_dir: str | Path,
    *,
    near_copy_distance: float,
    seed: int = 0,
    members_labels: np.ndarray | None = None,
    holdout_labels: np.ndarray | None = None,
) -> MembershipAudit:
    """membership_audit on a buffer dict and the site's uint8 images (at most gate_images
    of each; with labels, picked within each class in proportion, and the control's
    halvings stratified by class)."""
    from .trainer import prepare_images

    synthetic = buffer["images"].float() / 127.5 - 1.0
    rng = np.random.default_rng(seed)

    def pick(images: np.ndarray, labels: np.ndarray | None) -> tuple[Tensor, np.ndarray | None]:
        count = min(section.gate_images, len(images))
        if labels is None:
            chosen = np.sort(rng.choice(len(images), size=count, replace=False))
            return prepare_images(images[chosen], synthetic.shape[-1]), None
        labels = np.asarray(labels).reshape(-1)
        if len(labels) != len(images):
            raise ValueError(f"{len(labels)} labels for {len(images)} images")
        chosen = stratified_pick(labels, count, rng)
        return prepare_images(images[chosen], synthetic.shape[-1]), labels[chosen]

    members, _ = pick(members_uint8, members_labels)
    holdout, picked_holdout_labels = pick(holdout_uint8, holdout_labels)
    return membership_audit(
        synthetic,
        members,
        holdout,
        metric,
        out_dir,
        near_copy_distance=near_copy_distance,
        seed=seed,
        holdout_labels=picked_holdout_labels,
    )


def _write_histogram(
    d_mem: np.ndarray, d_hold: np.ndarray, near: float, path: Path, result: MembershipAudit
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    upper = max(float(d_mem.max()), float(d_hold.max()), near) * 1.05
    bins = np.linspace(0, upper, 30)
    ax.hist(d_mem, bins=bins, density=True, color="tab:red", alpha=0.55, label="members")
    ax.hist(d_hold, bins=bins, density=True, color="tab:blue", alpha=0.55, label="holdout")
    ax.axvline(near, color="black", linestyle="--", label=f"near-copy distance {near:.4f}")
    ax.set_xlabel(f"LPIPS distance to the nearest synthetic image ({result.lpips_backbone})")
    ax.set_ylabel("density")
    ax.set_title(f"Membership test: AUC {result.auc:.3f}, control {result.control_auc:.3f}")
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, path, mode=PRIVATE_FILE)
