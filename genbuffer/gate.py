"""The privacy gate: a synthetic buffer leaves the site only if it does not expose the site's images.

FedER's privacy loss pushes generated images away from the real ones during
training, but nothing in the paper checks the images that are actually sent.
Before a buffer leaves, the node compares it with its own private training
images in the same LPIPS space the privacy loss uses:

    nearest(x)  = min over synthetic s of d_L(x, s)            for each real x
    spacing(x)  = min over other real x' of d_L(x, x')
    d           = genbuffer.gate_distance, or
                  gate_distance_factor x median spacing           ("auto")
    exposed     = share of real x with nearest(x) < d

and releases the buffer only when `exposed <= gate_max_fraction` and the
membership test (audit.py) passes: the site keeps a holdout of its images out of
GAN training (`holdout_fraction`), and the buffer is refused when the attack
"members are nearer to the synthetic images than the holdout" has an AUC above
`gate_max_auc`, or when the share of members with a near copy (closer than d)
exceeds the holdout's share by more than `gate_max_near_copy_excess`. The
distance rule alone cannot tell memorisation from a site whose images are simply
alike; the membership test can, because alike images are alike in the holdout
too. A site too small for a holdout (`holdout_min_images`) is checked with the
distance rule alone, which the decision's `membership` block and the log say. The automatic
distance is relative to how far apart the site's own patients' images are, so
one rule holds across data sets and LPIPS backbones: a synthetic image closer to
a real one than half the typical distance between two real images is treated as
a copy of it. On PneumoniaMNIST with the AlexNet LPIPS, 0.7 % of real images
have another real image that close (duplicates in the data set included).

The decision, its figures, a histogram and a grid of the closest pairs go to
`out_dir` (privacy_gate.json / _hist.png / .png, and membership_audit.json /
_hist.png / _grid.png); the node shows the decision, the membership figures
included, on /status and the dashboard. The grids hold private images and the
JSON files a distance per private image: `out_dir` is the site's private
genbuffer folder (STATE/genbuffer, never the folder a buffer is shared from:
genbuffer/cli.py), made 0700 here, and every file is written 0600. They are
never served; only the summary figures are.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from p2pfl.files import PRIVATE_FILE, atomic_savefig, atomic_write_json, make_private_dir

from .config import GenbufferSection
from .errors import GenbufferError

if TYPE_CHECKING:  # lpips, torchvision and matplotlib load only when a buffer is checked
    from .privacy import PerceptualDistance

log = logging.getLogger(__name__)

GATE_JSON = "privacy_gate.json"
GATE_GRID = "privacy_gate.png"
GATE_HISTOGRAM = "privacy_gate_hist.png"


@dataclass
class GateDecision:
    """What the gate decided about one buffer, and the figures it decided on."""

    released: bool
    reason: str
    exposed_fraction: float
    max_fraction: float
    distance: float
    distance_source: str  # "configured" or "auto"
    real_images: int
    buffer_images: int
    nearest_synthetic: dict[str, float]  # min / p05 / median of nearest(x)
    real_spacing: dict[str, float]  # min / p05 / median of spacing(x)
    lpips_backbone: str
    buffer_hash: str
    seconds: float
    decided_at: float
    files: dict[str, str] = field(default_factory=dict)
    # the membership test's figures (audit.MembershipAudit), or why there was none
    membership: dict[str, Any] = field(default_factory=dict)
    refused_by: list[str] = field(default_factory=list)  # "distance", "auc", "near_copy_excess"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class PrivacyGateRefused(GenbufferError):
    """The buffer exposes too many of the site's images; it is not shared."""

    def __init__(self, decision: GateDecision) -> None:
        super().__init__("privacy_gate_refused", decision.reason)
        self.decision = decision


def _summary(values: np.ndarray) -> dict[str, float]:
    return {
        "min": round(float(values.min()), 6),
        "p05": round(float(np.percentile(values, 5)), 6),
        "median": round(float(np.median(values)), 6),
    }


def check_buffer(
    buffer: dict[str, Any],
    real_uint8: np.ndarray,
    metric: PerceptualDistance,
    section: GenbufferSection,
    out_dir: str | Path,
    *,
    holdout_uint8: np.ndarray | None = None,
    seed: int = 0,
    real_labels: np.ndarray | None = None,
    holdout_labels: np.ndarray | None = None,
) -> GateDecision:
    """Decide whether `buffer` may leave the site, write the evidence to `out_dir`
    (the private genbuffer folder: it is made 0700, the files 0600).

    real_uint8: the images the generator trained on (the members); holdout_uint8:
    the site's images kept out of its training (audit.holdout_split), or None/empty
    when the site has none, and the membership test is skipped. real_labels and
    holdout_labels, when given, keep the membership test's picks and its control's
    halvings stratified by class (audit.stratified_pick, audit.stratified_halves)."""
    from .audit import audit_buffer, embed, nearest, no_holdout
    from .projection import write_grid
    from .trainer import prepare_images

    start = time.perf_counter()
    out_dir = make_private_dir(out_dir)
    synthetic = buffer["images"].float() / 127.5 - 1.0
    if len(real_uint8) < 2:
        raise GenbufferError(
            "privacy_gate_no_images", "the privacy gate needs at least 2 real training images"
        )
    rng = np.random.default_rng(seed)
    count = min(section.gate_images, len(real_uint8))
    picks = np.sort(rng.choice(len(real_uint8), size=count, replace=False))
    real = prepare_images(real_uint8[picks], synthetic.shape[-1])
    if real.shape[1] != synthetic.shape[1]:
        raise GenbufferError(
            "privacy_gate_channels",
            f"the buffer has {synthetic.shape[1]} channels but the site's images have {real.shape[1]}",
        )
    e_real, e_syn = embed(metric, real), embed(metric, synthetic)
    nearest_t, nearest_index = nearest(e_real, e_syn)
    spacing, _ = nearest(e_real, e_real, exclude_self=True)
    nearest_np, spacing_np = nearest_t.numpy(), spacing.numpy()
    if section.gate_distance is not None:
        distance, source = float(section.gate_distance), "configured"
    else:
        distance = section.gate_distance_factor * float(np.median(spacing_np))
        source = "auto"
    exposed = float((nearest_np < distance).mean())
    refused_by = [] if exposed <= section.gate_max_fraction else ["distance"]
    if holdout_uint8 is not None and len(holdout_uint8) >= 2:
        audit = audit_buffer(
            buffer,
            real_uint8,
            holdout_uint8,
            metric,
            section,
            out_dir,
            near_copy_distance=distance,
            seed=seed,
            members_labels=real_labels,
            holdout_labels=holdout_labels,
        )
        assert audit.auc is not None and audit.near_copy_excess is not None
        if audit.auc > section.gate_max_auc:
            refused_by.append("auc")
        if audit.near_copy_excess > section.gate_max_near_copy_excess:
            refused_by.append("near_copy_excess")
        membership_text = (
            f"; membership AUC {audit.auc:.3f} (limit {section.gate_max_auc:.2f}), near-copy "
            f"excess {100 * audit.near_copy_excess:+.1f} points (limit "
            f"{100 * section.gate_max_near_copy_excess:.1f}) over {audit.holdout} held-out images"
        )
    else:
        audit = no_holdout(
            f"no holdout (fewer than genbuffer.holdout_min_images = {section.holdout_min_images} "
            "images to keep out of GAN training): membership test skipped, distance rule only"
        )
        log.warning("privacy gate: %s", audit.reason)
        membership_text = "; no membership test (no holdout)"
    released = not refused_by
    verdict = "released" if released else f"REFUSED ({', '.join(refused_by)})"
    reason = (
        f"privacy gate {verdict}: {100 * exposed:.1f}% of {count} site images have a synthetic "
        f"image closer than LPIPS {distance:.4f} ({source}; the limit is "
        f"{100 * section.gate_max_fraction:.1f}%){membership_text}"
    )
    if not released:
        reason += (
            f" — the buffer was not shared; see {out_dir / GATE_JSON} and {out_dir / GATE_GRID}. "
            "Retrain the generator with the privacy loss (genbuffer.alpha) or more data"
        )
    files = {
        "json": str(out_dir / GATE_JSON),
        "grid": str(out_dir / GATE_GRID),
        "histogram": str(out_dir / GATE_HISTOGRAM),
    }
    decision = GateDecision(
        released=released,
        reason=reason,
        exposed_fraction=round(exposed, 6),
        max_fraction=section.gate_max_fraction,
        distance=round(distance, 6),
        distance_source=source,
        real_images=count,
        buffer_images=len(synthetic),
        nearest_synthetic=_summary(nearest_np),
        real_spacing=_summary(spacing_np),
        lpips_backbone=metric.backbone,
        buffer_hash=str(buffer.get("content_hash", "")),
        seconds=0.0,
        decided_at=time.time(),
        files=files,
        membership=audit.to_json(),
        refused_by=refused_by,
    )
    closest = np.argsort(nearest_np, kind="stable")[: min(16, count)]
    write_grid(
        [real[closest], synthetic[nearest_index[closest]]],
        out_dir / GATE_GRID,
    )
    _write_histogram(nearest_np, spacing_np, distance, out_dir / GATE_HISTOGRAM, metric.backbone)
    decision.seconds = round(time.perf_counter() - start, 3)
    atomic_write_json(
        out_dir / GATE_JSON,
        {
            **decision.to_json(),
            "nearest_synthetic_distances": [round(float(v), 6) for v in nearest_np],
            "real_spacing_distances": [round(float(v), 6) for v in spacing_np],
        },
        mode=PRIVATE_FILE,
    )
    (log.info if released else log.error)("%s", reason)
    if metric.backbone == "random":
        log.warning(
            "the privacy gate measured distances with the RANDOM LPIPS backbone: its decision is "
            "not privacy evidence"
        )
    return decision


def gate_status(decision: GateDecision | None) -> dict[str, Any]:
    """The /status `privacy_gate` block for a decision, or for a gate switched off."""
    if decision is None:
        return {
            "enabled": False,
            "released": True,
            "reason": "PRIVACY GATE OFF (genbuffer.privacy_gate: false): the buffer was shared "
            "without being checked against this site's images",
        }
    return {"enabled": True, **decision.to_json()}


def read_decision(out_dir: str | Path) -> dict[str, Any] | None:
    """The last decision written in `out_dir`, without the per-image lists (None if absent/unreadable)."""
    path = Path(out_dir) / GATE_JSON
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict):
        return None
    return {"enabled": True, **{k: v for k, v in saved.items() if not k.endswith("_distances")}}


def _write_histogram(
    nearest: np.ndarray, spacing: np.ndarray, distance: float, path: Path, backbone: str
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    upper = max(float(nearest.max()), float(spacing[np.isfinite(spacing)].max()), distance) * 1.05
    bins = np.linspace(0, upper, 30)
    ax.hist(
        spacing, bins=bins, color="tab:gray", alpha=0.6, label="to the nearest other real image"
    )
    ax.hist(nearest, bins=bins, color="tab:red", alpha=0.6, label="to the nearest synthetic image")
    ax.axvline(distance, color="black", linestyle="--", label=f"gate distance {distance:.4f}")
    ax.set_xlabel(f"LPIPS distance ({backbone} backbone)")
    ax.set_ylabel("real images")
    ax.set_title("Privacy gate: how close the buffer comes to the site's images")
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, path, mode=PRIVATE_FILE)
