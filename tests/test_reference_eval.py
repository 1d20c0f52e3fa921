"""runtime.reference_eval: whole models with custom nodes, evaluated with float64 semantics for them."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

from opdef.binding import Binding
from opdef.errors import VerificationError
from opdef.registry import Entry, Registry
from opdef.schema import Argument, Attribute, Constraint, OpSchema
from runtime import reference
from runtime.reference_eval import evaluate

F32 = TensorProto.FLOAT
EPS = float(np.float32(1e-3))  # what a node's f32 attribute epsilon=1e-3 holds
ROLES = ("src", "diff_dst", "mean", "variance", "gamma", "diff_src", "diff_gamma", "diff_beta", "epsilon")


def _entry(domain, op_type, inputs, outputs, attributes, roles, *, optional_inputs=(), constraints=(),
           rule="batch_norm_backward", **binding):
    schema = OpSchema(
        name=op_type, domain=domain, version=1, dialect="onednn",
        inputs=tuple(Argument(n, optional=n in optional_inputs) for n in inputs),
        outputs=tuple(Argument(n, optional=i > 0) for i, n in enumerate(outputs)),
        attributes=tuple(Attribute(n, "string" if isinstance(d, str) else "f32", d is None, d)
                         for n, d in attributes),
        constraints=tuple(Constraint(f"C{i + 1}", t) for i, t in enumerate(constraints)))
    return Entry(schema, Binding(spec=f"{op_type}.rst", domain=domain, op_type=op_type, rule=rule,
                                 roles=tuple(zip(ROLES if roles is None else roles[0], roles[1], strict=True)
                                             if roles is not None else ()), **binding))


def _registry():
    onednn = _entry("onednn", "BNBackward", ["src", "diff_dst", "mean", "variance", "gamma"],
                    ["diff_src", "diff_gamma", "diff_beta"], [("epsilon", None), ("data_format", "NXC")],
                    (ROLES, ["src", "diff_dst", "mean", "variance", "gamma", "diff_src", "diff_gamma", "diff_beta",
                             "epsilon"]),
                    optional_inputs=("gamma",), layout="data_format", layout_attribute="data_format",
                    constraints=("diff_gamma and diff_beta are both requested or neither of them is.",),
                    options=(("param_grads", "both_or_neither"),))
    dml = _entry("directml", "BN_GRAD", ["In", "InGrad", "Mean", "Var", "Scale"], ["OutGrad", "ScaleGrad", "BiasGrad"],
                 [("Epsilon", None)], (ROLES, ["In", "InGrad", "Mean", "Var", "Scale", "OutGrad", "ScaleGrad",
                                               "BiasGrad", "Epsilon"]), layout="stats_broadcast", statistics="frozen")
    ms_roles = ("src", "diff_dst", "mean", "inv_std", "gamma", "diff_src", "diff_gamma", "diff_beta", "epsilon")
    ms = _entry("com.microsoft", "BatchNormalizationGrad", ["dY", "X", "scale", "saved_mean", "saved_inv_std"],
                ["X_grad", "scale_grad", "bias_grad"], [("epsilon", None)],
                (ms_roles, ["X", "dY", "saved_mean", "saved_inv_std", "scale", "X_grad", "scale_grad", "bias_grad",
                            "epsilon"]), stat_input="inv_std")
    internal_roles = ("src", "gamma", "beta", "input_mean", "input_var", "dst", "running_mean", "running_var",
                      "saved_mean", "saved_inv_std", "epsilon", "momentum", "training_mode")
    internal = _entry("com.microsoft", "BatchNormInternal", ["X", "scale", "B", "input_mean", "input_var"],
                      ["Y", "running_mean", "running_var", "saved_mean", "saved_inv_std"],
                      [("epsilon", 1e-5), ("momentum", 0.9), ("training_mode", 1)],
                      (internal_roles, ["X", "scale", "B", "input_mean", "input_var", "Y", "running_mean",
                                        "running_var", "saved_mean", "saved_inv_std", "epsilon", "momentum",
                                        "training_mode"]), rule="batch_norm_internal")
    return Registry([onednn, dml, ms, internal], Path("specs"))


def _vi(name, shape, elem_type=F32):
    return helper.make_tensor_value_info(name, elem_type, shape)


def _model(nodes, inputs, outputs, domains=("onednn",), functions=()):
    imports = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, 1) for d in domains)]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), opset_imports=imports,
                             functions=list(functions))


def _data(shape, channel_axis, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    c = shape[channel_axis]
    return {"x": rng.normal(size=shape).astype(dtype), "dy": rng.normal(size=shape).astype(dtype),
            "m": rng.normal(size=c).astype(np.float32), "v": rng.uniform(0.5, 2, size=c).astype(np.float32),
            "g": rng.normal(size=c).astype(np.float32)}


def _onednn_model(outputs=("dx", "dg", "db"), **attrs):
    node = helper.make_node("BNBackward", ["x", "dy", "m", "v", "g"], list(outputs), name="bn1", domain="onednn",
                            epsilon=1e-3, **attrs)
    return _model([node], [_vi("x", None), _vi("dy", None), _vi("m", [None]), _vi("v", [None]), _vi("g", [None])],
                  [_vi(o, None) for o in outputs if o])


@pytest.mark.parametrize(("data_format", "channel_axis"), [("NCX", 1), ("NXC", 3), (None, 3)])
def test_onednn_layouts_follow_data_format_and_its_schema_default(data_format, channel_axis):
    feeds = _data((2, 3, 4, 5), channel_axis)
    attrs = {} if data_format is None else {"data_format": data_format}
    out = evaluate(_onednn_model(**attrs), feeds, registry=_registry(), exact=True)
    axes = tuple(a for a in range(4) if a != channel_axis)
    want = reference.batch_norm_backward(feeds["x"], feeds["dy"], feeds["m"], feeds["v"], feeds["g"], epsilon=EPS,
                                         reduce_axes=axes)
    for name, role in (("dx", "diff_src"), ("dg", "diff_gamma"), ("db", "diff_beta")):
        assert out[name].dtype == np.float64
        np.testing.assert_array_equal(out[name], want[role])


def test_results_are_rounded_to_the_ops_types_unless_exact():
    feeds = _data((2, 3, 4), 2, dtype=ml_dtypes.bfloat16)
    feeds["m"], feeds["v"], feeds["g"] = (a.astype(ml_dtypes.bfloat16) for a in (feeds["m"], feeds["v"], feeds["g"]))
    model = _onednn_model()
    for name in ("x", "dy", "m", "v", "g"):
        model.graph.input[[i.name for i in model.graph.input].index(name)].type.tensor_type.elem_type = \
            TensorProto.BFLOAT16
    rounded = evaluate(model, feeds, registry=_registry())
    exact = evaluate(model, feeds, registry=_registry(), exact=True)
    assert all(a.dtype == ml_dtypes.bfloat16 for a in rounded.values())
    for name in rounded:
        np.testing.assert_array_equal(rounded[name], exact[name].astype(ml_dtypes.bfloat16))


def test_single_output_ignores_gamma_per_spec_and_freezes_statistics_upstream():
    feeds = _data((2, 3, 4), 1)
    model = _onednn_model(outputs=("dx",), data_format="NCX")
    spec = evaluate(model, feeds, registry=_registry(), exact=True)["dx"]
    upstream = evaluate(model, feeds, registry=_registry(), exact=True, single_output="upstream")["dx"]
    kw = {"epsilon": EPS, "reduce_axes": (0, 2), "outputs": ("diff_src",)}
    np.testing.assert_array_equal(spec, reference.batch_norm_backward(
        feeds["x"], feeds["dy"], feeds["m"], feeds["v"], **kw)["diff_src"])
    np.testing.assert_array_equal(upstream, reference.batch_norm_backward(
        feeds["x"], feeds["dy"], feeds["m"], feeds["v"], statistics="frozen", **kw)["diff_src"])
    # With a parameter gradient requested (even as the only other one), gamma counts again.
    both = evaluate(_onednn_model(outputs=("dx", "", "db"), data_format="NCX"), feeds, registry=_registry(),
                    exact=True)
    with_gamma = reference.batch_norm_backward(feeds["x"], feeds["dy"], feeds["m"], feeds["v"], feeds["g"], **kw)
    np.testing.assert_array_equal(both["dx"], with_gamma["diff_src"])
    assert set(both) == {"dx", "db"}


def test_directml_reduces_where_stats_have_size_one_with_frozen_statistics():
    rng = np.random.default_rng(4)
    shape, keep = (2, 3, 4, 5), (1, 3, 1, 5)  # statistics per (channel, width): reduce over axes 0 and 2
    x, dy = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
    m, v, g = (rng.uniform(0.5, 2, size=keep).astype(np.float32) for _ in range(3))
    node = helper.make_node("BN_GRAD", ["x", "dy", "m", "v", "g"], ["dx", "dg", "db"], domain="directml",
                            Epsilon=1e-4)
    model = _model([node], [_vi(n, None) for n in ("x", "dy", "m", "v", "g")], [_vi(n, None) for n in
                                                                                ("dx", "dg", "db")], ("directml",))
    out = evaluate(model, {"x": x, "dy": dy, "m": m, "v": v, "g": g}, registry=_registry(), exact=True)
    assert out["dg"].shape == keep and out["db"].shape == keep
    inv = 1.0 / np.sqrt(v.astype(np.float64) + float(np.float32(1e-4)))
    np.testing.assert_allclose(out["dx"], g.astype(np.float64) * inv * dy, rtol=1e-13)
    np.testing.assert_allclose(out["db"], dy.astype(np.float64).sum(axis=(0, 2), keepdims=True), rtol=1e-12)


def test_onnxruntime_training_grad_reads_inv_std():
    feeds = _data((4, 3, 2), 1)
    inv_std = (1.0 / np.sqrt(feeds["v"].astype(np.float64) + 1e-5)).astype(np.float32)
    node = helper.make_node("BatchNormalizationGrad", ["dy", "x", "g", "m", "s"], ["dx", "dg", "db"],
                            domain="com.microsoft", epsilon=1e-5)
    model = _model([node], [_vi(n, None) for n in ("dy", "x", "g", "m", "s")],
                   [_vi(n, None) for n in ("dx", "dg", "db")], ("com.microsoft",))
    out = evaluate(model, {"dy": feeds["dy"], "x": feeds["x"], "g": feeds["g"], "m": feeds["m"], "s": inv_std},
                   registry=_registry(), exact=True)
    want = reference.batch_norm_backward(feeds["x"], feeds["dy"], feeds["m"], inv_std, feeds["g"], epsilon=1e-5,
                                         reduce_axes=(0, 2), stat_input="inv_std")
    np.testing.assert_array_equal(out["dx"], want["diff_src"])
    np.testing.assert_array_equal(out["dg"], want["diff_gamma"])


def test_batch_norm_internal_forward_and_inference_mode():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 3, 5)).astype(np.float32)
    scale, bias, mean, var = (rng.uniform(0.5, 2, size=3).astype(np.float32) for _ in range(4))
    names = ["Y", "rm", "rv", "sm", "sis"]
    train = helper.make_node("BatchNormInternal", ["x", "s", "b", "m", "v"], names, domain="com.microsoft",
                             momentum=0.8)
    model = _model([train], [_vi(n, None) for n in ("x", "s", "b", "m", "v")], [_vi(n, None) for n in names],
                   ("com.microsoft",))
    feeds = {"x": x, "s": scale, "b": bias, "m": mean, "v": var}
    out = evaluate(model, feeds, registry=_registry())
    want = reference.batch_norm_internal(x, scale, bias, mean, var, epsilon=1e-5, momentum=float(np.float32(0.8)))
    for name, key in zip(names, want, strict=True):
        assert out[name].dtype == np.float32
        np.testing.assert_array_equal(out[name], want[key].astype(np.float32))
    infer = helper.make_node("BatchNormInternal", ["x", "s", "b", "m", "v"], ["Y"], domain="com.microsoft",
                             training_mode=0)
    model = _model([infer], [_vi(n, None) for n in ("x", "s", "b", "m", "v")], [_vi("Y", None)], ("com.microsoft",))
    y = evaluate(model, feeds, registry=_registry(), exact=True)["Y"]
    np.testing.assert_allclose(y, scale[:, None] * (x - mean[:, None]) / np.sqrt(var[:, None] + 1e-5) + bias[:, None],
                               rtol=1e-6, atol=1e-6)


def test_custom_nodes_in_subgraphs_and_functions_are_evaluated():
    feeds = _data((2, 3, 4), 1)
    inner = helper.make_node("BNBackward", ["x", "dy", "m", "v", "g"], ["t", "", ""], domain="onednn", epsilon=1e-3,
                             data_format="NCX")
    then_branch = helper.make_graph([inner], "then", [], [_vi("t", None)])
    else_branch = helper.make_graph([helper.make_node("Identity", ["dy"], ["e"])], "else", [], [_vi("e", None)])
    fn = helper.make_function("local", "grad", ["a", "b", "c", "d"], ["r"], [
        helper.make_node("BNBackward", ["a", "b", "c", "d"], ["r"], domain="onednn", epsilon=1e-3,
                         data_format="NCX")], [helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)])
    nodes = [helper.make_node("If", ["cond"], ["from_if"], then_branch=then_branch, else_branch=else_branch),
             helper.make_node("grad", ["x", "dy", "m", "v"], ["from_fn"], domain="local")]
    model = _model(nodes, [_vi("cond", [], TensorProto.BOOL)] + [_vi(n, None) for n in ("x", "dy", "m", "v", "g")],
                   [_vi("from_if", None), _vi("from_fn", None)], ("onednn", "local"), functions=[fn])
    out = evaluate(model, {"cond": np.array(True), **feeds}, registry=_registry(), exact=True)
    kw = {"epsilon": EPS, "reduce_axes": (0, 2), "outputs": ("diff_src",)}
    # The If branch requests no parameter gradient: gamma is ignored (spec), so both equal the gamma-free result.
    want = reference.batch_norm_backward(feeds["x"], feeds["dy"], feeds["m"], feeds["v"], **kw)["diff_src"]
    np.testing.assert_array_equal(out["from_if"], want)
    np.testing.assert_array_equal(out["from_fn"], want)


def test_bad_statistics_shape_is_a_verification_error_naming_the_node():
    feeds = _data((2, 3, 4), 1)
    feeds["m"] = np.zeros(4, np.float32)
    with pytest.raises(VerificationError, match=r"^onednn BNBackward 'bn1': mean has shape \[4\]"):
        evaluate(_onednn_model(data_format="NCX"), feeds, registry=_registry())


# -- the real registry, parsed from specs/ ----------------------------------------------------------

@pytest.fixture(scope="module")
def real_registry():
    from opdef.registry import load_schemas

    return load_schemas()


def _real_case(entry, rng):
    """Inputs, the node and the expected float64 result for one bundled batch-norm backward op."""
    b, schema = entry.binding, entry.schema
    keep_rank = b.layout == "stats_broadcast"
    shape = (2, 3, 4, 5)
    channel_axis = 1
    attrs = {b.arg("epsilon"): 1e-3}
    if b.layout == "data_format":
        attrs[b.layout_attribute] = "NCX"
    stat_shape = (1, 3, 1, 1) if keep_rank else (3,)
    values = {"src": rng.normal(size=shape), "diff_dst": rng.normal(size=shape),
              "mean": rng.normal(size=stat_shape), "variance": rng.uniform(0.5, 2, size=stat_shape),
              "gamma": rng.normal(size=stat_shape), "beta": rng.normal(size=stat_shape)}
    values["inv_std"] = 1.0 / np.sqrt(values["variance"] + 1e-3)
    by_name = {name: role for role, name in b.roles}
    feeds, inputs = {}, []
    for arg in schema.inputs:
        role = by_name.get(arg.name, "beta" if arg.name == "beta" else None)
        if role is None:
            pytest.fail(f"{b.key}: input {arg.name} has no role")
        feeds[arg.name] = values[role].astype(np.float32)
        inputs.append(arg.name)
    outputs = [f"out_{a.name}" for a in schema.outputs]
    node = helper.make_node(b.op_type, inputs, outputs, name="n", domain=b.domain, **attrs)
    model = _model([node], [_vi(n, None) for n in inputs], [_vi(n, None) for n in outputs], (b.domain,))
    stat = feeds[b.arg(b.stat_input) or b.arg("variance")]
    want = reference.batch_norm_backward(
        feeds[b.arg("src")], feeds[b.arg("diff_dst")], feeds[b.arg("mean")], stat, feeds[b.arg("gamma")],
        epsilon=EPS, reduce_axes=tuple(a for a in range(4) if a != channel_axis), statistics=b.statistics,
        stat_input=b.stat_input)
    expected = {f"out_{b.arg(role)}": value for role, value in want.items()}
    return model, feeds, expected


def test_every_bundled_backward_op_evaluates_like_the_reference(real_registry):
    rng = np.random.default_rng(6)
    entries = [e for e in real_registry if e.binding.rule == "batch_norm_backward"]
    assert entries
    for entry in entries:
        model, feeds, expected = _real_case(entry, rng)
        out = evaluate(model, feeds, registry=real_registry, exact=True)
        assert set(out) == set(expected), entry.binding.key
        for name, value in expected.items():
            np.testing.assert_allclose(out[name], value, rtol=1e-12, atol=1e-12, err_msg=f"{entry.binding.key} {name}")


def test_bundled_batch_norm_internal_evaluates_like_the_reference(real_registry):
    entry = real_registry.get("com.microsoft", "BatchNormInternal")
    assert entry is not None, "specs/ must bind com.microsoft BatchNormInternal"
    rng = np.random.default_rng(7)
    x = rng.normal(size=(4, 3, 2, 2)).astype(np.float32)
    stats = [rng.uniform(0.5, 2, size=3).astype(np.float32) for _ in range(4)]
    inputs = [a.name for a in entry.schema.inputs]
    outputs = [a.name for a in entry.schema.outputs]
    node = helper.make_node("BatchNormInternal", inputs, outputs, domain="com.microsoft")
    model = _model([node], [_vi(n, None) for n in inputs], [_vi(n, None) for n in outputs], ("com.microsoft",))
    out = evaluate(model, dict(zip(inputs, [x, *stats], strict=True)), registry=real_registry, exact=True)
    want = reference.batch_norm_internal(x, *stats, epsilon=1e-5, momentum=0.9)
    for name, value in zip(outputs, want.values(), strict=True):
        np.testing.assert_array_equal(out[name], value)
