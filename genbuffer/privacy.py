"""LPIPS distance and the FedER privacy-preserving generator loss.

FedER Eq. 4 defines the LPIPS distance d_L(x, y) = sum_l w_l . ||phi_l(x) - phi_l(y)||^2
(spatially averaged, channel-normalised features phi_l of an ImageNet network,
per-channel weights w_l >= 0 learned from human judgements). Written as

    d_L(x, y) = ||e(x) - e(y)||^2,  e(x) = concat_l sqrt(w_l / (H_l W_l)) * phi_l(x),

it needs one backbone pass per image rather than per pair, and the mean over
all real x synthetic pairs of a batch (Eq. 3) becomes

    mean_{r,s} d_L = mean_r ||e_r||^2 + mean_s ||e_s||^2 - 2 <mean_r e_r, mean_s e_s>.

By default we normalise Eq. 3 by the number of pairs (a mean), so alpha does
not depend on the batch size. Eq. 3 as printed divides the b x b sum by b only,
which is b times the mean: `normalization="batch"` reproduces it, and is the
same as the mean with alpha multiplied by b.

The network comes from the `lpips` package (its linear weights ship with it).
The ImageNet backbone under it is never downloaded: we build the package's
network with a random trunk and load the torchvision weights file ourselves
from the torch hub cache or a configured path. `backbone="random"` keeps the
random trunk; it exists for tests, gives no meaningful privacy, and says so.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Literal

import lpips
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import GenbufferError, LpipsBackboneMissing

log = logging.getLogger(__name__)

Backbone = Literal["alex", "vgg", "random"]
BACKBONE_FILES = {"alex": "alexnet-owt-7be5be79.pth", "vgg": "vgg16-397923af.pth"}
BACKBONE_URLS = {
    name: f"https://download.pytorch.org/models/{file}" for name, file in BACKBONE_FILES.items()
}
_TORCHVISION_BUILDERS = {"alex": "alexnet", "vgg": "vgg16"}
RANDOM_BACKBONE_SEED = (
    0  # the random trunk is the same in every process, so distances are comparable
)


def default_backbone_path(backbone: Literal["alex", "vgg"]) -> Path:
    """Where torchvision would have cached the weights: $TORCH_HOME/hub/checkpoints/<file>."""
    return Path(torch.hub.get_dir()) / "checkpoints" / BACKBONE_FILES[backbone]


def resolve_backbone_file(backbone: Literal["alex", "vgg"], configured: Path | None = None) -> Path:
    """The ImageNet weights file to load, or LpipsBackboneMissing saying where to put it."""
    path = Path(configured) if configured is not None else default_backbone_path(backbone)
    if path.is_file():
        return path
    file = BACKBONE_FILES[backbone]
    where = (
        f"genbuffer.lpips_weights points at {path}, which does not exist"
        if configured is not None
        else f"expected the file {path} (torch hub cache; set TORCH_HOME to move it, or genbuffer.lpips_weights to use another path)"
    )
    raise LpipsBackboneMissing(
        f"LPIPS needs the ImageNet '{backbone}' backbone weights and will not download them: {where}. "
        f'On a machine with internet, run `python -c "import torchvision; '
        f"torchvision.models.{_TORCHVISION_BUILDERS[backbone]}(weights='IMAGENET1K_V1')\"` "
        f"(or download {BACKBONE_URLS[backbone]}), then copy {file} to {path}"
    )


def _lpips_network(net: Literal["alex", "vgg"]) -> lpips.LPIPS:
    """The lpips package's network with a random trunk and no linear weights loaded (no I/O)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision's deprecation notice for `pretrained=`
        return lpips.LPIPS(pretrained=False, net=net, pnet_rand=True, verbose=False)


def _load_linear_weights(model: lpips.LPIPS, net: Literal["alex", "vgg"]) -> None:
    path = Path(lpips.__file__).parent / "weights" / "v0.1" / f"{net}.pth"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise GenbufferError(
            "lpips_package_broken", f"cannot read the lpips package's {path}: {exc}"
        ) from None
    missing = [k for k in state if not k.startswith("lin")]
    if missing:
        raise GenbufferError("lpips_package_broken", f"unexpected keys in {path}: {missing[:3]}")
    model.load_state_dict(state, strict=False)


def _load_backbone(model: lpips.LPIPS, net: Literal["alex", "vgg"], path: Path) -> None:
    """Copy torchvision `features.<i>.<param>` tensors into the lpips slices `slice<k>.<i>.<param>`."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise GenbufferError(
            "lpips_backbone_unreadable",
            f"cannot read LPIPS backbone weights {path}: {exc} — replace the file",
        ) from None
    with torch.no_grad():
        for name, param in model.net.named_parameters():
            _, index, kind = name.split(".")
            key = f"features.{index}.{kind}"
            source = state.get(key) if isinstance(state, dict) else None
            if source is None or tuple(source.shape) != tuple(param.shape):
                raise GenbufferError(
                    "lpips_backbone_mismatch",
                    f"{path} is not torchvision's ImageNet {_TORCHVISION_BUILDERS[net]} state dict "
                    f"(no matching {key}) — use the file {BACKBONE_FILES[net]}",
                )
            param.copy_(source)


class PerceptualDistance(nn.Module):
    """LPIPS on images in [-1, 1] with any channel count; frozen, differentiable in the images.

    One channel is repeated to three; three are used as they are; any other count
    is compared channel by channel (each as a grey image) and averaged. Images
    smaller than `min_size` are bilinearly upsampled first (AlexNet's stride-4
    stem leaves almost nothing of a 32-pixel image).
    """

    def __init__(self, model: lpips.LPIPS, backbone: Backbone, min_size: int = 64) -> None:
        super().__init__()
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.backbone = backbone
        self.min_size = min_size
        weights = [lin.model[-1].weight.detach().clamp(min=0).flatten() for lin in model.lins]
        for i, w in enumerate(weights):
            self.register_buffer(f"layer_weight_{i}", w)
        self.num_layers = len(weights)

    def train(self, mode: bool = True) -> PerceptualDistance:  # always frozen, always eval
        super().train(False)
        return self

    def _three_channel_views(self, images: Tensor) -> list[Tensor]:
        channels = images.shape[1]
        if images.shape[-1] < self.min_size:
            images = F.interpolate(
                images, size=(self.min_size, self.min_size), mode="bilinear", align_corners=False
            )
        if channels == 3:
            return [images]
        return [images[:, c : c + 1].expand(-1, 3, -1, -1) for c in range(channels)]

    def _layer_features(self, rgb: Tensor) -> list[Tensor]:
        outputs = self.model.net(self.model.scaling_layer(rgb))
        return [lpips.normalize_tensor(f) for f in outputs]

    def embed(self, images: Tensor) -> Tensor:
        """(N, D) with d_L(a, b) = ||embed(a) - embed(b)||^2 (FedER Eq. 4)."""
        views = self._three_channel_views(images)
        parts = []
        for rgb in views:
            for i, feat in enumerate(self._layer_features(rgb)):
                w = getattr(self, f"layer_weight_{i}")
                scale = (w / (feat.shape[2] * feat.shape[3])).sqrt()
                parts.append((feat * scale[None, :, None, None]).flatten(1))
        return torch.cat(parts, dim=1) / len(views) ** 0.5

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        """Distance of each pair (a[i], b[i]) -> (N,)."""
        return (self.embed(a) - self.embed(b)).square().sum(dim=1)

    def pairwise(self, a: Tensor, b: Tensor) -> Tensor:
        """All pairs -> (len(a), len(b))."""
        ea, eb = self.embed(a), self.embed(b)
        sq = ea.square().sum(1)[:, None] + eb.square().sum(1)[None, :] - 2 * ea @ eb.t()
        return sq.clamp(min=0)

    def mean_pairwise(self, a: Tensor, b: Tensor) -> Tensor:
        """Mean distance over all (a_i, b_j) pairs, from one pass per image (see module doc)."""
        ea, eb = self.embed(a), self.embed(b)
        return (
            ea.square().sum(1).mean()
            + eb.square().sum(1).mean()
            - 2 * (ea.mean(0) * eb.mean(0)).sum()
        )

    @torch.no_grad()
    def pooled_features(self, images: Tensor) -> Tensor:
        """(N, sum of layer widths): spatial means of the normalised features, for a Frechet distance."""
        views = self._three_channel_views(images)
        per_view = [
            torch.cat([f.mean(dim=(2, 3)) for f in self._layer_features(rgb)], dim=1)
            for rgb in views
        ]
        return torch.stack(per_view).mean(0)


def build_perceptual_distance(
    backbone: Backbone,
    weights: Path | None = None,
    *,
    min_size: int = 64,
    device: str | torch.device = "cpu",
) -> PerceptualDistance:
    """LPIPS with the given backbone; raises LpipsBackboneMissing before building anything heavy."""
    if backbone == "random":
        log.warning(
            "LPIPS backbone is RANDOM (lpips_backbone: random): the privacy loss and the audit measure "
            "distances in an untrained network's features. This is for tests and benchmarks only and "
            "gives NO meaningful privacy protection. Use 'alex' or 'vgg' with ImageNet weights for real sites."
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_BACKBONE_SEED)
            model = _lpips_network("alex")
        _load_linear_weights(model, "alex")
    else:
        path = resolve_backbone_file(backbone, weights)
        model = _lpips_network(backbone)
        _load_linear_weights(model, backbone)
        _load_backbone(model, backbone, path)
        log.info("LPIPS backbone '%s' loaded from %s", backbone, path)
    return PerceptualDistance(model, backbone, min_size=min_size).to(device)


def privacy_loss(
    metric: PerceptualDistance,
    real: Tensor,
    synthetic: Tensor,
    normalization: Literal["pairs", "batch"] = "pairs",
) -> Tensor:
    """FedER Eq. 3: L_PP, the LPIPS distance summed over all real x synthetic pairs of the batch,
    divided by the number of pairs ("pairs": the mean) or by the batch size ("batch": as printed)."""
    mean = metric.mean_pairwise(real, synthetic)
    return mean if normalization == "pairs" else mean * len(real)


def privacy_preserving_generator_loss(loss_g: Tensor, loss_pp: Tensor, alpha: float) -> Tensor:
    """FedER Eq. 5: L_G-PP = L_G - alpha * L_PP (maximise the distance to real images)."""
    return loss_g - alpha * loss_pp
