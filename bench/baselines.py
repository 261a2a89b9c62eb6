"""Reference points measured in the same run as the P2P protocols.

- `standalone`: every site trains alone, same model, data and epochs x rounds
  as in the federation; no communication. The floor a federation must beat.
- `centralized_fedavg`: server-based FedAvg (DFU Alg. 2), in one process, for
  reference only: each round every site starts from the global model, trains
  E local epochs, and the server replaces the global model with the
  sample-count-weighted mean. Each site's test split is evaluated with the
  global model.
- `pooled`: centralized training: one model trained on the union of every
  site's training split (epochs x rounds over all of it, the images the whole
  federation sees), chosen on the union of their validation splits, and
  evaluated on each site's test split. The ceiling a federation approaches.
- `centralized_fedsgd`: FedSGDP2P's reference (DFU Alg. 1 with C = 1), in one
  process: every local step every site computes the gradient of its next
  batch on the shared weights and all apply the batch-size-weighted mean of
  all of them, which is FedSGDP2P with every neighbour at every step. As in
  FedSGDP2P each site keeps its own BatchNorm running statistics.

All start from the federation's common initial model (`build_site`), follow
the nodes' learning-rate schedule (training.lr_schedule over the rounds), keep
each site's best model on its validation split as the nodes do
(p2pfl.learning.best: best_round, best_macro_f1, ... in every record), and
return per-site per-round records {node, round, macro_f1, accuracy, ...}.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import TensorDataset

from p2pfl.config import SiteConfig
from p2pfl.learning.best import BestModel
from p2pfl.learning.evaluate import evaluate_site
from p2pfl.learning.optimizer import lr_factor
from p2pfl.learning.train import LocalSite
from protocols.aggregate import weighted_mean
from protocols.memory.results import first_round_reaching, mean_by_round
from protocols.site import build_site

log = logging.getLogger(__name__)

# The test figures of pooled training's best model kept per site (as BestModel keeps them)
BEST_KEYS = ("macro_f1", "accuracy", "balanced_accuracy", "auc")


@dataclass
class BaselineResult:
    name: str
    records: list[dict[str, Any]]
    wall_s: float
    final_states: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # node -> model (cross-site evaluation)
    best_states: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # node (pooled: "pooled") -> its best model on validation (the global test set)

    def mean_by_round(self, metric: str = "macro_f1") -> dict[int, float]:
        return mean_by_round(self.records, metric)

    def rounds_to_threshold(self, threshold: float, metric: str = "macro_f1") -> int | None:
        return first_round_reaching(self.mean_by_round(metric), threshold)

    def final(self, metric: str = "macro_f1") -> dict[str, float]:
        """node -> value at its last logged round."""
        out: dict[str, tuple[int, float]] = {}
        for r in self.records:
            if r.get(metric) is not None and r["round"] >= out.get(r["node"], (-1, 0.0))[0]:
                out[r["node"]] = (r["round"], float(r[metric]))
        return {node: value for node, (_, value) in sorted(out.items())}

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "records": self.records, "wall_s": self.wall_s}


def _scores(
    site: LocalSite, best: BestModel | None = None, round_no: int = 0, *, keep: bool = False
) -> dict[str, Any]:
    """evaluate_site without the gossiped per-class F1 (baselines gossip nothing),
    with the site's best model so far (`best`, updated) as the nodes report it;
    `keep`: `best` keeps that model's weights too."""
    metrics = evaluate_site(site)
    metrics.pop("per_class_f1", None)
    if best is not None:
        metrics.update(best.observe(round_no, metrics, site.state_dict if keep else None))
    return metrics


def _schedule(sites: Sequence[LocalSite], round_no: int, rounds: int) -> None:
    """The round's learning rate on every site, as a node sets it."""
    for site in sites:
        site.set_lr_factor(lr_factor(site.training, round_no, rounds))


def _rounds(configs: Sequence[SiteConfig], rounds: int | None) -> int:
    if rounds is not None:
        return rounds
    return max(cfg.protocol.rounds for cfg in configs)


def own_loss(cfg: SiteConfig) -> SiteConfig:
    """`cfg` for a model that is not averaged across sites: under
    training.logit_adjustment `federated` it trains with the class-weighted
    loss, as a node's own models do (p2pfl/learning/personal.py)."""
    if cfg.training.logit_adjustment != "federated":
        return cfg
    training = cfg.training.model_copy(update={"logit_adjustment": False})
    return cfg.model_copy(update={"training": training})


def standalone(configs: Sequence[SiteConfig], *, rounds: int | None = None) -> BaselineResult:
    """Each site alone for `rounds` (default: the protocol's) x training.epochs epochs."""
    start = time.perf_counter()
    total = _rounds(configs, rounds)
    records: list[dict[str, Any]] = []
    final_states: dict[str, dict[str, Any]] = {}
    best_states: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        site = build_site(own_loss(cfg))
        best = BestModel()
        for r in range(1, total + 1):
            _schedule([site], r, total)
            t0 = time.perf_counter()
            fit = site.train_epochs()
            train_s = time.perf_counter() - t0
            metrics = _scores(site, best, r, keep=True)
            records.append(
                {
                    "node": cfg.node.name,
                    "round": r,
                    **metrics,
                    "train_loss": fit["loss"],
                    "train_s": train_s,
                }
            )
        log.info("standalone %s: %s", cfg.node.name, records[-1])
        final_states[cfg.node.name] = site.state_dict()
        if best.state is not None:
            best_states[cfg.node.name] = best.state
    return BaselineResult(
        "standalone", records, time.perf_counter() - start, final_states, best_states
    )


def centralized_fedavg(
    configs: Sequence[SiteConfig], *, rounds: int | None = None
) -> BaselineResult:
    """Server FedAvg over all sites every round (C = 1), weighted by num_train
    (DFU Alg. 2 line 9: w_{t+1} = sum_k n_k / n * w_{t+1}^k)."""
    start = time.perf_counter()
    total = _rounds(configs, rounds)
    sites = [build_site(cfg) for cfg in configs]
    global_state = sites[0].state_dict()
    weights = [float(site.num_train) for site in sites]
    bests = [BestModel(federated=True) for _ in sites]  # federated models, as a node's
    records: list[dict[str, Any]] = []
    for r in range(1, total + 1):
        _schedule(sites, r, total)
        local_states = []
        train_s = 0.0
        for site in sites:
            site.load_state_dict(global_state)
            t0 = time.perf_counter()
            site.train_epochs()
            train_s += time.perf_counter() - t0
            local_states.append(site.state_dict())
        global_state = weighted_mean(local_states, weights, own=0)
        for cfg, site, best in zip(configs, sites, bests, strict=True):
            site.load_state_dict(global_state)
            metrics = _scores(site, best, r)
            records.append({"node": cfg.node.name, "round": r, **metrics, "train_s": train_s})
    return BaselineResult("centralized_fedavg", records, time.perf_counter() - start)


def _union(datasets: Sequence[TensorDataset | None]) -> TensorDataset | None:
    """One TensorDataset of every site's split (None when no site has it)."""
    present = [d for d in datasets if d is not None and len(d) > 0]
    if not present:
        return None
    return TensorDataset(
        torch.cat([d.tensors[0] for d in present]), torch.cat([d.tensors[1] for d in present])
    )


def pooled(configs: Sequence[SiteConfig], *, rounds: int | None = None) -> BaselineResult:
    """Centralized training: one model on the union of every site's training
    split, `rounds` x training.epochs epochs (the first site's training
    settings; every site has the same in a benchmark), or, with
    training.steps_per_round, as many steps per round as all sites together
    take. The class weighting
    follows the union's class counts; the best model is chosen on the union of
    the validation splits, and each site's test split is scored with the
    latest model and with the best one."""
    start = time.perf_counter()
    total = _rounds(configs, rounds)
    sites = [build_site(own_loss(cfg)) for cfg in configs]
    first = sites[0]
    data = dataclasses.replace(
        first.data,
        train=_union([s.data.train for s in sites]),
        val=_union([s.data.val for s in sites]),
        test=None,
        source="pooled",
    )
    training = first.training
    if training.steps_per_round is not None:  # the steps of every site together
        training = training.model_copy(
            update={"steps_per_round": training.steps_per_round * len(sites)}
        )
    central = LocalSite(
        copy.deepcopy(first.model), data, training, augment=first.augment, device=first.device
    )
    best = BestModel()
    records: list[dict[str, Any]] = []
    for r in range(1, total + 1):
        _schedule([central], r, total)
        t0 = time.perf_counter()
        central.train_epochs()
        train_s = time.perf_counter() - t0
        best.observe(r, evaluate_site(central), central.state_dict)
        latest = central.state_dict()
        for cfg, site in zip(configs, sites, strict=True):
            site.load_state_dict(latest)
            metrics = _scores(site)
            if best.state is not None:
                site.load_state_dict(best.state)
                of_best = _scores(site)
                metrics.update({f"best_{k}": of_best[k] for k in BEST_KEYS})
                metrics["best_round"] = float(best.round or 0)
            records.append({"node": cfg.node.name, "round": r, **metrics, "train_s": train_s})
    kept = {"pooled": best.state} if best.state is not None else {}
    return BaselineResult("pooled", records, time.perf_counter() - start, best_states=kept)


def centralized_fedsgd(
    configs: Sequence[SiteConfig], *, rounds: int | None = None
) -> BaselineResult:
    """Every step, the batch-size-weighted mean of every site's gradient, applied
    by every site (the same weights and optimizer state everywhere); a site
    whose round has fewer steps (no steps_per_round) sits the rest out."""
    start = time.perf_counter()
    total = _rounds(configs, rounds)
    sites = [build_site(cfg) for cfg in configs]
    bests = [BestModel(federated=True) for _ in sites]  # federated models, as a node's
    records: list[dict[str, Any]] = []
    for r in range(1, total + 1):
        _schedule(sites, r, total)
        t0 = time.perf_counter()
        batches = [site.training_batches(site.training.epochs) for site in sites]
        steps = 0
        while True:
            taking = [(site, next(it, None)) for site, it in zip(sites, batches, strict=True)]
            taking = [(site, batch) for site, batch in taking if batch is not None]
            if not taking:
                break
            grads = [site.compute_gradient(x, y) for site, (x, y) in taking]
            mean = weighted_mean(grads, [float(len(y)) for _, (_, y) in taking])
            for site, _ in taking:
                site.apply_gradient(mean)
            steps += 1
        train_s = time.perf_counter() - t0
        for cfg, site, best in zip(configs, sites, bests, strict=True):
            metrics = _scores(site, best, r)
            records.append(
                {"node": cfg.node.name, "round": r, **metrics, "train_s": train_s, "steps": steps}
            )
    return BaselineResult("centralized_fedsgd", records, time.perf_counter() - start)
