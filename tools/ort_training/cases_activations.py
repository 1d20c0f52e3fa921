"""One-node cases of onnxruntime-training's activation family (issue 19), recorded by
``make_fixtures.py --family activations``: DropoutGrad with real masks (drawn here, fed as the mask input) at
ratios 0.1/0.5/0.7, the default ratio and ratio 0; TanhGrad, LeakyReluGrad, QuickGelu, QuickGeluGrad, GeluGrad,
FastGeluGrad, Gelu, BiasGelu, BiasGeluGrad_dX and BiasFastGeluGrad_dX in f32 and f16 (the kernels are f32;
onnxruntime runs f16 nodes through casts), f64 where onnxruntime-training runs it. Tiny tensors (<= 120
elements). New cases go at the end: the recorded ones keep their draws.
"""

from __future__ import annotations

import make_fixtures
import numpy as np

SEED = 19
H, D = np.float16, np.float64


def make(rng: np.random.Generator) -> None:
    record = make_fixtures.record
    def rand(*shape, dtype=np.float32, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    # DropoutGrad: the mask a Dropout of that ratio would write (kept with probability 1 - ratio)
    for ratio, ratio_type, dtype, variant in ((0.1, np.float32, np.float32, "ratio0.1"),
                                              (0.5, np.float32, np.float32, "ratio0.5"),
                                              (0.7, np.float32, np.float32, "ratio0.7"),
                                              (0.7, np.float32, H, "ratio0.7_f16"),
                                              (0.1, np.float64, D, "ratio0.1_f64"),
                                              (0.1, H, np.float32, "ratio0.1_f16ratio")):
        mask = rng.random((4, 6, 5)) >= ratio
        inputs = {"dy": rand(4, 6, 5, dtype=dtype), "mask": mask, "ratio": np.array(ratio, ratio_type)}
        record("DropoutGrad", variant, inputs, ["dx"])
    mask = rng.random((3, 8)) >= 0.5
    record("DropoutGrad", "default_ratio", {"dy": rand(3, 8), "mask": mask}, ["dx"])
    record("DropoutGrad", "training_mode_false", {"dy": rand(3, 8), "mask": mask, "ratio": np.array(0.3, np.float32),
                                                  "training_mode": np.array(False)}, ["dx"])
    record("DropoutGrad", "ratio0_mask_ignored", {"dy": rand(3, 8), "mask": mask, "ratio": np.array([0.0], np.float32),
                                                  "training_mode": np.array([True])}, ["dx"])

    for dtype, suffix in ((np.float32, ""), (H, "_f16")):
        x = rand(4, 5, 6, dtype=dtype, scale=2.5)
        x.reshape(-1)[:3] = 0  # the conventions at exactly 0
        dy = rand(4, 5, 6, dtype=dtype)
        y_tanh = np.tanh(x.astype(np.float64)).astype(dtype)
        record("TanhGrad", f"3d{suffix}", {"dY": dy, "Y": y_tanh}, ["dX"])
        y_leaky = np.where(x > 0, x, x * dtype(0.01)).astype(dtype)
        record("LeakyReluGrad", f"default_alpha{suffix}", {"dY": dy, "Y": y_leaky}, ["dX"])
        record("LeakyReluGrad", f"alpha0.2{suffix}", {"dY": dy, "Y": np.where(x > 0, x, x * dtype(0.2))}, ["dX"],
               {"alpha": 0.2})
        record("QuickGelu", f"default_alpha{suffix}", {"X": x}, ["Y"])
        record("QuickGelu", f"silu_alpha1{suffix}", {"X": x}, ["Y"], {"alpha": 1.0})
        record("QuickGeluGrad", f"default_alpha{suffix}", {"dY": dy, "X": x}, ["dX"])
        record("QuickGeluGrad", f"silu_alpha1{suffix}", {"dY": dy, "X": x}, ["dX"], {"alpha": 1.0})
        record("GeluGrad", f"3d{suffix}", {"dY": dy, "X": x}, ["dX"])
        record("FastGeluGrad", f"3d{suffix}", {"dY": dy, "X": x}, ["dX"])
        b = rand(6, dtype=dtype)
        record("BiasGelu", f"3d{suffix}", {"A": x, "B": b}, ["C"])
        record("BiasGeluGrad_dX", f"3d{suffix}", {"dY": dy, "X": x, "B": b}, ["dX"])
        record("BiasFastGeluGrad_dX", f"3d{suffix}", {"dY": dy, "X": x, "B": b}, ["dX"])
    # large magnitudes: the tails of erf/tanh/sigmoid
    x = rand(2, 10, scale=8.0)
    dy = rand(2, 10)
    record("GeluGrad", "2d_wide", {"dY": dy, "X": x}, ["dX"])
    record("FastGeluGrad", "2d_wide", {"dY": dy, "X": x}, ["dX"])
    record("QuickGeluGrad", "2d_wide", {"dY": dy, "X": x}, ["dX"])
    # f64 where onnxruntime-training runs it (TanhGrad and FastGeluGrad through their function bodies)
    x64 = rand(3, 7, dtype=D, scale=2.0)
    record("TanhGrad", "2d_f64", {"dY": rand(3, 7, dtype=D), "Y": np.tanh(x64)}, ["dX"])
    record("FastGeluGrad", "2d_f64", {"dY": rand(3, 7, dtype=D), "X": x64}, ["dX"])
    # Gelu (com.microsoft): the erf GELU after a Linear's Gemm, which generate_artifacts leaves fused as Gelu
    for dtype, suffix in ((np.float32, ""), (H, "_f16")):
        record("Gelu", f"3d{suffix}", {"X": rand(3, 4, 5, dtype=dtype, scale=3.0)}, ["Y"])
