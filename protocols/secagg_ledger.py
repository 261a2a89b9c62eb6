"""A contributor's ledger: which model it masked for which requester.

One masked input per (requester, model), the model known by its digest
whatever round it is served as: a requester that obtained two sums over the
same model could subtract them (protocols/secagg.py's
rules). The ledger outlives a restart, so a node that retrains or re-serves
a round after a crash does not mask it into a second sum of the same
requester; an unreadable ledger makes the node refuse to contribute at all
until an operator looks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from pathlib import Path

import torch
from pydantic import TypeAdapter
from torch import Tensor

from p2pfl.files import atomic_write_text
from p2pfl.learning.state import averaged_keys
from protocols.secagg_messages import LedgerRow

log = logging.getLogger(__name__)

LEDGER = TypeAdapter(list[LedgerRow])


def model_digest(state: dict[str, Tensor]) -> str:
    """What identifies a model for the ledger: SHA-256 over the name, dtype,
    shape and bytes of every entry a secure sum adds (`averaged_keys`: the
    floating-point ones). A round retrained into another model, or a new job
    in the same state directory, is another model (though the rounds a restart
    may train again are refused to their requesters: `ContributionLedger.refuses`); one
    that differs only in a counter no sum carries (BatchNorm's
    num_batches_tracked) is the same model, since its sums would be the same
    (a second review, 2026-11-28)."""
    digest = hashlib.sha256()
    for name in sorted(averaged_keys(state)):
        tensor = state[name].detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{tensor.dtype}|{tuple(state[name].shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class ContributionLedger:
    """(requester, model round) -> the digests of every model masked for it
    (a round re-served with another model, after a retraining, adds one: it
    never replaces the row of the model masked before), written to `path`
    (crash-safe) whenever it grows; None: kept in memory."""

    def __init__(self, path: Path | None, me: str) -> None:
        self.path = path
        self.me = me
        self.contributed: dict[tuple[str, int], tuple[str, ...]] = {}
        self.error: str | None = None  # set: this node refuses to contribute at all
        # rows written before the digest covered the summed entries only: their digest
        # matches no model now, so they refuse their (requester, round) whatever model
        self.legacy: set[tuple[str, int, str]] = set()
        self.digests: dict[int, tuple[dict[str, Tensor], str]] = {}  # round -> (model, digest)
        # the newest round of a ledger read from disk: a restart trains again the
        # round it cut off, and every round after the checkpoint it resumes from
        # (`refuses`)
        self.restarted_round: int | None = None
        self.load()

    def load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            rows = LEDGER.validate_json(self.path.read_bytes())
            self.restarted_round = max((r.round for r in rows), default=None)
            for r in rows:
                self._add(r.requester, r.round, r.model)
                if not r.summed:
                    self.legacy.add((r.requester, r.round, r.model))
        except Exception as exc:  # noqa: BLE001 - any damage: refuse to contribute, say why
            # My own file: unreadable means damaged. Refuse to contribute until an
            # operator looks, rather than risk masking a model twice.
            self.error = f"{self.path}: {exc} — move it away to start afresh"
            log.error("%s: secure-aggregation ledger unreadable: %s", self.me, self.error)

    def masked(self, requester: str, model_round: int) -> str | None:
        """The digest of the last model of `model_round` masked for `requester`, if any."""
        held = self.contributed.get((requester, model_round))
        return held[-1] if held else None

    def holds(self, requester: str, digest: str) -> bool:
        """Whether this model is in one of `requester`'s sums, under any round: a
        model served unchanged in two rounds went into two sums of one requester
        when only its round was looked up (a review, 2026-11-28)."""
        return any(r == requester and digest in ds for (r, _), ds in self.contributed.items())

    def refuses(self, requester: str, model_round: int, digest: str) -> bool:
        """Whether masking this model of `model_round` for `requester` could put a
        model into two of its sums: it is in one (`holds`), or a row of an older
        ledger, whose digest covered the counters too, holds that round: such a
        row matched no model after the upgrade, and the same model served again
        as its round went into a second sum (a third review, 2026-11-28). Or the
        round is the one a restart cut off and `requester` has a model of it:
        retrained from the same checkpoint on the same images, the new model is
        a near copy of the one masked before (another digest), and a requester
        chaining such sums over three restarted sites, {v, h}, {h', g},
        {g', v'}, read v's model off them (a review, rv_sa, 2026-11-28). Every
        round up to it: resumed from an older checkpoint (the newest torn,
        node/queues.py Checkpoints) or none (the checkpoints gone, the ledger
        kept), a node trains older rounds again too, and the newest round
        alone let v's round-1 model be peeled so (a review, rv2, 2026-11-28)."""
        newest = self.restarted_round
        return (
            self.holds(requester, digest)
            or any((r, m) == (requester, model_round) for r, m, _ in self.legacy)
            or (
                newest is not None
                and model_round <= newest
                and self.masked(requester, model_round) is not None
            )
        )

    def _add(self, requester: str, model_round: int, digest: str) -> None:
        held = self.contributed.get((requester, model_round), ())
        if digest not in held:
            self.contributed[(requester, model_round)] = (*held, digest)

    def record(self, requester: str, model_round: int, digest: str) -> None:
        """From now on this model is in one sum of this requester's, and in no other."""
        # Added, never replacing the model masked before under this round: a round
        # re-served with another model overwrote it, and the first model, still
        # served as another round, went into a second sum (a third review, 2026-11-28).
        self._add(requester, model_round, digest)
        if self.path is not None:
            rows = [
                {"requester": r, "round": m, "model": d, "summed": (r, m, d) not in self.legacy}
                for (r, m), ds in sorted(self.contributed.items())
                for d in ds
            ]
            atomic_write_text(self.path, json.dumps(rows), mode=0o600)

    async def digest(self, model_round: int, state: dict[str, Tensor]) -> str:
        """SHA-256 of a served model (once per round, off the event loop)."""
        cached = self.digests.get(model_round)
        if cached is None or cached[0] is not state:
            cached = (state, await asyncio.to_thread(model_digest, state))
            self.digests[model_round] = cached
        return cached[1]

    def forget_before(self, model_round: int, served: frozenset[str] = frozenset()) -> None:
        """Drop the rows of models older than `model_round`, except a model still
        `served` (digests): forgotten by round alone, a model kept unchanged for
        longer went into a second sum of one requester (a review, 2026-11-28)."""
        kept = {
            k: tuple(d for d in ds if k[1] >= model_round or d in served)
            for k, ds in self.contributed.items()
        }
        self.contributed = {k: ds for k, ds in kept.items() if ds}
        self.legacy = {row for row in self.legacy if row[2] in self.contributed.get(row[:2], ())}
        self.digests = {r: d for r, d in self.digests.items() if r >= model_round}
