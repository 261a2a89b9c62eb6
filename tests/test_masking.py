"""Pairwise additive masking: the requester gets the average, never a single model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pfl.config import ModelSection
from p2pfl.learning.site_model import create_site_model
from protocols import masking
from protocols.masking import MaskingError, masked_contribution, unmask_mean
from protocols.memory import InMemoryContext, InMemoryNetwork

CONTRIBUTORS = ["alice", "bob", "carol"]
REQUESTER = "dave"


def small_cnn_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = create_site_model(ModelSection(), in_chans=1, num_classes=3, image_size=8)
    for module in model.modules():  # give BatchNorm buffers non-trivial values
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
            module.num_batches_tracked.fill_(seed + 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def federation() -> dict[str, InMemoryContext]:
    network = InMemoryNetwork()
    return {name: network.join(name) for name in [*CONTRIBUTORS, REQUESTER]}


def contributions(
    ctxs: dict[str, InMemoryContext],
    states: dict[str, dict[str, torch.Tensor]],
    request_id: str = "0" * 32,
    weights: dict[str, float] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    context = masking.request_context(REQUESTER, request_id, 1)
    members = sorted(states)
    out = {}
    for me in members:
        secrets = {p: ctxs[me].pair_secret(p, context) for p in members if p != me}
        out[me] = masked_contribution(
            states[me],
            me=me,
            contributors=members,
            secrets=secrets,
            weight=(weights or {}).get(me, 1.0),
        )
    return out


def test_pair_secrets_come_from_real_key_agreement_and_are_bound_to_the_context() -> None:
    ctxs = federation()
    first = ctxs["alice"].pair_secret("bob", b"request-1")
    assert len(first) == 32
    assert ctxs["bob"].pair_secret("alice", b"request-1") == first  # both ends agree
    assert ctxs["alice"].pair_secret("bob", b"request-2") != first  # a fresh request: fresh masks
    assert ctxs["alice"].pair_secret("carol", b"request-1") != first  # another pair
    # a third node cannot derive alice-bob's secret from its own keys
    assert ctxs["carol"].pair_secret("bob", b"request-1") != first
    with pytest.raises(MaskingError):
        masking.pair_secret_from_shared(b"x" * 32, "alice", "alice", b"c")


def test_masked_contributions_sum_to_the_plain_average() -> None:
    ctxs = federation()
    states = {name: small_cnn_state(i) for i, name in enumerate(CONTRIBUTORS)}
    masked = contributions(ctxs, states)
    reference = small_cnn_state(99)  # the requester's own model (shapes, counters)
    mean, total_weight = unmask_mean(list(masked.values()), reference)
    assert total_weight == pytest.approx(3.0)
    for key, ref in reference.items():
        if ref.is_floating_point():
            plain = torch.stack([states[n][key].double() for n in CONTRIBUTORS]).mean(0)
            assert torch.allclose(mean[key].double(), plain, atol=2.0**-20), key
            assert mean[key].dtype == ref.dtype
        else:  # counters are never sent: the requester keeps its own
            assert torch.equal(mean[key], ref)
            assert key not in masked["alice"]


def test_no_single_masked_contribution_is_close_to_its_model() -> None:
    ctxs = federation()
    states = {name: small_cnn_state(i) for i, name in enumerate(CONTRIBUTORS)}
    masked = contributions(ctxs, states)
    for name in CONTRIBUTORS:
        for key, value in masked[name].items():
            if key == masking.WEIGHT_KEY or value.numel() < 16:
                continue
            assert value.dtype == torch.int64
            decoded = torch.from_numpy(
                masking.from_fixed(value.numpy().reshape(-1).view(np.uint64))
            )
            model = states[name][key].double().reshape(-1)
            # what a requester could read off one contribution is noise of magnitude ~2^43
            assert float((decoded - model).abs().median()) > 1e9
            # Chance correlation has sd ~ 1/sqrt(n): only test where 0.5 is far out (n >= 256: 8 sd).
            if float(model.std()) > 0 and model.numel() >= 256:
                corr = np.corrcoef(decoded.numpy(), model.numpy())[0, 1]
                assert abs(corr) < 0.5, (name, key, corr)
    # two of the three contributions do not cancel either
    partial = masking.sum_contributions([masked["alice"], masked["bob"]], states["alice"])
    decoded = masking.from_fixed(partial["classifier.weight"])
    plain = (states["alice"]["classifier.weight"] + states["bob"]["classifier.weight"]).reshape(-1)
    assert np.median(np.abs(decoded - plain.double().numpy())) > 1e9


def test_masks_cancel_bit_exactly() -> None:
    ctxs = federation()
    zeros = {"w": torch.zeros(1000), "b": torch.zeros(3, 7)}
    masked = contributions(ctxs, dict.fromkeys(CONTRIBUTORS, zeros))
    assert all(bool((m["w"] != 0).any()) for m in masked.values())  # each one is masked
    totals = masking.sum_contributions(list(masked.values()), zeros)
    assert not totals["w"].any() and not totals["b"].any()  # exactly zero, no rounding
    assert masking.from_fixed(totals[masking.WEIGHT_KEY])[0] == 3.0


def test_weighted_contributions_give_the_weighted_mean_and_only_the_total_weight() -> None:
    ctxs = federation()
    states = {"alice": {"w": torch.full((4,), 1.0)}, "bob": {"w": torch.full((4,), 5.0)}}
    masked = contributions(ctxs, states, weights={"alice": 3.0, "bob": 1.0})
    mean, total = unmask_mean(list(masked.values()), {"w": torch.zeros(4)})
    assert total == pytest.approx(4.0)
    assert torch.allclose(mean["w"], torch.full((4,), 2.0), atol=1e-6)  # (3*1 + 1*5) / 4


def test_unmaskable_values_are_refused_never_sent_in_clear() -> None:
    secrets = {"bob": b"k" * 32}
    for bad in (torch.tensor([float("inf")]), torch.tensor([float("nan")]), torch.tensor([1e12])):
        with pytest.raises(MaskingError) as err:
            masked_contribution(
                {"w": bad}, me="alice", contributors=["alice", "bob"], secrets=secrets
            )
        assert err.value.reason == "out_of_range"
    with pytest.raises(MaskingError) as err:
        masked_contribution(
            {"w": torch.zeros(2)}, me="alice", contributors=["alice"], secrets=secrets
        )
    assert err.value.reason == "bad_contributors"
    with pytest.raises(MaskingError) as err:
        masked_contribution(
            {"w": torch.zeros(2)}, me="alice", contributors=["alice", "carol"], secrets=secrets
        )
    assert err.value.reason == "missing_secret"


def test_mismatched_or_too_few_contributions_are_rejected() -> None:
    ctxs = federation()
    states = {"alice": {"w": torch.ones(4)}, "bob": {"w": torch.ones(4)}}
    masked = contributions(ctxs, states)
    with pytest.raises(MaskingError) as err:
        unmask_mean([masked["alice"]], {"w": torch.zeros(4)})
    assert err.value.reason == "too_few"
    with pytest.raises(MaskingError) as err:
        unmask_mean(list(masked.values()), {"w": torch.zeros(5)})
    assert err.value.reason == "shape_mismatch"
    with pytest.raises(MaskingError) as err:
        unmask_mean(list(masked.values()), {"v": torch.zeros(4)})
    assert err.value.reason == "key_mismatch"


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=5, max_size=5),
        min_size=2,
        max_size=5,
    ),
    secret_seed=st.binary(min_size=32, max_size=32),
)
def test_any_values_in_range_average_exactly_up_to_the_fixed_point_step(
    values: list[list[float]], secret_seed: bytes
) -> None:
    names = [f"n{i}" for i in range(len(values))]

    def secret(a: str, b: str) -> bytes:
        return masking.pair_secret_from_shared(secret_seed, a, b, b"ctx")

    masked = [
        masked_contribution(
            {"w": torch.tensor(v, dtype=torch.float64)},
            me=me,
            contributors=names,
            secrets={p: secret(me, p) for p in names if p != me},
        )
        for me, v in zip(names, values, strict=True)
    ]
    mean, _ = unmask_mean(masked, {"w": torch.zeros(5, dtype=torch.float64)})
    expected = np.mean(np.array(values), axis=0)
    assert np.allclose(mean["w"].numpy(), expected, rtol=0, atol=2.0**-20)
