"""onnxruntime execution of standard ONNX models (incl. bf16 I/O) and float64 NumPy references.

``runtime.session`` imports onnxruntime; ``runtime.reference`` needs only NumPy. The package exports
the session API lazily so that importing the reference does not load onnxruntime.
"""

__all__ = ["PreparedModel", "check_standard", "find_custom_nodes", "run_model"]


def __getattr__(name: str):
    if name in __all__:
        from runtime import session  # noqa: PLC0415

        return getattr(session, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
