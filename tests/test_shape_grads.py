"""The shape and matmul ops of onnxruntime-training's graphs (com.microsoft): FusedMatMul, GatherGrad, SliceGrad,
ConcatTraining, SplitTraining.

Per op: the parsed schema's facts; one failing test per spec constraint (a one-line VerificationError naming
node and problem, labelled with the spec's C-number); the inferred output shapes; the lowering for both
targets against the float64 reference of runtime.reference_shape (onnx.checker full_check, onnxruntime, opsets
12 and 17, every dtype the op takes, optional arguments present and omitted); the portable forms in OpenVINO,
tract and onnx.reference too; the gradients' references against finite differences of the forward ops; the
model evaluator (reference_eval); and onnxruntime-training 1.19.2's recorded one-node cases
(tools/ort_training/cases_shape.py) lowered for both targets.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from _one_node import close, one_node_model, verify
from _one_node import verification_error as _error
from _recorded import recorded_cases
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from test_portable_training import _refusal
from test_portable_training import _run as run_in
from test_training_grads_recorded import assert_matches_recorded, load_case

from lowering.cli import main
from lowering.passes import lower_model
from lowering.rules import PORTABLE_OPS, TARGETS, rule_targets
from opdef import load_schemas
from opdef.errors import LoweringError, VerificationError
from opdef.node import TensorType
from opdef.onnx_defs import register_onnx_schemas
from opdef.parse import parse_spec
from runtime import reference_shape as ref
from runtime.reference_eval import evaluate
from runtime.session import run_model

SPECS = Path(__file__).resolve().parent.parent / "specs" / "com.microsoft"
MS = "com.microsoft"
F32, F16, BF16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE
I32, I64, BOOL = TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16, F64: np.float64, I32: np.int32, I64: np.int64,
      BOOL: np.bool_}
OPS = ("FusedMatMul", "GatherGrad", "SliceGrad", "ConcatTraining", "SplitTraining")
RULES = ("fused_matmul", "gather_grad", "slice_grad", "concat_training", "split_training")
vi = helper.make_tensor_value_info
RNG = np.random.default_rng(19)


def rand(shape, elem=F32):
    return RNG.standard_normal(shape).astype(NP[elem])


# -- schemas ---------------------------------------------------------------------------------------------------

def test_fused_matmul_schema():
    s = parse_spec(SPECS / "FusedMatMul.rst")
    assert [(a.name, a.optional) for a in s.inputs] == [("A", False), ("B", False)]
    assert [a.name for a in s.outputs] == ["Y"]
    attrs = {a.name: a for a in s.attributes}
    assert (attrs["alpha"].type, attrs["alpha"].default, attrs["alpha"].required) == ("f32", 1.0, False)
    for flag in ("transA", "transB", "transBatchA", "transBatchB"):
        assert (attrs[flag].type, attrs[flag].default, attrs[flag].allowed_values) == ("s64", 0, (0, 1))
    assert {dict(c)["T"] for c in s.type_combinations} == {"f32", "f16", "f64"}
    assert [c.label for c in s.constraints] == ["C1", "C2", "C3"]


def test_gather_grad_schema():
    s = parse_spec(SPECS / "GatherGrad.rst")
    assert [(a.name, a.optional) for a in s.inputs] == [("shape", False), ("indices", False), ("dY", False)]
    (attr,) = s.attributes
    assert (attr.name, attr.type, attr.required, attr.default) == ("axis", "s64", False, 0)
    t = {a.name: a.type_var for a in (*s.inputs, *s.outputs)}
    assert t["dY"] == t["dX"] and len({t["shape"], t["indices"], t["dY"]}) == 3
    assert {dict(c)[t["shape"]] for c in s.type_combinations} == {"s64"}
    assert {dict(c)[t["indices"]] for c in s.type_combinations} == {"s32", "s64"}
    assert {dict(c)[t["dY"]] for c in s.type_combinations} == {"f32", "f16", "bf16", "f64"}


def test_slice_grad_schema():
    s = parse_spec(SPECS / "SliceGrad.rst")
    assert [(a.name, a.optional) for a in s.inputs] == [("dY", False), ("shape", False), ("starts", False),
                                                        ("ends", False), ("axes", True), ("steps", True)]
    assert s.attributes == ()
    t = {a.name: a.type_var for a in (*s.inputs, *s.outputs)}
    assert t["starts"] == t["ends"] == t["axes"] == t["steps"] != t["shape"]
    assert {dict(c)[t["starts"]] for c in s.type_combinations} == {"s32", "s64"}


def test_concat_and_split_training_schemas_are_variadic():
    s = parse_spec(SPECS / "ConcatTraining.rst")
    assert [(a.name, a.optional, a.variadic) for a in s.inputs] == [("inputs", False, True)]
    assert [(a.name, a.optional) for a in s.outputs] == [("concat_result", False), ("per_input_length", True)]
    (attr,) = s.attributes
    assert (attr.name, attr.type, attr.required) == ("axis", "s64", True)
    t = {a.name: a.type_var for a in (*s.inputs, *s.outputs)}
    assert {dict(c)[t["per_input_length"]] for c in s.type_combinations} == {"s64"}
    assert {"f32", "s64", "boolean"} <= {dict(c)[t["inputs"]] for c in s.type_combinations}
    s = parse_spec(SPECS / "SplitTraining.rst")
    assert [(a.name, a.variadic) for a in s.inputs] == [("input", False), ("split", False)]
    assert [(a.name, a.optional, a.variadic) for a in s.outputs] == [("outputs", False, True)]
    assert [(a.name, a.default, a.required) for a in s.attributes] == [("axis", 0, False)]


def test_every_rule_claims_both_targets():
    assert all(rule_targets(rule) == TARGETS for rule in RULES)


# -- constraints ---------------------------------------------------------------------------------------------

def _fmm(**attrs):
    return helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain=MS, name="fmm", **attrs)


def test_error_fused_matmul_c1_scalar_operand():
    message = _error(_fmm(), {"a": (F32, ()), "b": (F32, (3, 2))})
    assert "A is a scalar" in message and "[C1]" in message


@pytest.mark.parametrize("a, b", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (1, 2, 4, 5))])
def test_error_fused_matmul_c2_trans_batch_needs_one_rank_of_3(a, b):
    message = _error(_fmm(transBatchB=1), {"a": (F32, a), "b": (F32, b)})
    assert "need A and B of one rank >= 3" in message and "[C2]" in message


def test_error_fused_matmul_c3_contracted_sizes():
    message = _error(_fmm(transA=1), {"a": (F32, (2, 3, 4)), "b": (F32, (4, 5))})
    assert "contracted sizes differ: 3" in message and "[C3]" in message


def test_error_fused_matmul_c3_batch_broadcast():
    message = _error(_fmm(), {"a": (F32, (2, 3, 4)), "b": (F32, (3, 4, 5))})
    assert "do not broadcast" in message and "[C3]" in message


def test_error_fused_matmul_types_and_flags():
    assert "both are T" in _error(_fmm(), {"a": (F32, (3, 4)), "b": (F16, (4, 5))})
    assert "allowed: 0, 1" in _error(_fmm(transA=2), {"a": (F32, (3, 4)), "b": (F32, (3, 5))})
    assert "allowed" in _error(_fmm(), {"a": (I64, (3, 4)), "b": (I64, (4, 5))})


@pytest.mark.parametrize("flags", list(itertools.product((0, 1), repeat=4)))
def test_fused_matmul_infers_every_flag_combination(flags):
    trans_a, trans_b, batch_a, batch_b = flags
    a, b = rand((2, 3, 4, 5)), rand((3, 2, 6, 5))
    attrs = dict(transA=trans_a, transB=trans_b, transBatchA=batch_a, transBatchB=batch_b)
    try:
        want = ref.fused_matmul(a, b, trans_a=trans_a, trans_b=trans_b, trans_batch_a=batch_a,
                                trans_batch_b=batch_b).shape
    except ValueError:  # numpy refuses what the schema must refuse too
        want = None
    if want is None:
        with pytest.raises(VerificationError):
            verify(_fmm(**attrs), {"a": (F32, a.shape), "b": (F32, b.shape)})
    else:
        assert verify(_fmm(**attrs), {"a": (F32, a.shape), "b": (F32, b.shape)}).output_types[0].shape == want


def test_fused_matmul_infers_vectors_and_symbols():
    assert verify(_fmm(transA=1), {"a": (F32, (4,)), "b": (F32, (4, 3))}).output_types[0].shape == (3,)
    assert verify(_fmm(), {"a": (F32, ("N", 1, 3, 4)), "b": (F32, (4, 5))}).output_types[0].shape == ("N", 1, 3, 5)
    assert verify(_fmm(), {"a": (F32, (2, 3, 4)), "b": (F32, (4,))}).output_types[0].shape == (2, 3)


def _gg(axis=0, name="gg"):
    return helper.make_node("GatherGrad", ["shape", "idx", "dy"], ["dx"], domain=MS, name=name, axis=axis)


def test_error_gather_grad_c1_shape_and_axis():
    message = _error(_gg(), {"shape": (I64, (2, 1)), "idx": (I64, (3,)), "dy": (F32, (3, 4))})
    assert "expected a 1-D tensor" in message and "[C1]" in message
    message = _error(_gg(axis=2), {"shape": (I64, (2,)), "idx": (I64, (3,)), "dy": (F32, (3, 4))})
    assert "axis is 2; expected a value in [-2, 1]" in message and "[C1]" in message


def test_error_gather_grad_c2_dy_shape():
    message = _error(_gg(), {"shape": (I64, (2,)), "idx": (I64, (2, 3)), "dy": (F32, (6, 4))})
    assert "dY has rank 2 [6,4]; expected 3" in message and "[C2]" in message
    message = _error(_gg(axis=1), {"shape": (I64, (3,)), "idx": (I64, (5,)), "dy": (F32, (2, 4, 7))})
    assert "axis 1 is 4, but indices [5] has 5 there" in message and "[C2]" in message


def test_error_gather_grad_types():
    assert "allowed" in _error(_gg(), {"shape": (I32, (2,)), "idx": (I64, (3,)), "dy": (F32, (3, 4))})
    assert "allowed" in _error(_gg(), {"shape": (I64, (2,)), "idx": (F32, (3,)), "dy": (F32, (3, 4))})


def test_gather_grad_infers_what_dy_decides():
    inference = verify(_gg(axis=1), {"shape": (I64, (3,)), "idx": (I64, ()), "dy": (F32, ("B", 8))})
    assert inference.output_types[0] == TensorType(F32, ("B", None, 8))
    inference = verify(_gg(), {"shape": (I64, (2,)), "idx": (I32, (2, 6)), "dy": (F16, (2, 6, 4))})
    assert inference.output_types[0] == TensorType(F16, (None, 4))


def _sg(inputs=("dy", "shape", "starts", "ends", "axes", "steps"), name="sg"):
    return helper.make_node("SliceGrad", list(inputs), ["dx"], domain=MS, name=name)


def _sg_types(count=1, rank=3, **changes):
    types = {"dy": (F32, (1, 5, 4)[:rank] if rank <= 3 else (1,) * rank), "shape": (I64, (rank,)),
             "starts": (I64, (count,)), "ends": (I64, (count,)), "axes": (I64, (count,)), "steps": (I64, (count,))}
    types.update(changes)
    return types


def test_error_slice_grad_c1_shape_is_a_vector():
    message = _error(_sg(), _sg_types(shape=(I64, (2, 1))))
    assert "shape has shape [2,1]; expected a 1-D tensor" in message and "[C1]" in message


def test_slice_grad_takes_a_flattened_dy():
    """onnxruntime's kernel copies dY's elements in order into the slice: dY's rank need not be dX's."""
    inference = verify(_sg(), _sg_types(dy=(F32, (20,))))
    assert inference.output_types[0] == TensorType(F32, (None, None, None))
    inference = verify(_sg(["dy", "shape", "starts", "ends"]), _sg_types(count=2, dy=(F32, (5, 4))))
    assert inference.output_types[0] == TensorType(F32, (None, None, None))


def test_error_slice_grad_c2_entries():
    message = _error(_sg(), _sg_types(steps=(I64, (2,))))
    assert "one entry per sliced axis" in message and "[C2]" in message
    message = _error(_sg(), _sg_types(count=4))
    assert "4 sliced axes for rank 3" in message and "[C2]" in message
    assert "[C2]" in _error(_sg(), _sg_types(starts=(I64, (1, 1))))


def test_error_slice_grad_types():
    assert "allowed" in _error(_sg(), _sg_types(shape=(I32, (3,))))
    assert "both are" in _error(_sg(), _sg_types(ends=(I32, (1,))))


def test_slice_grad_infers_rank_and_whole_axes():
    inference = verify(_sg(["dy", "shape", "starts", "ends"]), _sg_types(count=2))
    assert inference.output_types[0] == TensorType(F32, (None, None, 4))
    assert verify(_sg(), _sg_types()).output_types[0] == TensorType(F32, (None, None, None))


def _ct(count=2, outputs=("y", "lengths"), name="ct", **attrs):
    return helper.make_node("ConcatTraining", [f"x{i}" for i in range(count)], list(outputs), domain=MS, name=name,
                            **attrs)


def test_error_concat_training_c2_shapes_and_axis():
    message = _error(_ct(axis=1), {"x0": (F32, (2, 3)), "x1": (F32, (2, 3, 1))})
    assert "inputs 1 has rank 3" in message and "[C2]" in message
    message = _error(_ct(axis=1), {"x0": (F32, (2, 3)), "x1": (F32, (4, 1))})
    assert "axis 0 must be 2" in message and "[C2]" in message
    message = _error(_ct(axis=-3), {"x0": (F32, (2, 3)), "x1": (F32, (2, 1))})
    assert "axis is -3" in message and "[C2]" in message


def test_error_concat_training_axis_required_and_types_agree():
    assert "required attribute 'axis'" in _error(_ct(), {"x0": (F32, (2, 3)), "x1": (F32, (2, 1))})
    assert "both are" in _error(_ct(axis=0), {"x0": (F32, (2, 3)), "x1": (F16, (2, 3))})


def test_concat_training_infers_sum_and_lengths():
    inference = verify(_ct(3, axis=-1), {"x0": (F32, ("B", 3)), "x1": (F32, ("B", 1)), "x2": (F32, (2, 2))})
    assert inference.output_types == (TensorType(F32, (2, 6)), TensorType(I64, (3,)))
    inference = verify(_ct(2, ("y",), axis=0), {"x0": (BOOL, ("N", 3)), "x1": (BOOL, (1, 3))})
    assert inference.output_types[0] == TensorType(BOOL, (None, 3)) and inference.outputs == ("y", None)


def _st(count=2, name="st", **attrs):
    return helper.make_node("SplitTraining", ["x", "split"], [f"y{i}" for i in range(count)], domain=MS, name=name,
                            **attrs)


def test_error_split_training_c2_axis():
    message = _error(_st(axis=2), {"x": (F32, (2, 6)), "split": (I64, (2,))})
    assert "axis is 2" in message and "[C2]" in message


def test_error_split_training_c3_split_entries():
    message = _error(_st(3), {"x": (F32, (2, 6)), "split": (I64, (2,))})
    assert "split has 2 entries; expected one per output (3)" in message and "[C3]" in message
    assert "[C3]" in _error(_st(), {"x": (F32, (2, 6)), "split": (I64, (2, 1))})
    assert "allowed" in _error(_st(), {"x": (F32, (2, 6)), "split": (I32, (2,))})


def test_split_training_infers_every_output():
    inference = verify(_st(3, axis=-1), {"x": (F16, ("B", 6, 4)), "split": (I64, (3,))})
    assert inference.output_types == (TensorType(F16, ("B", 6, None)),) * 3


def test_split_training_empty_split_cuts_equal_pieces():
    """onnxruntime's kernel reads an empty ``split`` as equal pieces, one per output."""
    inference = verify(_st(3, axis=1), {"x": (F32, ("B", 6)), "split": (I64, (0,))})
    assert inference.output_types == (TensorType(F32, ("B", 2)),) * 3
    inference = verify(_st(2), {"x": (F32, ("N", 6)), "split": (I64, (0,))})
    assert inference.output_types == (TensorType(F32, (None, 6)),) * 2
    message = _error(_st(4, axis=1), {"x": (F32, (2, 6)), "split": (I64, (0,))})
    assert "split is empty (equal pieces) and axis 1 of input [2,6] has 6 entries, not a multiple of the 4 outputs" \
        in message and "[C3]" in message


# -- lowering against the float64 reference ------------------------------------------------------------------

def _lowered(model, target, opset_ops=None):
    lowered = lower_model(model, target=target)
    onnx.checker.check_model(lowered, full_check=True)
    ops = {n.op_type for n in lowered.graph.node}
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    if target == "portable":
        assert ops <= PORTABLE_OPS, sorted(ops - PORTABLE_OPS)
    return lowered, ops


def _check_case(model, feeds, want, elem, target):
    lowered, ops = _lowered(model, target)
    got = run_model(lowered, feeds)
    for name, value in want.items():
        close(got[name], value, elem if np.asarray(value).dtype.kind == "f" else I64, name)
    return ops


def fused_matmul_case(a_shape, b_shape, elem=F32, opset=17, **attrs):
    a, b = rand(a_shape, elem), rand(b_shape, elem)
    want = ref.fused_matmul(a, b, alpha=attrs.get("alpha", 1.0), trans_a=attrs.get("transA", 0),
                            trans_b=attrs.get("transB", 0), trans_batch_a=attrs.get("transBatchA", 0),
                            trans_batch_b=attrs.get("transBatchB", 0))
    model = one_node_model(_fmm(**attrs), [("a", elem, list(a_shape)), ("b", elem, list(b_shape))],
                           [("y", elem, list(want.shape))], opset)
    return model, {"a": a, "b": b}, {"y": want}, elem


FMM_CASES = {
    "3d_2d_transB_alpha": ((2, 4, 6), (5, 6), F32, dict(transB=1, alpha=0.125)),
    "4d_4d_transBatch_both": ((2, 3, 4, 5), (5, 3, 4, 6), F32, dict(transBatchA=1, transBatchB=1)),
    "4d_all_flags_f16": ((2, 3, 4, 5), (6, 3, 4, 2), F16, dict(transA=1, transB=1, transBatchA=1, transBatchB=1,
                                                               alpha=0.5)),
    "vector_transA_ignored_f64": ((4,), (4, 3), F64, dict(transA=1, alpha=-2.0)),
    "broadcast": ((3, 1, 4, 5), (2, 5, 6), F32, {}),
}


def gather_grad_case(shape, index_shape, axis=0, elem=F32, index_type=I64, opset=17, negative=True):
    rank = len(shape)
    size = shape[axis % rank]
    indices = RNG.integers(-size if negative else 0, size, index_shape).astype(NP[index_type])
    dy_shape = (*shape[:axis % rank], *index_shape, *shape[axis % rank + 1:])
    dy = rand(dy_shape, elem)
    want = ref.gather_grad(np.array(shape), indices, dy, axis)
    model = one_node_model(_gg(axis), [("shape", I64, [rank]), ("idx", index_type, list(index_shape)),
                                       ("dy", elem, list(dy_shape))], [("dx", elem, list(shape))], opset)
    return model, {"shape": np.array(shape, np.int64), "idx": indices, "dy": dy}, {"dx": want}, elem


GG_CASES = {
    "embedding_repeats": ((6, 4), (3, 5), 0, F32, I64),
    "last_token_scalar_axis1": ((2, 5, 3), (), 1, F32, I64),
    "axis_minus1_int32_f16": ((3, 4), (6,), -1, F16, I32),
    "axis2_f64": ((2, 2, 5, 2), (3,), 2, F64, I64),
    "embedding_bf16": ((5, 3), (4,), 0, BF16, I64),
}


def slice_grad_case(dx_shape, starts, ends, axes=None, steps=None, elem=F32, index_type=I64, opset=17, flat=False):
    """``flat``: dY arrives flattened to 1-D (onnxruntime's kernel copies its elements in order into the slice)."""
    starts, ends = np.array(starts, NP[index_type]), np.array(ends, NP[index_type])
    dy = rand(ref.slice_forward(np.zeros(dx_shape), starts, ends, axes, steps).shape, elem)
    want = ref.slice_grad(dy, np.array(dx_shape), starts, ends, axes, steps)
    if flat:
        dy = dy.reshape(-1)
    names, inputs = ["dy", "shape", "starts", "ends"], [("dy", elem, list(dy.shape)), ("shape", I64, [len(dx_shape)]),
                                                        ("starts", index_type, [len(starts)]),
                                                        ("ends", index_type, [len(ends)])]
    feeds = {"dy": dy, "shape": np.array(dx_shape, np.int64), "starts": starts, "ends": ends}
    for name, value in (("axes", axes), ("steps", steps)):
        if value is not None:
            feeds[name] = np.array(value, NP[index_type])
            inputs.append((name, index_type, [len(value)]))
        names.append(name if value is not None else "")
    while names[-1] == "":
        names.pop()
    model = one_node_model(_sg(names), inputs, [("dx", elem, list(dx_shape))], opset)
    return model, feeds, {"dx": want}, elem


SG_CASES = {
    "prefix_axis1": ((1, 8, 4), [0], [5], [1], None, F32, I64),
    "negative_clamped_no_axes": ((6, 5), [-100, -2], [4, 1000], None, None, F32, I64),
    "negative_steps_axes": ((4, 7, 3), [-1, 6, 0], [-100, 0, 3], [0, -2, 2], [-2, -3, 1], F32, I64),
    "steps_int32_f16": ((5, 6), [1], [6], [1], [2], F16, I32),
    "two_axes_f64_bf": ((3, 4, 5), [0, 1], [2, -1], [2, 0], [1, 1], F64, I64),
    "bf16_empty_slice": ((4, 3), [3], [1], [0], None, BF16, I64),
    "flat_dy_steps": ((2, 4), [1, 0], [2, 3], [0, 1], [1, 2], F32, I64),
    "flat_dy_negative_steps_clamped_int32_f64": ((4, 7, 3), [-1, 100, 0], [-100, -6, 3], [0, -2, 2], [-2, -3, 1],
                                                 F64, I32),
    "flat_dy_no_axes_no_steps_f16": ((5, 3, 2), [1, -2], [1000, 3], None, None, F16, I64),
    "flat_dy_empty_slice": ((4, 3), [3], [1], [0], None, F32, I64),
    # every axis of dY empty (onnxruntime 1.23 cannot broadcast the 0 rows through the portable form's MatMul)
    "empty_on_two_axes": ((1, 1), [0, 0], [0, 0], [1, 0], [1, 1], F32, I64),
}


def concat_case(shapes, axis, elem=F32, lengths=True, opset=17):
    xs = [rand(s, elem) if elem != BOOL else RNG.integers(0, 2, s).astype(bool) for s in shapes]
    y, per_input = ref.concat_training(xs, axis)
    outputs = [("y", elem, list(y.shape))] + ([("lengths", I64, [len(xs)])] if lengths else [])
    model = one_node_model(_ct(len(xs), [n for n, _, _ in outputs], axis=axis),
                           [(f"x{i}", elem, list(s)) for i, s in enumerate(shapes)], outputs, opset)
    want = {"y": y} | ({"lengths": per_input} if lengths else {})
    return model, {f"x{i}": x for i, x in enumerate(xs)}, want, elem


CT_CASES = {
    "two_axis1": ([(2, 3, 4), (2, 1, 4)], 1, F32, True),
    "three_axis_minus1_f16_no_lengths": ([(2, 2), (2, 3), (2, 1)], -1, F16, False),
    "one_input_bool": ([(3, 2)], 0, BOOL, True),
    "bf16": ([(2, 2), (1, 2)], 0, BF16, True),
}


def split_case(shape, split, axis=0, elem=F32, opset=17, wanted=None):
    """``split`` a list of lengths, or an int: that many equal pieces from an empty ``split``."""
    x = rand(shape, elem)
    count = split if isinstance(split, int) else len(split)
    split = [] if isinstance(split, int) else split
    pieces = ref.split_training(x, split, axis, count)
    names = [f"y{i}" if wanted is None or i in wanted else "" for i in range(count)]
    node = helper.make_node("SplitTraining", ["x", "split"], names, domain=MS, name="st", axis=axis)
    outputs = [(n, elem, list(p.shape)) for n, p in zip(names, pieces, strict=True) if n]
    model = one_node_model(node, [("x", elem, list(shape)), ("split", I64, [len(split)])], outputs, opset)
    want = {n: p for n, p in zip(names, pieces, strict=True) if n}
    return model, {"x": x, "split": np.array(split, np.int64)}, want, elem


ST_CASES = {
    "two_axis1": ((2, 4, 3), [3, 1], 1, F32, None),
    "three_axis_minus1_empty_piece_f64": ((2, 6), [1, 0, 5], -1, F64, None),
    "first_output_omitted_f16": ((5, 2), [2, 3], 0, F16, {1}),
    "bf16": ((4, 2), [1, 3], 0, BF16, None),
    "empty_split_equal_pieces": ((2, 6, 3), 3, 1, F32, None),
    "empty_split_axis_minus1_last_omitted_f64": ((2, 4), 2, -1, F64, {0}),
}


CASES = {  # name -> (builder taking the opset, element type)
    **{f"fmm_{k}": (lambda opset, a=a, b=b, e=e, kw=kw: fused_matmul_case(a, b, e, opset, **kw), e)
       for k, (a, b, e, kw) in FMM_CASES.items()},
    **{f"gg_{k}": (lambda opset, s=s, i=i, ax=ax, e=e, t=t: gather_grad_case(s, i, ax, e, t, opset), e)
       for k, (s, i, ax, e, t) in GG_CASES.items()},
    **{f"sg_{k}": (lambda opset, d=d, s=s, en=en, ax=ax, st=st, e=e, t=t, k=k:
                   slice_grad_case(d, s, en, ax, st, e, t, opset, k.startswith("flat_")), e)
       for k, (d, s, en, ax, st, e, t) in SG_CASES.items()},
    **{f"ct_{k}": (lambda opset, s=s, ax=ax, e=e, ln=ln: concat_case(s, ax, e, ln, opset), e)
       for k, (s, ax, e, ln) in CT_CASES.items()},
    **{f"st_{k}": (lambda opset, s=s, sp=sp, ax=ax, e=e, w=w: split_case(s, sp, ax, e, opset, w), e)
       for k, (s, sp, ax, e, w) in ST_CASES.items()},
}
# bf16 is no type of the default domain before opset 13, and an empty slice needs Reshape's allowzero (opset 14):
# those cases run at opset 17 only
LOWERING_RUNS = [(c, t, o) for c in sorted(CASES) for t in TARGETS for o in (12, 17)
                 if not (o == 12 and (CASES[c][1] == BF16 or c.endswith("empty_slice")))]


@pytest.mark.parametrize("case, target, opset", LOWERING_RUNS)
def test_lowering_matches_float64(case, target, opset):
    model, feeds, want, elem = CASES[case][0](opset)
    ops = _check_case(model, feeds, want, elem, target)
    if case.startswith("sg_") and 0 in feeds["dy"].shape:  # an empty dY: dX is zeros of the shape, nothing else
        assert ops <= {"ConstantOfShape", "Cast"}, ops
    elif case.startswith(("gg_", "sg_")):  # the form per target and opset
        scatter = target == "onnxruntime" and (opset >= 16 or case.startswith("sg_"))
        assert ("ScatterND" in ops) == scatter and ("MatMul" in ops) != scatter
    if case.startswith("st_"):
        assert ("Split" in ops) == (target == "onnxruntime" and opset >= 13)


def _run_openvino(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """OpenVINO, ports matched by any of their names (a no-op Reshape of an input or before an output gives
    its port that value's name too), bf16 handed over as its bits."""
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(model=model.SerializeToString(), weights=b""), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    for port in compiled.inputs:
        value = np.asarray(feeds[next(v.name for v in model.graph.input if v.name in port.get_names())])
        if value.dtype == ml_dtypes.bfloat16:
            tensor = ov.Tensor(ov.Type.bf16, value.shape)
            tensor.data.view(np.uint16)[...] = value.view(np.uint16)
        else:
            tensor = ov.Tensor(np.array(value.view(np.int64) if value.dtype == np.int64 else value, order="C"))
        request.set_tensor(port, tensor)
    request.infer()
    out = {}
    for output in model.graph.output:
        port = next(p for p in compiled.outputs if output.name in p.get_names())
        tensor = request.get_tensor(port)
        data = np.array(tensor.data)
        out[output.name] = data.view(np.uint16).view(ml_dtypes.bfloat16) if tensor.element_type == ov.Type.bf16 \
            else data
    return out


# tract 0.23 wants every Reshape's shape known when it loads the model: GatherGrad's and SliceGrad's come from
# their shape input, a graph input here (below: from a Shape node, which it folds); and it fails on a Slice whose
# bounds are run-time values (SplitTraining's; an empty split of a static axis gives constant bounds, which it runs)
TRACT_REFUSALS = {"gg_": "shape input is variable", "sg_": "shape input is variable", "st_": "SymbolScope",
                  "st_empty_split": None}


@pytest.mark.parametrize("runtime", ["openvino", "tract", "reference"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_portable_forms_run_in_other_runtimes(case, runtime, tmp_path):
    model, feeds, want, elem = CASES[case][0](17)
    lowered, _ = _lowered(model, "portable")
    refusal = _refusal(runtime, elem)
    if refusal is None and runtime == "tract":
        refusal = TRACT_REFUSALS.get(case[:14], TRACT_REFUSALS.get(case[:3]))
    if refusal is not None:
        with pytest.raises(Exception, match=refusal):
            run_in(runtime, lowered, feeds, tmp_path)
        return
    got = _run_openvino(lowered, feeds) if runtime == "openvino" else run_in(runtime, lowered, feeds, tmp_path)
    # OpenVINO's CPU plugin has no f64 kernels: it runs an f64 graph in f32 (f64 in and out)
    precision = F32 if runtime == "openvino" and elem == F64 else elem
    for name, value in want.items():
        close(got[name], value, precision if np.asarray(value).dtype.kind == "f" else I64, f"{runtime} {name}")


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_slice_grad_lowering_over_random_bounds(data):
    """Random starts, ends and steps (negative, out of range, empty), both targets, against the reference."""
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3), label="shape"))
    axes = data.draw(st.permutations(range(len(shape))), label="axes")[:data.draw(st.integers(1, len(shape)))]
    bound = st.integers(-8, 8) | st.sampled_from([-(2**62), 2**62])
    starts = [data.draw(bound, label="start") for _ in axes]
    ends = [data.draw(bound, label="end") for _ in axes]
    steps = [data.draw(st.integers(-3, 3).filter(bool), label="step") for _ in axes]
    negative_axes = [a - len(shape) if data.draw(st.booleans()) else a for a in axes]
    model, feeds, want, elem = slice_grad_case(shape, starts, ends, negative_axes, steps)
    for target in TARGETS:
        _check_case(model, feeds, want, elem, target)


def test_gather_grad_symbolic_dims_and_runtime_shape():
    """shape computed by a Shape node at run time, a symbolic batch: nothing static but the ranks."""
    table, ids = rand((7, 3)), np.array([[1, 6, 1], [0, 1, 6]])
    dy = rand((2, 3, 3))
    shape_node = helper.make_node("Shape", ["table"], ["shape"])
    node = helper.make_node("GatherGrad", ["shape", "ids", "dy"], ["dx"], domain=MS, name="gg")
    graph = helper.make_graph([shape_node, node], "g", [vi("table", F32, ["V", 3]), vi("ids", I64, ["B", "T"]),
                                                        vi("dy", F32, ["B", "T", 3])], [vi("dx", F32, ["V", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    for target in TARGETS:
        lowered, _ = _lowered(model, target)
        close(run_model(lowered, {"table": table, "ids": ids, "dy": dy})["dx"],
              ref.gather_grad(table.shape, ids, dy), F32, target)


@pytest.mark.parametrize("runtime", ["tract", "openvino", "reference", "onnxruntime"])
def test_portable_forms_run_everywhere_with_shape_from_a_shape_node(runtime, tmp_path):
    """As in the training graphs: shape is Shape(X) of a statically shaped X, starts/ends/axes initializers."""
    table, ids, dy_gather = rand((7, 3)), np.array([[1, 6, 1], [0, -1, 6]]), rand((2, 3, 3))
    x, dy_slice = rand((1, 8, 4)), rand((1, 5, 4))
    nodes = [helper.make_node("Shape", ["table"], ["table_shape"]), helper.make_node("Shape", ["x"], ["x_shape"]),
             helper.make_node("GatherGrad", ["table_shape", "ids", "dyg"], ["dtable"], domain=MS, name="gg"),
             helper.make_node("SliceGrad", ["dys", "x_shape", "st", "en", "ax"], ["dx"], domain=MS, name="sg")]
    constants = [onnx.numpy_helper.from_array(np.array([v]), n) for n, v in (("st", 0), ("en", 5), ("ax", 1))]
    graph = helper.make_graph(nodes, "g", [vi("table", F32, [7, 3]), vi("ids", I64, [2, 3]), vi("dyg", F32, [2, 3, 3]),
                                           vi("x", F32, [1, 8, 4]), vi("dys", F32, [1, 5, 4])],
                              [vi("dtable", F32, [7, 3]), vi("dx", F32, [1, 8, 4])], initializer=constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    lowered, _ = _lowered(model, "portable")
    got = run_in(runtime, lowered, {"table": table, "ids": ids, "dyg": dy_gather, "x": x, "dys": dy_slice}, tmp_path)
    close(got["dtable"], ref.gather_grad(table.shape, ids, dy_gather), F32, "dtable")
    close(got["dx"], ref.slice_grad(dy_slice, x.shape, [0], [5], [1]), F32, "dx")


@pytest.mark.parametrize("axis", [1, -1])
def test_concat_training_lengths_of_symbolic_inputs_come_from_their_shapes(axis):
    xs = [rand((2, 3)), rand((2, 1))]
    node = _ct(2, axis=axis)
    model = one_node_model(node, [("x0", F32, ["B", "n"]), ("x1", F32, ["B", "m"])],
                           [("y", F32, ["B", None]), ("lengths", I64, [2])])
    for target in TARGETS:
        lowered, ops = _lowered(model, target)
        assert "Shape" in ops
        got = run_model(lowered, {"x0": xs[0], "x1": xs[1]})
        close(got["y"], np.concatenate(xs, axis), F32, "y")
        assert got["lengths"].tolist() == [3, 1]


def test_nodes_sharing_a_signature_each_get_their_own_values():
    """The pass replays a rule's nodes for later nodes of the same signature: each keeps its own inputs."""
    xs = [rand((2, n)) for n in (3, 1, 2, 2)]
    nodes = [helper.make_node("ConcatTraining", ["x0", "x1"], ["c0", "l0"], domain=MS, name="ct0", axis=1),
             helper.make_node("ConcatTraining", ["x2", "x3"], ["c1", "l1"], domain=MS, name="ct1", axis=1),
             helper.make_node("SplitTraining", ["c0", "l0"], ["s0", "s1"], domain=MS, name="st0", axis=1),
             helper.make_node("SplitTraining", ["c1", "l1"], ["s2", "s3"], domain=MS, name="st1", axis=1),
             helper.make_node("GatherGrad", ["shape", "i0", "s0"], ["g0"], domain=MS, name="gg0", axis=1),
             helper.make_node("GatherGrad", ["shape", "i1", "s3"], ["g1"], domain=MS, name="gg1", axis=1)]
    inputs = [vi(f"x{i}", F32, list(x.shape)) for i, x in enumerate(xs)] + [
        vi("shape", I64, [2]), vi("i0", I64, [3]), vi("i1", I64, [2])]
    outputs = [vi("c0", F32, [2, 4]), vi("c1", F32, [2, 4]), vi("s1", F32, [2, 1]), vi("s2", F32, [2, 2]),
               vi("g0", F32, [2, 5]), vi("g1", F32, [2, 5])]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    feeds = {f"x{i}": x for i, x in enumerate(xs)} | {"shape": np.array([2, 5]), "i0": np.array([4, 4, -5]),
                                                     "i1": np.array([1, 3])}
    shape = np.array([2, 5])
    want = {"c0": np.concatenate(xs[:2], 1), "c1": np.concatenate(xs[2:], 1), "s1": xs[1], "s2": xs[2],
            "g0": ref.gather_grad(shape, feeds["i0"], xs[0], 1), "g1": ref.gather_grad(shape, feeds["i1"], xs[3], 1)}
    for target in TARGETS:
        got = run_model(_lowered(model, target)[0], feeds)
        for name, value in want.items():
            close(got[name], value, F32, f"{target} {name}")


def test_fused_matmul_lowering_is_transpose_matmul_mul():
    model, _, _, _ = fused_matmul_case((2, 3, 4, 5), (5, 3, 4, 6), transBatchA=1, transBatchB=1, alpha=0.5)
    lowered, _ = _lowered(model, "onnxruntime")
    assert [n.op_type for n in lowered.graph.node if n.op_type != "Constant"] == ["Transpose", "Transpose", "MatMul",
                                                                                   "Mul"]
    model, _, _, _ = fused_matmul_case((3, 4), (4, 5))
    assert [n.op_type for n in _lowered(model, "onnxruntime")[0].graph.node] == ["MatMul"]


# -- onnxruntime's own unit tests of the two kernels (orttraining/.../cpu/tensor/slice_grad_op_test.cc and
# -- split_op_test.cc): each input and expected output as those tests state them, lowered for both targets

INT64_MAX = np.iinfo(np.int64).max
ORT_SLICE_GRAD_TESTS = {  # name: (dY shape, dY, shape, starts, ends, axes, steps, dX)
    "basic (dY flattened)": ((2,), [5, 7], [2, 4], [1, 0], [2, 3], [0, 1], [1, 2], [0, 0, 0, 0, 5, 0, 7, 0]),
    "blockcopy": ((2, 4), range(1, 9), [2, 4], [0, 0], [2, 4], [0, 1], [1, 1], range(1, 9)),
    "coalesce 1": ((1, 1, 2, 2), [1, 2, 3, 4], [2, 2, 2, 2], [1, 1], [0, 2], [0, 1], [-1, 1], [0] * 12 + [1, 2, 3, 4]),
    "coalesce 2": ((1, 2, 1, 2, 2), range(1, 9), [1, 2, 2, 2, 2], [1], [INT64_MAX], [2], [1],
                   [0, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0, 5, 6, 7, 8]),
    "coalesce 3": ((1, 1, 2, 1, 2), [1, 2, 3, 4], [1, 2, 2, 2, 2], [1, 1], [INT64_MAX, 2], [1, 3], [1, 1],
                   [0] * 10 + [1, 2, 0, 0, 3, 4]),
    "coalesce 4": ((1, 1, 1), [1], [1, 1, 1], [0], [INT64_MAX], [1], [1], [1]),
}


@pytest.mark.parametrize("elem", [F32, F64])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", sorted(ORT_SLICE_GRAD_TESTS))
def test_onnxruntime_slice_grad_unit_tests(case, target, elem):
    dy_shape, dy, shape, starts, ends, axes, steps, dx = ORT_SLICE_GRAD_TESTS[case]
    names = ("dy", "shape", "starts", "ends", "axes", "steps")
    feeds = dict(zip(names, [np.array(list(dy), NP[elem]).reshape(dy_shape),
                             *(np.array(v, np.int64) for v in (shape, starts, ends, axes, steps))], strict=True))
    model = one_node_model(_sg(names), [(n, elem if n == "dy" else I64, list(v.shape)) for n, v in feeds.items()],
                           [("dx", elem, list(shape))])
    got = run_model(_lowered(model, target)[0], feeds)["dx"]
    assert got.dtype == NP[elem] and got.tolist() == np.array(list(dx), NP[elem]).reshape(shape).tolist()


@pytest.mark.parametrize("opset", [12, 17])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("split", [[], [1, 3]])
@pytest.mark.parametrize("split_is_input", [False, True])
def test_onnxruntime_split_training_unit_tests(split, split_is_input, target, opset):
    """Axis0EqualSplitFloat, Axis0UnequalSplitFloat and their _not_initializer variants: x [4, 2], axis 0."""
    x = np.arange(1, 9, dtype=np.float32).reshape(4, 2)
    lengths = split or [2, 2]
    node = helper.make_node("SplitTraining", ["x", "split"], ["y0", "y1"], domain=MS, name="st", axis=0)
    outputs = [("y0", F32, [lengths[0], 2]), ("y1", F32, [lengths[1], 2])]
    split_value = np.array(split, np.int64)
    if split_is_input:
        model, feeds = one_node_model(node, [("x", F32, [4, 2]), ("split", I64, [len(split)])], outputs, opset), \
            {"x": x, "split": split_value}
    else:
        model, feeds = one_node_model(node, [("x", F32, [4, 2])], outputs, opset), {"x": x}
        model.graph.initializer.append(onnx.numpy_helper.from_array(split_value, "split"))
    got = run_model(_lowered(model, target)[0], feeds)
    assert got["y0"].tolist() == x[:lengths[0]].tolist() and got["y1"].tolist() == x[lengths[0]:].tolist()


@pytest.mark.parametrize("target", TARGETS)
def test_split_training_equal_pieces_of_a_symbolic_axis_and_a_split_of_unknown_length(target):
    """The equal length from the run-time shape; a ``split`` whose length the graph does not state is used as
    given, or read as equal pieces when it arrives empty."""
    x = rand((6, 2))
    for split_shape in ([0], ["k"]):
        node = helper.make_node("SplitTraining", ["x", "split"], ["y0", "y1", "y2"], domain=MS, name="st")
        model = one_node_model(node, [("x", F32, ["N", 2]), ("split", I64, split_shape)],
                               [(f"y{i}", F32, [None, 2]) for i in range(3)])
        lowered, _ = _lowered(model, target)
        for split in ([], [1, 2, 3]) if split_shape == ["k"] else ([],):
            got = run_model(lowered, {"x": x, "split": np.array(split, np.int64)})
            for i, piece in enumerate(ref.split_training(x, split, 0, 3)):
                assert got[f"y{i}"].tolist() == piece.tolist(), (split_shape, split, i)


@pytest.mark.parametrize("target", TARGETS)
def test_slice_grad_flattened_dy_of_unknown_rank_and_shape_length(target):
    """dY of unknown rank and a ``shape`` of unstated length: the slice's shape from starts, ends and steps."""
    x_shape, starts, ends, axes, steps = (3, 4, 5), [2, -1], [0, 1], [-1, 1], [-1, -2]
    dy = rand(ref.slice_forward(np.zeros(x_shape), starts, ends, axes, steps).shape)
    feeds = {"dy": dy.reshape(-1), "shape": np.array(x_shape), "starts": np.array(starts), "ends": np.array(ends),
             "axes": np.array(axes), "steps": np.array(steps)}
    model = one_node_model(_sg(), [("dy", F32, None), ("shape", I64, ["r"])] +
                           [(n, I64, [2]) for n in ("starts", "ends", "axes", "steps")], [("dx", F32, None)])
    got = run_model(lower_model(model, target=target), feeds)["dx"]  # (the checker wants dY's rank stated)
    close(got, ref.slice_grad(dy, x_shape, starts, ends, axes, steps), F32, target)


# -- what the lowering needs to know ----------------------------------------------------------------------

def test_fused_matmul_flags_need_the_rank():
    model = one_node_model(_fmm(transB=1), [("a", F32, [3, 4]), ("b", F32, None)], [("y", F32, None)])
    with pytest.raises(LoweringError, match=r"^com.microsoft FusedMatMul 'fmm': transB/transBatchB need the rank "
                                            r"of B known"):
        lower_model(model)


def test_slice_grad_needs_the_number_of_sliced_axes():
    model = one_node_model(_sg(["dy", "shape", "starts", "ends"]), [("dy", F32, [2, 3]), ("shape", I64, [2]),
                                                                    ("starts", I64, ["k"]), ("ends", I64, ["k"])],
                           [("dx", F32, [4, 3])])
    with pytest.raises(LoweringError, match=r"^com.microsoft SliceGrad 'sg': the number of entries of starts"):
        lower_model(model)


def test_gather_grad_negative_axis_needs_the_rank():
    model = one_node_model(_gg(axis=-1), [("shape", I64, ["r"]), ("idx", I64, [2]), ("dy", F32, None)],
                           [("dx", F32, None)])
    with pytest.raises(LoweringError, match=r"^com.microsoft GatherGrad 'gg': axis -1 is negative"):
        lower_model(model)


def test_cli_bad_node_is_one_line_and_writes_nothing(tmp_path, capsys):
    model = one_node_model(_st(3, axis=1), [("x", F32, [2, 6]), ("split", I64, [2])],
                           [(f"y{i}", F32, None) for i in range(3)])
    path, out = tmp_path / "model.onnx", tmp_path / "low.onnx"
    onnx.save(model, path)
    assert main(["lower", str(path), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"oplower lower: error: {path}: com.microsoft SplitTraining 'st': split has 2 entries; "
                          "expected one per output (3)")
    assert not out.exists()


def test_cli_lower_verify_passes_on_the_family(tmp_path, capsys):
    """``lower --verify``: the lowered graph against the model evaluator's float64 rules on random inputs."""
    model, _, _, _ = fused_matmul_case((2, 4, 6), (5, 6), transB=1, alpha=0.125)
    path, out = tmp_path / "model.onnx", tmp_path / "low.onnx"
    onnx.save(model, path)
    assert main(["lower", str(path), "-o", str(out), "--verify"]) == 0, capsys.readouterr().err
    assert out.exists()


@pytest.mark.parametrize("case", recorded_cases(*OPS), ids=lambda c: f"{c['op_type']}-{c['variant']}")
def test_onnx_checker_and_infer_shapes_know_the_unlowered_ops(case):
    model, _, recorded = load_case(case)
    register_onnx_schemas(load_schemas())
    onnx.checker.check_model(model, full_check=True)
    del model.graph.output[:]  # outputs left to inference
    model.graph.output.extend(helper.make_value_info(name, onnx.TypeProto()) for name in recorded)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type for v in (*inferred.graph.value_info, *inferred.graph.output)}
    for name, value in recorded.items():
        assert types[name].elem_type == helper.np_dtype_to_tensor_dtype(value.dtype), name


# -- the references against finite differences and each other -------------------------------------------

def _directional(f, x, eps=1e-6, count=4):
    rng = np.random.default_rng(0)
    for _ in range(count):
        v = rng.standard_normal(x.shape)
        yield v, (f(x + eps * v) - f(x - eps * v)) / (2 * eps)


@pytest.mark.parametrize("shape, index_shape, axis", [((6, 3), (2, 4), 0), ((2, 5, 3), (), 1), ((3, 4), (5,), -1)])
def test_gather_grad_reference_matches_finite_differences(shape, index_shape, axis):
    size = shape[axis]
    indices = RNG.integers(-size, size, index_shape)
    dy = RNG.standard_normal(ref.gather(np.zeros(shape), indices, axis).shape)
    dx = ref.gather_grad(np.array(shape), indices, dy, axis)
    x = RNG.standard_normal(shape)
    for v, numeric in _directional(lambda t: float(np.sum(ref.gather(t, indices, axis) * dy)), x):
        assert abs(float(np.sum(dx * v)) - numeric) < 1e-6 * max(1.0, abs(numeric))


@pytest.mark.parametrize("args", [([0], [5], [1], None), ([-100, -2], [4, 1000], None, None),
                                  ([-1, 6], [-100, 0], [0, -1], [-2, -3]), ([1, 0], [7, 100], [-2, 2], [2, 3])])
def test_slice_grad_reference_matches_finite_differences(args):
    starts, ends, axes, steps = args
    shape = (4, 8, 5)
    dy = RNG.standard_normal(ref.slice_forward(np.zeros(shape), starts, ends, axes, steps).shape)
    dx = ref.slice_grad(dy, np.array(shape), starts, ends, axes, steps)
    x = RNG.standard_normal(shape)
    for v, numeric in _directional(lambda t: float(np.sum(ref.slice_forward(t, starts, ends, axes, steps) * dy)), x):
        assert abs(float(np.sum(dx * v)) - numeric) < 1e-6 * max(1.0, abs(numeric))


def test_split_training_is_the_adjoint_of_concat_training():
    xs = [RNG.standard_normal((2, n, 3)) for n in (1, 4, 2)]
    g = RNG.standard_normal((2, 7, 3))
    y, lengths = ref.concat_training(xs, 1)
    pieces = ref.split_training(g, lengths, 1)
    assert abs(float(np.sum(y * g)) - sum(float(np.sum(x * p)) for x, p in zip(xs, pieces, strict=True))) < 1e-12


def test_fused_matmul_reference_is_the_spelled_out_product():
    """With every flag: op_A(a)[x, y, m, k] = a[k, x, y, m] (axis 0 to rank - 2, then the last two swapped)."""
    a, b = RNG.standard_normal((2, 3, 4, 5)), RNG.standard_normal((6, 3, 4, 2))
    got = ref.fused_matmul(a, b, alpha=0.5, trans_a=1, trans_b=1, trans_batch_a=1, trans_batch_b=1)
    assert np.allclose(got, 0.5 * np.einsum("kxym,nxyk->xymn", a, b))


# -- the model evaluator ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["fmm_3d_2d_transB_alpha", "gg_last_token_scalar_axis1", "sg_negative_steps_axes",
                                  "ct_two_axis1", "st_first_output_omitted_f16"])
def test_reference_eval_knows_the_ops(case):
    model, feeds, want, elem = CASES[case][0](17)
    got = evaluate(model, feeds)
    for name, value in want.items():
        assert got[name].dtype == (np.asarray(value).dtype if np.asarray(value).dtype.kind != "f" else NP[elem])
        close(got[name], value, elem if np.asarray(value).dtype.kind == "f" else I64, name)


# -- onnxruntime-training 1.19.2's recorded one-node cases ----------------------------------------------------

RECORDED = recorded_cases(*OPS)


def test_every_op_of_the_family_has_recorded_cases():
    assert {c["op_type"] for c in RECORDED} == set(OPS)
    flags = {tuple(c["attributes"].get(k, 0) for k in ("transA", "transB", "transBatchA", "transBatchB"))
             for c in RECORDED if c["op_type"] == "FusedMatMul"}
    assert flags == set(itertools.product((0, 1), repeat=4))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", RECORDED, ids=lambda c: f"{c['op_type']}-{c['variant']}")
def test_recorded_cases(case, target):
    model, feeds, recorded = load_case(case)
    lowered, _ = _lowered(model, target)
    assert all(n.op_type != case["op_type"] for n in lowered.graph.node)
    assert_matches_recorded(run_model(lowered, feeds), recorded)
