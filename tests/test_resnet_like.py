"""A ResNet-50-shaped training graph end to end: the 53 batch-norm backward nodes of ResNet-50 (12 shapes),
batch symbolic, NCX and NXC, f32 and bf16, each node's diff_src either a graph output or read by a node (as
in a training graph), its parameter gradients graph outputs.

It exercises together what the unit tests take one at a time: copies of a lowering for nodes with the same
key (lowering/passes.py), the Conv forms with a symbolic batch, staged sums
(lowering/rules/batch_norm_backward/emit.py). Checked against the float64 reference evaluator of the un-lowered
model (runtime/reference_eval.py), run at batch 1.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lowering.numerics import compare
from lowering.passes import lower_model_with_report
from runtime.reference_eval import evaluate
from runtime.session import run_model

F32, BF16 = TensorProto.FLOAT, TensorProto.BFLOAT16
NP = {F32: np.float32, BF16: ml_dtypes.bfloat16}


def resnet50_layers() -> list[tuple[int, int]]:
    """(channels, spatial size) of ResNet-50's batch-norm layers in order (v1.5: stride on the 3x3 conv)."""
    layers = [(64, 112)]
    size = 56
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        out = size // stride
        for block in range(blocks):
            first = block == 0
            layers += [(width, size if first else out), (width, out), (4 * width, out)]
            if first:
                layers.append((4 * width, out))  # the downsample branch
        size = out
    return layers


def _model(layout: str, io_type: int) -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    nodes, inputs, outputs = [], [], []
    for i, (c, s) in enumerate(resnet50_layers()):
        shape = ["n", c, s, s] if layout == "NCX" else ["n", s, s, c]
        names = [f"x{i}", f"dy{i}", f"m{i}", f"v{i}", f"g{i}"]
        inputs += [vi(names[0], io_type, shape), vi(names[1], io_type, shape)]
        inputs += [vi(name, F32, [c]) for name in names[2:]]
        outs = [f"dx{i}", f"dg{i}", f"db{i}"]
        nodes.append(helper.make_node("BatchNormTrainingBackward", names, outs, name=f"bn{i}", domain="onednn",
                                      epsilon=1e-5, data_format=layout))
        outputs += [vi(outs[1], F32, [c]), vi(outs[2], F32, [c])]
        if i % 2:  # read by a node, as in a training graph
            nodes.append(helper.make_node("Identity", [outs[0]], [f"r{i}"], name=f"read{i}"))
            outputs.append(vi(f"r{i}", io_type, shape))
        else:
            outputs.append(vi(outs[0], io_type, shape))
    graph = helper.make_graph(nodes, "resnet50_bn_backward", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)])
    model.ir_version = 10
    return model


def _feeds(model: onnx.ModelProto, io_type: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value or 1 for d in value.type.tensor_type.shape.dim]  # batch 1
        a = rng.standard_normal(dims)
        if value.name.startswith("v"):
            a = np.abs(a) + 0.5
        feeds[value.name] = a.astype(np.float32 if len(dims) == 1 else NP[io_type])
    return feeds


def test_layers():
    layers = resnet50_layers()
    assert len(layers) == 53 and len(set(layers)) == 12


@pytest.mark.parametrize("io_type", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["NCX", "NXC"])
def test_resnet50_shaped_graph(layout, io_type, monkeypatch):
    from lowering import passes

    copies = []
    real_replay = passes._replay
    monkeypatch.setattr(passes, "_replay", lambda *args: copies.append(args[1].name) or real_replay(*args))
    model = _model(layout, io_type)
    lowered, report = lower_model_with_report(model)
    # 12 shapes; diff_src a graph output or not splits a shape's key in two: at most 24 lowered afresh
    assert len(copies) >= 53 - 24
    onnx.checker.check_model(lowered, full_check=True)
    assert report.lowered == {"onednn::BatchNormTrainingBackward": 53}
    assert {n.domain for n in lowered.graph.node} == {""}
    if layout == "NCX":  # the depthwise Conv forms from 14x14 up: in place into a*dy where diff_src is read
        # by a node (f32) or a Cast (bf16); added to dy, then scaled by a, where f32 diff_src is a graph output
        convs = [n for n in lowered.graph.node if n.op_type == "Conv"]
        wide = {f"bn{i}" for i, (c, s) in enumerate(resnet50_layers()) if s * s >= 196}
        internal = {f"bn{i}" for i, (c, s) in enumerate(resnet50_layers()) if s * s >= 196
                    and (i % 2 or io_type == BF16)}
        assert {n.name.split("/")[0] for n in convs} == wide
        adds = {n.output[0] for n in lowered.graph.node if n.op_type == "Add"
                and any(c.output[0] in n.input for c in convs)}
        scaled_last = {n.name.split("/")[0] for n in lowered.graph.node if n.op_type == "Mul" and adds & set(n.input)}
        assert scaled_last == wide - internal
    feeds = _feeds(model, io_type)
    got = run_model(lowered, feeds)
    want = evaluate(model, feeds)
    types = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    bad = [r.describe() for name in want if not (r := compare(name, want[name], got[name], types[name])).ok]
    assert not bad, "\n".join(bad[:5])
