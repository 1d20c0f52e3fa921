"""``--target portable``: the lowering every ONNX runtime runs, beside the onnxruntime-tuned one (issue 14).

Every dialect, both layouts and each element type, lowered for both targets, run in onnxruntime, OpenVINO,
tract and ``onnx.reference.ReferenceEvaluator`` and compared with the float64 reference (runtime/reference.py,
through the examples' expected values and runtime.reference_eval for the forward op). What a runtime cannot
run is stated as such (an expected, asserted refusal), never skipped:
- tract refuses BatchNormalization whose parameters are computed ("Params are not const") and the training
  mode's three outputs ("Op says 1, node says 3"), which the onnxruntime target emits: the portable target
  exists for that;
- tract has no bf16 tensors at all: a bf16 model is refused at load, whatever the target.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lowering import lower_model
from lowering.builder import NodeBuilder
from lowering.demo.examples import BnCase, build_example
from lowering.numerics import compare
from lowering.rules import (
    PORTABLE_OPS,
    TARGETS,
    LoweringOptions,
    LoweringRequest,
    register_rule,
    rule_targets,
    unregister_rule,
)
from opdef.errors import LoweringError
from opdef.registry import load_schemas
from runtime.reference_eval import evaluate
from runtime.session import run_model

F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
ONEDNN = ("onednn", "BatchNormTrainingBackward")
OPSET_V0 = ("onednn", "BatchNormTrainingBackprop")
NGRAPH = ("ngraph", "BatchNormTrainingBackprop")
DIRECTML = ("directml", "BATCH_NORMALIZATION_GRAD")
MS = "com.microsoft"
MS_GRAD = (MS, "BatchNormalizationGrad")
RUNTIMES = ("onnxruntime", "openvino", "tract", "reference")
DTYPES = {"f32": F32, "f16": F16, "bf16": BF16}


def _cases(dtype: str) -> list[BnCase]:
    """Backward nodes of every dialect that has the element type. 14x14 NCX reaches the onnxruntime target's
    Conv forms (>= 196 elements per sample and channel), small NXC its MatMul sums and affine
    BatchNormalization; the DirectML case reduces over axes 0 and 2 only (the generic path)."""
    io = DTYPES[dtype]
    stat = F32 if dtype == "f16" else io  # oneDNN: stats f32 for f16 src, bf16 (or f32) for bf16 src
    cases = [
        BnCase(ONEDNN, (2, 4, 14, 14), layout="NCX", io_type=io, stat_type=stat, name="onednn_ncx", seed=1),
        BnCase(ONEDNN, (2, 6, 6, 4), layout="NXC", io_type=io, stat_type=stat, name="onednn_nxc", seed=2),
        BnCase(NGRAPH, (2, 4, 5), io_type=io, name="ngraph", seed=4),
        BnCase(MS_GRAD, (2, 4, 5, 5), io_type=io, name="ms_grad", seed=5),
        BnCase(OPSET_V0, (2, 4, 6, 6), layout="NXC", io_type=io, stat_type=stat, name="opset_v0", seed=3),
    ]
    if dtype != "bf16":  # DirectML: f32 and f16 only
        cases += [BnCase(DIRECTML, (2, 4, 3, 3), io_type=io, name="directml", seed=6),
                  BnCase(DIRECTML, (2, 4, 3, 3), io_type=io, reduce_axes=(0, 2), name="directml_axes", seed=7)]
    return cases


def _add_forward(model: onnx.ModelProto, feeds: dict, dtype: str) -> list[str]:
    """Append a com.microsoft BatchNormInternal (training mode, every output) to ``model``; its outputs."""
    io = DTYPES[dtype]
    stat = F32 if dtype != "f32" else io
    rng = np.random.default_rng(8)
    shape, c = (2, 4, 5, 5), 4
    vi = helper.make_tensor_value_info
    arrays = {"fw.X": (rng.standard_normal(shape) * 1.5 + 0.5, io, shape),
              "fw.scale": (rng.uniform(0.5, 1.5, c), io, [c]), "fw.B": (rng.standard_normal(c), io, [c]),
              "fw.mean": (rng.standard_normal(c), stat, [c]), "fw.var": (rng.uniform(0.5, 2, c), stat, [c])}
    for name, (value, elem, dims) in arrays.items():
        model.graph.input.append(vi(name, elem, dims))
        dtype_np = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16}[elem]
        feeds[name] = value.astype(np.float32).astype(dtype_np)
    outputs = ["fw.Y", "fw.running_mean", "fw.running_var", "fw.saved_mean", "fw.saved_inv_std"]
    model.graph.node.append(helper.make_node("BatchNormInternal", list(arrays), outputs, name="fw", domain=MS,
                                             epsilon=1e-5, momentum=0.9, training_mode=1))
    model.graph.output.extend([vi(outputs[0], io, shape)] + [vi(n, stat, [c]) for n in outputs[1:]])
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    return outputs


_MODELS: dict = {}


def _example(dtype: str):
    """(original model, feeds, float64 expected, elem type per output) for ``dtype``; built once."""
    if dtype not in _MODELS:
        registry = load_schemas()
        example = build_example(_cases(dtype), registry)
        model, feeds = example.model, dict(example.feeds)
        forward = _add_forward(model, feeds, dtype)
        expected = dict(example.expected)
        # training mode updates the running statistics in place: '<input>.updated' outputs (DESIGN.md section 9)
        updated = [f"{name}.updated" for name in model.graph.node[-1].input[3:5]]
        expected.update(evaluate(model, feeds, forward + updated, registry=registry, exact=True))
        types = dict(example.output_types)
        types.update({o.name: o.type.tensor_type.elem_type for o in model.graph.output if o.name in forward})
        types.update({name: types[forward[1]] for name in updated})
        _MODELS[dtype] = (model, feeds, expected, types)
    return _MODELS[dtype]


def _lowered(dtype: str, target: str) -> onnx.ModelProto:
    key = (dtype, target)
    if key not in _MODELS:
        _MODELS[key] = lower_model(_example(dtype)[0], target=target)
    return _MODELS[key]


# -- the runtimes --------------------------------------------------------------------------------------------

def _run_openvino(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    import openvino as ov

    core = ov.Core()
    # f32 stays f32: OpenVINO's CPU plugin may otherwise compute f32 graphs in bf16 where the CPU has it
    compiled = core.compile_model(core.read_model(model=model.SerializeToString(), weights=b""), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    for port in compiled.inputs:
        value = feeds[port.get_any_name()]
        if value.dtype == ml_dtypes.bfloat16:  # numpy has no bf16: hand OpenVINO the bits
            tensor = ov.Tensor(ov.Type.bf16, value.shape)
            tensor.data.view(np.uint16)[...] = value.view(np.uint16)
        else:
            tensor = ov.Tensor(np.ascontiguousarray(value))
        request.set_tensor(port.get_any_name(), tensor)
    request.infer()
    out = {}
    for port in compiled.outputs:
        tensor = request.get_tensor(port.get_any_name())
        data = np.array(tensor.data)
        if tensor.element_type == ov.Type.bf16:  # its .data shows bf16 bits under another 2-byte dtype
            data = data.view(np.uint16).view(ml_dtypes.bfloat16)
        out[port.get_any_name()] = data
    return out


def _run_tract(model: onnx.ModelProto, feeds: dict, tmp_path: Path) -> dict[str, np.ndarray]:
    import tract

    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    runnable = tract.onnx().load(str(path)).into_model().into_runnable()
    results = runnable.run([feeds[i.name] for i in model.graph.input])
    return {o.name: results[i].to_numpy() for i, o in enumerate(model.graph.output)}


def _run_reference(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(names, feeds), strict=True))


def _run(runtime: str, model: onnx.ModelProto, feeds: dict, tmp_path: Path) -> dict[str, np.ndarray]:
    if runtime == "onnxruntime":
        return run_model(model, feeds)
    if runtime == "openvino":
        return _run_openvino(model, feeds)
    if runtime == "tract":
        return _run_tract(model, feeds, tmp_path)
    return _run_reference(model, feeds)


def _refusal(runtime: str, target: str, dtype: str) -> str | None:
    """What a runtime is known to refuse (asserted below), or None: it must run and match."""
    if runtime == "tract" and dtype == "bf16":
        return "Bfloat16"  # no bf16 tensors in tract (0.23)
    if runtime == "tract" and target == "onnxruntime":
        # BatchNormalization with computed scale/bias/mean/variance, or in training mode (BatchNormInternal)
        return "Params are not const|Op says 1, node says 3"
    return None


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_every_dialect_runs_and_matches_float64(runtime, target, dtype, tmp_path):
    model, feeds, expected, types = _example(dtype)
    lowered = _lowered(dtype, target)
    refused = _refusal(runtime, target, dtype)
    if refused is not None:
        with pytest.raises(Exception, match=refused):
            _run(runtime, lowered, feeds, tmp_path)
        return
    got = _run(runtime, lowered, feeds, tmp_path)
    assert set(got) == set(expected)
    failures = []
    for name, want in expected.items():
        result = compare(name, want, got[name], types[name])
        if not result.ok:
            failures.append(result.describe())
    assert not failures, f"{runtime}/{target}/{dtype}: " + "; ".join(failures)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_portable_output_uses_portable_ops_only(dtype):
    """No Conv/ConvTranspose (runtime-tensor weights) and no BatchNormalization (computed parameters); the
    onnxruntime target of the same model does use them (so the check can fail)."""
    portable = _lowered(dtype, "portable")
    onnx.checker.check_model(portable, full_check=True)
    ops = {n.op_type for n in portable.graph.node}
    assert ops <= PORTABLE_OPS, sorted(ops - PORTABLE_OPS)
    assert all(n.domain == "" for n in portable.graph.node)
    tuned = {n.op_type for n in _lowered(dtype, "onnxruntime").graph.node}
    assert {"Conv", "BatchNormalization"} & tuned


@pytest.mark.parametrize("opset", [12, 13, 18])
@pytest.mark.parametrize("layout", ["NCX", "NXC"])
def test_portable_staged_sums_at_every_opset(opset, layout):
    """32,768 elements per channel (the staged sums; 16,384 per sample, where onnxruntime's target uses Conv):
    portable ops only, accepted by the checker for the model's own opset, within f32 tolerance."""
    shape = (2, 3, 128, 128) if layout == "NCX" else (2, 128, 128, 3)
    example = build_example([BnCase(ONEDNN, shape, layout=layout, name="bn")], load_schemas(), opset=opset)
    lowered = lower_model(example.model, target="portable")
    onnx.checker.check_model(lowered, full_check=True)
    assert {n.op_type for n in lowered.graph.node} <= PORTABLE_OPS
    got = run_model(lowered, example.feeds)
    for name, want in example.expected.items():
        result = compare(name, want, got[name], F32)
        assert result.ok, result.describe()


def test_symbolic_dims_portable():
    """A symbolic batch and spatial dims (no static count): the runtime-shape paths stay portable."""
    cases = [BnCase(ONEDNN, (3, 4, 5, 6), layout="NCX", symbolic=(0, 2, 3), name="ncx"),
             BnCase(ONEDNN, (3, 5, 6, 4), layout="NXC", symbolic=(0, 1, 2), name="nxc")]
    example = build_example(cases, load_schemas())
    lowered = lower_model(example.model, target="portable")
    assert {n.op_type for n in lowered.graph.node} <= PORTABLE_OPS
    for got in (run_model(lowered, example.feeds), _run_reference(lowered, example.feeds)):
        for name, want in example.expected.items():
            result = compare(name, want, got[name], F32)
            assert result.ok, result.describe()


# -- the target option and the rules -------------------------------------------------------------------------

def test_bundled_rules_declare_both_targets():
    assert rule_targets("batch_norm_backward") == TARGETS
    assert rule_targets("batch_norm_internal") == TARGETS


def test_unknown_target_is_refused():
    with pytest.raises(ValueError, match="target must be one of"):
        LoweringOptions(target="tensorrt")
    with pytest.raises(ValueError, match="target must be one of"):
        lower_model(_example("f32")[0], target="tensorrt")


def test_a_rule_without_a_portable_form_names_the_node(monkeypatch):
    """A rule registered for onnxruntime only (the default) raises a LoweringError naming the node under
    ``target="portable"``, and still lowers for onnxruntime."""
    import dataclasses

    registry = load_schemas()
    entry = registry.get(*NGRAPH)
    only_ort = dataclasses.replace(entry, binding=dataclasses.replace(entry.binding, rule="test_ort_only_rule"))
    monkeypatch.setitem(registry._entries, NGRAPH, only_ort)

    @register_rule("test_ort_only_rule")
    def ort_only(builder: NodeBuilder, request: LoweringRequest) -> None:
        for role in ("diff_src", "diff_gamma", "diff_beta"):
            if request.output(role):
                source = "src" if role == "diff_src" else "mean"
                builder.op1("Identity", [request.input(source)], request.output(role))

    try:
        model = build_example([BnCase(NGRAPH, (2, 3, 4), name="ng7")], registry).model
        assert rule_targets("test_ort_only_rule") == ("onnxruntime",)
        lower_model(model, registry=registry)  # fine for onnxruntime
        with pytest.raises(LoweringError, match=r"ngraph BatchNormTrainingBackprop 'ng7': no portable lowering"):
            lower_model(model, registry=registry, target="portable")
    finally:
        unregister_rule("test_ort_only_rule")


def test_register_rule_checks_its_targets():
    with pytest.raises(ValueError, match="targets of rule"):
        register_rule("test_bad_targets", targets=("tensorrt",))
    with pytest.raises(ValueError, match="targets of rule"):
        register_rule("test_bad_targets", targets=())


def test_replay_keeps_targets_apart():
    """Two nodes with one lowering key: the second is a copy of the first's lowering; with the portable
    target both copies are portable (the target is part of the replay key and of the options)."""
    cases = [BnCase(ONEDNN, (2, 4, 14, 14), name="a", seed=1), BnCase(ONEDNN, (2, 4, 14, 14), name="b", seed=2)]
    example = build_example(cases, load_schemas())
    portable = lower_model(example.model, target="portable")
    tuned = lower_model(example.model)
    assert {n.op_type for n in portable.graph.node} <= PORTABLE_OPS
    assert sum(n.op_type == "Conv" for n in tuned.graph.node) == 4  # each copy: the dot and the depthwise Conv
    got = run_model(portable, example.feeds)
    for name, want in example.expected.items():
        assert compare(name, want, got[name], F32).ok


def test_onnx_ir_pass_takes_the_target():
    import onnx_ir as ir

    from lowering import LowerCustomOpsPass

    model = ir.serde.deserialize_model(_example("f32")[0])
    result = ir.passes.PassManager([LowerCustomOpsPass(target="portable")])(model)
    ops = {node.op_type for node in result.model.graph}
    assert ops <= PORTABLE_OPS and "BatchNormTrainingBackward" not in ops


@pytest.mark.parametrize("command", ["lower", "run", "demo"])
def test_cli_target(command, tmp_path, capsys):
    from lowering.cli import main

    model, feeds, _, _ = _example("f32")
    source = tmp_path / "m.onnx"
    onnx.save(model, source)
    if command == "lower":
        out = tmp_path / "out.onnx"
        assert main(["lower", str(source), "-o", str(out), "--target", "portable", "--verify"]) == 0
        assert {n.op_type for n in onnx.load(out).graph.node} <= PORTABLE_OPS
    elif command == "run":
        inputs = tmp_path / "in.npz"
        np.savez(inputs, **feeds)
        assert main(["run", str(source), "--inputs", str(inputs), "--target", "portable", "--check"]) == 0
        assert "FAIL" not in capsys.readouterr().out
    else:
        assert main(["demo", "--target", "portable"]) == 0
        assert "target portable" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([command, *(["x.onnx", "-o", "y.onnx"] if command == "lower" else []),
              *(["x.onnx", "--inputs", "x.npz"] if command == "run" else []), "--target", "tensorrt"])
    assert exc.value.code == 2


def test_a_rule_that_claims_portability_but_emits_conv_is_caught(monkeypatch):
    """The pass checks what a rule emits for the portable target against PORTABLE_OPS."""
    import dataclasses

    registry = load_schemas()
    entry = registry.get(*NGRAPH)
    liar = dataclasses.replace(entry, binding=dataclasses.replace(entry.binding, rule="test_liar_rule"))
    monkeypatch.setitem(registry._entries, NGRAPH, liar)

    @register_rule("test_liar_rule", targets=TARGETS)
    def claims_portable(builder: NodeBuilder, request: LoweringRequest) -> None:
        src = request.input("src")
        for role in ("diff_src", "diff_gamma", "diff_beta"):
            if request.output(role):
                source = builder.op1("Conv", [src, src]) if role == "diff_src" else request.input("mean")
                builder.op1("Identity", [source], request.output(role))

    try:
        model = build_example([BnCase(NGRAPH, (2, 3, 4), name="ng8")], registry).model
        with pytest.raises(LoweringError, match=r"'ng8': the portable lowering emitted Conv"):
            lower_model(model, registry=registry, target="portable")
    finally:
        unregister_rule("test_liar_rule")


def test_cli_lower_portable_without_a_portable_rule_is_one_line_exit_1(monkeypatch, tmp_path, capsys):
    """`oplower lower --target portable` on a node whose rule has no portable form: exit 1, one line naming
    file, node and problem, no output file."""
    import dataclasses

    from lowering.cli import main

    registry = load_schemas()  # the CLI's registry: parsed once per directory
    entry = registry.get(*NGRAPH)
    only_ort = dataclasses.replace(entry, binding=dataclasses.replace(entry.binding, rule="test_ort_only_cli"))
    monkeypatch.setitem(registry._entries, NGRAPH, only_ort)

    @register_rule("test_ort_only_cli")
    def ort_only(builder: NodeBuilder, request: LoweringRequest) -> None:
        raise AssertionError("never called for the portable target")

    try:
        source, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
        onnx.save(build_example([BnCase(NGRAPH, (2, 3, 4), name="ng9")], registry).model, source)
        assert main(["lower", str(source), "-o", str(out), "--target", "portable"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(source) in err[0] and "'ng9': no portable lowering" in err[0], err
        assert "Traceback" not in err[0] and not out.exists()
    finally:
        unregister_rule("test_ort_only_cli")
