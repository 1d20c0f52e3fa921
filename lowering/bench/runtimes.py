"""``oplower bench --runtimes``: one layer's lowering, for a target, timed in every ONNX runtime at hand.

onnxruntime always; OpenVINO (``openvino``), tract (``tract``) and ``onnx.reference.ReferenceEvaluator`` when
importable (they are test extras, never dependencies). A runtime that refuses the model gets its first error
line in the table instead of a time: tract refuses the onnxruntime target's BatchNormalization with computed
parameters. Plain medians of single runs after two warm-ups, inputs fed afresh each run (the other runtimes'
APIs differ in how outputs can be preallocated, so onnxruntime is timed the same way here, not bound).
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

RUNTIMES = ("onnxruntime", "openvino", "tract", "reference")


def _median_ms(run: Callable[[], object], reps: int) -> float:
    for _ in range(2):
        run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _runner(runtime: str, model: onnx.ModelProto, feeds: dict[str, np.ndarray], workdir: Path) -> Callable[[], object]:
    data = model.SerializeToString()
    if runtime == "onnxruntime":
        from runtime.session import PreparedModel

        prepared = PreparedModel(model, allow_spinning=False)
        return lambda: prepared.run(feeds)
    if runtime == "openvino":
        import openvino as ov

        core = ov.Core()
        # f32 stays f32: the CPU plugin may otherwise compute in bf16 where the CPU has it
        compiled = core.compile_model(core.read_model(model=data, weights=b""), "CPU",
                                      {"INFERENCE_PRECISION_HINT": "f32"})
        request = compiled.create_infer_request()
        return lambda: request.infer(feeds)
    if runtime == "tract":
        import tract

        path = workdir / "model.onnx"
        path.write_bytes(data)
        runnable = tract.onnx().load(str(path)).into_model().into_runnable()
        ordered = [feeds[i.name] for i in model.graph.input]
        return lambda: runnable.run(ordered)
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(model)
    return lambda: evaluator.run(None, feeds)


def _available(runtime: str) -> bool:
    name = {"reference": "onnx", "onnxruntime": "onnxruntime"}.get(runtime, runtime)
    return importlib.util.find_spec(name) is not None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # tract puts the cause on a later "Caused by" line: keep the most specific one
    cause = next((lines[i + 1] for i, line in enumerate(lines[:-1]) if line.startswith("Caused by")), None)
    return (cause or (lines[0] if lines else type(exc).__name__))[:100]


def time_runtimes(layout: str, channels: int, size: int, batch: int, reps: int, target: str) -> list[dict]:
    """One row per runtime: ``ms`` (None when refused or not installed) and ``status``."""
    from lowering.bench import onednn_model
    from lowering.passes import lower_model

    shape = (batch, channels, size, size) if layout == "NCX" else (batch, size, size, channels)
    model = lower_model(onednn_model(shape, layout, TensorProto.FLOAT), target=target)
    rng = np.random.default_rng(0)
    vec = np.ones(channels, np.float32)
    feeds = {"src": rng.standard_normal(shape, dtype=np.float32),
             "diff_dst": rng.standard_normal(shape, dtype=np.float32),
             "mean": vec * 0, "variance": vec, "gamma": vec}
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for runtime in RUNTIMES:
            row = {"runtime": runtime, "target": target, "layout": layout, "channels": channels, "size": size,
                   "ms": None, "status": "ok"}
            if not _available(runtime):
                row["status"] = "not installed"
            else:
                try:
                    row["ms"] = _median_ms(_runner(runtime, model, feeds, Path(workdir)), reps)
                except Exception as exc:  # noqa: BLE001 (a runtime's refusal is a result here)
                    row["status"] = "refused: " + _first_line(exc)
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    r = rows[0]
    lines = ["", f"Runtimes (f32, {r['channels']}×{r['size']}², median of single runs, inputs fed each run):", "",
             "| runtime | target | layout | ms | |", "|---|---|---|---:|---|"]
    for row in rows:
        ms = f"{row['ms']:.2f}" if row["ms"] is not None else "–"
        lines.append(f"| {row['runtime']} | {row['target']} | {row['layout']} | {ms} | "
                     f"{'' if row['status'] == 'ok' else row['status']} |")
    return lines
