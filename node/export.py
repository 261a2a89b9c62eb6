"""`p2pfl-node export`: this site's model as a package with its model card.

    p2pfl-node export --config site.yaml [--which best|personal|federated|latest]
                      [--format safetensors onnx torchscript] --out DIR
                      [--cross-site evaluate.json]

The model comes from the node's last checkpoint (its latest model, or its best
on its own validation split; a split of one class cannot choose among the
federated rounds, and the latest is its best). The package (`p2pfl.learning.export`) holds each
requested format, checked against torch on this site's test split before it
is named, and model.json; the model card (model_card.md and .json) says what
the model was trained on (counts per class and split, never an image), by which
protocol and how many rounds, how well it does on this site's test split
(accuracy, macro-F1, ECE), across sites when `--cross-site` gives the JSON of
`p2pfl-node evaluate --json`, and under which privacy settings.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

from node.evaluate import WHICH_MODELS, read_checkpointed
from node.metricslog import read_metrics
from p2pfl.config import SiteConfig, load_config
from p2pfl.files import PUBLIC_FILE, atomic_write_text
from p2pfl.learning.dp import (
    DEFAULT_DELTA,
    LEDGER,
    LedgerUnprivate,
    checked_history,
    history_prefix,
    ledger_epsilon,
    read_ledger,
)
from p2pfl.learning.dp_recipe import recipe_settings
from p2pfl.learning.export import FORMATS, Architecture, ExportError, write_package
from p2pfl.learning.metrics import classification_report
from p2pfl.learning.train import LocalSite

CHECK_IMAGES = 512  # images of the test split each export is checked on


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="the site's site.yaml")
    parser.add_argument(
        "--which",
        default="best",
        choices=list(WHICH_MODELS),
        help="best (default): the model this site chose on its validation split, personal "
        "or federated; personal; federated (the best federated model on validation, the "
        "latest where the validation split holds one class); latest",
    )
    parser.add_argument(
        "--format",
        dest="formats",
        nargs="+",
        default=["safetensors", "onnx"],
        choices=list(FORMATS),
        help="one or more (default: safetensors onnx)",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument(
        "--cross-site",
        type=Path,
        help="the JSON of `p2pfl-node evaluate --json` for the model card",
    )


def class_counts(site: LocalSite) -> dict[str, dict[str, int]]:
    """Images per class and split: counts only."""
    names = site.data.class_names
    out = {
        split: dict(zip(names, site.data.class_counts(split), strict=True))
        for split in ("train", "val", "test")
        if getattr(site.data, split) is not None
    }
    if site.data.unlabeled is not None:
        out["unlabeled"] = {"(no label)": len(site.data.unlabeled)}
    return out


def privacy_settings(cfg: SiteConfig, dp: dict[str, Any] | None) -> dict[str, Any]:
    """The card's privacy section; `dp` is `dp_spent`'s."""
    protocol = cfg.protocol
    return {
        "payload_encryption": bool(cfg.wire.encryption),
        "mutual_tls": getattr(cfg.transport, "tls", None) is not None,
        "secure_aggregation": bool(getattr(protocol, "secure_aggregation", False)),
        "differential_privacy": dp,
        "what_left_the_site": _what_left(protocol.name),
    }


def dp_spent(
    cfg: SiteConfig, model_round: int | None, saved: dict[str, Any]
) -> dict[str, Any] | None:
    """training.dp's (ε, δ) for the card, both at the δ of this site.yaml: ε
    of the exported model (the model of `model_round`, from the checkpoint
    whose protocol state is `saved`) and ε the site has spent in all, which
    every model it sent is covered by. Both are computed from the privacy
    history, never taken from a metrics row as they stand: a row's ε is at the
    δ of the run that wrote it (review 2, finding 5), and counts only where
    that δ (`dp_delta`, absent before it was written) is no smaller than this
    one, as a lower bound.

    The site's total is the largest of STATE/dp_ledger.json (fsynced at every
    private step before anything computed from it can leave the site), the
    checkpoint's own `dp_history` and those rows; metrics.jsonl is written
    only at the end of a round, so a node killed after it served a round's
    model and before that row is one round behind (review finding 2). The
    model's ε is that of the steps it was trained with: the checkpoint's
    history, cut at its round's `dp_steps` for a model of an earlier round (the
    total where no row says how many).

    Refused (ExportError): a checkpoint that records no private step (trained,
    at least partly, without training.dp: no guarantee to state, review 2,
    finding 1), and a ledger or history that cannot be read (the spent ε
    would be unknown). None without training.dp."""
    dp = cfg.training.dp
    if dp is None:
        return None
    state = Path(cfg.node.state_dir)
    delta = dp.delta if dp.delta is not None else DEFAULT_DELTA
    trained, trained_steps = _checkpoint_history(saved)
    path = state / "metrics.jsonl"
    rows = [r for r in read_metrics(path) if _number(r.get("dp_epsilon")) is not None]
    ledger = state / LEDGER
    try:
        history = read_ledger(ledger)
    except FileNotFoundError:
        if rows or trained_steps:
            raise ExportError(
                f"training.dp: the privacy ledger {ledger} is missing although {path} or the "
                "checkpoint records private steps: the ε this site spent is unknown, so no model "
                "card is written — restore the file"
            ) from None
        raise ExportError(
            f"training.dp is set but {ledger} records no private step: run the node first"
        ) from None
    except LedgerUnprivate as exc:  # not unreadable: restoring the file changes nothing
        raise ExportError(
            f"training.dp: {ledger}: {exc}, so no model card states one — export with "
            "training.dp taken out of site.yaml (the card then says none), or train afresh "
            "under it from a fresh state directory"
        ) from None
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"training.dp: the privacy ledger {ledger} cannot be read ({exc}): the ε this site "
            "spent is unknown, so no model card is written — restore the file"
        ) from None
    bounds = [r for r in rows if _lower_bound(r, delta)]
    total = max(
        [ledger_epsilon(history, delta)]
        + ([ledger_epsilon(trained, delta)] if trained is not None else [])
        + [float(r["dp_epsilon"]) for r in bounds]
    )
    epsilon = _model_epsilon(
        model_round, saved, trained, trained_steps, history, rows, bounds, delta, total
    )
    last = rows[-1] if rows else {}
    sigma, q = (history[-1][0], history[-1][1]) if history else (float("nan"), float("nan"))
    return {
        "epsilon": epsilon,
        "epsilon_site_total": total,
        "delta": delta,
        "noise_multiplier": float(last.get("dp_noise_multiplier", sigma)),
        "max_grad_norm": dp.max_grad_norm,
        "target_epsilon": dp.target_epsilon,
        "accountant": "Opacus RDP, Poisson sampling at rate expected batch / train images",
        "sample_rate": float(last.get("dp_sample_rate", q)),
        "recipe": recipe_settings(cfg.training),
    }


def _lower_bound(row: dict[str, Any], delta: float) -> bool:
    """Whether a metrics row's ε bounds ε at `delta` from below: its run's δ
    was no smaller (a row of before `dp_delta` was written counts, which can
    only overstate)."""
    at = _number(row.get("dp_delta"))
    return at is None or at >= delta


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _checkpoint_history(
    saved: dict[str, Any],
) -> tuple[list[tuple[float, float, int]] | None, int]:
    """The checkpoint's privacy history (None for a checkpoint of before the
    ledger, which records only `dp_steps`) and how many private steps it
    records; ExportError for a checkpoint trained without training.dp, as
    `dp_resume_unprivate` refuses to resume it, or one whose history cannot
    be read."""
    raw, steps = saved.get("dp_history"), saved.get("dp_steps")
    where = f"the checkpoint of round {saved.get('round')}"
    if raw is None and steps is None:
        raise ExportError(
            f"training.dp is set but {where} was trained without it (it records no private "
            "step): its model carries no privacy guarantee, so no card states one — export "
            "with training.dp taken out of site.yaml (the card then says none), or train "
            "afresh under it"
        )
    try:
        if raw is None:
            count = _number(steps)
            if count is None or count < 0:
                raise ValueError(f"dp_steps {steps!r}")
            return None, int(count)
        trained = checked_history(raw)
    except ValueError as exc:
        raise ExportError(
            f"training.dp: the privacy history of {where} cannot be read ({exc}): the ε of its "
            "model is unknown, so no model card is written"
        ) from None
    return trained, sum(n for _, _, n in trained)


def _model_epsilon(
    model_round: int | None,
    saved: dict[str, Any],
    trained: list[tuple[float, float, int]] | None,
    trained_steps: int,
    history: list[tuple[float, float, int]],
    rows: list[dict[str, Any]],
    bounds: list[dict[str, Any]],
    delta: float,
    total: float,
) -> float:
    """ε at `delta` of the model of `model_round`: the steps it was trained
    with, as the checkpoint's history (or the ledger) prices them; `total`
    where the steps are unknown (at most what the site spent)."""
    if model_round is None:
        return total
    steps: int | None = None
    if model_round == saved.get("round"):
        steps = trained_steps
    else:
        counted = [_number(r.get("dp_steps")) for r in rows if r.get("round") == model_round]
        if counted and counted[-1] is not None and counted[-1] >= 0:
            steps = int(counted[-1])
    if steps is None:
        return total
    source = trained if trained is not None and trained_steps >= steps else history
    try:
        epsilon = ledger_epsilon(history_prefix(source, steps), delta)
    except ValueError:  # neither records that many steps
        return total
    at_model = [float(r["dp_epsilon"]) for r in bounds if r.get("round") == model_round]
    return min(total, max([epsilon] + at_model))


def _what_left(protocol: str) -> str:
    return {
        "fedavgp2p": "model weights, to the peers that asked (inside secure sums when "
        "secure_aggregation is on)",
        "fedsgdp2p": "gradients of every step, to the peers that asked",
        "feder": "the model relayed to one successor per round, and a buffer of synthetic "
        "images that passed the privacy gate",
        "feder_a": "a buffer of synthetic images that passed the privacy gate",
        "feder_b": "the model relayed to one successor per round, and a buffer of synthetic "
        "images that passed the privacy gate",
    }.get(protocol, "see docs/threat-model.md for this protocol")


def _cross_site(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
        return {
            k: float(v)
            for k, v in doc.items()
            if k.endswith(("_mean", "_std")) and isinstance(v, (int, float))
        } | {"split": doc.get("split"), "sites": sorted(doc.get("matrix", {}))}
    except (OSError, ValueError, AttributeError, TypeError, RecursionError) as exc:
        # TypeError, RecursionError: a "matrix" that is a number, a nested document
        raise ExportError(
            f"{path}: not the JSON of `p2pfl-node evaluate --json` ({str(exc)[:200]!r})"
        ) from None


def model_card(
    cfg: SiteConfig,
    site: LocalSite,
    which: str,
    model_round: int | None,
    evaluation: dict[str, Any] | None,
    cross_site: dict[str, Any] | None,
    files: dict[str, Any],
    choice: dict[str, Any] | None = None,
    dp: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The card; `dp` is `dp_spent`'s (None: no differential privacy)."""
    return {
        "site": cfg.node.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {
            "which": which,
            "round": model_round,
            "architecture": cfg.model.name,
            "image_size": site.data.image_size,
            "channels": site.data.channels,
            "classes": site.data.class_names,
            "files": files,
        },
        "training": {
            "protocol": cfg.protocol.name,
            "rounds": getattr(cfg.protocol, "rounds", None),
            "federation": cfg.federation.id,
            "optimizer": cfg.training.optimizer,
            "lr": cfg.training.lr,
            "lr_schedule": getattr(cfg.training, "lr_schedule", None),
            "class_weighting": {
                "mode": site.class_weighting["mode"],
                "applied": site.class_weighting["applied"],
            },
            "augmentation": str(cfg.data.augment),
        },
        "data": {
            "source_kind": _source_kind(cfg),
            "images_per_class": class_counts(site),
        },
        "evaluation_this_site": evaluation,
        "evaluation_cross_site": cross_site,
        "personalization": choice,
        "privacy": privacy_settings(cfg, dp),
        "limitations": [
            "Evaluated on this site's own test split; other sites' images may differ "
            "(scanner, population, protocol).",
            "Probabilities are not calibrated beyond what the ECE above shows.",
            "Not a medical device; for research use.",
        ],
    }


def _source_kind(cfg: SiteConfig) -> str:
    source = str(cfg.data.source)
    if source == "digits":
        return "digits (scikit-learn, embedded)"
    return "npz file" if source.endswith(".npz") else "image folder"


def card_markdown(card: dict[str, Any]) -> str:
    m, t, d = card["model"], card["training"], card["data"]
    lines = [
        f"# Model card: {m['architecture']} of site {card['site']}",
        "",
        f"Exported {card['created']}: the {m['which']} model"
        + (f" (round {m['round']})" if m["round"] is not None else "")
        + f", {m['image_size']}×{m['image_size']} px, {m['channels']} channel(s), "
        f"classes {', '.join(m['classes'])}.",
        "",
        "## Training",
        "",
        f"- protocol: {t['protocol']}, {t['rounds']} rounds",
        f"- optimizer: {t['optimizer']}, lr {t['lr']}, schedule {t['lr_schedule']}",
        f"- class weighting: {t['class_weighting']['mode']} (applied: "
        f"{t['class_weighting']['applied']}); augmentation: {t['augmentation']}",
        "",
        f"## Data of this site ({d['source_kind']}; counts only, no image leaves the site)",
        "",
        "| split | " + " | ".join(m["classes"]) + " |",
        "|---|" + "---:|" * len(m["classes"]),
    ]
    for split, counts in d["images_per_class"].items():
        if split == "unlabeled":
            continue
        lines.append(f"| {split} | " + " | ".join(str(counts[c]) for c in m["classes"]) + " |")
    if "unlabeled" in d["images_per_class"]:
        lines.append(f"\nUnlabelled images: {d['images_per_class']['unlabeled']['(no label)']}.")
    choice = card.get("personalization")
    if choice:
        lines += [
            "",
            f"Personalization ({choice.get('method')}): this site reports its "
            f"**{choice.get('reported')}** model ({choice.get('why')}; chosen on its "
            "validation split, never its test split). Exported: the "
            f"{m['which']} model.",
        ]
        if choice.get("personal_source") == "local":
            lines.append(
                "Its personal model is the one this site trained on its own data alone, "
                "from its initial weights: no federated weights are in it."
            )
    lines += ["", "## Evaluation", ""]
    ev = card["evaluation_this_site"]
    if ev:
        lines.append(
            f"This site's test split ({ev['n']} images): accuracy {ev['accuracy']:.3f}, "
            f"macro-F1 {ev['macro_f1']:.3f}, balanced accuracy {ev['balanced_accuracy']:.3f}, "
            f"ECE {ev['ece']:.3f} (15 bins)."
        )
    else:
        lines.append("This site has no test split: no evaluation here.")
    cs = card["evaluation_cross_site"]
    if cs:
        lines.append(
            f"\nAcross sites ({', '.join(cs['sites'])}, {cs['split']} splits, every node "
            f"model on every site): macro-F1 {cs.get('macro_f1_mean', float('nan')):.3f} ± "
            f"{cs.get('macro_f1_std', float('nan')):.3f}, accuracy "
            f"{cs.get('accuracy_mean', float('nan')):.3f} ± {cs.get('accuracy_std', float('nan')):.3f}."
        )
    else:
        lines.append("\nNo cross-site evaluation was given (`--cross-site`).")
    p = card["privacy"]
    dp = p["differential_privacy"]
    lines += [
        "",
        "## Privacy",
        "",
        f"- what left the site during training: {p['what_left_the_site']}",
        f"- payload encryption: {'on' if p['payload_encryption'] else 'off'}; "
        f"mutual TLS: {'on' if p['mutual_tls'] else 'off'}",
        f"- secure aggregation: {'on' if p['secure_aggregation'] else 'off'}",
        "- differential privacy: "
        + (
            "none (no ε guarantee)"
            if dp is None
            else f"DP-SGD (Opacus), ε = {dp['epsilon']:.2f} at δ = {dp['delta']:g} for this "
            f"model, ε = {dp['epsilon_site_total']:.2f} spent by the site in all; noise "
            f"multiplier {dp['noise_multiplier']:.3f}, clipping norm {dp['max_grad_norm']}, "
            f"Poisson sampling at rate {dp['sample_rate']:.4f}; recipe: "
            + ", ".join(f"{k} {v}" for k, v in (dp["recipe"] or {}).items())
        ),
        "",
        "## Files",
        "",
    ]
    for fmt, entry in m["files"].items():
        lines.append(f"- `{entry['file']}` ({fmt}), SHA-256 `{entry['sha256']}`")
    lines += ["", "## Limitations", ""] + [f"- {x}" for x in card["limitations"]]
    return "\n".join(lines) + "\n"


def run_export(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, check_files=False)
    if cfg.model.siamese.enabled or cfg.model.pretrained_from is not None:
        raise ExportError(
            "export: Siamese models and Fed-MAE classifiers are not exportable yet; "
            "export a site whose model.name builds the whole network"
        )
    cross = _cross_site(args.cross_site)
    found = read_checkpointed(cfg, args.config, args.which)
    state, model_round, choice = found.state, found.round, found.choice
    # an unknown ε, or a model trained partly in the clear, is refused before any file is written
    dp = dp_spent(cfg, model_round, found.saved)
    # `best` is the site's choice on validation: say which model that was
    which = f"best ({found.which})" if args.which == "best" else args.which
    site = LocalSite.from_config(cfg)
    site.load_state_dict(state)
    arch = Architecture(
        cfg.model.name, site.data.channels, site.data.num_classes, site.data.image_size
    )
    split = site.data.test if site.data.test is not None else site.data.val
    evaluation = None
    if split is not None:
        x, y = split.tensors
        proba = site.predict_proba(x).numpy()
        report = classification_report(y.numpy(), proba, site.num_classes)
        evaluation = {
            k: float(report[k]) for k in ("accuracy", "macro_f1", "balanced_accuracy", "ece")
        }
        evaluation["n"] = len(y)
        evaluation["split"] = "test" if site.data.test is not None else "val"
        check = x[:CHECK_IMAGES]
    else:
        check = site.data.train.tensors[0][:CHECK_IMAGES]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit's deprecation notice
        description = write_package(
            args.out,
            site.state_dict(),
            arch,
            site.data.class_names,
            args.formats,
            check,
            extra={"site": cfg.node.name, "which": which, "round": model_round},
        )
    card = model_card(
        cfg, site, which, model_round, evaluation, cross, description["files"], choice, dp
    )
    # the card goes with the package the operator asked to share
    atomic_write_text(
        args.out / "model_card.json", json.dumps(card, indent=2) + "\n", mode=PUBLIC_FILE
    )
    atomic_write_text(args.out / "model_card.md", card_markdown(card), mode=PUBLIC_FILE)
    summary = {
        "out": str(args.out),
        "formats": list(description["files"]),
        "which": which,
        "round": model_round,
        "max_abs_diff": {f: e["max_abs_diff"] for f, e in description["files"].items()},
        **(
            {f"test_{k}": evaluation[k] for k in ("accuracy", "macro_f1", "ece")}
            if evaluation
            else {}
        ),
    }
    print(json.dumps(summary))
    return 0
