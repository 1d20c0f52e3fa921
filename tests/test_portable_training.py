"""``--target portable`` for onnxruntime-training's gradient ops (issue 14, second part): ConvGrad, ReluGrad,
SigmoidGrad, Scale, SoftmaxCrossEntropyLossGrad, MaxPoolGrad and AveragePoolGrad.

Every case is lowered for the portable target, checked by onnx.checker (full_check) and against
lowering.rules.PORTABLE_OPS (so no Conv/ConvTranspose with runtime weights, no ScatterElements), then run in
onnxruntime, OpenVINO, tract and ``onnx.reference`` and compared with the float64 reference of
runtime.reference_training. What a runtime cannot run is an asserted refusal, never a skip (tract has no
bf16). Then the recorded onnxruntime-training fixtures lowered for the portable target and compared with
onnxruntime-training's own outputs: the one-node cases in onnxruntime, generate_artifacts' training graphs in
every runtime (but see STEP_REFUSALS).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from test_ort_training_artifacts import ARTIFACTS, _gradients_exposed
from test_ort_training_artifacts import NAMES as ARTIFACT_NAMES
from test_pool_grads import _case as _pool_case
from test_portable import _run as _run_any
from test_training_grads import _conv_case, draw_conv_geometry, sce_node_case
from test_training_grads_recorded import CASES as RECORDED_CASES
from test_training_grads_recorded import assert_matches_recorded, load_case

from lowering.cli import main
from lowering.passes import lower_model
from lowering.rules import PORTABLE_OPS, TARGETS, rule_targets
from opdef.errors import LoweringError
from runtime import reference_training as ref
from runtime.session import run_model

MS = "com.microsoft"
F32, F16, BF16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE
I32, I64 = TensorProto.INT32, TensorProto.INT64
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16, F64: np.float64, I32: np.int32, I64: np.int64}
# of the output's largest magnitude, as tests/test_training_grads.py (measured, the four runtimes: f32 <= 1.6e-7,
# f16 <= 3.1e-4, f64 <= 2.4e-16; OpenVINO's f64 see below)
TOL = {F32: 2e-6, F16: 2e-3, BF16: 1.6e-2, F64: 1e-12}
RUNTIMES = ("onnxruntime", "openvino", "tract", "reference")
RULES = ("conv_grad", "relu_grad", "sigmoid_grad", "scale", "softmax_cross_entropy_loss_grad", "max_pool_grad",
         "average_pool_grad")
vi = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, opset=17):
    graph = helper.make_graph(nodes, "g", [vi(n, t, s) for n, t, s in inputs], [vi(n, t, s) for n, t, s in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


# -- the cases: (model, feeds, float64 expected per output, output element type) -----------------------------

def _conv(x_shape, w_shape, attrs, elem=F32, opset=17, batch=None):
    x, w, dy, (dx, dw, db) = _conv_case(x_shape, w_shape, attrs, elem)
    n = batch or x_shape[0]
    node = helper.make_node("ConvGrad", ["dy", "x", "w"], ["dx", "dw", "db"], domain=MS, name="cg", **attrs)
    model = _model([node], [("dy", elem, [n, *dy.shape[1:]]), ("x", elem, [n, *x_shape[1:]]),
                            ("w", elem, list(w_shape))],
                   [("dx", elem, [n, *x_shape[1:]]), ("dw", elem, list(w_shape)), ("db", elem, [w_shape[0]])], opset)
    return model, {"dy": dy, "x": x, "w": w}, {"dx": dx, "dw": dw, "db": db}, elem


def _max_pool(x_shape, kernel, strides, pads, ceil_mode=0, dilations=None, elem=F32, opset=17):
    x, out, rng = _pool_case(x_shape, kernel, strides, pads, ceil_mode)
    attrs = {"kernel_shape": kernel, "strides": strides, "pads": pads, "ceil_mode": ceil_mode}
    if dilations is not None:
        attrs["dilations"] = dilations
    # the indices of onnxruntime's own MaxPool (the reference's MaxPool has no dilations; for the others it
    # matches onnxruntime's, tests/test_pool_grads.py)
    forward = helper.make_graph([helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)], "f",
                                [vi("x", F32, list(x_shape))], [vi("y", F32, None), vi("i", I64, None)])
    forward = helper.make_model(forward, opset_imports=[helper.make_opsetid("", 12)])
    forward.ir_version = 7
    _, indices = ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.astype(np.float32)})
    dy = rng.standard_normal(indices.shape).astype(NP[elem])
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg", **attrs)
    model = _model([node], [("dy", elem, list(dy.shape)), ("ind", I64, list(dy.shape))],
                   [("dx", elem, list(x_shape))], opset)
    return model, {"dy": dy, "ind": indices}, {"dx": ref.max_pool_grad(dy, indices, x_shape)}, elem


def _average_pool(x_shape, kernel, strides, pads, ceil_mode=0, count_include_pad=0, elem=F32, opset=17):
    _, out, rng = _pool_case(x_shape, kernel, strides, pads, ceil_mode)
    dy = rng.standard_normal((*x_shape[:2], *out)).astype(NP[elem])
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", kernel_shape=kernel, strides=strides,
                            pads=pads, ceil_mode=ceil_mode, count_include_pad=count_include_pad)
    model = _model([node], [("dy", elem, list(dy.shape))], [("dx", elem, list(x_shape))], opset)
    want = ref.average_pool_grad(dy, x_shape, kernel, strides, pads, count_include_pad)
    return model, {"dy": dy}, {"dx": want}, elem


def _elementwise(op_type, elem=F32, opset=17):
    rng = np.random.default_rng(11)
    shape = [3, 4, 5]
    dy, x = rng.standard_normal(shape), rng.standard_normal(shape)
    if op_type == "SigmoidGrad":
        x = ref.sigmoid(x)  # Y, the forward output
    node = helper.make_node(op_type, ["dy", "x"], ["dx"], domain=MS, name="eg")
    model = _model([node], [("dy", elem, shape), ("x", elem, shape)], [("dx", elem, shape)], opset)
    feeds = {"dy": dy.astype(NP[elem]), "x": x.astype(NP[elem])}
    # the reference of the rounded inputs: what the lowering computes before its one rounding
    f64 = {k: v.astype(np.float64) for k, v in feeds.items()}
    want = ref.relu_grad(f64["dy"], f64["x"]) if op_type == "ReluGrad" else ref.sigmoid_grad(f64["dy"], f64["x"])
    return model, feeds, {"dx": want}, elem


def _scale(scale_down):
    rng = np.random.default_rng(12)
    values, factor = rng.standard_normal((4, 6)).astype(np.float32), np.array([2.5], np.float32)
    node = helper.make_node("Scale", ["v", "s"], ["o"], domain=MS, name="sc", scale_down=scale_down)
    model = _model([node], [("v", F32, [4, 6]), ("s", F32, [1])], [("o", F32, [4, 6])])
    return model, {"v": values, "s": factor}, {"o": ref.scale(values, factor, scale_down)}, F32


def _sce(shape, reduction, weighted, ignore_index, label_type=I64, opset=17):
    attrs, inputs, feeds, want = sce_node_case(shape, reduction, weighted, ignore_index, label_type)
    node = helper.make_node("SoftmaxCrossEntropyLossGrad", [n for n, _, _ in inputs], ["dl"], domain=MS, name="sg",
                            **attrs)
    model = _model([node], inputs, [("dl", F32, list(shape))], opset)
    return model, feeds, {"dl": want}, F32


CASES = {
    "conv_2d_plain": lambda: _conv((2, 3, 5, 5), (4, 3, 3, 3), {}),
    "conv_2d_strides_pads_dilations": lambda: _conv((2, 4, 7, 6), (6, 2, 3, 2),
                                                    {"group": 2, "strides": [2, 1], "dilations": [1, 2],
                                                     "pads": [1, 0, 2, 1]}),
    "conv_2d_depthwise_stride2": lambda: _conv((2, 4, 6, 6), (4, 1, 3, 3),
                                               {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "conv_2d_dropped_tail": lambda: _conv((1, 2, 8, 7), (3, 2, 3, 2), {"strides": [3, 2]}),
    "conv_1d_strided": lambda: _conv((2, 3, 9), (5, 3, 3), {"strides": [3], "pads": [1, 1]}),
    "conv_1d_groups_dilated": lambda: _conv((2, 6, 10), (9, 2, 2), {"group": 3, "dilations": [3], "pads": [0, 2]}),
    "conv_3d": lambda: _conv((1, 2, 4, 5, 3), (2, 2, 2, 2, 2), {"strides": [1, 2, 1], "pads": [0, 1, 0, 0, 0, 1]}),
    "conv_pointwise": lambda: _conv((2, 3, 4, 4), (5, 3, 1, 1), {}),
    # no offset starts at an odd position: col2im fills those residue classes with zeros
    "conv_pointwise_strided": lambda: _conv((2, 3, 5, 6), (4, 3, 1, 1), {"strides": [2, 3]}),
    "conv_dilation_as_stride": lambda: _conv((1, 2, 7, 6), (3, 2, 2, 2), {"strides": [2, 2], "dilations": [2, 2]}),
    "conv_depthwise_opset12": lambda: _conv((2, 4, 6, 6), (4, 1, 3, 3), {"group": 4, "pads": [1, 1, 1, 1]}, opset=12),
    "conv_opset12_strided": lambda: _conv((2, 4, 7, 6), (6, 2, 3, 2), {"group": 2, "strides": [2, 3],
                                                                       "pads": [1, 0, 0, 1]}, opset=12),
    "conv_f16": lambda: _conv((2, 4, 5, 5), (4, 2, 3, 3), {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]},
                              elem=F16),
    "conv_f64": lambda: _conv((2, 3, 5, 5), (4, 3, 3, 3), {"strides": [2, 1], "pads": [1, 1, 0, 0]}, elem=F64),
    "relu_grad": lambda: _elementwise("ReluGrad"),
    "relu_grad_f16": lambda: _elementwise("ReluGrad", F16),
    "relu_grad_bf16": lambda: _elementwise("ReluGrad", BF16),
    "sigmoid_grad": lambda: _elementwise("SigmoidGrad"),
    "scale_mul": lambda: _scale(0),
    "scale_div": lambda: _scale(1),
    "sce_mean": lambda: _sce((4, 5), "mean", False, None),
    "sce_sum_weighted": lambda: _sce((4, 5), "sum", True, None),
    "sce_none_ignored_s32": lambda: _sce((4, 5), "none", False, 2, I32),
    "sce_mean_weighted_ignored_4d": lambda: _sce((3, 4, 2, 2), "mean", True, 1),
    "sce_opset12": lambda: _sce((6, 3), "mean", True, -100, opset=12),
    "max_pool_3x3_s2_p1": lambda: _max_pool((2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1]),
    "max_pool_2x2_s2": lambda: _max_pool((2, 3, 8, 8), [2, 2], [2, 2], [0, 0, 0, 0]),
    "max_pool_1d_s1_p1": lambda: _max_pool((2, 2, 9), [3], [1], [1, 1]),
    "max_pool_1d_s2_asymmetric": lambda: _max_pool((2, 2, 9), [3], [2], [1, 0]),
    "max_pool_ceil_mode": lambda: _max_pool((2, 3, 7, 7), [3, 3], [2, 2], [0, 0, 0, 0], 1),
    "max_pool_dilated": lambda: _max_pool((1, 2, 8, 7), [2, 2], [1, 2], [1, 0, 1, 1], dilations=[2, 2]),
    "max_pool_3d": lambda: _max_pool((1, 2, 5, 6, 4), [2, 3, 2], [1, 2, 2], [0, 1, 0, 1, 0, 0]),
    "max_pool_opset12": lambda: _max_pool((2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1], opset=12),
    "max_pool_f16": lambda: _max_pool((2, 3, 6, 6), [3, 3], [2, 2], [1, 1, 1, 1], elem=F16),
    "average_pool_3x3_s2_p1": lambda: _average_pool((2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1]),
    "average_pool_include_pad": lambda: _average_pool((2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1],
                                                      count_include_pad=1),
    "average_pool_1d": lambda: _average_pool((2, 2, 9), [3], [2], [1, 0]),
    "average_pool_ceil_mode": lambda: _average_pool((2, 3, 7, 7), [3, 3], [2, 2], [0, 0, 0, 0], 1, opset=12),
    "average_pool_3d": lambda: _average_pool((1, 2, 5, 6, 4), [2, 3, 2], [1, 2, 2], [0, 1, 0, 1, 0, 0], 0, 1),
    "average_pool_f16": lambda: _average_pool((2, 3, 6, 6), [2, 2], [2, 2], [0, 0, 0, 0], elem=F16),
}

_BUILT: dict = {}


def _built(case: str):
    """(model, feeds, expected, element type, portable lowering); built once per case."""
    if case not in _BUILT:
        model, feeds, expected, elem = CASES[case]()
        _BUILT[case] = (model, feeds, expected, elem, lower_model(model, target="portable"))
    return _BUILT[case]


def _run_openvino(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """OpenVINO with inputs and outputs matched by any of their names: its ports take the names of the
    values a no-op (a Reshape to the same shape) merged into them, so one name per port is not enough."""
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(model=model.SerializeToString(), weights=b""), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32"})  # f32 stays f32, see tests/test_portable.py
    # numpy's int64 comes under two type codes ('l', 'q'); OpenVINO's binding knows only np.int64's
    inputs = {}
    for i, port in enumerate(compiled.inputs):  # OpenVINO drops graph inputs nothing reads
        value = np.asarray(feeds[next(v.name for v in model.graph.input if v.name in port.get_names())])
        inputs[i] = value.view(np.int64) if value.dtype == np.int64 else value
    results = compiled(inputs)
    return {o.name: next(value for port, value in results.items() if o.name in port.get_names())
            for o in model.graph.output}


def _run(runtime: str, model: onnx.ModelProto, feeds: dict, tmp_path) -> dict[str, np.ndarray]:
    if runtime == "openvino" and not any(v.dtype == ml_dtypes.bfloat16 for v in feeds.values()):
        return _run_openvino(model, feeds)
    return _run_any(runtime, model, feeds, tmp_path)


def _refusal(runtime: str, elem: int) -> str | None:
    """What a runtime is known to refuse (asserted), or None: it must run and match."""
    if runtime == "tract" and elem == BF16:
        return "Bfloat16"  # no bf16 tensors in tract (0.23), whatever the ops
    return None


def _close(name, got, want, elem):
    got, want = np.asarray(got).astype(np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    err = float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)
    assert err <= TOL[elem], f"{name}: relative error {err:.3g} > {TOL[elem]}"


def test_every_training_rule_has_both_targets():
    for key in RULES:
        assert rule_targets(key) == TARGETS, key


@pytest.mark.parametrize("case", list(CASES))
def test_portable_lowering_uses_portable_ops_only(case):
    model, _, _, _, lowered = _built(case)
    onnx.checker.check_model(lowered, full_check=True)
    ops = {n.op_type for n in lowered.graph.node}
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    assert ops <= PORTABLE_OPS, sorted(ops - PORTABLE_OPS)
    assert not ops & {"Conv", "ConvTranspose", "ScatterElements", "ScatterND", "GatherElements"}
    tuned = {n.op_type for n in lower_model(model).graph.node}
    if case.startswith("conv") or case.startswith("average"):  # the forms really differ
        assert tuned & {"Conv", "ConvTranspose"} and not tuned <= PORTABLE_OPS
    if case.startswith("conv") and not case.startswith("conv_pointwise"):  # im2col: one strided Slice per kernel offset
        assert "Slice" in ops and ("MatMul" in ops) == ("depthwise" not in case)  # depthwise: Mul, ReduceSum


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("case", list(CASES))
def test_portable_lowering_runs_and_matches_float64(case, runtime, tmp_path):
    _, feeds, expected, elem, lowered = _built(case)
    refused = _refusal(runtime, elem)
    if refused is not None:
        with pytest.raises(Exception, match=refused):
            _run(runtime, lowered, feeds, tmp_path)
        return
    got = _run(runtime, lowered, feeds, tmp_path)
    # OpenVINO's CPU plugin has no f64 kernels: it runs an f64 graph in f32 (f64 in and out)
    precision = F32 if runtime == "openvino" and elem == F64 else elem
    for name, want in expected.items():
        assert got[name].dtype == NP[elem], (name, got[name].dtype)
        _close(name, got[name], want, precision)


# onnx.reference 1.23 fails inside its kernels on some onnxruntime forms (the portable ones all run there)
TUNED_REFUSALS = {
    ("conv_2d_strides_pads_dilations", "reference"): "cannot reshape",  # grouped (not depthwise) ConvGrad
    ("conv_1d_groups_dilated", "reference"): "cannot reshape",
    ("conv_opset12_strided", "reference"): "cannot reshape",
    ("conv_f16", "reference"): "could not broadcast",
    ("max_pool_opset12", "reference"): "array objects",  # MaxPoolGrad's scatter groups below opset 16
}


@pytest.mark.parametrize("runtime", [r for r in RUNTIMES if r != "onnxruntime"])
@pytest.mark.parametrize("case", list(CASES))
def test_onnxruntime_target_in_other_runtimes(case, runtime, tmp_path):
    """The onnxruntime forms (Conv/ConvTranspose with runtime weights, ScatterElements) where the runtime
    takes them: what docs/targets.md says about them."""
    model, feeds, expected, elem = CASES[case]()
    lowered = lower_model(model)
    refused = TUNED_REFUSALS.get((case, runtime)) or _refusal(runtime, elem)
    if refused is not None:
        with pytest.raises(Exception, match=refused):
            _run(runtime, lowered, feeds, tmp_path)
        return
    got = _run(runtime, lowered, feeds, tmp_path)
    # the onnxruntime form computes f64 in f32 (onnxruntime has no f64 Conv/ConvTranspose)
    precision = F32 if elem == F64 else elem
    for name, want in expected.items():
        _close(name, got[name], want, precision)


def test_portable_conv_grad_with_a_symbolic_batch():
    model, feeds, expected, elem = _conv((2, 4, 7, 6), (6, 2, 3, 2),
                                         {"group": 2, "strides": [2, 1], "pads": [1, 0, 2, 1]}, batch="N")
    got = run_model(lower_model(model, target="portable"), feeds)
    for name, want in expected.items():
        _close(name, got[name], want, elem)


def test_portable_max_pool_grad_with_a_symbolic_batch():
    model, feeds, expected, elem = _max_pool((2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1])
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    got = run_model(lower_model(model, target="portable"), feeds)
    _close("dx", got["dx"], expected["dx"], elem)


def test_portable_conv_grad_needs_static_spatial_dims():
    node = helper.make_node("ConvGrad", ["dy", "x", "w"], ["dx", "dw"], domain=MS, name="cg")
    model = _model([node], [("dy", F32, [2, 4, "H", "W"]), ("x", F32, [2, 3, "h", "w"]), ("w", F32, [4, 3, 3, 3])],
                   [("dx", F32, None), ("dw", F32, [4, 3, 3, 3])])
    lower_model(model)  # the onnxruntime form takes it (stride 1)
    with pytest.raises(LoweringError, match=r"^com.microsoft ConvGrad 'cg': the portable lowering needs X's "
                                            r"spatial dims static"):
        lower_model(model, target="portable")


def test_cli_portable_refusal_is_one_line_and_writes_nothing(tmp_path, capsys):
    node = helper.make_node("ConvGrad", ["dy", "x", "w"], ["dx"], domain=MS, name="cg")
    model = _model([node], [("dy", F32, [2, 4, "H", "W"]), ("x", F32, [2, 3, "h", "w"]), ("w", F32, [4, 3, 3, 3])],
                   [("dx", F32, None)])
    path, out = tmp_path / "model.onnx", tmp_path / "low.onnx"
    onnx.save(model, path)
    assert main(["lower", str(path), "-o", str(out)]) == 0  # the onnxruntime form
    out.unlink()
    assert main(["lower", str(path), "-o", str(out), "--target", "portable"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"oplower lower: error: {path}: com.microsoft ConvGrad 'cg': the portable lowering needs")
    assert not out.exists()


def test_portable_max_pool_grad_needs_kernel_shape():
    node = helper.make_node("MaxPoolGrad", ["dy", "ind"], ["dx"], name="mpg")
    model = _model([node], [("dy", F32, [2, 3, 2, 2]), ("ind", I64, [2, 3, 2, 2])], [("dx", F32, [2, 3, 4, 4])])
    lower_model(model)  # opset 17: the onnxruntime form's summing scatter needs no geometry
    with pytest.raises(LoweringError, match=r"^MaxPoolGrad 'mpg': the portable lowering needs kernel_shape and "
                                            r"dY's spatial dims static \(kernel_shape missing"):
        lower_model(model, target="portable")


def test_portable_average_pool_grad_needs_static_dy():
    node = helper.make_node("AveragePoolGrad", ["dy"], ["dx"], name="apg", kernel_shape=[2, 2], strides=[2, 2])
    model = _model([node], [("dy", F32, [2, 3, "h", "w"])], [("dx", F32, [2, 3, 4, 4])])
    with pytest.raises(LoweringError, match=r"'apg': dY's spatial dims must be static"):
        lower_model(model, target="portable")


# -- onnxruntime-training's recorded results, portable target ------------------------------------------------

@pytest.mark.parametrize("case", RECORDED_CASES, ids=lambda c: f"{c['op_type']}-{c['variant']}")
def test_recorded_cases_portable(case):
    model, feeds, recorded = load_case(case)
    lowered = lower_model(model, target="portable")
    onnx.checker.check_model(lowered, full_check=True)
    ops = {n.op_type for n in lowered.graph.node}
    assert ops <= PORTABLE_OPS, sorted(ops - PORTABLE_OPS)
    assert_matches_recorded(run_model(lowered, feeds), recorded)


# tract 0.23 has no SoftmaxCrossEntropyLoss with its log_prob output (the cnn's forward loss, left as it is);
# onnx.reference's own MaxPool returns wrong Indices where the pool has pads (the cnn's 3x3 pad 1 pool; see
# test_reference_eval_training.py), so its cnn step is another step, not checked there
STEP_REFUSALS = {("cnn", "tract"): "SoftmaxCrossEntropyLoss"}
STEP_RUNS = [(n, r) for n in ARTIFACT_NAMES for r in RUNTIMES if (n, r) != ("cnn", "reference")]


@pytest.mark.parametrize("name, runtime", STEP_RUNS)
def test_training_step_portable(name, runtime, tmp_path):
    """As tests/test_ort_training_artifacts.py, lowered for the portable target: every op the lowering emits
    is portable (the forward graph's own standard ops stay as they are), and the step runs in each runtime."""
    folder = ARTIFACTS / name
    meta = json.loads((folder / "meta.json").read_text())
    model, exposed = _gradients_exposed(onnx.load(str(folder / "training_model.onnx")))
    original = {n.name for n in model.graph.node if n.domain in ("", "ai.onnx")}
    lowered = lower_model(model, target="portable")
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    emitted = {n.op_type for n in lowered.graph.node if n.name not in original}
    assert emitted <= PORTABLE_OPS, sorted(emitted - PORTABLE_OPS)
    data = dict(np.load(folder / "data.npz"))
    data[meta["labels_input"]] = data.pop("labels")
    feeds = data | dict(np.load(folder / "initial_params.npz"))
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in lowered.graph.input}}
    if (name, runtime) in STEP_REFUSALS:
        with pytest.raises(Exception, match=STEP_REFUSALS[name, runtime]):
            _run(runtime, lowered, feeds, tmp_path)
        return
    got = _run(runtime, lowered, feeds, tmp_path)
    recorded = np.load(folder / "raw_train_step1.npz")
    loss_name = lowered.graph.output[0].name
    assert abs(float(got[loss_name]) - float(recorded[loss_name])) <= 1e-5 * abs(float(recorded[loss_name]))
    floor = 1e-2 * max(float(np.max(np.abs(recorded[buffer]))) for buffer in exposed)
    for buffer, gradient in exposed.items():
        want = recorded[buffer]
        err = float(np.max(np.abs(got[gradient] - want))) / max(float(np.max(np.abs(want))), floor)
        assert err <= 1e-4, f"{gradient}: {err:.3g} of the largest entry"


# -- any geometry (onnxruntime) -------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.data())
def test_portable_conv_grad_over_random_geometry(data):
    """1-3 spatial axes, groups (incl. depthwise), strides, dilations and asymmetric pads: im2col/col2im's
    residue classes, shifts, crops and tails."""
    x_shape, w_shape, attrs = draw_conv_geometry(data)
    group = attrs["group"]
    model, feeds, expected, _ = _conv(x_shape, w_shape, attrs)
    lowered = lower_model(model, target="portable")
    assert {n.op_type for n in lowered.graph.node} <= PORTABLE_OPS
    got = run_model(lowered, feeds)
    # f32 sums that cancel: bound the error by the sum of the terms' magnitudes, not by the result
    geometry = {k: attrs[k] for k in ("strides", "dilations", "pads")}
    magnitudes = ref.conv_grad(np.abs(feeds["dy"]), np.abs(feeds["x"]), np.abs(feeds["w"]), group=group, **geometry)
    for (name, want), size in zip(expected.items(), magnitudes, strict=True):
        assert np.all(np.abs(got[name] - want) <= 1e-6 * size + 1e-30), name


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_portable_pool_grads_over_random_geometry(data):
    spatial = data.draw(st.integers(1, 3), "spatial axes")
    kernel = [data.draw(st.integers(1, 3)) for _ in range(spatial)]
    strides = [data.draw(st.integers(1, 3)) for _ in range(spatial)]
    pads = [data.draw(st.integers(0, kernel[a % spatial] - 1)) for a in range(2 * spatial)]
    sizes = [data.draw(st.integers(max(1, kernel[a] - pads[a] - pads[a + spatial]), kernel[a] + 5))
             for a in range(spatial)]
    ceil_mode = data.draw(st.integers(0, 1), "ceil_mode")
    x_shape = (2, 2, *sizes)
    _, outputs, _ = _pool_case(x_shape, kernel, strides, pads, ceil_mode)
    # ceil_mode's last window must start inside the input or its begin padding (else the forward drops it)
    assume(all((outputs[a] - 1) * strides[a] < sizes[a] + pads[a] for a in range(spatial)))
    for model, feeds, expected, _ in (_max_pool(x_shape, kernel, strides, pads, ceil_mode),
                                      _average_pool(x_shape, kernel, strides, pads, ceil_mode,
                                                    data.draw(st.integers(0, 1), "count_include_pad"))):
        lowered = lower_model(model, target="portable")
        assert {n.op_type for n in lowered.graph.node} <= PORTABLE_OPS
        _close("dx", run_model(lowered, feeds)["dx"], expected["dx"], F32)
