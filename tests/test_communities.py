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
