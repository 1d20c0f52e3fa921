"""Test helpers for generated training models."""

from __future__ import annotations

import onnx
from onnx import helper

ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")
BUFFER = "_grad.accumulation.buffer"


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
