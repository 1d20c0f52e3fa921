"""A small CNN's backward pass as onnxruntime-training writes it (standard forward ops, then ConvGrad,
ReluGrad, MaxPoolGrad, AveragePoolGrad, Scale, SoftmaxCrossEntropyLossGrad and BatchNorm's gradient ops), lowered
whole and run on plain onnxruntime: every gradient against the float64 chain of runtime.reference_training
and runtime.reference, and against finite differences of the float64 loss."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lowering.passes import lower_model
from runtime import reference_training as ref
from runtime.session import run_model

MS = "com.microsoft"
F32, I64 = TensorProto.FLOAT, TensorProto.INT64
vi = helper.make_tensor_value_info
N, C, H, M, CLASSES = 4, 3, 8, 6, 5  # batch, input channels, image size, conv channels, classes
PADS = [1, 1, 1, 1]


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((N, C, H, H)), "w": rng.standard_normal((M, C, 3, 3)) * 0.3,
            "b": rng.standard_normal(M) * 0.1, "fc": rng.standard_normal((M * 2 * 2, CLASSES)) * 0.3,
            "label": rng.integers(0, CLASSES, N)}


def _forward(p, w=None, b=None):
    """float64: conv -> relu -> maxpool 2x2/2 -> avgpool 2x2/2 -> flatten -> matmul -> cross-entropy (mean)."""
    w = p["w"] if w is None else w
    b = p["b"] if b is None else b
    conv = ref.conv(p["x"], w, b, pads=PADS)
    relu = np.maximum(conv, 0)
    pooled, indices = ref.max_pool(relu, [2, 2], [2, 2], [0, 0, 0, 0], [H // 2, H // 2])
    avg = ref.average_pool(pooled, [2, 2], [2, 2], [0, 0, 0, 0], [H // 4, H // 4])
    logits = avg.reshape(N, -1) @ p["fc"]
    loss, log_prob = ref.softmax_cross_entropy_loss(logits, p["label"])
    return loss, dict(conv=conv, relu=relu, pooled=pooled, indices=indices, avg=avg, log_prob=log_prob)


def _model(p, opset):
    q = H // 4
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["conv"], name="conv", pads=PADS),
        helper.make_node("Relu", ["conv"], ["relu"], name="relu"),
        helper.make_node("MaxPool", ["relu"], ["pooled", "indices"], name="maxpool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("AveragePool", ["pooled"], ["avg"], name="avgpool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["avg"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "fc"], ["logits"], name="fc"),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss", "log_prob"], name="loss",
                         reduction="mean"),
        # backward, as the gradient builder writes it
        helper.make_node("Scale", ["loss_grad_in", "one"], ["loss_grad"], name="loss_scale", domain=MS),
        helper.make_node("SoftmaxCrossEntropyLossGrad", ["loss_grad", "log_prob", "label"], ["logits_grad"],
                         name="loss_grad", domain=MS, reduction="mean"),
        helper.make_node("Transpose", ["fc"], ["fc_t"], name="fc_t", perm=[1, 0]),
        helper.make_node("MatMul", ["logits_grad", "fc_t"], ["flat_grad"], name="flat_grad"),
        helper.make_node("Reshape", ["flat_grad", "avg_shape"], ["avg_grad"], name="unflatten"),
        helper.make_node("AveragePoolGrad", ["avg_grad"], ["pooled_grad"], name="avgpool_grad", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("MaxPoolGrad", ["pooled_grad", "indices"], ["relu_grad_out"], name="maxpool_grad",
                         kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("ReluGrad", ["relu_grad_out", "relu"], ["conv_grad_in"], name="relu_grad", domain=MS),
        helper.make_node("ConvGrad", ["conv_grad_in", "x", "w"], ["", "w_grad", "b_grad"], name="conv_grad",
                         domain=MS, pads=PADS),
    ]
    inits = [numpy_helper.from_array(p[name].astype(np.float32), name) for name in ("w", "b", "fc")] + [
        numpy_helper.from_array(np.array([1.0], np.float32), "one"),
        numpy_helper.from_array(np.array([N, M, q, q], np.int64), "avg_shape")]
    graph = helper.make_graph(
        nodes, "train", [vi("x", F32, [N, C, H, H]), vi("label", I64, [N]), vi("loss_grad_in", F32, [])],
        [vi("loss", F32, []), vi("w_grad", F32, [M, C, 3, 3]), vi("b_grad", F32, [M])], inits,
        value_info=[vi("relu_grad_out", F32, [N, M, H, H]), vi("pooled_grad", F32, [N, M, H // 2, H // 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 7
    return model


@pytest.mark.parametrize("opset", [12, 15, 17])
def test_cnn_backward_slice_runs_on_plain_onnxruntime(opset):
    p = _params()
    lowered = lower_model(_model(p, opset))
    onnx.checker.check_model(lowered, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    got = run_model(lowered, {"x": p["x"].astype(np.float32), "label": p["label"],
                              "loss_grad_in": np.array(1.0, np.float32)})
    loss, saved = _forward(p)
    # the float64 chain, op by op
    d_logits = ref.softmax_cross_entropy_loss_grad(np.array(1.0), saved["log_prob"], p["label"])
    d_avg = (d_logits @ p["fc"].T).reshape(saved["avg"].shape)
    d_pooled = ref.average_pool_grad(d_avg, saved["pooled"].shape, [2, 2], [2, 2], [0, 0, 0, 0])
    d_relu = ref.max_pool_grad(d_pooled, saved["indices"], saved["relu"].shape)
    d_conv = ref.relu_grad(d_relu, saved["conv"])
    _, dw, db = ref.conv_grad(d_conv, p["x"], p["w"], pads=PADS)
    assert abs(float(got["loss"]) - float(loss)) <= 1e-5 * abs(float(loss))
    for name, want in (("w_grad", dw), ("b_grad", db)):
        err = np.max(np.abs(got[name] - want)) / np.max(np.abs(want))
        assert err <= 1e-5, f"{name}: {err:.3g}"
    # and the chain is the loss's derivative: directional finite differences of the float64 forward
    rng = np.random.default_rng(1)
    for _ in range(3):
        v = rng.standard_normal(p["w"].shape)
        eps = 1e-6
        numeric = (_forward(p, w=p["w"] + eps * v)[0] - _forward(p, w=p["w"] - eps * v)[0]) / (2 * eps)
        assert abs(float(np.sum(dw * v)) - float(numeric)) <= 1e-6 * max(1.0, abs(float(numeric)))


def test_reference_evaluator_runs_the_gradient_ops_like_the_lowering():
    """runtime.reference_eval (onnx.reference + the float64 op references) knows ReluGrad, Scale, ConvGrad and
    SoftmaxCrossEntropyLossGrad, so `oplower run --check` works on such graphs."""
    from runtime.reference_eval import evaluate

    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["conv"], name="conv", pads=PADS, strides=[2, 2]),
        helper.make_node("Relu", ["conv"], ["relu"], name="relu"),
        helper.make_node("Flatten", ["relu"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "fc"], ["logits"], name="fc"),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss", "log_prob"], name="loss"),
        helper.make_node("Scale", ["loss_grad_in", "one"], ["loss_grad"], name="loss_scale", domain=MS),
        helper.make_node("SoftmaxCrossEntropyLossGrad", ["loss_grad", "log_prob", "label"], ["logits_grad"],
                         name="loss_grad", domain=MS),
        helper.make_node("Transpose", ["fc"], ["fc_t"], name="fc_t", perm=[1, 0]),
        helper.make_node("MatMul", ["logits_grad", "fc_t"], ["flat_grad"], name="flat_grad"),
        helper.make_node("Reshape", ["flat_grad", "relu_shape"], ["relu_grad_out"], name="unflatten"),
        helper.make_node("ReluGrad", ["relu_grad_out", "relu"], ["conv_grad_in"], name="relu_grad", domain=MS),
        helper.make_node("ConvGrad", ["conv_grad_in", "x", "w"], ["x_grad", "w_grad", "b_grad"], name="conv_grad",
                         domain=MS, pads=PADS, strides=[2, 2]),
    ]
    q = H // 2
    inits = [numpy_helper.from_array((rng.standard_normal((M, C, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal((M * q * q, CLASSES)) * 0.3).astype(np.float32), "fc"),
             numpy_helper.from_array(np.array([1.0], np.float32), "one"),
             numpy_helper.from_array(np.array([N, M, q, q], np.int64), "relu_shape")]
    graph = helper.make_graph(nodes, "train", [vi("x", F32, [N, C, H, H]), vi("label", I64, [N]),
                                               vi("loss_grad_in", F32, [])],
                              [vi(name, F32, None) for name in ("loss", "x_grad", "w_grad", "b_grad")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((N, C, H, H)).astype(np.float32), "label": rng.integers(0, CLASSES, N),
             "loss_grad_in": np.array(1.0, np.float32)}
    want = evaluate(model, feeds)
    got = run_model(lower_model(model), feeds)
    for name in ("loss", "x_grad", "w_grad", "b_grad"):
        err = np.max(np.abs(got[name] - want[name])) / np.max(np.abs(want[name]))
        assert err <= 2e-6, f"{name}: {err:.3g}"
