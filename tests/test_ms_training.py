"""onnxruntime-training graphs: com.microsoft BatchNormInternal and BatchNormalizationGrad.

Spec documents (specs/com.microsoft/, oneDNN grammar) -> schema; the verify rule; the BatchNormInternal
emitter on tiny models; BatchNormInternal -> Relu -> BatchNormalizationGrad graphs lowered and run in plain
onnxruntime against the float64 reference; a training-like graph whose other com.microsoft ops stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

import lowering.rules.batch_norm_internal  # noqa: F401  (registers the lowering rule "batch_norm_internal")
from lowering.builder import NodeBuilder
from lowering.rules.batch_norm_internal import BatchNormInternalPlan, emit_batch_norm_internal
from opdef.errors import VerificationError
from opdef.node import TensorType
from opdef.parse import parse_spec
from opdef.registry import load_schemas
from runtime import reference
from runtime.session import run_model

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs" / "com.microsoft"
MS = "com.microsoft"
F32, F16, BF16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16, F64: np.float64}
# error bound relative to the largest magnitude of the reference output
TOL = {F32: 5e-5, F16: 4e-3, BF16: 3e-2, F64: 1e-12}
FORWARD_OUTPUTS = ("Y", "running_mean", "running_var", "saved_mean", "saved_inv_std")
vi = helper.make_tensor_value_info


def close(got, want, elem_type, what=""):
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want))) / scale
    assert err <= TOL[elem_type], f"{what}: relative error {err:.3g} > {TOL[elem_type]}"


# -- spec documents -------------------------------------------------------------------------------------

def test_batch_norm_internal_spec_parses_with_onnxruntime_facts():
    s = parse_spec(SPECS / "BatchNormInternal.rst")
    assert s.name == "BatchNormInternal" and s.dialect == "onednn"
    assert [(a.name, a.optional) for a in s.inputs] == [
        ("X", False), ("scale", False), ("B", False), ("input_mean", False), ("input_var", False)]
    assert [(a.name, a.optional) for a in s.outputs] == [
        ("Y", False), ("running_mean", True), ("running_var", True), ("saved_mean", True), ("saved_inv_std", True)]
    attrs = {a.name: a for a in s.attributes}
    assert (attrs["epsilon"].type, attrs["epsilon"].required, attrs["epsilon"].default) == ("f32", False, 1e-5)
    assert (attrs["momentum"].type, attrs["momentum"].default) == ("f32", 0.9)
    assert (attrs["training_mode"].type, attrs["training_mode"].default) == ("s64", 1)
    assert attrs["training_mode"].allowed_values == ()  # any nonzero value means training
    # X, scale, B, Y share one type; the statistics another
    t = {a.name: a.type_var for a in (*s.inputs, *s.outputs)}
    assert t["X"] == t["scale"] == t["B"] == t["Y"] != t["input_mean"]
    assert len({t[n] for n in ("input_mean", "input_var", *FORWARD_OUTPUTS[1:])}) == 1
    combos = {tuple(v for _, v in c) for c in s.type_combinations}
    assert {("f32", "f32"), ("f16", "f16"), ("f16", "f32"), ("bf16", "bf16"), ("f64", "f64")} <= combos
    assert [c.label for c in s.constraints] == ["C1", "C2", "C3", "C4", "C5"]


def test_batch_norm_gradient_spec_names_the_inv_std_input():
    s = parse_spec(SPECS / "BatchNormalizationGrad.rst")
    assert [a.name for a in s.inputs] == ["dY", "X", "scale", "saved_mean", "saved_inv_std"]
    assert [a.name for a in s.outputs] == ["X_grad", "scale_grad", "bias_grad"]
    assert not any(a.optional for a in (*s.inputs, *s.outputs))
    (epsilon,) = s.attributes
    assert (epsilon.name, epsilon.type, epsilon.required) == ("epsilon", "f32", True)
    # one type for every argument, as onnxruntime's schema has it
    assert len({a.type_var for a in (*s.inputs, *s.outputs)}) == 1
    assert {c[0][1] for c in s.type_combinations} == {"f32", "f16", "bf16", "f64"}
    assert any("inverse standard deviation" in c.text and "saved_inv_std" in c.text for c in s.constraints)


def test_specs_are_detected_as_onednn_documents():
    from opdef.parse import detect_dialect

    for name in ("BatchNormInternal", "BatchNormalizationGrad"):
        assert detect_dialect((SPECS / f"{name}.rst").read_text()) == "onednn"


def _registry():
    import opdef

    return opdef.load_schemas()


def test_registry_binds_both_ops():
    registry = _registry()
    grad = registry.binding(MS, "BatchNormalizationGrad")
    assert (grad.rule, grad.stat_input, grad.layout) == ("batch_norm_backward", "inv_std", "channel_first")
    assert grad.arg("inv_std") == "saved_inv_std" and grad.arg("mean") == "saved_mean"
    internal = registry.binding(MS, "BatchNormInternal")
    assert internal.rule == "batch_norm_internal"
    assert registry.schema(MS, "BatchNormInternal").domain == MS


def test_cli_schema_json_for_the_gradient():
    _registry()
    from lowering.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["schema", "BatchNormalizationGrad", "--json"]) == 0
    data = json.loads(out.getvalue())
    assert (data["name"], data["domain"], data["dialect"]) == ("BatchNormalizationGrad", MS, "onednn")
    assert [i["name"] for i in data["inputs"]] == ["dY", "X", "scale", "saved_mean", "saved_inv_std"]
    assert data["attributes"][0]["name"] == "epsilon" and data["attributes"][0]["required"] is True


# -- verification ---------------------------------------------------------------------------------------

def _infer(node: onnx.NodeProto, types: dict[str, TensorType]):
    registry = _registry()
    from opdef.verify import infer_node

    return infer_node(node, types, registry=registry)


def _bni_node(outputs=("Y", "rm", "rv", "sm", "sis"), **attrs):
    return helper.make_node("BatchNormInternal", ["X", "scale", "B", "mean", "var"], list(outputs),
                            name="bn1", domain=MS, **attrs)


def _bni_types(x=(8, 4, 5, 5), c=4, stats=None, io=F32, st=F32):
    stats = stats or {}
    return {"X": TensorType(io, x), "scale": TensorType(io, stats.get("scale", (c,))),
            "B": TensorType(io, stats.get("B", (c,))), "mean": TensorType(st, stats.get("mean", (c,))),
            "var": TensorType(st, stats.get("var", (c,)))}


def test_verify_infers_batch_norm_internal_outputs():
    inference = _infer(_bni_node(), _bni_types(x=("N", 4, 5, 5), io=F16, st=F32))
    types = dict(zip(inference.outputs, inference.output_types, strict=True))
    assert types["Y"] == TensorType(F16, ("N", 4, 5, 5))
    for name in ("rm", "rv", "sm", "sis"):
        assert types[name] == TensorType(F32, (4,))
    assert inference.channel_axis == 1 and inference.reduce_axes == (0, 2, 3)
    assert inference.roles["saved_inv_std"] == "sis"


@pytest.mark.parametrize("arg", ["scale", "B", "mean", "var"])
def test_verify_batch_norm_internal_c2_per_channel_shape(arg):
    with pytest.raises(VerificationError) as err:
        _infer(_bni_node(), _bni_types(stats={arg: (3,)}))
    assert "expected [4]" in str(err.value) and "[C2]" in str(err.value)


def test_verify_batch_norm_internal_c2_rank_of_statistics():
    with pytest.raises(VerificationError, match=r"has shape \[1,4\]; expected \[4\].*\[C2\]"):
        _infer(_bni_node(), _bni_types(stats={"mean": (1, 4)}))


def test_verify_batch_norm_internal_c1_rank():
    with pytest.raises(VerificationError, match=r"X has rank 1 .*\[C1\]"):
        _infer(_bni_node(), _bni_types(x=(4,)))


@pytest.mark.parametrize("epsilon", [0.0, -1e-5, math.inf, math.nan])
def test_verify_batch_norm_internal_c4_epsilon(epsilon):
    with pytest.raises(VerificationError, match=r"epsilon .*\[C4\]"):
        _infer(_bni_node(epsilon=epsilon), _bni_types())


@pytest.mark.parametrize("momentum", [-0.1, 1.5, math.nan])
def test_verify_batch_norm_internal_c4_momentum(momentum):
    with pytest.raises(VerificationError, match=r"momentum .*\[C4\]"):
        _infer(_bni_node(momentum=momentum), _bni_types())


def test_verify_batch_norm_internal_c5_inference_mode_outputs():
    _infer(_bni_node(outputs=("Y",), training_mode=0), _bni_types())
    with pytest.raises(VerificationError, match=r"saved_mean \('sm'\) requested with training_mode 0.*\[C5\]"):
        _infer(_bni_node(outputs=("Y", "", "", "sm"), training_mode=0), _bni_types())


@given(dims=st.lists(st.one_of(st.integers(1, 6), st.sampled_from(["N", "H"])), min_size=2, max_size=5),
       stat_sizes=st.lists(st.integers(1, 6), min_size=4, max_size=4))
def test_verify_batch_norm_internal_shapes_property(dims, stat_sizes):
    types = _bni_types(x=tuple(dims), stats=dict(zip(("scale", "B", "mean", "var"),
                                                     [(c,) for c in stat_sizes], strict=True)))
    channels = dims[1]
    consistent = len(set(stat_sizes)) == 1 and (not isinstance(channels, int) or channels == stat_sizes[0])
    if consistent:
        inference = _infer(_bni_node(), types)
        out = dict(zip(inference.outputs, inference.output_types, strict=True))
        assert out["Y"].shape == tuple(dims)
        assert out["sis"].shape == (stat_sizes[0],)
    else:
        with pytest.raises(VerificationError, match=r"\[C2\]"):
            _infer(_bni_node(), types)


def test_verify_gradient_wrong_stat_shape():
    node = helper.make_node("BatchNormalizationGrad", ["dY", "X", "scale", "sm", "sis"],
                            ["dX", "dscale", "dB"], name="bng", domain=MS, epsilon=1e-5)
    types = {"dY": TensorType(F32, (2, 4, 3)), "X": TensorType(F32, (2, 4, 3)), "scale": TensorType(F32, (4,)),
             "sm": TensorType(F32, (4,)), "sis": TensorType(F32, (5,))}
    with pytest.raises(VerificationError, match=r"saved_inv_std has shape \[5\]; expected \[4\]"):
        _infer(node, types)
    types["sis"] = TensorType(F32, (4,))
    inference = _infer(node, types)
    assert inference.roles["inv_std"] == "sis" and inference.binding.stat_input == "inv_std"


# -- the BatchNormInternal emitter on its own ------------------------------------------------------------

def _emit_model(plan: BatchNormInternalPlan, opset: int, x_dims, c: int) -> onnx.ModelProto:
    b = NodeBuilder(opset, "bni")
    emit_batch_norm_internal(b, plan)
    inputs = [vi(plan.x, plan.io_type, x_dims), vi(plan.scale, plan.io_type, [c]), vi(plan.bias, plan.io_type, [c]),
              vi(plan.input_mean, plan.stat_type, [c]), vi(plan.input_var, plan.stat_type, [c])]
    outputs = [vi(plan.y, plan.io_type, x_dims)] if plan.y else []
    outputs += [vi(name, plan.stat_type, [c]) for name in
                (plan.running_mean, plan.running_var, plan.saved_mean, plan.saved_inv_std) if name]
    model = helper.make_model(helper.make_graph(b.nodes, "bni", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _forward_data(shape, io_type, stat_type, seed=0, offset=3.0):
    rng = np.random.default_rng(seed)
    c = shape[1]
    bshape = [1, c] + [1] * (len(shape) - 2)
    x = rng.normal(size=shape) * rng.uniform(0.5, 2.0, size=c).reshape(bshape) \
        + (offset + rng.normal(size=c)).reshape(bshape)
    return {"X": x.astype(NP[io_type]), "scale": rng.normal(size=c).astype(NP[io_type]),
            "B": rng.normal(size=c).astype(NP[io_type]), "mean": rng.normal(size=c).astype(NP[stat_type]),
            "var": rng.uniform(0.5, 2.0, size=c).astype(NP[stat_type])}


def _plan(io_type, stat_type, rank, shape=None, training=True, outputs=FORWARD_OUTPUTS,
          epsilon=1e-5, momentum=0.9):
    names = {o: (o if o in outputs else None) for o in FORWARD_OUTPUTS}
    return BatchNormInternalPlan(
        x="X", scale="scale", bias="B", input_mean="mean", input_var="var",
        y=names["Y"], running_mean=names["running_mean"], running_var=names["running_var"],
        saved_mean=names["saved_mean"], saved_inv_std=names["saved_inv_std"], training=training,
        epsilon=epsilon, momentum=momentum, io_type=io_type, stat_type=stat_type, rank=rank, x_shape=shape)


def _forward_reference(feeds, epsilon=1e-5, momentum=0.9):
    return reference.batch_norm_internal(feeds["X"], feeds["scale"], feeds["B"], feeds["mean"], feeds["var"],
                                         epsilon=epsilon, momentum=momentum)


@pytest.mark.parametrize("opset", [12, 13, 17, 18])
@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 7), (2, 3, 4, 5), (2, 3, 2, 3, 2)])
@pytest.mark.parametrize("io_type,stat_type", [(F32, F32), (F16, F16), (F16, F32), (F64, F64)])
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])  # staged sums + Conv / ReduceMean
def test_emit_batch_norm_internal_training(opset, shape, io_type, stat_type, static):
    model = _emit_model(_plan(io_type, stat_type, len(shape), shape if static else None), opset, list(shape),
                        shape[1])
    feeds = _forward_data(shape, io_type, stat_type)
    got = run_model(model, feeds)
    want = _forward_reference(feeds)
    for name in FORWARD_OUTPUTS:
        close(got[name], want[name], io_type if name == "Y" else stat_type, name)
        assert got[name].dtype == NP[io_type if name == "Y" else stat_type]


@pytest.mark.parametrize("io_type,stat_type", [(BF16, BF16), (BF16, F32)])
def test_emit_batch_norm_internal_bf16(io_type, stat_type):
    shape = (4, 3, 5)
    model = _emit_model(_plan(io_type, stat_type, 3, shape), 17, list(shape), 3)
    feeds = _forward_data(shape, io_type, stat_type)
    got = run_model(model, feeds)
    want = _forward_reference(feeds)
    for name in FORWARD_OUTPUTS:
        close(got[name], want[name], BF16, name)


@pytest.mark.parametrize("opset", [12, 17])
def test_emit_batch_norm_internal_symbolic_dims_and_unknown_rank(opset):
    shape = (3, 4, 5, 2)
    feeds = _forward_data(shape, F32, F32)
    want = _forward_reference(feeds)
    for rank, dims in ((4, ("N", 4, "H", "W")), (None, ("N", 4, "H", "W"))):
        model = _emit_model(_plan(F32, F32, rank, dims), opset, list(dims), 4)
        got = run_model(model, feeds)
        for name in FORWARD_OUTPUTS:
            close(got[name], want[name], F32, f"rank {rank}: {name}")


def test_emit_batch_norm_internal_variance_is_stable_for_large_means():
    # |mean| / std = 1e4: E[x^2] - E[x]^2 would lose every digit in f32; the centred form keeps them
    shape = (16, 2, 8, 8)
    feeds = _forward_data(shape, F32, F32, offset=1e4)
    got = run_model(_emit_model(_plan(F32, F32, 4, shape), 17, list(shape), 2), feeds)
    want = _forward_reference(feeds)
    close(got["running_var"], want["running_var"], F32, "running_var")
    np.testing.assert_allclose(got["saved_inv_std"], want["saved_inv_std"], rtol=1e-3)


def test_emit_batch_norm_internal_inference_mode():
    shape = (2, 3, 4)
    feeds = _forward_data(shape, F32, F32)
    got = run_model(_emit_model(_plan(F32, F32, 3, shape, training=False, outputs=("Y",)), 12, list(shape), 3),
                    feeds)
    want = reference.batch_norm_forward(feeds["X"], feeds["mean"], feeds["var"], feeds["scale"], feeds["B"],
                                        epsilon=1e-5, reduce_axes=(0, 2))
    close(got["Y"], want, F32, "Y")


def test_emit_batch_norm_internal_computes_only_what_is_requested():
    def op_types(outputs, shape=None, opset=13, target="onnxruntime"):
        b = NodeBuilder(opset, "bni")
        plan = dataclasses.replace(_plan(F32, F32, 4, shape, outputs=outputs), portable=target == "portable")
        emit_batch_norm_internal(b, plan)
        return [n.op_type for n in b.nodes if n.op_type != "Constant"]

    y_only = op_types(("Y",))
    assert "ReduceMean" in y_only and y_only.count("Mul") == 3  # variance * 1/M, inv_std * scale, centred * a
    everything = op_types(FORWARD_OUTPUTS)
    assert len(everything) > len(y_only)
    stats_only = op_types(("saved_mean", "saved_inv_std"))
    assert "Add" in stats_only and stats_only.count("Mul") == 1  # no Y, no running update
    assert op_types(()) == []
    # static dims: staged sums (last axis, then a ones MatMul over N) and Y as one depthwise Conv with bias
    staged = op_types(("Y",), (2, 3, 4, 4))
    assert "ReduceMean" not in staged and staged.count("MatMul") == 2 and staged.count("Conv") == 1
    assert staged.count("Mul") == 4 and "Add" in staged  # centred², mean and variance * 1/M, inv_std * scale
    assert op_types(("saved_mean", "saved_inv_std"), (2, 3, 4, 4)).count("Conv") == 0
    # opset 14 on, Y wanted: onnxruntime's own kernel (BatchNormalization in training mode, momentum 0)
    for shape in (None, (2, 3, 4, 4)):
        kernel = op_types(FORWARD_OUTPUTS, shape, opset=17)
        assert kernel.count("BatchNormalization") == 1 and "ReduceMean" not in kernel and "Sub" not in kernel
        assert "BatchNormalization" not in op_types(("saved_mean",), shape, opset=17)
        assert "BatchNormalization" not in op_types(("Y",), shape, opset=17, target="portable")
    b = NodeBuilder(17, "bni")
    emit_batch_norm_internal(b, _plan(F32, F32, 4, (2, 3, 4, 4)))
    (node,) = [n for n in b.nodes if n.op_type == "BatchNormalization"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["training_mode"] == 1 and attrs["momentum"] == 0.0 and len(set(node.input[3:])) == 2


def test_emit_batch_norm_internal_momentum_extremes():
    shape = (4, 2, 3)
    feeds = _forward_data(shape, F32, F32)
    for momentum in (0.0, 1.0):
        model = _emit_model(_plan(F32, F32, 3, shape, momentum=momentum), 17, list(shape), 2)
        got = run_model(model, feeds)
        want = _forward_reference(feeds, momentum=momentum)
        close(got["running_mean"], want["running_mean"], F32, f"momentum {momentum}")
        close(got["running_var"], want["running_var"], F32, f"momentum {momentum}")


# -- end to end: BatchNormInternal -> Relu -> BatchNormalizationGrad --------------------------------------

def _lower(model):
    from lowering.passes import lower_model

    _registry()
    return lower_model(model)


def _training_slice(opset, shape, t, epsilon=1e-5, momentum=0.9):
    """X -> BatchNormInternal -> Relu -> (dR masked by Relu') -> BatchNormalizationGrad, all of type t."""
    c = shape[1]
    dims = list(shape)
    nodes = [
        helper.make_node("BatchNormInternal", ["X", "scale", "B", "running_mean", "running_var"],
                         ["Y", "running_mean_out", "running_var_out", "saved_mean", "saved_inv_std"],
                         name="bn_fw", domain=MS, epsilon=epsilon, momentum=momentum, training_mode=1),
        helper.make_node("Relu", ["Y"], ["R"], name="relu"),
        helper.make_node("Constant", [], ["zero"], name="zero",
                         value=helper.make_tensor("zero", t, [], [0.0])),
        helper.make_node("Greater", ["R", "zero"], ["mask"], name="mask"),
        helper.make_node("Where", ["mask", "dR", "zero"], ["dY"], name="relu_grad"),
        helper.make_node("BatchNormalizationGrad", ["dY", "X", "scale", "saved_mean", "saved_inv_std"],
                         ["X_grad", "scale_grad", "bias_grad"], name="bn_bw", domain=MS, epsilon=epsilon),
    ]
    graph = helper.make_graph(
        nodes, "training_slice",
        [vi("X", t, dims), vi("scale", t, [c]), vi("B", t, [c]), vi("running_mean", t, [c]),
         vi("running_var", t, [c]), vi("dR", t, dims)],
        [vi("R", t, dims), vi("running_mean_out", t, [c]), vi("running_var_out", t, [c]),
         vi("X_grad", t, dims), vi("scale_grad", t, [c]), vi("bias_grad", t, [c])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("opset", [12, 17])
@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 4, 5)])
@pytest.mark.parametrize("t", [F32, F16, F64])
def test_training_slice_lowers_and_matches_float64(opset, shape, t):
    model = _training_slice(opset, shape, t)
    lowered = _lower(model)
    assert not [n for n in lowered.graph.node if n.domain == MS]
    onnx.checker.check_model(lowered, full_check=True)
    assert lowered.opset_import and all(o.domain != MS for o in lowered.opset_import)

    rng = np.random.default_rng(1)
    feeds = _forward_data(shape, t, t, offset=0.5)
    feeds = {"X": feeds["X"], "scale": feeds["scale"], "B": feeds["B"], "running_mean": feeds["mean"],
             "running_var": feeds["var"], "dR": rng.normal(size=shape).astype(NP[t])}
    got = run_model(lowered, feeds)

    fw = reference.batch_norm_internal(feeds["X"], feeds["scale"], feeds["B"], feeds["running_mean"],
                                       feeds["running_var"], epsilon=1e-5, momentum=0.9)
    close(got["R"], np.maximum(fw["Y"], 0.0), t, "R")
    close(got["running_mean_out"], fw["running_mean"], t, "running_mean")
    close(got["running_var_out"], fw["running_var"], t, "running_var")
    # Relu's mask from the run itself: values within rounding of 0 may fall either side
    dy = np.where(got["R"] > 0, feeds["dR"].astype(np.float64), 0.0)
    axes = tuple(a for a in range(len(shape)) if a != 1)
    bw = reference.batch_norm_backward(feeds["X"], dy, fw["saved_mean"], fw["saved_inv_std"], feeds["scale"],
                                       epsilon=1e-5, reduce_axes=axes, stat_input="inv_std")
    close(got["X_grad"], bw["diff_src"], t, "X_grad")
    close(got["scale_grad"], bw["diff_gamma"], t, "scale_grad")
    close(got["bias_grad"], bw["diff_beta"], t, "bias_grad")


def test_training_slice_gradient_matches_finite_differences():
    # L(X) = sum(dR * Relu(BatchNormInternal(X).Y)); BatchNormalizationGrad's X_grad is dL/dX, in float64
    shape = (3, 2, 4)
    lowered = _lower(_training_slice(17, shape, F64))
    rng = np.random.default_rng(5)
    feeds = {"X": rng.normal(size=shape), "scale": rng.normal(size=2), "B": rng.normal(size=2),
             "running_mean": np.zeros(2), "running_var": np.ones(2), "dR": rng.normal(size=shape)}

    def loss(x):
        out = run_model(lowered, {**feeds, "X": x}, ["R"])
        return float(np.sum(out["R"] * feeds["dR"]))

    x_grad = run_model(lowered, feeds, ["X_grad"])["X_grad"]
    h = 1e-6
    for index in [(0, 0, 0), (1, 1, 2), (2, 0, 3), (0, 1, 1)]:
        step = np.zeros(shape)
        step[index] = h
        numeric = (loss(feeds["X"] + step) - loss(feeds["X"] - step)) / (2 * h)
        assert abs(numeric - x_grad[index]) <= 1e-6 * max(1.0, abs(numeric)), index


@pytest.mark.parametrize("opset", [12, 17])
def test_inference_mode_batch_norm_internal_lowers(opset):
    shape = (2, 3, 4)
    node = helper.make_node("BatchNormInternal", ["X", "scale", "B", "mean", "var"], ["Y"], name="bn_eval",
                            domain=MS, epsilon=1e-3, training_mode=0)
    graph = helper.make_graph([node], "eval", [vi("X", F32, list(shape)), vi("scale", F32, [3]), vi("B", F32, [3]),
                                               vi("mean", F32, [3]), vi("var", F32, [3])], [vi("Y", F32, list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    lowered = _lower(model)
    onnx.checker.check_model(lowered, full_check=True)
    assert {n.op_type for n in lowered.graph.node}.isdisjoint({"ReduceMean", "ReduceSumSquare"})
    feeds = _forward_data(shape, F32, F32)
    got = run_model(lowered, feeds)["Y"]
    want = reference.batch_norm_forward(feeds["X"], feeds["mean"], feeds["var"], feeds["scale"], feeds["B"],
                                        epsilon=1e-3, reduce_axes=(0, 2))
    close(got, want, F32, "Y")


def test_unread_running_statistics_still_come_back_as_in_place_updates():
    """In a training graph nothing reads BatchNormInternal's running statistics, yet onnxruntime-training
    updates its input_mean / input_var in place (recorded: tests/fixtures/ort_training): on the main graph
    they are computed and returned as '<input>.updated' (DESIGN.md section 9), whether or not the node names
    them as outputs."""
    model = _training_slice(17, (2, 3, 4, 5), F32)
    del model.graph.output[1:3]  # nobody reads the running statistics any more
    lowered = _lower(model)
    outputs = [o.name for o in lowered.graph.output]
    assert outputs[-2:] == ["running_mean.updated", "running_var.updated"]
    assert len(lowered.graph.node) == len(_lower(_training_slice(17, (2, 3, 4, 5), F32)).graph.node)
    feeds = {i.name: np.random.default_rng(1).standard_normal(
        [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32) for i in lowered.graph.input}
    feeds["running_var"] = np.abs(feeds["running_var"]) + 0.5
    got = run_model(lowered, feeds)
    x = feeds["X"].astype(np.float64)
    batch_mean = x.mean(axis=(0, 2, 3))
    node = next(n for n in model.graph.node if n.op_type == "BatchNormInternal")
    momentum = next(a.f for a in node.attribute if a.name == "momentum")
    want = momentum * feeds["running_mean"] + (1 - momentum) * batch_mean
    np.testing.assert_allclose(got["running_mean.updated"], want, rtol=1e-5, atol=1e-6)


def test_inference_mode_batch_norm_internal_updates_nothing():
    """training_mode 0: no in-place update (bindings.json 'in_place_unless'), so no '.updated' output."""
    node = helper.make_node("BatchNormInternal", ["X", "scale", "B", "mean", "var"], ["Y"], name="bn_eval",
                            domain=MS, epsilon=1e-3, training_mode=0)
    graph = helper.make_graph([node], "eval", [vi("X", F32, [2, 3, 4]), vi("scale", F32, [3]), vi("B", F32, [3]),
                                               vi("mean", F32, [3]), vi("var", F32, [3])], [vi("Y", F32, [2, 3, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    assert [o.name for o in _lower(model).graph.output] == ["Y"]


# -- a training-graph-like model: only the batch-norm nodes change ----------------------------------------

def _training_graph(opset=12):
    n, c, h, w, classes = 2, 4, 5, 5, 3
    f = F32
    init = [helper.make_tensor(name, f, dims, np.random.default_rng(i).normal(size=dims).ravel().tolist())
            for i, (name, dims) in enumerate([("conv_w", [c, 3, 3, 3]), ("bn_scale", [c]), ("bn_bias", [c]),
                                              ("bn_mean", [c]), ("bn_var", [c]), ("fc_w", [c * h * w, classes])])]
    nodes = [
        helper.make_node("Conv", ["input", "conv_w"], ["conv_out"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormInternal", ["conv_out", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
                         ["bn_out", "bn_mean_out", "bn_var_out", "bn_saved_mean", "bn_saved_inv_std"],
                         name="bn", domain=MS, epsilon=1e-5, momentum=0.9, training_mode=1),
        helper.make_node("Relu", ["bn_out"], ["relu_out"], name="relu"),
        helper.make_node("Flatten", ["relu_out"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "fc_w"], ["logits"], name="fc"),
        helper.make_node("SoftmaxCrossEntropyLossInternal", ["logits", "labels"], ["loss", "log_prob"],
                         name="loss", domain=MS, reduction="mean"),
        helper.make_node("SoftmaxCrossEntropyLossGrad", ["loss_grad", "log_prob", "labels"], ["logits_grad"],
                         name="loss_grad_node", domain=MS, reduction="mean"),
        helper.make_node("MatMul", ["logits_grad", "fc_w_t"], ["flat_grad"], name="fc_grad"),
        helper.make_node("Reshape", ["flat_grad", "relu_shape"], ["relu_out_grad"], name="unflatten"),
        helper.make_node("ReluGrad", ["relu_out_grad", "relu_out"], ["bn_out_grad"], name="relu_grad", domain=MS),
        helper.make_node("BatchNormalizationGrad", ["bn_out_grad", "conv_out", "bn_scale", "bn_saved_mean",
                                                    "bn_saved_inv_std"],
                         ["conv_out_grad", "bn_scale_grad", "bn_bias_grad"], name="bn_grad", domain=MS,
                         epsilon=1e-5),
        helper.make_node("ConvGrad", ["conv_out_grad", "input", "conv_w"], ["", "conv_w_grad", ""],
                         name="conv_grad", domain=MS, pads=[1, 1, 1, 1]),
        helper.make_node("InPlaceAccumulatorV2", ["conv_w_grad_acc", "conv_w_grad"],
                         ["conv_w_grad_acc_updated", "conv_w_grad_acc_out"], name="acc_w", domain=MS),
        helper.make_node("InPlaceAccumulatorV2", ["bn_scale_grad_acc", "bn_scale_grad"],
                         ["bn_scale_grad_acc_updated", "bn_scale_grad_acc_out"], name="acc_scale", domain=MS),
        helper.make_node("InPlaceAccumulatorV2", ["bn_bias_grad_acc", "bn_bias_grad"],
                         ["bn_bias_grad_acc_updated", "bn_bias_grad_acc_out"], name="acc_bias", domain=MS),
    ]
    graph = helper.make_graph(
        nodes, "training", [vi("input", f, [n, 3, h, w]), vi("labels", TensorProto.INT64, [n]),
                            vi("loss_grad", f, []), vi("fc_w_t", f, [classes, c * h * w]),
                            vi("relu_shape", TensorProto.INT64, [4]), vi("conv_w_grad_acc", f, [c, 3, 3, 3]),
                            vi("bn_scale_grad_acc", f, [c]), vi("bn_bias_grad_acc", f, [c])],
        [vi("loss", f, []), vi("bn_mean_out", f, [c]), vi("bn_var_out", f, [c]),
         vi("conv_w_grad_acc_updated", TensorProto.BOOL, [1]), vi("bn_scale_grad_acc_updated", TensorProto.BOOL, [1]),
         vi("bn_bias_grad_acc_updated", TensorProto.BOOL, [1])],
        init, value_info=[vi("bn_out_grad", f, [n, c, h, w])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model


def _without_trailing_empty_outputs(node: onnx.NodeProto) -> onnx.NodeProto:
    node = onnx.NodeProto.FromString(node.SerializeToString())
    outputs = list(node.output)
    while outputs and not outputs[-1]:
        outputs.pop()
    del node.output[:]
    node.output.extend(outputs)
    return node


def _check_only_batch_norm_nodes_changed(model, lowered, same=lambda a, b: a == b):
    bn_ops = {o for d, o in (e.binding.key for e in load_schemas()) if d == MS}  # every op oplower lowers
    assert not [n for n in lowered.graph.node if n.domain == MS and n.op_type in bn_ops]
    before = [n for n in model.graph.node if not (n.domain == MS and n.op_type in bn_ops)]
    by_name = {n.name: n for n in lowered.graph.node}
    for node in before:
        assert node.name in by_name, f"{node.name} disappeared"
        assert same(by_name[node.name], node), f"{node.name} changed:\n{by_name[node.name]}\nwas\n{node}"
    # the untouched nodes keep their order
    order = [n.name for n in lowered.graph.node if n.name in {m.name for m in before}]
    assert order == [n.name for n in before]
    # other training ops still need their domain; graph inputs, outputs and initializers are unchanged
    assert any(o.domain == MS for o in lowered.opset_import)
    assert list(lowered.graph.input) == list(model.graph.input)
    # ... plus each accumulation buffer's in-place update (DESIGN.md section 9)
    # (and the running statistics BatchNormInternal updates in training mode), in node order
    updated = [name for n in model.graph.node for name in (
        n.input[3:5] if n.op_type == "BatchNormInternal" else n.input[:1] if n.op_type == "InPlaceAccumulatorV2"
        else [])]
    assert [o.name for o in lowered.graph.output] == [o.name for o in model.graph.output] + \
        [f"{b}.updated" for b in updated]
    assert list(lowered.graph.initializer) == list(model.graph.initializer)
    # the lowered batch-norm nodes are standard ONNX
    new = [n for n in lowered.graph.node if n.name not in {m.name for m in before}]
    assert new and all(n.domain in ("", "ai.onnx") for n in new)


@pytest.mark.parametrize("opset", [12, 17])
def test_training_graph_only_batch_norm_nodes_change(opset):
    model = _training_graph(opset)
    lowered = _lower(model)
    _check_only_batch_norm_nodes_changed(
        model, lowered, lambda a, b: _without_trailing_empty_outputs(a) == _without_trailing_empty_outputs(b))


def test_training_graph_other_node_protos_byte_identical():
    model = _training_graph(12)
    _check_only_batch_norm_nodes_changed(model, _lower(model))


def test_check_verifies_the_bound_ops_and_leaves_other_training_ops_alone(tmp_path, capsys):
    """com.microsoft is a shared domain: ops oplower has no spec for are onnxruntime's, not unknown ops."""
    from lowering.cli import main

    path = tmp_path / "train.onnx"
    onnx.save(_training_graph(12), path)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "com.microsoft BatchNormInternal" in out and "com.microsoft BatchNormalizationGrad" in out
    assert "com.microsoft ConvGrad" in out and "com.microsoft InPlaceAccumulatorV2" in out
    assert "SoftmaxCrossEntropyLossInternal" not in out  # no spec here: onnxruntime's, left alone


def test_unknown_op_in_an_owned_domain_is_an_error():
    """onednn is the project's own domain: an op it has no spec for is reported, not passed through."""
    from opdef.errors import VerificationError

    node = helper.make_node("BatchNormTrainingForward", ["x"], ["y"], domain="onednn", name="fwd")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)])
    with pytest.raises(VerificationError, match="unknown op type 'BatchNormTrainingForward'"):
        _lower(model)


# -- the recorded onnxruntime-training cases: at least as accurate as the native kernel ----------------------

def _recorded_bn_internal_cases():
    from _recorded import recorded_cases

    return recorded_cases("BatchNormInternal")


@pytest.mark.parametrize("case", _recorded_bn_internal_cases(), ids=lambda c: c["variant"])
def test_recorded_batch_norm_internal_is_as_accurate_as_the_native_kernel(case):
    """Each recorded case lowered and run: every output within 1e-5 of onnxruntime-training's; in training mode
    each output's error against the float64 reference (runtime.reference) is at most the native kernel's,
    and Y, the running statistics and saved_mean of the 4-d case are the native kernel's bits (the lowering
    runs onnxruntime's BatchNormalization kernel, which is its BatchNormInternal kernel)."""
    from test_training_grads_recorded import assert_matches_recorded, load_case

    from lowering.passes import lower_model

    model, feeds, recorded = load_case(case)
    lowered = lower_model(model)
    onnx.checker.check_model(lowered, full_check=True)
    got = run_model(lowered, feeds)
    assert_matches_recorded(got, recorded)
    (node,) = model.graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if not attrs.get("training_mode", 0):
        return
    truth = reference.batch_norm_internal(*(feeds[n].astype(np.float64) for n in node.input),
                                          epsilon=attrs["epsilon"], momentum=attrs["momentum"])
    for key, name in zip(FORWARD_OUTPUTS, node.output, strict=True):
        want = np.asarray(truth[key], np.float64).reshape(recorded[name].shape)
        scale = float(np.max(np.abs(want)))
        ours = float(np.max(np.abs(got[name] - want))) / scale
        native = float(np.max(np.abs(recorded[name] - want))) / scale
        assert ours <= native * (1 + 1e-9), f"{name}: error {ours:.3g} > onnxruntime-training's {native:.3g}"
        if len(recorded["Y"].shape) == 4 and key != "saved_inv_std":
            np.testing.assert_array_equal(got[name], recorded[name], err_msg=name)
