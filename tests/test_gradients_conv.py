"""The generator's CNN gradient rules (``lowering/training/gradients/conv.py`` and ``activation.py``).

Each case is a tiny forward model whose output is weighted by a fixed random tensor and summed into the loss;
``build_artifacts`` makes its training model (verified against the project's specs, ``oplower check``), the
accumulators are taken off so the gradients become graph outputs, the model is lowered and run on plain
onnxruntime, and every gradient is compared against central finite differences of the forward model in
float64 (``onnx.reference``) along random directions. The training op each rule emits is asserted (ConvGrad,
MaxPoolGrad, AveragePoolGrad, Scale, TanhGrad, LeakyReluGrad: onnxruntime-training's), and the activations'
gradients at their kinks are torch's (values recorded from torch 2.13).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference  # before the project's modules register its schemas (DESIGN.md section 8)
import pytest
from _artifacts import gradients_exposed
from onnx import TensorProto, helper, numpy_helper

from lowering.passes import lower_model
from lowering.training.artifacts import build_artifacts
from lowering.training.gradients.context import GradientError
from opdef.model_verify import verify_model
from runtime.session import run_model

F32 = TensorProto.FLOAT
ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")


def _forward(nodes, out: str, data: dict, params: dict, opset: int, seed: int, symbolic: dict | None = None,
             weights: np.ndarray | None = None) -> onnx.ModelProto:
    """``nodes`` then loss = ReduceSum(out * R), R a fixed random tensor of out's shape."""
    graph = helper.make_graph(list(nodes), "g",
                              [helper.make_tensor_value_info(k, F32, list((symbolic or {}).get(k, v.shape)))
                               for k, v in data.items()],
                              [helper.make_tensor_value_info(out, F32, None)],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    if weights is None:
        feeds = {k: v.astype(np.float32) for k, v in data.items()}
        shape = onnx.reference.ReferenceEvaluator(model).run([out], feeds)[0].shape
        weights = np.random.default_rng(seed + 1000).standard_normal(shape)
    r = weights
    g = model.graph
    g.initializer.append(numpy_helper.from_array(r.astype(np.float32), "loss_weights"))
    g.node.extend([helper.make_node("Mul", [out, "loss_weights"], ["weighted"]),
                   helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)])
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", F32, []))
    return model


def _float64(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for vi in list(g.input) + list(g.output):
        if vi.type.tensor_type.elem_type == F32:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    inits = [numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name)
             if t.data_type == F32 else t for t in g.initializer]
    del g.initializer[:]
    g.initializer.extend(inits)
    for node in g.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == F32:
                a.i = TensorProto.DOUBLE
            if a.name == "value" and a.t.data_type == F32:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
    return m




def _gradients(nodes, out, data, params, *, opset=17, seed=0, symbolic=None, weights=None, requires=None):
    """(forward model, training model, loss, {param: gradient}) of the lowered training model on onnxruntime."""
    forward = _forward(nodes, out, data, params, opset, seed, symbolic, weights)
    art = build_artifacts(forward, list(requires or params), loss=None)
    verify_model(art.training)  # oplower check: every custom node against the project's specs
    model, exposed = gradients_exposed(art.training)
    lowered = lower_model(model)
    assert not [n.op_type for n in lowered.graph.node if n.domain not in ("", "ai.onnx")]
    wanted = {i.name for i in lowered.graph.input}
    feeds = {k: v.astype(np.float32) for k, v in {**data, **params}.items() if k in wanted}
    got = run_model(lowered, feeds)
    return forward, art.training, float(got[art.loss]), {p: got[g] for p, g in exposed.items()}


def _training_ops(training: onnx.ModelProto) -> set[tuple[str, str]]:
    """The custom ops of the training model (default-domain MaxPoolGrad / AveragePoolGrad are no standard ONNX)."""
    return {(n.domain or "", n.op_type) for n in training.graph.node
            if n.domain not in ("", "ai.onnx") or n.op_type in ("MaxPoolGrad", "AveragePoolGrad")} - {ACCUMULATOR}


def check(nodes, out, data, params, *, ops=(), opset=17, seed=0, symbolic=None, requires=None, h=1e-5,
          directions=3, tol=3e-5):
    """Gradients of every parameter in ``requires`` against float64 central differences along random
    directions; the training ops the graph uses are ``ops``."""
    forward, training, loss, grads = _gradients(nodes, out, data, params, opset=opset, seed=seed,
                                                symbolic=symbolic, requires=requires)
    assert _training_ops(training) == set(ops), _training_ops(training)
    f64 = _float64(forward)
    session = onnx.reference.ReferenceEvaluator(f64)
    base = {k: v.astype(np.float32).astype(np.float64) for k, v in data.items()}
    p64 = {k: v.astype(np.float32).astype(np.float64) for k, v in params.items()}

    def loss_at(values):
        feeds = dict(base)
        m = onnx.ModelProto()
        m.CopyFrom(f64)
        inits = [numpy_helper.from_array(values[t.name], t.name) if t.name in values else t
                 for t in m.graph.initializer]
        del m.graph.initializer[:]
        m.graph.initializer.extend(inits)
        return float(onnx.reference.ReferenceEvaluator(m).run(["loss"], feeds)[0])

    want_loss = float(session.run(["loss"], base)[0])
    assert abs(loss - want_loss) <= 1e-5 * max(abs(want_loss), 1.0), (loss, want_loss)
    rng = np.random.default_rng(seed)
    for p in requires or params:
        g = grads[p].astype(np.float64)
        assert g.shape == params[p].shape, p
        for _ in range(directions):
            v = rng.standard_normal(g.shape)
            fd = (loss_at({**p64, p: p64[p] + h * v}) - loss_at({**p64, p: p64[p] - h * v})) / (2 * h)
            scale = float(np.sum(np.abs(g * v))) + 1e-12
            assert abs(float(np.sum(g * v)) - fd) <= tol * scale, f"{p}: {np.sum(g * v)} vs {fd}"
    return training, grads


def rnd(*shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


CONV_GRAD = {("com.microsoft", "ConvGrad")}


# -- Conv --

@pytest.mark.parametrize("case", [
    # (X shape, W shape, attributes, bias, X needs a gradient)
    ((2, 3, 6, 6), (4, 3, 3, 3), dict(pads=[1, 1, 1, 1]), True, True),
    ((2, 4, 7, 8), (6, 2, 2, 3), dict(strides=[2, 1], dilations=[2, 1], group=2, pads=[0, 1, 1, 0]), False, True),
    ((2, 4, 5, 5), (4, 1, 3, 3), dict(pads=[1, 1, 1, 1], group=4), True, False),       # depthwise, X is data
    ((3, 6, 9), (6, 2, 3), dict(strides=[2], pads=[1, 1], group=3), True, True),        # 1-D
    ((1, 2, 4, 5, 4), (3, 2, 2, 3, 2), dict(strides=[1, 2, 1], pads=[0, 1, 1, 1, 0, 0]), True, True),  # 3-D
    ((2, 3, 7, 6), (4, 3, 3, 2), dict(strides=[2, 2], auto_pad="SAME_UPPER"), True, True),
    ((2, 3, 7, 6), (4, 3, 3, 2), dict(strides=[2, 3], auto_pad="SAME_LOWER"), False, True),
    ((2, 3, 6, 5), (4, 3, 2, 2), dict(auto_pad="VALID", strides=[2, 2]), True, True),
], ids=["pads", "strided-dilated-grouped", "depthwise-data", "1d", "3d", "same-upper", "same-lower", "valid"])
def test_conv(case):
    x_shape, w_shape, attrs, bias, x_grad = case
    inputs = ["X", "W"] + (["B"] if bias else [])
    node = helper.make_node("Conv", inputs, ["Y"], kernel_shape=list(w_shape[2:]), **attrs)
    params = {"W": rnd(*w_shape, seed=1, scale=0.5)} | ({"B": rnd(w_shape[0], seed=2)} if bias else {})
    data = {"X": rnd(*x_shape, seed=3)}
    if x_grad:
        params, data = {"X": data["X"], **params}, {}
    training, _ = check([node], "Y", data, params, ops=CONV_GRAD)
    grad_node = next(n for n in training.graph.node if n.op_type == "ConvGrad")
    # dX, dW, dB only where needed: an unneeded trailing output is left off, an unneeded leading one is empty
    assert [bool(o) for o in grad_node.output] == [x_grad, True] + ([True] if bias else [])
    a = {x.name: helper.get_attribute_value(x) for x in grad_node.attribute}
    assert a.get("auto_pad", b"NOTSET") in (b"NOTSET", b"VALID")
    # dW and dB undeclared: onnxruntime-training 1.19.2's runtime leaves a declared 1-D grouped dW at zeros
    assert not {vi.name for vi in training.graph.value_info} & set(grad_node.output[1:])


def test_conv_without_kernel_shape_and_frozen_weight():
    """kernel_shape absent (W's own), W frozen: only dX, and a SAME pad resolved from W's static shape."""
    node = helper.make_node("Conv", ["X", "W"], ["Y"], auto_pad="SAME_UPPER", strides=[2, 2])
    params = {"X": rnd(2, 3, 5, 6, seed=4), "W": rnd(2, 3, 3, 2, seed=5)}
    training, _ = check([node], "Y", {}, params, ops=CONV_GRAD, requires=["X"])
    grad_node = next(n for n in training.graph.node if n.op_type == "ConvGrad")
    assert list(grad_node.output) == [grad_node.output[0]] and grad_node.output[0]


def test_conv_same_pad_with_dynamic_spatial_dims_is_refused():
    node = helper.make_node("Conv", ["X", "W"], ["Y"], auto_pad="SAME_UPPER", kernel_shape=[3, 3])
    forward = _forward([node], "Y", {"X": rnd(1, 2, 5, 5)}, {"W": rnd(2, 2, 3, 3)}, 17, 0,
                       symbolic={"X": ("N", 2, "H", "W")})
    with pytest.raises(GradientError, match="auto_pad SAME_UPPER needs X's spatial dims static"):
        build_artifacts(forward, ["W"], loss=None)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((2, 4, 4, 5), (4, 3, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 0])),
    ((2, 4, 3, 4), (4, 2, 2, 3), dict(strides=[2, 1], pads=[0, 1, 1, 0], dilations=[1, 2])),
    ((3, 2, 5), (2, 3, 4), dict(strides=[3], pads=[1, 2], output_padding=[2])),
], ids=["2d-output-padding", "dilated", "1d"])
def test_conv_transpose(x_shape, w_shape, attrs):
    node = helper.make_node("ConvTranspose", ["X", "W", "B"], ["Y"], kernel_shape=list(w_shape[2:]), **attrs)
    params = {"X": rnd(*x_shape, seed=30), "W": rnd(*w_shape, seed=31, scale=0.5),
              "B": rnd(w_shape[1] * attrs.get("group", 1), seed=32)}
    check([node], "Y", {}, params, ops=CONV_GRAD)


def test_conv_transpose_grouped():
    """Groups (onnx.reference's grouped ConvTranspose is broken): the gradients equal those of the ungrouped
    ConvTranspose with the block-diagonal kernel (which test_conv_transpose checks against finite differences)."""
    attrs = dict(strides=[2, 1], pads=[0, 1, 1, 0], dilations=[1, 2], output_padding=[1, 0], kernel_shape=[2, 3])
    x, w, b = rnd(2, 4, 3, 4, seed=35), rnd(4, 3, 2, 3, seed=36), rnd(6, seed=37)
    full = np.zeros((4, 6, 2, 3))
    full[:2, :3], full[2:, 3:] = w[:2], w[2:]
    weights = rnd(2, 6, 6, 7, seed=38)
    grouped = _gradients([helper.make_node("ConvTranspose", ["X", "W", "B"], ["Y"], group=2, **attrs)], "Y", {},
                         {"X": x, "W": w, "B": b}, weights=weights)[3]
    dense = _gradients([helper.make_node("ConvTranspose", ["X", "W", "B"], ["Y"], **attrs)], "Y", {},
                       {"X": x, "W": full, "B": b}, weights=weights)[3]
    np.testing.assert_allclose(grouped["X"], dense["X"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grouped["B"], dense["B"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grouped["W"], np.concatenate([dense["W"][:2, :3], dense["W"][2:, 3:]]), rtol=1e-5,
                               atol=1e-5)


# -- MaxPool --

MAX_POOL_GRAD = {("", "MaxPoolGrad")}


@pytest.mark.parametrize("x_shape,attrs", [
    ((2, 3, 6, 6), dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])),          # cnn's (overlapping)
    ((2, 3, 7), dict(kernel_shape=[2], strides=[2], ceil_mode=1)),                            # cnn1d's
    ((2, 2, 7, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 0], ceil_mode=1)),
    ((1, 2, 8, 7), dict(kernel_shape=[2, 2], dilations=[2, 2], strides=[1, 2])),
    ((2, 2, 7, 6), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    ((1, 2, 4, 5, 4), dict(kernel_shape=[2, 2, 2], strides=[2, 1, 2])),                     # 3-D
    ((2, 3, 6, 6), dict(kernel_shape=[2, 2], strides=[2, 2], storage_order=1)),              # order irrelevant
], ids=["cnn", "1d-ceil", "ceil-pads", "dilated", "same-upper", "3d", "storage-order"])
def test_max_pool(x_shape, attrs):
    node = helper.make_node("MaxPool", ["X"], ["Y"], **attrs)
    training, _ = check([node], "Y", {}, {"X": rnd(*x_shape, seed=6)}, ops=MAX_POOL_GRAD)
    pool = next(n for n in training.graph.node if n.op_type == "MaxPool")
    assert pool.output[0] == "Y" and len(pool.output) == 2  # the Indices output added, Y's name kept
    grad = next(n for n in training.graph.node if n.op_type == "MaxPoolGrad")
    declared = {vi.name: vi for vi in training.graph.value_info}
    dims = [d.dim_value for d in declared[grad.output[0]].type.tensor_type.shape.dim]
    assert dims == list(x_shape)  # dX's type declared: the kernels read the spatial dims there


def test_max_pool_eval_model_unchanged():
    node = helper.make_node("MaxPool", ["X"], ["Y"], kernel_shape=[2, 2])
    forward = _forward([helper.make_node("Conv", ["D", "W"], ["X"]), node], "Y", {"D": rnd(1, 2, 4, 4)},
                       {"W": rnd(3, 2, 1, 1)}, 17, 0)
    art = build_artifacts(forward, ["W"], loss=None)
    pools = [n for n in art.eval.graph.node if n.op_type == "MaxPool"]
    assert len(pools) == 1 and list(pools[0].output) == ["Y"]


def test_max_pool_with_dynamic_spatial_dims_scatters():
    """X's spatial dims known only at run time: no declared dX for MaxPoolGrad, the summing scatter instead."""
    nodes = [helper.make_node("Conv", ["D", "W"], ["X"], pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["X"], ["Y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])]
    check(nodes, "Y", {"D": rnd(2, 2, 7, 6, seed=7)}, {"W": rnd(3, 2, 3, 3, seed=8)}, ops=CONV_GRAD,
          symbolic={"D": ("N", 2, "H", "W")})


def test_max_pool_with_symbolic_batch():
    nodes = [helper.make_node("Conv", ["D", "W"], ["X"]),
             helper.make_node("MaxPool", ["X"], ["Y"], kernel_shape=[2, 2], strides=[1, 1])]
    check(nodes, "Y", {"D": rnd(3, 2, 5, 5, seed=9)}, {"W": rnd(3, 2, 2, 2, seed=10)},
          ops=CONV_GRAD | MAX_POOL_GRAD, symbolic={"D": ("N", 2, 5, 5)})


def test_max_pool_indices_the_model_uses():
    """A MaxPool that already outputs Indices (torch's return_indices) keeps them; the gradient reads them."""
    nodes = [helper.make_node("MaxPool", ["X"], ["Y", "I"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Cast", ["I"], ["If"], to=F32),
             helper.make_node("Mul", ["Y", "If"], ["Z"])]
    check(nodes, "Z", {}, {"X": rnd(1, 2, 4, 4, seed=11)}, ops=MAX_POOL_GRAD)


# -- AveragePool and the global pools --

AVG_POOL_GRAD = {("", "AveragePoolGrad")}


@pytest.mark.parametrize("x_shape,attrs", [
    ((2, 3, 6, 6), dict(kernel_shape=[2, 2], strides=[2, 2])),                                  # cnn's
    ((2, 3, 7), dict(kernel_shape=[3], strides=[1], pads=[1, 1], count_include_pad=1)),         # cnn1d's
    ((2, 2, 7, 6), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 1, 1, 0], count_include_pad=0)),
    ((2, 2, 7, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    ((2, 2, 7, 8), dict(kernel_shape=[3, 3], strides=[2, 3], ceil_mode=1, count_include_pad=1)),
    ((2, 2, 8, 6), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1)),
    ((2, 2, 7, 6), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    ((2, 2, 7, 6), dict(kernel_shape=[2, 3], strides=[2, 2], auto_pad="SAME_LOWER", count_include_pad=1)),
], ids=["cnn", "1d-count-pad", "exclude-pad", "ceil-pads", "ceil-count-pad", "ceil-count-pad-padded", "same-upper",
        "same-lower"])
def test_average_pool(x_shape, attrs):
    node = helper.make_node("AveragePool", ["X"], ["Y"], **attrs)
    training, _ = check([node], "Y", {}, {"X": rnd(*x_shape, seed=12)}, ops=AVG_POOL_GRAD)
    grad = next(n for n in training.graph.node if n.op_type == "AveragePoolGrad")
    a = {x.name: helper.get_attribute_value(x) for x in grad.attribute}
    assert a.get("auto_pad", b"NOTSET") in (b"NOTSET", b"VALID")


@pytest.mark.parametrize("x_shape", [(2, 3, 4, 5), (3, 2, 6), (1, 2, 2, 3, 2)])
def test_global_average_pool(x_shape):
    node = helper.make_node("GlobalAveragePool", ["X"], ["Y"])
    check([node], "Y", {}, {"X": rnd(*x_shape, seed=13)}, ops={("com.microsoft", "Scale")})


def test_global_average_pool_dynamic_spatial_dims():
    nodes = [helper.make_node("Conv", ["D", "W"], ["X"]), helper.make_node("GlobalAveragePool", ["X"], ["Y"])]
    check(nodes, "Y", {"D": rnd(2, 2, 5, 4, seed=14)}, {"W": rnd(3, 2, 2, 2, seed=15)},
          ops=CONV_GRAD | {("com.microsoft", "Scale")}, symbolic={"D": ("N", 2, "H", "W")})


@pytest.mark.parametrize("x_shape", [(2, 3, 4, 5), (1, 4, 3, 7)])
def test_global_max_pool(x_shape):
    check([helper.make_node("GlobalMaxPool", ["X"], ["Y"])], "Y", {}, {"X": rnd(*x_shape, seed=16)})


def test_global_max_pool_ties_go_to_the_first_maximum():
    x = np.zeros((1, 2, 2, 2))
    x[0, 1] = [[1.0, 3.0], [3.0, 2.0]]
    _, _, _, grads = _gradients([helper.make_node("GlobalMaxPool", ["X"], ["Y"])], "Y", {}, {"X": x},
                                weights=np.ones((1, 2, 1, 1)))
    want = np.zeros_like(x)
    want[0, 0, 0, 0] = want[0, 1, 0, 1] = 1.0
    np.testing.assert_array_equal(grads["X"], want)


# -- activations --

@pytest.mark.parametrize("op,attrs,ops,scale", [
    ("Tanh", {}, {("com.microsoft", "TanhGrad")}, 1.5),
    ("LeakyRelu", dict(alpha=0.1), {("com.microsoft", "LeakyReluGrad")}, 1.0),
    ("LeakyRelu", {}, {("com.microsoft", "LeakyReluGrad")}, 1.0),
    ("LeakyRelu", dict(alpha=-0.3), set(), 1.0),
    ("HardSigmoid", dict(alpha=1 / 6, beta=0.5), set(), 4.0),
    ("HardSigmoid", {}, set(), 4.0),
    ("HardSwish", {}, set(), 4.0),
    ("Elu", {}, set(), 2.0),
    ("Elu", dict(alpha=0.5), set(), 2.0),
    ("Selu", {}, set(), 2.0),
    ("Celu", dict(alpha=2.0), set(), 2.0),
    ("Softplus", {}, set(), 3.0),
    ("Softsign", {}, set(), 3.0),
    ("ThresholdedRelu", dict(alpha=0.5), set(), 2.0),
])
def test_activation(op, attrs, ops, scale):
    node = helper.make_node(op, ["X"], ["Y"], **attrs)
    check([node], "Y", {}, {"X": rnd(3, 4, 5, seed=17, scale=scale)}, ops=ops)


def test_relu6_from_torch_constants():
    """torch's ReLU6: Clip with min and max from Constant nodes."""
    nodes = [helper.make_node("Constant", [], ["lo"], value=numpy_helper.from_array(np.array(0.0, np.float32))),
             helper.make_node("Constant", [], ["hi"], value=numpy_helper.from_array(np.array(6.0, np.float32))),
             helper.make_node("Clip", ["X", "lo", "hi"], ["Y"])]
    check(nodes, "Y", {}, {"X": rnd(3, 4, 5, seed=18, scale=5.0)})


@pytest.mark.parametrize("inputs", [["X", "lo"], ["X", "", "hi"], ["X"]])
def test_clip_one_bound(inputs):
    params = {"X": rnd(3, 7, seed=19, scale=3.0)}
    consts = {"lo": np.array(-0.5), "hi": np.array(1.0)}
    forward_inits = {k: v for k, v in consts.items() if k in inputs}
    node = helper.make_node("Clip", inputs, ["Y"])
    check([node], "Y", {}, params | forward_inits, requires=["X"])


def test_clip_opset_10_attributes():
    node = helper.make_node("Clip", ["X"], ["Y"], min=-1.0, max=0.5)
    check([node], "Y", {}, {"X": rnd(3, 7, seed=20, scale=2.0)}, opset=10)


def test_prelu():
    """torch's PReLU: a per-channel slope of shape [C, 1, 1] broadcast over [N, C, H, W]."""
    node = helper.make_node("PRelu", ["X", "slope"], ["Y"])
    check([node], "Y", {}, {"X": rnd(2, 3, 4, 4, seed=21), "slope": rnd(3, 1, 1, seed=22, scale=0.3)})


@pytest.mark.parametrize("op,attrs,x,want", [
    # torch 2.13's gradients at the kinks (relu6, hardtanh; hardsigmoid; hardswish; leaky_relu; elu; selu; prelu)
    ("Clip", None, [-1.0, 0.0, 3.0, 6.0, 7.0], [0, 0, 1, 0, 0]),
    ("HardSigmoid", dict(alpha=1 / 6, beta=0.5), [-3.0, -1.0, 0.0, 1.0, 3.0], [0, 1 / 6, 1 / 6, 1 / 6, 0]),
    ("HardSwish", {}, [-3.0, -1.0, 0.0, 1.0, 3.0], [0, 1 / 6, 0.5, 5 / 6, 1]),
    ("LeakyRelu", dict(alpha=0.1), [-3.0, -1.0, 0.0, 1.0, 3.0], [0.1, 0.1, 0.1, 1, 1]),
    ("Elu", dict(alpha=0.5), [-1.0, 0.0, 1.0], [0.5 * np.exp(-1.0), 0.5, 1]),
    ("Selu", {}, [-1.0, 0.0, 1.0], [0.6467686, 1.7580993, 1.0507010]),
    ("PRelu", None, [-3.0, 0.0, 3.0], [0.25, 0.25, 1]),
    ("ThresholdedRelu", dict(alpha=1.0), [0.0, 1.0, 2.0], [0, 0, 1]),
])
def test_gradient_at_the_kinks_is_torchs(op, attrs, x, want):
    x = np.asarray(x)
    nodes, params = [], {"X": x}
    if op == "Clip":
        nodes = [helper.make_node("Constant", [], ["lo"], value=numpy_helper.from_array(np.array(0.0, np.float32))),
                 helper.make_node("Constant", [], ["hi"], value=numpy_helper.from_array(np.array(6.0, np.float32))),
                 helper.make_node("Clip", ["X", "lo", "hi"], ["Y"])]
    elif op == "PRelu":
        params["slope"] = np.array([0.25])
        nodes = [helper.make_node("PRelu", ["X", "slope"], ["Y"])]
    else:
        nodes = [helper.make_node(op, ["X"], ["Y"], **attrs)]
    _, _, _, grads = _gradients(nodes, "Y", {}, params, weights=np.ones(x.shape), requires=["X"])
    np.testing.assert_allclose(grads["X"], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("op,attrs", [("Conv", dict(pads=[1, 1, 1, 1])), ("MaxPool", dict(kernel_shape=[2, 2])),
                                      ("AveragePool", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
                                      ("GlobalAveragePool", {}), ("HardSwish", {}), ("Elu", dict(alpha=0.5)),
                                      ("LeakyRelu", dict(alpha=0.1)), ("Tanh", {}), ("Softplus", {})])
def test_float16_computes_in_the_forward_type(op, attrs):
    """An f16 forward model: its gradient graph runs in f16 and agrees with the f32 one to f16's rounding."""
    grads = {}
    for dtype, elem in ((np.float32, F32), (np.float16, TensorProto.FLOAT16)):
        params = {"X": rnd(2, 3, 4, 4, seed=33, scale=2.0)} | ({"W": rnd(4, 3, 3, 3, seed=34, scale=0.3)}
                                                               if op == "Conv" else {})
        node = helper.make_node(op, ["X", "W"] if op == "Conv" else ["X"], ["Y"], **attrs)
        graph = helper.make_graph([node, helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)], "g", [],
                                  [helper.make_tensor_value_info("loss", elem, [])],
                                  [numpy_helper.from_array(v.astype(dtype), k) for k, v in params.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        art = build_artifacts(model, list(params), loss=None)
        exposed_model, exposed = gradients_exposed(art.training)
        got = run_model(lower_model(exposed_model), {k: v.astype(dtype) for k, v in params.items()})
        assert all(got[g].dtype == dtype for g in exposed.values())
        grads[dtype] = {p: got[g].astype(np.float64) for p, g in exposed.items()}
    for p, want in grads[np.float32].items():
        assert np.max(np.abs(grads[np.float16][p] - want)) <= 2e-3 * np.max(np.abs(want)), p


# -- a small CNN end to end: the rules together (conv, BN, ReLU6, pools, the Sum of a residual) --

def test_small_cnn():
    c = lambda name, value: helper.make_node("Constant", [], [name],  # noqa: E731
                                             value=numpy_helper.from_array(np.array(value, np.float32)))
    nodes = [
        helper.make_node("Conv", ["D", "W1", "B1"], ["a"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        c("lo", 0.0), c("hi", 6.0),
        helper.make_node("Clip", ["a", "lo", "hi"], ["b"]),
        helper.make_node("MaxPool", ["b"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p", "W2"], ["q"], pads=[1, 1, 1, 1], kernel_shape=[3, 3], group=4),
        helper.make_node("LeakyRelu", ["q"], ["r"], alpha=0.2),
        helper.make_node("Add", ["r", "p"], ["s"]),
        helper.make_node("AveragePool", ["s"], ["t"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Tanh", ["t"], ["u"]),
        helper.make_node("GlobalAveragePool", ["u"], ["Y"]),
    ]
    params = {"W1": rnd(4, 3, 3, 3, seed=23, scale=0.8), "B1": rnd(4, seed=24), "W2": rnd(4, 1, 3, 3, seed=25)}
    check(nodes, "Y", {"D": rnd(2, 3, 6, 6, seed=26, scale=2.0)}, params,
          ops=CONV_GRAD | MAX_POOL_GRAD | AVG_POOL_GRAD | {("com.microsoft", "LeakyReluGrad"),
                                                          ("com.microsoft", "TanhGrad"), ("com.microsoft", "Scale")})
