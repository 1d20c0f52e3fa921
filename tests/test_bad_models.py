"""Corrupted models give the project's documented error naming the node and the problem — never a raw exception.

The cases (``bad_inputs.models``) cover truncated and garbage bytes, names that are not UTF-8, wrong arity,
wrong attribute types, NaN / infinite / negative / zero epsilon, unknown data_format, rank 0 and 1,
zero-sized and huge dimensions, duplicate node and value names, missing initializers, broken graphs, and
custom nodes inside If branches and model-local functions. Each goes through the library as the CLI does:
``load_model`` -> ``verify_model`` -> ``lower_model``.
"""

from __future__ import annotations

import hashlib

import onnx
import pytest
from bad_inputs.models import CASES

from lowering.modelio import load_model
from lowering.passes import lower_model
from opdef.errors import ModelError, OplowerError
from opdef.model_verify import verify_model
from opdef.registry import load_schemas


def _pipeline(path):
    registry = load_schemas()
    model = load_model(path)
    verify_model(model, registry)
    return lower_model(model, registry=registry)


def test_case_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_corrupted_model(case, tmp_path):
    path = tmp_path / "model.onnx"
    data = case.make()
    path.write_bytes(data)
    if case.error is None:
        lowered = _pipeline(path)
        onnx.checker.check_model(lowered)
        assert not [n for n in lowered.graph.node if n.domain in load_schemas().domains]
    else:
        with pytest.raises(OplowerError) as info:
            _pipeline(path)
        err = info.value
        assert type(err) is case.error, f"{type(err).__name__}: {err}"
        message = str(err)
        for fragment in case.fragments:
            assert fragment in message, message
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()


def core_case_count() -> int:
    return len(CASES)


@pytest.mark.parametrize("case", [c for c in CASES if c.error is ModelError and not c.id.startswith("bytes-")
                                  and "opset import" not in " ".join(c.fragments)], ids=lambda c: c.id)
def test_lower_model_on_a_proto_checks_the_graph_too(case):
    """The library path without load_model: lower_model(ModelProto) gives the same ModelError."""
    with pytest.raises(ModelError) as info:
        lower_model(onnx.load_from_string(case.make()), registry=load_schemas())
    for fragment in case.fragments:
        assert fragment in str(info.value)
