"""Large inputs: external data is carried without being loaded, and the pass's memory grows linearly.

Beyond 2 GB: protobuf cannot serialize a message over 2 GiB, so such models keep their tensors as external
data; ``oplower lower`` reads the graph without the tensors (``load_external_data=False``), writes the lowered
graph (small) and copies or keeps the data file, and refuses to write a lowered model that would itself be
over 2 GiB in one file.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from lowering.cli import main
from lowering.demo.examples import BnCase, build_example
from lowering.modelio import load_model
from lowering.numerics import compare
from lowering.passes import lower_model
from opdef.registry import load_schemas
from runtime.session import run_model

ONEDNN = ("onednn", "BatchNormTrainingBackward")
ROOT = Path(__file__).resolve().parent.parent
STATS = ("bn.mean", "bn.variance", "bn.gamma")


def _external_model(directory: Path, location: str = "data.bin"):
    """The example with its statistics and an unrelated 64 KiB weight as initializers stored in ``location``."""
    example = build_example([BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX")], load_schemas())
    model = example.model
    kept = [vi for vi in model.graph.input if vi.name not in STATS]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    for name in STATS:
        model.graph.initializer.append(numpy_helper.from_array(example.feeds.pop(name), name))
    weight = np.arange(16384, dtype=np.float32)
    model.graph.initializer.append(numpy_helper.from_array(weight, "weight"))
    model.graph.node.append(helper.make_node("Identity", ["weight"], ["weight_out"], name="keep_weight"))
    model.graph.output.append(helper.make_tensor_value_info("weight_out", TensorProto.FLOAT, [16384]))
    path = directory / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=location,
              size_threshold=0)
    return path, example


def _refuse_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("external data was loaded")

    monkeypatch.setattr(external_data_helper, "load_external_data_for_tensor", refuse)
    monkeypatch.setattr(external_data_helper, "load_external_data_for_model", refuse)
    monkeypatch.setattr(onnx, "load_external_data_for_model", refuse)


def _external_refs(model: onnx.ModelProto) -> dict[str, tuple]:
    return {t.name: tuple((e.key, e.value) for e in t.external_data) for t in model.graph.initializer
            if external_data_helper.uses_external_data(t)}


def test_library_lowers_without_loading_external_data(tmp_path, monkeypatch):
    path, _ = _external_model(tmp_path)
    refs = _external_refs(onnx.load(path, load_external_data=False))
    _refuse_loading(monkeypatch)
    lowered = lower_model(load_model(path, load_external_data=False))
    assert _external_refs(lowered) == refs and len(refs) == 4
    assert all(not t.raw_data for t in lowered.graph.initializer)


@pytest.mark.parametrize("where", ["beside", "elsewhere"])
def test_cli_lower_keeps_external_data(tmp_path, monkeypatch, capsys, where):
    path, example = _external_model(tmp_path)
    data = (tmp_path / "data.bin").read_bytes()
    out_dir = tmp_path if where == "beside" else tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / "lowered.onnx"
    with monkeypatch.context() as patch:
        _refuse_loading(patch)
        assert main(["lower", str(path), "-o", str(out)]) == 0, capsys.readouterr().err
    assert (tmp_path / "data.bin").read_bytes() == data
    assert (out_dir / "data.bin").read_bytes() == data
    assert _external_refs(onnx.load(out, load_external_data=False)) == _external_refs(
        onnx.load(path, load_external_data=False))
    got = run_model(out, example.feeds)
    for name, reference in example.expected.items():
        assert compare(name, reference, got[name], example.output_types[name]).ok
    assert np.array_equal(got["weight_out"], np.arange(16384, dtype=np.float32))


def test_cli_lower_with_missing_external_data_file(tmp_path, capsys):
    path, _ = _external_model(tmp_path)
    (tmp_path / "data.bin").unlink()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert main(["lower", str(path), "-o", str(out_dir / "lowered.onnx")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "data.bin" in err[0] and "missing" in err[0]
    assert not list(out_dir.iterdir())


def test_cli_check_with_missing_external_data_file(tmp_path, capsys):
    path, _ = _external_model(tmp_path)
    (tmp_path / "data.bin").unlink()
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "model.onnx" in err[0] and "Traceback" not in err[0]


def test_external_data_outside_the_model_directory_is_refused(tmp_path, capsys):
    inner = tmp_path / "models"
    inner.mkdir()
    path, _ = _external_model(inner, location="escape.bin")
    (inner / "escape.bin").rename(tmp_path / "escape.bin")
    model = onnx.load(path, load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../escape.bin"
    path.write_bytes(model.SerializeToString())  # onnx.save itself refuses such a location
    before = hashlib.sha256(path.read_bytes()).digest()
    out_dir = tmp_path / "out" / "deeper"
    out_dir.mkdir(parents=True)
    assert main(["lower", str(path), "-o", str(out_dir / "lowered.onnx")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "escape.bin" in err[0]
    assert not (tmp_path / "out" / "escape.bin").exists() and not list(out_dir.iterdir())
    assert hashlib.sha256(path.read_bytes()).digest() == before


# -- many nodes ------------------------------------------------------------------------------------------------

def directml_model(nodes: int, shape=(2, 4, 3)) -> onnx.ModelProto:
    """``nodes`` DirectML batch-norm backward nodes sharing their inputs; diff_src of each is an output."""
    vi = helper.make_tensor_value_info
    stat = [1, shape[1], 1]
    inputs = [vi("src", TensorProto.FLOAT, shape), vi("diff_dst", TensorProto.FLOAT, shape)] + [
        vi(name, TensorProto.FLOAT, stat) for name in ("mean", "variance", "gamma")]
    graph_nodes, outputs = [], []
    for i in range(nodes):
        names = [f"dx{i}", f"dgamma{i}", f"dbeta{i}"]
        graph_nodes.append(helper.make_node("BATCH_NORMALIZATION_GRAD", ["src", "diff_dst", "mean", "variance",
                                                                         "gamma"], names, name=f"bn{i}",
                                            domain="directml", Epsilon=1e-5))
        outputs.append(vi(names[0], TensorProto.FLOAT, shape))
    graph = helper.make_graph(graph_nodes, "many", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("directml", 1)])
    model.ir_version = 10
    return model


PER_NODE_BYTES = 32 * 1024  # measured ~14 KiB per node of traced peak before nodes sharing a lowering key were
# lowered as copies; ~1 KiB since for these nodes (~8 KiB for nodes that are all different)


def _traced_peak(nodes: int, registry, make=None) -> int:
    model = (make or directml_model)(nodes)
    tracemalloc.start()
    try:
        lower_model(model, registry=registry)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_traced_memory_grows_linearly_per_node():
    """tracemalloc slows the pass about sixfold, so this measures 400 and 1,200 nodes (a few seconds);
    the 10,000-node run below measures the whole process instead."""
    registry = load_schemas()
    lower_model(directml_model(2), registry=registry)  # warm caches (schemas, onnx defs)
    small, large = _traced_peak(400, registry), _traced_peak(1200, registry)
    assert large <= 1200 * PER_NODE_BYTES, large
    assert (large - small) / 800 <= PER_NODE_BYTES, (small, large)
    assert large <= 3.6 * small, (small, large)  # linear (3x the nodes), not quadratic (9x)


def test_traced_memory_grows_linearly_for_nodes_that_are_all_different():
    """The directml model's nodes share a lowering key (copies of the first); here each node has its own
    channel count, so each is verified and lowered afresh."""
    from lowering.bench import distinct_model

    registry = load_schemas()
    lower_model(distinct_model(2), registry=registry)
    small, large = _traced_peak(400, registry, distinct_model), _traced_peak(1200, registry, distinct_model)
    assert large <= 1200 * PER_NODE_BYTES, large
    assert (large - small) / 800 <= PER_NODE_BYTES, (small, large)
    assert large <= 3.6 * small, (small, large)


RSS_BOUND_MB = 600  # measured ~150 MB of growth for 10,000 nodes


def test_10000_nodes_lower_in_bounded_memory():
    """10,000 nodes in a fresh process: the growth of its peak resident size while lowering stays bounded."""
    script = textwrap.dedent(f"""
        import json, resource, sys, time
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_large_models import directml_model
        from lowering.passes import lower_model
        from opdef.registry import load_schemas
        registry = load_schemas()
        lower_model(directml_model(2), registry=registry)
        model = directml_model(10000)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        lowered = lower_model(model, registry=registry)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"grown_mb": (after - before) / 1024, "seconds": seconds,
                           "nodes": len(lowered.graph.node)}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["nodes"] >= 10000
    assert report["grown_mb"] < RSS_BOUND_MB, report


def test_lower_and_its_final_check_never_load_external_weights(tmp_path):
    """``oplower lower`` (its final check: onnx.checker full_check and an onnxruntime session included) on the
    cnn training artifact with 256 MiB of embedding tables as external data peaks at the same RSS as without
    them (tools/final_check_cost.py --large; docs/cli.md quotes its 2 GiB numbers)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tools" / "final_check_cost.py"
    spec = importlib.util.spec_from_file_location("final_check_cost", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (_, plain_rss), (_, large_rss) = tool.large(0.25, str(tmp_path))
    assert large_rss - plain_rss < 64, (plain_rss, large_rss)  # loaded tables would add 256 MiB
    assert (tmp_path / "large" / "model.lowered.onnx").stat().st_size < 1 << 20
