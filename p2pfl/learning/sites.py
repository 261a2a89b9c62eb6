"""The one way a site is built: `build_site(site_class, config, architecture)`.

Every site is built alike, the classifier (`LocalSite`, `DataParallelSite`) as
much as Fed-MAE's, Fed-BEiT's tokenizer's and its pre-training site:

  1. Python, NumPy and torch seeded from training.seed;
  2. the site's data loaded (partition and splits seeded from federation.seed
     + training.seed), unless the caller has it;
  3. the model built once, from the seeded generator, holding the federation's
     common initial weights when its architecture names them (every site draws
     those alike from federation.seed: no message is needed for them);
  4. the site class around model, data and training.

The order is part of a run's seeded results: the model's own draw advances the
global generator that later draws (augmentation, FixMatch's batches) follow.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from p2pfl.config import SiteConfig, TrainingSection
from p2pfl.learning.data import SiteData, load_site_data
from p2pfl.learning.site_model import create_site_model

SiteT = TypeVar("SiteT")
ModelT = TypeVar("ModelT", bound=nn.Module)

# Seeding torch's global generator and drawing a model from it is not safe while
# other threads draw from it (many simulated nodes in one process), so each common
# initial state is drawn once per process under this lock and then copied. The
# cache is bounded: a process rarely builds more than a couple of architectures.
_INITIAL_STATES_KEPT = 4
_initial_states_lock = threading.Lock()
_initial_states: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
# For the same reason sites are built one at a time: a site's seeding, data and
# model draw must not interleave with another thread's (in-memory nodes build
# their sites concurrently), or the common initial state drawn in between is not
# the one `federation.seed` gives.
_build_lock = threading.Lock()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def common_initial_state(key: str, seed: int, build: Callable[[], nn.Module]) -> dict[str, Tensor]:
    """The weights `build()` draws with torch seeded to `seed`, identical on
    every site; `key` names the architecture (and the seed) for the cache. The
    torch generator is restored afterwards."""
    with _initial_states_lock:
        if key not in _initial_states:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = build()
            if len(_initial_states) >= _INITIAL_STATES_KEPT:
                _initial_states.popitem(last=False)
            _initial_states[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {k: v.clone() for k, v in _initial_states[key].items()}


def interned_initial(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The cached common initial state `state` equals (never modified: one copy
    for every site of the process, thousands in memory), else `state` itself."""
    with _initial_states_lock:
        for cached in _initial_states.values():
            if cached.keys() == state.keys() and all(
                cached[k].dtype == v.dtype and torch.equal(cached[k], v) for k, v in state.items()
            ):
                return cached
    return state


def common_initial_model(key: str, seed: int, build: Callable[[], ModelT]) -> ModelT:
    """`build()` holding the common initial weights (`common_initial_state`)."""
    model = build()
    model.load_state_dict(common_initial_state(key, seed, build))
    return model


@dataclass(frozen=True)
class Architecture:
    """A site's model, as `build_site` needs it once the data is known.

    `build` draws the model; `key` names its common initial weights (see
    `common_initial_state`: architecture and federation.seed), or None for the
    weights `build` draws from training.seed; `site_args` are keyword arguments
    of the site class that come with the model (Fed-BEiT: its tokenizer)."""

    build: Callable[[], nn.Module]
    key: str | None = None
    site_args: dict[str, Any] = field(default_factory=dict)


def build_site(
    site_class: Callable[..., SiteT],
    config: SiteConfig,
    architecture: Callable[[SiteData], Architecture],
    *,
    data: SiteData | None = None,
    training: TrainingSection | None = None,
    **site_args: Any,
) -> SiteT:
    """Seed, load the data (unless given), build the model once from
    `architecture(data)`, and return `site_class(model=, data=, training=,
    augment=config.data.augment, **site_args)`. `training` replaces
    config.training (Fed-BEiT's tokenizer: its own lr)."""
    with _build_lock:
        seed_everything(config.training.seed)
        if data is None:
            data = load_site_data(config.data, seed=config.federation.seed + config.training.seed)
        arch = architecture(data)
        model = (
            arch.build()
            if arch.key is None
            else common_initial_model(arch.key, config.federation.seed, arch.build)
        )
    return site_class(
        model=model,
        data=data,
        training=config.training if training is None else training,
        augment=config.data.augment,
        **arch.site_args,
        **site_args,
    )


def classifier(config: SiteConfig, *, common_initial: bool) -> Callable[[SiteData], Architecture]:
    """The classifier model.* names, shaped to the site's data; from the
    federation's common initial weights with `common_initial`, else from
    training.seed."""

    def architecture(data: SiteData) -> Architecture:
        def build() -> nn.Module:
            return create_site_model(
                config.model,
                in_chans=data.channels,
                num_classes=data.num_classes,
                image_size=data.image_size,
            )

        key = (
            f"classifier|{config.model.model_dump_json()}|{data.channels}|{data.num_classes}|"
            f"{data.image_size}|{config.federation.seed}"
        )
        return Architecture(build, key if common_initial else None)

    return architecture
