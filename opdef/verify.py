"""Verify a node against its parsed schema and infer its outputs: one function (STYLE.md 4).

:func:`infer_node` runs the generic, schema-driven checks every op gets — arity (optional arguments
omitted at the end or given as ""), attributes (presence, ONNX type against the schema's, allowed
values, defaults applied), element types (per-argument lists, type variables, type constraints, the
supported-combination table, cross-variable rules), ranks the spec states — and then the op's
semantic rule, looked up by ``binding.rule`` in :mod:`opdef.rules`. Unknown element types, shapes,
ranks and symbolic dims pass through; only what is decidable is checked.

Whole models (every custom node, onnx shape inference) are :mod:`opdef.model_verify`'s: it builds on this
module and on :mod:`opdef.onnx_defs`, which in turn uses this one for its inference functions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from opdef.binding import Binding
from opdef.errors import VerificationError
from opdef.graphs import node_display_name
from opdef.node import NodeInference, TensorType
from opdef.registry import Registry, load_schemas
from opdef.rules import rule_for
from opdef.rules.base import (
    Conflict,
    NodeContext,
    RuleResult,
    bound_roles,
    format_elem,
    format_kind,
    format_shape,
    format_type,
    merge_shape,
)
from opdef.schema import Argument, Attribute, OpSchema
from opdef.types import ONNX_ELEM_TYPE, TYPE_CLASSES, normalize_type, sequence_element, type_name

__all__ = ["format_shape", "format_type", "infer_node", "infer_with_schema", "onnx_attribute_kind",
           "tensor_type_from_proto", "tensor_type_to_proto", "value_type_from_proto", "value_types_of_graph"]


# -- one node --------------------------------------------------------------------------------------

def infer_node(node: onnx.NodeProto, value_types: Mapping[str, TensorType | None],
               registry: Registry | None = None) -> NodeInference:
    """Verify ``node`` against its schema and infer its outputs; raises VerificationError.

    ``value_types`` maps ONNX value names to what is known of them; a missing name is simply unknown.
    """
    registry = registry if registry is not None else load_schemas()
    entry = registry.get(node.domain, node.op_type)
    if entry is None:
        domain = "" if node.domain == "ai.onnx" else node.domain
        known = sorted(o for d, o in (e.binding.key for e in registry) if d == domain)
        if domain == "":
            raise VerificationError(node.domain, node.op_type, node_display_name(node),
                                    f"unknown op type {node.op_type!r}: no standard ONNX op and no training op "
                                    f"oplower knows in the default domain ({', '.join(known)})")
        what = f"known in domain {node.domain!r}: {', '.join(known)}" if known else \
            f"no schemas for domain {node.domain!r}"
        raise VerificationError(node.domain, node.op_type, node_display_name(node),
                                f"unknown op type {node.op_type!r} ({what})")
    return infer_with_schema(entry.schema, entry.binding, node, value_types)


def infer_with_schema(schema: OpSchema, binding: Binding | None, node: onnx.NodeProto,
                      value_types: Mapping[str, TensorType | None]) -> NodeInference:
    """:func:`infer_node` for an explicit schema; ``binding=None`` runs the generic checks only."""
    ctx = _bind(schema, binding, node, value_types)
    _resolve_attributes(ctx, node)
    _check_types(ctx)
    _check_ranks(ctx)
    result = None
    if binding is not None:
        # A binding whose rule has no verifier yet gets the generic checks and its roles, nothing more.
        rule = rule_for(binding.rule)
        result = rule(ctx) if rule is not None else RuleResult(roles=bound_roles(ctx))
    _check_declared_outputs(ctx, value_types)
    return NodeInference(
        domain=ctx.domain, op_type=ctx.op_type, node_name=node.name, schema=schema,
        binding=binding,  # type: ignore[arg-type]  (None only in generic-schema use)
        inputs=tuple(ctx.inputs), outputs=tuple(ctx.outputs), attributes=dict(ctx.attributes),
        input_types=tuple(ctx.input_types), output_types=tuple(ctx.output_types),
        type_vars=dict(ctx.type_vars), roles=dict(result.roles) if result else {},
        rank=result.rank if result else None, channel_axis=result.channel_axis if result else None,
        reduce_axes=result.reduce_axes if result else None, epsilon=result.epsilon if result else None,
    )


# -- arity -----------------------------------------------------------------------------------------

def _bind(schema, binding, node, value_types) -> NodeContext:
    name = node_display_name(node)
    domain = binding.domain if binding else schema.domain
    op_type = binding.op_type if binding else schema.name

    def fail(message, constraint=None):
        return VerificationError(domain, op_type, name, message, constraint)

    in_args, inputs = _positions(schema.inputs, list(node.input), "input", fail)
    out_args, outputs = _positions(schema.outputs, list(node.output), "output", fail)
    input_types = [None if v is None else value_types.get(v) for v in inputs]
    return NodeContext(schema=schema, binding=binding, node_name=name, inputs=inputs, outputs=outputs,
                       attributes={}, input_types=input_types, output_types=[None] * len(outputs),
                       input_args=in_args, output_args=out_args)


def _positions(formal: tuple[Argument, ...], given: list[str], what: str, fail):
    """Map the node's values onto the schema's arguments: (argument per position, value name or None)."""
    variadic = bool(formal) and formal[-1].variadic
    fixed = formal[:-1] if variadic else formal
    if len(given) > len(formal) and not variadic:
        signature = ", ".join(a.name + ("?" if a.optional else "") for a in formal)
        raise fail(f"has {len(given)} {what}s; the schema takes at most {len(formal)} ({signature})")

    def missing(i, arg):
        return fail(f"required {what} '{arg.name}' (position {i}) is missing; the node's {what}s are {given}")

    args: list[Argument] = []
    values: list[str | None] = []
    for i, arg in enumerate(fixed):
        value = given[i] if i < len(given) else ""
        if not value and not arg.optional:
            raise missing(i, arg)
        args.append(arg)
        values.append(value or None)
    if variadic:
        tail = given[len(fixed):]
        if not any(tail) and not formal[-1].optional:
            raise missing(len(fixed), formal[-1])
        args += [formal[-1]] * len(tail)
        values += [v or None for v in tail]
    return args, values


# -- attributes ------------------------------------------------------------------------------------

_FLOAT_TYPES = {"f32", "f64", "f16", "bf16", "float", "double"}
_INT_RANGES = {"s64": (-2**63, 2**63 - 1), "s32": (-2**31, 2**31 - 1), "s16": (-2**15, 2**15 - 1),
               "s8": (-128, 127), "u64": (0, 2**64 - 1), "u32": (0, 2**32 - 1), "u16": (0, 2**16 - 1),
               "u8": (0, 255), "boolean": (0, 1), "int": (-2**63, 2**63 - 1)}


def onnx_attribute_kind(schema_type: str) -> int | None:
    """The ONNX AttributeProto type for a schema attribute type ("f32" -> FLOAT, "s64[]" -> INTS); None if unknown."""
    t = schema_type.strip()
    is_list = t.endswith("[]")
    base = normalize_type(t[:-2] if is_list else t)
    if base in _FLOAT_TYPES:
        kind = AttributeProto.FLOATS if is_list else AttributeProto.FLOAT
    elif base in _INT_RANGES:
        kind = AttributeProto.INTS if is_list else AttributeProto.INT
    elif base in ("string", "str"):
        kind = AttributeProto.STRINGS if is_list else AttributeProto.STRING
    else:
        return None
    return kind


def _resolve_attributes(ctx: NodeContext, node: onnx.NodeProto) -> None:
    schema = ctx.schema
    declared = {a.name: a for a in schema.attributes}
    given = {}
    for attr in node.attribute:
        spec = declared.get(attr.name)
        if spec is None:
            known = ", ".join(declared) or "none"
            raise ctx.error(f"unknown attribute '{attr.name}' (the schema's attributes: {known})")
        given[attr.name] = _attribute_value(ctx, spec, attr)
    for spec in schema.attributes:
        if spec.name in given:
            value = given[spec.name]
        elif spec.required:
            raise ctx.error(f"required attribute '{spec.name}' ({spec.type}) is missing")
        elif spec.default is None:
            continue
        else:
            value = spec.default
        ctx.attributes[spec.name] = value


def _attribute_value(ctx: NodeContext, spec: Attribute, attr: AttributeProto) -> Any:
    expected = onnx_attribute_kind(spec.type)
    actual_name = AttributeProto.AttributeType.Name(attr.type)
    if expected is not None and attr.type != expected:
        raise ctx.error(f"attribute '{spec.name}' is {actual_name}; the schema says {spec.type} "
                        f"(ONNX {AttributeProto.AttributeType.Name(expected)})")
    try:
        value = helper.get_attribute_value(attr)
    except Exception as exc:  # onnx raises on UNDEFINED or malformed attributes
        raise ctx.error(f"attribute '{spec.name}' cannot be read ({actual_name}: {exc})") from None
    if attr.type in (AttributeProto.FLOAT, AttributeProto.FLOATS):
        value = [_short_float(v) for v in value] if isinstance(value, list) else _short_float(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    elif isinstance(value, list) and value and isinstance(value[0], bytes):
        value = [v.decode("utf-8", "replace") for v in value]
    base = normalize_type(spec.type.removesuffix("[]"))
    items = value if isinstance(value, list) else [value]
    if base in _INT_RANGES:
        lo, hi = _INT_RANGES[base]
        bad = [v for v in items if not lo <= v <= hi]
        if bad:
            raise ctx.error(f"attribute '{spec.name}' is {value!r}; {spec.type} allows {lo}..{hi}")
        if base == "boolean":
            value = [bool(v) for v in value] if isinstance(value, list) else bool(value)
    if spec.allowed_values and not _allowed(value, spec.allowed_values):
        allowed = ", ".join(str(v) for v in spec.allowed_values)
        raise ctx.error(f"attribute '{spec.name}' is {value!r}; allowed: {allowed}")
    return value


def _short_float(value: float) -> float:
    """ONNX stores float attributes as float32: 1e-5 reads back as 9.99999974e-06. Give the shortest decimal
    that is the same float32 (1e-05), which is what the model's author wrote."""
    return float(str(np.float32(value)))


def _allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    for a in allowed:
        if isinstance(value, float) and isinstance(a, (int, float)) and not isinstance(a, bool):
            if math.isclose(value, a, rel_tol=1e-6):
                return True
        elif value == a or str(value) == str(a):
            return True
    return False


# -- element types ---------------------------------------------------------------------------------

def _elem_types(names: Iterable[str]) -> frozenset[int] | None:
    """Spec type names -> ONNX element types; None when none of them is a known element type."""
    return _elem_types_of(tuple(names))


def _element_of(name: str) -> str:
    """A spec type's element type: ``seq(f32)`` -> ``f32``, ``f32`` -> ``f32`` (normalized)."""
    norm = normalize_type(name)
    element = sequence_element(norm)
    return norm if element is None else element


@functools.lru_cache(maxsize=1024)
def container_of(names: tuple[str, ...]) -> str | None:
    """What an argument with these spec types takes: "seq" when every one is a sequence (``seq(f32)``),
    else None (a tensor)."""
    return "seq" if names and all(sequence_element(normalize_type(n)) is not None for n in names) else None


def _allowed_names(ctx: NodeContext, arg: Argument) -> tuple[str, ...]:
    return tuple(arg.types or ctx.schema.type_constraint_map.get(arg.type_var or "", ()))


def _kind_problem(t: TensorType, wants: str | None, allowed_names: tuple[str, ...]) -> str | None:
    """Why a value of type ``t`` cannot be an argument taking ``wants`` (None: fine)."""
    if t.container == wants:
        return None
    article = "an" if format_kind(t)[0] in "aeiou" else "a"
    needed = "a sequence" if wants == "seq" else "a tensor"
    allowed = ", ".join(normalize_type(n) for n in allowed_names)
    return f"is {article} {format_kind(t)}; {needed} is required" + (f" (allowed: {allowed})" if allowed else "")


@functools.lru_cache(maxsize=4096)  # a schema's few type lists, asked for by every node
def _elem_types_of(names: tuple[str, ...]) -> frozenset[int] | None:
    out = set()
    for name in names:
        norm = _element_of(name)
        for t in TYPE_CLASSES.get(norm, (norm,)):
            if t in ONNX_ELEM_TYPE:
                out.add(ONNX_ELEM_TYPE[t])
    return frozenset(out) or None


def _check_types(ctx: NodeContext) -> None:
    bound: dict[str, tuple[int, str]] = {}  # var -> (element type, the argument it came from)
    present = [(a, t) for a, v, t in zip(ctx.input_args, ctx.inputs, ctx.input_types, strict=True) if v is not None]
    for arg, t in present:
        if t is None:
            continue
        allowed_names = _allowed_names(ctx, arg)
        problem = _kind_problem(t, container_of(allowed_names), allowed_names)
        if problem is not None:
            raise ctx.error(f"{arg.name} {problem}")
        if t.elem_type is None:
            continue
        allowed = _elem_types(allowed_names)
        if allowed is not None and t.elem_type not in allowed:
            via = f" for {arg.type_var}" if arg.type_var and not arg.types else ""
            raise ctx.error(f"{arg.name} has element type {format_elem(t.elem_type)}; allowed{via}: "
                            f"{', '.join(normalize_type(n) for n in allowed_names)}")
        if arg.type_var:
            if arg.type_var in bound and bound[arg.type_var][0] != t.elem_type:
                first_t, first = bound[arg.type_var]
                raise ctx.error(f"{arg.name} has element type {format_elem(t.elem_type)} but {first} has "
                                f"{format_elem(first_t)}; both are {arg.type_var}",
                                ctx.constraint_label([first, arg.name], ("type",)))
            bound.setdefault(arg.type_var, (t.elem_type, arg.name))
    type_vars = {v: t for v, (t, _) in bound.items()}
    type_vars.update(_check_combinations(ctx, type_vars))
    _check_type_rules(ctx, type_vars)
    ctx.type_vars.update(type_vars)
    for i, (arg, value) in enumerate(zip(ctx.output_args, ctx.outputs, strict=True)):
        if value is not None and arg.type_var in type_vars:
            ctx.output_types[i] = TensorType(type_vars[arg.type_var], None, container_of(_allowed_names(ctx, arg)))


def _check_combinations(ctx: NodeContext, type_vars: dict[str, int]) -> dict[str, int]:
    """Check the supported-combination table; returns variables the table decides (f16 -> T2 = f32)."""
    combos = ctx.schema.type_combinations
    if not combos:
        return {}
    table = _combination_table(combos)
    fits = [row for row in table if all(type_vars.get(v, t) == t for v, t in row.items())]
    if not fits:
        got = ", ".join(f"{v}={format_elem(t)}" for v, t in sorted(type_vars.items()))
        supported = "; ".join(", ".join(f"{v}={normalize_type(t)}" for v, t in combo) for combo in combos)
        raise ctx.error(f"unsupported type combination {got}; supported: {supported}")
    decided = {}
    for var in fits[0]:
        values = {row.get(var) for row in fits}
        if var not in type_vars and len(values) == 1 and None not in values:
            decided[var] = values.pop()
    return decided


@functools.lru_cache(maxsize=256)
def _combination_table(combos: tuple[tuple[tuple[str, str], ...], ...]) -> tuple[dict[str, int | None], ...]:
    """The supported-combination table as element types, once per schema (callers only read the rows)."""
    return tuple({v: ONNX_ELEM_TYPE.get(_element_of(t)) for v, t in combo} for combo in combos)


def _check_type_rules(ctx: NodeContext, type_vars: dict[str, int]) -> None:
    for rule in ctx.schema.type_rules:
        var_t, when_t = type_vars.get(rule.var), type_vars.get(rule.when_var)
        if var_t is None or when_t is None:
            continue
        if var_t in (_elem_types(rule.types) or ()) and when_t not in (_elem_types(rule.when_types) or ()):
            text = f" ({rule.text})" if rule.text else ""
            raise ctx.error(f"{rule.var} is {format_elem(var_t)} while {rule.when_var} is {format_elem(when_t)}; "
                            f"{rule.var} may be {'/'.join(rule.types)} only when {rule.when_var} is "
                            f"{'/'.join(rule.when_types)}{text}")


# -- ranks -----------------------------------------------------------------------------------------

def _check_ranks(ctx: NodeContext) -> None:
    for arg, value, t in zip(ctx.input_args, ctx.inputs, ctx.input_types, strict=True):
        if value is None or t is None or t.shape is None:
            continue
        rank = len(t.shape)
        if (arg.min_rank is not None and rank < arg.min_rank) or (arg.max_rank is not None and rank > arg.max_rank):
            lo = arg.min_rank if arg.min_rank is not None else 0
            hi = arg.max_rank if arg.max_rank is not None else "any"
            raise ctx.error(f"{arg.name} has rank {rank} {format_shape(t.shape)}; the spec allows ranks {lo}..{hi}")


def _check_declared_outputs(ctx: NodeContext, value_types: Mapping[str, TensorType | None]) -> None:
    """An output the model already declares must agree with the inference; the result merges both."""
    for i, (arg, value) in enumerate(zip(ctx.output_args, ctx.outputs, strict=True)):
        declared = value_types.get(value) if value is not None else None
        if declared is None:
            continue
        allowed_names = _allowed_names(ctx, arg)
        wants = container_of(allowed_names)
        if declared.container != wants:
            writes = f"a sequence ({', '.join(allowed_names)})" if wants == "seq" else "a tensor"
            raise ctx.error(f"{arg.name} ('{value}') is declared {format_kind(declared)}; the op writes {writes}")
        inferred = ctx.output_types[i] or TensorType(None, None, wants)
        elem = inferred.elem_type
        if declared.elem_type is not None and elem is not None and declared.elem_type != elem:
            raise ctx.error(f"{arg.name} ('{value}') is declared {format_elem(declared.elem_type)}; "
                            f"inferred {format_elem(elem)}")
        try:
            shape = merge_shape(inferred.shape, declared.shape)
        except Conflict:
            raise ctx.error(f"{arg.name} ('{value}') is declared with shape {format_shape(declared.shape)}; "
                            f"inferred {format_shape(inferred.shape)}") from None
        if inferred.shape is not None:
            shape = inferred.shape if shape is None else shape
        ctx.output_types[i] = TensorType(elem if elem is not None else declared.elem_type, shape, wants)


# -- value types from ONNX protos ------------------------------------------------------------------

def tensor_type_from_proto(tp: onnx.TypeProto) -> TensorType | None:
    """A TypeProto's tensor type (dim_value -> int, dim_param -> str, neither -> None); None for non-tensors."""
    if tp.WhichOneof("value") != "tensor_type":
        return None
    tt = tp.tensor_type
    elem = tt.elem_type or None
    if not tt.HasField("shape"):
        return TensorType(elem, None)
    dims = []
    for d in tt.shape.dim:
        kind = d.WhichOneof("value")
        dims.append(d.dim_value if kind == "dim_value" else d.dim_param if kind == "dim_param" else None)
    return TensorType(elem, tuple(dims))


def value_type_from_proto(tp: onnx.TypeProto) -> TensorType | None:
    """A TypeProto as a :class:`TensorType`: tensors as :func:`tensor_type_from_proto`, a sequence or optional
    of tensors with ``container`` "seq" / "optional", any other non-tensor with its spelling; None when
    the type says nothing (no kind set)."""
    kind = tp.WhichOneof("value")
    if kind is None:
        return None
    if kind == "tensor_type":
        return tensor_type_from_proto(tp)
    if kind in ("sequence_type", "optional_type"):
        inner = getattr(tp, kind).elem_type
        if inner.WhichOneof("value") == "tensor_type":
            return TensorType(inner.tensor_type.elem_type or None, None,
                              "seq" if kind == "sequence_type" else "optional")
    return TensorType(None, None, _spelled(tp))


def _spelled(tp: onnx.TypeProto) -> str:
    """``seq(seq(tensor(f32)))``, ``map(s64,tensor(f32))``: a type as ONNX spells it (spec element names)."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        elem = getattr(tp, kind).elem_type
        word = "tensor" if kind == "tensor_type" else "sparse_tensor"
        return f"{word}({type_name(elem) if elem else '?'})"
    if kind == "sequence_type":
        return f"seq({_spelled(tp.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({_spelled(tp.optional_type.elem_type)})"
    if kind == "map_type":
        return f"map({type_name(tp.map_type.key_type)},{_spelled(tp.map_type.value_type)})"
    return kind or "?"


def tensor_type_to_proto(t: TensorType) -> onnx.TypeProto:
    """The TypeProto of a tensor, or of a sequence or optional of tensors (``t.container``)."""
    if t.container in ("seq", "optional"):
        tp = onnx.TypeProto()
        inner = tensor_type_to_proto(TensorType(t.elem_type, t.shape))
        (tp.sequence_type if t.container == "seq" else tp.optional_type).elem_type.CopyFrom(inner)
        return tp
    tp = onnx.TypeProto()
    tp.tensor_type.elem_type = t.elem_type or TensorProto.UNDEFINED
    if t.shape is not None:
        shape = tp.tensor_type.shape
        shape.SetInParent()
        for d in t.shape:
            dim = shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif isinstance(d, str):
                dim.dim_param = d
    return tp


def value_types_of_graph(graph: onnx.GraphProto | onnx.FunctionProto,
                         outer: Mapping[str, TensorType | None] | None = None) -> dict[str, TensorType | None]:
    """Every value type a graph (or function body) declares, on top of the enclosing scope's."""
    types: dict[str, TensorType | None] = dict(outer or {})
    declared = list(graph.value_info)
    if isinstance(graph, onnx.GraphProto):
        declared = list(graph.input) + list(graph.output) + declared
        for init in graph.initializer:
            types[init.name] = TensorType(init.data_type, tuple(int(d) for d in init.dims))
        for sparse in graph.sparse_initializer:
            types[sparse.values.name] = TensorType(sparse.values.data_type, tuple(int(d) for d in sparse.dims))
    for vi in declared:
        t = value_type_from_proto(vi.type)
        if t is not None and (t.container is not None or (types.get(vi.name) or t).container is not None):
            types[vi.name] = t
        elif t is not None:
            try:
                types[vi.name] = TensorType(t.elem_type or (types.get(vi.name) or t).elem_type,
                                            merge_shape(t.shape, (types.get(vi.name) or t).shape))
            except Conflict:
                types[vi.name] = t
    return types


# -- the model -------------------------------------------------------------------------------------
