"""How alike two nodes are, from the vectors they gossip: the one min-max
normalisation and cosine that FedPerl's communities and the cosine heuristic share.

Raw (mean, std) vectors of models that share an architecture all point the
same way, so their cosines would all be close to 1: each column (feature) is
first min-max normalised across the nodes, as FedPerl's public reference code
does (a constant column becomes 1), then compared by cosine,
omega_mk = F_m . F_k / (|F_m| |F_k|) (FedPerl journal Sec. 2.3.1; DFU Eq. 3).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


def normalise_columns(vectors: NDArray[np.float64]) -> NDArray[np.float64]:
    """Min-max normalise each column (feature) across the rows (nodes); a
    constant column becomes all ones (the reference code's convention)."""
    matrix = np.asarray(vectors, dtype=np.float64)
    if matrix.ndim != 2:
        raise ValueError(f"expected a nodes x features matrix, got shape {matrix.shape}")
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
    over all the vectors first when `normalise`); None where either vector is zero."""
    matrix = np.asarray(vectors, dtype=np.float64)
    if normalise and len(vectors) > 1:
        matrix = normalise_columns(matrix)
    norms = np.linalg.norm(matrix, axis=1)
    sims = cosine_matrix(matrix)
    return [
        float(sims[0, j]) if norms[0] > 0 and norms[j] > 0 else None for j in range(1, len(vectors))
    ]
