"""protocols/checks.py: the one door every merged tensor and every claimed
sample count goes through, the roster's max_samples behind it, and the
contexts that forward refusals (Fed-MAE's fine-tuning stage, the daemon's)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
import yaml

from node.cli import load_site, main
from p2pfl.config import FedSGDP2PParams, SSFLParams, params_class
from p2pfl.secure.identity import Card, IdentityError, LocalIdentity, Roster
from protocols import create
from protocols.base import NotReady
from protocols.checks import (
    admit,
    cap_claims,
    cap_weights,
    incompatibility,
    lower_median,
    own_weight_cap,
)
from protocols.memory import InMemoryNetwork, simulation_configs
from protocols.stages import StageContext

# ---------------------------------------------------------------------- cap_weights


def test_an_inflated_claim_is_capped_at_ratio_times_the_median() -> None:
    claims = {"me": 100.0, "a": 120.0, "b": 90.0, "liar": 100_000.0}
    capped, bitten = cap_weights(claims, ratio=4.0, own="me")
    # lower median of (90, 100, 120, 100000) is 100: the liar weighs 400, not 100000
    assert capped == {"me": 100.0, "a": 120.0, "b": 90.0, "liar": 400.0}
    assert bitten == ["liar"]


def test_with_two_claims_a_neighbour_is_capped_against_ours() -> None:
    # The plain median of two claims is their mean, which a claim can never exceed
    # ratio times: the lower median is ours, so the cap still bites.
    assert lower_median([10.0, 1e9]) == 10.0
    capped, bitten = cap_weights({"me": 10.0, "liar": 1e9}, ratio=4.0, own="me")
    assert capped == {"me": 10.0, "liar": 40.0} and bitten == ["liar"]


def test_our_own_count_is_never_capped() -> None:
    capped, bitten = cap_weights(
        {"me": 5000.0, "a": 100.0, "b": 100.0}, ratio=4.0, caps={"me": 10}, own="me"
    )
    assert capped["me"] == 5000.0 and bitten == []


def test_roster_caps_apply_first_and_the_median_is_taken_over_capped_claims() -> None:
    claims = {"me": 100.0, "a": 1e6, "b": 1e6, "c": 80.0, "d": 120.0}
    capped, bitten = cap_weights(claims, ratio=None, caps={"a": 300, "b": 50_000}, own="me")
    assert capped == {"me": 100.0, "a": 300.0, "b": 50_000.0, "c": 80.0, "d": 120.0}
    assert bitten == ["a", "b"]
    # with the ratio too: median of (100, 300, 50000, 80, 120) = 120, bound 480
    capped, bitten = cap_weights(claims, ratio=4.0, caps={"a": 300, "b": 50_000}, own="me")
    assert capped == {"me": 100.0, "a": 300.0, "b": 480.0, "c": 80.0, "d": 120.0}
    assert bitten == ["a", "b"]


def test_honest_claims_and_no_caps_change_nothing() -> None:
    claims = {"me": 100.0, "a": 350.0, "b": 30.0}
    assert cap_weights(claims, ratio=4.0, own="me") == (claims, [])
    assert cap_weights({"me": 1.0, "a": 1e9}, ratio=None, own="me") == (
        {"me": 1.0, "a": 1e9},
        [],
    )


def test_cap_claims_counts_each_bite_against_its_peer_with_the_rosters_caps() -> None:
    network = InMemoryNetwork(sample_caps={"a": 50, "me": 7})
    ctx = network.join("me")
    capped, bitten = cap_claims(ctx, {"me": 100.0, "a": 90.0, "b": 1e6, "c": 110.0}, ratio=4.0)
    assert bitten == ["a", "b"]
    assert capped == {"me": 100.0, "a": 50.0, "b": 400.0, "c": 110.0}
    assert sorted((r["peer"], r["reason"]) for r in network.rejections) == [
        ("a", "weight_capped"),
        ("b", "weight_capped"),
    ]
    assert own_weight_cap(ctx) == 7.0
    assert own_weight_cap(network.join("other")) is None


# ---------------------------------------------------------------------- admit


def test_admit_counts_every_refusal_under_what_and_reason() -> None:
    network = InMemoryNetwork()
    ctx = network.join("me")
    ours = {"w": torch.ones(4), "n": torch.tensor(3)}
    cases = {
        "bad_shape": ({"w": torch.ones(5), "n": torch.tensor(3)}, "grad_shape_mismatch"),
        "bad_dtype": ({"w": torch.ones(4, dtype=torch.float64), "n": torch.tensor(3)}, None),
        "nan": ({"w": torch.tensor([1.0, float("nan"), 1.0, 1.0]), "n": torch.tensor(3)}, None),
        "huge": ({"w": torch.full((4,), 100.0), "n": torch.tensor(3)}, "grad_huge_norm"),
        "keys": ({"w": torch.ones(4)}, "grad_key_mismatch"),
        "list": ([1, 2], "grad_not_a_state_dict"),
    }
    for peer, (state, _) in cases.items():
        assert not admit(ctx, peer, "grad", state, ours, max_norm_ratio=10.0)
    assert {r["peer"]: r["reason"] for r in network.rejections} == {
        "bad_shape": "grad_shape_mismatch",
        "bad_dtype": "grad_dtype_mismatch",
        "nan": "grad_non_finite",
        "huge": "grad_huge_norm",
        "keys": "grad_key_mismatch",
        "list": "grad_not_a_state_dict",
    }
    # within the bound, or with no bound at all: merged, nothing counted
    assert admit(
        ctx,
        "ok",
        "grad",
        {"w": torch.full((4,), 9.0), "n": torch.tensor(1)},
        ours,
        max_norm_ratio=10.0,
    )
    assert admit(ctx, "ok", "grad", {"w": torch.full((4,), 100.0), "n": torch.tensor(3)}, ours)
    assert len(network.rejections) == len(cases)


# ---------------------------------------------------------------------- configuration


def test_every_averaging_protocol_selects_its_aggregation_and_weight_cap() -> None:
    for name in ("fedavgp2p", "fedsgdp2p", "ssfl", "fedperl", "fedmae"):
        params = params_class(name)(name=name, aggregation="median", max_weight_ratio=2.0)
        assert params.aggregation == "median" and params.max_weight_ratio == 2.0  # type: ignore[attr-defined]
        assert params_class(name)(name=name).max_weight_ratio == 16.0  # type: ignore[attr-defined]
        assert params_class(name)(name=name, max_weight_ratio=None).max_weight_ratio is None  # type: ignore[attr-defined]
        with pytest.raises(ValueError):
            params_class(name)(name=name, max_weight_ratio=0.5)
    assert SSFLParams(name="ssfl").aggregation == "mean"  # FedPerl Eq. 1 by default
    assert FedSGDP2PParams(name="fedsgdp2p").max_norm_ratio == 100.0


def test_ssfl_and_fedperl_average_with_the_configured_aggregation() -> None:
    """SSFL/FedPerl hard-coded the plain mean; FedAVGP2P's aggregate now reads
    their `aggregation` (mean by default: FedPerl Eq. 1)."""
    for name in ("ssfl", "fedperl"):
        proto = create(name, aggregation="trimmed_mean", trim_ratio=0.3)
        assert proto.aggregation_options() == {  # type: ignore[attr-defined]
            "method": "trimmed_mean",
            "trim_ratio": 0.3,
            "clip_norm": None,
        }
        assert create(name).aggregation_options()["method"] == "mean"  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- roster cards


def test_a_card_carries_an_optional_max_samples_and_old_cards_still_load(tmp_path: Path) -> None:
    card = LocalIdentity.generate("a").card("127.0.0.1:7000")
    old = card.to_dict()
    assert "max_samples" not in old  # a card without a cap is written as before
    assert Card.from_dict(old, "roster").max_samples is None
    capped = Card.from_dict({**old, "max_samples": 1200}, "roster")
    assert capped.max_samples == 1200 and capped.to_dict()["max_samples"] == 1200
    path = Roster([capped, LocalIdentity.generate("b").card("127.0.0.1:7001")]).save(
        tmp_path / "roster.yaml"
    )
    loaded = Roster.load(path)
    assert loaded["a"].card.max_samples == 1200 and loaded["b"].card.max_samples is None
    for bad in (0, -3, 1.5, "100", True):
        with pytest.raises(IdentityError, match="max_samples"):
            Card.from_dict({**old, "max_samples": bad}, "roster")


def test_roster_add_sets_max_samples_and_a_re_added_card_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    roster = tmp_path / "roster.yaml"
    keys = tmp_path / "d"
    assert main(["keygen", "--name", "d", "--out", str(keys), "--address", "127.0.0.1:7200"]) == 0
    card = str(keys / "d.card.yaml")
    assert main(["roster", "add", card, "--roster", str(roster), "--max-samples", "640"]) == 0
    assert yaml.safe_load(roster.read_text())["sites"][0]["max_samples"] == 640
    # the site rotates its key and sends a new card without a cap: the roster keeps 640
    assert main(["keygen", "--rotate", "--name", "d", "--out", str(keys)]) == 0
    assert main(["roster", "add", card, "--roster", str(roster)]) == 0
    entry = yaml.safe_load(roster.read_text())["sites"][0]
    assert entry["max_samples"] == 640 and "previous_signing_key" in entry
    capsys.readouterr()
    assert main(["roster", "list", "--roster", str(roster)]) == 0
    assert "max_samples=640" in capsys.readouterr().out
    assert main(["roster", "add", card, "--roster", str(roster), "--max-samples", "0"]) == 2


def test_compose_rosters_keep_max_samples(tmp_path: Path) -> None:
    from node.deploy import write_compose

    fed = tmp_path / "fed"
    assert main(["provision", "--sites", "a,b", "--out", str(fed), "--base-port", "7300"]) == 0
    roster = Roster.load(fed / "roster.yaml")
    cards = [Card(**{**c.to_dict(), "max_samples": 99}) for c in roster.cards()]
    Roster(cards).save(fed / "roster.yaml")
    write_compose(fed, ["a", "b"], [7300, 7301], [8300, 8301])
    inside = Roster.load(fed / "compose" / "roster.yaml")
    assert {c.name: c.max_samples for c in inside.cards()} == {"a": 99, "b": 99}


async def test_a_nodes_context_gives_its_protocol_the_rosters_caps_and_reloads_them(
    tmp_path: Path,
) -> None:
    from node.daemon import Node

    fed = tmp_path / "fed"
    assert main(["provision", "--sites", "a,b,c", "--out", str(fed), "--base-port", "7400"]) == 0
    roster_path = fed / "roster.yaml"
    raw = yaml.safe_load(roster_path.read_text())
    raw["sites"][1]["max_samples"] = 500  # b
    roster_path.write_text(yaml.safe_dump(raw))
    cfg, roster, identity = load_site(fed / "a" / "site.yaml")
    node = Node(cfg, roster, identity)
    try:
        assert node.ctx.sample_caps() == {"b": 500}
        raw["sites"][2]["max_samples"] = 70  # c, then SIGHUP
        roster_path.write_text(yaml.safe_dump(raw))
        node.membership.reload_roster()
        assert node.ctx.sample_caps() == {"b": 500, "c": 70}
    finally:
        await node.stop()


# ---------------------------------------------------------------------- Fed-MAE's fine-tuning context


def finetune_context(network: InMemoryNetwork) -> StageContext:
    (cfg,) = simulation_configs(["digits"], protocol={"name": "fedavgp2p"}, names=["a"])
    return StageContext(network.join("a", cfg), cfg, protocol="fedmae", round_offset=5)


def test_the_finetuning_context_gives_the_rosters_caps() -> None:
    ft = finetune_context(InMemoryNetwork(sample_caps={"b": 12}))
    assert ft.sample_caps() == {"b": 12}


async def test_the_finetuning_context_forwards_refusals_and_offers() -> None:
    """Fed-MAE's chained fine-tuning protocol counts what it refuses and wakes
    the requests held open on it, like any protocol (this already held at the
    base commit: the issue's "forwards neither" is out of date)."""
    network = InMemoryNetwork(poll_interval_s=30.0)
    ft = finetune_context(network)
    asker = network.join("b")

    ft.reject("b", "model_huge_norm")
    assert network.rejections == [
        {"node": "a", "round": 0, "peer": "b", "reason": "model_huge_norm"}
    ]

    ready = False

    async def handler(requester: str, query: dict) -> dict:
        if not ready:
            raise NotReady("not yet")
        return {"ok": True}

    ft.serve("model", handler)
    request = asyncio.create_task(asker.request("a", "finetune.model", {}, timeout=20.0))
    await asyncio.sleep(0.2)  # the request is held open on the handler's NotReady
    assert not request.done()
    start = time.monotonic()
    ready = True
    ft.offered("model")  # without forwarding, the request would wait for its 30 s poll
    assert await asyncio.wait_for(request, 5.0) == {"ok": True}
    assert time.monotonic() - start < 5.0


def test_a_peer_cannot_replace_scatternets_fixed_features_or_poison_its_weights() -> None:
    """scatternet_linear's filters are not exchanged (docs/threat-model.md): a
    hostile peer's model that carries them, to change the features every
    merging site computes, is refused like any other wrong key set; so are
    NaN, inf, huge, reshaped and empty states, each counted under its reason.
    The same keys in another order are the same model and are merged."""
    from p2pfl.learning.models import create_model

    torch.manual_seed(0)
    model = create_model("scatternet_linear", in_chans=1, num_classes=2, image_size=28)
    ours = {k: v.clone() for k, v in model.state_dict().items()}
    filters = {f"scattering.{k}": v.clone() for k, v in model.scattering.named_buffers()}
    network = InMemoryNetwork()
    ctx = network.join("me")

    def changed(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**ours, key: value}

    cases = {
        "filters": (
            {**ours, **{k: torch.zeros_like(v) for k, v in filters.items()}},
            "key_mismatch",
        ),
        "nan": (
            changed("norm.weight", torch.full_like(ours["norm.weight"], float("nan"))),
            "non_finite",
        ),
        "inf": (changed("classifier.bias", torch.tensor([float("inf"), 0.0])), "non_finite"),
        "huge": (changed("classifier.weight", ours["classifier.weight"] * -1e6), "huge_norm"),
        "reshaped": (changed("classifier.weight", ours["classifier.weight"].T), "shape_mismatch"),
        "empty": ({}, "key_mismatch"),
    }
    for peer, (state, _) in cases.items():
        assert not admit(ctx, peer, "model", state, ours, max_norm_ratio=10.0)
    assert {r["peer"]: r["reason"] for r in network.rejections} == {
        peer: f"model_{reason}" for peer, (_, reason) in cases.items()
    }
    reordered = dict(reversed(list(ours.items())))
    assert admit(ctx, "honest", "model", reordered, ours, max_norm_ratio=10.0)
    assert len(network.rejections) == len(cases)
    # and a model that did carry them could not be loaded past the filters either
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_state_dict(cases["filters"][0], strict=True)
    assert all(
        torch.equal(v, filters[f"scattering.{k}"]) for k, v in model.scattering.named_buffers()
    )


class Unlistable(dict):  # type: ignore[type-arg]
    """A peer's state dict whose keys must not be listed one by one."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("listed every key of a peer's state dict on the event loop")


def test_a_state_with_millions_of_keys_is_refused_by_its_count() -> None:
    """A review (rv_proto, 2026-11-28): `set(state)` of a peer's reply with 5
    million keys (a ~40 MB message) took 0.6 s on the event loop, where the
    exchange calls `admit`."""
    huge = Unlistable({f"k{i}": torch.zeros(1) for i in range(10_000)})
    assert incompatibility(huge, {"w": torch.ones(3)}) == "key_mismatch"
    # the same count with another key is refused as before, without listing
    assert incompatibility(Unlistable({"v": torch.ones(3)}), {"w": torch.ones(3)}) == "key_mismatch"


def test_a_negative_batchnorm_variance_is_refused_and_an_honest_one_merged() -> None:
    """A peer's model whose BatchNorm running variances are negative is finite
    and well within the norm bound (1.8 x ours here), and its mean with ours
    made every evaluation logit of the node NaN (sqrt of var + eps): until a
    review (rv_comp, 2026-11-28) it was merged; now it is refused and counted
    (`model_negative_variance`). A variance of zero, or an honest model, is
    merged and the node's evaluation stays finite."""
    from p2pfl.learning.models import SmallCNN
    from protocols.aggregate import weighted_mean

    torch.manual_seed(0)
    net, x = SmallCNN(), torch.randn(16, 1, 28, 28)
    for _ in range(3):
        net(x)  # running statistics of its own
    ours = {k: v.detach().clone() for k, v in net.state_dict().items()}
    hostile = {k: -3 * v - 1 if k.endswith("running_var") else v for k, v in ours.items()}
    zero = {k: torch.zeros_like(v) if k.endswith("running_var") else v for k, v in ours.items()}
    network = InMemoryNetwork()
    ctx = network.join("me")
    assert not admit(ctx, "mallory", "model", hostile, ours, max_norm_ratio=10.0)
    assert [(r["peer"], r["reason"]) for r in network.rejections] == [
        ("mallory", "model_negative_variance")
    ]
    for honest in (zero, {k: v.clone() for k, v in ours.items()}):
        assert admit(ctx, "p", "model", honest, ours, max_norm_ratio=10.0)
        net.load_state_dict(weighted_mean([ours, honest], [1.0, 1.0]))
        net.eval()
        assert bool(torch.isfinite(net(x)).all())
        net.train()
    assert len(network.rejections) == 1
