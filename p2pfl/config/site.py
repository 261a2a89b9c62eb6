"""A whole site.yaml: `SiteConfig`, and reading, validating and resolving it.

`load_config` turns every failure a person can cause (missing file, YAML
syntax, wrong type, unknown protocol, missing key file) into one `ConfigError`
whose message names the file, the field path and the fix. The steps of
reading a YAML are public here, for the relay's loader (p2pfl/config/relay.py)
and the genbuffer CLI's (a standalone `genbuffer:` YAML): `read_yaml` /
`load_yaml_mapping` (the file, its syntax, a mapping at the top),
`resolve_path` / `resolve_paths` (paths relative to the YAML's folder) and
`require_files` (the first missing file, as one error).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, model_validator

from p2pfl.config.errors import ConfigError, FieldValueError, config_error
from p2pfl.config.genbuffer import GenbufferSection
from p2pfl.config.protocols import ProtocolParams
from p2pfl.config.sections import (
    DataSection,
    FederationSection,
    IdentitySection,
    LoggingSection,
    ModelSection,
    NodeSection,
    RelaySiteSection,
    Section,
    SelectionSection,
    StatusSection,
    TLSSection,
    TrainingSection,
    TransportSection,
    WireSection,
)


class SiteConfig(Section):
    node: NodeSection
    identity: IdentitySection = IdentitySection()
    federation: FederationSection
    data: DataSection = DataSection()
    model: ModelSection = ModelSection()
    training: TrainingSection = TrainingSection()
    protocol: Annotated[ProtocolParams, Field(discriminator="name")]
    selection: SelectionSection = SelectionSection()
    status: StatusSection = StatusSection()
    wire: WireSection = WireSection()
    transport: TransportSection = TransportSection()
    logging: LoggingSection = LoggingSection()
    genbuffer: GenbufferSection = GenbufferSection()
    relay: RelaySiteSection = RelaySiteSection()

    @model_validator(mode="after")
    def _relay_needs_encryption(self) -> SiteConfig:
        """A relay forwards only ciphertext (issue 31): it must never see a payload."""
        if self.relay.serve and not self.wire.encryption:
            raise FieldValueError("relay.serve", *RELAY_NEEDS_ENCRYPTION)
        return self

    @model_validator(mode="after")
    def _secure_aggregation_needs_encryption(self) -> SiteConfig:
        """Secure aggregation's shares and masked inputs travel as message payloads:
        in the clear, a passive observer of the links learns every secure sum."""
        field = secure_aggregation_field(self.protocol)
        if field and not self.wire.encryption:
            raise FieldValueError(
                field,
                "secure aggregation needs wire.encryption: true (in the clear, anyone "
                "who sees the traffic learns every secure sum from the shares and masked inputs)",
                "set wire.encryption: true in every site.yaml, or secure_aggregation: false",
            )
        return self

    @model_validator(mode="after")
    def _dp_only_where_planned(self) -> SiteConfig:
        """training.dp is the one guard of `check` and `run` alike: a protocol whose
        local training is DP-SGD planned over the whole run, or a refusal here."""
        if self.training.dp is not None or self.training.recipe == "dp":
            problem = dp_unsupported_setting(
                self.protocol.name,
                siamese=self.model.siamese.enabled,
                devices=self.training.devices,
            )
            if problem is not None:
                field = "training.dp" if self.training.dp is not None else "training.recipe"
                raise FieldValueError(field, *problem)
        return self

    # Resolved paths (filled by load_config relative to the config file).
    @property
    def state_dir(self) -> Path:
        return self.node.state_dir

    @property
    def signing_key_path(self) -> Path:
        return (
            self.identity.signing_key or self.node.state_dir / "keys" / f"{self.node.name}.sign.pem"
        )

    @property
    def agreement_key_path(self) -> Path:
        return (
            self.identity.agreement_key
            or self.node.state_dir / "keys" / f"{self.node.name}.kex.pem"
        )


RELAY_NEEDS_ENCRYPTION = (
    "relays (sites behind one, or this site relaying) need wire.encryption: true (a relay "
    "must never see a payload in the clear, and refuses one)",
    "set wire.encryption: true in every site.yaml",
)


def roster_names_relays(roster_path: Path) -> bool:
    """Does the roster file give any site a `via` (a site reached through relays)?
    Read as plain YAML: the roster itself is parsed and checked by p2pfl.secure."""
    try:
        raw = read_yaml(roster_path)
    except ConfigError:
        return False
    sites = raw.get("sites") if isinstance(raw, dict) else None
    return isinstance(sites, list) and any(isinstance(s, dict) and s.get("via") for s in sites)


DP_PROTOCOLS = ("fedavgp2p", "fedsgdp2p")  # the protocols whose local training is DP-SGD


def dp_unsupported_setting(protocol: str, *, siamese: bool, devices: int) -> tuple[str, str] | None:
    """(problem, fix) when training.dp cannot run with this protocol, Siamese
    head or number of training devices; else None. Only FedAVGP2P and
    FedSGDP2P plan DP-SGD over their rounds: the self-supervised stages, FedER's
    GAN and FedPerl's pseudo-labels would spend an unaccounted budget."""
    if protocol not in DP_PROTOCOLS:
        return (
            f"differential privacy is supported for {' and '.join(DP_PROTOCOLS)}, not {protocol}",
            "remove training.dp or change protocol.name",
        )
    if siamese or devices > 1:
        return (
            "differential privacy needs one training device and no Siamese head",
            "set training.devices: 1 and model.siamese.enabled: false",
        )
    return None


def secure_aggregation_field(protocol: ProtocolParams) -> str | None:
    """The field path that turns secure aggregation on (the protocol's own, or
    its chained fine-tuning's); None when neither does."""
    if getattr(protocol, "secure_aggregation", False):
        return "protocol.secure_aggregation"
    finetune = getattr(protocol, "finetune", None)
    if finetune is not None and getattr(finetune, "secure_aggregation", False):
        return "protocol.finetune.secure_aggregation"
    return None


def resolve_path(path: Path | None, base: Path) -> Path | None:
    """`path` with `~` expanded, taken relative to `base` (a YAML file's folder)
    unless absolute; None stays None."""
    if path is None:
        return None
    path = path.expanduser()
    return path if path.is_absolute() else (base / path)


def resolve_paths(base: Path, *fields: tuple[object, str]) -> None:
    """Resolve each (section, attribute) path field in place against `base`,
    as `resolve_path` does one."""
    for section, attr in fields:
        setattr(section, attr, resolve_path(getattr(section, attr), base))


def require_files(path: Path, required: Iterable[tuple[str, Path | str | None, str]]) -> None:
    """Raise the ConfigError of the first (field, file, fix) whose file does not
    exist; a field left unset (None) needs no file."""
    for field, file, fix in required:
        if file is not None and not Path(file).exists():
            raise ConfigError(path, field, f"file not found: {file}", fix)


def resolve_data_source(data: DataSection, base: Path) -> None:
    """A file or folder `data.source` is taken relative to `base`; 'digits' names no file."""
    if data.source != "digits" and not Path(data.source).is_absolute():
        data.source = str(base / data.source)


def resolve_genbuffer_paths(
    section: GenbufferSection, base: Path, state_dir: Path | None = None
) -> None:
    """Make the section's paths absolute, relative to `base` (the YAML file's folder).

    Given a site's (already resolved) `state_dir`, an `out_dir` the YAML does not
    set becomes STATE/genbuffer, so the GAN's files live with the node's state.
    """
    if state_dir is not None and "out_dir" not in section.model_fields_set:
        section.out_dir = state_dir / "genbuffer"
    else:
        section.out_dir = resolve_path(section.out_dir, base)  # type: ignore[assignment]
    section.lpips_weights = resolve_path(section.lpips_weights, base)


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file; every failure is a ConfigError naming the file (and line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            path, "", "file not found", "pass the path of an existing site.yaml (--config)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            path, "", f"cannot read: {exc}", "check the file's permissions and encoding"
        ) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            path, where, f"YAML syntax error: {problem}", "fix the indentation or quoting there"
        ) from None
    return raw


def load_config(path: str | Path, *, check_files: bool = True) -> SiteConfig:
    """Read, validate and resolve a site.yaml. Raises ConfigError only."""
    path = Path(path)
    return config_from_dict(load_yaml_mapping(path), path, check_files=check_files)


def load_yaml_mapping(
    path: str | Path,
    *,
    problem: str = "top level must be a mapping of sections",
    fix: str = "start from `p2pfl-node provision` output",
) -> dict[str, Any]:
    """`read_yaml`, and a ConfigError (`problem`, `fix`) unless the file's top
    level is a mapping (a site.yaml's words by default; relay.yaml gives its own)."""
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(Path(path), "", problem, fix)
    return raw


def config_from_dict(
    raw: dict[str, Any], path: str | Path = "<config>", *, check_files: bool = True
) -> SiteConfig:
    path = Path(path)
    try:
        cfg = SiteConfig.model_validate(raw)
    except ValidationError as exc:
        raise config_error(path, exc) from None
    base = path.parent if path.name else Path(".")
    resolve_paths(
        base,
        (cfg.node, "state_dir"),
        (cfg.federation, "roster"),
        (cfg.identity, "signing_key"),
        (cfg.identity, "agreement_key"),
        (cfg.model, "weights"),
        (cfg.model, "pretrained_from"),
        (cfg.model, "tokenizer_from"),
        (cfg.status, "token_file"),
    )
    if cfg.transport.tls:
        resolve_paths(base, *((cfg.transport.tls, attr) for attr in TLS_FILES))
    resolve_data_source(cfg.data, base)
    resolve_genbuffer_paths(cfg.genbuffer, base, cfg.node.state_dir)
    if check_files:
        check_config_files(cfg, path)
    return cfg


TLS_FILES = ("cert", "key", "ca")  # transport.tls's PEM files, in the order they are checked


def tls_files_required(tls: TLSSection) -> list[tuple[str, Path | str | None, str]]:
    """`require_files` entries for transport.tls's PEM files (site and relay alike)."""
    return [
        (f"transport.tls.{attr}", getattr(tls, attr), "provide the PEM file") for attr in TLS_FILES
    ]


def check_config_files(cfg: SiteConfig, path: Path) -> None:
    required: list[tuple[str, Path | str | None, str]] = [
        (
            "federation.roster",
            cfg.federation.roster,
            "create it with `p2pfl-node provision` or `p2pfl-node roster add`",
        ),
        ("identity.signing_key", cfg.signing_key_path, "create it with `p2pfl-node keygen`"),
        ("identity.agreement_key", cfg.agreement_key_path, "create it with `p2pfl-node keygen`"),
        (
            "model.weights",
            cfg.model.weights,
            "point it at an existing weights file or remove the key",
        ),
        (
            "model.pretrained_from",
            cfg.model.pretrained_from,
            "run pre-training first or remove the key",
        ),
        (
            "model.tokenizer_from",
            cfg.model.tokenizer_from,
            "point it at a Fed-BEiT tokenizer.pt or remove the key to let the federation train one",
        ),
        (
            "status.token_file",
            cfg.status.token_file,
            "write the token into that file or remove the key",
        ),
        (
            "genbuffer.lpips_weights",
            cfg.genbuffer.lpips_weights,
            "point it at the torchvision ImageNet weights file or remove the key",
        ),
    ]
    if cfg.transport.tls:
        required += tls_files_required(cfg.transport.tls)
    if cfg.data.source != "digits":
        required.append(
            (
                "data.source",
                Path(cfg.data.source),
                "use 'digits', an .npz file or an ImageFolder directory",
            )
        )
    require_files(path, required)
    if not cfg.wire.encryption and roster_names_relays(cfg.federation.roster):
        raise ConfigError(path, "wire.encryption", *RELAY_NEEDS_ENCRYPTION)


def config_schema() -> dict[str, Any]:
    return SiteConfig.model_json_schema()


# What `p2pfl-node check` shows in place of an inline status token.
MASKED = "<set: not shown>"


def dump_config(cfg: SiteConfig) -> str:
    """The config as YAML, for a person to read. An inline status.token is
    masked: this goes to terminals, CI logs and support tickets, and the
    token opens the status endpoint."""
    data = json.loads(cfg.model_dump_json())
    if data["status"].get("token"):
        data["status"]["token"] = MASKED
    return yaml.safe_dump(data, sort_keys=False)
