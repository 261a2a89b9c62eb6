"""Secure aggregation in a 32-bit ring (protocols/masking.py): masked entries
are uint32 (int32 on the wire, the bytes of a float32 model), weights are in
the session's unit W (w/W <= 1), and the bound that keeps a sum of n clipped
contributions from wrapping, n * ceil(C * 2^20) <= 2^31 - 1, is exact at its
edge: the largest sum it allows decodes exactly, and one step past it is
refused by the contributor and by `check`."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from node.cli import main
from p2pfl.config import ModelSection
from p2pfl.config.protocols import FedAvgP2PParams
from p2pfl.config.secagg_ring import secagg_ring_overflow
from p2pfl.learning.site_model import create_site_model
from p2pfl.learning.state import averaged_keys
from p2pfl.secure import tensors
from protocols import masking
from protocols import secagg_primitives as primitives
from protocols.base import NotReady
from protocols.memory import InMemoryNetwork
from protocols.secagg import SECAGG_KIND, Contributor, SecAggError, secure_sum
from protocols.secagg_requester import weight_scale_for

STEP = 2.0**-masking.FIXED_POINT_BITS
N = 5  # contributors at the edge
EDGE = masking.entry_limit(N) * STEP  # the largest clip norm for N contributors
REQUESTER = "req"
ROUND = 2


def names(n: int) -> list[str]:
    return [f"c{i}" for i in range(n)]


def federation(
    states: dict[str, dict[str, torch.Tensor]],
    weights: dict[str, float],
    *,
    clip_norm: float | None = None,
) -> tuple[InMemoryNetwork, dict[str, Any], dict[str, Contributor]]:
    network = InMemoryNetwork()
    ctxs = {n: network.join(n) for n in [*states, REQUESTER]}
    contributors = {}
    for name in states:

        def model(wanted: int, newest: int, purpose: str, name: str = name) -> Any:
            if wanted > ROUND:
                raise NotReady(f"round {wanted}")
            return ROUND, states[name], weights[name]

        contributors[name] = Contributor(ctxs[name], model, clip_norm=clip_norm)
        ctxs[name].serve(SECAGG_KIND, contributors[name].serve)
    return network, ctxs, contributors


def ask(ctxs: dict[str, Any], members: list[str], reference: Any, **kwargs: Any) -> Any:
    return asyncio.run(
        secure_sum(
            ctxs[REQUESTER],
            members,
            round_no=ROUND,
            max_round=ROUND,
            reference=reference,
            timeout=2.0,
            **kwargs,
        )
    )


# ---------------------------------------------------------------------- the edge


def test_the_edge_is_where_n_times_the_clip_fills_the_int32_range() -> None:
    largest = masking.entry_limit(N)
    assert largest / 2**20 == EDGE and N * largest <= 2**31 - 1 < N * (largest + 1)
    assert secagg_ring_overflow(N, EDGE) is None
    past = secagg_ring_overflow(N, EDGE + STEP)
    assert past is not None
    assert (
        f"n={N} contributors x clip {EDGE + STEP!r} x 2^20 = {N * (largest + 1)} >= 2^31"
        in (past[0])
    )
    assert repr(EDGE) in past[1]  # the fix names the largest clip that fits
    assert secagg_ring_overflow(N + 1, EDGE) is not None  # one more contributor
    assert secagg_ring_overflow(N, None) is None  # no clip: entries are checked one by one


def test_the_largest_allowed_sum_decodes_exactly_through_the_protocol() -> None:
    """N contributors, each a model of norm EDGE (one entry EDGE, the rest 0)
    and the full weight W: the int32 sum is N * floor((2^31 - 1) / N), as close
    to 2^31 as N values can come, and it decodes to exactly EDGE, unwrapped."""
    members = names(N)
    state = {"w": torch.tensor([EDGE, 0.0], dtype=torch.float64), "n": torch.tensor(3)}
    states = {m: dict(state) for m in members}
    weights = dict.fromkeys(members, 100.0)
    _, ctxs, _ = federation(states, weights, clip_norm=EDGE)
    reference = {"w": torch.zeros(2, dtype=torch.float64), "n": torch.tensor(0)}
    result = ask(ctxs, members, reference, weight_scale=100.0)
    assert result.contributors == members
    assert result.mean["w"].tolist() == [EDGE, 0.0]  # exact: no wrap, no rounding
    assert result.total_weight == 500.0


def test_the_most_negative_sum_decodes_exactly_too() -> None:
    members = names(N)
    masked, seeds, public = masked_inputs(
        {m: {"w": torch.tensor([-EDGE, EDGE / 3], dtype=torch.float64)} for m in members}
    )
    reference = {"w": torch.zeros(2, dtype=torch.float64)}
    mean, total = primitives.unmask_sum(masked, seeds, {}, public, b"ctx", reference)
    assert mean["w"][0].item() == -EDGE and total == float(N)
    assert abs(mean["w"][1].item() - EDGE / 3) <= STEP / 2


def masked_inputs(
    states: dict[str, dict[str, torch.Tensor]],
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, bytes], dict[str, bytes]]:
    members = sorted(states)
    private = {n: primitives.X25519PrivateKey.generate() for n in members}
    public = {n: k.public_key().public_bytes_raw() for n, k in private.items()}
    seeds = {n: bytes([i + 1]) * 32 for i, n in enumerate(members)}
    out = {}
    for me in members:
        pair = {
            v: primitives.mask_seed(private[me], public[v], b"ctx", me, v)
            for v in members
            if v != me
        }
        out[me] = primitives.masked_input(
            {k: v.double() for k, v in states[me].items()},
            1.0,
            me=me,
            self_seed=seeds[me],
            pair_seeds=pair,
            contributors=len(members),
        )
    return out, seeds, public


def test_one_step_past_the_edge_is_refused_never_wrapped() -> None:
    """An entry one fixed-point step past EDGE, or EDGE in a sum of N + 1: the
    contributor refuses to mask it (`out_of_range`), before any share is dealt."""
    for value, n in ((EDGE + STEP, N), (EDGE, N + 1)):
        with pytest.raises(SecAggError) as err:
            primitives.masked_input(
                {"w": torch.tensor([value], dtype=torch.float64)},
                1.0,
                me="c0",
                self_seed=b"s" * 32,
                pair_seeds={},
                contributors=n,
            )
        assert err.value.reason == "out_of_range"
    # through the protocol: the contributor refuses at Round 0 and is counted
    members = names(N)
    states = {m: {"w": torch.tensor([EDGE, 0.0], dtype=torch.float64)} for m in members}
    states["c4"] = {"w": torch.tensor([EDGE + STEP, 0.0], dtype=torch.float64)}
    network, ctxs, contributors = federation(states, dict.fromkeys(members, 1.0))
    reference = {"w": torch.zeros(2, dtype=torch.float64)}
    result = ask(ctxs, members, reference, weight_scale=1.0)
    assert result.contributors == names(4)  # the sum of the others, unharmed
    assert result.mean["w"].tolist() == [EDGE, 0.0]
    assert contributors["c4"].ledger.masked(REQUESTER, ROUND) is None  # never masked
    assert any(
        r["reason"] == "secagg_out_of_range" and r["peer"] == REQUESTER for r in network.rejections
    )


def test_the_params_refuse_a_clip_no_sum_of_two_can_carry() -> None:
    base = {"name": "fedavgp2p", "secure_aggregation": True}
    two = masking.entry_limit(2) * STEP
    assert FedAvgP2PParams(**base, secagg_clip_norm=two).secagg_clip_norm == two
    with pytest.raises(ValueError, match=r"n=2 contributors x clip .* >= 2\^31"):
        FedAvgP2PParams(**base, secagg_clip_norm=two + STEP)
    # without secure aggregation the clip norm is not used: nothing to refuse
    assert FedAvgP2PParams(name="fedavgp2p", secagg_clip_norm=1e9).secagg_clip_norm == 1e9


def provision(tmp_path: Path, sites: int) -> Path:
    out = tmp_path / f"fed{sites}"
    listed = ",".join(names(sites))
    assert main(["provision", "--sites", listed, "--out", str(out), "--base-port", "7300"]) == 0
    return out


def secure_site(fed: Path, clip: float) -> Path:
    path = fed / "c0" / "site.yaml"
    data = yaml.safe_load(path.read_text())
    data["protocol"].update(secure_aggregation=True, secagg_clip_norm=clip)
    data["wire"] = {**(data.get("wire") or {}), "encryption": True}
    path.write_text(yaml.safe_dump(data))
    return path


def test_check_accepts_the_edge_and_refuses_one_step_past_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A roster of N + 1 sites: a sum has at most N contributors. `check`
    accepts EDGE and refuses EDGE + 2^-20 in one line with the bound; with one
    site more in the roster EDGE is refused too."""
    fed = provision(tmp_path, N + 1)
    path = secure_site(fed, EDGE)
    assert main(["check", "--config", str(path)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    secure_site(fed, EDGE + STEP)
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    largest = masking.entry_limit(N)
    assert err.count("\n") == 1 and "protocol.secagg_clip_norm:" in err, err
    assert f"n={N} contributors x clip {EDGE + STEP!r} x 2^20 = {N * (largest + 1)} >= 2^31" in err
    assert f"set secagg_clip_norm <= {EDGE!r}" in err
    assert main(["run", "--config", str(path)]) == 2  # run refuses it alike
    assert "could overflow the 32-bit ring" in capsys.readouterr().err
    bigger = provision(tmp_path, N + 2)
    assert main(["check", "--config", str(secure_site(bigger, EDGE))]) == 2
    assert f"n={N + 1} contributors" in capsys.readouterr().err


# ---------------------------------------------------------------------- the weight unit


def test_weights_count_at_most_the_sessions_unit_and_come_back_in_samples() -> None:
    members = names(3)
    torch.manual_seed(0)
    states = {m: {"w": torch.randn(50, dtype=torch.float64)} for m in members}
    weights = {"c0": 10.0, "c1": 20.0, "c2": 30.0}
    _, ctxs, _ = federation(states, weights)
    result = ask(ctxs, members, {"w": torch.zeros(50, dtype=torch.float64)}, weight_scale=25.0)
    counted = {"c0": 10.0, "c1": 20.0, "c2": 25.0}  # c2 past W counts as W
    assert result.total_weight == pytest.approx(55.0, abs=25.0 * STEP)
    expected = sum(counted[m] * states[m]["w"] for m in members) / 55.0
    # sum w/W x and sum w/W are each off by at most n half-steps of 2^-20
    bound = len(members) * STEP / 2 / (55.0 / 25.0) * (1 + expected.abs())
    assert bool(((result.mean["w"] - expected).abs() <= bound).all())


def test_a_requester_cannot_tell_one_contributor_another_weight_unit() -> None:
    """W is bound into the session's context: a victim told a tiny W (its
    model at full weight) while the others are told a huge one (theirs
    rounding away) derives other pair keys, so the key tags fail in Round 1
    and nobody masks anything."""
    members = names(4)
    states = {m: {"w": torch.randn(8, dtype=torch.float64)} for m in members}
    network, ctxs, contributors = federation(states, dict.fromkeys(members, 10.0))
    ctx = ctxs[REQUESTER]
    original = ctx.request

    async def lying(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        told = {**query, "weight_scale": 1.0 if peer == "c0" else 2.0**30}
        return await original(peer, kind, told, timeout)

    ctx.request = lying  # type: ignore[method-assign]
    with pytest.raises(SecAggError):
        ask(ctxs, members, {"w": torch.zeros(8, dtype=torch.float64)}, weight_scale=10.0)
    assert all(c.ledger.masked(REQUESTER, ROUND) is None for c in contributors.values())
    assert any(r["reason"] == "secagg_bad_key_tag" for r in network.rejections)


def test_the_weight_unit_is_the_most_a_contributor_may_claim() -> None:
    # the roster cap, tightened by max_weight_ratio x own count; the largest over U
    assert weight_scale_for({"a": 50, "b": 400}, ["a", "b"], 20.0, 16.0) == 320.0
    assert weight_scale_for({"a": 50, "b": 80}, ["a", "b"], 20.0, 16.0) == 80.0
    assert weight_scale_for({}, ["a", "b"], 20.0, 4.0) == 80.0
    assert weight_scale_for({}, ["a", "b"], 20.0, None) == 320.0  # no bound: 16 x own
    assert weight_scale_for({}, ["a", "b"], None, None) == 1024.0  # nothing known


# ---------------------------------------------------------------------- what it costs


def real_states(n: int) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float]]:
    states = {}
    for i, name in enumerate(names(n)):
        torch.manual_seed(i)
        model = create_site_model(ModelSection(), in_chans=1, num_classes=3, image_size=28)
        states[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return states, {m: float(100 + 37 * i) for i, m in enumerate(names(n))}


def test_a_real_models_sum_is_within_the_fixed_point_bound_of_the_float_sum() -> None:
    """The small CNN, 4 contributors, weights 100..211, W = 16 x 100 (the
    default ratio): every entry of the secure mean is within
    (n/2 steps of 2^-20 over sum w/W) * (1 + |mean|) of the float64 weighted
    mean (both sums are rounded), and so is the weight."""
    states, weights = real_states(4)
    members = sorted(states)
    scale = 1600.0
    _, ctxs, _ = federation(states, weights)
    reference = states["c0"]
    result = ask(ctxs, members, reference, weight_scale=scale)
    total = sum(weights.values())
    assert result.total_weight == pytest.approx(total, abs=len(members) * scale * STEP)
    step = len(members) * STEP / 2 / (total / scale)
    for key in averaged_keys(reference):
        exact = sum(weights[m] * states[m][key].double() for m in members) / total
        # the ring's rounding of both sums, and float32's own (the reference's dtype)
        bound = step * (1 + exact.abs()) + exact.abs() * 2.0**-24
        assert bool(((result.mean[key].double() - exact).abs() <= bound).all()), key


def test_a_masked_input_is_the_size_of_a_float32_model_on_the_wire() -> None:
    states, _ = real_states(2)
    state = states["c0"]
    plain = len(tensors.dumps({k: state[k] for k in averaged_keys(state)}))
    masked = primitives.masked_input(
        state, 1.0, me="c0", self_seed=b"s" * 32, pair_seeds={"c1": b"p" * 32}, contributors=2
    )
    assert all(t.dtype == torch.int32 for t in masked.values())
    wire = len(tensors.dumps(masked))
    assert wire <= 1.01 * plain  # one more entry (the weight): 4 bytes and its name
    floats = sum(state[k].numel() for k in averaged_keys(state))
    assert wire - plain < 200 and floats * 4 < plain
    assert math.isfinite(wire / plain)


def test_mask_streams_cancel_in_the_ring() -> None:
    a = masking.mask_stream(b"k" * 32, "w", 1001)
    x = masking.to_fixed(np.array([0.5] * 1001))
    assert np.array_equal((x + a) - a, x)  # uint32 wraps both ways


@pytest.mark.parametrize(
    "scale", [float("nan"), float("inf"), -1.0, 0.0, 2.0**41, "16", True, None, [16.0]]
)
def test_a_hostile_weight_unit_is_refused_with_a_reason(scale: Any) -> None:
    members = names(2)
    network, ctxs, _ = federation(
        {m: {"w": torch.zeros(2)} for m in members}, dict.fromkeys(members, 1.0)
    )
    query = {
        "session": "a" * 32,
        "phase": "advertise",
        "contributors": members,
        "round": ROUND,
        "max_round": ROUND,
        "purpose": "model",
        "weight_scale": scale,
        "body": {},
    }
    reply = asyncio.run(ctxs[REQUESTER].request("c0", SECAGG_KIND, query, 2.0))
    assert reply == {"refused": "bad_request"}
    assert [r["reason"] for r in network.rejections] == ["secagg_bad_request"]


def test_a_share_reply_without_a_commitment_for_a_holder_is_refused_not_a_crash() -> None:
    """Found by test_secagg_hostile's random search (phase share, commitments
    {}): Round 2's relay looked the missing commitment up and raised KeyError
    out of secure_sum. Now such a Round 1 answer is malformed, counted, and
    the sum goes on without its sender."""
    members = names(5)
    torch.manual_seed(1)
    states = {m: {"w": torch.randn(6, dtype=torch.float64)} for m in members}
    network, ctxs, _ = federation(states, dict.fromkeys(members, 1.0))
    ctx = ctxs[REQUESTER]
    original = ctx.request

    async def forgetful(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        reply = await original(peer, kind, query, timeout)
        if peer == "c4" and query["phase"] == "share":
            reply = {**reply, "commitments": {}}
        return reply

    ctx.request = forgetful  # type: ignore[method-assign]
    result = ask(ctxs, members, {"w": torch.zeros(6, dtype=torch.float64)}, weight_scale=1.0)
    assert result.contributors == names(4)
    expected = sum(states[m]["w"] for m in names(4)) / 4
    assert torch.allclose(result.mean["w"], expected, atol=1e-6)
    assert {"peer": "c4", "reason": "secagg_malformed"}.items() <= next(
        r for r in network.rejections if r["peer"] == "c4"
    ).items()
