"""``oplower lower MODEL -o OUT``: rewrite every custom node into standard ONNX ops."""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper

from lowering.modelio import InFile, copy_atomic, load_model, write_atomic
from lowering.rules import ONEDNN_SINGLE_OUTPUT, TARGETS
from opdef.errors import ModelError, OplowerError

HELP = "lower every custom node of MODEL into standard ONNX ops and write the result to OUT"
STAT_ROLES = ("variance", "inv_std")  # inputs that must be positive in random test data


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="the ONNX model to lower (never modified)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write the lowered model")
    p.add_argument("--in-place", action="store_true", help="allow OUT to be MODEL itself (replaced atomically)")
    p.add_argument("--verify", action="store_true",
                   help="run the original (float64 reference) and the lowered model (onnxruntime) on random "
                        "inputs and fail unless every output agrees within tolerance")
    p.add_argument("--seed", type=int, default=0, help="random seed for --verify (default 0)")
    p.add_argument("--onednn-single-output", choices=ONEDNN_SINGLE_OUTPUT, default="spec",
                   help="oneDNN node with neither diff_gamma nor diff_beta: 'spec' ignores gamma (default); "
                        "'upstream' also uses frozen statistics, as oneDNN's implementation does")
    p.add_argument("--target", choices=TARGETS, default="onnxruntime",
                   help="'onnxruntime' (default): tuned for onnxruntime's CPU provider; 'portable': only ops "
                        "every ONNX runtime runs with computed inputs (no Conv/BatchNormalization on computed "
                        "weights or statistics)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 1, OUT not written) when a non-standard op without a lowering rule would "
                        "stay in the model; without it each such op type is one warning line on stderr")


def run(args: argparse.Namespace) -> int:
    from lowering.final_check import check_lowered
    from lowering.passes import lower_model_with_report
    from opdef.registry import load_schemas

    source, target = Path(args.model), Path(args.output)
    if _same_file(source, target) and not args.in_place:
        print(f"oplower lower: error: -o {target} is the input model; pass --in-place to replace it",
              file=sys.stderr)
        return 2
    model = load_model(source, load_external_data=False)
    registry = load_schemas()
    locations = _external_data_files(model, source.parent)  # checked before anything runs or is written
    try:
        lowered, report = lower_model_with_report(model, registry=registry,
                                                  onednn_single_output=args.onednn_single_output,
                                                  target=args.target)
    except OplowerError as exc:
        raise InFile(source, exc) from exc
    if report.left and args.strict:
        ops = "; ".join(f"{op.count} x {op.op} (first: node {op.first})" for op in report.left)
        print(f"oplower lower: error: {source}: --strict: {len(report.left)} op type(s) have no lowering rule "
              f"and would stay: {ops}; {target} not written", file=sys.stderr)
        return 1
    try:
        check_lowered(lowered, model)  # the guarantee: nothing is written that the checker or onnxruntime refuses
    except OplowerError as exc:
        raise InFile(source, exc) from exc
    for op in report.left:
        print(f"oplower lower: warning: {source}: {op.describe()}", file=sys.stderr)
    print(f"{source} -> {target}: {report.summary()}")
    if args.verify:
        failures = verify_lowering(model, lowered, source.parent, registry, seed=args.seed,
                                   single_output=args.onednn_single_output)
        if failures:
            print(f"oplower lower: error: {source}: {failures} output(s) of the lowered model differ from the "
                  f"float64 reference beyond tolerance; {target} not written", file=sys.stderr)
            return 1
    try:
        data = lowered.SerializeToString()
    except ValueError as exc:  # protobuf's 2 GB limit
        raise ModelError(f"{target}: the lowered model cannot be serialized ({exc}); store its tensors "
                         "as external data") from None
    if not target.parent.is_dir():
        raise ModelError(f"{target}: directory {target.parent} does not exist")
    _carry_external_data(locations, source.parent, target.parent)
    write_atomic(target, data)
    return 0


def verify_lowering(original: onnx.ModelProto, lowered: onnx.ModelProto, base_dir: Path, registry, *,
                    seed: int = 0, single_output: str = "spec") -> int:
    """Run both models on random inputs; print one line per output; return the number out of tolerance."""
    from lowering.numerics import compare, random_feeds
    from runtime.reference_eval import evaluate
    from runtime.session import run_model

    original, lowered = _with_data(original, base_dir), _with_data(lowered, base_dir)
    positive = _stat_inputs(original, registry)
    initialized = {t.name for t in original.graph.initializer}
    inputs = []
    for vi in original.graph.input:
        if vi.name in initialized:
            continue
        tensor = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tensor.HasField("shape"):
            raise ModelError(f"--verify: input '{vi.name}' declares no tensor shape; cannot make random data")
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
        inputs.append((vi.name, tensor.elem_type, dims))
    feeds = random_feeds(inputs, np.random.default_rng(seed), positive=positive.__contains__)
    try:
        reference = evaluate(original, feeds, registry=registry, exact=True, single_output=single_output)
    except OplowerError as exc:
        raise ModelError(f"--verify: the float64 reference failed on random inputs: {exc}") from None
    got = run_model(lowered, feeds)
    failures = 0
    for vi in lowered.graph.output:
        result = compare(vi.name, reference[vi.name], got[vi.name], vi.type.tensor_type.elem_type)
        failures += not result.ok
        print(f"  {result.describe()}")
    return failures


def _stat_inputs(model: onnx.ModelProto, registry) -> set[str]:
    """Value names bound to a variance or inv_std role of any custom node (main graph)."""
    names: set[str] = set()
    for node in model.graph.node:
        entry = registry.get(node.domain, node.op_type)
        if entry is None:
            continue
        for role in STAT_ROLES:
            arg = entry.binding.arg(role)
            inputs = [a.name for a in entry.schema.inputs]
            if arg not in inputs:  # absent, or the role names an output (a forward op's saved statistic)
                continue
            index = inputs.index(arg)
            if index < len(node.input) and node.input[index]:
                names.add(node.input[index])
    return names


def _with_data(model: onnx.ModelProto, base_dir: Path) -> onnx.ModelProto:
    """A copy with externally stored tensors loaded (verification needs the values)."""
    if not _external_locations(model):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    external_data_helper.load_external_data_for_model(copy, str(base_dir))
    return copy


def _external_locations(model: onnx.ModelProto) -> set[str]:
    return {external_data_helper.ExternalDataInfo(t).location
            for t in external_data_helper._get_all_tensors(model)  # noqa: SLF001 -- onnx's own walker
            if external_data_helper.uses_external_data(t)}


def _external_data_files(model: onnx.ModelProto, source_dir: Path) -> list[str]:
    """The model's external data locations, each checked: inside the model's directory and present."""
    locations = sorted(_external_locations(model))
    for location in locations:  # onnx refuses to load these; copying one would write outside the target
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise ModelError(f"external data location {location!r} points outside the model's directory "
                             f"{source_dir}; onnx refuses such models (keep data files beside the model)")
        if not (source_dir / location).is_file():
            raise ModelError(f"{source_dir / location}: external data file of the model is missing")
    return locations


def _carry_external_data(locations: list[str], source_dir: Path, target_dir: Path) -> None:
    """External data files stay where they are for an output beside the input; else they are copied along."""
    if _same_file(source_dir, target_dir):
        return
    for location in locations:
        src, dst = source_dir / location, target_dir / location
        if dst.exists():
            if _same_file(src, dst) or filecmp.cmp(src, dst, shallow=False):
                continue
            raise ModelError(f"{dst} exists and differs from the model's external data {src}; "
                             "write the lowered model elsewhere")
        dst.parent.mkdir(parents=True, exist_ok=True)  # inside target_dir, which exists (checked above)
        copy_atomic(src, dst)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()
