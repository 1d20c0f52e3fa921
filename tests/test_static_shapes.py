"""Shape / Size of statically shaped values folded to constants (lowering.static_shapes): the folded model
computes what the original computed (onnxruntime runs both), nothing is folded that the shapes do not fix,
and the committed static artifacts' train steps keep no Shape / Size kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from lowering.passes import lower_runnable
from lowering.static_shapes import fold_static_shapes
from lowering.training.trainer import lower_artifacts

ARTIFACTS = Path(__file__).parent / "fixtures" / "ort_training" / "artifacts"
F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, x_shape, outputs):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, x_shape)],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def _ops(model):
    return [n.op_type for n in model.graph.node]


def test_size_and_shape_slices_fold_to_what_they_computed():
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Size", ["r"], ["size"]),
             helper.make_node("Shape", ["r"], ["shape"]),
             helper.make_node("Shape", ["r"], ["tail"], start=1),
             helper.make_node("Shape", ["r"], ["middle"], start=-2, end=-1),
             helper.make_node("Shape", ["r"], ["clamped"], start=-9, end=9),
             # the chain onnxruntime-training writes for ReduceMean's gradient
             helper.make_node("Div", ["size", "size"], ["ratio"])]
    outputs = [("size", I64), ("shape", I64), ("tail", I64), ("middle", I64), ("clamped", I64), ("ratio", I64)]
    model = _model(nodes, [2, 3, 5], outputs)
    x = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(np.float32)
    want = _run(model, x)
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    assert fold_static_shapes(folded) == 6  # the Div of the two constants folds next
    assert _ops(folded) == ["Relu"] + ["Constant"] * 6
    for got, expected in zip(_run(folded, x), want, strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("opset", [12, 17])
def test_torchs_shape_chain_folds_in_rounds(opset):
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape, as torch exports a flatten: every link folds (the
    arithmetic in the model's own opset: Unsqueeze's axes an attribute before 13), the Reshape stays."""
    def unsqueeze(x, out):
        if opset < 13:
            return [helper.make_node("Unsqueeze", [x], [out], axes=[0])]
        return [helper.make_node("Unsqueeze", [x, "zero_axis"], [out])]

    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Gather", ["s", "index0"], ["n"], axis=0),
             *unsqueeze("n", "n1"),
             helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["r", "target"], ["flat"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [2, 3, 4])],
                              [helper.make_tensor_value_info("flat", F32, None)],
                              initializer=[onnx.numpy_helper.from_array(np.array(0, np.int64), "index0"),
                                           onnx.numpy_helper.from_array(np.array([0], np.int64), "zero_axis"),
                                           onnx.numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    want = _run(model, x)[0]
    assert fold_static_shapes(model) == 4
    assert _ops(model) == ["Relu", "Constant", "Constant", "Constant", "Constant", "Reshape"]
    np.testing.assert_array_equal(_run(model, x)[0], want)
    assert want.shape == (2, 12)


def test_large_arithmetic_stays_a_node():
    """Only small integer values are folded: a Range of 100 elements is left to run."""
    nodes = [helper.make_node("Size", ["x"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["r"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [10, 10])],
                              [helper.make_tensor_value_info("r", I64, None)],
                              initializer=[onnx.numpy_helper.from_array(np.array(0, np.int64), "zero"),
                                           onnx.numpy_helper.from_array(np.array(1, np.int64), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    assert fold_static_shapes(model) == 1 and _ops(model) == ["Constant", "Range"]


def test_only_what_the_shapes_fix_is_folded():
    nodes = [helper.make_node("Shape", ["x"], ["whole"]),
             helper.make_node("Shape", ["x"], ["tail"], start=1),
             helper.make_node("Size", ["x"], ["size"])]
    model = _model(nodes, ["batch", 4, 6], [("whole", I64), ("tail", I64), ("size", I64)])
    x = np.ones((3, 4, 6), np.float32)
    want = _run(model, x)
    assert fold_static_shapes(model) == 1  # [1:] of [batch, 4, 6]; the whole shape and the size need the batch
    assert _ops(model) == ["Shape", "Constant", "Size"]
    for got, expected in zip(_run(model, x), want, strict=True):
        np.testing.assert_array_equal(got, expected)


def _pool_then_shape(kernel, stride, pads, length):
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[kernel], strides=[stride], pads=pads,
                              ceil_mode=1),
             helper.make_node("Shape", ["p"], ["shape"])]
    return _model(nodes, [1, 1, length], [("shape", I64), ("p", F32)])


def test_a_ceil_mode_window_in_the_end_padding_leaves_the_model_alone():
    """onnx's inference counts a ceil-mode window that starts past the input (3 here), onnxruntime's pool does not
    (2); onnxruntime's own load-time folding of the Shape trusts the inference (3)."""
    model = _pool_then_shape(1, 3, [0, 0], 5)
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.output}
    assert [d.dim_value for d in inferred["p"].type.tensor_type.shape.dim] == [1, 1, 3]
    shape, pooled = _run(model, np.ones((1, 1, 5), np.float32))
    assert pooled.shape == (1, 1, 2)
    assert fold_static_shapes(model) == 0 and _ops(model) == ["MaxPool", "Shape"]


def test_a_ceil_mode_pool_whose_windows_all_start_inside_folds():
    model = _pool_then_shape(2, 2, [0, 1], 5)  # windows at 0, 2, 4: the last one half in the padding
    x = np.ones((1, 1, 5), np.float32)
    want = _run(model, x)
    assert fold_static_shapes(model) == 1 and _ops(model) == ["MaxPool", "Constant"]
    assert list(want[0]) == list(want[1].shape) == [1, 1, 3]
    np.testing.assert_array_equal(_run(model, x)[0], want[0])


def test_lower_runnable_leaves_the_callers_model_alone():
    model = _model([helper.make_node("Size", ["x"], ["size"])], [2, 3], [("size", I64)])
    lowered = lower_runnable(model, "m.onnx")
    assert _ops(model) == ["Size"] and _ops(lowered) == ["Constant"]


@pytest.mark.parametrize("name", ["mlp_act", "lstm", "gru", "bert", "mobilenet", "cnn1d"])
def test_static_train_steps_keep_no_shape_kernels(name):
    """The committed artifacts have static shapes: their ReduceMean gradients' Size / Shape and the recurrent
    rules' Shape -> Expand chains are constants in the train-step model (cnn1d: after a ceil-mode MaxPool whose
    windows all start inside its input)."""
    step = lower_artifacts(ARTIFACTS / name).step.model
    assert not {"Shape", "Size"} & set(_ops(step))


def _index_check(x_shape, indices, picked_shape):
    """GatherGrad's index checks on constant indices: normalized against the axis's size (from Shape), a Where
    over dY-like values picking them where all are inside; ``picked_shape``: the picked operand's shape."""
    const = helper.make_node("Constant", [], ["idx"], value=helper.make_tensor("idx", I64, [len(indices)], indices))
    nodes = [const,
             helper.make_node("Shape", ["x"], ["dims"]),
             helper.make_node("Gather", ["dims", "axis"], ["size"], axis=0),
             helper.make_node("Less", ["idx", "zero"], ["negative"]),
             helper.make_node("Where", ["negative", "wrapped", "idx"], ["positions"]),
             helper.make_node("Add", ["idx", "size"], ["wrapped"]),
             helper.make_node("GreaterOrEqual", ["positions", "zero"], ["low"]),
             helper.make_node("Less", ["positions", "size"], ["high"]),
             helper.make_node("And", ["low", "high"], ["inside"]),
             helper.make_node("Not", ["inside"], ["outside"]),
             helper.make_node("Unsqueeze", ["inside", "axes"], ["mask"]),
             helper.make_node("Slice", ["x", "zero_1", "rows", "zero_1"], ["values"]),
             helper.make_node("Where", ["mask", "values", "fill"], ["picked"])]
    # the nodes out of order on purpose: a round folds what its inputs fix, the next round the rest
    nodes = [nodes[0], nodes[1], nodes[2], nodes[3], nodes[5], nodes[4], *nodes[6:]]
    model = _model(nodes, x_shape, [("picked", F32), ("outside", TensorProto.BOOL), ("positions", I64)])
    model.graph.initializer.extend([
        onnx.numpy_helper.from_array(np.array(0, np.int64), "axis"),
        onnx.numpy_helper.from_array(np.array(0, np.int64), "zero"),
        onnx.numpy_helper.from_array(np.array([0], np.int64), "zero_1"),
        onnx.numpy_helper.from_array(np.array([picked_shape[0]], np.int64), "rows"),
        onnx.numpy_helper.from_array(np.array([1], np.int64), "axes"),
        onnx.numpy_helper.from_array(np.array(0.0, np.float32), "fill")])
    return model


@pytest.mark.parametrize("indices, kept", [([-1, 1], "values"), ([5, 7], "fill"), ([0, 9], None)])
def test_index_checks_on_constant_indices_fold(indices, kept):
    """Comparisons and logic on constants fold; a Where whose folded condition is one value throughout becomes
    an Identity of the operand it picks when that operand has the output's shape, else it stays."""
    model = _index_check([2, 3], indices, [2, 3])
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    want = _run(model, x)
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    fold_static_shapes(folded)
    ops = _ops(folded)
    assert not {"Shape", "Less", "GreaterOrEqual", "And", "Not", "Add"} & set(ops)
    picked = next(n for n in folded.graph.node if n.output[0] == "picked")
    if kept == "values":  # all inside: dY itself
        assert picked.op_type == "Identity" and list(picked.input) == ["values"]
    elif kept == "fill":  # all outside: the fill is a scalar, not of the output's shape, so the Where stays
        assert picked.op_type == "Where"
    else:  # mixed
        assert picked.op_type == "Where"
    for got, expected in zip(_run(folded, x), want, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_where_whose_condition_grows_the_operand_stays():
    """[1, 3] values against a [2, 3] all-true condition: the output is [2, 3], not the operand."""
    const = helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("cond", TensorProto.BOOL, [2, 3],
                                                                                  [True] * 6))
    nodes = [const, helper.make_node("Shape", ["x"], ["dims"]),
             helper.make_node("Where", ["cond", "x", "zero"], ["y"])]
    model = _model(nodes, [1, 3], [("y", F32), ("dims", I64)])
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    fold_static_shapes(model)
    assert next(n for n in model.graph.node if n.output[0] == "y").op_type == "Where"
    x = np.ones((1, 3), np.float32)
    assert _run(model, x)[0].shape == (2, 3)


def test_an_initializer_a_caller_may_feed_is_not_folded():
    """An initializer that is also a graph input is a default, not a constant: the arithmetic on it stays."""
    nodes = [helper.make_node("Shape", ["x"], ["dims"]), helper.make_node("Gather", ["dims", "which"], ["picked"])]
    model = _model(nodes, [2, 3], [("picked", I64)])
    model.graph.input.append(helper.make_tensor_value_info("which", I64, []))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, np.int64), "which"))
    fold_static_shapes(model)
    assert _ops(model) == ["Constant", "Gather"]  # the Shape folded, the Gather of the feedable index not
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.zeros((2, 3), np.float32)
    assert session.run(None, {"x": x, "which": np.array(0, np.int64)})[0] == 2
