"""The cost of ``oplower lower``'s final check (lowering.final_check) next to the lowering itself.

``PYTHONPATH=. python tools/final_check_cost.py [ROUNDS]``: medians over ROUNDS (default 15) for the committed
cnn training and optimizer artifacts, the checker and the onnxruntime session apart for the first.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import onnx

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


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
