"""Reading and writing model files with the project's error contract (clear error, atomic write)."""

from __future__ import annotations

import functools
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx

from opdef.errors import ModelError, OplowerError
from opdef.graphs import node_display_name


def load_model(path: Path | str, load_external_data: bool = True) -> onnx.ModelProto:
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, expected an ONNX model file")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if size == 0:
        raise ModelError(f"{path}: empty file, expected an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=load_external_data)
    except PermissionError:
        raise ModelError(f"{path}: cannot read: permission denied") from None
    except Exception as exc:  # onnx raises DecodeError, ValueError, OSError ... on garbage
        raise ModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'parse failed'})") from None
    if not model.HasField("graph"):
        raise ModelError(f"{path}: not an ONNX model (no graph)")
    check_structure(model, str(path))
    return model


_ELEM_TYPES = frozenset(onnx.TensorProto.DataType.values())


def _mode_for(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def check_structure(model: onnx.ModelProto, source: str = "the model") -> None:
    """The graph-level rules a model must follow before any node is looked at; raises ModelError.

    What ``onnx.checker`` checks about the graph, without its per-node schema checks (the verifier says
    more about custom nodes): IR version known, every name valid UTF-8, single assignment, every value
    defined before use (in scope for subgraphs), graph outputs produced, attribute names unique,
    dimensions not negative; in the main graph, its subgraphs and the model-local functions.
    """
    if model.ir_version > onnx.IR_VERSION:
        raise ModelError(f"{source}: IR version {model.ir_version} is newer than this onnx reads "
                         f"({onnx.IR_VERSION})")
    _check_opsets(model.opset_import, source, "the model")
    for vi in model.graph.input:  # onnx.checker relaxes this for subgraphs only
        if vi.type.WhichOneof("value") is None:
            raise ModelError(f"{source}: the main graph: input '{_text(vi.name)}' declares no type (onnx.checker "
                             "requires an element type or other kind on every graph input)")
    _Structure(source).graph(model.graph, frozenset(), "the main graph")
    for function in model.functions:
        where = f"function {_text(function.domain)}::{_text(function.name)}"
        _check_opsets(function.opset_import, source, where)
        _Structure(source).body(list(function.input), (), function.node, list(function.output), frozenset(), where)
    _check_strings(model, "model", source)


def _check_opsets(opset_import, source: str, where: str) -> None:
    """One version per domain ("" and "ai.onnx" are one domain): two different ones are refused, naming both
    (equal ones are merged by the lowering pass)."""
    seen: dict[str, tuple[str, int]] = {}
    for o in opset_import:
        domain = _text(o.domain)
        key = "" if domain == "ai.onnx" else domain
        first = seen.setdefault(key, (domain, o.version))
        if first[1] != o.version:
            raise ModelError(f"{source}: {where} imports opsets '{first[0]}' {first[1]} and '{domain}' {o.version}: "
                             f"two versions of one domain{' (the default domain)' if key == '' else ''}; keep one")


def _check_strings(model: onnx.ModelProto, where: str, source: str) -> None:
    """Every string field valid UTF-8 (protobuf hands back bytes for one that is not): graph and function
    names, domains, doc strings, metadata ... (tensor contents are not looked at).

    A model with every string valid (the common case) is confirmed by :func:`_strings_valid`; only a model
    with a bad one gets the walk that says which field it is."""
    if not _strings_valid(model):
        _find_bad_string(model, where, source)


def _find_bad_string(message, where: str, source: str) -> None:
    for field, value in message.ListFields():
        repeated = field.is_repeated
        if field.type == field.TYPE_STRING:
            for i, text in enumerate(value if repeated else [value]):
                if not isinstance(text, str):
                    at = f"{where}.{field.name}" + (f"[{i}]" if repeated else "")
                    raise ModelError(f"{source}: {at} is not valid UTF-8: {text!r}")
        elif field.type == field.TYPE_MESSAGE and field.message_type.name != "TensorProto":
            for i, item in enumerate(value if repeated else [value]):
                _find_bad_string(item, f"{where}.{field.name}" + (f"[{i}]" if repeated else ""), source)


@dataclass(frozen=True)
class _StringFields:
    """Where one message type keeps strings: its string fields, and the message fields that may hold more
    (the members of a oneof looked up once per oneof). TensorProto is skipped, as its contents are data."""

    strings: tuple[str, ...]
    string_lists: tuple[str, ...]
    messages: tuple[str, ...]
    message_lists: tuple[str, ...]
    oneofs: tuple[tuple[str, frozenset[str]], ...]  # (oneof name, its members worth descending into)
    types: tuple[str, ...] = ()  # TypeProto fields, checked by _tensor_type_valid (the bulk of a model's strings)


@functools.cache
def _string_fields(descriptor) -> _StringFields:
    strings, string_lists, messages, message_lists, types = [], [], [], [], []
    oneofs: dict[str, set[str]] = {}
    for f in descriptor.fields:
        if f.type == f.TYPE_STRING:
            (string_lists if f.is_repeated else strings).append(f.name)
        elif f.type == f.TYPE_MESSAGE and f.message_type.name != "TensorProto":
            if _TYPE_LAYOUT_KNOWN and f.message_type is _TYPE_PROTO and not f.is_repeated and not f.containing_oneof:
                types.append(f.name)
            elif f.is_repeated:
                message_lists.append(f.name)
            elif f.containing_oneof is not None:
                oneofs.setdefault(f.containing_oneof.name, set()).add(f.name)
            else:
                messages.append(f.name)
    return _StringFields(tuple(strings), tuple(string_lists), tuple(messages), tuple(message_lists),
                         tuple((name, frozenset(members)) for name, members in oneofs.items()), tuple(types))


def _field_names(message_type) -> dict[str, int]:
    return {f.name: f.type for f in message_type.DESCRIPTOR.fields}


_TYPE_PROTO = onnx.TypeProto.DESCRIPTOR
# _tensor_type_valid knows these layouts; another onnx version's gets the generic walk
_TYPE_LAYOUT_KNOWN = (
    {n for n, t in _field_names(onnx.TypeProto).items() if t == 9} == {"denotation"}
    and {f.name for f in _TYPE_PROTO.oneofs_by_name["value"].fields} == set(_field_names(onnx.TypeProto)) - {
        "denotation"}
    and _field_names(onnx.TypeProto.Tensor) == {"elem_type": 5, "shape": 11}
    and _field_names(onnx.TensorShapeProto) == {"dim": 11}
    and _field_names(onnx.TensorShapeProto.Dimension) == {"dim_value": 3, "dim_param": 9, "denotation": 9})


def _tensor_type_valid(tp: onnx.TypeProto) -> bool:
    """:func:`_strings_valid` for a TypeProto, a tensor type's dims read directly."""
    if type(tp.denotation) is not str:
        return False
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        tensor = tp.tensor_type
        if tensor.HasField("shape"):
            for d in tensor.shape.dim:
                if type(d.dim_param) is not str or type(d.denotation) is not str:
                    return False
        return True
    return kind is None or _strings_valid(getattr(tp, kind))


def _strings_valid(message) -> bool:
    """Whether every string :func:`_find_bad_string` looks at is a ``str``, without building field paths."""
    fields = _string_fields(message.DESCRIPTOR)
    for name in fields.strings:
        if type(getattr(message, name)) is not str:
            return False
    for name in fields.string_lists:
        for text in getattr(message, name):
            if type(text) is not str:
                return False
    for name in fields.types:
        if message.HasField(name) and not _tensor_type_valid(getattr(message, name)):
            return False
    for name in fields.messages:
        if message.HasField(name) and not _strings_valid(getattr(message, name)):
            return False
    for oneof, members in fields.oneofs:
        chosen = message.WhichOneof(oneof)
        if chosen in members and not _strings_valid(getattr(message, chosen)):
            return False
    for name in fields.message_lists:
        for item in getattr(message, name):
            if not _strings_valid(item):
                return False
    return True


def _text(name: str | bytes) -> str:
    return name if isinstance(name, str) else repr(name)


class _Structure:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, message: str) -> ModelError:
        return ModelError(f"{self.source}: {message}")

    def name(self, name: str | bytes, what: str) -> str:
        if not isinstance(name, str):  # protobuf hands back bytes for a string field that is not UTF-8
            raise self.fail(f"{what} {name!r} is not valid UTF-8")
        return name

    def graph(self, graph: onnx.GraphProto, outer: frozenset[str], where: str) -> None:
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            self._dims(vi, where)
        inputs = [self.name(vi.name, f"{where}: input") for vi in graph.input]
        inits = [self.name(t.name, f"{where}: initializer") for t in graph.initializer]
        inits += [self.name(t.values.name, f"{where}: sparse initializer") for t in graph.sparse_initializer]
        outputs = [self.name(vi.name, f"{where}: output") for vi in graph.output]
        self.body(inputs, inits, graph.node, outputs, outer, where)

    def body(self, inputs, inits, nodes, outputs, outer: frozenset[str], where: str) -> None:
        defined: set[str] = set()
        for name in inputs:
            if name in defined:
                raise self.fail(f"{where}: input '{name}' is declared twice")
            defined.add(name)
        defined.update(inits)  # an initializer may also be listed as an input (IR < 4 requires it)
        for node in nodes:
            label = self._label(node, where)
            for name in node.input:
                name = self.name(name, f"{label}: input")
                if name and name not in defined and name not in outer:
                    raise self.fail(f"{label} reads '{name}', which is no graph input, initializer or output "
                                    "of an earlier node (missing initializer, or nodes out of order?)")
            seen_attrs: set[str] = set()
            for attr in node.attribute:
                attr_name = self.name(attr.name, f"{label}: attribute")
                if attr_name in seen_attrs:
                    raise self.fail(f"{label} has attribute '{attr_name}' twice")
                seen_attrs.add(attr_name)
                if attr.type == onnx.AttributeProto.GRAPH:
                    self.graph(attr.g, frozenset(outer | defined), f"{label} attribute '{attr_name}'")
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        self.graph(g, frozenset(outer | defined), f"{label} attribute '{attr_name}'")
            for name in node.output:
                name = self.name(name, f"{label}: output")
                if not name:
                    continue
                if name in defined:
                    raise self.fail(f"{label} writes '{name}', which is already defined (a graph input, "
                                    "initializer or another node's output): each value has one producer")
                defined.add(name)
        for name in outputs:
            if name not in defined and name not in outer:
                raise self.fail(f"{where}: output '{name}' is produced by no node")

    def _label(self, node: onnx.NodeProto, where: str) -> str:
        self.name(node.name, f"{where}: node name")
        op = f"{_text(node.domain) or 'ai.onnx'}::{_text(node.op_type)}"
        shown = node_display_name(node)  # an output that is not UTF-8 (bytes) shows as its repr, like _text
        return f"node '{shown}' ({op}) in {where}" if where != "the main graph" else f"node '{shown}' ({op})"

    def _dims(self, vi: onnx.ValueInfoProto, where: str) -> None:
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is not None and tt.elem_type not in _ELEM_TYPES:
            raise self.fail(f"{where}: value '{_text(vi.name)}' has unknown element type {tt.elem_type}")
        if tt is None or not tt.HasField("shape"):
            return
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in tt.shape.dim]
        negative = [d for d in dims if isinstance(d, int) and d < 0]
        if negative:
            raise self.fail(f"{where}: value '{_text(vi.name)}' has negative dimension {negative[0]} in its "
                            f"shape {dims}")


class InFile(OplowerError):
    """An error about one input file: the file name in front of the underlying error's own line."""

    def __init__(self, path: Path | str, error: OplowerError) -> None:
        self.error = error
        super().__init__(f"{path}: {error}")


def write_atomic(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and a rename."""
    _atomic(Path(path), lambda handle: handle.write(data))


def copy_atomic(source: Path, path: Path) -> None:
    """Copy the file ``source`` to ``path`` the same way (a temporary file, then a rename)."""
    def copy(handle) -> None:
        with open(source, "rb") as src:
            shutil.copyfileobj(src, handle, 1 << 20)

    _atomic(Path(path), copy)


def _atomic(path: Path, fill) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise ModelError(f"{path}: directory {directory} does not exist")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, expected a file name to write")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise ModelError(f"{path}: cannot write in {directory}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), _mode_for(path))  # mkstemp makes 0600: a replaced file's mode, else umask
            fill(handle)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ModelError(f"{path}: cannot write: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
