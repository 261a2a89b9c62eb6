"""relay.yaml as pydantic v2 models: the configuration of a relay (issue 31),
the process that forwards signed, encrypted frames to sites that accept no
inbound connection (node/relay.py).

```yaml
relay: {name: r1, listen: 0.0.0.0:7100, max_pending_per_site: 64, ...}
federation: {id: local, roster: ../roster.yaml}
wire: {max_message_bytes: 536870912, clock_skew_s: 300}
transport: {tls: {cert: ..., key: ..., ca: ...}}   # optional: TLS only, then
status: {enabled: true, host: 127.0.0.1, port: 8100, token_file: ...}
logging: {level: INFO, format: text}
```

A relay holds no keys, no state and writes nothing to disk but its status
token (status.token beside relay.yaml, when none is configured): it authenticates
sites against the roster and reads only the clear, signed headers of the
frames it forwards. Paths are taken relative to the YAML file's folder, as in
site.yaml. `load_relay_config` turns every mistake into one `ConfigError` line.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError, field_validator

from p2pfl.config.errors import config_error
from p2pfl.config.sections import (
    MAX_CONNECTIONS_PER_SOURCE,
    FederationSection,
    LoggingSection,
    Section,
    StatusSection,
    TLSSection,
    parse_hostport,
)
from p2pfl.config.site import (
    TLS_FILES,
    load_yaml_mapping,
    require_files,
    resolve_paths,
    tls_files_required,
)


class RelaySettings(Section):
    """The limits of a relay, wherever it runs: the standalone process's
    `relay:` section (RelaySection adds its name and address) or a reachable
    site that also relays (its defaults)."""

    max_pending_per_site: int = Field(
        64, ge=1, description="frames in flight to one site; more are refused 503 queue_full"
    )
    max_pending_bytes_per_site: int = Field(
        1 << 30,
        ge=1024,
        description="frame bytes in flight to one site (held in memory); more are refused "
        "503 queue_full",
    )
    rate_limit_per_s: float = Field(
        200.0,
        gt=0.0,
        description="frames per second one sender may push through the relay (burst: "
        "max(10, a quarter of this)); more wait their turn, reads paused, and are refused 429 "
        "rate_limited after 2 s of waiting (node/relay_admission.py)",
    )
    idle_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="a site connection silent this long (no pong to the relay's pings, no "
        "message) is closed",
    )
    forward_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="longest a forwarded message waits for the site's answer (requests held "
        "open included); then 502 relay_lost",
    )
    auth_timeout_s: float = Field(
        10.0,  # node/relay_wire.py AUTH_TIMEOUT_S (config sits below node: not imported)
        gt=0.0,
        description="a challenge (nonce) a connecting site fetched is valid this many "
        "seconds, for one upgrade; an unused one then frees its handshake slot",
    )
    read_idle_timeout_s: float = Field(
        30.0, gt=0.0, description="an incoming message that sends no bytes this long is cut off"
    )
    max_handshakes: int = Field(
        64,
        ge=1,
        description="challenges outstanding (fetched, not yet used nor expired) at once; "
        "past it, the oldest of the host holding most is given up (handshake_evicted)",
    )
    max_handshakes_per_host: int = Field(
        8,
        ge=1,
        description="challenges outstanding at once for one host (an IPv4 address, an IPv6 "
        "/64); more are refused (429 too_many_handshakes), so one host cannot take every slot. "
        "Behind a proxy every client is the proxy's address: set it to max_handshakes",
    )
    min_upload_bytes_per_s: float = Field(
        65536.0,
        gt=0.0,
        description="a frame's payload must arrive, and the answer must be taken by its "
        "sender, within read_idle_timeout_s + its size at this rate (as a site's "
        "transport.min_upload_bytes_per_s): else upload_too_slow, or the connection is cut",
    )


class RelaySection(RelaySettings):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="this relay's name, as the roster's `relays:` lists it",
    )
    listen: str = Field(
        "0.0.0.0:7100", description="HOST:PORT sites connect to and peers send messages to"
    )

    @field_validator("listen")
    @classmethod
    def _hostport(cls, v: str) -> str:
        parse_hostport(v)
        return v


class RelayWireSection(Section):
    max_message_bytes: int = Field(
        512 * 1024 * 1024, ge=1024, description="the largest frame forwarded (as the sites')"
    )
    clock_skew_s: float = Field(
        300.0, gt=0.0, description="frames stamped further off this clock are refused"
    )


class RelayTransportSection(Section):
    max_connections: int = Field(
        16384,
        ge=1,
        description="connections relay.listen holds at once (at most half the process's "
        "file-descriptor limit); one more is closed at once (connection_limit). A site's "
        "WebSocket is one, a sender opens up to 8",
    )
    max_connections_per_source: int | None = MAX_CONNECTIONS_PER_SOURCE
    tls: TLSSection | None = Field(
        None,
        description="mutual TLS with the federation's CA (as the sites'): the relay then "
        "listens with TLS only",
    )


class RelayStatusSection(StatusSection):
    port: int = Field(8100, ge=0, lt=65536)
    token_file: Path | None = Field(
        None,
        description="file holding the bearer token; default (no token either): status.token "
        "beside relay.yaml, created with a random token (mode 0600) on the first start; its "
        "path is logged, never the token",
    )


class RelayConfig(Section):
    relay: RelaySection
    federation: FederationSection
    wire: RelayWireSection = RelayWireSection()
    transport: RelayTransportSection = RelayTransportSection()
    status: RelayStatusSection = RelayStatusSection()
    logging: LoggingSection = LoggingSection()


def load_relay_config(path: str | Path, *, check_files: bool = True) -> RelayConfig:
    """Read, validate and resolve a relay.yaml. Raises ConfigError only."""
    path = Path(path)
    raw = load_yaml_mapping(
        path,
        problem="top level must be a mapping of sections (relay, federation, ...)",
        fix="start from `p2pfl-node provision --relay NAME` output",
    )
    try:
        cfg = RelayConfig.model_validate(raw)
    except ValidationError as exc:
        raise config_error(path, exc) from None
    resolve_paths(path.parent, (cfg.federation, "roster"), (cfg.status, "token_file"))
    required = [
        ("federation.roster", cfg.federation.roster, "point it at the federation roster"),
        ("status.token_file", cfg.status.token_file, "write the token into it"),
    ]
    if cfg.transport.tls:
        resolve_paths(path.parent, *((cfg.transport.tls, attr) for attr in TLS_FILES))
        required += tls_files_required(cfg.transport.tls)
    if check_files:
        require_files(path, required)
    return cfg
