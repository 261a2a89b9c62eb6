"""A trained model as a package another program can run, and the reader that runs it.

A package is a directory:

    model.json         architecture (name and arguments), input (size, channels,
                       resizing, normalisation), class names, and each model
                       file with its SHA-256
    model.safetensors  the weights (safetensors: no code, no pickle)
    model.onnx         the network with a softmax on its output (onnxruntime)
    model.pt           TorchScript of the same (for torch programs; run it only
                       if it came from your own site: it is code)
    model_card.md/json what it was trained on and how well it does (node/export.py)

`Predictor` reads a package (safetensors with torch, or ONNX with onnxruntime),
checks each file's hash against model.json before it trusts a byte of it, and
applies exactly the preprocessing training used: resize to the training size
(bilinear, antialiased when shrinking), convert channels, scale to [0, 1],
normalise with mean 0.5 and std 0.5 (`p2pfl.learning.data.loaders`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from p2pfl.errors import UserError
from p2pfl.files import PUBLIC_FILE, atomic_write_text
from p2pfl.learning.data.loaders import MEAN, STD, convert_images, to_float_tensor
from p2pfl.learning.data.sources import UInt8Images

FORMAT_VERSION = 1
MODEL_JSON = "model.json"
FILES = {"safetensors": "model.safetensors", "onnx": "model.onnx", "torchscript": "model.pt"}
FORMATS = tuple(FILES)
Runtime = Literal["auto", "torch", "onnx"]
ONNX_TOLERANCE = 1e-4  # largest |p_onnx - p_torch| an export accepts
Runner = Callable[[Tensor], np.ndarray]  # preprocessed N,C,H,W -> N x classes probabilities
MAX_MODEL_JSON = 1 << 20  # bytes: a description with its class names
MAX_ONNX = (1 << 31) - 1  # bytes: protobuf's limit on one message, weights inside
IMAGE_SIZES = (8, 1024)  # data.image_size's range (p2pfl.config)
CHANNELS = (1, 3, 4)  # what convert_images makes


class ExportError(UserError):
    """A model that cannot be exported or a package that cannot be used; one line."""


@dataclass(frozen=True)
class Architecture:
    name: str
    in_chans: int
    num_classes: int
    image_size: int

    def build(self) -> nn.Module:
        from p2pfl.learning.models import create_model

        return create_model(
            self.name,
            in_chans=self.in_chans,
            num_classes=self.num_classes,
            image_size=self.image_size,
        )


class WithSoftmax(nn.Module):
    """The exported network: class probabilities, not logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return torch.softmax(self.model(x).float(), dim=1)


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def torch_runner(net: nn.Module) -> Runner:
    """A module that outputs probabilities (`WithSoftmax`, or TorchScript of it)."""
    net.eval()

    def run(x: Tensor) -> np.ndarray:
        with torch.no_grad():
            return net(x).numpy()

    return run


def onnx_runner(model: Path | bytes, where: str = "model.onnx") -> Runner:
    """onnxruntime on a model file, or on its bytes (what `Predictor` hashed);
    `where` names it in errors."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ExportError("ONNX needs onnxruntime: pip install onnxruntime") from None
    source = model if isinstance(model, bytes) else str(model)
    options = ort.SessionOptions()
    options.log_severity_level = 4  # its errors come back as exceptions, said in one line
    try:
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types for a bad graph
        raise ExportError(f"{where}: onnxruntime cannot load it ({_first_line(exc)})") from None
    names = [i.name for i in session.get_inputs()]
    if names != ["image"]:
        raise ExportError(
            f"{where}: its inputs are {names!r:.100}, not the one named 'image' export writes"
        )

    def run(x: Tensor) -> np.ndarray:
        return np.asarray(session.run(None, {"image": x.numpy()})[0])

    return run


def _first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, at most 200 characters."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def safetensors_model(arch: Architecture, path: Path, data: bytes | None = None) -> WithSoftmax:
    """The network model.json describes, with the weights of `path` (strict): from
    `data`, the file's bytes as they were hashed, when given."""
    from p2pfl.learning.models import ModelError, load_state, load_weights

    try:
        if data is None:
            return WithSoftmax(load_weights(arch.build(), path))
        from safetensors.torch import load

        try:
            state = load(data)
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for bad bytes
            raise ExportError(f"{path}: cannot read weights ({_first_line(exc)})") from None
        return WithSoftmax(load_state(arch.build(), state, path))
    except ModelError as exc:
        raise ExportError(str(exc)) from None


def input_description(image_size: int, channels: int) -> dict[str, Any]:
    return {
        "layout": "N,C,H,W float32",
        "image_size": image_size,
        "channels": channels,
        "resize": "bilinear to image_size x image_size, antialiased when shrinking",
        "channels_from": "1: luminance (ITU-R 601-2) of colour images; 3: grey repeated",
        "scale": "pixel / 255",
        "normalise": {"mean": MEAN, "std": STD},
    }


def write_package(
    out: Path,
    state: dict[str, Tensor],
    arch: Architecture,
    class_names: Sequence[str],
    formats: Sequence[str],
    check_images: Tensor,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the model in each of `formats` and model.json; every file is read
    back and checked against the torch model on `check_images` (N,C,H,W, already
    preprocessed) before model.json names it. Returns model.json's content."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ExportError(f"unknown format {unknown[0]!r}: choose from {', '.join(FORMATS)}")
    if len(class_names) != arch.num_classes:
        raise ExportError(
            f"the model has {arch.num_classes} outputs but the site has {len(class_names)} classes"
        )
    model = arch.build()
    refusals: dict[str, str] = getattr(model, "export_refusals", {})
    for fmt in formats:  # before anything is written: no half package
        if fmt in refusals:
            others = " ".join(f for f in FORMATS if f not in refusals)
            raise ExportError(f"{fmt}: {arch.name} {refusals[fmt]}; export it as --format {others}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ExportError(
            f"the checkpoint's model does not fit {arch.name} ({first}); "
            "export needs a model that `model.name` builds (Fed-MAE classifiers and "
            "Siamese models are not exportable yet)"
        ) from None
    net = WithSoftmax(model).eval()
    with torch.no_grad():
        reference = net(check_images).numpy()
    _check_out(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on its path: a traceback before
        raise ExportError(f"--out {out}: cannot be made a folder ({exc.strerror})") from None
    # Each file is written and checked in a private folder of this call's own,
    # and only then renamed over its name (a link at the name is replaced, never
    # written through: a review's model.json link had an unrelated file
    # overwritten), PUBLIC_FILE whatever the umask. An earlier package is left
    # whole until every new file is checked (a failed export removed its
    # model.json first: the working package lost), then its model.json goes
    # first: a crash among the renames leaves no description naming files this
    # one replaced, a folder predict refuses, never a mixed package.
    files: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=out, prefix=".export-") as scratch:
        for fmt in formats:
            path = Path(scratch) / FILES[fmt]
            run = _WRITERS[fmt](net, path, check_images, arch)
            gap = float(np.abs(run(check_images) - reference).max()) if len(reference) else 0.0
            if gap > ONNX_TOLERANCE:
                raise ExportError(
                    f"{fmt}: read back, its probabilities differ from torch's by {gap:.2e} "
                    f"(> {ONNX_TOLERANCE}); the export was removed"
                )
            files[fmt] = {"file": path.name, "sha256": sha256_of(path), "max_abs_diff": gap}
        (out / MODEL_JSON).unlink(missing_ok=True)
        for fmt in FORMATS:  # an earlier export's file of a format not asked for now goes
            (out / FILES[fmt]).unlink(missing_ok=True)
        for fmt in formats:
            os.chmod(Path(scratch) / FILES[fmt], PUBLIC_FILE)
            os.replace(Path(scratch) / FILES[fmt], out / FILES[fmt])
    description = {
        "format_version": FORMAT_VERSION,
        "architecture": {
            "name": arch.name,
            "in_chans": arch.in_chans,
            "num_classes": arch.num_classes,
            "image_size": arch.image_size,
        },
        "input": input_description(arch.image_size, arch.in_chans),
        "output": "class probabilities (softmax), one per class, in `classes` order",
        "classes": list(class_names),
        "files": files,
        **(extra or {}),
    }
    atomic_write_text(out / MODEL_JSON, json.dumps(description, indent=2) + "\n", mode=PUBLIC_FILE)
    return description


# what `export` writes into --out: a folder holding anything else is not overwritten
PACKAGE_FILES = frozenset(
    [MODEL_JSON, *FILES.values(), "model.onnx.data", "model_card.md", "model_card.json"]
)


def _check_out(out: Path) -> None:
    """Refuse an --out that is not a folder, or one holding files a package does
    not: an export replaces an earlier package, never a folder's other files."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a folder — choose a new folder")
    if not out.is_dir():
        return
    others = []
    for entry in out.iterdir():
        if entry.name.startswith(".export-") and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)  # the scratch folder of an export that was killed
        elif entry.name not in PACKAGE_FILES or (entry.is_dir() and not entry.is_symlink()):
            others.append(entry.name)
    others.sort()
    if others:
        shown = ", ".join(repr(name)[1:-1] for name in others[:3])
        raise ExportError(
            f"--out {out}: holds files that are not a package's ({shown}"
            f"{', ...' if len(others) > 3 else ''}) — choose a new or empty folder"
        )


# Each writer saves `net` to `path` and returns a runner of what it saved, read
# back as `predict` will read it.


def _write_safetensors(net: WithSoftmax, path: Path, x: Tensor, arch: Architecture) -> Runner:
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().clone() for k, v in net.model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})
    return torch_runner(safetensors_model(arch, path))  # built from the description alone


def _write_onnx(net: WithSoftmax, path: Path, x: Tensor, arch: Architecture) -> Runner:
    sample = x[:2] if len(x) >= 2 else torch.zeros(2, *x.shape[1:])  # a batch dim > 1
    torch.onnx.export(  # torch.export-based exporter (onnxscript), any batch size
        net,
        (sample,),
        str(path),
        input_names=["image"],
        output_names=["probabilities"],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
        dynamo=True,
        verbose=False,
    )
    _inline_weights(path)
    return onnx_runner(path)


def _inline_weights(path: Path) -> None:
    """Put the weights the exporter wrote beside `path` (model.onnx.data) into it,
    so that model.json's SHA-256 of model.onnx covers them: a review changed every
    weight in model.onnx.data and `predict --runtime onnx` took the package."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    outside = {
        entry.value
        for tensor in model.graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
    onnx.save_model(model, str(path))
    for name in outside:
        (path.parent / name).unlink(missing_ok=True)


def _refuse_external_weights(data: bytes, path: Path) -> None:
    """A model.onnx whose weights are in another file (what the exporter wrote
    before its weights were put inside it) is refused: model.json hashes
    model.onnx alone, and a review changed every weight of such a package's
    model.onnx.data without `predict` noticing."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # noqa: BLE001 - protobuf fails in many ways on bad bytes
        raise ExportError(f"{path}: not an ONNX model ({type(exc).__name__})") from None
    if any(uses_external_data(t) for t in _get_all_tensors(model)):
        raise ExportError(
            f"{path}: its weights are in another file, which {MODEL_JSON} does not hash "
            "(a package of before 2026-11-28) — export it again"
        )


def _write_torchscript(net: WithSoftmax, path: Path, x: Tensor, arch: Architecture) -> Runner:
    sample = x[:1] if len(x) else torch.zeros(1, *x.shape[1:])
    with torch.no_grad():
        traced = torch.jit.trace(net, sample)
    traced.save(str(path))
    return torch_runner(torch.jit.load(str(path)))  # our own file, written just now


_WRITERS = {
    "safetensors": _write_safetensors,
    "onnx": _write_onnx,
    "torchscript": _write_torchscript,
}


# ---------------------------------------------------------------------- reading


class Predictor:
    """An exported package, ready to turn uint8 images into class probabilities."""

    def __init__(self, package: Path, runtime: Runtime = "auto") -> None:
        self.dir = Path(package)
        meta_path = self.dir / MODEL_JSON
        if not meta_path.is_file():
            raise ExportError(
                f"{self.dir}: no {MODEL_JSON} — point --model at a directory written by "
                "`p2pfl-node export`"
            )
        # A package may come from another site: every value is checked before it
        # sizes anything (a review's image_size 10**6 asked torch for 4 TB, a
        # nested model.json or a files entry that is no object raised a traceback)
        try:
            if meta_path.stat().st_size > MAX_MODEL_JSON:
                raise ValueError(f"larger than {MAX_MODEL_JSON} bytes")
            meta = json.loads(meta_path.read_text())
            arch = meta["architecture"]
            self.arch = Architecture(
                str(arch["name"]),
                int(arch["in_chans"]),
                int(arch["num_classes"]),
                int(arch["image_size"]),
            )
            self.classes = [str(c) for c in meta["classes"]]
            files = {str(fmt): dict(entry) for fmt, entry in dict(meta["files"]).items()}
            version = int(meta.get("format_version", 0))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ExportError(f"{meta_path}: not a p2pfl-node model description ({exc})") from None
        if version > FORMAT_VERSION:
            raise ExportError(
                f"{meta_path}: format_version {version} is newer than this "
                f"p2pfl-node reads ({FORMAT_VERSION}); upgrade p2pfl-node"
            )
        low, high = IMAGE_SIZES
        if not low <= self.arch.image_size <= high or self.arch.in_chans not in CHANNELS:
            raise ExportError(
                f"{meta_path}: image_size {self.arch.image_size} and in_chans "
                f"{self.arch.in_chans} are not a model's input (image_size {low}-{high}, "
                f"in_chans {' or '.join(map(str, CHANNELS))})"
            )
        if len(self.classes) != self.arch.num_classes or not self.classes:
            raise ExportError(
                f"{meta_path}: {len(self.classes)} classes for a model with "
                f"{self.arch.num_classes} outputs"
            )
        self.runtime = self._choose(runtime, files)
        entry = files[self.runtime_format]
        if entry.get("file") != FILES[self.runtime_format]:
            # no path out of the package, and no file torch.load would unpickle
            raise ExportError(
                f"{meta_path}: the {self.runtime_format} file is {str(entry.get('file'))[:80]!r},"
                f" not {FILES[self.runtime_format]} — a package names the files export wrote"
            )
        path = self.dir / FILES[self.runtime_format]
        if not path.is_file():
            raise ExportError(f"{path}: missing (named in {MODEL_JSON})")
        if path.stat().st_size > MAX_ONNX:
            # read whole before it is hashed: a 50 GB file would have been read into memory
            raise ExportError(
                f"{path}: larger than an ONNX model with its weights inside can be "
                f"({MAX_ONNX} bytes, protobuf's limit), and than any weights file export writes"
            )
        # the bytes hashed are the bytes run, for both runtimes: no second read a
        # writer could race (until 2026-11-28 model.safetensors was hashed, then
        # read again to load, and a file swapped in between was run unchecked)
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.get("sha256"):
            raise ExportError(
                f"{path}: its SHA-256 differs from {MODEL_JSON}'s — the file was changed or "
                "damaged after export; export it again"
            )
        if self.runtime == "onnx":
            _refuse_external_weights(data, path)
        self._run = (
            torch_runner(safetensors_model(self.arch, path, data))
            if self.runtime == "torch"
            else onnx_runner(data, str(path))
        )
        # a package from elsewhere may hold a graph that fails or answers in
        # another shape: found on two blank images, before any of the site's
        self.predict_proba(torch.zeros(2, self.channels, self.image_size, self.image_size))

    @property
    def runtime_format(self) -> str:
        return "safetensors" if self.runtime == "torch" else "onnx"

    @property
    def image_size(self) -> int:
        return self.arch.image_size

    @property
    def channels(self) -> int:
        return self.arch.in_chans

    def _choose(self, runtime: Runtime, files: dict[str, Any]) -> str:
        if runtime == "torch" or (runtime == "auto" and "safetensors" in files):
            if "safetensors" not in files:
                raise ExportError(f"{self.dir}: no safetensors file; use --runtime onnx")
            return "torch"
        if "onnx" not in files:
            raise ExportError(f"{self.dir}: no ONNX file; use --runtime torch")
        return "onnx"

    def preprocess(self, image: UInt8Images) -> Tensor:
        """One uint8 H,W,C image -> the 1,C,H,W tensor training would have made of it."""
        batch = convert_images(np.array(image[None]), self.image_size, self.channels)
        return to_float_tensor(batch)

    def predict_proba(self, x: Tensor) -> np.ndarray:
        """Preprocessed N,C,H,W -> N x classes probabilities; ExportError (one
        line) for a model that fails or answers in another shape (an ONNX graph
        of another site's making raised onnxruntime's own errors, and one of
        256 outputs an IndexError, as tracebacks)."""
        try:
            proba = self._run(x.float().contiguous())
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
            raise ExportError(f"{self.dir}: the model fails to run ({_first_line(exc)})") from None
        expected = (len(x), len(self.classes))
        if np.shape(proba) != expected:
            raise ExportError(
                f"{self.dir}: the model answers {len(x)} images with shape "
                f"{np.shape(proba)}, not {expected[0]} x {expected[1]} class probabilities"
            )
        return proba
