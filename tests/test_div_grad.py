"""DivGrad (com.microsoft): Div's gradient as onnxruntime-training writes it (specs/com.microsoft/DivGrad.rst).

- the parsed schema's facts and the binding;
- one failing test per spec constraint and for malformed nodes (wrong input/output count, mismatched or
  unsupported element types): a one-line VerificationError naming node and problem;
- the lowering against onnxruntime-training 1.19.2's recorded results (tools/ort_training/cases_div_grad.py),
  both targets, asserted BIT-IDENTICAL: the lowering computes dA = dY / B and dB = dY * (A / -(B * B)) with the
  ReduceSum over the same axes, which is the CPU function body's arithmetic op for op (-(B*B) divides to the same
  number as -A divided by B*B: IEEE rounding is sign-symmetric), every elementwise op is correctly rounded in
  both runtimes, and the sums (at most 32 terms here) run in the same order; measured equal in onnxruntime 1.32
  (Python 3.12) and 1.23 (Python 3.10), f32, f64 and f16 alike;
- the lowering over dtypes, opsets, symbolic batch, omitted outputs and random broadcast pairs (hypothesis)
  against the float64 reference (checked by onnx.checker full_check), and the reference against finite
  differences;
- the portable form in onnxruntime, OpenVINO, tract and onnx.reference.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _one_node import close, numeric_gradient, one_node_model, verify
from _one_node import verification_error as _error
from _recorded import FIXTURES, recorded_cases
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from test_portable import _run as _run_any

from lowering.passes import lower_model
from lowering.rules import PORTABLE_OPS
from opdef.errors import LoweringError
from opdef.parse import parse_spec
from opdef.registry import load_schemas
from runtime import reference_training as ref
from runtime.session import run_model

SPEC = Path(__file__).resolve().parent.parent / "specs" / "com.microsoft" / "DivGrad.rst"
MS = "com.microsoft"
F32, F16, BF16, F64, I32 = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE,
                            TensorProto.INT32)
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16, F64: np.float64}
TARGETS = ("onnxruntime", "portable")
RECORDED = recorded_cases("DivGrad")


def _node(outputs=("da", "db"), inputs=("dy", "a", "b")):
    return helper.make_node("DivGrad", list(inputs), list(outputs), domain=MS, name="dg")


def _data(a_shape, b_shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(a_shape)
    b = rng.uniform(0.5, 2.0, b_shape) * rng.choice([-1.0, 1.0], b_shape)
    dy = rng.standard_normal(np.broadcast_shapes(a_shape, b_shape))
    return tuple(np.asarray(x, dtype=dtype) for x in (dy, a, b))


# -- schema ----------------------------------------------------------------------------------------------------

def test_div_grad_schema():
    s = parse_spec(SPEC)
    assert [(a.name, a.optional) for a in s.inputs] == [("dY", False), ("A", False), ("B", False)]
    assert [(a.name, a.optional) for a in s.outputs] == [("dA", True), ("dB", True)]
    assert s.attributes == () and len({a.type_var for a in (*s.inputs, *s.outputs)}) == 1
    assert {dict(c)["T"] for c in s.type_combinations} == {"f32", "f64", "f16", "bf16"}
    assert [c.label for c in s.constraints] == ["C1", "C2"]
    entry = load_schemas().get(MS, "DivGrad")
    assert entry.binding.rule == "div_grad"


@pytest.mark.parametrize("shapes, want", [
    (((2, 3, 4), (2, 3, 4), (3, 1)), ((2, 3, 4), (3, 1))),
    ((("N", 3, 4), ("N", 3, 4), ()), (("N", 3, 4), ())),
    (((2, 3, 4), (1, 3, 1), (2, 3, 4)), ((1, 3, 1), (2, 3, 4))),
    ((("N", 4, 3, 3), ("N", 4, 3, 3), ("N", 1, 3, 3)), (("N", 4, 3, 3), ("N", 1, 3, 3))),
])
def test_div_grad_infers_the_input_shapes(shapes, want):
    inference = verify(_node(), {n: (F32, s) for n, s in zip(("dy", "a", "b"), shapes, strict=True)})
    assert [t.shape for t in inference.output_types] == list(want)
    assert all(t.elem_type == F32 for t in inference.output_types)


# -- malformed nodes: one-line errors ---------------------------------------------------------------------------

def test_error_div_grad_missing_input():
    message = _error(_node(inputs=("dy", "a")), {"dy": (F32, (2, 3)), "a": (F32, (2, 3))})
    assert "required input 'B' (position 2) is missing" in message


def test_error_div_grad_too_many_inputs():
    types = {n: (F32, (2, 3)) for n in ("dy", "a", "b", "c")}
    assert "has 4 inputs; the schema takes at most 3 (dY, A, B)" in _error(_node(inputs=("dy", "a", "b", "c")), types)


def test_error_div_grad_too_many_outputs():
    types = {n: (F32, (2, 3)) for n in ("dy", "a", "b")}
    assert "has 3 outputs; the schema takes at most 2" in _error(_node(outputs=("da", "db", "dc")), types)


def test_error_div_grad_types_differ():
    message = _error(_node(), {"dy": (F32, (2, 3)), "a": (F32, (2, 3)), "b": (F64, (2, 3))})
    assert "B has element type f64 but dY has f32; both are T" in message


def test_error_div_grad_unsupported_type():
    message = _error(_node(), {n: (I32, (2, 3)) for n in ("dy", "a", "b")})
    assert "dY has element type s32; allowed for T: f32, f64, f16, bf16" in message


def test_error_div_grad_c1_inputs_do_not_broadcast():
    message = _error(_node(), {"dy": (F32, (2, 3, 4)), "a": (F32, (2, 3, 4)), "b": (F32, (2, 1))})
    assert "A [2,3,4] and B [2,1] do not broadcast (axis -2: 3 against 2)" in message and "[C1]" in message


def test_error_div_grad_c1_dy_is_not_the_broadcast_shape():
    message = _error(_node(), {"dy": (F32, (2, 3, 5)), "a": (F32, (2, 3, 4)), "b": (F32, (3, 1))})
    assert "dY has shape [2,3,5]; expected [2,3,4]" in message and "[C1]" in message


# -- onnxruntime-training's own results ---------------------------------------------------------------------------

def test_recorded_cases_cover_the_forms():
    variants = {c["variant"]: c for c in RECORDED}
    assert {"same_shape", "a_broadcast", "b_per_channel", "both_broadcast", "scalar_b", "only_dA", "only_dB"} <= set(
        variants)
    assert variants["only_dA"]["outputs"] == ["dA", ""] and variants["only_dB"]["outputs"] == ["", "dB"]
    dtypes = {np.load(FIXTURES / c["arrays"])["in.dY"].dtype for c in RECORDED}
    assert dtypes == {np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", RECORDED, ids=[c["variant"] for c in RECORDED])
def test_lowered_equals_onnxruntime_training_bit_for_bit(case, target):
    model = onnx.load(str(FIXTURES / case["model"]))
    arrays = np.load(FIXTURES / case["arrays"])
    feeds = {k[3:]: arrays[k] for k in arrays.files if k.startswith("in.")}
    lowered = lower_model(model, target=target)
    onnx.checker.check_model(lowered, full_check=True)
    got = run_model(lowered, feeds)
    for name in (n for n in case["outputs"] if n):
        want = arrays[f"out.{name}"]
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert np.array_equal(got[name], want), (name, float(np.max(np.abs(got[name].astype(np.float64) - want))))


# -- the lowering against the float64 reference ------------------------------------------------------------------

SHAPES = [((2, 3, 4), (2, 3, 4)), ((1, 3, 1), (2, 3, 4)), ((2, 3, 4, 4), (1, 3, 1, 1)), ((2, 1, 4), (3, 1)),
          ((2, 3, 5), ()), ((), (2, 3)), ((4,), (3, 1))]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("elem, opset", [(F32, 12), (F32, 17), (F16, 17), (BF16, 17), (F64, 13)])
@pytest.mark.parametrize("a_shape, b_shape", SHAPES)
def test_div_grad_lowering(a_shape, b_shape, elem, opset, target):
    dy, a, b = _data(a_shape, b_shape, NP[elem])
    y_shape = list(dy.shape)
    model = one_node_model(_node(), [("dy", elem, y_shape), ("a", elem, list(a_shape)), ("b", elem, list(b_shape))],
                           [("da", elem, list(a_shape)), ("db", elem, list(b_shape))], opset)
    lowered = lower_model(model, target=target)
    onnx.checker.check_model(lowered, full_check=True)
    got = run_model(lowered, {"dy": dy, "a": a, "b": b})
    want_da, want_db = ref.div_grad(dy, a, b)
    close(got["da"], want_da, elem, "dA")
    close(got["db"], want_db, elem, "dB")


@pytest.mark.parametrize("outputs, divisions", [(("da", ""), 1), (("", "db"), 1), (("da", "db"), 2)])
def test_div_grad_absent_outputs_are_not_computed(outputs, divisions):
    dy, a, b = _data((2, 3, 4), (1, 3, 1), np.float32)
    model = one_node_model(_node(outputs), [("dy", F32, [2, 3, 4]), ("a", F32, [2, 3, 4]), ("b", F32, [1, 3, 1])],
                           [(n, F32, s) for n, s in zip(outputs, ([2, 3, 4], [1, 3, 1]), strict=True) if n])
    lowered = lower_model(model)
    ops = [n.op_type for n in lowered.graph.node]
    assert ops.count("Div") == divisions and ("Neg" in ops) == ("db" in outputs)
    got = run_model(lowered, {"dy": dy, "a": a, "b": b})
    for name, want in zip(("da", "db"), ref.div_grad(dy, a, b), strict=True):
        if name in outputs:
            close(got[name], want, F32, name)


@pytest.mark.parametrize("target", TARGETS)
def test_div_grad_symbolic_batch(target):
    """LayerNorm2d's (x - mean) / sqrt(var + eps) with a symbolic batch: the broadcast axes are still decidable."""
    model = one_node_model(_node(), [("dy", F32, ["N", 4, 3, 3]), ("a", F32, ["N", 4, 3, 3]),
                                     ("b", F32, ["N", 1, 3, 3])],
                           [("da", F32, ["N", 4, 3, 3]), ("db", F32, ["N", 1, 3, 3])])
    lowered = lower_model(model, target=target)
    for batch in (1, 5):
        dy, a, b = _data((batch, 4, 3, 3), (batch, 1, 3, 3), np.float32, seed=batch)
        got = run_model(lowered, {"dy": dy, "a": a, "b": b})
        want_da, want_db = ref.div_grad(dy, a, b)
        close(got["da"], want_da, F32, "dA")
        close(got["db"], want_db, F32, "dB")


@pytest.mark.parametrize("target", TARGETS)
def test_div_grad_symbolic_shape_of_a_lower_rank_input(target):
    """A of shape [C] under dY [2, C]: summed over axis 0, reshaped to A's run-time shape (a Shape node)."""
    model = one_node_model(_node(), [("dy", F32, [2, "C"]), ("a", F32, ["C"]), ("b", F32, [2, "C"])],
                           [("da", F32, ["C"]), ("db", F32, [2, "C"])])
    lowered = lower_model(model, target=target)
    assert "Shape" in {n.op_type for n in lowered.graph.node}
    dy, a, b = _data((5,), (2, 5), np.float32, seed=4)
    got = run_model(lowered, {"dy": dy, "a": a, "b": b})
    want_da, want_db = ref.div_grad(dy, a, b)
    close(got["da"], want_da, F32, "dA")
    close(got["db"], want_db, F32, "dB")


def test_div_grad_undecidable_broadcast_is_a_lowering_error():
    """B's axis 1 is symbolic against a 4: it may be 1 (broadcast, summed) or 4 (not): refused in one line."""
    model = one_node_model(_node(), [("dy", F32, [2, 4]), ("a", F32, [2, 4]), ("b", F32, [2, "C"])],
                           [("da", F32, [2, 4]), ("db", F32, [2, "C"])])
    with pytest.raises(LoweringError) as info:
        lower_model(model)
    message = str(info.value)
    assert "\n" not in message and "'dg'" in message
    assert "cannot tell whether B's axis 1 (size C) is broadcast" in message


def test_div_grad_reference_matches_finite_differences():
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((2, 1, 4)), rng.uniform(0.5, 2.0, (3, 1))
    dy = rng.standard_normal((2, 3, 4))
    da, db = ref.div_grad(dy, a, b)
    for v, numeric in numeric_gradient(lambda z: np.sum(dy * (z / b)), a):
        assert abs(np.sum(da * v) - numeric) <= 1e-7 * max(1.0, abs(numeric))
    for v, numeric in numeric_gradient(lambda z: np.sum(dy * (a / z)), b):
        assert abs(np.sum(db * v) - numeric) <= 1e-7 * max(1.0, abs(numeric))


@st.composite
def _broadcast_pair(draw):
    """Two shapes that broadcast together: a common shape, each operand dropping leading axes or keeping 1s."""
    full = draw(st.lists(st.integers(1, 3), min_size=0, max_size=4))
    shapes = []
    for _ in range(2):
        lead = draw(st.integers(0, len(full)))
        shapes.append(tuple(d if draw(st.booleans()) else 1 for d in full[lead:]))
    return tuple(shapes)


@settings(max_examples=30, deadline=None)
@given(pair=_broadcast_pair(), target=st.sampled_from(TARGETS), outputs=st.sampled_from(
    [("da", "db"), ("da", ""), ("", "db")]))
def test_div_grad_lowering_over_random_broadcasts(pair, target, outputs):
    a_shape, b_shape = pair
    dy, a, b = _data(a_shape, b_shape, np.float32, seed=len(a_shape) * 7 + len(b_shape))
    model = one_node_model(_node(outputs), [("dy", F32, list(dy.shape)), ("a", F32, list(a_shape)),
                                            ("b", F32, list(b_shape))],
                           [(n, F32, list(s)) for n, s in zip(outputs, pair, strict=True) if n])
    # a plain session: runtime.session's IOBinding returns a 0-d output with shape (1,)
    session = ort.InferenceSession(lower_model(model, target=target).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(names, {"dy": dy, "a": a, "b": b}), strict=True))
    for name, want in zip(("da", "db"), ref.div_grad(dy, a, b), strict=True):
        if name in outputs:
            close(got[name], want, F32, name)


# -- the one form in every runtime ---------------------------------------------------------------------------------

RUNTIMES = ("onnxruntime", "openvino", "tract", "reference")


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("elem", [F32, F16, BF16])
@pytest.mark.parametrize("a_shape, b_shape", [((2, 3, 4, 4), (1, 3, 1, 1)), ((4,), (3, 1)), ((2, 3, 5), (1,))])
def test_div_grad_portable_form_in_every_runtime(a_shape, b_shape, elem, runtime, tmp_path):
    """The portable lowering (only lowering.rules.PORTABLE_OPS) runs in onnxruntime, OpenVINO, tract and
    onnx.reference; tract has no bf16 (an asserted refusal, as tests/test_portable.py). B of shape [1] rather than []:
    the OpenVINO harness feeds a 0-d input as shape [1]."""
    dy, a, b = _data(a_shape, b_shape, NP[elem], seed=3)
    model = one_node_model(_node(), [("dy", elem, list(dy.shape)), ("a", elem, list(a_shape)),
                                     ("b", elem, list(b_shape))],
                           [("da", elem, list(a_shape)), ("db", elem, list(b_shape))])
    lowered = lower_model(model, target="portable")
    assert {n.op_type for n in lowered.graph.node} <= PORTABLE_OPS
    feeds = {"dy": dy, "a": a, "b": b}
    if runtime == "tract" and elem == BF16:
        with pytest.raises(Exception, match="Bfloat16"):
            _run_any(runtime, lowered, feeds, tmp_path)
        return
    got = _run_any(runtime, lowered, feeds, tmp_path)
    for name, want in zip(("da", "db"), ref.div_grad(dy, a, b), strict=True):
        close(np.asarray(got[name]).reshape(want.shape), want, elem, f"{runtime} {name}")
