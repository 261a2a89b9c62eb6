"""Fed-BEiT's tokenizer averages its EMA codebook counters like weights, and
its codebook is ema_sum / ema_count. A review (2026-12, unverified) asked
whether a peer's model, within the norm bound and the weight cap, can drive a
merged count to a vanishing value, so that the next training step divides by
it and the codebook overflows to inf, then NaN.

What these tests found with the real merge arithmetic (admit, cap, float64
mean): the counts can be driven to 3e-17 (and others negative, so the total is
negative and the dead-code restart no longer catches the vanishing one). The
codebook does not reach inf (float32 holds up to 3e38; the merge cannot make a
count much smaller than 1e-19, and the norm bound keeps ema_sum near 1e3), but
an entry of 4e19 did appear, to stay until the total turned positive again
(about 100 steps): every peer's norm guard would refuse that node's model
(huge_norm, counted against an honest node), and its own would admit anything
up to 10 x 4e19. Fixed twice: the merge resets counters no honest
tokenizer holds (counted `tokenizer_bad_counts`), and the EMA update never
divides by a count below the restart threshold."""

from __future__ import annotations

import asyncio
import math
import types
from types import SimpleNamespace
from typing import Any

import torch

from p2pfl.config import FedBEiTParams, SelectionSection
from p2pfl.learning.tokenizer import VQTokenizer
from protocols.aggregate import aggregate
from protocols.checks import cap_weights, float_norm, incompatibility
from protocols.exchange import Term
from protocols.fedbeit import TokenizerStage
from protocols.rounds import Round

CODES, DIM = 64, 8
OWN_WEIGHT = 500.0


def images(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.rand(256, 1, 16, 16, generator=g)
    out[:, :, :8] *= 0.2
    return out


def tokenizer() -> VQTokenizer:
    torch.manual_seed(0)
    model = VQTokenizer(in_chans=1, patch_size=2, codebook_size=CODES, code_dim=DIM, hidden=16)
    model.restart_generator = torch.Generator().manual_seed(0)
    return model


def train(model: VQTokenizer, steps: int, seed: int = 0) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(seed)
    data = images()
    losses = []
    for _ in range(steps):
        out = model.train()(data[torch.randint(len(data), (32,), generator=g)])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    return losses


def crafted_peer(own: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """The victim's own model (a peer can pull it before answering), except for
    ema_count: for each code, the float32 count that, merged by the victim's
    weighted mean with a claimed weight, leaves the smallest positive count;
    the claimed weight is searched under the cap (16 x the lower median)."""
    v = own["ema_count"].double()
    best: tuple[float, float, torch.Tensor] = (math.inf, 0.0, v)
    for claim in range(1, int(16 * OWN_WEIGHT) + 1, 37):
        total = OWN_WEIGHT + claim
        c_own, c_peer = OWN_WEIGHT / total, claim / total
        base = (-c_own * v / c_peer).float()
        for k in range(-3, 4):
            x = base
            for _ in range(abs(k)):
                x = torch.nextafter(x, torch.full_like(x, math.copysign(math.inf, k)))
            stacked = torch.stack([v, x.double()])
            merged = torch.tensordot(torch.tensor([c_own, c_peer], dtype=torch.float64), stacked, 1)
            merged32 = merged.float()
            positive = merged32[merged32 > 0]
            if len(positive) and float(positive.min()) < best[0]:
                i = int(torch.nonzero(merged32 == positive.min())[0])
                counts = own["ema_count"].clone()
                counts[i] = x[i]
                best = (float(positive.min()), float(claim), counts)
    state = {k: t.clone() for k, t in own.items()}
    state["ema_count"] = best[2]
    return state, best[1]


def merge(own: dict[str, torch.Tensor], peer: dict[str, torch.Tensor], claim: float):
    """What FedAVGP2P does with one neighbour's model: admit, cap, mean."""
    assert incompatibility(peer, own, max_norm_ratio=10.0) is None  # admitted
    capped, bitten = cap_weights({"me": OWN_WEIGHT, "peer": claim}, ratio=16.0, own="me")
    assert bitten == []
    return aggregate("mean", [own, peer], [capped["me"], capped["peer"]], own=0)


def test_a_crafted_peer_model_leaves_a_vanishing_count_after_the_merge() -> None:
    victim = tokenizer()
    train(victim, 40)
    own = {k: t.detach().clone() for k, t in victim.state_dict().items()}
    peer, claim = crafted_peer(own)
    merged = merge(own, peer, claim)
    counts = merged["ema_count"]
    assert float(counts[counts > 0].min()) < 1e-12  # honest counts stay above ~0.01


def strongest_peer(own: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float, int]:
    """The vanishing count of `crafted_peer` on one code, every other merged
    count at -3 x the mean (a negative total: no dead-code restart), and the
    rest of the norm budget on that code's ema_sum."""
    peer, claim = crafted_peer(own)
    target = int(torch.nonzero(peer["ema_count"] != own["ema_count"])[0])
    total = OWN_WEIGHT + claim
    c_own, c_peer = OWN_WEIGHT / total, claim / total
    v = own["ema_count"].double()
    counts = ((-3 * v.mean() - c_own * v) / c_peer).float()
    counts[target] = peer["ema_count"][target]
    peer["ema_count"] = counts
    budget = 10 * float_norm(own)
    room = 0.9 * (budget**2 - float_norm(peer) ** 2) ** 0.5
    peer["ema_sum"][target] = room / DIM**0.5
    return peer, claim, target


def test_the_strongest_crafted_merge_is_admitted_and_is_what_an_honest_one_never_is() -> None:
    victim = tokenizer()
    train(victim, 40)
    own = {k: t.detach().clone() for k, t in victim.state_dict().items()}
    peer, claim, target = strongest_peer(own)
    merged = merge(own, peer, claim)  # admitted: norm bound and weight cap hold
    assert 0 < float(merged["ema_count"][target]) < 1e-15
    assert float(merged["ema_count"].sum()) < 0
    # an honest merge (two tokenizers trained apart) holds no such counter
    other = tokenizer()
    train(other, 40, seed=5)
    honest = aggregate("mean", [own, other.state_dict()], [OWN_WEIGHT, 700.0], own=0)
    fresh = tokenizer()
    fresh.load_state_dict(honest)
    assert fresh.reset_implausible_counts() == 0


def test_the_tokenizer_alone_never_divides_by_a_vanishing_count() -> None:
    """Without the merge's reset (the update's own guard): before the fix the
    codebook held an entry of 4e19 after five steps."""
    victim = tokenizer()
    train(victim, 40)
    own = {k: t.detach().clone() for k, t in victim.state_dict().items()}
    peer, claim, _ = strongest_peer(own)
    victim.load_state_dict(merge(own, peer, claim))
    losses = train(victim, 20, seed=1)
    assert all(math.isfinite(x) for x in losses)
    assert float(victim.codebook.abs().max()) < 1e3
    assert float(float_norm(victim.state_dict())) < 10 * float_norm(own)


def test_the_tokenizer_stage_resets_implausible_merged_counts_and_counts_them() -> None:
    victim = tokenizer()
    train(victim, 40)
    own = {k: t.detach().clone() for k, t in victim.state_dict().items()}
    peer, claim, target = strongest_peer(own)
    stage = TokenizerStage(FedBEiTParams(name="fedbeit"))
    rejected: list[tuple[str, str]] = []

    async def run_blocking(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    ctx = SimpleNamespace(
        me="me",
        config=SimpleNamespace(selection=SelectionSection()),
        run_blocking=run_blocking,
        reject=lambda p, r: rejected.append((p, r)),
        record_choice=lambda chosen: None,
        publish=lambda k, v: None,
    )
    site = SimpleNamespace(
        tokenizer=victim, load_state_dict=victim.load_state_dict, num_train=int(OWN_WEIGHT)
    )
    rnd = Round(3, own=own, received=[Term(peer, claim, [("evil", 3)])])
    asyncio.run(stage.aggregate(ctx, site, rnd))  # type: ignore[arg-type]
    counts = victim.ema_count
    assert bool((counts >= 0).all()) and float(counts[target]) == 0.0
    assert rejected == [("evil", "tokenizer_bad_counts")]
    train(victim, 20, seed=1)
    assert float(victim.codebook.abs().max()) < 1e3


def old_ema_update(self: VQTokenizer, z: torch.Tensor, idx: torch.Tensor) -> None:
    """The EMA update before the fix, for the comparison below."""
    flat = z.reshape(-1, self.code_dim).float()
    ids = idx.reshape(-1)
    counts = torch.bincount(ids, minlength=self.codebook_size).float()
    sums = torch.zeros_like(self.ema_sum).index_add_(0, ids, flat)
    self.ema_count.mul_(self.decay).add_(counts, alpha=1 - self.decay)
    self.ema_sum.mul_(self.decay).add_(sums, alpha=1 - self.decay)
    used = self.ema_count > 0
    self.codebook[used] = self.ema_sum[used] / self.ema_count[used, None]
    total = float(self.ema_count.sum())
    dead = self.ema_count < self.restart_share * total / self.codebook_size
    n_dead = int(dead.sum())
    if n_dead:
        pick = torch.randint(len(flat), (n_dead,), generator=self.restart_generator)
        fresh = flat[pick]
        share = total / self.codebook_size
        self.codebook[dead] = fresh
        self.ema_sum[dead] = fresh * share
        self.ema_count[dead] = share


def test_honest_training_is_bit_identical_to_the_update_before_the_fix() -> None:
    new, old = tokenizer(), tokenizer()
    old._ema_update = types.MethodType(old_ema_update, old)  # type: ignore[method-assign]
    train(new, 60)
    train(old, 60)
    for key, value in new.state_dict().items():
        assert torch.equal(value, old.state_dict()[key]), key
