"""site.yaml as pydantic v2 models.

Every section forbids unknown keys, so a typo is an error rather than a silently
ignored setting. `load_config` turns every failure a person can cause (missing
file, YAML syntax, wrong type, unknown protocol, missing key file) into one
`ConfigError` whose message names the file, the field path and the fix.
`read_yaml`, `config_error` and the `resolve_*` helpers are shared with the
genbuffer CLI's loader, which also reads a standalone `genbuffer:` YAML.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from p2pfl.errors import UserError
from p2pfl.protocol_params import ProtocolParams, protocol_names


class ConfigError(UserError):
    """A configuration mistake a person can fix; `str()` is the one-line message."""

    def __init__(self, file: str | Path, field: str, problem: str, fix: str = "") -> None:
        self.file = str(file)
        self.field = field
        self.problem = problem
        self.fix = fix
        where = f"{self.file}: {field}" if field else self.file
        super().__init__(f"{where}: {problem}" + (f" — {fix}" if fix else ""))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


def parse_hostport(value: str) -> tuple[str, int]:
    """'127.0.0.1:7000' or '[::1]:7000' -> (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range 1-65535")
    return host.strip("[]"), port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class NodeSection(Section):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="site name, as in the roster"
    )
    listen: str = Field("127.0.0.1:7000", description="HOST:PORT the peer transport binds to")
    advertise: str | None = Field(
        None, description="HOST:PORT peers use to reach this node; defaults to listen"
    )
    state_dir: Path = Field(Path("state"), description="keys, spool, checkpoints, metrics, log")
    startup_wait_s: float = Field(
        30.0,
        ge=0.0,
        description="wait up to this long for every roster peer before starting the protocol",
    )
    exit_when_done: bool = Field(
        False, description="exit once the protocol finished and every peer is done or gone"
    )

    @field_validator("listen", "advertise")
    @classmethod
    def _hostport(cls, v: str | None) -> str | None:
        if v is not None:
            parse_hostport(v)
        return v


class IdentitySection(Section):
    signing_key: Path | None = Field(
        None, description="Ed25519 private key (PEM); default STATE/keys/<name>.sign.pem"
    )
    agreement_key: Path | None = Field(
        None, description="X25519 private key (PEM); default STATE/keys/<name>.kex.pem"
    )


class FederationSection(Section):
    id: str = Field(
        min_length=1, max_length=64, description="federation id carried in every message header"
    )
    roster: Path = Field(description="roster YAML listing every site's address and public keys")
    seed: int = Field(0, description="shared seed (rings, partitions, tie-breaks)")


class DataSection(Section):
    source: str = Field(
        "digits",
        description="'digits' (embedded), a MedMNIST-style .npz, or an ImageFolder directory",
    )
    image_size: int = Field(28, ge=8, le=1024)
    channels: int = Field(1, ge=1, le=4)
    val_fraction: float = Field(
        0.15, ge=0.0, lt=1.0, description="split off train when the source has no val split"
    )
    label_fraction: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="keep labels for this share of train; rest becomes unlabeled",
    )
    augment: Literal["none", "weak", "strong"] = "weak"


class SiameseSection(Section):
    enabled: bool = False
    margin: float = Field(1.0, gt=0.0, description="contrastive-loss margin m")
    embedding_dim: int = Field(64, ge=2)


class ModelSection(Section):
    name: str = Field(
        "small_cnn",
        description="small_cnn, resnet18, efficientnet_b0, mobilenetv2_100, vit_tiny_patch16_224, ...",
    )
    weights: Path | None = Field(
        None, description="local weights file (safetensors or torch state dict) to start from"
    )
    init: Literal["default", "xavier"] = "default"
    pretrained_from: Path | None = Field(
        None, description="encoder weights from a pre-training run (Fed-MAE)"
    )
    siamese: SiameseSection = SiameseSection()


class TrainingSection(Section):
    epochs: int = Field(1, ge=1, description="local epochs per round (E)")
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    optimizer: Literal["adam", "sgd"] = "adam"
    weight_decay: float = Field(0.0, ge=0.0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    devices: int = Field(1, ge=1, description="data-parallel processes for local training")
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for torch (default: torch's choice; set 1 when several nodes share a machine)",
    )
    seed: int = 0
    max_steps_per_epoch: int | None = Field(
        None, ge=1, description="cap local steps (demos, tests)"
    )
    steps_per_round: int | None = Field(
        None,
        ge=1,
        description="local steps per round instead of epochs (equal work per site, whatever its size)",
    )
    class_weighted: bool = Field(
        False,
        description="weight cross-entropy by median class frequency / class frequency of the labelled train split",
    )


class SelectionSection(Section):
    name: Literal["random", "n_latest", "f1", "cosine"] = "random"
    n: int = Field(
        1,
        ge=0,
        description="n_latest, f1, cosine: how many recent neighbours to avoid (DFU client.last)",
    )
    prefer: Literal["dissimilar", "similar"] | None = Field(
        None, description="default: the heuristic's own (f1: dissimilar, cosine: similar)"
    )
    vector: Literal["f1", "model_stats"] = Field(
        "f1", description="cosine: compare per-class F1 or model statistics"
    )


class StatusSection(Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, lt=65536)
    token: str | None = Field(
        None, min_length=16, description="bearer token; required off loopback"
    )
    token_file: Path | None = None

    @model_validator(mode="after")
    def _token_off_loopback(self) -> StatusSection:
        if self.enabled and not is_loopback(self.host) and not (self.token or self.token_file):
            raise ValueError(
                f"status endpoint bound to non-loopback address {self.host!r} needs a bearer token: "
                "set status.token (16+ characters) or status.token_file, or bind status.host to 127.0.0.1"
            )
        return self


class WireSection(Section):
    max_message_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    clock_skew_s: float = Field(300.0, gt=0.0)
    encryption: bool = False
    replay_cache_size: int = Field(100_000, ge=16)


class TLSSection(Section):
    cert: Path
    key: Path
    ca: Path = Field(description="CA bundle used to verify peers' certificates")


class TransportSection(Section):
    connect_timeout_s: float = Field(5.0, gt=0)
    request_timeout_s: float = Field(60.0, gt=0)
    retries: int = Field(4, ge=0)
    backoff_base_s: float = Field(0.2, gt=0)
    backoff_max_s: float = Field(10.0, gt=0)
    breaker_failures: int = Field(
        5, ge=1, description="consecutive failures that open a peer's circuit"
    )
    breaker_reset_s: float = Field(15.0, gt=0)
    heartbeat_s: float = Field(2.0, gt=0)
    suspect_after_s: float = Field(6.0, gt=0)
    dead_after_s: float = Field(15.0, gt=0)
    inbox_size: int = Field(256, ge=1)
    outbox_ttl_s: float = Field(
        3600.0, gt=0, description="how long a push interrupted by a crash is retried after restart"
    )
    rate_limit_per_s: float = Field(
        200.0, gt=0, description="messages per second accepted from one peer"
    )
    read_idle_timeout_s: float = Field(
        30.0, gt=0, description="an incoming message that sends no bytes this long is cut off"
    )
    tls: TLSSection | None = None


class LoggingSection(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"


class GenbufferSection(Section):
    """Privacy-preserving GAN (FedER Sec. 3.2 / 4.2.2), synthetic buffers and the privacy audit."""

    # --- network (StyleGAN2) ---------------------------------------------------------------
    resolution: int = Field(32, description="image side the GAN works at: a power of two, 16-256")
    channels: int | None = Field(
        None, ge=1, le=16, description="image channels; default: those of the data"
    )
    z_dim: int = Field(128, ge=1, description="latent z size")
    w_dim: int = Field(128, ge=1, description="intermediate latent w size")
    mapping_layers: int = Field(4, ge=1, le=8, description="layers of the mapping network")
    channel_base: int = Field(
        4096, ge=16, description="feature maps at resolution r: min(channel_base / r, channel_max)"
    )
    channel_max: int = Field(256, ge=1)
    # --- optimisation -------------------------------------------------------------------------
    batch_size: int = Field(32, ge=2, description="minibatch (FedER: 32)")
    lr: float = Field(0.0025, gt=0.0, description="Adam learning rate of G and D (FedER: 0.0025)")
    adam_betas: tuple[float, float] = Field((0.0, 0.99), description="Adam betas of G and D")
    r1_gamma: float | None = Field(
        None, ge=0.0, description="R1 weight; default 0.0002 * resolution^2 / batch_size"
    )
    r1_interval: int = Field(
        16, ge=1, description="apply R1 every this many D steps (lazy regularization)"
    )
    ema_half_life_images: int = Field(
        10_000, ge=1, description="half-life of the generator EMA, in images"
    )
    ema_rampup: float | None = Field(
        0.05, gt=0.0, description="EMA half-life at most this share of the images seen so far"
    )
    style_mixing_prob: float = Field(0.9, ge=0.0, le=1.0)
    # --- adaptive discriminator augmentation ---------------------------------------------------
    augment: bool = Field(True, description="adaptive discriminator augmentation on/off")
    ada_target: float = Field(0.6, gt=0.0, lt=1.0, description="target of r_t = E[sign(D(real))]")
    ada_interval: int = Field(4, ge=1, description="adjust p every this many D steps")
    ada_speed_images: int = Field(
        500_000, ge=1, description="images over which p can move from 0 to 1"
    )
    # --- privacy loss (FedER Eq. 3-5) ----------------------------------------------------------
    alpha: float = Field(
        1.0, ge=0.0, description="weight of the LPIPS privacy term: L_G-PP = L_G - alpha * L_PP"
    )
    pp_normalization: Literal["pairs", "batch"] = Field(
        "pairs",
        description="L_PP = sum of the pairwise distances divided by the number of pairs (a mean), "
        "or by the batch size as FedER Eq. 3 writes it (batch size times the mean)",
    )
    lpips_backbone: Literal["alex", "vgg", "random"] = Field(
        "alex",
        description="ImageNet backbone under LPIPS; 'random' is for tests only and gives no real privacy",
    )
    lpips_weights: Path | None = Field(
        None,
        description="torchvision ImageNet weights file of the backbone; default: the torch hub cache",
    )
    lpips_min_size: int = Field(
        64, ge=16, description="smaller images are upsampled to this side before LPIPS"
    )
    # --- two-stage training (FedER Sec. 4.2.2) -------------------------------------------------
    iterations: int = Field(50_000, ge=1, description="stage 1 (no privacy loss): most iterations")
    stage1_patience: int = Field(
        10_000,
        ge=1,
        description="stage 1 stops after this many iterations without a better quality score",
    )
    stage2_iterations: int = Field(
        10_000, ge=0, description="stage 2 (with privacy loss): most iterations"
    )
    stage2_degrade_factor: float = Field(
        2.5,
        gt=1.0,
        description="stage 2 stops once the quality score exceeds this factor times stage 1's",
    )
    quality_features: Literal["classifier", "lpips"] = Field(
        "classifier",
        description="Frechet distance on a small CNN trained on the site's images, or on the LPIPS backbone's features",
    )
    quality_classifier_steps: int = Field(
        500, ge=1, description="training steps of the quality-score CNN"
    )
    quality_every: int = Field(500, ge=1, description="iterations between quality evaluations")
    stage2_quality_every: int | None = Field(
        None,
        ge=1,
        description="iterations between quality evaluations in stage 2; default quality_every",
    )
    quality_samples: int = Field(1000, ge=16, description="synthetic images per quality evaluation")
    train_reference: bool = Field(
        True, description="also continue stage 1 without the privacy loss, for the audit"
    )
    checkpoint_every: int = Field(
        1000, ge=1, description="iterations between resumable training-state saves"
    )
    # --- buffers ------------------------------------------------------------------------------
    buffer_size: int = Field(512, ge=1, description="synthetic images per buffer (B)")
    per_class: Literal["balanced", "prior"] = Field(
        "balanced", description="equal counts per class, or the local label prior"
    )
    truncation_psi: float = Field(1.0, gt=0.0, le=1.0)
    # --- audit (FedER Sec. 4.4) ---------------------------------------------------------------
    audit_images: int = Field(64, ge=1, description="real training images projected into W")
    audit_steps: int = Field(300, ge=1, description="optimisation steps per projection")
    audit_lr: float = Field(0.1, gt=0.0)
    # --- where and how ------------------------------------------------------------------------
    out_dir: Path = Field(
        Path("genbuffer"),
        description="checkpoints, buffers and audit files; default in a site.yaml: STATE/genbuffer",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0

    @field_validator("resolution")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 16 or v > 256 or v & (v - 1):
            raise ValueError(
                f"{v} is not a power of two between 16 and 256 — use 16, 32, 64, 128 or 256"
            )
        return v

    @field_validator("lpips_weights")
    @classmethod
    def _weights_need_imagenet_backbone(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        # A field validator (lpips_backbone is declared first), so the error names lpips_weights.
        if v is not None and info.data.get("lpips_backbone") == "random":
            raise ValueError(
                "set, but lpips_backbone 'random' loads no weights — remove one of the two keys"
            )
        return v

    def stage2_settings(self) -> dict[str, object]:
        """The settings that define stage 2; changing them redoes stage 2 from the stage-1 result."""
        return {
            "alpha": self.alpha,
            "pp_normalization": self.pp_normalization,
            "stage2_iterations": self.stage2_iterations,
            "stage2_degrade_factor": self.stage2_degrade_factor,
            "stage2_quality_every": self.stage2_quality_every or self.quality_every,
            "train_reference": self.train_reference,
        }

    def effective_r1_gamma(self) -> float:
        """StyleGAN2-ADA's heuristic: 0.0002 * resolution^2 / batch_size."""
        if self.r1_gamma is not None:
            return self.r1_gamma
        return 0.0002 * self.resolution**2 / self.batch_size


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


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in protocol_names() and parts and parts[-1] == "protocol":
            continue  # discriminated-union tag: the user wrote protocol.<field>, not protocol.<name>.<field>
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def _describe(err: dict[str, Any]) -> tuple[str, str]:
    kind = err["type"]
    if kind == "extra_forbidden":
        return (
            "unknown key",
            "remove it or check its spelling (`p2pfl-node schema` lists every key)",
        )
    if kind == "missing":
        return "required key is missing", "add it (`p2pfl-node schema` shows its type)"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return (
            f"unknown protocol {err.get('input', {}).get('name') if isinstance(err.get('input'), dict) else ''!r}".replace(
                "''", "(none)"
            ),
            "set protocol.name to one of: " + ", ".join(protocol_names()),
        )
    if kind == "literal_error":
        return err["msg"], "use one of the listed values"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, "), ""
    return err["msg"], "fix the value (`p2pfl-node schema` shows the expected type)"


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


def config_error(path: str | Path, exc: ValidationError) -> ConfigError:
    """The first pydantic error as the one-line FILE: FIELD: problem — fix message."""
    err = exc.errors()[0]
    problem, fix = _describe(err)
    loc = tuple(err["loc"])
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        loc = ("protocol", "name")
    return ConfigError(path, _field_path(loc), problem, fix)


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


def config_schema() -> dict[str, Any]:
    return SiteConfig.model_json_schema()


def dump_config(cfg: SiteConfig) -> str:
    return yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False)
