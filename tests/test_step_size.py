"""The small-step policy (lowering.training.step_size): multiply-accumulates counted from static shapes, and
Trainer's choice of one intra-op thread and the memory pattern for a small step (the caller's threads win)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lowering.static_shapes import fold_static_shapes
from lowering.training.step_size import SMALL_STEP_MACS, is_small_step, multiply_accumulates, step_is_small
from lowering.training.trainer import Trainer, initial_parameters, lower_artifacts

ARTIFACTS = Path(__file__).parent / "fixtures" / "ort_training" / "artifacts"
F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs=("y",)):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F32, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, F32, None) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_counts_each_kind_by_hand():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),            # [2, 4, 8, 8] x 3*3*3
             helper.make_node("Conv", ["c", "g"], ["d"], group=2),                      # [2, 4, 6, 6] x 2*3*3
             helper.make_node("ConvTranspose", ["d", "t"], ["e"], group=2),             # [2, 4, 8, 8] x 2*3*3
             helper.make_node("MatMul", ["a", "b"], ["m"]),                             # [5, 3, 7] x 6
             helper.make_node("Gemm", ["p", "q"], ["y"], transA=1)]                     # [4, 9] x 10
    model = _model(nodes, [("x", [2, 3, 8, 8]), ("w", [4, 3, 3, 3]), ("g", [4, 2, 3, 3]), ("t", [4, 2, 3, 3]),
                           ("a", [5, 3, 6]), ("b", [6, 7]), ("p", [10, 4]), ("q", [10, 9])], ("y", "m", "e"))
    want = 2 * 4 * 64 * 27 + 2 * 4 * 36 * 18 + 2 * 4 * 64 * 18 + 5 * 3 * 7 * 6 + 4 * 9 * 10
    assert multiply_accumulates(model) == want


def test_a_symbolic_dimension_counts_as_unknown():
    model = _model([helper.make_node("MatMul", ["a", "b"], ["y"])], [("a", ["batch", 6]), ("b", [6, 7])])
    assert multiply_accumulates(model) is None
    assert not is_small_step(model) and step_is_small(model) is None
    assert step_is_small(model, {"a": (5, 6)}) is True  # the batch at hand fixes it: 5 * 7 * 6
    assert step_is_small(model, {"a": (SMALL_STEP_MACS, 6)}) is False


def test_shape_chains_count_once_folded():
    """A MatMul operand whose shape a Shape -> Expand chain makes (the recurrent lowerings' ones and zero states)
    counts once lowering has folded the chain (lowering.static_shapes; onnx's data propagation, which would follow
    it, holds hundreds of MB on a MobileNetV2 step); a symbolic batch fixed by the batch at hand is folded too."""
    nodes = [helper.make_node("Shape", ["a"], ["s"]),
             helper.make_node("Expand", ["one", "s"], ["ones"]),
             helper.make_node("MatMul", ["ones", "b"], ["y"])]
    model = _model(nodes, [("a", [4, 6]), ("one", []), ("b", [6, 7])])
    assert multiply_accumulates(model) is None
    symbolic = _model(nodes, [("a", ["batch", 6]), ("one", []), ("b", [6, 7])])
    assert step_is_small(symbolic) is None and step_is_small(symbolic, {"a": (4, 6)}) is True
    assert fold_static_shapes(model) == 1
    assert multiply_accumulates(model) == 4 * 7 * 6


def test_threshold():
    side = 256  # a [256, 256] x [256, 256] product: 16.8M multiply-accumulates, just above the threshold
    big = _model([helper.make_node("MatMul", ["a", "b"], ["y"])], [("a", [side, side]), ("b", [side, side])])
    assert side ** 3 > SMALL_STEP_MACS and not is_small_step(big)
    small = _model([helper.make_node("MatMul", ["a", "b"], ["y"])], [("a", [240, side]), ("b", [side, side])])
    assert 240 * side * side <= SMALL_STEP_MACS and is_small_step(small)


@pytest.fixture(scope="module")
def cnn():
    directory = ARTIFACTS / "cnn"
    models = lower_artifacts(directory)
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")))
    return models, start


def _session_options(trainer):
    session = trainer._bound.session  # the train-step model's session
    return session.get_session_options()


def test_trainer_takes_one_thread_and_the_memory_pattern_for_a_small_step(cnn):
    models, start = cnn
    assert is_small_step(models.step.model)  # 1.2M multiply-accumulates at batch 4
    trainer = Trainer(models, start)
    options = _session_options(trainer)
    assert trainer.small_step and trainer.threads == 1
    assert options.intra_op_num_threads == 1 and options.enable_mem_pattern
    chosen = Trainer(models, start, threads=2)  # the caller's count stays
    assert chosen.threads == 2 and _session_options(chosen).intra_op_num_threads == 2
    assert _session_options(chosen).enable_mem_pattern  # still a small step
    data = dict(np.load(ARTIFACTS / "cnn" / "data.npz"))
    batch = {models.step.interface.data[0]: data["input"], "labels": data["labels"]}
    losses = [[t.step(batch) for _ in range(3)] for t in (trainer, chosen)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)  # the same training either way


def test_trainer_keeps_the_default_for_a_large_step(cnn, monkeypatch):
    models, start = cnn
    monkeypatch.setattr("lowering.training.trainer.step_is_small", lambda model, shapes=None: False)
    trainer = Trainer(models, start)
    options = _session_options(trainer)
    assert not trainer.small_step and trainer.threads is None
    assert options.intra_op_num_threads == 0 and not options.enable_mem_pattern  # 0: onnxruntime's default


def test_an_explicit_memory_pattern_wins(cnn):
    models, start = cnn
    assert not _session_options(Trainer(models, start, memory_pattern=False)).enable_mem_pattern


def _symbolic_batch(models):
    """``models`` whose train-step model declares a symbolic batch on its data inputs."""
    step = onnx.ModelProto()
    step.CopyFrom(models.step.model)
    for value in step.graph.input:
        if value.name in models.step.interface.data:
            value.type.tensor_type.shape.dim[0].dim_param = "batch"
    return dataclasses.replace(models, step=dataclasses.replace(models.step, model=step))


def test_a_symbolic_batch_is_decided_by_the_first_batch(cnn):
    models, start = cnn
    symbolic = _symbolic_batch(models)
    trainer = Trainer(symbolic, start)
    assert trainer.small_step is None and trainer.threads is None  # unknown until a batch is seen
    assert _session_options(trainer).intra_op_num_threads == 0
    data = dict(np.load(ARTIFACTS / "cnn" / "data.npz"))
    batch = {models.step.interface.data[0]: data["input"], "labels": data["labels"]}
    losses = [trainer.step(batch) for _ in range(3)]
    assert trainer.small_step is True and trainer.threads == 1
    options = _session_options(trainer)
    assert options.intra_op_num_threads == 1 and options.enable_mem_pattern
    static = Trainer(models, start)  # the same state went over to the new session: the same training
    np.testing.assert_allclose(losses, [static.step(batch) for _ in range(3)], rtol=1e-6)
    np.testing.assert_allclose(trainer.params[models.params[0]], static.params[models.params[0]], rtol=1e-6)


def test_a_symbolic_batch_with_the_callers_threads_keeps_them(cnn):
    models, start = cnn
    trainer = Trainer(_symbolic_batch(models), start, threads=2)
    assert trainer.small_step is None and trainer.threads == 2
    data = dict(np.load(ARTIFACTS / "cnn" / "data.npz"))
    trainer.step({models.step.interface.data[0]: data["input"], "labels": data["labels"]})
    assert trainer.small_step is True and trainer.threads == 2  # the batch's own session, the caller's threads
    assert _session_options(trainer).intra_op_num_threads == 2


def test_a_symbolic_batch_found_large_keeps_the_default(cnn, monkeypatch):
    models, start = cnn
    monkeypatch.setattr("lowering.training.trainer.step_is_small",
                        lambda model, shapes=None: None if shapes is None else False)
    trainer = Trainer(_symbolic_batch(models), start)
    session = trainer._bound.session
    data = dict(np.load(ARTIFACTS / "cnn" / "data.npz"))
    trainer.step({models.step.interface.data[0]: data["input"], "labels": data["labels"]})
    assert trainer.small_step is False and trainer.threads is None
    assert trainer._bound.session is session  # no second session


def _symbolic_artifact(name: str, directory: Path) -> Path:
    """A copy of a committed artifact whose training model declares a symbolic batch (lowered as such)."""
    shutil.copytree(ARTIFACTS / name, directory)
    model = onnx.load(directory / "training_model.onnx")
    for value in model.graph.input[:2]:  # the data and the labels
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    del model.graph.value_info[:]
    onnx.save(model, directory / "training_model.onnx")
    return directory


def test_each_batch_shape_runs_its_own_folded_session(tmp_path, monkeypatch):
    """A symbolic batch: each batch shape gets a session of the model with that shape fixed and its shape
    arithmetic folded (kept for the next batch of that shape), training bit for bit as the unfolded model does."""
    directory = _symbolic_artifact("mlp_act", tmp_path / "mlp_act")
    models = lower_artifacts(directory)
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")))
    assert any(n.op_type == "Shape" for n in models.step.model.graph.node)  # the batch's size, read per step
    data = dict(np.load(directory / "data.npz"))
    names = (*models.step.interface.data[:1], "target")
    full = dict(zip(names, (data["input"], data["labels"]), strict=True))
    part = {k: v[:2] for k, v in full.items()}  # an epoch's last, smaller batch
    batches = [full, full, part, full, part]
    trainer = Trainer(models, start, threads=1)
    built = _recording(trainer)
    losses, sessions = [], []
    for batch in batches:
        losses.append(trainer.step(batch))
        sessions.append(trainer._bound.session)
    assert sessions[0] is sessions[1] is sessions[3] and sessions[2] is sessions[4] and sessions[0] is not sessions[2]
    assert trainer.small_step is True and len(trainer._shaped) == 2 and len(built) == 2
    assert not any(n.op_type == "Shape" for model in built for n in model.graph.node)
    monkeypatch.setattr("lowering.training.trainer.fold_static_shapes", lambda model: 0)
    monkeypatch.setattr("lowering.training.trainer.with_input_shapes", lambda model, shapes: model)
    plain = Trainer(models, start, threads=1)
    plain_losses = [plain.step(batch) for batch in batches]
    assert [np.float32(x).tobytes() for x in losses] == [np.float32(x).tobytes() for x in plain_losses]
    params, plain_params = trainer.params, plain.params
    for p in models.params:
        assert params[p].tobytes() == plain_params[p].tobytes(), p


def _recording(trainer: Trainer) -> list[onnx.ModelProto]:
    """The list the models ``trainer`` builds sessions of from now on are appended to."""
    built = []
    trainer._session = lambda model, options, what: built.append(model) or Trainer._session(model, options, what)
    return built


def test_shapes_past_the_first_few_share_one_session(tmp_path, monkeypatch):
    """A length that varies batch by batch builds no session per batch: past SHAPED_SESSIONS shapes they share one
    session of the model as it is (built once), and the training stays bit for bit the unfolded model's."""
    directory = _symbolic_artifact("mlp_act", tmp_path / "mlp_act")
    models = lower_artifacts(directory)
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")))
    data = dict(np.load(directory / "data.npz"))
    names = (*models.step.interface.data[:1], "target")
    rows = {k: np.concatenate([v] * 3) for k, v in zip(names, (data["input"], data["labels"]), strict=True)}
    sizes = [4, 3, 2, 1, 6, 5, 4, 7, 6]  # four shapes, then three more (two of them twice)

    def run(trainer):
        built = _recording(trainer)
        losses, sessions = [], []
        for n in sizes:
            losses.append(trainer.step({k: v[:n] for k, v in rows.items()}))
            sessions.append(trainer._bound.session)
        return losses, sessions, built

    trainer = Trainer(models, start, threads=1)
    losses, sessions, built = run(trainer)
    assert len(built) == Trainer.SHAPED_SESSIONS + 1  # one per shape of the first four, one for all the others
    assert sessions[4] is sessions[5] is sessions[7] is sessions[8] and sessions[6] is sessions[0]
    assert not any(n.op_type == "Shape" for n in built[0].graph.node)  # the first shapes' models folded
    assert any(n.op_type == "Shape" for n in built[-1].graph.node)  # the shared one as it is
    monkeypatch.setattr("lowering.training.trainer.fold_static_shapes", lambda model: 0)
    monkeypatch.setattr("lowering.training.trainer.with_input_shapes", lambda model, shapes: model)
    plain, _, _ = run(Trainer(models, start, threads=1))
    assert [np.float32(x).tobytes() for x in losses] == [np.float32(x).tobytes() for x in plain]
