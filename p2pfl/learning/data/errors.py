"""The data sources' error (its own module: readers of single formats, such as
dicom.py, raise it without importing sources.py)."""

from __future__ import annotations


class DataError(Exception):
    """A data source that cannot be used; `reason` is a stable code, `str()` names the
    file and the fix."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
