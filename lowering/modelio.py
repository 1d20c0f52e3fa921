"""Reading and writing model files with the project's error contract (clear error, atomic write)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx

from opdef.errors import ModelError


def load_model(path: Path | str, load_external_data: bool = True) -> onnx.ModelProto:
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, expected an ONNX model file")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if size == 0:
        raise ModelError(f"{path}: empty file, expected an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=load_external_data)
    except PermissionError:
        raise ModelError(f"{path}: cannot read: permission denied") from None
    except Exception as exc:  # onnx raises DecodeError, ValueError, OSError ... on garbage
        raise ModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'parse failed'})") from None
    if not model.HasField("graph"):
        raise ModelError(f"{path}: not an ONNX model (no graph)")
    return model


def write_atomic(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and a rename."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise ModelError(f"{path}: directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
