"""Gradient rules: the loss blocks' own ops (SoftmaxCrossEntropyLoss)."""

from __future__ import annotations

from lowering.training.gradients.context import GradientContext
from lowering.training.gradients.registry import gradient_rule

MS = "com.microsoft"


def _with_log_prob(node, f):
    """SoftmaxCrossEntropyLoss's gradient reads its log_prob output: name it when the forward node has none."""
    if len(node.output) < 2 or not node.output[1]:
        import onnx  # noqa: PLC0415

        new = onnx.NodeProto()
        new.CopyFrom(node)
        while len(new.output) < 2:
            new.output.append("")
        new.output[1] = f.fresh(f"{node.output[0]}_log_prob")
        return [new]
    return None


@gradient_rule("SoftmaxCrossEntropyLoss", differentiable=(0,), prepare=_with_log_prob)
def softmax_cross_entropy_loss(ctx: GradientContext) -> None:
    inputs = [ctx.dy(0), ctx.y(1), ctx.x(1)]
    if ctx.x(2):
        inputs.append(ctx.x(2))
    attrs = {"reduction": ctx.attr("reduction", b"mean")}
    if ctx.attr("ignore_index") is not None:
        attrs["ignore_index"] = int(ctx.attr("ignore_index"))
    reduction = attrs["reduction"]
    attrs["reduction"] = reduction.decode() if isinstance(reduction, bytes) else reduction
    ctx.set_dx(0, ctx.f.node1("SoftmaxCrossEntropyLossGrad", inputs, domain=MS,
                              output=ctx.f.fresh(f"{ctx.x(0)}_grad"), **attrs))
