"""The registry: specs/ + bindings.json parsed once, looked up by (domain, op_type); binding data validated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from opdef.errors import SpecError
from opdef.registry import BINDINGS_FILE, build_registry, default_spec_dir, load_schemas

SPECS = Path(__file__).resolve().parent.parent / "specs"

BUNDLED = {
    ("onednn", "BatchNormTrainingBackward"): "onednn",
    ("onednn", "BatchNormTrainingBackprop"): "opset_v0",
    ("ngraph", "BatchNormTrainingBackprop"): "ngraph",
    ("directml", "BATCH_NORMALIZATION_GRAD"): "directml",
    ("com.microsoft", "BatchNormalizationGrad"): "onednn",
    ("com.microsoft", "BatchNormInternal"): "onednn",
    ("com.microsoft", "ReluGrad"): "onednn",
    ("com.microsoft", "SigmoidGrad"): "onednn",
    ("com.microsoft", "DivGrad"): "onednn",
    ("com.microsoft", "Scale"): "onednn",
    ("com.microsoft", "ConvGrad"): "onednn",
    ("com.microsoft", "SoftmaxCrossEntropyLossGrad"): "onednn",
    ("", "MaxPoolGrad"): "onednn",
    ("", "AveragePoolGrad"): "onednn",
    ("com.microsoft", "InPlaceAccumulatorV2"): "onednn",
    ("com.microsoft", "AdamWOptimizer"): "onednn",
    ("com.microsoft", "SGDOptimizerV2"): "onednn",
    ("com.microsoft", "SoftmaxGrad"): "onednn",
    ("com.microsoft", "SoftmaxGrad_13"): "onednn",
    ("com.microsoft", "LogSoftmaxGrad"): "onednn",
    ("com.microsoft", "LogSoftmaxGrad_13"): "onednn",
    ("com.microsoft", "LayerNormalizationGrad"): "onednn",
    ("com.microsoft", "SimplifiedLayerNormalizationGrad"): "onednn",
    ("", "SimplifiedLayerNormalization"): "onednn",
    ("com.microsoft", "FusedMatMul"): "onednn",
    ("com.microsoft", "GatherGrad"): "onednn",
    ("com.microsoft", "SliceGrad"): "onednn",
    ("com.microsoft", "ConcatTraining"): "onednn",
    ("com.microsoft", "SplitTraining"): "onednn",
    ("com.microsoft", "DropoutGrad"): "onednn",
    ("com.microsoft", "TanhGrad"): "onednn",
    ("com.microsoft", "LeakyReluGrad"): "onednn",
    ("com.microsoft", "QuickGelu"): "onednn",
    ("com.microsoft", "QuickGeluGrad"): "onednn",
    ("com.microsoft", "BiasGelu"): "onednn",
    ("com.microsoft", "BiasGeluGrad_dX"): "onednn",
    ("com.microsoft", "GeluGrad"): "onednn",
    ("com.microsoft", "FastGeluGrad"): "onednn",
    ("com.microsoft", "BiasFastGeluGrad_dX"): "onednn",
    ("com.microsoft", "Gelu"): "onednn",
    ("com.microsoft", "LSTMTraining"): "onednn",
    ("com.microsoft", "LSTMGrad"): "onednn",
    ("com.microsoft", "GRUTraining"): "onednn",
    ("com.microsoft", "GRUGrad"): "onednn",
}


def test_bundled_registry_has_every_op_with_its_dialect_and_domain():
    registry = load_schemas()
    assert {e.binding.key: e.schema.dialect for e in registry} == BUNDLED
    for entry in registry:
        assert entry.schema.domain == entry.binding.domain  # the binding's domain wins over the dialect's


def test_load_schemas_parses_once():
    assert load_schemas() is load_schemas()


def test_default_spec_dir_holds_the_bindings():
    assert (default_spec_dir() / BINDINGS_FILE).is_file()


def test_shared_domain_handles_only_bound_ops():
    registry = load_schemas()
    assert registry.handles("com.microsoft", "BatchNormalizationGrad")
    assert registry.handles("com.microsoft", "ConvGrad")
    assert not registry.handles("com.microsoft", "ReduceSumTraining")  # onnxruntime's, not ours
    assert registry.handles("onednn", "NoSuchOp")  # our own domain: reported as unknown by verification
    assert not registry.handles("", "Relu")


def _spec_copy(tmp_path: Path, edit) -> Path:
    target = tmp_path / "specs"
    shutil.copytree(SPECS, target)
    data = json.loads((target / BINDINGS_FILE).read_text())
    edit(data)
    (target / BINDINGS_FILE).write_text(json.dumps(data))
    return target


def _first(data):
    return data["ops"][0]


BAD_BINDINGS = {
    "unknown-field": (lambda d: _first(d).update(colour="red"), "unknown field"),
    "missing-rule": (lambda d: _first(d).pop("rule"), "'rule' must be a non-empty string"),
    "bad-layout": (lambda d: _first(d).update(layout="diagonal"), "layout 'diagonal'"),
    "data-format-without-attribute": (lambda d: _first(d).pop("layout_attribute"), "needs 'layout_attribute'"),
    "bad-statistics": (lambda d: _first(d).update(statistics="running"), "statistics 'running'"),
    "bad-stat-input": (lambda d: _first(d).update(stat_input="std"), "stat_input 'std'"),
    "rank-not-int": (lambda d: _first(d).update(min_rank="2"), "min_rank must be a non-negative integer"),
    "negative-rank": (lambda d: _first(d).update(max_rank=-1), "max_rank must be a non-negative integer"),
    "role-names-nothing": (lambda d: _first(d)["roles"].update(src="source"), "role 'src' names 'source'"),
    "op-type-mismatch": (lambda d: _first(d).update(op_type="BatchNormBackward"), "binds it as 'BatchNormBackward'"),
    "duplicate": (lambda d: d["ops"].append(dict(_first(d))), "two bindings for onednn::BatchNormTrainingBackward"),
    "shared-domains-not-list": (lambda d: d.update(shared_domains="com.microsoft"), "shared_domains"),
    "ops-missing": (lambda d: d.pop("ops"), '"ops" list'),
    "missing-document": (lambda d: _first(d).update(spec="onednn/Nope.rst"), "cannot read"),
    "default-domain-without-since-opset": (lambda d: next(o for o in d["ops"] if o["domain"] == "").pop("since_opset"),
                                           "a default-domain op needs 'since_opset'"),
    "since-opset-not-int": (lambda d: _first(d).update(since_opset="9"), "since_opset must be a non-negative integer"),
}


@pytest.mark.parametrize("case", list(BAD_BINDINGS))
def test_bad_binding_data_is_a_spec_error(tmp_path, case):
    edit, message = BAD_BINDINGS[case]
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_registry(_spec_copy(tmp_path, edit))


def test_invalid_json_names_the_line(tmp_path):
    target = tmp_path / "specs"
    shutil.copytree(SPECS, target)
    (target / BINDINGS_FILE).write_text('{\n  "ops": [\n    oops\n  ]\n}\n')
    with pytest.raises(SpecError, match=r"bindings.json:3: invalid JSON"):
        build_registry(target)
