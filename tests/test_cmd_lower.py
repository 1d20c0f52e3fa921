"""``oplower lower``: exit codes, atomic output, the input never touched, --verify, external data."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import lowering.passes
from lowering.cli import main
from lowering.demo.examples import BnCase, build_example
from lowering.numerics import compare
from opdef.registry import load_schemas
from runtime.session import run_model

ONEDNN = ("onednn", "BatchNormTrainingBackward")
DIRECTML = ("directml", "BATCH_NORMALIZATION_GRAD")


@pytest.fixture(scope="module")
def registry():
    return load_schemas()


@pytest.fixture
def example(registry):
    return build_example([BnCase(ONEDNN, (2, 3, 4, 5), layout="NXC", symbolic=(0, 1)),
                          BnCase(DIRECTML, (2, 3, 4), io_type=TensorProto.FLOAT16, name="d")], registry)


@pytest.fixture
def model_path(example, tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(example.model, path)
    return path


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_lower_writes_a_standard_model(model_path, example, tmp_path, capsys):
    before = digest(model_path)
    out = tmp_path / "out.onnx"
    assert main(["lower", str(model_path), "-o", str(out)]) == 0
    assert digest(model_path) == before
    lowered = onnx.load(out)
    onnx.checker.check_model(lowered, full_check=True)
    assert {n.domain for n in lowered.graph.node} == {""}
    got = run_model(out, example.feeds)
    assert compare("x", example.expected["bn.diff_src"], got["bn.diff_src"], TensorProto.FLOAT).ok
    summary = capsys.readouterr().out
    assert "1 x onednn::BatchNormTrainingBackward" in summary and "nodes 2 ->" in summary
    assert not leftovers(tmp_path)


def test_verify_reports_each_output(model_path, tmp_path, capsys):
    before = digest(model_path)
    assert main(["lower", str(model_path), "-o", str(tmp_path / "out.onnx"), "--verify", "--seed", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    checked = [line for line in lines if "max abs err" in line]
    assert len(checked) == 6 and all(line.endswith("PASS") for line in checked)
    assert digest(model_path) == before


def test_verify_failure_exits_1_and_writes_nothing(model_path, tmp_path, monkeypatch, capsys, registry):
    """A lowering that disagrees with the reference (upstream reading vs the spec's) fails --verify."""
    example = build_example([BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX", outputs=("diff_src",))], registry)
    onnx.save(example.model, model_path)
    real = lowering.passes.lower_model_with_report

    def wrong(model, **kwargs):
        return real(model, **{**kwargs, "onednn_single_output": "upstream"})

    monkeypatch.setattr(lowering.passes, "lower_model_with_report", wrong)
    out = tmp_path / "out.onnx"
    assert main(["lower", str(model_path), "-o", str(out), "--verify"]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "not written" in captured.err
    assert not out.exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("mode", ["spec", "upstream"])
def test_single_output_option_is_passed_through(registry, tmp_path, capsys, mode):
    example = build_example([BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX", outputs=("diff_src",))], registry,
                            onednn_single_output=mode)
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(example.model, path)
    assert main(["lower", str(path), "-o", str(out), "--verify", "--onednn-single-output", mode]) == 0
    got = run_model(out, example.feeds)
    assert compare("x", example.expected["bn.diff_src"], got["bn.diff_src"], TensorProto.FLOAT).ok


def test_output_equal_to_input_is_refused(model_path, capsys):
    before = digest(model_path)
    assert main(["lower", str(model_path), "-o", str(model_path)]) == 2
    assert "--in-place" in capsys.readouterr().err
    assert digest(model_path) == before
    # the same file under another spelling
    alias = model_path.parent / "." / model_path.name
    assert main(["lower", str(model_path), "-o", str(alias)]) == 2
    assert digest(model_path) == before


def test_in_place(model_path, example):
    assert main(["lower", str(model_path), "-o", str(model_path), "--in-place"]) == 0
    lowered = onnx.load(model_path)
    assert {n.domain for n in lowered.graph.node} == {""}
    assert not leftovers(model_path.parent)


def test_bad_input_exits_1_with_one_line(tmp_path, capsys):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not a model at all")
    out = tmp_path / "out.onnx"
    assert main(["lower", str(garbage), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "garbage.onnx" in err
    assert not out.exists()
    assert main(["lower", str(tmp_path / "missing.onnx"), "-o", str(out)]) == 1
    assert "no such file" in capsys.readouterr().err


def test_invalid_node_exits_1_naming_the_node(model_path, example, tmp_path, capsys):
    mean = next(i for i in example.model.graph.input if i.name == "bn.mean")
    mean.type.tensor_type.shape.dim[0].dim_value = 7
    onnx.save(example.model, model_path)
    before = digest(model_path)
    out = tmp_path / "out.onnx"
    assert main(["lower", str(model_path), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'bn'" in err and "Traceback" not in err
    assert err.startswith(f"oplower lower: error: {model_path}: onednn BatchNormTrainingBackward 'bn': ")
    assert not out.exists() and digest(model_path) == before


def test_missing_output_directory_exits_1(model_path, tmp_path, capsys):
    assert main(["lower", str(model_path), "-o", str(tmp_path / "nowhere" / "out.onnx")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()  # not created on the way


def test_usage_errors_exit_2(model_path):
    with pytest.raises(SystemExit) as exc:
        main(["lower", str(model_path)])  # no -o
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["lower", str(model_path), "-o", "x.onnx", "--onednn-single-output", "sometimes"])
    assert exc.value.code == 2


def _external_model(registry, tmp_path):
    """A oneDNN example whose statistics are initializers stored in in/weights.bin; (path, example)."""
    example = build_example([BnCase(ONEDNN, (2, 8, 4, 5), layout="NCX")], registry)
    graph = example.model.graph
    for vi in list(graph.input):
        if vi.name in ("bn.mean", "bn.variance", "bn.gamma"):
            graph.initializer.append(onnx.numpy_helper.from_array(example.feeds.pop(vi.name), vi.name))
            graph.input.remove(vi)
    source = tmp_path / "in"
    source.mkdir()
    path = source / "model.onnx"
    onnx.save(example.model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    return path, example


def test_external_data_is_kept_and_carried(registry, tmp_path):
    path, example = _external_model(registry, tmp_path)
    source = path.parent
    data_before = digest(source / "weights.bin")
    # beside the input: the data file is shared
    assert main(["lower", str(path), "-o", str(source / "low.onnx"), "--verify"]) == 0
    # elsewhere: the data file is copied along
    target = tmp_path / "out"
    target.mkdir()
    assert main(["lower", str(path), "-o", str(target / "low.onnx")]) == 0
    assert digest(target / "weights.bin") == data_before == digest(source / "weights.bin")
    for out in (source / "low.onnx", target / "low.onnx"):
        lowered = onnx.load(out, load_external_data=False)
        assert all(onnx.external_data_helper.uses_external_data(t) for t in lowered.graph.initializer)
        got = run_model(str(out), example.feeds)
        assert compare("x", example.expected["bn.diff_src"], got["bn.diff_src"], TensorProto.FLOAT, 1e-6).ok
    # a different file of that name in the target directory is not overwritten
    (target / "weights.bin").write_bytes(b"something else")
    assert main(["lower", str(path), "-o", str(target / "again.onnx")]) == 1
    assert not (target / "again.onnx").exists()
    np.testing.assert_equal((target / "weights.bin").read_bytes(), b"something else")




def test_copied_external_data_gets_the_umask_mode_not_0600(registry, tmp_path):
    import os
    import stat

    path, _ = _external_model(registry, tmp_path)
    target = tmp_path / "out"
    target.mkdir()
    umask = os.umask(0o022)
    try:
        assert main(["lower", str(path), "-o", str(target / "low.onnx")]) == 0
    finally:
        os.umask(umask)
    assert stat.S_IMODE((target / "weights.bin").stat().st_mode) == 0o644
    assert stat.S_IMODE((target / "low.onnx").stat().st_mode) == 0o644


@pytest.mark.parametrize("verify", [False, True])
def test_missing_external_data_is_one_line_before_anything_runs(registry, tmp_path, capsys, verify):
    path, _ = _external_model(registry, tmp_path)
    (path.parent / "weights.bin").unlink()
    target = tmp_path / "out"
    target.mkdir()
    args = ["lower", str(path), "-o", str(target / "low.onnx")] + (["--verify"] if verify else [])
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "external data file of the model is missing" in err
    assert "internal error" not in err and list(target.iterdir()) == []


def test_a_failing_write_is_one_line_and_leaves_nothing(model_path, tmp_path, monkeypatch, capsys):
    import errno

    import lowering.modelio

    def full_disk(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lowering.modelio.os, "replace", full_disk)
    out = tmp_path / "out.onnx"
    assert main(["lower", str(model_path), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write: No space left on device" in err and "internal" not in err
    assert not out.exists() and leftovers(tmp_path) == []
