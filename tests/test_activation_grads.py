"""onnxruntime-training's activation family in com.microsoft (issue 19): DropoutGrad, TanhGrad, LeakyReluGrad,
QuickGelu, QuickGeluGrad, GeluGrad, FastGeluGrad, BiasGelu, BiasGeluGrad_dX, BiasFastGeluGrad_dX.

Per op: the parsed schema's facts; one failing test per spec constraint (a one-line VerificationError naming
node and problem, labelled with the spec's C-number); the lowering against the float64 reference of
runtime.reference_activations across element types, opsets and optional arguments (onnx.checker full_check,
onnxruntime), for both targets, the portable form also in OpenVINO, tract and onnx.reference; the reference
against finite differences of the forward op; runtime.reference_eval's rules; and the one-node cases recorded
from onnxruntime-training 1.19.2 (tools/ort_training/cases_activations.py), both targets.
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from _one_node import close, one_node_model, verification_error
from _recorded import recorded_cases
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper
from test_portable_training import _run as run_in
from test_training_grads_recorded import assert_matches_recorded, load_case

from lowering.passes import lower_model
from lowering.rules import PORTABLE_OPS, TARGETS, rule_targets
from opdef.errors import VerificationError
from opdef.node import TensorType
from opdef.parse import parse_spec
from opdef.verify import infer_node
from runtime import reference_activations as ref
from runtime.reference_eval import evaluate

SPECS = Path(__file__).resolve().parent.parent / "specs" / "com.microsoft"
MS = "com.microsoft"
F32, F16, BF16, F64, BOOL = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE,
                             TensorProto.BOOL)
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16, F64: np.float64, BOOL: np.bool_}
OPS = ("DropoutGrad", "TanhGrad", "LeakyReluGrad", "QuickGelu", "QuickGeluGrad", "GeluGrad", "FastGeluGrad",
       "Gelu", "BiasGelu", "BiasGeluGrad_dX", "BiasFastGeluGrad_dX")
RULES = ("dropout_grad", "tanh_grad", "leaky_relu_grad", "quick_gelu", "quick_gelu_grad", "gelu_grad",
         "fast_gelu_grad", "gelu", "bias_gelu", "bias_gelu_grad", "bias_fast_gelu_grad")
ERF_OPS = ("GeluGrad", "Gelu", "BiasGelu", "BiasGeluGrad_dX")  # no f64: onnxruntime has no f64 Erf
vi = helper.make_tensor_value_info


# -- the cases: op, attributes, inputs -> (model, feeds, float64 expected of the rounded inputs) ------------

def _case(op_type, elem=F32, opset=17, shape=(3, 4, 6), seed=0, **attrs):
    """A one-node model of ``op_type`` with random inputs of ``elem`` and its float64 expectation."""
    rng = np.random.default_rng(seed)
    shape = list(shape)

    def draw(*s, scale=2.0):
        return (rng.standard_normal(s) * scale).astype(NP[elem])

    alpha = attrs.get("alpha")
    x, dy = draw(*shape), draw(*shape, scale=1.0)
    x.reshape(-1)[:2] = 0  # the conventions at exactly 0
    f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731 (the reference of the rounded inputs)
    if op_type == "TanhGrad":
        y = np.tanh(f64(x)).astype(NP[elem])
        feeds, want = {"dy": dy, "y": y}, ref.tanh_grad(f64(dy), f64(y))
    elif op_type == "LeakyReluGrad":
        y = ref.leaky_relu(f64(x), 0.01 if alpha is None else alpha).astype(NP[elem])
        feeds, want = {"dy": dy, "y": y}, ref.leaky_relu_grad(f64(dy), f64(y), 0.01 if alpha is None else alpha)
    elif op_type == "QuickGelu":
        feeds, want = {"x": x}, ref.quick_gelu(f64(x), 1.702 if alpha is None else alpha)
    elif op_type == "QuickGeluGrad":
        feeds, want = {"dy": dy, "x": x}, ref.quick_gelu_grad(f64(dy), f64(x), 1.702 if alpha is None else alpha)
    elif op_type in ("GeluGrad", "FastGeluGrad"):
        fn = ref.gelu_grad if op_type == "GeluGrad" else ref.fast_gelu_grad
        feeds, want = {"dy": dy, "x": x}, fn(f64(dy), f64(x))
    elif op_type == "Gelu":
        feeds, want = {"x": x}, ref.gelu(f64(x))
    elif op_type == "BiasGelu":
        b = draw(shape[-1])
        feeds, want = {"x": x, "b": b}, ref.bias_gelu(f64(x), f64(b))
    elif op_type in ("BiasGeluGrad_dX", "BiasFastGeluGrad_dX"):
        b = draw(shape[-1])
        fn = ref.bias_gelu_grad if op_type == "BiasGeluGrad_dX" else ref.bias_fast_gelu_grad
        feeds, want = {"dy": dy, "x": x, "b": b}, fn(f64(dy), f64(x), f64(b))
    else:
        raise ValueError(op_type)
    names = list(feeds)
    node = helper.make_node(op_type, names, ["out"], domain=MS, name="act", **attrs)
    model = one_node_model(node, [(n, elem, list(v.shape)) for n, v in feeds.items()], [("out", elem, shape)], opset)
    return model, feeds, want


def _dropout_case(elem=F32, ratio=0.3, ratio_elem=F32, ratio_shape=(), training_mode=None, opset=17, seed=1,
                  mask_all_false_at=None):
    rng = np.random.default_rng(seed)
    shape = [4, 5, 3]
    dy = rng.standard_normal(shape).astype(NP[elem])
    mask = rng.random(shape) >= (0.5 if ratio is None else ratio)
    feeds = {"dy": dy, "mask": mask}
    inputs = [("dy", elem, shape), ("mask", BOOL, shape)]
    names = ["dy", "mask"]
    if ratio is not None or training_mode is not None:
        names.append("ratio" if ratio is not None else "")
        if ratio is not None:
            feeds["ratio"] = np.full(ratio_shape, ratio, NP[ratio_elem])
            inputs.append(("ratio", ratio_elem, list(ratio_shape)))
    if training_mode is not None:
        names.append("training_mode")
        feeds["training_mode"] = np.array(training_mode)
        inputs.append(("training_mode", BOOL, []))
    node = helper.make_node("DropoutGrad", names, ["dx"], domain=MS, name="dg")
    model = one_node_model(node, inputs, [("dx", elem, shape)], opset)
    want = ref.dropout_grad(dy.astype(np.float64), mask, None if ratio is None else feeds["ratio"])
    return model, {"dy": dy, **{k: v for k, v in feeds.items() if k != "dy"}}, {"dx": want}


def _lowered(model, target="onnxruntime"):
    lowered = lower_model(model, target=target)
    onnx.checker.check_model(lowered, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    return lowered


# -- schemas ---------------------------------------------------------------------------------------------

SCHEMAS = {  # op: (inputs with optionality, outputs, {attribute: default}, element types of the first input)
    "DropoutGrad": ([("dy", False), ("mask", False), ("ratio", True), ("training_mode", True)], ["dx"], {},
                    {"f32", "f16", "bf16", "f64"}),
    "TanhGrad": ([("dY", False), ("Y", False)], ["dX"], {}, {"f32", "f16", "bf16", "f64"}),
    "LeakyReluGrad": ([("dY", False), ("Y", False)], ["dX"], {"alpha": 0.01}, {"f32", "f16", "bf16", "f64"}),
    "QuickGelu": ([("X", False)], ["Y"], {"alpha": 1.702}, {"f32", "f16", "bf16", "f64"}),
    "QuickGeluGrad": ([("dY", False), ("X", False)], ["dX"], {"alpha": 1.702}, {"f32", "f16", "bf16", "f64"}),
    "GeluGrad": ([("dY", False), ("X", False)], ["dX"], {}, {"f32", "f16", "bf16"}),
    "FastGeluGrad": ([("dY", False), ("X", False)], ["dX"], {}, {"f32", "f16", "bf16", "f64"}),
    "Gelu": ([("X", False)], ["Y"], {}, {"f32", "f16", "bf16"}),
    "BiasGelu": ([("A", False), ("B", False)], ["C"], {}, {"f32", "f16", "bf16"}),
    "BiasGeluGrad_dX": ([("dY", False), ("X", False), ("B", False)], ["dX"], {}, {"f32", "f16", "bf16"}),
    "BiasFastGeluGrad_dX": ([("dY", False), ("X", False), ("B", False)], ["dX"], {}, {"f32", "f16", "bf16", "f64"}),
}


@pytest.mark.parametrize("op_type", OPS)
def test_schema(op_type):
    inputs, outputs, attributes, types = SCHEMAS[op_type]
    s = parse_spec(SPECS / f"{op_type}.rst")
    assert [(a.name, a.optional) for a in s.inputs] == inputs
    assert [a.name for a in s.outputs] == outputs
    assert {a.name: a.default for a in s.attributes} == attributes
    assert all(a.type == "f32" and not a.required for a in s.attributes)
    var = s.inputs[0].type_var
    assert {dict(c)[var] for c in s.type_combinations} == types
    assert s.outputs[0].type_var == var
    if op_type != "DropoutGrad":
        assert {a.type_var for a in s.inputs} == {var}


def test_dropout_grad_schema_types():
    s = parse_spec(SPECS / "DropoutGrad.rst")
    t = {a.name: a.type_var for a in s.inputs}
    assert t["mask"] == t["training_mode"] != t["ratio"] != t["dy"]
    assert {dict(c)[t["mask"]] for c in s.type_combinations} == {"boolean"}
    assert {dict(c)[t["ratio"]] for c in s.type_combinations} == {"f32", "f16", "bf16", "f64"}
    assert [c.label for c in s.constraints] == ["C1", "C2", "C3"]


# -- constraints: one failing node each --------------------------------------------------------------------

def _error(op_type, names, types, **attrs) -> str:
    node = helper.make_node(op_type, names, ["out"], domain=MS, name="bad", **attrs)
    message = verification_error(node, types)
    assert op_type in message
    return message


@pytest.mark.parametrize("op_type, second", [("TanhGrad", "Y"), ("LeakyReluGrad", "Y"), ("QuickGeluGrad", "X"),
                                             ("GeluGrad", "X"), ("FastGeluGrad", "X")])
def test_error_c1_shapes_differ(op_type, second):
    message = _error(op_type, ["dy", "x"], {"dy": (F32, (4, 5)), "x": (F32, (4, 6))})
    assert f"{second} has shape [4,6]; expected [4,5]" in message and "[C1]" in message


@pytest.mark.parametrize("op_type", ["LeakyReluGrad", "QuickGeluGrad"])
def test_error_c2_alpha_not_finite(op_type):
    message = _error(op_type, ["dy", "x"], {"dy": (F32, (4,)), "x": (F32, (4,))}, alpha=math.nan)
    assert "alpha is nan; it must be finite" in message and "[C2]" in message


def test_error_quick_gelu_c2_alpha_not_finite():
    message = _error("QuickGelu", ["x"], {"x": (F32, (4,))}, alpha=math.inf)
    assert "alpha is inf" in message and "[C2]" in message


def test_error_types_differ():
    assert "element type" in _error("TanhGrad", ["dy", "y"], {"dy": (F32, (4,)), "y": (F16, (4,))})


@pytest.mark.parametrize("op_type", ERF_OPS)
def test_error_erf_forms_take_no_f64(op_type):
    names = ["dy", "x", "b"][:len(SCHEMAS[op_type][0])]
    types = {n: (F64, (2, 3) if n != "b" else (3,)) for n in names}
    assert "f64" in _error(op_type, names, types)


@pytest.mark.parametrize("op_type, names", [("BiasGelu", ["x", "b"]), ("BiasGeluGrad_dX", ["dy", "x", "b"]),
                                            ("BiasFastGeluGrad_dX", ["dy", "x", "b"])])
def test_error_bias_c1(op_type, names):
    x = "A" if op_type == "BiasGelu" else "X"
    types = {n: (F32, (2, 3)) for n in names}
    message = _error(op_type, names, {**types, "b": (F32, (4,))})
    assert f"B has shape [4]; expected [3] (the last dimension of {x} [2,3])" in message and "[C1]" in message
    message = _error(op_type, names, {**types, "b": (F32, (1, 3))})
    assert "B has shape [1,3]; expected a 1D tensor" in message and "[C1]" in message
    message = _error(op_type, names, {**{n: (F32, ()) for n in names}, "b": (F32, (1,))})
    assert f"{x} is a scalar" in message and "[C1]" in message


@pytest.mark.parametrize("op_type", ["BiasGeluGrad_dX", "BiasFastGeluGrad_dX"])
def test_error_bias_grad_c2_shapes_differ(op_type):
    message = _error(op_type, ["dy", "x", "b"], {"dy": (F32, (3, 3)), "x": (F32, (2, 3)), "b": (F32, (3,))})
    assert "X has shape [2,3]; expected [3,3]" in message and "[C2]" in message


def test_error_dropout_grad_c1_mask_shape():
    message = _error("DropoutGrad", ["dy", "m"], {"dy": (F32, (2, 3)), "m": (BOOL, (3, 2))})
    assert "mask has shape [3,2]; expected [2,3] (the shape of dy)" in message and "[C1]" in message


@pytest.mark.parametrize("names, which", [(["dy", "m", "r"], "ratio"), (["dy", "m", "", "t"], "training_mode")])
def test_error_dropout_grad_c2_one_element(names, which):
    types = {"dy": (F32, (2, 3)), "m": (BOOL, (2, 3)), "r": (F32, (2,)), "t": (BOOL, (1, 2))}
    message = _error("DropoutGrad", names, {n: types[n] for n in names if n})
    assert f"{which} has shape" in message and "expected one element" in message and "[C2]" in message


def test_error_dropout_grad_mask_not_boolean():
    assert "boolean" in _error("DropoutGrad", ["dy", "m"], {"dy": (F32, (2, 3)), "m": (F32, (2, 3))})


def test_inference_gives_the_output_type_and_shape():
    node = helper.make_node("BiasGeluGrad_dX", ["dy", "x", "b"], ["dx"], domain=MS, name="g")
    inference = infer_node(node, {"dy": TensorType(F16, ("N", 8)), "x": TensorType(F16, (4, 8)),
                                  "b": TensorType(F16, (8,))})
    assert inference.output_types == (TensorType(F16, (4, 8)),)


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), bias=st.integers(1, 6),
       op_type=st.sampled_from(["BiasGelu", "BiasGeluGrad_dX", "BiasFastGeluGrad_dX"]))
def test_bias_rule_accepts_exactly_the_last_dimension(shape, bias, op_type):
    names = ["x", "b"] if op_type == "BiasGelu" else ["dy", "x", "b"]
    node = helper.make_node(op_type, names, ["out"], domain=MS, name="p")
    types = {n: TensorType(F32, tuple(shape)) for n in names} | {"b": TensorType(F32, (bias,))}
    if bias == shape[-1]:
        assert infer_node(node, types).output_types == (TensorType(F32, tuple(shape)),)
    else:
        with pytest.raises(VerificationError, match=r"B has shape \[\d\]; expected \["):
            infer_node(node, types)


@given(shape=st.lists(st.integers(1, 4), min_size=0, max_size=3), symbolic=st.integers(0, 3))
def test_dropout_grad_merges_symbolic_dims(shape, symbolic):
    """A symbol in dy's shape takes mask's size (the output is the more specific shape)."""
    dy_shape = tuple("S" if i == symbolic else d for i, d in enumerate(shape))
    node = helper.make_node("DropoutGrad", ["dy", "m"], ["dx"], domain=MS, name="p")
    inference = infer_node(node, {"dy": TensorType(F16, dy_shape), "m": TensorType(BOOL, tuple(shape))})
    assert inference.output_types == (TensorType(F16, tuple(shape)),)


# -- lowering against the float64 reference ----------------------------------------------------------------

ELEMENT_CASES = [(op, elem, opset) for op in OPS if op != "DropoutGrad"
                 for elem, opset in ((F32, 17), (F32, 12), (F16, 17), (BF16, 17), (F64, 13))
                 if not (elem == F64 and op in ERF_OPS)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("op_type, elem, opset", ELEMENT_CASES)
def test_lowering_matches_float64(op_type, elem, opset, target):
    model, feeds, want = _case(op_type, elem, opset)
    close(_run_lowered(model, feeds, target), want, elem, op_type)


def _run_lowered(model, feeds, target="onnxruntime", runtime="onnxruntime", tmp_path=None):
    return run_in(runtime, _lowered(model, target), feeds, tmp_path)[model.graph.output[0].name]


@pytest.mark.parametrize("op_type, alpha", [("LeakyReluGrad", 0.2), ("LeakyReluGrad", 0.0), ("QuickGelu", 1.0),
                                            ("QuickGelu", -0.5), ("QuickGeluGrad", 1.0), ("QuickGeluGrad", 2.5)])
def test_lowering_alpha(op_type, alpha):
    model, feeds, want = _case(op_type, F32, alpha=alpha)
    close(_run_lowered(model, feeds), want, F32, op_type)


def test_quick_gelu_alpha_1_is_silu_without_the_scaling_mul():
    model, _, _ = _case("QuickGelu", F32, alpha=1.0)
    assert [n.op_type for n in _lowered(model).graph.node if n.op_type != "Constant"] == ["Sigmoid", "Mul"]


def test_leaky_relu_grad_where_picks_between_constants():
    model, _, _ = _case("LeakyReluGrad", F32)
    lowered = _lowered(model)
    constants = {o for n in lowered.graph.node if n.op_type == "Constant" for o in n.output}
    (where,) = [n for n in lowered.graph.node if n.op_type == "Where"]
    assert set(where.input[1:]) <= constants


DROPOUT_CASES = {
    "ratio_0.3": {}, "default_ratio": {"ratio": None}, "ratio_0.7_shape1": {"ratio": 0.7, "ratio_shape": (1,)},
    "ratio_0.1_f16_ratio": {"ratio": 0.1, "ratio_elem": F16}, "ratio_f64_ratio": {"ratio": 0.1, "ratio_elem": F64},
    "ratio_0_mask_ignored": {"ratio": 0.0}, "training_mode_false": {"training_mode": False},
    "training_mode_only": {"ratio": None, "training_mode": True},
    "f16": {"elem": F16}, "bf16": {"elem": BF16}, "f64": {"elem": F64}, "f64_opset12": {"elem": F64, "opset": 12},
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(DROPOUT_CASES))
def test_dropout_grad_lowering(case, target):
    args = DROPOUT_CASES[case]
    model, feeds, want = _dropout_case(**args)
    close(_run_lowered(model, feeds, target), want["dx"], args.get("elem", F32), case)


def test_dropout_grad_ratio_0_passes_dy_through_a_false_mask():
    model, feeds, _ = _dropout_case(ratio=0.0)
    feeds["mask"][:] = False
    np.testing.assert_array_equal(_run_lowered(model, feeds), feeds["dy"])


def test_dropout_grad_dropped_elements_are_signed_zeros_like_the_kernel():
    model, feeds, _ = _dropout_case(ratio=0.5)
    got = _run_lowered(model, feeds)
    kernel = feeds["mask"].astype(np.float32) * feeds["dy"] / (np.float32(1) - np.float32(0.5))
    np.testing.assert_array_equal(got.view(np.int32), kernel.view(np.int32))


def test_dropout_grad_default_ratio_is_two_passes():
    model, _, _ = _dropout_case(ratio=None)
    assert [n.op_type for n in _lowered(model).graph.node if n.op_type != "Constant"] == ["Where", "Div"]


# -- portable: ops, and every runtime --------------------------------------------------------------------

def test_every_activation_rule_has_both_targets():
    for key in RULES:
        assert rule_targets(key) == TARGETS, key


PORTABLE_CASES = {**{f"{op}_f32": (lambda op=op: _case(op, F32)) for op in OPS if op != "DropoutGrad"},
                  "GeluGrad_f16": lambda: _case("GeluGrad", F16),
                  "FastGeluGrad_f64": lambda: _case("FastGeluGrad", F64),
                  "QuickGelu_bf16": lambda: _case("QuickGelu", BF16),
                  "DropoutGrad_ratio": lambda: _dropout_case(),
                  "DropoutGrad_default_ratio": lambda: _dropout_case(ratio=None),
                  "DropoutGrad_ratio0_f16": lambda: _dropout_case(F16, ratio=0.0)}


def _elem(model):
    return model.graph.output[0].type.tensor_type.elem_type


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino", "tract", "reference"])
@pytest.mark.parametrize("case", list(PORTABLE_CASES))
def test_portable_lowering_runs_everywhere(case, runtime, tmp_path):
    model, feeds, want = PORTABLE_CASES[case]()
    want = want["dx"] if isinstance(want, dict) else want
    lowered = _lowered(model, "portable")
    ops = {n.op_type for n in lowered.graph.node}
    assert ops <= PORTABLE_OPS, sorted(ops - PORTABLE_OPS)
    elem = _elem(model)
    if runtime == "tract" and elem == BF16:  # no bf16 tensors in tract (0.23), whatever the ops
        with pytest.raises(Exception, match="Bfloat16"):
            run_in(runtime, lowered, feeds, tmp_path)
        return
    got = run_in(runtime, lowered, feeds, tmp_path)[model.graph.output[0].name]
    assert got.dtype == NP[elem]
    if runtime == "openvino" and elem == F64:  # OpenVINO's CPU plugin runs an f64 graph in f32 (f64 in and out)
        elem = F32
    close(got, want, elem, f"{case} in {runtime}")


# -- the float64 reference against finite differences -------------------------------------------------------

def _check_gradient(forward, grad, x, dy, eps=1e-6, rtol=1e-7):
    rng = np.random.default_rng(5)
    for _ in range(4):
        v = rng.standard_normal(x.shape)
        numeric = (np.sum(dy * forward(x + eps * v)) - np.sum(dy * forward(x - eps * v))) / (2 * eps)
        assert abs(np.sum(grad * v) - numeric) <= rtol * max(1.0, abs(numeric))


def _away_from_zero(shape, seed=3):
    x = np.random.default_rng(seed).standard_normal(shape) * 3
    return np.where(np.abs(x) < 0.05, 0.5, x)  # the kinks stay farther than eps


def test_finite_differences():
    rng = np.random.default_rng(4)
    x, dy, b = _away_from_zero((4, 6)), rng.standard_normal((4, 6)), rng.standard_normal(6)
    _check_gradient(np.tanh, ref.tanh_grad(dy, np.tanh(x)), x, dy)
    _check_gradient(lambda z: ref.leaky_relu(z, 0.2), ref.leaky_relu_grad(dy, ref.leaky_relu(x, 0.2), 0.2), x, dy)
    _check_gradient(lambda z: ref.quick_gelu(z, 1.702), ref.quick_gelu_grad(dy, x, 1.702), x, dy)
    _check_gradient(lambda z: ref.quick_gelu(z, 1.0), ref.quick_gelu_grad(dy, x, 1.0), x, dy)
    _check_gradient(ref.gelu, ref.gelu_grad(dy, x), x, dy)
    _check_gradient(ref.fast_gelu, ref.fast_gelu_grad(dy, x), x, dy)
    _check_gradient(lambda z: ref.bias_gelu(z, b), ref.bias_gelu_grad(dy, x, b), x, dy)
    _check_gradient(lambda z: ref.fast_gelu(z + b), ref.bias_fast_gelu_grad(dy, x, b), x, dy)
    mask = rng.random((4, 6)) >= 0.3
    ratio = np.float32(0.3)
    keep = float(np.float32(1) - ratio)
    _check_gradient(lambda z: np.where(mask, z / keep, 0.0), ref.dropout_grad(dy, mask, ratio), x, dy)


def test_reference_gelu_values():
    assert ref.gelu(np.array([0.0, 1.0])).tolist() == pytest.approx([0.0, 0.8413447460685429], abs=1e-15)
    assert ref.gelu_grad(np.array([1.0]), np.array([0.0])).tolist() == [0.5]


# -- runtime.reference_eval -----------------------------------------------------------------------------------

@pytest.mark.parametrize("op_type", OPS)
def test_reference_eval_rule(op_type):
    model, feeds, want = _dropout_case() if op_type == "DropoutGrad" else _case(op_type, F32)
    want = want["dx"] if isinstance(want, dict) else want
    out = model.graph.output[0].name
    got = evaluate(model, feeds, exact=True)[out]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    assert evaluate(model, feeds)[out].dtype == np.float32


# -- onnxruntime-training's recorded cases ------------------------------------------------------------------

CASES = recorded_cases(*OPS)


def test_every_activation_op_has_recorded_cases():
    assert {c["op_type"] for c in CASES} == set(OPS)
    ratios = {c["variant"] for c in CASES if c["op_type"] == "DropoutGrad"}
    assert {"ratio0.1", "ratio0.5", "ratio0.7", "default_ratio", "ratio0_mask_ignored"} <= ratios
    assert all(any(c["op_type"] == op and c["variant"].endswith("_f16") for c in CASES) for op in OPS)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['op_type']}-{c['variant']}")
def test_lowering_matches_onnxruntime_training(case, target):
    model, feeds, recorded = load_case(case)
    lowered = _lowered(model, target)
    assert all(n.op_type != case["op_type"] for n in lowered.graph.node)
    got = run_in("onnxruntime", lowered, feeds, None)
    assert_matches_recorded(got, recorded)
    if case["op_type"] in ("DropoutGrad", "TanhGrad", "LeakyReluGrad", "QuickGeluGrad") and \
            next(iter(recorded.values())).dtype != np.float16:
        for name, want in recorded.items():  # the kernels' own order of operations: the same bits
            np.testing.assert_array_equal(got[name], want)


# -- a graph of the family: symbolic batch, the CLI's --verify, a bad node -----------------------------------

def _chain_model(bias_size=6):
    """Gelu, and the backward of Linear -> BiasGelu -> Dropout -> QuickGelu -> Tanh -> LeakyRelu as
    onnxruntime-training's ops would chain it (forward values are graph inputs), batch dimension symbolic."""
    nodes = [
        helper.make_node("BiasGelu", ["a", "b"], ["h"], domain=MS, name="fwd_gelu"),
        helper.make_node("QuickGelu", ["h"], ["q"], domain=MS, name="fwd_silu", alpha=1.0),
        helper.make_node("Gelu", ["a"], ["g"], domain=MS, name="fwd_plain_gelu"),
        helper.make_node("LeakyReluGrad", ["dz", "z"], ["dt"], domain=MS, name="leaky_grad", alpha=0.1),
        helper.make_node("TanhGrad", ["dt", "t"], ["dq"], domain=MS, name="tanh_grad"),
        helper.make_node("QuickGeluGrad", ["dq", "h"], ["dd"], domain=MS, name="silu_grad", alpha=1.0),
        helper.make_node("DropoutGrad", ["dd", "mask", "ratio", "mode"], ["dh"], domain=MS, name="dropout_grad"),
        helper.make_node("BiasGeluGrad_dX", ["dh", "a", "b"], ["da"], domain=MS, name="gelu_grad"),
        helper.make_node("BiasFastGeluGrad_dX", ["dh", "a", "b"], ["da_fast"], domain=MS, name="fast_gelu_grad"),
    ]
    shape = ["N", 6]
    inputs = [vi("a", F32, shape), vi("b", F32, [bias_size]), vi("dz", F32, shape), vi("z", F32, shape),
              vi("t", F32, shape), vi("mask", BOOL, shape), vi("ratio", F32, []), vi("mode", BOOL, [])]
    outputs = [vi(n, F32, shape) for n in ("q", "g", "da", "da_fast")]
    graph = helper.make_graph(nodes, "chain", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def _chain_feeds(batch, seed=8):
    rng = np.random.default_rng(seed)
    f = {n: rng.standard_normal((batch, 6)).astype(np.float32) for n in ("a", "dz", "z")}
    f["t"] = np.tanh(rng.standard_normal((batch, 6))).astype(np.float32)
    f["b"] = rng.standard_normal(6).astype(np.float32)
    f["mask"], f["ratio"], f["mode"] = rng.random((batch, 6)) >= 0.2, np.array(0.2, np.float32), np.array(True)
    return f


def _chain_expected(f):
    h = ref.bias_gelu(f["a"], f["b"])
    dh = ref.dropout_grad(ref.quick_gelu_grad(ref.tanh_grad(ref.leaky_relu_grad(f["dz"], f["z"], 0.1), f["t"]), h, 1.0),
                          f["mask"], f["ratio"])
    return {"q": ref.quick_gelu(h, 1.0), "g": ref.gelu(f["a"]), "da": ref.bias_gelu_grad(dh, f["a"], f["b"]),
            "da_fast": ref.bias_fast_gelu_grad(dh, f["a"], f["b"])}


@pytest.mark.parametrize("target", TARGETS)
def test_chain_with_symbolic_batch(target):
    lowered = _lowered(_chain_model(), target)
    for batch in (1, 5):
        feeds = _chain_feeds(batch)
        got = run_in("onnxruntime", lowered, feeds, None)
        for name, want in _chain_expected(feeds).items():
            # f32 all along the chain against float64: rounding of the intermediate values accumulates
            assert float(np.max(np.abs(got[name] - want))) <= 1e-5 * float(np.max(np.abs(want))), name


def test_cli_lower_verify_on_the_chain(tmp_path, capsys):
    from lowering.cli import main  # noqa: PLC0415

    model = tmp_path / "chain.onnx"
    onnx.save(_chain_model(), model)
    assert main(["lower", str(model), "-o", str(tmp_path / "out.onnx"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "lowered" in out and out.count("PASS") == 4 and "FAIL" not in out


def test_cli_refuses_a_bad_bias(tmp_path, capsys):
    from lowering.cli import main  # noqa: PLC0415

    model = tmp_path / "chain.onnx"
    onnx.save(_chain_model(bias_size=5), model)
    before = model.read_bytes()
    assert main(["lower", str(model), "-o", str(tmp_path / "out.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and str(model) in err
    assert "'fwd_gelu'" in err and "B has shape [5]; expected [6]" in err
    assert not (tmp_path / "out.onnx").exists() and model.read_bytes() == before


def test_recorded_agreement_tool():
    """tools/ort_training/recorded_agreement.py (the numbers docs quote) on the cases it must find exact."""
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "ort_training"))
    from recorded_agreement import agreement  # noqa: PLC0415

    table = agreement(["DropoutGrad", "GeluGrad"], "portable")
    assert table[("DropoutGrad", "float32")] == (0.0, 7, 7)
    worst, _, count = table[("GeluGrad", "float32")]
    assert count == 2 and 0 < worst <= 1e-6
