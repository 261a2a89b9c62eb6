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
network with a random trunk and load, from a configured path or the torch hub
cache, either a full `lpips.LPIPS` state dict or torchvision's backbone file. `backbone="random"` keeps the
random trunk; it exists for tests, gives no meaningful privacy, and says so.
"""

from __future__ import annotations

import logging
import pickle
import warnings
from pathlib import Path
from typing import Literal

import lpips
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import GenbufferError, LpipsBackboneMissing

log = logging.getLogger(__name__)

Backbone = Literal["alex", "vgg", "squeeze", "random"]
Net = Literal["alex", "vgg", "squeeze"]
BACKBONE_FILES = {
    "alex": "alexnet-owt-7be5be79.pth",
    "vgg": "vgg16-397923af.pth",
    "squeeze": "squeezenet1_1-b8a52dc0.pth",
}
BACKBONE_URLS = {
    name: f"https://download.pytorch.org/models/{file}" for name, file in BACKBONE_FILES.items()
}
_TORCHVISION_BUILDERS = {"alex": "alexnet", "vgg": "vgg16", "squeeze": "squeezenet1_1"}
ACCEPTED_KINDS = (
    "a full lpips.LPIPS state dict of the same net (backbone + linear layers), "
    "or torchvision's ImageNet backbone file ({file}), loadable with weights_only=True"
)
RANDOM_BACKBONE_SEED = (
    0  # the random trunk is the same in every process, so distances are comparable
)


def default_backbone_path(backbone: Net) -> Path:
    """Where torchvision caches the weights: $TORCH_HOME/hub/checkpoints/<file>.

    The exact file name carries a hash prefix that torchvision has changed before;
    any `<arch>-*.pth` beside it is taken when the current name is absent."""
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    exact = folder / BACKBONE_FILES[backbone]
    if not exact.is_file() and folder.is_dir():
        prefix = BACKBONE_FILES[backbone].rsplit("-", 1)[0]
        others = sorted(folder.glob(f"{prefix}-*.pth"))
        if others:
            return others[0]
    return exact


def resolve_backbone_file(backbone: Net, configured: Path | None = None) -> Path:
    """The weights file to load, or LpipsBackboneMissing saying where to put one."""
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
        f"LPIPS needs ImageNet '{backbone}' weights and will not download them: {where}. "
        f"Accepted: {ACCEPTED_KINDS.format(file=file)}. "
        f'On a machine with internet, run `python -c "import torchvision; '
        f"torchvision.models.{_TORCHVISION_BUILDERS[backbone]}(weights='IMAGENET1K_V1')\"` "
        f"(or download {BACKBONE_URLS[backbone]}), then copy {file} to {path}"
    )


def _lpips_network(net: Net) -> lpips.LPIPS:
    """The lpips package's network with a random trunk and no linear weights loaded (no I/O)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision's deprecation notice for `pretrained=`
        return lpips.LPIPS(pretrained=False, net=net, pnet_rand=True, verbose=False)


def _load_linear_weights(model: lpips.LPIPS, net: Net) -> None:
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


def _wrong_kind(path: Path, net: Net, what: str) -> GenbufferError:
    return GenbufferError(
        "lpips_weights_wrong_kind",
        f"{path} is {what}, not weights for lpips_backbone '{net}' — accepted: "
        + ACCEPTED_KINDS.format(file=BACKBONE_FILES[net]),
    )


def _backbone_key(name: str) -> str:
    """lpips slice parameter `slice<k>.<i>.<rest>` -> torchvision `features.<i>.<rest>`."""
    _, rest = name.split(".", 1)
    return f"features.{rest}"


def load_lpips_weights(model: lpips.LPIPS, net: Net, path: Path) -> str:
    """Load `path` into `model` strictly; returns the kind of file it was.

    Two kinds are accepted: a full `lpips.LPIPS` state dict (keys `net.slice*`,
    `lin*`, `scaling_layer.*`), loaded with strict=True; or torchvision's ImageNet
    backbone (`features.*`, classifier keys ignored), where every backbone tensor
    must be present with its shape and the package's own linear layers are used.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise GenbufferError(
            "lpips_weights_unreadable",
            f"{path} holds Python objects besides tensors, which are never unpickled "
            "(weights_only=True) — accepted: " + ACCEPTED_KINDS.format(file=BACKBONE_FILES[net]),
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GenbufferError(
            "lpips_weights_unreadable",
            f"cannot read {path} with weights_only=True ({first[:200]}) — accepted: "
            + ACCEPTED_KINDS.format(file=BACKBONE_FILES[net]),
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise _wrong_kind(path, net, "not a state dict of tensors")
    if any(str(k).startswith("net.slice") for k in state):
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError:
            expected = set(model.state_dict())
            stray = sorted(set(state) - expected)[:2]
            absent = sorted(expected - set(state))[:2]
            shapes = [
                k
                for k, v in model.state_dict().items()
                if k in state and tuple(state[k].shape) != tuple(v.shape)
            ][:2]
            detail = "; ".join(
                part
                for part in (
                    f"missing {absent}" if absent else "",
                    f"unexpected {stray}" if stray else "",
                    f"other shapes {shapes}" if shapes else "",
                )
                if part
            )
            raise _wrong_kind(
                path, net, f"an lpips state dict of another network ({detail})"
            ) from None
        return "lpips_state_dict"
    if not any(str(k).startswith("features.") for k in state):
        keys = ", ".join(list(map(str, state))[:3])
        raise _wrong_kind(path, net, f"a state dict of another model (keys {keys}, ...)")
    _load_linear_weights(model, net)
    with torch.no_grad():
        for name, param in model.net.named_parameters():
            key = _backbone_key(name)
            source = state.get(key)
            if source is None or tuple(source.shape) != tuple(param.shape):
                raise _wrong_kind(
                    path,
                    net,
                    f"not torchvision's ImageNet {_TORCHVISION_BUILDERS[net]} "
                    f"({key} {'missing' if source is None else 'has another shape'})",
                )
            param.copy_(source)
    return "torchvision_backbone"


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
        kind = load_lpips_weights(model, backbone, path)
        log.info("LPIPS backbone '%s' loaded from %s (%s)", backbone, path, kind)
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
