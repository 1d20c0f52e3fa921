"""One-node onnxruntime-training cases of the recurrent ops (LSTMTraining, LSTMGrad, GRUTraining, GRUGrad), recorded by
``make_fixtures.py --family recurrent``. onnxruntime-training 1.19.2's kernels run only direction
``forward``, f32, without ``sequence_lengths`` (its error: "Sequence lengths input tensor ... is not
supported"), ``clip``, ``input_forget`` or other activations: those cases are tested against the float64
reference only (tests/test_recurrent.py). Each gradient case reads the outputs of the forward case recorded
just before it, as in a training graph."""

from __future__ import annotations

import make_fixtures

SEED = 2020


def make(rng) -> None:
    def rand(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype("float32")

    lstm_outputs = ["HAll", "HFinal", "CFinal", "CAll", "iofc"]
    grad_outputs = ["dX", "dW", "dR", "dB", "dH0", "dC0", "dP"]
    # (variant, S, N, I, H, bias, initial states, peepholes, dHAll, dHFinal, dCFinal, grad outputs)
    cases = [
        ("full", 3, 2, 4, 5, True, True, False, True, True, True, grad_outputs),
        ("hidden_ne_input_no_bias_no_state", 4, 3, 5, 3, False, False, False, True, False, False,
         ["", "dW", "dR", "dB", "", "", ""]),
        ("final_state_grads_only", 3, 2, 3, 4, True, True, False, False, True, True, ["dX", "dW", "dR", "", "dH0",
                                                                                        "dC0", ""]),
        ("peepholes", 3, 2, 4, 3, True, True, True, True, True, False, grad_outputs),
    ]
    for variant, s, n, i, h, bias, state, peep, d_all, d_hf, d_cf, wanted in cases:
        x, w, r = rand(s, n, i), rand(1, 4 * h, i, scale=0.5), rand(1, 4 * h, h, scale=0.5)
        b = rand(1, 8 * h, scale=0.5) if bias else None
        h0, c0 = (rand(1, n, h), rand(1, n, h)) if state else (None, None)
        p = rand(1, 3 * h, scale=0.5) if peep else None
        inputs = {"X": x, "W": w, "R": r, "B": b, "sequence_lengths": None, "initial_h": h0, "initial_c": c0,
                  "P": p}
        while inputs and list(inputs.values())[-1] is None:
            inputs.popitem()
        fwd = make_fixtures.record("LSTMTraining", variant, inputs, lstm_outputs, {"hidden_size": h})
        grads = {"X": x, "W": w, "R": r, "sequence_lengths": None, "initial_h": h0, "initial_c": c0,
                 "HAll": fwd["HAll"], "CAll": fwd["CAll"], "iofc": fwd["iofc"],
                 "dHAll": rand(s, 1, n, h) if d_all else None, "dHFinal": rand(1, n, h) if d_hf else None,
                 "dCFinal": rand(1, n, h) if d_cf else None}
        while list(grads.values())[-1] is None:
            grads.popitem()
        make_fixtures.record("LSTMGrad", variant, grads, wanted, {"hidden_size": h})
    # only the outputs a training graph reads (HFinal, CFinal not requested)
    x, w, r = rand(2, 2, 3), rand(1, 8, 3, scale=0.5), rand(1, 8, 2, scale=0.5)
    make_fixtures.record("LSTMTraining", "states_and_gates_only", {"X": x, "W": w, "R": r},
                         ["HAll", "", "", "CAll", "iofc"], {"hidden_size": 2})
    gru_cases(rng, rand_of(rng))


def rand_of(rng):
    def rand(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype("float32")
    return rand


def gru_cases(rng, rand) -> None:
    # (variant, S, N, I, H, linear_before_reset, bias, initial state, dHAll, dHFinal, grad outputs)
    every = ["dX", "dW", "dR", "dB", "dH0"]
    cases = [
        ("full", 3, 2, 4, 5, 0, True, True, True, True, every),
        ("linear_before_reset", 3, 2, 4, 5, 1, True, True, True, True, every),
        ("hidden_ne_input_no_bias_no_state", 4, 3, 5, 3, 0, False, False, True, False, ["", "dW", "dR", "dB", ""]),
        ("linear_before_reset_final_only", 3, 2, 3, 4, 1, True, False, False, True, ["dX", "dW", "dR", "", "dH0"]),
    ]
    for variant, s, n, i, h, lbr, bias, state, d_all, d_hf, wanted in cases:
        x, w, r = rand(s, n, i), rand(1, 3 * h, i, scale=0.5), rand(1, 3 * h, h, scale=0.5)
        b = rand(1, 6 * h, scale=0.5) if bias else None
        h0 = rand(1, n, h) if state else None
        attrs = {"hidden_size": h, "linear_before_reset": lbr}
        inputs = {"X": x, "W": w, "R": r, "B": b, "sequence_lengths": None, "initial_h": h0}
        while list(inputs.values())[-1] is None:
            inputs.popitem()
        fwd = make_fixtures.record("GRUTraining", variant, inputs, ["HAll", "HFinal", "ZRH"], attrs)
        grads = {"X": x, "W": w, "R": r, "B": b, "sequence_lengths": None, "initial_h": h0, "HAll": fwd["HAll"],
                 "ZRH": fwd["ZRH"], "dHAll": rand(s, 1, n, h) if d_all else None,
                 "dHFinal": rand(1, n, h) if d_hf else None}
        while list(grads.values())[-1] is None:
            grads.popitem()
        make_fixtures.record("GRUGrad", variant, grads, wanted, attrs)
