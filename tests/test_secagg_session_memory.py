"""What a requester's open sessions make a contributor hold.

Found by a review (2026-11-28): each Round 0 clipped the contributor's model
(`secagg_clip_norm`) into a copy of its own and kept it in the session, so a
requester that opened its 16 sessions over one model and went silent made
the contributor hold 16 copies of it (and every roster member as much
again). Now the sessions over one model share one clipped copy.
"""

from __future__ import annotations

import asyncio
import secrets

import torch

from protocols.memory import InMemoryNetwork
from protocols.secagg import MAX_OPEN_SESSIONS, SECAGG_KIND, Contributor

NAMES = ["a", "b", "v"]


def test_a_requesters_open_sessions_share_one_clipped_copy_of_the_model() -> None:
    async def flood() -> tuple[Contributor, list[dict[str, object]], dict[str, torch.Tensor]]:
        network = InMemoryNetwork()
        ctxs = {n: network.join(n) for n in [*NAMES, "r"]}
        torch.manual_seed(0)
        model = {"w": torch.randn(4096)}  # norm ~64: clipped to 1
        contributor = Contributor(ctxs["v"], lambda *_: (1, model, 10.0), clip_norm=1.0)
        ctxs["v"].serve(SECAGG_KIND, contributor.serve)
        answers = []
        for _ in range(MAX_OPEN_SESSIONS + 2):
            query = dict(
                session=secrets.token_hex(16),
                phase="advertise",
                contributors=NAMES,
                round=1,
                max_round=1,
                purpose="model",
                weight_scale=10.0,
                body={},
            )
            answers.append(await ctxs["r"].request("v", SECAGG_KIND, query, 5.0))
        return contributor, answers, model

    contributor, answers, model = asyncio.run(flood())
    assert [a.get("refused") for a in answers[-2:]] == ["too_many_sessions"] * 2
    assert len(contributor.sessions) == MAX_OPEN_SESSIONS
    copies = {id(s.state["w"].untyped_storage()) for s in contributor.sessions.values()}
    assert len(copies) == 1
    clipped = next(iter(contributor.sessions.values())).state["w"]
    assert float(clipped.norm()) <= 1.0 < float(model["w"].norm())  # clipped, not the model


def held_copies(rounds: int, at_once: bool) -> tuple[int, int]:
    """A requester's 16 Round 0 requests over `rounds` kept models (in turn),
    sent one by one or all at once: (open sessions, clipped copies they hold)."""

    async def flood() -> tuple[int, int]:
        network = InMemoryNetwork()
        ctxs = {n: network.join(n) for n in [*NAMES, "r"]}
        torch.manual_seed(0)
        models = {r: {"w": torch.randn(4096)} for r in range(1, rounds + 1)}
        contributor = Contributor(
            ctxs["v"], lambda wanted, *_: (wanted, models[wanted], 10.0), clip_norm=1.0
        )
        ctxs["v"].serve(SECAGG_KIND, contributor.serve)

        def query(i: int) -> dict[str, object]:
            r = 1 + i % rounds
            return dict(
                session=secrets.token_hex(16),
                phase="advertise",
                contributors=NAMES,
                round=r,
                max_round=r,
                purpose="model",
                weight_scale=10.0,
                body={},
            )

        asks = [ctxs["r"].request("v", SECAGG_KIND, query(i), 5.0) for i in range(16)]
        if at_once:
            await asyncio.gather(*asks)
        else:
            for ask in asks:
                await ask
        held = {id(s.state["w"].untyped_storage()) for s in contributor.sessions.values()}
        return len(contributor.sessions), len(held)

    return asyncio.run(flood())


def test_requests_alternating_between_kept_models_hold_one_copy_of_each() -> None:
    """A second review (2026-11-28): the shared copy was the LAST model clipped,
    so a requester asking for rounds 1, 2, 1, 2, ... re-clipped at every
    request and its 16 sessions held 16 copies again."""
    assert held_copies(rounds=2, at_once=False) == (MAX_OPEN_SESSIONS, 2)
    assert held_copies(rounds=3, at_once=False) == (MAX_OPEN_SESSIONS, 3)


def test_requests_sent_at_once_share_one_clipping() -> None:
    """16 Round 0 requests in flight together each clipped the model while the
    first clipping ran off the event loop: 16 copies (the same review)."""
    assert held_copies(rounds=1, at_once=True) == (MAX_OPEN_SESSIONS, 1)
