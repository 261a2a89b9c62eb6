"""A hostile review of the compressed, asynchronous and 32-bit secure exchanges
and of the slow_train drill: what a roster peer that is authenticated but lies
can send, and what a careless operator can leave on disk or in a fault plan.

Each attack asserts the promise of docs/protocols.md and docs/threat-model.md:
refused with a stable reason and counted, memory bounded by the roster and the
model, the node goes on (the next honest reply is merged). All in memory.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from bench.copy_writes import legacy_index
from node.faults import FaultPlan, parse_slow_train
from p2pfl.secure.tensors import dumps, loads
from protocols.async_exchange import AsyncExchange
from protocols.compressed_exchange import (
    CompressedExchange,
    CompressedGradientExchange,
    copy_file_name,
)
from protocols.compression import compress_state, parse
from protocols.exchange import ServedModels
from protocols.masking import FIXED_POINT_BITS, MaskingError, entry_limit, from_fixed, to_fixed
from protocols.secagg_messages import SessionRequest, session_context
from protocols.secagg_primitives import SecAggError, fits_ring, masked_input

OWN = {
    "w": torch.linspace(-1.0, 1.0, 620).reshape(20, 31),
    "b": torch.zeros(5),
    "n": torch.tensor(3),
}
N = 625  # float values of OWN
ENTRIES = [["w", [20, 31]], ["b", [5]]]


def own() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in OWN.items()}


class Ctx:
    """The context as an exchange sees it; `answer(query)` is the peer's reply,
    through the real wire codec."""

    me = "me"

    def __init__(
        self,
        answer: Callable[[dict[str, Any]], Any] | None = None,
        roster: list[str] | None = None,
        path: Path | None = None,
    ) -> None:
        self.answer = answer
        self.rejected: list[tuple[str, str]] = []
        self.queries: list[dict[str, Any]] = []
        self._roster = roster or ["me", "p"]
        self.path = path

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        self.queries.append(query)
        assert self.answer is not None
        reply = self.answer(query)
        if asyncio.iscoroutine(reply):
            reply = await reply
        return loads(dumps(reply))

    def reject(self, peer: str, reason: str) -> None:
        self.rejected.append((peer, reason))

    def sample_caps(self) -> dict[str, int]:
        return {}

    def roster(self) -> list[str]:
        return self._roster

    def serve(self, kind: str, handler: Any) -> None:
        pass

    def offered(self, kind: str) -> None:
        pass

    def durable_file(self, name: str) -> Path | None:
        return None if self.path is None else self.path / name

    async def run_blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


def exchange(setting: str) -> CompressedExchange:
    return CompressedExchange(
        ServedModels(3),
        compression=setting,
        max_staleness=1,
        timeout=1.0,
        max_norm_ratio=10.0,
        max_weight_ratio=16.0,
    )


def sender(
    setting: str, model: dict[str, torch.Tensor] | None = None, **ctx: Any
) -> CompressedExchange:
    tx = exchange(setting)
    c = Ctx(**ctx)
    tx.start(c)  # type: ignore[arg-type]
    tx.offer(c, 1, model or OWN, 10)  # type: ignore[arg-type]
    return tx


def serve(tx: CompressedExchange, requester: str, ref: Any = 0) -> dict[str, Any]:
    return asyncio.run(tx.serve(requester, {"round": 1, "max_round": 2, "ref": ref}))


def pull(
    rx: CompressedExchange, answer: Callable[[dict[str, Any]], Any], **ctx: Any
) -> tuple[Any, Ctx]:
    c = Ctx(answer, **ctx)
    rx.start(c)  # type: ignore[arg-type]
    got = asyncio.run(rx.collect(c, 1, OWN, 10.0, ["p"], 1))  # type: ignore[arg-type]
    return got, c


def tamper(reply: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**reply, "state": {**reply["state"], **fields}}


# ---------------------------------------------------------------------- hostile payloads


def _hostile_replies() -> list[tuple[str, str, Any, str]]:
    i8 = serve(sender("int8"), "me")
    f16 = serve(sender("fp16"), "me")
    topk = {  # a top-k difference from the copy 77 the receiver holds
        "$q": "topk",
        "shape": [N],
        "values": torch.ones(3, dtype=torch.float16),
        "index": torch.tensor([1, 2, 3], dtype=torch.int32),
        "entries": ENTRIES,
        "raw": {"n": OWN["n"]},
    }
    tk = {"round": 1, "num_train": 10, "format": "topk:0.01", "ref": 77, "id": 78, "state": topk}
    big = 1 << 40
    return [
        # declared sizes that disagree with each other or with the model
        ("q two-dimensional", "int8", tamper(i8, q=i8["state"]["q"].view(25, 25)), "size_mismatch"),
        ("huge declared shape", "int8", tamper(i8, shape=[big]), "shape_mismatch"),
        ("shape of floats", "int8", tamper(i8, shape=[float(N)]), "malformed"),
        (
            "entry named huge",
            "int8",
            tamper(i8, entries=[["w", [big]], ["b", [5]]]),
            "shape_mismatch",
        ),
        ("a thousand entries", "int8", tamper(i8, entries=[["w", [1]]] * 1000), "key_mismatch"),
        ("entry not a pair", "int8", tamper(i8, entries=[["w"], ["b", [5]]]), "malformed"),
        ("raw extra key", "int8", tamper(i8, raw={"n": OWN["n"], "x": OWN["n"]}), "key_mismatch"),
        ("block huge", "int8", tamper(i8, block=1 << 40), "bad_block"),
        ("block zero", "int8", tamper(i8, block=0), "bad_block"),
        ("block string", "int8", tamper(i8, block="256"), "bad_block"),
        # dtypes other than the format's
        ("q as uint8", "int8", tamper(i8, q=i8["state"]["q"].view(torch.uint8)), "bad_dtype"),
        ("fp16 values as float32", "fp16", tamper(f16, values=torch.zeros(N)), "bad_dtype"),
        (
            "fp16 values bf16",
            "fp16",
            tamper(f16, values=torch.zeros(N, dtype=torch.bfloat16)),
            "bad_dtype",
        ),
        ("values not a tensor", "fp16", tamper(f16, values=[0.0] * N), "malformed"),
        (
            "index int64",
            "topk:0.01",
            {**tk, "state": {**topk, "index": torch.tensor([1, 2, 3])}},
            "bad_dtype",
        ),
        (
            "mask int8",
            "topk:0.01",
            {
                **tk,
                "state": {
                    **{k: v for k, v in topk.items() if k != "index"},
                    "mask": torch.zeros(79, dtype=torch.int8),
                },
            },
            "bad_dtype",
        ),
        (
            "values 2-D",
            "topk:0.01",
            {**tk, "state": {**topk, "values": torch.ones(3, 1, dtype=torch.float16)}},
            "too_many_indices",
        ),
        # NaN / inf in values; a scale whose product overflows float32
        (
            "fp16 inf",
            "fp16",
            tamper(f16, values=torch.full((N,), math.inf, dtype=torch.float16)),
            "non_finite",
        ),
        (
            "scale x 127 overflows",
            "int8",
            tamper(i8, q=torch.full((N,), 127, dtype=torch.int8), scale=torch.full((3,), 3e37)),
            "non_finite",
        ),
        (
            "topk inf value",
            "topk:0.01",
            {
                **tk,
                "state": {**topk, "values": torch.tensor([1, math.inf, 1], dtype=torch.float16)},
            },
            "non_finite",
        ),
        # top-k counts: every entry carries exactly ceil(F * size) values (w: 7 of
        # 620, b: 1 of 5); an entry with none sent would leave the merge's bound
        # (the smallest value sent in it) undefined: the round crashed on it
        (
            "topk no value for one entry",
            "topk:0.01",
            {
                **tk,
                "state": {
                    **topk,
                    "values": torch.ones(7, dtype=torch.float16),
                    "index": torch.arange(7, dtype=torch.int32),
                },
            },
            "size_mismatch",
        ),
        ("topk fewer values than it keeps", "topk:0.01", tk, "size_mismatch"),
        (
            "topk more values than it keeps",
            "topk:0.01",
            {
                **tk,
                "state": {
                    **topk,
                    "values": torch.ones(9, dtype=torch.float16),
                    "index": torch.tensor([*range(8), 620], dtype=torch.int32),
                },
            },
            "size_mismatch",
        ),
        # ids: out of range, of the wrong type, or a copy the receiver does not hold
        ("id zero", "int8", {**i8, "id": 0}, "malformed"),
        ("id past 52 bits", "int8", {**i8, "id": 1 << 52}, "malformed"),
        ("id a float", "int8", {**i8, "id": 5.0}, "malformed"),
        ("id a bool", "int8", {**i8, "id": True}, "malformed"),
        ("id NaN", "int8", {**i8, "id": math.nan}, "malformed"),
        ("id infinite", "int8", {**i8, "id": math.inf}, "malformed"),
        ("id negative", "int8", {**i8, "id": -5}, "malformed"),
        ("id huge", "int8", {**i8, "id": 2**63 - 1}, "malformed"),  # (past 2^64: not on the wire)
        ("id a string", "int8", {**i8, "id": "5"}, "malformed"),
        ("id empty", "int8", {**i8, "id": []}, "malformed"),
        ("id missing", "int8", {k: v for k, v in i8.items() if k != "id"}, "malformed"),
        # an id names one copy, whose file is written once
        ("id the held copy's again", "int8", {**i8, "id": 77}, "malformed"),
        ("ref negative", "int8", {**i8, "ref": -1}, "malformed"),
        ("ref of another peer's copy", "int8", {**i8, "ref": 88}, "bad_ref"),
        ("ref stale (the copy before 77)", "int8", {**i8, "ref": 76}, "bad_ref"),
        # a peer switching format mid-run
        ("switched to fp16", "int8", f16, "mismatch"),
        ("switched to none", "int8", {**i8, "format": "none"}, "mismatch"),
        ("format missing", "int8", {k: v for k, v in i8.items() if k != "format"}, "mismatch"),
    ]


HOSTILE = _hostile_replies()


@pytest.mark.parametrize(
    ("what", "setting", "reply", "reason"), HOSTILE, ids=[h[0] for h in HOSTILE]
)
def test_a_lying_peers_compressed_reply_is_refused_counted_and_the_node_goes_on(
    what: str, setting: str, reply: Any, reason: str
) -> None:
    rx = exchange(setting)
    rx.held["p"] = (77, own())  # the copy a difference starts from
    rx.held["q"] = (88, own())  # another sender's copy
    got, ctx = pull(rx, lambda q: reply)
    assert got.terms == [], what
    assert ctx.rejected == [("p", f"compression_{reason}")], what
    assert rx.held["p"][0] == 77 and rx.held["q"][0] == 88  # the pairs' copies untouched
    assert rx.pending == {}  # nothing half-adopted
    good = serve(sender(setting), "me")
    again, ctx = pull(exchange(setting), lambda q: good)
    assert len(again.terms) == 1 and ctx.rejected == []


def test_a_denormal_scale_decodes_to_finite_values_and_is_merged() -> None:
    """Subnormal float32 scales are finite: decoded, admitted, no exception."""
    reply = serve(sender("int8"), "me")
    reply = tamper(reply, scale=torch.full((3,), 1e-45))
    got, ctx = pull(exchange("int8"), lambda q: reply)
    assert ctx.rejected == [] and len(got.terms) == 1
    assert all(bool(torch.isfinite(v).all()) for v in got.terms[0].state.values())


def test_a_difference_that_overflows_the_copy_is_refused_and_the_copy_kept() -> None:
    """A finite delta that makes copy + delta infinite (the copy near float32's
    max): refused by the checks (non-finite), the pair keeps its copy."""
    rx = exchange("fp16")
    rx.held["p"] = (77, {**own(), "w": torch.full((20, 31), 3.4e38)})
    big = {
        "$q": "fp16",
        "shape": [N],
        "values": torch.full((N,), 60000.0, dtype=torch.float16),
        "entries": ENTRIES,
        "raw": {"n": OWN["n"]},
    }
    reply = {"round": 1, "num_train": 10, "format": "fp16", "ref": 77, "id": 5, "state": big}
    got, ctx = pull(rx, lambda q: reply)
    assert got.terms == [] and len(ctx.rejected) == 1
    assert rx.held["p"][0] == 77 and rx.pending == {}  # the refused copy is not kept either


# ---------------------------------------------------------------------- the sender's copies


def test_thousands_of_ref_ids_keep_at_most_two_copies_per_requester() -> None:
    tx = sender("int8")
    first = serve(tx, "p")
    for ref in [first["id"], *range(1, 2000), -5, 2**60, "x", 1.5, True, None]:
        reply = serve(tx, "p", ref)
        assert reply["ref"] in (0, first["id"])  # a keyframe, or the one copy it holds
        assert len(tx.sent["p"]) <= 2
    assert list(tx.sent) == ["p"]


def test_requesters_past_the_roster_do_not_grow_the_copies() -> None:
    tx = sender("int8", roster=["me", "p", "q"])
    for i in range(200):
        serve(tx, f"x{i}")
    assert len(tx.sent) <= 3 and sum(len(c) for c in tx.sent.values()) <= 6


def test_a_ref_naming_another_requesters_copy_gets_a_keyframe() -> None:
    tx = sender("int8")
    mine = serve(tx, "q")
    stolen = serve(tx, "p", mine["id"])
    assert stolen["ref"] == 0  # a keyframe from zeros, not a difference from q's copy
    assert mine["id"] in tx.sent["q"]  # q's copy untouched


def test_parallel_pulls_by_one_requester_stay_bounded_and_decodable() -> None:
    tx = sender("topk:0.1")
    first = serve(tx, "p")

    async def flood() -> list[dict[str, Any]]:
        query = {"round": 1, "max_round": 2, "ref": first["id"]}
        return await asyncio.gather(*(tx.serve("p", dict(query)) for _ in range(40)))

    replies = asyncio.run(flood())
    assert len(tx.sent["p"]) <= 2
    # each reply decodes on its own against the copy it names
    rx = exchange("topk:0.1")
    rx.held["p"] = (first["id"], _decoded_copy(first))
    for reply in replies[:3]:
        copy, _ = rx.reconstruct(loads(dumps(reply["state"])), OWN, rx.held["p"][1])
        assert all(bool(torch.isfinite(v).all()) for v in copy.values() if v.is_floating_point())


def _decoded_copy(keyframe: dict[str, Any]) -> dict[str, torch.Tensor]:
    rx = exchange("topk:0.1")
    copy, _ = rx.reconstruct(loads(dumps(keyframe["state"])), OWN, None)
    return copy


# ---------------------------------------------------------------------- copies on disk


def _corrupt_files(tmp: Path) -> dict[str, bytes]:
    good = sender("int8", path=tmp / "good")
    serve(good, "p")
    good.held["p"] = (77, own())
    valid = legacy_index("int8", good.snapshot())
    wrong = {"t0": torch.zeros(3), "t1": torch.zeros(2, 2), "t2": torch.tensor(1)}
    index = [["sent", "p", 5, "w"], ["sent", "p", 5, "b"], ["sent", "p", 5, "n"]]
    nan = {"t0": torch.full((20, 31), math.nan), "t1": torch.zeros(5), "t2": torch.tensor(3)}
    return {
        "garbage": b"\x00\xffnot a safetensors file",
        "empty": b"",
        "truncated": valid[: len(valid) // 2],
        "header lies about its length": (1 << 60).to_bytes(8, "little") + valid[8:],
        "index not json": save_safetensors(
            {"t0": torch.zeros(1)}, metadata={"format": "int8", "index": "{"}
        ),
        "index a dict": save_safetensors(
            {"t0": torch.zeros(1)}, metadata={"format": "int8", "index": '{"abcd": 1}'}
        ),
        "copy id infinite": save_safetensors(
            {"t0": torch.zeros(1)},
            metadata={"format": "int8", "index": '[["sent", "p", 1e999, "w"]]'},
        ),
        "tensor missing": save_safetensors(
            {"t0": torch.zeros(1)}, metadata={"format": "int8", "index": json.dumps(index)}
        ),
        "copies of another model": save_safetensors(
            wrong, metadata={"format": "int8", "index": json.dumps(index)}
        ),
        "a NaN copy": save_safetensors(
            nan, metadata={"format": "int8", "index": json.dumps(index)}
        ),
        "written under another format": save_safetensors(
            {"t0": OWN["w"], "t1": OWN["b"], "t2": OWN["n"]},
            metadata={"format": "fp16", "index": json.dumps(index)},
        ),
        "held copies of another model": save_safetensors(
            wrong,
            metadata={"format": "int8", "index": json.dumps([["held", *e[1:]] for e in index])},
        ),
    }


@pytest.mark.parametrize("what", list(_corrupt_files(Path("/nonexistent")).keys()))
def test_a_corrupt_copies_file_is_no_crash_and_pairs_restart_from_a_keyframe(
    tmp_path: Path, what: str
) -> None:
    data = _corrupt_files(tmp_path)[what]
    state_dir = tmp_path / "node"
    state_dir.mkdir()
    (state_dir / "compression.safetensors").write_bytes(data)
    tx = sender("int8", path=state_dir)  # start() loads the file: no exception
    reply = serve(tx, "p", 5)  # the id the file claims for p
    assert reply["ref"] == 0  # a keyframe, never a difference from a bad copy
    rx = exchange("int8")
    got, ctx = pull(rx, lambda q: reply, path=state_dir)
    assert ctx.rejected == [] and len(got.terms) == 1
    torch.testing.assert_close(got.terms[0].state["w"], OWN["w"], atol=0.01, rtol=0)


def test_a_legacy_index_with_its_copies_inside_still_loads(tmp_path: Path) -> None:
    """An index of before the files' layout (the copies' tensors in the index
    file): its copies are used, so a restarted node sends a difference."""
    state_dir, first_id = _legacy_state_dir(tmp_path)
    tx = sender("int8", path=state_dir)
    assert serve(tx, "p", first_id)["ref"] == first_id


def _legacy_state_dir(tmp: Path) -> tuple[Path, int]:
    """A state directory holding an index of before the files' layout (the
    copies' tensors in the index file), and the id of the copy sent to p."""
    good = sender("int8", path=tmp / "good")
    first = serve(good, "p")
    state_dir = tmp / "node"
    state_dir.mkdir()
    (state_dir / "compression.safetensors").write_bytes(legacy_index("int8", good.snapshot()))
    return state_dir, int(first["id"])


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files the compressed exchange writes, in order."""
    import protocols.compressed_exchange as module

    names: list[str] = []
    real = module.atomic_write_bytes

    def counting(path: Path, data: Any, **kw: Any) -> Path:
        names.append(Path(path).name)
        return real(path, data, **kw)

    monkeypatch.setattr(module, "atomic_write_bytes", counting)
    return names


def _saved_files(tmp: Path) -> tuple[Path, int]:
    """A node's state directory after a save in the files' layout, and the
    id of the copy it sent to p."""
    state_dir = tmp / "node"
    good = sender("int8", path=state_dir)
    first = serve(good, "p")
    good.held["q"] = (77, own())
    good.save()
    return state_dir, int(first["id"])


def _break_files(state_dir: Path, sent_id: int, what: str) -> None:
    index_path = state_dir / "compression.safetensors"
    copy = state_dir / "compression.copies" / copy_file_name("sent", "p", sent_id)
    meta = {"format": "int8", "layout": "files"}
    if what == "a copy file garbage":
        copy.write_bytes(b"\x00\xffnot a safetensors file")
    elif what == "a copy file missing":
        copy.unlink()
    elif what == "a copy file truncated":
        copy.write_bytes(copy.read_bytes()[:100])
    elif what == "a NaN copy":
        nan = {"w": torch.full((20, 31), math.nan), "b": torch.zeros(5), "n": torch.tensor(3)}
        copy.write_bytes(save_safetensors(nan, metadata={"format": "int8"}))
    elif what == "a copy of another model":
        wrong = {"w": torch.zeros(3), "b": torch.zeros(2, 2), "n": torch.tensor(1)}
        copy.write_bytes(save_safetensors(wrong, metadata={"format": "int8"}))
    elif what == "a copy file of another format":
        copy.write_bytes(save_safetensors(own(), metadata={"format": "fp16"}))
    elif what == "a side that is a path":
        index = [["../../etc/passwd", "p", sent_id]]
        index_path.write_bytes(save_safetensors({}, metadata={**meta, "index": json.dumps(index)}))
    elif what == "a peer that is not a string":
        index = [["sent", ["p"], sent_id]]
        index_path.write_bytes(save_safetensors({}, metadata={**meta, "index": json.dumps(index)}))
    elif what == "an entry of two fields":
        index_path.write_bytes(
            save_safetensors({}, metadata={**meta, "index": json.dumps([["sent", "p"]])})
        )
    elif what == "an id of 1e999":
        index_path.write_bytes(
            save_safetensors({}, metadata={**meta, "index": '[["sent", "p", 1e999]]'})
        )
    elif what != "nothing":
        raise AssertionError(what)


FILE_FAULTS = [
    "a copy file garbage",
    "a copy file missing",
    "a copy file truncated",
    "a NaN copy",
    "a copy of another model",
    "a copy file of another format",
    "a side that is a path",
    "a peer that is not a string",
    "an entry of two fields",
    "an id of 1e999",
]


@pytest.mark.parametrize("what", ["nothing", *FILE_FAULTS])
def test_a_broken_copy_file_is_no_crash_and_that_pair_restarts_from_a_keyframe(
    tmp_path: Path, what: str
) -> None:
    """The files' layout, attacked file by file: loading never raises, and a
    pair whose copy is broken answers with a keyframe, never a difference from
    a bad copy, while the other pairs keep theirs (a broken index loses them
    all); untouched ("nothing"), the copy is used."""
    state_dir, sent_id = _saved_files(tmp_path)
    _break_files(state_dir, sent_id, what)
    tx = sender("int8", path=state_dir)  # start() loads: no exception
    if what.startswith("a copy") or what in ("nothing", "a NaN copy"):
        assert tx.held["q"][0] == 77  # q's copy, in a file of its own, is kept
    reply = serve(tx, "p", sent_id)
    if what == "nothing":  # the copy loaded: a difference from it
        assert reply["ref"] == sent_id
        return
    assert reply["ref"] == 0
    rx = exchange("int8")  # and the keyframe decodes to the model
    got, ctx = pull(rx, lambda q: reply, path=tmp_path / "rx")
    assert ctx.rejected == [] and len(got.terms) == 1
    torch.testing.assert_close(got.terms[0].state["w"], OWN["w"], atol=0.01, rtol=0)


@pytest.mark.parametrize("fail_at", range(5))
def test_a_save_cut_at_any_step_never_leaves_a_wrong_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """A save after two new copies, cut at each of its writes and deletions in
    turn (a full disk, a crash): a restarted node loads only copies whose
    content is the one their id names, and the next save completes."""
    import protocols.compressed_exchange as module

    state_dir = tmp_path / "node"
    tx = sender("int8", path=state_dir)
    made: dict[tuple[str, str, int], dict[str, torch.Tensor]] = {}
    first = serve(tx, "p")
    tx.held["q"] = (77, own())
    tx.save()
    second = serve(tx, "p", first["id"])
    tx.held["q"] = (78, {k: v + 1 if v.is_floating_point() else v for k, v in own().items()})
    for side, peer, cid, state in tx.snapshot():
        made[(side, peer, cid)] = state
    made[("held", "q", 77)] = own()
    steps = [0]
    real_write, real_unlink = module.atomic_write_bytes, Path.unlink

    def step() -> None:
        steps[0] += 1
        if steps[0] == fail_at + 1:
            raise OSError(28, "No space left on device")

    def write(path: Path, data: Any, **kw: Any) -> Path:
        step()
        return real_write(path, data, **kw)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        step()
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(module, "atomic_write_bytes", write)
    monkeypatch.setattr(Path, "unlink", unlink)
    tx.save()  # cut at step fail_at (or not at all, past the last step)
    monkeypatch.undo()
    again = sender("int8", path=state_dir)
    loaded = [(s, p, c, st) for s, p, c, st in again.snapshot()]
    with safe_open(str(state_dir / "compression.safetensors"), framework="pt") as opened:
        named = json.loads((opened.metadata() or {})["index"])
    # every copy the index names loads (copies are on disk before the index names them)
    assert sorted((s, p, c) for s, p, c, _ in loaded) == sorted(tuple(e) for e in named)
    for side, peer, cid, state in loaded:
        for key, value in state.items():
            assert torch.equal(value, made[(side, peer, cid)][key]), (side, peer, cid, key)
    tx.save()  # the retry completes: the latest copies load
    latest = sender("int8", path=state_dir)
    assert latest.held["q"][0] == 78 and second["id"] in latest.sent["p"]


def test_a_legacy_index_migrates_and_a_restart_writes_no_copy_again(
    tmp_path: Path, written: list[str]
) -> None:
    """A legacy index's copies are written to files at the first save; after a
    restart from the files, the first save writes only the index."""
    state_dir, first_id = _legacy_state_dir(tmp_path)
    written.clear()
    migrated = sender("int8", path=state_dir)
    migrated.save()
    assert copy_file_name("sent", "p", first_id) in written
    written.clear()
    restarted = sender("int8", path=state_dir)
    assert first_id in restarted.sent["p"]
    restarted.save()
    assert written == ["compression.safetensors"]


@pytest.fixture
def fill_disk(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Once called, until monkeypatch.undo(): the disk is full when the index
    is written (the copies' own files still go through)."""
    import protocols.compressed_exchange as module

    real = module.atomic_write_bytes

    def full(path: Path, data: Any, **kw: Any) -> Path:
        if Path(path).name == "compression.safetensors":
            raise OSError(28, "No space left on device")
        return real(path, data, **kw)

    return lambda: monkeypatch.setattr(module, "atomic_write_bytes", full)


def test_an_old_id_used_again_after_a_failed_save_is_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fill_disk: Callable[[], None]
) -> None:
    """A peer names a new copy with an id it used before, while the file of
    that id is still on disk (the save that would have removed it failed): the
    file is written again, so a restart loads the copy held, not the old one."""
    state_dir = tmp_path / "node"
    rx = sender("int8", path=state_dir)
    first = own()
    rx.held["p"] = (5, first)
    rx.save()
    rx.held["p"] = (6, {k: v + 1 if v.is_floating_point() else v for k, v in first.items()})
    fill_disk()
    rx.save()  # copy 6 written, the index not: 5's file stays
    monkeypatch.undo()
    again = {k: v + 2 if v.is_floating_point() else v for k, v in first.items()}
    rx.held["p"] = (5, again)  # id 5 once more, other content
    rx.save()
    restarted = sender("int8", path=state_dir)
    assert restarted.held["p"][0] == 5
    assert torch.equal(restarted.held["p"][1]["w"], again["w"])


def test_the_files_tracked_stay_those_of_the_copies_in_use(
    tmp_path: Path, fill_disk: Callable[[], None]
) -> None:
    """Saves that keep failing after the copies are written (a full disk at the
    index) do not make the node hold on to copies no longer in use."""
    fill_disk()
    rx = sender("int8", path=tmp_path / "node")
    for cid in range(1, 41):  # a new copy of p every exchange
        rx.held["p"] = (cid, own())
        rx.save()
        assert len(rx.on_disk) <= len(rx.snapshot())
    assert set(rx.on_disk) == {copy_file_name("held", "p", 40)}


def test_a_reply_that_reuses_the_held_copys_id_is_refused() -> None:
    """An id names one copy, whose file is written once: a reply that names
    its new copy with the id of the copy it started from is refused."""
    tx, rx = sender("int8"), exchange("int8")
    first = serve(tx, "p")
    got, ctx = pull(rx, lambda q: first)
    assert ctx.rejected == [] and rx.held["p"][0] == first["id"]
    second = serve(tx, "p", first["id"])
    assert second["ref"] == first["id"] and second["id"] != first["id"]
    got, ctx = pull(rx, lambda q: {**second, "id": first["id"]})
    assert ctx.rejected == [("p", "compression_malformed")] and got.terms == []
    got, ctx = pull(rx, lambda q: second)  # the honest reply still decodes
    assert ctx.rejected == [] and rx.held["p"][0] == second["id"]


def test_each_copy_is_written_once_and_the_files_of_dropped_copies_go(
    tmp_path: Path, written: list[str]
) -> None:
    """A copy never changes, so it is written when it is made, not after every
    exchange; a copy no longer in use loses its file; the index names the rest."""
    state_dir = tmp_path / "node"
    tx = sender("int8", path=state_dir)
    first = serve(tx, "p")
    tx.save()
    folder = state_dir / "compression.copies"
    assert sorted(written) == sorted(
        [copy_file_name("sent", "p", first["id"]), "compression.safetensors"]
    )
    written.clear()
    second = serve(tx, "p", first["id"])  # keeps the copy it started from, adds one
    tx.save()
    assert sorted(written) == sorted(
        [copy_file_name("sent", "p", second["id"]), "compression.safetensors"]
    )
    assert len(list(folder.iterdir())) == 2
    written.clear()
    third = serve(tx, "p", second["id"])  # the first copy is no longer kept
    tx.save()
    assert written.count("compression.safetensors") == 1 and len(written) == 2
    names = {f.name for f in folder.iterdir()}
    assert names == {copy_file_name("sent", "p", i) for i in (second["id"], third["id"])}
    tx.save()  # nothing new: only the index
    assert written[-1] == "compression.safetensors" and len(written) == 3


def test_a_held_copy_that_does_not_fit_the_model_is_dropped_not_a_crash() -> None:
    """The receiver's copy (from disk) has other shapes: a reply naming it is
    skipped (not counted against the honest peer) and the copy dropped, so the
    next pull asks for a keyframe."""
    rx = exchange("int8")
    rx.held["p"] = (5, {"w": torch.zeros(3), "b": torch.zeros(5), "n": torch.tensor(3)})
    tx = sender("int8")
    first = serve(tx, "p")
    tx.sent["p"][5] = dict(own())  # the sender does hold a good copy 5
    reply = serve(tx, "p", 5)
    assert reply["ref"] == 5
    got, ctx = pull(rx, lambda q: reply)
    assert got.terms == [] and ctx.rejected == []  # my copy's fault, not the peer's
    assert "p" not in rx.held and first["ref"] == 0
    again, ctx = pull(rx, lambda q: tx.serve("p", q))
    assert ctx.queries[-1]["ref"] == 0 and len(again.terms) == 1 and ctx.rejected == []


# ---------------------------------------------------------------------- gradients


def test_a_hostile_compressed_gradient_is_refused_not_a_crash() -> None:
    rx = CompressedGradientExchange(
        compression="int8", keep=2, timeout=1.0, max_norm_ratio=10.0, max_weight_ratio=16.0
    )
    payload = compress_state(own(), parse("int8"))
    for bad, reason in [
        ({**payload, "shape": [1 << 40]}, "shape_mismatch"),
        ({**payload, "scale": torch.full((3,), math.nan)}, "non_finite"),
        ({**payload, "entries": "w"}, "key_mismatch"),
        ([1, 2, 3], "malformed"),
    ]:
        reply = {"round": 1, "step": 0, "batch_size": 8, "format": "int8", "grad": bad}
        ctx = Ctx()
        got = asyncio.run(rx.decoded(ctx, "p", loads(dumps(reply)), OWN))  # type: ignore[arg-type]
        assert got is None and ctx.rejected == [("p", f"compression_{reason}")]


# ---------------------------------------------------------------------- asynchronous


def _async() -> AsyncExchange:
    return AsyncExchange(
        ServedModels(keep=3),
        max_staleness=1,
        timeout=5.0,
        max_norm_ratio=10.0,
        max_weight_ratio=16.0,
        staleness_bound=2,
        staleness_exponent=0.5,
    )


@pytest.mark.parametrize("claimed", [6, 1000, 2**62 - 1])
def test_a_future_round_weighs_no_more_than_an_honest_fresh_model(claimed: int) -> None:
    w = {"w": torch.ones(4)}

    def answer(peer_round: int) -> Callable[[dict[str, Any]], Any]:
        return lambda q: {"round": peer_round, "num_train": 20, "state": w}

    async def weight(peer_round: int) -> float:
        ex = _async()
        ctx = Ctx(answer(peer_round))
        got = await ex.collect(ctx, 5, {"w": torch.full((4,), 0.9)}, 20.0, ["p"], 1)  # type: ignore[arg-type]
        assert ctx.rejected == []
        (term,) = got.terms
        assert got.log["staleness_max"] == 0
        return term.weight

    assert asyncio.run(weight(claimed)) == asyncio.run(weight(5)) == 20.0


# 2^62 and past: a round no node reaches, and one `after` could not name (the
# node would be served that peer's model in full at every pull, and discard it)
@pytest.mark.parametrize("claimed", [-1, -(2**63), True, 5.0, None, 2**62, 2**64 - 1])
def test_a_negative_or_mistyped_round_is_refused(claimed: Any) -> None:
    ex = _async()
    ctx = Ctx(lambda q: {"round": claimed, "num_train": 20, "state": {"w": torch.ones(4)}})
    got = asyncio.run(ex.collect(ctx, 5, {"w": torch.zeros(4)}, 20.0, ["p"], 1))  # type: ignore[arg-type]
    assert got.terms == [] and ctx.rejected == [("p", "model_wrong_round")]


# ---------------------------------------------------------------------- the 32-bit ring


@pytest.mark.parametrize("n", [2, 3, 7, 64])
@pytest.mark.parametrize("share", [1.0, 0.5, 1 / 3])
def test_the_ring_edge_is_accepted_and_one_step_past_it_refused_alike_everywhere(
    n: int, share: float
) -> None:
    """An entry exactly at the limit of a sum of n is masked, one fixed-point
    step past it is refused (out_of_range), and the pre-check `fits_ring` agrees
    with the masking itself at both points (no model passes one and fails the other)."""
    limit = entry_limit(n)
    edge = limit / 2.0**FIXED_POINT_BITS / share
    seed = bytes(32)
    for value, fits in [(edge, True), ((limit + 1) / 2.0**FIXED_POINT_BITS / share, False)]:
        state = {"w": torch.tensor([value, -value], dtype=torch.float64)}
        assert fits_ring(state, share, n) is fits
        if fits:
            masked_input(
                state,
                share,
                me="a",
                self_seed=seed,
                pair_seeds={},
                weight_scale=1.0,
                contributors=n,
            )
        else:
            with pytest.raises(SecAggError) as err:
                masked_input(
                    state,
                    share,
                    me="a",
                    self_seed=seed,
                    pair_seeds={},
                    weight_scale=1.0,
                    contributors=n,
                )
            assert err.value.reason == "out_of_range"
    # n entries at the edge sum without wrapping
    fixed = to_fixed(np.array([limit / 2.0**FIXED_POINT_BITS]), limit=limit)
    total = np.zeros(1, dtype=np.uint32)
    for _ in range(n):
        total += fixed
    assert from_fixed(total)[0] == pytest.approx(n * limit / 2.0**FIXED_POINT_BITS, abs=0)
    with pytest.raises(MaskingError):
        to_fixed(np.array([math.nan]), limit=limit)


# ---------------------------------------------------------------------- slow_train


@pytest.mark.parametrize(
    "plan",
    [
        {"slow_train": 10**400},
        {"slow_train": 1e300},
        {"slow_train": 1e9},
        {"latency_s": 10**400},
        {"partition": [{"from_round": 1e999, "to_round": 2}]},
        {"slow_train": {"factor": 4}},
        {"latency_s": math.nan},
        {"latency_s": math.inf},
        {"latency_s": -1},
    ],
    ids=[
        "huge int",
        "1e300",
        "1e9",
        "latency huge int",
        "partition inf",
        "a map",
        "latency NaN",
        "latency inf",
        "latency negative",
    ],
)
async def test_a_hostile_slow_train_plan_is_refused_and_the_node_goes_on(
    tmp_path: Path, plan: dict[str, Any]
) -> None:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps({"slow_train": 2}))
    fp = FaultPlan(path)
    assert fp.slow_train == 2.0
    path.write_text(json.dumps(plan))
    fp.reload(force=True)  # no exception escapes
    assert fp.slow_train == 2.0 and fp.latency_s == 0.0 and fp.partitions == []
    assert await fp.after_training(1, 0.001) == pytest.approx(0.001)


def test_slow_train_has_an_upper_bound() -> None:
    assert parse_slow_train(100) == 100.0
    for value in (10**400, 1e300, 1e9):
        with pytest.raises(ValueError, match="slow_train"):
            parse_slow_train(value)


@pytest.mark.parametrize(
    "saved",
    [
        {"w": torch.zeros(3), "b": torch.zeros(5)},  # another model's shapes
        {"w": torch.ones(1), "b": torch.zeros(5)},  # would broadcast silently
        {"w": torch.full((20, 31), math.nan), "b": torch.zeros(5)},  # a NaN residual
    ],
    ids=["other shape", "broadcastable", "NaN"],
)
def test_a_residual_from_a_bad_checkpoint_is_dropped_not_a_crash_or_a_wrong_update(
    saved: dict[str, torch.Tensor],
) -> None:
    tx = CompressedGradientExchange(
        compression="int8", keep=2, timeout=1.0, max_norm_ratio=10.0, max_weight_ratio=16.0
    )
    tx.restore_residual(saved)
    payload = tx.feedback.compress(own())
    fresh = CompressedGradientExchange(
        compression="int8", keep=2, timeout=1.0, max_norm_ratio=10.0, max_weight_ratio=16.0
    )
    expected = fresh.feedback.compress(own())  # as with no residual at all
    torch.testing.assert_close(payload["q"], expected["q"])
    torch.testing.assert_close(payload["scale"], expected["scale"])
    assert tx.residual is not None and tx.residual["w"].shape == (20, 31)


def test_a_non_finite_local_gradient_is_served_and_refused_not_a_crash_of_the_sender() -> None:
    """A diverged step's NaN gradient: offered like a plain NaN gradient (each
    receiver refuses it, compression_non_finite), the residual restarts, and the
    next finite step compresses as if fresh."""
    tx = CompressedGradientExchange(
        compression="int8", keep=2, timeout=1.0, max_norm_ratio=10.0, max_weight_ratio=16.0
    )
    tx.feedback.compress(own())
    bad = {**own(), "w": torch.full((20, 31), math.nan)}
    payload = tx.feedback.compress(bad)  # no exception
    assert tx.residual is None
    ctx = Ctx()
    reply = {"round": 1, "step": 0, "batch_size": 8, "format": "int8", "grad": payload}
    assert asyncio.run(tx.decoded(ctx, "p", loads(dumps(reply)), OWN)) is None  # type: ignore[arg-type]
    assert ctx.rejected == [("p", "compression_non_finite")]
    again = tx.feedback.compress(own())
    assert bool(torch.isfinite(again["scale"]).all()) and tx.residual is not None


def test_the_weight_unit_is_bound_to_the_last_bit_and_an_int_is_the_same_unit() -> None:
    """A requester cannot tell two contributors units that differ by one ulp
    (their contexts, hence pair keys, differ); an honest W sent as an int binds
    as the same float."""

    def context(scale: Any) -> bytes:
        request = SessionRequest.model_validate(
            {
                "session": "a" * 32,
                "phase": "advertise",
                "contributors": ["c0", "c1"],
                "round": 1,
                "max_round": 1,
                "purpose": "model",
                "weight_scale": scale,
            }
        )
        return session_context("r", request)

    assert context(16) == context(16.0)
    assert context(16.0) != context(math.nextafter(16.0, math.inf))


def test_a_copies_file_holding_more_than_a_run_keeps_is_trimmed_at_start(tmp_path: Path) -> None:
    """A file with 50 peers x 5 copies (edited, or from a larger roster): the
    node keeps what a run would (two sent and one held per roster member)."""
    big = exchange("int8")

    def small() -> dict[str, torch.Tensor]:
        return {k: v[:1].clone() if v.dim() else v.clone() for k, v in OWN.items()}

    for i in range(50):
        big.sent[f"x{i}"] = {cid: small() for cid in range(1, 6)}
        big.held[f"x{i}"] = (7, small())
    big.path = tmp_path / "compression.safetensors"
    big.save()
    tx = sender("int8", roster=["me", "p", "q"], path=tmp_path)
    assert len(tx.held) <= 3 and len(tx.sent) <= 3
    assert all(len(c) <= 2 for c in tx.sent.values())


def test_copies_that_cannot_be_saved_cost_a_warning_not_the_round(tmp_path: Path) -> None:
    """The state directory is not writable (here: a file where the folder
    should be): the exchange still returns its merged terms."""
    blocked = tmp_path / "state"
    blocked.write_text("a file, not a folder")
    tx = sender("int8")
    rx = exchange("int8")
    got, ctx = pull(rx, lambda q: tx.serve("me", q), path=blocked / "sub")
    assert len(got.terms) == 1 and ctx.rejected == [] and rx.dirty


# A requester's `after` (the round it merged last) in every shape a hostile
# one could send: ignored, and the latest model served, as to any requester.
HOSTILE_AFTER = [
    math.nan,
    math.inf,
    -math.inf,
    -1,
    -(2**63),
    True,
    5.0,
    "9",
    2**62,
    2**63 - 1,
    [],
    {},
    None,
]


@pytest.mark.parametrize("after", HOSTILE_AFTER, ids=[repr(a)[:12] for a in HOSTILE_AFTER])
def test_a_hostile_after_is_ignored_and_the_latest_model_served(after: Any) -> None:
    ex = _async()
    ex.store.put(3, {"w": torch.ones(4)}, 20)
    query = loads(dumps({"round": 5, "max_round": 6, "freshest": True, "after": after}))
    reply = asyncio.run(ex.serve("x", query))
    assert reply["round"] == 3 and reply["state"] is not None


# A neighbour's "not_newer" answer with a round in every shape: skipped and
# counted as already merged (it only withholds its own model), the memory of
# what was merged never corrupted; a valid lower round is a rollback.
NOT_NEWER_ROUNDS = [math.nan, -5, 2**62, "x", None, True, 2.0, [1], 1]


@pytest.mark.parametrize("claimed", NOT_NEWER_ROUNDS, ids=[repr(r)[:12] for r in NOT_NEWER_ROUNDS])
def test_a_hostile_not_newer_answer_is_skipped_and_corrupts_nothing(claimed: Any) -> None:
    ex = _async()
    ex.last_merged["p"] = 3
    ctx = Ctx(lambda q: {"round": claimed, "state": None, "num_train": 0, "reason": "not_newer"})
    got = asyncio.run(ex.collect(ctx, 5, {"w": torch.ones(4)}, 20.0, ["p"], 1))  # type: ignore[arg-type]
    assert got.terms == [] and ctx.rejected == []
    assert got.log["models_already_merged"] == 1
    assert ctx.queries[-1]["after"] == 3
    assert ex.last_merged == {"p": 1 if claimed == 1 and claimed is not True else 3}
