"""Gradient rules the held-out sweep (tools/ort_training/heldout_sweep.py) found missing: Resize
(``gradients/upsample.py``), InstanceNormalization (``gradients/normalization_extra.py``), and a 0-d frozen
parameter in the checkpoint.

Each rule case is a tiny forward model whose output is weighted by a fixed random tensor and summed into the
loss; ``build_artifacts`` makes its training model (verified against the project's specs), the accumulators are
taken off so the gradients become graph outputs, the model is lowered and run on plain onnxruntime, and every
gradient is compared with central finite differences of the forward model in float64 (``onnx.reference``) along
random directions. Resize's interpolation matrices are also checked against onnxruntime's own Resize kernel.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference  # before the project's modules register its schemas (DESIGN.md section 8)
import pytest
from _artifacts import gradients_exposed
from onnx import TensorProto, helper, numpy_helper
from onnx.reference.op_run import OpRun

from lowering.passes import lower_model
from lowering.training.artifacts import build_artifacts
from lowering.training.checkpoint import Checkpoint, decode_checkpoint, encode_checkpoint
from lowering.training.gradients.context import GradientError
from lowering.training.gradients.upsample import interpolation_matrix
from opdef.model_verify import verify_model
from runtime.session import run_model

F32 = TensorProto.FLOAT
ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")
# the training ops of the cases' other nodes
OTHER_RULES = {"InPlaceAccumulatorV2", "TanhGrad", "SigmoidGrad", "ConvGrad", "ConcatTraining", "SplitTraining"}


class RNN(OpRun):
    """onnx.reference's RNN knows Tanh only: every activation the rule differentiates, in float64 (the others and
    clip: tanh, unclipped -- they serve only to shape the refusal tests' models)."""

    def _run(self, x, w, r, b=None, sequence_lens=None, initial_h=None, activation_alpha=None,
             activation_beta=None, activations=None, clip=None, direction=None, hidden_size=None, layout=None):
        acts = {"Tanh": np.tanh, "Relu": lambda v: np.maximum(v, 0), "Sigmoid": lambda v: 1 / (1 + np.exp(-v))}
        direction = direction or "forward"
        dirs = 2 if direction == "bidirectional" else 1
        activations = list(activations or ["Tanh"] * dirs)
        xt = np.swapaxes(x, 0, 1) if layout else x
        steps, batch, _ = xt.shape
        h0 = np.swapaxes(initial_h, 0, 1) if initial_h is not None and layout else initial_h
        ys, finals = [], []
        for d in range(dirs):
            bias = b[d, :hidden_size] + b[d, hidden_size:] if b is not None else 0.0
            h = h0[d] if h0 is not None else np.zeros((batch, hidden_size), x.dtype)
            out = [None] * steps
            order = range(steps - 1, -1, -1) if direction == "reverse" or d == 1 else range(steps)
            for t in order:
                h = acts.get(activations[d], np.tanh)(xt[t] @ w[d].T + h @ r[d].T + bias)
                out[t] = h
            ys.append(np.stack(out))
            finals.append(h)
        y = np.stack(ys, axis=1)  # [T, D, B, H]
        y_h = np.stack(finals)
        if layout:
            return np.transpose(y, (2, 0, 1, 3)), np.swapaxes(y_h, 0, 1)
        return y, y_h


def _evaluator(model):
    return onnx.reference.ReferenceEvaluator(model, new_ops=[RNN])


def _forward(nodes, out, data, params, consts, opset, seed, symbolic):
    graph = helper.make_graph(
        list(nodes), "g",
        [helper.make_tensor_value_info(k, F32 if v.dtype.kind == "f" else TensorProto.INT64,
                                       list((symbolic or {}).get(k, v.shape))) for k, v in data.items()],
        [helper.make_tensor_value_info(out, F32, None)],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()] +
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    feeds = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in data.items()}
    shape = _evaluator(model).run([out], feeds)[0].shape
    weights = np.random.default_rng(seed + 1000).standard_normal(shape)
    g = model.graph
    g.initializer.append(numpy_helper.from_array(weights.astype(np.float32), "loss_weights"))
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
             if t.data_type == F32 and t.name not in ("scales",) else t for t in g.initializer]
    del g.initializer[:]
    g.initializer.extend(inits)
    return m




def check(nodes, out, data, params, *, consts=None, opset=17, seed=0, symbolic=None, h=1e-5, directions=3,
          tol=3e-5, custom=()):
    """Every parameter's gradient against float64 central differences along random directions; the custom ops of
    the training model are ``custom``. Returns the training model."""
    consts = consts or {}
    forward = _forward(nodes, out, data, params, consts, opset, seed, symbolic)
    art = build_artifacts(forward, list(params), loss=None)
    verify_model(art.training)
    # the rules under test emit standard ops (onnxruntime-training has no CPU kernel of its own for them)
    assert {n.op_type for n in art.training.graph.node if n.domain not in ("", "ai.onnx")} - OTHER_RULES == set(custom)
    model, exposed = gradients_exposed(art.training)
    lowered = lower_model(model)
    assert not [n.op_type for n in lowered.graph.node if n.domain not in ("", "ai.onnx")]
    wanted = {i.name for i in lowered.graph.input}
    feeds = {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in {**data, **params}.items()
             if k in wanted}
    got = run_model(lowered, feeds)
    loss, grads = float(got[art.loss]), {p: got[g] for p, g in exposed.items()}

    f64 = _float64(forward)
    base = {k: (v.astype(np.float32).astype(np.float64) if v.dtype.kind == "f" else v) for k, v in data.items()}
    p64 = {k: v.astype(np.float32).astype(np.float64) for k, v in params.items()}

    def loss_at(values):
        m = onnx.ModelProto()
        m.CopyFrom(f64)
        inits = [numpy_helper.from_array(values[t.name], t.name) if t.name in values else t
                 for t in m.graph.initializer]
        del m.graph.initializer[:]
        m.graph.initializer.extend(inits)
        return float(_evaluator(m).run(["loss"], base)[0])

    want = loss_at(p64)
    assert abs(loss - want) <= 1e-5 * max(abs(want), 1.0), (loss, want)
    rng = np.random.default_rng(seed)
    for p in params:
        g = grads[p].astype(np.float64)
        assert g.shape == params[p].shape, p
        for _ in range(directions):
            v = rng.standard_normal(g.shape)
            fd = (loss_at({**p64, p: p64[p] + h * v}) - loss_at({**p64, p: p64[p] - h * v})) / (2 * h)
            scale = float(np.sum(np.abs(g * v))) + 1e-12
            assert abs(float(np.sum(g * v)) - fd) <= tol * scale, f"{p}: {np.sum(g * v)} vs {fd}"
    return art.training


def rnd(*shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


# -- Resize ----------------------------------------------------------------------------------------------------

RESIZE_CASES = {
    # id: (attributes, input spatial shape, "scales" [h, w] or "sizes" [h, w])
    "nearest-asym-floor-x2": (dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
                              (3, 4), ("scales", [2.0, 2.0])),
    "nearest-halfpixel-sizes": (dict(mode="nearest"), (4, 3), ("sizes", [7, 5])),
    "nearest-ceil-down": (dict(mode="nearest", nearest_mode="ceil", coordinate_transformation_mode="align_corners"),
                          (6, 5), ("sizes", [4, 3])),
    "nearest-prefer-ceil-tf": (dict(mode="nearest", nearest_mode="round_prefer_ceil",
                                    coordinate_transformation_mode="tf_half_pixel_for_nn"), (3, 3),
                               ("scales", [1.5, 2.0])),
    "nearest-prefer-ceil": (dict(mode="nearest", nearest_mode="round_prefer_ceil"), (3, 5), ("scales", [2.0, 0.6])),
    "linear-halfpixel-x2": (dict(mode="linear"), (3, 4), ("scales", [2.0, 2.0])),
    "linear-pytorch-down": (dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"), (6, 5),
                            ("sizes", [4, 1])),
    "linear-align-corners": (dict(mode="linear", coordinate_transformation_mode="align_corners"), (3, 4),
                             ("sizes", [5, 7])),
    "linear-asym-fraction": (dict(mode="linear", coordinate_transformation_mode="asymmetric"), (4, 4),
                             ("scales", [1.75, 0.5])),
    "cubic-align-corners": (dict(mode="cubic", coordinate_transformation_mode="align_corners"), (4, 5),
                            ("sizes", [6, 3])),
    "cubic-halfpixel-exclude": (dict(mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5), (4, 4),
                                ("scales", [2.0, 1.5])),
}


@pytest.mark.parametrize("case", RESIZE_CASES, ids=list(RESIZE_CASES))
def test_resize_matrices_are_onnxruntimes_kernel(case):
    """A of each axis equals what onnxruntime's Resize does to the unit vectors (its float32 coordinates)."""
    attrs, (h, w), (kind, values) = RESIZE_CASES[case]
    x = np.zeros((h * w, 1, h, w), np.float32)
    x[np.arange(h * w), 0, np.arange(h * w) // w, np.arange(h * w) % w] = 1.0
    inputs = {"X": x}
    if kind == "scales":
        node = helper.make_node("Resize", ["X", "", "S"], ["Y"], **attrs)
        consts = [numpy_helper.from_array(np.array([1, 1, *values], np.float32), "S")]
    else:
        node = helper.make_node("Resize", ["X", "", "", "Z"], ["Y"], **attrs)
        consts = [numpy_helper.from_array(np.array([h * w, 1, *values], np.int64), "Z")]
    graph = helper.make_graph([node], "r", [helper.make_tensor_value_info("X", F32, list(x.shape))],
                              [helper.make_tensor_value_info("Y", F32, None)], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    y = run_model(model, inputs)["Y"]  # [h*w, 1, H, W]: column (i, j) of the 2-D operator
    out_h, out_w = y.shape[2:]
    sh = values[0] if kind == "scales" else np.float32(out_h) / np.float32(h)
    sw = values[1] if kind == "scales" else np.float32(out_w) / np.float32(w)
    a_h, a_w = interpolation_matrix(h, out_h, sh, attrs), interpolation_matrix(w, out_w, sw, attrs)
    want = np.einsum("ai,bj->ijab", a_h, a_w).reshape(h * w, out_h, out_w)
    np.testing.assert_allclose(y[:, 0], want, atol=2e-6)


# onnx.reference has no tf_half_pixel_for_nn (deprecated since opset 13): its matrix is checked above only
GRADIENT_CASES = [c for c in RESIZE_CASES if "tf_half_pixel_for_nn" not in RESIZE_CASES[c][0].values()]


@pytest.mark.parametrize("case", GRADIENT_CASES, ids=GRADIENT_CASES)
def test_resize_gradient(case):
    attrs, (h, w), (kind, values) = RESIZE_CASES[case]
    data = {"x": rnd(2, 3, h, w, seed=1)}
    params = {"s": rnd(1, 3, 1, 1, seed=2) + 1.0}
    if kind == "scales":
        resize = helper.make_node("Resize", ["xs", "", "scales"], ["y"], **attrs)
        consts = {"scales": np.array([1, 1, *values], np.float32)}
    else:
        resize = helper.make_node("Resize", ["xs", "", "", "sizes"], ["y"], **attrs)
        consts = {"sizes": np.array([2, 3, *values], np.int64)}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), resize, helper.make_node("Tanh", ["y"], ["out"])]
    training = check(nodes, "out", data, params, consts=consts, opset=18, custom=())
    # static sizes: the interpolation matrices are constants, no run-time construction
    assert not any(n.op_type == "Range" for n in training.graph.node)


def test_resize_scales_computed_in_the_graph_and_symbolic_batch():
    """torch's nn.Upsample export: the scales are a Concat of two Constants (no constant the generator can
    read), the batch symbolic: the interpolation matrix is built at run time (Range, Equal...)."""
    data = {"x": rnd(2, 3, 3, 4, seed=3)}
    params = {"w": rnd(3, 3, 1, 1, seed=4)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("Constant", [], ["s01"], value=numpy_helper.from_array(np.ones(2, np.float32))),
             helper.make_node("Constant", [], ["s23"], value=numpy_helper.from_array(np.array([2.0, 1.5],
                                                                                                np.float32))),
             helper.make_node("Concat", ["s01", "s23"], ["scales"], axis=0),
             helper.make_node("Resize", ["c", "", "scales"], ["y"], mode="linear",
                              coordinate_transformation_mode="half_pixel"),
             helper.make_node("Sigmoid", ["y"], ["out"])]
    training = check(nodes, "out", data, params, symbolic={"x": ["batch", 3, 3, 4]})
    assert any(n.op_type == "Range" for n in training.graph.node)


@pytest.mark.parametrize("mode,transform,nearest", [
    ("nearest", "asymmetric", "floor"), ("nearest", "half_pixel", "round_prefer_floor"),
    ("linear", "align_corners", None), ("linear", "pytorch_half_pixel", None), ("cubic", "half_pixel", None)])
def test_resize_sizes_computed_in_the_graph(mode, transform, nearest):
    """Sizes from Shape(x)[:2] and a Constant (the generator cannot read them; shape inference does not tell Y's
    spatial size): every axis's matrix is built at run time, the two kept axes come out as identities."""
    data = {"x": rnd(2, 2, 4, 3, seed=5)}
    params = {"b": rnd(1, 2, 1, 1, seed=6)}
    extra = {"nearest_mode": nearest} if nearest else {}
    nodes = [helper.make_node("Add", ["x", "b"], ["xb"]),
             helper.make_node("Shape", ["xb"], ["shape"], end=2),
             helper.make_node("Constant", [], ["hw"], value=numpy_helper.from_array(np.array([6, 5], np.int64))),
             helper.make_node("Concat", ["shape", "hw"], ["sizes"], axis=0),
             helper.make_node("Resize", ["xb", "", "", "sizes"], ["y"], mode=mode,
                              coordinate_transformation_mode=transform, **extra),
             helper.make_node("Mul", ["y", "y"], ["out"])]
    check(nodes, "out", data, params, opset=18)


def test_resize_1d_and_3d_axes():
    """A resized last axis only (rank 3) and a trilinear rank-5 resize (a middle axis through Transpose)."""
    data = {"x": rnd(2, 3, 5, seed=7)}
    params = {"s": rnd(3, 1, seed=8)}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Resize", ["xs", "", "scales"], ["y"], mode="linear"),
             helper.make_node("Tanh", ["y"], ["out"])]
    check(nodes, "out", data, params, consts={"scales": np.array([1, 1, 1.6], np.float32)})
    data = {"x": rnd(1, 2, 3, 2, 3, seed=9)}
    params = {"s": rnd(2, 1, 1, 1, seed=10)}
    nodes[1] = helper.make_node("Resize", ["xs", "", "scales"], ["y"], mode="linear",
                                coordinate_transformation_mode="align_corners")
    check(nodes, "out", data, params, consts={"scales": np.array([1, 1, 2, 1.5, 2], np.float32)})


def test_resize_refuses_what_it_cannot_differentiate():
    data = {"x": rnd(1, 1, 4, 4, seed=11)}
    params = {"s": rnd(1, 1, 1, 1, seed=12)}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Resize", ["xs", "roi", "scales"], ["out"], mode="linear",
                              coordinate_transformation_mode="tf_crop_and_resize")]
    consts = {"scales": np.array([1, 1, 2, 2], np.float32), "roi": np.array([0, 0, 0, 0, 1, 1, 1, 1], np.float32)}
    forward = _forward(nodes, "out", data, params, consts, 17, 0, None)
    with pytest.raises(GradientError, match="tf_crop_and_resize"):
        build_artifacts(forward, ["s"], loss=None)
    # spatial sizes only the run knows: a run-time matrix, no refusal
    nodes[1] = helper.make_node("Resize", ["xs", "", "scales"], ["out"], mode="nearest")
    forward = _forward(nodes, "out", data, params, {"scales": np.array([1, 1, 2, 2], np.float32)}, 17, 0,
                       {"x": [1, 1, "h", "w"]})
    assert any(n.op_type == "Range" for n in build_artifacts(forward, ["s"], loss=None).training.graph.node)


# -- InstanceNormalization ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,symbolic", [((2, 3, 5), None), ((2, 3, 4, 3), None), ((3, 2, 2, 3, 2), None),
                                            ((2, 3, 4, 3), ["n", 3, 4, 3])], ids=["1d", "2d", "3d", "symbolic"])
def test_instance_normalization(shape, symbolic):
    c = shape[1]
    data = {"x": rnd(*shape, seed=20, scale=2.0) + 0.5}
    params = {"w": rnd(c, c, seed=21) + np.eye(c), "scale": rnd(c, seed=22) + 1.0, "bias": rnd(c, seed=23)}
    perm = [0, *range(2, len(shape)), 1]
    back = [0, len(shape) - 1, *range(1, len(shape) - 1)]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=perm),          # a channel mix before: dX matters
             helper.make_node("MatMul", ["xt", "w"], ["m"]),
             helper.make_node("Transpose", ["m"], ["xm"], perm=back),
             helper.make_node("InstanceNormalization", ["xm", "scale", "bias"], ["y"], epsilon=1e-3),
             helper.make_node("Tanh", ["y"], ["out"])]
    check(nodes, "out", data, params, symbolic={"x": symbolic} if symbolic else None)


def test_group_norm_as_torch_exports_it():
    """Reshape [N, G, -1] -> InstanceNormalization(scale 1, bias 0: constants) -> Reshape -> Mul -> Add."""
    data = {"x": rnd(2, 4, 3, 3, seed=24)}
    params = {"w": rnd(4, 4, 1, 1, seed=25), "gamma": rnd(4, 1, 1, seed=26) + 1.0, "beta": rnd(4, 1, 1, seed=27)}
    consts = {"g_shape": np.array([0, 2, -1], np.int64), "ones": np.ones(2, np.float32),
              "zeros": np.zeros(2, np.float32), "x_shape": np.array([0, 4, 3, 3], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("Reshape", ["c", "g_shape"], ["r"]),
             helper.make_node("InstanceNormalization", ["r", "ones", "zeros"], ["n"], epsilon=1e-5),
             helper.make_node("Reshape", ["n", "x_shape"], ["b"]),
             helper.make_node("Mul", ["b", "gamma"], ["bm"]),
             helper.make_node("Add", ["bm", "beta"], ["out"])]
    check(nodes, "out", data, params, consts=consts)


# -- the checkpoint ----------------------------------------------------------------------------------------------

def test_checkpoint_keeps_a_0d_frozen_value_0d():
    """A scalar initializer passed as a frozen parameter (a hand-built graph's constant): onnxruntime-training's
    checkpoint stores it with no dims, and its CheckpointState gives it back 0-d; ours did [1]."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs.Checkpoint import Checkpoint as Flat

    data = encode_checkpoint(Checkpoint(params={"w": np.ones((2, 3), np.float32)},
                                        frozen={"one": np.array(2.0, np.float32), "ax": np.array([1], np.int64)}))
    back = decode_checkpoint(data)
    assert back.frozen["one"].shape == () and float(back.frozen["one"]) == 2.0
    assert back.frozen["ax"].shape == (1,) and back.params["w"].shape == (2, 3)
    module = Flat.GetRootAs(data, 0).ModuleState()
    dims = {module.FrozenParams(i).Name(): module.FrozenParams(i).DimsLength()
            for i in range(module.FrozenParamsLength())}
    assert dims == {b"one": 0, b"ax": 1}


# -- NegativeLogLikelihoodLoss -------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction,weighted,ignore,spatial", [
    ("mean", False, None, False), ("mean", True, None, False), ("mean", True, 2, False), ("mean", False, 1, True),
    ("sum", False, None, True), ("sum", True, 0, False), ("none", True, 3, True), ("none", False, None, False)])
def test_negative_log_likelihood_loss(reduction, weighted, ignore, spatial):
    shape = (4, 5, 3) if spatial else (6, 5)
    target = np.random.default_rng(30).integers(0, 5, size=(shape[0], *shape[2:])).astype(np.int64)
    if ignore is not None:
        target.reshape(-1)[:3] = ignore  # some positions ignored for sure
    data = {"x": rnd(*shape, seed=31), "t": target}
    params = {"s": rnd(5, 5, seed=32) + np.eye(5)}
    consts = {"w": np.array([1.0, 2.0, 0.5, 1.5, 0.7], np.float32)} if weighted else {}
    perm = [0, 2, 1] if spatial else [0, 1]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=perm),
             helper.make_node("MatMul", ["xt", "s"], ["m"]),
             helper.make_node("Transpose", ["m"], ["mt"], perm=perm),
             helper.make_node("LogSoftmax", ["mt"], ["lp"], axis=1),
             helper.make_node("NegativeLogLikelihoodLoss", ["lp", "t"] + (["w"] if weighted else []), ["out"],
                              reduction=reduction, **({"ignore_index": ignore} if ignore is not None else {}))]
    check(nodes, "out", data, params, consts=consts, custom={"LogSoftmaxGrad_13"})


# -- RNN ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("direction,activation,layout,bias,initial,outputs", [
    ("forward", "Tanh", 0, True, False, "both"), ("reverse", "Tanh", 0, True, True, "Y"),
    ("bidirectional", "Tanh", 0, True, True, "both"), ("forward", "Relu", 0, False, False, "Y_h"),
    ("bidirectional", "Sigmoid", 0, True, False, "Y_h")],
    ids=["forward", "reverse-h0", "bidirectional-h0", "relu-no-bias-yh", "bidirectional-sigmoid-yh"])
def test_rnn(direction, activation, layout, bias, initial, outputs):
    d = 2 if direction == "bidirectional" else 1
    t, b, i, h = 4, 3, 2, 3
    data = {"x": rnd(*((b, t, i) if layout else (t, b, i)), seed=40)}
    params = {"W": rnd(d, h, i, seed=41, scale=0.6), "R": rnd(d, h, h, seed=42, scale=0.5)}
    if bias:
        params["B"] = rnd(d, 2 * h, seed=43, scale=0.3)
    if initial:
        params["h0"] = rnd(*((b, d, h) if layout else (d, b, h)), seed=44, scale=0.5)
    ins = ["x", "W", "R", "B" if bias else "", "", "h0" if initial else ""]
    while not ins[-1]:
        ins.pop()
    y, yh = ("y" if outputs in ("Y", "both") else ""), ("yh" if outputs in ("Y_h", "both") else "")
    nodes = [helper.make_node("RNN", ins, [y, yh], hidden_size=h, direction=direction, layout=layout,
                              activations=[activation] * d)]
    if outputs == "both":
        nodes += [helper.make_node("ReduceMean", ["y"], ["ym"], axes=[1 if layout else 0], keepdims=0),
                  helper.make_node("Reshape", ["ym", "flat"], ["ymf"]),
                  helper.make_node("Reshape", ["yh", "flat"], ["yhf"]),
                  helper.make_node("Concat", ["ymf", "yhf"], ["out"], axis=0)]
        consts = {"flat": np.array([-1], np.int64)}
    else:
        nodes += [helper.make_node("Identity", [y or yh], ["out"])]
        consts = {}
    training = check(nodes, "out", data, params, consts=consts, opset=14 if outputs == "both" else 17)
    assert sum(n.op_type == "RNN" for n in training.graph.node) == 1


def test_rnn_refuses_what_it_cannot_differentiate():
    data = {"x": rnd(4, 2, 3, seed=45)}
    params = {"W": rnd(1, 2, 3, seed=46), "R": rnd(1, 2, 2, seed=47)}
    for attrs, match in ((dict(clip=1.0), "clip"), (dict(activations=["HardSigmoid"]), "activations"),
                         (dict(layout=1), "layout")):
        forward = _forward([helper.make_node("RNN", ["x", "W", "R"], ["out"], hidden_size=2, **attrs)], "out", data,
                           params, {}, 17, 0, None)
        with pytest.raises(GradientError, match=match):
            build_artifacts(forward, ["W", "R"], loss=None)
    forward = _forward([helper.make_node("RNN", ["x", "W", "R"], ["out"], hidden_size=2)], "out", data, params, {},
                       17, 0, {"x": ["t", 2, 3]})
    with pytest.raises(GradientError, match="sequence length"):
        build_artifacts(forward, ["W", "R"], loss=None)


# -- Pad's other modes and AveragePool over a symbolic batch (the separable maps of upsample.py) ---------------------

@pytest.mark.parametrize("mode,pads,opset", [
    ("reflect", [0, 0, 1, 2, 0, 0, 2, 1], 17), ("edge", [0, 0, 2, 0, 0, 0, 1, 3], 17),
    ("reflect", [0, 0, 0, 3, 0, 0, 0, 3], 17), ("wrap", [0, 0, 1, 2, 0, 0, 2, 1], 19)],
    ids=["reflect", "edge", "reflect-wide", "wrap"])
def test_pad_modes(mode, pads, opset):
    data = {"x": rnd(2, 3, 4, 5, seed=50)}
    params = {"s": rnd(3, 1, 1, seed=51) + 1.0}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Pad", ["xs", "pads"], ["p"], mode=mode),
             helper.make_node("Tanh", ["p"], ["out"])]
    check(nodes, "out", data, params, consts={"pads": np.array(pads, np.int64)}, opset=opset)


@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[2, 2], strides=[2, 2]),
    dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1]),
    dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1),
    dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 0, 0], ceil_mode=1),
    dict(kernel_shape=[2, 3], strides=[2, 2], pads=[0, 1, 0, 1], ceil_mode=1, count_include_pad=1),
    dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")],
    ids=["plain", "pads", "include-pad", "ceil", "ceil-include-pad", "same-upper"])
def test_average_pool_with_a_symbolic_batch(attrs):
    """No AveragePoolGrad where the batch is symbolic (onnxruntime-training's kernel would make it 0 rows)."""
    data = {"x": rnd(3, 2, 5, 6, seed=52)}
    params = {"w": rnd(2, 2, 1, 1, seed=53)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("AveragePool", ["c"], ["out"], **attrs)]
    training = check(nodes, "out", data, params, symbolic={"x": ["n", 2, 5, 6]})
    assert not any(n.op_type == "AveragePoolGrad" for n in training.graph.node)


def test_integer_frozen_parameters_are_constants_to_the_rules():
    """onnxruntime's tutorials freeze every initializer not trained: a hand-built graph's pads then are a frozen
    parameter (a training-model input fed from the checkpoint). An integer one can change in no step, so the rules
    read its value (Pad reflect needs its pads); a float frozen one (running statistics) stays an input."""
    data = {"x": rnd(2, 3, 4, seed=60)}
    params = {"s": rnd(3, 1, seed=61) + 1.0}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Pad", ["xs", "pads"], ["p"], mode="reflect"),
             helper.make_node("Mul", ["p", "gain"], ["out"])]
    consts = {"pads": np.array([0, 1, 2, 0, 0, 1], np.int64), "gain": np.array(1.5, np.float32)}
    forward = _forward(nodes, "out", data, params, consts, 17, 0, None)
    art = build_artifacts(forward, ["s"], frozen_params=["pads", "gain"], loss=None)
    assert {"pads", "gain"} <= {i.name for i in art.training.graph.input}  # still fed as frozen parameters
    model, exposed = gradients_exposed(art.training)
    feeds = {"x": data["x"].astype(np.float32), "s": params["s"].astype(np.float32), **consts}
    got = run_model(lower_model(model), {k: v for k, v in feeds.items()
                                         if k in {i.name for i in model.graph.input}})[exposed["s"]]
    # d/ds sum(W * 1.5 * pad(x * s)) = sum(pad^T(1.5 W) * x) over all but s's axis; pad^T by numpy's np.pad of
    # each unit tensor (numpy's "reflect" is ONNX's)
    weights = np.random.default_rng(1000).standard_normal((2, 4, 7)) * 1.5
    back = np.zeros((2, 3, 4))
    for index in np.ndindex(back.shape):
        unit = np.zeros(back.shape)
        unit[index] = 1.0
        back[index] = np.sum(weights * np.pad(unit, [(0, 0), (1, 0), (2, 1)], mode="reflect"))
    want = np.sum(back * data["x"], axis=(0, 2)).reshape(3, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- recurrent.py: reverse / bidirectional LSTM and GRU as forward-direction training nodes -------------------------

@pytest.mark.parametrize("kind,direction", [("LSTM", "reverse"), ("LSTM", "bidirectional"), ("GRU", "reverse"),
                                            ("GRU", "bidirectional")])
def test_reverse_and_bidirectional_recurrent_nodes_run_forward_only(kind, direction):
    """onnxruntime-training's LSTMTraining/LSTMGrad and GRUTraining/GRUGrad kernels refuse any direction but
    forward ("only supports the forward direction for now"): such a node becomes one forward-direction node per
    direction (X reversed in time for the reverse one); the gradients still equal float64 finite differences."""
    d, g, t, b, i, h = (2 if direction == "bidirectional" else 1), (4 if kind == "LSTM" else 3), 4, 2, 3, 2
    data = {"x": rnd(t, b, i, seed=70)}
    params = {"W": rnd(d, g * h, i, seed=71, scale=0.6), "R": rnd(d, g * h, h, seed=72, scale=0.6),
              "B": rnd(d, 2 * g * h, seed=73, scale=0.3), "h0": rnd(d, b, h, seed=74, scale=0.5)}
    ins = ["x", "W", "R", "B", "", "h0"]
    outs = ["y", "yh"]
    nodes = [helper.make_node(kind, ins, outs, hidden_size=h, direction=direction),
             helper.make_node("ReduceMean", ["y", "ax0"], ["ym"], keepdims=0),
             helper.make_node("Mul", ["ym", "yh"], ["out"])]
    training = check(nodes, "out", data, params, consts={"ax0": np.array([0], np.int64)}, opset=18,
                     custom={f"{kind}Training", f"{kind}Grad", "SliceGrad"})
    recurrent = [n for n in training.graph.node if n.op_type == f"{kind}Training"]
    assert len(recurrent) == d
    assert all(helper.get_attribute_value(next(a for a in n.attribute if a.name == "direction")) == b"forward"
               for n in recurrent)


@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[2], strides=[2]), dict(kernel_shape=[3], strides=[2], pads=[1, 1]),
    dict(kernel_shape=[3], strides=[2], pads=[1, 0], count_include_pad=1),
    dict(kernel_shape=[2], strides=[2], ceil_mode=1), dict(kernel_shape=[3], strides=[2], pads=[1, 1], ceil_mode=1,
                                                          count_include_pad=1)],
    ids=["plain", "pads", "include-pad", "ceil", "ceil-include-pad"])
def test_average_pool_over_a_symbolic_length(attrs):
    """A 1-D AveragePool over a length only the run knows (variable-length audio): the averaging map is built by
    the graph (AveragePoolGrad would need the length in dX's declared type)."""
    data = {"x": rnd(2, 2, 9, seed=54)}
    params = {"w": rnd(2, 2, 1, seed=55)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("AveragePool", ["c"], ["out"], **attrs)]
    training = check(nodes, "out", data, params, symbolic={"x": ["n", 2, "t"]})
    assert not any(n.op_type == "AveragePoolGrad" for n in training.graph.node)
    assert any(n.op_type == "Range" for n in training.graph.node)
