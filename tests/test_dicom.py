"""DICOM (.dcm) images: value mapping, refusals, privacy and ImageFolder trees."""

from __future__ import annotations

import logging
import subprocess
import sys
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.pixels import convert_color_space, get_decoder
from pydicom.uid import (
    ExplicitVRLittleEndian,
    JPEGLosslessSV1,
    SecondaryCaptureImageStorage,
    generate_uid,
)

from p2pfl.learning.data.dicom import read_dicom
from p2pfl.learning.data.sources import DataError, read_source

SECRETS = ("Doe^Jane", "Doe", "Jane", "SECRET123", "19700101", "St Elsewhere", "ACC999")


def _dataset(pixels: np.ndarray, photometric: str, bits_stored: int | None = None) -> FileDataset:
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset("x.dcm", Dataset(), file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.Modality = "OT"
    ds.PatientName = "Doe^Jane"
    ds.PatientID = "SECRET123"
    ds.PatientBirthDate = "19700101"
    ds.InstitutionName = "St Elsewhere"
    ds.AccessionNumber = "ACC999"
    bits = bits_stored or pixels.dtype.itemsize * 8
    ds.set_pixel_data(pixels, photometric, bits, generate_instance_uid=False)
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    return ds


def _write(
    path: Path,
    pixels: np.ndarray,
    photometric: str = "MONOCHROME2",
    bits_stored: int | None = None,
    **attributes: object,
) -> Path:
    ds = _dataset(pixels, photometric, bits_stored)
    for keyword, value in attributes.items():
        setattr(ds, keyword, value)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def _refusal(path: Path) -> DataError:
    with pytest.raises(DataError) as caught:
        read_dicom(path)
    message = str(caught.value)
    assert message.startswith(str(path)), message
    assert "\n" not in message
    return caught.value


def _refusal_and_peak(path: Path) -> tuple[DataError, int]:
    """`_refusal(path)`, and the peak of the memory Python allocated meanwhile."""
    tracemalloc.start()
    try:
        error = _refusal(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return error, peak


def _write_garbage(path: Path) -> Path:
    path.write_bytes(b"\0" * 128 + b"DICM" + b"Doe^Jane SECRET123" * 8)
    return path


def _assert_private(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked into {text!r}"


# ---------------------------------------------------------------------- greyscale


def test_monochrome2_min_max_maps_to_full_range(tmp_path: Path) -> None:
    pixels = np.array([[100, 300], [500, 1100]], dtype=np.uint16)
    image = read_dicom(_write(tmp_path / "a.dcm", pixels))
    assert image.dtype == np.uint8 and image.shape == (2, 2, 1)
    # (v - 100) / 1000 * 255: 100 -> 0, 300 -> 51, 500 -> 102, 1100 -> 255
    assert image[..., 0].tolist() == [[0, 51], [102, 255]]


def test_constant_image_gives_zeros(tmp_path: Path) -> None:
    image = read_dicom(_write(tmp_path / "c.dcm", np.full((3, 4), 777, dtype=np.uint16)))
    assert image.shape == (3, 4, 1) and not image.any()


def _linear_window(x: float, center: float, width: float) -> int:
    """DICOM PS3.3 C.11.2.1.2.1 LINEAR window onto 0..255, written out by hand."""
    if x <= center - 0.5 - (width - 1) / 2:
        return 0
    if x > center - 0.5 + (width - 1) / 2:
        return 255
    return round(((x - (center - 0.5)) / (width - 1) + 0.5) * 255)


def test_rescale_then_window_in_rescaled_units(tmp_path: Path) -> None:
    # Stored s -> HU = 2 s - 1000; window 40/400 in HU: below -160 black, above 239 white.
    stored = np.array([[0, 420, 480], [520, 560, 620]], dtype=np.uint16)
    path = _write(
        tmp_path / "ct.dcm",
        stored,
        bits_stored=12,
        RescaleSlope=2,
        RescaleIntercept=-1000,
        WindowCenter=40,
        WindowWidth=400,
    )
    image = read_dicom(path)[..., 0]
    hounsfield = 2.0 * stored - 1000  # [[-1000, -160, -40], [40, 120, 240]]
    expected = [[_linear_window(x, 40, 400) for x in row] for row in hounsfield]
    assert expected == [[0, 0, 77], [128, 179, 255]]
    assert image.tolist() == expected


def test_window_center_width(tmp_path: Path) -> None:
    stored = np.array([[0, 900, 950], [1000, 1100, 65535]], dtype=np.uint16)
    path = _write(tmp_path / "w.dcm", stored, WindowCenter=1000, WindowWidth=200)
    image = read_dicom(path)[..., 0]
    assert image[0, 0] == 0 and image[0, 1] == 0  # below the window
    assert image[1, 1] == 255 and image[1, 2] == 255  # above the window
    assert abs(int(image[1, 0]) - 128) <= 1  # the centre
    assert image[0, 2] == _linear_window(950, 1000, 200) == 64


def test_signed_pixels_without_window_use_min_max(tmp_path: Path) -> None:
    pixels = np.array([[-500, 0], [500, 1500]], dtype=np.int16)
    image = read_dicom(_write(tmp_path / "s.dcm", pixels))[..., 0]
    # (v + 500) / 2000 * 255
    assert image.tolist() == [[0, 64], [128, 255]]


def test_monochrome1_is_inverted(tmp_path: Path) -> None:
    pixels = np.array([[100, 300], [500, 1100]], dtype=np.uint16)
    mono2 = read_dicom(_write(tmp_path / "m2.dcm", pixels, "MONOCHROME2"))
    mono1 = read_dicom(_write(tmp_path / "m1.dcm", pixels, "MONOCHROME1"))
    assert mono1[..., 0].tolist() == [[255, 204], [153, 0]]
    np.testing.assert_array_equal(mono1, 255 - mono2)


# ---------------------------------------------------------------------- colour


COLOURS = np.array(
    [[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [255, 255, 255]], [[10, 20, 30], [0, 0, 0]]],
    dtype=np.uint8,
)


def test_rgb_gives_three_channels(tmp_path: Path) -> None:
    image = read_dicom(_write(tmp_path / "rgb.dcm", COLOURS, "RGB"))
    assert image.dtype == np.uint8 and image.shape == (3, 2, 3)
    np.testing.assert_array_equal(image, COLOURS)


def test_ybr_full_is_converted_to_rgb(tmp_path: Path) -> None:
    ybr = convert_color_space(COLOURS, "RGB", "YBR_FULL")
    image = read_dicom(_write(tmp_path / "ybr.dcm", ybr, "YBR_FULL"))
    assert image.shape == (3, 2, 3)
    assert np.abs(image.astype(int) - COLOURS.astype(int)).max() <= 2


# ---------------------------------------------------------------------- refusals


def test_multi_frame_refused(tmp_path: Path) -> None:
    frames = np.zeros((2, 4, 4), dtype=np.uint8)
    error = _refusal(_write(tmp_path / "mf.dcm", frames))
    assert error.reason == "multi_frame"
    assert "2 frames" in str(error) and "export one frame per file" in str(error)


def test_random_bytes_refused_as_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "x.dcm"
    path.write_bytes(np.random.default_rng(7).integers(0, 256, 512, dtype=np.uint8).tobytes())
    error = _refusal(path)
    assert error.reason == "corrupt_image" and "not a DICOM image" in str(error)


def test_palette_colour_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.dcm"
    ds = _dataset(np.zeros((4, 4), dtype=np.uint8), "MONOCHROME2")
    ds.PhotometricInterpretation = "PALETTE COLOR"
    ds.save_as(path, enforce_file_format=True)
    error = _refusal(path)
    assert error.reason == "unsupported_dicom" and "PALETTE COLOR" in str(error)


def test_no_pixel_data_refused(tmp_path: Path) -> None:
    ds = _dataset(np.zeros((4, 4), dtype=np.uint8), "MONOCHROME2")
    del ds.PixelData
    path = tmp_path / "report.dcm"
    ds.save_as(path, enforce_file_format=True)
    error = _refusal(path)
    assert error.reason == "corrupt_image" and "no pixel data" in str(error)


def test_a_header_declaring_a_huge_image_is_refused_before_decoding(tmp_path: Path) -> None:
    """A 1.3 kB RLE file whose Rows and Columns say 60000 x 60000 had pydicom's
    decoder allocate 7.6 GB before it failed (a review). The size a header
    declares is refused before any decoder runs; here 10000 x 10000 (100 M
    pixels, over MAX_IMAGE_PIXELS), which the decoder used to allocate too."""
    from pydicom.uid import RLELossless

    ds = _dataset(np.zeros((16, 16), dtype=np.uint16), "MONOCHROME2")
    ds.compress(RLELossless)
    ds.Rows = ds.Columns = 10_000
    path = tmp_path / "bomb.dcm"
    ds.save_as(path, enforce_file_format=True)
    error, peak = _refusal_and_peak(path)
    assert error.reason == "image_too_large", error
    assert peak < 20_000_000, peak  # no pixel buffer of the declared size


def test_a_deflated_dataset_is_refused_before_it_is_inflated_past_any_image(
    tmp_path: Path,
) -> None:
    """The pixel limit is read from Rows and Columns, after pydicom has read the
    dataset; a Deflated Explicit VR file is inflated whole by pydicom first, so a
    600 kB file of 10 x 10 pixels whose pixel data inflates to 600 MB took
    gigabytes before any check (a review: 1.7 GB from 390 kB, at deflate's
    1000-fold). Its inflated size is now counted as it streams, in bounded
    memory, and one larger than any image the limit allows is refused; an
    honest deflated image still reads."""
    import zlib

    from pydicom.uid import DeflatedExplicitVRLittleEndian

    pixels = np.arange(100, dtype=np.uint16).reshape(10, 10)
    ds = _dataset(pixels, "MONOCHROME2")
    ds.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    honest = tmp_path / "honest.dcm"
    ds.save_as(honest, enforce_file_format=True)
    assert np.array_equal(read_dicom(honest), read_dicom(_write(tmp_path / "plain.dcm", pixels)))

    raw = honest.read_bytes()
    start = 144 + int.from_bytes(raw[140:144], "little")  # after the file meta group
    dataset = zlib.decompress(raw[start:], -zlib.MAX_WBITS)
    assert dataset[-212:-200] == b"\xe0\x7f\x10\x00OW\x00\x00" + (200).to_bytes(4, "little")
    size = 600_000_000
    deflater = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    body = [deflater.compress(dataset[:-208] + size.to_bytes(4, "little"))]
    zeros = bytes(1 << 20)
    body += [deflater.compress(zeros) for _ in range(size >> 20)]
    body += [deflater.compress(bytes(size - (size >> 20 << 20))), deflater.flush()]
    bomb = tmp_path / "bomb.dcm"
    bomb.write_bytes(raw[:start] + b"".join(body))
    assert bomb.stat().st_size < 1_000_000
    error, peak = _refusal_and_peak(bomb)
    assert error.reason == "image_too_large", error
    assert peak < 20_000_000, peak


def test_pixel_data_far_longer_than_declared_is_refused_before_decoding(tmp_path: Path) -> None:
    """Pixel data of many frames' length behind Rows x Columns of one (and no
    Number of Frames) was decoded as that many frames, then refused for its
    shape: 40 MB behind 10 x 10 pixels took 200 MB and more of copies first
    (a deflated one, 400 MB, 1.7 GB). Uncompressed pixel data twice as long as
    the one frame declared, or longer, is refused before it is decoded; one
    padded by a few bytes still reads."""
    pixels = np.arange(100, dtype=np.uint16).reshape(10, 10)
    padded = _dataset(pixels, "MONOCHROME2")
    padded.PixelData = pixels.tobytes() + b"\0" * 8
    padded.save_as(tmp_path / "padded.dcm", enforce_file_format=True)
    assert np.array_equal(
        read_dicom(tmp_path / "padded.dcm"), read_dicom(_write(tmp_path / "plain.dcm", pixels))
    )
    size = 40_000_000
    ds = _dataset(pixels, "MONOCHROME2")
    ds.PixelData = bytes(size)
    path = tmp_path / "long.dcm"
    ds.save_as(path, enforce_file_format=True)
    del ds
    error, peak = _refusal_and_peak(path)
    assert error.reason == "corrupt_image" and "twice" in str(error), error
    assert peak < 1.5 * size, peak


@pytest.mark.skipif(get_decoder(JPEGLosslessSV1).is_available, reason="decoder installed")
def test_missing_decoder_names_the_plugin(tmp_path: Path) -> None:
    ds = _dataset(np.zeros((4, 4), dtype=np.uint8), "MONOCHROME2")
    ds.file_meta.TransferSyntaxUID = JPEGLosslessSV1
    ds.PixelData = encapsulate([b"\xff\xd8not-really-jpeg\xff\xd9"])
    path = tmp_path / "jpeg.dcm"
    ds.save_as(path, enforce_file_format=True)
    error = _refusal(path)
    assert error.reason == "corrupt_image"
    assert "pylibjpeg" in str(error) and "JPEG Lossless" in str(error)


def test_force_only_for_dcm_suffix(tmp_path: Path) -> None:
    ds = _dataset(np.array([[0, 10], [20, 30]], dtype=np.uint8), "MONOCHROME2")
    ds.preamble = None
    ds.file_meta = FileMetaDataset()
    raw = tmp_path / "raw.dcm"  # a bare dataset: no preamble, no DICM, no file meta
    ds.save_as(raw, enforce_file_format=False, implicit_vr=True, little_endian=True)
    assert b"DICM" not in raw.read_bytes()
    assert read_dicom(raw)[..., 0].tolist() == [[0, 85], [170, 255]]
    other = tmp_path / "raw.img"
    other.write_bytes(raw.read_bytes())
    assert _refusal(other).reason == "corrupt_image"


# ---------------------------------------------------------------------- privacy


def test_no_patient_metadata_in_messages_logs_or_output(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    builders: list[Callable[[Path], Path]] = [
        lambda p: _write(p, np.zeros((2, 3, 3), dtype=np.uint8)),  # multi-frame
        lambda p: _write(p, np.zeros((2, 2), dtype=np.uint16), WindowCenter=1, WindowWidth=0),
        _write_garbage,
    ]
    messages = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, build in enumerate(builders):
            path = build(tmp_path / f"bad{i}.dcm")
            messages.append(str(_refusal(path)))
        image = read_dicom(_write(tmp_path / "ok.dcm", np.arange(6, dtype=np.uint16).reshape(2, 3)))
    assert image.dtype == np.uint8 and isinstance(image, np.ndarray)
    assert image[..., 0].tolist() == [[0, 51, 102], [153, 204, 255]]
    for text in [*messages, *(r.getMessage() for r in caplog.records)]:
        _assert_private(text)
    for warning in caught:
        _assert_private(str(warning.message))
    assert not caplog.records and not caught  # nothing logged or warned at all


# ---------------------------------------------------------------------- sources


def test_image_folder_mixes_dicom_and_png(tmp_path: Path) -> None:
    ct = [np.array([[0, 1000], [2000, 4000]], dtype=np.uint16), np.eye(2, dtype=np.uint16)]
    for i, pixels in enumerate(ct):
        _write(tmp_path / "train" / "ct" / f"{i}.dcm", pixels)
    photos = [np.array([[1, 2], [3, 4]], dtype=np.uint8), np.full((2, 2), 9, dtype=np.uint8)]
    (tmp_path / "train" / "photo").mkdir(parents=True)
    for i, pixels in enumerate(photos):
        Image.fromarray(pixels, mode="L").save(tmp_path / "train" / "photo" / f"{i}.png")
    raw = read_source(tmp_path)
    assert raw.class_names == ["ct", "photo"]
    assert raw.train_labels.tolist() == [0, 0, 1, 1]
    assert raw.train_images.shape == (4, 2, 2, 1) and raw.train_images.dtype == np.uint8
    assert raw.train_images[0, ..., 0].tolist() == [[0, 64], [128, 255]]
    assert raw.train_images[1, ..., 0].tolist() == [[255, 0], [0, 255]]
    assert raw.train_images[2, ..., 0].tolist() == photos[0].tolist()
    assert raw.train_images[3, ..., 0].tolist() == photos[1].tolist()


def test_importing_sources_does_not_import_pydicom() -> None:
    # Load sources.py on its own (the package __init__ pulls in torch, which is slow).
    sources = Path(__file__).parents[1] / "p2pfl" / "learning" / "data" / "sources.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('probe', {str(sources)!r})\n"
        "module = sys.modules['probe'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert '.dcm' in module.IMAGE_SUFFIXES\n"
        "assert 'pydicom' not in sys.modules, 'sources.py imported pydicom'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
