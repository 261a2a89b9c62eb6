"""From a trained federation to predictions on new files: export, then predict.

    python -m bench.export_roundtrip --data digits|FILE.npz [--nodes 3] [--rounds 3]
                                     [--seed 0] [--out DIR]

Trains a federation of real `p2pfl-node` processes (FedAVGP2P, the federation
benchmark's defaults), then for every site: `p2pfl-node export` of its best
model in each format (safetensors, ONNX, TorchScript), `p2pfl-node predict` of
its test split (the site's own .npz, so exactly its test images) with the torch
and the ONNX runtimes, and the node's own evaluation of the same split
(LocalSite, the code that scores a round). Figures per site and overall: the
share of images whose predicted class equals the node's own (target 1.0), the
largest |p_onnx - p_torch| (target <= 1e-4) and |p_torch - p_node|. The last
stdout line is one JSON object; DIR/export_roundtrip.json keeps it.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.federation.processes import run_processes
from bench.federation.specs import RunSpec, partition
from p2pfl.files import atomic_write_text

FORMATS = ("safetensors", "onnx", "torchscript")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, timeout=600
    )


def probabilities(path: Path, classes: list[str]) -> tuple[list[str], np.ndarray]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return [r["prediction"] for r in rows], np.array([[float(r[c]) for c in classes] for r in rows])


def one_site(config: Path, source: Path, out: Path) -> dict[str, Any]:
    from node.evaluate import latest_model
    from p2pfl.config.site import load_config
    from p2pfl.learning.train import LocalSite

    package = out / "package"
    done = cli(
        "export",
        "--config",
        str(config),
        "--which",
        "best",
        "--out",
        str(package),
        "--format",
        *FORMATS,
    )
    if done.returncode != 0:
        raise SystemExit(f"export failed for {config}: {done.stderr.strip()[-500:]}")
    exported = json.loads(done.stdout.strip().splitlines()[-1])
    meta = json.loads((package / "model.json").read_text())
    classes = meta["classes"]

    cfg = load_config(config, check_files=False)
    site = LocalSite.from_config(cfg)
    site.load_state_dict(latest_model(cfg, config, "best"))
    x, _ = site.data.test.tensors
    node_p = site.predict_proba(x).numpy()
    node_classes = [classes[i] for i in node_p.argmax(1)]

    with np.load(source) as arrays:
        images = arrays["test_images"]
    np.savez(out / "test.npz", images=images)
    figures: dict[str, Any] = {"site": cfg.node.name, "test_images": len(images)}
    runtimes: dict[str, np.ndarray] = {}
    for runtime in ("torch", "onnx"):
        target = out / f"predict_{runtime}.csv"
        started = time.perf_counter()
        done = cli(
            "predict",
            "--model",
            str(package),
            str(out / "test.npz"),
            "--csv",
            str(target),
            "--runtime",
            runtime,
        )
        if done.returncode != 0:
            raise SystemExit(f"predict failed for {config}: {done.stderr.strip()[-500:]}")
        predicted, runtimes[runtime] = probabilities(target, classes)
        figures[f"same_class_{runtime}"] = float(
            np.mean([a == b for a, b in zip(predicted, node_classes, strict=True)])
        )
        figures[f"predict_s_{runtime}"] = round(time.perf_counter() - started, 2)
    figures["max_abs_onnx_vs_torch"] = float(np.abs(runtimes["onnx"] - runtimes["torch"]).max())
    figures["max_abs_torch_vs_node"] = float(np.abs(runtimes["torch"] - node_p).max())
    figures["export_check_max_abs_diff"] = exported["max_abs_diff"]
    figures["test_macro_f1"] = exported.get("test_macro_f1")
    figures["test_ece"] = exported.get("test_ece")
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.export_roundtrip", description=__doc__.splitlines()[0]
    )
    p.add_argument("--data", default="digits")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--partition", default="iid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/export_roundtrip"))
    args = p.parse_args(argv)
    started = time.perf_counter()
    spec = RunSpec(
        nodes=args.nodes,
        rounds=args.rounds,
        data=args.data,
        partition=args.partition,
        seed=args.seed,
        fraction=1.0,
    )
    sources, _ = partition(spec, args.out / "data")
    outcome = run_processes(spec, args.out / "fed", sources)
    if outcome.failure or outcome.timed_out:
        print(json.dumps({"bench": "export_roundtrip", "ok": False, "failure": outcome.failure}))
        return 1
    sites = []
    for i, source in enumerate(sources):
        config = args.out / "fed" / f"site_{i}" / "site.yaml"
        sites.append(one_site(config, source, args.out / f"site_{i}"))
        print(f"    {json.dumps(sites[-1])}", flush=True)
    summary = {
        "bench": "export_roundtrip",
        "data": args.data,
        "nodes": args.nodes,
        "rounds": args.rounds,
        "formats": list(FORMATS),
        "test_images": sum(s["test_images"] for s in sites),
        "same_class_torch": min(s["same_class_torch"] for s in sites),
        "same_class_onnx": min(s["same_class_onnx"] for s in sites),
        "max_abs_onnx_vs_torch": max(s["max_abs_onnx_vs_torch"] for s in sites),
        "max_abs_torch_vs_node": max(s["max_abs_torch_vs_node"] for s in sites),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    summary["ok"] = bool(
        summary["same_class_torch"] == 1.0
        and summary["same_class_onnx"] == 1.0
        and summary["max_abs_onnx_vs_torch"] <= 1e-4
    )
    atomic_write_text(
        args.out / "export_roundtrip.json",
        json.dumps({"sites": sites, "summary": summary}, indent=2) + "\n",
    )
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
