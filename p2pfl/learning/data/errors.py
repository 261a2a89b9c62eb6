"""The data sources' error (its own module: readers of single formats, such as
dicom.py, raise it without importing sources.py)."""

from __future__ import annotations

# The most pixels (rows x columns x frames) a reader decodes from one file: Pillow's
# own decompression-bomb threshold (Image.MAX_IMAGE_PIXELS). A header declares the
# size before any pixel is read, so a 1 kB file could otherwise claim 60000 x 60000
# and have a decoder allocate gigabytes (a review's RLE DICOM of 1.3 kB took 7.6 GB).
MAX_IMAGE_PIXELS = 89_478_485


class DataError(Exception):
    """A data source that cannot be used; `reason` is a stable code, `str()` names the
    file and the fix."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
