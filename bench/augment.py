"""What augmentation costs next to a training step, measured in one run.

    python -m bench.augment [--steps 300] [--batch-size 32] [--image-size 28] [--threads 1]

Times, interleaved round-robin so every figure sees the same machine load:
- step: one training step of the default small CNN (forward, backward, Adam
  step) on a batch of --batch-size grey images at --image-size px, on CPU;
- weak, strong: the batched views of p2pfl.learning.data.augment of that batch;
- weak_torchvision, strong_torchvision: the same views computed image by image
  with torchvision.transforms.v2, as the module did before (the "before" path,
  kept here as the reference).
Prints a table with the medians and, as its last line, one JSON object:
step_ms, <view>_ms, <view>_overhead (= view / step), and `pass`
(weak_overhead <= 0.15, the target of issue 17).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from p2pfl.config import ModelSection, TrainingSection
from p2pfl.learning.data.augment import strong_augment_batch, weak_augment_batch
from p2pfl.learning.optimizer import build_optimizer
from p2pfl.learning.site_model import create_site_model

TARGET = 0.15


def torchvision_views() -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """The per-image torchvision path the batched module replaced."""
    from torchvision.transforms import v2

    weak = v2.Compose(
        [v2.RandomHorizontalFlip(p=0.5), v2.RandomAffine(degrees=10, translate=(0.1, 0.1))]
    )
    rand = v2.RandAugment(num_ops=2, magnitude=9)

    def weak_batch(x: torch.Tensor) -> torch.Tensor:
        unit = (x * 0.5 + 0.5).clamp(0, 1)
        return (torch.stack([weak(im) for im in unit]) - 0.5) / 0.5

    def strong_batch(x: torch.Tensor) -> torch.Tensor:
        unit = (x * 0.5 + 0.5).clamp(0, 1)
        views = [
            rand((weak(im) * 255).round().clamp(0, 255).to(torch.uint8)).float() / 255
            for im in unit
        ]
        return (torch.stack(views) - 0.5) / 0.5

    return weak_batch, strong_batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.augment", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=300, help="repetitions of each timed piece")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.steps < 5 or args.batch_size < 2 or args.image_size < 8:
        parser.error("--steps >= 5, --batch-size >= 2 and --image-size >= 8")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = create_site_model(ModelSection(), in_chans=1, num_classes=2, image_size=args.image_size)
    optimizer = build_optimizer(model, TrainingSection())
    x = torch.rand(args.batch_size, 1, args.image_size, args.image_size) * 2 - 1
    y = torch.randint(0, 2, (args.batch_size,))
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    tv_weak, tv_strong = torchvision_views()
    pieces: dict[str, Callable[[], object]] = {
        "step": step,
        "weak": lambda: weak_augment_batch(x),
        "strong": lambda: strong_augment_batch(x),
        "weak_torchvision": lambda: tv_weak(x),
        "strong_torchvision": lambda: tv_strong(x),
    }
    for fn in pieces.values():  # warm-up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for i in range(args.steps):
        for name, fn in pieces.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        if (i + 1) % max(1, args.steps // 5) == 0:
            print(f"  {i + 1}/{args.steps} repetitions", flush=True)
    ms = {name: statistics.median(t) * 1000 for name, t in times.items()}
    result: dict[str, object] = {
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "threads": args.threads,
        "repetitions": args.steps,
        "step_ms": round(ms["step"], 3),
    }
    print(f"{'piece':<20}{'median ms':>10}{'/ step':>9}")
    for name, value in ms.items():
        print(f"{name:<20}{value:>10.3f}{value / ms['step']:>9.3f}")
        if name != "step":
            result[f"{name}_ms"] = round(value, 3)
            result[f"{name}_overhead"] = round(value / ms["step"], 4)
    result["pass"] = ms["weak"] / ms["step"] <= TARGET
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
