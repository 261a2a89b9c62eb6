"""Read one DICOM (.dcm) image as native-size uint8 pixels H,W,C.

Greyscale (MONOCHROME1/2) goes through the modality LUT (Rescale Slope/Intercept or a
Modality LUT Sequence), then the VOI LUT or Window Center/Width when the file has one,
and is mapped linearly onto 0..255; MONOCHROME1 is inverted so that brighter means
higher, as in MONOCHROME2. Colour (RGB, YBR_*) comes back as RGB.

Privacy: messages name the file and at most technical pixel-format values (frame
count, photometric interpretation, transfer syntax); never a patient, study or
institution attribute. pydicom's own warnings and log records are silenced while a
file is read, as they may quote header values. Nothing is logged on success.
"""

from __future__ import annotations

import logging
import string
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from p2pfl.learning.data.errors import MAX_IMAGE_PIXELS, DataError

if TYPE_CHECKING:
    from pydicom.dataset import Dataset

MONOCHROME = ("MONOCHROME1", "MONOCHROME2")
# YBR_FULL/YBR_FULL_422 are converted to RGB by pydicom's decoders (as_rgb, the default);
# YBR_ICT/YBR_RCT (JPEG 2000) are returned as RGB by the JPEG 2000 decoders.
COLOUR = ("RGB", "YBR_FULL", "YBR_FULL_422", "YBR_ICT", "YBR_RCT")
PIXEL_KEYWORDS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")
_PRINTABLE = set(string.ascii_letters + string.digits + " .,:;()[]_-^/+=")


def _error(reason: str, message: str) -> Exception:
    return DataError(reason, message)


def _safe(value: object) -> str:
    """A technical header value, reduced to one short printable line."""
    text = "".join(c for c in str(value).strip() if c in _PRINTABLE)
    return text[:64] or "?"


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextmanager
def _silenced() -> Iterator[None]:
    """Drop pydicom's warnings and log records (they may quote header values)."""
    drop = _DropAll()
    manager = logging.Logger.manager
    loggers = [logging.getLogger("pydicom")] + [
        logger
        for name, logger in list(manager.loggerDict.items())
        if name.startswith("pydicom.") and isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


# The most bytes a Deflated Explicit VR dataset may inflate to: the pixel data of
# the largest image MAX_IMAGE_PIXELS allows (3 samples of 16 bits) and 1 MiB of
# attributes. pydicom inflates such a dataset whole before any attribute can be
# checked, and deflate expands up to about 1000-fold.
MAX_INFLATED_BYTES = 6 * MAX_IMAGE_PIXELS + (1 << 20)


def _check_inflated_size(path: Path) -> None:
    """Refuse a Deflated Explicit VR file whose dataset inflates past
    MAX_INFLATED_BYTES, counted as it streams (never held); any other file, or
    one whose file meta cannot be read, is left to dcmread."""
    import zlib

    from pydicom.filereader import _read_file_meta_info, read_preamble
    from pydicom.uid import DeflatedExplicitVRLittleEndian

    try:
        fp = open(path, "rb")  # noqa: SIM115 - closed below, on every path
    except OSError:
        return  # dcmread says why
    with fp:
        try:
            read_preamble(fp, False)
            syntax = _read_file_meta_info(fp).get("TransferSyntaxUID")
        except Exception:  # noqa: BLE001 - not a file with a DICM header: dcmread says why
            return
        if syntax != DeflatedExplicitVRLittleEndian:
            return
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        total = 0
        while chunk := fp.read(1 << 16):
            while chunk:
                try:
                    total += len(inflater.decompress(chunk, 1 << 20))
                except zlib.error:
                    return  # damaged: dcmread says so
                if total > MAX_INFLATED_BYTES:
                    raise _error(
                        "image_too_large",
                        f"{path}: its deflated dataset inflates past {MAX_INFLATED_BYTES} "
                        "bytes, more than any image of at most "
                        f"{MAX_IMAGE_PIXELS} pixels — replace or re-export the file",
                    )
                chunk = inflater.unconsumed_tail


def _read_dataset(path: Path) -> tuple[Dataset, bool]:
    """The dataset, and whether it was read without a DICM header (force=True)."""
    import pydicom
    from pydicom.errors import InvalidDicomError
    from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

    _check_inflated_size(path)
    forced = False
    try:
        try:
            ds = pydicom.dcmread(path)
        except InvalidDicomError:
            if path.suffix.lower() != ".dcm":
                raise
            forced = True
            ds = pydicom.dcmread(path, force=True)  # no DICM preamble: a raw .dcm dataset
    except Exception as exc:  # noqa: BLE001 - a damaged file fails in many ways
        raise _error(
            "corrupt_image",
            f"{path}: cannot read as DICOM ({type(exc).__name__}) — replace or remove the file",
        ) from None
    if "TransferSyntaxUID" not in ds.file_meta:
        implicit, little = ds.original_encoding
        if implicit is None or little is None:
            raise _error(
                "corrupt_image",
                f"{path}: not a DICOM file (no transfer syntax) — replace or remove the file",
            )
        ds.file_meta.TransferSyntaxUID = (
            ImplicitVRLittleEndian
            if implicit
            else ExplicitVRLittleEndian
            if little
            else ExplicitVRBigEndian
        )
    return ds, forced


def _check_format(ds: Dataset, path: Path, forced: bool) -> str:
    """Refuse what cannot become one image; return the photometric interpretation."""
    from pydicom.pixels import get_decoder

    if not any(keyword in ds for keyword in PIXEL_KEYWORDS):
        if forced:
            raise _error(
                "corrupt_image",
                f"{path}: not a DICOM image (no DICM header, no pixel data found) — "
                "replace or remove the file",
            )
        raise _error(
            "corrupt_image",
            f"{path}: DICOM file has no pixel data — remove it (only image files can be used)",
        )
    try:
        frames = int(ds.get("NumberOfFrames") or 1)
    except (TypeError, ValueError):
        raise _error(
            "corrupt_image",
            f"{path}: unreadable Number of Frames — replace or remove the file",
        ) from None
    if frames > 1:
        raise _error(
            "multi_frame",
            f"{path}: DICOM file has {frames} frames; export one frame per file",
        )
    try:
        pixels = int(ds.get("Rows") or 0) * int(ds.get("Columns") or 0)
    except (TypeError, ValueError):
        raise _error(
            "corrupt_image", f"{path}: unreadable Rows or Columns — replace or remove the file"
        ) from None
    if pixels > MAX_IMAGE_PIXELS:  # before a decoder allocates what the header declares
        raise _error(
            "image_too_large",
            f"{path}: the image declares more than {MAX_IMAGE_PIXELS} pixels — "
            "downscale it or split it into tiles",
        )
    _check_pixel_length(ds, path, pixels)
    photometric = str(ds.get("PhotometricInterpretation") or "").strip().upper()
    if not photometric:
        raise _error(
            "corrupt_image",
            f"{path}: DICOM file has no Photometric Interpretation — replace or remove the file",
        )
    if photometric not in MONOCHROME + COLOUR:
        raise _error(
            "unsupported_dicom",
            f"{path}: photometric interpretation {_safe(photometric)} is not supported — "
            "export the image as MONOCHROME2 or RGB",
        )
    syntax = ds.file_meta.TransferSyntaxUID
    try:
        compressed = bool(syntax.is_compressed)
    except (AttributeError, ValueError):  # not a transfer syntax pydicom knows
        compressed = True
    if compressed:
        try:
            decoder = get_decoder(syntax)
        except (NotImplementedError, ValueError):
            raise _error(
                "corrupt_image",
                f"{path}: transfer syntax {_safe(syntax.name)} cannot be decoded — "
                "re-export the file uncompressed",
            ) from None
        if not decoder.is_available:
            codec = "pylibjpeg-openjpeg" if "2000" in syntax.name else "pylibjpeg-libjpeg"
            raise _error(
                "corrupt_image",
                f"{path}: compressed transfer syntax {_safe(syntax.name)} needs a decoder "
                f"plugin — install one (pip install pylibjpeg {codec}, or gdcm) "
                "or re-export the file uncompressed",
            )
    return photometric


def _check_pixel_length(ds: Dataset, path: Path, pixels: int) -> None:
    """Refuse uncompressed pixel data at least twice one frame's length: pydicom
    decoded it as that many frames (copies of all of it) before its shape was
    refused. A few bytes of padding are a frame still."""
    data = ds.get("PixelData")
    try:
        encapsulated = bool(ds.file_meta.TransferSyntaxUID.is_encapsulated)
    except (AttributeError, ValueError):  # not a transfer syntax pydicom knows
        return
    if encapsulated or not isinstance(data, bytes):
        return
    try:
        bits = int(ds.get("BitsAllocated") or 0) * int(ds.get("SamplesPerPixel") or 1)
    except (TypeError, ValueError):
        return  # the decoder says what is wrong
    frame = (pixels * bits + 7) // 8
    if frame and len(data) >= 2 * frame:
        raise _error(
            "corrupt_image",
            f"{path}: DICOM pixel data of {len(data)} bytes is at least twice the "
            f"{frame} bytes of the one frame Rows x Columns declare — replace or "
            "re-export the file",
        )


def _stored_range(ds: Dataset) -> tuple[float, float]:
    bits = int(ds.BitsStored)
    if int(ds.get("PixelRepresentation") or 0) == 0:
        return 0.0, float(2**bits - 1)
    return float(-(2 ** (bits - 1))), float(2 ** (bits - 1) - 1)


def _to_uint8(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """Map low..high linearly onto 0..255 (all zeros when the range is empty)."""
    if not high > low:
        return np.zeros(values.shape, dtype=np.uint8)
    scaled = (values.astype(np.float64) - low) / (high - low) * 255.0
    return np.rint(scaled).clip(0, 255).astype(np.uint8)


def _has_voi_lut(ds: Dataset) -> bool:
    sequence = ds.get("VOILUTSequence")
    return bool(sequence) and None not in (
        sequence[0].get("LUTDescriptor"),
        sequence[0].get("LUTData"),
    )


def _grey(ds: Dataset, pixels: np.ndarray) -> np.ndarray:
    from pydicom.pixels import apply_modality_lut, apply_voi_lut

    values: Any = apply_modality_lut(pixels, ds)
    has_window = ds.get("WindowCenter") is not None and ds.get("WindowWidth") is not None
    if _has_voi_lut(ds):
        # apply_voi_lut prefers the VOI LUT Sequence: its output spans the LUT's bit depth.
        bits = int(ds.VOILUTSequence[0].LUTDescriptor[2])
        return _to_uint8(apply_voi_lut(values, ds), 0.0, float(2**bits - 1))
    if has_window:
        # The window maps onto the stored range (BitsStored/PixelRepresentation, after any
        # rescale); ask pydicom for the ends of that range with values far outside the window.
        ends = apply_voi_lut(np.array([-1e300, 1e300]), ds)
        return _to_uint8(apply_voi_lut(values, ds), float(ends[0]), float(ends[1]))
    values = np.asarray(values, dtype=np.float64)
    return _to_uint8(values, float(values.min()), float(values.max()))


def read_dicom(path: Path) -> np.ndarray:
    """One single-frame DICOM image as uint8 H,W,C (C=1 for greyscale, 3 for colour)."""
    path = Path(path)
    with _silenced():
        ds, forced = _read_dataset(path)
        photometric = _check_format(ds, path, forced)
        try:
            pixels = np.asarray(ds.pixel_array)
        except Exception as exc:  # noqa: BLE001 - decoders fail in many ways on bad data
            raise _error(
                "corrupt_image",
                f"{path}: cannot decode the DICOM pixel data ({type(exc).__name__}) — "
                "replace or re-export the file",
            ) from None
        expected_ndim = 2 if photometric in MONOCHROME else 3
        if pixels.ndim != expected_ndim or (expected_ndim == 3 and pixels.shape[2] != 3):
            raise _error(
                "corrupt_image",
                f"{path}: DICOM pixel data has shape {pixels.shape}, which does not match "
                f"{photometric} — replace or re-export the file",
            )
        if photometric not in MONOCHROME:
            if pixels.dtype == np.uint8:
                return np.ascontiguousarray(pixels)
            return _to_uint8(pixels, *_stored_range(ds))
        try:
            grey = _grey(ds, pixels)
        except Exception as exc:  # noqa: BLE001 - malformed LUT/window attributes
            raise _error(
                "unsupported_dicom",
                f"{path}: cannot apply the modality/VOI LUT or window ({type(exc).__name__}) "
                "— fix or remove the Rescale, Window and LUT attributes",
            ) from None
        if photometric == "MONOCHROME1":
            grey = 255 - grey
        return grey[..., None]
