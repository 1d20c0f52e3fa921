"""Float64 NumPy references of onnxruntime-training's recurrent ops: LSTMTraining and LSTMGrad
(``specs/com.microsoft/LSTMTraining.rst``, ``LSTMGrad.rst``).

Written from the ONNX LSTM semantics, one batch entry at a time (a shorter sequence simply runs fewer
steps; the reverse direction starts at its own last step), not from the lowering's masked whole-batch
form. Layouts as onnxruntime-training records them (tests/fixtures/ort_training/ops/LSTMTraining):
``HAll``/``CAll`` [S, D, N, H], ``iofc`` [S, D, N, 4H] holding the gates after their activations in the
order i, o, f, c; gate rows of ``W``/``R``/``B`` in that order too.
"""

from __future__ import annotations

import numpy as np


def _f64(a) -> np.ndarray | None:
    return None if a is None else np.asarray(a).astype(np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def directions(direction: str) -> list[bool]:
    """Per direction index: whether it runs the sequence backwards."""
    return {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]


def _steps(length: int, backwards: bool) -> list[int]:
    return list(range(length - 1, -1, -1) if backwards else range(length))


def _lengths(sequence_lengths, steps: int, batch: int) -> list[int]:
    if sequence_lengths is None:
        return [steps] * batch
    return [int(v) for v in np.asarray(sequence_lengths).reshape(-1)]


def lstm_training(x, w, r, b=None, sequence_lengths=None, initial_h=None, initial_c=None, p=None,
                  direction: str = "forward") -> dict[str, np.ndarray]:
    """LSTMTraining's five outputs: HAll, HFinal, CFinal, CAll, iofc (float64)."""
    x, w, r = _f64(x), _f64(w), _f64(r)
    steps, batch, _ = x.shape
    dirs = directions(direction)
    hidden = r.shape[-1]
    b = np.zeros((len(dirs), 8 * hidden)) if b is None else _f64(b)
    p = np.zeros((len(dirs), 3 * hidden)) if p is None else _f64(p)
    h0 = np.zeros((len(dirs), batch, hidden)) if initial_h is None else _f64(initial_h)
    c0 = np.zeros((len(dirs), batch, hidden)) if initial_c is None else _f64(initial_c)
    h_all = np.zeros((steps, len(dirs), batch, hidden))
    c_all = np.zeros_like(h_all)
    gates = np.zeros((steps, len(dirs), batch, 4 * hidden))
    h_final, c_final = h0.copy(), c0.copy()
    for d, backwards in enumerate(dirs):
        bias = b[d, :4 * hidden] + b[d, 4 * hidden:]
        p_i, p_o, p_f = np.split(p[d], 3)
        for n, length in enumerate(_lengths(sequence_lengths, steps, batch)):
            h, c = h0[d, n], c0[d, n]
            for t in _steps(length, backwards):
                z_i, z_o, z_f, z_c = np.split(w[d] @ x[t, n] + r[d] @ h + bias, 4)
                i, f, g = _sigmoid(z_i + p_i * c), _sigmoid(z_f + p_f * c), np.tanh(z_c)
                c = f * c + i * g
                o = _sigmoid(z_o + p_o * c)
                h = o * np.tanh(c)
                h_all[t, d, n], c_all[t, d, n] = h, c
                gates[t, d, n] = np.concatenate([i, o, f, g])
            h_final[d, n], c_final[d, n] = h, c
    return {"HAll": h_all, "HFinal": h_final, "CFinal": c_final, "CAll": c_all, "iofc": gates}


def lstm_grad(x, w, r, sequence_lengths, initial_h, initial_c, h_all, c_all, iofc, d_h_all=None,
              d_h_final=None, d_c_final=None, direction: str = "forward") -> dict[str, np.ndarray]:
    """LSTMGrad's outputs dX, dW, dR, dB, dH0, dC0, dP (float64): backpropagation through time from the
    forward's recorded states and gates. There is no peephole input: the gradient is that of an LSTM
    without peepholes (dP is still the gradient with respect to them, at P = 0)."""
    x, w, r = _f64(x), _f64(w), _f64(r)
    h_all, c_all, iofc = _f64(h_all), _f64(c_all), _f64(iofc)
    steps, batch, _ = x.shape
    dirs = directions(direction)
    hidden = r.shape[-1]
    zeros = np.zeros((len(dirs), batch, hidden))
    h0 = zeros if initial_h is None else _f64(initial_h)
    c0 = zeros if initial_c is None else _f64(initial_c)
    d_h_all = np.zeros_like(h_all) if d_h_all is None else _f64(d_h_all)
    d_h_final = zeros if d_h_final is None else _f64(d_h_final)
    d_c_final = zeros if d_c_final is None else _f64(d_c_final)
    dx, dw, dr = np.zeros_like(x), np.zeros_like(w), np.zeros_like(r)
    db, dp = np.zeros((len(dirs), 8 * hidden)), np.zeros((len(dirs), 3 * hidden))
    dh0, dc0 = np.zeros_like(zeros), np.zeros_like(zeros)
    for d, backwards in enumerate(dirs):
        for n, length in enumerate(_lengths(sequence_lengths, steps, batch)):
            order = _steps(length, backwards)
            dh, dc = d_h_final[d, n].copy(), d_c_final[d, n].copy()
            for k in range(len(order) - 1, -1, -1):
                t = order[k]
                h_prev = h0[d, n] if k == 0 else h_all[order[k - 1], d, n]
                c_prev = c0[d, n] if k == 0 else c_all[order[k - 1], d, n]
                i, o, f, g = np.split(iofc[t, d, n], 4)
                tanh_c = np.tanh(c_all[t, d, n])
                dh_t = dh + d_h_all[t, d, n]
                dz_o = dh_t * tanh_c * o * (1 - o)
                dc_t = dc + dh_t * o * (1 - tanh_c ** 2)
                dz_i, dz_f, dz_c = dc_t * g * i * (1 - i), dc_t * c_prev * f * (1 - f), dc_t * i * (1 - g ** 2)
                dz = np.concatenate([dz_i, dz_o, dz_f, dz_c])
                dx[t, n] += dz @ w[d]
                dw[d] += np.outer(dz, x[t, n])
                dr[d] += np.outer(dz, h_prev)
                db[d] += np.concatenate([dz, dz])
                dp[d] += np.concatenate([dz_i * c_prev, dz_o * c_all[t, d, n], dz_f * c_prev])
                dh, dc = dz @ r[d], dc_t * f
            dh0[d, n], dc0[d, n] = dh, dc
    return {"dX": dx, "dW": dw, "dR": dr, "dB": db, "dH0": dh0, "dC0": dc0, "dP": dp}
