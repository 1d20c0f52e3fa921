"""The transformer gradient rules: MatMul (lowering/training/gradients/matmul.py), Softmax, LogSoftmax,
LayerNormalization, Dropout (normalization.py) and the elementwise math around them (elementwise.py: Sqrt,
Reciprocal, Erf, Sum, Mean, Max, Min, Pow, Div...).

Each case is a tiny forward model whose differentiable values are parameters; the loss is the sum of its output
times fixed random weights. ``build_artifacts`` makes the training model, whose custom nodes must verify
against the project's specs (``oplower check``); it is lowered and run in onnxruntime, and each parameter's
gradient is compared with central finite differences of the same model in float64 (``onnx.reference``, or
NumPy where the reference lacks an op's old semantics). Dropout with a nonzero ratio is random: its gradient
is checked against the mask the same run drew.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import onnx.reference  # noqa: F401 -- before the project registers its schemas (DESIGN.md section 8)
import pytest
from onnx import TensorProto, helper, numpy_helper

from lowering.passes import lower_model
from lowering.training.artifacts import build_artifacts
from lowering.training.gradients.context import GradientError
from opdef.model_verify import verify_model
from runtime.session import run_model

ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")
MS = "com.microsoft"


class Case:
    """``build(dtype)`` -> (nodes, parameters {name: float64 array}, constants {name: array}, output name);
    every parameter is trained. ``data``: graph inputs (name -> array; float ones take the case's dtype),
    ``dims``: their declared shapes where not the array's (symbolic dims)."""

    def __init__(self, id_: str, build: Callable, *, opset: int = 17, data: dict | None = None,
                 dims: dict | None = None, numpy_forward: Callable | None = None, ops: tuple = (),
                 dtype=np.float32, tol: float | None = None, shape: tuple | None = None):
        self.id, self.build, self.opset = id_, build, opset
        self.data, self.dims = data or {}, dims or {}
        self.numpy_forward, self.ops, self.dtype = numpy_forward, ops, dtype
        self.tol = tol if tol is not None else (2e-5 if dtype == np.float32 else 1e-8)
        self.shape = shape  # the output's shape where onnx.reference cannot run the nodes

    def model(self, dtype) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        nodes, params, consts, out = self.build(dtype)
        weights = np.random.default_rng(99).standard_normal(self.shape if self.shape is not None else
                                                            _out_shape(self))
        consts = {**consts, "loss_weights": weights}
        graph_nodes = [*nodes, helper.make_node("Mul", [out, "loss_weights"], ["loss_terms"], name="weigh"),
                       helper.make_node("ReduceSum", ["loss_terms"], ["loss"], name="total", keepdims=0)]
        inits = [numpy_helper.from_array(_cast(v, dtype), k) for k, v in {**params, **consts}.items()]
        inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(_cast(v, dtype).dtype),
                                                self.dims.get(k, list(v.shape))) for k, v in self.data.items()]
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        graph = helper.make_graph(graph_nodes, self.id, inputs, [helper.make_tensor_value_info("loss", elem, [])],
                                  inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=8)
        return model, {k: _cast(v, dtype) for k, v in params.items()}


def _cast(v, dtype):
    """Float values in the case's dtype, except a float32 array given as such (a constant of another type)."""
    v = np.asarray(v)
    return v.astype(dtype) if v.dtype.kind == "f" and v.dtype != np.float32 else v


def _out_shape(case: Case) -> tuple[int, ...]:
    """The output's shape, from a float64 reference run of the bare nodes."""
    nodes, params, consts, out = case.build(np.float64)
    inits = [numpy_helper.from_array(_cast(v, np.float64), k) for k, v in {**params, **consts}.items()]
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(_cast(v, np.float64).dtype),
                                            list(v.shape)) for k, v in case.data.items()]
    graph = helper.make_graph(nodes, "shape", inputs, [helper.make_empty_tensor_value_info(out)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)], ir_version=8)
    feeds = {k: _cast(v, np.float64) for k, v in case.data.items()}
    return np.asarray(onnx.reference.ReferenceEvaluator(model).run(None, feeds)[0]).shape


def training_run(case: Case, extra_outputs: tuple[str, ...] = (), feeds: dict | None = None):
    """(training model, {parameter: gradient} from the lowered model in onnxruntime, extra outputs)."""
    model, params = case.model(case.dtype)
    art = build_artifacts(model, list(params), loss=None)
    training = art.training
    verify_model(training)  # every custom node valid against the project's specs, as `oplower check`
    exposed = onnx.ModelProto.FromString(training.SerializeToString())
    grads = {n.input[0][: -len("_grad.accumulation.buffer")]: n.input[1] for n in exposed.graph.node
             if (n.domain, n.op_type) == ACCUMULATOR}
    kept = [n for n in exposed.graph.node if (n.domain, n.op_type) != ACCUMULATOR]
    del exposed.graph.node[:]
    exposed.graph.node.extend(kept)
    del exposed.graph.output[:]
    exposed.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in (*grads.values(), *extra_outputs))
    keep = [i for i in exposed.graph.input if not i.name.endswith("buffer") and i.name != "lazy_reset_grad"]
    del exposed.graph.input[:]
    exposed.graph.input.extend(keep)
    data = {k: _cast(v, case.dtype) for k, v in (feeds if feeds is not None else case.data).items()}
    got = run_model(lower_model(exposed), {**data, **params})
    return training, {p: got[g] for p, g in grads.items()}, {n: got[n] for n in extra_outputs}


def finite_differences(case: Case, h: float = 1e-5) -> dict[str, np.ndarray]:
    """Central differences of the float64 loss with respect to every parameter element."""
    model, params = case.model(np.float64)
    weights = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "loss_weights"))
    data = {k: _cast(v, np.float64) for k, v in case.data.items()}
    if case.numpy_forward is not None:
        def loss(values):
            return float(np.sum(case.numpy_forward(**values) * weights))
    else:
        stripped = onnx.ModelProto.FromString(model.SerializeToString())
        names = set(params)
        kept = [t for t in stripped.graph.initializer if t.name not in names]
        del stripped.graph.initializer[:]
        stripped.graph.initializer.extend(kept)
        stripped.graph.input.extend(helper.make_tensor_value_info(k, TensorProto.DOUBLE, list(v.shape))
                                    for k, v in params.items())
        evaluator = onnx.reference.ReferenceEvaluator(stripped)

        def loss(values):
            return float(np.sum(evaluator.run(None, {**data, **values})[0]))
    out = {}
    for name, value in params.items():
        grad = np.zeros_like(value)
        for i in np.ndindex(value.shape):
            step = h * max(1.0, abs(value[i]))
            for sign in (1, -1):
                moved = value.copy()
                moved[i] += sign * step
                grad[i] += sign * loss({**params, name: moved}) / (2 * step)
        out[name] = grad
    return out


def check(case: Case) -> onnx.ModelProto:
    training, got, _ = training_run(case)
    want = finite_differences(case)
    assert set(got) == set(want)
    for p in want:
        scale = max(float(np.max(np.abs(want[p]))), 1e-3)
        err = float(np.max(np.abs(got[p].astype(np.float64) - want[p])))
        assert err <= case.tol * scale, f"{case.id}: d/d{p} off by {err:.3g} (largest {scale:.3g})"
    present = {(n.domain or "", n.op_type) for n in training.graph.node}
    for op in case.ops:
        assert (op if isinstance(op, tuple) else ("", op)) in present, f"{case.id}: no {op} in the training model"
    return training


def _rand(seed, *shape, low=None, high=None):
    rng = np.random.default_rng(seed)
    if low is not None:
        return rng.uniform(low, high, shape)
    return rng.standard_normal(shape)


# -- MatMul -----------------------------------------------------------------------------------------------------

def _matmul(a_shape, b_shape, seed=0):
    def build(dtype):
        params = {"A": _rand(seed, *a_shape), "B": _rand(seed + 1, *b_shape)}
        return [helper.make_node("MatMul", ["A", "B"], ["Y"], name="mm")], params, {}, "Y"
    return build


MATMUL = [
    Case("matmul-2x2", _matmul((3, 4), (4, 5)), ops=("Gemm",)),
    Case("matmul-3dx2d-weight", _matmul((2, 3, 4), (4, 5)), ops=((MS, "FusedMatMul"), "Gemm")),
    Case("matmul-attention-4d", _matmul((2, 2, 3, 4), (2, 2, 4, 3)), ops=((MS, "FusedMatMul"),)),
    Case("matmul-broadcast-batch", _matmul((2, 1, 3, 4), (3, 4, 5)), ops=((MS, "FusedMatMul"), "ReduceSum")),
    Case("matmul-2dx3d", _matmul((3, 4), (2, 4, 5))),
    Case("matmul-1dx3d", _matmul((4,), (2, 4, 5))),
    Case("matmul-3dx1d", _matmul((2, 3, 4), (4,))),
    Case("matmul-1dx2d", _matmul((4,), (4, 5))),
    Case("matmul-2dx1d", _matmul((3, 4), (4,))),
    Case("matmul-1dx1d", _matmul((4,), (4,))),
    Case("matmul-4d-f64", _matmul((2, 1, 3, 4), (2, 4, 2)), dtype=np.float64),
    Case("matmul-opset11-1d", _matmul((2, 3, 4), (4,)), opset=11),
]


def _dynamic_batch(dtype):
    """B = xin + boff with xin [N, 4, 5] of a symbolic N: the batch reduction and the row reshape run on runtime
    shapes where shape inference leaves N open."""
    params = {"A": _rand(3, 3, 4), "boff": _rand(4, 4, 5), "C": _rand(5, 5, 2)}
    nodes = [helper.make_node("Add", ["xin", "boff"], ["B"]),
             helper.make_node("MatMul", ["A", "B"], ["Y"]),  # [N, 3, 5]: dA summed over N
             helper.make_node("MatMul", ["Y", "C"], ["Z"])]  # [N, 3, 2]: dC one Gemm over N*3 rows
    return nodes, params, {}, "Z"


MATMUL.append(Case("matmul-symbolic-batch", _dynamic_batch, data={"xin": _rand(6, 2, 4, 5)},
                   dims={"xin": ["N", 4, 5]}))


def _half(case: Case, tol: float = 1e-2) -> Case:
    """The case in float16 (computed in float16 as the forward: 1e-2 of the largest entry)."""
    return Case(f"{case.id}-f16", case.build, opset=case.opset, data=case.data, dims=case.dims,
                numpy_forward=case.numpy_forward, ops=case.ops, dtype=np.float16, tol=tol, shape=case.shape)


MATMUL.append(_half(MATMUL[2]))


@pytest.mark.parametrize("case", MATMUL, ids=lambda c: c.id)
def test_matmul(case):
    check(case)


# -- Softmax, LogSoftmax ----------------------------------------------------------------------------------------

def _softmax_np(x, axis, coerced, log):
    axes = tuple(range(axis % x.ndim, x.ndim)) if coerced else (axis,)
    z = x - x.max(axis=axes, keepdims=True)
    if log:
        return z - np.log(np.exp(z).sum(axis=axes, keepdims=True))
    e = np.exp(z)
    return e / e.sum(axis=axes, keepdims=True)


def _softmax(op, axis, opset):
    def build(dtype):
        attrs = {} if axis is None else {"axis": axis}
        return [helper.make_node(op, ["X"], ["Y"], name="sm", **attrs)], {"X": _rand(7, 2, 3, 4)}, {}, "Y"
    default = -1 if opset >= 13 else 1
    grad = f"{op}Grad" + ("_13" if opset >= 13 else "")
    return Case(f"{op}-axis{axis}-opset{opset}", build, opset=opset, ops=((MS, grad),),
                numpy_forward=lambda X: _softmax_np(X, default if axis is None else axis, opset < 13,
                                                    op == "LogSoftmax"))


SOFTMAX = [_softmax(op, axis, opset) for op in ("Softmax", "LogSoftmax")
           for axis, opset in ((None, 17), (1, 17), (0, 13), (None, 12), (1, 12), (-1, 12))]
SOFTMAX += [_half(SOFTMAX[0]), _half(SOFTMAX[6])]


@pytest.mark.parametrize("case", SOFTMAX, ids=lambda c: c.id)
def test_softmax(case):
    training = check(case)
    grad = next(n for n in training.graph.node if n.domain == MS and "SoftmaxGrad" in n.op_type)
    forward = next(n for n in training.graph.node if n.op_type in ("Softmax", "LogSoftmax"))
    assert grad.input[1] == forward.output[0]  # reads Y, not X, as onnxruntime-training's


# -- LayerNormalization -----------------------------------------------------------------------------------------

def _layer_norm(axis=-1, bias=True, stats=False, epsilon=None, shape=(2, 3, 4), stash=None):
    def build(dtype):
        norm = shape[axis:] if axis != -1 else shape[-1:]
        params = {"X": _rand(11, *shape) * 2 + 3, "scale": 1 + 0.3 * _rand(12, *norm)}
        inputs = ["X", "scale"]
        if bias:
            params["bias"] = 0.2 * _rand(13, *norm)
            inputs.append("bias")
        attrs = {"axis": axis}
        if epsilon is not None:
            attrs["epsilon"] = epsilon
        if stash is not None:
            attrs["stash_type"] = stash
        outputs = ["Y", "mean", "inv_std"] if stats else ["Y"]
        return [helper.make_node("LayerNormalization", inputs, outputs, name="ln", **attrs)], params, {}, "Y"
    return build


LAYER_NORM = [
    Case("ln-last", _layer_norm(), ops=((MS, "LayerNormalizationGrad"),)),
    Case("ln-axis1", _layer_norm(axis=1), ops=((MS, "LayerNormalizationGrad"),)),
    Case("ln-no-bias", _layer_norm(bias=False)),
    Case("ln-with-stats-eps1e-2", _layer_norm(stats=True, epsilon=1e-2)),
    # stash_type 1: Mean and InvStdDev are float32 also for a float64 X (onnxruntime's forward kernel and the
    # gradient read the rounded values): 1e-7 relative, not float64's 1e-8
    Case("ln-2d-f64", _layer_norm(shape=(3, 5)), dtype=np.float64, tol=3e-7),
]
LAYER_NORM.append(_half(LAYER_NORM[0]))


@pytest.mark.parametrize("case", LAYER_NORM, ids=lambda c: c.id)
def test_layer_normalization(case):
    training = check(case)
    ln = next(n for n in training.graph.node if n.op_type == "LayerNormalization")
    grad = next(n for n in training.graph.node if n.op_type == "LayerNormalizationGrad")
    assert len(ln.output) == 3 and all(ln.output)
    assert list(grad.input[3:]) == list(ln.output[1:])
    assert len(grad.output) == 3 and all(grad.output)  # onnxruntime-training's schema requires all three
    attrs = {a.name: helper.get_attribute_value(a) for a in grad.attribute}
    fwd = {a.name: helper.get_attribute_value(a) for a in ln.attribute}
    assert attrs["axis"] == fwd["axis"] and attrs["stash_type"] == 1
    assert attrs["epsilon"] == pytest.approx(fwd.get("epsilon", 1e-5))


def test_layer_norm_eval_model_keeps_the_forward_node():
    model, _ = Case("ln", _layer_norm()).model(np.float32)
    art = build_artifacts(model, ["X", "scale", "bias"], loss=None)
    ln = next(n for n in art.eval.graph.node if n.op_type == "LayerNormalization")
    assert list(ln.output) == ["Y"]
    onnx.checker.check_model(art.eval, full_check=True)


def _decomposed_layer_norm(dtype):
    """LayerNormalization as torch exports it before opset 17: ReduceMean, Sub, Pow 2 (an f32 exponent),
    Sqrt, Div, Mul, Add."""
    params = {"X": _rand(14, 2, 5) + 1, "scale": 1 + 0.3 * _rand(15, 5), "bias": 0.1 * _rand(16, 5)}
    consts = {"two": np.array(2.0), "eps": np.array(1e-5)}
    nodes = [helper.make_node("ReduceMean", ["X"], ["mu"], axes=[-1]),
             helper.make_node("Sub", ["X", "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]),
             helper.make_node("Mul", ["n", "scale"], ["ns"]),
             helper.make_node("Add", ["ns", "bias"], ["Y"])]
    return nodes, params, consts, "Y"


def test_decomposed_layer_norm_opset13():
    check(Case("ln-decomposed", _decomposed_layer_norm, opset=13, ops=("Sqrt",)))


# -- Dropout ----------------------------------------------------------------------------------------------------

def _dropout(ratio, mode, mask=False):
    """``mode``: "train" (training_mode a constant true), "off" (a constant false), "absent" (no
    training_mode: nn.MultiheadAttention's export), "input" (a graph input)."""
    def build(dtype):
        consts = {} if ratio is None else {"ratio": np.array(ratio, np.float32)}
        inputs = ["X", "" if ratio is None else "ratio"]
        if mode in ("train", "off"):
            consts["training_mode"] = np.array(mode == "train")
            inputs.append("training_mode")
        elif mode == "input":
            inputs.append("tm")
        while not inputs[-1]:
            inputs.pop()
        outputs = ["Y", "M"] if mask else ["Y"]
        nodes = [helper.make_node("Dropout", inputs, outputs, name="drop"),
                 helper.make_node("Mul", ["Y", "k"], ["Z"])]  # something after it, as in a network
        return nodes, {"X": _rand(20, 4, 6), "k": _rand(21, 6)}, consts, "Z"
    return build


def _dropout_case(ratio, mode, mask=False, tm=None):
    return Case(f"dropout-{ratio}-{mode}" + ("-mask" if mask else ""), _dropout(ratio, mode, mask),
                data={} if tm is None else {"tm": np.array(tm)}, shape=(4, 6))


@pytest.mark.parametrize("case", [_dropout_case(0.0, "train"), _dropout_case(0.0, "train", mask=True),
                                  _dropout_case(0.3, "absent"), _dropout_case(0.3, "off", mask=True),
                                  _dropout_case(0.0, "input", tm=True), _dropout_case(0.4, "input", tm=False)],
                         ids=lambda c: c.id)
def test_dropout_deterministic(case):
    """Ratio 0, or inference mode: Y = X, and the gradient is the identity's (finite differences apply)."""
    training = check(case)
    mode = case.id.split("-")[2]
    grads = [n for n in training.graph.node if n.op_type == "DropoutGrad"]
    assert len(grads) == (0 if mode in ("absent", "off") else 1)
    drop = next(n for n in training.graph.node if n.op_type == "Dropout")
    if grads:
        assert grads[0].input[1] == drop.output[1]


@pytest.mark.parametrize("ratio,mode", [(0.5, "train"), (0.25, "input"), (None, "train")])
def test_dropout_training_mode_uses_the_drawn_mask(ratio, mode):
    """A real ratio: dX = dY * mask / (1 - ratio) with the mask the same run drew (default ratio 0.5)."""
    case = Case("dropout-random", _dropout(ratio, mode), data={"tm": np.array(True)} if mode == "input" else {},
                shape=(4, 6))
    model, params = case.model(np.float32)
    art = build_artifacts(model, list(params), loss=None)
    drop = next(n for n in art.training.graph.node if n.op_type == "Dropout")
    assert len(drop.output) == 2 and drop.output[1]
    _, grads, extra = training_run(case, extra_outputs=(drop.output[0], drop.output[1]))
    mask = extra[drop.output[1]]
    assert mask.dtype == np.bool_ and 0 < mask.mean() < 1
    keep = 1.0 - (0.5 if ratio is None else ratio)
    weights = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "loss_weights"))
    dy = weights * params["k"]
    np.testing.assert_allclose(grads["X"], dy * mask / np.float32(keep), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(extra[drop.output[0]], params["X"] * mask / np.float32(keep), rtol=1e-6, atol=1e-7)
    # the eval model: inference mode, one output, Y = X
    ev_drop = next(n for n in art.eval.graph.node if n.op_type == "Dropout")
    assert len(ev_drop.input) <= 2 and list(ev_drop.output) == ["Y"]
    feeds = {"tm": np.array(True)} if mode == "input" else {}
    out = run_model(art.eval, {**feeds, **params})
    np.testing.assert_allclose(out["loss"], np.sum(params["X"] * params["k"] * weights), rtol=1e-5)


def test_dropout_runtime_training_mode_false_passes_the_gradient_through():
    case = Case("dropout-input-false", _dropout(0.5, "input"), data={"tm": np.array(False)}, shape=(4, 6))
    _, grads, _ = training_run(case)
    model, params = case.model(np.float32)
    weights = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "loss_weights"))
    np.testing.assert_allclose(grads["X"], weights * params["k"], rtol=1e-6)


# -- elementwise math -------------------------------------------------------------------------------------------

def _unary(op, low, high, seed=30):
    def build(dtype):
        return [helper.make_node(op, ["X"], ["Y"])], {"X": _rand(seed, 3, 4, low=low, high=high)}, {}, "Y"
    return build


_ERF = np.vectorize(math.erf, otypes=[np.float64])  # onnx.reference's Erf rounds to float32


def _gelu_erf(dtype):
    """nn.GELU() as torch exports it: x * 0.5 * (1 + erf(x / sqrt 2)), a bias before it."""
    params = {"X": _rand(31, 3, 5) * 1.5, "b": 0.2 * _rand(32, 5)}
    consts = {"sqrt2": np.array(np.sqrt(2.0)), "one": np.array(1.0), "half": np.array(0.5)}
    nodes = [helper.make_node("Add", ["X", "b"], ["xb"]),
             helper.make_node("Div", ["xb", "sqrt2"], ["s"]),
             helper.make_node("Erf", ["s"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]),
             helper.make_node("Mul", ["xb", "e1"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["Y"])]
    return nodes, params, consts, "Y"


def _variadic(op, shapes, seed=40):
    def build(dtype):
        names = [f"x{i}" for i in range(len(shapes))]
        params = {n: _rand(seed + i, *s) for i, (n, s) in enumerate(zip(names, shapes, strict=True))}
        return [helper.make_node(op, names, ["Y"])], params, {}, "Y"
    return build


def _binary(op, a_shape, b_shape, *, b_const=None, a_range=None, seed=50):
    def build(dtype):
        a = _rand(seed, *a_shape, low=a_range[0], high=a_range[1]) if a_range else _rand(seed, *a_shape)
        params = {"A": a}
        consts = {}
        if b_const is not None:
            consts["B"] = b_const
        else:
            params["B"] = _rand(seed + 1, *b_shape, low=0.5, high=1.5) if op in ("Div", "Pow") else \
                _rand(seed + 1, *b_shape)
        return [helper.make_node(op, ["A", "B"], ["Y"])], params, consts, "Y"
    return build


ELEMENTWISE = [
    Case("sqrt", _unary("Sqrt", 0.3, 2.0), ops=("Sqrt",)),
    Case("reciprocal", _unary("Reciprocal", 0.5, 2.0)),
    Case("reciprocal-negative", _unary("Reciprocal", -2.0, -0.5)),
    Case("erf", _unary("Erf", -2.0, 2.0), numpy_forward=lambda X: _ERF(X)),
    Case("gelu-erf", _gelu_erf, numpy_forward=lambda X, b: (X + b) * 0.5 * (1 + _ERF((X + b) / np.sqrt(2.0)))),
    Case("sum-3-broadcast", _variadic("Sum", [(2, 3), (3,), (2, 1)])),
    Case("sum-1", _variadic("Sum", [(2, 3)])),
    Case("mean-3-broadcast", _variadic("Mean", [(2, 3), (1, 3), (3,)])),
    Case("max-2-broadcast", _variadic("Max", [(3, 4), (4,)])),
    Case("min-3", _variadic("Min", [(3, 4), (3, 4), (1, 4)])),
    Case("max-1", _variadic("Max", [(3, 4)])),
    Case("div-both-broadcast", _binary("Div", (2, 3), (3,))),
    Case("div-scalar-constant", _binary("Div", (2, 3), (), b_const=np.array(2.8284271))),
    Case("div-constant-numerator", lambda dtype: ([helper.make_node("Div", ["one", "A"], ["Y"])],
                                                  {"A": _rand(51, 3, low=0.5, high=2.0)}, {"one": np.array(1.0)},
                                                  "Y")),
    Case("pow-int64-exponent", _binary("Pow", (2, 3), (), b_const=np.array(3, np.int64))),
    Case("pow-f32-exponent-2", _binary("Pow", (2, 3), (), b_const=np.array(2.0))),
    Case("pow-f32-exponent-of-f64-base", _binary("Pow", (2, 3), (), b_const=np.array(1.5, np.float32),
                                                 a_range=(0.5, 2.0)), dtype=np.float64),
    Case("pow-both", _binary("Pow", (2, 3), (3,), a_range=(0.5, 2.0))),
    Case("sub-broadcast", _binary("Sub", (2, 1, 3), (4, 1))),
    Case("mul-broadcast-self", lambda dtype: ([helper.make_node("Mul", ["A", "A"], ["Y"])], {"A": _rand(52, 2, 3)},
                                              {}, "Y")),
    Case("add-scalar-param", _binary("Add", (2, 3), ())),
    Case("sqrt-f64", _unary("Sqrt", 0.3, 2.0), dtype=np.float64),
]
ELEMENTWISE += [_half(c) for c in ELEMENTWISE if c.id in ("gelu-erf", "reciprocal", "max-2-broadcast")]


@pytest.mark.parametrize("case", ELEMENTWISE, ids=lambda c: c.id)
def test_elementwise(case):
    check(case)


def _tie_run(op):
    a = np.array([[1.0, 2.0, -1.0], [0.5, 3.0, 3.0]])
    b = np.array([[1.0, 1.0, -1.0], [0.7, 3.0, 2.0]])
    c = np.array([[1.0, 0.0, 5.0], [0.5, 3.0, 3.0]])
    case = Case(f"{op}-ties", lambda dtype: ([helper.make_node(op, ["a", "b", "c"], ["Y"])],
                                            {"a": a, "b": b, "c": c}, {}, "Y"))
    model, _ = case.model(np.float32)
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "loss_weights"))
    return case, (a, b, c), w


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_ties_share_the_gradient_evenly(op):
    """torch's maximum/minimum (and amax/amin) split dY evenly among the inputs equal to the result."""
    case, values, w = _tie_run(op)
    _, grads, _ = training_run(case)
    y = np.maximum.reduce(values) if op == "Max" else np.minimum.reduce(values)
    hits = [(v == y).astype(np.float64) for v in values]
    count = sum(hits)
    for name, hit in zip("abc", hits, strict=True):
        np.testing.assert_allclose(grads[name], w * hit / count, rtol=1e-6, err_msg=name)


def test_pow_exponent_gradient_is_zero_where_the_base_is_zero():
    """d(A^B)/dB = A^B log A is 0 at A = 0, B >= 0 (torch's convention), not NaN."""
    a = np.array([0.0, 0.5, 2.0])
    case = Case("pow-zero-base", lambda dtype: ([helper.make_node("Pow", ["A", "B"], ["Y"])],
                                                {"A": a, "B": np.array([2.0, 1.5, 0.5])}, {}, "Y"))
    _, grads, _ = training_run(case)
    model, params = case.model(np.float32)
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "loss_weights"))
    want = np.zeros(3)
    want[1:] = w[1:] * a[1:] ** params["B"][1:].astype(np.float64) * np.log(a[1:])
    assert np.all(np.isfinite(grads["B"]))
    np.testing.assert_allclose(grads["B"], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads["A"][0], 0.0, atol=1e-7)


def test_pow_exponent_parameter_of_another_type_gets_its_own_type():
    """A float32 exponent parameter of a float64 base: its gradient is float32 (the accumulator's type)."""
    a, b = np.array([0.5, 1.5, 2.0]), np.array([1.5, 2.0, 0.5], np.float32)
    case = Case("pow-mixed", lambda dtype: ([helper.make_node("Pow", ["A", "B"], ["Y"])], {"A": a, "B": b}, {}, "Y"),
                dtype=np.float64)
    _, grads, _ = training_run(case)
    model, _ = case.model(np.float64)
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "loss_weights"))
    assert grads["B"].dtype == np.float32 and grads["A"].dtype == np.float64
    np.testing.assert_allclose(grads["B"], w * a ** b.astype(np.float64) * np.log(a), rtol=1e-6)
    np.testing.assert_allclose(grads["A"], w * b * a ** (b.astype(np.float64) - 1), rtol=1e-12)


# -- errors -----------------------------------------------------------------------------------------------------

def test_matmul_of_unknown_rank_is_a_one_line_error():
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["Y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones((3, 2), np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(GradientError, match=r"'mm' \(MatMul\): the rank of an operand is unknown"):
        build_artifacts(model, ["W"], loss=None)
