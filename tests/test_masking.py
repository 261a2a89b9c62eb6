"""The masking arithmetic secure aggregation builds on: pair secrets, fixed point, keystreams."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2pfl.config import ModelSection
from p2pfl.learning.site_model import create_site_model
from protocols import masking
from protocols.masking import MaskingError
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


def test_fixed_point_refuses_what_it_cannot_carry_and_round_trips_the_rest() -> None:
    for bad in (torch.tensor([float("inf")]), torch.tensor([float("nan")]), torch.tensor([1e12])):
        with pytest.raises(MaskingError) as err:
            masking.to_fixed(bad)
        assert err.value.reason == "out_of_range"
    values = torch.tensor([-3.5, 0.0, 1e-3, 1234.567], dtype=torch.float64)
    fixed = masking.to_fixed(values)
    assert fixed.dtype == np.uint32  # the 32-bit ring
    back = masking.from_fixed(fixed)
    assert np.allclose(back, values.numpy(), rtol=0, atol=2.0**-21)
    # the largest value one of n contributors may mask, and one step past it
    limit = masking.entry_limit(5)
    assert limit == (2**31 - 1) // 5
    edge = torch.tensor([limit / 2.0**masking.FIXED_POINT_BITS], dtype=torch.float64)
    assert masking.from_fixed(masking.to_fixed(edge, limit=limit))[0] == edge[0]
    assert masking.from_fixed(masking.to_fixed(-edge, limit=limit))[0] == -edge[0]
    with pytest.raises(MaskingError) as err:
        masking.to_fixed(edge + 2.0**-masking.FIXED_POINT_BITS, limit=limit)
    assert err.value.reason == "out_of_range"
    # the wire form is the same 32 bits as int32
    wire = masking.to_wire(fixed)
    assert wire.dtype == torch.int32
    assert np.array_equal(masking.ring_of(wire), fixed)


def test_mask_streams_are_the_same_on_both_ends_and_differ_per_entry_and_key() -> None:
    key = b"k" * 32
    first = masking.mask_stream(key, "w", 1000)
    assert first.dtype == np.uint32 and first.nbytes == 4000  # 4 keystream bytes per entry
    assert np.array_equal(first, masking.mask_stream(key, "w", 1000))
    # the first 4n bytes of the same ChaCha20 keystream whatever the length
    assert np.array_equal(masking.mask_stream(key, "w", 10), first[:10])
    assert not np.array_equal(first, masking.mask_stream(key, "b", 1000))
    assert not np.array_equal(first, masking.mask_stream(b"j" * 32, "w", 1000))
    with pytest.raises(MaskingError):
        masking.mask_stream(b"short", "w", 10)
