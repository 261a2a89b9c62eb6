"""Secure aggregation (protocols/secagg.py): the requester gets the sum of the
contributors that stayed, never one contributor's model, whatever it asks."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensor_util import tensors_in

from p2pfl.config import ModelSection
from p2pfl.learning.site_model import create_site_model
from protocols import masking, secagg
from protocols import secagg_primitives as primitives
from protocols.base import NotReady, PeerUnavailable
from protocols.memory import InMemoryContext, InMemoryNetwork
from protocols.secagg import SECAGG_KIND, Contributor, SecAggError, secure_sum

CONTRIBUTORS = ["alice", "bob", "carol", "erin"]
REQUESTER = "dave"
ROUND = 3


def small_cnn_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = create_site_model(ModelSection(), in_chans=1, num_classes=3, image_size=8)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
            module.num_batches_tracked.fill_(seed + 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Federation:
    """Four contributors serving `secagg` over an in-memory network, one requester."""

    def __init__(self, names: list[str] = CONTRIBUTORS, weights: dict[str, float] | None = None):
        self.network = InMemoryNetwork()
        self.ctxs: dict[str, InMemoryContext] = {
            n: self.network.join(n) for n in [*names, REQUESTER]
        }
        self.states = {n: small_cnn_state(i) for i, n in enumerate(names)}
        self.weights = weights or {n: float(10 * (i + 1)) for i, n in enumerate(names)}
        self.contributors: dict[str, Contributor] = {}
        for name in names:
            contributor = Contributor(self.ctxs[name], self.source(name))
            self.contributors[name] = contributor
            self.ctxs[name].serve(SECAGG_KIND, contributor.serve)
        self.reference = small_cnn_state(99)

    def source(self, name: str) -> Any:
        def model(
            wanted: int, newest: int, purpose: str
        ) -> tuple[int, dict[str, torch.Tensor], float]:
            if wanted > ROUND:
                raise NotReady(f"round {wanted}")
            return ROUND, self.states[name], self.weights[name]

        return model

    def expected(self, members: list[str]) -> dict[str, torch.Tensor]:
        total = sum(self.weights[m] for m in members)
        out = {}
        for key, ref in self.reference.items():
            if ref.is_floating_point():
                out[key] = (
                    sum(self.weights[m] * self.states[m][key].double() for m in members) / total
                )
        return out

    async def ask(self, members: list[str], **kwargs: Any) -> secagg.SecureSum:
        # W, the session's weight unit: the most any contributor claims (w/W <= 1)
        kwargs.setdefault("weight_scale", max(self.weights.values()))
        return await secure_sum(
            self.ctxs[REQUESTER],
            members,
            round_no=ROUND,
            max_round=ROUND,
            reference=self.reference,
            timeout=2.0,
            **kwargs,
        )

    async def raw(
        self, peer: str, phase: str, session: str, members: list[str], body: dict[str, Any]
    ) -> Any:
        query = {
            "session": session,
            "phase": phase,
            "contributors": members,
            "round": ROUND,
            "max_round": ROUND,
            "purpose": "model",
            "body": body,
        }
        return await self.ctxs[REQUESTER].request(peer, SECAGG_KIND, query, 2.0)


def relayed(advert: dict[str, Any], to: str, owner: str = "") -> dict[str, Any]:
    """A Round 0 answer as the requester relays it to `to`: the keys, and the
    tag the owner made for `to` (none for the owner itself)."""
    entry = {k: v for k, v in advert.items() if k != "tags"}
    entry["tag"] = b"" if owner == to else advert["tags"].get(to, b"")
    return entry


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for key, value in want.items():
        assert torch.allclose(got[key].double(), value, atol=1e-5), key


def test_the_requester_gets_the_weighted_mean_of_all_contributors() -> None:
    fed = Federation()
    result = asyncio.run(fed.ask(CONTRIBUTORS))
    assert result.contributors == CONTRIBUTORS
    assert result.dropped == []
    assert result.total_weight == pytest.approx(sum(fed.weights.values()), abs=1e-5)
    assert_close(result.mean, fed.expected(CONTRIBUTORS))
    # counters are not averaged: the requester keeps its own
    for key, ref in fed.reference.items():
        if not ref.is_floating_point():
            assert torch.equal(result.mean[key], ref)


def test_nothing_the_requester_receives_is_an_individual_model() -> None:
    """Record every reply the requester gets: no float tensor, and no masked
    input equals (or reveals, by a fixed-point decode) a contributor's model."""
    fed = Federation()
    seen: list[Any] = []
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request

    async def spying(peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        reply = await original(peer, kind, query, timeout)
        seen.append(reply)
        return reply

    ctx.request = spying  # type: ignore[method-assign]
    asyncio.run(fed.ask(CONTRIBUTORS))
    tensors = [t for reply in seen for t in tensors_in(reply)]
    assert tensors, "the masked inputs travelled"
    assert all(t.dtype == torch.int32 for t in tensors)  # the 32-bit ring, float32's size
    key = (
        "net.0.weight"
        if "net.0.weight" in fed.reference
        else next(k for k, v in fed.reference.items() if v.is_floating_point())
    )
    for t in tensors:
        if tuple(t.shape) != tuple(fed.reference[key].shape):
            continue
        decoded = t.double() / 2**20
        for name in CONTRIBUTORS:
            share = fed.weights[name] / max(fed.weights.values())
            plain = fed.states[name][key].double() * share
            assert not torch.allclose(decoded, plain, atol=1e-3)


def test_a_contributor_that_dies_after_masking_leaves_the_survivors_sum() -> None:
    """1 of 5 contributors gone after Round 2 (its masked input lost): the
    survivors reveal its mask key's shares and the sum over the other 4 comes out.
    (A sum of 4 tolerates no such dropout: t = 3 of 3 holders, least_threshold.)"""
    members = [*CONTRIBUTORS, "frank"]
    fed = Federation(names=members)
    ctx = fed.ctxs[REQUESTER]
    original = ctx.request

    async def losing_erins_input(
        peer: str, kind: str, query: dict[str, Any], timeout: float
    ) -> Any:
        reply = await original(peer, kind, query, timeout)
        if peer == "erin" and query["phase"] == "mask":
            fed.network.kill("erin")  # it masked, then died before its input arrived
            raise PeerUnavailable(peer, "dead")
        return reply

    ctx.request = losing_erins_input  # type: ignore[method-assign]
    result = asyncio.run(fed.ask(members))
    survivors = ["alice", "bob", "carol", "frank"]
    assert result.contributors == survivors
    assert result.dropped == ["erin"]
    assert_close(result.mean, fed.expected(survivors))


def test_two_dropouts_of_four_leave_no_sum_rather_than_a_smaller_one() -> None:
    fed = Federation()
    fed.network.kill("carol")
    fed.network.kill("erin")
    with pytest.raises(SecAggError) as err:
        asyncio.run(fed.ask(CONTRIBUTORS))
    assert err.value.reason == "too_few"


def test_two_contributors_give_their_sum_and_one_is_refused() -> None:
    fed = Federation(names=["alice", "bob"])
    result = asyncio.run(fed.ask(["alice", "bob"]))
    assert_close(result.mean, fed.expected(["alice", "bob"]))
    with pytest.raises(SecAggError):
        asyncio.run(fed.ask(["alice"]))


def test_subset_difference_is_refused_one_contribution_per_model() -> None:
    """The attack on the old anonymized peer: the sum over {A,B,C} and then over
    {A,B} gives C's model. Now the second request is refused by A and B."""
    fed = Federation()
    asyncio.run(fed.ask(["alice", "bob", "carol"]))
    with pytest.raises(SecAggError) as err:
        asyncio.run(fed.ask(["alice", "bob"]))
    assert err.value.reason == "too_few"
    reply = asyncio.run(fed.raw("alice", "advertise", "b" * 32, ["alice", "bob"], {}))
    assert reply == {"refused": "already_contributed"}
    counted = {(r["peer"], r["reason"]) for r in fed.network.rejections if r["node"] == "alice"}
    assert counted == {(REQUESTER, "secagg_already_contributed")}


def test_a_contributor_refuses_sessions_it_must_not_join() -> None:
    fed = Federation()
    members = ["alice", "bob"]
    # the requester among the contributors would hold a pair key
    assert asyncio.run(fed.raw("alice", "advertise", "c" * 32, ["alice", REQUESTER], {})) == {
        "refused": "requester_is_contributor"
    }
    assert asyncio.run(fed.raw("alice", "advertise", "c" * 32, ["bob", "carol"], {})) == {
        "refused": "not_a_contributor"
    }
    assert asyncio.run(fed.raw("alice", "advertise", "c" * 32, ["alice", "mallory"], {})) == {
        "refused": "unknown_contributor"
    }
    assert asyncio.run(fed.raw("alice", "advertise", "nothex", members, {})) == {
        "refused": "bad_request"
    }
    # a later phase of a session that does not exist, or out of order
    assert asyncio.run(fed.raw("alice", "unmask", "d" * 32, members, {"u4": members})) == {
        "refused": "unknown_session"
    }
    asyncio.run(fed.raw("alice", "advertise", "e" * 32, members, {}))
    assert asyncio.run(
        fed.raw("alice", "unmask", "e" * 32, members, {"u4": members, "tags": {}})
    ) == {"refused": "out_of_order"}


def test_a_swapped_public_key_is_caught_by_its_tag() -> None:
    """The requester relays the contributors' keys: it cannot replace one with
    its own (a man in the middle between two contributors)."""
    fed = Federation()
    members = ["alice", "bob", "carol"]
    session = "f" * 32
    replies = {m: asyncio.run(fed.raw(m, "advertise", session, members, {})) for m in members}
    forged = primitives.X25519PrivateKey.generate().public_key().public_bytes_raw()
    keys = {v: relayed(replies[v], "alice") for v in members}
    keys["bob"]["s_pk"] = forged
    reply = asyncio.run(fed.raw("alice", "share", session, members, {"keys": keys, "threshold": 2}))
    assert reply == {"refused": "bad_key_tag"}


@pytest.mark.parametrize("t", [1, 2])
def test_a_threshold_below_two_thirds_of_the_holders_is_refused(t: int) -> None:
    """t = 1 over 3 other holders would let two contributors told different
    stories reveal both secrets of one contributor; t = 2 (a majority, the
    bound before) lets the requester do it with one colluding contributor
    (tests/test_secagg_collusion.py)."""
    fed = Federation()
    session = "a1" * 16
    replies = {
        m: asyncio.run(fed.raw(m, "advertise", session, CONTRIBUTORS, {})) for m in CONTRIBUTORS
    }
    keys = {v: relayed(replies[v], "alice", owner=v) for v in CONTRIBUTORS}
    reply = asyncio.run(
        fed.raw("alice", "share", session, CONTRIBUTORS, {"keys": keys, "threshold": t})
    )
    assert reply == {"refused": "bad_threshold"}


def test_unmasking_needs_every_member_to_vouch_for_the_same_survivors() -> None:
    """The requester tells alice and bob that erin dropped, carol that she
    stayed (so that carol would reveal erin's self-mask share): alice sees that
    carol vouched for another U3 and reveals nothing."""
    members = [*CONTRIBUTORS, "frank"]  # 4 holders: t = 3, |U3| >= 4
    fed = Federation(names=members)
    session = "b2" * 16

    async def attack() -> dict[str, Any]:
        adv = {m: await fed.raw(m, "advertise", session, members, {}) for m in members}
        shares = {}
        for m in members:
            keys = {v: relayed(adv[v], m, owner=v) for v in members}
            shares[m] = await fed.raw(m, "share", session, members, {"keys": keys, "threshold": 3})
        views = {}
        for m in members:
            body = {
                "u2": members,
                "shares": {v: shares[v]["shares"][m] for v in members if v != m},
                "commitments": {v: shares[v]["commitments"][m] for v in members if v != m},
            }
            reply = await fed.raw(m, "mask", session, members, body)
            assert "masked" in reply
            views[m] = reply["view_tags"]

        def told(m: str, u3: list[str]) -> dict[str, Any]:
            return {"u3": u3, "view_tags": {v: views[v][m] for v in u3 if v != m}}

        # alice and bob are told erin dropped; carol and erin that everyone stayed
        short = ["alice", "bob", "carol", "frank"]
        tags = {
            m: (await fed.raw(m, "consistency", session, members, told(m, short)))["tags"]
            for m in ("alice", "bob")
        }
        full = {
            m: (await fed.raw(m, "consistency", session, members, told(m, members)))["tags"]
            for m in ("carol", "erin", "frank")
        }
        # alice would reveal erin's mask key if carol's word matched her U3; it does not
        body = {
            "u4": short,
            "tags": {
                "bob": tags["bob"]["alice"],
                "carol": full["carol"]["alice"],
                "frank": full["frank"]["alice"],
            },
        }
        return await fed.raw("alice", "unmask", session, members, body)

    assert asyncio.run(attack()) == {"refused": "inconsistent"}


def test_shamir_shares_rebuild_the_secret_from_any_t() -> None:
    secret = bytes(range(32))
    shares = primitives.share_secret(secret, 2, 3)
    assert primitives.combine_shares([shares[0], shares[2]]) == secret
    assert primitives.combine_shares([shares[1], shares[2]]) == secret
    assert primitives.combine_shares([shares[0]]) != secret


# ---------------------------------------------------------------------- the masked inputs


def masked_inputs(
    states: dict[str, dict[str, torch.Tensor]], weights: dict[str, float] | None = None
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, bytes], dict[str, bytes]]:
    """Round 2 for every contributor as the protocol does it (fresh X25519
    keys, self seeds): (masked inputs, self seeds, public keys)."""
    names = sorted(states)
    private = {n: primitives.X25519PrivateKey.generate() for n in names}
    public = {n: k.public_key().public_bytes_raw() for n, k in private.items()}
    seeds = {n: bytes([i + 1]) * 32 for i, n in enumerate(names)}
    out = {}
    for me in names:
        pair = {
            v: primitives.mask_seed(private[me], public[v], b"ctx", me, v) for v in names if v != me
        }
        out[me] = primitives.masked_input(
            states[me],
            (weights or {}).get(me, 1.0),
            me=me,
            self_seed=seeds[me],
            pair_seeds=pair,
            contributors=len(names),
        )
    return out, seeds, public


def test_no_single_masked_input_is_close_to_its_model() -> None:
    states = {name: small_cnn_state(i) for i, name in enumerate(CONTRIBUTORS)}
    masked, _, _ = masked_inputs(states)
    for name in CONTRIBUTORS:
        for key, value in masked[name].items():
            if key == masking.WEIGHT_KEY or value.numel() < 16:
                continue
            assert value.dtype == torch.int32
            decoded = torch.from_numpy(masking.from_fixed(masking.ring_of(value)))
            model = states[name][key].double().reshape(-1)
            # what a requester could read off one input is uniform noise over the
            # whole ring, +-2^11 once decoded: the model's entries are ~0.1
            assert float((decoded - model).abs().median()) > 100
            if float(model.std()) > 0 and model.numel() >= 256:
                corr = np.corrcoef(decoded.numpy(), model.numpy())[0, 1]
                assert abs(corr) < 0.5, (name, key, corr)
    # the sum of all inputs is still masked by the self masks until they are revealed
    key = "classifier.weight"
    total = sum(masking.ring_of(masked[n][key]) for n in CONTRIBUTORS)
    plain = sum(states[n][key].double() for n in CONTRIBUTORS).reshape(-1).numpy()
    assert np.median(np.abs(masking.from_fixed(total) - plain)) > 100


def test_masks_cancel_bit_exactly() -> None:
    zeros = {"w": torch.zeros(1000), "b": torch.zeros(3, 7)}
    masked, seeds, public = masked_inputs(dict.fromkeys(CONTRIBUTORS, zeros))
    assert all(bool((m["w"] != 0).any()) for m in masked.values())  # each one is masked
    mean, total = primitives.unmask_sum(masked, seeds, {}, public, b"ctx", zeros)
    assert total == 4.0
    assert not mean["w"].any() and not mean["b"].any()  # exactly zero, no rounding


def test_unmaskable_values_are_refused_never_sent_in_clear() -> None:
    for bad in (torch.tensor([float("inf")]), torch.tensor([float("nan")]), torch.tensor([1e12])):
        with pytest.raises(SecAggError) as err:
            primitives.masked_input({"w": bad}, 1.0, me="a", self_seed=b"s" * 32, pair_seeds={})
        assert err.value.reason == "out_of_range"
    with pytest.raises(SecAggError) as err:
        primitives.masked_input(
            {"w": torch.zeros(2)}, 0.0, me="a", self_seed=b"s" * 32, pair_seeds={}
        )
    assert err.value.reason == "bad_weight"


def test_a_contributor_clips_its_own_model_before_masking() -> None:
    state = {"w": torch.full((4,), 3.0), "n": torch.tensor(5)}
    clipped = primitives.clip_state(state, 2.0)
    assert float(clipped["w"].norm()) == pytest.approx(2.0)
    assert torch.equal(clipped["n"], state["n"])  # counters untouched
    assert torch.equal(primitives.clip_state(state, 100.0)["w"], state["w"])


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(
        # what one of 5 may mask: |x| * 2^20 <= (2^31 - 1) // 5, i.e. |x| <= 409.59
        st.lists(st.floats(-409.5, 409.5, allow_nan=False), min_size=5, max_size=5),
        min_size=2,
        max_size=5,
    )
)
def test_any_values_in_range_average_exactly_up_to_the_fixed_point_step(
    values: list[list[float]],
) -> None:
    states = {f"n{i}": {"w": torch.tensor(v, dtype=torch.float64)} for i, v in enumerate(values)}
    masked, seeds, public = masked_inputs(states)
    reference = {"w": torch.zeros(5, dtype=torch.float64)}
    mean, _ = primitives.unmask_sum(masked, seeds, {}, public, b"ctx", reference)
    expected = np.mean(np.array(values), axis=0)
    assert np.allclose(mean["w"].numpy(), expected, rtol=0, atol=2.0**-20)


def test_a_flood_of_sessions_is_bounded() -> None:
    fed = Federation()
    members = ["alice", "bob"]
    for i in range(secagg.MAX_OPEN_SESSIONS):
        assert "c_pk" in asyncio.run(fed.raw("alice", "advertise", f"{i:032x}", members, {}))
    reply = asyncio.run(fed.raw("alice", "advertise", "f" * 32, members, {}))
    assert reply == {"refused": "too_many_sessions"}
