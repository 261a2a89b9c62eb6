"""Peer-selection heuristics of the DFU P2P paper (Sec. 4.1-4.4): H0 random,
H1 n-latest, H2 F1 dissimilarity, H3 cosine.

One registry, one factory: `selection.create("f1", prefer="similar")`, or
`selection.from_config(cfg.selection)` from site.yaml. Every heuristic ranks
*all* candidates by preference and returns their names: the first k are this
round's neighbours, the rest are the fallbacks, in order, for when a chosen
neighbour does not answer. A ranking depends only on its inputs and the seed,
never on the order the candidates are listed in.

What peers gossip (`ctx.publish`) and the heuristics read from `PeerInfo.meta`:
  "f1"          per-class F1 of the peer's model on its validation split (H2, H3)
  "model_stats" FedPerl-style (mean, std) per state-dict entry (H3, vector=model_stats)
  "recent"      the peer's n most recent neighbours (H1)

These are claims a peer makes about itself, and a heartbeat is encoded per
recipient, so a hostile peer can tell each node something else. What no honest
node could send is refused, counted through `select(reject=...)` once per
peer, reason and round, and the peer ranked as one without a vector (after the
scored ones): an F1 outside [0, 1] (`gossip_f1_range`; 1e300 made a liar the
most "dissimilar" peer of every node) and model statistics beyond 1e6
(`gossip_stats_range`), and a `recent` that is no list of at most
max(n, 1024) names (`gossip_recent_malformed`; it ranked first, as overlapping
nobody). A vector of another length than mine is left out unread: a heartbeat
may hold millions of numbers, read at every ranking on the event loop before
(a review, 2026-11-28). A vector equal to mine is not refused, F1 or
statistics: honest ones collide (two sites perfect on their validation
splits both send [1.0] * K; two that predict only the majority class of the
same prevalence p both send [2p / (1 + p), 0]; nodes that merged the same
neighbours hold the same merged model). An F1 echo refusal (`gossip_echo`,
added after a review of 2026-12) was dropped after a later review: it ranked
such an honest twin, the most similar peer, last and counted it as lying,
while a liar's copy off by 1e-6 passed it. A peer that lies within the
ranges (a copy of each node's vector, exact or near) still ranks itself
where it likes under f1 and cosine: docs/threat-model.md states it; `random`
reads no claim.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

from p2pfl.config import SelectionSection
from protocols.base import PeerInfo
from protocols.similarity import MAX_FEATURE_ABS, cosine_to_first

Reject = Callable[[str, str], None]  # (peer, reason): RoundContext.reject

log = logging.getLogger(__name__)

Prefer = Literal["dissimilar", "similar"]
F1_KEY = "f1"
MODEL_STATS_KEY = "model_stats"
RECENT_KEY = "recent"


def seeded_rng(seed: int, me: str, round_no: int, step: int = 0) -> random.Random:
    """A generator that depends only on (seed, node, round, step): the same run
    picks the same neighbours on every machine (no dependence on hash seeds)."""
    digest = hashlib.sha256(f"{seed}|{me}|{round_no}|{step}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def neighbour_count(fraction: float, num_others: int) -> int:
    """k = max(1, round(c * (N - 1))): how many neighbours a node averages with
    (the fraction c of the paper's Algorithms 3-10), never more than exist."""
    if num_others <= 0:
        return 0
    return min(num_others, max(1, round(fraction * num_others)))


def recent_neighbours(history: Sequence[Sequence[str]], n: int) -> list[str]:
    """DFU Alg. 5 line 8: client.last = (client.last + neighbors)[-n:]."""
    if n <= 0:
        return []
    flat = [name for chosen in history for name in chosen]
    return flat[-n:]


class Heuristic(ABC):
    """Ranks candidate peers; the first k of the ranking are the neighbours.
    The n most recent neighbours (DFU's client.last) are moved behind the
    others after ranking: H1-H3 take n from site.yaml, H0 has none."""

    name: ClassVar[str]
    n: int = 0

    def keep_out_recent(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"{self.name}: n must be >= 0, got {n}")
        self.n = n

    def select(
        self,
        me: str,
        candidates: Sequence[PeerInfo],
        k: int,
        *,
        round_no: int,
        seed: int,
        my_meta: Mapping[str, Any] | None = None,
        history: Sequence[Sequence[str]] = (),
        step: int = 0,
        reject: Reject | None = None,
    ) -> list[str]:
        """Every candidate's name (never `me`), most preferred first; take [:k]
        for this round and walk on for fallbacks. `history` holds this node's
        chosen neighbours per past round (oldest first). A peer whose gossip is
        refused is passed to `reject` with the reason, once per round (FedSGDP2P
        ranks at every step)."""
        pool = sorted((c for c in candidates if c.name != me), key=lambda c: c.name)
        if not pool:
            return []
        rng = seeded_rng(seed, me, round_no, step)
        self._refused: list[tuple[str, str]] = []  # (peer, reason) of this ranking
        ranking = self.rank(me, pool, rng, dict(my_meta or {}), history, k)
        self._count_refusals(round_no, reject)
        ranking = recent_last(ranking, history, self.n)  # GetNeighbors(.., without=client.last)
        log.debug("%s round %d: %s ranks %s (k=%d)", me, round_no, self.name, ranking, k)
        return ranking

    def refuse(self, peer: str, reason: str) -> None:
        """`peer`'s gossip is not used by this ranking (see the module docstring)."""
        self.__dict__.setdefault("_refused", []).append((peer, reason))

    def _count_refusals(self, round_no: int, reject: Reject | None) -> None:
        """Log and pass on this ranking's refusals, each (peer, reason) once a round."""
        refused, self._refused = self.__dict__.get("_refused", []), []
        counted_round, counted = self.__dict__.get("_counted", (None, set()))
        if counted_round != round_no:
            counted = set()
        self._counted: tuple[int, set[tuple[str, str]]] = (round_no, counted)
        for peer, reason in refused:
            if (peer, reason) in counted:
                continue
            counted.add((peer, reason))
            log.warning("%s: gossip of %s not used for ranking (%s)", self.name, peer, reason)
            if reject is not None:
                reject(peer, reason)

    @abstractmethod
    def rank(
        self,
        me: str,
        pool: list[PeerInfo],
        rng: random.Random,
        my_meta: dict[str, Any],
        history: Sequence[Sequence[str]],
        k: int,
    ) -> list[str]:
        """Order `pool` (sorted by name, never empty) by preference; `k`
        neighbours will be taken, the rest of the ranking are fallbacks."""


def recent_last(ranking: list[str], history: Sequence[Sequence[str]], n: int) -> list[str]:
    """DFU Alg. 5-10, GetNeighbors(c, without=client.last): the n most recent
    neighbours move behind every other candidate (keeping the ranking's order
    among the rest), least recently used first: they are only fallbacks."""
    mine = recent_neighbours(history, n)
    if not mine:
        return ranking
    last_use = {name: i for i, name in enumerate(mine)}
    fresh = [name for name in ranking if name not in last_use]
    stale = sorted((name for name in ranking if name in last_use), key=last_use.__getitem__)
    return fresh + stale


def _shuffled(names: list[str], rng: random.Random) -> list[str]:
    order = list(names)
    rng.shuffle(order)
    return order


RANDOM_FALLBACKS_MIN = 32  # a random ranking is at least this long (or every peer)
RECENT_MAX = 1024  # the longest `recent` read from a peer, or selection.n if more


class RandomSelection(Heuristic):
    """H0 (Alg. 3-4): a uniformly random subset, GetRandomNeighbors(c).

    With more than max(4k, 32) candidates only that many are drawn (a random
    sample is the prefix of a random order): k neighbours and their fallbacks,
    in O(k) rather than a shuffle of every peer, which in a simulation of
    thousands of nodes costs N per node per round. Smaller federations get the
    whole shuffled order, as before."""

    name = "random"

    def rank(self, me, pool, rng, my_meta, history, k):  # type: ignore[no-untyped-def]
        names = [p.name for p in pool]
        wanted = max(4 * k, RANDOM_FALLBACKS_MIN)
        if len(names) > wanted:
            return rng.sample(names, wanted)
        return _shuffled(names, rng)


class NLatestSelection(Heuristic):
    """H1 (Alg. 5-6): never the n most recent neighbours while others exist
    (GetRandomNeighbors(c, without=client.last)); among the rest, least overlap
    first: peers whose own published recent neighbours share the fewest names
    with mine (me included) come first, ties in random order. The recently used
    come last, least recent first, as fallbacks."""

    name = "n_latest"

    def __init__(self, n: int = 1) -> None:
        self.keep_out_recent(n)

    def rank(self, me, pool, rng, my_meta, history, k):  # type: ignore[no-untyped-def]
        circle = set(recent_neighbours(history, self.n)) | {me}
        longest = max(self.n, RECENT_MAX)

        def overlap(peer: PeerInfo) -> int:
            theirs = peer.meta.get(RECENT_KEY)
            if theirs is None:
                return 0  # published nothing yet (its first round)
            # A peer's n most recent neighbours: a list of at most n names. What
            # no honest node sends (a dict, numbers, millions of names read at
            # every FedSGDP2P step) ranked first, as overlapping nobody: refused,
            # counted, and ranked after every peer that overlaps all of my circle.
            if (
                not isinstance(theirs, list)
                or len(theirs) > longest
                or not all(isinstance(x, str) for x in theirs)
            ):
                self.refuse(peer.name, "gossip_recent_malformed")
                return len(circle) + 1
            return len(circle & set(theirs))

        tiebreak = {name: i for i, name in enumerate(_shuffled([p.name for p in pool], rng))}
        return [p.name for p in sorted(pool, key=lambda p: (overlap(p), tiebreak[p.name]))]


def _vector(meta: Mapping[str, Any], key: str) -> list[float] | str | None:
    """A peer's `key` vector; None where it published none; else, where it is
    no vector of finite numbers (NaN, inf, strings, booleans, a dict), the
    reason it is refused (`gossip_<f1|stats>_malformed`)."""
    value = meta.get(key)
    if value is None:
        return None
    malformed = f"gossip_{'f1' if key == F1_KEY else 'stats'}_malformed"
    if not isinstance(value, list | tuple) or not value:
        return malformed
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in value):
        return malformed
    vec = [float(x) for x in value]
    if not all(math.isfinite(x) for x in vec):
        return malformed
    return vec


def _own_vector(meta: Mapping[str, Any], key: str) -> list[float] | None:
    """This node's own `key` vector, or None where it has no usable one yet."""
    vec = _vector(meta, key)
    return vec if isinstance(vec, list) else None


def claim_problem(key: str, vector: list[float]) -> str | None:
    """Why a peer's finite `key` vector is one no honest node sends (None if it
    is not): an F1 outside [0, 1], model statistics beyond MAX_FEATURE_ABS."""
    if key == F1_KEY and any(not 0.0 <= x <= 1.0 for x in vector):
        return "gossip_f1_range"
    if key == MODEL_STATS_KEY and any(abs(x) > MAX_FEATURE_ABS for x in vector):
        return "gossip_stats_range"
    return None


def peer_vectors(
    heuristic: Heuristic, pool: list[PeerInfo], key: str, mine: list[float]
) -> dict[str, list[float]]:
    """The `key` vectors of the peers in `pool` that can be scored against
    `mine`: those of another length are left out as before (not yet
    published, another model); out-of-range claims are refused
    (`heuristic.refuse`). A vector equal to `mine` is scored like any other:
    honest F1 vectors take few values and collide (module docstring)."""
    out: dict[str, list[float]] = {}
    for peer in pool:
        value = peer.meta.get(key)
        if isinstance(value, list | tuple) and value and len(value) != len(mine):
            # Left out unread: a heartbeat may hold millions of numbers, and
            # checking each cost ~0.5 s per million at every ranking (FedSGDP2P
            # ranks at every step), on the event loop.
            continue
        theirs = _vector(peer.meta, key)
        if isinstance(theirs, str):
            heuristic.refuse(peer.name, theirs)
            continue
        if theirs is None or len(theirs) != len(mine):
            continue
        problem = claim_problem(key, theirs)
        if problem is not None:
            heuristic.refuse(peer.name, problem)
            continue
        out[peer.name] = theirs
    return out


def _rank_by_score(
    pool: list[PeerInfo],
    scores: dict[str, float],
    rng: random.Random,
    *,
    highest_first: bool,
) -> list[str]:
    """Scored peers by score (ties in seeded random order), then unscored ones
    in seeded random order."""
    order = _shuffled([p.name for p in pool], rng)
    tiebreak = {name: i for i, name in enumerate(order)}
    sign = -1.0 if highest_first else 1.0
    scored = sorted(scores, key=lambda name: (sign * scores[name], tiebreak[name]))
    unscored = [name for name in order if name not in scores]
    return scored + unscored


class F1Selection(Heuristic):
    """H2 (Alg. 7-8): neighbour dissimilarity score (DFU Eq. 2)
    ndc = sum_i |F_k,i - F_c,i| over per-class F1 vectors; the most dissimilar
    first by default, `prefer="similar"` for the opposite. Peers that have not
    published a vector yet (or one of another length) rank after the others;
    before this node has its own vector the ranking is random. As in the
    algorithm box (GetNeighbors(c, without=client.last, metric=ndc)) the n most
    recent neighbours come last, as fallbacks; n = 0 ranks by score alone."""

    name = "f1"

    def __init__(self, prefer: Prefer = "dissimilar", n: int = 1) -> None:
        if prefer not in ("dissimilar", "similar"):
            raise ValueError(f"f1: prefer must be 'dissimilar' or 'similar', got {prefer!r}")
        self.prefer = prefer
        self.keep_out_recent(n)

    def rank(self, me, pool, rng, my_meta, history, k):  # type: ignore[no-untyped-def]
        mine = _own_vector(my_meta, F1_KEY)
        scores: dict[str, float] = {}
        if mine is not None:
            for name, theirs in peer_vectors(self, pool, F1_KEY, mine).items():
                scores[name] = sum(abs(a - b) for a, b in zip(mine, theirs, strict=True))
        return _rank_by_score(pool, scores, rng, highest_first=self.prefer == "dissimilar")


class CosineSelection(Heuristic):
    """H3 (Alg. 9-10): DFU Eq. 3 scores a neighbour by cos(F_k, F_c) and the
    algorithm box takes the neighbours with the highest score, as for H2. With
    a cosine that means the most *similar* models first, so that is the
    default; `prefer="dissimilar"` takes the lowest cosine first. The n most
    recent neighbours come last (without=client.last), as for H2.

    `vector="f1"` compares per-class F1 vectors; `vector="model_stats"` compares
    model-statistics vectors, min-max normalised per coordinate over me and
    the candidates first (protocols/similarity.py)."""

    name = "cosine"

    def __init__(
        self,
        prefer: Prefer = "similar",
        vector: Literal["f1", "model_stats"] = "f1",
        n: int = 1,
    ) -> None:
        if prefer not in ("dissimilar", "similar"):
            raise ValueError(f"cosine: prefer must be 'dissimilar' or 'similar', got {prefer!r}")
        if vector not in ("f1", "model_stats"):
            raise ValueError(f"cosine: vector must be 'f1' or 'model_stats', got {vector!r}")
        self.prefer = prefer
        self.vector = vector
        self.keep_out_recent(n)

    def rank(self, me, pool, rng, my_meta, history, k):  # type: ignore[no-untyped-def]
        key = F1_KEY if self.vector == "f1" else MODEL_STATS_KEY
        mine = _own_vector(my_meta, key)
        scores: dict[str, float] = {}
        if mine is not None:
            vectors = {me: mine, **peer_vectors(self, pool, key, mine)}
            names = list(vectors)
            cosines = cosine_to_first(
                [vectors[name] for name in names], normalise=self.vector == "model_stats"
            )
            scores = {
                name: score
                for name, score in zip(names[1:], cosines, strict=True)
                if score is not None
            }
        return _rank_by_score(pool, scores, rng, highest_first=self.prefer == "similar")


REGISTRY: dict[str, type[Heuristic]] = {
    RandomSelection.name: RandomSelection,
    NLatestSelection.name: NLatestSelection,
    F1Selection.name: F1Selection,
    CosineSelection.name: CosineSelection,
}


def create(name: str, **params: Any) -> Heuristic:
    """selection.create("f1", prefer="similar") -> a Heuristic."""
    if name not in REGISTRY:
        raise KeyError(
            f"unknown selection heuristic {name!r}; known: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[name](**params)


def from_config(section: SelectionSection) -> Heuristic:
    """The heuristic site.yaml's `selection:` names. `prefer: null` (the default)
    keeps each heuristic's paper default (H2 dissimilar, H3 similar)."""
    params: dict[str, Any] = {}
    if section.name in ("n_latest", "f1", "cosine"):
        params["n"] = section.n
    if section.name in ("f1", "cosine") and section.prefer is not None:
        params["prefer"] = section.prefer
    if section.name == "cosine":
        params["vector"] = section.vector
    return create(section.name, **params)
