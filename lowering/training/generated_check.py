"""The generated training model's check from the types it declares: every custom node verified, no whole-model
shape inference.

``build_artifacts`` checks each custom node the gradient rules emit against the project's schemas (a failure is
a rule's bug). :func:`opdef.model_verify.verify_model` does that for any model: onnx shape inference of the whole
model (each custom node inferred through the schemas' inference functions), then the per-node verification
(:func:`opdef.verify.infer_node`) of every custom node with the inferred types -- 48-90 ms on ResNet / MobileNetV2
CIFAR, most of it the inference, which types every value of the model to check the few hundred a custom node
reads. The generated training model already declares those types: the forward values' from the generator's own
shape inference, the gradients' as their values' (value_info). :func:`verify_generated` runs the same per-node
verification on them, the same way verify_model's walk does:

- the nodes in graph order, every custom node through ``infer_node`` with the types known so far, its inferred
  output types then known to the nodes after it;
- a custom node's input that the model does not declare (a value a rule computes with standard ops, e.g. the
  ``Shape`` a GatherGrad reads) is typed by onnx's inference of only the standard nodes that compute it
  (``onnx.shape_inference.infer_node_outputs``, initializers and Constant values as its data), as the whole-model
  inference would type it;
- custom nodes whose verification reads the same things (domain, op type, attributes, which inputs and outputs
  are given, the inputs' types and the outputs' declared types) verify alike: each distinct one is verified once
  (``infer_node`` reads nothing else of a node but its name, which only an error message shows, and the first
  failing node raises). MobileNetV2 CIFAR: 317 custom nodes, 111 distinct. The memo lives as long as the process
  does, one per registry (bounded): a second generation in the process -- the same network again, or another
  made of the same layers -- verifies only the signatures it has not seen.

The first invalid node raises its :class:`~opdef.errors.VerificationError`, the error verify_model raises.
A model with model-local functions or subgraphs is no generated training model's shape: the caller verifies
it with verify_model (``None`` comes back).
"""

from __future__ import annotations

import weakref

import onnx

from opdef.node import TensorType
from opdef.registry import Registry, load_schemas
from opdef.verify import infer_node, tensor_type_to_proto, value_type_from_proto, value_types_of_graph

__all__ = ["verify_generated"]

_DATA_LIMIT = 4096  # initializers the whole-model check's inference copy keeps (artifacts._inference_copy)
_MEMO_LIMIT = 8192  # verified signatures kept per registry (a few hundred per network)
_MEMOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Registry -> {signature: output types}

Memo = dict[tuple, tuple[TensorType | None, ...]]

# Every type the check holds is interned -- one object per distinct TensorType, and per distinct declared TypeProto
# -- so that a signature names its types by id (hashing and comparing TensorTypes is Python code: a third of a
# memoised check). Ids are unique while the objects live: the tables keep them, and when they are cleared (too
# big) the epoch moves on and every memo of the older epoch is emptied.
_INTERN_LIMIT = 1 << 16
_interned: dict[TensorType, TensorType] = {}
_from_bytes: dict[bytes, TensorType | None] = {}
_EPOCH = ("epoch",)  # a memo's entry: the epoch its signatures' ids belong to
_epoch = 0


def _intern(t: TensorType | None) -> TensorType | None:
    return None if t is None else _interned.setdefault(t, t)


def verify_generated(model: onnx.ModelProto, registry: Registry | None = None, memo: Memo | None = None
                     ) -> dict[str, TensorType] | None:
    """Verify every custom node of ``model`` (raises the first node's VerificationError); returns the value types
    the check used and inferred, or None when the model needs :func:`opdef.model_verify.verify_model`.
    ``memo``: the verified signatures to reuse and extend (default: the process's, for ``registry``)."""
    global _epoch
    registry = registry if registry is not None else load_schemas()
    if len(_interned) > _INTERN_LIMIT or len(_from_bytes) > _INTERN_LIMIT:
        _interned.clear()
        _from_bytes.clear()
        _epoch += 1
    if memo is None:
        memo = _MEMOS.get(registry)
        if memo is None or len(memo) > _MEMO_LIMIT:
            memo = _MEMOS[registry] = {}
    if memo.get(_EPOCH) != _epoch:
        memo.clear()
        memo[_EPOCH] = _epoch
    graph = model.graph
    nodes = graph.node
    if model.functions:
        return None
    handled: dict[tuple[str, str], bool] = {}  # registry.handles per op (683 nodes, 25 ops: MobileNetV2)
    custom = []
    for n in nodes:
        op = (n.domain, n.op_type)
        known = handled.get(op)
        if known is None:
            known = handled[op] = registry.handles(*op)
        custom.append(known)
        if n.attribute and any(a.type in _GRAPH_KINDS for a in n.attribute):
            return None
    types = _declared_types(graph)
    get = types.get
    cone: set[int] | None = None  # found at the first custom node with an input of unknown type
    data: dict = {}
    for index, node in enumerate(nodes):
        if custom[index]:
            # a signature names each input and output by its type's id: the interned type, True for a given value
            # of unknown type, False for an omitted one ("")
            ins = tuple(map(id, map(get, node.input, map(bool, node.input))))
            if cone is None and _TRUE in ins:  # (ids: ``True in`` would call TensorType.__eq__ on each)
                cone = _undeclared_cone(nodes, custom, types)
                data = _data(graph) if cone else {}
                for i in sorted(c for c in cone if c < index):  # in graph order, as the walk would have
                    _infer_standard(nodes[i], types, data, model)
                ins = tuple(map(id, map(get, node.input, map(bool, node.input))))
            key = (node.domain, node.op_type, ins,
                   tuple(map(id, map(get, node.output, map(bool, node.output)))),
                   tuple(map(_serialize, node.attribute)))
            out = memo.get(key)
            if out is None:
                out = memo[key] = tuple(_intern(t) for t in infer_node(node, types, registry).output_types)
            # the inference's positions are node.output's (one per schema output: more when some are left off)
            for value, t in zip(node.output, out, strict=False):
                if value and t is not None:
                    types[value] = t
        elif cone and index in cone:
            _infer_standard(node, types, data, model)
    return types


_GRAPH_KINDS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
_TRUE = id(True)
_serialize = onnx.AttributeProto.SerializeToString


def _declared_types(graph: onnx.GraphProto) -> dict[str, TensorType | None]:
    """``value_types_of_graph(graph)``, interned; for a graph that declares each name once (a generated training
    model does) each distinct TypeProto is converted once (MobileNetV2 CIFAR: 1,172 declared values, 4.5 -> 1.5
    ms), and once per process."""
    sources = (graph.initializer, graph.sparse_initializer, graph.input, graph.output, graph.value_info)
    names = [x.values.name if isinstance(x, onnx.SparseTensorProto) else x.name for src in sources for x in src]
    if len(set(names)) != len(names):  # merged declarations: opdef's rules
        return {k: _intern(v) for k, v in value_types_of_graph(graph).items()}
    types: dict[str, TensorType | None] = {}
    for t in graph.initializer:
        types[t.name] = _intern(TensorType(t.data_type, tuple(int(d) for d in t.dims)))
    for sparse in graph.sparse_initializer:
        types[sparse.values.name] = _intern(TensorType(sparse.values.data_type, tuple(int(d) for d in sparse.dims)))
    for src in sources[2:]:
        for vi in src:
            key = vi.type.SerializeToString()
            t = _from_bytes[key] if key in _from_bytes else \
                _from_bytes.setdefault(key, _intern(value_type_from_proto(vi.type)))
            if t is not None:
                types[vi.name] = t
    return types


def _undeclared_cone(nodes, custom: list[bool], types: dict) -> set[int]:
    """The standard nodes that compute, through undeclared values only, an undeclared input of a custom node."""
    made = {o for n, c in zip(nodes, custom, strict=True) if c for o in n.output}  # typed by the check itself
    stack = [v for n, c in zip(nodes, custom, strict=True) if c for v in n.input
             if v and v not in types and v not in made]
    cone: set[int] = set()
    if not stack:  # every custom node's inputs declared or made by custom nodes (a CNN's): no producer map
        return cone
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    while stack:
        i = producer.get(stack.pop())
        if i is None or custom[i] or i in cone:
            continue
        cone.add(i)
        stack.extend(v for v in nodes[i].input if v and v not in types)
    return cone


def _data(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    data = {t.name: t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL
            and _count(t.dims) <= _DATA_LIMIT}
    for n in graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.output) == 1:
            for a in n.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    data[n.output[0]] = a.t
    return data


def _count(dims) -> int:
    total = 1
    for d in dims:
        total *= d
    return total


def _infer_standard(node: onnx.NodeProto, types: dict, data: dict, model: onnx.ModelProto) -> None:
    """onnx's inference of one standard node: its outputs the model does not declare, typed."""
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    domain = "" if node.domain == "ai.onnx" else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
        inputs = {v: tensor_type_to_proto(types[v]) for v in node.input if v and types.get(v) is not None}
        given = {v: data[v] for v in node.input if v in data}
        out = onnx.shape_inference.infer_node_outputs(schema, node, inputs, given,
                                                      opset_imports=list(model.opset_import),
                                                      ir_version=model.ir_version)
    except Exception:  # noqa: BLE001 -- as the whole-model inference (strict_mode off): the outputs stay unknown
        return
    for value, tp in out.items():
        t = value_type_from_proto(tp)
        if value not in types and t is not None:
            types[value] = _intern(t)
