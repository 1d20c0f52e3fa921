"""GRUGrad's four-block backward step (issue 31, fewer kernels per small training step): with linear_before_reset
1, H and the batch static, both at least 2 and N H at most FOUR_BLOCKS_LIMIT, the onnxruntime target multiplies
[dh, a_h, a_h, dh] by three stacked factors into [a_z, a_r, a_h r, dh z] and runs two Gemms of it, 8 kernels a
step (+ the dHAll Add) instead of 10. Its outputs are the two-product form's bits: the exact zero terms of the
padded rows add nothing and dh z comes last into the first Gemm's sum."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from test_recurrent import GRU_GRAD_IN, GRU_GRAD_OUT, _gru_grad_feeds, _gru_inputs, _lowered, _model
from test_recurrent_forms import _bodies as scan_bodies

from lowering.rules import recurrent
from runtime.session import run_model


def _case(direction="forward", lengths=None, hidden=3, batch=3, lbr=1, d_all=True, d_h=True, state=True, seed=60):
    rng = np.random.default_rng(seed)
    d = 2 if direction == "bidirectional" else 1
    fwd = _gru_inputs(rng, batch=batch, hidden=hidden, directions=d, lengths=lengths, state=state)
    feeds = _gru_grad_feeds(rng, fwd, direction, lbr, d_all=d_all, d_h=d_h)
    attrs = {"direction": direction, "linear_before_reset": lbr, "hidden_size": hidden}
    return _model("GRUGrad", feeds, GRU_GRAD_IN, GRU_GRAD_OUT, attrs), {k: v for k, v in feeds.items() if v is not None}


def _bodies(model: onnx.ModelProto) -> list[collections.Counter]:
    return [ops for _, ops in scan_bodies(model)]


def _four_blocks(model: onnx.ModelProto) -> bool:
    return all(body.get("Gemm", 0) == 2 and body["Mul"] == 5 for body in _bodies(model))


CASES = [("forward", None, 3, 3, True, True, True), ("forward", [2, 4, 3, 1], 8, 4, True, True, True),
         ("reverse", None, 2, 3, False, True, False), ("reverse", [1, 4], 16, 2, True, False, True),
         ("bidirectional", None, 5, 3, True, True, True), ("bidirectional", [3, 1, 4], 4, 3, False, False, False)]


@pytest.mark.parametrize("direction, lengths, hidden, batch, d_all, d_h, state", CASES, ids=str)
def test_four_blocks_give_the_two_product_forms_bits(monkeypatch, direction, lengths, hidden, batch, d_all, d_h,
                                                     state):
    model, feeds = _case(direction, lengths, hidden, batch, d_all=d_all, d_h=d_h, state=state)
    lowered = _lowered(model)
    body = _bodies(lowered)[0]
    assert body == collections.Counter({"Mul": 5, "Gemm": 2, "Concat": 1} | ({"Add": 1} if d_all else {}) |
                                       ({"Where": 2} if lengths else {}))
    got = run_model(lowered, feeds)
    monkeypatch.setattr(recurrent, "FOUR_BLOCKS_LIMIT", 0)
    two_products = _lowered(model)
    assert not _four_blocks(two_products)
    want = run_model(two_products, feeds)
    portable = run_model(_lowered(model, "portable"), feeds)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert np.array_equal(got[name], value), name
        assert np.array_equal(got[name], portable[name]), name


@pytest.mark.parametrize("change", [{"lbr": 0}, {"hidden": 11}, {"hidden": 1}, {"batch": 1}])
def test_four_blocks_only_where_taken(change):
    """linear_before_reset 0, N H past FOUR_BLOCKS_LIMIT, and H or a static batch of 1 (onnxruntime's one-column
    and one-row GEMM paths sum the padded rows in another order) keep the two products."""
    assert recurrent.FOUR_BLOCKS_LIMIT == 32
    model, feeds = _case(**change)
    lowered = _lowered(model)
    assert not _four_blocks(lowered)
    want = run_model(_lowered(model, "portable"), feeds)
    got = run_model(lowered, feeds)
    assert all(np.array_equal(got[k], v) for k, v in want.items())
