"""Cross-check the per-op fixtures against torch autograd in float64 (an independent implementation).

Run with the fixture environment's python (it has torch): prints, per case, the largest difference
relative to the largest entry of the recorded output; exit 1 if any exceeds 1e-5.

    /work/ortt-venv/bin/python tools/ort_training/check_fixtures.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "ort_training"
TOLERANCE = 1e-5


def t(a):
    return torch.tensor(np.asarray(a, np.float64), requires_grad=True)


def _pad_input(x, pads):
    """Explicit (possibly asymmetric) ONNX pads [b1, b2, ..., e1, e2, ...] as F.pad's reversed pairs."""
    rank = len(pads) // 2
    pairs = []
    for i in reversed(range(rank)):
        pairs += [pads[i], pads[i + rank]]
    return F.pad(x, pairs)


def conv_grad(case, a):
    at = case["attributes"]
    x, w = t(a["in.X"]), t(a["in.W"])
    b = t(np.zeros(w.shape[0]))
    conv = F.conv1d if x.ndim == 3 else F.conv2d
    y = conv(_pad_input(x, at["pads"]), w, b, stride=at["strides"], dilation=at["dilations"], groups=at["group"])
    y.backward(torch.tensor(a["in.dY"], dtype=torch.float64))
    return {"dX": x.grad, "dW": w.grad, "dB": b.grad}


def relu_grad(case, a):
    return {"dX": np.where(a["in.X"] > 0, a["in.dY"], 0)}


def sigmoid_grad(case, a):
    y = a["in.Y"].astype(np.float64)
    return {"dX": a["in.dY"] * y * (1 - y)}


def max_pool_grad(case, a):
    # scatter-add dY through the recorded Indices (ONNX MaxPool's flat NCHW positions)
    dx = np.zeros(int(np.prod(case["forward_input_shape"])))
    np.add.at(dx, a["in.Indices"].ravel(), a["in.dY"].astype(np.float64).ravel())
    return {"dX": dx.reshape(case["forward_input_shape"])}


def average_pool_grad(case, a):
    at = case["attributes"]
    shape = case["forward_input_shape"]
    rank = len(shape) - 2
    pads = at["pads"]
    symmetric = pads[:rank] == pads[rank:]
    if not symmetric and not at["count_include_pad"]:
        return None  # torch cannot express asymmetric pads excluded from the count
    x = t(np.zeros(shape))
    pool = F.avg_pool1d if rank == 1 else F.avg_pool2d
    if symmetric:
        y = pool(x, at["kernel_shape"], at["strides"], pads[:rank], ceil_mode=bool(at.get("ceil_mode", 0)),
                 count_include_pad=bool(at["count_include_pad"]))
    else:
        y = pool(_pad_input(x, pads), at["kernel_shape"], at["strides"], 0, ceil_mode=bool(at.get("ceil_mode", 0)))
    y.backward(torch.tensor(a["in.dY"], dtype=torch.float64))
    return {"dX": x.grad}


def scale(case, a):
    s = float(np.asarray(a["in.scale"]).reshape(-1)[0])
    return {"output": a["in.input"] / s if case["attributes"]["scale_down"] else a["in.input"] * s}


def softmax_ce_grad(case, a):
    at = case["attributes"]
    logits = t(a["in.log_prob"])  # log_softmax(log_prob) == log_prob, so its gradient is d_logits
    weight = torch.tensor(a["in.weight"], dtype=torch.float64) if "in.weight" in a else None
    loss = F.cross_entropy(logits, torch.tensor(a["in.label"]), weight=weight, reduction=at["reduction"],
                           ignore_index=at.get("ignore_index", -100))
    loss.backward(torch.tensor(a["in.dY"], dtype=torch.float64))
    return {"d_logits": logits.grad}


CHECKS = {"ConvGrad": conv_grad, "ReluGrad": relu_grad, "SigmoidGrad": sigmoid_grad,
          "MaxPoolGrad": max_pool_grad, "AveragePoolGrad": average_pool_grad, "Scale": scale,
          "SoftmaxCrossEntropyLossGrad": softmax_ce_grad}


def main() -> int:
    worst, failed = 0.0, []
    for case in json.loads((FIXTURES / "ops" / "cases.json").read_text()):
        check = CHECKS.get(case["op_type"])
        if check is None:
            continue
        arrays = dict(np.load(FIXTURES / case["arrays"]))
        expected = check(case, arrays)
        name = f"{case['op_type']}/{case['variant']}"
        if expected is None:
            print(f"{name}: no torch equivalent, not checked")
            continue
        for output, value in expected.items():
            if f"out.{output}" not in arrays:
                continue
            recorded = arrays[f"out.{output}"].astype(np.float64)
            value = value.detach().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            error = float(np.abs(recorded - value).max() / max(np.abs(value).max(), 1e-30))
            tolerance = 1e-3 if arrays[f"out.{output}"].dtype == np.float16 else TOLERANCE
            worst = max(worst, error) if tolerance == TOLERANCE else worst
            print(f"{name} {output}: {error:.1e}")
            if error > tolerance:
                failed.append(f"{name} {output}")
    print(f"worst relative error (f32 cases): {worst:.1e}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
