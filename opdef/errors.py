"""The project's error hierarchy.

Every error a user can provoke with bad input is one of these; the CLI prints ``str(err)`` as a single
line and exits 1. Anything else escaping is a bug in oplower.
"""

from __future__ import annotations


class OplowerError(Exception):
    """Base class of every error oplower raises on bad input."""


class SpecError(OplowerError):
    """A specification document is malformed: names the file, the line and what was expected."""

    def __init__(self, source: str, line: int | None, message: str) -> None:
        self.source = str(source)
        self.line = line
        self.message = message
        where = f"{self.source}:{line}" if line else self.source
        super().__init__(f"{where}: {message}")


class ModelError(OplowerError):
    """A model file or graph cannot be read or is structurally broken (not about one custom node)."""


class VerificationError(OplowerError):
    """A node violates its op schema.

    ``str()`` reads e.g. ``onednn BatchNormTrainingBackward 'bn3': mean has shape [63]; expected [64]
    (channel axis 1 of src [8,64,7,7])``.
    """

    def __init__(self, domain: str, op_type: str, node: str, message: str, constraint: str | None = None):
        self.domain = domain
        self.op_type = op_type
        self.node = node
        self.message = message
        self.constraint = constraint
        label = f" [{constraint}]" if constraint else ""
        super().__init__(f"{domain} {op_type} '{node}': {message}{label}")


class LoweringError(OplowerError):
    """A node could not be lowered (unsupported combination, missing information)."""


class RuntimeFailure(OplowerError):
    """onnxruntime refused or failed to run a model (e.g. it still contains custom nodes)."""
