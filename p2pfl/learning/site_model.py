"""The model a site.yaml's `model:` section asks for, and the check that it can
be built.

`create_site_model` is the one place a `model:` section becomes a module: the
registered model `model.name` (p2pfl.learning.models), or with
`model.pretrained_from` the ViT classifier around a pre-trained Fed-MAE encoder
(p2pfl.learning.mae), wrapped in a SiameseNet when `model.siamese.enabled`,
then `model.weights` loaded. `check_model_name` is what `p2pfl-node check`
asks of `model.name`, in the same words the site gives when it cannot build it.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from p2pfl.config import ConfigError, FedBEiTParams, FedMAEParams, ModelSection, SiteConfig
from p2pfl.learning.mae import create_pretrained_classifier, not_a_vit
from p2pfl.learning.models import SiameseNet, create_model, load_weights, unknown_model


def create_site_model(
    model_cfg: ModelSection, *, in_chans: int, num_classes: int, image_size: int
) -> nn.Module:
    """The model a site.yaml asks for: `create_model(model.name, ...)` (or, with
    `model.pretrained_from`, the ViT classifier around that pre-trained Fed-MAE
    encoder, `create_pretrained_classifier`), wrapped in a SiameseNet (encoder
    head = embedding_dim outputs) when model.siamese.enabled, then
    `model.weights` loaded into the whole thing."""
    siamese = model_cfg.siamese
    head = siamese.embedding_dim if siamese.enabled else num_classes
    if model_cfg.pretrained_from is not None:
        # Fed-MAE fine-tuning: the ViT classifier around a pre-trained encoder.
        model = create_pretrained_classifier(
            model_cfg.name,
            model_cfg.pretrained_from,
            in_chans=in_chans,
            num_classes=head,
            image_size=image_size,
        )
    else:
        model = create_model(
            model_cfg.name,
            in_chans=in_chans,
            num_classes=head,
            image_size=image_size,
            init=model_cfg.init,
        )
    if siamese.enabled:
        model = SiameseNet(
            model,
            num_classes=num_classes,
            embedding_dim=siamese.embedding_dim,
            margin=siamese.margin,
        )
    if model_cfg.weights is not None:
        load_weights(model, model_cfg.weights)
    return model


def check_model_name(cfg: SiteConfig, path: str | Path) -> None:
    """A ConfigError naming the file and `model.name` unless the site can build
    that model: a registered one, or a timm ViT where Fed-MAE builds it
    (protocol fedmae or fedbeit, or model.pretrained_from set). Builds nothing."""
    name = cfg.model.name
    builds_vit = cfg.model.pretrained_from is not None or isinstance(
        cfg.protocol, (FedMAEParams, FedBEiTParams)
    )
    problem = not_a_vit(name) if builds_vit else unknown_model(name)
    if problem is not None:
        raise ConfigError(path, "model.name", *problem)


def check_dp(cfg: SiteConfig, path: str | Path) -> None:
    """What `p2pfl-node check` and `run` both ask of training.dp beyond the
    site.yaml's own guard (a protocol whose local training is DP-SGD, checked
    when the file loads): a model Opacus can take per-sample gradients of
    (builds the model with random weights, nothing else)."""
    from p2pfl.learning.dp import refuse_unsupported
    from p2pfl.learning.errors import TrainingError

    if cfg.training.dp is None:
        return
    model = create_model(
        cfg.model.name,
        in_chans=cfg.data.channels,
        num_classes=2,
        image_size=cfg.data.image_size,
    )
    try:
        refuse_unsupported(model, cfg.model.name)
    except TrainingError as exc:
        problem, _, fix = str(exc).partition("; ")
        raise ConfigError(path, "model.name", problem, fix) from None
