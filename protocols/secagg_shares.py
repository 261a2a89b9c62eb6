"""A contributor's Shamir shares in secure aggregation (protocols/secagg.py runs
the rounds with these; Bonawitz et al., CCS 2017, Fig. 4, rounds ShareKeys and
MaskedInputCollection).

Dealing (Round 1): t-out-of-|U1|-1 shares of the session's mask key s_u and
self-mask seed b_u for every other member of U1, each sealed for its holder
alone (ChaCha20-Poly1305 under a key from X25519(c_u, c_v), the session context
and the direction u>v), with a hash commitment to each share that the requester
keeps: a share revealed in Unmasking is taken only if it matches its dealer's
commitment, at the index that is the holder's place in U1.

Opening (Round 2): before it masks, a holder unseals the share every other
member of U2 dealt it and checks that it is addressed from that dealer to this
holder at this holder's index, and that it matches the commitment the requester
relays; else an honest holder would later be blamed for a dealer's lie. Every
failure is a `SecAggError("bad_share")`.

Kept apart from the exchange of the rounds so that the rounds read as the
paper's boxes, and the share handling, which does no network I/O, can be read
(and run off the event loop) on its own.
"""

from __future__ import annotations

import hmac
from typing import Any

from p2pfl.secure import tensors
from protocols.secagg_messages import MaskBody, SealedShare, parse
from protocols.secagg_primitives import (
    SecAggError,
    seal,
    share_commitment,
    share_key,
    share_secret,
    unseal,
)
from protocols.secagg_session import Session


def deal_shares(session: Session, me: str, holders: list[str]) -> dict[str, Any]:
    """Shares of s_u and b_u for every holder, each sealed for it alone,
    and the commitments to them the requester checks revealed shares by."""
    t, context = session.threshold, session.context
    sk_shares = share_secret(session.s_private.private_bytes_raw(), t, len(holders))
    b_shares = share_secret(session.self_seed, t, len(holders))
    sealed: dict[str, bytes] = {}
    commitments: dict[str, dict[str, bytes]] = {}
    for v, (idx, sk_share), (_, b_share) in zip(holders, sk_shares, b_shares, strict=True):
        plain = tensors.dumps({"from": me, "to": v, "idx": idx, "sk": sk_share, "b": b_share})
        key = share_key(session.c_private, session.keys[v][0], context, me, v)
        sealed[v] = seal(key, plain, context)
        commitments[v] = {
            "sk": share_commitment(context, me, v, idx, "sk", sk_share),
            "b": share_commitment(context, me, v, idx, "b", b_share),
        }
    return {"shares": sealed, "commitments": commitments}


def open_shares(session: Session, me: str, u2: list[str], body: MaskBody) -> None:
    """Unseal and check the share each other member of `u2` dealt to `me`, and
    keep it in `session.held` (v -> (idx, share of s_v, share of b_v)).

    Raises SecAggError("bad_share") at the first share that is missing,
    undecodable, misaddressed, at another index or unlike its commitment.
    """
    context = session.context
    for v in u2:
        if v == me:
            continue
        ciphertext = body.shares.get(v)
        if ciphertext is None:
            raise SecAggError("bad_share", f"no share from {v}")
        key = share_key(session.c_private, session.keys[v][0], context, v, me)
        try:
            decoded = tensors.decode(unseal(key, ciphertext, context))
        except SecAggError:
            raise
        except Exception:  # noqa: BLE001 - the dealer's bytes: its fault, never this holder's
            # tensors.decode promises CodecError, but anything else a sealed share
            # raises must still blame the dealer (`bad_share`), not fail this
            # holder's handler (`handler_error`) as a RuntimeError once did.
            raise SecAggError("bad_share", f"share from {v} undecodable") from None
        share = parse(SealedShare, decoded)
        place = [h for h in session.u1 if h != v].index(me) + 1
        if share is None or share.sender != v or share.to != me or share.idx != place:
            raise SecAggError("bad_share", f"share from {v} malformed")
        # What the requester will check my revealed share against must be what
        # I hold, or an honest holder would be blamed for a dealer's lie.
        committed = body.commitments.get(v)
        if committed is None or not (
            hmac.compare_digest(
                committed.sk, share_commitment(context, v, me, place, "sk", share.sk)
            )
            and hmac.compare_digest(
                committed.b, share_commitment(context, v, me, place, "b", share.b)
            )
        ):
            raise SecAggError("bad_share", f"{v}'s shares do not match their commitments")
        session.held[v] = (share.idx, share.sk, share.b)
