"""Compressed exchanges (`protocol.compression`: fp16, int8, topk:F), with error feedback.

Models (`CompressedExchange`, FedAVGP2P, SSFL, FedPerl, Fed-MAE, Fed-BEiT):
each node compresses its model's difference from a copy both ends of a pair
hold, the scheme of CHOCO-gossip's public copies (Koloskova et al. 2019,
"Decentralized stochastic optimization and gossip algorithms with compressed
communication", ICML 2019). Sender j keeps, per requester i, the copies
x_hat_ji that i may hold, each under a random 52-bit id (0: none, the zero
model). A pull names the id of the copy i holds (`ref`). j answers with a new
id and C(x_j - x_hat), x_hat being that copy, or the zero model when j holds
no copy of that id (a restart, a lost reply twice): both ends then start
again from zeros, never from a wrong reference. A top-k reply with no shared
copy is a keyframe in int8 (its 10 % of the raw weights would be a useless
model to merge). Both ends set x_hat_ji = x_hat + decompress(C(...)) with
the same elementwise float32 operations, bit for bit. What C dropped,
x_j - x_hat_ji, stays at the sender and is part of its next difference: that
is the error feedback (Seide et al. 2014; Karimireddy et al. 2019). The
receiver admits and merges the dense x_hat_ji (`checks.admit`, unchanged),
with one exception: a top-k difference refreshes a tenth of the copy, and
the other entries may be rounds old when neighbours are chosen at random;
merging them pulls the model back toward old weights. So the term merged is
the copy where the reply carried an entry (x_j there, up to float16) and,
elsewhere, the node's own value clamped into the band top-k guarantees
around the copy (`topk_term`); the copy itself, the pair's reference, is
kept whole. (In memory, 5 digit sites, dirichlet:0.5, fraction 0.5, 10
rounds, topk:0.1, seeds 0-2: final val macro-F1 0.58-0.76 merging the copy,
0.89-0.92 merging the node's own value unclamped, 0.84-0.94 uncompressed;
the clamp's figures are in docs/benchmarks.md.)

Memory: the sender keeps at most two copies per roster member (the copy the
last reply started from, so that one lost reply does not reset the pair, and
the copy it made), the receiver one per roster member: at most 3 x (N - 1)
models of float32 beside the node's own. They outlive a restart in the state
directory: each copy in a file of its own under `compression.<stage>copies/`,
written once, at the first save after it is made (a copy never changes; a
file whose name a copy of other content takes, as when a peer uses an id
twice, is written again), and an index,
`compression.<stage>safetensors`, rewritten after each exchange, that names
the copies in use (the files of the others are then removed). Rewriting every
copy after every exchange cost up to 3 x (N - 1) models of writes a round, a
resnet18's 45 MB each. An index of before this layout (the copies' tensors in
the index file itself) still loads. A copy lost there only costs its pair a
keyframe (the other pairs keep theirs), and so does one that
does not fit the model (other entries, shapes or dtypes, or not finite: a
corrupt file, a model changed between runs; `fits`): the sender starts that
pair from zeros, the receiver drops it and skips a reply built on it (logged,
not counted against the peer: the fault is its own). A file that does not
load is logged and ignored.

Gradients (`CompressedGradientExchange`, FedSGDP2P): one residual per node,
`compression.ErrorFeedback`: each step's g + e is compressed once and that
payload is served to every puller; the receiver decompresses it (no
reference) and admits it. The residual is kept in FedSGDP2P's checkpoint.

A reply in another format than this node's (`format` field, or a typed map of
another kind) is refused as `compression_mismatch`; a payload that does not
decode, as `compression_<reason>` (protocols/compression.py); a reference id
this node does not hold, as `compression_bad_ref`; a new id equal to the one
it holds (an id names one copy, whose file is written once), as
`compression_malformed`. Each is counted through
`ctx.reject` and the exchange goes on with the other neighbours.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors
from torch import Tensor

from p2pfl.files import atomic_write_bytes
from p2pfl.text import shown
from protocols.base import RoundContext
from protocols.checks import clamp_variances
from protocols.compression import (
    CompressionRefused,
    ErrorFeedback,
    Format,
    add,
    compress_state,
    decode_state,
    dense,
    dense_nbytes,
    parse,
    payload_nbytes,
    split_positions,
    subtract,
    zeros_like,
)
from protocols.exchange import Collected, GradientExchange, PlainExchange, ServedModels

log = logging.getLogger(__name__)

State = dict[str, Tensor]
ID_BITS = 52  # copy ids: exact in a float64 too; a collision is 2^-52 per copy
SIDES = ("sent", "held")
LAYOUT = "files"  # the index's `layout`: each copy in a file of its own


# What reading a copies file (the node's own, but maybe corrupt or edited) can
# raise: each is logged and costs keyframes, never the node.
LOAD_ERRORS = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    RuntimeError,
    ArithmeticError,  # an id of 1e999 in the index
    UnicodeError,
    SafetensorError,  # not a safetensors file: garbage, empty, truncated
)


def read_safetensors(path: Path) -> tuple[dict[str, str], State]:
    """A safetensors file's metadata and tensors, in one read."""
    with safe_open(str(path), framework="pt") as opened:
        keys = opened.keys()  # (a safe_open handle is not iterable)
        return opened.metadata() or {}, {key: opened.get_tensor(key) for key in keys}


def copy_file_name(side: str, peer: str, cid: int) -> str:
    """The file of one copy: its side, a digest of the peer's name (any string
    a roster holds, never a path) and its id."""
    tag = hashlib.sha256(peer.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{side}-{tag}-{int(cid)}.safetensors"


def _copy_id(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << ID_BITS:
        return value
    return None


def fits(copy: State, model: State) -> bool:
    """Whether a copy can be a reference for `model`: the same entries, shapes
    and dtypes, every float entry finite. A copy from disk (a corrupt file, a
    model changed between runs) or one made NaN is otherwise a crash in
    subtract/add, or a pair stuck on replies the checks refuse forever."""
    if copy.keys() != model.keys():
        return False
    for key, value in model.items():
        held = copy[key]
        if not isinstance(held, Tensor) or held.shape != value.shape or held.dtype != value.dtype:
            return False
        if held.is_floating_point() and held.numel() and not bool(torch.isfinite(held).all()):
            return False
    return True


class CompressedExchange(PlainExchange):
    """PlainExchange's pulls with compressed, per-pair differences (module docstring)."""

    def __init__(self, store: ServedModels, *, compression: str, **options: Any) -> None:
        super().__init__(store, **options)
        self.fmt: Format = parse(compression)
        self.sent: OrderedDict[str, dict[int, State]] = OrderedDict()  # requester -> copies
        self.held: OrderedDict[str, tuple[int, State]] = OrderedDict()  # sender -> its copy
        self.roster: Callable[[], list[str]] | None = None  # ctx.roster, set at start
        self.path: Path | None = None
        self.bytes_sent = self.bytes_received = self.dense_received = 0
        self.clamped = self.unsent = 0  # top-k: entries not sent, and those the band moved
        self.count_lock = threading.Lock()
        self.dirty = False  # copies changed since the last save
        # copy file -> the copy it holds (written, or loaded): a name whose copy
        # is another object is written again (an id a peer used twice)
        self.on_disk: dict[str, State] = {}
        self.copies_dir: Path | None = None
        self.pending: dict[str, State] = {}  # peer -> the copy its reply made, until admitted

    # ------------------------------------------------------------------ sender side

    @property
    def limit(self) -> int:
        """Roster members tracked: the roster as it is now. Until a review
        (rv_comp, 2026-11-28) its size at start: a roster grown by a reload
        (SIGHUP) evicted live pairs, so their next replies were refused and
        counted as `compression_bad_ref` against honest peers."""
        return max(1, len(self.roster())) if self.roster is not None else 1 << 16

    def start(self, ctx: RoundContext) -> None:
        self.roster = ctx.roster
        self.path = copies_file(ctx)
        self.copies_dir = copies_file(ctx, "copies")
        self.load()
        super().start(ctx)

    async def serve(self, requester: str, query: dict[str, Any]) -> dict[str, Any]:
        """The model PlainExchange would serve, as the difference from the copy
        `requester` names (`ref`), or from zeros."""
        found = await super().serve(requester, query)
        if found.get("state") is None:
            return found
        ref = _copy_id(query.get("ref")) or 0
        copies = self.sent.get(requester, {})
        base = copies.get(ref) if ref else None
        new_id = secrets.randbits(ID_BITS) or 1
        while new_id == ref:  # an id names one copy only (its file is written once)
            new_id = secrets.randbits(ID_BITS) or 1
        # Not on the node's training thread (ctx.run_blocking): a slower peer's
        # pull must not wait for this node's next round of training.
        payload, x_hat, used = await asyncio.to_thread(self.encode, found["state"], base)
        base = base if used else None  # a copy that does not fit the model: a keyframe
        kept = {new_id: x_hat}
        if base is not None:
            kept[ref] = base
        self.sent[requester] = kept
        self.sent.move_to_end(requester)
        self.dirty = True
        while len(self.sent) > self.limit:
            self.sent.popitem(last=False)
        self.bytes_sent += payload_nbytes(payload)
        return {
            "round": found["round"],
            "num_train": found["num_train"],
            "format": self.fmt.setting,
            "ref": ref if base is not None else 0,
            "id": new_id,
            "state": payload,
        }

    def encode(self, model: State, base: State | None) -> tuple[dict[str, Any], State, bool]:
        """(C(model - base), base + decompress(C(...)), whether `base` was used):
        the reply and the new copy; from zeros if `base` does not fit `model`."""
        if base is not None and not fits(base, model):
            base = None
        keyframe = base is None
        start = zeros_like(model) if base is None else base
        payload = compress_state(subtract(model, start), self.fmt, keyframe)
        return payload, add(start, dense(payload, self.fmt, keyframe)), not keyframe

    # ------------------------------------------------------------------ requester side

    def query(self, peer: str, round_no: int, newest: int) -> dict[str, Any]:
        held = self.held.get(peer)
        return {"round": round_no, "max_round": newest, "ref": held[0] if held else 0}

    async def decoded(
        self, ctx: RoundContext, peer: str, reply: dict[str, Any], reference: State
    ) -> Any:
        """x_hat_ji: the copy the reply started from plus its decoded difference."""
        if reply.get("format") != self.fmt.setting:
            return self.refuse(ctx, peer, "mismatch", f"format {shown(reply.get('format'))}")
        ref, new_id = _copy_id(reply.get("ref")), _copy_id(reply.get("id"))
        if ref is None or not new_id:
            return self.refuse(ctx, peer, "malformed", "ref or id")
        held = self.held.get(peer)
        if ref and (held is None or held[0] != ref):
            return self.refuse(ctx, peer, "bad_ref", f"copy {ref} is not the one held")
        if held is not None and new_id == held[0]:
            # An id names one copy: its file is written once, when it is made. A
            # sender draws a new one for every reply (52 random bits).
            return self.refuse(ctx, peer, "malformed", f"id {new_id} reused")
        base = held[1] if ref and held is not None else None
        if base is not None and not await ctx.run_blocking(fits, base, reference):
            # This node's own copy is bad (a corrupt file, another model): not the
            # peer's fault, so not counted against it; the next pull asks for a keyframe.
            log.warning("%s: my copy %d of %s does not fit the model; dropped", ctx.me, ref, peer)
            self.held.pop(peer, None)
            self.dirty = True
            return None
        try:
            copy, term = await ctx.run_blocking(self.reconstruct, reply["state"], reference, base)
        except CompressionRefused as exc:
            return self.refuse(ctx, peer, exc.reason, str(exc))
        except Exception as exc:  # noqa: BLE001 - a case the checks missed: the peer's, refused
            return self.refuse(ctx, peer, "malformed", f"{type(exc).__name__}: {exc}"[:80])
        self.bytes_received += payload_nbytes(reply["state"])
        self.dense_received += dense_nbytes(reference)
        self.pending[peer] = copy
        return term

    def reconstruct(
        self, payload: Any, reference: State, base: State | None
    ) -> tuple[State, State]:
        """(the pair's new copy x_hat_ji, the term to merge). The term is the
        copy, except for a top-k difference (`topk_term`)."""
        keyframe = base is None
        delta = decode_state(payload, reference, self.fmt, keyframe=keyframe)
        copy = add(zeros_like(reference) if base is None else base, delta)
        # The term's variances at zero at least (the copy, the pair's reference,
        # stays as both ends computed it): a difference's rounding can take an
        # honest variance near zero below it, which `admit` would refuse.
        if keyframe or self.fmt.name != "topk":
            return copy, clamp_variances(copy)
        sent = split_positions(payload, reference)
        term = clamp_variances(topk_term(copy, delta, sent, reference))
        unsent = clamped = 0
        for key, mask in sent.items():  # how often the band moved this node's own value
            unsent += int((~mask).sum())
            clamped += int(((term[key] != reference[key]) & ~mask).sum())
        with self.count_lock:  # replies are reconstructed on worker threads
            self.unsent += unsent
            self.clamped += clamped
        return copy, term

    def refuse(self, ctx: RoundContext, peer: str, reason: str, detail: str) -> None:
        log.warning("%s: compressed model from %s refused (%s)", ctx.me, peer, detail)
        ctx.reject(peer, f"compression_{reason}")
        return None

    def adopt(self, peer: str, reply: dict[str, Any], state: State) -> None:
        copy = self.pending.pop(peer, state)
        # a copy of its own wherever it shares a tensor with the term (all of
        # them, or all but the variances `clamp_variances` raised), whatever the
        # merge does to the term
        if any(copy[k] is state.get(k) for k in copy):
            copy = {k: v.clone() for k, v in copy.items()}
        self.held[peer] = (int(reply["id"]), copy)
        self.held.move_to_end(peer)
        self.dirty = True
        while len(self.held) > self.limit:
            self.held.popitem(last=False)

    async def collect(
        self,
        ctx: RoundContext,
        key: Any,
        own: State,
        own_weight: float,
        ranking: list[str],
        k: int,
    ) -> Collected:
        """PlainExchange's collect; then the copies are saved and the round's
        compressed bytes logged."""
        got = await super().collect(ctx, key, own, own_weight, ranking, k)
        self.pending.clear()  # the copies of replies the checks refused: never adopted
        got.log.update(
            exchange_bytes_sent=float(self.bytes_sent),
            exchange_bytes_received=float(self.bytes_received),
            compression_ratio=self.bytes_received / self.dense_received
            if self.dense_received
            else 1.0,
        )
        if self.fmt.name == "topk":
            got.log["topk_clamped_share"] = self.clamped / self.unsent if self.unsent else 0.0
        self.bytes_sent = self.bytes_received = self.dense_received = 0
        self.clamped = self.unsent = 0
        if self.path is not None and self.dirty:
            await ctx.run_blocking(self.write, self.snapshot())
        return got

    # ------------------------------------------------------------------ persistence

    def save(self) -> None:
        """Every copy to the folder beside `path`, and the index to `path`
        (safetensors: tensors and a JSON index, no pickle)."""
        self.write(self.snapshot())

    def snapshot(self) -> list[tuple[str, str, int, State]]:
        """The copies in use, (side, peer, id, state), taken on the event loop
        (serve and adopt change the maps there; the tensors never change)."""
        self.dirty = False
        copies = [("sent", peer, cid, st) for peer, c in self.sent.items() for cid, st in c.items()]
        copies += [("held", peer, cid, st) for peer, (cid, st) in self.held.items()]
        return copies

    def folder(self) -> Path | None:
        """Where the copies' own files are: `compression.<stage>copies/` (beside
        `path` when only that was given)."""
        if self.copies_dir is not None:
            return self.copies_dir
        return None if self.path is None else self.path.with_name(f"{self.path.stem}.copies")

    def write(self, copies: list[tuple[str, str, int, State]]) -> None:
        """Best effort: a copy not saved costs a keyframe after a restart, so a
        full or read-only disk is logged, not the end of the round. The copies
        not yet on disk first (each at the first save after it is made), then
        the index, then the files of copies no longer in use and temporary
        files a crash left: a crash between two steps leaves an index whose
        files all exist (a file that fails to load costs its pair a keyframe)."""
        folder = self.folder()
        if self.path is None or folder is None:
            return
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            named = [(copy_file_name(side, peer, cid), state) for side, peer, cid, state in copies]
            wanted = {name for name, _ in named}
            # only the copies in use stay referenced here (their files go below)
            self.on_disk = {n: st for n, st in self.on_disk.items() if n in wanted}
            for name, state in named:
                if self.on_disk.get(name) is not state:
                    self.on_disk.pop(name, None)
                    data = {k: v.contiguous() for k, v in state.items()}
                    meta = {"format": self.fmt.setting}
                    atomic_write_bytes(folder / name, save_safetensors(data, metadata=meta))
                    self.on_disk[name] = state
            index = [[side, peer, cid] for side, peer, cid, _ in copies]
            meta = {"format": self.fmt.setting, "layout": LAYOUT, "index": json.dumps(index)}
            atomic_write_bytes(self.path, save_safetensors({}, metadata=meta))
            for stale in [*folder.glob("*.safetensors"), *folder.glob(".*.tmp")]:
                if stale.name not in wanted and stale.is_file():
                    stale.unlink(missing_ok=True)
        except (OSError, RuntimeError, SafetensorError) as exc:
            self.dirty = True  # tried again after the next exchange
            log.warning("compressed exchange: copies not saved to %s (%s)", self.path, exc)

    def load(self) -> None:
        """The copies of the last save, if they are of this format; else none
        (every pair starts from a keyframe)."""
        if self.path is None or not self.path.exists():
            return
        sent: dict[str, dict[int, State]] = {}
        held: dict[str, dict[int, State]] = {}
        on_disk: dict[str, State] = {}
        try:
            meta, tensors = read_safetensors(self.path)
            if meta.get("format") != self.fmt.setting:
                return
            entries = json.loads(meta["index"])
            if not isinstance(entries, list):
                raise ValueError("the index is not a list")
            if meta.get("layout") == LAYOUT:
                folder = self.folder()
                failed: list[str] = []
                for entry in entries if folder is not None else []:
                    loaded = self._load_copy(folder, entry)
                    if isinstance(loaded, str):
                        failed.append(loaded)  # that pair starts from a keyframe
                        continue
                    side, peer, cid, state, name = loaded
                    (sent if side == "sent" else held).setdefault(peer, {})[cid] = state
                    on_disk[name] = state
                if failed:  # one line, however many (an edited index may name thousands)
                    log.warning(
                        "compressed exchange: %d copies in %s not loaded (%s)",
                        len(failed),
                        folder,
                        failed[0],
                    )
            else:  # before the files' layout: every copy's tensors in this file
                for i, (side, peer, cid, name) in enumerate(entries):
                    target = sent if side == "sent" else held
                    target.setdefault(str(peer), {}).setdefault(int(cid), {})[str(name)] = tensors[
                        f"t{i}"
                    ]
        except LOAD_ERRORS as exc:
            log.warning("compressed exchange: copies in %s not loaded (%s)", self.path, exc)
            return
        # As many as a run keeps (two sent, one held per roster member), whatever
        # the file holds; a copy that does not fit the model is refused at use.
        self.sent = OrderedDict((p, dict(list(c.items())[-2:])) for p, c in sent.items())
        self.held = OrderedDict((p, next(iter(c.items()))) for p, c in held.items() if c)
        for copies in (self.sent, self.held):
            while len(copies) > self.limit:
                copies.popitem(last=False)
        self.on_disk = on_disk

    def _load_copy(self, folder: Path, entry: Any) -> tuple[str, str, int, State, str] | str:
        """(side, peer, id, copy, file name) of one index entry, or why not
        when the entry is malformed or its file does not load."""
        try:
            side, peer, cid = entry
            if side not in SIDES or not isinstance(peer, str) or type(cid) is not int:
                raise ValueError(f"index entry {str(entry)[:80]}")
            name = copy_file_name(side, peer, cid)
            meta, state = read_safetensors(folder / name)
            if meta.get("format") != self.fmt.setting:
                raise ValueError(f"{name} is of another format")
            return side, peer, cid, state, name
        except LOAD_ERRORS as exc:
            return f"{type(exc).__name__}: {exc}"[:160]


def topk_term(copy: State, delta: State, sent: dict[str, Tensor], own: State) -> State:
    """What a node merges for a top-k reply: the copy where the reply carried
    an entry; elsewhere its own value, clamped to within tau of the copy.

    Top-k keeps the entries of largest |x_j - x_hat| in each tensor, so an
    entry it did not send differs from the sender's model x_j by at most tau,
    the smallest |difference| it did send in that tensor (up to float16's
    rounding and its clamp at 65504; decode_state refuses a reply with no
    value sent in a tensor). Within that band the receiver cannot tell x_j
    apart, and keeps its own value, which is the newer one (the copy may be
    rounds old). Outside it, its own value is certainly not the sender's, and
    the clamp moves it to the nearest value that is. Without the clamp, a
    small site whose weights are far from its neighbours' kept 90 % of them
    for the whole run (issue 32, seed 1)."""
    term = dict(copy)
    for key, mask in sent.items():
        if bool(mask.all()):
            continue
        tau = delta[key][mask].abs().min()
        near = torch.minimum(torch.maximum(own[key], copy[key] - tau), copy[key] + tau)
        term[key] = torch.where(mask, copy[key], near.to(copy[key].dtype))
    return term


def copies_file(ctx: RoundContext, kind: str = "safetensors") -> Path | None:
    """Where the pairs' copies outlive a restart: the index (`safetensors`) or
    the copies' folder (`copies`); None for a simulated node with no storage
    (a stage's exchange has its own)."""
    stage = getattr(ctx, "prefix", "")
    try:
        return ctx.durable_file(f"compression.{stage}{kind}")
    except (RuntimeError, OSError):
        return None


class CompressedGradientExchange(GradientExchange):
    """GradientExchange with each step's gradient compressed once, with error
    feedback, and the same payload served to every puller."""

    def __init__(self, *, compression: str, **options: Any) -> None:
        super().__init__(**options)
        self.fmt: Format = parse(compression)
        self.feedback = ErrorFeedback(self.fmt)
        self.bytes_offered = self.bytes_received = self.dense_received = 0

    def offer(self, ctx: RoundContext, key: Any, state: State, weight: float) -> None:
        payload = self.feedback.compress(state)
        self.bytes_offered += payload_nbytes(payload)
        super().offer(ctx, key, payload, weight)
        self.served[tuple(key)]["format"] = self.fmt.setting

    def round_log(self) -> dict[str, float]:
        """This round's compressed bytes (offered once per step, received) and
        their share of the same gradients in float32; then the counts restart."""
        out = {
            "exchange_bytes_offered": float(self.bytes_offered),
            "exchange_bytes_received": float(self.bytes_received),
            "compression_ratio": self.bytes_received / self.dense_received
            if self.dense_received
            else 1.0,
        }
        self.bytes_offered = self.bytes_received = self.dense_received = 0
        return out

    def decode(self, payload: Any, reference: State) -> State:
        out = decode_state(payload, reference, self.fmt)
        self.bytes_received += payload_nbytes(payload)
        self.dense_received += dense_nbytes(reference)
        return out

    async def decoded(
        self, ctx: RoundContext, peer: str, reply: dict[str, Any], reference: State
    ) -> Any:
        if reply.get("format") != self.fmt.setting:
            fmt = shown(reply.get("format"))
            log.warning("%s: gradient from %s in format %s", ctx.me, peer, fmt)
            ctx.reject(peer, "compression_mismatch")
            return None
        try:
            return await ctx.run_blocking(self.decode, reply["grad"], reference)
        except CompressionRefused as exc:
            log.warning("%s: compressed gradient from %s refused (%s)", ctx.me, peer, exc)
            ctx.reject(peer, f"compression_{exc.reason}")
            return None
        except Exception as exc:  # noqa: BLE001 - a case the checks missed: the peer's, refused
            log.warning("%s: compressed gradient from %s refused (%r)", ctx.me, peer, exc)
            ctx.reject(peer, "compression_malformed")
            return None

    @property
    def residual(self) -> dict[str, Tensor] | None:
        return self.feedback.residual

    def restore_residual(self, saved: Any) -> None:
        """The residual of a checkpoint (ignored unless a map of float tensors)."""
        if isinstance(saved, dict) and all(
            isinstance(v, Tensor) and v.is_floating_point() for v in saved.values()
        ):
            self.feedback.residual = {k: v.to(torch.float32) for k, v in saved.items()}


async def relayed_model(
    ctx: RoundContext, sender: str, payload: dict[str, Any], reference: State, fmt: Format
) -> State | None:
    """FedER's relayed model compressed with no shared reference (a keyframe,
    no error feedback: each hop rounds afresh) as a dense state in `reference`'s
    dtypes for `admit`, or None: refused and counted as `compression_<reason>`."""
    try:
        if not isinstance(payload, dict):
            raise CompressionRefused("malformed", "not a map")
        if payload.get("compression") != fmt.setting:
            raise CompressionRefused("mismatch", f"format {shown(payload.get('compression'))}")
        delta = await ctx.run_blocking(decode_state, payload.get("model"), reference, fmt, True)
        return add(zeros_like(reference), delta)
    except CompressionRefused as exc:
        log.warning("%s: compressed relay from %s refused (%s)", ctx.me, sender, exc)
        ctx.reject(sender, f"compression_{exc.reason}")
        return None
    except Exception as exc:  # noqa: BLE001 - a case the checks missed: the sender's, refused
        log.warning("%s: compressed relay from %s refused (%r)", ctx.me, sender, exc)
        ctx.reject(sender, "compression_malformed")
        return None
