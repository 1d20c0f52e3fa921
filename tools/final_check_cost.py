"""The cost of ``oplower lower``'s final check (lowering.final_check) next to the lowering itself.

``PYTHONPATH=. python tools/final_check_cost.py [ROUNDS]``: medians over ROUNDS (default 15) for the committed
cnn training and optimizer artifacts, the checker and the onnxruntime session apart for the first.

``PYTHONPATH=. python tools/final_check_cost.py --large [GIB] [DIR]``: ``oplower lower`` (the final check
included) as a process of its own on the cnn training artifact with GIB (default 2) GiB of embedding tables
stored as external data in DIR (default a fresh directory under /tmp, removed afterwards; the data file is
written in 64 MiB chunks, never held in memory), next to the same model without the tables: wall time and
peak RSS of each. Weights that were loaded would show in the RSS; ``lower`` writes its output beside the
input, so the data file is neither copied nor read.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from lowering import final_check
from lowering.passes import lower_model
from opdef.registry import load_schemas

ARTIFACTS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "ort_training" / "artifacts"


def _median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(rounds: int = 15) -> None:
    registry = load_schemas()
    for name in ("cnn/training_model", "cnn/optimizer_model"):
        model = onnx.load(ARTIFACTS / f"{name}.onnx")
        lowered = lower_model(model, registry=registry)
        final_check.check_lowered(lowered, model)  # warm-up
        lower_ms = _median_ms(lambda m=model: lower_model(m, registry=registry), rounds)
        check_ms = _median_ms(lambda low=lowered, m=model: final_check.check_lowered(low, m), rounds)
        checker_ms = _median_ms(lambda low=lowered: onnx.checker.check_model(low, full_check=True), rounds)
        load_ms = _median_ms(lambda low=lowered, m=model: final_check._check_loads(low, low, m), rounds)  # noqa: SLF001
        print(f"{name}: {len(model.graph.node)} -> {len(lowered.graph.node)} nodes; lower {lower_ms:.1f} ms, "
              f"final check {check_ms:.1f} ms (onnx.checker {checker_ms:.1f} ms, onnxruntime session {load_ms:.1f} ms)")


CHUNK = 64 << 20  # bytes per embedding table and per write
ROOT = Path(__file__).resolve().parent.parent


def _with_tables(model: onnx.ModelProto, directory: Path, gib: float) -> Path:
    """``model`` plus float32 embedding tables of ``gib`` GiB in total, each read by a Gather of two rows
    (a graph output), stored in ``directory/tables.bin``; returns the model's path."""
    width = 256
    rows = CHUNK // (4 * width)
    count = max(1, round(gib * (1 << 30) / CHUNK))
    rng = np.random.default_rng(0)
    with open(directory / "tables.bin", "wb") as data:
        for i in range(count):
            name = f"table_{i}"
            tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[rows, width])
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", "tables.bin"), ("offset", str(i * CHUNK)), ("length", str(CHUNK))):
                tensor.external_data.add(key=key, value=value)
            model.graph.initializer.append(tensor)
            data.write(rng.standard_normal(rows * width, dtype=np.float32).tobytes())
            model.graph.initializer.append(helper.make_tensor(f"{name}_rows", TensorProto.INT64, [2], [0, rows - 1]))
            model.graph.node.append(helper.make_node("Gather", [name, f"{name}_rows"], [f"{name}_out"], axis=0))
            model.graph.output.append(helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2, width]))
    path = directory / "model.onnx"
    onnx.save(model, path)
    return path


def _lower_process(path: Path) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of ``python -m lowering lower PATH -o PATH.lowered.onnx``."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "lowering", "lower", str(path), "-o",
                                str(path.with_suffix(".lowered.onnx"))], env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"oplower lower {path} failed")
    return seconds, usage.ru_maxrss / 1024  # KiB on Linux


def large(gib: float = 2.0, directory: str | None = None) -> list[tuple[float, float]]:
    """Prints and returns (seconds, peak RSS MiB) without and with the tables."""
    base = Path(directory or tempfile.mkdtemp(prefix="final_check_cost_"))
    try:
        plain_dir, large_dir = base / "plain", base / "large"
        plain_dir.mkdir(parents=True, exist_ok=True)
        large_dir.mkdir(parents=True, exist_ok=True)
        source = ARTIFACTS / "cnn" / "training_model.onnx"
        plain = plain_dir / "model.onnx"
        shutil.copy(source, plain)
        big = _with_tables(onnx.load(source), large_dir, gib)
        size = (large_dir / "tables.bin").stat().st_size / (1 << 30)
        results = []
        for name, path in (("cnn training model", plain), (f"the same + {size:.2f} GiB external data", big)):
            seconds, rss = _lower_process(path)
            print(f"oplower lower, {name}: {seconds:.2f} s, peak RSS {rss:.0f} MiB")
            results.append((seconds, rss))
        return results
    finally:
        if directory is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--large":
        large(float(sys.argv[2]) if len(sys.argv) > 2 else 2.0, sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
