"""Record onnxruntime-training's own results as test fixtures (tests/fixtures/ort_training/).

Run with the python of the environment tools/ort_training/make_env.sh makes (onnxruntime-training
1.19.2, onnx 1.17.0, numpy<2, torch 2.13.0); never imported by the package or its tests:

    /work/ortt-venv/bin/python tools/ort_training/make_fixtures.py [--only ops|artifacts]
    /work/ortt-venv/bin/python tools/ort_training/make_fixtures.py --family NAME

An op family (``cases_<NAME>.py`` beside this file: ``SEED`` and ``make(rng)`` calling ``record``) draws from
its own seeded stream and writes its own index ``ops/cases_<NAME>.json``, so families are recorded (and
re-recorded) independently of each other and of the core cases in ``ops/cases.json``.

Writes
- ops/<Op>/<variant>.onnx + .npz: one training op in a one-node model, run by onnxruntime-training's
  InferenceSession (its CPU kernels for the training ops); the npz holds ``in.<name>`` and
  ``out.<name>`` arrays (a tensor sequence as ``in.<name>.<i>``); ops/cases.json indexes them.
- op_schemas.json: each training op's inputs/outputs/attributes as onnxruntime-training reports them
  (when the wheel exposes schemas; the 1.19.2 wheel does not, and op_schemas_source.py writes it).
- artifacts/<name>/: generate_artifacts output for small torch models plus the training API's results
  (see make_artifacts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

HERE = Path(__file__).resolve().parent
OUT = HERE.parent.parent / "tests" / "fixtures" / "ort_training"
OPSET = 17  # the default-domain opset generate_artifacts' torch export uses
RNG = np.random.default_rng(12)

# (domain, op_type) of every training op recorded; op_schemas.json describes exactly these.
TRAINING_OPS = [
    ("com.microsoft", "ConvGrad"), ("com.microsoft", "ReluGrad"), ("", "MaxPoolGrad"),
    ("", "AveragePoolGrad"), ("com.microsoft", "Scale"), ("com.microsoft", "SoftmaxCrossEntropyLossGrad"),
    ("com.microsoft", "SoftmaxCrossEntropyLossInternal"), ("com.microsoft", "SoftmaxCrossEntropyLossInternalGrad"),
    ("com.microsoft", "InPlaceAccumulatorV2"), ("com.microsoft", "AdamWOptimizer"),
    ("com.microsoft", "SGDOptimizerV2"), ("com.microsoft", "BatchNormInternal"),
    ("com.microsoft", "BatchNormalizationGrad"), ("com.microsoft", "SigmoidGrad"),
    ("com.microsoft", "GatherGrad"), ("com.microsoft", "SoftmaxGrad_13"), ("com.microsoft", "SoftmaxGrad"),
    ("com.microsoft", "LogSoftmaxGrad_13"), ("com.microsoft", "GlobalAveragePoolGrad"),
    ("com.microsoft", "BroadcastGradientArgs"), ("com.microsoft", "ReduceSumTraining"),
]

_NP = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
       np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.int64): TensorProto.INT64,
       np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL}

_cases: list[dict] = []


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def _value_info(name: str, value) -> onnx.ValueInfoProto:
    if isinstance(value, list):
        elem = helper.make_tensor_type_proto(_NP[value[0].dtype], None)
        return helper.make_value_info(name, helper.make_sequence_type_proto(elem))
    return helper.make_tensor_value_info(name, _NP[value.dtype], list(value.shape))


def record(op: str, variant: str, inputs: dict, outputs: list[str], attrs: dict | None = None,
           domain: str = "com.microsoft", output_types: dict | None = None) -> dict:
    """Build a one-node model of ``op``, run it in onnxruntime-training, save model + arrays.

    ``inputs`` maps input names to arrays (a list = tensor sequence; None = omitted optional input,
    kept as an empty name so later inputs keep their positions). ``outputs``: names, "" = not requested.
    """
    attrs = attrs or {}
    in_names = [name if value is not None else "" for name, value in inputs.items()]
    node = helper.make_node(op, in_names, outputs, name=f"{op}_{variant}", domain=domain, **attrs)
    graph_inputs = [_value_info(n, v) for n, v in inputs.items() if v is not None]
    # output types are left to onnxruntime's inference; declared ones only where it needs them
    graph_outputs = [helper.make_value_info(n, onnx.TypeProto()) if not (output_types or {}).get(n)
                     else output_types[n] for n in outputs if n]
    graph = helper.make_graph([node], f"{op}_{variant}", graph_inputs, graph_outputs)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="make_fixtures")
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {n: v for n, v in inputs.items() if v is not None}
    # the session gets copies: the in-place kernels (accumulator, optimizers) write into the fed
    # arrays' memory, which would change the recorded inputs and the arrays later cases share
    results = session.run(None, {n: [np.array(t, copy=True) for t in v] if isinstance(v, list)
                                 else np.array(v, copy=True) for n, v in feeds.items()})
    requested = [n for n in outputs if n]
    arrays: dict[str, np.ndarray] = {}
    for name, value in feeds.items():
        _put(arrays, f"in.{name}", value)
    for name, value in zip(requested, results, strict=True):
        _put(arrays, f"out.{name}", value)
    # fix the declared output types to what onnxruntime produced, so the saved model is self-describing
    del model.graph.output[:]  # make_model copied the graph
    model.graph.output.extend(_value_info(n, v if not isinstance(v, list) else list(v))
                        for n, v in zip(requested, results, strict=True))
    directory = OUT / "ops" / op
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(model, directory / f"{variant}.onnx")
    np.savez_compressed(directory / f"{variant}.npz", **arrays)
    case = {"op_type": op, "domain": domain, "variant": variant,
            "model": f"ops/{op}/{variant}.onnx", "arrays": f"ops/{op}/{variant}.npz",
            "attributes": {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()},
            "inputs": in_names, "outputs": outputs,
            "sequences": [n for n, v in inputs.items() if isinstance(v, list)]
            + [n for n, v in zip(requested, results, strict=True) if isinstance(v, list)]}
    _cases.append(case)
    print(f"  {op}/{variant}")
    return dict(zip(requested, results, strict=True))


def _put(arrays: dict, key: str, value) -> None:
    if isinstance(value, list):
        for i, item in enumerate(value):
            arrays[f"{key}.{i}"] = np.asarray(item)
    else:
        arrays[key] = np.asarray(value)


def conv_out(size: int, k: int, s: int, d: int, pb: int, pe: int) -> int:
    return (size + pb + pe - d * (k - 1) - 1) // s + 1


def conv_grad_cases() -> None:
    # (variant, N, C, spatial, M, group, kernel, strides, pads, dilations, bias_grad)
    cases = [
        ("2d_basic", 2, 4, (6, 6), 6, 1, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), True),
        ("2d_no_bias", 2, 4, (6, 6), 6, 1, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), False),
        ("2d_stride2", 2, 4, (7, 7), 8, 1, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), True),
        ("2d_stride2_nopad", 3, 4, (8, 8), 4, 1, (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), True),
        ("2d_asym_pads_stride", 2, 3, (7, 6), 5, 1, (3, 2), (2, 1), (0, 1, 2, 0), (1, 1), True),
        ("2d_dilation2", 2, 4, (8, 8), 4, 1, (3, 3), (1, 1), (2, 2, 2, 2), (2, 2), True),
        ("2d_group2", 2, 4, (6, 6), 6, 2, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), True),
        ("2d_depthwise", 2, 6, (6, 6), 6, 6, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), True),
        ("2d_depthwise_mult2_stride2", 2, 4, (8, 8), 8, 4, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False),
        ("2d_1x1", 2, 8, (6, 6), 4, 1, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), False),
        ("1d_basic", 2, 4, (10,), 6, 1, (3,), (1,), (1, 1), (1,), True),
        ("1d_stride2_dilation2_group2", 3, 4, (12,), 6, 2, (3,), (2,), (2, 1), (2,), True),
        ("1d_depthwise_no_bias", 2, 4, (9,), 4, 4, (5,), (1,), (2, 2), (1,), False),
    ]
    for variant, n, c, spatial, m, group, kernel, strides, pads, dilations, bias_grad in cases:
        rank = len(spatial)
        out_spatial = tuple(conv_out(spatial[i], kernel[i], strides[i], dilations[i], pads[i], pads[i + rank])
                            for i in range(rank))
        inputs = {"dY": rand(n, m, *out_spatial), "X": rand(n, c, *spatial), "W": rand(m, c // group, *kernel)}
        attrs = {"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads),
                 "dilations": list(dilations), "group": group}
        record("ConvGrad", variant, inputs, ["dX", "dW", "dB" if bias_grad else ""], attrs)
    # only dW (a frozen input's gradient is not requested): what a first conv layer gets
    inputs = {"dY": rand(2, 4, 6, 6), "X": rand(2, 3, 6, 6), "W": rand(4, 3, 3, 3)}
    record("ConvGrad", "2d_only_dW_dB", inputs, ["", "dW", "dB"],
           {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1})


def relu_grad_cases() -> None:
    x = rand(2, 4, 6, 6)
    x[0, 0, 0, :3] = 0.0  # the gradient at exactly 0 is a convention worth pinning
    record("ReluGrad", "4d", {"dY": rand(2, 4, 6, 6), "X": x}, ["dX"])
    record("ReluGrad", "2d", {"dY": rand(3, 5), "X": rand(3, 5)}, ["dX"])
    record("ReluGrad", "4d_f16", {"dY": rand(2, 3, 4, 4, dtype=np.float16), "X": rand(2, 3, 4, 4, dtype=np.float16)},
           ["dX"])


def sigmoid_grad_cases() -> None:
    # the BCEWithLogitsLoss artifact's gradient; its second input is the Sigmoid output
    y = (1.0 / (1.0 + np.exp(-rand(4, 3)))).astype(np.float32)
    record("SigmoidGrad", "2d", {"dY": rand(4, 3), "Y": y}, ["dX"])


def float16_cases() -> None:
    # onnxruntime-training runs these with f16 tensors (through its own kernels or casts it inserts)
    h = np.float16
    record("ConvGrad", "2d_f16", {"dY": rand(2, 4, 6, 6, dtype=h), "X": rand(2, 3, 6, 6, dtype=h),
                                  "W": rand(4, 3, 3, 3, dtype=h)}, ["dX", "dW", "dB"],
           {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1], "group": 1})
    record("Scale", "f16", {"input": rand(3, 4, dtype=h), "scale": np.array(2.0, np.float32)}, ["output"],
           {"scale_down": 1})
    logits = rand(4, 5)
    log_prob = (logits - np.log(np.exp(logits).sum(1, keepdims=True))).astype(h)  # a real log-softmax
    record("SoftmaxCrossEntropyLossGrad", "mean_f16", {"dY": np.array(1.0, h), "log_prob": log_prob,
                                                       "label": np.array([0, 1, 2, 3], np.int64)},
           ["d_logits"], {"reduction": "mean"})
    record("InPlaceAccumulatorV2", "f16", {"accumulation_buffer": rand(4, dtype=h), "value": rand(4, dtype=h)},
           ["updated_flag", "accumulation_buffer_out"])
    xs = rand(2, 3, 4, 4)
    inv_std = (1.0 / np.sqrt(xs.var(axis=(0, 2, 3)) + 1e-5)).astype(np.float32)
    record("BatchNormalizationGrad", "4d_f16_f32stats",
           {"dY": rand(2, 3, 4, 4, dtype=h), "X": xs.astype(h), "scale": rand(3),
            "mean": xs.mean(axis=(0, 2, 3)).astype(np.float32), "variance": inv_std},
           ["X_grad", "scale_grad", "bias_grad"], {"epsilon": 1e-5})


def pool_out(size, k, s, pb, pe, ceil, d=1):
    span = size + pb + pe - d * (k - 1) - 1
    return (-(-span // s) if ceil else span // s) + 1


def max_pool_grad_cases() -> None:
    # (variant, X shape, kernel, strides, pads, ceil_mode, dilations)
    cases = [
        ("k2s2", (2, 4, 6, 6), (2, 2), (2, 2), (0, 0, 0, 0), 0, None),
        ("k3s2p1", (2, 4, 8, 8), (3, 3), (2, 2), (1, 1, 1, 1), 0, None),
        ("k3s1p1_overlap", (2, 3, 6, 6), (3, 3), (1, 1), (1, 1, 1, 1), 0, None),
        ("k3s2_ceil", (2, 4, 8, 8), (3, 3), (2, 2), (0, 0, 0, 0), 1, None),
        ("k2s1_asym", (2, 3, 7, 6), (2, 3), (1, 2), (0, 1, 1, 0), 0, None),
        ("1d_k3s2", (3, 4, 9), (3,), (2,), (1, 1), 0, None),
    ]
    for variant, shape, kernel, strides, pads, ceil, dilations in cases:
        x = rand(*shape)
        attrs = {"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads)}
        fwd_attrs = dict(attrs, ceil_mode=ceil)
        if dilations:
            fwd_attrs["dilations"] = list(dilations)
        # the Indices input comes from the forward MaxPool, as in a training graph
        fwd = helper.make_node("MaxPool", ["X"], ["Y", "Indices"], **fwd_attrs)
        g = helper.make_graph([fwd], "mp", [_value_info("X", x)],
                              [helper.make_value_info("Y", onnx.TypeProto()),
                               helper.make_value_info("Indices", onnx.TypeProto())])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
        m.ir_version = 8
        y, indices = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})
        dy = rand(*y.shape)
        # the kernel takes dX's shape from the graph's declared output shape, not from an input
        declared = {"dX": helper.make_tensor_value_info("dX", TensorProto.FLOAT, list(x.shape))}
        record("MaxPoolGrad", variant, {"dY": dy, "Indices": indices}, ["dX"], attrs, domain="",
               output_types=declared)
        _cases[-1]["forward_input_shape"] = list(x.shape)


def average_pool_grad_cases() -> None:
    # (variant, X shape, kernel, strides, pads, count_include_pad, ceil_mode)
    cases = [
        ("k2s2", (2, 4, 6, 6), (2, 2), (2, 2), (0, 0, 0, 0), 0, 0),
        ("k3s1p1_exclude_pad", (2, 3, 6, 6), (3, 3), (1, 1), (1, 1, 1, 1), 0, 0),
        ("k3s1p1_include_pad", (2, 3, 6, 6), (3, 3), (1, 1), (1, 1, 1, 1), 1, 0),
        ("k3s2p1_include_pad", (2, 4, 7, 7), (3, 3), (2, 2), (1, 1, 1, 1), 1, 0),
        ("k3s2_ceil", (2, 4, 8, 8), (3, 3), (2, 2), (0, 0, 0, 0), 0, 1),
        ("k2s1_asym_pads", (2, 3, 6, 7), (2, 3), (1, 2), (1, 0, 0, 1), 0, 0),
        ("1d_k3s2p1", (3, 4, 9), (3,), (2,), (1, 1), 1, 0),
    ]
    for variant, shape, kernel, strides, pads, include, ceil in cases:
        rank = len(kernel)
        out = tuple(pool_out(shape[2 + i], kernel[i], strides[i], pads[i], pads[i + rank], ceil) for i in range(rank))
        attrs = {"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads),
                 "count_include_pad": include}
        if ceil:
            attrs["ceil_mode"] = ceil
        x = rand(*shape)
        dy = rand(shape[0], shape[1], *out)
        # like MaxPoolGrad, the kernel reads dX's shape from the declared graph output
        declared = {"dX": helper.make_tensor_value_info("dX", TensorProto.FLOAT, list(x.shape))}
        try:
            record("AveragePoolGrad", variant, {"dY": dy}, ["dX"], attrs, domain="", output_types=declared)
            _cases[-1]["forward_input_shape"] = list(x.shape)
        except Exception as err:  # ceil_mode may not be an attribute of the schema: say so, go on
            print(f"  AveragePoolGrad/{variant}: not recorded: {str(err).splitlines()[0]}")


def scale_cases() -> None:
    for scale_down in (0, 1):
        record("Scale", f"scale_down{scale_down}", {"input": rand(2, 4, 3), "scale": np.array(0.25, np.float32)},
               ["output"], {"scale_down": scale_down})
    record("Scale", "scale_shape1", {"input": rand(3, 5), "scale": np.array([4.0], np.float32)}, ["output"],
           {"scale_down": 1})


def softmax_ce_grad_cases() -> None:
    n, c = 4, 5
    labels = np.array([1, 0, 4, 2], np.int64)
    logits = rand(n, c)
    log_prob = (logits - np.log(np.exp(logits).sum(1, keepdims=True))).astype(np.float32)
    weight = np.abs(rand(c)) + 0.1
    for reduction in ("mean", "sum", "none"):
        dy = rand(n) if reduction == "none" else np.array(0.7, np.float32)
        for use_weight in (False, True):
            for ignore in (None, 2):
                lab = labels.copy()
                if ignore is not None:
                    lab[1] = ignore
                attrs = {"reduction": reduction}
                if ignore is not None:
                    attrs["ignore_index"] = ignore
                variant = f"{reduction}{'_weight' if use_weight else ''}{'_ignore' if ignore is not None else ''}"
                inputs = {"dY": dy, "log_prob": log_prob, "label": lab}
                if use_weight:
                    inputs["weight"] = weight
                record("SoftmaxCrossEntropyLossGrad", variant, inputs, ["d_logits"], attrs)
    # 3-D logits [N, C, D] as CrossEntropyLoss on a sequence emits
    log_prob3 = rand(2, c, 3)
    log_prob3 = log_prob3 - np.log(np.exp(log_prob3).sum(1, keepdims=True))
    record("SoftmaxCrossEntropyLossGrad", "mean_3d", {"dY": np.array(1.0, np.float32),
           "log_prob": log_prob3.astype(np.float32), "label": np.array([[0, 4, 1], [2, 2, 3]], np.int64)},
           ["d_logits"], {"reduction": "mean"})


def accumulator_cases() -> None:
    for lazy in (False, True):
        buf, value = rand(4, 3), rand(4, 3)
        record("InPlaceAccumulatorV2", f"lazy_reset_{str(lazy).lower()}",
               {"accumulation_buffer": buf, "value": value, "overwrite_flag": np.array([lazy])},
               ["updated_flag", "accumulation_buffer_out"])
    record("InPlaceAccumulatorV2", "no_overwrite_flag", {"accumulation_buffer": rand(6), "value": rand(6)},
           ["updated_flag", "accumulation_buffer_out"])


def optimizer_cases() -> None:
    shapes = [(4, 3, 3, 3), (4,), (5, 4)]
    params = [rand(*s) for s in shapes]
    grads = [rand(*s) for s in shapes]
    m1 = [rand(*s) * 0.1 for s in shapes]
    m2 = [np.abs(rand(*s)) * 0.01 for s in shapes]
    zeros = [np.zeros(s, np.float32) for s in shapes]
    lr = np.array([1e-2], np.float32)
    adamw = [
        ("defaults_step1_zero_moments", {}, 1, zeros, zeros),
        ("defaults_step5", {}, 5, m1, m2),
        ("torch_mode_step1", {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8, "weight_decay": 0.01,
                              "adam_mode": 0, "correct_bias": 1}, 1, zeros, zeros),
        ("torch_mode_step3", {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8, "weight_decay": 0.01,
                              "adam_mode": 0, "correct_bias": 1}, 3, m1, m2),
        ("hf_mode_step3", {"alpha": 0.8, "beta": 0.99, "epsilon": 1e-6, "weight_decay": 0.1,
                           "adam_mode": 1, "correct_bias": 1}, 3, m1, m2),
        ("hf_mode_no_bias_correction_step3", {"alpha": 0.8, "beta": 0.99, "epsilon": 1e-6, "weight_decay": 0.1,
                                              "adam_mode": 1, "correct_bias": 0}, 3, m1, m2),
        ("torch_mode_no_weight_decay_step2", {"weight_decay": 0.0, "adam_mode": 0, "correct_bias": 1}, 2, m1, m2),
    ]
    out = ["updated_flag", "updated_weights", "updated_momentums_1", "updated_momentums_2"]
    for variant, attrs, step, mom1, mom2 in adamw:
        inputs = {"lr": lr, "step": np.array([step], np.int64), "weights": params, "gradients": grads,
                  "momentums_1": mom1, "momentums_2": mom2}
        record("AdamWOptimizer", variant, inputs, out, attrs)
    inputs = {"lr": lr, "step": np.array([1], np.int64), "weights": params, "gradients": grads,
              "momentums_1": zeros, "momentums_2": zeros, "update_signal": np.array([False])}
    record("AdamWOptimizer", "update_signal_false", inputs, out, {})
    for variant, extra in (("basic", {}), ("update_signal_true", {"update_signal": np.array([True])}),
                           ("update_signal_false", {"update_signal": np.array([False])})):
        inputs = {"lr": lr, "weights": params, "gradients": grads, **extra}
        record("SGDOptimizerV2", variant, inputs, ["update_completed", "updated_weights"])


def batch_norm_cases() -> None:
    x, scale, bias = rand(3, 4, 5, 5), rand(4), rand(4)
    mean, var = rand(4) * 0.1, np.abs(rand(4)) + 0.5
    out = ["Y", "running_mean", "running_var", "saved_mean", "saved_inv_std"]
    for variant, attrs in (("train_4d", {"epsilon": 1e-5, "momentum": 0.9, "training_mode": 1}),
                           ("eval_4d", {"epsilon": 1e-5, "momentum": 0.9, "training_mode": 0})):
        record("BatchNormInternal", variant, {"X": x, "scale": scale, "B": bias, "input_mean": mean,
                                              "input_var": var}, out if "train" in variant else out[:1], attrs)
    saved = record("BatchNormInternal", "train_2d", {"X": rand(6, 4), "scale": scale, "B": bias,
                                                     "input_mean": mean, "input_var": var}, out,
                   {"epsilon": 1e-3, "momentum": 0.8, "training_mode": 1})
    del saved
    # the gradient takes the forward's saved mean and inverse std
    xs = rand(3, 4, 5, 5)
    mu = xs.mean(axis=(0, 2, 3))
    inv_std = (1.0 / np.sqrt(xs.var(axis=(0, 2, 3)) + 1e-5)).astype(np.float32)
    record("BatchNormalizationGrad", "4d", {"dY": rand(3, 4, 5, 5), "X": xs, "scale": scale,
                                            "mean": mu.astype(np.float32), "variance": inv_std},
           ["X_grad", "scale_grad", "bias_grad"], {"epsilon": 1e-5})


def schemas() -> None:
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    if not hasattr(state, "get_all_operator_schema"):
        # the 1.19.2 wheel is built without the schema binding: op_schemas.json then comes from
        # op_schemas_source.py, transcribed from onnxruntime's training_op_defs.cc
        print("op_schemas.json: this build exposes no operator schemas; run op_schemas_source.py")
        return
    wanted = {(d, op) for d, op in TRAINING_OPS}
    found: dict[str, dict] = {}
    for schema in state.get_all_operator_schema():
        if (schema.domain, schema.name) not in wanted:
            continue
        key = f"{schema.domain or 'ai.onnx'}::{schema.name}"
        if key in found and found[key]["since_version"] > schema.since_version:
            continue

        def formal(p):
            return {"name": p.name, "type_str": p.typeStr, "option": str(p.option).split(".")[-1],
                    "description": p.description}

        found[key] = {
            "domain": schema.domain, "name": schema.name, "since_version": schema.since_version,
            "inputs": [formal(p) for p in schema.inputs], "outputs": [formal(p) for p in schema.outputs],
            "min_input": schema.min_input, "max_input": schema.max_input,
            "min_output": schema.min_output, "max_output": schema.max_output,
            "attributes": {name: {"type": str(a.type).split(".")[-1], "required": a.required,
                                  "default": _attr_default(a.default_value), "description": a.description}
                           for name, a in sorted(schema.attributes.items())},
            "type_constraints": [{"type_param": tc.type_param_str, "allowed": sorted(tc.allowed_type_strs)}
                                 for tc in schema.type_constraints],
            "doc": schema.doc,
        }
    (OUT / "op_schemas.json").write_text(json.dumps(dict(sorted(found.items())), indent=1) + "\n")
    missing = sorted(f"{d}::{o}" for d, o in wanted if f"{d or 'ai.onnx'}::{o}" not in found)
    print(f"op_schemas.json: {len(found)} schemas; not registered: {missing}")


def _attr_default(attribute_proto) -> object:
    if attribute_proto is None or not attribute_proto.name and attribute_proto.type == 0:
        return None
    try:
        value = helper.get_attribute_value(attribute_proto)
    except Exception:
        return None
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    return value


def ops() -> None:
    global _cases
    _cases = []
    schemas()
    for make in (conv_grad_cases, relu_grad_cases, max_pool_grad_cases, average_pool_grad_cases, scale_cases,
                 softmax_ce_grad_cases, accumulator_cases, optimizer_cases, batch_norm_cases, sigmoid_grad_cases,
                 float16_cases):
        make()
    (OUT / "ops" / "cases.json").write_text(json.dumps(_cases, indent=1) + "\n")
    print(f"{len(_cases)} op cases")


def family(name: str) -> None:
    """Record one op family: ``cases_<name>.py``'s ``make(rng)`` with its own ``SEED``; index cases_<name>.json."""
    global _cases, RNG
    sys.path.insert(0, str(HERE))
    # the family module's ``import make_fixtures`` must get this very module (run as __main__), else its
    # ``record`` calls would fill a second copy's case list and the index would stay empty
    sys.modules.setdefault("make_fixtures", sys.modules[__name__])
    module = __import__(f"cases_{name}")
    _cases = []
    RNG = np.random.default_rng(module.SEED)  # ``rand`` draws from it too
    module.make(RNG)
    (OUT / "ops" / f"cases_{name}.json").write_text(json.dumps(_cases, indent=1) + "\n")
    print(f"{len(_cases)} {name} cases")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["ops", "artifacts"])
    parser.add_argument("--family", help="record only the op family tools/ort_training/cases_<FAMILY>.py")
    parser.add_argument("--artifact", action="append", help="record only this artifact (repeatable)")
    args = parser.parse_args()
    print("onnxruntime", ort.__version__, "onnx", onnx.__version__, "numpy", np.__version__)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.family:
        family(args.family)
        return 0
    if args.artifact:
        args.only = "artifacts"
    if args.only in (None, "ops"):
        ops()
    if args.only in (None, "artifacts"):
        # torch's oneDNN picks its convolution kernels by CPU: the artifacts were exported with its AVX2 ones
        # (on an AVX-512 host cnn's BatchNorm running stats, which the export's training-mode forward updates,
        # come out a bit off). oneDNN reads this at its first convolution, so setting it here still counts
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        sys.path.insert(0, str(HERE))
        import make_artifacts

        make_artifacts.main(OUT / "artifacts", args.artifact)
    return 0


if __name__ == "__main__":
    sys.exit(main())
