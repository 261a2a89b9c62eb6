"""Federated-learning protocols: one registry from site.yaml names to code."""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import TypeAdapter

from p2pfl.config import ProtocolParams
from protocols.base import Protocol

# name -> "module:Class"; a new protocol is one file plus one line here.
REGISTRY: dict[str, str] = {
    "fedavgp2p": "protocols.fedavgp2p:FedAvgP2P",
    "fedsgdp2p": "protocols.fedsgdp2p:FedSgdP2P",
    "probe": "protocols.probe:Probe",
    "ssfl": "protocols.fedperl:SSFL",
    "fedperl": "protocols.fedperl:FedPerl",
    "fedmae": "protocols.fedmae:FedMAE",
    "feder": "protocols.feder:FedER",
    "feder_a": "protocols.feder:FedER",
    "feder_b": "protocols.feder:FedER",
}

_params_adapter: TypeAdapter[Any] = TypeAdapter(ProtocolParams)


def create(name: str, **params: Any) -> Protocol:
    """protocols.create("fedavgp2p", fraction=0.5) -> a Protocol instance."""
    if name not in REGISTRY:
        raise KeyError(f"unknown protocol {name!r}; known: {', '.join(sorted(REGISTRY))}")
    validated = _params_adapter.validate_python({"name": name, **params})
    return from_params(validated)


def from_params(params: Any) -> Protocol:
    module_name, _, cls_name = REGISTRY[params.name].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(params)
