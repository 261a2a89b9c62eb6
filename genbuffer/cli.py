"""`p2pfl-node genbuffer train|sample|audit|lpips --config site.yaml`.

node/cli.py registers this with `add_genbuffer_parser(subparsers, help_line)` and runs
`run_genbuffer(args)`. The config may be a site.yaml (validated whole, like
`p2pfl-node check` but without the roster and key files; its `genbuffer:` and
`data:` sections are used) or a standalone YAML with just those sections and a
`seed:`.
Command-line options override the YAML. Mistakes a person can fix print one
line and return 2.

Everything derived from the site's private images (generators, training state,
quality classifier, the privacy gate's and the audits' grids of real images and
per-image distances, the buffer's preview) goes to `genbuffer.out_dir`, the
site's private folder (STATE/genbuffer in a site.yaml), made 0700 with its files
0600; a site.yaml's state dir is tightened to 0700 as run_node does, since this
CLI may run before the node ever has. `sample --out` names where the buffer
alone goes, the one thing a site chooses to share, and it is written there only
once the privacy gate accepted it: a refused buffer leaves nothing in that folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from p2pfl.config import ConfigError, DataSection
from p2pfl.files import PRIVATE_FILE, atomic_write_bytes, make_private_dir

from .config import GenbufferConfig, GenbufferSection, load_genbuffer_config
from .errors import GenbufferError

log = logging.getLogger(__name__)


def add_genbuffer_parser(
    subparsers: argparse._SubParsersAction, help_line: str
) -> argparse.ArgumentParser:
    """Add `genbuffer` with its `train`, `sample` and `audit` sub-commands
    (`help_line`: its line in `p2pfl-node --help`, node/cli.py OPTIONAL_HELP)."""
    parser = subparsers.add_parser(
        "genbuffer",
        help=help_line,
        description="Train the site's privacy-preserving conditional StyleGAN2-ADA (FedER), "
        "sample synthetic buffers from it, and audit how well it hides the training images.",
    )
    parser.set_defaults(func=run_genbuffer)
    sub = parser.add_subparsers(dest="genbuffer_command", metavar="{train,sample,audit,lpips}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            required=True,
            type=Path,
            help="site.yaml or a YAML with a genbuffer: section",
        )
        p.add_argument(
            "--device", choices=["auto", "cpu", "cuda"], help="override genbuffer.device"
        )
        p.add_argument("--seed", type=int, help="override genbuffer.seed")

    train = sub.add_parser(
        "train", help="two-stage training (stage 1 plain, stage 2 with the LPIPS privacy loss)"
    )
    common(train)
    train.add_argument(
        "--out",
        type=Path,
        help="private output folder, made 0700 (default genbuffer.out_dir)",
    )
    train.add_argument(
        "--iterations", type=int, help="stage 1: most iterations (genbuffer.iterations)"
    )
    train.add_argument(
        "--stage2-iterations", type=int, help="stage 2: most iterations; 0 skips stage 2"
    )
    train.add_argument(
        "--patience", type=int, help="stage 1: iterations without improvement before stopping"
    )
    train.add_argument("--quality-every", type=int, help="iterations between quality scores")
    train.add_argument("--resolution", type=int, help="GAN resolution (power of two, 16-256)")
    train.add_argument("--batch-size", type=int)
    train.add_argument("--alpha", type=float, help="weight of the privacy loss (FedER Eq. 5)")
    train.add_argument("--lpips-backbone", choices=["alex", "vgg", "squeeze", "random"])
    train.add_argument(
        "--lpips-weights", type=Path, help="lpips state dict or torchvision backbone file"
    )
    train.add_argument(
        "--no-reference", action="store_true", help="skip the no-privacy continuation used by audit"
    )
    train.add_argument(
        "--restart", action="store_true", help="ignore an existing training state and start over"
    )

    sample = sub.add_parser(
        "sample", help="write a synthetic buffer (uint8 images + labels, tensor codec)"
    )
    common(sample)
    sample.add_argument(
        "--checkpoint", type=Path, help="generator file (default OUT_DIR/generator.pt)"
    )
    sample.add_argument("--size", type=int, help="number of images (genbuffer.buffer_size)")
    sample.add_argument(
        "--per-class", choices=["balanced", "prior"], help="class counts: equal or local prior"
    )
    sample.add_argument(
        "--out",
        type=Path,
        help="buffer file, written (0600) only if the privacy gate accepts it (default "
        "OUT_DIR/buffer.bin); the gate's evidence and a preview PNG stay in OUT_DIR",
    )

    audit = sub.add_parser(
        "audit", help="project real images into W of the generators with/without privacy loss"
    )
    common(audit)
    audit.add_argument(
        "--pp-checkpoint",
        type=Path,
        help="generator with privacy loss (default OUT_DIR/generator.pt)",
    )
    audit.add_argument(
        "--nopp-checkpoint",
        type=Path,
        help="generator without it (default OUT_DIR/reference_nopp.pt)",
    )
    audit.add_argument(
        "--images", type=int, help="real training images to project (genbuffer.audit_images)"
    )
    audit.add_argument(
        "--steps", type=int, help="optimisation steps per projection (genbuffer.audit_steps)"
    )
    audit.add_argument(
        "--out",
        type=Path,
        help="private folder for audit.json and the PNGs of real images, made 0700 "
        "(default OUT_DIR/audit)",
    )
    audit.add_argument("--lpips-backbone", choices=["alex", "vgg", "squeeze", "random"])
    audit.add_argument("--lpips-weights", type=Path)

    distance = sub.add_parser(
        "lpips",
        help="print the LPIPS distance of two images, to check the configured weights",
        description="LPIPS distance between two image files with the site's genbuffer.lpips_backbone "
        "and lpips_weights. Images are compared at their own size (no upsampling), as the "
        "lpips package does, so published reference values can be checked.",
    )
    common(distance)
    distance.add_argument("image_a", type=Path)
    distance.add_argument("image_b", type=Path)
    distance.add_argument("--lpips-backbone", choices=["alex", "vgg", "squeeze", "random"])
    distance.add_argument("--lpips-weights", type=Path)
    return parser


def _user_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


COMMON_OVERRIDES = {
    "device": "device",
    "seed": "seed",
    "lpips_backbone": "lpips_backbone",
    "lpips_weights": "lpips_weights",
}


def _with_overrides(
    config: GenbufferConfig, args: argparse.Namespace, options: dict[str, str]
) -> GenbufferSection:
    """The config's genbuffer section with the options given on the command line
    applied: the common ones and `options` (argparse name -> section field)."""
    section = config.genbuffer
    names = {**COMMON_OVERRIDES, **options}
    updates: dict[str, Any] = {}
    for arg, field in names.items():
        value = getattr(args, arg, None)
        if value is not None:
            updates[field] = value
    if not updates:
        return section
    try:
        return GenbufferSection.model_validate({**section.model_dump(), **updates})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        option = next(
            (f"--{a.replace('_', '-')}" for a, f in names.items() if f == field), field or "options"
        )
        problem = err["msg"].removeprefix("Value error, ")
        raise GenbufferError("bad_option", f"{option}: {problem}") from None


def _progress_bar() -> Any:
    """A progress callback drawing one tqdm bar per phase, or logging a line every 15 s
    (genbuffer.progress) when stderr is not a terminal."""
    if not sys.stderr.isatty():
        from .progress import TrainingProgress

        return TrainingProgress()
    from tqdm import tqdm

    bars: dict[str, Any] = {}

    def update(phase: str, done: int, total: int, stats: dict[str, float]) -> None:
        bar = bars.get(phase)
        if bar is None:
            for other in bars.values():
                other.close()
            bar = bars[phase] = tqdm(total=total, desc=phase, unit="it", dynamic_ncols=True)
        bar.n = done
        bar.set_postfix({k: f"{v:.3f}" for k, v in stats.items()}, refresh=False)
        bar.refresh()
        if done >= total:
            bar.close()

    return update


def _site_training_arrays(config: GenbufferConfig) -> tuple[np.ndarray, np.ndarray, int]:
    from p2pfl.learning.data import DataError, load_site_data

    data_section = config.data or DataSection()
    try:
        data = load_site_data(data_section, seed=config.seed)
    except DataError as exc:
        raise GenbufferError(f"data_{exc.reason}", f"{config.path}: data.source: {exc}") from None
    return data.train_uint8, np.asarray(data.train_labels), data.num_classes


def _members_and_holdout(
    section: GenbufferSection, images: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(member images, member labels, holdout images, holdout labels): the node's split
    (audit.holdout_split)."""
    from .audit import holdout_split

    members, holdout = holdout_split(
        labels, section.holdout_fraction, section.holdout_min_images, section.seed
    )
    log.info(
        "%d of the site's %d training images are held out of GAN training for the membership test",
        len(holdout),
        len(images),
    )
    return images[members], labels[members], images[holdout], labels[holdout]


def _tighten_state_dir(config: GenbufferConfig) -> None:
    """A site.yaml's state dir made 0700 as run_node does: `p2pfl-node provision`
    leaves it 0755, and the GAN's private folder is inside it."""
    if config.state_dir is not None:
        make_private_dir(config.state_dir)


def _cmd_train(config: GenbufferConfig, args: argparse.Namespace) -> int:
    from .train import train_generator

    section = _with_overrides(
        config,
        args,
        {
            "out": "out_dir",
            "iterations": "iterations",
            "stage2_iterations": "stage2_iterations",
            "patience": "stage1_patience",
            "quality_every": "quality_every",
            "resolution": "resolution",
            "batch_size": "batch_size",
            "alpha": "alpha",
        },
    )
    if args.no_reference:
        section = section.model_copy(update={"train_reference": False})
    _tighten_state_dir(config)  # train_generator makes out_dir itself, once LPIPS is ready
    images, labels, num_classes = _site_training_arrays(config)
    images, labels, _, _ = _members_and_holdout(section, images, labels)
    # Subnormal floats make long CPU runs many times slower; the flag is process-wide,
    # so it is switched off again (the default) when training returns.
    torch.set_flush_denormal(True)
    try:
        result = train_generator(
            images,
            labels,
            num_classes,
            section,
            section.out_dir,
            resume=not args.restart,
            progress=_progress_bar(),
        )
    finally:
        torch.set_flush_denormal(False)
    print(json.dumps(result.to_json()))
    return 0


def _cmd_sample(config: GenbufferConfig, args: argparse.Namespace) -> int:
    from .buffer import buffer_to_bytes, sample_buffer
    from .checkpoint import load_generator
    from .projection import write_grid
    from .train import GENERATOR_FILE, resolve_device

    section = _with_overrides(config, args, {"size": "buffer_size", "per_class": "per_class"})
    checkpoint = args.checkpoint or section.out_dir / GENERATOR_FILE
    generator, info = load_generator(checkpoint, resolve_device(section.device))
    buffer = sample_buffer(
        generator,
        section.buffer_size,
        per_class=section.per_class,
        label_prior=info.label_prior,
        seed=section.seed,
        truncation_psi=section.truncation_psi,
    )
    _tighten_state_dir(config)
    private = make_private_dir(section.out_dir)
    out = args.out or private / "buffer.bin"
    # The gate's evidence shows and measures the site's images: it stays in the private
    # folder, never beside the buffer, which goes out only once the gate accepted it.
    gate = _gate(config, section, buffer, private)
    atomic_write_bytes(out, buffer_to_bytes(buffer), mode=PRIVATE_FILE)
    preview = private / f"{out.stem}_preview.png"
    rows = []
    for c in range(generator.num_classes):
        picked = buffer["images"][buffer["labels"] == c][:16]
        if len(picked):
            rows.append(picked.float() / 127.5 - 1)
    width = min(len(r) for r in rows) if rows else 0
    if width:
        write_grid([r[:width] for r in rows], preview)
    counts = torch.bincount(buffer["labels"], minlength=generator.num_classes).tolist()
    print(
        json.dumps(
            {
                "buffer": str(out),
                "preview": str(preview),
                "images": len(buffer["labels"]),
                "per_class": counts,
                "content_hash": buffer["content_hash"],
                "generator": str(checkpoint),
                "privacy_gate": gate,
            }
        )
    )
    return 0


def _gate(
    config: GenbufferConfig, section: GenbufferSection, buffer: Any, private: Path
) -> dict[str, Any]:
    """The privacy gate on a buffer about to be written (raises when it is refused);
    its evidence, grids of the site's images included, goes to the `private` folder."""
    from .gate import PrivacyGateRefused, check_buffer, gate_status
    from .privacy import build_perceptual_distance

    if not section.privacy_gate:
        log.warning("PRIVACY GATE OFF (genbuffer.privacy_gate: false): buffer written unchecked")
        return gate_status(None)
    metric = build_perceptual_distance(
        section.lpips_backbone, section.lpips_weights, min_size=section.lpips_min_size
    )
    members, member_labels, holdout, holdout_labels = _members_and_holdout(
        section, *_site_training_arrays(config)[:2]
    )
    decision = check_buffer(
        buffer,
        members,
        metric,
        section,
        private,
        holdout_uint8=holdout,
        seed=section.seed,
        real_labels=member_labels,
        holdout_labels=holdout_labels,
    )
    if not decision.released:
        raise PrivacyGateRefused(decision)
    return gate_status(decision)


def _cmd_audit(config: GenbufferConfig, args: argparse.Namespace) -> int:
    from .checkpoint import load_generator
    from .privacy import build_perceptual_distance
    from .projection import audit_privacy
    from .train import GENERATOR_FILE, REFERENCE_GENERATOR, resolve_device
    from .trainer import prepare_images

    section = _with_overrides(config, args, {"images": "audit_images", "steps": "audit_steps"})
    _tighten_state_dir(config)  # audit_privacy makes its own folder private
    device = resolve_device(section.device)
    metric = build_perceptual_distance(
        section.lpips_backbone,
        section.lpips_weights,
        min_size=section.lpips_min_size,
        device=device,
    )
    pp_path = args.pp_checkpoint or section.out_dir / GENERATOR_FILE
    nopp_path = args.nopp_checkpoint or section.out_dir / REFERENCE_GENERATOR
    if not nopp_path.is_file():
        raise GenbufferError(
            "no_reference",
            f"{nopp_path}: no generator trained without the privacy loss — run `genbuffer train` "
            "without --no-reference (genbuffer.train_reference: true), or pass --nopp-checkpoint",
        )
    generator_pp, info_pp = load_generator(pp_path, device)
    generator_nopp, _ = load_generator(nopp_path, device)
    if info_pp.lpips_backbone and info_pp.lpips_backbone != section.lpips_backbone:
        log.warning(
            "the generator was trained with the %s LPIPS backbone but the audit uses %s",
            info_pp.lpips_backbone,
            section.lpips_backbone,
        )
    # The projection audit asks whether the GAN stored its training images: the members.
    images, labels, _, _ = _members_and_holdout(section, *_site_training_arrays(config)[:2])
    rng = np.random.default_rng(section.seed)
    picks = np.sort(
        rng.choice(len(images), size=min(section.audit_images, len(images)), replace=False)
    )
    real = prepare_images(images[picks], generator_pp.spec.resolution)
    out = args.out or section.out_dir / "audit"
    result = audit_privacy(
        generator_pp,
        generator_nopp,
        real,
        torch.as_tensor(labels[picks]),
        metric,
        out,
        steps=section.audit_steps,
        lr=section.audit_lr,
        seed=section.seed,
    )
    summary = {k: v for k, v in result.to_json().items() if not k.startswith("distances")}
    print(json.dumps({**summary, "lpips_backbone": section.lpips_backbone}))
    return 0


def _read_image(path: Path) -> torch.Tensor:
    """(1, C, H, W) in [-1, 1]; C is 1 for grey images and 3 for colour ones."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            mode = "L" if image.mode in ("1", "L", "I", "I;16", "F") else "RGB"
            pixels = np.asarray(image.convert(mode), dtype=np.float32)
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise GenbufferError("image_unreadable", f"{path}: not a readable image ({exc})") from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return torch.from_numpy(pixels).permute(2, 0, 1)[None] / 127.5 - 1


def _cmd_lpips(config: GenbufferConfig, args: argparse.Namespace) -> int:
    from .privacy import build_perceptual_distance

    section = _with_overrides(config, args, {})
    a, b = _read_image(args.image_a), _read_image(args.image_b)
    if a.shape[1] != b.shape[1]:  # grey against colour: compare both in colour
        a, b = a.expand(-1, 3, -1, -1), b.expand(-1, 3, -1, -1)
    if a.shape != b.shape:
        raise GenbufferError(
            "image_sizes_differ",
            f"{args.image_a} is {a.shape[-1]}x{a.shape[-2]} but {args.image_b} is "
            f"{b.shape[-1]}x{b.shape[-2]} — LPIPS compares images of the same size",
        )
    metric = build_perceptual_distance(
        section.lpips_backbone, section.lpips_weights, min_size=min(a.shape[-2:])
    )
    with torch.no_grad():
        d = float(metric(a, b)[0])
    print(
        json.dumps(
            {
                "lpips": round(d, 6),
                "image_a": str(args.image_a),
                "image_b": str(args.image_b),
                "lpips_backbone": section.lpips_backbone,
                "lpips_weights": str(section.lpips_weights) if section.lpips_weights else None,
            }
        )
    )
    return 0


def run_genbuffer(args: argparse.Namespace) -> int:
    command = getattr(args, "genbuffer_command", None)
    if command is None:
        return _user_error(
            "genbuffer needs a sub-command: train, sample, audit or lpips (see --help)"
        )
    try:
        config = load_genbuffer_config(args.config)
        handler = {
            "train": _cmd_train,
            "sample": _cmd_sample,
            "audit": _cmd_audit,
            "lpips": _cmd_lpips,
        }[command]
        return handler(config, args)
    except (ConfigError, GenbufferError) as exc:
        return _user_error(str(exc))
