"""Issue 31's forms with fewer kernels per small training step: the train-step model's AdamW step scalars (stacked
bias corrections, learning_rate and step read as fed) and SoftmaxCrossEntropyLossGrad's one-hot form (the labels'
weights summed out of the one-hot). Each is taken where it applies and gives the other form's bits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import lowering.training.train_step as ts
from lowering import lower_model
from lowering.builder import NodeBuilder
from lowering.rules.training_updates import AdamW, sgd_update

ARTIFACTS = Path(__file__).resolve().parent / "fixtures" / "ort_training" / "artifacts"
F32, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    model.ir_version = 8  # onnx's helpers write the newest IR; onnxruntime 1.23 (Python 3.10) reads up to 11
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


# -- AdamW's step scalars ----------------------------------------------------------------------------------------

def _scalars_model(settings: AdamW, *, stacked: bool, portable: bool) -> onnx.ModelProto:
    """learning_rate [1], step [1] -> the step scalars, each as [1]; the unstacked form reads them as scalars
    (the optimizer model's Loop body, a train step with a rank-0 parameter alone)."""
    graph = helper.make_graph([], "scalars", [helper.make_tensor_value_info("learning_rate", F32, [1]),
                                              helper.make_tensor_value_info("step", I64, [1])], [])
    b = NodeBuilder(17, "s", lambda name: False, into=graph.node)
    lr, step = "learning_rate", "step"
    if not stacked:
        scalar = b.const(np.array([], np.int64), hint="scalar_shape")
        lr, step = b.op1("Reshape", [lr, scalar]), b.op1("Reshape", [step, scalar])
    s = settings.step_scalars(b, lr, step, stacked=stacked, portable=portable)
    one = b.const(np.array([1], np.int64), hint="one_element")
    for name in ("alpha_correction", "beta_correction", "lr_corrected", "lr_decay"):
        b.op1("Reshape", [getattr(s, name), one], name)
        graph.output.append(helper.make_tensor_value_info(name, F32, [1]))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("mode, correct_bias", [(1, 1), (0, 1), (1, 0)])
def test_stacked_step_scalars_give_the_kernels_bits(mode, correct_bias):
    """One Pow over [alpha, beta] (int64 exponent on onnxruntime) and two Slices give the two Pow, Cast, Sub
    chains' bits, and both equal onnxruntime-training's kernel: 1 - (float)pow(a, t) and lr * (sqrt(c2) / c1)."""
    settings = AdamW(float(np.float32(0.9)), float(np.float32(0.999)), float(np.float32(1e-6)), 0.0, mode,
                     correct_bias)
    models = {(stacked, portable): _scalars_model(settings, stacked=stacked, portable=portable)
              for stacked, portable in ((False, False), (True, False), (True, True))}
    stacked_ops = [n.op_type for n in models[True, False].graph.node if n.op_type != "Constant"]
    if correct_bias:
        assert stacked_ops.count("Pow") == 1 and "Cast" not in [
            n.op_type for n in models[True, False].graph.node if "step" in n.input]
    sessions = {k: _session(m) for k, m in models.items()}
    f32 = np.float32
    lr = f32(0.0123)
    for t in [*range(1, 400), 1000, 12345, 10**6]:
        feeds = {"learning_rate": np.array([lr], f32), "step": np.array([t], np.int64)}
        runs = {k: s.run(None, feeds) for k, s in sessions.items()}
        for got in runs.values():
            for a, b in zip(got, runs[False, False], strict=True):
                assert a.tobytes() == b.tobytes(), t
        c1, c2, lr_corrected, _ = (v[0] for v in runs[True, False])
        if correct_bias:
            assert c1 == f32(1) - f32(np.float64(f32(0.9)) ** t) and c2 == f32(1) - f32(np.float64(f32(0.999)) ** t)
        if mode == 1:
            assert lr_corrected == (lr * (np.sqrt(c2) / c1) if correct_bias else lr), t


@pytest.mark.parametrize("mode, weight_decay", [(0, 0.01), (1, 0.01), (1, 0.0)])
def test_update_with_stacked_scalars_gives_the_scalar_forms_bits(mode, weight_decay):
    """The whole update of a flat buffer, from [1]-shaped stacked scalars and from rank-0 unstacked ones."""
    settings = AdamW(float(np.float32(0.9)), float(np.float32(0.999)), float(np.float32(1e-8)),
                     float(np.float32(weight_decay)), mode, 1)
    n = 1000
    graph = helper.make_graph([], "update", [helper.make_tensor_value_info("learning_rate", F32, [1]),
                                             helper.make_tensor_value_info("step", I64, [1]),
                                             *(helper.make_tensor_value_info(x, F32, [n]) for x in "wgab")], [])
    b = NodeBuilder(17, "u", lambda name: False, into=graph.node)
    scalar = b.const(np.array([], np.int64), hint="scalar_shape")
    for form, stacked in (("stacked", True), ("scalar", False)):
        lr, step = "learning_rate", "step"
        if not stacked:
            lr, step = b.op1("Reshape", [lr, scalar]), b.op1("Reshape", [step, scalar])
        scalars = settings.step_scalars(b, lr, step, stacked=stacked)
        for value, name in zip(settings.update(b, scalars, "w", "g", "a", "b"), "wab", strict=True):
            b.op1("Identity", [value], f"{form}.{name}")
            graph.output.append(helper.make_tensor_value_info(f"{form}.{name}", F32, [n]))
    session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    rng = np.random.default_rng(mode)
    for t in (1, 2, 3, 10, 1000):
        feeds = {"learning_rate": np.array([0.01], np.float32), "step": np.array([t], np.int64),
                 "w": rng.standard_normal(n).astype(np.float32), "g": rng.standard_normal(n).astype(np.float32),
                 "a": rng.standard_normal(n).astype(np.float32) * 0.1, "b": rng.random(n).astype(np.float32) * 0.01}
        out = session.run(None, feeds)
        for stacked_value, scalar_value in zip(out[:3], out[3:], strict=True):
            assert stacked_value.tobytes() == scalar_value.tobytes(), t


def test_train_step_reads_learning_rate_and_step_as_fed():
    """Every trainable parameter of rank 1 or more: no Reshape of learning_rate or step, one Pow, no Cast of step."""
    step = ts.train_step(ARTIFACTS / "cnn", flat_state=True)
    readers = [n.op_type for n in step.model.graph.node if {"learning_rate", "step"} & set(n.input)]
    assert sorted(readers) == ["Mul", "Mul", "Pow"]  # lr * (sqrt(c2) / c1), lr * weight_decay; the corrections
    assert [n.op_type for n in step.model.graph.node].count("Pow") == 1


def _feeds(step):
    directory = ARTIFACTS / "cnn"
    meta = json.loads((directory / "meta.json").read_text())
    initial, data = dict(np.load(directory / "initial_params.npz")), dict(np.load(directory / "data.npz"))
    interface = step.interface
    feeds = {interface.data[0]: data["input"], meta["labels_input"]: data["labels"],
             "learning_rate": np.array([meta["learning_rate"]], np.float32)}
    feeds |= {p: initial[p] for p in interface.params} | {n: initial[n] for n in interface.frozen}
    return feeds | {p + m: np.zeros_like(initial[p]) for p in interface.params
                    for m in (".first_order_moment", ".second_order_moment")}


@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
def test_a_parameter_of_unknown_rank_alone_gets_scalar_step_values(target, monkeypatch):
    """A parameter of unknown shape is updated alone and may be of rank 0: learning_rate and step are reshaped to
    scalars (its update keeps its shape), the unstacked corrections; two steps give the stacked form's bits."""
    stacked = ts.train_step(ARTIFACTS / "cnn", target=target)
    real = ts._static_shape
    monkeypatch.setattr(ts, "_static_shape", lambda vi: None if vi.name == "13.bias" else real(vi))
    scalar = ts.train_step(ARTIFACTS / "cnn", target=target)
    assert [n.op_type for n in scalar.model.graph.node if {"learning_rate", "step"} & set(n.input)] == \
        ["Reshape", "Reshape"]
    assert [n.op_type for n in scalar.model.graph.node].count("Pow") == 2
    runs = []
    for step in (stacked, scalar):
        session = _session(step.model)
        names = [o.name for o in session.get_outputs()]
        fed = _feeds(step)
        for k in (1, 2):
            out = dict(zip(names, session.run(None, {**fed, "step": np.array([k], np.int64)}), strict=True))
            fed = {**fed, **{n: out[f"{n}.updated"] for n in step.interface.state_inputs}}
        runs.append(out)
    assert runs[0].keys() == runs[1].keys()
    for name in runs[0]:
        np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)


# -- SoftmaxCrossEntropyLossGrad ---------------------------------------------------------------------------------

def _sce_grad_model(shape, reduction, label_type, ignore_index, symbolic_classes: bool, io=F32) -> onnx.ModelProto:
    label_shape = [shape[0], *shape[2:]]
    dy_shape = label_shape if reduction == "none" else []
    attrs = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    node = helper.make_node("SoftmaxCrossEntropyLossGrad", ["dy", "lp", "label"], ["dl"], domain="com.microsoft",
                            name="sg", **attrs)
    lp_shape = list(shape)
    if symbolic_classes:
        lp_shape[1] = "C"
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("dy", io, dy_shape),
                                            helper.make_tensor_value_info("lp", io, lp_shape),
                                            helper.make_tensor_value_info("label", label_type, label_shape)],
                              [helper.make_tensor_value_info("dl", io, lp_shape)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
@pytest.mark.parametrize("io", [F32, TensorProto.FLOAT16])
@pytest.mark.parametrize("label_type", [I64, I32])
@pytest.mark.parametrize("ignore_index", [None, -100, 5, 2**40])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(6, 5), (3, 5, 4)])
def test_sce_loss_grad_onehot_form_gives_the_guarded_forms_bits(shape, reduction, ignore_index, label_type, io,
                                                                 target):
    """C static, no class weights, ignore_index no class id: the one-hot form (8 nodes, 11 for a mean); C only
    known at run time takes the clamp-and-compare form. Labels in range, ignore_index, -1, C and huge ones, and a
    batch where none counts: the same bits."""
    classes = shape[1]
    onehot = lower_model(_sce_grad_model(shape, reduction, label_type, ignore_index, False, io), target=target)
    guarded = lower_model(_sce_grad_model(shape, reduction, label_type, ignore_index, True, io), target=target)
    ops = [n.op_type for n in onehot.graph.node if n.op_type != "Constant"]
    assert {"Min", "Range", "Where"}.isdisjoint(ops) and "Range" in [n.op_type for n in guarded.graph.node]
    # 8; mean: ReduceSum, Max, Div; none: the Unsqueeze of dY; f16: Casts (dY is a scalar: no Reshape)
    assert len(ops) == 8 + (reduction == "mean") * 3 + (reduction == "none") + (io != F32) * 3
    rng = np.random.default_rng(len(shape) + classes)
    int_np = np.int64 if label_type == I64 else np.int32
    np_io = np.float32 if io == F32 else np.float16
    batches = []
    for bad in ([], [-1, classes, 2**31 - 1 if label_type == I32 else 2**33 + 1, -(2**31)], None):
        label = rng.integers(0, classes, (shape[0], *shape[2:]))
        if bad is None:  # nothing counts: dY undivided
            label[...] = -1
        else:
            label.flat[:len(bad)] = bad
            if ignore_index is not None and np.iinfo(int_np).min <= ignore_index <= np.iinfo(int_np).max:
                label.flat[-1] = ignore_index
        scores = rng.standard_normal(shape)
        log_prob = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
        dy = rng.standard_normal(label.shape) if reduction == "none" else np.array(1.7)
        batches.append({"dy": dy.astype(np_io), "lp": log_prob.astype(np_io), "label": label.astype(int_np)})
    sessions = [_session(m) for m in (onehot, guarded)]
    for feeds in batches:
        got, want = (s.run(None, feeds)[0] for s in sessions)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("shape, ignore_index", [((6, 5), 2), ((256, 128), None), ((256, 129), None)])
def test_sce_loss_grad_keeps_the_guard_for_a_class_ignored_or_a_large_log_prob(shape, ignore_index):
    """ignore_index 2 is a class id; past ONEHOT_WEIGHTS_LIMIT elements the one-hot's extra pass costs more than
    the kernels it saves ([256, 128] is the limit itself)."""
    model = _sce_grad_model(shape, "mean", I64, ignore_index, False)
    ops = [n.op_type for n in lower_model(model).graph.node]
    guarded = shape != (256, 128)
    assert ("Min" in ops) == guarded and ("Range" in ops) == guarded


# -- SGD -----------------------------------------------------------------------------------------------------------

def test_sgd_update_is_one_sub_with_the_neg_forms_bits():
    """w - lr * g gives w + (-lr) * g's bits (zeros of both signs, infinities, subnormals included); a NaN stays a
    NaN (its sign bit may differ: onnxruntime's Sub flips a NaN subtrahend's)."""
    graph = helper.make_graph([], "sgd", [helper.make_tensor_value_info(n, F32, s)
                                          for n, s in (("w", [64]), ("g", [64]), ("lr", [1]))], [])
    b = NodeBuilder(17, "s", lambda name: False, into=graph.node)
    b.op1("Identity", [sgd_update(b, "lr", "w", "g")], "new")
    b.op1("Add", ["w", b.op1("Mul", [b.op1("Neg", ["lr"]), "g"])], "old")
    graph.output.extend(helper.make_tensor_value_info(n, F32, [64]) for n in ("new", "old"))
    assert [n.op_type for n in graph.node].count("Neg") == 1  # the old form's alone
    session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    rng = np.random.default_rng(7)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3e38, -3e38, 1.0], np.float32)
    for lr in (1e-3, -0.5, 0.0, -0.0, 3e38, np.inf):
        w, g = (np.concatenate([special, rng.standard_normal(54).astype(np.float32)]) for _ in range(2))
        g = rng.permutation(g)
        new, old = session.run(None, {"w": w, "g": g, "lr": np.array([lr], np.float32)})
        nan = np.isnan(old)
        assert np.array_equal(np.isnan(new), nan) and new[~nan].tobytes() == old[~nan].tobytes(), lr
