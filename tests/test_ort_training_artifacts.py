"""generate_artifacts' training graphs (onnxruntime-training 1.19.2; a CNN with BatchNorm, MaxPool, AvgPool,
grouped and depthwise Convs and CrossEntropyLoss, and MLPs with MSE, BCEWithLogits and L1 losses; copied
byte-identical from issue12a's fixtures) with every gradient op lowered and run on plain onnxruntime: the loss
and every parameter gradient of one step against onnxruntime-training's own (raw_train_step1.npz).

InPlaceAccumulatorV2 (the gradient accumulation) is another branch's lowering: here each one is cut off and
the gradient it would add goes out as a graph output; with zero buffers the recorded updated buffer is it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from lowering.passes import lower_model
from runtime.session import run_model

ARTIFACTS = Path(__file__).resolve().parent / "fixtures" / "ort_training" / "artifacts"
NAMES = ("cnn", "mlp", "mlp_bce", "mlp_l1")
ACCUMULATOR = ("com.microsoft", "InPlaceAccumulatorV2")


def _gradients_exposed(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The model without its accumulators: {recorded updated-buffer name: gradient value now a graph output}."""
    graph = model.graph
    kept, exposed = [], {}
    for node in graph.node:
        if (node.domain, node.op_type) == ACCUMULATOR:
            exposed[f"{node.input[0]}.updated"] = node.input[1]
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    accumulated = {n for n in exposed.values()}
    outputs = [o for o in graph.output if not o.name.endswith(".accumulation.out")]
    del graph.output[:]
    graph.output.extend(outputs)
    graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in sorted(accumulated))
    buffers = {name.removesuffix(".updated") for name in exposed} | {"lazy_reset_grad"}
    inputs = [i for i in graph.input if i.name not in buffers]
    del graph.input[:]
    graph.input.extend(inputs)
    return model, exposed


@pytest.mark.parametrize("name", NAMES)
def test_one_training_step_matches_onnxruntime_training(name):
    folder = ARTIFACTS / name
    meta = json.loads((folder / "meta.json").read_text())
    model, exposed = _gradients_exposed(onnx.load(str(folder / "training_model.onnx")))
    lowered = lower_model(model)
    left = {(n.domain or "ai.onnx", n.op_type) for n in lowered.graph.node if n.domain not in ("", "ai.onnx")}
    assert not left, f"not lowered: {left}"
    data = dict(np.load(folder / "data.npz"))
    data[meta["labels_input"]] = data.pop("labels")  # the graph's own name for the labels
    feeds = data | dict(np.load(folder / "initial_params.npz"))
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in lowered.graph.input}}
    got = run_model(lowered, feeds)
    recorded = np.load(folder / "raw_train_step1.npz")
    loss_name = lowered.graph.output[0].name
    loss, want_loss = float(got[loss_name]), float(recorded[loss_name])
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
    assert len(exposed) == len(meta["trainable_params"])
    # every gradient within 1e-4 of its largest entry (measured: <= 1e-6); one that is zero up to rounding
    # (the bias of a layer right before BatchNorm: entries ~1e-9 on both sides, differing by up to 2e-8) is
    # held to 1e-6 of the model's largest gradient entry instead of to its own noise
    floor = 1e-2 * max(float(np.max(np.abs(recorded[buffer]))) for buffer in exposed)
    for buffer, gradient in exposed.items():
        want = recorded[buffer]
        err = float(np.max(np.abs(got[gradient] - want))) / max(float(np.max(np.abs(want))), floor)
        assert err <= 1e-4, f"{gradient}: {err:.3g} of the largest entry"
