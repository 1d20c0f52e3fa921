"""lowering.loss_forms: a training graph's SoftmaxCrossEntropyLoss written out in fewer kernels than onnxruntime's
inlined ONNX function, with its bits (loss and log_prob compared byte for byte), and where it is not taken."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from lowering.loss_forms import shorten_cross_entropy
from lowering.passes import lower_runnable

ARTIFACTS = Path(__file__).parent / "fixtures" / "ort_training" / "artifacts"
_NP = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64, TensorProto.INT64: np.int64,
       TensorProto.INT32: np.int32}


def _model(shape: tuple, *, ignore_index: int | None = None, reduction: str = "mean", ftype: int = TensorProto.FLOAT,
           ltype: int = TensorProto.INT64, weight: bool = False, read_log_prob: bool = True,
           opset: int = 17) -> onnx.ModelProto:
    """One SoftmaxCrossEntropyLoss of the scores ``x`` (declared only through the Identity producing them, as in a
    training graph) and labels ``y``; log_prob read by a node where ``read_log_prob`` (a gradient would)."""
    attrs = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    nodes = [helper.make_node("Identity", ["x"], ["scores"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "y"] + (["w"] if weight else []),
                              ["loss", "log_prob"], name="sce", **attrs)]
    outputs = [helper.make_tensor_value_info("loss", ftype, None)]
    if read_log_prob:
        nodes.append(helper.make_node("Exp", ["log_prob"], ["prob"]))
        outputs.append(helper.make_tensor_value_info("prob", ftype, None))
    outputs.append(helper.make_tensor_value_info("log_prob", ftype, None))
    inputs = [helper.make_tensor_value_info("x", ftype, list(shape)),
              helper.make_tensor_value_info("y", ltype, [shape[0], *shape[2:]])]
    if weight:
        inputs.append(helper.make_tensor_value_info("w", ftype, [shape[1]]))
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8  # onnxruntime 1.23 (the last for Python 3.10) reads IR 11 at most
    return model


def _shortened(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy, shorten_cross_entropy(copy)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, feeds: dict) -> list | type:
    try:
        return session.run(None, feeds)
    except Exception as exc:  # noqa: BLE001 -- both forms must refuse the same labels
        return type(exc)


SHAPES = [(1, 1), (1, 5), (3, 2), (7, 10), (16, 17), (33, 64), (4, 1000), (2, 5, 3), (4, 3, 7), (3, 1, 4)]


@pytest.mark.parametrize("ftype", [TensorProto.FLOAT, TensorProto.DOUBLE])
@pytest.mark.parametrize("ltype", [TensorProto.INT64, TensorProto.INT32])
@pytest.mark.parametrize("ignore_index", [None, -100, 0, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_bits_of_the_function(ftype: int, ltype: int, ignore_index: int | None, reduction: str) -> None:
    """Loss and log_prob byte for byte equal to onnxruntime's inlined function on random scores (up to 1e38,
    with inf, -inf, NaN, signed zeros and the largest finite value sprinkled in) and labels with ignored ones
    (none, some, all)."""
    rng = np.random.default_rng([ftype, ltype, abs(ignore_index or 7), len(reduction)])
    fnp, lnp = _NP[ftype], _NP[ltype]
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, np.finfo(fnp).max], fnp)
    for shape in SHAPES:
        model = _model(shape, ignore_index=ignore_index, reduction=reduction, ftype=ftype, ltype=ltype)
        short, taken = _shortened(model)
        assert taken == 1
        native, ours = _session(model), _session(short)
        labels_shape = [shape[0], *shape[2:]]
        for case in range(6):
            with np.errstate(over="ignore"):
                x = (rng.standard_normal(shape) * [1, 10, 1e4, 1e30, 1e38, 1][case]).astype(fnp)
            if case == 5:
                flat = x.reshape(-1)
                at = rng.integers(0, flat.size, size=max(1, flat.size // 7))
                flat[at] = rng.choice(specials, size=at.size)
            y = rng.integers(0, shape[1], size=labels_shape).astype(lnp)
            if ignore_index is not None:
                y[rng.random(labels_shape) < [0.3, 0.0, 1.0, 0.5, 0.3, 0.3][case]] = ignore_index
            expected, got = _run(native, {"x": x, "y": y}), _run(ours, {"x": x, "y": y})
            if isinstance(expected, type):
                assert got is expected
                continue
            for e, g in zip(expected, got, strict=True):
                assert e.shape == g.shape and e.dtype == g.dtype
                assert e.tobytes() == g.tobytes(), (shape, case)


@pytest.mark.parametrize(("ignore_index", "reduction", "ops"), [
    (None, "mean", ["Unsqueeze", "LogSoftmax", "GatherElements", "Neg", "ReduceMean"]),
    (None, "none", ["Unsqueeze", "LogSoftmax", "GatherElements", "Neg", "Squeeze"]),
    (-100, "mean", ["Unsqueeze", "LogSoftmax", "Equal", "Where", "GatherElements", "Where", "Neg", "Where",
                    "ReduceSum", "ReduceSum", "Div"]),
])
def test_kernels(ignore_index: int | None, reduction: str, ops: list[str]) -> None:
    """5 kernels a step for the committed artifacts' loss (onnxruntime's expansion: 11), 11 with torch's
    ignore_index (21)."""
    short, _ = _shortened(_model((4, 5), ignore_index=ignore_index, reduction=reduction))
    emitted = [n.op_type for n in short.graph.node if n.name.partition("/")[0] == "sce" and n.op_type != "Constant"]
    assert sorted(emitted) == sorted(ops)


@pytest.mark.parametrize("kwargs", [
    {"weight": True},  # class weights: the function's weighted gather and mean
    {"read_log_prob": False},  # an evaluation graph: workflow reads scores and labels off its loss node
    {"opset": 12},  # SoftmaxCrossEntropyLoss-12
    {"shape": (2, 3, 4, 5)},  # the function's [N, C, D] view is not the scores themselves
    {"ignore_index": 2**31, "ltype": TensorProto.INT32},  # compared through int64 by the function
])
def test_not_taken(kwargs: dict) -> None:
    model, taken = _shortened(_model(kwargs.pop("shape", (4, 5)), **kwargs))
    assert taken == 0
    assert [n.op_type for n in model.graph.node].count("SoftmaxCrossEntropyLoss") == 1


def test_training_artifact() -> None:
    """A training graph lowered for onnxruntime runs the short form (its gradient reads log_prob); for the
    portable target the loss node stays (spelled out later for tract)."""
    model = onnx.load(ARTIFACTS / "cnn" / "training_model.onnx")
    lowered = lower_runnable(model, "cnn", target="onnxruntime")
    ops = [n.op_type for n in lowered.graph.node]
    assert "SoftmaxCrossEntropyLoss" not in ops and "LogSoftmax" in ops
    portable = lower_runnable(model, "cnn", target="portable")
    assert "SoftmaxCrossEntropyLoss" in [n.op_type for n in portable.graph.node]
