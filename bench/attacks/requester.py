"""The curious requester of hole 1, over the wire: roster member m runs the
real requester (protocols/secagg_requester.py `secure_sum`, the code every
node runs) against the daemons through `WireContext`, a RoundContext whose
requests are m's own signed frames (bench/peer.py RawPeer). The attacks
choose only contributor sets, rounds and one lie: a contributor whose masked
input arrived is reported to `secure_sum` as gone, so the others are told it
dropped and reveal the shares of its mask key; with them m peels that
contributor's pair masks off the input it kept (`peel_pair_masks`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from torch import Tensor

from bench.peer import RawPeer
from node.provision import SitePlan
from p2pfl.learning.state import averaged_keys
from protocols.base import PeerUnavailable
from protocols.masking import WEIGHT_KEY, from_fixed, mask_stream, ring_of
from protocols.secagg_messages import Revealed, SessionRequest, parse, session_context
from protocols.secagg_primitives import SecAggError, mask_seed
from protocols.secagg_requester import matches_key, rebuild, secure_sum


@dataclass
class Sum:
    """What a requester obtained: sum_u w_u x_u per float entry (float64) and
    sum_u w_u; `extra`: what the lie peeled, by contributor."""

    entries: dict[str, np.ndarray]
    weight: float
    extra: dict[str, Any] = field(default_factory=dict)


class WireContext:
    """The part of a RoundContext that `secure_sum` uses (`me`, `request`,
    `reject`, `sample_caps`, `train`), played by a RawPeer. It records every contributor's
    answer per phase (`answers`), and withholds the masked inputs of
    `withheld` from `secure_sum` (as if they never arrived) while keeping them
    (`kept`) with what peeling them needs: the advertised keys, U2, the
    threshold, the session and the revealed shares."""

    def __init__(self, attacker: RawPeer, *, withheld: list[str] | None = None) -> None:
        self.attacker = attacker
        self.me = attacker.name
        self.withheld = set(withheld or [])
        self.answers: dict[str, dict[str, Any]] = {}
        self.rejected: list[tuple[str, str]] = []  # (peer, reason) the requester's checks found
        self.session: dict[str, Any] = {}
        self.adverts: dict[str, dict[str, Any]] = {}
        self.threshold = 0
        self.holders = 0
        self.u2: list[str] = []
        self.kept: dict[str, dict[str, Tensor]] = {}
        self.revealed: dict[str, Any] = {}
        self.one_at_a_time = asyncio.Lock()  # one codec, one request on the wire at a time

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        phase, body = query["phase"], query["body"]
        self.session = {k: v for k, v in query.items() if k not in ("phase", "body")}
        if phase == "share":
            self.threshold, self.holders = body["threshold"], len(body["keys"]) - 1
        if phase == "mask":
            self.u2 = list(body["u2"])
        async with self.one_at_a_time:
            reply, payload = await asyncio.to_thread(
                self.attacker.request, peer, kind, query, round_no=query["round"], wait_s=timeout
            )
        record = self.answers.setdefault(peer, {})
        if not reply.accepted or not isinstance(payload, dict) or "refused" in payload:
            record[phase] = reply.brief() | {
                "refused": payload.get("refused") if isinstance(payload, dict) else None
            }
            if not reply.accepted:
                raise PeerUnavailable(peer, str(reply.reason or reply.status))
            return payload
        record[phase] = {"status": 200}
        if phase == "advertise":
            self.adverts[peer] = payload
        elif phase == "unmask":
            self.revealed[peer] = payload
        elif phase == "mask" and peer in self.withheld and isinstance(payload.get("masked"), dict):
            self.kept[peer] = payload["masked"]
            raise PeerUnavailable(peer, "withheld: the requester claims it dropped")
        return payload

    def reject(self, peer: str, reason: str) -> None:
        self.rejected.append((peer, reason))

    def sample_caps(self) -> dict[str, int]:
        """The roster cards' max_samples, as a daemon's context reads them
        (`secure_sum` sizes its weight unit W from them)."""
        return {
            card.name: card.max_samples
            for card in self.attacker.codec.roster.cards()
            if card.max_samples is not None
        }

    async def run_blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    def mask_key(self, dropped: str) -> bytes:
        """`dropped`'s mask private key, rebuilt from the shares the others
        revealed (checked against the public key it advertised)."""
        shares = []
        for reply in self.revealed.values():
            given = parse(Revealed, reply)
            item = given.key_shares.get(dropped) if given is not None else None
            if item is not None:
                shares.append((item.idx, item.share))
        public = self.adverts[dropped]["s_pk"]
        return rebuild(shares, self.threshold, self.holders, lambda sk: matches_key(sk, public))

    def context(self) -> bytes:
        return session_context(self.me, SessionRequest(**self.session, phase="unmask"))


def own_reference(plan: SitePlan) -> dict[str, Tensor]:
    """The entries a sum has (float64 zeros), from the requester's own model:
    every site of the federation builds the same one."""
    from p2pfl.config import load_config
    from protocols.site import build_site

    state = build_site(load_config(plan.config_path)).state_dict()
    return {
        k: torch.zeros(tuple(state[k].shape), dtype=torch.float64) for k in averaged_keys(state)
    }


def collect_sum(
    attacker: RawPeer,
    contributors: list[str],
    round_no: int,
    reference: dict[str, Tensor],
    *,
    dropped: list[str] | None = None,
    wait_s: float = 10.0,
) -> tuple[Sum | None, dict[str, Any]]:
    """One secure sum over `contributors`' models of `round`, asked for by
    `attacker` with the real requester. `dropped`: contributors to claim
    dropped out after masking (secure aggregation's Unmasking), though they
    answered; their masked inputs, peeled of every pair mask the revealed
    keys remove, are the sum's `extra`. Returns (the sum over the
    contributors the others unmasked, or None when they did not all go
    along; what each answered)."""
    ctx = WireContext(attacker, withheld=dropped)
    try:
        found = asyncio.run(
            secure_sum(
                ctx,  # type: ignore[arg-type]  # the parts of a RoundContext secure_sum uses
                contributors,
                round_no=round_no,
                max_round=round_no,
                reference=reference,
                timeout=wait_s,
            )
        )
    except SecAggError:
        return None, ctx.answers
    total = found.total_weight
    result = Sum(
        {k: (v.double() * total).numpy().reshape(-1) for k, v in found.mean.items()}, total
    )
    # The lie's prize: a masked input whose owner's mask key the others revealed.
    public_keys = {v: advert["s_pk"] for v, advert in ctx.adverts.items()}
    for v, masked in ctx.kept.items():
        result.extra[v] = peel_pair_masks(
            masked, v, ctx.mask_key(v), public_keys, ctx.u2, ctx.context()
        )
    return result, ctx.answers


def peel_pair_masks(
    masked: dict[str, Tensor],
    owner: str,
    private_key: bytes,
    public_keys: dict[str, bytes],
    u2: list[str],
    context: bytes,
) -> dict[str, np.ndarray]:
    """owner's masked input less its pair masks with every other member of U2
    (rebuilt from its revealed mask key): what is left is its weighted model
    plus its self-mask, which only the shares of its self-mask seed remove."""
    private = X25519PrivateKey.from_private_bytes(private_key)
    out = {}
    for entry, value in masked.items():
        if entry == WEIGHT_KEY:
            continue
        flat = ring_of(value)
        for u in u2:
            if u == owner:
                continue
            seed = mask_seed(private, public_keys[u], context, owner, u)
            mask = mask_stream(seed, entry, flat.size)
            if owner < u:
                flat -= mask
            else:
                flat += mask
        out[entry] = from_fixed(flat)
    return out


def combination(sums: list[tuple[int, Sum]]) -> dict[str, np.ndarray]:
    """sum_i c_i S_i / sum_i c_i W_i: one model out of signed combinations of
    weighted sums (e.g. S_abc - S_ab = w_c x_c, over W_abc - W_ab = w_c)."""
    weight = sum(c * s.weight for c, s in sums)
    keys = set.intersection(*(set(s.entries) for _, s in sums))
    return {
        k: sum(c * s.entries[k] for c, s in sums) / (weight if abs(weight) > 1e-9 else 1.0)
        for k in keys
    }
