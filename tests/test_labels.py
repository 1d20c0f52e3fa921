"""Class labels checked against the class count before they are fed (issue 24, lowering/training/labels.py): the
library's Trainer and batches, ``oplower train``, ``oplower train-step --bundle`` and ``oplower run --check``
refuse a label outside [0, C) that is not ignore_index with one line naming the input, the first bad value and
its position; ignore_index passes; on the CLI exit 1, no traceback, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lowering.cli import main
from lowering.training.labels import LabelInput, LabelValueError, label_inputs
from lowering.training.trainer import Trainer, batches, lower_artifacts, starting_point

ARTIFACTS = Path(__file__).parent / "fixtures" / "ort_training" / "artifacts"
CNN = ARTIFACTS / "cnn"  # labels [4] int64, 4 classes (the scores 'output' [4, 4])
MS = "com.microsoft"
vi = helper.make_tensor_value_info


def _data(**labels) -> dict[str, np.ndarray]:
    data = dict(np.load(CNN / "data.npz"))
    data.update(labels)
    return data


def _with_ignore_index(tmp_path: Path, ignore_index: int) -> Path:
    """A copy of the cnn artifacts whose loss and its gradient ignore ``ignore_index``."""
    directory = tmp_path / "cnn"
    shutil.copytree(CNN, directory)
    model = onnx.load(directory / "training_model.onnx")
    for node in model.graph.node:
        if "SoftmaxCrossEntropyLoss" in node.op_type:
            node.attribute.append(helper.make_attribute("ignore_index", ignore_index))
    onnx.save(model, directory / "training_model.onnx")
    return directory


def test_label_inputs_of_the_artifacts():
    found = label_inputs(onnx.load(CNN / "training_model.onnx"))
    assert [(x.name, x.classes, x.ignore_index, x.scores) for x in found] == [("labels", 4, None, "output")]
    assert label_inputs(onnx.load(ARTIFACTS / "cnn1d" / "training_model.onnx"))[0].classes == 3
    assert label_inputs(onnx.load(ARTIFACTS / "mlp" / "training_model.onnx")) == ()  # MSELoss: no class labels


def test_label_inputs_through_value_keeping_ops_and_the_gradient_op():
    nodes = [helper.make_node("Cast", ["y"], ["y64"], to=TensorProto.INT64),
             helper.make_node("Reshape", ["y64", "flat"], ["y1"]),
             helper.make_node("SoftmaxCrossEntropyLossGrad", ["dy", "lp", "y1"], ["dl"], domain=MS, name="g",
                              ignore_index=-1)]
    graph = helper.make_graph(nodes, "g", [vi("y", TensorProto.INT32, [2, 3]), vi("dy", TensorProto.FLOAT, []),
                                           vi("lp", TensorProto.FLOAT, [6, 7])], [vi("dl", TensorProto.FLOAT, [6, 7])],
                              [helper.make_tensor("flat", TensorProto.INT64, [1], [-1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    assert label_inputs(model) == (LabelInput("y", 7, -1, "lp", "SoftmaxCrossEntropyLossGrad 'g'"),)


def test_first_bad_is_row_major_and_ignore_index_passes():
    label = LabelInput("t", 5, -100, "s", "n")
    assert label.first_bad(np.array([[0, 4, -100], [2, 3, 1]])) is None
    assert label.first_bad(np.array([[0, 4, -100], [7, -1, 5]])) == ((1, 0), 7)
    assert LabelInput("t", 5, None, "s", "n").first_bad(np.array([0, -100], np.int32)) == ((1,), -100)


def test_first_bad_on_large_batches_and_empty_ones():
    """Past 256 labels the class-id check reduces with NumPy instead of Python's min and max: the same answers."""
    label = LabelInput("t", 5, -100, "s", "n")
    good = np.arange(3000).reshape(30, 100) % 5
    assert label.first_bad(good) is None
    for position, value in (((29, 99), 5), ((0, 0), -1), ((17, 3), 9)):
        bad = good.copy()
        bad[position] = value
        assert label.first_bad(bad) == (position, value)
    ignored = good.copy()
    ignored[3, 4] = -100
    assert label.first_bad(ignored) is None
    assert label.first_bad(np.zeros((0, 4), np.int64)) is None


def test_trainer_refuses_a_bad_label_before_the_step_and_keeps_its_state():
    models = lower_artifacts(CNN)
    trainer = Trainer(models, starting_point(CNN, models))
    before = {k: v.copy() for k, v in trainer.params.items()}
    batch = {k: v for k, v in _data().items()}
    batch["labels"] = np.array([1, 2, 4, 0])
    with pytest.raises(LabelValueError) as info:
        trainer.step(batch)
    message = str(info.value)
    assert message == ("step 1: label input 'labels' holds 4 at [2]; each label must be a class id in [0, 4) "
                       "(4 classes: axis 1 of 'output', read by SoftmaxCrossEntropyLoss "
                       "'onnx::SoftmaxCrossEntropyLoss::4')")
    assert trainer.step_count == 0
    assert all(np.array_equal(before[k], v) for k, v in trainer.params.items())
    batch["labels"] = np.array([1, 2, 3, 0])
    assert np.isfinite(trainer.step(batch)) and trainer.step_count == 1


def test_batches_refuse_a_bad_label_naming_the_batch():
    models = lower_artifacts(CNN)
    data = _data(labels=np.array([[1, 2, 3, 0], [0, 1, -1, 2]]), input=np.stack([_data()["input"]] * 2))
    with pytest.raises(LabelValueError, match=r"^data.npz: label input 'labels' holds -1 at \[1, 2\] \(batch 1\); "
                                              r"each label must be a class id in \[0, 4\)"):
        batches(data, models, starting_point(CNN, models).frozen, "data.npz")


def test_ignore_index_is_allowed(tmp_path):
    directory = _with_ignore_index(tmp_path, -100)
    models = lower_artifacts(directory)
    assert models.labels[0].ignore_index == -100
    start = starting_point(directory, models)
    trainer = Trainer(models, start)
    feed = batches(_data(labels=np.array([1, -100, 3, 0])), models, start.frozen, "d.npz")
    assert np.isfinite(trainer.step(feed(0)))
    with pytest.raises(LabelValueError, match="holds -99 at \\[1\\]; each label must be a class id in \\[0, 4\\) "
                                              "or the ignore_index -100"):
        trainer.step({**feed(0), "labels": np.array([1, -99, 3, 0])})


def _cli_error(capsys, argv: list[str], command: str) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 1 and len(err) == 1, captured.err
    assert err[0].startswith(f"oplower {command}: error: ") and "Traceback" not in captured.err
    return err[0]


def test_cli_train_refuses_bad_labels_and_writes_nothing(tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", **_data(labels=np.array([1, 2, 3, 9])))
    out, ckpt = tmp_path / "trained.npz", tmp_path / "ckpt"
    line = _cli_error(capsys, ["train", str(CNN), "--steps", "2", "--data", str(tmp_path / "bad.npz"), "--save",
                               str(out), "--save-checkpoint", str(ckpt)], "train")
    assert f"{tmp_path / 'bad.npz'}: label input 'labels' holds 9 at [0, 3] (batch 0)" in line
    assert not out.exists() and not ckpt.exists()


def test_cli_train_step_bundle_refuses_bad_labels_and_writes_nothing(tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", **_data(labels=np.array([-5, 2, 3, 1])))
    bundle, step = tmp_path / "web", tmp_path / "step.onnx"
    line = _cli_error(capsys, ["train-step", str(CNN), "-o", str(step), "--bundle", str(bundle), "--data",
                               str(tmp_path / "bad.npz")], "train-step")
    assert "label input 'labels' holds -5 at [0, 0] (batch 0)" in line
    assert not bundle.exists() and not step.exists()


def _sce_grad_model(tmp_path: Path, ignore_index: int | None = None) -> Path:
    attrs = {} if ignore_index is None else {"ignore_index": ignore_index}
    node = helper.make_node("SoftmaxCrossEntropyLossGrad", ["dy", "lp", "label"], ["dl"], domain=MS, name="sg",
                            **attrs)
    graph = helper.make_graph([node], "g", [vi("dy", TensorProto.FLOAT, []), vi("lp", TensorProto.FLOAT, [3, 5]),
                                            vi("label", TensorProto.INT64, [3])], [vi("dl", TensorProto.FLOAT, [3, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    path = tmp_path / "sce.onnx"
    onnx.save(model, path)
    return path


def _sce_inputs(tmp_path: Path, label) -> Path:
    lp = np.log(np.full((3, 5), 0.2, np.float32))
    path = tmp_path / "in.npz"
    np.savez(path, dy=np.array(1.0, np.float32), lp=lp, label=np.array(label, np.int64))
    return path


def test_cli_run_check_refuses_bad_labels_and_writes_nothing(tmp_path, capsys):
    model, inputs, out = _sce_grad_model(tmp_path, -100), _sce_inputs(tmp_path, [0, 5, -100]), tmp_path / "out.npz"
    line = _cli_error(capsys, ["run", str(model), "--inputs", str(inputs), "--check", "--outputs", str(out)], "run")
    assert line.endswith(f"{inputs}: label input 'label' holds 5 at [1]; each label must be a class id in [0, 5) or "
                         "the ignore_index -100 (5 classes: axis 1 of 'lp', read by SoftmaxCrossEntropyLossGrad 'sg')")
    assert not out.exists()
    # ignore_index passes the check; without --check the lowered graph runs the bad label as ignored
    assert main(["run", str(model), "--inputs", str(_sce_inputs(tmp_path, [0, 4, -100])), "--check"]) == 0
    assert main(["run", str(model), "--inputs", str(_sce_inputs(tmp_path, [0, 5, -100])), "--outputs",
                 str(out)]) == 0
    capsys.readouterr()
    got = np.load(out)["dl"]
    assert np.all(got[1:] == 0) and np.allclose(got[0], [-0.8, 0.2, 0.2, 0.2, 0.2])  # label 0 alone counted
