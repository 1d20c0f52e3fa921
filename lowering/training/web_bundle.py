"""What the browser page (``web/``) trains: the train-step model, its starting state and the data, as files a
static page can fetch.

``bundle.json`` names the model file, the loss output, the step count, learning rate, the trainable
parameters (``params``), the first step's number (``first_step``, after a checkpoint's steps), and every
tensor by
its input name: ``data`` (a leading batch-index axis; step k feeds index k mod B), ``state`` (the inputs each
step updates: the page feeds the ``<name>.updated`` output back as ``<name>`` next step) and ``constants``
(frozen values no op updates). Each tensor is ``{"dtype", "shape", "offset", "bytes"}`` into one
little-endian ``tensors.bin``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lowering.modelio import write_atomic
from lowering.training.train_step import FIRST_MOMENT, SECOND_MOMENT, TrainStep
from opdef.errors import ModelError

MODEL_FILE, INDEX_FILE, TENSOR_FILE = "train_step.onnx", "bundle.json", "tensors.bin"
# numpy dtypes the page knows (onnxruntime-web tensor types)
WEB_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(np.int32): "int32",
              np.dtype(np.bool_): "bool"}


def write_bundle(out_dir: Path, step: TrainStep, data: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray],
                 frozen: Mapping[str, np.ndarray], *, steps: int, learning_rate: float,
                 moments: Sequence[Sequence[np.ndarray]] = (), steps_taken: int = 0) -> None:
    """Write ``MODEL_FILE``, ``INDEX_FILE`` and ``TENSOR_FILE`` into ``out_dir`` (created if needed).
    ``data``: one array per data input with a leading batch-index axis; ``moments``: a checkpoint's first and
    second moments (one array per parameter, zeros when absent); ``steps_taken``: its optimizer step, so the
    page's first step is ``steps_taken + 1``."""
    interface = step.interface
    state = {p: np.asarray(params[p]) for p in interface.params}
    if interface.moments:
        for i, p in enumerate(interface.params):
            for k, suffix in enumerate((FIRST_MOMENT, SECOND_MOMENT)):
                state[p + suffix] = np.asarray(moments[k][i]) if len(moments) > k else np.zeros_like(state[p])
    state.update({n: np.asarray(frozen[n]) for n in interface.updated_frozen})
    constants = {n: np.asarray(frozen[n]) for n in interface.frozen if n not in interface.updated_frozen}
    blob = bytearray()
    index: dict = {"model": MODEL_FILE, "tensors": TENSOR_FILE, "loss": interface.loss, "steps": steps,
                   "learning_rate": learning_rate, "optimizer": interface.optimizer, "params": list(interface.params),
                   "first_step": steps_taken + 1}
    for kind, arrays in (("data", {n: data[n] for n in interface.data}), ("state", state), ("constants", constants)):
        index[kind] = {}
        for name, value in arrays.items():
            value = np.ascontiguousarray(value)
            if value.dtype not in WEB_DTYPES:
                raise ModelError(f"{name}: dtype {value.dtype} has no onnxruntime-web tensor type here "
                                 f"({', '.join(WEB_DTYPES.values())})")
            raw = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
            index[kind][name] = {"dtype": WEB_DTYPES[value.dtype], "shape": list(value.shape),
                                 "offset": len(blob), "bytes": len(raw)}
            blob += raw
            blob += bytes(-len(blob) % 8)  # typed-array views need aligned offsets
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / MODEL_FILE, step.model.SerializeToString())
    write_atomic(out_dir / TENSOR_FILE, bytes(blob))
    write_atomic(out_dir / INDEX_FILE, (json.dumps(index, indent=1) + "\n").encode())
