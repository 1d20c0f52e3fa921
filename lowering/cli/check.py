"""``oplower check``: verify every custom node of a model and print its inferred output types."""

from __future__ import annotations

import argparse
import sys

from lowering.modelio import InFile, load_model
from opdef.errors import OplowerError
from opdef.model_verify import InvalidNodes, verify_model
from opdef.node import NodeInference
from opdef.registry import load_schemas
from opdef.verify import format_type

HELP = "verify every custom node of a model and print each one's inferred output types and shapes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="an ONNX model file")
    p.add_argument("--all", action="store_true",
                   help="report every invalid node (one line each) instead of stopping at the first")


def run(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    registry = load_schemas()
    try:
        results = verify_model(model, registry, all_errors=args.all)
    except InvalidNodes as exc:
        _print_results(exc.results)
        for error in exc.errors:
            print(f"oplower check: error: {args.model}: {' '.join(str(error).split())}", file=sys.stderr)
        print(f"{len(exc.errors)} invalid custom node{'s' if len(exc.errors) != 1 else ''}, "
              f"{len(exc.results)} valid", file=sys.stderr)
        return 1
    except OplowerError as exc:
        raise InFile(args.model, exc) from exc
    _print_results(results)
    if results:
        print(f"{len(results)} custom node{'s' if len(results) != 1 else ''} verified")
    else:
        print(f"no custom nodes (domains known: {', '.join(sorted(registry.domains))})")
    return 0


def _print_results(results: list[NodeInference]) -> None:
    for inference in results:
        print(format_inference(inference))


def format_inference(inference: NodeInference) -> str:
    """``domain op_type 'name':`` then one line per requested output: ``diff_src: f32 [N,64,7,7]``."""
    name = inference.node_name or next((o for o in inference.outputs if o), "?")
    lines = [f"{inference.domain} {inference.op_type} '{name}':"]
    args = _output_args(inference)
    for arg_name, value, t in zip(args, inference.outputs, inference.output_types, strict=True):
        if value is None:
            continue
        alias = f"  ({value})" if value != arg_name else ""
        lines.append(f"  {arg_name}: {format_type(t)}{alias}")
    return "\n".join(lines)


def _output_args(inference: NodeInference) -> list[str]:
    formal = [a.name for a in inference.schema.outputs]
    if len(formal) >= len(inference.outputs):
        return formal[: len(inference.outputs)]
    return formal + [formal[-1]] * (len(inference.outputs) - len(formal))  # a variadic tail
