"""Writes tests/fixtures/ort_training/op_schemas.json.

The onnxruntime-training 1.19.2 wheel has no binding that lists operator schemas
(onnxruntime_pybind11_state.get_all_operator_schema is absent), so the names, optionality, type
constraints and attributes below were transcribed by hand from onnxruntime's
orttraining/orttraining/core/graph/training_op_defs.cc (and the BatchNormInternal /
BatchNormalizationGrad schemas there) and checked against what the 1.19.2 kernels accept
(tests/fixtures/ort_training/ops/: input counts, optional outputs). Run with any python.
"""

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "ort_training" / "op_schemas.json"
FLOATS = ["tensor(float16)", "tensor(float)", "tensor(double)"]
FLOATS_BF = FLOATS + ["tensor(bfloat16)"]
SEQ = ["seq(tensor(float16))", "seq(tensor(float))", "seq(tensor(double))"]
POOL_ATTRS = {"kernel_shape": ("INTS", True, None), "strides": ("INTS", False, None),
              "auto_pad": ("STRING", False, "NOTSET"), "pads": ("INTS", False, None)}

RNN_ATTRS = {"activation_alpha": ("FLOATS", False, None), "activation_beta": ("FLOATS", False, None),
             "activations": ("STRINGS", False, None), "clip": ("FLOAT", False, None),
             "direction": ("STRING", False, "forward"), "hidden_size": ("INT", False, None)}


def io(*items):
    """(name, type_param, option) triples; option: Single | Optional."""
    return [{"name": n, "type_str": t, "option": o} for n, t, o in items]


def attrs(**spec):
    return {k: {"type": t, "required": r, "default": d} for k, (t, r, d) in spec.items()}


S, OPT = "Single", "Optional"
KERNEL_F32 = "the 1.19.2 CPU kernel is f32 only; f16 nodes run through casts it inserts (recorded)"
SCHEMAS = {
    "com.microsoft::ConvGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("X", "T", S), ("W", "T", S)),
        outputs=io(("dX", "T", OPT), ("dW", "T", OPT), ("dB", "T", OPT)), attributes={},
        allow_unchecked_attributes=True,
        note="attributes are Conv's (auto_pad, dilations, group, kernel_shape, pads, strides), unchecked",
        type_constraints={"T": FLOATS}),
    "com.microsoft::ReluGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("X", "T", S)), outputs=io(("dX", "T", S)), attributes={},
        type_constraints={"T": FLOATS_BF}),
    "ai.onnx::MaxPoolGrad": dict(
        since_version=9, inputs=io(("dY", "T", S), ("Indices", "I", S)), outputs=io(("dX", "T", S)),
        attributes={}, allow_unchecked_attributes=True,
        note="attributes are MaxPool's, unchecked; the CPU kernel takes dX's shape from the node's "
             "declared output shape (there is no X input)",
        type_constraints={"T": FLOATS, "I": ["tensor(int64)"]}),
    "ai.onnx::AveragePoolGrad": dict(
        since_version=9, inputs=io(("dY", "T", S)), outputs=io(("dX", "T", S)),
        attributes=attrs(**POOL_ATTRS, count_include_pad=("INT", False, 0)), allow_unchecked_attributes=True,
        note="other AveragePool attributes (ceil_mode) pass unchecked; dX's shape comes from the node's "
             "declared output shape",
        type_constraints={"T": FLOATS}),
    "com.microsoft::Scale": dict(
        since_version=1, inputs=io(("input", "T", S), ("scale", "ScaleT", S)), outputs=io(("output", "T", S)),
        attributes=attrs(scale_down=("INT", False, 0)),
        note="ScaleT's allowed types were not transcribed; float32 is recorded", type_constraints={"T": FLOATS}),
    "com.microsoft::SoftmaxCrossEntropyLossGrad": dict(
        since_version=1,
        inputs=io(("dY", "T", S), ("log_prob", "T", S), ("label", "Tind", S), ("weight", "T", OPT)),
        outputs=io(("d_logits", "T", S)),
        attributes=attrs(reduction=("STRING", False, "mean"), ignore_index=("INT", False, None)),
        type_constraints={"T": FLOATS_BF, "Tind": ["tensor(int32)", "tensor(int64)"]}),
    "com.microsoft::InPlaceAccumulatorV2": dict(
        since_version=1,
        inputs=io(("accumulation_buffer", "T", S), ("value", "T_GRAD", S), ("overwrite_flag", "T_BOOL", OPT)),
        outputs=io(("updated_flag", "T_BOOL", S), ("accumulation_buffer_out", "T", OPT)), attributes={},
        note="updated_flag has shape [1]; without accumulation_buffer_out the buffer is updated in place",
        type_constraints={"T": FLOATS_BF, "T_GRAD": FLOATS_BF, "T_BOOL": ["tensor(bool)"]}),
    "com.microsoft::AdamWOptimizer": dict(
        since_version=1,
        inputs=io(("lr", "T1", S), ("step", "T2", S), ("weights", "S_WEIGHT", S), ("gradients", "S_GRAD", S),
                  ("momentums_1", "S_MOMENT", S), ("momentums_2", "S_MOMENT", S), ("update_signal", "T_BOOL", OPT)),
        outputs=io(("updated_flag", "T2", S), ("updated_weights", "S_WEIGHT", OPT),
                   ("updated_momentums_1", "S_MOMENT", OPT), ("updated_momentums_2", "S_MOMENT", OPT)),
        attributes=attrs(alpha=("FLOAT", False, 0.9), beta=("FLOAT", False, 0.999), epsilon=("FLOAT", False, 1e-8),
                         weight_decay=("FLOAT", False, 1e-2), correct_bias=("INT", False, 1),
                         adam_mode=("INT", False, 0)),
        note="adam_mode 0: weight decay before the update (torch AdamW); 1: after (Hugging Face AdamW)",
        type_constraints={"T1": ["tensor(float)"], "T2": ["tensor(int64)"], "S_WEIGHT": SEQ, "S_GRAD": SEQ,
                          "S_MOMENT": SEQ, "T_BOOL": ["tensor(bool)"]}),
    "com.microsoft::SGDOptimizerV2": dict(
        since_version=1,
        inputs=io(("lr", "T1", S), ("weights", "S_WEIGHT", S), ("gradients", "S_GRAD", S),
                  ("update_signal", "T_BOOL", OPT)),
        outputs=io(("update_completed", "T_BOOL", S), ("updated_weights", "S_WEIGHT", OPT)), attributes={},
        type_constraints={"T1": ["tensor(float)"], "T_BOOL": ["tensor(bool)"], "S_WEIGHT": SEQ, "S_GRAD": SEQ}),
    "com.microsoft::BatchNormInternal": dict(
        since_version=1,
        inputs=io(("X", "T", S), ("scale", "T", S), ("B", "T", S), ("input_mean", "U", S), ("input_var", "U", S)),
        outputs=io(("Y", "T", S), ("running_mean", "U", OPT), ("running_var", "U", OPT), ("saved_mean", "U", OPT),
                   ("saved_inv_std", "U", OPT)),
        attributes=attrs(epsilon=("FLOAT", False, 1e-5), momentum=("FLOAT", False, 0.9),
                         training_mode=("INT", False, 1)),
        note="see specs/com.microsoft/BatchNormInternal.rst", type_constraints={}),
    "com.microsoft::BatchNormalizationGrad": dict(
        since_version=1,
        inputs=io(("dY", "T", S), ("X", "T", S), ("scale", "T1", S), ("mean", "T2", S), ("variance", "T2", S)),
        outputs=io(("X_grad", "T", S), ("scale_grad", "T1", S), ("bias_grad", "T1", S)),
        attributes=attrs(epsilon=("FLOAT", False, None)),
        note="input names as the project's spec quotes onnxruntime's schema; the fifth input is read as the "
             "saved inverse standard deviation; see "
             "specs/com.microsoft/BatchNormalizationGrad.rst", type_constraints={}),
    "com.microsoft::SigmoidGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("Y", "T", S)), outputs=io(("dX", "T", S)), attributes={},
        note="seen in the BCEWithLogitsLoss artifact; input names not transcribed (positional: output gradient, "
             "Sigmoid output); the fixture ops/SigmoidGrad shows dX = dY * Y * (1 - Y)",
        type_constraints={"T": FLOATS_BF}),
    "com.microsoft::DivGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("A", "T", S), ("B", "T", S)),
        outputs=io(("dA", "T", OPT), ("dB", "T", OPT)), attributes={},
        note="no CPU kernel: the CPU runs the schema's function body (Div, ReduceSumTraining over "
             "BroadcastGradientArgs' axes, Reshape; dB = dY * (-A / (B * B))), f32/f64/f16, bf16 refused by "
             "ReduceSumTraining (the ops/DivGrad fixtures)",
        type_constraints={"T": FLOATS_BF}),
    "com.microsoft::SoftmaxGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("Y", "T", S)), outputs=io(("dX", "T", S)),
        attributes=attrs(axis=("INT", False, 1)),
        note="pre-13 axis: the sum runs over every axis from axis on (the ops/SoftmaxGrad fixtures); the CPU kernel "
             "runs f32/f16, f64 through the schema's function body",
        type_constraints={"T": FLOATS_BF}),
    "com.microsoft::SoftmaxGrad_13": dict(
        since_version=1, inputs=io(("dY", "T", S), ("Y", "T", S)), outputs=io(("dX", "T", S)),
        attributes=attrs(axis=("INT", False, -1)),
        note="the sum runs over axis alone; the CPU kernel runs f32/f16 (no f64)",
        type_constraints={"T": FLOATS_BF}),
    "com.microsoft::LogSoftmaxGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("X", "T", S)), outputs=io(("dX", "T", S)),
        attributes=attrs(axis=("INT", False, 1)),
        note="X is the LogSoftmax output; pre-13 axis as SoftmaxGrad; the CPU kernel runs f32/f16 (no f64)",
        type_constraints={"T": FLOATS}),
    "com.microsoft::LogSoftmaxGrad_13": dict(
        since_version=1, inputs=io(("dY", "T", S), ("X", "T", S)), outputs=io(("dX", "T", S)),
        attributes=attrs(axis=("INT", False, -1)),
        note="X is the LogSoftmax output; the sum runs over axis alone; the CPU kernel runs f32/f16 (no f64)",
        type_constraints={"T": FLOATS}),
    "com.microsoft::LayerNormalizationGrad": dict(
        since_version=1,
        inputs=io(("Y_grad", "T", S), ("X", "T", S), ("scale", "T", S), ("mean", "U", S), ("inv_std_var", "U", S)),
        outputs=io(("X_grad", "T", S), ("scale_grad", "T", S), ("bias_grad", "T", S)),
        attributes=attrs(axis=("INT", False, -1)), allow_unchecked_attributes=True,
        note="the gradient builder copies the forward's epsilon and stash_type onto it (unchecked); every output "
             "is required by the schema; the CPU kernel takes T f32/f16/f64 with U f32 only",
        type_constraints={"T": FLOATS_BF, "U": ["tensor(float)", "tensor(bfloat16)"]}),
    "com.microsoft::SimplifiedLayerNormalizationGrad": dict(
        since_version=1,
        inputs=io(("Y_grad", "T", S), ("X", "T", S), ("scale", "T", S), ("inv_std_var", "U", S)),
        outputs=io(("X_grad", "T", S), ("scale_grad", "T", S)),
        attributes=attrs(axis=("INT", False, -1)), allow_unchecked_attributes=True,
        note="epsilon and stash_type copied from the forward (unchecked); both outputs required by the schema; the "
             "CPU kernel takes T f32/f16 (no f64)",
        type_constraints={"T": FLOATS_BF, "U": ["tensor(float)"]}),
    "ai.onnx::SimplifiedLayerNormalization": dict(
        since_version=1, inputs=io(("X", "T", S), ("scale", "T", S)),
        outputs=io(("Y", "T", S), ("inv_std_var", "U", OPT)),
        attributes=attrs(axis=("INT", False, -1), epsilon=("FLOAT", False, 1e-5)), allow_unchecked_attributes=True,
        note="default domain, not standard ONNX: onnxruntime's fusion of a hand-written RMSNorm, written into "
             "generate_artifacts' training models; inv_std_var has X's row dims followed by 1s (the kernel's shape); "
             "the CPU kernel takes f32/f16 (no f64)",
        type_constraints={"T": FLOATS_BF, "U": ["tensor(float)"]}),
    "com.microsoft::FusedMatMul": dict(
        since_version=1, inputs=io(("A", "T", S), ("B", "T", S)), outputs=io(("Y", "T", S)),
        attributes=attrs(alpha=("FLOAT", False, 1.0), transA=("INT", False, 0), transB=("INT", False, 0),
                         transBatchA=("INT", False, 0), transBatchB=("INT", False, 0)),
        note="a contrib op of plain onnxruntime too; the 1.19.2 CPU kernel runs f32 and f16 (no f64); transBatch "
             "moves axis 0 to rank - 2 and needs both operands of one rank >= 3 (ops/FusedMatMul)",
        type_constraints={"T": FLOATS_BF}),
    "com.microsoft::GatherGrad": dict(
        since_version=1, inputs=io(("shape", "I", S), ("indices", "Tind", S), ("dY", "T", S)),
        outputs=io(("dX", "T", S)), attributes=attrs(axis=("INT", False, 0)),
        note="the 1.19.2 CPU kernel takes shape as int64 only (int32 has no kernel)",
        type_constraints={"I": ["tensor(int32)", "tensor(int64)"], "T": FLOATS_BF,
                          "Tind": ["tensor(int32)", "tensor(int64)"]}),
    "com.microsoft::SliceGrad": dict(
        since_version=1,
        inputs=io(("dY", "T", S), ("shape", "I", S), ("starts", "Tind", S), ("ends", "Tind", S),
                  ("axes", "Tind", OPT), ("steps", "Tind", OPT)),
        outputs=io(("dX", "T", S)), attributes={},
        note="T is every tensor type in the schema; the 1.19.2 CPU kernel runs f32 and f64 only and fails on "
             "negative steps",
        type_constraints={"I": ["tensor(int64)"], "T": FLOATS_BF, "Tind": ["tensor(int32)", "tensor(int64)"]}),
    "com.microsoft::ConcatTraining": dict(
        since_version=1, inputs=io(("inputs", "T", "Variadic")),
        outputs=io(("concat_result", "T", S), ("per_input_length", "Tint", OPT)),
        attributes=attrs(axis=("INT", True, None)),
        note="T is every tensor type", type_constraints={"T": FLOATS_BF, "Tint": ["tensor(int64)"]}),
    "com.microsoft::SplitTraining": dict(
        since_version=1, inputs=io(("input", "T", S), ("split", "tensor(int64)", S)),
        outputs=io(("outputs", "T", "Variadic")), attributes=attrs(axis=("INT", False, 0)),
        note="T is every tensor type in the schema; the 1.19.2 CPU kernel runs f32 only among the floats, takes "
             "an empty split as equal pieces, and stops the process when an output is omitted",
        type_constraints={"T": FLOATS_BF}),
    # the activation family (issue 19; tools/ort_training/cases_activations.py records each)
    "com.microsoft::DropoutGrad": dict(
        since_version=1,
        inputs=io(("dy", "T", S), ("mask", "T2", S), ("ratio", "T1", OPT), ("training_mode", "T2", OPT)),
        outputs=io(("dx", "T", S)), attributes={}, allow_unchecked_attributes=True,
        note="ratio defaults to 0.5; the f32/f64 CPU kernels pass dy unchanged at ratio 0 and ignore "
             "training_mode; f16 runs through the schema's function body (Where(mask, dy / (1 - ratio), 0))",
        type_constraints={"T": FLOATS_BF, "T1": FLOATS_BF, "T2": ["tensor(bool)"]}),
    "com.microsoft::TanhGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("Y", "T", S)), outputs=io(("dX", "T", S)), attributes={},
        note="Y is the Tanh output; " + KERNEL_F32, type_constraints={"T": FLOATS_BF}),
    "com.microsoft::LeakyReluGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("Y", "T", S)), outputs=io(("dX", "T", S)),
        attributes=attrs(alpha=("FLOAT", False, 0.01)), note="Y is the LeakyRelu output; " + KERNEL_F32,
        type_constraints={"T": FLOATS_BF}),
    "com.microsoft::QuickGelu": dict(
        since_version=1, inputs=io(("X", "T", S)), outputs=io(("Y", "T", S)),
        attributes=attrs(alpha=("FLOAT", False, 1.702)), note="contrib op; SiLU becomes alpha 1; " + KERNEL_F32,
        type_constraints={"T": FLOATS_BF}),
    "com.microsoft::QuickGeluGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("X", "T", S)), outputs=io(("dX", "T", S)),
        attributes=attrs(alpha=("FLOAT", False, 1.702)), note=KERNEL_F32, type_constraints={"T": FLOATS_BF}),
    "com.microsoft::GeluGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("X", "T", S)), outputs=io(("dX", "T", S)), attributes={},
        note="erf GELU; " + KERNEL_F32, type_constraints={"T": FLOATS_BF}),
    "com.microsoft::FastGeluGrad": dict(
        since_version=1, inputs=io(("dY", "T", S), ("X", "T", S)), outputs=io(("dX", "T", S)), attributes={},
        note="tanh-approximation GELU; " + KERNEL_F32, type_constraints={"T": FLOATS_BF}),
    "com.microsoft::Gelu": dict(
        since_version=1, inputs=io(("X", "T", S)), outputs=io(("Y", "T", S)), attributes={},
        note="contrib op: erf GELU (what onnxruntime fuses torch's gelu into after a Gemm); " + KERNEL_F32,
        type_constraints={"T": FLOATS_BF}),
    "com.microsoft::BiasGelu": dict(
        since_version=1, inputs=io(("A", "T", S), ("B", "T", S)), outputs=io(("C", "T", S)), attributes={},
        note="contrib op: erf GELU of A + B, B 1D of A's last dimension; " + KERNEL_F32,
        type_constraints={"T": FLOATS_BF}),
    "com.microsoft::BiasGeluGrad_dX": dict(
        since_version=1, inputs=io(("dY", "T", S), ("X", "T", S), ("B", "T", S)), outputs=io(("dX", "T", S)),
        attributes={}, note="GeluGrad at X + B; " + KERNEL_F32, type_constraints={"T": FLOATS_BF}),
    "com.microsoft::BiasFastGeluGrad_dX": dict(
        since_version=1, inputs=io(("dY", "T", S), ("X", "T", S), ("B", "T", S)), outputs=io(("dX", "T", S)),
        attributes={}, note="FastGeluGrad at X + B; " + KERNEL_F32, type_constraints={"T": FLOATS_BF}),
    "com.microsoft::LSTMTraining": dict(
        since_version=1,
        inputs=io(("X", "T", S), ("W", "T", S), ("R", "T", S), ("B", "T", OPT), ("SL", "TInt32", OPT),
                  ("Ht0", "T", OPT), ("Ct0", "T", OPT), ("P", "T", OPT)),
        outputs=io(("HAll", "T", OPT), ("HFinal", "T", OPT), ("CFinal", "T", OPT), ("CAll", "T", OPT),
                   ("iofc", "T", OPT)),
        attributes=attrs(**RNN_ATTRS, input_forget=("INT", False, 0)),
        note="names as in the issue's signature; the 1.19.2 CPU kernel runs only direction forward, f32, no SL, "
             "no clip/input_forget/other activations (tools/ort_training/cases_recurrent.py); the fixture "
             "ops/LSTMTraining shows HAll/CAll [S,D,N,H] and iofc [S,D,N,4H] after activations, order i,o,f,c",
        type_constraints={"T": ["tensor(float)"], "TInt32": ["tensor(int32)"]}),
    "com.microsoft::LSTMGrad": dict(
        since_version=1,
        inputs=io(("X", "T", S), ("W", "T", S), ("R", "T", S), ("SL", "TInt32", OPT), ("Ht0", "T", OPT),
                  ("Ct0", "T", OPT), ("HAll", "T", S), ("CAll", "T", S), ("iofc", "T", S), ("dHAll", "T", OPT),
                  ("dHFinal", "T", OPT), ("dCFinal", "T", OPT)),
        outputs=io(("dX", "T", OPT), ("dW", "T", OPT), ("dR", "T", OPT), ("dB", "T", OPT), ("dH0", "T", OPT),
                   ("dC0", "T", OPT), ("dP", "T", OPT)),
        attributes=attrs(**RNN_ATTRS, input_forget=("INT", False, 0)),
        note="no B (the gates in iofc hold it) and no P input: the gradient is that of an LSTM without "
             "peepholes, dP at P = 0 (fixture ops/LSTMGrad/peepholes)",
        type_constraints={"T": ["tensor(float)"], "TInt32": ["tensor(int32)"]}),
    "com.microsoft::GRUTraining": dict(
        since_version=1,
        inputs=io(("X", "T", S), ("W", "T", S), ("R", "T", S), ("B", "T", OPT), ("SL", "TInt32", OPT),
                  ("Ht0", "T", OPT)),
        outputs=io(("HAll", "T", OPT), ("HFinal", "T", OPT), ("ZRH", "T", OPT)),
        attributes=attrs(**RNN_ATTRS, linear_before_reset=("INT", False, 0)),
        note="names as in the issue's signature; the 1.19.2 CPU kernel runs only direction forward, f32, no SL; "
             "the fixture ops/GRUTraining shows HAll [S,D,N,H] and ZRH [S,D,N,3H] after activations, order z,r,h",
        type_constraints={"T": ["tensor(float)"], "TInt32": ["tensor(int32)"]}),
    "com.microsoft::GRUGrad": dict(
        since_version=1,
        inputs=io(("X", "T", S), ("W", "T", S), ("R", "T", S), ("B", "T", OPT), ("SL", "TInt32", OPT),
                  ("Ht0", "T", OPT), ("HAll", "T", S), ("ZRH", "T", S), ("dHAll", "T", OPT), ("dHFinal", "T", OPT)),
        outputs=io(("dX", "T", OPT), ("dW", "T", OPT), ("dR", "T", OPT), ("dB", "T", OPT), ("dH0", "T", OPT)),
        attributes=attrs(**RNN_ATTRS, linear_before_reset=("INT", False, 0)),
        note="B is read for linear_before_reset 1 (the reset gate multiplies h R_h^T + Rb_h)",
        type_constraints={"T": ["tensor(float)"], "TInt32": ["tensor(int32)"]}),
}

if __name__ == "__main__":
    doc = {"_source": "transcribed from onnxruntime training_op_defs.cc; see tools/ort_training/op_schemas_source.py"}
    doc.update({k: {"domain": k.split("::")[0].replace("ai.onnx", ""), "name": k.split("::")[1], **v}
                for k, v in sorted(SCHEMAS.items())})
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{OUT}: {len(SCHEMAS)} schemas")
