"""FedPerl communities without a server: feature vectors, similarity, top-T, policies.

Every node gossips its feature vector (`FEATURES_KEY`) and computes, on its
own, the same similarity matrix the papers' server would:

- feature vector F_m = ((mu_0, sigma_0), ..., (mu_l, sigma_l)): mean and
  unbiased std of every averaged state-dict entry (p2pfl.learning.state.feature_vector;
  FedPerl journal Sec. 2.3.1, MICCAI Sec. 2.2 "Building communities");
- each column clipped to its median +- 50 MADs (over its distinct values), then min-max normalised
  across the nodes, then cosine similarity (protocols/similarity.py); a
  vector with a non-finite entry or one beyond 1e6 is left out;
- the top T peers by similarity, never itself, never a negative (or
  undefined) similarity; ties broken by name so every run picks alike;
- a policy on the top T (journal Sec. 2.3.5): static (all T), validation
  (peers whose validation accuracy >= mine), gated validation (>= rho), gated
  similarity (similarity >= rho).

Pure functions of their inputs: no network, no torch training.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from protocols.similarity import cosine_matrix, normalise_columns, vector_problem

log = logging.getLogger(__name__)

FEATURES_KEY = "fedperl_features"  # gossiped: {"round": r, "vector": [...]}
VAL_ACCURACY_KEY = "val_accuracy"  # gossiped: validation accuracy of the last evaluation
COMMUNITY_KEY = "community"  # no longer gossiped (none read it); dropped from old checkpoints

Policy = Literal["static", "validation", "gated_validation", "gated_similarity"]
POLICIES: tuple[str, ...] = ("static", "validation", "gated_validation", "gated_similarity")


@dataclass
class SimilarityMatrix:
    """W over `names` (rows and columns in that order)."""

    names: list[str]
    values: NDArray[np.float64]

    def row(self, name: str) -> dict[str, float]:
        """Similarity of `name` to every other node (a non-finite one left out)."""
        i = self.names.index(name)
        return {
            n: float(self.values[i, j])
            for j, n in enumerate(self.names)
            if n != name and math.isfinite(float(self.values[i, j]))
        }


def similarity_matrix(
    vectors: Mapping[str, Sequence[float]], *, normalise: bool = True
) -> SimilarityMatrix:
    """W (FedPerl journal Sec. 2.3.1) of the nodes whose vectors have the most
    common length (a node with another model shape cannot be compared)."""
    usable = {k: list(v) for k, v in vectors.items() if len(v) > 0}
    if not usable:
        return SimilarityMatrix([], np.zeros((0, 0)))
    lengths = [len(v) for v in usable.values()]
    common = max(set(lengths), key=lambda n: (lengths.count(n), n))
    names = sorted(k for k, v in usable.items() if len(v) == common)
    dropped = sorted(set(usable) - set(names))
    if dropped:
        log.warning("feature vectors of %s have another length; left out", dropped)
    unusable = sorted(n for n in names if vector_problem(usable[n]) is not None)
    if unusable:
        log.warning("feature vectors of %s are not finite or out of range; left out", unusable)
        names = [n for n in names if n not in unusable]
    matrix = np.array([usable[n] for n in names], dtype=np.float64).reshape(len(names), common)
    if normalise and len(names) > 0:
        matrix = normalise_columns(matrix)
    return SimilarityMatrix(names, cosine_matrix(matrix))


def top_t(similarities: Mapping[str, float], t: int, *, exclude: str | None = None) -> list[str]:
    """The T most similar peers, most similar first: never `exclude` (myself),
    never a negative or non-finite similarity; equal similarities in name order."""
    if t <= 0:
        return []
    ranked = sorted(
        (
            (sim, name)
            for name, sim in similarities.items()
            if name != exclude and math.isfinite(sim) and sim >= 0.0
        ),
        key=lambda pair: (-pair[0], pair[1]),
    )
    return [name for _, name in ranked[:t]]


@dataclass
class PolicyInputs:
    """What the dynamic policies read (journal Sec. 2.3.5)."""

    similarities: Mapping[str, float] = field(default_factory=dict)
    my_val_accuracy: float | None = None
    peer_val_accuracy: Mapping[str, float] = field(default_factory=dict)


def apply_policy(policy: str, chosen: Sequence[str], inputs: PolicyInputs, rho: float) -> list[str]:
    """Which of the top-T `chosen` peers take part in peer learning.

    static: all of them. validation: V_acc(peer) >= V_acc(me). gated_validation:
    V_acc(peer) >= rho. gated_similarity: similarity(me, peer) >= rho. A peer
    whose figure is unknown does not pass a gate; under `validation`, without my
    own accuracy nobody passes."""
    if policy == "static":
        return list(chosen)
    if policy == "validation":
        mine = inputs.my_val_accuracy
        if mine is None:
            return []
        return [p for p in chosen if _known(inputs.peer_val_accuracy.get(p)) >= mine]
    if policy == "gated_validation":
        return [p for p in chosen if _known(inputs.peer_val_accuracy.get(p)) >= rho]
    if policy == "gated_similarity":
        return [p for p in chosen if _known(inputs.similarities.get(p)) >= rho]
    raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")


def _known(value: float | None) -> float:
    if value is None or not math.isfinite(value):
        return -math.inf
    return float(value)


def choice_frequencies(
    choices: Sequence[Mapping[str, object]], names: Sequence[str]
) -> NDArray[np.float64]:
    """Who-chose-whom (journal Fig. 3): entry [i, j] = share of node i's
    recorded choices that included node j."""
    index = {n: i for i, n in enumerate(names)}
    counts = np.zeros((len(names), len(names)))
    rounds = np.zeros(len(names))
    for choice in choices:
        node = str(choice["node"])
        if node not in index:
            continue
        rounds[index[node]] += 1
        chosen = choice.get("chosen") or []
        for peer in chosen if isinstance(chosen, list) else []:
            if peer in index:
                counts[index[node], index[str(peer)]] += 1
    return counts / np.maximum(rounds, 1)[:, None]
