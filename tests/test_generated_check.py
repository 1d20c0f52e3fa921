"""The generated training model's check from its declared types (lowering/training/generated_check.py): as strict
as the whole-model check (opdef.model_verify.verify_model) it replaces in build_artifacts -- the same types for
every custom node of every committed architecture, the same one-line error for a wrong emitted node."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from _artifacts import make_oplower_artifacts_driver
from onnx import TensorProto, helper, numpy_helper

from lowering.training import artifacts as artifacts_module
from lowering.training import generated_check
from lowering.training.artifacts import LossType, build_artifacts
from lowering.training.generated_check import verify_generated
from lowering.training.gradients import registry as gradient_registry
from opdef.errors import OplowerError, VerificationError
from opdef.model_verify import verify_model
from opdef.node import TensorType
from opdef.verify import value_types_of_graph

F32 = TensorProto.FLOAT
MS = "com.microsoft"


DRIVER = make_oplower_artifacts_driver()


def _plain(t: TensorType | None) -> TensorType | None:
    """onnx's inference names an unknown dim it makes ``unk__<n>`` (unique, so it matches nothing): unknown."""
    if t is None or t.shape is None:
        return t
    return dataclasses.replace(t, shape=tuple(None if isinstance(d, str) and d.startswith("unk__") else d
                                              for d in t.shape))


@pytest.mark.parametrize("name", DRIVER.architectures())
def test_every_custom_node_sees_the_types_the_whole_model_check_gives_it(name):
    training = DRIVER.build(name).training
    full = verify_model(artifacts_module._inference_copy(training))
    types = verify_generated(training)
    assert types is not None, "the declared types did not suit a generated training model"
    assert generated_check._declared_types(training.graph) == value_types_of_graph(training.graph)
    assert full, "no custom node to check"
    for r in full:
        pairs = list(zip(r.inputs, r.input_types, strict=True)) + list(zip(r.outputs, r.output_types, strict=True))
        for value, t in pairs:
            if value:
                assert _plain(types.get(value)) == _plain(t), (r.op_type, r.node_name, value)


def _cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"], transB=1)]
    params = {"w": rng.standard_normal((4, 3, 3, 3)), "b": rng.standard_normal(4),
              "w2": rng.standard_normal((4, 4, 3, 3)), "fc": rng.standard_normal((5, 4)), "fcb": np.zeros(5)}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [2, 3, 6, 6])],
                              [helper.make_tensor_value_info("y", F32, [2, 5])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _break_rule(monkeypatch, op_type: str, damage) -> None:
    """The gradient rule of ``op_type`` emits its nodes, then ``damage`` changes the last custom one."""
    key = ("", op_type)
    rule = gradient_registry._RULES[key]

    def emit(ctx):
        before = len(ctx.f.nodes)
        rule.emit(ctx)
        custom = [n for n in ctx.f.nodes[before:] if n.domain == MS]
        damage(custom[-1])

    monkeypatch.setitem(gradient_registry._RULES, key, dataclasses.replace(rule, emit=emit))


def _bogus_attribute(node):
    node.attribute.append(helper.make_attribute("colour", 1))


def _wrong_attribute_type(node):
    node.attribute.append(helper.make_attribute("strides", [1.0, 1.0]))  # ConvGrad's strides are ints


def _missing_input(node):
    del node.input[1:]


def _extra_input(node):
    node.input.append(node.input[0])


def _full_check_message(monkeypatch, model, **kwargs) -> str:
    """The message build_artifacts gave before: the whole-model check (verify_model) of the same training model."""
    training = build_artifacts(model, verify=False, **kwargs).training
    with pytest.raises((VerificationError, OplowerError)) as info:
        verify_model(artifacts_module._inference_copy(training))
    return str(info.value)


@pytest.mark.parametrize(("op_type", "damage", "expect"), [
    ("Relu", _bogus_attribute, "unknown attribute 'colour'"),
    ("Relu", _missing_input, "required input"),
    ("Relu", _extra_input, "has 3 inputs"),
    ("Conv", _wrong_attribute_type, "attribute 'strides' is FLOATS"),
    ("Conv", _missing_input, "required input"),
])
def test_a_wrong_emitted_node_is_caught_with_the_same_one_line_error(monkeypatch, op_type, damage, expect):
    _break_rule(monkeypatch, op_type, damage)
    model = _cnn()
    kwargs = {"requires_grad": ["w", "b", "w2", "fc", "fcb"], "loss": LossType.CrossEntropyLoss}
    with pytest.raises(OplowerError) as info:
        build_artifacts(model, **kwargs)
    message = str(info.value)
    assert "\n" not in message and expect in message
    assert message.startswith("the generated training model fails verification (a gradient rule's bug")
    full = _full_check_message(monkeypatch, model, **kwargs)
    assert message.endswith(full), (message, full)


def test_an_undeclared_input_is_typed_by_the_standard_nodes_that_compute_it(monkeypatch):
    """A rule that feeds a custom node a value it computes with standard ops (undeclared): typed by onnx's per-node
    inference, so a wrong element type there is caught as the whole-model check catches it."""
    key = ("", "Relu")
    rule = gradient_registry._RULES[key]

    def emit(ctx):
        shape = ctx.f.node1("Shape", [ctx.x(0)], ctx.f.fresh("shape_of_x"))
        cast = ctx.f.node1("Cast", [shape], to=TensorProto.INT64)
        ctx.set_dx(0, ctx.f.node1("ReluGrad", [ctx.dy(0), cast], domain=MS))

    monkeypatch.setitem(gradient_registry._RULES, key, dataclasses.replace(rule, emit=emit))
    kwargs = {"requires_grad": ["w", "b", "w2", "fc", "fcb"], "loss": LossType.CrossEntropyLoss}
    training = build_artifacts(_cnn(), verify=False, **kwargs).training
    casts = [n.output[0] for n in training.graph.node if n.op_type == "Cast" and n.input[0].startswith("shape_of_x")]
    assert len(casts) == 2 and not set(casts) & {vi.name for vi in training.graph.value_info}  # undeclared
    with pytest.raises(VerificationError) as cheap:
        verify_generated(training)
    with pytest.raises(VerificationError) as full:
        verify_model(artifacts_module._inference_copy(training))
    assert str(cheap.value) == str(full.value)
    assert "X has element type s64" in str(cheap.value)
    # without the per-node inference of the Shape and Cast the value is unknown and the node would pass
    monkeypatch.setattr(generated_check, "_undeclared_cone", lambda *args: set())
    assert verify_generated(training) is not None


@pytest.fixture
def verified(monkeypatch) -> list[str]:
    """The op type of every node generated_check verifies (infer_node's calls), in order."""
    calls: list[str] = []
    real = generated_check.infer_node

    def counting(node, types, registry=None):
        calls.append(node.op_type)
        return real(node, types, registry)

    monkeypatch.setattr(generated_check, "infer_node", counting)
    return calls


def test_identical_nodes_are_verified_once_and_a_different_one_still_is(verified):
    """The memo: the second ReluGrad of the same types is not verified again; a damaged one differs and fails."""
    calls = verified
    model = _cnn()
    training = build_artifacts(model, requires_grad=["w", "b", "w2", "fc", "fcb"], loss=LossType.CrossEntropyLoss,
                               verify=False).training
    memo = {}
    verify_generated(training, memo=memo)
    relu_grads = [n for n in training.graph.node if n.op_type == "ReluGrad"]
    conv_grads = [n for n in training.graph.node if n.op_type == "ConvGrad"]
    assert len(relu_grads) == 2 and calls.count("ReluGrad") == 1  # both [2, 4, 6, 6]
    assert len(conv_grads) == 2 and calls.count("ConvGrad") == 2  # different weights
    assert calls.count("InPlaceAccumulatorV2") == 5  # five parameters of five shapes
    # the same signatures again: nothing to verify
    calls.clear()
    verify_generated(training, memo=memo)
    assert calls == []
    # a node that differs only in an attribute is verified on its own and fails, every time
    relu_grads[-1].attribute.append(helper.make_attribute("colour", 1))
    for _ in range(2):
        with pytest.raises(VerificationError, match="unknown attribute 'colour'"):
            verify_generated(training, memo=memo)
    assert calls == ["ReluGrad", "ReluGrad"]


def test_the_process_memo_is_per_registry(verified, tmp_path):
    """By default the verified signatures are kept for the process, one memo per registry: a second registry (other
    specs) verifies everything again."""
    import shutil

    from opdef.registry import build_registry, default_spec_dir, load_schemas

    calls = verified
    training = build_artifacts(_cnn(), requires_grad=["w", "b", "w2", "fc", "fcb"], loss=LossType.CrossEntropyLoss,
                               verify=False).training
    verify_generated(training)
    verify_generated(training)
    assert calls.count("ConvGrad") <= 2  # the second run (and any earlier test's) reused the process memo
    calls.clear()
    verify_generated(training, load_schemas())
    assert calls == []
    other = build_registry(shutil.copytree(default_spec_dir(), tmp_path / "specs"))
    verify_generated(training, other)
    assert calls.count("ConvGrad") == 2


def test_a_model_with_a_subgraph_goes_through_the_whole_model_check():
    then = helper.make_graph([helper.make_node("Identity", ["a"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F32, [2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["o"], then_branch=then, else_branch=then),
         helper.make_node("ReluGrad", ["o", "a"], ["g"], domain=MS)], "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), helper.make_tensor_value_info("a", F32, [2])],
        [helper.make_tensor_value_info("g", F32, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    assert verify_generated(model) is None
