"""``oplower demo``: the main job end to end on an embedded example, no files needed.

Builds one model holding batch-norm training backward nodes of every bundled dialect (several layouts and
element types), lowers it to standard ONNX, runs it in onnxruntime and compares every output with the
float64 reference.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import TensorProto

from lowering.demo.examples import BnCase, build_example, case_geometry
from lowering.numerics import compare
from lowering.passes import lower_model_with_report
from opdef.registry import Registry, load_schemas
from opdef.types import type_name
from runtime.session import run_model

F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16

DEMO_CASES = (
    BnCase(("onednn", "BatchNormTrainingBackward"), (4, 7, 7, 16), layout="NXC", name="onednn_nxc_f32"),
    BnCase(("onednn", "BatchNormTrainingBackward"), (8, 16, 5, 5), layout="NCX", name="onednn_ill_conditioned",
           conditioning=1e4, seed=1),
    BnCase(("onednn", "BatchNormTrainingBackprop"), (4, 16, 6, 6), layout="NCX", io_type=BF16, stat_type=BF16,
           name="opset_v0_ncx_bf16", seed=2),
    BnCase(("ngraph", "BatchNormTrainingBackprop"), (4, 8, 10), name="ngraph_f32", seed=3),
    BnCase(("directml", "BATCH_NORMALIZATION_GRAD"), (2, 8, 6, 6), io_type=F16, name="directml_f16_frozen",
           seed=4),
    BnCase(("com.microsoft", "BatchNormalizationGrad"), (4, 8, 5, 5), name="ort_training_f32", seed=5),
)


def run_demo(registry: Registry | None = None, echo: Callable[[str], None] = print,
             target: str = "onnxruntime") -> int:
    """Returns 0 when every output is within tolerance of the float64 reference, 1 otherwise."""
    registry = registry if registry is not None else load_schemas()
    cases = [c for c in DEMO_CASES if c.op in registry]
    example = build_example(cases, registry)
    lowered, report = lower_model_with_report(example.model, registry=registry, target=target)
    onnx.checker.check_model(lowered, full_check=True)
    got = run_model(lowered, example.feeds)
    echo(f"example model: {len(cases)} batch-norm backward nodes; target {target}; {report.summary()}")
    echo("lowered model: standard ONNX only, passes onnx.checker (full_check), runs in onnxruntime")
    echo("")
    failed = 0
    for case in cases:
        entry = registry.get(*case.op)
        _, axes, stat_shape = case_geometry(entry, case)
        layout = case.layout if entry.binding.layout == "data_format" else (
            "stats keep rank" if entry.binding.layout == "stats_broadcast" else "NCX")
        types = type_name(case.io_type) + "/" + type_name(case.stat_type or case.io_type)
        dialect = "onnxruntime-training" if case.op[0] == "com.microsoft" else entry.schema.dialect
        echo(f"{case.name}: {dialect} {case.op[0]}::{case.op[1]}, {layout}, {types}, "
             f"src {list(case.shape)}, stats {list(stat_shape)}, statistics {entry.binding.statistics}")
        for name, (case_name, role) in example.output_roles.items():
            if case_name != case.name:
                continue
            result = compare(role, example.expected[name], got[name], example.output_types[name])
            failed += not result.ok
            echo(f"    {result.describe()}")
    echo("")
    echo("all outputs match the float64 reference" if not failed else f"{failed} output(s) out of tolerance")
    return 0 if not failed else 1
