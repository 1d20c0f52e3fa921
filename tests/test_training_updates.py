"""onnxruntime-training's in-place update ops: InPlaceAccumulatorV2, AdamWOptimizer, SGDOptimizerV2.

Spec documents -> schema facts; the lowered graphs (standard ONNX, onnx.checker full_check) run in plain
onnxruntime against the float64 references of runtime/reference_updates.py; the in-place contract
(``<input>.updated`` main-graph outputs, DESIGN.md section 9); one failing test per checked constraint.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import lowering
from opdef.errors import LoweringError, VerificationError
from opdef.parse import parse_spec
from runtime import reference_updates as ref

SPECS = Path(__file__).resolve().parent.parent / "specs" / "com.microsoft"
MS = "com.microsoft"
F32 = TensorProto.FLOAT
SEQ = helper.make_sequence_type_proto(helper.make_tensor_type_proto(F32, None))
SHAPES = [(3, 4), (5,), (), (2, 1, 3)]  # a rank-0 parameter too: the scalars must not widen it
vi = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, opset=17, value_info=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)],
                             ir_version=8)


def _lower_and_run(model, feeds):
    lowered = lowering.lower_model(model)
    onnx.checker.check_model(lowered, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lowered, dict(zip(names, session.run(None, feeds), strict=True))


def _close(got, want, tol=2e-6, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-30)
    err = float(np.max(np.abs(got - want))) / scale if want.size else 0.0
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


# -- spec documents -----------------------------------------------------------------------------------

def test_accumulator_spec_facts():
    s = parse_spec(SPECS / "InPlaceAccumulatorV2.rst")
    assert [(a.name, a.optional) for a in s.inputs] == [
        ("accumulation_buffer", False), ("value", False), ("overwrite_flag", True)]
    assert [(a.name, a.optional) for a in s.outputs] == [("updated", False), ("accumulation_buffer_out", True)]
    assert s.attributes == ()
    tc = s.type_constraint_map
    assert tc[s.input("value").type_var] == ("f32", "f16", "f64")
    assert tc[s.input("overwrite_flag").type_var] == ("boolean",)


def test_adamw_spec_facts():
    s = parse_spec(SPECS / "AdamWOptimizer.rst")
    assert [a.name for a in s.inputs] == ["lr", "step", "weights", "gradients", "momentums_1", "momentums_2",
                                          "update_signal"]
    assert [a.optional for a in s.outputs] == [False, True, True, True]
    assert {a.name: a.default for a in s.attributes} == {
        "alpha": 0.9, "beta": 0.999, "epsilon": 1e-8, "weight_decay": 0.01, "adam_mode": 0, "correct_bias": 1}
    tc = s.type_constraint_map
    assert tc[s.input("weights").type_var] == ("seq(f32)",)
    assert tc[s.input("step").type_var] == ("s64",)


def test_sgd_spec_facts():
    s = parse_spec(SPECS / "SGDOptimizerV2.rst")
    assert [(a.name, a.optional) for a in s.inputs] == [
        ("lr", False), ("weights", False), ("gradients", False), ("update_signal", True)]
    assert [a.name for a in s.outputs] == ["update_completed", "updated_weights"]
    assert s.type_constraint_map[s.input("gradients").type_var] == ("seq(f32)",)


def test_sequence_types_reach_onnx_defs():
    from opdef.onnx_defs import _tensor_types
    assert _tensor_types(("seq(f32)",)) == ["seq(tensor(float))"]


# -- InPlaceAccumulatorV2 -----------------------------------------------------------------------------

def _accumulator_model(overwrite=True, flag_shape=(1,), name_out=False, opset=17):
    inputs = ["w_grad.accumulation.buffer", "w_grad"] + (["lazy_reset_grad"] if overwrite else [])
    outputs = ["w_grad.accumulation.out"] + (["w_grad.buffer_named"] if name_out else [])
    graph_inputs = [vi("w_grad.accumulation.buffer", F32, [2, 3]), vi("w_grad", F32, [2, 3])]
    if overwrite:
        graph_inputs.append(vi("lazy_reset_grad", TensorProto.BOOL, [1]))
    return _model([helper.make_node("InPlaceAccumulatorV2", inputs, outputs, domain=MS, name="acc")],
                  graph_inputs, [vi("w_grad.accumulation.out", TensorProto.BOOL, list(flag_shape))], opset=opset)


@pytest.mark.parametrize("lazy_reset_grad", [True, False])
@pytest.mark.parametrize("opset", [12, 17])
def test_accumulator_honours_lazy_reset_grad(lazy_reset_grad, opset):
    rng = np.random.default_rng(1)
    buffer, grad = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    lowered, out = _lower_and_run(_accumulator_model(opset=opset), {
        "w_grad.accumulation.buffer": buffer, "w_grad": grad, "lazy_reset_grad": np.array([lazy_reset_grad])})
    assert [o.name for o in lowered.graph.output] == ["w_grad.accumulation.out", "w_grad.accumulation.buffer.updated"]
    updated, want = ref.in_place_accumulator(buffer, grad, lazy_reset_grad)
    _close(out["w_grad.accumulation.buffer.updated"], want, 0 if lazy_reset_grad else 1.2e-7, "buffer")
    assert out["w_grad.accumulation.out"].shape == (1,) and bool(out["w_grad.accumulation.out"][0]) is updated


def test_accumulator_without_overwrite_flag_adds():
    buffer, grad = np.full((2, 3), 0.5, np.float32), np.arange(6, dtype=np.float32).reshape(2, 3)
    _, out = _lower_and_run(_accumulator_model(overwrite=False, flag_shape=()),
                            {"w_grad.accumulation.buffer": buffer, "w_grad": grad})
    _close(out["w_grad.accumulation.buffer.updated"], buffer.astype(np.float64) + grad, 1.2e-7)
    assert out["w_grad.accumulation.out"].shape == () and out["w_grad.accumulation.out"]


def test_accumulator_output_the_node_names_is_kept_and_joined():
    buffer, grad = np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)
    model = _accumulator_model(name_out=True)
    model.graph.output.append(vi("w_grad.buffer_named", F32, [2, 3]))
    lowered, out = _lower_and_run(model, {"w_grad.accumulation.buffer": buffer, "w_grad": grad,
                                          "lazy_reset_grad": np.array([False])})
    assert out["w_grad.buffer_named"].tolist() == out["w_grad.accumulation.buffer.updated"].tolist() == [[2] * 3] * 2


def test_accumulator_c1_shape_mismatch_names_node():
    model = _accumulator_model()
    model.graph.input[1].CopyFrom(vi("w_grad", F32, [2, 4]))
    with pytest.raises(VerificationError) as info:
        lowering.lower_model(model)
    msg = str(info.value)
    assert "'acc'" in msg and "value has shape [2,4]" in msg and "C1" in msg and "\n" not in msg


def test_accumulator_c2_flag_of_two_elements():
    model = _accumulator_model()
    model.graph.input[2].CopyFrom(vi("lazy_reset_grad", TensorProto.BOOL, [2]))
    with pytest.raises(VerificationError, match="overwrite_flag has shape \\[2\\]; expected one element.*C2"):
        lowering.lower_model(model)


def test_updated_name_already_in_use_is_refused():
    model = _accumulator_model()
    model.graph.value_info.append(vi("w_grad.accumulation.buffer.updated", F32, [2, 3]))
    model.graph.node.append(helper.make_node("Identity", ["w_grad"], ["w_grad.accumulation.buffer.updated"]))
    with pytest.raises(LoweringError, match="already uses that name"):
        lowering.lower_model(model)


def test_accumulator_inside_a_subgraph_adds_no_graph_output():
    """Inside an If branch the update is visible only through the outputs the node names (in_place.py)."""
    acc = helper.make_node("InPlaceAccumulatorV2", ["buf", "g"], ["flag", "new_buf"], domain=MS, name="acc")
    branch = helper.make_graph([acc], "then", [], [vi("new_buf", F32, [3])])
    other = helper.make_graph([helper.make_node("Identity", ["buf"], ["kept"])], "else", [], [vi("kept", F32, [3])])
    node = helper.make_node("If", ["c"], ["out"], then_branch=branch, else_branch=other)
    model = _model([node], [vi("c", TensorProto.BOOL, []), vi("buf", F32, [3]), vi("g", F32, [3])],
                   [vi("out", F32, [3])])
    lowered, out = _lower_and_run(model, {"c": np.array(True), "buf": np.ones(3, np.float32),
                                          "g": np.full(3, 2.0, np.float32)})
    assert [o.name for o in lowered.graph.output] == ["out"]
    assert out["out"].tolist() == [3.0, 3.0, 3.0]


# -- optimizers --------------------------------------------------------------------------------------

def _params(seed, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _adamw_model(opset=17, signal=False, **attrs):
    inputs = ["learning_rate", "step", "params", "gradients", "first_order_moments", "second_order_moments"]
    graph_inputs = [vi("learning_rate", F32, [1]), vi("step", TensorProto.INT64, [1])] + \
        [helper.make_value_info(n, SEQ) for n in inputs[2:]]
    if signal:
        inputs.append("update_signal")
        graph_inputs.append(vi("update_signal", TensorProto.BOOL, [1]))
    node = helper.make_node("AdamWOptimizer", inputs, ["update_completed"], domain=MS, name="adamw", **attrs)
    return _model([node], graph_inputs, [vi("update_completed", TensorProto.BOOL, [1])], opset=opset)


def _adamw_feeds(lr, step, w, g, m1, m2, signal=None):
    w, g, m1, m2 = ([np.asarray(t, np.float32) for t in s] for s in (w, g, m1, m2))  # 0-d arrays, not scalars
    feeds = {"learning_rate": np.array([lr], np.float32), "step": np.array([step], np.int64), "params": w,
             "gradients": g, "first_order_moments": m1, "second_order_moments": m2}
    if signal is not None:
        feeds["update_signal"] = np.array([signal])
    return feeds


def _f32(x: float) -> float:
    return float(np.float32(x))  # attributes are stored as f32


ADAMW_CASES = [
    dict(),
    dict(weight_decay=0.01),
    dict(adam_mode=1, weight_decay=0.01, alpha=0.8, beta=0.99, epsilon=1e-6),
    dict(adam_mode=1, correct_bias=0, weight_decay=0.1),
]


@pytest.mark.parametrize("attrs", ADAMW_CASES, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "defaults")
@pytest.mark.parametrize("opset", [13, 17])
def test_adamw_first_and_later_steps_match_the_float64_reference(attrs, opset):
    lowered = lowering.lower_model(_adamw_model(opset, **attrs))
    onnx.checker.check_model(lowered, full_check=True)
    assert [o.name for o in lowered.graph.output] == [
        "update_completed", "params.updated", "first_order_moments.updated", "second_order_moments.updated"]
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    w = _params(2)
    m1, m2 = [np.zeros_like(p) for p in w], [np.zeros_like(p) for p in w]
    # the spec's defaults (weight_decay 0.01 as onnxruntime-training's kernel: its recorded 'defaults' fixture
    # case decays), stored as f32 like any attribute
    defaults = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8, "weight_decay": 0.01, "adam_mode": 0,
                "correct_bias": 1}
    hyper = {k: _f32(v) if isinstance(v, float) else v for k, v in {**defaults, **attrs}.items()}
    want = (w, m1, m2)
    for step in (1, 2, 3):  # step 1 first, as onnxruntime-training; later steps carry the moments
        g = _params(10 + step)
        flag, w, m1, m2 = session.run(None, _adamw_feeds(1e-2, step, w, g, m1, m2))
        _, *want = ref.adamw_optimizer(_f32(1e-2), step, want[0], g, want[1], want[2], **hyper)
        assert flag.tolist() == [True]
        for got_list, want_list, what in zip((w, m1, m2), want, ("params", "m1", "m2"), strict=True):
            assert len(got_list) == len(SHAPES)
            for i, (got, exp) in enumerate(zip(got_list, want_list, strict=True)):
                _close(got, exp, 1e-5, f"step {step} {what}[{i}]")


def test_adamw_first_step_moves_each_weight_by_about_the_learning_rate():
    """Independent of the reference: at step 1 with zero moments, bias-corrected Adam moves every element
    by lr * g / (|g| + eps'), i.e. by the learning rate, against the gradient's sign."""
    w, g = _params(3), _params(4)
    _, out = _lower_and_run(_adamw_model(weight_decay=0.0), _adamw_feeds(1e-3, 1, w, g, [np.zeros_like(p) for p in w],
                                                         [np.zeros_like(p) for p in w]))
    for before, grad, after in zip(w, g, out["params.updated"], strict=True):
        np.testing.assert_allclose(after - before, -1e-3 * np.sign(grad), rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("signal", [True, False])
def test_adamw_update_signal(signal):
    w, g = _params(5), _params(6)
    m1, m2 = _params(7), [np.abs(p) for p in _params(8)]
    _, out = _lower_and_run(_adamw_model(signal=True), _adamw_feeds(1e-2, 4, w, g, m1, m2, signal))
    flag, *want = ref.adamw_optimizer(_f32(1e-2), 4, w, g, m1, m2, alpha=_f32(0.9), beta=_f32(0.999),
                                      epsilon=_f32(1e-8), weight_decay=_f32(0.01), adam_mode=0, correct_bias=1,
                                      update_signal=signal)
    assert out["update_completed"].tolist() == [flag]
    for got, exp in zip(out["params.updated"], want[0], strict=True):
        _close(got, exp, 1e-5 if signal else 0)


def test_optimizer_below_opset_13_is_refused_clearly():
    with pytest.raises(LoweringError, match="'adamw'.*needs default opset 13 or newer.*imports opset 12"):
        lowering.lower_model(_adamw_model(opset=12))


def test_adamw_c3_mode_0_needs_correct_bias():
    with pytest.raises(VerificationError, match="'adamw'.*correct_bias is 0 with adam_mode 0.*C3"):
        lowering.lower_model(_adamw_model(correct_bias=0))


def test_adamw_c1_learning_rate_of_two_elements():
    model = _adamw_model()
    model.graph.input[0].CopyFrom(vi("learning_rate", F32, [2]))
    with pytest.raises(VerificationError, match="'adamw'.*lr has shape \\[2\\]; expected one element.*C1"):
        lowering.lower_model(model)


def test_adamw_attribute_outside_allowed_values():
    with pytest.raises(VerificationError, match="adam_mode"):
        lowering.lower_model(_adamw_model(adam_mode=2))


def _sgd_model(signal=False):
    inputs = ["learning_rate", "params", "gradients"] + (["update_signal"] if signal else [])
    graph_inputs = [vi("learning_rate", F32, [1]), helper.make_value_info("params", SEQ),
                    helper.make_value_info("gradients", SEQ)]
    if signal:
        graph_inputs.append(vi("update_signal", TensorProto.BOOL, [1]))
    node = helper.make_node("SGDOptimizerV2", inputs, ["update_completed"], domain=MS, name="sgd")
    return _model([node], graph_inputs, [vi("update_completed", TensorProto.BOOL, [1])])


@pytest.mark.parametrize("signal", [None, True, False])
def test_sgd_matches_the_float64_reference(signal):
    w, g = _params(9), _params(10)
    feeds = {"learning_rate": np.array([0.1], np.float32), "params": w, "gradients": g}
    if signal is not None:
        feeds["update_signal"] = np.array([signal])
    lowered, out = _lower_and_run(_sgd_model(signal is not None), feeds)
    assert [o.name for o in lowered.graph.output] == ["update_completed", "params.updated"]
    flag, want = ref.sgd_optimizer(_f32(0.1), w, g, signal)
    assert out["update_completed"].tolist() == [flag]
    for got, exp in zip(out["params.updated"], want, strict=True):
        _close(got, exp, 1e-6)


def test_optimizer_model_lowers_through_the_cli(tmp_path):
    from lowering.cli import main
    src, dst = tmp_path / "optimizer_model.onnx", tmp_path / "out.onnx"
    onnx.save(_sgd_model(), src)
    assert main(["lower", str(src), "-o", str(dst)]) == 0
    assert [o.name for o in onnx.load(dst).graph.output] == ["update_completed", "params.updated"]
    bad = _sgd_model()
    bad.graph.input[0].CopyFrom(vi("learning_rate", F32, [3]))
    onnx.save(bad, src)
    dst.unlink()
    assert main(["lower", str(src), "-o", str(dst)]) == 1
    assert not dst.exists()
