"""The lowering pass end to end: every dialect x layout x element types x optional arguments x ranks.

Each lowered model must pass ``onnx.checker`` (full_check), contain only default-domain ops, run in
onnxruntime and match the float64 reference: f32 within 1e-6 of the output's scale, f16/bf16 within one
unit in the last place of the output type (they are computed in f32 and rounded once).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnx_ir.traversal import RecursiveGraphIterator

import lowering.compat
from lowering import LowerCustomOpsPass, lower_model, lower_model_with_report
from lowering.builder import NodeBuilder
from lowering.demo.examples import BnCase, build_example
from lowering.numerics import compare
from lowering.rules import LoweringRequest, register_rule, rule_for, unregister_rule
from opdef.errors import LoweringError, VerificationError
from opdef.registry import load_schemas
from runtime.session import run_model

F32, F16, BF16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE
F32_REL = 1e-6

ONEDNN = ("onednn", "BatchNormTrainingBackward")
OPSET_V0 = ("onednn", "BatchNormTrainingBackprop")
NGRAPH = ("ngraph", "BatchNormTrainingBackprop")
DIRECTML = ("directml", "BATCH_NORMALIZATION_GRAD")
ORT_TRAINING = ("com.microsoft", "BatchNormalizationGrad")

SHAPES = {1: (6,), 2: (6, 3), 3: (2, 3, 5), 4: (2, 3, 4, 5), 5: (2, 3, 2, 3, 4), 6: (2, 3, 2, 1, 2, 3),
          7: (1, 3, 2, 2, 1, 2, 3), 8: (2, 3, 1, 2, 1, 2, 1, 2)}


@pytest.fixture(scope="module")
def registry():
    return load_schemas()


# -- helpers ---------------------------------------------------------------------------------------

def standard_only(model: onnx.ModelProto) -> bool:
    local = {(f.domain, f.name) for f in model.functions}
    ir_model = ir.from_proto(model)
    graphs = [ir_model.graph, *ir_model.functions.values()]
    return all(n.domain == "" or (n.domain, n.op_type) in local for g in graphs for n in RecursiveGraphIterator(g))


def lower_and_check(example, registry, rel=F32_REL, **options):
    before = example.model.SerializeToString()
    lowered = lower_model(example.model, registry=registry, **options)
    assert example.model.SerializeToString() == before, "lower_model modified its input"
    onnx.checker.check_model(lowered, full_check=True)
    assert standard_only(lowered)
    got = run_model(lowered, example.feeds)
    results = [compare(name, example.expected[name], got[name], example.output_types[name], rel)
               for name in example.expected]
    bad = [r.describe() for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    return lowered, got


# -- the matrix ------------------------------------------------------------------------------------

def _matrix():
    onednn_types = [(F32, F32), (BF16, F32), (BF16, BF16), (F16, F32)]
    optional = {"all": dict(gamma=True, outputs=("diff_src", "diff_gamma", "diff_beta")),
                "no_gamma": dict(gamma=False, outputs=("diff_src", "diff_gamma", "diff_beta")),
                "diff_src_only": dict(gamma=True, outputs=("diff_src",)),
                "no_gamma_diff_src_only": dict(gamma=False, outputs=("diff_src",))}
    for op, layout, types, opt in itertools.product((ONEDNN, OPSET_V0), ("NCX", "NXC"), onednn_types, optional):
        yield pytest.param(op, layout, types, optional[opt], range(2, 6), id=f"{op[1]}-{layout}-{_tn(types)}-{opt}")
    for types, consumed in itertools.product([(F32, F32), (F16, F16), (BF16, BF16), (F64, F64)],
                                             ("all", "diff_src_only")):
        opt = dict(consumed=("diff_src",)) if consumed == "diff_src_only" else {}
        yield pytest.param(NGRAPH, "NCX", types, opt, range(2, 6), id=f"ngraph-{_tn(types)}-{consumed}")
        if types[0] != BF16:
            yield pytest.param(ORT_TRAINING, "NCX", types, opt, range(2, 6), id=f"ms-{_tn(types)}-{consumed}")
    for types, consumed in itertools.product([(F32, F32), (F16, F16)], ("all", "param_grads_only")):
        opt = dict(consumed=("diff_gamma", "diff_beta")) if consumed == "param_grads_only" else {}
        yield pytest.param(DIRECTML, "NCX", types, opt, range(1, 9), id=f"directml-{_tn(types)}-{consumed}")


def _tn(types):
    names = {F32: "f32", F16: "f16", BF16: "bf16", F64: "f64"}
    return "_".join(names[t] for t in types)


@pytest.mark.parametrize("op,layout,types,options,ranks", list(_matrix()))
def test_lowered_matches_float64_reference(registry, op, layout, types, options, ranks):
    cases = [BnCase(op, SHAPES[r], layout=layout, io_type=types[0], stat_type=types[1], name=f"r{r}", seed=r,
                    **options) for r in ranks]
    if types[0] in (F32, F64):  # ill-conditioned: |mean|/std = 1e4 (bf16/f16 cannot even hold such data)
        cases.append(BnCase(op, SHAPES[4], layout=layout, io_type=types[0], stat_type=types[1],
                            name="ill", conditioning=1e4, seed=9, **options))
    lower_and_check(build_example(cases, registry), registry)


def test_directml_keep_rank_stats_on_other_axes(registry):
    cases = [BnCase(DIRECTML, (2, 3, 4, 5), reduce_axes=(0, 1), name="hw"),
             BnCase(DIRECTML, (2, 3, 4, 5), reduce_axes=(0, 1, 2, 3), name="all"),
             BnCase(DIRECTML, (2, 3, 4, 5), reduce_axes=(2,), name="one")]
    lower_and_check(build_example(cases, registry), registry)


def test_onednn_unit_test_case(registry):
    """oneDNN's own test: NCX 1x1x2x2, src 1..4, gamma 2, mean 2.5, variance 1.25, epsilon 1e-9."""
    data = {"src": np.array([1, 2, 3, 4], np.float32).reshape(1, 1, 2, 2),
            "diff_dst": np.array([0.1, 0.1, 0.2, 0.2], np.float32).reshape(1, 1, 2, 2),
            "gamma": np.array([2.0], np.float32), "mean": np.array([2.5], np.float32),
            "variance": np.array([1.25], np.float32)}
    example = build_example([BnCase(ONEDNN, (1, 1, 2, 2), layout="NCX", epsilon=1e-9, data=data)], registry)
    _, got = lower_and_check(example, registry)
    np.testing.assert_allclose(got["bn.diff_src"].ravel(), [0.017889, -0.053666, 0.053666, -0.017889], atol=1e-6)
    np.testing.assert_allclose(got["bn.diff_gamma"], [0.178885], atol=1e-6)
    np.testing.assert_allclose(got["bn.diff_beta"], [0.6], atol=1e-6)


# -- oneDNN single-output rule ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["spec", "upstream"])
def test_onednn_single_output_modes(registry, mode):
    """Neither diff_gamma nor diff_beta requested: gamma is ignored; 'upstream' also freezes the statistics."""
    case = BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX", outputs=("diff_src",))
    example = build_example([case], registry, onednn_single_output=mode)
    _, got = lower_and_check(example, registry, onednn_single_output=mode)
    with_gamma = build_example([BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX")], registry)
    assert not np.allclose(example.expected["bn.diff_src"], with_gamma.expected["bn.diff_src"])
    other = build_example([case], registry, onednn_single_output="upstream" if mode == "spec" else "spec")
    assert not np.allclose(got["bn.diff_src"], other.expected["bn.diff_src"])


def test_onednn_single_output_depends_on_declared_not_consumed_outputs(registry):
    """Declared but unused parameter gradients still count as requested: gamma is used."""
    case = BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX", consumed=("diff_src",))
    example = build_example([case], registry)
    full = build_example([BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX")], registry)
    np.testing.assert_array_equal(example.expected["bn.diff_src"], full.expected["bn.diff_src"])
    lower_and_check(example, registry)


def test_opset_v0_has_no_single_output_rule(registry):
    """The opset_v0 document states no both-or-neither constraint, so gamma always applies there."""
    case = BnCase(OPSET_V0, (2, 3, 4, 5), layout="NCX", outputs=("diff_src",))
    example = build_example([case], registry)
    full = build_example([BnCase(OPSET_V0, (2, 3, 4, 5), layout="NCX")], registry)
    np.testing.assert_array_equal(example.expected["bn.diff_src"], full.expected["bn.diff_src"])
    lower_and_check(example, registry)


def test_invalid_option_is_refused(registry):
    example = build_example([BnCase(ONEDNN, (2, 3))], registry)
    with pytest.raises(ValueError, match="onednn_single_output"):
        lower_model(example.model, registry=registry, onednn_single_output="sometimes")


# -- graph structure ------------------------------------------------------------------------------

def _cases():
    return [BnCase(ONEDNN, (2, 3, 4, 5), layout="NXC", name="a"),
            BnCase(DIRECTML, (2, 3, 4), io_type=F16, name="b", seed=1)]


def test_inside_if_branches(registry):
    example = build_example(_cases(), registry)
    graph = example.model.graph
    then_g = helper.make_graph(list(graph.node), "then", [], list(graph.output))
    else_nodes = []
    for node in graph.node:  # the same nodes under other output names
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = node.name + "_else"
        copy.output[:] = [o and o + "_else" for o in node.output]
        else_nodes.append(copy)
    else_outputs = []
    for vi in graph.output:
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(vi)
        copy.name = vi.name + "_else"
        else_outputs.append(copy)
    else_g = helper.make_graph(else_nodes, "else", [], else_outputs)
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    if_node = helper.make_node("If", ["cond"], [o.name for o in graph.output], then_branch=then_g,
                               else_branch=else_g)
    model = helper.make_model(helper.make_graph([if_node], "g", [*graph.input, cond], list(graph.output)),
                              opset_imports=list(example.model.opset_import))
    lowered, report = lower_model_with_report(model, registry=registry)
    assert sum(report.lowered.values()) == 4
    for flag in (True, False):
        example.model, example.feeds["cond"] = model, np.array(flag)
        lower_and_check(example, registry)
    assert [o.domain for o in lowered.opset_import] == [""]


def test_inside_model_local_function(registry):
    example = build_example(_cases(), registry)
    graph = example.model.graph
    customs = [o for o in example.model.opset_import if o.domain]
    function = helper.make_function("local", "Backward", [i.name for i in graph.input],
                                    [o.name for o in graph.output], list(graph.node),
                                    [helper.make_opsetid("", 17), *customs])
    call = helper.make_node("Backward", [i.name for i in graph.input], [o.name for o in graph.output],
                            domain="local", name="call")
    model = helper.make_model(helper.make_graph([call], "g", list(graph.input), list(graph.output)),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                              functions=[function])
    example.model = model
    lowered, _ = lower_and_check(example, registry)
    assert [o.domain for o in lowered.functions[0].opset_import] == [""]
    assert {o.domain for o in lowered.opset_import} == {"", "local"}


def test_symbolic_batch_and_spatial_dims(registry):
    cases = [BnCase(ONEDNN, (2, 3, 4, 5), layout="NXC", symbolic=(0, 1, 2), name="a"),
             BnCase(ONEDNN, (3, 4, 5), layout="NCX", symbolic=(0, 1, 2), name="b"),
             BnCase(NGRAPH, (2, 3, 4, 5), symbolic=(0, 2, 3), name="c"),
             BnCase(DIRECTML, (2, 3, 4, 5), symbolic=(0, 2, 3), name="d"),
             BnCase(ORT_TRAINING, (2, 3, 4), symbolic=(0, 2), io_type=F16, name="e")]
    example = build_example(cases, registry)
    lower_and_check(example, registry)
    for vi in example.model.graph.input:
        if vi.name == "a.src":
            assert [d.dim_param for d in vi.type.tensor_type.shape.dim][:3] == ["a_d0", "a_d1", "a_d2"]
    # other runtime sizes than the example's: M comes from the runtime shape
    bigger = build_example([BnCase(ONEDNN, (5, 3, 6, 7), layout="NCX", symbolic=(0, 2, 3), name="b")], registry)
    lowered = lower_model(build_example([BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX", symbolic=(0, 2, 3),
                                                name="b")], registry).model, registry=registry)
    got = run_model(lowered, bigger.feeds)
    assert compare("d", bigger.expected["b.diff_src"], got["b.diff_src"], F32, F32_REL).ok


@pytest.mark.parametrize("opset", [12, 13, 17, 18, 21])
def test_model_default_opset(registry, opset):
    example = build_example(_cases(), registry, opset=opset)
    lowered, _ = lower_and_check(example, registry)
    assert {o.domain: o.version for o in lowered.opset_import} == {"": opset}
    sums = [n for n in lowered.graph.node if n.op_type == "ReduceSum"]
    assert sums and all((len(n.input) == 1) == (opset < 13) for n in sums)


def test_opset_before_12_is_refused(registry):
    example = build_example(_cases(), registry, opset=11)
    with pytest.raises(LoweringError, match="opset 11"):
        lower_model(example.model, registry=registry)


def test_model_without_default_opset_gets_one(registry):
    example = build_example(_cases(), registry)
    del example.model.opset_import[0]
    assert "" not in {o.domain for o in example.model.opset_import}
    lowered, _ = lower_and_check(example, registry)
    assert {o.domain: o.version for o in lowered.opset_import} == {"": 17}


def test_fresh_names_never_collide(registry):
    """The model already uses every name the first lowering generated: the second must avoid them all."""
    example = build_example(_cases(), registry)
    first = lower_model(example.model, registry=registry)
    graph = example.model.graph
    outputs = {o.name for o in graph.output}
    generated = [n for node in first.graph.node for n in [*node.output, node.name] if n and n not in outputs]
    # An If whose branches define values (and nodes) under the generated names, and a graph-level node too.
    branch_nodes = [helper.make_node("Identity", ["a.src"], [name], name=f"taken_{i}")
                    for i, name in enumerate(generated)]
    branch_nodes.append(helper.make_node("Identity", ["a.src"], ["branch_out"], name=generated[0]))
    branch = helper.make_graph(branch_nodes, "b", [], [helper.make_tensor_value_info("branch_out", F32, None)])
    taken = helper.make_node("If", ["cond"], ["collide_out"], then_branch=branch, else_branch=branch,
                             name=generated[1])
    graph.node.append(taken)
    graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    graph.output.append(helper.make_tensor_value_info("collide_out", F32, [2, 3, 4, 5]))
    example.feeds["cond"] = np.array(True)
    lowered, got = lower_and_check(example, registry)
    main_names = [n for node in lowered.graph.node for n in node.output]
    assert not set(main_names) & set(generated)
    node_names = [node.name for node in lowered.graph.node]
    assert len(node_names) == len(set(node_names))
    np.testing.assert_array_equal(got["collide_out"], example.feeds["a.src"])


def dead_nodes(graph: onnx.GraphProto) -> list[str]:
    """Nodes none of whose outputs anything reads: work done for nobody."""
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    return [node.name for node in graph.node if not read & set(node.output)]


def test_unused_outputs_are_not_computed(registry):
    full = build_example([BnCase(NGRAPH, (2, 3, 4, 5))], registry)
    lowered_full = lower_model(full.model, registry=registry)
    for consumed in [("diff_src",), ("diff_gamma",), ("diff_beta",), ("diff_gamma", "diff_beta")]:
        partial = build_example([BnCase(NGRAPH, (2, 3, 4, 5), consumed=consumed)], registry)
        lowered, _ = lower_and_check(partial, registry)
        produced = {o for n in lowered.graph.node for o in n.output}
        assert {f"bn.{r}" for r in ("diff_src", "diff_gamma", "diff_beta") if r not in consumed}.isdisjoint(produced)
        assert not dead_nodes(lowered.graph)
        if "diff_src" not in consumed:  # no 1/M, no centring of diff_dst: strictly less work
            assert len(lowered.graph.node) < len(lowered_full.graph.node)


def test_node_with_no_consumed_output_disappears(registry):
    cases = [BnCase(NGRAPH, (2, 3, 4), consumed=(), name="dead"), BnCase(NGRAPH, (2, 3, 4), name="live")]
    example = build_example(cases, registry)
    lowered, report = lower_model_with_report(example.model, registry=registry)
    assert report.lowered["ngraph::BatchNormTrainingBackprop"] == 2
    assert not any(n.name.startswith("dead") for n in lowered.graph.node)
    lower_and_check(example, registry)


def test_graph_inputs_outputs_and_their_types_unchanged(registry):
    example = build_example(_cases() + [BnCase(ORT_TRAINING, (2, 3, 4), name="c")], registry)
    lowered, _ = lower_and_check(example, registry)
    assert list(lowered.graph.input) == list(example.model.graph.input)
    assert list(lowered.graph.output) == list(example.model.graph.output)


def test_verification_errors_propagate(registry):
    example = build_example([BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX")], registry)
    mean = next(i for i in example.model.graph.input if i.name == "bn.mean")
    mean.type.tensor_type.shape.dim[0].dim_value = 4  # expected 3 (channel axis 1)
    with pytest.raises(VerificationError, match="bn"):
        lower_model(example.model, registry=registry)


# -- model formats ---------------------------------------------------------------------------------

def _with_initializers(example, roles=("gamma", "mean", "variance")):
    """Move some inputs into initializers (so that they can be stored externally)."""
    graph = example.model.graph
    for vi in list(graph.input):
        if vi.name.split(".")[-1] in roles:
            graph.initializer.append(onnx.numpy_helper.from_array(example.feeds.pop(vi.name), vi.name))
            graph.input.remove(vi)
    return example


def test_external_data_model_keeps_its_data(registry, tmp_path):
    example = _with_initializers(build_example([BnCase(ONEDNN, (2, 16, 4, 5), layout="NCX")], registry))
    path = tmp_path / "model.onnx"
    onnx.save(example.model, path, save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.data", size_threshold=0)
    loaded = onnx.load(path, load_external_data=False)
    assert all(onnx.external_data_helper.uses_external_data(t) for t in loaded.graph.initializer)
    lowered = lower_model(loaded, registry=registry)
    kept = {t.name: t for t in lowered.graph.initializer}
    assert set(kept) == {"bn.gamma", "bn.mean", "bn.variance"}
    assert all(onnx.external_data_helper.uses_external_data(t) for t in kept.values())
    out = tmp_path / "lowered.onnx"
    onnx.save(lowered, out)  # beside the data file: the references stay valid
    onnx.checker.check_model(str(out), full_check=True)
    got = run_model(str(out), example.feeds)
    assert compare("diff_src", example.expected["bn.diff_src"], got["bn.diff_src"], F32, F32_REL).ok


def test_ir_version_14_input(registry, monkeypatch):
    example = build_example(_cases(), registry, ir_version=14)
    lowered, _ = lower_and_check(example, registry)
    import onnxruntime

    onnxruntime.InferenceSession(lowered.SerializeToString())  # directly, no downgrade by runtime/
    # A runtime that reads at most IR 13 (onnxruntime 1.31) gets IR 13.
    monkeypatch.setattr(lowering.compat, "_runtime_accepts", lambda v: v <= 13)
    assert lower_model(example.model, registry=registry).ir_version == 13


def test_model_without_custom_nodes_is_left_alone(registry):
    x = helper.make_tensor_value_info("x", F32, [2])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                                                [helper.make_tensor_value_info("y", F32, [2])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    assert lower_model(model, registry=registry) == model
    result = LowerCustomOpsPass(registry)(ir.from_proto(model))
    assert not result.modified


# -- onnx-ir ---------------------------------------------------------------------------------------

def test_onnx_ir_pass_in_pass_manager(registry):
    from onnx_ir.passes import PassManager
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    example = build_example(_cases(), registry)
    model = ir.from_proto(example.model)
    lowering_pass = LowerCustomOpsPass(registry)
    result = PassManager([lowering_pass, RemoveUnusedNodesPass()])(model)
    assert result.modified and result.model is model
    assert lowering_pass.report.lowered == {"onednn::BatchNormTrainingBackward": 1,
                                            "directml::BATCH_NORMALIZATION_GRAD": 1}
    example.model = ir.to_proto(model)
    lower_and_check(example, registry)


def test_lower_model_takes_an_onnx_ir_model(registry):
    example = build_example(_cases(), registry)
    model = ir.from_proto(example.model)
    assert lower_model(model, registry=registry) is model
    assert all(n.domain == "" for n in model.graph)


def test_lower_model_refuses_other_objects(registry):
    with pytest.raises(TypeError, match="ModelProto"):
        lower_model(b"not a model", registry=registry)


# -- rule registry ---------------------------------------------------------------------------------

def test_registering_a_rule_twice_is_an_error():
    rule_for("batch_norm_backward")
    with pytest.raises(ValueError, match="already registered"):
        register_rule("batch_norm_backward")(lambda builder, request: None)


def test_unknown_rule_is_a_lowering_error():
    with pytest.raises(LoweringError, match="no lowering rule"):
        rule_for("no_such_rule")


def test_a_rule_that_misses_an_output_is_reported(registry, monkeypatch):
    import dataclasses

    binding = registry.binding(*NGRAPH)
    broken = dataclasses.replace(binding, rule="test_broken_rule")
    entry = dataclasses.replace(registry.get(*NGRAPH), binding=broken)
    monkeypatch.setitem(registry._entries, NGRAPH, entry)

    @register_rule("test_broken_rule")
    def broken_rule(builder: NodeBuilder, request: LoweringRequest) -> None:
        builder.op1("Identity", [request.input("src")], request.output("diff_src"))

    try:
        example = build_example([BnCase(NGRAPH, (2, 3))], registry)
        with pytest.raises(LoweringError, match="did not produce"):
            lower_model(example.model, registry=registry)
    finally:
        unregister_rule("test_broken_rule")
