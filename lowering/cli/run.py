"""``oplower run``: execute a model in onnxruntime (lowering its custom nodes first) on inputs from an .npz."""

from __future__ import annotations

import argparse
import io
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
from onnx import TensorProto

from lowering.cli.arguments import positive_int
from lowering.modelio import load_model, write_atomic
from lowering.rules import TARGETS
from lowering.training.labels import check_labels, label_inputs
from opdef.errors import LoweringError, OplowerError, RuntimeFailure
from runtime.session import ValueSpec, find_custom_nodes, model_inputs, run_model

HELP = "run a model in onnxruntime's CPU provider on inputs from an .npz file (custom nodes are lowered first)"

_BF16 = np.dtype(ml_dtypes.bfloat16)


class InputDataError(OplowerError):
    """The --inputs file cannot be read or does not match the model's inputs."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="an ONNX model file")
    p.add_argument("--inputs", required=True, metavar="IN.npz",
                   help="one array per model input, keyed by input name (np.savez); bf16 arrays as NumPy "
                        "stores ml_dtypes.bfloat16 (2-byte void, '|V2') or as ml_dtypes arrays")
    p.add_argument("--outputs", metavar="OUT.npz", help="write every output here (bf16 as '|V2', like np.savez)")
    p.add_argument("--threads", type=positive_int, metavar="N", help="onnxruntime intra-op threads (default: its own)")
    p.add_argument("--check", action="store_true",
                   help="also evaluate the original model with the float64 reference and compare")
    p.add_argument("--onednn-single-output", choices=("spec", "upstream"), default="spec",
                   help="oneDNN nodes requesting neither parameter gradient: ignore gamma as the spec says "
                        "(default), or also freeze the statistics as upstream oneDNN does")
    p.add_argument("--target", choices=TARGETS, default="onnxruntime",
                   help="'onnxruntime' (default): tuned for onnxruntime's CPU provider; 'portable': only ops "
                        "every ONNX runtime runs with computed inputs (no Conv/BatchNormalization on computed "
                        "weights or statistics)")


def run(args: argparse.Namespace) -> int:
    model_path, inputs_path = Path(args.model), Path(args.inputs)
    outputs_path = Path(args.outputs) if args.outputs else None
    if outputs_path is not None and outputs_path.resolve() in (model_path.resolve(), inputs_path.resolve()):
        raise InputDataError(f"{outputs_path}: refusing to overwrite an input file")
    model = load_model(model_path)
    feeds = match_inputs(load_npz(inputs_path), model_inputs(model), inputs_path)
    if args.check:  # the float64 reference takes class ids only (lowering.training.labels)
        check_labels(feeds, label_inputs(model), str(inputs_path))

    custom = find_custom_nodes(model)
    runnable = model
    if custom:
        from lowering import lower_model_with_report  # noqa: PLC0415 (onnx-ir only when needed)

        try:
            runnable, report = lower_model_with_report(model, onednn_single_output=args.onednn_single_output,
                                                         target=args.target)
        except OplowerError as exc:
            raise LoweringError(f"{model_path}: {exc}") from None
        print(report.summary())
        left = find_custom_nodes(runnable)
        if left:
            raise LoweringError(f"{model_path}: node {left[0].describe()} has no lowering rule (oplower knows no "
                                "spec for it) and onnxruntime cannot run it")
    try:
        outputs = run_model(runnable, feeds, intra_op_threads=args.threads)
    except RuntimeFailure as exc:
        raise RuntimeFailure(f"{model_path}: {exc}") from None

    width = max((len(name) for name in outputs), default=0)
    for name, value in outputs.items():
        print(f"{name:<{width}}  {value.dtype}  {list(value.shape)}  {summarize(value)}")
    if args.check:
        check_against_reference(model, feeds, outputs, args.onednn_single_output, model_path)
    if outputs_path is not None:
        buffer = io.BytesIO()
        np.savez(buffer, **outputs)
        write_atomic(outputs_path, buffer.getvalue())
        print(f"wrote {outputs_path}")
    return 0


def load_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an .npz file (no pickles)."""
    if not path.exists():
        raise InputDataError(f"{path}: no such file")
    if path.is_dir():
        raise InputDataError(f"{path}: is a directory, expected an .npz file")
    try:
        with path.open("rb") as handle:
            magic = handle.read(6)
        if not magic.startswith((b"PK", b"\x93NUMPY")):
            raise InputDataError(f"{path}: not a readable .npz file (neither a zip archive of arrays nor a "
                                 "NumPy array)")
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise InputDataError(f"{path}: a single array (.npy), expected an .npz file (np.savez) keyed by "
                                 "input name")
        with data:
            arrays = {name: data[name] for name in data.files}
        for name, value in arrays.items():
            if not isinstance(value, np.ndarray):  # NpzFile hands back a member that is no .npy as raw bytes
                raise InputDataError(f"{path}: member '{name}' is not a NumPy array (.npy); save inputs with np.savez")
        return arrays
    except InputDataError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if "Object arrays" in reason:
            reason = "it holds object arrays, which are never unpickled"
        raise InputDataError(f"{path}: not a readable .npz file ({reason})") from None


def match_inputs(arrays: dict[str, np.ndarray], inputs: dict[str, ValueSpec], path: Path) -> dict[str, np.ndarray]:
    """The feeds for the model: every required input present, nothing extra, bf16 restored from '|V2'."""
    extra = [name for name in arrays if name not in inputs]
    if extra:
        raise InputDataError(f"{path}: {extra[0]!r} is not an input of the model (its inputs: "
                             f"{', '.join(inputs) or 'none'})")
    missing = [spec for spec in inputs.values() if spec.name not in arrays and not spec.optional]
    if missing:
        names = ", ".join(f"'{s.name}' ({s.describe()})" for s in missing)
        raise InputDataError(f"{path}: missing input{'s' if len(missing) > 1 else ''} {names}")
    feeds = {}
    for name, array in arrays.items():
        spec = inputs[name]
        if spec.elem_type == TensorProto.BFLOAT16 and array.dtype.kind == "V" and array.dtype.itemsize == 2:
            array = array.view(_BF16)
        if spec.elem_type is not None and array.dtype != spec.dtype:
            raise InputDataError(f"{path}: input '{name}' has dtype {_dtype_name(array.dtype)}; the model expects "
                                 f"{spec.describe()}")
        feeds[name] = array
    return feeds


def _dtype_name(dtype: np.dtype) -> str:
    return f"{dtype.name} ('{dtype.str}')" if dtype.kind == "V" else dtype.name


def summarize(value: np.ndarray) -> str:
    """A few numbers that tell outputs apart at a glance."""
    if value.size == 0:
        return "empty"
    if value.dtype == np.bool_:
        return f"true {int(value.sum())}/{value.size}"
    if value.dtype.kind not in "iuf" and value.dtype != _BF16:
        return ""
    data = value.astype(np.float64)
    finite = np.isfinite(data)
    text = ""
    if not finite.all():
        text = f"non-finite {int((~finite).sum())}/{value.size}  "
        data = data[finite]
        if data.size == 0:
            return text.strip()
    if value.dtype.kind in "iu":
        return f"{text}min {int(data.min())}  max {int(data.max())}"
    return (f"{text}min {data.min():.6g}  max {data.max():.6g}  mean {data.mean():.6g}  "
            f"rms {np.sqrt(np.mean(data * data)):.6g}")


def check_against_reference(model, feeds, outputs, single_output: str, model_path: Path) -> None:
    """Compare onnxruntime's outputs with the float64 reference evaluation of the original model."""
    from lowering.numerics import compare  # noqa: PLC0415
    from runtime.reference_eval import evaluate  # noqa: PLC0415

    reference = evaluate(model, feeds, list(outputs), exact=True, single_output=single_output)
    failed = []
    for name, got in outputs.items():
        elem_type = _elem_type(got.dtype)
        if elem_type is None:
            ok = np.array_equal(np.asarray(reference[name]), got)
            print(f"check {name}: {'PASS' if ok else 'FAIL'} (exact)")
        else:
            comparison = compare(name, reference[name], got, elem_type)
            ok = comparison.ok
            print(f"check {comparison.describe()}")
        if not ok:
            failed.append(name)
    if failed:
        raise RuntimeFailure(f"{model_path}: output{'s' if len(failed) > 1 else ''} {', '.join(failed)} "
                             "differ from the float64 reference beyond tolerance")


def _elem_type(dtype: np.dtype) -> int | None:
    return {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE,
            np.dtype(np.float16): TensorProto.FLOAT16, _BF16: TensorProto.BFLOAT16}.get(np.dtype(dtype))
