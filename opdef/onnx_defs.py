"""Parsed schemas as ``onnx.defs.OpSchema``: onnx.checker and onnx shape inference learn the custom ops.

Each registered schema carries a Python type-and-shape inference function that calls
:func:`opdef.verify.infer_with_schema`, so ``onnx.shape_inference.infer_shapes`` fills in the outputs of
un-lowered nodes and raises :class:`VerificationError` on an invalid one (onnx passes the exception on
to its caller). Pitfalls handled here (DESIGN.md section 8): onnx refuses a second registration of
the same (domain, name, version), so registration is idempotent; the inference function sees an
absent attribute as missing, and the schema's default is applied by the verifier.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator

import onnx
import onnx.defs
from onnx import AttributeProto, TensorProto, helper

from opdef.errors import SpecError, VerificationError
from opdef.registry import Entry, Registry, load_schemas
from opdef.schema import Argument, Attribute
from opdef.types import ONNX_ELEM_TYPE, TYPE_CLASSES, normalize_type, sequence_element
from opdef.verify import infer_with_schema, onnx_attribute_kind, tensor_type_to_proto, value_type_from_proto

__all__ = ["lenient_inference", "register_onnx_schemas", "to_onnx_schema", "unregister_onnx_schemas"]

_Onnx = onnx.defs.OpSchema
# (domain, op_type, version) -> the registry entry the inference function uses
_REGISTERED: dict[tuple[str, str, int], Entry] = {}
_LENIENT: contextvars.ContextVar[bool] = contextvars.ContextVar("oplower_lenient_inference", default=False)


def register_onnx_schemas(registry: Registry | None = None) -> list[onnx.defs.OpSchema]:
    """Register every schema of ``registry`` with onnx (once; again only when its schema changed)."""
    registry = registry if registry is not None else load_schemas()
    _build_reference_schema_table_first()
    out = []
    for entry in registry:
        key = (entry.binding.domain, entry.binding.op_type, onnx_version(entry))
        previous = _REGISTERED.get(key)
        if previous is not None and previous == entry:
            out.append(onnx.defs.get_schema(key[1], key[2], key[0]))
            continue
        schema = to_onnx_schema(entry)
        if previous is not None:
            onnx.defs.deregister_schema(key[1], key[2], key[0])
        try:
            onnx.defs.register_schema(schema)
        except onnx.defs.SchemaError as exc:
            raise SpecError(entry.schema.source or "<schema>", None,
                            f"onnx refused the schema of {key[0]}::{key[1]}: {exc}") from None
        _REGISTERED[key] = entry
        out.append(schema)
    return out


def _build_reference_schema_table_first() -> None:
    """onnx.reference indexes every registered schema by bare name when first imported and refuses two
    domains sharing a name (onednn and ngraph both define BatchNormTrainingBackprop). Importing it before
    registering keeps the reference evaluator usable in the same process."""
    import onnx.reference.op_run  # noqa: F401


def unregister_onnx_schemas() -> None:
    """Remove what :func:`register_onnx_schemas` registered (tests)."""
    for domain, op_type, version in list(_REGISTERED):
        onnx.defs.deregister_schema(op_type, version, domain)
        del _REGISTERED[(domain, op_type, version)]


@contextlib.contextmanager
def lenient_inference() -> Iterator[None]:
    """Within this block an invalid custom node leaves its outputs untyped instead of raising
    (verify_model reports every invalid node itself)."""
    token = _LENIENT.set(True)
    try:
        yield
    finally:
        _LENIENT.reset(token)


# -- building the onnx schema ----------------------------------------------------------------------

def onnx_version(entry: Entry) -> int:
    """The since-version to register: a default-domain op's is the default opset it exists from (its binding's
    ``since_opset``: onnx.checker then refuses it in older models, as onnxruntime does); a custom domain's is
    the document's version."""
    if entry.binding.domain == "" and entry.binding.since_opset is not None:
        return entry.binding.since_opset
    return entry.schema.version


def to_onnx_schema(entry: Entry) -> onnx.defs.OpSchema:
    schema, binding = entry.schema, entry.binding
    constraints: dict[str, list[str]] = {}
    for var, types in schema.type_constraints:
        constraints[var] = _tensor_types(types)

    def formal(arg: Argument) -> onnx.defs.OpSchema.FormalParameter:
        if arg.types:  # per-argument list (DirectML): its own variable unless it is exactly its type var's
            var = arg.type_var if arg.type_var and constraints.get(arg.type_var) == _tensor_types(arg.types) \
                else _fresh_var(f"T_{arg.name}", constraints)
            constraints.setdefault(var, _tensor_types(arg.types))
        elif arg.type_var and arg.type_var in constraints:
            var = arg.type_var
        else:
            var = arg.type_var or _fresh_var(f"T_{arg.name}", constraints)
            constraints.setdefault(var, _tensor_types(TYPE_CLASSES["any"]))
        option = (_Onnx.FormalParameterOption.Variadic if arg.variadic else
                  _Onnx.FormalParameterOption.Optional if arg.optional else _Onnx.FormalParameterOption.Single)
        return _Onnx.FormalParameter(arg.name, var, arg.description, param_option=option,
                                     min_arity=0 if arg.optional else 1)

    inputs = [formal(a) for a in schema.inputs]
    outputs = [formal(a) for a in schema.outputs]
    attributes = [_attribute(entry, a) for a in schema.attributes]
    version = onnx_version(entry)
    onnx_schema = _Onnx(binding.op_type, binding.domain, version, schema.description,
                        inputs=inputs, outputs=outputs, attributes=attributes,
                        type_constraints=[(v, t, "") for v, t in constraints.items()])
    onnx_schema.set_type_and_shape_inference_function(_inference_function(binding.domain, binding.op_type,
                                                                           version))
    return onnx_schema


def _tensor_types(names) -> list[str]:
    out = []
    for name in names:
        norm = normalize_type(name)
        element = sequence_element(norm)
        if element in ONNX_ELEM_TYPE:  # seq(f32): onnx spells it seq(tensor(float))
            s = f"seq(tensor({TensorProto.DataType.Name(ONNX_ELEM_TYPE[element]).lower()}))"
            if s not in out:
                out.append(s)
            continue
        for t in TYPE_CLASSES.get(norm, (norm,)):
            if t in ONNX_ELEM_TYPE:
                s = f"tensor({TensorProto.DataType.Name(ONNX_ELEM_TYPE[t]).lower()})"
                if s not in out:
                    out.append(s)
    return out or [f"tensor({TensorProto.DataType.Name(ONNX_ELEM_TYPE[t]).lower()})" for t in TYPE_CLASSES["any"]]


def _fresh_var(base: str, taken) -> str:
    base = re.sub(r"\W", "_", base)
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


_ATTR_TYPE = {
    AttributeProto.FLOAT: _Onnx.AttrType.FLOAT, AttributeProto.INT: _Onnx.AttrType.INT,
    AttributeProto.STRING: _Onnx.AttrType.STRING, AttributeProto.FLOATS: _Onnx.AttrType.FLOATS,
    AttributeProto.INTS: _Onnx.AttrType.INTS, AttributeProto.STRINGS: _Onnx.AttrType.STRINGS,
}


def _attribute(entry: Entry, a: Attribute) -> onnx.defs.OpSchema.Attribute:
    kind = onnx_attribute_kind(a.type)
    if kind is None:
        raise SpecError(entry.schema.source or "<schema>", None,
                        f"{entry.binding.domain}::{entry.binding.op_type}: attribute {a.name!r} has type "
                        f"{a.type!r}, which has no ONNX attribute type")
    if a.required or a.default is None:
        return _Onnx.Attribute(a.name, _ATTR_TYPE[kind], a.description, required=a.required)
    default = _default_attribute(a.name, kind, a.default)
    return _Onnx.Attribute(a.name, default, a.description)


def _default_attribute(name: str, kind: int, value) -> AttributeProto:
    proto = AttributeProto(name=name, type=kind)
    if kind == AttributeProto.FLOAT:
        proto.f = float(value)
    elif kind == AttributeProto.INT:
        proto.i = int(value)
    elif kind == AttributeProto.STRING:
        proto.s = str(value).encode()
    elif kind == AttributeProto.FLOATS:
        proto.floats.extend(float(v) for v in value)
    elif kind == AttributeProto.INTS:
        proto.ints.extend(int(v) for v in value)
    else:
        proto.strings.extend(str(v).encode() for v in value)
    return proto


# -- the inference function ------------------------------------------------------------------------

_DISPLAY_NAME = re.compile(r"\((.*)\)\s*$")


def _inference_function(domain: str, op_type: str, version: int):
    key = (domain, op_type, version)

    def infer(ctx) -> None:
        entry = _REGISTERED.get(key)
        if entry is None:
            return
        node, value_types = _node_from_context(ctx, entry)
        try:
            inference = infer_with_schema(entry.schema, entry.binding, node, value_types)
        except VerificationError:
            if _LENIENT.get():
                return
            raise
        for i, t in enumerate(inference.output_types):
            if t is not None and t.elem_type is not None and ctx.has_output(i):
                ctx.set_output_type(i, tensor_type_to_proto(t))

    return infer


def _node_from_context(ctx, entry: Entry):
    """A stand-in NodeProto for the verifier: onnx's context gives types and attributes, not value names."""

    inputs, value_types = [], {}
    for i in range(ctx.get_num_inputs()):
        if not ctx.has_input(i):
            inputs.append("")
            continue
        name = f"input:{i}"
        inputs.append(name)
        tp = ctx.get_input_type(i)
        value_types[name] = value_type_from_proto(tp) if tp is not None else None
    outputs = [f"output:{i}" if ctx.has_output(i) else "" for i in range(ctx.get_num_outputs())]
    match = _DISPLAY_NAME.search(ctx.get_display_name() or "")
    node = helper.make_node(entry.binding.op_type, inputs, outputs, name=match.group(1) if match else "",
                            domain=entry.binding.domain)
    for a in entry.schema.attributes:
        proto = ctx.get_attribute(a.name)
        if proto is not None:  # absent: the verifier applies the schema's default
            node.attribute.append(proto)
    return node, value_types
