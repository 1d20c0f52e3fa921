"""Runs every case of a directory in one runtime, in a process of its own (tests/test_bad_values.py starts
it): a runtime that aborts or crashes on a case (an out-of-bounds access a native kernel does not check) ends
this process, not the test session, and the case it was running is the last line it printed.

    python tests/_runtime_worker.py RUNTIME DIR

``DIR/<case>/model.onnx`` and ``feeds.npz`` in; ``outputs.npz`` or ``error.txt`` (the runtime's exception,
one line) out. Prints ``start <case>`` before and ``done <case>`` after each case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx


def _onnxruntime(model: onnx.ModelProto, path: Path, feeds: dict) -> dict:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _openvino(model: onnx.ModelProto, path: Path, feeds: dict) -> dict:
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    inputs = {}
    for i, port in enumerate(compiled.inputs):  # a port may carry several names (see test_portable_training)
        value = np.asarray(feeds[next(v.name for v in model.graph.input if v.name in port.get_names())])
        inputs[i] = value.view(np.int64) if value.dtype == np.int64 else value
    results = compiled(inputs)
    return {o.name: np.array(next(value for port, value in results.items() if o.name in port.get_names()))
            for o in model.graph.output}


def _tract(model: onnx.ModelProto, path: Path, feeds: dict) -> dict:
    import tract

    runnable = tract.onnx().load(str(path)).into_model().into_runnable()
    results = runnable.run([feeds[i.name] for i in model.graph.input])
    return {o.name: results[i].to_numpy() for i, o in enumerate(model.graph.output)}


def _reference(model: onnx.ModelProto, path: Path, feeds: dict) -> dict:
    from onnx.reference import ReferenceEvaluator

    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(names, feeds), strict=True))


RUNNERS = {"onnxruntime": _onnxruntime, "openvino": _openvino, "tract": _tract, "reference": _reference}


def main(runtime: str, root: Path) -> None:
    run = RUNNERS[runtime]
    for case in sorted(p for p in root.iterdir() if p.is_dir()):
        print("start", case.name, flush=True)
        model = onnx.load(case / "model.onnx")
        inputs = {i.name for i in model.graph.input}
        with np.load(case / "feeds.npz") as data:
            feeds = {k: data[k] for k in data.files if k in inputs}
        try:
            outputs = run(model, case / "model.onnx", feeds)
        except Exception as exc:  # the runtime refused the case: recorded, asserted by the test
            (case / "error.txt").write_text(f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else
                                            type(exc).__name__)
        else:
            np.savez(case / "outputs.npz", **outputs)
        print("done", case.name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
