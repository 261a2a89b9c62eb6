"""Model registry and factory: our small CNN, timm backbones, and the Siamese variant.

Every model a site.yaml `model.name` can name is a builder registered with
`@register_model` under its function name (timm style); `create_model(name,
in_chans=, num_classes=, image_size=)` builds one and `list_models()` names
them. A new model is one builder function here. (`p2pfl.learning.site_model`
turns a whole `model:` section into the site's model.)

Siamese variant (DFU paper, Sec. 2.1 and Fig. 4): one encoder with shared
weights embeds both images of a pair; the contrastive loss (Eq. 1) pulls
same-class embeddings together and pushes different-class ones at least the
margin m apart. A sample is classified by its nearest class prototype, the mean
training embedding of each class, and the softmax over negative distances to
the prototypes gives scores for the metrics.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

# A builder takes in_chans, num_classes and image_size (keywords) and returns a
# module with random weights.
ModelBuilder = Callable[..., nn.Module]

_MODELS: dict[str, ModelBuilder] = {}


class ModelError(Exception):
    """A model that cannot be built or loaded; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def model_name_error(reason: str, problem: str, fix: str) -> ModelError:
    """The error of a `model.name` that cannot be built: the line `p2pfl-node
    check` prints for it (`p2pfl.learning.site_model.check_model_name`), without
    the file."""
    return ModelError(reason, f"model.name: {problem} — {fix}")


# ---------------------------------------------------------------------- registry


def register_model(builder: ModelBuilder) -> ModelBuilder:
    """Decorator: register `builder` under its function name, the `model.name`
    a site.yaml writes."""
    name = builder.__name__
    if name in _MODELS:
        raise ValueError(f"model {name!r} is registered twice")
    _MODELS[name] = builder
    return builder


def list_models() -> list[str]:
    """The registered model names, in registration order (small_cnn first)."""
    return list(_MODELS)


def unknown_model(name: str) -> tuple[str, str] | None:
    """(problem, fix) when no builder is registered under `name`, else None."""
    if name in _MODELS:
        return None
    return f"unknown model {name!r}", f"known models are {', '.join(list_models())}"


class WSConv2d(nn.Conv2d):
    """A convolution whose weights are standardized per output channel (zero
    mean, unit variance over fan-in) before use: Qiao et al. 2019, "Micro-Batch
    Training with Batch-Channel Normalization and Weight Standardization";
    with GroupNorm it is what De et al. 2022 (Sec. 3.2) train privately. Opacus
    has no per-sample rule for it, so it takes its per-sample gradients with
    functorch, through the standardization."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) / torch.sqrt(var + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class SmallCNN(nn.Module):
    """Three conv-norm-ReLU blocks (16, 32, 64 channels; BatchNorm, or GroupNorm
    with norm="group"), the first two followed by
    2x2 max pooling, global average pooling and a linear classifier. Works from
    8x8 upward and trains in well under a second per epoch on a few hundred
    28x28 images on one CPU core."""

    def __init__(
        self,
        in_chans: int = 1,
        num_classes: int = 10,
        widths: tuple[int, int, int] = (16, 32, 64),
        norm: str = "batch",
        weight_standardization: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        previous = in_chans
        for index, width in enumerate(widths):
            # The stem stays a plain convolution: on a one-channel image a standardized
            # (zero-mean) 3x3 filter cannot see brightness, which is what an X-ray's
            # opacity is (validation macro-F1 0.49 with it, 0.71 without, issue 33).
            conv = WSConv2d if weight_standardization and index > 0 else nn.Conv2d
            layers += [
                conv(previous, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width) if norm == "batch" else nn.GroupNorm(min(8, width), width),
                nn.ReLU(inplace=norm == "batch"),  # Opacus's hooks forbid in-place ops
            ]
            if index < len(widths) - 1:
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
            previous = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.num_features = previous
        self.classifier = nn.Linear(previous, num_classes)

    def forward_features(self, x: Tensor) -> Tensor:
        return self.pool(self.features(x)).flatten(1)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.forward_features(x))


SCATTER_J = 2  # scales: the features are at 1/4 of the image's side
SCATTER_GROUPS = 27  # Tramèr & Boneh 2021: GroupNorm of 27 groups on the 81 channels


class ScatterNetLinear(nn.Module):
    """A linear classifier on a fixed scattering transform: Tramèr & Boneh 2021,
    "Differentially Private Learning Needs Better Features (or Much More
    Data)", ICLR 2021 (ScatterNet+linear, Sec. 3). The features are the
    wavelet scattering coefficients of Oyallon & Mallat (J = 2, L = 8
    orientations, orders 0-2: 81 channels per input channel at 1/4 of the
    image's side), computed by kymatio and never trained; GroupNorm
    (27 groups, per image, so no privacy cost) normalizes them, and one
    linear layer classifies. Only GroupNorm's affine weights and the linear
    layer train, on features that need no data, which is what DP-SGD on
    small data does best with (the paper's Table 1). The linear layer has
    81 x channels x (side / 4)^2 x classes weights: 7,938 at 28 px, one
    channel, two classes, but 1.5 M at 224 px in RGB; it is a model for
    small images.

    The transform's filters are non-persistent buffers: `.to()` moves them,
    but they are not in the state dict (they are fixed and rebuilt from J, L,
    the image size and kymatio's version, pinned in pyproject.toml), so peers
    exchange, check and average only what trains."""

    # export formats this model cannot be written in, and why (p2pfl.learning.export)
    export_refusals: ClassVar[dict[str, str]] = {
        "torchscript": "cannot be traced to TorchScript (kymatio's scattering is a "
        "Python autograd function)"
    }

    def __init__(self, in_chans: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.scattering = _scattering_2d(image_size=image_size)
        for name, buffer in list(self.scattering.named_buffers(recurse=False)):
            self.scattering.register_buffer(name, buffer, persistent=False)
        with torch.no_grad():
            probe = self.scattering(torch.zeros(1, in_chans, image_size, image_size))
        channels, h, w = in_chans * probe.shape[-3], probe.shape[-2], probe.shape[-1]
        self.norm = nn.GroupNorm(SCATTER_GROUPS, channels)
        self.num_features = channels * h * w
        self.classifier = nn.Linear(self.num_features, num_classes)

    def _scatter(self, x: Tensor) -> Tensor:
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            out = self.scattering(x.float().contiguous())  # (B, C, 81, h, w)
        return out.flatten(1, 2)

    def forward_features(self, x: Tensor) -> Tensor:
        return self.norm(self._scatter(x)).flatten(1)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.forward_features(x))


def _scattering_2d(*, image_size: int) -> nn.Module:
    """kymatio's 2-D scattering in torch. Imported from its 2-D frontend: the
    package's top level (`kymatio.torch`) also imports its 3-D transform, which
    needs `scipy.special.sph_harm`, gone from SciPy 1.15."""
    try:
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D
    except ImportError as exc:
        raise model_name_error(
            "kymatio_missing",
            f"scatternet_linear needs kymatio ({exc})",
            "pip install 'kymatio==0.3.0'",
        ) from None
    return ScatteringTorch2D(J=SCATTER_J, shape=(image_size, image_size), L=8)


def vit_patch_size(image_size: int) -> int:
    """Largest of 16, 14, 8, 7, 4, 2, 1 that divides image_size and leaves a grid of
    at least 7x7 patches (224 -> 16, 28 -> 4, 8 -> 1)."""
    for patch in (16, 14, 8, 7, 4, 2, 1):
        if image_size % patch == 0 and image_size // patch >= 7:
            return patch
    return 1


def xavier_init_(model: nn.Module) -> nn.Module:
    """Xavier-uniform weights and zero biases for every conv and linear layer."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


def read_weights_file(path: str | Path) -> dict[str, Tensor]:
    """A state dict from a safetensors file (when the package is installed) or a
    torch file loaded with weights_only=True; {'state_dict': ...} / {'model': ...}
    wrappers are unwrapped."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(
            "weights_not_found",
            f"{path}: weights file not found — fix model.weights or remove the key",
        )
    try:
        if path.suffix == ".safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise ModelError(
                    "safetensors_missing",
                    f"{path}: a .safetensors file needs the 'safetensors' package — pip install safetensors",
                ) from None
            state: object = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch/safetensors raise many types for a bad file
        raise ModelError(
            "corrupt_weights", f"{path}: cannot read weights ({exc}) — re-export the file"
        ) from None
    if isinstance(state, dict):
        for wrapper in ("state_dict", "model"):
            if wrapper in state and isinstance(state[wrapper], dict):
                state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ModelError(
            "corrupt_weights", f"{path}: not a state dict of tensors — save model.state_dict()"
        )
    return state  # type: ignore[return-value]


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a local weights file into `model` (strict)."""
    return load_state(model, read_weights_file(path), path)


def load_state(model: nn.Module, state: dict[str, Tensor], path: str | Path) -> nn.Module:
    """Load `state`, read from `path`, into `model` (strict)."""
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelError(
            "weights_mismatch",
            # torch's first line names only the class; the second says what did not fit
            f"{path}: weights do not fit the model: "
            f"{' '.join(line.strip() for line in str(exc).strip().splitlines()[:2])[:300]} — "
            "check model.name, data.channels and the number of classes",
        ) from None
    return model


def create_model(
    name: str,
    *,
    in_chans: int,
    num_classes: int,
    image_size: int,
    init: Literal["default", "xavier"] = "default",
    weights: Path | None = None,
) -> nn.Module:
    """Build the registered model `name` with random weights, optionally Xavier
    initialised, optionally loaded from a local weights file."""
    problem = unknown_model(name)
    if problem is not None:
        raise model_name_error("unknown_model", *problem)
    model = _MODELS[name](in_chans=in_chans, num_classes=num_classes, image_size=image_size)
    if init == "xavier":
        xavier_init_(model)
    elif init != "default":
        raise ValueError(f"unknown init {init!r}: use 'default' or 'xavier'")
    if weights is not None:
        load_weights(model, weights)
    return model


# ---------------------------------------------------------------------- the models


@register_model
def small_cnn(*, in_chans: int, num_classes: int, image_size: int) -> nn.Module:
    """`SmallCNN`: any image size from 8x8 up."""
    return SmallCNN(in_chans=in_chans, num_classes=num_classes)


@register_model
def small_cnn_gn(*, in_chans: int, num_classes: int, image_size: int) -> nn.Module:
    """`SmallCNN` with GroupNorm (8 groups) instead of BatchNorm: per-sample
    gradients exist, so it trains under differential privacy (training.dp)."""
    return SmallCNN(in_chans=in_chans, num_classes=num_classes, norm="group")


@register_model
def small_cnn_ws(*, in_chans: int, num_classes: int, image_size: int) -> nn.Module:
    """`SmallCNN` with GroupNorm and weight-standardized convolutions after the
    stem: the architecture of training.dp's recipe (De et al. 2022, Sec. 3.2)."""
    return SmallCNN(
        in_chans=in_chans, num_classes=num_classes, norm="group", weight_standardization=True
    )


@register_model
def scatternet_linear(*, in_chans: int, num_classes: int, image_size: int) -> nn.Module:
    """`ScatterNetLinear`: fixed scattering features (kymatio), GroupNorm and a
    linear classifier; a model for training.dp on small sites (Tramèr & Boneh
    2021)."""
    return ScatterNetLinear(in_chans=in_chans, num_classes=num_classes, image_size=image_size)


def timm_model(name: str, *, in_chans: int, num_classes: int, **kwargs: object) -> nn.Module:
    """timm's `name` with random weights (nothing is downloaded)."""
    import timm  # slow to import; a small_cnn site never needs it

    return timm.create_model(
        name, pretrained=False, in_chans=in_chans, num_classes=num_classes, **kwargs
    )


@register_model
def efficientnet_b0(*, in_chans: int, num_classes: int, image_size: int) -> nn.Module:
    return timm_model("efficientnet_b0", in_chans=in_chans, num_classes=num_classes)


@register_model
def mobilenetv2_100(*, in_chans: int, num_classes: int, image_size: int) -> nn.Module:
    return timm_model("mobilenetv2_100", in_chans=in_chans, num_classes=num_classes)


@register_model
def resnet18(*, in_chans: int, num_classes: int, image_size: int) -> nn.Module:
    return timm_model("resnet18", in_chans=in_chans, num_classes=num_classes)


@register_model
def vit_tiny_patch16_224(*, in_chans: int, num_classes: int, image_size: int) -> nn.Module:
    """ViT-Tiny at the data's image size, patches of `vit_patch_size(image_size)`."""
    return timm_model(
        "vit_tiny_patch16_224",
        in_chans=in_chans,
        num_classes=num_classes,
        img_size=image_size,
        patch_size=vit_patch_size(image_size),
    )


# ---------------------------------------------------------------------- Siamese


def contrastive_loss(embeddings: Tensor, labels: Tensor, margin: float) -> Tensor:
    """DFU paper Eq. 1 over every pair (i < j) of a batch:
    (1 - Y) * 1/2 * D^2 + Y * 1/2 * max(0, m - D)^2, with Y = 1 for a dissimilar
    (different-class) pair and D the Euclidean distance of the two embeddings.
    Similar and dissimilar pairs are averaged separately and added, so the
    (usually rarer) similar pairs are not drowned out."""
    diff = embeddings[:, None, :] - embeddings[None, :, :]
    squared = diff.pow(2).sum(-1)
    distance = (squared + 1e-12).sqrt()
    n = len(labels)
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool, device=labels.device), diagonal=1)
    dissimilar = (labels[:, None] != labels[None, :]) & upper
    similar = (labels[:, None] == labels[None, :]) & upper
    loss = embeddings.new_zeros(())
    if similar.any():
        loss = loss + 0.5 * squared[similar].mean()
    if dissimilar.any():
        loss = loss + 0.5 * (margin - distance[dissimilar]).clamp_min(0).pow(2).mean()
    return loss


class SiameseNet(nn.Module):
    """Twin encoder (one set of weights) + nearest-prototype classifier.

    `embed(x)` gives L2-normalised embeddings; `forward(x)` gives class scores
    -distance / T to each prototype, T = 0.1 * margin, so softmax(forward(x)) is a
    probability per class. Prototypes are a non-persistent buffer: they are not
    part of the state dict peers exchange, and each site recomputes them from its
    own training set (`set_prototypes`). Classes without a prototype score -1e4."""

    def __init__(
        self, encoder: nn.Module, *, num_classes: int, embedding_dim: int, margin: float = 1.0
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.num_classes = num_classes
        self.embedding_dim = embedding_dim
        self.margin = margin
        self.temperature = 0.1 * margin
        self.register_buffer(
            "prototypes", torch.zeros(num_classes, embedding_dim), persistent=False
        )
        self.register_buffer(
            "has_prototype", torch.zeros(num_classes, dtype=torch.bool), persistent=False
        )

    def embed(self, x: Tensor) -> Tensor:
        return nn.functional.normalize(self.encoder(x), dim=1)

    @torch.no_grad()
    def set_prototypes(self, embeddings: Tensor, labels: Tensor) -> None:
        """Prototype of class c = mean embedding of the samples labelled c."""
        for cls in range(self.num_classes):
            mask = labels == cls
            self.has_prototype[cls] = bool(mask.any())
            if mask.any():
                self.prototypes[cls] = embeddings[mask].mean(0).to(self.prototypes.dtype)

    @torch.no_grad()
    def fit_prototypes(
        self,
        batches: Iterable[tuple[Tensor, Tensor]],
        *,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        """Prototypes from labelled (x, y) batches: each class's mean embedding, in
        eval mode, each batch moved to `device` and embedded under `autocast()`."""
        self.eval()
        chunks: list[Tensor] = []
        labels: list[Tensor] = []
        for x, y in batches:
            with autocast():
                chunks.append(self.embed(x.to(device)).float())
            labels.append(y.to(device))
        self.set_prototypes(torch.cat(chunks), torch.cat(labels))

    def forward(self, x: Tensor) -> Tensor:
        embeddings = self.embed(x).float()
        squared = (embeddings[:, None, :] - self.prototypes[None, :, :].float()).pow(2).sum(-1)
        scores = -(squared + 1e-12).sqrt() / self.temperature
        return scores.masked_fill(~self.has_prototype[None, :], -1e4)
