"""The site a protocol trains, built from the federation's common initial weights.

The DFU paper starts every client from the same model. Every site draws that
model from `federation.seed` itself, so no message is needed for it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn

from p2pfl.config import SiteConfig
from p2pfl.learning.site_model import create_site_model
from p2pfl.learning.sites import create_site
from p2pfl.learning.train import LocalSite

# Seeding torch's global generator and drawing a model from it is not safe while
# other threads draw from it (many simulated nodes in one process), so each common
# initial state is drawn once per process under this lock and then copied. The
# cache is bounded: a process rarely builds more than a couple of architectures.
_INITIAL_STATES_KEPT = 4
ModelT = TypeVar("ModelT", bound=nn.Module)
_initial_states_lock = threading.Lock()
_initial_states: OrderedDict[str, dict[str, Tensor]] = OrderedDict()


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


def common_initial_model(key: str, seed: int, build: Callable[[], ModelT]) -> ModelT:
    """`build()` holding the common initial weights (`common_initial_state`)."""
    model = build()
    model.load_state_dict(common_initial_state(key, seed, build))
    return model


def build_site(config: SiteConfig) -> LocalSite:
    """The site's LocalSite (model, optimizer, data), starting from the common
    initial weights, its inference batch size calibrated before any round."""
    site = create_site(config)
    data = site.data
    key = (
        f"classifier|{config.model.model_dump_json()}|{data.channels}|{data.num_classes}|"
        f"{data.image_size}|{config.federation.seed}"
    )
    site.load_state_dict(
        common_initial_state(
            key,
            config.federation.seed,
            lambda: create_site_model(
                config.model,
                in_chans=data.channels,
                num_classes=data.num_classes,
                image_size=data.image_size,
            ),
        )
    )
    site.calibrate_eval_batch()
    return site
