"""Local semi-supervised reference points, measured in the same run as SSFL-P2P and FedPerl.

- `local_supervised`: the local lower bound, each site alone on its labeled
  images only (class-weighted cross-entropy on weak views), for as many steps a
  round as FixMatch takes, so compute is equal;
- `local_fixmatch`: each site alone with FixMatch on its labeled and unlabeled
  images (FedPerl journal, "Local/FixMatch").

No communication. Both start from the federation's common initial model
(`build_site`), rebuild Adam every round like the federated runs, read tau,
beta, unlabeled_ratio and class_weighted from each site's `protocol:` section
(an `ssfl` or `fedperl` one) and return per-site per-round records
{node, round, macro_f1, accuracy, ece, mce, val_accuracy, ...} in a
`BaselineResult`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.baselines import BaselineResult
from p2pfl.config import SiteConfig
from p2pfl.learning.evaluate import CALIBRATION_KEYS, evaluate_site
from p2pfl.learning.semisup import fixmatch_epoch, supervised_epoch
from p2pfl.learning.train import LocalSite
from protocols.site import build_site

log = logging.getLogger(__name__)


def _semisup_params(cfg: SiteConfig) -> dict[str, Any]:
    p = cfg.protocol
    return {
        "tau": getattr(p, "tau", 0.6),
        "beta": getattr(p, "beta", 0.5),
        "unlabeled_ratio": getattr(p, "unlabeled_ratio", 1),
        "class_weighted": getattr(p, "class_weighted", True),
    }


def _run_alone(
    name: str,
    configs: Sequence[SiteConfig],
    rounds: int | None,
    fit: Callable[[LocalSite, dict[str, Any]], dict[str, float]],
) -> BaselineResult:
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    for cfg in configs:
        total = rounds if rounds is not None else cfg.protocol.rounds
        site = build_site(cfg)
        params = _semisup_params(cfg)
        for r in range(1, total + 1):
            site.reset_optimizer()
            t0 = time.perf_counter()
            result = fit(site, params)
            train_s = time.perf_counter() - t0
            metrics = evaluate_site(site, CALIBRATION_KEYS)
            metrics.pop("per_class_f1", None)
            records.append(
                {
                    "node": cfg.node.name,
                    "round": r,
                    **{k: v for k, v in metrics.items() if v is not None},
                    "train_loss": result["loss"],
                    "mask_rate": result["mask_rate"],
                    "train_s": train_s,
                }
            )
        log.info("%s %s: %s", name, cfg.node.name, records[-1])
    return BaselineResult(name, records, time.perf_counter() - start)


def local_supervised(configs: Sequence[SiteConfig], *, rounds: int | None = None) -> BaselineResult:
    """Each site alone on its labeled images (the local lower bound)."""
    return _run_alone(
        "local_supervised",
        configs,
        rounds,
        lambda site, p: supervised_epoch(
            site, p["class_weighted"], unlabeled_ratio=p["unlabeled_ratio"]
        ),
    )


def local_fixmatch(configs: Sequence[SiteConfig], *, rounds: int | None = None) -> BaselineResult:
    """Each site alone with FixMatch on its labeled + unlabeled images."""
    return _run_alone("local_fixmatch", configs, rounds, lambda site, p: fixmatch_epoch(site, **p))
