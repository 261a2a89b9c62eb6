"""The weight unit W of a secure sum, chosen by the requester, against a
contributor whose roster card keeps its weight under the floor.

A contributor's weight w counts as w/W in the sum; a card-less one lighter
than W / 2^12 is raised to that floor, so no W rounds it out. A carded one is
raised at most to its card. Found by a review (2026-11-27): a requester that
sends W = 2^40 to a carded and a card-less site of 500 images each rounded the
first out (500 / 2^40) while the second stayed at 2^-12: the "sum" of two was
the card-less site's model. Now a contributor refuses a W past 2^12 x its
card (`weight_scale_too_large`, counted), and an honest requester never asks
for one (`weight_scale_for`).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pfl.config.secagg_ring import narrow_entries
from protocols.exchange import ServedModels
from protocols.memory import InMemoryNetwork
from protocols.secagg import MIN_WEIGHT_SHARE, SecAggError, secure_sum
from protocols.secagg_requester import weight_scale_for
from protocols.secure_exchange import SecureExchange

OPTIONS = dict(max_staleness=1, timeout=5.0, max_norm_ratio=10.0, max_weight_ratio=16.0)


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(32, 16, 3, 3, generator=g) * 0.05,
        "fc.bias": torch.randn(2, generator=g) * 0.1,
    }


def federation(ring: int, caps: dict[str, int]) -> tuple[InMemoryNetwork, object]:
    network = InMemoryNetwork(sample_caps=caps)
    for name, seed in (("alice", 1), ("bob", 2)):
        exchange = SecureExchange(ServedModels(keep=3), ring=ring, **OPTIONS)
        exchange.start(network.join(name))
        exchange.store.put(1, model(seed), 500)
    return network, network.join("mallory")


def steps_for(ring: int) -> dict[str, float] | None:
    if ring == 32:
        return None
    sizes = {k: v.numel() for k, v in model(3).items()}
    return dict.fromkeys(narrow_entries(ring, sizes), 2.0**-26)


def sum_of_both(requester: object, weight_scale: float, ring: int = 32) -> object:
    """The requester's secure sum of alice and bob at the unit it picks."""
    return asyncio.run(
        secure_sum(
            requester,
            ["alice", "bob"],
            round_no=1,
            max_round=2,
            reference=model(3),
            timeout=5.0,
            weight_scale=weight_scale,
            ring=ring,
            steps=steps_for(ring),
        )
    )


@pytest.mark.parametrize("ring", [32, 16])
def test_a_huge_weight_unit_does_not_isolate_the_card_less_site(ring: int) -> None:
    network, requester = federation(ring, {"alice": 500})  # bob has no card
    with pytest.raises(SecAggError) as err:  # alice refuses: no sum of one is left
        sum_of_both(requester, 2.0**40, ring)
    assert err.value.reason == "too_few"
    refused = [(r["node"], r["peer"], r["reason"]) for r in network.rejections]
    assert ("alice", "mallory", "secagg_weight_scale_too_large") in refused


def test_the_largest_unit_a_carded_site_accepts_counts_both_alike() -> None:
    """At W = 2^12 x alice's card, both sit on the floor: the sum is their mean."""
    network, requester = federation(32, {"alice": 500})
    got = sum_of_both(requester, 500 / MIN_WEIGHT_SHARE)
    assert got.contributors == ["alice", "bob"]
    a, b = model(1), model(2)
    for key in a:
        assert torch.allclose(got.mean[key], (a[key] + b[key]) / 2, atol=1e-2)
    assert not network.rejections


def test_an_honest_requester_never_asks_for_a_unit_a_card_refuses() -> None:
    caps = {"big": 10_000_000, "small": 100}
    scale = weight_scale_for(caps, ["big", "small"], own_weight=1000.0, ratio=None)
    assert scale == 100 / MIN_WEIGHT_SHARE  # the big site counts as W: capped, not refused
    assert weight_scale_for(caps, ["big"], own_weight=1000.0, ratio=None) == 10_000_000
