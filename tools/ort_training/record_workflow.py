"""Record onnxruntime-training 1.19.2's checkpoint, eval and export results on committed artifacts.

Run in the onnxruntime-training venv (never imported by the package or its tests):

    /work/ortt-venv/bin/python tools/ort_training/record_workflow.py

For each artifact in ARTIFACTS (tests/fixtures/ort_training/artifacts/<name>, its ``checkpoint`` the
initial state) it writes tests/fixtures/ort_training/workflow/<name>/:

- ``ortt_k3.ckpt``: the training API's checkpoint after K=3 steps (module(input, labels), optimizer.step(),
  lazy_reset_grad(), data.npz's batch every step), optimizer state included;
- ``ortt_k6.npz``: ``loss`` of all K+M=6 steps of that same run, ``param.<name>`` (trainable and frozen) after
  step 6;
- ``eval_data.npz``: two batches (data.npz's and a seeded random one) keyed by the eval model's data inputs,
  with a leading batch-index axis;
- ``eval.npz``: ``loss`` (one per batch) of the training API's eval step (Module.eval(), module(input,
  labels)) on the parameters after step 6, with eval_model.onnx repaired (generate_artifacts keeps an
  inference-mode BatchNormalization's three outputs, which onnxruntime refuses: the two unread ones are
  dropped, as oplower's lowering.training.workflow.repair_eval_model does) -- and ``output`` (one per batch) of the
  model ``Module.export_model_for_inferencing(path, ["output"])`` writes, run by InferenceSession;
- ``export.json``: that model's inputs, outputs, initializer names and node op types;
- ``oplower_k3.ckpt``: the checkpoint ``oplower train --steps 3 --save-checkpoint`` writes (run with the
  project's own venv, OPLOWER_PYTHON, default /work/venv/bin/python), and ``ortt_from_oplower.npz``: the
  training API loading it (CheckpointState.load_checkpoint, Module, Optimizer): ``loaded.<name>`` the
  parameters it read, ``loss`` of its next step (step 4) and ``param.<name>`` after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.training.api import CheckpointState, Module, Optimizer

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS_DIR = ROOT / "tests" / "fixtures" / "ort_training" / "artifacts"
OUT = ROOT / "tests" / "fixtures" / "ort_training" / "workflow"
ARTIFACTS = {"cnn1d": 22, "mlp_bce": 23}  # name: seed of the second eval batch
K, M = 3, 3


def repaired_eval_model(source: Path, target: Path) -> None:
    model = onnx.load(source)
    read = {n for node in model.graph.node for n in node.input} | {o.name for o in model.graph.output}
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and not any(o in read for o in node.output[1:]):
            del node.output[1:]
    onnx.save(model, target)


def params_of(state: CheckpointState, names: list[str], prefix: str) -> dict:
    return {f"{prefix}{p}": np.array(state.parameters[p].data) for p in names}


def record(name: str, seed: int) -> None:
    art = ARTIFACTS_DIR / name
    meta = json.loads((art / "meta.json").read_text())
    names = meta["trainable_params"] + meta["frozen_params"]
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    data = np.load(art / "data.npz")
    x, labels = data["input"], data["labels"]
    label_input = meta["labels_input"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        eval_path = tmp / "eval_model.onnx"
        repaired_eval_model(art / "eval_model.onnx", eval_path)

        state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
        module = Module(str(art / "training_model.onnx"), state, str(eval_path), device="cpu")
        optimizer = Optimizer(str(art / "optimizer_model.onnx"), module)
        losses = []
        for step in range(K + M):
            module.train()
            losses.append(float(module(x, labels)))
            optimizer.step()
            module.lazy_reset_grad()
            if step + 1 == K:
                CheckpointState.save_checkpoint(state, str(out / "ortt_k3.ckpt"), include_optimizer_state=True)
        np.savez_compressed(out / "ortt_k6.npz", loss=np.array(losses, np.float32), **params_of(state, names, "param."))

        rng = np.random.default_rng(seed)
        x2 = rng.standard_normal(x.shape).astype(x.dtype)
        if labels.dtype.kind == "i":
            labels2 = rng.integers(0, int(labels.max()) + 1, size=labels.shape).astype(labels.dtype)
        else:
            labels2 = rng.integers(0, 2, size=labels.shape).astype(labels.dtype)
        eval_data = {"input": np.stack([x, x2]), label_input: np.stack([labels, labels2])}
        np.savez_compressed(out / "eval_data.npz", **eval_data)
        module.eval()
        eval_losses = [float(module(eval_data["input"][b], eval_data[label_input][b])) for b in range(2)]
        exported = tmp / "inference.onnx"
        module.export_model_for_inferencing(str(exported), ["output"])
        session = ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"])
        outputs = np.stack([session.run(None, {"input": eval_data["input"][b]})[0] for b in range(2)])
        np.savez_compressed(out / "eval.npz", loss=np.array(eval_losses, np.float32), output=outputs)
        model = onnx.load(exported)
        (out / "export.json").write_text(json.dumps({
            "inputs": [i.name for i in model.graph.input], "outputs": [o.name for o in model.graph.output],
            "initializers": sorted(t.name for t in model.graph.initializer),
            "nodes": [n.op_type for n in model.graph.node],
            "opset_imports": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "ir_version": model.ir_version}, indent=1) + "\n")

        # oplower's checkpoint after K steps, loaded by the training API, one more step
        train_data = tmp / "data.npz"
        np.savez(train_data, input=x, **{label_input: labels})
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        python = os.environ.get("OPLOWER_PYTHON", "/work/venv/bin/python")
        subprocess.run([python, "-m", "lowering", "train", str(art), "--steps", str(K), "--data", str(train_data),
                        "--save-checkpoint", str(out / "oplower_k3.ckpt")], check=True, env=env,
                       stdout=subprocess.DEVNULL, cwd=ROOT)
        state = CheckpointState.load_checkpoint(str(out / "oplower_k3.ckpt"))
        loaded = params_of(state, names, "loaded.")
        module = Module(str(art / "training_model.onnx"), state, device="cpu")
        optimizer = Optimizer(str(art / "optimizer_model.onnx"), module)
        module.train()
        loss = float(module(x, labels))
        optimizer.step()
        np.savez_compressed(out / "ortt_from_oplower.npz", loss=np.float32(loss), **loaded,
                            **params_of(state, names, "param."))
    print(f"  workflow {name}: 6-step loss {losses[0]:.6f} -> {losses[-1]:.6f}, eval {eval_losses}, "
          f"step 4 from oplower's checkpoint {loss:.6f}")


def main() -> None:
    for name, seed in ARTIFACTS.items():
        record(name, seed)


if __name__ == "__main__":
    sys.exit(main())
