"""How alike two nodes are, from the vectors they gossip: the one min-max
normalisation and cosine that FedPerl's communities and the cosine heuristic share.

Raw (mean, std) vectors of models that share an architecture all point the
same way, so their cosines would all be close to 1: each column (feature) is
first min-max normalised across the nodes, as FedPerl's public reference code
does (a constant column becomes 1), then compared by cosine,
omega_mk = F_m . F_k / (|F_m| |F_k|) (FedPerl journal Sec. 2.3.1; DFU Eq. 3).

The vectors are what peers claim about themselves, so no single row may set
a column's scale: a finite 1e308 overflowed the span (NaN rows, and a FedPerl
node whose /status could not be written stopped training), and one vector far
out squashed every honest value of its column to about 0 (communities off for
everyone). Two guards, both attacked in tests/test_communities.py:

- a vector with an entry beyond MAX_FEATURE_ABS (means and stds of model
  weights are never near it) is refused where it is read (`vector_problem`);
- before min-max, each column is clipped to its median +- CLIP_MADS scaled
  median absolute deviations of its distinct values (`clip_columns`): a row
  far out is pulled in to that bound. The bound is wide, so honest vectors
  keep today's similarities: on six to ten perturbed small_cnn models nothing
  was clipped, and a site six times farther from the rest than they are from
  each other is pulled in a little (similarities move by under 0.01). In
  in-memory FedPerl runs (4 and 6 digit sites, 5 rounds) similarities moved
  by at most 0.005 and no top-2 changed; on FedAVGP2P's merged models (the
  cosine heuristic, 5 to 8 sites) no ranking changed (at 20 MADs one of 184
  did). A column where more than
  half the distinct values agree (MAD 0) is not clipped.

What is left (docs/threat-model.md): the clip stops NaN and zeroed
similarities, not steering. A row inside the bound still stretches each
column's span, and with a handful of sites that is enough for one peer to
choose which honest peers enter a node's top-T: in a review's random search
(6 honest sites, 16 columns; a vector sent to each victim apart, every
column within 45 scaled MADs of its median) one colluder made a chosen
honest peer a victim's most similar honest peer in 16 of 24 (victim, target)
pairs, two colluders in 22 of 24. Not near ties: each victim's honest
similarities spread 0.12 to 0.43. At a 3-MAD clip it was still 11 and 14 of
24: min-max with a hostile row is steerable even at a tight clip. A
normalisation one row cannot move much (ranks, median/MAD z-scores) would
depart from FedPerl's reference code and is not done.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

MAX_FEATURE_ABS = 1e6  # a gossiped mean or std beyond this is refused
CLIP_MADS = 50.0  # columns clipped to median +- this many scaled MADs before min-max
_MAD_TO_SIGMA = 1.4826  # MAD x this estimates a normal column's standard deviation
ECHO_REL_TOL = 1e-9  # a peer vector this close to mine, entry by entry, is an echo
ECHO_ABS_TOL = 1e-12


def vector_problem(vector: list[float]) -> str | None:
    """Why a peer's gossiped vector cannot be compared (None if it can): a
    non-finite entry, or one beyond MAX_FEATURE_ABS."""
    if not all(math.isfinite(x) for x in vector):
        return "non_finite"
    if any(abs(x) > MAX_FEATURE_ABS for x in vector):
        return "out_of_range"
    return None


def is_echo(theirs: list[float], mine: list[float]) -> bool:
    """Whether a peer's vector equals this node's own within float tolerance:
    a peer that sends each node its own vector back (heartbeats are encoded
    per recipient) would be every node's most similar peer. Only for vectors
    of models trained apart (FedPerl's feature vectors), which honest sites
    never share to 1e-9; not for per-class F1 or merged-model statistics,
    which honest sites do share (protocols/selection.py)."""
    return (
        bool(mine)
        and len(theirs) == len(mine)
        and all(
            math.isclose(a, b, rel_tol=ECHO_REL_TOL, abs_tol=ECHO_ABS_TOL)
            for a, b in zip(theirs, mine, strict=True)
        )
    )


def clip_columns(matrix: NDArray[np.float64]) -> NDArray[np.float64]:
    """Each column clipped to median +- CLIP_MADS x 1.4826 x MAD, both taken
    over the column's distinct values: one row (or a minority) can no longer
    set the column's span. Distinct, because nodes that merged the same
    neighbours hold the same model: their equal statistics would otherwise
    shrink the MAD and clip honest values (seen on FedAVGP2P's merged models
    under the cosine heuristic)."""
    out = matrix.copy()
    for j in range(matrix.shape[1]):
        values = np.unique(matrix[:, j])
        median = float(np.median(values))
        scale = _MAD_TO_SIGMA * float(np.median(np.abs(values - median)))
        if scale > 0:
            out[:, j] = np.clip(
                matrix[:, j], median - CLIP_MADS * scale, median + CLIP_MADS * scale
            )
    return out


def normalise_columns(vectors: NDArray[np.float64]) -> NDArray[np.float64]:
    """Min-max normalise each column (feature) across the rows (nodes), after
    clipping its outliers (`clip_columns`); a constant column becomes all ones
    (the reference code's convention). Rows must be finite."""
    matrix = np.asarray(vectors, dtype=np.float64)
    if matrix.ndim != 2:
        raise ValueError(f"expected a nodes x features matrix, got shape {matrix.shape}")
    if matrix.size:
        matrix = clip_columns(matrix)
    low = matrix.min(axis=0)
    span = matrix.max(axis=0) - low
    out = np.ones_like(matrix)
    varying = span > 0
    out[:, varying] = (matrix[:, varying] - low[varying]) / span[varying]
    return out


def cosine_matrix(matrix: NDArray[np.float64]) -> NDArray[np.float64]:
    """Pairwise cosine similarity of the rows; 0 where a row is all zeros."""
    norms = np.linalg.norm(matrix, axis=1)
    safe = np.where(norms > 0, norms, 1.0)
    unit = matrix / safe[:, None]
    sim = unit @ unit.T
    sim[norms == 0, :] = 0.0
    sim[:, norms == 0] = 0.0
    return sim


def cosine_to_first(vectors: list[list[float]], *, normalise: bool) -> list[float | None]:
    """cos(vectors[0], vectors[j]) for every j >= 1 (columns min-max normalised
    over all the vectors first when `normalise`); None where either vector is
    zero or the cosine is not a finite number."""
    matrix = np.asarray(vectors, dtype=np.float64)
    if normalise and len(vectors) > 1:
        matrix = normalise_columns(matrix)
    norms = np.linalg.norm(matrix, axis=1)
    sims = cosine_matrix(matrix)
    out: list[float | None] = []
    for j in range(1, len(vectors)):
        value = float(sims[0, j])
        usable = norms[0] > 0 and norms[j] > 0 and math.isfinite(value)
        out.append(value if usable else None)
    return out
