"""GatherGrad's lowered forms timed in onnxruntime (CPU, 2 intra-op threads): an embedding table [V, H] whose
gradient collects N token rows (repeated ids accumulate).

    PYTHONPATH=. python tools/bench_gather_grad.py [--vocab 5000] [--hidden 256] [--ids 2048] [--rounds 15]

Forms: the pass's onnxruntime target at opset 17 (one ScatterND, reduction "add"), its portable target (the
one-hot [V, N] matrix times dY [N, H], one MatMul; also the onnxruntime target below opset 16), and for
comparison a hand-built ScatterElements (reduction "add", opset 16) with the ids expanded to dY's shape.
Rounds alternate the forms; medians in ms. Every form's result is checked against the float64 reference first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from lowering.passes import lower_model
from runtime.reference_shape import gather_grad


def _gather_grad_model(vocab: int, hidden: int, ids: int, opset: int) -> onnx.ModelProto:
    node = helper.make_node("GatherGrad", ["shape", "ids", "dy"], ["dx"], domain="com.microsoft", name="gg")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
                                            helper.make_tensor_value_info("ids", TensorProto.INT64, [ids]),
                                            helper.make_tensor_value_info("dy", TensorProto.FLOAT, [ids, hidden])],
                              [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [vocab, hidden])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _scatter_elements_model(hidden: int, ids: int) -> onnx.ModelProto:
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                              value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0])),
             helper.make_node("Unsqueeze", ["ids", "one"], ["column"]),
             helper.make_node("Expand", ["column", "dy_shape"], ["index"]),
             helper.make_node("Shape", ["dy"], ["dy_shape"]),
             helper.make_node("ScatterElements", ["zeros", "index", "dy"], ["dx"], axis=0, reduction="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
                                           helper.make_tensor_value_info("ids", TensorProto.INT64, [ids]),
                                           helper.make_tensor_value_info("dy", TensorProto.FLOAT, [ids, hidden])],
                              [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)],
                              initializer=[onnx.numpy_helper.from_array(np.array([1], np.int64), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=5000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ids", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    feeds = {"shape": np.array([args.vocab, args.hidden], np.int64),
             "ids": rng.integers(0, args.vocab, args.ids).astype(np.int64),
             "dy": rng.standard_normal((args.ids, args.hidden)).astype(np.float32)}
    want = gather_grad(feeds["shape"], feeds["ids"], feeds["dy"])
    forms = {
        "ScatterND add (onnxruntime target, opset 17)": lower_model(_gather_grad_model(args.vocab, args.hidden,
                                                                                      args.ids, 17)),
        "one-hot MatMul (portable; onnxruntime target below opset 16)":
            lower_model(_gather_grad_model(args.vocab, args.hidden, args.ids, 17), target="portable"),
        "ScatterElements add, ids expanded (opset 16, hand-built)": _scatter_elements_model(args.hidden, args.ids),
    }
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    sessions = {name: ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                for name, m in forms.items()}
    for name, session in sessions.items():
        got = session.run(None, feeds)[0]
        err = float(np.max(np.abs(got - want))) / float(np.max(np.abs(want)))
        assert err < 1e-5, f"{name}: relative error {err:.3g}"
        for _ in range(3):
            session.run(None, feeds)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(args.rounds):
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feeds)
            times[name].append((time.perf_counter() - start) * 1e3)
    print(f"GatherGrad dX [{args.vocab}, {args.hidden}] from {args.ids} ids, onnxruntime {ort.__version__}, "
          f"2 threads, median of {args.rounds} (min..max) ms")
    for name, values in times.items():
        print(f"  {name}: {statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})")


if __name__ == "__main__":
    main()
