"""Typed parameters of each protocol, as written under `protocol:` in site.yaml.

They live in the foundation (not in protocols/) because config validation must
not import the algorithms. Each params class's `name: Literal[...]` is where a
protocol's site.yaml name is written, the only place: `protocol_names()` and
`params_class(name)` are derived from the `ProtocolParams` union. A new protocol
adds one params class here, one entry in `ProtocolParams` and one file in
protocols/. Secure aggregation's ring, which the validators bound, is in
p2pfl/config/secagg_ring.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from p2pfl.config.secagg_ring import (
    SECAGG_MAX_STALENESS_RATIO,
    SECAGG_MIN_SUM,
    secagg_ring_bits,
    secagg_ring_overflow,
)


def compression_setting(value: str) -> str:
    """`protocol.compression` normalised (none, fp16, int8, topk:F with 0 < F < 1);
    ValueError in one line otherwise (protocols/compression.py has the formats)."""
    text = str(value).strip().lower()
    if text in ("none", "fp16", "int8"):
        return text
    fraction = text[5:] if text.startswith("topk:") else ""
    try:
        ok = 0.0 < float(fraction) < 1.0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"compression {value!r}: use none, fp16, int8 or topk:FRACTION with 0 < FRACTION < 1"
        )
    return f"topk:{float(fraction):g}"


class BaseParams(BaseModel):
    """What every protocol's parameters share (rounds, timeouts, evaluation)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    rounds: int = Field(10, ge=0, description="federated rounds this node runs")
    round_timeout_s: float = Field(120.0, gt=0, description="how long to wait for a peer's update")
    max_staleness: int = Field(
        1,
        ge=0,
        description="a pull for round r also accepts the peer's model of rounds r+1..r+max_staleness",
    )
    eval_every: int = Field(1, ge=1)
    min_peers: int | None = Field(
        None,
        ge=1,
        description="quorum: before exchanging, wait (phase waiting_for_quorum) until at least "
        "this many peers are alive, instead of going on with fewer; resumes by itself when "
        "they return. null: go on with whoever is alive",
    )
    max_norm_ratio: float | None = Field(
        10.0,
        gt=1.0,
        description="refuse a peer's model whose L2 norm is more than this many times the node's "
        "own (a huge-norm attack); null accepts any",
    )


class _Aggregation(BaseParams):
    """How a protocol that averages its neighbours' models or gradients merges
    them, and how far it trusts the sample counts they claim."""

    aggregation: Literal["mean", "median", "trimmed_mean", "norm_clip"] = "mean"
    trim_ratio: float = Field(
        0.2, ge=0.0, lt=0.5, description="trimmed_mean: share cut at each end"
    )
    clip_norm: float | None = Field(
        None,
        gt=0,
        description="norm_clip: max L2 norm of a neighbour's update (default: the median of "
        "the neighbours' update norms)",
    )
    max_weight_ratio: float | None = Field(
        16.0,
        ge=1.0,
        description="cap each neighbour's claimed sample count (or batch size) at this many "
        "times the median claim of the merge (own included); null = no cap. The roster card's "
        "max_samples caps a site's claims too",
    )
    compression: str = Field(
        "none",
        description="how models or gradients travel, federation-wide: none (float32), fp16, "
        "int8 (blockwise, one scale per 256 values) or topk:FRACTION (the largest entries); the "
        "lossy formats send the difference from a copy both ends hold, with error feedback "
        "(protocols/compression.py). A peer sending another format is refused",
    )

    @field_validator("compression")
    @classmethod
    def _known_compression(cls, value: str) -> str:
        return compression_setting(value)


class _SecureAggregation(_Aggregation):
    """The model exchange of FedAVGP2P and of the protocols that run it (SSFL,
    FedPerl, Fed-MAE), optionally through secure aggregation (protocols/secagg.py)."""

    secure_aggregation: bool = Field(
        False,
        description="obtain only the masked, weighted sum of the chosen neighbours' models "
        "(SecAgg without a server), never an individual model; this node serves none either",
    )
    secagg_threshold: int | None = Field(
        None,
        ge=1,
        description="Shamir threshold t of secure aggregation; default (and least accepted): "
        "floor(2h/3) + 1 of the h other contributors of a sum (Bonawitz et al. 2017, against a "
        "requester that deviates; it then takes 2t - h colluding contributors to peel a model). "
        "Higher: more colluders needed, fewer dropouts tolerated (h - t)",
    )
    secagg_min_contributors: int = Field(
        2,
        ge=2,
        le=64,
        description="the fewest contributors of a secure sum this node answers, and asks for "
        "(it asks max(k, this)). A requester picks the sum's size: with 2, one contributor "
        "colluding with it sees the other's model. `check` prints how many colluders and "
        "dropouts the sums then tolerate",
    )
    secagg_clip_norm: float | None = Field(
        None,
        gt=0,
        description="secure aggregation: this node scales its contributed model down to this L2 "
        "norm before masking (the requester cannot check a single contribution). Masked "
        "entries live in a 32-bit ring: n contributors x clip x 2^20 must stay below 2^31, n "
        "the roster's other sites (`check` refuses more); null: each entry is checked instead",
    )
    asynchronous: bool = Field(
        False,
        description="never wait for a neighbour's round-r model: merge the freshest model each "
        "chosen neighbour has, weighted by its sample count x (staleness + 1)^-staleness_exponent "
        "(FedAsync, Xie et al. 2019); a neighbour with no model yet is skipped; with "
        "secure_aggregation, a secure sum of the freshest models not yet in one of this "
        "node's sums, each weighted so by its contributor (not with fedperl)",
    )
    staleness_exponent: float = Field(
        0.5,
        ge=0.0,
        description="asynchronous: a of FedAsync's polynomial staleness weight (t - tau + 1)^-a, "
        "staleness t - tau in rounds; 0 weighs every model alike",
    )
    staleness_bound: int = Field(
        10,
        ge=0,
        description="asynchronous: a neighbour's model more than this many rounds behind this "
        "node's round is not merged (the next neighbour in the ranking is asked instead)",
    )

    @model_validator(mode="after")
    def _secure_aggregation_needs_the_mean(self) -> _SecureAggregation:
        method = getattr(self, "aggregation", "mean")
        if self.secure_aggregation and method != "mean":
            raise ValueError(
                f"aggregation {method!r} needs every neighbour's model, but with "
                "secure_aggregation a node only sees their sum: use aggregation: mean, or "
                "secure_aggregation: false"
            )
        return self

    @model_validator(mode="after")
    def _secure_sums_weigh_no_model_away(self) -> _SecureAggregation:
        """An asynchronous secure sum weighs a model tau rounds behind by
        (staleness_bound + 1)^-a at the least: a weight near zero would leave
        the sum one contributor's model, so it stays >= 1/SECAGG_MAX_STALENESS_RATIO."""
        if self.asynchronous and self.secure_aggregation:
            ratio = (self.staleness_bound + 1) ** self.staleness_exponent
            if ratio > SECAGG_MAX_STALENESS_RATIO:
                raise ValueError(
                    f"asynchronous secure sums weigh a model {self.staleness_bound} rounds stale "
                    f"1/{ratio:.3g} of a fresh one ((staleness_bound + 1)^staleness_exponent); "
                    f"more than {SECAGG_MAX_STALENESS_RATIO:g}x apart, the fresh contributors' "
                    "models would all but stand alone in the sum: lower staleness_bound or "
                    "staleness_exponent"
                )
        return self

    @model_validator(mode="after")
    def _secagg_clip_fits_the_ring(self) -> _SecureAggregation:
        """A clip norm no secure sum can carry, even of the fewest (two)
        contributors; `check` and `run` bound it by the roster's size too."""
        if self.secure_aggregation:
            problem = secagg_ring_overflow(SECAGG_MIN_SUM, self.secagg_clip_norm)
            if problem is not None:
                raise ValueError("; ".join(problem))
        return self

    @model_validator(mode="after")
    def _secure_aggregation_sums_dense_models(self) -> _SecureAggregation:
        if self.secure_aggregation and secagg_ring_bits(self.compression) is None:
            raise ValueError(
                f"compression {self.compression!r} with secure_aggregation: a secure sum adds "
                "every contributor's masked entries at the same positions, and top-k keeps "
                "other positions at every site; use none, fp16 or int8 (a 32-, 16- or 8-bit ring)"
            )
        return self


class _ModelAveraging(_SecureAggregation):
    """FedAVGP2P's exchange: k neighbours' models, averaged (robustly if asked)."""

    fraction: float = Field(
        0.5, gt=0.0, le=1.0, description="c: share of the other nodes to average with"
    )


class FedAvgP2PParams(_ModelAveraging):
    name: Literal["fedavgp2p"]


class FedSGDP2PParams(_Aggregation):
    name: Literal["fedsgdp2p"]
    fraction: float = Field(0.5, gt=0.0, le=1.0)
    step_timeout_s: float = Field(
        30.0, gt=0, description="how long to wait for a neighbour's gradient"
    )
    max_norm_ratio: float | None = Field(
        100.0,
        gt=1.0,
        description="refuse a neighbour's gradient whose L2 norm is more than this many times "
        "the node's own gradient of the same step; null accepts any. Honest gradients of one "
        "step differ far more than models do (up to 35x apart on the pneumoniamnist bench split)",
    )


class ProbeParams(BaseParams):
    """A connectivity and throughput check of the federation (no learning)."""

    name: Literal["probe"]
    payload_kb: int = Field(
        64, ge=0, le=1024 * 1024, description="size of the tensor pushed to each peer per round"
    )
    interval_s: float = Field(0.0, ge=0.0, description="pause between rounds")


class _SemiSupervised(_SecureAggregation):
    fraction: float = Field(
        0.5, gt=0.0, le=1.0, description="c of the FedAVGP2P exchange between rounds"
    )
    tau: float = Field(0.6, gt=0.0, le=1.0, description="pseudo-label confidence threshold")
    beta: float = Field(0.5, ge=0.0, description="weight of the unlabeled (strong-view) loss")
    unlabeled_ratio: int = Field(
        1, ge=1, description="unlabeled images per labeled image in a step (FixMatch mu)"
    )
    class_weighted: bool = Field(
        True, description="supervised CE weighted by median frequency / class frequency"
    )


class SSFLParams(_SemiSupervised):
    """FixMatch locally + FedAVGP2P between rounds (FedPerl with T = 0)."""

    name: Literal["ssfl"]


class FedPerlParams(_SemiSupervised):
    name: Literal["fedperl"]
    top_t: int = Field(
        2,
        ge=2,
        description="T: peers in the anonymized ensemble (>= 2: one peer's mean is its model)",
    )
    warmup_rounds: int = Field(
        10, ge=0, description="rounds of plain SSFL before peer learning starts"
    )
    gamma: float = Field(
        0.01, ge=0.0, description="weight of the consistency loss with the anonymized peer"
    )
    policy: Literal["static", "validation", "gated_validation", "gated_similarity"] = "static"
    rho: float = Field(0.85, description="gate of the gated policies")

    @model_validator(mode="after")
    def _asynchronous_not_with_secure_aggregation(self) -> FedPerlParams:
        if self.asynchronous and self.secure_aggregation:
            raise ValueError(
                "asynchronous cannot be used with secure_aggregation in fedperl: its secure "
                "sums are the anonymized peer over the community's round-r models, which waits "
                "for them; choose one of them"
            )
        return self


class _PreTraining(_ModelAveraging):
    """Self-supervised pre-training of a ViT encoder over FedAVGP2P's exchange,
    then (optionally) a chained fine-tuning protocol starting from it."""

    patch_size: int | None = Field(None, ge=1, description="default: chosen from the image size")
    encoder_depth: int | None = Field(
        None,
        ge=1,
        description="transformer blocks of the ViT encoder (default: the model's own, 12 for vit_tiny)",
    )
    encoder_out: str = Field(
        "pretrained_encoder.pt", description="written under the state dir at the end"
    )
    finetune: (
        Annotated[
            FedAvgP2PParams | FedSGDP2PParams | SSFLParams | FedPerlParams,
            Field(discriminator="name"),
        ]
        | None
    ) = Field(
        None,
        description="a protocol section (e.g. {name: fedavgp2p, rounds: 10}) run after pre-training, "
        "starting from the pre-trained encoder; with secure_aggregation it inherits "
        "secure_aggregation: true, and secagg_min_contributors and secagg_threshold where unset "
        "(a smaller one is refused)",
    )

    @model_validator(mode="after")
    def _secure_aggregation_covers_the_fine_tuning(self) -> _PreTraining:
        """`secure_aggregation: true` covers both stages. The fine-tuning section
        has its own flag (false by default), so without this the fine-tuned
        model was served in the clear to every peer, or FedSGDP2P's per-step
        gradients, from which images can be reconstructed (found by a review,
        2026-11-27). It is inherited where the section does not set it; a
        section that says false, or a fine-tuning stage that cannot be secure,
        is refused. After validation, so that every value pydantic reads as
        true (`1`, `"yes"`) counts, as a second review found."""
        finetune = self.finetune
        if not self.secure_aggregation or finetune is None:
            return self
        if isinstance(finetune, FedSGDP2PParams):
            raise ValueError(
                "secure_aggregation covers the fine-tuning stage too, and fedsgdp2p serves its "
                "per-step gradients in the clear: fine-tune with fedavgp2p, ssfl or fedperl, or "
                "turn secure_aggregation off"
            )
        if not finetune.secure_aggregation and "secure_aggregation" in finetune.model_fields_set:
            raise ValueError(
                "secure_aggregation: true covers the fine-tuning stage too, but finetune says "
                "secure_aggregation: false; remove it (the stage inherits true) or turn both off"
            )
        update = secure_finetune_update(self, finetune)
        if update:
            given = finetune.model_dump(exclude_unset=True)
            self.finetune = type(finetune).model_validate({**given, **update})
        return self


def secure_finetune_update(parent: Any, finetune: Any) -> dict[str, Any]:
    """What a fine-tuning section inherits from a pre-training with
    `secure_aggregation`: the flag, and the collusion bounds it leaves unset
    (`secagg_min_contributors`, `secagg_threshold`). Only the flag was
    inherited, so a federation that set secagg_min_contributors: 4 (three
    colluders needed) answered sums of two in fine-tuning, where one colluder
    and the requester peeled a model (a review, 2026-11-28). A section that
    sets a smaller minimum or threshold than the pre-training's is refused
    (ValueError; a smaller threshold was accepted: a second review)."""
    update: dict[str, Any] = {}
    if not getattr(finetune, "secure_aggregation", False):
        update["secure_aggregation"] = True
    given = finetune.model_fields_set
    least = int(getattr(parent, "secagg_min_contributors", 2))
    if "secagg_min_contributors" in given and finetune.secagg_min_contributors < least:
        raise ValueError(
            f"finetune.secagg_min_contributors {finetune.secagg_min_contributors} is below the "
            f"pre-training's {least}: secure aggregation's collusion bound covers both stages; "
            "remove it (the stage inherits it) or raise it"
        )
    top = getattr(parent, "secagg_threshold", None)
    if "secagg_threshold" in given and top is not None and (finetune.secagg_threshold or 0) < top:
        raise ValueError(
            f"finetune.secagg_threshold {finetune.secagg_threshold} is below the pre-training's "
            f"{top}: secure aggregation's collusion bound covers both stages; remove it (the "
            "stage inherits it) or raise it"
        )
    for name in ("secagg_min_contributors", "secagg_threshold"):
        value = getattr(parent, name, None)
        if name not in given and value is not None and getattr(finetune, name, None) != value:
            update[name] = value
    return update


class FedMAEParams(_PreTraining):
    """Masked-autoencoder pre-training of a ViT, peer to peer (then fine-tuning).

    The exchange between rounds is FedAVGP2P's (fraction, aggregation, the
    configured selection heuristic) over the encoder and decoder weights."""

    name: Literal["fedmae"]
    mask_ratio: float = Field(
        0.6, gt=0.0, lt=1.0, description="gamma: share of patches masked (Fed-MAE: 0.6)"
    )
    decoder_dim: int = Field(128, ge=8)
    decoder_depth: int = Field(2, ge=1)
    decoder_heads: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _decoder_heads_divide_dim(self) -> FedMAEParams:
        if self.decoder_dim % self.decoder_heads:
            raise ValueError(
                f"decoder_dim {self.decoder_dim} is not a multiple of decoder_heads {self.decoder_heads}"
            )
        return self


class FedBEiTParams(_PreTraining):
    """BEiT masked-token pre-training of a ViT, peer to peer, over visual tokens
    from a tokenizer the federation trains first (or `model.tokenizer_from`),
    then fine-tuning. Both stages exchange with FedAVGP2P."""

    name: Literal["fedbeit"]
    mask_ratio: float = Field(
        0.4,
        gt=0.0,
        lt=1.0,
        description="at most this share of patches masked, in blocks (BEiT: 0.4)",
    )
    min_block_patches: int | None = Field(
        None,
        ge=1,
        description="smallest masked block (default: BEiT's 16 of 196 patches, scaled to the grid)",
    )
    codebook_size: int = Field(256, ge=2, description="visual tokens (BEiT's dVAE: 8192)")
    code_dim: int = Field(32, ge=2, description="dimension of a codebook vector")
    tokenizer_hidden: int = Field(64, ge=4, description="channels of the tokenizer's convolutions")
    tokenizer_rounds: int = Field(
        10, ge=1, description="rounds of the tokenizer stage (unless model.tokenizer_from is set)"
    )
    tokenizer_lr: float | None = Field(
        None, gt=0.0, description="learning rate of the tokenizer stage (default: training.lr)"
    )
    tokenizer_out: str = Field(
        "tokenizer.pt", description="the trained tokenizer, written under the state dir"
    )


class FedERParams(BaseParams):
    """FedER relay (Alg. 1) and its privacy-enhanced variants (Sec. 4.4)."""

    name: Literal["feder", "feder_a", "feder_b"]
    buffer_size: int = Field(
        512,
        ge=1,
        le=2048,  # protocols.feder_buffers.MAX_BUFFER_IMAGES: what every peer takes
        description="synthetic images per buffer (paper: 512; at most 2048, what a peer takes)",
    )
    buffer_per_class: Literal["balanced", "prior"] = "balanced"
    lambda_: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        alias="lambda",
        description="Eq. 6 weight of the private half of each mini-batch",
    )
    successor: Literal["ring", "random", "heuristic"] = Field(
        "ring",
        description="ring: a fresh random ring per round, the same on every node; random: any alive peer (asynchronous, queued); heuristic: the selection section",
    )
    initial_epochs: int = Field(
        1, ge=0, description="epochs of M_i^0 on private data before federation"
    )
    generator: str | None = Field(
        None,
        description="a trained generator file (genbuffer train); default: train one before federation",
    )
    genbuffer: dict | None = Field(
        None,
        description="deprecated: GAN settings for training the generator here; use the "
        "site-level genbuffer: section, which `check` validates",
    )
    reset_optimizer: bool = Field(
        True, description="rebuild Adam each round, as the reference code does"
    )
    compression: str = Field(
        "none",
        description="how the relayed model travels, federation-wide: none, fp16, or int8 "
        "(blockwise); the raw model, with no shared reference and no error feedback (each hop "
        "rounds afresh); topk:F relays int8 (top-k of raw weights is no model)",
    )

    @field_validator("compression")
    @classmethod
    def _known_compression(cls, value: str) -> str:
        return compression_setting(value)


ProtocolParams = (
    FedAvgP2PParams
    | FedSGDP2PParams
    | ProbeParams
    | SSFLParams
    | FedPerlParams
    | FedMAEParams
    | FedBEiTParams
    | FedERParams
)


def _params_by_name() -> dict[str, type[BaseParams]]:
    by_name: dict[str, type[BaseParams]] = {}
    for cls in get_args(ProtocolParams):
        for name in get_args(cls.model_fields["name"].annotation):
            by_name[name] = cls
    return by_name


_PARAMS_BY_NAME = _params_by_name()


def protocol_names() -> list[str]:
    """Every protocol name site.yaml accepts, in the order of `ProtocolParams`."""
    return list(_PARAMS_BY_NAME)


def params_class(name: str) -> type[BaseParams]:
    """The params class whose `name` literal is `name` (FedERParams for feder,
    feder_a and feder_b); KeyError naming the known protocols otherwise."""
    try:
        return _PARAMS_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown protocol {name!r}; known: {', '.join(protocol_names())}") from None
