"""The numbers a request or a heartbeat carries for the node itself, not for
its protocol: a request's `_wait_s` (how long it may be held open) and a
heartbeat's `round` (node/peers.py reads it). They pass a pydantic schema with
finite bounds before the node acts on them; anything else is refused
`payload_schema` (node/inbound.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from p2pfl.secure.wire import WireError

MAX_WAIT_S = 3600.0  # the longest `_wait_s` a request may carry (then capped by the config)


class RequestControl(BaseModel):
    """What a request's query says to the node itself, not to the protocol."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    wait_s: float = Field(0.0, alias="_wait_s", ge=0.0, le=MAX_WAIT_S)


class HeartbeatControl(BaseModel):
    """The numbers of a heartbeat the node acts on (node/peers.py reads them)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    round: int = Field(0, ge=-1, le=2**31 - 1)


def validated(schema: type[BaseModel], payload: Any) -> Any:
    """`payload` as `schema`, or WireError payload_schema naming the first bad field."""
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise WireError("payload_schema", f"{where}: {first['msg']}"[:120]) from None
