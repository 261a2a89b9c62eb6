"""What the 32-bit ring of secure aggregation costs and saves, on real models
(protocols/masking.py): no processes, the masking arithmetic alone.

For each model (small_cnn, resnet18 by default; states of the real
architectures, one per contributor from its own seed, BatchNorm statistics
drawn as training leaves them), n contributors with sample counts
100, 137, 174, ... mask their models as Round 2 does (`masked_input`: self
mask and a pair mask with every other contributor) and the requester unmasks
the sum (`unmask_sum`). Reported, per weight unit W:

- the error of the secure weighted mean against the float64 weighted mean
  (max and RMS over every entry) and the bound it must stay under,
  (n * 2^-21 / sum(w/W)) * (1 + |mean|) per entry (both the weighted sum and
  the sum of the weights are rounded); W = 16 x the smallest count (max_weight_ratio's default, no
  roster caps) and W = the largest count (a roster cap that fits);
- the bytes of one masked input on the wire (`tensors.dumps`) against the
  float32 model's;
- the time to mask one input and to unmask the sum, and the time of the
  ChaCha20 keystream per entry at 4 bytes (the ring) and at 8 bytes (the
  64-bit ring before), one stream of the model's size each.

    python -m bench.secagg_ring --models small_cnn resnet18 --contributors 4

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from p2pfl.config import ModelSection
from p2pfl.learning.site_model import create_site_model
from p2pfl.learning.state import averaged_keys
from p2pfl.secure import tensors
from protocols import masking
from protocols.secagg_primitives import mask_seed, masked_input, unmask_sum
from protocols.secagg_requester import DEFAULT_WEIGHT_RATIO


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=["small_cnn", "resnet18"])
    p.add_argument("--contributors", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def model_state(name: str, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = create_site_model(ModelSection(name=name), in_chans=1, num_classes=2, image_size=28)
    for module in model.modules():  # statistics as training leaves them, not the init's 0/1
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            assert module.running_mean is not None and module.running_var is not None
            module.running_mean.normal_(0.0, 0.5)
            module.running_var.uniform_(0.05, 3.0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def keystream_seconds(numel: int, entry_bytes: int) -> float:
    """One ChaCha20 keystream of numel entries of entry_bytes (best of 3)."""
    zeros = bytes(numel * entry_bytes)
    out = bytearray(numel * entry_bytes + 16)
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        enc = Cipher(algorithms.ChaCha20(b"k" * 32, b"\0" * 16), mode=None).encryptor()
        enc.update_into(zeros, out)
        best = min(best, time.perf_counter() - started)
    return best


def one_model(name: str, n: int, seed: int) -> dict[str, Any]:
    members = [f"c{i}" for i in range(n)]
    states = {m: model_state(name, seed * 100 + i) for i, m in enumerate(members)}
    weights = {m: 100.0 + 37.0 * i for i, m in enumerate(members)}
    keys = averaged_keys(states[members[0]])
    numel = sum(states[members[0]][k].numel() for k in keys)
    total = sum(weights.values())
    exact = {k: sum(weights[m] * states[m][k].double() for m in members) / total for k in keys}
    private = {m: X25519PrivateKey.generate() for m in members}
    public = {m: k.public_key().public_bytes_raw() for m, k in private.items()}
    self_seeds = {m: os.urandom(32) for m in members}
    out: dict[str, Any] = {
        "model": name,
        "contributors": n,
        "entries": numel,
        "weights": list(weights.values()),
    }
    units = {
        "W=16x_smallest": DEFAULT_WEIGHT_RATIO * min(weights.values()),
        "W=largest": max(weights.values()),
    }
    for label, scale in units.items():
        masked = {}
        mask_s = []
        for me in members:
            pairs = {
                v: mask_seed(private[me], public[v], b"bench", me, v) for v in members if v != me
            }
            started = time.perf_counter()
            masked[me] = masked_input(
                states[me],
                weights[me],
                me=me,
                self_seed=self_seeds[me],
                pair_seeds=pairs,
                weight_scale=scale,
                contributors=n,
            )
            mask_s.append(time.perf_counter() - started)
        reference = {k: v.double() for k, v in states[members[0]].items()}
        started = time.perf_counter()
        mean, got_total = unmask_sum(
            masked, self_seeds, {}, public, b"bench", reference, weight_scale=scale
        )
        unmask_s = time.perf_counter() - started
        errors = torch.cat([(mean[k] - exact[k]).abs().reshape(-1) for k in keys])
        shares = sum(weights[m] / scale for m in members)
        # sum w/W x and sum w/W each off by at most n half-steps: the mean by
        # (n * 2^-21 / sum w/W) * (1 + |mean|)
        step = n * 2.0 ** -(masking.FIXED_POINT_BITS + 1) / shares
        bounds = torch.cat([(step * (1 + exact[k].abs())).reshape(-1) for k in keys])
        row = {
            "weight_scale": scale,
            "max_abs_error": float(errors.max()),
            "rms_error": float(errors.square().mean().sqrt()),
            "max_abs_entry": float(torch.cat([exact[k].abs().reshape(-1) for k in keys]).max()),
            "bound_at_zero": step,
            "worst_error_over_bound": float((errors / bounds).max()),
            "total_weight": got_total,
            "total_weight_error": abs(got_total - total),
            "mask_s_mean": round(sum(mask_s) / len(mask_s), 4),
            "unmask_s": round(unmask_s, 4),
        }
        row["within_bound"] = row["worst_error_over_bound"] <= 1.0
        out[label] = row
    plain = len(tensors.dumps({k: states[members[0]][k].float() for k in keys}))
    wire = len(tensors.dumps(masked[members[0]]))
    out["bytes_float32_model"] = plain
    out["bytes_masked_input"] = wire
    out["bytes_ratio"] = round(wire / plain, 5)
    out["bytes_ratio_64bit_ring"] = round((8 * numel + 8) / (4 * numel), 5)  # what it was
    ring32, ring64 = keystream_seconds(numel, 4), keystream_seconds(numel, 8)
    out["keystream_s_32bit"] = round(ring32, 4)
    out["keystream_s_64bit"] = round(ring64, 4)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        row = one_model(name, args.contributors, args.seed)
        sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()
        rows.append(row)
    result = {
        "bench": "secagg_ring",
        "seed": args.seed,
        "rows": rows,
        "ok": all(r[u]["within_bound"] for r in rows for u in ("W=16x_smallest", "W=largest")),
    }
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
