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

from p2pfl.config.protocols import FedAvgP2PParams, FedMAEParams, FedPerlParams
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


def async_pair(p: FedMAEParams, stale: int) -> float:
    """A requester alone, no colluder: the largest error of the mean of an
    asynchronous secure sum of {fresh victim, one `stale` rounds behind}
    against the victim's model, on the fine-tuning stage's real exchange."""

    async def attack() -> float:
        network = InMemoryNetwork()
        torch.manual_seed(0)
        models = {"victim": (100, torch.randn(4, 8)), "other": (100 - stale, torch.randn(4, 8))}
        for name, (r, w) in models.items():
            exchange = finetune_stage(p.finetune, p.encoder_out, p)[0].loop.exchanger
            exchange.store.put(r, {"w": w}, 100)
            exchange.start(network.join(name))
        got = await secure_sum(
            network.join("requester"),
            ["other", "victim"],
            round_no=100 - stale,
            max_round=100,
            reference={"w": torch.zeros(4, 8)},
            timeout=3.0,
            weight_scale=100.0,
            purpose="freshest",
            at_round=100,
        )
        return float((got.mean["w"] - models["victim"][1]).abs().max())

    return asyncio.run(attack())


def test_a_section_made_in_code_passes_what_configuration_asks_of_a_secure_one() -> None:
    """A second review (2026-11-28): the stage inherited secure_aggregation by
    `model_copy`, which runs no validator, so a section made in code with
    asynchronous: true, staleness_bound: 100, staleness_exponent: 2 (valid
    without secure aggregation) ran asynchronous secure sums that weigh a
    stale model 10,201 times less than a fresh one (configuration refuses
    more than 4): one sum of two gave the requester the fresh site's
    fine-tuned model to 1e-3, no colluder needed. FedPerl's asynchronous
    mode and top-k compression were built secure the same way."""
    stale = FedAvgP2PParams(
        name="fedavgp2p", rounds=2, asynchronous=True, staleness_bound=100, staleness_exponent=2.0
    )
    for section, refusal in (
        (stale, "asynchronous secure sums weigh"),
        (FedPerlParams(name="fedperl", rounds=2, asynchronous=True), "asynchronous cannot"),
        (FedAvgP2PParams(name="fedavgp2p", rounds=2, compression="topk:0.1"), "top-k"),
    ):
        coded = params().model_copy(update={"finetune": section})
        with pytest.raises(FedMAEError, match=refusal):
            finetune_stage(coded.finetune, coded.encoder_out, coded)
    # the control: within configuration's bound, the same sum is a mean of two
    within = stale.model_copy(update={"staleness_bound": 3, "staleness_exponent": 0.5})
    assert async_pair(params().model_copy(update={"finetune": within}), stale=3) > 0.5
