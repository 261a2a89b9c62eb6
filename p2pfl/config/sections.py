"""The sections of site.yaml as pydantic v2 models (all but `protocol:`, in
p2pfl.config.protocols, and `genbuffer:`, in p2pfl.config.genbuffer).

Every section forbids unknown keys, so a typo is an error rather than a
silently ignored setting.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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
    channels: int = Field(
        1, ge=1, le=4, description="1 (grey), 3 (RGB) or 4 (RGB and an opaque alpha)"
    )
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

    @field_validator("channels")
    @classmethod
    def _channels_images_have(cls, value: int) -> int:
        # 2 passed `check` and the node then stopped at its first image with
        # convert_images' ValueError, a traceback
        if value not in (1, 3, 4):
            raise ValueError(f"{value} channels: images have 1 (grey), 3 (RGB) or 4 (RGBA)")
        return value


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
        None, description="encoder weights from a pre-training run (Fed-MAE, Fed-BEiT)"
    )
    tokenizer_from: Path | None = Field(
        None,
        description="Fed-BEiT: a trained tokenizer file to use instead of training one in the federation",
    )
    siamese: SiameseSection = SiameseSection()


class DPSection(Section):
    """Differentially private local training (Opacus DP-SGD)."""

    noise_multiplier: float | None = Field(
        None, ge=0.0, description="Gaussian noise std / max_grad_norm (or give target_epsilon)"
    )
    target_epsilon: float | None = Field(
        None,
        gt=0.0,
        description="the ε the whole run may spend: the noise multiplier is computed for the "
        "protocol's rounds x the steps of a round (or give noise_multiplier)",
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="per-sample gradient clipping norm")
    delta: float | None = Field(
        None, gt=0.0, lt=1.0, description="δ of the (ε, δ) guarantee (default 1e-5)"
    )

    @model_validator(mode="after")
    def _one_noise_setting(self) -> DPSection:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("training.dp: give exactly one of noise_multiplier and target_epsilon")
        return self


class DPRecipeSection(Section):
    """How a site trains under training.dp (and, for a like-for-like baseline,
    with training.recipe: dp alone): De et al. 2022, "Unlocking high-accuracy
    differentially private image classification through scale" (Sec. 3),
    scaled to a hospital site of a few hundred to a few thousand images.
    `p2pfl.learning.dp_recipe` says what each setting does and why."""

    batch_size: int = Field(
        256,
        ge=2,
        description="expected logical batch: each image joins a step's batch with probability "
        "batch_size / train images (Poisson sampling; capped at the site's images)",
    )
    physical_batch_size: int = Field(
        64, ge=1, description="images per forward/backward pass (virtual steps; memory only)"
    )
    epochs: int = Field(
        4,
        ge=1,
        description="expected passes over the site's images per round (large batches take "
        "few steps per pass: more passes, as De et al.)",
    )
    augmult: int = Field(
        1,
        ge=1,
        description="augmentation multiplicity: each image's gradient is the mean over this "
        "many augmented views before clipping (De et al. Sec. 3.3)",
    )
    lr: float = Field(
        1.0,
        gt=0.0,
        description="SGD learning rate for the mean clipped gradient (chosen on validation: "
        "docs, bench.dp_utility)",
    )
    ema_decay: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="per-step EMA of the parameters over a round's steps, which becomes the "
        "round's model (0: off); post-processing, so free of privacy cost",
    )
    class_balance: Literal["after_clipping", "none"] = Field(
        "after_clipping",
        description="the site's class weights, scaled to at most 1, multiply each clipped "
        "per-sample gradient: minority classes keep their weight and the sensitivity stays "
        "max_grad_norm",
    )


class PersonalizationSection(Section):
    """Each site keeps, beside the federated model, a personal one, and reports,
    exports and predicts with whichever does better on its own validation split
    (`p2pfl.learning.personal`; docs/protocols.md#personalization)."""

    method: Literal["auto", "none", "finetune", "ditto"] = Field(
        "auto",
        description="finetune: after the last round, fine-tune the federated model on the "
        "site's train split (FedAvg + local fine-tuning; Cheng et al. 2021); ditto: a personal "
        "model trained every round beside the federated one, pulled towards it (Li et al. "
        "2021); none; auto: finetune, or none under training.dp (a personal model trained "
        "without DP would leave the site's guarantee behind)",
    )
    finetune_epochs: int = Field(
        10,
        ge=1,
        description="finetune: epochs over the site's train split at most (10: as many as a "
        "site alone trains in a 10-round run of one epoch each; chosen over 5 on a development "
        "copy without the test split); the epoch with the best validation score (select_by) "
        "is kept (early stopping on validation, never test)",
    )
    finetune_lr_factor: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="finetune: learning rate = training.lr x this (1: the training lr, as "
        "local adaptation in Yu et al. 2020; chosen over 0.1, the cosine schedule's last lr, "
        "on a development copy without the test split: docs/protocols.md#personalization)",
    )
    local_candidate: bool = Field(
        True,
        description="finetune: the model the site would have trained alone (from the weights "
        "the rounds start from, the same epochs x rounds and learning-rate schedule, its best "
        "epoch on validation) is a candidate for the personal model too, so a site the "
        "federation did not help on its validation split keeps what it would have had alone "
        "(costs one standalone training after the last round; chosen on a development copy "
        "without the test split: docs/protocols.md#personalization)",
    )
    ditto_lambda: float = Field(
        0.1,
        ge=0.0,
        description="ditto: weight of the proximal term lambda/2 ||v - w||^2 pulling the "
        "personal model v towards the federated w (Li et al. 2021, Alg. 1)",
    )
    local_norm: bool = Field(
        False,
        description="FedBN (Li et al. 2021, ICLR): BatchNorm weights and statistics stay the "
        "site's own; merging leaves them as they were (model-averaging protocols only)",
    )


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
    class_weighted: bool | Literal["auto"] = Field(
        "auto",
        description="weight cross-entropy by median class frequency / class frequency of the "
        "labelled train split: true, false, or auto (weighted when the split's imbalance "
        "exceeds imbalance_threshold)",
    )
    imbalance_threshold: float = Field(
        1.5,
        ge=1.0,
        description="class_weighted auto: weighted when the largest class of the labelled train "
        "split has more than this many times the images of the smallest class present",
    )
    lr_schedule: Literal["constant", "cosine", "step"] = Field(
        "cosine",
        description="learning rate over the protocol's rounds: cosine from lr in round 1 to "
        "lr x lr_min_factor in the last round, step (x lr_gamma every lr_step_rounds rounds), "
        "or constant",
    )
    lr_min_factor: float = Field(
        0.1, ge=0.0, le=1.0, description="cosine: the last round's lr is lr x this"
    )
    lr_step_rounds: int = Field(5, ge=1, description="step: rounds between two lr drops")
    lr_gamma: float = Field(0.5, gt=0.0, le=1.0, description="step: factor of each lr drop")
    dp: DPSection | None = Field(
        None,
        description="differentially private local training (Opacus: per-sample clipping, "
        "noise, RDP accountant); FedAVGP2P and FedSGDP2P only; trains with the dp recipe",
    )
    recipe: Literal["standard", "dp"] = Field(
        "standard",
        description="dp: train with dp_recipe (Poisson batches, augmentation multiplicity, "
        "class balance after clipping, EMA, SGD); set by training.dp, or alone for a "
        "non-private baseline of the same recipe",
    )
    dp_recipe: DPRecipeSection = DPRecipeSection()
    logit_adjustment: bool | Literal["federated"] = Field(
        False,
        description="balanced softmax (Ren et al. 2020; as FedLC, Zhang et al. 2022, for label "
        "skew): train on logits + log(site class prior), predict with the plain logits, so the "
        "federated model is not pulled towards each site's majority class; replaces "
        "class_weighted's weights when on. federated: only the models that are averaged (the "
        "federated model), while a site's own models (fine-tuned, trained alone, ditto) keep "
        "the class-weighted loss, as FedRoD (Chen & Chao 2022) trains its generic and "
        "personalized models",
    )
    personalization: PersonalizationSection = PersonalizationSection()
    select_by: Literal["macro_f1", "balanced_loss"] = Field(
        "balanced_loss",
        description="the validation figure that chooses among a site's models (the round kept "
        "as best, the fine-tuning epoch, personal or federated): macro_f1 (higher wins), or "
        "balanced_loss (the default: the mean over the classes present of each class's mean "
        "negative log-likelihood; lower wins), which moves with every image's probability where "
        "macro-F1 moves only when a prediction flips; chosen on a development copy of "
        "PneumoniaMNIST without its test split (docs/protocols.md#personalization)",
    )

    @model_validator(mode="after")
    def _dp_trains_with_its_recipe(self) -> TrainingSection:
        if self.logit_adjustment and (self.recipe == "dp" or self.dp is not None):
            raise ValueError(
                "training.logit_adjustment is not applied by the DP recipe's per-sample loss "
                "(training.dp or recipe: dp), which keeps its class balance after clipping: "
                "leave logit_adjustment out with the DP recipe"
            )
        if self.dp is not None:
            if "recipe" in self.model_fields_set and self.recipe != "dp":
                raise ValueError(
                    "training.dp trains with the DP recipe: remove training.recipe: standard"
                )
            self.recipe = "dp"
            if self.personalization.method in ("finetune", "ditto"):
                raise ValueError(
                    f"training.personalization.method {self.personalization.method} trains a "
                    "personal model without DP, which training.dp's guarantee would not cover: "
                    "use method none (or auto) with training.dp"
                )
        return self


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
        None,
        min_length=16,
        description="bearer token of every route but /healthz; default: status.token_file, "
        "else a random token the node keeps in STATE/status.token",
    )
    token_file: Path | None = None
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="names (or IP addresses) a browser may reach this endpoint by, beside "
        "localhost, 127.0.0.1, [::1] and status.host; any other Host header gets 403 "
        "(against DNS rebinding). Bound to 0.0.0.0 or ::, every IP address is accepted",
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _bare_host_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(r"[A-Za-z0-9.:_-]+", name.strip("[]")):
                raise ValueError(
                    f"status.allowed_hosts entry {name!r} is not a host name or IP address "
                    "(no scheme, path or port)"
                )
        return [name.strip("[]").lower().rstrip(".") for name in names]

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
    encryption: bool = Field(
        False,
        description="encrypt every payload to its recipient (heartbeats included) and refuse "
        "payloads that arrive in the clear; switch every site together",
    )
    replay_cache_size: int = Field(100_000, ge=16)
    replay_margin_s: float = Field(
        5.0,
        gt=0.0,
        le=60.0,
        description="how far ahead of each sender's newest accepted timestamp the replay marks "
        "are kept on disk: larger means fewer writes, and fresh messages refused (and sent "
        "again) for longer right after a restart",
    )


class TLSSection(Section):
    cert: Path
    key: Path
    ca: Path = Field(description="CA bundle used to verify peers' certificates")


# transport.max_connections_per_source, of the sites' and the relay's ports alike
MAX_CONNECTIONS_PER_SOURCE = Field(
    256,
    ge=1,
    description="of those, connections one source address holds at once (an IPv6 one by "
    "its /64; loopback sources are not capped); one more pushes out that source's own "
    "oldest connection still waiting for its headers, else it is closed at once "
    "(source_connection_limit). A peer opens up to 8. null: no such cap, for a port "
    "behind a proxy or load balancer that hides the peers' addresses (then every peer "
    "comes from the proxy's)",
)


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
    max_held_per_peer: int = Field(
        16, ge=1, description="requests one peer may have held open at once; more are refused"
    )
    max_connections: int = Field(
        16384,
        ge=1,
        description="connections the peer port holds at once (at most half the process's "
        "file-descriptor limit); one more is closed at once (connection_limit). A peer opens "
        "up to 8. High by default: a stranger can hold a place by asking something before "
        "each keep-alive ends, so the cap is what it must open",
    )
    max_connections_per_source: int | None = MAX_CONNECTIONS_PER_SOURCE
    min_upload_bytes_per_s: float = Field(
        65536.0,
        gt=0,
        description="an incoming payload must arrive within read_idle_timeout_s + its size at "
        "this rate, else it is cut off (upload_too_slow)",
    )
    link_mbit: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="emulated uplink of this site in Mbit/s: a token bucket on the bytes it "
        "sends, requests and replies (node/link.py); unset: unshaped. An emulation: tc tbf "
        "on a network namespace is the real thing",
    )
    tls: TLSSection | None = None

    @model_validator(mode="after")
    def _link_fast_enough(self) -> TransportSection:
        # Peers cut off an upload slower than their min_upload_bytes_per_s: a link
        # slower than that (the federation shares transport settings) could send nothing.
        if self.link_mbit is not None and self.link_mbit * 1e6 / 8 < self.min_upload_bytes_per_s:
            raise ValueError(
                f"link_mbit {self.link_mbit:g} ({self.link_mbit * 1e6 / 8:.0f} bytes/s) is "
                f"slower than min_upload_bytes_per_s ({self.min_upload_bytes_per_s:.0f}): "
                "peers would cut off every upload as upload_too_slow"
            )
        return self


class RelaySiteSection(Section):
    """This site as a relay for outbound-only sites (issue 31)."""

    serve: bool = Field(
        False,
        description="also relay for outbound-only sites (node/relay.py routes on this site's peer "
        "port): the roster's `relays:` must list this site's address; needs wire.encryption",
    )


class LoggingSection(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"
