"""Weighted and robust aggregation of state dicts."""

from __future__ import annotations

import pytest
import torch

from protocols.aggregate import (
    AggregationError,
    aggregate,
    aggregate_gradients,
    coordinate_median,
    norm_clip,
    trimmed_mean,
    update_norm,
    weighted_mean,
)


def state(w: list[float], b: float, tracked: int) -> dict[str, torch.Tensor]:
    return {
        "layer.weight": torch.tensor(w, dtype=torch.float32),
        "layer.bias": torch.tensor([b], dtype=torch.float32),
        "bn.num_batches_tracked": torch.tensor(tracked, dtype=torch.int64),
    }


def test_weighted_mean_weights_by_sample_count_and_keeps_own_integer_buffers() -> None:
    mine = state([1.0, 2.0], 0.0, tracked=5)
    theirs = state([3.0, 6.0], 4.0, tracked=99)
    out = weighted_mean([mine, theirs], [100, 300], own=0)
    # (100 * 1 + 300 * 3) / 400 = 2.5 ; (100 * 2 + 300 * 6) / 400 = 5 ; bias 3
    assert torch.allclose(out["layer.weight"], torch.tensor([2.5, 5.0]))
    assert torch.allclose(out["layer.bias"], torch.tensor([3.0]))
    assert out["bn.num_batches_tracked"].item() == 5  # ours, not averaged
    assert out["layer.weight"].dtype == torch.float32
    assert weighted_mean([mine, theirs], [100, 300], own=1)["bn.num_batches_tracked"].item() == 99


def test_weighted_mean_keeps_half_precision_dtype() -> None:
    a = {"w": torch.tensor([1.0, 3.0], dtype=torch.float16)}
    b = {"w": torch.tensor([3.0, 5.0], dtype=torch.float16)}
    out = weighted_mean([a, b], [1, 1])
    assert out["w"].dtype == torch.float16
    assert out["w"].tolist() == [2.0, 4.0]


def test_median_and_trimmed_mean_by_hand() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 1000.0]
    states = [{"w": torch.tensor([v, -v])} for v in values]
    assert coordinate_median(states)["w"].tolist() == [3.0, -3.0]
    assert coordinate_median(states[:4])["w"].tolist() == [
        2.5,
        -2.5,
    ]  # even count: mean of the middle two
    # trim 0.2 of 5 = 1 value cut at each end: mean(2, 3, 4) = 3
    assert trimmed_mean(states, 0.2)["w"].tolist() == [3.0, -3.0]
    # too few states to cut anything: the plain mean
    assert trimmed_mean(states[:3], 0.2)["w"].tolist() == [2.0, -2.0]


def test_norm_clip_by_hand() -> None:
    mine = {"w": torch.tensor([0.0, 0.0])}
    theirs = {"w": torch.tensor([3.0, 4.0])}  # update of norm 5, clipped to 1 -> (0.6, 0.8)
    out = norm_clip([mine, theirs], [1, 1], clip_norm=1.0)
    assert torch.allclose(out["w"], torch.tensor([0.3, 0.4]))
    assert update_norm(theirs, mine) == pytest.approx(5.0)
    # within the bound an update passes unchanged: the plain weighted mean
    assert torch.allclose(
        norm_clip([mine, theirs], [1, 1], clip_norm=10.0)["w"], torch.tensor([1.5, 2.0])
    )


def test_robust_aggregators_resist_one_huge_outlier() -> None:
    gen = torch.Generator().manual_seed(0)
    honest = [{"w": torch.ones(50) + 0.01 * torch.randn(50, generator=gen)} for _ in range(4)]
    attacker = {"w": torch.full((50,), 1e6)}
    states = [*honest, attacker]
    weights = [100.0] * 5
    target = torch.ones(50)

    def error(method: str, **kw: float) -> float:
        out = aggregate(method, states, weights, own=0, **kw)  # type: ignore[arg-type]
        return float((out["w"] - target).abs().max())

    assert error("mean") > 1e5  # the plain mean is dragged away
    assert error("median") < 0.05
    assert error("trimmed_mean", trim_ratio=0.2) < 0.05
    # adaptive clip bound (median update norm): the attacker moves us by about one honest update
    assert error("norm_clip") < 0.2
    assert error("norm_clip", clip_norm=0.5) < 0.2


def test_mismatched_states_are_refused_with_a_reason() -> None:
    a = {"w": torch.zeros(2)}
    with pytest.raises(AggregationError) as missing:
        weighted_mean([a, {"v": torch.zeros(2)}], [1, 1])
    assert missing.value.reason == "key_mismatch"
    with pytest.raises(AggregationError) as shape:
        coordinate_median([a, {"w": torch.zeros(3)}])
    assert shape.value.reason == "shape_mismatch"
    with pytest.raises(AggregationError) as weights:
        weighted_mean([a, a], [0, 0])
    assert weights.value.reason == "bad_weights"
    with pytest.raises(AggregationError) as method:
        aggregate("max", [a], [1])  # type: ignore[arg-type]
    assert method.value.reason == "unknown_method"


def test_norm_clip_on_gradients_clips_each_neighbours_gradient_itself() -> None:
    """A gradient is the update: norm_clip measures it from zero, not from our
    own gradient, and never clips ours."""
    mine = {"g": torch.tensor([3.0, 4.0])}  # norm 5
    small = {"g": torch.tensor([0.0, 1.0])}  # norm 1
    huge = {"g": torch.tensor([0.0, -100.0])}  # norm 100
    out = aggregate_gradients("norm_clip", [mine, small, huge], [1, 1, 1], clip_norm=2.0)
    # (3, 4) unclipped + (0, 1) + (0, -100) scaled to norm 2 = (0, -2); / 3
    assert torch.allclose(out["g"], torch.tensor([1.0, 1.0]))
    # adaptive bound: the lower median of every gradient's norm, ours included
    # (1, 5, 100 -> 5): the huge one is cut to the typical size
    out = aggregate_gradients("norm_clip", [mine, small, huge], [1, 1, 1])
    assert torch.allclose(out["g"], torch.tensor([1.0, (4.0 + 1.0 - 5.0) / 3]))
    # with one neighbour, the smaller of the two norms
    out = aggregate_gradients("norm_clip", [mine, huge], [1, 1])
    assert torch.allclose(out["g"], torch.tensor([1.5, (4.0 - 5.0) / 2]))
    # measured from our own gradient instead, the small one would be "far" too:
    # the model-state norm_clip is a different rule
    as_models = aggregate("norm_clip", [mine, small, huge], [1, 1, 1], clip_norm=2.0)
    assert not torch.allclose(as_models["g"], out["g"])
    # the other methods are the same over gradients as over states
    for method in ("mean", "median", "trimmed_mean"):
        grads = aggregate_gradients(method, [mine, small, huge], [1, 2, 3])  # type: ignore[arg-type]
        states = aggregate(method, [mine, small, huge], [1, 2, 3])  # type: ignore[arg-type]
        assert torch.equal(grads["g"], states["g"]), method
