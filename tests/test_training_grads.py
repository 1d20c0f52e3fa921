"""onnxruntime-training's gradient ops in com.microsoft: ReluGrad, Scale, ConvGrad, SoftmaxCrossEntropyLossGrad.

Per op: the parsed schema's facts; one failing test per spec constraint (a one-line VerificationError naming
node and problem, labelled with the spec's C-number); the lowering against the float64 reference of
runtime.reference_training (checked by onnx.checker full_check, run in onnxruntime, opsets 12 and 17); the
reference itself against finite differences of the forward op in float64.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from _one_node import close, numeric_gradient, one_node_model
from _one_node import verification_error as _error
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

from lowering.passes import lower_model
from opdef.errors import LoweringError, VerificationError
from opdef.parse import parse_spec
from runtime import reference_training as ref
from runtime.session import run_model

SPECS = Path(__file__).resolve().parent.parent / "specs" / "com.microsoft"
MS = "com.microsoft"
F32, F16, BF16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE
I32, I64 = TensorProto.INT32, TensorProto.INT64
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16, F64: np.float64, I32: np.int32, I64: np.int64}
vi = helper.make_tensor_value_info


def lowered_outputs(model, feeds):
    lowered = lower_model(model)
    onnx.checker.check_model(lowered, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    return run_model(lowered, feeds)


# -- schemas ---------------------------------------------------------------------------------------------

def test_relu_grad_and_scale_schemas():
    s = parse_spec(SPECS / "ReluGrad.rst")
    assert [a.name for a in s.inputs] == ["dY", "X"] and [a.name for a in s.outputs] == ["dX"]
    assert s.attributes == () and len({a.type_var for a in (*s.inputs, *s.outputs)}) == 1
    assert {dict(c)["T"] for c in s.type_combinations} == {"f32", "f16", "bf16", "f64"}
    s = parse_spec(SPECS / "Scale.rst")
    assert [a.name for a in s.inputs] == ["input", "scale"] and [a.name for a in s.outputs] == ["output"]
    (attr,) = s.attributes
    assert (attr.name, attr.type, attr.required, attr.default) == ("scale_down", "s64", False, 0)
    t = {a.name: a.type_var for a in (*s.inputs, *s.outputs)}
    assert {dict(c)[t["scale"]] for c in s.type_combinations} == {"f32", "f16", "f64", "s32", "s64"}
    assert {dict(c)[t["input"]] for c in s.type_combinations} == {"f32", "f16", "f64"}


def test_conv_grad_schema():
    s = parse_spec(SPECS / "ConvGrad.rst")
    assert [a.name for a in s.inputs] == ["dY", "X", "W"]
    assert [(a.name, a.optional) for a in s.outputs] == [("dX", True), ("dW", True), ("dB", True)]
    attrs = {a.name: a for a in s.attributes}
    assert set(attrs) == {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"}
    assert (attrs["group"].type, attrs["group"].default) == ("s64", 1)
    assert attrs["auto_pad"].default == "NOTSET"
    assert set(attrs["auto_pad"].allowed_values) == {"NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"}
    assert all(attrs[n].type == "s64[]" and attrs[n].default is None
               for n in ("dilations", "kernel_shape", "pads", "strides"))
    assert {dict(c)["T"] for c in s.type_combinations} == {"f32", "f16", "f64"}
    assert [c.label for c in s.constraints] == ["C1", "C2", "C3", "C4", "C5", "C6"]


def test_softmax_cross_entropy_loss_grad_schema():
    s = parse_spec(SPECS / "SoftmaxCrossEntropyLossGrad.rst")
    assert [(a.name, a.optional) for a in s.inputs] == [("dY", False), ("log_prob", False), ("label", False),
                                                        ("weight", True)]
    attrs = {a.name: a for a in s.attributes}
    assert (attrs["reduction"].default, set(attrs["reduction"].allowed_values)) == ("mean", {"none", "sum", "mean"})
    assert (attrs["ignore_index"].type, attrs["ignore_index"].default) == ("s64", None)
    t = {a.name: a.type_var for a in (*s.inputs, *s.outputs)}
    assert t["dY"] == t["log_prob"] == t["weight"] == t["d_logits"] != t["label"]
    assert {dict(c)[t["label"]] for c in s.type_combinations} == {"s32", "s64"}


# -- constraints: one failing node each --------------------------------------------------------------------

def test_error_relu_grad_c1_shapes_differ():
    node = helper.make_node("ReluGrad", ["dy", "x"], ["dx"], domain=MS, name="rg")
    message = _error(node, {"dy": (F32, (4, 5)), "x": (F32, (4, 6))})
    assert "X has shape [4,6]; expected [4,5]" in message and "[C1]" in message


def test_sigmoid_grad_schema():
    s = parse_spec(SPECS / "SigmoidGrad.rst")
    assert [a.name for a in s.inputs] == ["dY", "Y"] and [a.name for a in s.outputs] == ["dX"]
    assert s.attributes == () and len({a.type_var for a in (*s.inputs, *s.outputs)}) == 1


def test_error_sigmoid_grad_c1_shapes_differ():
    node = helper.make_node("SigmoidGrad", ["dy", "y"], ["dx"], domain=MS, name="sg")
    message = _error(node, {"dy": (F32, (4, 5)), "y": (F32, (5, 4))})
    assert "Y has shape [5,4]; expected [4,5]" in message and "[C1]" in message


@pytest.mark.parametrize("elem, opset", [(F32, 12), (F16, 17), (BF16, 17), (F64, 13)])
def test_sigmoid_grad_lowering(elem, opset):
    rng = np.random.default_rng(6)
    y = ref.sigmoid(rng.standard_normal((3, 7)) * 3).astype(NP[elem])
    dy = rng.standard_normal((3, 7)).astype(NP[elem])
    model = one_node_model(helper.make_node("SigmoidGrad", ["dy", "y"], ["dx"], domain=MS, name="sg"),
                           [("dy", elem, [3, 7]), ("y", elem, [3, 7])], [("dx", elem, [3, 7])], opset)
    close(lowered_outputs(model, {"dy": dy, "y": y})["dx"], ref.sigmoid_grad(dy, y), elem, "dX")


def test_sigmoid_grad_reference_matches_finite_differences():
    rng = np.random.default_rng(7)
    x, dy = rng.standard_normal((4, 6)) * 4, rng.standard_normal((4, 6))
    grad = ref.sigmoid_grad(dy, ref.sigmoid(x))
    for v, numeric in numeric_gradient(lambda z: np.sum(dy * ref.sigmoid(z)), x):
        assert abs(np.sum(grad * v) - numeric) <= 1e-7 * max(1.0, abs(numeric))


def test_error_relu_grad_types_differ():
    node = helper.make_node("ReluGrad", ["dy", "x"], ["dx"], domain=MS, name="rg")
    assert "element type" in _error(node, {"dy": (F32, (4, 5)), "x": (F16, (4, 5))})


def test_error_scale_c1_more_than_one_element():
    node = helper.make_node("Scale", ["x", "s"], ["y"], domain=MS, name="sc")
    message = _error(node, {"x": (F32, (4, 5)), "s": (F32, (2,))})
    assert "scale has shape [2]" in message and "[C1]" in message


def _conv(name="cg", outputs=("dx", "dw", "db"), **attrs):
    return helper.make_node("ConvGrad", ["dy", "x", "w"], list(outputs), domain=MS, name=name, **attrs)


def test_error_conv_grad_c1_rank():
    message = _error(_conv(), {"dy": (F32, (2, 4, 5)), "x": (F32, (2, 3, 5, 5)), "w": (F32, (4, 3, 1, 1))})
    assert "must share one rank" in message and "[C1]" in message


@pytest.mark.parametrize("attrs, x, w, fragment", [
    ({"group": 2}, (2, 3, 5, 5), (4, 1, 3, 3), "X has 3 channels"),
    ({"group": 2}, (2, 4, 5, 5), (3, 2, 3, 3), "W has 3 output channels"),
    ({"group": 2}, (2, 4, 5, 5), (4, 4, 3, 3), "expected axis 1 = C/group"),
    ({"group": 0}, (2, 4, 5, 5), (4, 4, 3, 3), "group is 0"),
])
def test_error_conv_grad_c2_groups(attrs, x, w, fragment):
    message = _error(_conv(**attrs), {"dy": (F32, None), "x": (F32, x), "w": (F32, w)})
    assert fragment in message and "[C2]" in message


@pytest.mark.parametrize("attrs, fragment", [
    ({"strides": [1]}, "strides has 1 entries"),
    ({"pads": [1, 1]}, "pads has 2 entries"),
    ({"dilations": [1, 0]}, "every entry must be >= 1"),
    ({"kernel_shape": [3, 2]}, "kernel_shape is [3, 2] but W's spatial shape is [3,3]"),
])
def test_error_conv_grad_c3_attributes(attrs, fragment):
    message = _error(_conv(**attrs), {"dy": (F32, None), "x": (F32, (2, 3, 5, 5)), "w": (F32, (4, 3, 3, 3))})
    assert fragment in message and "[C3]" in message


def test_error_conv_grad_c4_dy_shape():
    message = _error(_conv(strides=[2, 2], pads=[1, 1, 1, 1]),
                     {"dy": (F32, (2, 4, 4, 3)), "x": (F32, (2, 3, 8, 8)), "w": (F32, (4, 3, 3, 3))})
    assert "dY has shape [2,4,4,3]; expected [2,4,4,4]" in message and "[C4]" in message


def test_error_conv_grad_c5_declared_output_shape():
    model = one_node_model(_conv(), [("dy", F32, [2, 4, 3, 3]), ("x", F32, [2, 3, 5, 5]), ("w", F32, [4, 3, 3, 3])],
                           [("dx", F32, [2, 3, 5, 5]), ("dw", F32, [4, 3, 3, 2]), ("db", F32, [4])])
    with pytest.raises(VerificationError, match=r"dW \('dw'\) is declared with shape \[4,3,3,2\]"):
        lower_model(model)


def test_error_conv_grad_c6_same_padding():
    message = _error(_conv(auto_pad="SAME_UPPER"), {"dy": (F32, None), "x": (F32, (2, 3, 5, 5)),
                                                     "w": (F32, (4, 3, 3, 3))})
    assert "auto_pad is 'SAME_UPPER'" in message and "[C6]" in message


def _sce(inputs=("dy", "lp", "label"), **attrs):
    return helper.make_node("SoftmaxCrossEntropyLossGrad", list(inputs), ["dl"], domain=MS, name="sce", **attrs)


def test_error_sce_grad_c1_label_shape():
    message = _error(_sce(), {"dy": (F32, ()), "lp": (F32, (4, 5, 3)), "label": (I64, (4, 5))})
    assert "label has shape [4,5]; expected [4,3]" in message and "[C1]" in message


def test_error_sce_grad_c1_rank():
    message = _error(_sce(), {"dy": (F32, ()), "lp": (F32, (5,)), "label": (I64, (5,))})
    assert "log_prob has rank 1" in message


def test_error_sce_grad_c2_weight_shape():
    message = _error(_sce(("dy", "lp", "label", "w")), {"dy": (F32, ()), "lp": (F32, (4, 5)), "label": (I64, (4,)),
                                                        "w": (F32, (4,))})
    assert "weight has shape [4]; expected [5]" in message and "[C2]" in message


@pytest.mark.parametrize("reduction, dy, fragment", [
    ("none", (3,), "with reduction 'none' expected [4]"),
    ("mean", (4,), "with reduction 'mean' expected a scalar"),
])
def test_error_sce_grad_c3_dy_shape(reduction, dy, fragment):
    message = _error(_sce(reduction=reduction), {"dy": (F32, dy), "lp": (F32, (4, 5)), "label": (I64, (4,))})
    assert fragment in message and "[C3]" in message


def test_error_sce_grad_label_type():
    message = _error(_sce(), {"dy": (F32, ()), "lp": (F32, (4, 5)), "label": (F32, (4,))})
    assert "label has element type f32" in message


def test_error_sce_grad_unknown_reduction():
    message = _error(_sce(reduction="avg"), {"dy": (F32, ()), "lp": (F32, (4, 5)), "label": (I64, (4,))})
    assert "attribute 'reduction' is 'avg'" in message


# -- lowering against the float64 reference ----------------------------------------------------------------

@pytest.mark.parametrize("elem, opset", [(F32, 12), (F32, 17), (F16, 12), (F16, 17), (BF16, 17), (F64, 12)])
def test_relu_grad_lowering(elem, opset):  # bf16 is no type of opset 12
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 5)).astype(NP[elem])
    x[0, 0, :2] = 0  # exactly zero passes no gradient
    dy = rng.standard_normal((3, 4, 5)).astype(NP[elem])
    model = one_node_model(helper.make_node("ReluGrad", ["dy", "x"], ["dx"], domain=MS, name="rg"),
                           [("dy", elem, [3, 4, 5]), ("x", elem, [3, 4, 5])], [("dx", elem, [3, 4, 5])], opset)
    close(lowered_outputs(model, {"dy": dy, "x": x})["dx"], ref.relu_grad(dy, x), elem, "dX")


@pytest.mark.parametrize("scale_down", [0, 1])
@pytest.mark.parametrize("elem, scale_elem, scale_shape", [(F32, F32, [1]), (F32, F32, []), (F16, F32, [1]),
                                                           (F64, F64, [1, 1]), (F32, I64, []), (F16, I32, [1])])
def test_scale_lowering(scale_down, elem, scale_elem, scale_shape):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3)).astype(NP[elem])
    s = np.full(scale_shape, 0.37 if scale_elem in (F32, F16, F64) else 49, NP[scale_elem])  # an int: a count
    model = one_node_model(helper.make_node("Scale", ["x", "s"], ["y"], domain=MS, name="sc", scale_down=scale_down),
                           [("x", elem, [2, 3]), ("s", scale_elem, scale_shape)], [("y", elem, [2, 3])], 12)
    close(lowered_outputs(model, {"x": x, "s": s})["y"], ref.scale(x, s, scale_down), elem, "output")


CONV_CASES = [  # (X shape, W shape, attributes)
    ((2, 3, 9), (4, 3, 3), {"strides": [2], "pads": [1, 1]}),
    ((2, 4, 7, 6), (6, 2, 3, 2), {"group": 2, "strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 0, 1]}),
    ((2, 3, 8, 8), (5, 3, 3, 3), {"strides": [3, 3], "auto_pad": "VALID"}),
    ((2, 4, 6, 6), (4, 1, 3, 3), {"group": 4, "pads": [1, 1, 1, 1]}),  # depthwise
    ((2, 3, 5, 5), (4, 3, 1, 1), {}),
    ((1, 4, 5, 6, 7), (4, 1, 3, 3, 2), {"group": 4, "strides": [2, 2, 3], "pads": [1, 0, 1, 0, 1, 1]}),
    ((2, 2, 6, 5, 4), (3, 2, 2, 2, 2), {"dilations": [2, 1, 2], "kernel_shape": [2, 2, 2]}),
]


def _conv_case(x_shape, w_shape, attrs, elem=F32, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(NP[elem])
    w = rng.standard_normal(w_shape).astype(NP[elem])
    geometry = {k: attrs.get(k) for k in ("strides", "dilations", "pads")}
    y = ref.conv(x, w, group=attrs.get("group", 1), **geometry)
    dy = rng.standard_normal(y.shape).astype(NP[elem])
    return x, w, dy, ref.conv_grad(dy, x, w, group=attrs.get("group", 1), **geometry)


@pytest.mark.parametrize("opset", [12, 17])
@pytest.mark.parametrize("x_shape, w_shape, attrs", CONV_CASES)
def test_conv_grad_lowering(x_shape, w_shape, attrs, opset):
    x, w, dy, (dx, dw, db) = _conv_case(x_shape, w_shape, attrs)
    model = one_node_model(_conv(**attrs), [("dy", F32, list(dy.shape)), ("x", F32, list(x_shape)),
                                            ("w", F32, list(w_shape))],
                           [("dx", F32, list(x_shape)), ("dw", F32, list(w_shape)), ("db", F32, [w_shape[0]])], opset)
    got = lowered_outputs(model, {"dy": dy, "x": x, "w": w})
    close(got["dx"], dx, F32, "dX")
    close(got["dw"], dw, F32, "dW")
    close(got["db"], db, F32, "dB")


@pytest.mark.parametrize("outputs", [("", "dw", ""), ("dx", "dw", ""), ("dx", "", "db"), ("dx",)])
def test_conv_grad_without_some_outputs(outputs):
    x_shape, w_shape, attrs = CONV_CASES[1]
    x, w, dy, expected = _conv_case(x_shape, w_shape, attrs)
    declared = {"dx": list(x_shape), "dw": list(w_shape), "db": [w_shape[0]]}
    model = one_node_model(_conv(outputs=outputs, **attrs),
                           [("dy", F32, list(dy.shape)), ("x", F32, list(x_shape)), ("w", F32, list(w_shape))],
                           [(o, F32, declared[o]) for o in outputs if o])
    lowered = lower_model(model)
    got = run_model(lowered, {"dy": dy, "x": x, "w": w})
    for name, want in zip(("dx", "dw", "db"), expected, strict=True):
        if name in outputs:
            close(got[name], want, F32, name)
    # dB alone needs no Conv; dX alone no Conv (only its ConvTranspose)
    ops = [n.op_type for n in lowered.graph.node]
    assert ("Conv" in ops) == ("dw" in outputs)
    assert ("ConvTranspose" in ops) == ("dx" in outputs)


@pytest.mark.parametrize("elem", [F16, F64])
def test_conv_grad_other_types(elem):
    x_shape, w_shape, attrs = CONV_CASES[1]
    x, w, dy, (dx, dw, db) = _conv_case(x_shape, w_shape, attrs, elem)
    model = one_node_model(_conv(**attrs), [("dy", elem, list(dy.shape)), ("x", elem, list(x_shape)),
                                            ("w", elem, list(w_shape))],
                           [("dx", elem, list(x_shape)), ("dw", elem, list(w_shape)), ("db", elem, [w_shape[0]])])
    got = lowered_outputs(model, {"dy": dy, "x": x, "w": w})
    for name, want in zip(("dx", "dw", "db"), (dx, dw, db), strict=True):
        assert got[name].dtype == NP[elem]
        close(got[name], want, F32 if elem == F64 else F16, name)  # f64 is computed in f32 (no f64 Conv)


def test_conv_grad_symbolic_batch():
    x_shape, w_shape, attrs = CONV_CASES[1]
    x, w, dy, (dx, dw, db) = _conv_case(x_shape, w_shape, attrs)
    model = one_node_model(_conv(**attrs), [("dy", F32, ["N", *dy.shape[1:]]), ("x", F32, ["N", *x_shape[1:]]),
                                            ("w", F32, list(w_shape))],
                           [("dx", F32, ["N", *x_shape[1:]]), ("dw", F32, list(w_shape)), ("db", F32, [w_shape[0]])])
    got = lowered_outputs(model, {"dy": dy, "x": x, "w": w})
    close(got["dx"], dx, F32, "dX")
    close(got["dw"], dw, F32, "dW")


def test_conv_grad_unknown_spatial_size_with_stride_is_a_lowering_error():
    model = one_node_model(_conv(strides=[2, 2]), [("dy", F32, [2, 4, "H", "W"]), ("x", F32, [2, 3, "h", "w"]),
                                                   ("w", F32, [4, 3, 3, 3])], [("dx", F32, None)])
    with pytest.raises(LoweringError, match=r"ConvGrad 'cg': dX needs X's spatial size on axis 2 with stride 2"):
        lower_model(model)


SCE_CASES = [  # (log_prob shape, reduction, with weight, ignore_index, label type)
    ((4, 5), "mean", False, None, I64),
    ((4, 5), "sum", True, None, I64),
    ((4, 5), "none", False, 2, I32),
    ((6, 3), "mean", True, -100, I64),
    ((3, 4, 2, 2), "mean", True, 1, I64),
    ((3, 4, 5), "none", True, -1, I32),
    ((2, 3, 4), "sum", False, 0, I64),
]


def _sce_case(shape, reduction, weighted, ignore_index, seed=4):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal(shape)
    label = rng.integers(0, shape[1], (shape[0], *shape[2:]))
    if ignore_index is not None:
        label.flat[0] = label.flat[-1] = ignore_index
    weight = rng.random(shape[1]) + 0.1 if weighted else None
    loss, log_prob = ref.softmax_cross_entropy_loss(scores, label, weight, reduction=reduction,
                                                    ignore_index=ignore_index)
    dy = rng.standard_normal(loss.shape) if reduction == "none" else np.array(1.7)
    return scores, label, weight, log_prob, dy


def sce_node_case(shape, reduction, weighted, ignore_index, label_type=I64):
    """A one-node SoftmaxCrossEntropyLossGrad case in f32: (attributes, [(input, elem, shape)], feeds, the
    float64 d_logits); inputs dy, lp, label and, when weighted, w."""
    _, label, weight, log_prob, dy = _sce_case(shape, reduction, weighted, ignore_index)
    attrs = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    inputs = [("dy", F32, list(dy.shape)), ("lp", F32, list(shape)), ("label", label_type, list(label.shape))]
    feeds = {"dy": dy.astype(np.float32), "lp": log_prob.astype(np.float32), "label": label.astype(NP[label_type])}
    if weighted:
        inputs.append(("w", F32, [shape[1]]))
        feeds["w"] = weight.astype(np.float32)
    want = ref.softmax_cross_entropy_loss_grad(dy, log_prob, label, weight, reduction=reduction,
                                               ignore_index=ignore_index)
    return attrs, inputs, feeds, want


@pytest.mark.parametrize("opset", [12, 17])
@pytest.mark.parametrize("shape, reduction, weighted, ignore_index, label_type", SCE_CASES)
def test_sce_grad_lowering(shape, reduction, weighted, ignore_index, label_type, opset):
    attrs, inputs, feeds, want = sce_node_case(shape, reduction, weighted, ignore_index, label_type)
    model = one_node_model(_sce(tuple(n for n, _, _ in inputs), **attrs), inputs, [("dl", F32, list(shape))], opset)
    close(lowered_outputs(model, feeds)["dl"], want, F32, "d_logits")


def test_sce_grad_mean_with_every_label_ignored_leaves_dy_undivided():
    log_prob = np.log(np.full((2, 3), 1 / 3))
    label = np.array([1, 1])
    model = one_node_model(_sce(ignore_index=1), [("dy", F32, []), ("lp", F32, [2, 3]), ("label", I64, [2])],
                           [("dl", F32, [2, 3])])
    got = lowered_outputs(model, {"dy": np.array(2.0, np.float32), "lp": log_prob.astype(np.float32),
                                  "label": label})["dl"]
    assert np.all(np.isfinite(got)) and np.all(got == 0)


# -- the references against finite differences of the forward ops ------------------------------------------

@pytest.mark.parametrize("x_shape, w_shape, attrs", [CONV_CASES[0], CONV_CASES[1], CONV_CASES[5]])
def test_conv_grad_reference_matches_finite_differences(x_shape, w_shape, attrs):
    x, w, dy, (dx, dw, db) = _conv_case(x_shape, w_shape, attrs, F64)
    geometry = {k: attrs.get(k) for k in ("strides", "dilations", "pads")}
    group = attrs.get("group", 1)
    b0 = np.zeros(w_shape[0])
    loss = {  # <dY, conv(X, W) + B> as a function of each argument
        "x": lambda v: np.sum(dy * ref.conv(v, w, group=group, **geometry)),
        "w": lambda v: np.sum(dy * ref.conv(x, v, group=group, **geometry)),
        "b": lambda v: np.sum(dy * ref.conv(x, w, v, group=group, **geometry)),
    }
    for name, at, grad in (("x", x, dx), ("w", w, dw), ("b", b0, db)):
        for v, numeric in numeric_gradient(loss[name], at):
            assert abs(np.sum(grad * v) - numeric) <= 1e-6 * max(1.0, abs(numeric)), name


@pytest.mark.parametrize("shape, reduction, weighted, ignore_index, label_type", SCE_CASES)
def test_sce_grad_reference_matches_finite_differences(shape, reduction, weighted, ignore_index, label_type):
    scores, label, weight, log_prob, dy = _sce_case(shape, reduction, weighted, ignore_index)
    d_logits = ref.softmax_cross_entropy_loss_grad(dy, log_prob, label, weight, reduction=reduction,
                                                   ignore_index=ignore_index)

    def loss(s):
        return np.sum(dy * ref.softmax_cross_entropy_loss(s, label, weight, reduction=reduction,
                                                          ignore_index=ignore_index)[0])

    for v, numeric in numeric_gradient(loss, scores):
        assert abs(np.sum(d_logits * v) - numeric) <= 1e-7 * max(1.0, abs(numeric))


def test_relu_grad_and_scale_references_match_finite_differences():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 6))
    x[np.abs(x) < 1e-3] = 0.5  # away from the kink
    dy = rng.standard_normal((4, 6))
    for v, numeric in numeric_gradient(lambda z: np.sum(dy * np.maximum(z, 0)), x):
        assert abs(np.sum(ref.relu_grad(dy, x) * v) - numeric) <= 1e-7
    s = np.array([0.3])
    for down in (0, 1):
        forward = (lambda z: np.sum(dy * z / s)) if down else (lambda z: np.sum(dy * z * s))
        # Scale is linear in its input: its gradient is Scale of dY with the same factor
        for v, numeric in numeric_gradient(forward, x):
            assert abs(np.sum(ref.scale(dy, s, down) * v) - numeric) <= 1e-6 * max(1.0, abs(numeric))


def draw_conv_geometry(data) -> tuple[tuple[int, ...], tuple[int, ...], dict]:
    """A legal ConvGrad geometry drawn by hypothesis: (X shape, W shape, attributes) with 1-3 spatial axes,
    groups, strides, dilations and (asymmetric) pads, X big enough for one window."""
    spatial = data.draw(st.integers(1, 3), "spatial axes")
    group = data.draw(st.sampled_from([1, 2, 3]), "group")
    per_group_in, per_group_out = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    kernel = [data.draw(st.integers(1, 3)) for _ in range(spatial)]
    dilations = [data.draw(st.integers(1, 2)) for _ in range(spatial)]
    strides = [data.draw(st.integers(1, 3)) for _ in range(spatial)]
    pads = [data.draw(st.integers(0, 2)) for _ in range(2 * spatial)]
    sizes = []
    for a in range(spatial):
        span = dilations[a] * (kernel[a] - 1) + 1
        sizes.append(data.draw(st.integers(max(1, span - pads[a] - pads[a + spatial]), span + 4)))
    attrs = {"group": group, "strides": strides, "dilations": dilations, "pads": pads}
    return (2, group * per_group_in, *sizes), (group * per_group_out, per_group_in, *kernel), attrs


@given(st.data())
def test_conv_grad_lowering_over_random_geometry(data):
    """Any legal geometry: 1-3 spatial axes, groups, strides, dilations and (asymmetric) pads."""
    x_shape, w_shape, attrs = draw_conv_geometry(data)
    group = attrs["group"]
    x, w, dy, (dx, dw, db) = _conv_case(x_shape, w_shape, attrs)
    model = one_node_model(_conv(**attrs), [("dy", F32, list(dy.shape)), ("x", F32, list(x_shape)),
                                            ("w", F32, list(w_shape))],
                           [("dx", F32, list(x_shape)), ("dw", F32, list(w_shape)), ("db", F32, [w_shape[0]])])
    got = lowered_outputs(model, {"dy": dy, "x": x, "w": w})
    # f32 sums that cancel: bound the error by the sum of the terms' magnitudes, not by the result
    geometry = {k: attrs[k] for k in ("strides", "dilations", "pads")}
    magnitudes = ref.conv_grad(np.abs(dy), np.abs(x), np.abs(w), group=group, **geometry)
    for name, want, size in zip(("dx", "dw", "db"), (dx, dw, db), magnitudes, strict=True):
        assert np.all(np.abs(got[name] - want) <= 1e-6 * size + 1e-30), name


@pytest.mark.parametrize("elem", [F16, BF16, F64])
def test_sce_grad_other_types(elem):
    shape, reduction, weighted, ignore_index, _ = SCE_CASES[3]
    _, label, weight, log_prob, dy = _sce_case(shape, reduction, weighted, ignore_index)
    inputs = [("dy", elem, []), ("lp", elem, list(shape)), ("label", I64, list(label.shape)), ("w", elem, [shape[1]])]
    feeds = {"dy": dy.astype(NP[elem]), "lp": log_prob.astype(NP[elem]), "label": label, "w": weight.astype(NP[elem])}
    model = one_node_model(_sce(("dy", "lp", "label", "w"), reduction=reduction, ignore_index=ignore_index), inputs,
                           [("dl", elem, list(shape))])
    want = ref.softmax_cross_entropy_loss_grad(feeds["dy"], feeds["lp"], label, feeds["w"], reduction=reduction,
                                               ignore_index=ignore_index)
    close(lowered_outputs(model, feeds)["dl"], want, elem, "d_logits")
