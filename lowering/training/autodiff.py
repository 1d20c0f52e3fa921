"""Reverse-mode differentiation of a forward graph, one gradient rule per forward op.

Only the part of the graph between a trainable parameter and the loss is differentiated: a value *depends*
on the parameters when a differentiable input of its producer does; a node is *on the path* when one of its
outputs carries a gradient back from the loss and one of its differentiable inputs depends on a parameter.
A node on the path without a gradient rule is an error naming the op, the node and a parameter that needs
it. Gradients reaching one value from several consumers are summed (``Sum``); the gradient of parameter
``p`` is named ``p_grad``, as onnxruntime-training names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from lowering.builder import outer_reads
from lowering.training.gradients import NO_GRADIENT, rule_for
from lowering.training.gradients.context import FLOAT_TYPES, ForwardContext, GradientContext, GradientError


@dataclass
class GradientGraph:
    forward: list[onnx.NodeProto]         # the forward nodes as prepared for training
    backward: list[onnx.NodeProto]        # the gradient nodes, in execution order
    gradients: dict[str, str]             # parameter -> its gradient's value name (``<p>_grad``)


def display(node: onnx.NodeProto, index: int) -> str:
    return repr(node.name) if node.name else f"#{index} (output {node.output[0]!r})" if node.output else f"#{index}"


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def prepare_forward(nodes: Sequence[onnx.NodeProto], f: ForwardContext, *, eval_model: bool = False,
                    keep: frozenset[str] = frozenset()) -> list[onnx.NodeProto]:
    """Each node through its rule's ``prepare`` (training) or ``eval_form`` (eval model); nodes named in
    ``keep`` stay as they are."""
    out: list[onnx.NodeProto] = []
    for node in nodes:
        rule = rule_for(node.domain, node.op_type)
        hook = None if rule is None or node.name in keep else rule.eval_form if eval_model else rule.prepare
        replaced = hook(node, f) if hook is not None else None
        out.extend([node] if replaced is None else replaced)
    return out


def differentiate(nodes: Sequence[onnx.NodeProto], loss: str, params: Sequence[str], f: ForwardContext
                  ) -> GradientGraph:
    """The gradient graph of ``loss`` with respect to ``params`` (the nodes must be in execution order)."""
    params = list(params)
    # which values depend on a parameter, and one parameter each depends on (for the error message)
    origin: dict[str, str] = {p: p for p in params}
    for node in nodes:
        if node.op_type in NO_GRADIENT and node.domain in ("", "ai.onnx"):
            continue
        rule = rule_for(node.domain, node.op_type)
        positions = rule.differentiable if rule is not None else range(len(node.input))
        source = next((origin[node.input[i]] for i in positions
                       if i < len(node.input) and node.input[i] in origin), None)
        if source is None and _has_subgraph(node):
            source = next((origin[n] for a in node.attribute for g in
                           ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))
                           for n in outer_reads(g) if n in origin), None)
        if source is None:
            continue
        for out in node.output:
            if out and (f.elem_type(out) in FLOAT_TYPES or f.elem_type(out) is None):
                origin.setdefault(out, source)

    if loss not in origin:
        raise GradientError(f"the loss {loss!r} does not depend on any trainable parameter")

    # walk back from the loss: which nodes are on the path
    wanted = {loss}
    on_path: list[tuple[int, onnx.NodeProto]] = []
    for index in range(len(nodes) - 1, -1, -1):
        node = nodes[index]
        if not any(o in wanted for o in node.output if o):
            continue
        if node.op_type in NO_GRADIENT and node.domain in ("", "ai.onnx"):
            continue
        rule = rule_for(node.domain, node.op_type)
        dependent = [i for i, name in enumerate(node.input) if name in origin]
        if not dependent:
            continue
        if rule is None:
            domain = node.domain or "ai.onnx"
            raise GradientError(
                f"node {display(node, index)}: no gradient rule for {domain}::{node.op_type}, which is on the path "
                f"from parameter {origin[node.input[dependent[0]]]!r} to the loss")
        flowing = [i for i in dependent if i in rule.differentiable]
        if not flowing:
            continue
        on_path.append((index, node))
        wanted.update(node.input[i] for i in flowing)

    missing = [p for p in params if p not in wanted]
    if missing:
        raise GradientError(f"parameter {missing[0]!r} does not reach the loss {loss!r} through differentiable ops"
                            " (freeze it, or leave it out of requires_grad)")

    emitted_before = len(f.nodes)
    # the parameters' gradients are named <p>_grad at the end: reserved, so no rule's fresh name takes one
    reserved = {p: f"{p}_grad" for p in params}
    clash = next((n for n in reserved.values() if n in f.taken), None)
    if clash is not None:
        raise GradientError(f"the model already has a value named {clash!r} (the name of a parameter's gradient)")
    f.taken.update(reserved.values())
    contributions: dict[str, list[str]] = {}
    # the seed: ones of the loss's shape (a scalar for every loss block; a custom loss may be a tensor)
    loss_grad = f.fresh(f"{loss}_grad")
    elem = f.elem_type(loss) or onnx.TensorProto.FLOAT
    shape = f.static_shape(loss)
    if shape is not None:
        f.initializers.append(helper.make_tensor(loss_grad, elem, shape, np.ones(
            shape, helper.tensor_dtype_to_np_dtype(elem)).ravel().tolist()))
    else:
        f.node("ConstantOfShape", [f.node1("Shape", [loss])], [loss_grad],
               value=helper.make_tensor("one", elem, [1], [1]))
    contributions[loss] = [loss_grad]
    summed: dict[str, str | None] = {}

    def total(name: str) -> str | None:
        if name in summed:
            return summed[name]
        parts = contributions.get(name)
        if not parts:
            result = None
        elif len(parts) == 1:
            result = parts[0]
        else:
            result = f.node1("Sum", parts, f.fresh(f"{name}_grad"), hint="accumulate_grad")
            if name in f.types:
                f.types[result] = f.types[name]
        summed[name] = result
        return result

    for index, node in on_path:
        dys = [total(o) if o else None for o in node.output]
        if all(d is None for d in dys):
            continue
        rule = rule_for(node.domain, node.op_type)
        requires = [i in rule.differentiable and name in origin and name in wanted for i, name in enumerate(node.input)]
        ctx = GradientContext(f, node, dys, requires, display(node, index))
        f.scope = f"{node.name or node.output[0]}_Grad"
        try:
            rule.emit(ctx)
        finally:
            f.scope = ""
        for i, name in ctx.dx.items():
            contributions.setdefault(node.input[i], []).append(name)
            # a gradient has its value's type: recorded for the value_info the lowering's shape inference reads
            if name not in f.types and node.input[i] in f.types:
                f.types[name] = f.types[node.input[i]]

    gradients: dict[str, str] = {}
    produced = {o: node for node in f.nodes[emitted_before:] for o in node.output if o}
    renames: dict[str, str] = {}
    for p in params:
        g = total(p)
        if g is None:
            raise GradientError(f"parameter {p!r} gets no gradient from the loss {loss!r}")
        name = reserved[p]
        if g in produced and g not in renames and g not in origin:
            renames[g] = name  # the value a rule made: renamed in place, no Identity node
        else:
            f.node("Identity", [renames.get(g, g)], [name], hint=f"{p}_grad_identity")
        if g in f.types:
            f.types[name] = f.types[g]
        gradients[p] = name
    if renames:
        for node in f.nodes[emitted_before:]:
            for i, v in enumerate(node.input):
                if v in renames:
                    node.input[i] = renames[v]
            for i, v in enumerate(node.output):
                if v in renames:
                    node.output[i] = renames[v]
    backward = f.nodes[emitted_before:]
    del f.nodes[emitted_before:]
    return GradientGraph(list(nodes), backward, gradients)
