"""Federated-learning protocols: one registry from site.yaml to code.

A protocol's name is written once, in its params class (`name: Literal[...]` in
p2pfl/config/protocols.py, which config validation reads without importing any
algorithm); this registry says which class runs those params. A new protocol is
one params class, one file here and one line below. Modules are imported only
when their protocol runs, so a node never loads the GAN code it does not use.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import TypeAdapter

from p2pfl.config import ProtocolParams, protocol_names
from p2pfl.config import protocols as params
from protocols.base import Protocol

IMPLEMENTATIONS: dict[type, str] = {
    params.FedAvgP2PParams: "protocols.fedavgp2p:FedAvgP2P",
    params.FedSGDP2PParams: "protocols.fedsgdp2p:FedSgdP2P",
    params.ProbeParams: "protocols.probe:Probe",
    params.SSFLParams: "protocols.ssfl:SSFL",
    params.FedPerlParams: "protocols.fedperl:FedPerl",
    params.FedMAEParams: "protocols.fedmae:FedMAE",
    params.FedBEiTParams: "protocols.fedbeit:FedBEiT",
    params.FedERParams: "protocols.feder:FedER",  # feder, feder_a, feder_b
}

_params_adapter: TypeAdapter[Any] = TypeAdapter(ProtocolParams)


def create(name: str, **options: Any) -> Protocol:
    """protocols.create("fedavgp2p", fraction=0.5) -> a Protocol instance."""
    if name not in protocol_names():
        raise KeyError(f"unknown protocol {name!r}; known: {', '.join(sorted(protocol_names()))}")
    validated = _params_adapter.validate_python({"name": name, **options})
    return from_params(validated)


def from_params(validated: Any) -> Protocol:
    module_name, _, cls_name = IMPLEMENTATIONS[type(validated)].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(validated)
