"""The train-step model as the Trainer runs it (lowering.training.train_step.bound_model): the parameters bound
as views of the flat state's memory, AdamW's step scalars computed in Python, batch norm's scratch statistics
inputs and (one thread) its staged sums merged must give the train-step model's own results bit for bit, with
the kernels they replace gone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from lowering.builder import NodeBuilder
from lowering.rules.training_updates import AdamW
from lowering.training.train_step import BoundModel, StepScalarFeed, bound_model, merge_staged_sums
from lowering.training.trainer import Trainer, initial_parameters, lower_artifacts

ARTIFACTS = Path(__file__).parent / "fixtures" / "ort_training" / "artifacts"


def _scalar_session(adamw: AdamW) -> tuple[ort.InferenceSession, list[str]]:
    """The step scalars as the train-step model computes them ([1] lr and step in, stacked and split)."""
    graph = helper.make_graph([], "g", [], [])
    b = NodeBuilder(17, "s", lambda name: False, into=graph.node)
    scalars = adamw.step_scalars(b, "lr", "step", stacked=True, split=True)
    fields = list(adamw.computed_fields())
    outputs = [getattr(scalars, f) for f in fields]
    graph.node.extend(helper.make_node("Identity", [o], [f"out.{f}"]) for o, f in zip(outputs, fields, strict=True))
    graph.input.extend([helper.make_tensor_value_info("lr", TensorProto.FLOAT, [1]),
                        helper.make_tensor_value_info("step", TensorProto.INT64, [1])])
    graph.output.extend(helper.make_tensor_value_info(f"out.{f}", TensorProto.FLOAT, None) for f in fields)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime 1.23 (the last for Python 3.10) reads IR 11 at most
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]), fields


@pytest.mark.parametrize("adamw", [AdamW(0.9, 0.999, 1e-8, 0.01, 1, 1), AdamW(0.9, 0.999, 1e-8, 0.0, 0, 1),
                                   AdamW(0.8, 0.95, 1e-6, 0.1, 1, 0), AdamW(0.99, 0.9999, 1e-8, 0.05, 1, 1)])
def test_fed_step_scalars_are_the_graph_scalars_bits(adamw):
    session, fields = _scalar_session(adamw)
    feed = StepScalarFeed(adamw, {f"in.{f}": f for f in fields})
    rng = np.random.default_rng(0)
    # from the first step on, past a table's end, far ahead (a new table) and back (another)
    steps = [*range(1, 1100), *sorted(rng.integers(1100, 10**9, 200).tolist()), 7, 3000]
    rates = [1e-3, 3e-4, 0.1, *rng.uniform(1e-6, 1.0, 2).tolist()]
    assert fields  # every form has some
    for lr in rates:
        lr = np.float32(lr)
        for step in steps:
            feed.write(lr, step)
            want = session.run(None, {"lr": np.array([lr], np.float32), "step": np.array([step], np.int64)})
            for field, value in zip(fields, want, strict=True):
                got = feed.arrays[f"in.{field}"]
                assert got.tobytes() == value.reshape(-1)[:1].tobytes(), (field, lr, step)


def _setup(name: str):
    directory = ARTIFACTS / name
    models = lower_artifacts(directory)
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")))
    data = dict(np.load(directory / "data.npz"))
    meta = json.loads((directory / "meta.json").read_text())
    batch = {models.step.interface.data[0]: data["input"], meta["labels_input"]: data["labels"]}
    return models, start, batch


def _unbound_steps(models, start, batch, rates):
    """The train-step model run with plain feeds, its .updated outputs fed back: (losses, final state)."""
    step = models.step
    interface = step.interface
    options = ort.SessionOptions()
    # one thread like the bound side: onnxruntime's LSTM kernel (the onnxruntime target's LSTMTraining) splits the
    # batch across threads, whose smaller GEMMs round otherwise
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(step.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    trainer = Trainer(models, start, threads=1)  # for its initial state only (flat buffers as it builds them)
    names = list(interface.state_inputs)
    state = trainer._bound.read(names)  # the flat inputs in the train-step model's order (BoundModel.layouts)
    constants = {n: v.numpy() for n, v in trainer._bound._constants.items()}
    inputs = {i.name for i in session.get_inputs()}
    losses = []
    for i, rate in enumerate(rates, start=1):
        feeds = {**batch, **constants, **state, "learning_rate": np.array([rate], np.float32),
                 "step": np.array([i], np.int64)}
        out = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {k: v for k, v in feeds.items() if k in inputs}), strict=True))
        losses.append(out[interface.loss])
        state = {n: out[f"{n}.updated"] for n in names}
    return losses, state


@pytest.mark.parametrize("name", ["mlp_act", "cnn", "cnn1d", "bert", "lstm", "lstm2", "gru"])
def test_bound_steps_are_the_train_step_models_bits(name):
    models, start, batch = _setup(name)
    rates = [1e-2, 3e-3, 3e-3, 2e-2]
    trainer = Trainer(models, start, threads=1)
    losses = []
    for rate in rates:
        trainer.learning_rate = np.array([rate], np.float32)
        losses.append(trainer.step(batch))
    want_losses, want_state = _unbound_steps(models, start, batch, rates)
    assert [np.float32(x).tobytes() for x in losses] == [np.asarray(x).reshape(-1)[0].tobytes() for x in want_losses]
    got = trainer._bound.read(want_state)
    for n, value in want_state.items():
        assert got[n].tobytes() == value.tobytes(), n


@pytest.mark.parametrize("name", ["mlp_act", "cnn", "bert", "lstm"])
def test_the_cut_and_the_scalars_are_gone(name):
    models, _, _ = _setup(name)
    step = models.step
    bound = bound_model(step)
    flat = {f.names[0] for f in step.interface.flat}
    assert flat and bound.views
    splits = [n for n in bound.model.graph.node if n.op_type == "Split" and n.input[0] in flat]
    assert not splits  # the parameters are bound, not cut
    before = [n for n in step.model.graph.node if n.op_type == "Split" and n.input[0] in flat]
    assert len(before) == 1
    if step.adamw is not None:
        assert set(bound.scalars.values()) >= {"alpha_correction", "beta_correction", "lr_decay"}
        assert not any("step" in n.input for n in bound.model.graph.node)  # the bias corrections' Pow is gone
        assert "step" not in {i.name for i in bound.model.graph.input}
        assert len(bound.model.graph.node) <= len(step.model.graph.node) - 9
    inputs = {i.name: i for i in bound.model.graph.input}
    for name_, (source, start, end, shape) in bound.views.items():
        assert source in flat and 0 <= start < end and int(np.prod(shape)) == end - start
        dims = [d.dim_value for d in inputs[name_].type.tensor_type.shape.dim]
        assert dims == list(shape)


@pytest.mark.parametrize("name", ["lstm", "lstm2", "gru"])
def test_torch_gate_reorders_are_bound_views(name):
    """torch's recurrent exports read every weight and bias in the ONNX kernel's gate order (Concats of the flat
    input's pieces) and write every gradient back in torch's (Splits of the kernel's gradients): the bound buffer
    holds the parameters, and with them the moments, in the kernels' order (BoundModel.layouts), so each join is
    a bound view and each gradient goes into the flat gradient's Concat whole. Reading and writing the state goes
    by the train-step model's order (the steps' bits: test_bound_steps_are_the_train_step_models_bits)."""
    models, start, _ = _setup(name)
    step = models.step
    bound = bound_model(step)
    flat = step.interface.flat[0]
    (index,) = bound.layouts.values()
    assert list(bound.layouts) == [flat.names[0]] and sorted(index) == list(range(flat.size))
    assert not np.array_equal(index, np.arange(flat.size))
    views = set(bound.views)
    assert not [n for n in bound.model.graph.node if n.op_type == "Concat" and set(n.input) <= views]
    gradient = next(n for n in bound.model.graph.node if n.op_type == "Concat" and "flat_gradients" in n.output[0])
    before = next(n for n in step.model.graph.node if n.op_type == "Concat" and "flat_gradients" in n.output[0])
    assert len(gradient.input) < len(before.input)
    producer = {o: n for n in bound.model.graph.node for o in n.output}
    assert not [v for v in gradient.input if v in producer and producer[v].op_type == "Split"]
    trainer = Trainer(models, start, threads=1)
    assert trainer._bound._layouts
    params = trainer.params
    for p, value in params.items():
        assert np.array_equal(value, np.asarray(start.params[p], value.dtype)), p
    shuffled = {p: np.random.default_rng(1).standard_normal(v.shape).astype(v.dtype) for p, v in params.items()}
    trainer.params = shuffled
    assert all(np.array_equal(trainer.params[p], v) for p, v in shuffled.items())
    first = trainer._bound.read([flat.names[0]])[flat.names[0]]
    assert np.array_equal(first, np.concatenate([shuffled[p].reshape(-1) for p in flat.params]))


def test_a_join_read_after_the_update_keeps_the_written_order():
    """A joined view read by a node the update does not wait for (here an extra output of it) could be read after
    onnxruntime wrote an update result into its memory: the buffer keeps the written order, the join its Concat."""
    models, _, _ = _setup("lstm")
    step = models.step
    model = onnx.ModelProto()
    model.CopyFrom(step.model)
    flat = step.interface.flat[0].names[0]
    pieces = {o for n in model.graph.node if n.op_type == "Split" and n.input[0] == flat for o in n.output}
    join = next(n for n in model.graph.node if n.op_type == "Concat" and set(n.input) <= pieces)
    model.graph.node.append(helper.make_node("Identity", [join.output[0]], ["extra"]))
    model.graph.output.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, None))
    guarded = bound_model(dataclasses.replace(step, model=model))
    assert guarded.views and not guarded.layouts
    assert join.output[0] in {o for n in guarded.model.graph.node if n.op_type == "Concat" for o in n.output}
    assert bound_model(step).layouts  # the same step without the extra reader


def test_sgd_keeps_its_learning_rate_input():
    models, _, _ = _setup("cnn1d")
    bound = bound_model(models.step)
    assert models.step.adamw is None and not bound.scalars
    assert "learning_rate" in {i.name for i in bound.model.graph.input}


def test_batch_norm_statistics_inputs_are_scratch_buffers():
    """The training-mode BatchNormalizations (momentum 0) read their running-statistics inputs only times 0: the
    two Muls of the scale per node that made them go, each a scratch input of the scale's shape."""
    models, _, _ = _setup("cnn")
    step = models.step
    bound = bound_model(step)
    norms = [n for n in bound.model.graph.node if n.op_type == "BatchNormalization"
             and any(a.name == "training_mode" and a.i == 1 for a in n.attribute)]
    assert norms and len(bound.scratch) == 2 * len(norms)
    for node in norms:
        assert set(node.input[3:5]) <= set(bound.scratch)
        assert bound.scratch[node.input[3]][1] == bound.views[node.input[1]][3]  # [C], the scale's shape
    produced = {o for n in bound.model.graph.node for o in n.output}
    assert not set(bound.scratch) & produced


def test_views_need_every_reader_before_the_update():
    """A parameter read by a node the update does not wait for (here an extra output of it) could be read after
    onnxruntime wrote an update result into the flat input in place: no views then (the Split stays)."""
    models, _, _ = _setup("mlp_act")
    step = models.step
    model = onnx.ModelProto()
    model.CopyFrom(step.model)
    param = next(iter(bound_model(step).views))
    model.graph.node.append(helper.make_node("Identity", [param], ["extra"]))
    model.graph.output.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, None))
    guarded = bound_model(dataclasses.replace(step, model=model))
    assert not guarded.views and guarded.scalars  # the scalars do not depend on it
    flat = {f.names[0] for f in step.interface.flat}
    assert any(n.op_type == "Split" and n.input[0] in flat for n in guarded.model.graph.node)


@pytest.mark.parametrize("name", ["cnn", "mobilenet"])
def test_a_nan_batch_leaves_no_trace_in_the_scratch(name, monkeypatch):
    """onnxruntime writes each batch's statistics into the scratch inputs: a batch with a NaN must not spoil the
    steps after the state is restored (the buffers are zeroed before every run), bit for bit as the plain model."""
    models, start, batch = _setup(name)
    key = models.step.interface.data[0]
    bad = {**batch, key: batch[key].copy()}
    bad[key].flat[0] = np.nan

    def run():
        trainer = Trainer(models, start, threads=1)
        trainer.step(batch)
        saved = trainer.params, trainer.first_moments, trainer.second_moments, trainer.frozen
        assert not np.isfinite(trainer.step(bad))
        trainer.params, trainer.first_moments, trainer.second_moments, trainer.frozen = saved
        return [trainer.step(batch) for _ in range(2)], trainer

    losses, trainer = run()
    assert trainer._bound._scratch and all(np.isfinite(losses))
    assert all(np.isfinite(v).all() for v in trainer.params.values())
    monkeypatch.setattr("lowering.training.trainer.bound_model",
                        lambda step, single_thread=False: BoundModel(step.model, {}, {}, step.adamw))
    plain, _ = run()
    assert [np.float32(x).tobytes() for x in losses] == [np.float32(x).tobytes() for x in plain]


def test_staged_sums_are_merged_for_one_thread_only():
    """Batch norm's per-channel sums in two stages (spatial axes, then the batch) become one ReduceSum where the
    session has one thread (the bits: test_bound_steps_are_the_train_step_models_bits runs one thread)."""
    models, _, _ = _setup("cnn")

    def pairs(model):
        producer = {o: n for n in model.graph.node for o in n.output}
        return sum(n.op_type == "ReduceSum" and n.input[0] in producer and producer[n.input[0]].op_type == "ReduceSum"
                   for n in model.graph.node)

    two, one = bound_model(models.step), bound_model(models.step, single_thread=True)
    # two batch-norm layers, two staged sums each (the loss gradient's keepdims pair is another kind)
    assert pairs(two.model) - pairs(one.model) == 4
    sums = [n.op_type for n in one.model.graph.node].count("ReduceSum")
    assert sums == [n.op_type for n in two.model.graph.node].count("ReduceSum") - 4
    start = _setup("cnn")[1]
    assert Trainer(models, start, threads=1)._merged and not Trainer(models, start, threads=2)._merged


def test_a_staged_sum_whose_first_stage_is_an_output_stays():
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "spatial"], ["rows"], keepdims=0),
         helper.make_node("ReduceSum", ["rows", "batch"], ["total"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("rows", TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(np.array([2], np.int64), "spatial"),
         onnx.numpy_helper.from_array(np.array([0], np.int64), "batch")])
    assert merge_staged_sums(graph) == 0
    del graph.output[1:]
    assert merge_staged_sums(graph) == 1 and len(graph.node) == 1
    merged = graph.node[0]
    axes = next(t for t in graph.initializer if t.name == merged.input[1])
    assert merged.input[0] == "x" and onnx.numpy_helper.to_array(axes).tolist() == [0, 2]
