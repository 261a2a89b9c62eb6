"""A lossy difference and a BatchNorm running variance near zero: the rounding
of C(x - x_hat) can take an honest variance below zero (int8: to -0.008 for a
variance of 1e-3 sent as a difference from 0.5), which made the node's
evaluation NaN once merged, and which `checks.admit` now refuses from a peer
(`model_negative_variance`, tests/test_checks.py). The compressed exchange
merges such a term with its variances at zero at least, counts nothing
against the honest sender, and keeps the pair's copy as both ends computed it
(review rv_comp, 2026-11-28)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from test_exchange_attacks import Ctx, exchange

VAR = "bn.running_var"


def model(gen: torch.Generator, var: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"w": 0.1 * torch.randn(5000, generator=gen), VAR: var, "n": torch.tensor(3)}


def test_an_honest_variance_rounded_below_zero_is_merged_at_zero_not_refused() -> None:
    """top-k here (the variances' differences are the largest, so sent, in
    float16); fp16 and int8 go below zero as well, for other values."""
    setting = "topk:0.1"
    gen = torch.Generator().manual_seed(0)
    before = model(gen, 0.1 + 2 * torch.rand(256, generator=gen))
    after = {**before, VAR: 1e-3 * torch.rand(256, generator=gen)}
    tx, rx = exchange(setting), exchange(setting)
    tx_ctx = Ctx()
    tx.start(tx_ctx)  # type: ignore[arg-type]

    async def answer(query: dict[str, Any]) -> Any:
        return await tx.serve("me", query)

    ctx = Ctx(answer)
    rx.start(ctx)  # type: ignore[arg-type]
    for round_no, state in ((1, before), (2, after)):
        tx.offer(tx_ctx, round_no, state, 10)  # type: ignore[arg-type]
        got = asyncio.run(rx.collect(ctx, round_no, after, 10.0, ["p"], 1))  # type: ignore[arg-type]
        assert ctx.rejected == [] and len(got.terms) == 1, (round_no, ctx.rejected)
    held_id, held = rx.held["p"]
    assert float(held[VAR].min()) < 0  # the rounding did go below zero, on both ends alike
    assert all(torch.equal(held[k], tx.sent["me"][held_id][k]) for k in held)
    assert float(got.terms[0].state[VAR].min()) >= 0  # what is merged
