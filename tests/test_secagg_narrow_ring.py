"""Secure aggregation at the size of a compressed model: protocol.compression
fp16 / int8 with secure_aggregation mask quantized values in a 16- / 8-bit ring
(protocols/masking.py `to_narrow`). Each contributor masks w/W * x in the
requester's step for that entry, stochastically rounded, mod 2^bits; the sum
wraps, and the requester decodes it as the value nearest to sum(w/W) * its own
model (`from_narrow`). The steps are in the session's context, so a requester
cannot quantize one victim finely and the others to nothing; a sum whose
values crowd the ring's edge is dropped; and a masked int8 input is the size
of the plain int8 format."""

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
from p2pfl.config.secagg_ring import SECAGG_WIDE_ENTRY
from p2pfl.learning.site_model import create_site_model
from p2pfl.learning.state import averaged_keys
from p2pfl.secure import tensors
from protocols import compression, masking
from protocols import secagg_primitives as primitives
from protocols.base import NotReady, PeerUnavailable
from protocols.memory import InMemoryNetwork
from protocols.secagg import SECAGG_KIND, Contributor, SecAggError, SecureSum, secure_sum
from protocols.secagg_requester import ring_steps
from protocols.secure_exchange import SecureExchange

REQUESTER = "req"
ROUND = 2
RINGS = {"fp16": 16, "int8": 8}
FIXED = 2.0**-20  # the 32-bit ring's fixed-point step, for entries under 1,024 values


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
                if wanted > ROUND + 100:
                    raise NotReady(f"round {wanted}")
                return wanted, self.states[name], self.weights[name]

            own_ring = (rings or {}).get(name, ring)
            self.contributors[name] = Contributor(self.ctxs[name], model, ring=own_ring)
            self.ctxs[name].serve(SECAGG_KIND, self.contributors[name].serve)

    def ask(self, members: list[str], reference: dict[str, torch.Tensor], **kw: Any) -> Any:
        kw.setdefault("weight_scale", max(self.weights.values()))
        kw.setdefault("ring", self.ring)
        # each sum of a test its own model round, over a ledger that holds no
        # sum yet: a contributor masks one model (known by its digest, whatever
        # its round) for one requester once, and these tests sum the same
        # models again to test the ring
        self.asked = getattr(self, "asked", -1) + 1
        for contributor in self.contributors.values():
            contributor.ledger.contributed.clear()
        return asyncio.run(
            secure_sum(
                self.ctxs[REQUESTER],
                members,
                round_no=ROUND + self.asked,
                max_round=ROUND + self.asked,
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
        # a narrow entry: one step per contributor; a small one: 32-bit fixed point
        bound = len(members) * steps.get(key, FIXED) / shares + 1e-6
        assert float(error.max()) <= bound, key
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


def plain_exchange(ring: int) -> SecureExchange:
    return SecureExchange(
        None,  # type: ignore[arg-type]
        max_staleness=0,
        timeout=1.0,
        max_norm_ratio=10.0,
        max_weight_ratio=None,
        ring=ring,
    )


def test_a_sum_past_the_steps_reach_is_flagged_at_the_edge_and_dropped() -> None:
    """Contributors far from the requester's own model (1e4 x N(0, 1) against
    ones): their sum wraps, its values decode all over the ring, many in its
    outer quarter, and the exchange drops the sum rather than merge it, counts
    it against every contributor (nobody can tell which one it was), and
    calibrates again."""
    members = names(3)
    torch.manual_seed(5)
    states = {m: {"w": 1e4 * torch.randn(2048, dtype=torch.float64)} for m in members}
    fed = Federation(states, dict.fromkeys(members, 10.0), 8)
    reference = {"w": torch.ones(2048, dtype=torch.float64)}
    result = fed.ask(members, reference, weight_scale=10.0)
    assert result.ring_edge > 100
    exchange = plain_exchange(8)
    exchange.spreads["model"] = ({"w": 1e-3}, 30.0, 3)
    ctx = fed.ctxs[REQUESTER]
    assert not asyncio.run(exchange.decoded_well(ctx, ROUND, "model", result, reference, 10.0))
    assert "model" not in exchange.spreads and exchange.ring_edge_drops == 1
    assert exchange.narrow(reference, members, "model", 10.0)[0] == 16  # calibrates again
    blamed = [r["peer"] for r in fed.network.rejections if r["reason"] == "sum_ring_edge"]
    assert sorted(blamed) == members


def test_one_value_that_wraps_drops_the_sum() -> None:
    """The edge check counts values: 50 of 100,000 values of an entry moved
    3-20x farther than the last spread (wrapped, they decode wrong, and under
    a 0.1 % share rule the sum was kept) drop the sum: moved by different
    amounts, some of them land in the ring's outer quarter."""
    members = names(2)
    torch.manual_seed(6)
    base = torch.ones(100_000, dtype=torch.float64)
    states = {m: {"w": base + 0.001 * torch.randn(100_000, dtype=torch.float64)} for m in members}
    moved = torch.linspace(0.01, 0.05, 50, dtype=torch.float64)  # 3-20x the last spread
    for m in members:
        states[m]["w"][:50] += moved
    fed = Federation(states, dict.fromkeys(members, 10.0), 8)
    reference = {"w": base.clone()}
    steps = ring_steps(reference, 8, 2, {"w": 0.0025}, 2.0)
    result = fed.ask(members, reference, weight_scale=10.0, steps=steps)
    assert 0 < result.ring_edge <= 50
    assert not asyncio.run(
        plain_exchange(8).decoded_well(fed.ctxs[REQUESTER], ROUND, "model", result, reference, 10.0)
    )


def test_one_dishonest_contributor_can_drop_sums_and_is_counted_for_it() -> None:
    """A contributor that moves a few masked values by half the ring after
    masking makes the requester drop the sum: a denial of service that
    secure aggregation cannot attribute (the requester sees only the sum), so
    each contributor of the sum is counted (`sum_ring_edge`)."""
    members = names(3)
    states = {m: {"w": torch.ones(4096, dtype=torch.float64)} for m in members}
    fed = Federation(states, dict.fromkeys(members, 10.0), 8)
    original = fed.contributors["c2"].serve

    async def tampering(requester: str, query: dict[str, Any]) -> dict[str, Any]:
        reply = await original(requester, query)
        masked = reply.get("masked", {})
        if query.get("phase") == "mask" and masked and masked["w"].dtype == torch.int8:
            w = reply["masked"]["w"].numpy().reshape(-1).view(np.uint8)
            w[:8] += 110  # past three quarters of half the 8-bit ring
        return reply

    fed.ctxs["c2"].serve(SECAGG_KIND, tampering)
    reference = {"w": torch.ones(4096, dtype=torch.float64)}
    exchange = plain_exchange(8)
    ring, steps = exchange.narrow(reference, members, "model", 10.0)
    result = fed.ask(members, reference, weight_scale=10.0, ring=ring, steps=steps)
    assert result.ring == 16  # a calibration sum: +110 of 2^16 is no edge...
    asyncio.run(exchange.decoded_well(fed.ctxs[REQUESTER], ROUND, "model", result, reference, 10.0))
    ring, steps = exchange.narrow(reference, members, "model", 10.0)
    assert ring == 8
    result = fed.ask(members, reference, weight_scale=10.0, ring=ring, steps=steps)
    assert result.ring_edge >= 1  # ...but in the 8-bit ring it is
    assert not asyncio.run(
        exchange.decoded_well(fed.ctxs[REQUESTER], ROUND, "model", result, reference, 10.0)
    )
    assert sum(r["reason"] == "sum_ring_edge" for r in fed.network.rejections) == 3


def test_noise_does_not_feed_the_steps_of_sixty_four_contributors() -> None:
    """64 contributors 1e-3 from my model, W = 16 x their weight, ten sums
    in a row through the real masking and unmasking (self masks only; pair
    masks cancel exactly): the steps settle, and the error stays well below
    the spread over the last three sums (without the noise allowance the
    steps grew 30-fold and the error reached 30x the spread, every sum kept).
    The rounding is random: the settled error, 0.19x the spread, is reached
    by the sixth or seventh sum (18 runs), so the last three leave margin."""
    n, size = 64, 20_000
    torch.manual_seed(9)
    own = {"w": 0.05 * torch.randn(size, dtype=torch.float64)}
    states = {
        f"c{i}": {"w": own["w"] + 1e-3 * torch.randn(size, dtype=torch.float64)} for i in range(n)
    }
    weights = dict.fromkeys(states, 100.0)
    scale = 1600.0
    exact = sum(states[m]["w"] for m in states) / n
    spread = float((exact - own["w"]).abs().max())
    exchange = plain_exchange(8)
    ctx = InMemoryNetwork().join(REQUESTER)
    seen, errors = [], []
    for _ in range(10):
        ring, steps = exchange.narrow(own, sorted(states), "model", scale)
        assert steps is not None
        inputs, seeds = {}, {}
        for name, state in states.items():
            seeds[name] = bytes(32 - len(name)) + name.encode()
            inputs[name] = primitives.masked_input(
                state, weights[name], me=name, self_seed=seeds[name], pair_seeds={},
                weight_scale=scale, contributors=n, ring=ring, steps=steps,
            )  # fmt: skip
        edge: dict[str, int] = {}
        mean, total = primitives.unmask_sum(
            inputs, seeds, {}, {}, b"ctx", own, weight_scale=scale, ring=ring, steps=steps,
            edge=edge,
        )  # fmt: skip
        result = SecureSum(mean, total, sorted(states), dict.fromkeys(states, 0), [], ring=ring, steps=steps, ring_edge=sum(edge.values()))  # fmt: skip
        assert asyncio.run(exchange.decoded_well(ctx, ROUND, "model", result, own, scale))
        seen.append(steps["w"])
        errors.append(float((mean["w"] - exact).square().mean().sqrt()))
    assert max(seen[2:]) <= seen[1]  # never growing after the calibration
    assert max(errors[7:]) < spread / 3


def test_small_entries_of_a_narrow_sum_travel_in_fixed_point() -> None:
    """Entries under SECAGG_WIDE_ENTRY values (biases, norm layers' weights
    and running statistics, which differ most between sites) are masked in
    the 32-bit fixed-point ring in a narrow sum too: no step, exact to 2^-20,
    and nothing of theirs can wrap or drop a sum (a site whose running
    statistics lay far from its neighbours' dropped every calibration sum
    when they were 16-bit)."""
    members = names(3)
    big = {m: {"w": torch.ones(2048, dtype=torch.float64), "var": torch.full((16,), 50.0 * (i + 1), dtype=torch.float64)} for i, m in enumerate(members)}  # fmt: skip
    fed = Federation(big, dict.fromkeys(members, 10.0), 8)
    reference = {"w": torch.ones(2048, dtype=torch.float64), "var": torch.full((16,), 1.0, dtype=torch.float64)}  # fmt: skip
    steps = ring_steps(reference, 8, 3)
    assert set(steps) == {"w"}
    result = fed.ask(members, reference, weight_scale=10.0)
    assert result.ring_edge == 0
    assert float((result.mean["var"] - 100.0).abs().max()) <= 3 * FIXED / 3 + 1e-9


def test_a_uniform_shift_past_the_reach_is_not_seen_a_known_limit() -> None:
    """What the edge check cannot see: every value of an entry moved by the
    same amount, past the steps' reach, wraps to the same wrong offset, none
    near the edge. The calibration sums and the 8x headroom over the last
    spread make it unlikely; nothing detects it (docs/protocols.md)."""
    members = names(2)
    states = {m: {"w": torch.full((2048,), 1.0 + 138 / 64, dtype=torch.float64)} for m in members}
    fed = Federation(states, dict.fromkeys(members, 10.0), 8)
    reference = {"w": torch.ones(2048, dtype=torch.float64)}
    steps = {"w": 1 / 64}  # the sum lies 2 x 138 = 256 + 20 steps from my estimate
    result = fed.ask(members, reference, weight_scale=10.0, steps=steps)
    assert result.ring_edge == 0
    assert not torch.allclose(result.mean["w"], states["c0"]["w"])


def test_the_first_sum_calibrates_in_16_bits_and_the_next_are_int8() -> None:
    """An int8 federation: my first sum is a 16-bit calibration sum (steps from
    my own model's range), the next ones 8-bit with steps from its spread, much
    finer; every step is a power of two; a sum refused by the norm check sets
    nothing."""
    members = names(3)
    torch.manual_seed(7)
    near = {m: {"w": 1.0 + 0.01 * torch.randn(4096, dtype=torch.float64)} for m in members}
    fed = Federation(near, dict.fromkeys(members, 10.0), 8)
    reference = {"w": torch.ones(4096, dtype=torch.float64)}
    exchange = plain_exchange(8)
    ring, steps = exchange.narrow(reference, members, "model", 10.0)
    assert ring == 16 and steps is not None
    result = fed.ask(members, reference, weight_scale=10.0, ring=ring, steps=steps)
    assert result.ring == 16
    exact = fed.exact(members, "w")
    assert float((result.mean["w"] - exact).abs().max()) <= 3 * steps["w"] / 3.0 + 1e-12
    assert asyncio.run(
        exchange.decoded_well(fed.ctxs[REQUESTER], ROUND, "model", result, reference, 10.0)
    )
    ring, fine = exchange.narrow(reference, members, "model", 10.0)
    assert ring == 8 and fine is not None
    result = fed.ask(members, reference, weight_scale=10.0, ring=8, steps=fine)
    assert result.ring == 8 and result.ring_edge == 0
    error = (result.mean["w"] - exact).abs()
    spread = float((exact - 1.0).abs().max())
    assert float(error.max()) <= 3 * fine["w"] / 3.0 + 1e-12
    assert float(error.square().mean().sqrt()) < spread / 10  # int8, far below the spread
    for step in [*steps.values(), *fine.values()]:
        assert step == 2.0 ** round(np.log2(step))
    # a sum whose mean fails the norm check is merged by nobody, and sets nothing
    exchange.spreads.clear()
    result.mean["w"] = result.mean["w"] * 1e6
    assert asyncio.run(
        exchange.decoded_well(fed.ctxs[REQUESTER], ROUND, "model", result, reference, 10.0)
    )
    assert "model" not in exchange.spreads


def test_the_weights_are_not_capped_below_their_bound() -> None:
    """The narrow ring keeps the session's W (the most a contributor may
    claim): weights 1000, 100 and 10 give their weighted mean in the first
    sum (an earlier design tightened W and capped the heavy ones)."""
    members = names(3)
    values = {"c0": 0.1, "c1": 0.5, "c2": 0.9}
    states = {m: {"w": torch.full((64,), values[m], dtype=torch.float64)} for m in members}
    weights = {"c0": 1000.0, "c1": 100.0, "c2": 10.0}
    fed = Federation(states, weights, 8)
    reference = {"w": torch.full((64,), 0.5, dtype=torch.float64)}
    exchange = plain_exchange(8)
    ring, steps = exchange.narrow(reference, members, "model", 1000.0)
    result = fed.ask(members, reference, weight_scale=1000.0, ring=ring, steps=steps)
    weighted = (1000 * 0.1 + 100 * 0.5 + 10 * 0.9) / 1110
    assert float((result.mean["w"] - weighted).abs().max()) < 0.01
    assert result.total_weight == pytest.approx(1110.0, rel=1e-5)


def test_a_contributor_that_dies_after_masking_leaves_the_survivors_narrow_sum() -> None:
    """Dropout recovery in the 8-bit ring: the survivors reveal the dead
    contributor's mask key, and its pair masks come out of the uint8 sum."""
    fed, members = real_federation(5, 8)
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request

    async def losing(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        reply = await original(peer, kind, query, timeout)
        if peer == "c4" and query["phase"] == "mask":
            fed.network.kill("c4")
            raise PeerUnavailable(peer, "dead")
        return reply

    ctx.request = losing  # type: ignore[method-assign]
    reference = cnn_state(7)
    result = fed.ask(members, reference)
    survivors = ["c0", "c1", "c2", "c3"]
    assert result.contributors == survivors and result.dropped == ["c4"]
    scale = max(fed.weights.values())
    shares = sum(fed.weights[m] for m in survivors) / scale
    steps = ring_steps(reference, 8, len(members))  # the steps secure_sum chose
    for key in averaged_keys(reference):
        error = (result.mean[key].double() - fed.exact(survivors, key)).abs()
        # each survivor rounds by less than one step: at most len(survivors) steps in all
        assert float(error.max()) <= len(survivors) * steps.get(key, FIXED) / shares + 1e-6, key


# ---------------------------------------------------------------------- what travels


def test_a_masked_int8_input_is_near_the_size_of_the_plain_int8_format() -> None:
    """A masked int8 input of the small CNN (its large entries int8, its 722
    values in entries under 1,024 values 32-bit fixed point, its weight one
    32-bit entry) against the plain exchange's int8 payload of the same model
    (blockwise, one float32 scale per block): at most 1.11x."""
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
    for key, value in masked.items():
        small = key == masking.WEIGHT_KEY or value.numel() < SECAGG_WIDE_ENTRY
        want = torch.int32 if small else torch.int8
        assert value.dtype == want, key
    wire = len(tensors.dumps(masked))
    assert wire <= 1.11 * plain, (wire, plain)


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
    large = [k for k in averaged_keys(reference) if reference[k].numel() >= SECAGG_WIDE_ENTRY]
    assert len(masked) >= 3 * len(large)
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
    members = names(5)
    states = {m: cnn_state(i) for i, m in enumerate(members)}
    fed = Federation(states, dict.fromkeys(members, 10.0), 8, rings={"c4": 32})
    result = fed.ask(members, cnn_state(7), ring=8)
    assert result.contributors == ["c0", "c1", "c2", "c3"]
    assert any(r["reason"] == "secagg_ring_mismatch" for r in fed.network.rejections)
    # an int8 federation answers a 16-bit calibration sum; an fp16 one no 8-bit sum
    fed = Federation(states, dict.fromkeys(members, 10.0), 8, rings={"c4": 16})
    assert fed.ask(members, cnn_state(7), ring=16).contributors == members
    assert fed.ask(members, cnn_state(7), ring=8).contributors == ["c0", "c1", "c2", "c3"]


@pytest.mark.parametrize(
    "change",
    [
        {"steps": None},  # a narrow ring without steps
        {"steps": {"w": 0.1}},  # steps that do not name the model's entries
        {"steps": "drop"},  # one entry without a step
        {"ring": 12},  # not a ring
        {"ring": 32},  # steps with the 32-bit ring
        {"steps": {"KEY": float("nan")}},
        {"steps": {"KEY": 0.0}},
        {"steps": {"KEY": -1.0}},
        {"steps": {"KEY": 2.0**80}},
        {"steps": {"x" * 600: 0.1}},
        {"steps": {"x" * 2000: 0.1}},  # a name past the schema's 1,024 characters
        {"steps": {}},
        {"steps": [0.1]},
        {"steps": "MANY"},  # 16,385 names: past the schema's bound, never stored
        {"steps": {"KEY": float("inf")}},
        {"steps": {"KEY": "0.1"}},
        {"steps": {"KEY": True}},
        {"ring": 24},
        {"ring": "8"},
        {"ring": True},
        {"ring": -8},
        {"ring": 2**40},
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
            elif value == "MANY":
                told[field] = {f"e{i}": 0.1 for i in range(16_385)}
            elif field == "steps" and isinstance(value, dict) and "KEY" in value:
                first = sorted(query[field])[0]  # a real entry of the model, a bad step
                told[field] = {**query[field], first: value["KEY"]}
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
    from test_secagg_ring import provision  # the 32-bit ring's federation on disk

    path = provision(tmp_path, sites) / "c0" / "site.yaml"
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


@pytest.mark.parametrize(
    ("fmt", "secure", "ring"),
    [("int8", True, 8), ("fp16", True, 16), ("int8", False, 8), ("topk:0.1", False, 32)],
)
def test_fedperls_anonymized_peer_sums_in_its_compressions_ring(
    fmt: str, secure: bool, ring: int
) -> None:
    """FedPerl's anonymized peer is a secure sum in every mode: in the ring of
    its compression, and dense (32 bits) under top-k, which cannot be summed."""
    from p2pfl.config import FedPerlParams
    from protocols.fedperl import FedPerl

    protocol = FedPerl(FedPerlParams(name="fedperl", compression=fmt, secure_aggregation=secure))
    assert protocol.anonymizer.ring == ring


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e308])
def test_a_requester_whose_own_model_has_no_steps_gets_no_sum_and_goes_on(bad: float) -> None:
    """Steps come from my own model: a non-finite (or float64-huge) value in
    it is no step, a refusal of this sum (logged), not an exception out of
    the exchange that would fail the protocol."""
    from protocols.exchange import ServedModels

    members = names(2)
    fed = Federation({m: {"w": torch.ones(2048, dtype=torch.float64)} for m in members}, dict.fromkeys(members, 10.0), 8)  # fmt: skip
    exchange = SecureExchange(
        ServedModels(3), max_staleness=0, timeout=1.0, max_norm_ratio=None,
        max_weight_ratio=None, ring=8,
    )  # fmt: skip
    own = {"w": torch.ones(2048, dtype=torch.float64)}
    own["w"][3] = bad
    got = asyncio.run(exchange.sum_of(fed.ctxs[REQUESTER], ROUND, own, members))
    assert got is None
    assert all(c.ledger.masked(REQUESTER, ROUND) is None for c in fed.contributors.values())


def test_the_next_steps_follow_this_sums_unit_not_the_last_ones() -> None:
    """W changes with the chosen contributors' roster caps: a last sum in W =
    16,000 (sum of w/W 0.125) and a next one in W = 2,000 of the same weights
    (sum of w/W 1.0). The carried-over sum of w/W is 1.0, so the next steps
    hold an honest sum within the last spread (they were 8x too fine, and the
    sum dropped, counted against honest contributors)."""
    members = names(2)
    torch.manual_seed(10)
    own = {"w": torch.zeros(4096, dtype=torch.float64)}
    near = {m: {"w": 0.05 * (2 * torch.rand(4096, dtype=torch.float64) - 1)} for m in members}
    fed = Federation(near, dict.fromkeys(members, 1000.0), 8)
    exchange = plain_exchange(8)
    exchange.spreads["model"] = ({"w": 0.05}, 2000.0, 2)  # kept in W = 16,000
    ring, steps = exchange.narrow(own, members, "model", 2000.0)
    assert ring == 8 and steps is not None
    result = fed.ask(members, own, weight_scale=2000.0, ring=ring, steps=steps)
    assert result.ring_edge == 0
    assert asyncio.run(
        exchange.decoded_well(fed.ctxs[REQUESTER], ROUND, "model", result, own, 2000.0)
    )


def test_a_requester_cannot_tell_contributors_different_rings() -> None:
    """The ring is in the session's context too: one contributor told 16
    bits while the others are told 8 derives other pair keys; the tags fail
    in Round 1 and nobody masks."""
    fed, members = real_federation(3, 8)
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request

    async def lying(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        if peer == "c0":
            query = {**query, "ring": 16}
        return await original(peer, kind, query, timeout)

    ctx.request = lying  # type: ignore[method-assign]
    with pytest.raises(SecAggError):
        fed.ask(members, cnn_state(7))
    assert all(c.ledger.masked(REQUESTER, ROUND) is None for c in fed.contributors.values())
    assert any(r["reason"] == "secagg_bad_key_tag" for r in fed.network.rejections)


def test_steps_changed_after_round_0_are_refused() -> None:
    """Steps travel in Round 0; a later phase may repeat them, never change
    them: a contributor told other steps when asked to mask refuses
    (`session_mismatch`, counted) and masks nothing."""
    fed, members = real_federation(3, 8)
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request
    first: dict[str, Any] = {}

    async def changing(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        if query["phase"] == "advertise":
            first.update(query["steps"])
        elif query["phase"] == "mask":
            query = {**query, "steps": {k: v * 1000 for k, v in first.items()}}
        return await original(peer, kind, query, timeout)

    ctx.request = changing  # type: ignore[method-assign]
    with pytest.raises(SecAggError):
        fed.ask(members, cnn_state(7))
    assert all(c.ledger.masked(REQUESTER, ROUND) is None for c in fed.contributors.values())
    reasons = [r["reason"] for r in fed.network.rejections]
    assert reasons.count("secagg_session_mismatch") == 3


@pytest.mark.parametrize(
    "forge", ["int16 for an int8 entry", "int32 for an int8 entry", "one value more", "float32"]
)
def test_a_masked_input_of_another_width_or_size_is_refused_and_counted(forge: str) -> None:
    """A contributor whose masked input does not have the session's wire form
    (each large entry int8, each small one and the weight int32, every shape
    the requester's) is left out of the sum and counted (`secagg_malformed`);
    the others' sum goes on, without a crash."""
    fed, members = real_federation(5, 8)
    reference = cnn_state(7)
    large = next(k for k in averaged_keys(reference) if reference[k].numel() >= SECAGG_WIDE_ENTRY)
    original = fed.contributors["c4"].serve

    async def forging(requester: str, query: dict[str, Any]) -> dict[str, Any]:
        reply = await original(requester, query)
        if query.get("phase") == "mask" and "masked" in reply:
            value = reply["masked"][large]
            reply["masked"][large] = {
                "int16 for an int8 entry": value.to(torch.int16),
                "int32 for an int8 entry": value.to(torch.int32),
                "one value more": torch.cat([value.reshape(-1), value.reshape(-1)[:1]]),
                "float32": value.to(torch.float32),
            }[forge]
        return reply

    fed.ctxs["c4"].serve(SECAGG_KIND, forging)
    result = fed.ask(members, reference)
    assert result.contributors == ["c0", "c1", "c2", "c3"] and result.dropped == ["c4"]
    assert ("c4", "secagg_malformed") in [(r["peer"], r["reason"]) for r in fed.network.rejections]


def test_a_calibration_and_a_narrow_sum_at_once_get_each_model_once() -> None:
    """A requester asking for a 16-bit and an 8-bit sum of the same models at
    once (two rings, two sets of steps: two sums it could subtract) gets at
    most one of them: each model is masked for it once, whatever the ring."""
    fed, members = real_federation(3, 8)
    reference = cnn_state(7)

    async def both() -> list[Any]:
        async def one(ring: int) -> Any:
            try:
                return await secure_sum(
                    fed.ctxs[REQUESTER], members, round_no=ROUND, max_round=ROUND,
                    reference=reference, timeout=5.0, weight_scale=174.0, ring=ring,
                )  # fmt: skip
            except SecAggError as exc:
                return exc

        return await asyncio.wait_for(asyncio.gather(one(16), one(8)), 60)

    results = asyncio.run(both())
    assert sum(not isinstance(r, SecAggError) for r in results) <= 1, results
