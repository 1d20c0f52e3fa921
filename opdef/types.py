"""Element-type vocabulary shared by every dialect (spelling only; no op facts here)."""

from __future__ import annotations

from onnx import TensorProto

# Canonical spelling (oneDNN's) -> ONNX TensorProto element type.
ONNX_ELEM_TYPE: dict[str, int] = {
    "f32": TensorProto.FLOAT,
    "f16": TensorProto.FLOAT16,
    "bf16": TensorProto.BFLOAT16,
    "f64": TensorProto.DOUBLE,
    "s64": TensorProto.INT64,
    "s32": TensorProto.INT32,
    "s16": TensorProto.INT16,
    "s8": TensorProto.INT8,
    "u64": TensorProto.UINT64,
    "u32": TensorProto.UINT32,
    "u16": TensorProto.UINT16,
    "u8": TensorProto.UINT8,
    "boolean": TensorProto.BOOL,
}
SPEC_TYPE_NAME: dict[int, str] = {v: k for k, v in ONNX_ELEM_TYPE.items()}

# Other spellings the dialects use for the same element types.
ALIASES: dict[str, str] = {
    "float32": "f32", "float": "f32", "fp32": "f32",
    "float16": "f16", "half": "f16", "fp16": "f16",
    "bfloat16": "bf16",
    "float64": "f64", "double": "f64", "fp64": "f64",
    "int64": "s64", "int32": "s32", "int16": "s16", "int8": "s8",
    "uint64": "u64", "uint32": "u32", "uint16": "u16", "uint8": "u8",
    "bool": "boolean",
}

# nGraph's element-type classes.
TYPE_CLASSES: dict[str, tuple[str, ...]] = {
    "real": ("f32", "f16", "bf16", "f64"),
    "any": tuple(ONNX_ELEM_TYPE),
}


def normalize_type(name: str) -> str:
    """``FLOAT32`` -> ``f32``, ``seq(float)`` -> ``seq(f32)``; unknown names are returned lower-cased."""
    key = name.strip().strip("`*").lower()
    element = sequence_element(key)
    if element is not None:
        return f"seq({normalize_type(element)})"
    return ALIASES.get(key, key)


def sequence_element(name: str) -> str | None:
    """``seq(f32)`` -> ``f32`` (a sequence of tensors, as onnxruntime's optimizers take); None otherwise."""
    key = name.strip().lower()
    if key.startswith("seq(") and key.endswith(")"):
        return key[4:-1].strip()
    return None


def is_known_type(name: str) -> bool:
    """An element type, or a sequence of tensors of one (``seq(f32)``)."""
    norm = normalize_type(name)
    element = sequence_element(norm)
    return (element if element is not None else norm) in ONNX_ELEM_TYPE


def type_name(elem_type: int) -> str:
    if elem_type in SPEC_TYPE_NAME:
        return SPEC_TYPE_NAME[elem_type]
    if elem_type in TensorProto.DataType.values():
        return TensorProto.DataType.Name(elem_type).lower()
    return f"unknown element type {elem_type}"  # a corrupted or newer model: still say what is there
