"""runtime.reference: the float64 batch-norm backward oracle and the BatchNormInternal forward."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from runtime.reference import (
    batch_norm_backward,
    batch_norm_forward,
    batch_norm_internal,
    batch_statistics,
)

NCX = (0, 2, 3)  # reduce axes of a rank-4 NCX tensor
NXC = (0, 1, 2)


def test_onednn_unit_test_case():
    # oneDNN's own batch-norm backward test: NCX 1x1x2x2.
    src = np.array([1.0, 2.0, 3.0, 4.0], np.float32).reshape(1, 1, 2, 2)
    diff_dst = np.array([0.1, 0.1, 0.2, 0.2], np.float32).reshape(1, 1, 2, 2)
    out = batch_norm_backward(src, diff_dst, np.float32([2.5]), np.float32([1.25]), np.float32([2.0]),
                              epsilon=1e-9, reduce_axes=NCX)
    assert list(out) == ["diff_src", "diff_gamma", "diff_beta"]
    assert all(a.dtype == np.float64 for a in out.values())
    assert out["diff_src"].shape == (1, 1, 2, 2) and out["diff_gamma"].shape == (1,)
    np.testing.assert_allclose(out["diff_src"].ravel(), [0.017889, -0.053666, 0.053666, -0.017889], atol=1e-6)
    np.testing.assert_allclose(out["diff_gamma"], [0.178885], atol=1e-6)
    np.testing.assert_allclose(out["diff_beta"], [0.6], rtol=1e-6)


def _loss(x, gamma, beta, w, axes, epsilon):
    mean, variance = batch_statistics(x, reduce_axes=axes)
    return float((batch_norm_forward(x, mean, variance, gamma, beta, epsilon=epsilon, reduce_axes=axes) * w).sum())


def test_batch_statistics_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    axes, epsilon, h = (0, 1), 1e-3, 1e-6  # NXC rank 3: channel axis 2
    x = rng.normal(size=(3, 4, 5)) * 2.0 + 0.5
    gamma, beta = rng.normal(size=5), rng.normal(size=5)
    w = rng.normal(size=x.shape)  # diff_dst = dLoss/dy

    def grad(f, a):
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            up, down = a.copy(), a.copy()
            up[i] += h
            down[i] -= h
            g[i] = (f(up) - f(down)) / (2 * h)
        return g

    num_x = grad(lambda v: _loss(v, gamma, beta, w, axes, epsilon), x)
    num_gamma = grad(lambda v: _loss(x, v, beta, w, axes, epsilon), gamma)
    num_beta = grad(lambda v: _loss(x, gamma, v, w, axes, epsilon), beta)
    mean, variance = batch_statistics(x, reduce_axes=axes)
    out = batch_norm_backward(x, w, mean, variance, gamma, epsilon=epsilon, reduce_axes=axes)
    np.testing.assert_allclose(out["diff_src"], num_x, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["diff_gamma"], num_gamma, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["diff_beta"], num_beta, rtol=1e-6, atol=1e-7)
    # The frozen-statistics gradient is a different thing: it must not match here.
    frozen = batch_norm_backward(x, w, mean, variance, gamma, epsilon=epsilon, reduce_axes=axes, statistics="frozen")
    assert not np.allclose(frozen["diff_src"], num_x, rtol=1e-3)


def _case(shape=(2, 3, 4, 5), axes=NCX, seed=1):
    rng = np.random.default_rng(seed)
    src = rng.normal(size=shape)
    channels = [n for a, n in enumerate(shape) if a not in axes]
    mean, variance = rng.normal(size=channels), rng.uniform(0.5, 2.0, size=channels)
    return src, rng.normal(size=shape), mean, variance, rng.normal(size=channels)


def test_frozen_statistics_is_scaled_diff_dst():
    src, dy, mean, variance, gamma = _case(axes=NXC)
    out = batch_norm_backward(src, dy, mean, variance, gamma, epsilon=1e-5, reduce_axes=NXC, statistics="frozen")
    np.testing.assert_allclose(out["diff_src"], gamma * dy / np.sqrt(variance + 1e-5), rtol=1e-13)
    # Parameter gradients do not depend on the statistics mode.
    batch = batch_norm_backward(src, dy, mean, variance, gamma, epsilon=1e-5, reduce_axes=NXC)
    np.testing.assert_array_equal(out["diff_gamma"], batch["diff_gamma"])
    np.testing.assert_array_equal(out["diff_beta"], dy.sum(axis=NXC))


@pytest.mark.parametrize("statistics", ["batch", "frozen"])
def test_inv_std_mode_equals_variance_mode(statistics):
    src, dy, mean, variance, gamma = _case()
    epsilon = 1e-3
    by_variance = batch_norm_backward(src, dy, mean, variance, gamma, epsilon=epsilon, reduce_axes=NCX,
                                      statistics=statistics)
    by_inv_std = batch_norm_backward(src, dy, mean, 1.0 / np.sqrt(variance + epsilon), gamma, epsilon=epsilon,
                                     reduce_axes=NCX, statistics=statistics, stat_input="inv_std")
    for name in by_variance:
        np.testing.assert_allclose(by_inv_std[name], by_variance[name], rtol=1e-12, atol=1e-14)
    # Epsilon is not applied a second time: another epsilon changes nothing in inv_std mode.
    other = batch_norm_backward(src, dy, mean, 1.0 / np.sqrt(variance + epsilon), gamma, epsilon=0.5,
                                reduce_axes=NCX, statistics=statistics, stat_input="inv_std")
    np.testing.assert_array_equal(other["diff_src"], by_inv_std["diff_src"])


def test_keep_rank_statistics_match_vectors():
    src, dy, mean, variance, gamma = _case()
    keep = (1, 3, 1, 1)
    vector = batch_norm_backward(src, dy, mean, variance, gamma, epsilon=1e-5, reduce_axes=NCX)
    ranked = batch_norm_backward(src, dy, mean.reshape(keep), variance.reshape(keep), gamma.reshape(keep),
                                 epsilon=1e-5, reduce_axes=NCX)
    assert ranked["diff_gamma"].shape == keep and ranked["diff_beta"].shape == keep
    np.testing.assert_allclose(ranked["diff_src"], vector["diff_src"], rtol=1e-14)
    np.testing.assert_allclose(ranked["diff_gamma"].ravel(), vector["diff_gamma"], rtol=1e-14)
    with pytest.raises(ValueError, match=r"mean has shape \[1, 4, 1, 1\]; expected \[1, 3, 1, 1\]"):
        batch_norm_backward(src, dy, np.zeros((1, 4, 1, 1)), variance.reshape(keep), epsilon=1e-5, reduce_axes=NCX)


def test_gamma_absent_means_one_and_outputs_can_be_selected():
    src, dy, mean, variance, _ = _case()
    without = batch_norm_backward(src, dy, mean, variance, epsilon=1e-5, reduce_axes=NCX, outputs=("diff_src",))
    ones = batch_norm_backward(src, dy, mean, variance, np.ones(3), epsilon=1e-5, reduce_axes=NCX)
    assert list(without) == ["diff_src"]
    np.testing.assert_array_equal(without["diff_src"], ones["diff_src"])


def test_ill_conditioned_data_stays_accurate():
    # |mean|/std = 1e4, float32 input: the result must equal the one computed on exactly shifted data.
    rng = np.random.default_rng(2)
    shift = 1.0e4
    src = (shift + rng.normal(size=(8, 2, 16, 16))).astype(np.float32)
    dy = rng.normal(size=src.shape).astype(np.float32)
    mean, variance = batch_statistics(src, reduce_axes=NCX)
    assert np.all(np.abs(mean) / np.sqrt(variance) > 0.9e4)
    out = batch_norm_backward(src, dy, mean, variance, np.float32([1.5, -0.5]), epsilon=1e-5, reduce_axes=NCX)
    shifted = batch_norm_backward(src.astype(np.float64) - shift, dy, mean - shift, variance,
                                  np.float32([1.5, -0.5]), epsilon=1e-5, reduce_axes=NCX)
    for name in out:
        np.testing.assert_allclose(out[name], shifted[name], rtol=1e-9, atol=1e-12 * np.abs(shifted[name]).max())


def test_low_precision_inputs_are_computed_in_float64():
    src, dy, mean, variance, gamma = _case(shape=(2, 3, 4))
    axes = (0, 2)
    bf16 = [a.astype(ml_dtypes.bfloat16) for a in (src, dy, mean, variance, gamma)]
    out = batch_norm_backward(*bf16, epsilon=1e-5, reduce_axes=axes)
    exact = batch_norm_backward(*(a.astype(np.float64) for a in bf16), epsilon=1e-5, reduce_axes=axes)
    for name in out:
        assert out[name].dtype == np.float64
        np.testing.assert_array_equal(out[name], exact[name])


def test_batch_norm_internal_matches_direct_formula():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 3, 5, 2)) * 3.0 + 1.0
    scale, bias = rng.normal(size=3), rng.normal(size=3)
    running_mean, running_var = rng.normal(size=3), rng.uniform(0.5, 2.0, size=3)
    epsilon, momentum = 1e-5, 0.9
    out = batch_norm_internal(x, scale, bias, running_mean, running_var, epsilon=epsilon, momentum=momentum)
    assert list(out) == ["Y", "running_mean", "running_var", "saved_mean", "saved_inv_std"]
    for c in range(3):
        xc = x[:, c]
        mean, biased = xc.mean(), np.var(xc)
        np.testing.assert_allclose(out["Y"][:, c], scale[c] * (xc - mean) / np.sqrt(biased + epsilon) + bias[c],
                                   rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out["running_mean"][c], 0.9 * running_mean[c] + 0.1 * mean, rtol=1e-13)
        np.testing.assert_allclose(out["running_var"][c], 0.9 * running_var[c] + 0.1 * biased, rtol=1e-13)
        np.testing.assert_allclose(out["saved_mean"][c], mean, rtol=1e-13)
        np.testing.assert_allclose(out["saved_inv_std"][c], 1.0 / np.sqrt(biased + epsilon), rtol=1e-13)
    # Channel-last: the same numbers with the channel axis moved.
    last = batch_norm_internal(np.moveaxis(x, 1, -1), scale, bias, running_mean, running_var, epsilon=epsilon,
                               momentum=momentum, channel_axis=-1)
    np.testing.assert_allclose(np.moveaxis(last["Y"], -1, 1), out["Y"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(last["saved_inv_std"], out["saved_inv_std"], rtol=1e-13)
