"""Communities: feature vectors, normalised cosine similarity, top-T, policies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from p2pfl.learning.state import DESCRIBED_ALONE, feature_vector
from protocols.communities import (
    PolicyInputs,
    apply_policy,
    choice_frequencies,
    similarity_matrix,
    top_t,
)
from protocols.similarity import cosine_matrix, normalise_columns


def test_feature_vector_of_a_known_model() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.BatchNorm1d(8))
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(64, dtype=torch.float32).reshape(8, 8))
        model[0].bias.copy_(torch.full((8,), -1.0))
        model[1].weight.copy_(torch.ones(8, 8))
        model[1].bias.copy_(torch.zeros(8))
        model[2].running_mean.copy_(torch.full((8,), 2.0))
    model[2].num_batches_tracked.fill_(7)
    vector = feature_vector(model.state_dict())
    # 0.weight and 1.weight (64 values each) alone; the 6 smaller entries pooled
    # (48 values), and a pool under DESCRIBED_ALONE joins the last weight described
    small = torch.cat(
        [
            torch.full((8,), -1.0),
            torch.zeros(8),
            torch.ones(8),
            torch.zeros(8),
            torch.full((8,), 2.0),
            torch.ones(8),
        ]
    )
    last = torch.cat([torch.ones(64), small]).double()
    expected = [
        31.5,
        float(torch.arange(64.0).double().std()),
        float(last.mean()),
        float(last.std()),
    ]
    assert vector == pytest.approx(expected)  # num_batches_tracked left out


def test_small_entries_are_never_described_one_by_one() -> None:
    """A review recovered a 2-value classifier bias, exactly, from its (mean,
    std) in the gossip: entries under DESCRIBED_ALONE values are pooled, and a
    pool that small is described with a larger entry, never on its own."""
    big = torch.randn(DESCRIBED_ALONE)
    more = torch.randn(DESCRIBED_ALONE)
    smalls = {f"b{i}": torch.randn(20) for i in range(4)}  # 80 values: a pool of its own
    vector = feature_vector({"w": big, "v": more, **smalls})
    pool = torch.cat(list(smalls.values())).double()
    assert len(vector) == 6
    assert vector[4:] == pytest.approx([float(pool.mean()), float(pool.std())])
    tiny = feature_vector(
        {"w": big, "bias": torch.tensor([0.8123, -0.4410]), "s": torch.tensor([3.0])}
    )
    assert len(tiny) == 2 and 0.8123 not in tiny and -0.4410 not in tiny


def test_a_single_element_entry_has_zero_std() -> None:
    assert feature_vector({"scale": torch.tensor([3.0])}) == [3.0, 0.0]


def test_columns_are_min_max_normalised_and_a_constant_column_becomes_one() -> None:
    matrix = np.array([[1.0, 5.0, 2.0], [3.0, 5.0, 4.0], [2.0, 5.0, 3.0]])
    assert normalise_columns(matrix).tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.5, 1.0, 0.5]]


def test_similarity_is_cosine_after_normalisation() -> None:
    vectors = {"a": [0.0, 10.0], "b": [1.0, 10.0], "c": [1.0, 20.0], "d": [0.5, 15.0]}
    # normalised: a=(0,0) b=(1,0) c=(1,1) d=(0.5,0.5)
    sim = similarity_matrix(vectors)
    assert sim.names == ["a", "b", "c", "d"]
    assert sim.row("b") == pytest.approx({"a": 0.0, "c": 1 / math.sqrt(2), "d": 1 / math.sqrt(2)})
    assert sim.row("c")["d"] == pytest.approx(1.0)
    assert sim.row("a") == {"b": 0.0, "c": 0.0, "d": 0.0}  # the all-minimum node: no direction
    raw = similarity_matrix(vectors, normalise=False)
    assert raw.row("b")["c"] > 0.99  # without normalisation the large column dominates


def test_vectors_of_another_length_or_not_finite_are_left_out() -> None:
    sim = similarity_matrix(
        {"a": [1.0, 2.0], "b": [2.0, 1.0], "c": [1.0, 2.0], "x": [1.0], "y": [1.0, math.nan]}
    )
    assert sim.names == ["a", "b", "c"]


def test_cosine_of_opposite_vectors_is_negative() -> None:
    sim = cosine_matrix(np.array([[1.0, 0.0], [-1.0, 0.0]]))
    assert sim[0, 1] == pytest.approx(-1.0)


def test_top_t_excludes_self_negatives_and_breaks_ties_by_name() -> None:
    similarities = {"me": 1.0, "d": 0.9, "b": 0.9, "c": 0.5, "a": -0.2, "e": math.nan}
    assert top_t(similarities, 2, exclude="me") == ["b", "d"]
    assert top_t(similarities, 3, exclude="me") == ["b", "d", "c"]
    assert top_t(similarities, 10, exclude="me") == ["b", "d", "c"]  # never a negative or NaN
    assert top_t(similarities, 0, exclude="me") == []
    assert top_t({"x": 0.0, "w": 0.0}, 1) == ["w"]  # zero similarity is allowed, ties by name


def test_static_policy_keeps_the_top_t() -> None:
    assert apply_policy("static", ["b", "c"], PolicyInputs(), rho=0.85) == ["b", "c"]


def test_validation_policy_keeps_peers_at_least_as_accurate_as_me() -> None:
    inputs = PolicyInputs(my_val_accuracy=0.8, peer_val_accuracy={"b": 0.8, "c": 0.79, "d": 0.9})
    assert apply_policy("validation", ["b", "c", "d", "e"], inputs, rho=0.0) == ["b", "d"]
    assert apply_policy("validation", ["b"], PolicyInputs(peer_val_accuracy={"b": 1.0}), 0.0) == []


def test_gated_validation_policy_keeps_peers_at_or_above_rho() -> None:
    inputs = PolicyInputs(my_val_accuracy=0.99, peer_val_accuracy={"b": 0.85, "c": 0.84})
    assert apply_policy("gated_validation", ["b", "c", "d"], inputs, rho=0.85) == ["b"]


def test_gated_similarity_policy_keeps_peers_at_or_above_rho() -> None:
    inputs = PolicyInputs(similarities={"b": 0.95, "c": 0.85, "d": 0.849})
    assert apply_policy("gated_similarity", ["b", "c", "d"], inputs, rho=0.85) == ["b", "c"]


def test_unknown_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        apply_policy("vote", ["b"], PolicyInputs(), rho=0.5)


def test_choice_frequencies_count_shares_of_rounds() -> None:
    choices = [
        {"node": "a", "round": 1, "chosen": ["b", "c"]},
        {"node": "a", "round": 2, "chosen": ["b"]},
        {"node": "b", "round": 1, "chosen": []},
    ]
    freq = choice_frequencies(choices, ["a", "b", "c"])
    assert freq.tolist() == [[0.0, 1.0, 0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_a_small_pool_joins_the_last_entry_described() -> None:
    """resnet18's only small entry is its 2-value fc.bias: pooled alone, the
    pool was the bias again (a second review). It joins fc.weight instead."""
    weight = torch.randn(2, DESCRIBED_ALONE)
    bias = torch.tensor([0.8123, -0.4410])
    vector = feature_vector({"fc.weight": weight, "fc.bias": bias})
    both = torch.cat([weight.flatten(), bias]).double()
    assert vector == pytest.approx([float(both.mean()), float(both.std())])


# ---------------------------------------------------------------------- hostile vectors
# Feature vectors are what peers claim about themselves (reviews of 2026-12:
# a finite 1e308 overflowed min-max into NaN rows; one far-out vector squashed
# every honest similarity to 0 and switched communities off).


def honest_vectors(n: int = 6) -> dict[str, list[float]]:
    """Feature vectors of n small_cnn models trained apart (perturbed copies)."""
    from p2pfl.learning.models import create_model

    torch.manual_seed(0)
    out = {}
    for i in range(n):
        model = create_model("small_cnn", num_classes=2, in_chans=1, image_size=28)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05 * (i + 1))
        out[f"site{i}"] = feature_vector(model.state_dict())
    return out


def plain_min_max_rows(vectors: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """The similarities as computed before the fix (min-max, no clipping)."""
    names = sorted(vectors)
    matrix = np.array([vectors[n] for n in names])
    low, span = matrix.min(0), matrix.max(0) - matrix.min(0)
    norm = np.ones_like(matrix)
    norm[:, span > 0] = (matrix[:, span > 0] - low[span > 0]) / span[span > 0]
    sim = cosine_matrix(norm)
    return {a: {b: sim[i, j] for j, b in enumerate(names) if b != a} for i, a in enumerate(names)}


def test_honest_similarities_are_those_of_plain_min_max() -> None:
    vectors = honest_vectors()
    before = plain_min_max_rows(vectors)
    matrix = similarity_matrix(vectors)
    for name in vectors:
        assert matrix.row(name) == pytest.approx(before[name], abs=1e-12)


def test_huge_finite_vectors_are_left_out_instead_of_turning_rows_nan() -> None:
    vectors = honest_vectors()
    width = len(vectors["site0"])
    attacked = dict(vectors)
    attacked["zed"] = [1.7e308 if j % 2 else -1.7e308 for j in range(width)]
    attacked["zed2"] = [-x for x in attacked["zed"]]
    attacked["one"] = [1e308] * width
    matrix = similarity_matrix(attacked)
    assert set(matrix.names) == set(vectors)  # all three left out
    assert np.isfinite(matrix.values).all()
    assert matrix.row("site0") == pytest.approx(similarity_matrix(vectors).row("site0"))


def test_a_far_vector_within_the_bound_can_no_longer_squash_the_others_to_zero() -> None:
    vectors = honest_vectors()
    width = len(vectors["site0"])
    for far in ([1e6] * width, [-1e6] * width, [1e6 if j % 2 else -1e6 for j in range(width)]):
        row = similarity_matrix({**vectors, "zed": far}).row("site0")
        assert all(math.isfinite(v) for v in row.values())
        honest = [row[n] for n in vectors if n != "site0"]
        assert min(honest) > 0.1  # before: all 0.0 for a 1e308; 0.03 for a 1e6
        top = top_t(row, 2, exclude="site0")
        assert top[0] == "site1" and "zed" not in top  # before: ["site1", "zed"] for +1e6
        # The stated limit: within the bound it still moves the others'
        # similarities (flattened toward 1, or the farthest honest peer down).


def test_clipping_bounds_a_column_at_its_median_plus_minus_fifty_mads() -> None:
    column = np.array([[1.0], [2.0], [3.0], [4.0], [1e6]])
    clipped = normalise_columns(column)[:, 0]
    # median 3, MAD 1 -> the far value is pulled in to 3 + 50 x 1.4826
    assert clipped[-1] == 1.0
    assert clipped[:4] == pytest.approx((np.array([1, 2, 3, 4]) - 1) / (3 + 50 * 1.4826 - 1))
    # a column where most nodes agree exactly (MAD 0) is left as it is
    assert normalise_columns(np.array([[5.0], [5.0], [5.0], [6.0]]))[:, 0].tolist() == [
        0.0,
        0.0,
        0.0,
        1.0,
    ]


def test_a_non_finite_similarity_is_left_out_of_a_row() -> None:
    from protocols.communities import SimilarityMatrix

    matrix = SimilarityMatrix(["a", "b", "c"], np.array([[1, np.nan, 0.5], [0, 1, 0], [0, 0, 1.0]]))
    assert matrix.row("a") == {"c": 0.5}


def test_nodes_holding_the_same_merged_model_do_not_get_honest_values_clipped() -> None:
    """FedAVGP2P nodes that merged the same neighbours gossip equal statistics;
    counted once each, they shrank the MAD and clipped an honest value (a
    cosine-heuristic run ranked differently). Values from that run."""
    column = np.array([[0.19292283], [0.19303375], [0.19303375], [0.19308785], [0.19303599]])
    from protocols.similarity import clip_columns

    assert np.array_equal(clip_columns(column), column)
