"""What a long GAN training tells the operator while it runs.

On a CPU, a FedER site's two-stage training takes minutes to hours; before this,
a node logged "training the genbuffer GAN on 908 images" and then nothing. A
`TrainingProgress` is a `train_generator` progress callback that logs one line
at the first iteration of every stage, then every `every_s` seconds and at the
stage's end: stage, iteration / most iterations, the losses, the latest quality
score and an ETA. The same line, shortened and without the quality score, goes
to `on_phase`, which the FedER node shows as its phase on /status and the
dashboard, and which its heartbeats carry to every roster member.

The ETA is for the stage's most iterations (stage 1 may stop earlier, on
patience), at the speed measured in this stage by this process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("genbuffer.train")

STAGE_NAMES = {
    "stage1": "stage 1 (no privacy loss)",
    "stage2": "stage 2 (privacy loss)",
    "reference": "reference (no privacy loss, for the audit)",
}


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class TrainingProgress:
    """A `ProgressFn` (genbuffer.train) that logs and reports a phase line, throttled."""

    def __init__(
        self,
        on_phase: Callable[[str], None] | None = None,
        *,
        every_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.on_phase = on_phase
        self.every_s = every_s
        self.clock = clock
        self._stage: str | None = None
        self._stage_start = (0.0, 0)  # clock, iteration at this process's first step of the stage
        self._last_report = -float("inf")
        self.last_line = ""

    def __call__(self, phase: str, done: int, total: int, stats: dict[str, float]) -> None:
        now = self.clock()
        first = phase != self._stage
        if first:
            self._stage = phase
            self._stage_start = (now, done - 1)
        if not (first or done >= total or now - self._last_report >= self.every_s):
            return
        self._last_report = now
        started_at, started_done = self._stage_start
        steps = done - started_done
        rate = steps / (now - started_at) if now > started_at and steps > 0 else None
        eta = format_seconds((total - done) / rate) if rate else "?"
        losses = ", ".join(
            f"{k} {stats[k]:.3f}" for k in ("loss_g", "loss_d", "loss_pp", "ada_p") if k in stats
        )
        quality = stats.get("quality")
        quality_text = f"{quality:.4f}" if quality is not None else "not yet scored"
        speed = f"{rate:.2f} it/s" if rate else "? it/s"
        log.info(
            "genbuffer GAN %s: iteration %d/%d, %s, quality %s, %s, ETA %s",
            STAGE_NAMES.get(phase, phase),
            done,
            total,
            losses or "no losses yet",
            quality_text,
            speed,
            eta,
        )
        # the phase goes to every roster member in heartbeats: the quality score, a
        # figure measured on this site's own images, stays in the log
        self.last_line = f"generator: {phase} {done}/{total}, ETA {eta}"
        if self.on_phase is not None:
            self.on_phase(self.last_line)
