"""The judge of bench/secagg_adversary.py: with everything the adversarial
requester received, rebuild every secret it can (Shamir combinations of any t
revealed shares; shares decrypted by keystream reuse across sessions, whose
plaintext layout it knows) and try to peel every masked input it holds. A
peeled input equal to the contributor's true weighted model is a breach; a
model masked into two of its sums is one too.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from torch import Tensor

from bench.secagg_sessions import REQUESTER, Honest, Knowledge
from p2pfl.secure import tensors
from protocols import secagg
from protocols import secagg_primitives as primitives
from protocols.masking import from_fixed, mask_stream, ring_of


def mask_public(advert: dict[str, Any]) -> bytes | None:
    """The public key the pair masks are agreed with, as the contributor advertised it."""
    for name in ("s_pk", "pk"):
        if isinstance(advert.get(name), bytes):
            return advert[name]
    return None


def _layout(dealer: str, holder: str, idx: int) -> tuple[int, int, int]:
    """Where a sealed share's `sk` and `b` fields lie in its plaintext, as the
    adversary can compute it (it knows the format): (sk offset, b offset, length)."""
    sk, b = bytes([0xA5]) * 32, bytes([0x5A]) * 32
    plain = tensors.dumps({"from": dealer, "to": holder, "idx": idx, "sk": sk, "b": b})
    return plain.index(sk), plain.index(b), len(plain)


def keystream_shares(
    known: list[Knowledge],
) -> dict[tuple[str, str, str, str], list[tuple[int, bytes]]]:
    """Shares decrypted by keystream reuse: the same (dealer, holder) sealed
    twice under one key and nonce gives c2 xor c1 xor p1. p1's field is known
    where the holder revealed it (its unmask reply). Returned as
    (session id, dealer, field, holder) -> [(idx, share)], every guess (the
    judge verifies them by using them)."""
    out: dict[tuple[str, str, str, str], list[tuple[int, bytes]]] = {}
    for k1, k2 in itertools.permutations(known, 2):
        for (dealer, holder), c2 in k2.sealed.items():
            c1 = k1.sealed.get((dealer, holder))
            reply = k1.revealed.get(holder)
            if c1 is None or reply is None or len(c1) != len(c2):
                continue
            for field_name, reply_key in (("b", "self_shares"), ("sk", "key_shares")):
                item = (reply.get(reply_key) or {}).get(dealer)
                if not isinstance(item, dict) or not isinstance(item.get("share"), bytes):
                    continue
                idx = item.get("idx")
                if not isinstance(idx, int) or not 0 < idx < 256:
                    continue
                sk_at, b_at, length = _layout(dealer, holder, idx)
                at = b_at if field_name == "b" else sk_at
                for prefix in (0, 12):  # ct||tag, or nonce||ct||tag
                    if prefix + length + 16 != len(c1):
                        continue
                    lo, hi = prefix + at, prefix + at + 32
                    stream = bytes(a ^ b for a, b in zip(c1[lo:hi], item["share"], strict=True))
                    guess = bytes(a ^ b for a, b in zip(c2[lo:hi], stream, strict=True))
                    key = (k2.plan.session, dealer, field_name, holder)
                    out.setdefault(key, []).append((idx, guess))
    return out


def revealed_shares(k: Knowledge, field_name: str) -> dict[str, list[tuple[int, bytes]]]:
    """dealer -> [(idx, share)] of `b` (self_shares) or `sk` (key_shares) revealed in k."""
    reply_key = "self_shares" if field_name == "b" else "key_shares"
    out: dict[str, list[tuple[int, bytes]]] = {}
    for reply in k.revealed.values():
        for dealer, item in (reply.get(reply_key) or {}).items():
            if (
                isinstance(item, dict)
                and isinstance(item.get("idx"), int)
                and isinstance(item.get("share"), bytes)
                and len(item["share"]) == 32
            ):
                out.setdefault(dealer, []).append((item["idx"], item["share"]))
    return out


def candidates(shares: list[tuple[int, bytes]], limit: int = 64) -> list[bytes]:
    """Every secret any t of these shares rebuild, for every t (bounded)."""
    unique = sorted({s for s in shares if 0 < s[0] < 256}, key=lambda s: s[0])
    out: list[bytes] = []
    for t in range(1, len(unique) + 1):
        for combo in itertools.combinations(unique, t):
            if len({i for i, _ in combo}) != t:
                continue
            try:
                out.append(primitives.combine_shares(list(combo)))
            except Exception:  # noqa: BLE001 - a guess that does not combine is no secret
                continue
            if len(out) >= limit:
                return out
    return out


def mask_keys(k: Knowledge, extra: dict[str, list[tuple[int, bytes]]]) -> dict[str, bytes]:
    """dealer -> its mask private key, where some combination rebuilds one that
    matches the public key it advertised (so verified, not guessed)."""
    found: dict[str, bytes] = {}
    pool = revealed_shares(k, "sk")
    for dealer, shares in extra.items():
        pool.setdefault(dealer, []).extend(shares)
    for dealer, shares in pool.items():
        public = mask_public(k.adverts.get(dealer, {}))
        for secret in candidates(shares):
            try:
                private = X25519PrivateKey.from_private_bytes(secret)
            except ValueError:
                continue
            if private.public_key().public_bytes_raw() == public:
                found[dealer] = secret
                break
    return found


def try_unmask(fed: Honest, known: list[Knowledge]) -> tuple[list[dict[str, Any]], float]:
    """Every masked input the adversary holds, peeled with every secret it can
    rebuild: the breaches (contributor, session, model round), and how close
    the best attempt came (0..2: the share of its pair masks the adversary can
    remove, plus the share of t self-mask shares it holds; 2 is a breach),
    which the search maximises."""
    breaches = []
    progress = 0.0
    stolen = keystream_shares(known)
    for k in known:
        extra_b: dict[str, list[tuple[int, bytes]]] = {}
        extra_sk: dict[str, list[tuple[int, bytes]]] = {}
        for (sid, dealer, field_name, _), shares in stolen.items():
            if sid == k.plan.session:
                (extra_b if field_name == "b" else extra_sk).setdefault(dealer, []).extend(shares)
        sk_of = mask_keys(k, extra_sk)
        b_pool = revealed_shares(k, "b")
        for dealer, shares in extra_b.items():
            b_pool.setdefault(dealer, []).extend(shares)
        for u, reply in k.masked.items():
            model_round = reply.get("model_round")
            y = reply["masked"].get("w")
            if not isinstance(y, Tensor) or not isinstance(model_round, int):
                continue
            context = secagg.session_context(REQUESTER, k.requests[u])
            partners = [v for v in k.told_u2[u] if v != u]
            pair_seeds: dict[str, bytes] = {}
            for v in partners:
                owner, other = (u, v) if u in sk_of else (v, u)
                peer = mask_public(k.adverts.get(other, {}))
                if owner in sk_of and peer is not None:
                    private = X25519PrivateKey.from_private_bytes(sk_of[owner])
                    pair_seeds[v] = primitives.mask_seed(private, peer, context, u, v)
            b_held = len({i for i, _ in b_pool.get(u, [])})
            progress = max(
                progress,
                len(pair_seeds) / max(1, len(partners))
                + min(1.0, b_held / max(1, k.thresholds.get(u, 1))),
            )
            if len(pair_seeds) < len(partners):
                continue
            truth = fed.truth(u, model_round)
            base = ring_of(y)
            for v, seed in pair_seeds.items():
                stream = mask_stream(seed, "w", base.size)
                base = base - stream if u < v else base + stream
            for b in candidates(b_pool.get(u, [])):
                peeled = from_fixed(base - mask_stream(b, "w", base.size))
                if np.allclose(peeled, truth, atol=1e-5):
                    breaches.append(
                        {"victim": u, "session": k.plan.session, "model_round": model_round}
                    )
                    break
    return breaches, progress


def double_contributions(fed: Honest, known: list[Knowledge]) -> list[dict[str, Any]]:
    """A model masked into two sums for the adversary: their difference could
    isolate inputs, so each contributor must mask a model at most once per requester."""
    seen: dict[tuple[str, int], str] = {}
    out = []
    for k in known:
        for u, reply in k.masked.items():
            key = (u, reply.get("model_round"))
            if key in seen:
                out.append(
                    {"victim": u, "model_round": key[1], "sessions": [seen[key], k.plan.session]}
                )
            seen[key] = k.plan.session  # type: ignore[index]
    return out
