"""oplower's generate_artifacts on every committed architecture's forward model, for onnxruntime-training's runtime.

    PYTHONPATH=. python tools/make_oplower_artifacts.py --out DIR [NAME ...]

For each architecture under ``tests/fixtures/ort_training/artifacts/`` (or the NAMEs given), its
``forward_model.onnx`` (torch's export, unpatched) with every Dropout's ratio set to 0 (the recorded
onnxruntime-training results were taken with zeroed ratios; see :func:`zero_dropout`) goes through
:func:`lowering.training.artifacts.build_artifacts` with the recorded ``meta.json``'s arguments
(``trainable_params`` as ``requires_grad``, ``frozen_params``, ``loss``, ``optimizer``), and the four files go to
``DIR/<name>/``. ``DIR/made.json`` lists, per architecture, the sha256 of the training model written, or the
one-line error of an architecture the generator cannot do yet. Then, in onnxruntime-training's venv:

    /work/ortt-venv/bin/python tools/ort_training/run_oplower_artifacts.py DIR \\
        --record tests/fixtures/ort_training/oplower_made.json

``tests/test_oplower_made_in_ort_training.py`` imports :func:`build` to check that the recorded sha256 is still
the one the current generator writes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tests" / "fixtures" / "ort_training" / "artifacts"


def architectures() -> list[str]:
    """Every committed artifact directory with a forward model, sorted."""
    return sorted(d.name for d in ARTIFACTS.iterdir() if (d / "forward_model.onnx").is_file())


def zero_dropout(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose every Dropout reads a ratio of 0 (a new initializer ``<node>.ratio0`` of the old
    ratio's type; a Dropout without a ratio input gets one); Constant nodes left unread are dropped."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    types = {t.name: t.data_type for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = a.t.data_type
    for index, node in enumerate(graph.node):
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        elem = types.get(node.input[1], onnx.TensorProto.FLOAT) if len(node.input) > 1 and node.input[1] else \
            onnx.TensorProto.FLOAT
        zero = f"{node.name or node.output[0] or index}.ratio0"
        graph.initializer.append(numpy_helper.from_array(
            np.zeros((), helper.tensor_dtype_to_np_dtype(elem)), zero))
        if len(node.input) > 1:
            node.input[1] = zero
        else:
            node.input.append(zero)
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    kept = [n for n in graph.node if n.op_type != "Constant" or any(o in read for o in n.output)]
    del graph.node[:]
    graph.node.extend(kept)
    return out


def forward_model(name: str) -> onnx.ModelProto:
    """The architecture's forward model as the generator gets it: ``forward_model.onnx``, Dropout ratios 0."""
    return zero_dropout(onnx.load(ARTIFACTS / name / "forward_model.onnx"))


def build(name: str):
    """:class:`lowering.training.artifacts.Artifacts` of the architecture, with its recorded arguments."""
    from lowering.training.artifacts import LossType, OptimType, build_artifacts

    meta = json.loads((ARTIFACTS / name / "meta.json").read_text())
    return build_artifacts(forward_model(name), requires_grad=meta["trainable_params"],
                           frozen_params=meta["frozen_params"], loss=LossType[meta["loss"]],
                           optimizer=OptimType[meta["optimizer"]])


def training_sha256(artifacts) -> str:
    """The sha256 of the training model file :func:`lowering.training.artifacts.write_artifacts` writes."""
    return hashlib.sha256(artifacts.training.SerializeToString()).hexdigest()


def main() -> int:
    from lowering.training.artifacts import write_artifacts
    from opdef.errors import OplowerError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="architectures (default: every committed one with a forward model)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    names = args.names or architectures()
    made: dict[str, dict] = {}
    for name in names:
        try:
            artifacts = build(name)
        except OplowerError as exc:
            made[name] = {"error": str(exc)}
            print(f"{name}: {exc}", file=sys.stderr)
            continue
        write_artifacts(artifacts, args.out / name)
        digest = training_sha256(artifacts)
        on_disk = hashlib.sha256((args.out / name / "training_model.onnx").read_bytes()).hexdigest()
        if on_disk != digest:
            raise SystemExit(f"{name}: the written training model's sha256 differs from the serialised model's")
        made[name] = {"training_model_sha256": digest}
        print(f"{name}: wrote {args.out / name} (training model sha256 {digest[:12]})")
    (args.out / "made.json").write_text(json.dumps(made, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
