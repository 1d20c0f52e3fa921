"""Lowering rule for ``binding.rule == "batch_norm_backward"``: a verified node -> a plan -> emitted nodes.

Every dialect of DESIGN.md section 4 arrives here as a :class:`~opdef.node.NodeInference` whose canonical
roles (src, diff_dst, mean, variance | inv_std, gamma; diff_src, diff_gamma, diff_beta) the binding
resolved. This module only decides the semantics; :mod:`lowering.rules.batch_norm_backward.emit` does the math.
"""

from __future__ import annotations

from lowering.builder import NodeBuilder
from lowering.rules import TARGETS, LoweringRequest, register_rule
from lowering.rules.batch_norm_backward.emit import BatchNormBackwardPlan, emit_batch_norm_backward
from lowering.rules.batch_norm_backward.portable import emit_batch_norm_backward_portable
from opdef.binding import Binding
from opdef.errors import LoweringError
from opdef.node import NodeInference, TensorType


@register_rule("batch_norm_backward", targets=TARGETS)
def lower_batch_norm_backward(builder: NodeBuilder, request: LoweringRequest) -> None:
    """Emit standard ONNX for one batch-norm training backward node.

    - gamma absent: gamma = 1.
    - DirectML (``layout == "stats_broadcast"``): statistics are frozen (``diff_src = gamma*inv*diff_dst``)
      and mean/variance/gamma and the parameter gradients keep the input's rank; the sums run over every
      axis where mean's size is 1.
    - onnxruntime training (``stat_input == "inv_std"``): the statistics input already is
      1/sqrt(variance + epsilon); only the binding differs.
    - oneDNN single-output rule, for schemas whose constraints say diff_gamma and diff_beta come both or
      neither (the oneDNN dialects). When the node requests neither of them:
      ``request.options.onednn_single_output == "spec"`` (default): gamma is ignored, as the spec's note
      says; statistics stay batch statistics.
      ``"upstream"``: gamma is ignored *and* statistics are treated as frozen, as upstream oneDNN's
      implementation does (the spec does not say so).
      "Requested" means the node declares the output, whether or not anything consumes it: an output
      nobody reads is not computed, but it does not change the semantics of the others.

    ``request.options.target``: "onnxruntime" emits the form tuned for its CPU provider (emit.py),
    "portable" the one without Conv/BatchNormalization on computed tensors (portable.py).
    """
    plan = plan_batch_norm_backward(request)
    if plan.diff_src is None and plan.diff_gamma is None and plan.diff_beta is None:
        return  # nothing anybody reads
    if request.options.target == "portable":
        emit_batch_norm_backward_portable(builder, plan)
    else:
        emit_batch_norm_backward(builder, plan)


def plan_batch_norm_backward(request: LoweringRequest) -> BatchNormBackwardPlan:
    node = request.inference
    binding = node.binding
    src_type = _input_type(node, "src")
    stat_type = _input_type(node, "mean")
    single_output = binding.paired_param_grads and not (
        request.requested("diff_gamma") or request.requested("diff_beta"))
    statistics = binding.statistics
    if single_output and request.options.onednn_single_output == "upstream":
        statistics = "frozen"
    channel_last = False
    if binding.layout == "data_format":  # the verifier applied the schema's default and checked the value
        channel_last = str(node.attributes[binding.layout_attribute]).upper() == "NXC"
    return BatchNormBackwardPlan(
        src=_required(request, "src"),
        diff_dst=_required(request, "diff_dst"),
        mean=_required(request, "mean"),
        stat=_required(request, binding.stat_input),
        gamma=None if single_output else request.input("gamma"),
        diff_src=request.output("diff_src"),
        diff_gamma=request.output("diff_gamma"),
        diff_beta=request.output("diff_beta"),
        rank=node.rank,
        channel_axis=_channel_axis(node, binding),
        reduce_axes=node.reduce_axes,
        stats_keep_rank=binding.layout == "stats_broadcast",
        statistics=statistics,
        stat_input=binding.stat_input,
        epsilon=_epsilon(node),
        io_type=_elem_type(node, "src", src_type),
        stat_type=_elem_type(node, "mean", stat_type),
        src_shape=src_type.shape if src_type is not None else None,
        channel_last=channel_last,
        diff_src_internal=request.output("diff_src") not in request.graph_outputs,
    )


def _channel_axis(node: NodeInference, binding: Binding) -> int | None:
    """The verifier's channel axis. Keep-rank statistics (DirectML) need none (the reduce axes decide), but
    their reduce axes must be known: guessing would sum over the wrong axes."""
    if binding.layout == "stats_broadcast" and node.rank is not None and node.reduce_axes is None:
        stats = [node.input_types[i] for i, v in enumerate(node.inputs) if v and v == node.roles.get("mean")]
        shape = stats[0].shape if stats and stats[0] is not None else None
        raise LoweringError(f"{node.domain} {node.op_type} '{node.node_name}': cannot tell which axes the "
                            f"statistics reduce: mean has shape {_dims(shape)}, src {_dims(_src_shape(node))}; "
                            "declare the statistics' shape with 1 on every reduced axis and src's size (or "
                            "symbol) on the others")
    return node.channel_axis


def _dims(shape) -> str:
    return "unknown" if shape is None else "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def _src_shape(node: NodeInference):
    for value, t in zip(node.inputs, node.input_types, strict=False):
        if value and value == node.roles.get("src"):
            return None if t is None else t.shape
    return None


def _required(request: LoweringRequest, role: str) -> str:
    name = request.input(role)
    if name is None:
        node = request.inference
        raise LoweringError(f"{node.domain} {node.op_type} '{node.node_name}': no value bound to role {role!r}")
    return name


def _input_type(node: NodeInference, role: str) -> TensorType | None:
    name = node.roles.get(role)
    if not name or name not in node.inputs:
        return None
    return node.input_types[node.inputs.index(name)]


def _elem_type(node: NodeInference, role: str, t: TensorType | None) -> int:
    if t is None or t.elem_type is None:
        raise LoweringError(f"{node.domain} {node.op_type} '{node.node_name}': the element type of {role} "
                            f"({node.roles.get(role)!r}) is unknown; declare it (graph input or value_info)")
    return t.elem_type


def _epsilon(node: NodeInference) -> float:
    if node.epsilon is not None:
        return float(node.epsilon)
    name = node.binding.arg("epsilon")
    value = node.attributes.get(name) if name else None
    if value is None:
        raise LoweringError(f"{node.domain} {node.op_type} '{node.node_name}': no epsilon")
    return float(value)
