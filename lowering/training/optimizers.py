"""The optimizer model onnxruntime-training 1.19.2 writes (``optimizer_model.onnx``), built the same way.

Inputs: ``learning_rate`` (float [1]), ``step`` (int64 [1]), the tensor sequences ``params``, ``gradients``,
``first_order_moments`` (both optimizers) and ``second_order_moments`` (AdamW); one node,
``com.microsoft::AdamWOptimizer`` (alpha 0.9, beta 0.999, epsilon 1e-6, weight_decay 0, correct_bias 1,
adam_mode 1) or ``com.microsoft::SGDOptimizerV2``; its output a bool [1] flag.
"""

from __future__ import annotations

from enum import Enum

import onnx
from onnx import helper

from lowering.training.losses import Tokens

OPTIMIZER_IR_VERSION = 10  # what onnxruntime-training 1.19.2's optimizer models declare


class OptimType(Enum):
    """The optimizer (``generate_artifacts``' ``optimizer``); values as onnxruntime's."""

    AdamW = 1
    SGD = 2


ADAMW_DEFAULTS = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-6, "weight_decay": 0.0, "correct_bias": 1, "adam_mode": 1}


def optimizer_model(optimizer: OptimType, elem_type: int, opset: int, tokens: Tokens) -> onnx.ModelProto:
    seq = [helper.make_tensor_sequence_value_info(n, elem_type, None)
           for n in ("params", "gradients", "first_order_moments")]
    inputs = [helper.make_tensor_value_info("learning_rate", onnx.TensorProto.FLOAT, [1]),
              helper.make_tensor_value_info("step", onnx.TensorProto.INT64, [1]), *seq]
    if optimizer is OptimType.AdamW:
        inputs.append(helper.make_tensor_sequence_value_info("second_order_moments", elem_type, None))
        flag = tokens("adamw.updated_flag")
        node = helper.make_node("AdamWOptimizer", ["learning_rate", "step", "params", "gradients",
                                                   "first_order_moments", "second_order_moments"], [flag],
                                name=tokens("AdamWOptimizer"), domain="com.microsoft", **ADAMW_DEFAULTS)
    elif optimizer is OptimType.SGD:
        flag = tokens("update_completed")
        node = helper.make_node("SGDOptimizerV2", ["learning_rate", "params", "gradients"], [flag],
                                name=tokens("SGDOptimizerV2"), domain="com.microsoft")
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    flag_vi = helper.make_tensor_value_info(flag, onnx.TensorProto.BOOL, [1])
    graph = helper.make_graph([node], "graph", inputs, [flag_vi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid("", opset)],
                              producer_name="oplower")
    model.ir_version = OPTIMIZER_IR_VERSION
    return model
