"""What one training-graph op type costs inside the lowered train step: the step against the same step with that op's
lowered nodes knocked out (in-process, alternating, CPU clock).

    PYTHONPATH=. python tools/group_cost.py DIR OP [OP ...] [--rounds 9] [--steps 300]

DIR as for ``tools/ab_train_step.py``; OP a training-graph op type (``BatchNormalizationGrad``, ``ConvGrad``,
``LSTMTraining`` ...). Every lowered node charged to a node of that type (its name starts with the node's name) is
removed, and each output the rest of the step reads is made by one Identity of a same-shaped input of the node (or of
a constant, or a Reshape of a same-sized input for a view the flat gradient reads): the step computes garbage, but
runs every other kernel as before. Prints the median over rounds of (full step - knocked-out step) in microseconds
and the full step's median: the op's in-situ cost, stand-ins included (~0.3 us each).

Kernel counts (``tools/kernel_count.py``) do not say this: kernels cost 0.3 to several microseconds at small sizes
(a strided Slice ~2 us, a Reshape ~0.1), and microbenchmarks of several identical nodes on one input measure one
of them (onnxruntime's common-subexpression elimination merges them): give each copy its own input.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import _artifact
import numpy as np
import onnx
from onnx import helper, numpy_helper

from lowering.modelio import load_model
from lowering.static_shapes import static_shapes
from lowering.training.trainer import TRAINING_MODEL


def knocked_out(step: onnx.ModelProto, raw: onnx.ModelProto, ops: list[str]) -> tuple[onnx.ModelProto, int]:
    """``step`` without the lowered nodes of ``raw``'s nodes of type ``ops`` (Constants kept: other rules share
    them), with stand-ins for what the rest reads; (model, nodes removed)."""
    raw_shape, step_shape = static_shapes(raw), static_shapes(step)
    targets = [n for n in raw.graph.node if n.op_type in ops and n.name]
    model = onnx.ModelProto()
    model.CopyFrom(step)
    graph = model.graph

    def charged(name: str) -> onnx.NodeProto | None:
        """The target node a lowered node or value name belongs to (the lowering prefixes them with its name)."""
        return next((t for t in targets if name.startswith(t.name + "/")), None)

    kept = [n for n in graph.node if n.op_type == "Constant" or charged(n.name) is None]
    removed = len(graph.node) - len(kept)
    available = {o for n in kept for o in n.output} | {i.name for i in graph.input} | \
        {i.name for i in graph.initializer} | {""}
    stand_ins = []

    def stand_in(name: str, target: onnx.NodeProto, shape: list[int | None] | None) -> None:
        if shape is None or None in shape:
            raise SystemExit(f"group_cost: no static shape for {name!r} (read after {target.op_type} "
                             f"{target.name!r})")
        same = next((i for i in target.input if i and raw_shape.get(i) == shape), None)
        if same is not None:
            stand_ins.append(helper.make_node("Identity", [same], [name], name=f"knockout/{name}"))
        elif (same := next((i for i in target.input if i and raw_shape.get(i) and None not in raw_shape[i]
                            and math.prod(raw_shape[i]) == math.prod(shape)), None)) is not None:
            graph.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), f"knockout/shape/{name}"))
            stand_ins.append(helper.make_node("Reshape", [same, f"knockout/shape/{name}"], [name],
                                              name=f"knockout/{name}"))
        else:
            graph.initializer.append(numpy_helper.from_array(np.full(shape, 0.5, np.float32), f"knockout/{name}/c"))
            stand_ins.append(helper.make_node("Identity", [f"knockout/{name}/c"], [name], name=f"knockout/{name}"))
        available.add(name)

    for target in targets:
        for out in target.output:
            if out and out not in available:
                stand_in(out, target, raw_shape.get(out))
    for node in kept:
        for name in node.input:
            if name not in available:
                target = charged(name)
                if target is None:
                    raise SystemExit(f"group_cost: {node.op_type} {node.name!r} reads {name!r}, made by no node")
                stand_in(name, target, step_shape.get(name))
    order, pending = [], kept + stand_ins
    made = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    while pending:  # topological order
        ready = [n for n in pending if all(i in made for i in n.input)]
        if not ready:
            raise SystemExit(f"group_cost: cannot order {pending[0].op_type} {pending[0].name!r}")
        order += ready
        made |= {o for n in ready for o in n.output}
        pending = [n for n in pending if all(n is not m for m in ready)]
    del graph.node[:]
    graph.node.extend(order)
    return model, removed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("ops", nargs="+")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    artifact = _artifact.load(args.directory)
    raw = load_model(args.directory / TRAINING_MODEL)
    model, removed = knocked_out(artifact.models.step.model, raw, args.ops)
    if not removed:
        raise SystemExit(f"group_cost: no lowered node of {' '.join(args.ops)} in the train step")
    models = dataclasses.replace(artifact.models, step=dataclasses.replace(artifact.models.step, model=model))
    sides = {"full": artifact.trainer(None), "knocked out": artifact.trainer(None, models=models)}
    for trainer in sides.values():
        for _ in range(args.steps):
            trainer.step(artifact.batch)
    full, cost = [], []
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        ms = {name: artifact.median_step_ms(sides[name], args.steps, time.process_time) for name in order}
        full.append(ms["full"] * 1e3)
        cost.append((ms["full"] - ms["knocked out"]) * 1e3)
    print(f"{args.directory.name}: {' '.join(args.ops)} ({removed} lowered nodes) costs {statistics.median(cost):.1f} "
          f"us of a {statistics.median(full):.1f} us step (CPU clock, median of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
