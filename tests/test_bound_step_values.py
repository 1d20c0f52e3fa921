"""The bound train step writes the learning rate and the step number, and reads the loss, through NumPy arrays
that share their OrtValues' memory (lowering.training.train_step.BoundStep): a learning rate changed between
steps, the step count AdamW's bias corrections read and the loss of every step must come out as the two-model
path (training model, then optimizer model, NumPy feeds) computes them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from lowering.training.train_step import _loss_buffers
from lowering.training.trainer import Trainer, initial_parameters, lower_artifacts

ARTIFACTS = Path(__file__).parent / "fixtures" / "ort_training" / "artifacts"


@pytest.fixture(scope="module", params=["mlp_act", "cnn1d"])  # AdamW / SGD
def artifact(request):
    directory = ARTIFACTS / request.param
    models = lower_artifacts(directory)
    start = initial_parameters(directory, models, dict(np.load(directory / "initial_params.npz")))
    data = dict(np.load(directory / "data.npz"))
    labels = json.loads((directory / "meta.json").read_text())["labels_input"]
    batch = {models.step.interface.data[0]: data["input"], labels: data["labels"]}
    return models, start, batch


def _train(trainer: Trainer, batch, rates) -> list[float]:
    losses = []
    for rate in rates:
        trainer.learning_rate = np.array([rate], np.float32)
        losses.append(trainer.step(batch))
    return losses


def test_rates_steps_and_losses_match_the_two_model_path(artifact):
    models, start, batch = artifact
    rates = [1e-2, 1e-2, 5e-2, 1e-3, 2e-2]  # changed between steps
    bound = Trainer(models, start, threads=1)
    assert bound._bound is not None and bound._bound._losses  # the in-place loss is what runs
    plain = Trainer(dataclasses.replace(models, step=None), start, threads=1)
    got, want = _train(bound, batch, rates), _train(plain, batch, rates)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert len(set(got)) == len(got)  # each step's own loss, not one buffer read late
    for name in models.params:
        np.testing.assert_allclose(bound.params[name], plain.params[name], rtol=1e-5, atol=1e-7)
    assert bound.step_count == plain.step_count == len(rates)


def test_a_loss_of_unknown_shape_gets_an_allocated_output():
    class Output:
        def __init__(self, shape, type_):
            self.name, self.shape, self.type = "loss", shape, type_

    class Session:
        def __init__(self, output):
            self.output = output

        def get_outputs(self):
            return [self.output]

    assert [b.shape for b in _loss_buffers(Session(Output([], "tensor(float)")), "loss")] == [(), ()]
    assert _loss_buffers(Session(Output(["batch"], "tensor(float)")), "loss") == []
    assert _loss_buffers(Session(Output([1], "tensor(bfloat16)")), "loss") == []
