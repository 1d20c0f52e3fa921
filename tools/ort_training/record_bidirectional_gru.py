"""A bidirectional GRU classifier's training graph, which onnxruntime-training writes but cannot run, with torch's
own loss and gradients as the expected values (tests/test_recurrent.py).

Run with the onnxruntime-training environment's python (it has torch):

    /work/ortt-venv/bin/python tools/ort_training/record_bidirectional_gru.py

``generate_artifacts`` turns ``nn.GRU(bidirectional=True)`` into GRUTraining/GRUGrad with direction
``bidirectional``; onnxruntime-training 1.19.2's kernel refuses that direction at session creation, so there is
no training-API result to record. Instead torch's autograd gives the reference: the same model, parameters and
batch, CrossEntropyLoss (mean), one backward. Writes tests/fixtures/ort_training/graphs/gru_bidirectional/:
training_model.onnx, data.npz (input, labels), initial_params.npz, torch_step1.npz (loss, grad.<param>).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
from onnxruntime.training import artifacts
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_artifacts import RecurrentClassifier  # noqa: E402

OUT = HERE.parent.parent / "tests" / "fixtures" / "ort_training" / "graphs" / "gru_bidirectional"
SEED = 2021


def main() -> None:
    torch.manual_seed(SEED)
    model = RecurrentClassifier(nn.GRU, bidirectional=True)
    model.train()
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(3, 5, 4, generator=gen)
    labels = torch.randint(0, 3, (3,), generator=gen)
    with tempfile.TemporaryDirectory() as tmp:
        forward = Path(tmp) / "forward.onnx"
        torch.onnx.export(model, (x,), str(forward), input_names=["input"], output_names=["output"],
                          opset_version=17, do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
                          dynamo=False)
        fwd = onnx.load(forward)
        trained = [i.name for i in fwd.graph.initializer if ".weight" in i.name or ".bias" in i.name]
        artifacts.generate_artifacts(fwd, requires_grad=trained, loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp)
        shutil.rmtree(OUT, ignore_errors=True)
        OUT.mkdir(parents=True)
        shutil.copy(Path(tmp) / "training_model.onnx", OUT / "training_model.onnx")
    params = dict(model.named_parameters())
    assert set(params) == set(trained), (sorted(params), sorted(trained))
    loss = nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    np.savez_compressed(OUT / "data.npz", input=x.numpy(), labels=labels.numpy().astype(np.int64))
    np.savez_compressed(OUT / "initial_params.npz", **{k: v.detach().numpy() for k, v in params.items()})
    np.savez_compressed(OUT / "torch_step1.npz", loss=loss.detach().numpy(),
                        **{f"grad.{k}": v.grad.numpy() for k, v in params.items()})
    print(f"{OUT}: loss {float(loss):.6f}")


if __name__ == "__main__":
    main()
