"""``oplower run``: inputs from .npz, lowering first, outputs to .npz, one-line errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lowering.cli import main
from runtime import reference

F32 = TensorProto.FLOAT


def _save(tmp_path, model, name="m.onnx"):
    path = tmp_path / name
    onnx.save(model, path)
    return path


def _standard_model():
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Cast", ["sum"], ["half"], to=16)],
        "g", [helper.make_tensor_value_info("a", F32, ["n"]), helper.make_tensor_value_info("b", F32, ["n"])],
        [helper.make_tensor_value_info("sum", F32, ["n"]),
         helper.make_tensor_value_info("half", TensorProto.BFLOAT16, ["n"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])  # IR 14


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_runs_a_standard_model_and_writes_outputs(tmp_path, capsys):
    model_path = _save(tmp_path, _standard_model())
    np.savez(tmp_path / "in.npz", a=np.array([1.0, 2.5], np.float32), b=np.array([0.5, -1.0], np.float32))
    before = model_path.read_bytes()
    code, out, err = _run([ "run", str(model_path), "--inputs", str(tmp_path / "in.npz"),
                           "--outputs", str(tmp_path / "out.npz")], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["sum", "float32", "[2]", "min"] and "max 1.5" in lines[0]
    assert lines[1].split()[:3] == ["half", "bfloat16", "[2]"]
    assert lines[-1] == f"wrote {tmp_path / 'out.npz'}"
    with np.load(tmp_path / "out.npz") as data:
        np.testing.assert_array_equal(data["sum"], [1.5, 1.5])
        assert data["half"].dtype == np.dtype("V2")  # NumPy's own way of storing ml_dtypes.bfloat16
        np.testing.assert_array_equal(data["half"].view(ml_dtypes.bfloat16).astype(np.float32), [1.5, 1.5])
    assert model_path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz", "m.onnx", "out.npz"]


def test_bf16_inputs_round_trip_through_npz(tmp_path, capsys):
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [None, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [None, 2])])
    model_path = _save(tmp_path, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.array([[1.0, -2.0], [0.375, 3e38]], np.float32).astype(ml_dtypes.bfloat16)
    np.savez(tmp_path / "in.npz", x=x)  # stored as |V2
    code, out, err = _run(["run", str(model_path), "--inputs", str(tmp_path / "in.npz"), "--outputs",
                           str(tmp_path / "out.npz")], capsys)
    assert code == 0, err
    with np.load(tmp_path / "out.npz") as data:
        np.testing.assert_array_equal(data["y"].view(np.uint16), x.view(np.uint16))
    # Fed back as its own input, the output file works as well.
    code, _, err = _run(["run", str(model_path), "--inputs", str(tmp_path / "out.npz").replace("out", "in")],
                        capsys)
    assert code == 0, err


@pytest.mark.parametrize(("arrays", "message"), [
    ({"a": np.zeros(2, np.float32)}, r"in\.npz: missing input 'b' \(float32 \[n\]\)$"),
    ({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32), "c": np.zeros(1)},
     r"in\.npz: 'c' is not an input of the model \(its inputs: a, b\)$"),
    ({"a": np.zeros(2, np.float64), "b": np.zeros(2, np.float32)},
     r"in\.npz: input 'a' has dtype float64; the model expects float32 \[n\]$"),
    ({"a": np.zeros((2, 1), np.float32), "b": np.zeros(2, np.float32)},
     r"m\.onnx: input 'a' has rank 2 \(shape \[2, 1\]\); the model expects rank 1 \(float32 \[n\]\)$"),
])
def test_input_mismatches_are_one_line_errors(tmp_path, capsys, arrays, message):
    model_path = _save(tmp_path, _standard_model())
    np.savez(tmp_path / "in.npz", **arrays)
    code, out, err = _run(["run", str(model_path), "--inputs", str(tmp_path / "in.npz"), "--outputs",
                           str(tmp_path / "out.npz")], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("oplower run: error: ")
    assert pytest.importorskip("re").search(message, err.strip()), err
    assert not (tmp_path / "out.npz").exists()


def test_unreadable_inputs_files(tmp_path, capsys):
    model_path = _save(tmp_path, _standard_model())
    (tmp_path / "garbage.npz").write_bytes(b"not a zip at all")
    np.save(tmp_path / "single.npy", np.zeros(2, np.float32))
    np.savez(tmp_path / "objects.npz", a=np.array([{"k": 1}], dtype=object))
    cases = {
        "absent.npz": "absent.npz: no such file",
        "garbage.npz": "garbage.npz: not a readable .npz file (neither a zip archive of arrays nor a NumPy array)",
        "single.npy": "single.npy: a single array (.npy), expected an .npz file",
        "objects.npz": "objects.npz: not a readable .npz file (it holds object arrays, which are never unpickled)",
    }
    for name, message in cases.items():
        code, _, err = _run(["run", str(model_path), "--inputs", str(tmp_path / name)], capsys)
        assert code == 1 and message in err and err.count("\n") == 1, err


def test_refuses_to_overwrite_its_inputs_and_reports_model_errors(tmp_path, capsys):
    model_path = _save(tmp_path, _standard_model())
    np.savez(tmp_path / "in.npz", a=np.zeros(2, np.float32), b=np.zeros(2, np.float32))
    before = (tmp_path / "in.npz").read_bytes()
    code, _, err = _run(["run", str(model_path), "--inputs", str(tmp_path / "in.npz"), "--outputs",
                         str(tmp_path / "in.npz")], capsys)
    assert code == 1 and "refusing to overwrite an input file" in err
    assert (tmp_path / "in.npz").read_bytes() == before
    code, _, err = _run(["run", str(tmp_path / "nope.onnx"), "--inputs", str(tmp_path / "in.npz")], capsys)
    assert code == 1 and "nope.onnx: no such file" in err
    code, _, err = _run(["run", str(model_path), "--inputs", str(tmp_path / "in.npz"), "--outputs",
                         str(tmp_path / "missing_dir" / "out.npz")], capsys)
    assert code == 1 and "does not exist" in err
    with pytest.raises(SystemExit) as info:
        main(["run", str(model_path)])
    assert info.value.code == 2


def test_onnxruntime_failure_names_the_model(tmp_path, capsys):
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", F32, [None]),
                               helper.make_tensor_value_info("s", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", F32, None)])
    model_path = _save(tmp_path, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    np.savez(tmp_path / "in.npz", x=np.zeros(3, np.float32), s=np.array([4]))
    code, _, err = _run(["run", str(model_path), "--inputs", str(tmp_path / "in.npz")], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "m.onnx: onnxruntime failed to run the model:" in err and "Traceback" not in err


# -- models with custom nodes: lowered first ---------------------------------------------------------

def _custom_model():
    node = helper.make_node("BatchNormTrainingBackward", ["src", "diff_dst", "mean", "variance", "gamma"],
                            ["diff_src", "diff_gamma", "diff_beta"], name="bn1", domain="onednn", epsilon=1e-5,
                            data_format="NCX")
    shape = ["N", 3, 4, 4]
    graph = helper.make_graph([node], "g", [
        helper.make_tensor_value_info("src", F32, shape), helper.make_tensor_value_info("diff_dst", F32, shape),
        helper.make_tensor_value_info("mean", F32, [3]), helper.make_tensor_value_info("variance", F32, [3]),
        helper.make_tensor_value_info("gamma", F32, [3])], [
        helper.make_tensor_value_info("diff_src", F32, shape), helper.make_tensor_value_info("diff_gamma", F32, [3]),
        helper.make_tensor_value_info("diff_beta", F32, [3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)])


def test_custom_nodes_are_lowered_then_run_and_checked(tmp_path, capsys):
    model_path = _save(tmp_path, _custom_model())
    rng = np.random.default_rng(0)
    feeds = {"src": rng.normal(size=(2, 3, 4, 4)).astype(np.float32),
             "diff_dst": rng.normal(size=(2, 3, 4, 4)).astype(np.float32),
             "mean": rng.normal(size=3).astype(np.float32), "variance": rng.uniform(0.5, 2, 3).astype(np.float32),
             "gamma": rng.normal(size=3).astype(np.float32)}
    np.savez(tmp_path / "in.npz", **feeds)
    before = model_path.read_bytes()
    code, out, err = _run(["run", str(model_path), "--inputs", str(tmp_path / "in.npz"), "--outputs",
                           str(tmp_path / "out.npz"), "--check"], capsys)
    assert code == 0, err
    assert "1 x onednn::BatchNormTrainingBackward" in out.splitlines()[0]
    assert sum(line.startswith("check ") and line.endswith("PASS") for line in out.splitlines()) == 3
    want = reference.batch_norm_backward(feeds["src"], feeds["diff_dst"], feeds["mean"], feeds["variance"],
                                         feeds["gamma"], epsilon=float(np.float32(1e-5)), reduce_axes=(0, 2, 3))
    with np.load(tmp_path / "out.npz") as data:
        for name, value in want.items():
            np.testing.assert_allclose(data[name], value, rtol=1e-4, atol=1e-5 * np.abs(value).max())
    assert model_path.read_bytes() == before


def test_unknown_custom_domain_is_a_clear_error(tmp_path, capsys):
    graph = helper.make_graph([helper.make_node("Mystery", ["x"], ["y"], name="m1", domain="acme")], "g",
                              [helper.make_tensor_value_info("x", F32, [2])], [helper.make_tensor_value_info("y", F32,
                                                                                                          [2])])
    model_path = _save(tmp_path, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                                         helper.make_opsetid("acme", 1)]))
    np.savez(tmp_path / "in.npz", x=np.zeros(2, np.float32))
    code, _, err = _run(["run", str(model_path), "--inputs", str(tmp_path / "in.npz")], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "'m1' (acme::Mystery)" in err, err
