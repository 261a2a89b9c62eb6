"""The fine-tuning stage of Fed-MAE / Fed-BEiT keeps the pre-training's
secure-aggregation collusion bounds.

Found by a review (2026-11-28): the `finetune` section inherited
`secure_aggregation: true` and nothing else, so a federation that set
`secagg_min_contributors: 4` (three colluders needed) answered sums of two in
fine-tuning, and a requester with ONE colluding contributor peeled the other's
fine-tuned model out of a sum of {victim, colluder}. These tests run that
attack on the stage's real exchange (built as a node builds it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from p2pfl.config.protocols import FedAvgP2PParams, FedMAEParams
from protocols.fedmae import FedMAEError, finetune_stage
from protocols.memory import InMemoryNetwork
from protocols.secagg import SecAggError, secure_sum

PRETRAIN = {"name": "fedmae", "rounds": 2, "secure_aggregation": True}


def params(**extra: Any) -> FedMAEParams:
    return FedMAEParams.model_validate({**PRETRAIN, **extra})


def peel(p: FedMAEParams) -> float:
    """The pair attack on the fine-tuning stage's own exchange: the largest
    error of the victim's model peeled from a sum of {victim, colluder}."""

    async def attack() -> float:
        network = InMemoryNetwork()
        torch.manual_seed(0)
        models = {n: {"w": torch.randn(4, 8)} for n in ("colluder", "victim")}
        for name, model in models.items():
            exchange = finetune_stage(p.finetune, p.encoder_out, p)[0].loop.exchanger
            exchange.store.put(1, model, 100)
            exchange.start(network.join(name))
        got = await secure_sum(
            network.join("requester"),
            ["colluder", "victim"],
            round_no=1,
            max_round=1,
            reference={"w": torch.zeros(4, 8)},
            timeout=3.0,
            weight_scale=100.0,
        )
        peeled = got.mean["w"] * 2 - models["colluder"]["w"]
        return float((peeled - models["victim"]["w"]).abs().max())

    return asyncio.run(attack())


def test_the_fine_tuning_section_inherits_the_collusion_bounds() -> None:
    p = params(secagg_min_contributors=4, secagg_threshold=3, finetune={"name": "fedavgp2p"})
    assert p.finetune is not None
    assert p.finetune.secure_aggregation
    assert p.finetune.secagg_min_contributors == 4
    assert p.finetune.secagg_threshold == 3
    # a section's own stricter bound stands
    stricter = params(
        secagg_min_contributors=3, finetune={"name": "fedavgp2p", "secagg_min_contributors": 5}
    )
    assert stricter.finetune is not None and stricter.finetune.secagg_min_contributors == 5


def test_a_fine_tuning_section_with_a_smaller_minimum_is_refused_in_one_line() -> None:
    with pytest.raises(ValidationError, match="below the pre-training's 4"):
        params(
            secagg_min_contributors=4,
            finetune={"name": "fedavgp2p", "secagg_min_contributors": 2},
        )


def test_a_colluder_and_the_requester_cannot_peel_a_fine_tuned_model_from_a_pair() -> None:
    p = params(secagg_min_contributors=4, finetune={"name": "fedavgp2p"})
    with pytest.raises(SecAggError, match="advertised keys"):  # every contributor refuses
        peel(p)
    # params made in code skip validation: the stage still holds the bound
    coded = params(secagg_min_contributors=4).model_copy(
        update={"finetune": FedAvgP2PParams(name="fedavgp2p", rounds=2)}
    )
    exchange = finetune_stage(coded.finetune, coded.encoder_out, coded)[0].loop.exchanger
    assert exchange.min_contributors == 4
    with pytest.raises(SecAggError, match="advertised keys"):
        peel(coded)
    lower = coded.model_copy(
        update={"finetune": FedAvgP2PParams(name="fedavgp2p", secagg_min_contributors=2)}
    )
    with pytest.raises(FedMAEError, match="below the pre-training's 4"):
        finetune_stage(lower.finetune, lower.encoder_out, lower)


def test_without_the_bound_the_pair_gives_the_model_what_the_minimum_is_for() -> None:
    """The control: at the default minimum of two, the same attack peels the
    model (so the test above can tell)."""
    assert peel(params(finetune={"name": "fedavgp2p"})) < 1e-5


def test_a_fine_tuning_section_with_a_smaller_threshold_is_refused() -> None:
    """A second review (2026-11-28): a smaller minimum was refused, a smaller
    threshold accepted, so a sum of 6 needed 5 colluders in pre-training and
    3 in fine-tuning (`secagg_colluders_needed`)."""
    with pytest.raises(ValidationError, match="secagg_threshold 1 is below the pre-training's 5"):
        params(
            secagg_min_contributors=6,
            secagg_threshold=5,
            finetune={"name": "fedavgp2p", "secagg_threshold": 1},
        )
    with pytest.raises(ValidationError, match="secagg_threshold None is below"):
        params(secagg_threshold=5, finetune={"name": "fedavgp2p", "secagg_threshold": None})
    coded = params(secagg_threshold=5).model_copy(
        update={"finetune": FedAvgP2PParams(name="fedavgp2p", secagg_threshold=2)}
    )
    with pytest.raises(FedMAEError, match="secagg_threshold 2 is below the pre-training's 5"):
        finetune_stage(coded.finetune, coded.encoder_out, coded)
    # equal or stricter stands; without a pre-training threshold any is the section's own
    assert params(secagg_threshold=5, finetune={"name": "fedavgp2p", "secagg_threshold": 6})
    assert params(finetune={"name": "fedavgp2p", "secagg_threshold": 2})
