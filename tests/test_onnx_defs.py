"""onnx learns the parsed schemas: infer_shapes and check_model(full_check=True) on un-lowered models,
and verify_model over graphs, subgraphs and model-local functions."""

from __future__ import annotations

import onnx
import onnx.defs
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
    bn_model,
    bn_node,
    make_model,
    output_types,
    stats_shape,
)
from onnx import TensorProto, helper

from opdef import load_schemas
from opdef.errors import ModelError, OplowerError, VerificationError
from opdef.model_verify import InvalidNodes, verify_model
from opdef.onnx_defs import register_onnx_schemas, to_onnx_schema

REGISTRY = load_schemas()
register_onnx_schemas(REGISTRY)

CASES = [
    (ONEDNN, F32, F32, "NCX"), (ONEDNN, BF16, F32, "NXC"), (ONEDNN, BF16, BF16, None), (ONEDNN, F16, F32, "NCX"),
    (OPSET_V0, F32, F32, "NXC"), (OPSET_V0, F16, F32, "NCX"), (OPSET_V0, BF16, BF16, None),
    (NGRAPH, F32, F32, None), (NGRAPH, F64, F64, None), (NGRAPH, BF16, BF16, None),
    (DIRECTML, F32, F32, None), (DIRECTML, F16, F16, None),
]


def entry(key):
    return REGISTRY.get(*key)


def test_registration_is_idempotent():
    first = register_onnx_schemas(REGISTRY)
    second = register_onnx_schemas(REGISTRY)
    assert [s.name for s in first] == [s.name for s in second]
    for key in SEED_OPS:
        assert onnx.defs.has(key[1], key[0])


def test_onnx_schema_mirrors_the_parsed_schema():
    s = to_onnx_schema(entry(ONEDNN))
    assert (s.domain, s.name, s.since_version) == ("onednn", "BatchNormTrainingBackward", 1)
    assert [i.name for i in s.inputs] == ["src", "diff_dst", "mean", "variance", "gamma"]
    assert s.inputs[4].option == onnx.defs.OpSchema.FormalParameterOption.Optional
    assert s.outputs[1].option == onnx.defs.OpSchema.FormalParameterOption.Optional
    constraints = {c.type_param_str: set(c.allowed_type_strs) for c in s.type_constraints}
    assert constraints["T1"] == {"tensor(float)", "tensor(bfloat16)", "tensor(float16)"}
    assert constraints["T2"] == {"tensor(float)", "tensor(bfloat16)"}
    assert s.attributes["epsilon"].required
    assert s.attributes["epsilon"].type == onnx.defs.OpSchema.AttrType.FLOAT
    assert s.attributes["data_format"].default_value.s == b"NXC"


def test_directml_per_argument_types_become_tensor_constraints():
    s = to_onnx_schema(entry(DIRECTML))
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in s.type_constraints}
    for p in s.inputs:
        assert allowed[p.type_str] == {"tensor(float)", "tensor(float16)"}


@pytest.mark.parametrize(("key", "t1", "t2", "layout"), CASES)
def test_infer_shapes_fills_in_the_outputs(key, t1, t2, layout):
    e = entry(key)
    shape = ("N", 16, 5, 3)
    model = bn_model(e, shape, t1, t2, layout=layout)
    del model.graph.output[:]  # nothing declared: everything comes from inference
    model.graph.output.append(helper.make_tensor_value_info("diff_src", t1, None))
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = output_types(inferred)
    stat = stats_shape(e, shape, layout)
    assert types["diff_src"] == (t1, shape)
    assert types["diff_gamma"] == (t2, stat)
    assert types["diff_beta"] == (t2, stat)


@pytest.mark.parametrize(("key", "t1", "t2", "layout"), CASES)
@pytest.mark.parametrize(("gamma", "grads"), [(True, True), (False, False)])
def test_check_model_full_check_accepts_valid_unlowered_models(key, t1, t2, layout, gamma, grads):
    e = entry(key)
    if not grads and not any(a.optional for a in e.schema.outputs):
        gamma, grads = True, True  # every argument required in this dialect
    model = bn_model(e, ("N", 16, 5), t1, t2, layout=layout, gamma=gamma, grads=grads)
    onnx.checker.check_model(model, full_check=True)


def test_default_attribute_applied_inside_onnx_inference():
    e = entry(ONEDNN)
    model = bn_model(e, (2, 3, 5), layout=None)  # data_format absent: NXC, statistics [5]
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert output_types(inferred)["diff_gamma"] == (F32, (5,))


def test_infer_shapes_raises_the_verification_error():
    e = entry(ONEDNN)
    model = bn_model(e, (8, 64, 7, 7), layout="NCX", node_name="bn3")
    model.graph.input[2].type.tensor_type.shape.dim[0].dim_value = 63
    with pytest.raises(VerificationError) as info:
        onnx.shape_inference.infer_shapes(model)
    assert str(info.value) == ("onednn BatchNormTrainingBackward 'bn3': mean has shape [63]; expected [64] "
                               "(channel axis 1 of src [8,64,7,7])")


def test_check_model_rejects_an_invalid_node():
    e = entry(DIRECTML)
    model = bn_model(e, (8, 64, 7, 7), epsilon=-1.0)
    with pytest.raises(OplowerError, match=r"Epsilon is -1.0; it must be finite and > 0"):
        onnx.checker.check_model(model, full_check=True)


def test_check_model_rejects_an_unknown_attribute():
    e = entry(NGRAPH)
    model = bn_model(e, (8, 64, 7))
    model.graph.node[0].attribute.append(helper.make_attribute("data_format", "NCX"))
    with pytest.raises(onnx.checker.ValidationError, match="data_format"):
        onnx.checker.check_model(model, full_check=True)


# -- verify_model ------------------------------------------------------------------------------------

def test_verify_model_returns_every_custom_node():
    e = entry(ONEDNN)
    model = bn_model(e, ("N", 64, 7, 7), layout="NCX")
    relu = helper.make_node("Relu", ["diff_src"], ["r"])
    model.graph.node.append(relu)
    [inf] = verify_model(model, REGISTRY)
    assert inf.output_types[0].shape == ("N", 64, 7, 7)
    assert inf.roles["src"] == "src"


def _if_model(e, inner_shape):
    """A main-graph node plus a copy inside an If's then-branch (outer-scope values feed it)."""
    outer = bn_node(e, name="outer", layout="NCX")
    inner = bn_node(e, name="inner", layout="NCX")
    inner.output[:] = ["in_" + o for o in inner.output]
    then_graph = helper.make_graph([inner], "then", [], [helper.make_tensor_value_info("in_diff_src", F32, None)])
    else_graph = helper.make_graph([helper.make_node("Identity", ["src"], ["e_out"])], "else", [],
                                   [helper.make_tensor_value_info("e_out", F32, None)])
    node_if = helper.make_node("If", ["cond"], ["branch"], then_branch=then_graph, else_branch=else_graph)
    vi = helper.make_tensor_value_info
    inputs = [vi("cond", TensorProto.BOOL, []), vi("src", F32, inner_shape), vi("diff_dst", F32, inner_shape),
              vi("mean", F32, [inner_shape[1]]), vi("variance", F32, [inner_shape[1]]),
              vi("gamma", F32, [inner_shape[1]])]
    graph = helper.make_graph([outer, node_if], "g", inputs,
                              [vi("diff_src", F32, inner_shape), vi("branch", F32, None)])
    return make_model(graph, e.binding.domain)


def test_verify_model_walks_subgraphs():
    model = _if_model(entry(ONEDNN), [2, 3, 4])
    results = verify_model(model, REGISTRY)
    assert [r.node_name for r in results] == ["outer", "inner"]
    assert results[1].output_types[0].shape == (2, 3, 4)


def test_verify_model_walks_model_local_functions():
    e = entry(NGRAPH)
    body = bn_node(e, name="in_function")
    function = helper.make_function("local", "f", list(body.input), list(body.output), [body],
                                    [helper.make_opsetid("", 17), helper.make_opsetid("ngraph", 1)])
    function.value_info.extend([helper.make_tensor_value_info("src", F32, [2, 3, 4]),
                                helper.make_tensor_value_info("mean", F32, [5])])
    call = helper.make_node("f", list(body.input), ["o1", "o2", "o3"], domain="local")
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([call], "g", [vi(v, F32, None) for v in body.input],
                              [vi(o, F32, None) for o in ("o1", "o2", "o3")])
    model = make_model(graph, "ngraph", "local", functions=[function])
    with pytest.raises(VerificationError, match=r"'in_function': mean has shape \[5\]; expected \[3\]"):
        verify_model(model, REGISTRY)


def test_verify_model_all_errors_collects_every_invalid_node():
    e = entry(ONEDNN)
    model = _if_model(e, [2, 3, 4])
    then_branch = next(a.g for a in model.graph.node[1].attribute if a.name == "then_branch")
    for node in (model.graph.node[0], then_branch.node[0]):
        for a in node.attribute:
            if a.name == "epsilon":
                a.f = 0.0
    with pytest.raises(InvalidNodes) as info:
        verify_model(model, REGISTRY, all_errors=True)
    assert [err.node for err in info.value.errors] == ["outer", "inner"]
    assert info.value.results == []
    assert str(info.value).startswith("2 invalid nodes: onednn BatchNormTrainingBackward 'outer': epsilon is 0.0")


def test_verify_model_first_error_without_all_errors():
    model = _if_model(entry(ONEDNN), [2, 3, 4])
    model.graph.node[0].attribute.append(helper.make_attribute("bogus", 1))
    with pytest.raises(VerificationError, match=r"'outer': unknown attribute 'bogus'"):
        verify_model(model, REGISTRY)


def test_verify_model_unknown_op_type_in_a_registered_domain():
    vi = helper.make_tensor_value_info
    node = helper.make_node("BatchNormForwardTraining", ["x"], ["y"], name="fwd", domain="onednn")
    graph = helper.make_graph([node], "g", [vi("x", F32, [2, 3])], [vi("y", F32, None)])
    with pytest.raises(VerificationError, match=r"onednn BatchNormForwardTraining 'fwd': unknown op type"):
        verify_model(make_model(graph, "onednn"), REGISTRY)


def test_verify_model_turns_onnx_inference_failures_into_model_errors(monkeypatch):
    # onnx's non-strict inference rarely raises; when it does, its exception must not escape as such
    def broken(*args, **kwargs):
        raise onnx.shape_inference.InferenceError("[ShapeInferenceError] something onnx disliked\nmore")

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", broken)
    model = bn_model(entry(ONEDNN), (2, 3), layout="NCX")
    with pytest.raises(ModelError, match=r"^onnx shape inference failed: \[ShapeInferenceError\] something onnx "
                                         r"disliked$"):
        verify_model(model, REGISTRY)


def test_verify_model_ignores_standard_nodes_and_other_domains():
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Foo", ["y"], ["z"], domain="elsewhere")]
    graph = helper.make_graph(nodes, "g", [vi("x", F32, [2])], [vi("z", F32, None)])
    assert verify_model(make_model(graph, "elsewhere"), REGISTRY) == []
