"""A contributor's `out_of_range` refusal tells a requester nothing it can search.

Found by a review (2026-11-28): a contributor refused a model that did not fit
the sum it was asked for at the requester's weight unit, w/W x max|x| against
(2^31 - 1) // n, before any share was dealt, so nothing was recorded and the
requester could ask again. Binary-searching W over ~80 Round 0 requests read
the victim's w x max|x| (sample count times the largest value of its
fixed-point entries: every entry in 32 bits, the biases and norm statistics in
fp16 / int8) to five digits. Now it checks its model at full weight against
the largest sum of its roster: one answer to every request.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest
import torch

from protocols.memory import InMemoryNetwork
from protocols.secagg import SECAGG_KIND, Contributor

NAMES = ["a", "b", "c", "v"]  # a roster of 5 with the requester: sums of at most 4
WEIGHT = 137.0


def answers(ring: int, largest: float) -> set[str]:
    """The victim's Round 0 answers over a grid of W (1 to 2^40) and sizes."""

    async def probe() -> set[str]:
        network = InMemoryNetwork()
        ctxs = {n: network.join(n) for n in [*NAMES, "r"]}
        torch.manual_seed(0)
        model = {"big.weight": torch.randn(4096) * 0.05, "bn.running_var": torch.rand(64) + 1}
        model["bn.running_var"][7] = largest
        victim = Contributor(ctxs["v"], lambda *_: (1, model, WEIGHT), ring=ring)
        ctxs["v"].serve(SECAGG_KIND, victim.serve)
        seen = set()
        for size in (2, 3, 4):
            for power in range(0, 41, 4):
                victim.sessions.clear()  # room for every probe (16 open per requester)
                query = dict(
                    session=secrets.token_hex(16),
                    phase="advertise",
                    contributors=NAMES[-size:],
                    round=1,
                    max_round=1,
                    purpose="model",
                    weight_scale=2.0**power,
                    ring=ring,
                    body={},
                )
                if ring != 32:
                    query["steps"] = {"big.weight": 2.0**-10}
                reply = await ctxs["r"].request("v", SECAGG_KIND, query, 5.0)
                seen.add(reply.get("refused", "answered"))
        return seen

    return asyncio.run(probe())


@pytest.mark.parametrize("ring", [32, 8])
def test_a_model_past_the_rosters_bound_is_refused_whatever_w_and_size(ring: int) -> None:
    # 987 x 2^20 > (2^31 - 1) // 4: no sum of this roster holds it at full weight
    assert answers(ring, 987.654321) == {"out_of_range"}


@pytest.mark.parametrize("ring", [32, 8])
def test_a_model_within_the_rosters_bound_is_never_refused_out_of_range(ring: int) -> None:
    assert answers(ring, 300.0) == {"answered"}
