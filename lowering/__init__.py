"""Lowering custom nodes into standard ONNX: the pass, one rule per op, the CLI.

``lower_model(model)`` (``onnx.ModelProto`` -> new ``ModelProto``; ``onnx_ir.Model`` -> the same model,
lowered in place) and ``LowerCustomOpsPass`` (an onnx-ir ``InPlacePass``) are imported on first use, so
the CLI's other commands do not pay for onnx-ir.
"""

from __future__ import annotations

__all__ = ["LeftOp", "LeftOpsError", "LowerCustomOpsPass", "LoweringReport", "left_ops", "lower_model",
           "lower_model_with_report"]


def __getattr__(name: str):
    if name in __all__:
        from lowering import passes

        return getattr(passes, name)
    raise AttributeError(f"module 'lowering' has no attribute {name!r}")
