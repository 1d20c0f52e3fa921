"""How close the lowering comes to onnxruntime-training's own results on the recorded one-node cases.

    PYTHONPATH=. python tools/ort_training/recorded_agreement.py [--target onnxruntime|portable] [OP ...]

For each op and element type: the largest |lowered - recorded| over its cases, relative to the largest
recorded entry (what tests/test_training_grads_recorded.py bounds by 1e-5, f16 1e-3), and how many cases
are bit-identical (signed zeros equal). Runs the lowered models in plain onnxruntime.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def agreement(op_types: list[str], target: str) -> dict[tuple[str, str], tuple[float, int, int]]:
    """{(op, dtype): (max relative error, bit-identical cases, cases)} over the recorded cases of op_types."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _recorded import recorded_cases  # noqa: PLC0415 (the tests' own loaders)
    from test_training_grads_recorded import load_case  # noqa: PLC0415

    from lowering.passes import lower_model  # noqa: PLC0415
    from runtime.session import run_model  # noqa: PLC0415

    table: dict[tuple[str, str], tuple[float, int, int]] = {}
    for case in recorded_cases(*op_types):
        model, feeds, recorded = load_case(case)
        got = run_model(lower_model(model, target=target), feeds)
        for name, want in recorded.items():
            g, w = got[name].astype(np.float64), want.astype(np.float64)
            err = float(np.max(np.abs(g - w))) / max(float(np.max(np.abs(w))), 1e-30)
            key = (case["op_type"], str(want.dtype))
            worst, exact, count = table.get(key, (0.0, 0, 0))
            table[key] = (max(worst, err), exact + int(np.array_equal(g, w)), count + 1)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", help="op types (default: every recorded op)")
    parser.add_argument("--target", default="onnxruntime", choices=["onnxruntime", "portable"])
    args = parser.parse_args(argv)
    for (op, dtype), (err, exact, count) in sorted(agreement(args.ops, args.target).items()):
        print(f"{op:28s} {dtype:8s} max error {err:.2g} of the largest entry; bit-identical {exact}/{count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
