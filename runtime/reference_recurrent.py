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


def gru_training(x, w, r, b=None, sequence_lengths=None, initial_h=None, direction: str = "forward",
                 linear_before_reset: int = 0) -> dict[str, np.ndarray]:
    """GRUTraining's outputs HAll, HFinal, ZRH (float64); gates z, r, h in that order, ``ZRH`` after their
    activations."""
    x, w, r = _f64(x), _f64(w), _f64(r)
    steps, batch, _ = x.shape
    dirs = directions(direction)
    hidden = r.shape[-1]
    b = np.zeros((len(dirs), 6 * hidden)) if b is None else _f64(b)
    h0 = np.zeros((len(dirs), batch, hidden)) if initial_h is None else _f64(initial_h)
    h_all = np.zeros((steps, len(dirs), batch, hidden))
    gates = np.zeros((steps, len(dirs), batch, 3 * hidden))
    h_final = h0.copy()
    for d, backwards in enumerate(dirs):
        w_z, w_r, w_h = np.split(w[d], 3)
        r_z, r_r, r_h = np.split(r[d], 3)
        wb_z, wb_r, wb_h, rb_z, rb_r, rb_h = np.split(b[d], 6)
        for n, length in enumerate(_lengths(sequence_lengths, steps, batch)):
            h = h0[d, n]
            for t in _steps(length, backwards):
                xt = x[t, n]
                z = _sigmoid(w_z @ xt + r_z @ h + wb_z + rb_z)
                rr = _sigmoid(w_r @ xt + r_r @ h + wb_r + rb_r)
                if linear_before_reset:
                    hh = np.tanh(w_h @ xt + wb_h + rr * (r_h @ h + rb_h))
                else:
                    hh = np.tanh(w_h @ xt + r_h @ (rr * h) + wb_h + rb_h)
                h = (1 - z) * hh + z * h
                h_all[t, d, n] = h
                gates[t, d, n] = np.concatenate([z, rr, hh])
            h_final[d, n] = h
    return {"HAll": h_all, "HFinal": h_final, "ZRH": gates}


def gru_grad(x, w, r, b, sequence_lengths, initial_h, h_all, zrh, d_h_all=None, d_h_final=None,
             direction: str = "forward", linear_before_reset: int = 0) -> dict[str, np.ndarray]:
    """GRUGrad's outputs dX, dW, dR, dB, dH0 (float64) by backpropagation through time from the forward's
    recorded states and gate activations (``B`` is read for ``linear_before_reset`` 1, where the reset gate
    multiplies ``h R_h^T + Rb_h``)."""
    x, w, r = _f64(x), _f64(w), _f64(r)
    h_all, zrh = _f64(h_all), _f64(zrh)
    steps, batch, _ = x.shape
    dirs = directions(direction)
    hidden = r.shape[-1]
    b = np.zeros((len(dirs), 6 * hidden)) if b is None else _f64(b)
    zeros = np.zeros((len(dirs), batch, hidden))
    h0 = zeros if initial_h is None else _f64(initial_h)
    d_h_all = np.zeros_like(h_all) if d_h_all is None else _f64(d_h_all)
    d_h_final = zeros if d_h_final is None else _f64(d_h_final)
    dx, dw, dr = np.zeros_like(x), np.zeros_like(w), np.zeros_like(r)
    db, dh0 = np.zeros((len(dirs), 6 * hidden)), np.zeros_like(zeros)
    for d, backwards in enumerate(dirs):
        r_z, r_r, r_h = np.split(r[d], 3)
        rb_h = b[d, 5 * hidden:]
        for n, length in enumerate(_lengths(sequence_lengths, steps, batch)):
            order = _steps(length, backwards)
            dh = d_h_final[d, n].copy()
            for k in range(len(order) - 1, -1, -1):
                t = order[k]
                h_prev = h0[d, n] if k == 0 else h_all[order[k - 1], d, n]
                z, rr, hh = np.split(zrh[t, d, n], 3)
                dh_t = dh + d_h_all[t, d, n]
                da_h = dh_t * (1 - z) * (1 - hh ** 2)
                da_z = dh_t * (h_prev - hh) * z * (1 - z)
                dh = dh_t * z
                if linear_before_reset:
                    q = r_h @ h_prev + rb_h
                    da_r = da_h * q * rr * (1 - rr)
                    dq = da_h * rr
                    dr[d, 2 * hidden:] += np.outer(dq, h_prev)
                    db[d, 5 * hidden:] += dq
                    dh += dq @ r_h
                else:
                    d_reset_h = da_h @ r_h
                    da_r = d_reset_h * h_prev * rr * (1 - rr)
                    dr[d, 2 * hidden:] += np.outer(da_h, rr * h_prev)
                    db[d, 5 * hidden:] += da_h
                    dh += d_reset_h * rr
                dr[d, :hidden] += np.outer(da_z, h_prev)
                dr[d, hidden:2 * hidden] += np.outer(da_r, h_prev)
                db[d, 3 * hidden:5 * hidden] += np.concatenate([da_z, da_r])
                dh += da_z @ r_z + da_r @ r_r
                da = np.concatenate([da_z, da_r, da_h])
                dx[t, n] += da @ w[d]
                dw[d] += np.outer(da, x[t, n])
                db[d, :3 * hidden] += da
            dh0[d, n] = dh
    return {"dX": dx, "dW": dw, "dR": dr, "dB": db, "dH0": dh0}
