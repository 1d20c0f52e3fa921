"""Bad values at run time (issue 24): a class label outside [0, C) that is not ignore_index, a MaxPoolGrad index
outside dX, a GatherGrad index outside [-D, D). onnxruntime-training's kernels refuse them at run time; a
standard graph cannot raise, so the lowered forms define a result (docs/ops.md, "Bad values at run time") and
must never read or write out of bounds.

Every lowered form (both targets, the opset-dependent variants) runs with such values in onnxruntime, OpenVINO,
tract and ``onnx.reference``, each runtime in a process of its own (tests/_runtime_worker.py): a runtime that
aborts fails the test naming the case instead of killing the session. Each result is compared with the float64
reference run on the same inputs with the bad entries taken out (a bad label replaced by ignore_index, a bad
index's gradient dropped), which is what the docs say the lowered graph computes.
"""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_portable_training import _max_pool

from lowering.passes import lower_model
from lowering.training.portable_std import spell_out_for_portable
from runtime import reference_shape
from runtime import reference_training as ref

MS = "com.microsoft"
F32, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
INT_NP = {I32: np.int32, I64: np.int64}
TOL = 2e-6  # of the largest entry, f32 (as tests/test_portable_training.py)
RUNTIMES = ("onnxruntime", "openvino", "tract", "reference")
WORKER = Path(__file__).with_name("_runtime_worker.py")
vi = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, opset=17, initializers=()):
    graph = helper.make_graph(nodes, "g", [vi(n, t, s) for n, t, s in inputs], [vi(n, t, s) for n, t, s in outputs],
                              initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def _symbolic_batch(model: onnx.ModelProto) -> None:
    """Axis 0 of every graph input and output of rank > 1 becomes the symbol N (the batch of a real model)."""
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if len(dims) > 1:
            dims[0].dim_param = "N"


# -- SoftmaxCrossEntropyLossGrad and the portable SoftmaxCrossEntropyLoss ------------------------------------------

def _labels(shape, classes, bad, ignore_index, seed):
    """Labels in [0, C) with ``bad`` values at the first positions and ignore_index (when any) at the last."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, classes, (shape[0], *shape[2:]))
    label.flat[:len(bad)] = bad
    if ignore_index is not None:
        label.flat[-1] = ignore_index
    return label


def _wrapped(values, wrap: bool):
    """The integers a runtime that runs int64 as int32 sees (OpenVINO's CPU plugin): wrapped to 32 bits."""
    return np.asarray(values).astype(np.int32).astype(np.int64) if wrap else np.asarray(values)


def _as_ignored(label, classes, ignore_index):
    """The labels the reference sees: every bad one replaced by an ignore_index (-1 when the node has none), and
    that ignore_index."""
    ignore = -1 if ignore_index is None else ignore_index
    return np.where((label < 0) | (label >= classes), ignore, label), ignore


def _sce_grad(shape, reduction, weighted, ignore_index, bad, label_type=I64, opset=17, seed=0, symbolic=False,
              wrap=False):
    rng = np.random.default_rng(seed + 100)
    classes = shape[1]
    label = _labels(shape, classes, bad, ignore_index, seed)
    weight = rng.random(classes) + 0.1 if weighted else None
    scores = rng.standard_normal(shape)
    log_prob = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    dy = rng.standard_normal(label.shape) if reduction == "none" else np.array(1.7)
    # an ignore_index the label type cannot hold equals no label: the reference sees none
    holds = ignore_index is not None and np.iinfo(INT_NP[label_type]).min <= ignore_index <= \
        np.iinfo(INT_NP[label_type]).max
    seen, ignore = _as_ignored(_wrapped(label, wrap), classes, ignore_index if holds else None)
    want = ref.softmax_cross_entropy_loss_grad(dy, log_prob, seen, weight, reduction=reduction, ignore_index=ignore)
    attrs = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    inputs = [("dy", F32, list(dy.shape)), ("lp", F32, list(shape)), ("label", label_type, list(label.shape))]
    feeds = {"dy": dy.astype(np.float32), "lp": log_prob.astype(np.float32), "label": label.astype(INT_NP[label_type])}
    if weighted:
        inputs.append(("w", F32, [classes]))
        feeds["w"] = weight.astype(np.float32)
    node = helper.make_node("SoftmaxCrossEntropyLossGrad", [n for n, _, _ in inputs], ["dl"], domain=MS, name="sg",
                            **attrs)
    model = _model([node], inputs, [("dl", F32, list(shape))], opset)
    if symbolic == "classes":  # C only known at run time: the guard compares with a Shape-derived value
        for value in [*model.graph.input, *model.graph.output]:
            if value.name in ("lp", "dl", "w"):
                value.type.tensor_type.shape.dim[0 if value.name == "w" else 1].dim_param = "C"
    elif symbolic:
        _symbolic_batch(model)
    return {t: (lower_model(model, target=t), {"dl": want}) for t in ("onnxruntime", "portable")}, feeds


def _sce_forward(shape, reduction, weighted, ignore_index, bad, label_type=I64, opset=17, seed=0, wrap=False):
    """The standard SoftmaxCrossEntropyLoss as the portable train-step model spells it out."""
    rng = np.random.default_rng(seed + 200)
    classes = shape[1]
    label = _labels(shape, classes, bad, ignore_index, seed)
    weight = rng.random(classes) + 0.1 if weighted else None
    scores = rng.standard_normal(shape)
    holds = ignore_index is not None and np.iinfo(INT_NP[label_type]).min <= ignore_index <= \
        np.iinfo(INT_NP[label_type]).max
    seen, ignore = _as_ignored(_wrapped(label, wrap), classes, ignore_index if holds else None)
    loss, log_prob = ref.softmax_cross_entropy_loss(scores, seen, weight, reduction=reduction, ignore_index=ignore)
    attrs = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    inputs = [("x", F32, list(shape)), ("label", label_type, list(label.shape))]
    feeds = {"x": scores.astype(np.float32), "label": label.astype(INT_NP[label_type])}
    if weighted:
        inputs.append(("w", F32, [classes]))
        feeds["w"] = weight.astype(np.float32)
    node = helper.make_node("SoftmaxCrossEntropyLoss", [n for n, _, _ in inputs], ["loss", "lp"], name="sce", **attrs)
    model = _model([node], inputs, [("loss", F32, list(loss.shape)), ("lp", F32, list(shape))], opset)
    spelled = spell_out_for_portable(model)
    assert not any(n.op_type == "SoftmaxCrossEntropyLoss" for n in spelled.graph.node)
    return {"portable": (spelled, {"loss": loss, "lp": log_prob})}, feeds


# -- MaxPoolGrad ------------------------------------------------------------------------------------------------

INT64_MIN, INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


def _max_pool_grad(x_shape, kernel, strides, pads, opset, bad=(-1, "size", "size+7", "-size", INT64_MAX, INT64_MIN),
                   elsewhere=False, symbolic=False, wrap=False):
    """MaxPool's own indices with ``bad`` values written over the first ones ("size": dX's element count).
    ``elsewhere``: one more index inside dX but in another sample's plane (the targets differ there)."""
    model, feeds, _, _ = _max_pool(x_shape, kernel, strides, pads, opset=opset)
    if symbolic:
        _symbolic_batch(model)
    size = int(np.prod(x_shape))
    values = [{"size": size, "size+7": size + 7, "-size": -size}.get(v, v) for v in bad]
    indices = feeds["ind"].copy()
    indices.flat[:len(values)] = values
    dy = feeds["dy"]
    feeds = {"dy": dy, "ind": indices.copy()}
    indices = _wrapped(indices, wrap)
    outside = (indices < 0) | (indices >= size)
    kept_dy = np.where(outside, 0.0, dy.astype(np.float64))
    # the portable form adds an index only inside its own window: every bad one drops out (wrapped to 32 bits,
    # INT64_MIN becomes 0, inside dX but outside the window of the output it is written at)
    window_dy = kept_dy.copy()
    window_dy.flat[:len(values)] = 0.0
    if elsewhere:  # the last output of the last plane points at the first element of dX
        indices.flat[-1] = 0
        feeds["ind"].flat[-1] = 0
        window_dy.flat[-1] = 0.0
    safe = np.where(outside, 0, indices)
    wants = {"onnxruntime": ref.max_pool_grad(kept_dy, safe, x_shape),
             "portable": ref.max_pool_grad(window_dy, safe, x_shape)}
    return {t: (lower_model(model, target=t), {"dx": w}) for t, w in wants.items()}, feeds


# -- GatherGrad -------------------------------------------------------------------------------------------------

def _gather_grad(shape, axis, indices, index_type=I64, opset=17, seed=3, from_shape=False, wrap=False):
    """GatherGrad with ``shape`` an initializer (tract wants Reshape's shapes known when it loads), or with
    ``from_shape`` the Shape of an input x, as in the training graphs."""
    rng = np.random.default_rng(seed)
    indices = np.asarray(indices, INT_NP[index_type])
    dy_shape = (*shape[:axis], *indices.shape, *shape[axis + 1:])
    dy = rng.standard_normal(dy_shape).astype(np.float32)
    size = shape[axis]
    feeds = {"idx": indices, "dy": dy}
    indices = _wrapped(indices, wrap)
    outside = (indices < -size) | (indices >= size)
    moved = np.moveaxis(dy.astype(np.float64).reshape(*shape[:axis], indices.size, *shape[axis + 1:]), axis, 0)
    moved = np.moveaxis(np.where(outside.reshape(-1, *([1] * (len(shape) - 1))), 0.0, moved), 0, axis)
    want = reference_shape.gather_grad(shape, np.where(outside, 0, indices), moved, axis=axis)
    node = helper.make_node("GatherGrad", ["shape", "idx", "dy"], ["dx"], domain=MS, name="gg", axis=axis)
    inputs = [("idx", index_type, list(indices.shape)), ("dy", F32, list(dy_shape))]
    if from_shape:
        feeds["x"] = np.zeros(shape, np.float32)
        model = _model([helper.make_node("Shape", ["x"], ["shape"]), node], [*inputs, ("x", F32, list(shape))],
                       [("dx", F32, list(shape))], opset)
    else:
        model = _model([node], inputs, [("dx", F32, list(shape))], opset,
                       [numpy_helper.from_array(np.array(shape, np.int64), "shape")])
    return {t: (lower_model(model, target=t), {"dx": want}) for t in ("onnxruntime", "portable")}, feeds


BIG = 2**40
CASES = {
    "sce_grad_mean": partial(_sce_grad, (4, 5), "mean", False, None, [-1, 5]),
    "sce_grad_mean_weighted_ignore_neg": partial(_sce_grad, (6, 5), "mean", True, -100, [7, -1, BIG, INT64_MIN]),
    "sce_grad_sum_weighted_s32": partial(_sce_grad, (4, 5), "sum", True, 2, [5, -(2**31)], I32),
    "sce_grad_none_4d_s32": partial(_sce_grad, (3, 4, 2, 2), "none", True, 1, [4, -1, 2**31 - 1], I32),
    "sce_grad_opset12": partial(_sce_grad, (6, 3), "mean", True, -100, [3, -5], opset=12),
    "sce_grad_huge_ignore_s32": partial(_sce_grad, (4, 5), "mean", False, 2**31, [5, -7], I32),
    "sce_grad_every_label_bad": partial(_sce_grad, (3, 4), "mean", True, -100, [4, -1, 9]),
    "sce_forward_mean": partial(_sce_forward, (4, 5), "mean", False, None, [-1, 5]),
    "sce_forward_mean_weighted_s32": partial(_sce_forward, (6, 5), "mean", True, -100, [6, -1, 2**31 - 1], I32),
    "sce_forward_sum_ignore_in_range": partial(_sce_forward, (5, 3), "sum", False, 1, [3, BIG]),
    "sce_forward_none_4d": partial(_sce_forward, (2, 4, 3, 2), "none", True, -1, [4, -2, INT64_MAX]),
    "sce_forward_huge_ignore_s32": partial(_sce_forward, (4, 5), "mean", True, 2**31, [5, -7], I32),
    "sce_forward_opset12": partial(_sce_forward, (6, 3), "mean", True, -100, [3, -5], opset=12),
    "max_pool_grad_3x3_s2_p1": partial(_max_pool_grad, (2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1], 17),
    "max_pool_grad_opset12_groups": partial(_max_pool_grad, (2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1], 12),
    "max_pool_grad_1d_s1": partial(_max_pool_grad, (2, 2, 9), [3], [1], [1, 1], 17),
    "max_pool_grad_other_plane": partial(_max_pool_grad, (2, 2, 6, 6), [2, 2], [2, 2], [0, 0, 0, 0], 17,
                                                        elsewhere=True),
    "max_pool_grad_symbolic_batch": partial(_max_pool_grad, (2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1], 17,
                                            symbolic=True),
    "sce_grad_symbolic_batch": partial(_sce_grad, (4, 3, 2), "none", True, -100, [3, BIG, -1, INT64_MAX],
                                       symbolic=True),
    "sce_grad_symbolic_classes": partial(_sce_grad, (8, 3), "mean", True, None,
                                         [3, 2**32 + 1, -1, INT64_MAX, 2**31, -(2**32) + 2], symbolic="classes"),
    "sce_grad_symbolic_classes_s32": partial(_sce_grad, (4, 3), "sum", False, 1, [3, -(2**31), 2**31 - 1], I32,
                                             symbolic="classes"),
    "gather_grad_axis0": partial(_gather_grad, (5, 3), 0, [0, 4, -1, 5, -6, 100, BIG, -BIG, 2, 2]),
    "gather_grad_axis1_s32": partial(_gather_grad, (2, 4, 3), 1, [[3, -5], [4, 1], [-(2**31), 2**31 - 1]], I32),
    "gather_grad_from_shape": partial(_gather_grad, (5, 3), 0, [2**32 + 1, 2**31, -(2**32) - 1, 3, INT64_MAX],
                                      from_shape=True),
    "gather_grad_opset13": partial(_gather_grad, (5, 3), 0, [1, 5, -6, INT64_MAX, INT64_MIN, 1], opset=13),
}
# what a runtime refuses on the lowered form whatever the values (asserted): onnx.reference 1.23's
# ScatterElements cannot take the grouped MaxPoolGrad form below opset 16 (tests/test_portable_training.py)
REFUSALS = {("max_pool_grad_opset12_groups", "onnxruntime", "reference"): "array objects"}


# Only in bounds, values not compared: tract 0.23 computes GatherGrad's indices against a Shape-derived D as its
# symbolic TDim, through 32 bits (2**32 + 1 lands at 1, -(2**32) - 1 at D - 1); the rows of in-range indices
# are still checked.
IN_BOUNDS_ONLY = {("gather_grad_from_shape", "tract")}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[Path, dict]:
    """Every (case, target): written to a directory for the workers; the expected outputs kept here."""
    root = tmp_path_factory.mktemp("bad_values")
    expected = {}
    for name, build in CASES.items():
        forms, feeds = build()
        wrapped, _ = build(wrap=True)
        for target, (model, want) in forms.items():
            onnx.checker.check_model(model, full_check=True)
            directory = root / f"{name}-{target}"
            directory.mkdir()
            onnx.save(model, directory / "model.onnx")
            np.savez(directory / "feeds.npz", **feeds)
            expected[(name, target, False)] = want
            expected[(name, target, True)] = wrapped[target][1]
    return root, expected


_RUNS: dict = {}


def _worker(runtime: str, root: Path) -> subprocess.CompletedProcess:
    """One process per runtime runs every case (copied so workers do not share files)."""
    if runtime not in _RUNS:
        directory = root.parent / f"{root.name}-{runtime}"
        subprocess.run(["cp", "-r", str(root), str(directory)], check=True)
        result = subprocess.run([sys.executable, str(WORKER), runtime, str(directory)], capture_output=True,
                                text=True, timeout=900)
        _RUNS[runtime] = (result, directory)
    return _RUNS[runtime]


def test_every_case_has_both_targets_or_is_the_portable_spelling():
    for name, build in CASES.items():
        forms, _ = build()
        assert set(forms) == ({"portable"} if name.startswith("sce_forward") else {"onnxruntime", "portable"}), name


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("case", [(name, t) for name in CASES
                                  for t in (("portable",) if name.startswith("sce_forward") else
                                            ("onnxruntime", "portable"))], ids="-".join)
def test_bad_values_run_in_bounds_and_compute_what_the_docs_say(cases, case, runtime):
    root, expected = cases
    result, directory = _worker(runtime, root)
    name, target = case
    started = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("start ")]
    done = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("done ")}
    assert result.returncode == 0, (f"{runtime} died (exit {result.returncode}) running {started[-1:]}: "
                                    f"{result.stderr.strip().splitlines()[-3:]}")
    key = f"{name}-{target}"
    assert key in done
    error = directory / key / "error.txt"
    refusal = REFUSALS.get((name, target, runtime))
    if refusal is not None:
        assert error.exists() and refusal in error.read_text(), error.read_text() if error.exists() else "ran"
        return
    assert not error.exists(), f"{runtime} refused {key}: {error.read_text()}"
    with np.load(directory / key / "outputs.npz") as got:
        # OpenVINO's CPU plugin runs int64 as int32: it sees every label and index wrapped to 32 bits
        for output, want in expected[(name, target, runtime == "openvino")].items():
            value = np.asarray(got[output]).astype(np.float64)
            want = np.asarray(want, np.float64)
            assert value.shape == want.shape, (output, value.shape, want.shape)
            assert np.all(np.isfinite(value)), output
            if (name, runtime) in IN_BOUNDS_ONLY:
                assert np.allclose(value[3], want[3], rtol=1e-6), (runtime, key)  # index 3: in range
                continue
            scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
            err = float(np.max(np.abs(value - want))) / scale if want.size else 0.0
            assert err <= TOL, f"{runtime} {key} {output}: relative error {err:.3g} > {TOL}"
