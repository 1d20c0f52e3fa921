"""The per-kernel floor of onnxruntime's CPU provider: a chain of K tiny elementwise kernels, timed per kernel.

    PYTHONPATH=. python tools/kernel_floor.py [--kernels 300] [--elements 2048] [--threads 2]

A model of ``--kernels`` chained Add nodes (each adds a constant to the previous result) on a float tensor of
``--elements`` elements, run bound (IOBinding, output preallocated) with the Trainer's session settings (2
intra-op threads, spinning off, memory pattern off), median of 200 runs after warm-up, divided by the kernel
count: what every kernel costs before it does any work. Times the kernel count of a lowered train step
(``tools/step_profile.py`` prints it) it bounds the step from below, whatever the kernels compute.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


def floor_us(kernels: int, elements: int, threads: int) -> float:
    nodes = [helper.make_node("Add", ["x" if i == 0 else f"t{i - 1}", "one"],
                              ["y" if i == kernels - 1 else f"t{i}"]) for i in range(kernels)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [elements])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [elements])],
                              [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.enable_mem_pattern = False
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = ort.OrtValue.ortvalue_from_numpy(np.zeros(elements, np.float32))
    y = ort.OrtValue.ortvalue_from_numpy(np.zeros(elements, np.float32))
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", x)
    binding.bind_ortvalue_output("y", y)
    for _ in range(50):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / kernels * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=300)
    parser.add_argument("--elements", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    us = floor_us(args.kernels, args.elements, args.threads)
    print(f"{us:.2f} us per kernel ({args.kernels} chained Adds of {args.elements} float32, {args.threads} threads, "
          f"onnxruntime {ort.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
