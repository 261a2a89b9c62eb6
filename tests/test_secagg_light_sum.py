"""A secure sum whose contributors all collude can claim any total weight
above zero (rv_sa review): the requester merges it at that weight, its merged
model is then its own to within that weight, and what it gossips of the merged
model (per-class F1, model statistics, FedPerl's validation accuracy) is of its
own model. A stated limit (docs/threat-model.md, "Heartbeat gossip")."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from p2pfl.config import FedAvgP2PParams, SelectionSection
from protocols import masking
from protocols import secagg_primitives as primitives
from protocols.aggregate import aggregate
from protocols.fedavgp2p import FedAvgP2P
from protocols.memory import InMemoryNetwork
from protocols.secagg_requester import SecureSum
from protocols.secure_exchange import SecureExchange
from protocols.selection import F1_KEY, MODEL_STATS_KEY


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, generator=g) * 0.1, "b": torch.randn(8, generator=g) * 0.1}


def colluders_inputs(
    plausible: dict[str, torch.Tensor], weight_scale: float, light: float
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, bytes], dict[str, bytes]]:
    """Round 2 of two colluding contributors: c1 masks `plausible` at weight
    10 x `light`, c2 masks -`plausible` at 9 x `light` and negates its weight
    entry in the ring (a dishonest contributor may send any ring element).
    Their sum is `light` x `plausible` at total weight `light`: its mean is
    `plausible` (to the fixed point's rounding)."""
    names = ["c1", "c2"]
    private = {n: primitives.X25519PrivateKey.generate() for n in names}
    public = {n: k.public_key().public_bytes_raw() for n, k in private.items()}
    seeds = {n: bytes([i + 1]) * 32 for i, n in enumerate(names)}
    out = {}
    for me, sign, weight in (("c1", 1.0, 10 * light), ("c2", -1.0, 9 * light)):
        pair = {
            v: primitives.mask_seed(private[me], public[v], b"ctx", me, v) for v in names if v != me
        }
        out[me] = primitives.masked_input(
            {k: sign * v for k, v in plausible.items()},
            weight,
            me=me,
            self_seed=seeds[me],
            pair_seeds=pair,
            contributors=len(names),
            weight_scale=weight_scale,
        )
    flat = masking.ring_of(out["c2"][masking.WEIGHT_KEY])
    flat -= 2 * masking.to_fixed(np.array([9 * light / weight_scale]))
    out["c2"][masking.WEIGHT_KEY] = masking.to_wire(flat)
    return out, seeds, public


def test_colluders_that_are_all_of_a_sum_make_the_merge_the_requesters_own_model_the_stated_limit() -> (
    None
):
    own, plausible = state(0), state(1)
    # W as an honest requester of 500 samples picks it (16 x its own count), and
    # a sum two colluders say weighs one sample
    own_weight, weight_scale, light = 500.0, 8000.0, 1.0
    inputs, seeds, public = colluders_inputs(plausible, weight_scale, light)
    mean, total = primitives.unmask_sum(
        inputs, seeds, {}, public, b"ctx", own, weight_scale=weight_scale
    )
    # the requester decodes the colluders' mean at a total weight of one sample
    assert torch.allclose(mean["w"], plausible["w"], atol=0.02)
    assert total == pytest.approx(light, rel=1e-3)
    network = InMemoryNetwork()
    ctx = network.join("me")
    exchange = FedAvgP2P(FedAvgP2PParams(name="fedavgp2p", secure_aggregation=True)).exchanger
    assert isinstance(exchange, SecureExchange)
    light = SecureSum(mean, total, ["c1", "c2"], {"c1": 1, "c2": 1}, [])
    got = exchange.collected(ctx, 1, [light], own, own_weight, k=2)
    (term,) = got.terms  # merged: neither the norm check nor the weight cap refuses it
    assert term.weight == total and not network.rejections
    merged = aggregate("mean", [own, term.state], [own_weight, term.weight], own=0)
    share = total / (own_weight + total)
    assert float((merged["w"] - own["w"]).abs().max()) <= share * 1.01
    # ...and it counts as a round that merged peers' models: the statistics of a
    # model within 0.2% of the site's own, or its per-class F1, go out to every
    # roster member
    protocol = FedAvgP2P(FedAvgP2PParams(name="fedavgp2p", secure_aggregation=True))
    protocol.merged = [[1, [["c1", 1], ["c2", 1]]]]
    for section, key in (
        (SelectionSection(name="cosine", vector="model_stats"), MODEL_STATS_KEY),
        (SelectionSection(name="f1"), F1_KEY),
    ):
        published: dict[str, object] = {}
        recorder = SimpleNamespace(
            me="me", config=SimpleNamespace(selection=section), publish=published.__setitem__
        )
        protocol.update_gossip(recorder, [0.9, 0.0, 0.8], [0.1, 0.2])  # type: ignore[arg-type]
        assert key in published
