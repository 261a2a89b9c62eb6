"""What a compressed exchange writes to keep its pairs' copies (issue 32).

    python -m bench.copy_writes --out runs/i32/copy_writes
    python -m bench.copy_writes --nodes 2 --rounds 2 --out /tmp/cw   # a smoke run

An in-memory FedAVGP2P federation on the embedded digits (Dirichlet 0.5 label
skew, fraction 0.5, `--compression` int8 by default) with a state directory,
so each node's CompressedExchange saves its copies after every exchange
(protocols/compressed_exchange.py). For every save it counts the bytes
actually written (each new copy's own file and the index) and, as the
baseline in the same run, the bytes of the layout before 2026-11-27: one file
holding every copy in use, rewritten after every exchange (the same
safetensors serialization, computed from the same snapshot). The copies'
size grows with the model, so the ratio is what carries over to resnet18.

Prints one line per round and, last, one JSON object: bytes per node-round
written and of the rewrite-everything layout, their ratio, copy files and
index files written, and the final mean macro-F1. With --out, a plot of both
per round (copy_writes.png) and the JSON (copy_writes.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from safetensors.torch import save as save_safetensors

import protocols.compressed_exchange as exchange_module
from p2pfl.learning.data.partition import partition_dataset
from protocols.memory import InMemoryNetwork, simulate, simulation_configs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.copy_writes", description=__doc__)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--compression", default="int8", help="int8, fp16 or topk:F")
    parser.add_argument("--image-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.rounds < 1:
        parser.error("--nodes must be at least 2 and --rounds at least 1")
    if args.compression == "none":
        parser.error("--compression none keeps no copies: use int8, fp16 or topk:F")
    return args


def legacy_index(fmt: str, copies: list[tuple[str, str, int, Any]]) -> bytes:
    """The one file the layout before 2026-11-27 wrote for this snapshot:
    every copy's tensors and a JSON index of [side, peer, id, entry]."""
    tensors: dict[str, Any] = {}
    index: list[list[Any]] = []
    for side, peer, cid, state in copies:
        for name, value in state.items():
            tensors[f"t{len(index)}"] = value.contiguous()
            index.append([side, peer, cid, name])
    return save_safetensors(tensors, metadata={"format": fmt, "index": json.dumps(index)})


class Counter:
    """Wraps CompressedExchange.write and the module's atomic_write_bytes."""

    def __init__(self) -> None:
        self.written: dict[int, int] = defaultdict(int)  # save number -> bytes
        self.legacy: dict[int, int] = defaultdict(int)
        self.copy_files = 0
        self.index_files = 0
        self.saves = 0
        self._real_write = exchange_module.atomic_write_bytes
        self._real_save = exchange_module.CompressedExchange.write

    def install(self) -> None:
        counter = self

        def write(path: Path | str, data: Any, **kw: Any) -> Path:
            size = len(data) if isinstance(data, bytes | bytearray | memoryview) else 0
            counter.written[counter.saves] += size
            if Path(path).parent.name.endswith(".copies"):
                counter.copy_files += 1
            else:
                counter.index_files += 1
            return counter._real_write(path, data, **kw)

        def save(self: Any, copies: list[tuple[str, str, int, Any]]) -> None:
            counter.saves += 1
            counter.legacy[counter.saves] += len(legacy_index(self.fmt.setting, copies))
            counter._real_save(self, copies)

        exchange_module.atomic_write_bytes = write  # type: ignore[assignment]
        exchange_module.CompressedExchange.write = save  # type: ignore[method-assign]

    def remove(self) -> None:
        exchange_module.atomic_write_bytes = self._real_write  # type: ignore[assignment]
        exchange_module.CompressedExchange.write = self._real_save  # type: ignore[method-assign]


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="copy_writes_"))
    partition_dataset("digits", args.nodes, "dirichlet:0.5", root / "data", seed=args.seed)
    sources = [str(root / "data" / f"site_{i}.npz") for i in range(args.nodes)]
    configs = simulation_configs(
        sources,
        protocol={
            "name": "fedavgp2p",
            "rounds": args.rounds,
            "fraction": args.fraction,
            "compression": args.compression,
        },
        data={"image_size": args.image_size, "augment": "none"},
        training={"epochs": 1, "batch_size": 32, "lr": 3e-3, "device": "cpu"},
        state_root=root / "state",
        seed=args.seed,
    )
    counter = Counter()
    counter.install()
    try:
        network = InMemoryNetwork(inline_train=True, checkpoint_dir=root / "checkpoints")
        result = asyncio.run(simulate(configs, network=network))
    finally:
        counter.remove()
    if result.errors:
        raise SystemExit(f"bench.copy_writes: nodes failed: {result.errors}")
    node_rounds = args.nodes * args.rounds
    written, legacy = sum(counter.written.values()), sum(counter.legacy.values())
    finals = [r["macro_f1"] for r in result.records if r["round"] == args.rounds]
    per_save = [
        (counter.written.get(i, 0), counter.legacy.get(i, 0)) for i in range(1, counter.saves + 1)
    ]
    for i, (w, old) in enumerate(per_save, 1):
        print(f"save {i:3d}: {w:9d} B written, {old:9d} B rewriting every copy")
    return {
        "bench": "copy_writes",
        "nodes": args.nodes,
        "rounds": args.rounds,
        "fraction": args.fraction,
        "compression": args.compression,
        "seed": args.seed,
        "saves": counter.saves,
        "bytes_written_per_node_round": round(written / node_rounds, 1),
        "bytes_rewriting_every_copy_per_node_round": round(legacy / node_rounds, 1),
        "ratio": round(written / legacy, 4) if legacy else None,
        "copy_files_written": counter.copy_files,
        "index_files_written": counter.index_files,
        "macro_f1_final": round(sum(finals) / len(finals), 4) if finals else None,
        "per_save": per_save,
    }


def plot(summary: dict[str, Any], path: Path) -> Path:
    from bench.plots import plt, save

    per_save = summary["per_save"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(1, len(per_save) + 1)
    ax.plot(xs, [old / 1e3 for _, old in per_save], label="every copy rewritten (before)")
    ax.plot(xs, [w / 1e3 for w, _ in per_save], label="new copies and the index (now)")
    ax.set_xlabel("save (one per node and exchange)")
    ax.set_ylabel("kB written")
    ax.set_title(
        f"{summary['compression']}, {summary['nodes']} nodes, {summary['rounds']} rounds: "
        f"{summary['ratio']}x the bytes"
    )
    ax.legend()
    return save(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "copy_writes.json").write_text(json.dumps(summary, indent=1))
        plot(summary, args.out / "copy_writes.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "per_save"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
