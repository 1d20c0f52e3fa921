"""The accuracy table of docs/numerics.md: error / scale against float64 of the lowered batch-norm backward (f32, both
targets) and of torch's fused kernel on the same data, on the ResNet-50 layers of `oplower bench`.

Needs torch (never a dependency; `pip install torch==2.13.0`). Never imported by the package or the tests;
`tests/test_bn_emit.py` pins the bounds that do not need torch.

    python tools/accuracy_vs_torch.py            # batch 32, every layer, both layouts and targets (~3 minutes)
    python tools/accuracy_vs_torch.py --seed 1

Data: x ~ 2·N(0,1) + 0.5, dy ~ N(0,1) + 0.01, gamma ~ U(0.5, 1.5), mean and variance of x in float64 rounded
to f32. Per output, error = max |got − float64| / max |float64|; a case's error is the worst of diff_src,
diff_gamma and diff_beta, and "× torch" the largest of the three per-output ratios to torch's error.
"""

from __future__ import annotations

import argparse

import numpy as np
from onnx import TensorProto

from lowering import lower_model
from lowering.bench import RESNET50, onednn_model
from runtime.reference import batch_norm_backward as reference
from runtime.session import run_model

OUTPUTS = ("diff_src", "diff_gamma", "diff_beta")
EPSILON = 1e-5


def _torch_outputs(torch, x, dy, mean, var, gamma, layout):
    def nchw(a):  # NXC data stays channels-last in memory: torch runs its channels-last kernel
        t = torch.from_numpy(a)
        return t if layout == "NCX" else t.permute(0, 3, 1, 2)

    inv_std = torch.from_numpy((1.0 / np.sqrt(var.astype(np.float64) + EPSILON)).astype(np.float32))
    dx, dg, db = torch.ops.aten.native_batch_norm_backward(
        nchw(dy), nchw(x), torch.from_numpy(gamma), None, None, torch.from_numpy(mean), inv_std, True, EPSILON,
        [True, True, True])
    if layout == "NXC":
        dx = dx.permute(0, 2, 3, 1)
    return {"diff_src": dx.numpy(), "diff_gamma": dg.numpy(), "diff_beta": db.numpy()}


def _error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    print("| layout | C×H×W | onnxruntime target | × torch | portable | × torch |\n|---|---|---:|---:|---:|---:|")
    for layout in ("NCX", "NXC"):
        for channels, size in RESNET50:
            shape = (args.batch, channels, size, size) if layout == "NCX" else (args.batch, size, size, channels)
            axes = (0, 2, 3) if layout == "NCX" else (0, 1, 2)
            rng = np.random.default_rng(args.seed)
            x = rng.standard_normal(shape, dtype=np.float32) * 2 + np.float32(0.5)
            dy = rng.standard_normal(shape, dtype=np.float32) + np.float32(0.01)
            mean = x.astype(np.float64).mean(axis=axes).astype(np.float32)
            var = x.astype(np.float64).var(axis=axes).astype(np.float32)
            gamma = rng.uniform(0.5, 1.5, channels).astype(np.float32)
            want = reference(x, dy, mean, var, gamma, epsilon=EPSILON, reduce_axes=axes, statistics="batch",
                             stat_input="variance", outputs=OUTPUTS)
            theirs = _torch_outputs(torch, x, dy, mean, var, gamma, layout)
            torch_error = {o: _error(theirs[o], want[o]) for o in OUTPUTS}
            cells = []
            for target in ("onnxruntime", "portable"):
                model = lower_model(onednn_model(shape, layout, TensorProto.FLOAT), target=target)
                got = run_model(model, {"src": x, "diff_dst": dy, "mean": mean, "variance": var, "gamma": gamma})
                errors = {o: _error(got[f"{o}_0"], want[o]) for o in OUTPUTS}
                cells += [f"{max(errors.values()):.1e}", f"{max(errors[o] / torch_error[o] for o in OUTPUTS):.2f}"]
            print(f"| {layout} | {channels}×{size}² | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
