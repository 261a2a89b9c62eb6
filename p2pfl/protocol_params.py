"""Typed parameters of each protocol, as written under `protocol:` in site.yaml.

They live in the foundation (not in protocols/) because config validation must
not import the algorithms. A new protocol adds one model here, one entry in
`ProtocolParams`, one file in protocols/ and one registry line.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    rounds: int = Field(10, ge=0, description="federated rounds this node runs")
    round_timeout_s: float = Field(120.0, gt=0, description="how long to wait for a peer's update")
    max_staleness: int = Field(
        1, ge=0, description="accept a peer model at most this many rounds old"
    )
    eval_every: int = Field(1, ge=1)


class FedAvgP2PParams(_Params):
    name: Literal["fedavgp2p"]
    fraction: float = Field(
        0.5, gt=0.0, le=1.0, description="c: share of the other nodes to average with"
    )
    aggregation: Literal["mean", "median", "trimmed_mean", "norm_clip"] = "mean"
    trim_ratio: float = Field(
        0.2, ge=0.0, lt=0.5, description="trimmed_mean: share cut at each end"
    )
    clip_norm: float | None = Field(
        None, gt=0, description="norm_clip: max L2 distance of an update from ours"
    )


class FedSGDP2PParams(_Params):
    name: Literal["fedsgdp2p"]
    fraction: float = Field(0.5, gt=0.0, le=1.0)
    step_timeout_s: float = Field(
        30.0, gt=0, description="how long to wait for a neighbour's gradient"
    )


class ProbeParams(_Params):
    """A connectivity and throughput check of the federation (no learning)."""

    name: Literal["probe"]
    payload_kb: int = Field(
        64, ge=0, le=1024 * 1024, description="size of the tensor pushed to each peer per round"
    )
    interval_s: float = Field(0.0, ge=0.0, description="pause between rounds")


ProtocolParams = FedAvgP2PParams | FedSGDP2PParams | ProbeParams


def protocol_names() -> list[str]:
    return [cls.model_fields["name"].annotation.__args__[0] for cls in ProtocolParams.__args__]  # type: ignore[attr-defined]
