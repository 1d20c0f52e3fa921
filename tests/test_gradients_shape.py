"""The artifact generator's shape and indexing gradient rules (lowering/training/gradients/shape.py).

Each case is a tiny forward model ``loss = ReduceSum(Y * Y)`` with ``Y = op(...)`` fed by a trainable parameter
(through an Add with a data input where the op's input should carry a symbolic batch). ``build_artifacts`` makes
the training model; its custom nodes verify against the project's specs (``oplower check``); it is lowered and run
in onnxruntime in float64, and every parameter's gradient is compared with central finite differences of the
forward model (onnx.reference, float64). Static and symbolic shapes, negative axes, the training ops
onnxruntime-training uses (GatherGrad, SliceGrad, ConcatTraining + SplitTraining) and the opset spellings (axes
as attributes before 13, as inputs after) are covered; the float32 form of a chain as well. The transformer and
recurrent fixtures' torch exports differentiate with the family's training ops onnxruntime-training used.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from _artifacts import gradients_exposed
from onnx import TensorProto, helper, numpy_helper

from lowering.passes import lower_model
from lowering.training.artifacts import LossType, OptimType, build_artifacts
from lowering.training.gradients import rule_for
from opdef.model_verify import verify_model
from runtime.session import run_model

MS = "com.microsoft"
F64, F32 = TensorProto.DOUBLE, TensorProto.FLOAT
NP = {F64: np.float64, F32: np.float32}
ACCUMULATOR = (MS, "InPlaceAccumulatorV2")
RNG = np.random.default_rng(7)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape)


def i64(values) -> np.ndarray:
    return np.asarray(values, np.int64)


class Case:
    """A forward model around ``nodes`` (which compute ``y``), its artifacts and feeds; ``model64`` is the same
    model in float64 (the finite differences' truth)."""

    def __init__(self, nodes, *, data=None, params=None, consts=None, opset=17, elem=F64, y="y", truth="reference"):
        self.nodes, self.y, self.truth = list(nodes), y, truth
        self.data = dict(data or {})          # name -> (array, dims)
        self.params = {k: np.asarray(v, NP[elem]) for k, v in (params or {}).items()}
        self.consts = dict(consts or {})
        self.elem, self.opset = elem, opset
        self.model = self._build(elem)
        self.model64 = self._build(F64)

    def _build(self, elem: int) -> onnx.ModelProto:
        def typed(a):
            a = np.asarray(a)
            return a.astype(NP[elem]) if a.dtype.kind == "f" else a

        loss_nodes = [helper.make_node("Mul", [self.y, self.y], ["sq"]),
                      helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
        inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(typed(array).dtype), list(dims))
                  for name, (array, dims) in self.data.items()]
        inits = [numpy_helper.from_array(typed(v), k) for k, v in {**self.params, **self.consts}.items()]
        graph = helper.make_graph(self.nodes + loss_nodes, "g", inputs,
                                  [helper.make_tensor_value_info("loss", elem, [])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        return model

    @property
    def feeds(self) -> dict[str, np.ndarray]:
        return {k: v[0] for k, v in self.data.items()}

    def loss(self, params: dict[str, np.ndarray]) -> float:
        """The float64 loss by onnx.reference (onnxruntime where onnx.reference lacks a case: negative pads,
        GatherElements indices shorter than the data on another axis)."""
        from onnx.reference import ReferenceEvaluator

        m = onnx.ModelProto()
        m.CopyFrom(self.model64)
        for t in m.graph.initializer:
            if t.name in params:
                t.CopyFrom(numpy_helper.from_array(np.asarray(params[t.name], np.float64), t.name))
        feeds = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in self.feeds.items()}
        if self.truth == "onnxruntime":
            return float(run_model(m, feeds)["loss"])
        return float(ReferenceEvaluator(m).run(["loss"], feeds)[0])

    def numeric(self) -> dict[str, np.ndarray]:
        """Central finite differences of the float64 loss."""
        grads = {}
        base = {k: v.astype(np.float64) for k, v in self.params.items()}
        for name, value in base.items():
            g = np.zeros_like(value)
            for idx in np.ndindex(value.shape):
                eps = 1e-6 * max(1.0, abs(value[idx]))
                plus, minus = {**base, name: value.copy()}, {**base, name: value.copy()}
                plus[name][idx] += eps
                minus[name][idx] -= eps
                g[idx] = (self.loss(plus) - self.loss(minus)) / (2 * eps)
            grads[name] = g
        return grads

    def artifacts(self):
        return build_artifacts(self.model, requires_grad=list(self.params), loss=None)

    def gradients(self) -> tuple[dict[str, np.ndarray], onnx.ModelProto]:
        """The training model's gradients (lowered, onnxruntime) and the training model."""
        training = self.artifacts().training
        verify_model(training)  # oplower check: every custom node against the specs
        model, exposed = gradients_exposed(training)
        lowered = lower_model(model)
        left = {(n.domain, n.op_type) for n in lowered.graph.node if n.domain not in ("", "ai.onnx")}
        assert not left, f"not lowered: {left}"
        out = run_model(lowered, {**self.feeds, **self.params})
        return {p: out[g] for p, g in exposed.items()}, training




def custom_ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node if n.domain == MS and n.op_type != "InPlaceAccumulatorV2"}


def check(case: Case, *, training_ops: set[str] = frozenset(), tol: float = 1e-7) -> onnx.ModelProto:
    got, training = case.gradients()
    want = case.numeric()
    for name, expected in want.items():
        scale = max(1.0, float(np.abs(expected).max()))
        assert got[name].shape == expected.shape, name
        err = float(np.abs(got[name] - expected).max()) / scale
        assert err < tol, f"{name}: max error {err:.3g} (relative to {scale:.3g})"
    assert custom_ops(training) == set(training_ops)
    return training


def through(x_dims, param_shape, op_nodes, *, extra_data=None, consts=None, opset=17, elem=F64, name="h",
            truth="reference"):
    """``h = Add(x, w)`` (x data with ``x_dims``, possibly symbolic; w a parameter broadcasting to it), then
    ``op_nodes`` reading ``h``."""
    concrete = [d if isinstance(d, int) else 2 for d in x_dims]
    data = {"x": (rand(*concrete).astype(NP[elem]), x_dims), **(extra_data or {})}
    nodes = [helper.make_node("Add", ["x", "w"], [name]), *op_nodes]
    return Case(nodes, data=data, params={"w": rand(*param_shape)}, consts=consts, opset=opset, elem=elem,
                truth=truth)


STATIC_AND_SYMBOLIC = pytest.mark.parametrize("batch", [2, "N"], ids=["static", "symbolic"])


# -- reshaping -------------------------------------------------------------------------------------

@STATIC_AND_SYMBOLIC
def test_reshape(batch):
    case = through([batch, 3, 4], (3, 4), [helper.make_node("Reshape", ["h", "s"], ["y"])],
                   consts={"s": i64([0, -1, 2])})
    training = check(case)
    # dY reshaped to the input's shape: a constant where static, a Shape node at run time where the batch is symbolic
    (node,) = [n for n in training.graph.node if n.op_type == "Reshape" and n.name.startswith("y_Grad")]
    producers = {o: n.op_type for n in training.graph.node for o in n.output}
    constants = {t.name for t in training.graph.initializer}
    assert (producers.get(node.input[1]) == "Shape") == (batch == "N")
    assert (node.input[1] in constants) == (batch == 2)


@STATIC_AND_SYMBOLIC
def test_flatten(batch):
    check(through([batch, 3, 4], (3, 4), [helper.make_node("Flatten", ["h"], ["y"], axis=2)]))


@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("opset", [11, 17])
def test_squeeze_and_unsqueeze(batch, opset):
    if opset >= 13:
        nodes = [helper.make_node("Unsqueeze", ["h", "ax"], ["u"]), helper.make_node("Squeeze", ["u", "ax2"], ["y"])]
        consts = {"ax": i64([-1, 1]), "ax2": i64([1])}
    else:
        nodes = [helper.make_node("Unsqueeze", ["h"], ["u"], axes=[-1, 1]),
                 helper.make_node("Squeeze", ["u"], ["y"], axes=[1])]
        consts = {}
    check(through([batch, 3, 4], (3, 4), nodes, consts=consts, opset=opset))


@STATIC_AND_SYMBOLIC
def test_squeeze_without_axes(batch):
    case = through([batch, 1, 4], (1, 4), [helper.make_node("Squeeze", ["h"], ["y"])])
    check(case)


@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("perm", [[2, 0, 1], [1, 2, 0], None])
def test_transpose(batch, perm):
    node = helper.make_node("Transpose", ["h"], ["y"], **({} if perm is None else {"perm": perm}))
    check(through([batch, 3, 4], (3, 4), [node]))


# -- joining and cutting ---------------------------------------------------------------------------

@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("axis", [1, -1, 0])
def test_concat_becomes_concat_training(batch, axis):
    """Concat -> ConcatTraining forward, SplitTraining backward; the parameters' pieces of different lengths."""
    shapes = {0: [(1, 3, 4), (2, 3, 4)], 1: [(1, 1, 4), (1, 3, 4)], -1: [(1, 3, 1), (1, 3, 4)]}[axis]
    params = {"a": rand(*shapes[0]), "b": rand(*shapes[1])}
    x_dims = [batch, 3, 4] if axis != 0 else [2, 3, 4]
    concrete = [d if isinstance(d, int) else 2 for d in x_dims]
    nodes = [helper.make_node("Add", ["x", "w"], ["h"]),
             helper.make_node("Concat", ["a", "h", "b"], ["y"], axis=axis)]
    if axis != 0:  # a and b broadcast over the batch through an Expand to h's batch
        nodes = [helper.make_node("Add", ["x", "w"], ["h"]),
                 helper.make_node("Shape", ["h"], ["hs"]),
                 helper.make_node("Slice", ["hs", "zero", "one"], ["n"]),
                 helper.make_node("Concat", ["n", "a_rest"], ["a_shape"], axis=0),
                 helper.make_node("Concat", ["n", "b_rest"], ["b_shape"], axis=0),
                 helper.make_node("Expand", ["a", "a_shape"], ["ae"]),
                 helper.make_node("Expand", ["b", "b_shape"], ["be"]),
                 helper.make_node("Concat", ["ae", "h", "be"], ["y"], axis=axis)]
    case = Case(nodes, data={"x": (rand(*concrete), x_dims)}, params={"w": rand(3, 4), **params},
                consts={"zero": i64([0]), "one": i64([1]), "a_rest": i64(shapes[0][1:]), "b_rest": i64(shapes[1][1:])})
    training = check(case, training_ops={"ConcatTraining", "SplitTraining"})
    # the shape-arithmetic Concats (int64) stay plain Concats
    assert sum(n.op_type == "ConcatTraining" for n in training.graph.node) == 1
    # the eval model keeps the standard Concat
    eval_ops = [n.op_type for n in case.artifacts().eval.graph.node]
    assert "ConcatTraining" not in eval_ops and eval_ops.count("Concat") == (1 if axis == 0 else 3)


def test_concat_rule_without_rewrite():
    """The plain Concat rule (a Concat differentiated without its forward rewrite): Split by the lengths."""
    assert rule_for("", "Concat").prepare is not None
    from lowering.training.autodiff import differentiate
    from lowering.training.gradients.context import ForwardContext

    case = Case([helper.make_node("Concat", ["a", "b"], ["y"], axis=-1)],
                params={"a": rand(2, 3), "b": rand(2, 2)})
    types = {n: helper.make_tensor_type_proto(F64, s) for n, s in
             (("a", [2, 3]), ("b", [2, 2]), ("y", [2, 5]), ("sq", [2, 5]), ("loss", []))}
    f = ForwardContext({"a", "b", "y", "sq", "loss"}, 17, types, {})
    graph = differentiate(list(case.model.graph.node), "loss", ["a", "b"], f)
    assert [n.op_type for n in graph.backward if n.op_type == "Split"] == ["Split"]
    model = helper.make_model(helper.make_graph(
        list(case.model.graph.node) + graph.backward, "g", [],
        [helper.make_empty_tensor_value_info(graph.gradients[p]) for p in ("a", "b")],
        [numpy_helper.from_array(v, k) for k, v in case.params.items()] + f.initializers),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    got = run_model(model, {})
    want = case.numeric()
    for p in ("a", "b"):
        np.testing.assert_allclose(got[graph.gradients[p]], want[p], atol=1e-7)


@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("opset", [12, 13, 18])
@pytest.mark.parametrize("unused", [False, True], ids=["all_used", "one_unused"])
def test_split(batch, opset, unused):
    """Concat of the outputs' gradients; zeros where an output does not reach the loss."""
    if opset >= 18:
        split = helper.make_node("Split", ["h"], ["p0", "p1", "p2"], axis=-1, num_outputs=3)
        consts = {}
        sizes = (2, 2, 2)
    elif opset >= 13:
        split = helper.make_node("Split", ["h", "sp"], ["p0", "p1", "p2"], axis=-1)
        consts, sizes = {"sp": i64([1, 3, 2])}, (1, 3, 2)
    else:
        split = helper.make_node("Split", ["h"], ["p0", "p1", "p2"], axis=2, split=[1, 3, 2])
        consts, sizes = {}, (1, 3, 2)
    del sizes
    tail = [helper.make_node("Concat", ["p2", "p0"] if unused else ["p2", "p0", "p1"], ["y"], axis=-1)]
    check(through([batch, 3, 6], (3, 6), [split, *tail], consts=consts, opset=opset),
          training_ops={"ConcatTraining", "SplitTraining"})


@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("spec", [
    ([1], [3], [1], None),              # h[:, 1:3]
    ([-3], [100], [-1], None),          # h[..., -3:]
    ([3, 0], [0, -1], [-1, 1], [-1, 2]),  # negative step on the last axis, stride 2 on axis 1
    ([0], [2], None, None),             # axes absent: the first axis
])
def test_slice_grad(batch, spec):
    starts, ends, axes, steps = spec
    names = ["h", "st", "en"]
    consts = {"st": i64(starts), "en": i64(ends)}
    if axes is not None or steps is not None:
        names.append("ax" if axes is not None else "")
        if axes is not None:
            consts["ax"] = i64(axes)
    if steps is not None:
        names.append("sp")
        consts["sp"] = i64(steps)
    x_dims = [batch, 3, 4] if axes is not None else [3, batch, 4]
    w = (3, 4) if axes is not None else (3, 1, 4)
    check(through(x_dims, w, [helper.make_node("Slice", names, ["y"])], consts=consts),
          training_ops={"SliceGrad"})


def test_slice_grad_opset9_attributes():
    """Slice-1's attributes become SliceGrad's constant inputs (the lowering needs opset 12: checked as a graph)."""
    case = through([2, 3, 4], (3, 4), [helper.make_node("Slice", ["h"], ["y"], starts=[1, -2], ends=[3, 100],
                                                          axes=[1, -1])], opset=9)
    training = case.artifacts().training
    verify_model(training)
    (node,) = [n for n in training.graph.node if n.op_type == "SliceGrad"]
    values = {t.name: numpy_helper.to_array(t) for t in training.graph.initializer}
    assert [values[n].tolist() for n in node.input[1:]] == [[2, 3, 4], [1, -2], [3, 100], [1, -1]]


@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("pads, dynamic", [([0, 1, 2, 0, 0, 1], False), ([0, 0, 1, 0, 2, 0], False),
                                           ([0, 1, -1, 0, 1, 1], False), ([0, 1, 2, 0, 0, 1], True)],
                         ids=["constant", "begin_only", "cropping", "runtime_pads"])
def test_pad(batch, pads, dynamic):
    consts = {"v": np.asarray(0.5)}
    extra = {}
    if dynamic:
        extra = {"pads": (i64(pads), [6])}
    else:
        consts["pads"] = i64(pads)
    check(through([batch, 3, 4], (3, 4), [helper.make_node("Pad", ["h", "pads", "v"], ["y"])],
                  consts=consts, extra_data=extra, truth="onnxruntime" if min(pads) < 0 else "reference"))


def test_pad_opset18_axes_and_opset10_attribute():
    check(through([2, 3, 4], (3, 4), [helper.make_node("Pad", ["h", "pads", "", "ax"], ["y"])], opset=18,
                  consts={"pads": i64([1, 2, 0, 1]), "ax": i64([-1, 1])}))
    check(through([2, 3, 4], (3, 4), [helper.make_node("Pad", ["h"], ["y"], pads=[0, 1, 0, 0, 2, 3])], opset=10))


def test_pad_reflect_over_a_symbolic_axis_is_refused():
    # reflect/edge/wrap are differentiated where the padded axes are static (tests/test_gradients_extra.py)
    case = through(["N", 3, 4], (3, 4), [helper.make_node("Pad", ["h", "pads"], ["y"], mode="reflect")],
                   consts={"pads": i64([1, 0, 0, 1, 0, 0])})
    with pytest.raises(Exception, match="static size"):
        case.artifacts()


# -- broadcasting and repetition ------------------------------------------------------------------

@STATIC_AND_SYMBOLIC
def test_expand(batch):
    """A [3, 1] parameter expanded to h's [N, 3, 4] (through Shape), and a [1, 4] one by a constant shape."""
    nodes = [helper.make_node("Add", ["x", "w"], ["h"]),
             helper.make_node("Shape", ["h"], ["hs"]),
             helper.make_node("Expand", ["c", "hs"], ["ce"]),
             helper.make_node("Expand", ["d", "ds"], ["de"]),
             helper.make_node("Mul", ["ce", "h"], ["t"]),
             helper.make_node("Add", ["t", "de"], ["y"])]
    case = Case(nodes, data={"x": (rand(2, 3, 4), [batch, 3, 4])},
                params={"w": rand(3, 4), "c": rand(3, 1), "d": rand(1, 4)}, consts={"ds": i64([3, 4])})
    check(case)


@STATIC_AND_SYMBOLIC
def test_tile(batch):
    check(through([batch, 3, 4], (3, 4), [helper.make_node("Tile", ["h", "r"], ["y"])],
                  consts={"r": i64([2, 1, 3])}))


def test_tile_runtime_repeats():
    check(through(["N", 3, 4], (3, 4), [helper.make_node("Tile", ["h", "r"], ["y"])],
                  extra_data={"r": (i64([1, 2, 2]), [3])}))


# -- indexing --------------------------------------------------------------------------------------

@STATIC_AND_SYMBOLIC
def test_gather_embedding_negative_and_repeated_indices(batch):
    """An embedding table read at [N, 3] indices (repeats, negatives): GatherGrad on Shape(table)."""
    ids = i64([[1, -1, 1], [0, 4, -5]])
    case = Case([helper.make_node("Gather", ["table", "ids"], ["y"])], data={"ids": (ids, [batch, 3])},
                params={"table": rand(5, 3)})
    check(case, training_ops={"GatherGrad"})


@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("axis, ids", [(1, i64(-1)), (-1, i64([3, 0, 3])), (1, i64([[2, -3]]))])
def test_gather_axes(batch, axis, ids):
    """``x[:, -1]`` (a scalar index), a negative axis, 2-D indices."""
    check(through([batch, 3, 4], (3, 4), [helper.make_node("Gather", ["h", "ids"], ["y"], axis=axis)],
                  consts={"ids": ids}), training_ops={"GatherGrad"})


@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("axis", [1, -1])
def test_gather_elements(batch, opset, axis):
    """Repeated and negative indices accumulate; below opset 16 the one-hot form."""
    ids = i64([[[0, 2, -1, 0], [1, 1, 1, -3]]] * 2) if axis == 1 else i64([[[3, -1, 3], [0, 0, 2], [1, 1, -4]]] * 2)
    # onnx.reference mishandles a negative GatherElements axis: onnxruntime computes that truth
    check(through([batch, 3, 4], (3, 4), [helper.make_node("GatherElements", ["h", "ids"], ["y"], axis=axis)],
                  consts={"ids": ids}, opset=opset, truth="onnxruntime" if axis < 0 else "reference"))


@pytest.mark.parametrize("opset", [13, 17])
def test_gather_elements_indices_shorter_on_another_axis(opset):
    """Indices [2, 2, 3] into [N, 3, 4] along the last axis: the rows they skip get zeros."""
    ids = i64([[[3, -1, 3], [0, 0, 2]]] * 2)
    check(through(["N", 3, 4], (3, 4), [helper.make_node("GatherElements", ["h", "ids"], ["y"], axis=-1)],
                  consts={"ids": ids}, opset=opset, truth="onnxruntime"))


@STATIC_AND_SYMBOLIC
def test_gather_nd(batch):
    ids = i64([[[2, 1], [0, 0], [2, 1]]] * 2)  # a repeated pair accumulates
    check(through([batch, 3, 4], (3, 4), [helper.make_node("GatherND", ["w", "ids"], ["y"])],
                  consts={"ids": ids}))


@STATIC_AND_SYMBOLIC
def test_top_k(batch):
    nodes = [helper.make_node("TopK", ["h", "k"], ["y", "idx"], axis=-1)]
    check(through([batch, 3, 4], (3, 4), nodes, consts={"k": i64([2])}))


# -- selection, prefix sums, triangles -------------------------------------------------------------

@STATIC_AND_SYMBOLIC
def test_where_branches_broadcast(batch):
    """Both branches parameters of smaller shapes (summed back); a constant branch gets nothing."""
    cond = RNG.random((2, 3, 4)) > 0.5
    nodes = [helper.make_node("Add", ["x", "w"], ["h"]),
             helper.make_node("Where", ["c", "h", "b"], ["t"]),
             helper.make_node("Where", ["c", "minus", "t"], ["y"])]
    case = Case(nodes, data={"x": (rand(2, 3, 4), [batch, 3, 4]), "c": (cond, [batch, 3, 4])},
                params={"w": rand(3, 4), "b": rand(3, 1)}, consts={"minus": np.asarray(-2.0)})
    check(case)


@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cum_sum(batch, exclusive, reverse):
    check(through([batch, 3, 4], (3, 4), [helper.make_node("CumSum", ["h", "ax"], ["y"], exclusive=exclusive,
                                                          reverse=reverse)], consts={"ax": i64(-1)}))


@pytest.mark.parametrize("upper, k", [(1, 1), (0, 0), (0, -1)])
def test_trilu(upper, k):
    check(through(["N", 4, 4], (4, 4), [helper.make_node("Trilu", ["h", "k"], ["y"], upper=upper)],
                  consts={"k": i64(k)}))


# -- reductions ------------------------------------------------------------------------------------

REDUCTIONS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL1", "ReduceL2",
              "ReduceLogSumExp"]


@STATIC_AND_SYMBOLIC
@pytest.mark.parametrize("op", REDUCTIONS)
@pytest.mark.parametrize("axes, keepdims", [([-1], 0), ([0, 2], 1), (None, 0)])
def test_reductions(batch, op, axes, keepdims):
    attrs = {"keepdims": keepdims}
    inputs = ["h"]
    consts = {}
    opset = 18
    if axes is not None:
        inputs.append("ax")
        consts["ax"] = i64(axes)
    check(through([batch, 3, 4], (3, 4), [helper.make_node(op, inputs, ["y"], **attrs)], consts=consts,
                  opset=opset))


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceL2", "ReduceMean"])
def test_reductions_axes_attribute(op):
    """Before opset 18 (ReduceSum: 13) the axes are an attribute."""
    check(through(["N", 3, 4], (3, 4), [helper.make_node(op, ["h"], ["y"], axes=[1, -1], keepdims=0)], opset=17))


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reductions_runtime_axes(op, keepdims):
    """Axes fed at run time (a graph input): Unsqueeze by the same axes, the mean's count from the sizes."""
    check(through(["N", 3, 4], (3, 4), [helper.make_node(op, ["h", "ax"], ["y"], keepdims=keepdims)], opset=18,
                  extra_data={"ax": (i64([-1, 0]), [2])}))


def test_reduce_max_ties_share_evenly():
    """Ties share dY evenly (torch's amax): a parameter of equal entries gets dY / 3 in each."""
    case = Case([helper.make_node("ReduceMax", ["w"], ["y"], axes=[1], keepdims=0)],
                params={"w": np.asarray([[1.0, 1.0, 1.0], [0.0, 2.0, 1.0]])}, opset=17)
    got, _ = case.gradients()
    np.testing.assert_allclose(got["w"], [[2 / 3, 2 / 3, 2 / 3], [0.0, 4.0, 0.0]], atol=1e-12)


def test_reduce_sum_noop_with_empty_axes():
    check(through([2, 3, 4], (3, 4), [helper.make_node("ReduceSum", ["h"], ["y"], noop_with_empty_axes=1)]))


def test_reduce_l2_zero_norm_gets_zero():
    case = Case([helper.make_node("ReduceL2", ["w"], ["y"], axes=[1], keepdims=1)],
                params={"w": np.asarray([[0.0, 0.0], [3.0, 4.0]])}, opset=17)
    got, _ = case.gradients()
    np.testing.assert_allclose(got["w"], [[0.0, 0.0], [6.0, 8.0]], atol=1e-12)  # d(y^2) = 2 y * x / y


# -- float32 and a chain of several shape ops -----------------------------------------------------

def test_float32_attention_like_chain():
    """Reshape to heads, Transpose, Slice, Gather, Unsqueeze, Concat, Expand in float32 with a symbolic batch:
    the gradient within float32 rounding of the float64 finite differences."""
    nodes = [helper.make_node("Add", ["x", "w"], ["h"]),                        # [N, 4, 6]
             helper.make_node("Reshape", ["h", "heads"], ["r"]),                # [N, 4, 2, 3]
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),    # [N, 2, 4, 3]
             helper.make_node("Slice", ["t", "s0", "s1", "s2"], ["s"]),         # [N, 2, 3, 3]
             helper.make_node("Gather", ["s", "first"], ["g"], axis=2),         # [N, 2, 3]
             helper.make_node("Unsqueeze", ["g", "two"], ["u"]),                # [N, 2, 1, 3]
             helper.make_node("Concat", ["u", "s"], ["c"], axis=2),             # [N, 2, 4, 3]
             helper.make_node("Shape", ["c"], ["cs"]),
             helper.make_node("Expand", ["v", "cs"], ["ve"]),
             helper.make_node("Mul", ["c", "ve"], ["y"])]
    case = Case(nodes, data={"x": (rand(2, 4, 6).astype(np.float32), ["N", 4, 6])},
                params={"w": rand(4, 6), "v": rand(1, 4, 1)}, elem=F32,
                consts={"heads": i64([0, 4, 2, 3]), "s0": i64([1]), "s1": i64([4]), "s2": i64([2]),
                        "first": i64(0), "two": i64([2])})
    check(case, training_ops={"SliceGrad", "GatherGrad", "ConcatTraining", "SplitTraining"}, tol=2e-5)


def test_every_rule_is_registered():
    for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split", "Slice", "Pad",
               "Expand", "Tile", "Gather", "GatherElements", "GatherND", "TopK", "Where", "CumSum", "Trilu",
               *REDUCTIONS):
        assert rule_for("", op) is not None, op
    assert rule_for(MS, "ConcatTraining") is not None


# -- the committed architectures ------------------------------------------------------------------

ARTIFACTS = Path(__file__).resolve().parent / "fixtures" / "ort_training" / "artifacts"
FAMILY_OPS = {"GatherGrad", "SliceGrad", "ConcatTraining", "SplitTraining"}
# onnxruntime-training's own graphs have the same ops, except that it fuses the recurrent models' weight Slices
# into a Split (GatherSliceToSplitFusion) where ours keep them (SliceGrad)
ARCHITECTURES = {"bert": {"GatherGrad"}, "bert_torch": {"GatherGrad"}, "gpt": {"GatherGrad", "SliceGrad"},
                 "vit": {"GatherGrad", "ConcatTraining", "SplitTraining"},
                 "lstm": {"SliceGrad", "ConcatTraining", "SplitTraining"},
                 "gru": {"SliceGrad", "ConcatTraining", "SplitTraining"},
                 "lstm2": {"SliceGrad", "ConcatTraining", "SplitTraining"}}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architectures_get_past_every_shape_op(name):
    """The torch exports (forward_model.onnx) of the transformer and recurrent fixtures differentiate (every
    shape op on the path has its rule) with this family's training ops, the ones onnxruntime-training used."""
    path = ARTIFACTS / name / "forward_model.onnx"
    meta = json.loads((ARTIFACTS / name / "meta.json").read_text())
    art = build_artifacts(onnx.load(str(path)), meta["trainable_params"], meta["frozen_params"],
                          LossType[meta["loss"]], OptimType[meta["optimizer"]])
    ours = custom_ops(art.training) & FAMILY_OPS
    theirs = custom_ops(onnx.load(str(ARTIFACTS / name / "training_model.onnx"))) & FAMILY_OPS
    assert ours == ARCHITECTURES[name]
    assert ours - theirs <= {"SliceGrad"} and theirs <= ours
