"""Typed errors of the genbuffer package, each with a stable reason code."""

from __future__ import annotations

from p2pfl.errors import UserError


class GenbufferError(UserError):
    """Something a person can fix (missing weights file, bad checkpoint, bad buffer).

    `reason` is a short stable code for logs and tests; `str()` is a one-line
    message that says what is wrong and how to fix it.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class LpipsBackboneMissing(GenbufferError):
    """The ImageNet backbone under LPIPS is not on disk (we never download it)."""

    def __init__(self, message: str) -> None:
        super().__init__("lpips_backbone_missing", message)


class CheckpointError(GenbufferError):
    """A generator or training-state file is missing, unreadable or of another format."""


class SyntheticBufferError(GenbufferError):
    """A synthetic buffer that does not match its schema or its content hash."""
