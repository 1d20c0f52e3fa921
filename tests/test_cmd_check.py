"""``oplower check MODEL [--all]`` through lowering.cli.main: stdout, stderr, exit codes."""

from __future__ import annotations

import onnx
from _models import DIRECTML, F32, NGRAPH, ONEDNN, bn_model, bn_node, make_model
from onnx import helper

from lowering.cli import main
from opdef import load_schemas

REGISTRY = load_schemas()


def save(tmp_path, model, name="m.onnx"):
    path = tmp_path / name
    onnx.save(model, str(path))
    return str(path)


def test_check_prints_each_output_with_type_and_symbolic_shape(tmp_path, capsys):
    path = save(tmp_path, bn_model(REGISTRY.get(*ONEDNN), ("N", 64, 7, 7), layout="NCX", node_name="bn1"))
    assert main(["check", path]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "onednn BatchNormTrainingBackward 'bn1':",
        "  diff_src: f32 [N,64,7,7]",
        "  diff_gamma: f32 [64]",
        "  diff_beta: f32 [64]",
        "1 custom node verified",
    ]


def test_check_shows_value_names_that_differ_from_the_spec_names(tmp_path, capsys):
    path = save(tmp_path, bn_model(REGISTRY.get(*DIRECTML), (8, 64, 7, 7), node_name="dml"))
    assert main(["check", path]) == 0
    out = capsys.readouterr().out
    assert "directml BATCH_NORMALIZATION_GRAD 'dml':" in out
    assert "  OutputGradientTensor: f32 [8,64,7,7]  (diff_src)" in out
    assert "  OutputScaleGradientTensor: f32 [1,64,1,1]  (diff_gamma)" in out


def test_check_invalid_node_is_one_line_and_exit_1(tmp_path, capsys):
    model = bn_model(REGISTRY.get(*ONEDNN), (8, 64, 7, 7), layout="NCX", node_name="bn3")
    model.graph.input[2].type.tensor_type.shape.dim[0].dim_value = 63
    path = save(tmp_path, model)
    assert main(["check", path]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert lines == [f"oplower check: error: {path}: onednn BatchNormTrainingBackward 'bn3': mean has shape [63]; "
                     "expected [64] (channel axis 1 of src [8,64,7,7])"]


def test_check_all_reports_every_invalid_node(tmp_path, capsys):
    e = REGISTRY.get(*NGRAPH)
    good = bn_node(e, name="good")
    bad1 = bn_node(e, name="bad1", epsilon=0.0)
    bad2 = bn_node(e, name="bad2")
    bad1.output[:] = [o + "_1" for o in bad1.output]
    bad2.output[:] = [o + "_2" for o in bad2.output]
    bad2.input[1] = "wrong_gamma"
    vi = helper.make_tensor_value_info
    inputs = [vi(v, F32, [4, 8, 3] if v in ("src", "diff_dst") else [8]) for v in good.input]
    inputs.append(vi("wrong_gamma", F32, [9]))
    outputs = [vi(o, F32, None) for o in [*good.output, *bad1.output, *bad2.output]]
    graph = helper.make_graph([good, bad1, bad2], "g", inputs, outputs)
    path = save(tmp_path, make_model(graph, "ngraph"))
    assert main(["check", path, "--all"]) == 1
    captured = capsys.readouterr()
    assert "ngraph BatchNormTrainingBackprop 'good':" in captured.out
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 2
    assert "'bad1': epsilon is 0.0; it must be finite and > 0" in errors[0]
    assert "'bad2': gamma has shape [9]; expected [8] (channel axis 1 of input [4,8,3])" in errors[1]
    assert "2 invalid custom nodes, 1 valid" in captured.err


def test_check_without_all_stops_at_the_first(tmp_path, capsys):
    e = REGISTRY.get(*NGRAPH)
    model = bn_model(e, (4, 8, 3), epsilon=0.0, node_name="bad1")
    assert main(["check", save(tmp_path, model)]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_check_model_without_custom_nodes(tmp_path, capsys):
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x", F32, [2])], [vi("y", F32, [2])])
    assert main(["check", save(tmp_path, make_model(graph))]) == 0
    assert capsys.readouterr().out.startswith("no custom nodes")


def test_check_missing_file(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope.onnx")]) == 1
    err = capsys.readouterr().err
    assert "nope.onnx: no such file" in err and len(err.strip().splitlines()) == 1


def test_check_garbage_file(tmp_path, capsys):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"\x00not a model at all")
    assert main(["check", str(path)]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
