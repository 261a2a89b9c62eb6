"""Hostile review of issue #30's personalization: fast tests that pin down
defects (each test states the behaviour the feature promises; a failure is
the defect's evidence) and the cases that were checked and hold.

- Balanced softmax (training.logit_adjustment) was a silent no-op under the
  DP recipe (its own per-sample loss) and in FixMatch: both are now refused.
- site.loss drops an explicit weight= under balanced softmax; FedER's
  replayed images get this site's prior instead of their own class mix.
- The fine-tuned personal model is checkpointed with its fine-tuning epoch as
  its `round`, which `export`/`evaluate` then report as the model's round.
- A personal model's choice on a site whose val split exists but is empty,
  and on a site with a single training image, does not crash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from node.provision import provision
from p2pfl.config import TrainingSection, load_config
from p2pfl.config.site import SiteConfig
from p2pfl.learning.best import BestModel
from p2pfl.learning.personal import Personalization
from p2pfl.learning.train import LocalSite

FAST = {"training": {"max_steps_per_epoch": 2, "threads": 1}, "data": {"augment": "none"}}


def config(tmp_path: Path, **training: Any) -> SiteConfig:
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 2},
        overrides={**FAST, "training": {**FAST["training"], **training}},
    )
    return load_config(plans[0].config_path)


def trained(cfg: SiteConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    site = LocalSite.from_config(cfg)
    torch.manual_seed(1)
    site.train_epochs()
    return site.state_dict()


def test_balanced_softmax_is_refused_with_the_dp_recipe_it_would_not_reach(tmp_path):
    """The DP recipe computes its own per-sample loss: balanced softmax would be
    a silent no-op there while switching the class weights off."""
    with pytest.raises(ValueError, match="logit_adjustment is not applied by the DP recipe"):
        TrainingSection(logit_adjustment=True, recipe="dp")
    with pytest.raises(ValueError, match="logit_adjustment is not applied by the DP recipe"):
        TrainingSection(logit_adjustment=True, dp={"target_epsilon": 4.0})
    standard = trained(config(tmp_path / "s"))
    adjusted = trained(config(tmp_path / "a", logit_adjustment=True))
    assert any(not torch.equal(standard[k], adjusted[k]) for k in standard)  # it does train


def test_fixmatch_protocols_refuse_balanced_softmax(tmp_path):
    """SSFL's and FedPerl's FixMatch loss would ignore it: refused at setup."""
    import asyncio

    from p2pfl.config import ConfigError
    from protocols.ssfl import SSFL

    cfg = config(tmp_path, logit_adjustment=True)

    class Ctx:
        config = cfg

    plans = provision(tmp_path / "ssfl", ["a", "b"], protocol={"name": "ssfl", "rounds": 1})
    loop = SSFL(load_config(plans[0].config_path).protocol)
    with pytest.raises(ConfigError, match="does not apply balanced softmax"):
        asyncio.run(loop.setup(Ctx()))  # type: ignore[arg-type]


def test_replayed_images_keep_their_own_weights_under_balanced_softmax(tmp_path):
    """LocalSite.loss promises cross-entropy "with the site's class weights
    unless `weight` gives others"; under logit_adjustment an explicit weight=
    is silently dropped (p2pfl/learning/train.py:170-171). In FedER's
    train_replay (replay.py:79, 82) the replayed images, whose class mix is the
    replay buffer's, are then adjusted with this site's train prior."""
    cfg = config(tmp_path, logit_adjustment=True)
    torch.manual_seed(0)
    site = LocalSite.from_config(cfg)
    x, y = next(site.batches("train"))
    x = x.to(site.device)
    y = y.to(site.device)
    weight = torch.linspace(0.1, 3.0, site.num_classes)
    with torch.no_grad():
        assert not torch.allclose(site.loss(x, y, weight=weight), site.loss(x, y)), (
            "an explicit weight= is ignored under logit_adjustment"
        )


def test_the_personal_models_round_is_a_federated_round(tmp_path):
    """`export --which personal` reports the checkpoint's personal best
    `round` as the model's round (node/evaluate.py _round_of); after fine-tuning
    that entry holds the fine-tuning epoch (1..finetune_epochs), not the round
    of the federated model it started from."""
    cfg = config(tmp_path, personalization={"method": "finetune", "finetune_epochs": 2})
    torch.manual_seed(0)
    site = LocalSite.from_config(cfg)
    federated = BestModel()
    federated.observe(10, {"val_score": 0.0, "val_macro_f1": 0.0, "macro_f1": 0.0}, site.state_dict)
    personal = Personalization(cfg.training, site)
    personal.choose(site, federated)
    saved = personal.checkpoint()["best"]
    assert saved is not None
    assert saved["round"] >= 10, f"personal model checkpointed as round {saved['round']}"


def test_the_choice_survives_a_site_with_an_empty_val_split(tmp_path):
    """A site whose val split exists but is empty reports its federated model
    and says why (checked: holds)."""
    cfg = config(tmp_path)
    torch.manual_seed(0)
    site = LocalSite.from_config(cfg)
    personal = Personalization(cfg.training, site)
    personal.has_val = False  # what Personalization computes for len(val) == 0
    figures = personal.choose(site, BestModel())
    assert figures["reported_personal"] == 0.0
    assert personal.choice is not None and "validation" in personal.choice["why"]


def test_fine_tuning_a_site_with_one_training_image_does_not_crash(tmp_path):
    """Batches of one image are skipped: fine-tuning then takes no step, and
    the personal model equals the start (checked: holds, no crash)."""
    cfg = config(tmp_path, personalization={"method": "finetune", "finetune_epochs": 1})
    torch.manual_seed(0)
    site = LocalSite.from_config(cfg)
    x, y = site.data.train.tensors
    site.data.train.tensors = (x[:1], y[:1])
    start = site.state_dict()
    personal = Personalization(cfg.training, site)
    personal.finetune(site, start)
    assert personal.best.state is not None
    for k, v in start.items():
        assert torch.equal(v, personal.best.state[k]), k
