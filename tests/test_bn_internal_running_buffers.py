"""The premise of BatchNormInternal's kernel form feeding BatchNormalization's running-statistics inputs two Muls
of scale (lowering/rules/batch_norm_internal.py): onnxruntime's training-mode BatchNormalization writes its
running outputs into the buffers of inputs 3 and 4 whatever else reads them, so each must be a buffer of the node's
own, computed every run. Two cheaper sources were tried (issue 31) and are wrong: constants (folded into
initializers: a NaN batch's statistics stay in them for every later run) and one computed buffer for both inputs,
even one a later node reads too (the variance lands over the mean and over what the later node reads). (Where the
running outputs are graph outputs they get buffers of their own; in the lowering nodes read them.)"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

F32 = TensorProto.FLOAT
C = 8
SHAPE = (4, C, 3, 3)


def _model(stats_in: list[onnx.NodeProto], mean: str, var: str, also_read: str | None = None) -> onnx.ModelProto:
    nodes = [*stats_in, helper.make_node("BatchNormalization", ["x", "scale", "bias", mean, var], ["y", "m", "v"],
                                         epsilon=1e-5, momentum=0.0, training_mode=1)]
    # the statistics read by a node, as in the lowering (a graph output would get a buffer of its own)
    nodes += [helper.make_node("Mul", ["m", "one"], ["mean"]), helper.make_node("Mul", ["v", "one"], ["variance"])]
    outputs = ["mean", "variance"]
    if also_read is not None:  # a node after the BatchNormalization reading the input buffer too
        nodes.append(helper.make_node("Add", [also_read, "variance"], ["later"]))
        outputs.append("later")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, F32, s) for n, s in (("x", SHAPE), ("scale", [C]),
                                                                             ("bias", [C]))],
        [helper.make_tensor_value_info(n, F32, None) for n in outputs],
        [numpy_helper.from_array(np.array([C], np.int64), "channels"),
         numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
         numpy_helper.from_array(np.array(0.5, np.float32), "half"),
         numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _filled(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node("ConstantOfShape", ["channels"], [name], value=helper.make_tensor("v", F32, [1], [value]))


def _runs(model: onnx.ModelProto, nan_first: bool) -> tuple[list[list[np.ndarray]], list[dict]]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = []
    for run in range(3):
        x = (rng.standard_normal(SHAPE) * 2 + 1).astype(np.float32)
        if nan_first and run == 0:
            x[0, 0, 0, 0] = np.nan
        feeds.append({"x": x, "scale": rng.standard_normal(C).astype(np.float32),
                      "bias": rng.standard_normal(C).astype(np.float32)})
    return [session.run(None, f) for f in feeds], feeds


def _statistics_right(outputs: list[np.ndarray], feeds: dict) -> bool:
    x = feeds["x"].astype(np.float64)
    return bool(np.allclose(outputs[0], x.mean((0, 2, 3)), atol=1e-5)
                and np.allclose(outputs[1], x.var((0, 2, 3)), rtol=1e-5))


def test_two_muls_of_scale_are_buffers_of_the_nodes_own():
    """The lowering's form: right statistics on every run, a NaN batch leaves nothing behind."""
    muls = [helper.make_node("Mul", ["scale", "zero"], ["mean_in"]), helper.make_node("Mul", ["scale", "half"],
                                                                                       ["var_in"])]
    outputs, feeds = _runs(_model(muls, "mean_in", "var_in"), nan_first=True)
    assert all(_statistics_right(o, f) for o, f in zip(outputs[1:], feeds[1:], strict=True))


def test_constants_keep_a_nan_batch_for_later_runs():
    """Two distinct constants (ConstantOfShape, folded into initializers at load): after a NaN batch every later
    run's statistics are NaN (the kernel wrote NaN into the initializers, and NaN * momentum 0 is NaN)."""
    outputs, feeds = _runs(_model([_filled("mean_in", 0.0), _filled("var_in", 0.5)], "mean_in", "var_in"),
                           nan_first=True)
    assert not any(_statistics_right(o, f) for o, f in zip(outputs[1:], feeds[1:], strict=True))
    assert np.isnan(outputs[2][0]).any()


@pytest.mark.parametrize("source", ["mul", "constant"])
def test_one_buffer_for_both_inputs_is_overwritten_even_when_read_later(source):
    """One buffer for inputs 3 and 4 (a Mul of scale, or a constant), which an Add after the BatchNormalization
    reads too: the mean output is the variance, and the Add reads the variance instead of zeros."""
    stats_in = [helper.make_node("Mul", ["scale", "zero"], ["both"])] if source == "mul" else [_filled("both", 0.0)]
    outputs, feeds = _runs(_model(stats_in, "both", "both", also_read="both"), nan_first=False)
    for (mean, variance, later), f in zip(outputs, feeds, strict=True):
        assert not _statistics_right([mean, variance], f)
        assert np.array_equal(mean, variance) and not np.array_equal(later, variance)
