"""One masked input per (requester, model), whatever round the model is served as.

Found by a review (2026-11-28): the ledger looked a model up by its round, so
a site that served the same model in two rounds (a round that trained and
merged nothing) put it into two sums of one requester, over different partners.
"""

from __future__ import annotations

import asyncio

import torch

from protocols.exchange import ServedModels
from protocols.memory import InMemoryNetwork
from protocols.secagg import SecAggError, secure_sum
from protocols.secagg_ledger import ContributionLedger
from protocols.secagg_requester import SecureSum
from protocols.secure_exchange import SecureExchange

OPTIONS = dict(max_staleness=1, timeout=5.0, max_norm_ratio=10.0, max_weight_ratio=16.0)


def federation(*names: str) -> tuple[InMemoryNetwork, dict[str, SecureExchange]]:
    """An in-memory network with a SecureExchange for each of `names`."""
    network = InMemoryNetwork()
    exchanges = {}
    for name in names:
        exchanges[name] = SecureExchange(ServedModels(keep=3), **OPTIONS)
        exchanges[name].start(network.join(name))
    return network, exchanges


async def ask(
    requester: object,
    contributors: list[str],
    round_no: int,
    reference: dict[str, torch.Tensor] | None = None,
) -> object:
    """One secure sum of `contributors`' round-`round_no` models: who was in
    it (sorted), or the requester's reason for none."""
    try:
        got = await secure_sum(
            requester,  # type: ignore[arg-type]
            contributors,
            round_no=round_no,
            max_round=round_no,
            reference=reference if reference is not None else {"w": torch.zeros(8)},
            timeout=2.0,
            weight_scale=10.0,
        )
        return sorted(got.contributors)
    except SecAggError as exc:
        return exc.reason


async def weighted_sum(requester: object, contributors: list[str], round_no: int) -> object:
    """One secure sum of `contributors`' round-`round_no` 64-value models
    (weight 10 each): its weighted sum, or the requester's reason for none."""
    try:
        got: SecureSum = await secure_sum(
            requester,  # type: ignore[arg-type]
            contributors,
            round_no=round_no,
            max_round=round_no,
            reference={"w": torch.zeros(64)},
            timeout=2.0,
            weight_scale=10.0,
        )
    except SecAggError as exc:
        return exc.reason
    return got.mean["w"] * (got.total_weight / 10.0)


def two_sums(second_model_changes: bool) -> list[object]:
    async def run() -> list[object]:
        network, exchanges = federation("v", "a", "b")
        torch.manual_seed(0)
        frozen = {"w": torch.randn(8)}
        exchanges["v"].store.put(1, frozen, 10)
        later = {"w": frozen["w"] + 1} if second_model_changes else frozen
        exchanges["v"].store.put(2, later, 10)
        for r in (1, 2):
            exchanges["a"].store.put(r, {"w": torch.full((8,), float(r))}, 10)
            exchanges["b"].store.put(r, {"w": torch.full((8,), float(-r))}, 10)
        requester = network.join("r")
        out: list[object] = []
        for r, partner in ((1, "a"), (2, "b")):
            out.append(await ask(requester, ["v", partner], r))
        refusals = [x["reason"] for x in network.rejections if x["peer"] == "r"]
        return [*out, refusals]

    return asyncio.run(run())


def test_a_model_served_in_two_rounds_goes_into_one_sum_of_a_requester() -> None:
    first, second, refusals = two_sums(second_model_changes=False)
    assert first == ["a", "v"]
    assert second == "too_few"  # v refused: nobody masked
    assert refusals == ["secagg_already_contributed"]


def test_a_new_model_of_the_next_round_still_joins_its_sum() -> None:
    first, second, refusals = two_sums(second_model_changes=True)
    assert first == ["a", "v"] and second == ["b", "v"] and refusals == []


def test_a_model_kept_longer_than_the_ledgers_rounds_still_goes_into_one_sum() -> None:
    """A second review (2026-11-28): the ledger forgot its rows by round, so a
    model served unchanged for more rounds than the contributor keeps, once
    ANY requester's sum moved the contributor past them, went into a second
    sum of the requester it was already in."""

    async def run() -> list[object]:
        network, exchanges = federation("v", "a", "b")
        torch.manual_seed(0)
        frozen = {"w": torch.randn(8)}
        requester, honest = network.join("r"), network.join("c")
        out: list[object] = []

        for r in range(1, 6):
            exchanges["v"].store.put(r, frozen, 10)
            exchanges["a"].store.put(r, {"w": torch.full((8,), float(r))}, 10)
            exchanges["b"].store.put(r, {"w": torch.full((8,), float(-r))}, 10)
            if r == 1:
                out.append(await ask(requester, ["v", "a"], 1))
        out.append(await ask(honest, ["v", "a"], 5))  # an honest requester's sum of round 5
        out.append(await ask(requester, ["v", "b"], 5))
        out.append(await ask(requester, ["v", "b"], 3))
        return out

    assert asyncio.run(run()) == [["a", "v"], ["a", "v"], "too_few", "too_few"]


def test_a_model_that_differs_only_in_a_counter_no_sum_carries_is_the_same_model():
    """Two rounds of v's model equal in every summed entry, differing only in
    BatchNorm's num_batches_tracked (an integer no secure sum adds): their sums
    would be the same, so the second sum of the same requester is refused.
    The ledger's digest covered the counter too and let both in (a second
    review, 2026-11-28)."""

    async def run() -> list[object]:
        network, exchanges = federation("v", "a", "b")
        torch.manual_seed(0)
        w = torch.randn(8)
        counter = "bn.num_batches_tracked"
        exchanges["v"].store.put(1, {"w": w.clone(), counter: torch.tensor(5)}, 10)
        exchanges["v"].store.put(2, {"w": w.clone(), counter: torch.tensor(6)}, 10)
        for r in (1, 2):
            exchanges["a"].store.put(r, {"w": torch.full((8,), 1.0), counter: torch.tensor(0)}, 10)
            exchanges["b"].store.put(r, {"w": torch.full((8,), -1.0), counter: torch.tensor(0)}, 10)
        requester = network.join("r")
        out: list[object] = []
        for r, partner in ((1, "a"), (2, "b")):
            reference = {"w": torch.zeros(8), counter: torch.tensor(0)}
            out.append(await ask(requester, ["v", partner], r, reference))
        return out

    assert asyncio.run(run()) == [["a", "v"], "too_few"]


def test_a_round_re_served_with_another_model_keeps_the_first_models_row(tmp_path) -> None:
    """A third review (2026-11-28): the ledger held one digest per (requester,
    round), so a round re-served with another model (retrained after a crash)
    replaced the row of the model masked before; that model, still served as
    another round, then went into a second sum of the same requester."""

    async def run() -> list[object]:
        network, exchanges = federation("v", "a", "b")
        torch.manual_seed(0)
        frozen = {"w": torch.randn(8)}
        exchanges["v"].store.put(1, frozen, 10)
        exchanges["v"].store.put(2, frozen, 10)  # kept unchanged: rounds 1 and 2
        for r in (1, 2):
            exchanges["a"].store.put(r, {"w": torch.full((8,), float(r))}, 10)
            exchanges["b"].store.put(r, {"w": torch.full((8,), float(-r))}, 10)
        requester = network.join("r")
        out: list[object] = []
        for r, partner in ((2, "a"), (2, "b"), (1, "b")):
            out.append(await ask(requester, ["v", partner], r))
            if len(out) == 1:  # round 2 re-served with another model
                exchanges["v"].store.put(2, {"w": frozen["w"] + 1}, 10)
        ledger = exchanges["v"].contributor.ledger  # type: ignore[union-attr]
        # the file keeps both rows of round 2: a restart still refuses the first model
        reread = ContributionLedger(tmp_path / "ledger.json", "v")
        for (who, r), digests in ledger.contributed.items():
            for digest in digests:
                reread.record(who, r, digest)
        restarted = ContributionLedger(tmp_path / "ledger.json", "v")
        out.append(restarted.holds("r", await ledger.digest(1, frozen)))
        return out

    first, second, third, remembered = asyncio.run(run())
    assert first == ["a", "v"] and second == ["b", "v"]
    assert third == "too_few"  # v refused the first model again: nobody masked
    assert remembered is True


def test_a_ledger_of_before_the_summed_digest_still_refuses_its_round(tmp_path) -> None:
    """A third review (2026-11-28): a row written before the digest left the
    counters out holds a digest no model matches now, so after the upgrade the
    same model (with num_batches_tracked) served again as its round went into a
    second sum of that requester; such a row refuses its round, and keeps
    doing so when the ledger is written again."""
    import hashlib
    import json

    def digest_of_before(state: dict[str, torch.Tensor]) -> str:  # every entry
        digest = hashlib.sha256()
        for name in sorted(state):
            tensor = state[name].detach().contiguous().reshape(-1)
            digest.update(f"{name}|{tensor.dtype}|{tuple(state[name].shape)}|".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    torch.manual_seed(0)
    model = {"bn.weight": torch.randn(8), "bn.num_batches_tracked": torch.tensor(5)}
    path = tmp_path / "secagg_ledger.json"
    path.write_text(json.dumps([{"requester": "r", "round": 2, "model": digest_of_before(model)}]))

    async def run() -> object:
        network, exchanges = federation("v", "a")
        exchanges["v"].contributor.ledger = ContributionLedger(path, "v")  # type: ignore[union-attr]
        exchanges["v"].store.put(2, model, 10)
        other = {"bn.weight": torch.ones(8), "bn.num_batches_tracked": torch.tensor(5)}
        exchanges["a"].store.put(2, other, 10)
        reference = {k: torch.zeros_like(t) for k, t in model.items()}
        return await ask(network.join("r"), ["v", "a"], 2, reference)

    assert asyncio.run(run()) == "too_few"  # v refused: nobody masked
    ledger = ContributionLedger(path, "v")
    ledger.record("q", 3, "0" * 64)  # written again: the old row stays an old row
    again = ContributionLedger(path, "v")
    assert again.refuses("r", 2, "f" * 64) and not again.refuses("q", 2, "f" * 64)


def test_a_round_retrained_after_a_restart_goes_into_no_second_sum_of_a_requester(
    tmp_path,
) -> None:
    """A review (rv_sa, 2026-11-28): a node that restarts mid-round retrains that
    round from the same checkpoint on the same images, a near copy of the model
    it masked before the restart (another shuffle and augmentation, so another
    digest), and the ledger took it into a second sum of the same requester.
    With three sites restarted so (a rolling upgrade, a power cut), a requester
    alone chained sums {v, h}, {h', g}, {g', v'} and read (S1 - S2 + S3) / 2 as
    v's model, off only by the retrainings' differences. The newest round a
    restarted node's ledger holds is now refused to a requester that has a
    model of it in a sum; the next rounds are new models, as before."""
    names = ("v", "h", "g")
    torch.manual_seed(0)
    first = {n: {"w": torch.randn(64)} for n in names}  # masked before the restart
    retrained = {n: {"w": first[n]["w"] + 1e-3 * torch.randn(64)} for n in names}

    async def run() -> list[object]:
        network, exchanges = federation(*names)
        for n in names:
            exchanges[n].contributor.ledger = ContributionLedger(tmp_path / f"{n}.json", n)  # type: ignore[union-attr]
            exchanges[n].store.put(1, first[n], 10)
        requester = network.join("r")

        def restart(n: str) -> None:  # what survives: the ledger; round 1 retrained
            exchanges[n].contributor.ledger = ContributionLedger(tmp_path / f"{n}.json", n)  # type: ignore[union-attr]
            exchanges[n].store.put(1, retrained[n], 10)

        out = [await weighted_sum(requester, ["v", "h"], 1)]
        restart("h")
        out.append(await weighted_sum(requester, ["h", "g"], 1))
        restart("g")
        restart("v")
        out.append(await weighted_sum(requester, ["g", "v"], 1))
        # the next round is a new model, and joins a sum as before
        for n in names:
            exchanges[n].store.put(2, {"w": torch.randn(64)}, 10)
        out.append(await weighted_sum(requester, ["v", "h"], 2))
        return out

    s1, s2, s3, later = asyncio.run(run())
    assert isinstance(s1, torch.Tensor) and isinstance(later, torch.Tensor)
    if isinstance(s2, torch.Tensor) and isinstance(s3, torch.Tensor):
        peeled = (s1 - s2 + s3) / 2
        error = float((peeled - first["v"]["w"]).abs().max())
        raise AssertionError(f"v's model peeled by one requester, off by {error:.1e} at most")
    assert s2 == "too_few" and s3 == "too_few"  # h, then v, refused: nobody masked


def test_every_round_a_restart_trains_again_goes_into_no_second_sum_of_a_requester(
    tmp_path,
) -> None:
    """A review (rv2, 2026-11-28): a restart trains again every round after the
    checkpoint it resumes from, and that is not always the ledger's newest
    round alone. The newest checkpoint torn (node/queues.py Checkpoints skips
    it for an older one, three kept), or the checkpoints gone with the ledger
    kept, the node trains rounds 1 and 2 again from round 0's model: its
    round-1 model then was a near copy of one masked before, under a round
    older than the ledger's newest, and went into a second sum of the same
    requester. Three sites restarted so, a requester alone chained {v, h},
    {h', g}, {g', v'} of round 1 and read v's round-1 model off them. Every
    round up to the ledger's newest is refused now to a requester that has a
    model of it in a sum."""
    names = ("v", "h", "g")
    torch.manual_seed(0)
    first = {n: {"w": torch.randn(64)} for n in names}  # round 1, masked before
    second = {n: {"w": torch.randn(64)} for n in names}  # round 2, masked before
    again = {n: {"w": first[n]["w"] + 1e-3 * torch.randn(64)} for n in names}

    async def run() -> list[object]:
        network, exchanges = federation(*names)
        for n in names:
            exchanges[n].contributor.ledger = ContributionLedger(tmp_path / f"{n}.json", n)  # type: ignore[union-attr]
            exchanges[n].store.put(1, first[n], 10)
            exchanges[n].store.put(2, second[n], 10)
        requester = network.join("r")

        def restart(n: str) -> None:  # from round 0's checkpoint: rounds 1 and 2 again
            exchanges[n].contributor.ledger = ContributionLedger(tmp_path / f"{n}.json", n)  # type: ignore[union-attr]
            exchanges[n].store.models.clear()
            exchanges[n].store.put(1, again[n], 10)

        out = [await weighted_sum(requester, ["v", "h"], 1)]
        newest = await weighted_sum(requester, ["v", "h", "g"], 2)
        assert isinstance(newest, torch.Tensor)  # newest: 2
        restart("h")
        out.append(await weighted_sum(requester, ["h", "g"], 1))
        restart("g")
        restart("v")
        out.append(await weighted_sum(requester, ["g", "v"], 1))
        return out

    s1, s2, s3 = asyncio.run(run())
    assert isinstance(s1, torch.Tensor)
    if isinstance(s2, torch.Tensor) and isinstance(s3, torch.Tensor):
        peeled = (s1 - s2 + s3) / 2
        error = float((peeled - first["v"]["w"]).abs().max())
        raise AssertionError(f"v's round-1 model peeled by one requester, off by {error:.1e}")
    assert s2 == "too_few" and s3 == "too_few"  # h, then v, refused: nobody masked
