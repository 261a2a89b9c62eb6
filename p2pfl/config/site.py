"""A whole site.yaml: `SiteConfig`, and reading, validating and resolving it.

`load_config` turns every failure a person can cause (missing file, YAML
syntax, wrong type, unknown protocol, missing key file) into one `ConfigError`
whose message names the file, the field path and the fix. `read_yaml` and the
`resolve_*` helpers are shared with the genbuffer CLI's loader, which also
reads a standalone `genbuffer:` YAML.
"""

from __future__ import annotations

import json
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


def _resolve(path: Path | None, base: Path) -> Path | None:
    if path is None:
        return None
    path = path.expanduser()
    return path if path.is_absolute() else (base / path)


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
        section.out_dir = _resolve(section.out_dir, base)  # type: ignore[assignment]
    section.lpips_weights = _resolve(section.lpips_weights, base)


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
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(
            path,
            "",
            "top level must be a mapping of sections",
            "start from `p2pfl-node provision` output",
        )
    return config_from_dict(raw, path, check_files=check_files)


def config_from_dict(
    raw: dict[str, Any], path: str | Path = "<config>", *, check_files: bool = True
) -> SiteConfig:
    path = Path(path)
    try:
        cfg = SiteConfig.model_validate(raw)
    except ValidationError as exc:
        raise config_error(path, exc) from None
    base = path.parent if path.name else Path(".")
    cfg.node.state_dir = _resolve(cfg.node.state_dir, base)  # type: ignore[assignment]
    cfg.federation.roster = _resolve(cfg.federation.roster, base)  # type: ignore[assignment]
    for section, attr in (
        (cfg.identity, "signing_key"),
        (cfg.identity, "agreement_key"),
        (cfg.model, "weights"),
        (cfg.model, "pretrained_from"),
        (cfg.model, "tokenizer_from"),
        (cfg.status, "token_file"),
    ):
        setattr(section, attr, _resolve(getattr(section, attr), base))
    if cfg.transport.tls:
        for attr in ("cert", "key", "ca"):
            setattr(cfg.transport.tls, attr, _resolve(getattr(cfg.transport.tls, attr), base))
    resolve_data_source(cfg.data, base)
    resolve_genbuffer_paths(cfg.genbuffer, base, cfg.node.state_dir)
    if check_files:
        check_config_files(cfg, path)
    return cfg


def check_config_files(cfg: SiteConfig, path: Path) -> None:
    required: list[tuple[str, Path | None, str]] = [
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
        for attr in ("cert", "key", "ca"):
            required.append(
                (f"transport.tls.{attr}", getattr(cfg.transport.tls, attr), "provide the PEM file")
            )
    if cfg.data.source != "digits":
        required.append(
            (
                "data.source",
                Path(cfg.data.source),
                "use 'digits', an .npz file or an ImageFolder directory",
            )
        )
    for field, file, fix in required:
        if file is not None and not Path(file).exists():
            raise ConfigError(path, field, f"file not found: {file}", fix)
    if not cfg.wire.encryption and roster_names_relays(cfg.federation.roster):
        raise ConfigError(path, "wire.encryption", *RELAY_NEEDS_ENCRYPTION)


def config_schema() -> dict[str, Any]:
    return SiteConfig.model_json_schema()


def dump_config(cfg: SiteConfig) -> str:
    return yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False)
