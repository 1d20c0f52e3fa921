"""The ``portable`` target of batch-norm training backward: the same math and numerics as
:mod:`lowering.rules.batch_norm_backward.emit`, without the forms only onnxruntime's CPU provider is known to
take with runtime tensors.

What ``emit.py`` chooses for onnxruntime and what this module replaces:
- ``sum(dy*xc)`` as a grouped Conv whose kernels are ``xc`` (``_Fast.conv_dot``): Mul + the staged sums;
- ``b*xc + c`` as a depthwise Conv with a computed bias (``_Fast.conv_channels``) or a BatchNormalization with
  computed scale/bias/mean/variance (dx form "affine"): Mul + Add ("muladd");
- ``x - mean`` and ``a*dy`` of small tensors as BatchNormalizations (``_Fast.small_channels``): Sub and Mul;
- the f32 form of small tensors (``_Fast.f32_channels``), all BatchNormalizations: the f64 vectors.
Everything else (casts up and down once, the views, the staged ReduceSum / MatMul-with-ones sums, the
generic path for other layouts) is shared: those ops take runtime tensors in every conforming runtime
(tract refuses BatchNormalization whose parameters are not constants; TensorRT and converters want constant
Conv weights). The pass checks every portable lowering against ``lowering.rules.PORTABLE_OPS``, so a new
onnxruntime-only form in ``emit.py`` that leaks here is an error, not a silently unportable model.
"""

from __future__ import annotations

from lowering.builder import NodeBuilder
from lowering.rules.batch_norm_backward.emit import BatchNormBackwardPlan, _Emitter, _Fast


class _PortableFast(_Fast):
    """``_Fast`` with its onnxruntime-only choices switched off."""

    def __init__(self, e: _Emitter, layout: str) -> None:
        super().__init__(e, layout, dx_form="muladd")

    def dot_pieces(self) -> int | None:
        return None  # no Conv with xc as kernels

    def conv_channels(self) -> int | None:
        return None  # no depthwise Conv with computed weights and bias

    def small_channels(self) -> int | None:
        return None  # no BatchNormalization for x - mean and a*dy: Sub and Mul

    def f32_channels(self) -> int | None:
        return None  # no BatchNormalization with computed scale and bias (emit_f32): the f64 vectors


class _PortableEmitter(_Emitter):
    def fast(self, layout: str) -> _Fast:
        return _PortableFast(self, layout)


def emit_batch_norm_backward_portable(b: NodeBuilder, plan: BatchNormBackwardPlan) -> None:
    """Emit nodes into ``b`` computing the requested outputs of ``plan`` with portable ops only."""
    _PortableEmitter(b, plan).emit()
