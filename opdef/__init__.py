"""Op definitions parsed from specification documents: schema model, parsers, registry, verification."""

from opdef.binding import Binding
from opdef.errors import (
    LoweringError,
    ModelError,
    OplowerError,
    RuntimeFailure,
    SpecError,
    VerificationError,
)
from opdef.parse import detect_dialect, parse_spec, parse_spec_text
from opdef.registry import Registry, load_schemas
from opdef.schema import Argument, Attribute, Constraint, OpSchema, TypeRule

__all__ = [
    "Argument", "Attribute", "Binding", "Constraint", "LoweringError", "ModelError", "OpSchema",
    "OplowerError", "Registry", "RuntimeFailure", "SpecError", "TypeRule", "VerificationError",
    "detect_dialect", "load_schemas", "parse_spec", "parse_spec_text",
]

from opdef.model_verify import InvalidNodes, verify_model  # noqa: E402
from opdef.node import NodeInference, TensorType  # noqa: E402
from opdef.onnx_defs import register_onnx_schemas  # noqa: E402
from opdef.verify import infer_node  # noqa: E402

__all__ += ["InvalidNodes", "NodeInference", "TensorType", "infer_node", "register_onnx_schemas", "verify_model"]
