"""Secure aggregation at the size of a compressed model: protocol.compression
fp16 / int8 with secure_aggregation mask quantized values in a 16- / 8-bit ring
(protocols/masking.py `to_narrow`). Each of n contributors quantizes w/W * x in
the requester's step for that entry, stochastically rounded and clamped to
(2^(bits-1) - 1) // n, so the sum never wraps; the steps are in the session's
context, so a requester cannot quantize one victim finely and the others to
nothing; and a masked int8 input is the size of the plain int8 format."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from tensor_util import tensors_in

from node.cli import main
from p2pfl.config import ModelSection
from p2pfl.config.protocols import FedAvgP2PParams
from p2pfl.learning.site_model import create_site_model
from p2pfl.learning.state import averaged_keys
from p2pfl.secure import tensors
from protocols import compression, masking
from protocols import secagg_primitives as primitives
from protocols.base import NotReady, PeerUnavailable
from protocols.memory import InMemoryNetwork
from protocols.secagg import SECAGG_KIND, Contributor, SecAggError, secure_sum
from protocols.secagg_requester import ring_steps
from protocols.secure_exchange import RING_EDGE_LIMIT, SecureExchange

REQUESTER = "req"
ROUND = 2
RINGS = {"fp16": 16, "int8": 8}


def names(n: int) -> list[str]:
    return [f"c{i}" for i in range(n)]


def cnn_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = create_site_model(ModelSection(), in_chans=1, num_classes=3, image_size=28)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Federation:
    """n contributors serving `secagg` in one ring over an in-memory network."""

    def __init__(
        self,
        states: dict[str, dict[str, torch.Tensor]],
        weights: dict[str, float],
        ring: int,
        rings: dict[str, int] | None = None,
    ) -> None:
        self.network = InMemoryNetwork()
        self.ctxs = {n: self.network.join(n) for n in [*states, REQUESTER]}
        self.states, self.weights, self.ring = states, weights, ring
        self.contributors = {}
        for name in states:

            def model(wanted: int, newest: int, purpose: str, name: str = name) -> Any:
                if wanted > ROUND:
                    raise NotReady(f"round {wanted}")
                return ROUND, self.states[name], self.weights[name]

            own_ring = (rings or {}).get(name, ring)
            self.contributors[name] = Contributor(self.ctxs[name], model, ring=own_ring)
            self.ctxs[name].serve(SECAGG_KIND, self.contributors[name].serve)

    def ask(self, members: list[str], reference: dict[str, torch.Tensor], **kw: Any) -> Any:
        kw.setdefault("weight_scale", max(self.weights.values()))
        kw.setdefault("ring", self.ring)
        return asyncio.run(
            secure_sum(
                self.ctxs[REQUESTER],
                members,
                round_no=ROUND,
                max_round=ROUND,
                reference=reference,
                timeout=5.0,
                **kw,
            )
        )

    def exact(self, members: list[str], key: str) -> torch.Tensor:
        total = sum(self.weights[m] for m in members)
        return sum(self.weights[m] * self.states[m][key].double() for m in members) / total


def real_federation(n: int, ring: int) -> tuple[Federation, list[str]]:
    members = names(n)
    states = {m: cnn_state(i) for i, m in enumerate(members)}
    weights = {m: float(100 + 37 * i) for i, m in enumerate(members)}
    return Federation(states, weights, ring), members


# ---------------------------------------------------------------------- the sum


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_a_real_models_narrow_sum_is_within_one_step_per_contributor(fmt: str) -> None:
    """The small CNN, 3 contributors of weights 100..174, the requester's own
    model another draw: every entry of the mean is within n steps of the
    float64 weighted mean, divided by sum w/W (each stochastic rounding is off
    by less than one step, and nothing is clamped at a 2x margin)."""
    ring = RINGS[fmt]
    fed, members = real_federation(3, ring)
    reference = cnn_state(7)
    result = fed.ask(members, reference)
    assert result.contributors == members and result.dropped == []
    scale = max(fed.weights.values())
    shares = sum(fed.weights.values()) / scale
    steps = ring_steps(reference, ring, len(members))
    for key in averaged_keys(reference):
        error = (result.mean[key].double() - fed.exact(members, key)).abs()
        bound = len(members) * steps[key] / shares + 1e-6
        assert float(error.max()) <= bound, key
        # and the rounding is real: an int8 sum is not the float sum
    assert result.total_weight == pytest.approx(sum(fed.weights.values()), rel=1e-5)


def test_stochastic_rounding_is_unbiased() -> None:
    """E[q] * step = value: 4,000 draws of one value between two levels average
    to it within 5 standard errors (a deterministic rounding would be off by
    0.3 steps)."""
    value = torch.full((4000,), 0.3)
    q = masking.to_narrow(value, 1.0, 8, torch.Generator().manual_seed(1))
    got = q.view(np.int8).astype(np.float64)
    assert set(np.unique(got)) == {0.0, 1.0}
    assert abs(got.mean() - 0.3) < 5 * np.sqrt(0.3 * 0.7 / 4000)


@pytest.mark.parametrize("bits", [8, 16])
def test_a_sum_within_half_the_ring_of_the_estimate_decodes_exactly(bits: int) -> None:
    """The residue mod 2^bits of any S within 2^(bits-1) - 1 of the estimate
    gives S back exactly, whatever its size; the offsets say how far it lay."""
    half = (1 << (bits - 1)) - 1
    expected = np.array([1e6 + 0.4, -3e5 - 0.2, 12.0, 0.0])
    for offset in (-half, -1, 0, 1, half):
        exact = np.round(expected) + offset
        residue = np.mod(exact.astype(np.int64), 1 << bits).astype(
            {8: np.uint8, 16: np.uint16}[bits]
        )
        decoded, offsets = masking.from_narrow(residue, 0.5, expected)
        assert np.array_equal(decoded, exact * 0.5) and np.all(offsets == offset)
    with pytest.raises(masking.MaskingError):
        masking.from_narrow(np.zeros(1, dtype=np.uint8), 1.0, np.array([2.0**60]))


def test_a_sum_past_the_steps_reach_is_flagged_at_the_edge_and_dropped() -> None:
    """Contributors far from the requester's own model (1e6 against 1, far
    past the steps' reach): their sum wraps, its values decode all over the
    ring, the share in its outer quarter is far above RING_EDGE_LIMIT, and the
    exchange drops the sum rather than merge it, and widens its next steps."""
    members = names(3)
    states = {m: {"w": torch.full((256,), 1e6, dtype=torch.float64)} for m in members}
    fed = Federation(states, dict.fromkeys(members, 10.0), 8)
    reference = {"w": torch.ones(256, dtype=torch.float64)}
    result = fed.ask(members, reference, weight_scale=10.0)
    assert result.ring_edge > 100 * RING_EDGE_LIMIT
    exchange = SecureExchange(
        None,  # type: ignore[arg-type]
        max_staleness=0,
        timeout=1.0,
        max_norm_ratio=None,
        max_weight_ratio=None,
        ring=8,
    )
    exchange.spreads["model"] = {"w": 1e-3}
    assert not exchange.decoded_well(fed.ctxs[REQUESTER], ROUND, "model", result, reference)
    assert "model" not in exchange.spreads and exchange.ring_edge_drops == 1
    # members near my model: kept, and the next steps follow its spread
    near = {
        m: {"w": torch.full((256,), 1.0 + 0.01 * i, dtype=torch.float64)}
        for i, m in enumerate(members)
    }
    fed = Federation(near, dict.fromkeys(members, 10.0), 8)
    result = fed.ask(members, reference, weight_scale=10.0)
    assert result.ring_edge == 0.0
    assert exchange.decoded_well(fed.ctxs[REQUESTER], ROUND, "model", result, reference)
    wide = ring_steps(reference, 8, 3)["w"]  # the first sum's: 3 x 2 x max|own| / 127
    # the mean is 1.01: its spread from my model is 0.01, up to one step each of the
    # 3 (sum w/W = 3)
    assert abs(exchange.spreads["model"]["w"] - 0.01) <= wide + 1e-9
    assert exchange.last_totals["model"] == pytest.approx(30.0, rel=1e-5)
    assert exchange.steps(reference, members, "model")["w"] < wide / 10  # type: ignore[index]


def test_a_contributor_that_dies_after_masking_leaves_the_survivors_narrow_sum() -> None:
    """Dropout recovery in the 8-bit ring: the survivors reveal the dead
    contributor's mask key, and its pair masks come out of the uint8 sum."""
    fed, members = real_federation(4, 8)
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request

    async def losing(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        reply = await original(peer, kind, query, timeout)
        if peer == "c3" and query["phase"] == "mask":
            fed.network.kill("c3")
            raise PeerUnavailable(peer, "dead")
        return reply

    ctx.request = losing  # type: ignore[method-assign]
    reference = cnn_state(7)
    result = fed.ask(members, reference)
    survivors = ["c0", "c1", "c2"]
    assert result.contributors == survivors and result.dropped == ["c3"]
    scale = max(fed.weights.values())
    shares = sum(fed.weights[m] for m in survivors) / scale
    steps = ring_steps(reference, 8, 4)
    for key in averaged_keys(reference):
        error = (result.mean[key].double() - fed.exact(survivors, key)).abs()
        assert float(error.max()) <= 3 * steps[key] / shares + 1e-6, key


# ---------------------------------------------------------------------- what travels


def test_a_masked_int8_input_is_the_size_of_the_plain_int8_format() -> None:
    """Secure aggregation at plain size: the masked int8 input of the small
    CNN (plus its 32-bit weight) against the plain exchange's int8 payload of
    the same model (blockwise, one float32 scale per block): at most 1.05x."""
    state = cnn_state(0)
    floats = {k: state[k] for k in averaged_keys(state)}
    plain = len(tensors.dumps(compression.compress_state(floats, compression.parse("int8"))))
    steps = ring_steps(state, 8, 2)
    masked = primitives.masked_input(
        state,
        1.0,
        me="c0",
        self_seed=b"s" * 32,
        pair_seeds={"c1": b"p" * 32},
        contributors=2,
        ring=8,
        steps=steps,
    )
    assert {t.dtype for k, t in masked.items() if k != masking.WEIGHT_KEY} == {torch.int8}
    assert masked[masking.WEIGHT_KEY].dtype == torch.int32
    wire = len(tensors.dumps(masked))
    assert wire <= 1.05 * plain, (wire, plain)


def test_nothing_the_requester_receives_is_a_contributors_quantized_model() -> None:
    """Every masked int8 tensor the requester receives, read back with the
    session's step, is nowhere near the contributor's quantized model: the
    masks are uniform in the 8-bit ring (each of the 256 values about equally
    often)."""
    fed, members = real_federation(3, 8)
    seen: list[Any] = []
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request

    async def spying(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        reply = await original(peer, kind, query, timeout)
        seen.append(reply)
        return reply

    ctx.request = spying  # type: ignore[method-assign]
    reference = cnn_state(7)
    fed.ask(members, reference)
    masked = [t for reply in seen for t in tensors_in(reply) if t.dtype == torch.int8]
    assert len(masked) >= 3 * len(averaged_keys(reference))
    values = np.concatenate([t.numpy().reshape(-1).view(np.uint8) for t in masked])
    counts = np.bincount(values, minlength=256)
    expected = len(values) / 256
    assert len(values) > 50_000
    assert float(((counts - expected) ** 2 / expected).sum()) < 400  # chi2(255): p ~ 1e-8
    steps = ring_steps(reference, 8, 3)
    key = max(averaged_keys(reference), key=lambda k: reference[k].numel())
    for t in masked:
        if tuple(t.shape) != tuple(reference[key].shape):
            continue
        decoded = t.double() * steps[key]
        for name in members:
            plain = fed.states[name][key].double() * fed.weights[name] / 174.0
            assert float((decoded - plain).abs().mean()) > 10 * steps[key]


# ---------------------------------------------------------------------- hostile requests


def test_a_requester_cannot_give_one_contributor_finer_steps() -> None:
    """The steps are in the session's context: a victim told steps 1,000
    times finer than the others (so that their values round to nothing and the
    sum is its model) derives other pair keys; the tags fail in Round 1 and
    nobody masks anything."""
    fed, members = real_federation(3, 8)
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request

    async def lying(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        if peer != "c0" and "steps" in query:  # Round 0 carries them
            query = {**query, "steps": {k: v * 1000 for k, v in query["steps"].items()}}
        return await original(peer, kind, query, timeout)

    ctx.request = lying  # type: ignore[method-assign]
    with pytest.raises(SecAggError):
        fed.ask(members, cnn_state(7))
    assert all(c.ledger.masked(REQUESTER, ROUND) is None for c in fed.contributors.values())
    assert any(r["reason"] == "secagg_bad_key_tag" for r in fed.network.rejections)


def test_a_request_in_another_ring_is_refused_with_a_reason() -> None:
    """The ring is federation-wide: a contributor of an int8 federation
    refuses a 32-bit or a 16-bit session, and the sum goes on without it."""
    members = names(4)
    states = {m: cnn_state(i) for i, m in enumerate(members)}
    fed = Federation(states, dict.fromkeys(members, 10.0), 8, rings={"c3": 32})
    result = fed.ask(members, cnn_state(7), ring=8)
    assert result.contributors == ["c0", "c1", "c2"]
    assert any(r["reason"] == "secagg_ring_mismatch" for r in fed.network.rejections)


@pytest.mark.parametrize(
    "change",
    [
        {"steps": None},  # a narrow ring without steps
        {"steps": {"w": 0.1}},  # steps that do not name the model's entries
        {"steps": "drop"},  # one entry without a step
        {"ring": 12},  # not a ring
        {"ring": 32},  # steps with the 32-bit ring
        {"steps": {"net.0.weight": float("nan")}},
        {"steps": {"net.0.weight": 0.0}},
        {"steps": {"net.0.weight": -1.0}},
        {"steps": {"net.0.weight": 2.0**80}},
        {"steps": {"x" * 600: 0.1}},
    ],
)
def test_hostile_steps_and_rings_are_refused_never_masked(change: dict[str, Any]) -> None:
    members = names(3)
    states = {m: cnn_state(i) for i, m in enumerate(members)}
    fed = Federation(states, dict.fromkeys(members, 10.0), 8)
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request

    async def hostile(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        told = dict(query)
        if query["phase"] != "advertise":
            return await original(peer, kind, told, timeout)
        for field, value in change.items():
            if value == "drop":
                told[field] = dict(list(query[field].items())[1:])
            elif field == "steps" and isinstance(value, dict) and "net.0.weight" in value:
                told[field] = {**query[field], **value}
            else:
                told[field] = value
        return await original(peer, kind, told, timeout)

    ctx.request = hostile  # type: ignore[method-assign]
    with pytest.raises(SecAggError):
        fed.ask(members, cnn_state(7))
    assert all(c.ledger.masked(REQUESTER, ROUND) is None for c in fed.contributors.values())
    assert fed.network.rejections, "each refusal is counted"


# ---------------------------------------------------------------------- configuration


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_the_params_accept_fp16_and_int8_with_secure_aggregation(fmt: str) -> None:
    params = FedAvgP2PParams(name="fedavgp2p", secure_aggregation=True, compression=fmt)
    assert params.compression == fmt


def test_the_params_refuse_topk_with_secure_aggregation_in_one_line() -> None:
    with pytest.raises(ValueError) as caught:
        FedAvgP2PParams(name="fedavgp2p", secure_aggregation=True, compression="topk:0.1")
    message = str(caught.value)
    assert "top-k keeps other positions" in message and "use none, fp16 or int8" in message


def narrow_site(tmp_path: Path, sites: int, fmt: str) -> Path:
    out = tmp_path / f"fed{sites}"
    listed = ",".join(names(sites))
    assert main(["provision", "--sites", listed, "--out", str(out), "--base-port", "7300"]) == 0
    path = out / "c0" / "site.yaml"
    data = yaml.safe_load(path.read_text())
    data["protocol"].update(secure_aggregation=True, compression=fmt)
    data["wire"] = {**(data.get("wire") or {}), "encryption": True}
    path.write_text(yaml.safe_dump(data))
    return path


def test_check_accepts_int8_secure_sums_and_refuses_topk_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--config", str(narrow_site(tmp_path, 5, "int8"))]) == 0
    capsys.readouterr()
    path = narrow_site(tmp_path / "k", 5, "topk:0.1")
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "top-k keeps other positions" in err, err
    assert main(["run", "--config", str(path)]) == 2
    assert "top-k keeps other positions" in capsys.readouterr().err
