"""Issue 31, the train-step model's update with fewer kernels: each form is taken where it applies and gives the
other form's bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.rules.training_updates import AdamW
from lowering.training.train_step import train_step

ARTIFACTS = Path(__file__).resolve().parent / "fixtures" / "ort_training" / "artifacts"
F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    model.ir_version = 8  # onnxruntime 1.23 (Python 3.10) reads up to IR 11; onnx's helpers write the newest
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _update_ops(step) -> list[str]:
    return [n.op_type for n in step.model.graph.node if n.name.startswith("train_step/")]


@pytest.mark.parametrize("opset", [12, 17])
@pytest.mark.parametrize("mode, correct_bias", [(1, 1), (0, 1), (1, 0)])
def test_split_step_scalars_give_the_sliced_forms_bits(opset, mode, correct_bias):
    """The bias corrections cut by one Split (the flat state form) are the two Slices' values: every scalar bit for
    bit over steps 1..400 and a few large ones."""
    settings = AdamW(float(np.float32(0.9)), float(np.float32(0.999)), float(np.float32(1e-8)), 0.01, mode,
                     correct_bias)
    graph = helper.make_graph([], "scalars", [helper.make_tensor_value_info("learning_rate", F32, [1]),
                                              helper.make_tensor_value_info("step", I64, [1])], [])
    b = NodeBuilder(opset, "s", lambda name: False, into=graph.node)
    for split in (False, True):
        s = settings.step_scalars(b, "learning_rate", "step", stacked=True, split=split)
        for name in ("alpha_correction", "beta_correction", "lr_corrected", "lr_decay"):
            out = f"{name}.{split}"
            b.op1("Identity", [getattr(s, name)], out)
            graph.output.append(helper.make_tensor_value_info(out, F32, None))
    ops = [n.op_type for n in graph.node]
    assert ops.count("Split") == correct_bias and ops.count("Slice") == 2 * correct_bias
    session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
    for t in [*range(1, 401), 12345, 10**6, 2**40]:
        for lr in (1e-3, 0.0123):
            out = session.run(None, {"learning_rate": np.array([lr], np.float32), "step": np.array([t], np.int64)})
            for sliced, split in zip(out[:4], out[4:], strict=True):
                assert sliced.shape == split.shape and sliced.tobytes() == split.tobytes(), t


@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
def test_flat_state_cuts_the_corrections_by_one_split(target):
    """The flat state form (what Trainer runs): the corrections by a Split of their own, no Slice (the portable
    target: two Slices, it has no Split); the per-parameter form keeps the Slices."""
    flat = _update_ops(train_step(ARTIFACTS / "cnn", target=target, flat_state=True))
    each = _update_ops(train_step(ARTIFACTS / "cnn", target=target))
    if target == "onnxruntime":
        assert flat.count("Split") == 2 and flat.count("Slice") == 0  # the parameters, the corrections
        assert each.count("Slice") == 2
    else:
        assert flat.count("Split") == each.count("Split") == 0 and flat.count("Slice") > 2


# -- the flat state's views of the training graph's axis-0 Split / Concat chains ---------------------------------

def _trainer_run(directory: Path, steps: int) -> tuple[list[float], dict[str, np.ndarray], list[np.ndarray]]:
    import json

    from lowering.training.trainer import Trainer, initial_parameters, lower_artifacts

    meta = json.loads((directory / "meta.json").read_text())
    models = lower_artifacts(directory)
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")))
    data = dict(np.load(directory / "data.npz"))
    batch = {models.step.interface.data[0]: data["input"], meta["labels_input"]: data["labels"]}
    trainer = Trainer(models, start, learning_rate=meta["learning_rate"], threads=1)
    losses = [trainer.step(batch) for _ in range(steps)]
    return losses, trainer.params, [*trainer.first_moments, *trainer.second_moments]


def _assert_same_bits(ran, reference) -> None:
    """Two ``_trainer_run`` results: the same losses, parameters and moments, bit for bit."""
    assert ran[0] == reference[0]
    for p in reference[1]:
        assert ran[1][p].tobytes() == reference[1][p].tobytes(), p
    for got, want in zip(ran[2], reference[2], strict=True):
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", ["lstm", "lstm2", "gru"])
def test_recurrent_gate_reorders_cut_from_the_flat_state_give_the_same_bits(name, monkeypatch):
    """torch's recurrent exports reorder every weight's and bias's gates (Split, Concat, Unsqueeze) forwards and
    their gradients' backwards (Squeeze, Split, Concat): in the flat state form these chains are views of the flat
    buffers (the reordered weights one Concat of the flat Split's pieces and a Reshape; the gradients' sources
    flattened and split once), in fewer kernels, and three steps give the chains' bits."""
    import lowering.training.train_step as ts

    directory = ARTIFACTS / name
    viewed = train_step(directory, flat_state=True)
    ran = _trainer_run(directory, 3)
    monkeypatch.setattr(ts, "static_shapes", lambda model: {})  # no shapes: the chains run as they are
    plain = train_step(directory, flat_state=True)
    assert viewed.interface == plain.interface

    def kernels(step) -> list[str]:
        return [n.op_type for n in step.model.graph.node if n.op_type not in ("Constant", "Identity")]

    def reorders(step) -> list[str]:
        # the forward gate Splits of the weights and biases (fused from torch's Slices) and their gradients' Concats
        return [n.name for n in step.model.graph.node if "GatherSliceToSplitFusion" in n.name]

    assert reorders(plain) and not reorders(viewed)
    layers = 2 if name == "lstm2" else 1
    assert len(kernels(plain)) - len(kernels(viewed)) >= 10 * layers
    reference = _trainer_run(directory, 3)
    _assert_same_bits(ran, reference)


def test_a_broadcast_parameter_is_read_and_summed_flat(monkeypatch):
    """vit's cls token [1, 1, 8]: the Expand reading it reads the flat Split's [8] piece (the same broadcast), its
    gradient, the Expand's gradient ReduceSum with keepdims, is summed without them straight into the flat gradient
    (no Reshape; onnxruntime sums the same elements in the same order), and three steps give the Reshapes' bits."""
    import lowering.training.train_step as ts

    directory = ARTIFACTS / "vit"
    viewed = train_step(directory, flat_state=True)
    ran = _trainer_run(directory, 3)
    monkeypatch.setattr(ts, "static_shapes", lambda model: {})
    plain = train_step(directory, flat_state=True)

    def flat_sums(step) -> list[onnx.NodeProto]:
        concat = next(n for n in step.model.graph.node if n.name.startswith("train_step/flat_gradients"))
        producer = {o: n for n in step.model.graph.node for o in n.output}
        return [producer[i] for i in concat.input if i in producer and producer[i].op_type == "ReduceSum"
                and producer[i].name.startswith("train_step/")]

    assert flat_sums(viewed) and not flat_sums(plain)

    def expand_source(step) -> str:
        producer = {o: n for n in step.model.graph.node for o in n.output}
        expand = next(n for n in step.model.graph.node if n.op_type == "Expand" and n.name == "/Expand")
        return producer[expand.input[0]].op_type

    assert expand_source(viewed) == "Split" and expand_source(plain) == "Reshape"
    assert all(a.name != "keepdims" or a.i == 0 for n in flat_sums(viewed) for a in n.attribute)
    reference = _trainer_run(directory, 3)
    _assert_same_bits(ran, reference)


@pytest.mark.parametrize("shape, flat", [((1, 1, 8), True), ((1, 8), True), ((8, 1, 1), False), ((1, 8, 1), False),
                                         ((2, 8), False)])
def test_only_a_leading_ones_view_is_read_flat(shape, flat):
    """Only leading ones broadcast away: a channels-first [C, 1, 1] scale read as [C] would broadcast along the
    last axis instead."""
    import lowering.training.train_step as ts

    nodes = [helper.make_node("Mul", ["x", "p"], ["y"]), helper.make_node("Expand", ["p", "s"], ["e"])]
    graph = helper.make_graph(nodes, "g", [], [])
    shapes = {"x": [2, 8, 4, 8], "p": list(shape), "s": [4]}
    views = {"p": ([(0, 8)], shape)}
    ts._broadcast_views(NodeBuilder(17, "t", lambda name: False, into=graph.node), graph, views, shapes)
    assert ("p" not in views) == flat
    assert all(("p" in n.input) != flat for n in graph.node)
