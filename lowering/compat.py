"""Which ONNX IR version the installed onnxruntime reads (onnx 1.23's helpers write 14; older runtimes stop at 13)."""

from __future__ import annotations

import functools

import onnx
from onnx import helper

OLDEST_PROBED = 7  # opset 12 needs IR 7


def runtime_ir_version(ir_version: int, opset_imports: dict[str, int]) -> int:
    """The IR version to declare: ``ir_version`` if onnxruntime reads it, else the newest one it reads,
    never below what the opsets need (onnx.helper.find_min_ir_version_for)."""
    if _runtime_accepts(ir_version):
        return ir_version
    ids = [helper.make_opsetid(d, v) for d, v in opset_imports.items()]
    needed = helper.find_min_ir_version_for(ids, ignore_unknown=True)
    for candidate in range(ir_version - 1, OLDEST_PROBED - 1, -1):
        if _runtime_accepts(candidate):
            return max(candidate, needed)
    return ir_version


@functools.cache
def _runtime_accepts(ir_version: int) -> bool:
    """Probe the runtime with a one-node model (no other way to ask it)."""
    if ir_version < OLDEST_PROBED:
        return True
    try:
        import onnxruntime
    except ImportError:  # no runtime: nothing to adapt to
        return True
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = ir_version
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    try:
        onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 -- any refusal means "not this version"
        return False
    return True
