"""Run a standard ONNX model in onnxruntime's CPU provider with NumPy inputs and outputs.

What plain ``InferenceSession.run`` does not do, and this module does (DESIGN.md section 8):
- bf16 (and float8) tensors as ``ml_dtypes`` arrays: fed as OrtValues over a same-width unsigned-integer
  view, read back through IOBinding (``OrtValue.numpy()`` has no NumPy type for them);
- models whose IR version is newer than this onnxruntime reads run from a copy with a lowered IR version
  when the model uses nothing of the newer IR;
- a model that still contains custom nodes (the project's dialect domains, onnxruntime-training ops)
  is refused with an error that says to lower it, before onnxruntime sees it;
- every onnxruntime failure becomes a one-line :class:`RuntimeFailure`; wrong feeds name the input.

:class:`PreparedModel` keeps one session for repeated runs; ``bind`` + ``run_bound`` run into
caller-owned, preallocated output buffers (no allocation, no page faults per call) for benchmarking.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from opdef.errors import ModelError, RuntimeFailure
from opdef.graphs import first_output, located_nodes, model_graphs

STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})
# onnxruntime-training ops that a plain (inference) onnxruntime lacks; used when onnxruntime's own
# schema list is not available.
_TRAINING_ONLY_OPS = frozenset({("com.microsoft", "BatchNormInternal"), ("com.microsoft", "BatchNormalizationGrad")})

# Element types onnxruntime's Python layer cannot turn into NumPy arrays: (ml_dtypes type, storage type).
_BIT_TYPES: dict[int, tuple[np.dtype, np.dtype]] = {
    TensorProto.BFLOAT16: (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)),
    TensorProto.FLOAT8E4M3FN: (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8)),
    TensorProto.FLOAT8E4M3FNUZ: (np.dtype(ml_dtypes.float8_e4m3fnuz), np.dtype(np.uint8)),
    TensorProto.FLOAT8E5M2: (np.dtype(ml_dtypes.float8_e5m2), np.dtype(np.uint8)),
    TensorProto.FLOAT8E5M2FNUZ: (np.dtype(ml_dtypes.float8_e5m2fnuz), np.dtype(np.uint8)),
}
_ORT_TYPE_NAME = {
    "tensor(bfloat16)": TensorProto.BFLOAT16,
    "tensor(float8e4m3fn)": TensorProto.FLOAT8E4M3FN,
    "tensor(float8e4m3fnuz)": TensorProto.FLOAT8E4M3FNUZ,
    "tensor(float8e5m2)": TensorProto.FLOAT8E5M2,
    "tensor(float8e5m2fnuz)": TensorProto.FLOAT8E5M2FNUZ,
}

# The IR version that introduced an element type (onnx.proto's Version comments).
_ELEM_TYPE_IR: dict[int, int] = {}
for _names, _ir in ((("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ"), 9),
                    (("UINT4", "INT4"), 10), (("FLOAT4E2M1",), 11), (("FLOAT8E8M0",), 12),
                    (("UINT2", "INT2"), 13), (("FLOAT6E2M3", "FLOAT6E3M2"), 14)):
    for _name in _names:
        if hasattr(TensorProto, _name):
            _ELEM_TYPE_IR[getattr(TensorProto, _name)] = _ir

_OWN_FUSION_UNRUNNABLE = re.compile(r"Failed to find kernel for com\.microsoft\.\w+\(\d+\) \(node:'[^']*Fusion/")
_IR_REFUSED = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")
_LOWER_HINT = "lower it first (oplower lower, lowering.lower_model)"


# -- custom nodes --------------------------------------------------------------------------------

@dataclass(frozen=True)
class CustomNode:
    """A node plain onnxruntime cannot run: ``where`` says where it sits ("" for the main graph)."""

    name: str
    domain: str
    op_type: str
    where: str = ""

    def describe(self) -> str:
        place = f" {self.where}" if self.where else ""
        return f"'{self.name}' ({self.domain}::{self.op_type}){place}"


def _ort_contrib_ops() -> frozenset[tuple[str, str]] | None:
    """(domain, op_type) of every non-standard op this onnxruntime build has a schema for."""
    try:
        from onnxruntime.capi import _pybind_state as capi  # noqa: PLC0415 (private API; optional)

        return frozenset((s.domain, s.name) for s in capi.get_all_operator_schema()
                         if s.domain not in STANDARD_DOMAINS)
    except Exception:  # pragma: no cover - a build without the schema list
        return None


_CONTRIB_OPS: frozenset[tuple[str, str]] | None = None


def _is_custom(domain: str, op_type: str, local_functions: frozenset[tuple[str, str]]) -> bool:
    global _CONTRIB_OPS
    if domain in STANDARD_DOMAINS or (domain, op_type) in local_functions:
        return False
    if (domain, op_type) in _TRAINING_ONLY_OPS:
        return True
    if _CONTRIB_OPS is None:
        _CONTRIB_OPS = _ort_contrib_ops() or frozenset()
    if _CONTRIB_OPS:
        return (domain, op_type) not in _CONTRIB_OPS
    return domain != "com.microsoft"


def onnxruntime_runs(domain: str, op_type: str) -> bool:
    """Whether plain onnxruntime has a kernel schema for the op (standard ops, its own contrib ops)."""
    return not _is_custom(domain, op_type, frozenset())


def _node_label(node: onnx.NodeProto, index: int) -> str:
    if node.name:
        return node.name
    first = first_output(node)
    return f"#{index} -> {first}" if first else f"#{index}"


def find_custom_nodes(model: onnx.ModelProto) -> list[CustomNode]:
    """Every node (main graph, subgraphs, model-local functions) that plain onnxruntime cannot run."""
    local = frozenset((f.domain, f.name) for f in model.functions)
    return [CustomNode(_node_label(node, index), node.domain, node.op_type, where)
            for node, index, where in located_nodes(model, _node_label)
            if _is_custom(node.domain, node.op_type, local)]


def check_standard(model: onnx.ModelProto) -> None:
    """Raise :class:`RuntimeFailure` naming the first custom node, if the model has any."""
    custom = find_custom_nodes(model)
    if custom:
        more = f" (and {len(custom) - 1} more)" if len(custom) > 1 else ""
        raise RuntimeFailure(f"model contains custom node {custom[0].describe()}{more}: {_LOWER_HINT}")


# -- IR version ------------------------------------------------------------------------------------

def _type_protos(graph: onnx.GraphProto) -> Iterator[onnx.TypeProto]:
    for vi in (*graph.input, *graph.output, *graph.value_info):
        yield vi.type


def _elem_types(tp: onnx.TypeProto) -> Iterator[int]:
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        yield getattr(tp, kind).elem_type
    elif kind in ("sequence_type", "optional_type"):
        yield from _elem_types(getattr(tp, kind).elem_type)
    elif kind == "map_type":
        yield tp.map_type.key_type
        yield from _elem_types(tp.map_type.value_type)


def required_ir_version(model: onnx.ModelProto) -> tuple[int, str]:
    """The lowest IR version the model's content needs, and the feature that needs it."""
    need, why = 3, "the minimum"
    opsets = [o for o in model.opset_import if o.domain in STANDARD_DOMAINS]
    if opsets:
        ir = helper.find_min_ir_version_for(opsets, ignore_unknown=True)
        if ir > need:
            need, why = ir, "its opset imports"
    if any(f.overload for f in model.functions) and need < 10:
        need, why = 10, "function overloads"
    elem_types: set[int] = set()
    for graph in model_graphs(model):
        if not isinstance(graph, onnx.GraphProto):
            continue  # the graphs only: a function body's own nodes and value_info are not looked at
        for tp in _type_protos(graph):
            elem_types.update(_elem_types(tp))
        elem_types.update(t.data_type for t in graph.initializer)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    elem_types.add(attr.t.data_type)
                elif attr.name == "to" and node.op_type == "Cast" and attr.type == onnx.AttributeProto.INT:
                    elem_types.add(attr.i)
    for t in elem_types:
        ir = _ELEM_TYPE_IR.get(t, 0)
        if ir > need:
            need, why = ir, f"element type {TensorProto.DataType.Name(t)}"
    return need, why


def _with_ir_version(model: onnx.ModelProto, ir_version: int) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.ir_version = ir_version
    return copy


# -- onnxruntime errors ----------------------------------------------------------------------------

_ORT_PREFIX = re.compile(r"\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:?\s*")
_SOURCE_LOCATION = re.compile(r"\S+\.(?:cc|cpp|h|hpp):\d+\s+")


def ort_message(exc: BaseException) -> str:
    """onnxruntime's message on one line, without source locations and C++ signatures."""
    text = " ".join(str(exc).split())
    while True:
        m = _SOURCE_LOCATION.search(text)
        if not m:
            break
        end = m.end()
        paren = text.find("(", end)
        # "file.cc:87 virtual OrtValue* ns::Fn(args) [const] message": drop up to the signature's ')'.
        if paren != -1:
            depth, i = 0, paren
            while i < len(text):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                if depth == 0:
                    break
                i += 1
            end = i + 1
            if text.startswith(" const", end):
                end += len(" const")
        text = (text[:m.start()] + text[end:].lstrip()).strip()
    text = _ORT_PREFIX.sub("", text).strip()
    return text or type(exc).__name__


# -- feeds -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ValueSpec:
    """A graph input or output as declared: element type (None: not a tensor) and shape (None: any rank)."""

    name: str
    elem_type: int | None
    shape: tuple[int | str | None, ...] | None
    optional: bool = False  # an input with an initializer (overridable)

    @property
    def dtype(self) -> np.dtype | None:
        return None if self.elem_type is None else np_dtype(self.elem_type)

    def describe(self) -> str:
        dtype = "?" if self.elem_type is None else _dtype_name(self.elem_type)
        shape = "any shape" if self.shape is None else "[" + ",".join(
            "?" if d is None else str(d) for d in self.shape) + "]"
        return f"{dtype} {shape}"


def np_dtype(elem_type: int) -> np.dtype:
    if elem_type in _BIT_TYPES:
        return _BIT_TYPES[elem_type][0]
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def _dtype_name(elem_type: int) -> str:
    try:
        return np_dtype(elem_type).name
    except (KeyError, TypeError, ValueError):
        return TensorProto.DataType.Name(elem_type).lower()


def _value_spec(vi: onnx.ValueInfoProto, optional: bool = False) -> ValueSpec:
    if vi.type.WhichOneof("value") != "tensor_type":
        return ValueSpec(vi.name, None, None, optional)
    tt = vi.type.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
    return ValueSpec(vi.name, tt.elem_type or None, shape, optional)


def model_inputs(model: onnx.ModelProto) -> dict[str, ValueSpec]:
    """The graph inputs as declared; an input with an initializer is optional (it may be overridden)."""
    initializers = {t.name for t in model.graph.initializer}
    return {vi.name: _value_spec(vi, vi.name in initializers) for vi in model.graph.input}


def model_outputs(model: onnx.ModelProto) -> dict[str, ValueSpec]:
    return {vi.name: _value_spec(vi) for vi in model.graph.output}


def _check_feed(spec: ValueSpec, value) -> np.ndarray:
    array = np.asarray(value)
    if spec.elem_type is None:
        return array
    expected = spec.dtype
    if array.dtype != expected:
        raise RuntimeFailure(f"input '{spec.name}' has dtype {array.dtype}; the model expects "
                             f"{spec.describe()}")
    if spec.shape is not None:
        if array.ndim != len(spec.shape):
            raise RuntimeFailure(f"input '{spec.name}' has rank {array.ndim} (shape {list(array.shape)}); "
                                 f"the model expects rank {len(spec.shape)} ({spec.describe()})")
        for axis, (got, want) in enumerate(zip(array.shape, spec.shape, strict=True)):
            if isinstance(want, int) and want > 0 and got != want:
                raise RuntimeFailure(f"input '{spec.name}' has shape {list(array.shape)}; the model expects "
                                     f"{spec.describe()} (dimension {axis} is {got}, expected {want})")
    return np.ascontiguousarray(array)


def _ortvalue(array: np.ndarray, elem_type: int | None) -> ort.OrtValue:
    """An OrtValue over the array's memory (no copy for C-contiguous CPU arrays)."""
    if elem_type in _BIT_TYPES:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(_BIT_TYPES[elem_type][1]), elem_type)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _to_numpy(value: ort.OrtValue) -> np.ndarray:
    """A NumPy copy of an onnxruntime-allocated output (bf16/float8 via a same-width integer buffer)."""
    elem_type = _ORT_TYPE_NAME.get(value.data_type())
    if elem_type is None:
        return np.array(value.numpy(), copy=True)
    dtype, storage = _BIT_TYPES[elem_type]
    out = np.empty(tuple(value.shape()), dtype=storage)
    if out.nbytes:
        ctypes.memmove(out.ctypes.data, value.data_ptr(), out.nbytes)
    return out.view(dtype)


# -- sessions --------------------------------------------------------------------------------------

def _as_model(model: onnx.ModelProto | str | Path | bytes) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        try:
            return onnx.load_from_string(model)
        except Exception as exc:
            raise ModelError(f"not a readable ONNX model ({type(exc).__name__})") from None
    path = Path(model)
    try:
        return onnx.load(str(path))
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except Exception as exc:
        raise ModelError(f"{path}: not a readable ONNX model ({type(exc).__name__})") from None


class PreparedModel:
    """One onnxruntime CPU session over a standard model, for repeated runs.

    ``run(feeds)`` returns fresh arrays. For timing, preallocate outputs once (``allocate_outputs``),
    ``bind(feeds, outputs)`` once, then call ``run_bound()``: onnxruntime writes into the caller's buffers.
    ``allow_spinning=False`` stops onnxruntime's worker threads from busy-waiting after a run
    (DESIGN.md section 7).
    """

    def __init__(self, model: onnx.ModelProto | str | Path | bytes, *, intra_op_threads: int | None = None,
                 allow_spinning: bool = True, optimize: bool = True) -> None:
        proto = _as_model(model)
        check_standard(proto)
        self.inputs: dict[str, ValueSpec] = model_inputs(proto)
        self.outputs: dict[str, ValueSpec] = model_outputs(proto)
        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if intra_op_threads is not None:
            options.intra_op_num_threads = int(intra_op_threads)
        if not allow_spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if not optimize:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.ir_version = proto.ir_version  # the IR version the session was created with
        self._session = self._create(proto, options)
        self._binding: ort.IOBinding | None = None
        self._bound: dict[str, object] = {}

    def _create(self, proto: onnx.ModelProto, options: ort.SessionOptions) -> ort.InferenceSession:
        try:
            return self._session_from(proto, options)
        except RuntimeFailure as failure:
            basic = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
            if _OWN_FUSION_UNRUNNABLE.search(str(failure)) and options.graph_optimization_level not in basic:
                # onnxruntime < 1.24 (the last for Python 3.10 is 1.23) fuses float64 Transpose + MatMul into
                # FusedMatMul (and x*Sigmoid(a*x) into QuickGelu), for which it has no float64 kernel: its own
                # extended fusions off, the graph as given runs
                options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
                return self._create(proto, options)
            m = _IR_REFUSED.search(str(failure))
            if not m:
                raise
        have, supported = int(m.group(1)), int(m.group(2))
        need, why = required_ir_version(proto)
        if need > supported:
            raise RuntimeFailure(f"model IR version {have} is newer than onnxruntime {ort.__version__} reads "
                                 f"(at most {supported}) and cannot be lowered: {why} needs IR {need}") from None
        self.ir_version = supported
        return self._session_from(_with_ir_version(proto, supported), options)

    @staticmethod
    def _session_from(proto: onnx.ModelProto, options: ort.SessionOptions) -> ort.InferenceSession:
        try:
            return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise RuntimeFailure(f"onnxruntime cannot load the model: {ort_message(exc)}") from None

    @property
    def session(self) -> ort.InferenceSession:
        return self._session

    # -- feeds and outputs --
    def _feeds(self, feeds: Mapping[str, object]) -> dict[str, np.ndarray]:
        unknown = [name for name in feeds if name not in self.inputs]
        if unknown:
            raise RuntimeFailure(f"unknown input '{unknown[0]}'; the model's inputs are: "
                                 f"{', '.join(self.inputs) or '(none)'}")
        for spec in self.inputs.values():
            if spec.name not in feeds and not spec.optional:
                raise RuntimeFailure(f"missing input '{spec.name}' ({spec.describe()})")
        return {name: _check_feed(self.inputs[name], value) for name, value in feeds.items()}

    def _output_names(self, output_names: Iterable[str] | None) -> list[str]:
        if output_names is None:
            return list(self.outputs)
        names = list(output_names)
        for name in names:
            if name not in self.outputs:
                raise RuntimeFailure(f"unknown output '{name}'; the model's outputs are: {', '.join(self.outputs)}")
        return names

    def _needs_binding(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> bool:
        """Whether bf16/float8 tensors are involved (onnxruntime's own output types: declared ones may be absent)."""
        if any(a.dtype in _BIT_DTYPES for a in feeds.values()):
            return True
        types = {o.name: o.type for o in self._session.get_outputs()}
        return any(types.get(n) in _ORT_TYPE_NAME for n in names)

    def run(self, feeds: Mapping[str, object], output_names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Run once; returns {output name: array} (bf16 outputs as ml_dtypes.bfloat16 arrays)."""
        arrays = self._feeds(feeds)
        names = self._output_names(output_names)
        if not self._needs_binding(arrays, names):
            try:
                values = self._session.run(names, arrays)
            except Exception as exc:
                raise RuntimeFailure(f"onnxruntime failed to run the model: {ort_message(exc)}") from None
            return dict(zip(names, values, strict=True))
        binding = self._session.io_binding()
        keep = []
        for name, array in arrays.items():
            value = _ortvalue(array, self.inputs[name].elem_type)
            keep.append(value)
            binding.bind_ortvalue_input(name, value)
        for name in names:
            binding.bind_output(name, "cpu")
        self._run_binding(binding)
        return {name: _to_numpy(value) for name, value in zip(names, binding.get_outputs(), strict=True)}

    def _run_binding(self, binding: ort.IOBinding) -> None:
        try:
            self._session.run_with_iobinding(binding)
        except Exception as exc:
            raise RuntimeFailure(f"onnxruntime failed to run the model: {ort_message(exc)}") from None

    def allocate_outputs(self, feeds: Mapping[str, object],
                         output_names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Output buffers of the right dtype and shape for these feeds (runs the model once to learn them)."""
        return {name: np.empty_like(a) for name, a in self.run(feeds, output_names).items()}

    def bind(self, feeds: Mapping[str, object], outputs: Mapping[str, np.ndarray]) -> None:
        """Bind inputs and caller-owned output buffers for :meth:`run_bound` (which writes into them).

        The arrays must stay alive and unmoved until the next ``bind``; outputs not given are not computed.
        """
        arrays = self._feeds(feeds)
        names = self._output_names(outputs)
        binding = self._session.io_binding()
        keep: dict[str, object] = {"inputs": arrays, "outputs": dict(outputs), "values": []}
        for name, array in arrays.items():
            value = _ortvalue(array, self.inputs[name].elem_type)
            keep["values"].append(value)
            binding.bind_ortvalue_input(name, value)
        for name in names:
            buffer, spec = outputs[name], self.outputs[name]
            if not isinstance(buffer, np.ndarray) or not buffer.flags.c_contiguous or not buffer.flags.writeable:
                raise RuntimeFailure(f"output buffer for '{name}' must be a writeable C-contiguous NumPy array")
            if spec.elem_type is not None and buffer.dtype != spec.dtype:
                raise RuntimeFailure(f"output buffer for '{name}' has dtype {buffer.dtype}; the model produces "
                                     f"{spec.describe()}")
            if spec.shape is not None and (buffer.ndim != len(spec.shape) or any(
                    isinstance(w, int) and w > 0 and g != w for g, w in zip(buffer.shape, spec.shape, strict=True))):
                raise RuntimeFailure(f"output buffer for '{name}' has shape {list(buffer.shape)}; the model "
                                     f"produces {spec.describe()}")
            value = _ortvalue(buffer, spec.elem_type)
            keep["values"].append(value)
            binding.bind_ortvalue_output(name, value)
        self._binding, self._bound = binding, keep

    def run_bound(self) -> dict[str, np.ndarray]:
        """Run with the arrays given to :meth:`bind`; returns the (caller-owned) output buffers."""
        if self._binding is None:
            raise RuntimeFailure("run_bound() called before bind()")
        self._run_binding(self._binding)
        return self._bound["outputs"]


_BIT_DTYPES = frozenset(dtype for dtype, _ in _BIT_TYPES.values())


def run_model(model: onnx.ModelProto | str | Path | bytes, feeds: Mapping[str, np.ndarray],
              output_names: Iterable[str] | None = None, *,
              intra_op_threads: int | None = None) -> dict[str, np.ndarray]:
    """Run a standard ONNX model once in onnxruntime's CPU provider; returns {output name: array}."""
    return PreparedModel(model, intra_op_threads=intra_op_threads).run(feeds, output_names)
