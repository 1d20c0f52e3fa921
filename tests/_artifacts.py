"""Test helpers for generated training models."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import onnx
from onnx import helper

ROOT = Path(__file__).resolve().parent.parent

ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")
BUFFER = "_grad.accumulation.buffer"


def make_oplower_artifacts_driver() -> ModuleType:
    """``tools/make_oplower_artifacts.py`` as a module (tools/ is no package): its architectures and the
    generator call every fixture of oplower-made artifacts was recorded with."""
    path = ROOT / "tools" / "make_oplower_artifacts.py"
    spec = importlib.util.spec_from_file_location("make_oplower_artifacts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gradients_exposed(training: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of the training model without its accumulators, each trainable parameter's gradient a graph output
    (after the model's own outputs but the accumulators' flags); the buffers and ``lazy_reset_grad`` are no
    inputs any more. Returns the copy and {parameter: its gradient's value name}."""
    model = onnx.ModelProto.FromString(training.SerializeToString())
    graph = model.graph
    kept, exposed = [], {}
    for node in graph.node:
        if (node.domain, node.op_type) == ACCUMULATOR:
            exposed[node.input[0].removesuffix(BUFFER)] = node.input[1]
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    outputs = [o for o in graph.output if not o.name.endswith(".accumulation.out")]
    del graph.output[:]
    graph.output.extend(outputs + [helper.make_empty_tensor_value_info(g) for g in exposed.values()])
    inputs = [i for i in graph.input if not i.name.endswith(BUFFER) and i.name != "lazy_reset_grad"]
    del graph.input[:]
    graph.input.extend(inputs)
    return model, exposed
