"""onnxruntime-training's MaxPoolGrad and AveragePoolGrad: default-domain ops that are no standard ONNX.

Recognised by (domain "", op_type) from their ``since_opset`` on; every standard op stays as it is and a
default-domain name that is neither standard nor bound is an error. Lowered against the float64 reference of
runtime.reference_training (opsets 12 to 17: below 16 MaxPoolGrad has no summing scatter), checked by
onnx.checker full_check and run in onnxruntime; the reference against finite differences of the forward pool;
the MaxPool reference's indices against onnxruntime's own MaxPool.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper
from test_training_grads import SPECS, close, numeric_gradient  # noqa: E402  (tests/ is on the path)

from lowering.passes import lower_model
from opdef import load_schemas, register_onnx_schemas
from opdef.errors import LoweringError, VerificationError
from opdef.node import TensorType
from opdef.parse import parse_spec
from opdef.verify import infer_node
from runtime import reference_training as ref
from runtime.session import run_model

TRAINING_SPECS = SPECS.parent / "onnx.training"
F32, I64 = TensorProto.FLOAT, TensorProto.INT64
vi = helper.make_tensor_value_info


def _output_size(size, kernel, stride, begin, end, ceil_mode):
    return (math.ceil if ceil_mode else math.floor)((size + begin + end - kernel) / stride) + 1


def _case(x_shape, kernel, strides, pads, ceil_mode=0, seed=7):
    k = len(x_shape) - 2
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape)
    out = [_output_size(x_shape[2 + a], kernel[a], strides[a], pads[a], pads[a + k], ceil_mode) for a in range(k)]
    return x, out, rng


def _model(node, inputs, dx_shape, opset):
    graph = helper.make_graph([node], "g", [vi(n, t, s) for n, t, s in inputs], [vi("dx", F32, dx_shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _run(model, feeds):
    lowered = lower_model(model)
    onnx.checker.check_model(lowered, full_check=True)
    assert all(n.domain in ("", "ai.onnx") and n.op_type not in ("MaxPoolGrad", "AveragePoolGrad")
               for n in lowered.graph.node)
    return lowered, run_model(lowered, feeds)["dx"]


# -- schemas and recognition ------------------------------------------------------------------------------

def test_pool_grad_schemas_keep_the_default_domain():
    registry = load_schemas()
    for op in ("MaxPoolGrad", "AveragePoolGrad"):
        entry = registry.get("", op)
        assert entry.schema.domain == "" and entry.binding.since_opset == 9
    s = parse_spec(TRAINING_SPECS / "MaxPoolGrad.rst")
    assert [a.name for a in s.inputs] == ["dY", "Indices"] and [a.name for a in s.outputs] == ["dX"]
    t = {a.name: a.type_var for a in (*s.inputs, *s.outputs)}
    assert t["dY"] == t["dX"] != t["Indices"]
    assert {dict(c)[t["Indices"]] for c in s.type_combinations} == {"s64"}
    s = parse_spec(TRAINING_SPECS / "AveragePoolGrad.rst")
    attrs = {a.name: a for a in s.attributes}
    assert attrs["kernel_shape"].required and attrs["kernel_shape"].type == "s64[]"
    assert (attrs["count_include_pad"].default, attrs["ceil_mode"].default) == (0, 0)


def test_default_domain_recognition():
    registry = load_schemas()
    assert registry.handles("", "MaxPoolGrad", 12) and registry.handles("ai.onnx", "AveragePoolGrad", 17)
    assert not registry.handles("", "MaxPoolGrad", 8)  # onnxruntime has it from opset 9
    assert not registry.handles("", "MaxPool", 17) and not registry.handles("", "Relu", 12)
    assert registry.handles("", "NoSuchOpGrad", 17)  # reported by verification, never passed through
    assert "" not in registry.domains


def test_unknown_default_domain_op_is_an_error():
    node = helper.make_node("NoSuchOpGrad", ["dy"], ["dx"], name="mystery")
    with pytest.raises(VerificationError, match=r"'mystery': unknown op type 'NoSuchOpGrad': no standard ONNX op"):
        lower_model(_model(node, [("dy", F32, [2, 3])], [2, 3], 17))


def test_standard_ops_are_left_alone_byte_identical():
    x, out, rng = _case((2, 3, 6, 6), [2, 2], [2, 2], [0, 0, 0, 0])
    nodes = [helper.make_node("MaxPool", ["x"], ["y", "ind"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Relu", ["y"], ["dy"], name="relu"),
             helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="pool_grad", kernel_shape=[2, 2],
                              strides=[2, 2])]
    graph = helper.make_graph(nodes, "g", [vi("x", F32, [2, 3, 6, 6])], [vi("dx", F32, [2, 3, 6, 6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    lowered, got = _run(model, {"x": x.astype(np.float32)})
    assert [n.SerializeToString() for n in lowered.graph.node[:2]] == [n.SerializeToString() for n in nodes[:2]]
    y, indices = ref.max_pool(x.astype(np.float32), [2, 2], [2, 2], [0, 0, 0, 0], out)
    close(got, ref.max_pool_grad(np.maximum(y, 0), indices, x.shape), F32, "dX")


def test_unlowered_model_passes_onnx_checker_with_the_registered_schemas():
    register_onnx_schemas()
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", kernel_shape=[2, 2], strides=[2, 2])
    onnx.checker.check_model(_model(node, [("dy", F32, [2, 3, 3, 3])], [2, 3, 6, 6], 12), full_check=True)


# -- constraints -------------------------------------------------------------------------------------------

def _verify_error(node, types):
    with pytest.raises(VerificationError) as info:
        infer_node(node, {k: TensorType(t, s) for k, (t, s) in types.items()})
    message = str(info.value)
    assert "\n" not in message and f"'{node.name}'" in message
    return message


def test_error_max_pool_grad_c1_indices_shape():
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg")
    message = _verify_error(node, {"dy": (F32, (2, 3, 4, 4)), "ind": (I64, (2, 3, 4, 5))})
    assert "Indices has shape [2,3,4,5]; expected [2,3,4,4]" in message and "[C1]" in message


def test_error_max_pool_grad_indices_type():
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg")
    assert "Indices has element type s32" in _verify_error(node, {"dy": (F32, (2, 3, 4, 4)),
                                                                  "ind": (TensorProto.INT32, (2, 3, 4, 4))})


def test_error_max_pool_grad_c3_attribute_length():
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg", kernel_shape=[2])
    message = _verify_error(node, {"dy": (F32, (2, 3, 4, 4)), "ind": (I64, (2, 3, 4, 4))})
    assert "kernel_shape has 1 entries" in message and "[C3]" in message


def test_error_average_pool_grad_c1_rank():
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", kernel_shape=[2, 2, 2, 2])
    message = _verify_error(node, {"dy": (F32, (1, 2, 3, 3, 3, 3))})
    assert "dY has rank 6" in message and "[C1]" in message


def test_error_average_pool_grad_c3_dilations():
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", kernel_shape=[2, 2], dilations=[2, 1])
    message = _verify_error(node, {"dy": (F32, (1, 2, 3, 3))})
    assert "dilations is [2, 1]" in message and "[C3]" in message


def test_error_average_pool_grad_c4_same_padding():
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", kernel_shape=[2, 2], auto_pad="SAME_UPPER")
    message = _verify_error(node, {"dy": (F32, (1, 2, 3, 3))})
    assert "auto_pad is 'SAME_UPPER'" in message and "[C4]" in message


def test_error_average_pool_grad_missing_kernel_shape():
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg")
    assert "required attribute 'kernel_shape'" in _verify_error(node, {"dy": (F32, (1, 2, 3, 3))})


def test_undeclared_dx_shape_is_a_lowering_error():
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg", kernel_shape=[2, 2], strides=[2, 2])
    model = _model(node, [("dy", F32, [2, 3, 2, 2]), ("ind", I64, [2, 3, 2, 2])], [2, 3, "H", "W"], 17)
    with pytest.raises(LoweringError, match=r"MaxPoolGrad 'mpg': the graph must declare dX's spatial dims"):
        lower_model(model)


def test_max_pool_grad_below_opset_16_without_kernel_shape_is_a_lowering_error():
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg")
    model = _model(node, [("dy", F32, [2, 3, 2, 2]), ("ind", I64, [2, 3, 2, 2])], [2, 3, 4, 4], 15)
    with pytest.raises(LoweringError, match=r"'mpg': the model's default opset is below 16 .*\(opset 16\)"):
        lower_model(model)


# -- lowering against the float64 reference ----------------------------------------------------------------

POOL_CASES = [  # (X shape, kernel, strides, pads, ceil_mode)
    ((2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1], 0),  # overlapping windows (ResNet's stem pool)
    ((2, 3, 8, 8), [2, 2], [2, 2], [0, 0, 0, 0], 0),
    ((2, 2, 9), [3], [1], [1, 1], 0),
    ((2, 2, 9), [3], [2], [1, 0], 0),
    ((1, 2, 5, 6, 4), [2, 3, 2], [1, 2, 2], [0, 1, 0, 1, 0, 0], 0),
    ((2, 3, 7, 7), [3, 3], [2, 2], [0, 0, 0, 0], 1),
]


@pytest.mark.parametrize("opset", [12, 15, 16, 17])
@pytest.mark.parametrize("x_shape, kernel, strides, pads, ceil_mode", POOL_CASES)
def test_max_pool_grad_lowering(x_shape, kernel, strides, pads, ceil_mode, opset):
    x, out, rng = _case(x_shape, kernel, strides, pads, ceil_mode)
    y, indices = ref.max_pool(x, kernel, strides, pads, out)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg", kernel_shape=kernel, strides=strides,
                            pads=pads, ceil_mode=ceil_mode)
    model = _model(node, [("dy", F32, list(dy.shape)), ("ind", I64, list(dy.shape))], list(x_shape), opset)
    lowered, got = _run(model, {"dy": dy, "ind": indices})
    close(got, ref.max_pool_grad(dy, indices, x_shape), F32, "dX")
    assert any(a.name == "reduction" for n in lowered.graph.node for a in n.attribute) == (opset >= 16)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("x_shape, kernel, strides, pads, ceil_mode", POOL_CASES)
def test_average_pool_grad_lowering(x_shape, kernel, strides, pads, ceil_mode, count_include_pad):
    x, out, rng = _case(x_shape, kernel, strides, pads, ceil_mode)
    dy = rng.standard_normal((*x_shape[:2], *out)).astype(np.float32)
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", kernel_shape=kernel, strides=strides,
                            pads=pads, ceil_mode=ceil_mode, count_include_pad=count_include_pad)
    model = _model(node, [("dy", F32, list(dy.shape))], list(x_shape), 12 if ceil_mode else 17)
    _, got = _run(model, {"dy": dy})
    close(got, ref.average_pool_grad(dy, x_shape, kernel, strides, pads, count_include_pad), F32, "dX")


def test_max_pool_grad_symbolic_batch():
    x_shape, kernel, strides, pads, _ = POOL_CASES[0]
    x, out, rng = _case(x_shape, kernel, strides, pads)
    y, indices = ref.max_pool(x, kernel, strides, pads, out)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg", kernel_shape=kernel, strides=strides,
                            pads=pads)
    model = _model(node, [("dy", F32, ["N", *dy.shape[1:]]), ("ind", I64, ["N", *dy.shape[1:]])],
                   ["N", *x_shape[1:]], 12)
    close(_run(model, {"dy": dy, "ind": indices})[1], ref.max_pool_grad(dy, indices, x_shape), F32, "dX")


# -- the references ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape, kernel, strides, pads, ceil_mode", POOL_CASES[:2])
def test_max_pool_reference_matches_onnxruntime_max_pool(x_shape, kernel, strides, pads, ceil_mode):
    x, out, _ = _case(x_shape, kernel, strides, pads, ceil_mode)
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=kernel, strides=strides, pads=pads)
    graph = helper.make_graph([node], "g", [vi("x", F32, list(x_shape))], [vi("y", F32, None), vi("i", I64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    y, indices = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.astype(np.float32)})
    want_y, want_indices = ref.max_pool(x.astype(np.float32), kernel, strides, pads, out)
    assert np.array_equal(indices, want_indices) and np.allclose(y, want_y)


@pytest.mark.parametrize("x_shape, kernel, strides, pads, ceil_mode", POOL_CASES)
def test_pool_grad_references_match_finite_differences(x_shape, kernel, strides, pads, ceil_mode):
    x, out, rng = _case(x_shape, kernel, strides, pads, ceil_mode)
    y, indices = ref.max_pool(x, kernel, strides, pads, out)
    dy = rng.standard_normal(y.shape)
    dx = ref.max_pool_grad(dy, indices, x_shape)
    # the max picks one element per window; small steps keep every pick (random data has no ties)
    for v, numeric in numeric_gradient(lambda z: np.sum(dy * ref.max_pool(z, kernel, strides, pads, out)[0]), x,
                                       eps=1e-7):
        assert abs(np.sum(dx * v) - numeric) <= 1e-6 * max(1.0, abs(numeric))
    for include in (0, 1):
        dx = ref.average_pool_grad(dy, x_shape, kernel, strides, pads, include)
        forward = lambda z, include=include: np.sum(dy * ref.average_pool(z, kernel, strides, pads, out, include))  # noqa: E731
        for v, numeric in numeric_gradient(forward, x):
            assert abs(np.sum(dx * v) - numeric) <= 1e-7 * max(1.0, abs(numeric))


def test_cli_lower_refuses_an_unknown_default_domain_op(tmp_path, capsys):
    from lowering.cli import main

    node = helper.make_node("NoSuchOpGrad", ["dy"], ["dx"], name="mystery")
    source, target = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(_model(node, [("dy", F32, [2, 3])], [2, 3], 17), source)
    assert main(["lower", str(source), "-o", str(target)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'mystery': unknown op type 'NoSuchOpGrad'" in err
    assert not target.exists()


def test_cli_check_lists_the_pool_gradients(tmp_path, capsys):
    from lowering.cli import main

    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", kernel_shape=[2, 2], strides=[2, 2])
    source = tmp_path / "m.onnx"
    onnx.save(_model(node, [("dy", F32, [2, 3, 3, 3])], [2, 3, 6, 6], 12), source)
    assert main(["check", str(source)]) == 0
    out = capsys.readouterr().out
    assert "AveragePoolGrad 'apg'" in out and "f32 [2,3,6,6]" in out


@given(st.data())
def test_pool_grads_over_random_geometry(data):
    """Any legal window geometry, 1-3 spatial axes, both roundings, both opset paths of MaxPoolGrad."""
    spatial = data.draw(st.integers(1, 3), "spatial axes")
    kernel = [data.draw(st.integers(1, 3)) for _ in range(spatial)]
    strides = [data.draw(st.integers(1, 3)) for _ in range(spatial)]
    pads = [data.draw(st.integers(0, k - 1)) for k in kernel] + [data.draw(st.integers(0, k - 1)) for k in kernel]
    sizes = [data.draw(st.integers(kernel[a], kernel[a] + 5)) for a in range(spatial)]
    ceil_mode = data.draw(st.integers(0, 1), "ceil_mode")
    x_shape = (2, 2, *sizes)
    x, out, rng = _case(x_shape, kernel, strides, pads, ceil_mode)
    # ONNX: with ceil_mode a last window that would start in the end padding is dropped
    out = [o - 1 if ceil_mode and (o - 1) * s >= size + begin else o
           for o, s, size, begin in zip(out, strides, sizes, pads[:spatial], strict=True)]
    y, indices = ref.max_pool(x, kernel, strides, pads, out)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    attrs = {"kernel_shape": kernel, "strides": strides, "pads": pads, "ceil_mode": ceil_mode}
    opset = data.draw(st.sampled_from([12, 17]), "opset")
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg", **attrs)
    model = _model(node, [("dy", F32, list(dy.shape)), ("ind", I64, list(dy.shape))], list(x_shape), opset)
    close(_run(model, {"dy": dy, "ind": indices})[1], ref.max_pool_grad(dy, indices, x_shape), F32, "MaxPoolGrad")
    include = data.draw(st.integers(0, 1), "count_include_pad")
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", count_include_pad=include, **attrs)
    model = _model(node, [("dy", F32, list(dy.shape))], list(x_shape), opset)
    close(_run(model, {"dy": dy})[1], ref.average_pool_grad(dy, x_shape, kernel, strides, pads, include), F32,
          "AveragePoolGrad")


def test_default_domain_schemas_are_registered_from_their_since_opset():
    register_onnx_schemas()
    assert onnx.defs.get_schema("MaxPoolGrad", 17, "").since_version == 9
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg")
    model = _model(node, [("dy", F32, [2, 3, 2, 2]), ("ind", I64, [2, 3, 2, 2])], [2, 3, 4, 4], 8)
    model.ir_version = 4
    with pytest.raises(onnx.checker.ValidationError, match="MaxPoolGrad"):
        onnx.checker.check_model(model)


def test_average_pool_grad_dy_that_is_no_forward_output_is_a_lowering_error():
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", kernel_shape=[2, 2], strides=[2, 2])
    model = _model(node, [("dy", F32, [2, 3, 4, 3])], [2, 3, 6, 6], 17)
    with pytest.raises(LoweringError, match=r"'apg': dY has 4 positions on axis 2; the forward output of dX's 6 "
                                            r"with kernel 2, stride 2 and pads 0\+0 has 3"):
        lower_model(model)


def test_max_pool_grad_symbolic_spatial_dims_below_opset_16():
    """dY's spatial sizes unknown: every window group is emitted, empty ones included (1 output, 2 groups)."""
    x, out, rng = _case((2, 3, 3, 3), [3, 3], [2, 2], [0, 0, 0, 0])
    y, indices = ref.max_pool(x, [3, 3], [2, 2], [0, 0, 0, 0], out)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg", kernel_shape=[3, 3], strides=[2, 2])
    model = _model(node, [("dy", F32, ["N", 3, "h", "w"]), ("ind", I64, ["N", 3, "h", "w"])], ["N", 3, 3, 3], 12)
    close(_run(model, {"dy": dy, "ind": indices})[1], ref.max_pool_grad(dy, indices, x.shape), F32, "dX")


def test_a_model_local_function_in_the_default_domain_is_no_unknown_op():
    body = [helper.make_node("Relu", ["a"], ["b"])]
    function = helper.make_function("", "MyActivation", ["a"], ["b"], body, [helper.make_opsetid("", 17)])
    node = helper.make_node("MyActivation", ["dy"], ["dx"], name="call")
    model = _model(node, [("dy", F32, [2, 3])], [2, 3], 17)
    model.functions.append(function)
    lowered = lower_model(model)
    assert [n.op_type for n in lowered.graph.node] == ["MyActivation"]
    from opdef.model_verify import verify_model

    assert verify_model(model) == []


@pytest.mark.parametrize("elem, opset", [(TensorProto.FLOAT16, 12), (TensorProto.FLOAT16, 17),
                                         (TensorProto.DOUBLE, 12), (TensorProto.DOUBLE, 17)])
def test_pool_grads_in_f16_and_f64(elem, opset):
    np_type = {TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64}[elem]
    x_shape, kernel, strides, pads, _ = POOL_CASES[0]
    x, out, rng = _case(x_shape, kernel, strides, pads)
    y, indices = ref.max_pool(x, kernel, strides, pads, out)
    dy = rng.standard_normal(y.shape).astype(np_type)
    attrs = {"kernel_shape": kernel, "strides": strides, "pads": pads}
    # f16 within half an f16 ulp-ish of the scale; f64: MaxPoolGrad exact in f64, AveragePoolGrad via f32
    tolerance = {TensorProto.FLOAT16: (2e-3, 2e-3), TensorProto.DOUBLE: (1e-12, 2e-7)}[elem]
    for op, inputs, feeds, want, tol in (
            ("MaxPoolGrad", ["dy", "ind"], {"dy": dy, "ind": indices}, ref.max_pool_grad(dy, indices, x_shape),
             tolerance[0]),
            ("AveragePoolGrad", ["dy"], {"dy": dy}, ref.average_pool_grad(dy, x_shape, kernel, strides, pads),
             tolerance[1])):
        declared = [("dy", elem, list(dy.shape)), ("ind", I64, list(dy.shape))][:len(inputs)]
        graph = helper.make_graph([helper.make_node(op, inputs, ["dx"], name="g", **attrs)], "g",
                                  [vi(n, t, s) for n, t, s in declared], [vi("dx", elem, list(x_shape))])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        got = _run(model, feeds)[1]
        assert got.dtype == np_type
        assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want)), op
