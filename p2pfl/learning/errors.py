"""The error local learning raises when a request cannot be served."""

from __future__ import annotations


class TrainingError(Exception):
    """A training/evaluation request that cannot be served; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
