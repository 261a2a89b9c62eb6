"""Each site's personal model beside the federated one (issue #30):
p2pfl.learning.personal, its place in the round skeleton, the checkpoint, and
`export --which`.

- The choice between the two models is made on the site's validation split:
  two sites that differ only in their test labels make the same choice.
- Ditto's personal model and its optimizer survive a checkpoint: a site
  restored after round 2 trains round 3 to the same weights as one that ran
  straight through.
- FedBN's local_norm keeps the site's BatchNorm entries through a merge.
- Balanced softmax adds the site's log prior in training only.
- Real daemons log the choice in metrics.jsonl and show it on /status; `export
  --which personal|federated|best` exports the model the checkpoint names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from inproc_util import InProcessFederation
from safetensors.torch import load_file
from test_export import FAST as EXPORT_FAST

from node.cli import main
from node.evaluate import checkpointed_model
from node.export import card_markdown
from node.provision import provision
from node.queues import Checkpoints
from p2pfl.config import ConfigError, TrainingSection, load_config
from p2pfl.config.site import SiteConfig
from p2pfl.learning.best import BestModel
from p2pfl.learning.class_weights import log_class_prior
from p2pfl.learning.data import SiteData
from p2pfl.learning.evaluate import evaluate_site
from p2pfl.learning.optimizer import lr_factor
from p2pfl.learning.personal import Personalization, norm_keys, resolve_method
from p2pfl.learning.sites import interned_initial
from p2pfl.learning.train import LocalSite

FAST = EXPORT_FAST  # the export tests' quick transport and training


def digits_config(tmp_path: Path, **training: Any) -> SiteConfig:
    """A single digits site (train, val and test splits) with a small CNN."""
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 2},
        overrides={**FAST, "training": {**FAST["training"], **training}},
    )
    return load_config(plans[0].config_path)


def site_of(cfg: SiteConfig) -> LocalSite:
    torch.manual_seed(0)
    return LocalSite.from_config(cfg)


# ---------------------------------------------------------------- the choice


def test_the_choice_is_made_on_validation_and_never_sees_the_test_split(tmp_path):
    cfg = digits_config(tmp_path)
    site = site_of(cfg)
    x_test, y_test = site.data.test.tensors
    federated = BestModel()
    federated_score = -site.evaluate("val")["balanced_loss"]
    federated.observe(
        1, {"val_score": federated_score, "val_macro_f1": 0.5, "macro_f1": 0.5}, site.state_dict
    )
    start = federated.state

    def choose(test_labels: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
        other = site_of(cfg)
        other.data = SiteData(
            **{
                **other.data.__dict__,
                "test": torch.utils.data.TensorDataset(x_test, test_labels),
            }
        )
        personal = Personalization(cfg.training, other)
        # three rounds: the model trained alone chooses among them on validation too
        figures = personal.choose(other, BestModel(**{**federated.__dict__, "state": start}), 3)
        assert personal.choice is not None
        return figures, personal.choice

    figures, choice = choose(y_test)
    scrambled, choice2 = choose((y_test + 1) % 10)
    assert choice["reported"] == choice2["reported"]
    assert choice["personal_val_macro_f1"] == choice2["personal_val_macro_f1"]
    # the model trained alone is a candidate by default, chosen on validation too
    assert choice["alone_val_score"] is not None
    assert choice["alone_val_score"] == choice2["alone_val_score"]
    assert choice["alone_round"] == choice2["alone_round"]
    assert choice["personal_source"] == choice2["personal_source"]
    assert choice["personal_round"] == choice2["personal_round"]
    # The test figures are reported, and they did change with the test labels.
    assert figures["personal_macro_f1"] != scrambled["personal_macro_f1"]
    assert set(figures) >= {"reported_personal", "reported_macro_f1", "personal_val_macro_f1"}
    # The rule: personal when its validation score (training.select_by's figure,
    # the class-balanced loss by default, negated) beats the federated one's.
    assert choice["select_by"] == "balanced_loss"
    expected = "personal" if choice["personal_val_score"] > federated_score else "federated"
    assert choice["reported"] == expected


def test_with_select_by_balanced_loss_the_lower_validation_loss_is_reported(tmp_path):
    """training.select_by balanced_loss: the fine-tuning epoch and the choice
    follow the class-balanced validation loss (lower wins), whatever the
    macro-F1s say; the choice names the figure it compared."""
    cfg = digits_config(tmp_path, select_by="balanced_loss")
    site = site_of(cfg)
    loss = site.evaluate("val")["balanced_loss"]
    federated = BestModel()
    federated.observe(
        1, {"val_score": -loss, "val_macro_f1": 0.99, "macro_f1": 0.5}, site.state_dict
    )
    personal = Personalization(cfg.training, site)
    personal.choose(site, federated)
    choice = personal.choice
    assert choice is not None and choice["select_by"] == "balanced_loss"
    # the kept epoch's score is its own balanced loss, negated
    assert choice["personal_val_score"] < 0
    # fine-tuned from an untrained model, the personal loss is far below the
    # federated one: reported, though the federated macro-F1 claimed is higher
    assert choice["personal_val_score"] > -loss, choice
    assert choice["personal_val_macro_f1"] < 0.99 and choice["reported"] == "personal"
    assert "balanced loss" in choice["why"], choice["why"]


def _ruined(site: LocalSite) -> dict[str, torch.Tensor]:
    """A federated model the federation did not help with: every parameter
    zero (its outputs uniform, its hidden gradients zero), so one epoch of
    fine-tuning cannot bring it back; buffers as they are."""
    params = {name for name, _ in site.model.named_parameters()}
    return {k: v * 0.0 if k in params else v.clone() for k, v in site.state_dict().items()}


def test_a_site_the_federation_did_not_help_keeps_the_model_it_trains_alone(tmp_path):
    """local_candidate (default): the model the site would have trained alone
    (from the weights its rounds start from, as many rounds, best on
    validation) is a personal candidate. With a ruined federated model and one
    fine-tuning epoch, it leads on validation: the site reports it, says so,
    and the module keeps its own weights."""
    cfg = digits_config(tmp_path, personalization={"method": "finetune", "finetune_epochs": 1})
    site = site_of(cfg)
    initial = site.state_dict()
    personal = Personalization(cfg.training, site)
    assert personal.initial is not None
    assert all(torch.equal(personal.initial[k], initial[k]) for k in initial)
    site.train_epochs()  # the rounds move the module on; the candidate starts from `initial`
    served = site.state_dict()
    starts: list[dict[str, torch.Tensor]] = []
    steps = personal._steps

    def recording(site_: Any, optimizer: Any, extra: Any = None) -> list[float]:
        starts.append(site_.state_dict())
        return steps(site_, optimizer, extra)

    personal._steps = recording  # type: ignore[method-assign]
    federated = BestModel(federated=True)
    bad = _ruined(site)
    with torch.no_grad():
        site.load_state_dict(bad)
        federated.observe(3, evaluate_site(site), site.state_dict)
        site.load_state_dict(served)
    figures = personal.choose(site, federated, 3)
    choice = personal.choice
    assert choice is not None
    assert choice["personal_source"] == "local", choice
    assert choice["reported"] == "personal" and "(trained alone)" in choice["why"]
    assert choice["alone_val_score"] == choice["personal_val_score"] > choice["federated_val_score"]
    assert choice["finetune_epoch"] is None and 1 <= choice["alone_round"] <= 3
    assert choice["personal_round"] == 3  # a model of the whole run (export, model card)
    assert figures["personal_trained_alone"] == 1.0 and figures["reported_personal"] == 1.0
    # one fine-tuning epoch from the ruined model, then three rounds alone from `initial`
    assert len(starts) == 4
    assert all(torch.equal(starts[0][k], bad[k]) for k in bad)
    assert all(torch.equal(starts[1][k], initial[k]) for k in initial)
    assert all(torch.equal(v, served[k]) for k, v in site.state_dict().items())
    assert personal.best.state is not None
    assert any(not torch.equal(personal.best.state[k], initial[k]) for k in initial)
    # the choice survives the checkpoint (export, the model card, /status)
    restored = Personalization(cfg.training, site_of(cfg))
    restored.restore(personal.checkpoint())
    assert restored.choice == choice
    assert restored.best.state is not None
    assert all(torch.equal(restored.best.state[k], personal.best.state[k]) for k in initial)


def test_sites_of_the_common_initial_weights_share_one_initial_copy(tmp_path):
    """Thousands of in-memory sites start from the federation's common initial
    weights: their local candidates share that one copy, which training alone
    leaves untouched."""
    cfg = digits_config(tmp_path, personalization={"method": "finetune", "finetune_epochs": 1})
    sites = [LocalSite.from_config(cfg, common_initial=True) for _ in range(2)]
    first, second = (Personalization(cfg.training, s) for s in sites)
    assert first.initial is not None and first.initial is second.initial
    kept = {k: v.clone() for k, v in first.initial.items()}
    federated = BestModel(federated=True)
    federated.observe(2, evaluate_site(sites[0]), sites[0].state_dict)
    first.choose(sites[0], federated, 2)
    assert all(torch.equal(second.initial[k], kept[k]) for k in kept)
    # the same values in another dtype are another model (a half-precision site)
    assert interned_initial({k: v.double() for k, v in kept.items()}) is not first.initial
    wide = LocalSite.from_config(cfg, common_initial=True)
    wide.model.double()
    assert Personalization(cfg.training, wide).initial is not first.initial
    # a site that starts from other weights keeps its own copy
    other = site_of(cfg)
    other.load_state_dict({k: v + 1.0 if v.is_floating_point() else v for k, v in kept.items()})
    own = Personalization(cfg.training, other).initial
    assert own is not None and own is not first.initial


def test_a_fine_tuned_model_that_leads_on_validation_stays_the_personal_model(tmp_path):
    """The model alone replaces the fine-tuned one only where it leads on
    validation: fine-tuned from a model trained for five epochs, against one
    round alone, the fine-tuned one stays; on a tie it stays too."""
    cfg = digits_config(tmp_path, personalization={"method": "finetune", "finetune_epochs": 1})
    site = site_of(cfg)
    personal = Personalization(cfg.training, site)
    site.train_epochs(5)
    federated = BestModel(federated=True)
    federated.observe(1, evaluate_site(site), site.state_dict)
    personal.choose(site, federated, 1)
    choice = personal.choice
    assert choice is not None and choice["personal_source"] == "finetune", choice
    assert choice["alone_val_score"] < choice["personal_val_score"]
    # a tie: the model alone scores exactly what the fine-tuned one does
    tie = Personalization(cfg.training, site_of(cfg))
    tuned: list[float] = []
    tune = tie.finetune

    def finetune(site_: Any, start: dict[str, torch.Tensor]) -> None:
        tune(site_, start)
        assert tie.best.val_score is not None
        tuned.append(tie.best.val_score)

    def alone(site_: Any, rounds: int) -> BestModel:
        return BestModel(round=1, val_score=tuned[0], state=site_.state_dict())

    tie.finetune = finetune  # type: ignore[method-assign]
    tie.train_alone = alone  # type: ignore[method-assign]
    tie.choose(site, federated, 1)
    assert tie.choice is not None and tie.choice["personal_source"] == "finetune"


def test_the_model_alone_trains_as_the_site_alone_would(tmp_path):
    """As many rounds as the run (not the federated best round's), each at the
    rounds' learning rate (cosine), with a fresh optimizer, and its best round
    on validation is kept, not its last."""
    cfg = digits_config(tmp_path, personalization={"method": "finetune", "finetune_epochs": 1})
    site = site_of(cfg)
    personal = Personalization(cfg.training, site)
    calls: list[tuple[float, Any, int]] = []
    steps = personal._steps

    def recording(site_: Any, optimizer: Any, extra: Any = None) -> list[float]:
        calls.append((optimizer.param_groups[0]["lr"], optimizer, len(optimizer.state)))
        return steps(site_, optimizer, extra)

    # the validation losses, scripted: one fine-tuning epoch, then four rounds alone
    # whose second is the best (the last is not)
    script = iter([5.0, 0.5, 0.2, 0.4, 0.9])
    evaluate = site.evaluate

    def evaluating(split: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = evaluate(split, *args, **kwargs)
        return {**out, "balanced_loss": next(script)} if split == "val" else out

    federated = BestModel(federated=True)
    federated.observe(1, evaluate_site(site), site.state_dict)  # the best round: 1 of 4
    personal._steps = recording  # type: ignore[method-assign]
    site.evaluate = evaluating  # type: ignore[method-assign]
    personal.choose(site, federated, 4)
    alone = calls[1:]  # after the one fine-tuning epoch
    expected = [cfg.training.lr * lr_factor(cfg.training, r, 4) for r in range(1, 5)]
    assert [lr for lr, _, _ in alone] == pytest.approx(expected)
    assert len({id(opt) for _, opt, _ in alone}) == 1
    assert alone[0][1] is not site.optimizer and alone[0][2] == 0  # fresh, no Adam state
    choice = personal.choice
    assert choice is not None and choice["personal_source"] == "local"
    assert choice["alone_round"] == 2 and choice["alone_val_score"] == -0.2


def test_no_local_candidate_where_the_start_is_no_sites_own_or_the_recipe_is_dp(tmp_path):
    cfg = digits_config(tmp_path, personalization={"method": "finetune"})
    stage = Personalization(cfg.training, site_of(cfg), own_start=False)
    assert stage.initial is None and "pre-trained encoder" in (stage.alone_skipped or "")
    recipe = digits_config(tmp_path / "recipe", recipe="dp")
    site = LocalSite.from_config(recipe)
    personal = Personalization(recipe.training, site)
    assert personal.initial is None and "recipe dp" in (personal.alone_skipped or "")
    federated = BestModel(federated=True)
    federated.observe(1, evaluate_site(site), site.state_dict)
    personal.choose(site, federated, 1)
    assert personal.choice is not None and personal.choice["alone_val_score"] is None
    assert "recipe dp" in personal.choice["alone_skipped"]


def test_without_the_local_candidate_nothing_is_trained_alone(tmp_path):
    cfg = digits_config(
        tmp_path,
        personalization={"method": "finetune", "finetune_epochs": 1, "local_candidate": False},
    )
    site = site_of(cfg)
    personal = Personalization(cfg.training, site)
    assert personal.initial is None
    federated = BestModel(federated=True)
    federated.observe(2, evaluate_site(site), site.state_dict)
    figures = personal.choose(site, federated, 2)
    assert personal.choice is not None and personal.choice["personal_source"] == "finetune"
    assert personal.choice["alone_val_score"] is None
    assert figures["personal_trained_alone"] == 0.0


def test_ditto_has_no_local_candidate(tmp_path):
    """Ditto's personal model already trains on the site's own loss every round
    (lambda -> 0 is training alone): no second model is kept for it."""
    cfg = digits_config(tmp_path, personalization={"method": "ditto"})
    assert Personalization(cfg.training, site_of(cfg)).initial is None


def test_without_personalization_or_validation_the_federated_model_is_reported(tmp_path):
    cfg = digits_config(tmp_path, personalization={"method": "none"})
    site = site_of(cfg)
    personal = Personalization(cfg.training, site)
    figures = personal.choose(site, BestModel())
    assert figures == {"reported_personal": 0.0}
    assert personal.choice is not None and personal.choice["why"] == "personalization.method none"


def test_a_one_class_validation_split_follows_the_latest_federated_round(tmp_path):
    """A one-class val split cannot choose among the federated model's rounds
    (any model that predicts its class scores perfectly there): the node's
    federated model is its latest round's, and the personal model is
    fine-tuned from that one, then chosen on validation as ever (the model
    trained alone, another candidate, is left out here)."""
    cfg = digits_config(tmp_path, personalization={"local_candidate": False})
    site = site_of(cfg)
    x_val, y_val = site.data.val.tensors
    site.data = SiteData(
        **{
            **site.data.__dict__,
            "val": torch.utils.data.TensorDataset(x_val, torch.zeros_like(y_val)),
        }
    )
    personal = Personalization(cfg.training, site)  # before training, as the rounds build it
    federated = BestModel(federated=True)
    for r in (1, 2):
        site.train_epochs()
        metrics = evaluate_site(site)
        assert metrics["val_classes"] == 1
        federated.observe(r, metrics, site.state_dict)
    assert federated.follows_latest and federated.round == 2
    latest = {k: v.clone() for k, v in site.state_dict().items()}
    assert all(torch.equal(latest[k], v) for k, v in federated.state.items())
    starts: list[dict[str, torch.Tensor]] = []
    tune = personal.finetune

    def finetune(site_: Any, start: dict[str, torch.Tensor]) -> None:
        starts.append(start)
        tune(site_, start)

    personal.finetune = finetune  # type: ignore[method-assign]
    personal.choose(site, federated, 2)
    assert len(starts) == 1 and all(torch.equal(latest[k], v) for k, v in starts[0].items())
    assert personal.choice is not None and personal.choice["personal_round"] == 2
    assert personal.choice["finetune_epoch"] is not None  # the personal model still chose
    # a val split of the site's usual classes chooses as before
    assert evaluate_site(site_of(cfg))["val_classes"] == 10


def test_a_site_that_is_no_classifier_has_nothing_to_personalize():
    """The probe protocol has no site, a pre-training stage no classifier."""
    personal = Personalization(TrainingSection(personalization={"local_norm": True}), None)
    assert personal.method == "none" and not personal.active
    personal.start_round(None)
    assert personal.keep_norm(None) is None and personal.after_fit(None) == {}
    assert personal.observe(1, None) == {} and personal.choose(None, BestModel()) == {}
    assert personal.choice is None


def test_dp_turns_auto_personalization_off_and_refuses_an_explicit_one():
    assert resolve_method(TrainingSection(dp={"target_epsilon": 4.0})) == "none"
    assert resolve_method(TrainingSection()) == "finetune"
    with pytest.raises(ValueError, match="personal model without DP"):
        TrainingSection(dp={"target_epsilon": 4.0}, personalization={"method": "ditto"})


# ---------------------------------------------------------------- ditto and its checkpoint


def _ditto_round(personal: Personalization, site: LocalSite, round_no: int) -> None:
    torch.manual_seed(round_no)
    personal.start_round(site)
    site.train_epochs()
    personal.after_fit(site)


def test_dittos_personal_model_and_optimizer_resume_from_a_checkpoint(tmp_path):
    cfg = digits_config(tmp_path, personalization={"method": "ditto", "ditto_lambda": 0.5})
    straight_site, resumed_site = site_of(cfg), site_of(cfg)
    straight = Personalization(cfg.training, straight_site)
    first = Personalization(cfg.training, resumed_site)
    for r in (1, 2):
        _ditto_round(straight, straight_site, r)
        _ditto_round(first, resumed_site, r)
    # Through the node's own checkpoint files, then into a fresh object.
    store = Checkpoints(tmp_path / "ckpt")
    store.save({"personal": first.checkpoint()})
    saved = store.latest()
    assert saved is not None
    resumed = Personalization(cfg.training, resumed_site)
    resumed.restore(saved["personal"])
    _ditto_round(straight, straight_site, 3)
    _ditto_round(resumed, resumed_site, 3)
    assert straight.state is not None and resumed.state is not None
    for key, value in straight.state.items():
        assert torch.equal(value, resumed.state[key]), key
    # The personal model is not the federated one: lambda pulls, it does not pin.
    assert any(
        not torch.equal(straight.state[k], straight_site.state_dict()[k]) for k in straight.state
    )


def test_a_restored_optimizer_matters(tmp_path):
    """The test above would pass without the optimizer state if Adam's moments
    did not matter: without them, round 3 ends elsewhere."""
    cfg = digits_config(tmp_path, personalization={"method": "ditto", "ditto_lambda": 0.5})
    a_site, b_site = site_of(cfg), site_of(cfg)
    a, b = Personalization(cfg.training, a_site), Personalization(cfg.training, b_site)
    for r in (1, 2):
        _ditto_round(a, a_site, r)
        _ditto_round(b, b_site, r)
    saved = b.checkpoint()
    saved["optimizer"] = None
    fresh = Personalization(cfg.training, b_site)
    fresh.restore(saved)
    _ditto_round(a, a_site, 3)
    _ditto_round(fresh, b_site, 3)
    assert a.state is not None and fresh.state is not None
    assert any(not torch.equal(a.state[k], fresh.state[k]) for k in a.state)


# ---------------------------------------------------------------- FedBN and balanced softmax


def test_local_norm_keeps_the_sites_batchnorm_through_a_merge(tmp_path):
    cfg = digits_config(tmp_path, personalization={"local_norm": True})
    site = site_of(cfg)
    keys = norm_keys(site.model)
    assert keys and any(k.endswith("running_mean") for k in keys)
    site.train_epochs()
    personal = Personalization(cfg.training, site)
    own = site.state_dict()
    kept = personal.keep_norm(site)
    merged = {k: v + 1.0 if v.is_floating_point() else v for k, v in own.items()}
    site.load_state_dict(merged)  # what an aggregate phase does
    personal.restore_norm(site, kept)
    after = site.state_dict()
    for key in own:
        if key in keys:
            assert torch.equal(after[key], own[key]), key
        elif own[key].is_floating_point():
            assert torch.equal(after[key], merged[key]), key


def test_local_norm_is_refused_for_a_protocol_that_merges_no_models(tmp_path):
    from protocols.fedsgdp2p import FedSgdP2P

    cfg = digits_config(tmp_path, personalization={"local_norm": True})
    site = site_of(cfg)

    class Ctx:
        config = cfg

    loop = FedSgdP2P(load_config_protocol(tmp_path, "fedsgdp2p"))
    with pytest.raises(ConfigError, match="no aggregate phase"):
        loop.personalization(Ctx(), site)  # type: ignore[arg-type]


def load_config_protocol(tmp_path: Path, name: str) -> Any:
    plans = provision(tmp_path / f"fed_{name}", ["a", "b"], protocol={"name": name, "rounds": 1})
    return load_config(plans[0].config_path).protocol


def test_balanced_softmax_adds_the_log_prior_in_training_only(tmp_path):
    cfg = digits_config(tmp_path, logit_adjustment=True)
    site = site_of(cfg)
    assert site.class_weight is None and site.class_weighting["mode"] == "logit_adjustment"
    x, y = next(site.batches("train"))
    prior = log_class_prior(site.data.class_counts("train"), site.num_classes)
    site.model.eval()
    with torch.no_grad():
        logits = site.model(x)
        expected = F.cross_entropy(logits + prior, y)
        assert torch.allclose(site.loss(x, y), expected)
        proba = site.predict_proba(x)
    assert torch.allclose(proba, torch.softmax(logits, dim=1), atol=1e-6)
    counts = [0, 3, 1]
    assert torch.allclose(log_class_prior(counts, 3).exp(), torch.tensor([1 / 7, 4 / 7, 2 / 7]))


def test_logit_adjustment_federated_leaves_a_sites_own_models_their_class_weighted_loss(
    tmp_path, monkeypatch
):
    """`logit_adjustment: federated` (FedRoD's split): the federated model's
    training adds the log prior; the personal models' steps (fine-tuning,
    trained alone, ditto) use the site's class weights, as with it off; the
    standalone and pooled baselines train as with it off too."""
    from bench.baselines import own_loss

    cfg = digits_config(tmp_path, logit_adjustment="federated")
    plain = digits_config(tmp_path / "plain")
    site, reference = site_of(cfg), site_of(plain)
    assert site.log_prior is not None and site.class_weight is None
    # the weights the site would train with, logit adjustment off (None where
    # its split is balanced enough to need none)
    if reference.class_weight is None:
        assert site.site_class_weight is None
    else:
        assert torch.allclose(site.site_class_weight, reference.class_weight)
    seen: list[Any] = []
    original = LocalSite.loss

    def spy(self, x, y, weight="site"):
        seen.append(weight)
        return original(self, x, y, weight)

    monkeypatch.setattr(LocalSite, "loss", spy)
    personal = Personalization(cfg.training, site)
    optimizer = torch.optim.SGD(site.model.parameters(), lr=0.0)
    personal._steps(site, optimizer)
    assert seen and all(w is site.site_class_weight for w in seen)
    seen.clear()
    site.train_epochs()  # the federated model's own training
    assert seen and all(w == "site" for w in seen)
    assert own_loss(cfg).training.logit_adjustment is False
    assert own_loss(plain) is plain
    with pytest.raises(ValueError):
        TrainingSection(logit_adjustment="personal")


# ---------------------------------------------------------------- real daemons, export


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two real daemons (in one process), two rounds: a with Ditto, b with the
    default (fine-tuning after the last round)."""
    root = tmp_path_factory.mktemp("personal")
    plans = provision(
        root / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 2, "fraction": 1.0},
        overrides=FAST,
        per_site={"a": {"training": {**FAST["training"], "personalization": {"method": "ditto"}}}},
    )
    status: dict[str, Any] = {}
    with InProcessFederation(plans) as fed:
        for name in ("a", "b"):
            fed[name].wait_for(lambda s: s["phase"] == "done", 120, "two rounds done")
            status[name] = fed[name].status()
    return {"configs": {p.name: p.config_path for p in plans}, "status": status}


pytestmark_group = pytest.mark.xdist_group("personal_federation")


@pytestmark_group
@pytest.mark.parametrize("name, method", [("a", "ditto"), ("b", "finetune")])
def test_real_nodes_log_and_show_the_choice(federation, name, method):
    block = federation["status"][name]["training"]["personalization"]
    assert block["method"] == method
    choice = block["choice"]
    assert choice["reported"] in ("personal", "federated")
    assert choice["personal_val_macro_f1"] is not None
    cfg = load_config(federation["configs"][name])
    rows = [
        json.loads(line)
        for line in (Path(cfg.node.state_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    last = [r for r in rows if r.get("round") == 2][-1]
    assert last["reported_personal"] == float(choice["reported"] == "personal")
    if method == "finetune":  # the model trained alone was a candidate, chosen on validation
        assert choice["personal_source"] in ("finetune", "local")
        assert choice["alone_val_score"] is not None
        assert last["personal_trained_alone"] == float(choice["personal_source"] == "local")
    assert {"personal_macro_f1", "reported_macro_f1", "personal_val_macro_f1"} <= set(last)
    if method == "ditto":  # its personal model trained every round
        assert all(r.get("personal_s", 0) > 0 for r in rows if "train_s" in r)
    # the end-of-run personalization is timed apart: the last round only, not in its round_s
    assert [r["round"] for r in rows if "personalize_s" in r] == [2]
    first = [r for r in rows if r.get("round") == 1][-1]
    wall = last["t"] - first["t"]  # round 2 from round 1's log line to its own
    assert last["personalize_s"] > 0
    assert last["round_s"] + last["personalize_s"] <= wall + 0.005  # the ms of `t`'s rounding


@pytestmark_group
def test_export_which_personal_federated_and_best(federation, tmp_path, capsys):
    config = federation["configs"]["b"]
    cfg = load_config(config)
    personal, _ = checkpointed_model(cfg, config, "personal")
    federated, _ = checkpointed_model(cfg, config, "federated")
    best, _ = checkpointed_model(cfg, config, "best")
    assert any(not torch.equal(personal[k], federated[k]) for k in personal)
    reported = federation["status"]["b"]["training"]["personalization"]["choice"]["reported"]
    chosen = personal if reported == "personal" else federated
    assert all(torch.equal(best[k], chosen[k]) for k in best)
    for which, state in (("personal", personal), ("federated", federated)):
        out = tmp_path / which
        assert main(["export", "--config", str(config), "--which", which, "--out", str(out)]) == 0
        exported = load_file(str(out / "model.safetensors"))
        common = [k for k in state if k in exported]
        assert common and all(torch.equal(exported[k], state[k].float()) for k in common), which
        card = json.loads((out / "model_card.json").read_text())
        assert card["model"]["which"] == which
        assert card["personalization"]["reported"] == reported
        alone = card["personalization"]["personal_source"] == "local"
        assert ("trained on its own data alone" in (out / "model_card.md").read_text()) == alone
        for source, said in (("local", True), ("finetune", False)):
            card["personalization"]["personal_source"] = source
            assert ("trained on its own data alone" in card_markdown(card)) == said
    capsys.readouterr()


def test_dittos_personal_weights_never_stay_in_the_model_the_node_serves(tmp_path):
    """What a node offers its peers is its site's module after the train phase
    (FedAVGP2P's fit copies it). Ditto trains the personal model in that same
    module, swapped in and out: after its steps, and after its evaluation, the
    module holds the federated weights again, bit for bit."""
    cfg = digits_config(tmp_path, personalization={"method": "ditto", "ditto_lambda": 0.1})
    site = site_of(cfg)
    personal = Personalization(cfg.training, site)
    for r in (1, 2):
        personal.start_round(site)
        site.train_epochs()
        federated = site.state_dict()
        personal.after_fit(site)
        personal.observe(r, site)
        served = site.state_dict()
        assert all(torch.equal(served[k], federated[k]) for k in federated), r
        assert personal.state is not None
        assert any(not torch.equal(personal.state[k], served[k]) for k in served), r
