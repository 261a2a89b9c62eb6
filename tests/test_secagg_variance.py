"""A BatchNorm running variance below zero in a secure sum's mean.

A plain reply with one is refused (`model_negative_variance`,
tests/test_checks.py), but a secure sum hides who sent it: a contributor
masked a negative variance into a real secure sum, its mean came out below
zero, passed the sum's checks (finite, under the norm guard) and the merge
made every logit of the requester's model NaN. The sum's variances are now
raised to zero where it is decoded (every secure sum: FedAVGP2P's, the
asynchronous one, FedPerl's community and anonymized peer), counted in the
round log (`secagg_variances_raised`), and counted against nobody: the sum
cannot say which contributor it was. An honest sum never has one (the ring's
rounding keeps a value at or above zero)."""

from __future__ import annotations

import asyncio
import logging

import torch
from test_secagg import CONTRIBUTORS, REQUESTER, Federation
from test_secagg_narrow_ring import Federation as NarrowFederation
from test_secagg_narrow_ring import names

from p2pfl.config import ModelSection
from p2pfl.learning.site_model import create_site_model
from protocols.aggregate import aggregate
from protocols.exchange import ServedModels
from protocols.secure_exchange import SecureExchange

VAR = "features.1.running_var"


def _logits(state: dict[str, torch.Tensor]) -> torch.Tensor:
    torch.manual_seed(0)
    model = create_site_model(ModelSection(), in_chans=1, num_classes=3, image_size=8)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(torch.randn(16, 1, 8, 8))


def test_a_contributors_negative_variance_in_a_secure_sum_is_raised_not_merged(caplog) -> None:
    fed = Federation()
    hostile = CONTRIBUTORS[0]
    fed.states[hostile][VAR][0] = -60.0  # its weight is 10 of 100: the mean goes below zero
    assert float(fed.expected(CONTRIBUTORS)[VAR][0]) < 0
    caplog.set_level(logging.WARNING)
    result = asyncio.run(fed.ask(CONTRIBUTORS))
    assert result.contributors == CONTRIBUTORS
    assert float(result.mean[VAR][0]) == 0.0  # raised, not merged below zero
    assert result.variances_raised == 1
    honest = fed.expected(CONTRIBUTORS)
    assert torch.allclose(result.mean[VAR][1:].double(), honest[VAR][1:], atol=1e-5)
    assert any("variance" in r.getMessage() for r in caplog.records), caplog.text

    # as a merge term, the node's model stays usable; the round log counts it,
    # and nobody is counted against (the sum does not say who sent it)
    ctx = fed.ctxs[REQUESTER]
    exchange = SecureExchange(
        ServedModels(3), max_staleness=1, timeout=2.0, max_norm_ratio=10.0, max_weight_ratio=None
    )
    got = exchange.collected(ctx, 3, [result], fed.reference, 10.0, 4)
    assert got.log["secagg_variances_raised"] == 1
    assert len(got.terms) == 1
    assert not fed.network.rejections
    term = got.terms[0]
    merged = aggregate("mean", [fed.reference, term.state], [1.0, term.weight])
    assert bool(torch.isfinite(_logits(merged)).all())


def test_an_honest_secure_sum_raises_nothing() -> None:
    fed = Federation()
    for state in fed.states.values():  # variances at and near zero: a dead channel
        state[VAR][0] = 0.0
        state[VAR][1] = 1e-30
    result = asyncio.run(fed.ask(CONTRIBUTORS))
    assert result.variances_raised == 0
    assert float(result.mean[VAR][0]) == 0.0 and float(result.mean[VAR][1]) >= 0.0


def test_an_honest_narrow_ring_sum_raises_nothing() -> None:
    """The same in an 8-bit ring (int8), whose stochastic rounding floors a
    value at or above zero: a large BatchNorm's variances (4,096, so not in the
    32-bit ring), a quarter at zero, far from the requester's own."""
    torch.manual_seed(1)

    def state(scale: float) -> dict[str, torch.Tensor]:
        var = torch.rand(4096) * scale
        var[:1000] = 0.0
        var[1000:1500] = 1e-30
        return {"bn.running_var": var, "bn.weight": torch.randn(4096)}

    members = names(4)
    weights = {n: float(10 + 7 * i) for i, n in enumerate(members)}
    fed = NarrowFederation({n: state(1e-3) for n in members}, weights, 8)
    result = fed.ask(members, state(1.0))
    assert result.ring == 8 and result.ring_edge == 0
    assert result.variances_raised == 0
    assert float(result.mean["bn.running_var"].min()) >= 0.0
