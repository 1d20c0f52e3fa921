"""opdef.verify.infer_node on the four seed dialects (from the bundled specs/), plus generic-schema units.

Valid cases: both layouts, every legal type combination, with and without gamma and parameter
gradients, symbolic and unknown dims, every rank each dialect allows. Invalid cases: one test per
constraint, each failing for that reason alone, asserting on the label and the actual values.
"""

from __future__ import annotations

import math

import pytest
from _models import (
    BF16,
    DIRECTML,
    F16,
    F32,
    F64,
    NGRAPH,
    ONEDNN,
    OPSET_V0,
    SEED_OPS,
    bn_node,
    stats_shape,
    value_types,
)
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

from opdef import load_schemas
from opdef.errors import VerificationError
from opdef.node import TensorType
from opdef.rules import RULES, register_rule, rule_for
from opdef.schema import Argument, Attribute, Constraint, OpSchema, TypeRule
from opdef.verify import infer_node, infer_with_schema

REGISTRY = load_schemas()


def entry(key):
    return REGISTRY.get(*key)


def infer(key, types, **node_kw):
    return infer_node(bn_node(entry(key), **node_kw), types, REGISTRY)


def fails(key, types, **node_kw) -> VerificationError:
    with pytest.raises(VerificationError) as info:
        infer(key, types, **node_kw)
    return info.value


# -- legal type combinations, as the seed documents state them ---------------------------------------
LEGAL_TYPES = {
    ONEDNN: [(F32, F32), (BF16, F32), (BF16, BF16), (F16, F32)],
    OPSET_V0: [(F32, F32), (F16, F32), (BF16, F32), (BF16, BF16)],
    NGRAPH: [(F32, F32), (F16, F16), (BF16, BF16), (F64, F64)],
    DIRECTML: [(F32, F32), (F16, F16)],
}
LAYOUTS = {ONEDNN: ["NCX", "NXC", None], OPSET_V0: ["NCX", "NXC", None], NGRAPH: [None], DIRECTML: [None]}
RANKS = {ONEDNN: range(2, 7), OPSET_V0: range(2, 7), NGRAPH: range(2, 7), DIRECTML: range(1, 9)}
SIZES = (3, 5, 7, 2, 4, 6, 2, 3)


def _shape(rank):
    return tuple(SIZES[:rank])


def _cases():
    for key in SEED_OPS:
        for t1, t2 in LEGAL_TYPES[key]:
            for layout in LAYOUTS[key]:
                yield pytest.param(key, t1, t2, layout, id=f"{key[0]}-{key[1]}-{t1}-{t2}-{layout}")


# -- valid -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "t1", "t2", "layout"), list(_cases()))
def test_valid_types_and_layouts(key, t1, t2, layout):
    e = entry(key)
    shape = (8, 64, 7, 5)
    types = value_types(e, shape, t1, t2, layout)
    inf = infer(key, types, layout=layout)
    stat = stats_shape(e, shape, layout)
    assert inf.output_types[0] == TensorType(t1, shape)
    assert inf.output_types[1] == TensorType(t2, stat)
    assert inf.output_types[2] == TensorType(t2, stat)
    assert inf.rank == 4
    expected_axis = 3 if layout in ("NXC", None) and e.binding.layout == "data_format" else 1
    assert inf.channel_axis == expected_axis
    assert inf.reduce_axes == tuple(i for i in range(4) if i != expected_axis)
    assert inf.epsilon == pytest.approx(1e-5)


@pytest.mark.parametrize("key", SEED_OPS)
def test_roles_map_canonical_names_to_onnx_values(key):
    e = entry(key)
    node = bn_node(e)
    renamed = helper.make_node(node.op_type, [f"v_{v}" for v in node.input], [f"o_{v}" for v in node.output],
                               name="bn", domain=node.domain)
    renamed.attribute.extend(node.attribute)
    types = {f"v_{k}": v for k, v in value_types(e, (2, 3, 4)).items()}
    inf = infer_node(renamed, types, REGISTRY)
    for role in ("src", "diff_dst", "mean", "variance", "gamma", "diff_src", "diff_gamma", "diff_beta"):
        spec_name = e.binding.arg(role)
        assert inf.roles[role] in (f"v_{role}", f"o_{role}"), (role, spec_name)
    assert "epsilon" not in inf.roles  # attributes are not values
    assert "beta" not in inf.roles


@pytest.mark.parametrize(("key", "rank"), [(k, r) for k in SEED_OPS for r in RANKS[k]])
def test_every_rank_the_dialect_allows(key, rank):
    e = entry(key)
    layout = "NCX" if e.binding.layout == "data_format" else None
    shape = _shape(rank)
    inf = infer(key, value_types(e, shape, layout=layout), layout=layout)
    assert inf.rank == rank
    assert inf.output_types[0].shape == shape
    if e.binding.layout == "stats_broadcast":
        assert inf.reduce_axes == ((0,) + tuple(range(2, rank)) if rank > 1 else ())
        assert inf.channel_axis == (1 if rank > 1 else 0)
    else:
        assert inf.channel_axis == 1
        assert inf.reduce_axes == (0,) + tuple(range(2, rank))


@pytest.mark.parametrize("key", [ONEDNN, OPSET_V0])
@pytest.mark.parametrize(("gamma", "grads"), [(True, True), (False, True), (True, False), (False, False)])
def test_optional_gamma_and_parameter_gradients(key, gamma, grads):
    e = entry(key)
    types = value_types(e, (4, 3, 5), layout="NCX")
    inf = infer(key, types, gamma=gamma, grads=grads, layout="NCX")
    assert (inf.roles.get("gamma") == "gamma") is gamma
    assert ("diff_gamma" in inf.roles) is grads and ("diff_beta" in inf.roles) is grads
    assert inf.inputs[4] == ("gamma" if gamma else None)
    assert inf.outputs[1:] == (("diff_gamma", "diff_beta") if grads else (None, None))
    assert inf.output_types[1:] == ((TensorType(F32, (3,)),) * 2 if grads else (None, None))


@pytest.mark.parametrize("key", [ONEDNN, OPSET_V0])
def test_omitted_optionals_given_as_empty_strings(key):
    e = entry(key)
    node = bn_node(e, layout="NCX")
    node.input[4] = ""  # gamma given as ""
    node.output[1] = ""
    node.output[2] = ""
    inf = infer_node(node, value_types(e, (4, 3, 5), layout="NCX"), REGISTRY)
    assert inf.inputs[4] is None and inf.outputs[1:] == (None, None)


def test_data_format_default_is_nxc():
    e = entry(ONEDNN)
    inf = infer(ONEDNN, value_types(e, (2, 5, 7), layout="NXC"))
    assert inf.attributes["data_format"] == "NXC"
    assert inf.channel_axis == 2 and inf.reduce_axes == (0, 1)


@pytest.mark.parametrize("key", SEED_OPS)
def test_symbolic_dims_propagate(key):
    e = entry(key)
    shape = ("N", 64, "H", "W")
    layout = "NCX" if e.binding.layout == "data_format" else None
    inf = infer(key, value_types(e, shape, layout=layout), layout=layout)
    assert inf.output_types[0].shape == shape
    assert inf.output_types[1].shape == stats_shape(e, shape, layout)


def test_symbolic_channel_takes_the_size_from_the_statistics():
    e = entry(ONEDNN)
    types = value_types(e, ("N", "C", 7), stat_shape=(64,))
    inf = infer(ONEDNN, types, layout="NCX")
    assert inf.output_types[0].shape == ("N", "C", 7)
    assert inf.output_types[1].shape == (64,)


def test_diff_dst_fills_in_what_src_leaves_open():
    e = entry(NGRAPH)
    types = value_types(e, (8, 64, 7))
    types["src"] = TensorType(F32, (None, 64, None))
    types["diff_dst"] = TensorType(F32, ("N", 64, 7))
    inf = infer(NGRAPH, types)
    assert inf.output_types[0].shape == ("N", 64, 7)


@pytest.mark.parametrize("key", [ONEDNN, OPSET_V0])
def test_unknown_rank_with_nxc_leaves_the_channel_axis_open(key):
    e = entry(key)
    types = value_types(e, None, stat_shape=(64,))
    inf = infer(key, types, layout="NXC")
    assert inf.rank is None and inf.channel_axis is None and inf.reduce_axes is None
    assert inf.output_types[0] == TensorType(F32, None)
    assert inf.output_types[1] == TensorType(F32, (64,))


def test_unknown_rank_with_ncx_still_knows_the_channel_axis():
    e = entry(ONEDNN)
    inf = infer(ONEDNN, value_types(e, None, stat_shape=(64,)), layout="NCX")
    assert inf.channel_axis == 1 and inf.reduce_axes is None


def test_unknown_types_and_shapes_are_not_errors():
    inf = infer(ONEDNN, {}, layout="NCX")
    assert inf.output_types[0] == TensorType(None, None)
    assert inf.output_types[1] == TensorType(None, (None,))


def test_type_table_decides_the_statistics_type():
    # f16 data admits only f32 statistics (onednn's table), even before the statistics' types are known
    e = entry(ONEDNN)
    types = value_types(e, (2, 3), F16, F32)
    for name in ("mean", "variance", "gamma"):
        types[name] = TensorType(None, (3,))
    inf = infer(ONEDNN, types, layout="NCX")
    assert inf.type_vars == {"T1": F16, "T2": F32}
    assert inf.output_types[1].elem_type == F32


def test_directml_statistics_over_several_axes():
    e = entry(DIRECTML)
    types = value_types(e, (8, 64, 7, 7), stat_shape=(1, 64, 7, 1))
    inf = infer(DIRECTML, types)
    assert inf.reduce_axes == (0, 3)
    assert inf.channel_axis is None  # more than one kept axis
    assert inf.output_types[1].shape == (1, 64, 7, 1)


def test_directml_symbolic_statistics_leave_reduce_axes_open():
    e = entry(DIRECTML)
    inf = infer(DIRECTML, value_types(e, ("N", "C", 7, 7), stat_shape=(1, "K", 1, 1)))
    assert inf.reduce_axes is None and inf.channel_axis is None


def test_directml_statistics_sharing_src_symbols_decide_reduce_axes():
    """A stats dim with src's own symbol is kept (if it is 1 at run time, summing over it changes nothing)."""
    e = entry(DIRECTML)
    inf = infer(DIRECTML, value_types(e, ("N", "C", 7, 7), stat_shape=(1, "C", 1, 1)))
    assert inf.reduce_axes == (0, 2, 3) and inf.channel_axis == 1


def test_declared_output_types_merge_with_the_inference():
    e = entry(ONEDNN)
    types = value_types(e, ("N", 64, 7), layout="NCX")
    types["diff_src"] = TensorType(F32, (8, 64, None))
    inf = infer(ONEDNN, types, layout="NCX")
    assert inf.output_types[0] == TensorType(F32, (8, 64, 7))


@given(rank=st.integers(2, 6), data=st.data())
def test_property_ncx_nxc_outputs_mirror_inputs(rank, data):
    e = entry(ONEDNN)
    shape = tuple(data.draw(st.one_of(st.integers(1, 9), st.sampled_from(["N", "C", "H"]))) for _ in range(rank))
    layout = data.draw(st.sampled_from(["NCX", "NXC"]))
    inf = infer(ONEDNN, value_types(e, shape, layout=layout), layout=layout)
    axis = 1 if layout == "NCX" else rank - 1
    assert inf.output_types[0].shape == shape
    assert inf.output_types[1].shape == (shape[axis],)
    assert inf.channel_axis == axis and sorted((*inf.reduce_axes, axis)) == list(range(rank))


# -- invalid: arity ---------------------------------------------------------------------------------

def test_error_too_many_inputs():
    e = entry(ONEDNN)
    node = bn_node(e, layout="NCX")
    node.input.append("extra")
    with pytest.raises(VerificationError) as info:
        infer_node(node, value_types(e, (2, 3)), REGISTRY)
    msg = str(info.value)
    assert msg.startswith("onednn BatchNormTrainingBackward 'bn': has 6 inputs; the schema takes at most 5")
    assert "gamma?" in msg


def test_error_too_many_outputs():
    e = entry(NGRAPH)
    node = bn_node(e)
    node.output.append("extra")
    with pytest.raises(VerificationError, match=r"has 4 outputs; the schema takes at most 3"):
        infer_node(node, value_types(e, (2, 3)), REGISTRY)


@pytest.mark.parametrize("key", SEED_OPS)
def test_error_missing_required_input(key):
    e = entry(key)
    node = bn_node(e, layout=None)
    del node.input[3:]
    with pytest.raises(VerificationError) as info:
        infer_node(node, value_types(e, (2, 3)), REGISTRY)
    assert f"required input '{e.schema.inputs[3].name}' (position 3) is missing" in str(info.value)


def test_error_required_input_given_as_empty_string():
    e = entry(ONEDNN)
    node = bn_node(e, layout="NCX")
    node.input[2] = ""
    with pytest.raises(VerificationError, match=r"required input 'mean' \(position 2\) is missing"):
        infer_node(node, value_types(e, (2, 3)), REGISTRY)


def test_error_required_output_missing():
    e = entry(DIRECTML)
    node = bn_node(e)
    node.output[0] = ""
    with pytest.raises(VerificationError, match=r"required output 'OutputGradientTensor' \(position 0\) is missing"):
        infer_node(node, value_types(e, (2, 3)), REGISTRY)


# -- invalid: attributes ----------------------------------------------------------------------------

@pytest.mark.parametrize("key", SEED_OPS)
def test_error_required_attribute_missing(key):
    e = entry(key)
    eps = e.binding.arg("epsilon")
    err = fails(key, value_types(e, (2, 3)), attrs={})
    assert f"required attribute '{eps}'" in str(err) and "is missing" in str(err)


def test_error_unknown_attribute():
    e = entry(NGRAPH)
    err = fails(NGRAPH, value_types(e, (2, 3)), attrs={"epsilon": 1e-5, "data_format": "NCX"})
    assert "unknown attribute 'data_format' (the schema's attributes: epsilon)" in str(err)


def test_error_attribute_onnx_type_differs_from_schema_type():
    e = entry(ONEDNN)
    err = fails(ONEDNN, value_types(e, (2, 3)), attrs={"epsilon": 1})
    assert "attribute 'epsilon' is INT; the schema says f32 (ONNX FLOAT)" in str(err)


def test_error_string_attribute_given_as_int():
    e = entry(OPSET_V0)
    err = fails(OPSET_V0, value_types(e, (2, 3)), attrs={"epsilon": 1e-5, "data_format": 1})
    assert "attribute 'data_format' is INT; the schema says string" in str(err)


@pytest.mark.parametrize("key", [ONEDNN, OPSET_V0])
def test_error_data_format_not_allowed(key):
    e = entry(key)
    err = fails(key, value_types(e, (2, 3)), layout="NHWC")
    assert "attribute 'data_format' is 'NHWC'; allowed: " in str(err)
    assert "NCX" in str(err) and "NXC" in str(err)


@pytest.mark.parametrize("key", SEED_OPS)
@pytest.mark.parametrize("epsilon", [0.0, -1e-5, math.inf, -math.inf, math.nan])
def test_error_epsilon_not_finite_positive(key, epsilon):
    e = entry(key)
    err = fails(key, value_types(e, (2, 3)), epsilon=epsilon)
    eps = e.binding.arg("epsilon")
    assert f"{eps} is {float(epsilon)!r}; it must be finite and > 0" in str(err)


# -- invalid: element types -------------------------------------------------------------------------

def test_error_element_type_outside_the_type_variable():
    e = entry(ONEDNN)
    err = fails(ONEDNN, value_types(e, (2, 3), F64, F32), layout="NCX")
    assert "src has element type f64; allowed for T1: f32, bf16, f16" in str(err)


def test_error_statistics_type_outside_the_type_variable():
    e = entry(OPSET_V0)
    err = fails(OPSET_V0, value_types(e, (2, 3), F32, F16), layout="NCX")
    assert "mean has element type f16; allowed for T2: f32, bf16" in str(err)


def test_error_per_argument_types_directml():
    e = entry(DIRECTML)
    types = value_types(e, (2, 3))
    types["InputTensor"] = TensorType(F64, (2, 3))
    types["diff_dst"] = TensorType(F64, (2, 3))
    types["src"] = TensorType(F64, (2, 3))
    err = fails(DIRECTML, types)
    assert "InputTensor" in str(err) or "src" in str(err)
    assert "has element type f64; allowed" in str(err) and "f32, f16" in str(err)


@pytest.mark.parametrize("key", SEED_OPS)
def test_error_type_variable_inconsistent(key):
    e = entry(key)
    types = value_types(e, (2, 3), F32, F32)
    types["diff_dst"] = TensorType(F16, (2, 3))
    err = fails(key, types, layout="NCX" if e.binding.layout == "data_format" else None)
    src, dd = e.binding.arg("src"), e.binding.arg("diff_dst")
    assert f"{dd} has element type f16 but {src} has f32" in str(err)
    if key == DIRECTML:
        assert err.constraint == "C1"


def test_error_directml_statistics_type_differs_from_input_c1():
    e = entry(DIRECTML)
    types = value_types(e, (2, 3), F16)
    types["variance"] = TensorType(F32, (1, 3))
    err = fails(DIRECTML, types)
    assert "VarianceTensor has element type f32 but InputTensor has f16" in str(err)
    assert err.constraint == "C1" and str(err).endswith("[C1]")


def test_error_ngraph_single_type_variable():
    e = entry(NGRAPH)
    err = fails(NGRAPH, value_types(e, (2, 3), F32, F16))
    assert "gamma has element type f16 but input has f32; both are T" in str(err)


def test_error_unsupported_type_combination_onednn():
    e = entry(ONEDNN)
    err = fails(ONEDNN, value_types(e, (2, 3), F16, BF16), layout="NCX")
    assert "unsupported type combination T1=f16, T2=bf16; supported: " in str(err)
    assert "T1=bf16, T2=bf16" in str(err)


def test_error_onednn_f32_data_with_bf16_statistics():
    e = entry(ONEDNN)
    err = fails(ONEDNN, value_types(e, (2, 3), F32, BF16), layout="NCX")
    assert "unsupported type combination T1=f32, T2=bf16" in str(err)


@pytest.mark.parametrize("t1", [F32, F16])
def test_error_type_rule_opset_v0(t1):
    e = entry(OPSET_V0)
    err = fails(OPSET_V0, value_types(e, (2, 3), t1, BF16), layout="NCX")
    name = {F32: "f32", F16: "f16"}[t1]
    assert f"T2 is bf16 while T1 is {name}; T2 may be bf16 only when T1 is bf16" in str(err)
    assert "T2 can be bf16 only when T1 is bf16." in str(err)


# -- invalid: ranks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key", [ONEDNN, OPSET_V0, NGRAPH])
def test_error_rank_below_the_binding_minimum(key):
    e = entry(key)
    types = value_types(e, (5,), stat_shape=(5,))
    err = fails(key, types, layout="NXC" if e.binding.layout == "data_format" else None)
    src = e.binding.arg("src")
    assert f"{src} has rank 1 [5]; expected rank >= 2" in str(err)


def test_error_directml_rank_above_the_spec_maximum():
    e = entry(DIRECTML)
    shape = (2,) * 9
    err = fails(DIRECTML, value_types(e, shape))
    assert "InputTensor has rank 9 [2,2,2,2,2,2,2,2,2]; the spec allows ranks 1..8" in str(err)


# -- invalid: shapes --------------------------------------------------------------------------------

def test_error_mean_not_the_channel_size_onednn():
    e = entry(ONEDNN)
    types = value_types(e, (8, 64, 7, 7), layout="NCX")
    types["mean"] = TensorType(F32, (63,))
    err = fails(ONEDNN, types, name="bn3", layout="NCX")
    assert str(err) == ("onednn BatchNormTrainingBackward 'bn3': mean has shape [63]; expected [64] "
                        "(channel axis 1 of src [8,64,7,7])")


@pytest.mark.parametrize("key", [ONEDNN, OPSET_V0])
def test_error_statistics_follow_the_last_axis_for_nxc(key):
    e = entry(key)
    types = value_types(e, (8, 64, 7, 5), layout="NCX")  # [64] statistics, but NXC puts C last
    err = fails(key, types, layout="NXC")
    assert "mean has shape [64]; expected [5] (channel axis 3 of " in str(err)


@pytest.mark.parametrize("key", [ONEDNN, OPSET_V0, NGRAPH])
@pytest.mark.parametrize("role", ["variance", "gamma"])
def test_error_variance_or_gamma_not_the_channel_size(key, role):
    e = entry(key)
    layout = "NCX" if e.binding.layout == "data_format" else None
    types = value_types(e, (8, 64, 7), layout=layout)
    types[role] = TensorType(F32, (32,))
    err = fails(key, types, layout=layout)
    assert f"{e.binding.arg(role)} has shape [32]; expected [64] (channel axis 1 of " in str(err)


def test_error_ngraph_beta_has_the_documented_statistics_shape():
    e = entry(NGRAPH)
    types = value_types(e, (8, 64, 7))
    types["beta"] = TensorType(F32, (65,))
    err = fails(NGRAPH, types)
    assert "beta has shape [65]; expected [64] (channel axis 1 of input [8,64,7])" in str(err)


@pytest.mark.parametrize("key", [ONEDNN, OPSET_V0, NGRAPH])
def test_error_statistics_not_one_dimensional(key):
    e = entry(key)
    layout = "NCX" if e.binding.layout == "data_format" else None
    types = value_types(e, (8, 64, 7), layout=layout)
    types["mean"] = TensorType(F32, (1, 64, 1))
    err = fails(key, types, layout=layout)
    assert "mean has shape [1,64,1]; expected [64] (one value per channel, channel axis 1 of" in str(err)


def test_error_statistics_disagree_when_the_channel_is_symbolic():
    e = entry(ONEDNN)
    types = value_types(e, ("N", "C", 7), stat_shape=(64,))
    types["variance"] = TensorType(F32, (63,))
    err = fails(ONEDNN, types, layout="NCX")
    assert "variance has shape [63]; expected [64] (the shape of mean)" in str(err)


@pytest.mark.parametrize("key", SEED_OPS)
def test_error_diff_dst_shape_differs_from_src(key):
    e = entry(key)
    layout = "NCX" if e.binding.layout == "data_format" else None
    types = value_types(e, (8, 64, 7, 7), layout=layout)
    types["diff_dst"] = TensorType(F32, (8, 64, 7, 6))
    err = fails(key, types, layout=layout)
    src, dd = e.binding.arg("src"), e.binding.arg("diff_dst")
    assert f"{dd} has shape [8,64,7,6]; expected {src}'s shape [8,64,7,7]" in str(err)


def test_error_diff_dst_rank_differs_from_src():
    e = entry(ONEDNN)
    types = value_types(e, (8, 64, 7), layout="NCX")
    types["diff_dst"] = TensorType(F32, (8, 64))
    err = fails(ONEDNN, types, layout="NCX")
    assert "diff_dst has shape [8,64]; expected src's shape [8,64,7]" in str(err)


def test_error_directml_statistics_rank_differs_from_input_c1():
    e = entry(DIRECTML)
    types = value_types(e, (8, 64, 7, 7), stat_shape=(64,))
    err = fails(DIRECTML, types)
    assert "MeanTensor has rank 1 [64]; expected InputTensor's rank 4 [8,64,7,7]" in str(err)
    assert err.constraint == "C1"


def test_error_directml_statistics_dim_neither_one_nor_the_input_size():
    e = entry(DIRECTML)
    types = value_types(e, (8, 64, 7, 7))
    for role in ("mean", "variance", "gamma"):
        types[role] = TensorType(F32, (1, 63, 1, 1))
    err = fails(DIRECTML, types)
    assert ("MeanTensor has shape [1,63,1,1]; every dim must be 1 or InputTensor's [8,64,7,7]: "
            "axis 1 is 63, not 1 or 64") in str(err)


def test_error_directml_statistics_disagree_c2():
    e = entry(DIRECTML)
    types = value_types(e, (8, 64, 7, 7))
    types["gamma"] = TensorType(F32, (1, 64, 7, 1))
    err = fails(DIRECTML, types)
    assert "ScaleTensor has shape [1,64,7,1]; expected MeanTensor's shape [1,64,1,1]" in str(err)
    assert err.constraint == "C2"


# -- invalid: outputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", [1, 2])
def test_error_onednn_c1_diff_gamma_and_diff_beta_both_or_neither(missing):
    e = entry(ONEDNN)
    node = bn_node(e, layout="NCX")
    node.output[missing] = ""
    with pytest.raises(VerificationError) as info:
        infer_node(node, value_types(e, (2, 3)), REGISTRY)
    given_, absent = ("diff_beta", "diff_gamma") if missing == 1 else ("diff_gamma", "diff_beta")
    assert f"{given_} is requested but {absent} is not; request both or neither" in str(info.value)
    assert info.value.constraint == "C1" and str(info.value).endswith("[C1]")


def test_opset_v0_has_no_both_or_neither_constraint():
    e = entry(OPSET_V0)
    node = bn_node(e, layout="NCX")
    del node.output[2]
    inf = infer_node(node, value_types(e, (2, 3)), REGISTRY)
    assert inf.outputs == ("diff_src", "diff_gamma", None)


def test_error_declared_output_type_conflicts():
    e = entry(ONEDNN)
    types = value_types(e, (2, 3))
    types["diff_src"] = TensorType(F16, (2, 3))
    err = fails(ONEDNN, types, layout="NCX")
    assert "diff_src ('diff_src') is declared f16; inferred f32" in str(err)


def test_error_declared_output_shape_conflicts():
    e = entry(ONEDNN)
    types = value_types(e, (2, 3))
    types["diff_gamma"] = TensorType(F32, (4,))
    err = fails(ONEDNN, types, layout="NCX")
    assert "diff_gamma ('diff_gamma') is declared with shape [4]; inferred [3]" in str(err)


def test_error_unknown_op_type_in_a_registered_domain():
    node = helper.make_node("BatchNormTrainingForward", ["x"], ["y"], name="f", domain="onednn")
    with pytest.raises(VerificationError) as info:
        infer_node(node, {}, REGISTRY)
    assert "onednn BatchNormTrainingForward 'f': unknown op type 'BatchNormTrainingForward'" in str(info.value)
    assert "BatchNormTrainingBackward" in str(info.value)


def test_unnamed_node_is_named_by_its_first_output():
    e = entry(ONEDNN)
    err = fails(ONEDNN, value_types(e, (2, 3)), name="", epsilon=0.0)
    assert "'<diff_src>'" in str(err)


# -- generic schemas (hand-made, not from specs/) ---------------------------------------------------

GENERIC = OpSchema(
    name="Generic", domain="test", version=1, dialect="onednn",
    inputs=(Argument("a", type_var="T"), Argument("b", optional=True, type_var="T"),
            Argument("rest", optional=True, variadic=True, type_var="U", min_rank=1, max_rank=2)),
    outputs=(Argument("y", type_var="T"), Argument("z", optional=True, type_var="U")),
    attributes=(Attribute("flag", "bool", False, default=False), Attribute("k", "s8", False, default=3),
                Attribute("axes", "s64[]", False), Attribute("scale", "f32", False, default=1.0,
                                                                 allowed_values=(1.0, 2.0))),
    type_constraints=(("T", ("real",)), ("U", ("s64", "s32"))),
    type_rules=(TypeRule("U", ("s64",), "T", ("f64",), "U is s64 only with f64 T"),),
    constraints=(Constraint("C7", "a and b agree", ("a", "b")),),
)


def generic(node_inputs, node_outputs=("y",), types=None, **attrs):
    node = helper.make_node("Generic", list(node_inputs), list(node_outputs), name="g", domain="test", **attrs)
    return infer_with_schema(GENERIC, None, node, types or {})


def test_generic_defaults_and_variadic_tail():
    inf = generic(["a", "", "r1", "r2"], types={"a": TensorType(F32, (2,)), "r1": TensorType(TensorProto.INT32,
                                                                                         (1,))})
    assert inf.inputs == ("a", None, "r1", "r2")
    assert inf.attributes == {"flag": False, "k": 3, "scale": 1.0}
    assert inf.type_vars == {"T": F32, "U": TensorProto.INT32}
    assert inf.output_types[0] == TensorType(F32, None)
    assert inf.roles == {}


def test_generic_bool_and_list_attributes():
    inf = generic(["a"], flag=1, axes=[0, 2])
    assert inf.attributes["flag"] is True and inf.attributes["axes"] == [0, 2]


def test_generic_error_integer_attribute_out_of_range():
    with pytest.raises(VerificationError, match=r"attribute 'k' is 300; s8 allows -128..127"):
        generic(["a"], k=300)


def test_generic_error_bool_attribute_not_zero_or_one():
    with pytest.raises(VerificationError, match=r"attribute 'flag' is 2; bool allows 0..1"):
        generic(["a"], flag=2)


def test_generic_error_float_attribute_not_allowed():
    with pytest.raises(VerificationError, match=r"attribute 'scale' is 3.0; allowed: 1.0, 2.0"):
        generic(["a"], scale=3.0)


def test_generic_error_type_variable_label_from_constraint():
    with pytest.raises(VerificationError) as info:
        generic(["a", "b"], types={"a": TensorType(F32, None), "b": TensorType(F64, None)})
    assert "b has element type f64 but a has f32; both are T" in str(info.value)


def test_generic_error_type_rule():
    with pytest.raises(VerificationError, match=r"U is s64 while T is f32; U may be s64 only when T is f64"):
        generic(["a", "", "r"], types={"a": TensorType(F32, None), "r": TensorType(TensorProto.INT64, None)})


def test_generic_error_rank_of_a_variadic_argument():
    with pytest.raises(VerificationError, match=r"rest has rank 3 \[1,1,1\]; the spec allows ranks 1..2"):
        generic(["a", "", "r"], types={"r": TensorType(TensorProto.INT32, (1, 1, 1))})


def test_generic_error_type_class_real_rejects_integers():
    with pytest.raises(VerificationError, match=r"a has element type s64; allowed for T: real"):
        generic(["a"], types={"a": TensorType(TensorProto.INT64, None)})


def test_rules_register_once():
    assert rule_for("batch_norm_backward") is RULES["batch_norm_backward"]
    with pytest.raises(ValueError, match="already registered"):
        register_rule("batch_norm_backward")(lambda ctx: None)


def test_every_bundled_binding_has_a_verification_rule():
    assert all(rule_for(e.binding.rule) is not None for e in REGISTRY)


def test_binding_without_a_verifier_gets_generic_checks_and_roles(monkeypatch):
    e = entry(ONEDNN)
    monkeypatch.delitem(RULES, "batch_norm_backward")
    inf = infer_node(bn_node(e, layout="NCX"), value_types(e, (2, 3)), REGISTRY)
    assert inf.roles["src"] == "src" and inf.roles["diff_beta"] == "diff_beta"
    assert inf.output_types[0] == TensorType(F32, None)  # element type from T1; no shape rule ran
    assert inf.channel_axis is None


# -- onnxruntime-training's BatchNormalizationGrad (inv_std input, channel axis 1) ------------------

MS_GRAD = ("com.microsoft", "BatchNormalizationGrad")


def test_ms_grad_binds_inv_std_and_infers_outputs():
    e = entry(MS_GRAD)
    inf = infer(MS_GRAD, value_types(e, ("N", 8, 5), BF16))
    assert inf.roles["inv_std"] == "inv_std" and "variance" not in inf.roles
    assert inf.output_types == (TensorType(BF16, ("N", 8, 5)), TensorType(BF16, (8,)), TensorType(BF16, (8,)))
    assert inf.channel_axis == 1 and inf.reduce_axes == (0, 2)


def test_error_ms_grad_c2_per_channel_shape():
    e = entry(MS_GRAD)
    types = value_types(e, (4, 8, 5))
    types["inv_std"] = TensorType(F32, (7,))
    err = fails(MS_GRAD, types)
    assert "saved_inv_std has shape [7]; expected [8] (channel axis 1 of X [4,8,5])" in str(err)
    assert err.constraint == "C2"


def test_error_ms_grad_c1_rank():
    e = entry(MS_GRAD)
    err = fails(MS_GRAD, value_types(e, (8,), stat_shape=(8,)))
    assert "X has rank 1 [8]; expected rank >= 2" in str(err) and err.constraint == "C1"


def test_error_ms_grad_c1_dy_shape():
    e = entry(MS_GRAD)
    types = value_types(e, (4, 8, 5))
    types["diff_dst"] = TensorType(F32, (4, 8, 6))
    err = fails(MS_GRAD, types)
    assert "dY has shape [4,8,6]; expected X's shape [4,8,5]" in str(err) and err.constraint == "C1"


def test_error_ms_grad_c4_epsilon():
    e = entry(MS_GRAD)
    err = fails(MS_GRAD, value_types(e, (4, 8)), epsilon=-1.0)
    assert "epsilon is -1.0; it must be finite and > 0" in str(err) and err.constraint == "C4"


# -- malformed input never escapes as anything but a VerificationError ------------------------------

_dims = st.one_of(st.none(), st.integers(0, 9), st.sampled_from(["N", "C"]))
_shapes = st.one_of(st.none(), st.lists(_dims, max_size=9).map(tuple))
_elems = st.sampled_from([None, F32, F16, BF16, F64, TensorProto.INT64])


@given(key=st.sampled_from(SEED_OPS), data=st.data())
def test_property_random_types_either_verify_or_raise_verification_error(key, data):
    e = entry(key)
    node = bn_node(e, layout=data.draw(st.sampled_from([None, "NCX", "NXC"])) if e.binding.layout_attribute else None,
                   gamma=data.draw(st.booleans()), grads=data.draw(st.booleans()),
                   epsilon=data.draw(st.floats(allow_nan=True, allow_infinity=True, width=32)))
    types = {v: TensorType(data.draw(_elems), data.draw(_shapes)) for v in node.input if v}
    try:
        inf = infer_node(node, types, REGISTRY)
    except VerificationError as err:
        assert str(err).startswith(f"{key[0]} {key[1]} 'bn': ")
        return
    assert inf.epsilon > 0 and math.isfinite(inf.epsilon)
    assert len(inf.output_types) == len(e.schema.outputs)


def test_error_rank_zero_has_no_channel_axis_even_without_a_binding_minimum():
    import dataclasses

    e = entry(ONEDNN)
    binding = dataclasses.replace(e.binding, min_rank=None)
    node = bn_node(e, layout="NXC")
    with pytest.raises(VerificationError, match=r"src has rank 0 \[\]; expected rank >= 1 \(a channel axis"):
        infer_with_schema(e.schema, binding, node, value_types(e, (), stat_shape=(3,)))
    inf = infer_with_schema(e.schema, binding, node, value_types(e, (3,), stat_shape=(3,)))
    assert inf.channel_axis == 0 and inf.reduce_axes == ()
