"""oplower-made artifacts in onnxruntime-training 1.19.2's own runtime, against its own artifacts' recorded step.

    PYTHONPATH=. python tools/make_oplower_artifacts.py --out DIR                   # the project venv: oplower
    /work/ortt-venv/bin/python tools/ort_training/run_oplower_artifacts.py DIR \\
        [--record tests/fixtures/ort_training/oplower_made.json] [NAME ...]

Never imports oplower (the two cannot share a venv). DIR holds one directory per committed architecture that
``tools/make_oplower_artifacts.py`` wrote (its forward_model.onnx with Dropout ratios 0, the recorded
meta.json's arguments) and ``made.json``. Per architecture, with ``onnxruntime.training.api``:

- ``CheckpointState.load_checkpoint`` of our checkpoint (its parameters must equal ``initial_params.npz``: the
  recorded runs started there); ``Module(training_model, state, eval_model)`` and ``Optimizer(optimizer_model)``,
  the learning rate of ``api_curve.json``;
- one ``module(input, labels)`` against ``api_step1.npz`` (loss, every gradient), one ``optimizer.step()``
  against ``api_optimizer_step1.npz`` (every parameter, frozen running statistics included), then
  ``lazy_reset_grad()`` and 19 more steps against ``api_curve.json`` -- the recorded procedure on
  onnxruntime-training's own artifacts, from the same parameters and batch;
- ``module.eval()`` and one ``module(input, labels)`` on our eval model, against the same on
  onnxruntime-training's own eval model (which for a BatchNorm net does not load: the reference is then its eval
  model with BatchNormalization's extra outputs dropped).

Tolerances: loss 1e-5 relative (first step and every curve step), gradients and parameters 1e-4 of the largest
entry of each reference array; a gradient whose float64 truth (``torch_f64_step1.npz``) is zero to rounding (a
conv bias before BatchNorm, attention's key bias: both sides hold f32 noise of 1e-9) is judged against the
model's largest gradient entry instead. ``--record`` writes the outcome (per architecture: the errors, whether the eval
model loaded, the sha256 of the training model run) for ``tests/test_oplower_made_in_ort_training.py``; an
architecture that fails (or that the generator could not make) is listed with its reason instead. Exit 1 when
any fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ARTIFACTS = ROOT / "tests" / "fixtures" / "ort_training" / "artifacts"
LOSS_RTOL = 1e-5
ARRAY_TOL = 1e-4  # of the largest entry of the reference array


def relative_to_largest(got: np.ndarray, ref: np.ndarray) -> float:
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    err = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64)))) if ref.size else 0.0
    return err / scale if scale > 0 else err


def worst(errors: dict[str, float]) -> tuple[float, str]:
    name = max(errors, key=errors.get)
    return errors[name], name


def run(name: str, made: Path) -> dict:
    import onnxruntime as ort
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    ref = ARTIFACTS / name
    meta = json.loads((ref / "meta.json").read_text())
    data = np.load(ref / "data.npz")
    x, labels = data["input"], data["labels"]
    initial = dict(np.load(ref / "initial_params.npz"))
    step1 = dict(np.load(ref / "api_step1.npz"))
    after = dict(np.load(ref / "api_optimizer_step1.npz"))
    curve_ref = json.loads((ref / "api_curve.json").read_text())
    training, evaluation = made / "training_model.onnx", made / "eval_model.onnx"
    result: dict = {"training_model_sha256": hashlib.sha256(training.read_bytes()).hexdigest()}

    state = CheckpointState.load_checkpoint(str(made / "checkpoint"))
    missing = sorted(p for p in initial if p not in state.parameters)
    if missing:
        raise RuntimeError(f"the checkpoint lacks {missing[:3]}")
    result["checkpoint_vs_initial_params"] = max(
        float(np.max(np.abs(np.array(state.parameters[p].data) - v))) if v.size else 0.0 for p, v in initial.items())
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    module = Module(str(training), state, str(evaluation), device="cpu", session_options=options)
    optimizer = Optimizer(str(made / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(curve_ref["learning_rate"])
    module.train()
    loss1 = float(module(x, labels))
    result["loss1"] = loss1
    result["loss1_rel"] = abs(loss1 - float(step1["loss"])) / abs(float(step1["loss"]))
    got = {p: np.array(state.parameters[p].grad) for p in meta["trainable_params"]}
    largest = max(float(np.max(np.abs(step1[f"grad.{p}"]))) for p in got)
    truth = dict(np.load(ref / "torch_f64_step1.npz"))
    # a gradient whose float64 truth is zero to rounding (a bias before BatchNorm, attention's key bias) is f32
    # noise on both sides: judged against the model's largest gradient entry instead of its own
    zero = sorted(p for p in got if float(np.max(np.abs(truth[f"grad.{p}"]))) <= 1e-12 * largest)
    grads = {p: relative_to_largest(g, step1[f"grad.{p}"]) for p, g in got.items() if p not in zero}
    result["grad_rel_max"], result["grad_worst_param"] = worst(grads)
    result["zero_truth_grads"] = {p: float(np.max(np.abs(got[p] - step1[f"grad.{p}"]))) / largest for p in zero}
    result["grad_rel_max"] = max([result["grad_rel_max"], *result["zero_truth_grads"].values()])
    optimizer.step()
    params = {k[len("param."):]: relative_to_largest(np.array(state.parameters[k[len("param."):]].data), v)
              for k, v in after.items()}
    result["param_rel_max"], result["param_worst"] = worst(params)
    module.lazy_reset_grad()
    curve = [loss1]
    for _ in range(len(curve_ref["loss"]) - 1):
        curve.append(float(module(x, labels)))
        optimizer.step()
        module.lazy_reset_grad()
    result["curve_rel_max"] = max(abs(a - b) / abs(b) for a, b in zip(curve, curve_ref["loss"], strict=True))
    result["curve_last"] = curve[-1]

    # the eval model: a fresh module from the initial parameters (the training above moved them)
    state = CheckpointState.load_checkpoint(str(made / "checkpoint"))
    try:
        module = Module(str(training), state, str(evaluation), device="cpu", session_options=options)
        module.eval()
        result["eval_loss"] = float(module(x, labels))
        result["eval_loaded"] = True
    except Exception as exc:  # noqa: BLE001 -- recorded, the test fails on it
        result["eval_loaded"] = False
        result["eval_error"] = short(exc)
    own = native_eval_loss(ref, x, labels, options)
    result["own_eval_model"] = own
    if "eval_loss" in result:
        result["eval_loss_rel_to_own"] = abs(result["eval_loss"] - own["loss"]) / abs(own["loss"])
    result["passed"] = bool(result["loss1_rel"] <= LOSS_RTOL and result["grad_rel_max"] <= ARRAY_TOL
                            and result["param_rel_max"] <= ARRAY_TOL and result["curve_rel_max"] <= LOSS_RTOL
                            and result["eval_loaded"] and result.get("eval_loss_rel_to_own", 0.0) <= LOSS_RTOL)
    return result


def native_eval_loss(ref: Path, x, labels, options) -> dict:
    """onnxruntime-training's own eval model's loss on the batch, from its own checkpoint: ``loss`` and whether
    its eval model loaded as written (``loaded``, else ``error``). One that does not load (a BatchNorm net's:
    training-mode BatchNormalization's running-statistics outputs kept with training_mode off) is retried with
    those extra outputs dropped, which gives the reference loss all the same."""
    import tempfile

    import onnx
    from onnxruntime.training.api import CheckpointState, Module

    def loss(eval_path: Path) -> float:
        state = CheckpointState.load_checkpoint(str(ref / "checkpoint"))
        module = Module(str(ref / "training_model.onnx"), state, str(eval_path), device="cpu", session_options=options)
        module.eval()
        return float(module(x, labels))

    try:
        return {"loaded": True, "loss": loss(ref / "eval_model.onnx")}
    except Exception as exc:  # noqa: BLE001
        error = short(exc)
    model = onnx.load(ref / "eval_model.onnx")
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and len(node.output) > 1:
            del node.output[1:]
    with tempfile.TemporaryDirectory() as work:
        onnx.save(model, Path(work) / "eval_model.onnx")
        return {"loaded": False, "error": error, "loss": loss(Path(work) / "eval_model.onnx"),
                "loss_from": "its eval model with BatchNormalization's extra outputs dropped"}


def short(exc: Exception) -> str:
    """onnxruntime's message without the C++ location in front."""
    text = str(exc)
    if "[ONNXRuntimeError]" in text:
        text = text[text.index("[ONNXRuntimeError]"):]
    return text.splitlines()[0][:300] if text else type(exc).__name__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("made", type=Path, help="tools/make_oplower_artifacts.py's --out directory")
    parser.add_argument("names", nargs="*")
    parser.add_argument("--record", type=Path, help="write the outcome here (oplower_made.json)")
    args = parser.parse_args()
    import onnxruntime

    made = json.loads((args.made / "made.json").read_text())
    names = args.names or sorted(made)
    results, failed = {}, {}
    for name in names:
        entry = made.get(name)
        if entry is None or "error" in entry:
            failed[name] = "generator: " + (entry["error"] if entry else "not made")
            print(f"{name}: not made ({failed[name]})")
            continue
        try:
            result = run(name, args.made / name)
        except Exception as exc:  # noqa: BLE001 -- one architecture's failure is recorded, the rest run
            failed[name] = f"onnxruntime-training: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(f"{name}: FAILED {failed[name]}")
            continue
        if result["training_model_sha256"] != entry["training_model_sha256"]:
            raise SystemExit(f"{name}: the training model changed since made.json was written")
        line = (f"{name}: loss {result['loss1_rel']:.1e}, grads {result['grad_rel_max']:.1e}, "
                f"params {result['param_rel_max']:.1e}, curve {result['curve_rel_max']:.1e}, "
                f"eval {'loads' if result['eval_loaded'] else 'FAILS'}"
                + (f" ({result['eval_loss_rel_to_own']:.1e} from its own" if "eval_loss_rel_to_own" in result
                   else " (") + ("" if result["own_eval_model"]["loaded"] else ", which does not load") + ")")
        if result["passed"]:
            results[name] = result
            print(line + " PASS")
        else:
            failed[name] = "beyond tolerance: " + line
            print(line + " FAIL")
    if args.record:
        record = {"tool": "tools/ort_training/run_oplower_artifacts.py",
                  "onnxruntime_training": onnxruntime.__version__,
                  "tolerances": {"loss_rel": LOSS_RTOL, "grad_param_of_largest": ARRAY_TOL},
                  "architectures": results, "failing": failed}
        text = json.dumps(record, indent=1, sort_keys=True) + "\n"
        args.record.write_text(text.replace(str(ROOT) + "/", ""))  # paths in messages relative to the checkout
        print(f"wrote {args.record}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
