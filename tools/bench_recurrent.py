"""Time onnxruntime-training 1.19.2's own LSTM/GRU training kernels against oplower's lowering on plain onnxruntime.

    PYTHONPATH=. /work/venv/bin/python tools/bench_recurrent.py [--size S N I H] [--rounds 2]
        [--ortt-python /work/ortt-venv/bin/python]

Writes one-node LSTMTraining / LSTMGrad / GRUTraining / GRUGrad models (direction forward, linear_before_reset 1
as nn.GRU exports) into a temporary directory, then alternates rounds: the native side (onnxruntime-training's
kernels, run by the ortt python: the two cannot share a process) and the lowered side (plain onnxruntime), each
2 intra-op threads, 3 warm-up runs, the median of 15. Prints one line per side and round, milliseconds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

NAMES = ("lstm_fwd", "lstm_grad", "gru_fwd", "gru_grad")


def write_models(directory: Path, steps: int, batch: int, inputs: int, hidden: int) -> None:
    import onnx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_recurrent as t

    rng = np.random.default_rng(0)
    lstm = t._lstm_inputs(rng, steps=steps, batch=batch, inputs=inputs, hidden=hidden)
    lstm_grad = t._grad_feeds(rng, lstm, "forward")
    gru = t._gru_inputs(rng, steps=steps, batch=batch, inputs=inputs, hidden=hidden)
    gru_grad = t._gru_grad_feeds(rng, gru, "forward", 1)
    gru_attrs = {"hidden_size": hidden, "linear_before_reset": 1}
    cases = {"lstm_fwd": ("LSTMTraining", lstm, t.LSTM_IN, t.LSTM_OUT, {"hidden_size": hidden}),
             "lstm_grad": ("LSTMGrad", lstm_grad, t.GRAD_IN, t.GRAD_OUT, {"hidden_size": hidden}),
             "gru_fwd": ("GRUTraining", gru, t.GRU_IN, t.GRU_OUT, gru_attrs),
             "gru_grad": ("GRUGrad", gru_grad, t.GRU_GRAD_IN, t.GRU_GRAD_OUT, gru_attrs)}
    for name, (op, feeds, ins, outs, attrs) in cases.items():
        onnx.save(t._model(op, feeds, ins, outs, attrs), directory / f"{name}.onnx")
        np.savez(directory / f"{name}.npz", **{k: v for k, v in feeds.items() if v is not None})


def time_side(directory: Path, lowered: bool) -> str:
    import onnx
    import onnxruntime as ort

    results = []
    for name in NAMES:
        model = onnx.load(directory / f"{name}.onnx")
        if lowered:
            from lowering.passes import lower_model

            model = lower_model(model)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feeds = dict(np.load(directory / f"{name}.npz"))
        for _ in range(3):
            session.run(None, feeds)
        times = []
        for _ in range(15):
            start = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - start)
        results.append(f"{name} {np.median(times) * 1e3:.2f}")
    return ("lowered " if lowered else "native  ") + " | ".join(results)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, nargs=4, default=[50, 32, 64, 128], metavar=("S", "N", "I", "H"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ortt-python", default="/work/ortt-venv/bin/python")
    parser.add_argument("--side", choices=["native", "lowered"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(time_side(Path(args.dir), args.side == "lowered"))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        write_models(Path(tmp), *args.size)
        print(f"S, N, I, H = {args.size}; median of 15 runs, ms")
        for _ in range(args.rounds):
            for python, side in ((args.ortt_python, "native"), (sys.executable, "lowered")):
                run = subprocess.run([python, __file__, "--side", side, "--dir", tmp], capture_output=True, text=True)
                print(run.stdout.strip() or run.stderr.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
