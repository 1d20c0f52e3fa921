"""The lowering pass: replace every custom node the registry knows by standard ONNX nodes.

The pass does the matching, verification, placement and cleanup; the rule registered for the node's
``binding.rule`` only emits nodes (:mod:`lowering.rules`). It works on ``onnx.ModelProto``: a rule writes
the custom node's own output names (its intermediates get fresh ones), so nothing needs rewiring; each
graph's node list is rebuilt once, the custom node replaced in place by what its rule emitted, every other
node kept as it was. :func:`lower_model` returns a new ``ModelProto`` (the caller's is never touched);
:class:`LowerCustomOpsPass` wraps the same work as an onnx-ir pass (:mod:`lowering.ir_bridge`).
"""

from __future__ import annotations

import dataclasses
import gc
import operator
from collections import ChainMap, Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from lowering import graphs, ir_bridge
from lowering.builder import NodeBuilder
from lowering.compat import needs_old_runtime_forms, old_runtime_forms, runtime_ir_version
from lowering.loss_forms import shorten_cross_entropy
from lowering.modelio import check_structure
from lowering.rules import LoweringOptions, LoweringRequest, check_portable, check_target, rule_for
from lowering.static_shapes import fold_static_shapes
from opdef import in_place
from opdef.errors import LoweringError, OplowerError
from opdef.graphs import all_nodes, first_output, located_nodes, model_nodes, subgraphs
from opdef.node import NodeInference, TensorType
from opdef.registry import Registry, load_schemas
from opdef.verify import infer_node, tensor_type_to_proto, value_types_of_graph

DEFAULT_OPSET = 17  # declared when a model imports no default-domain opset at all
MIN_OPSET = 12  # ReduceSum & co. as the rules emit them; onnxruntime-training writes opset 12

ModelT = TypeVar("ModelT", onnx.ModelProto, ir.Model)
# a rule's lowering with one of these is never copied: its subgraphs may read outer values by name
_SUBGRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
Types = Mapping[str, TensorType | None]
STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})


@dataclass(frozen=True)
class LeftOp:
    """Nodes of one non-standard op type the pass had no rule for, so they are still in the lowered model."""

    op: str  # "domain::op_type"
    count: int
    first: str  # the first such node: its name (or index and first output) and where it sits
    onnxruntime_runs: bool  # one of plain onnxruntime's own contrib ops (FusedMatMul ...): it runs there only

    def describe(self) -> str:
        runs = ("not standard ONNX: only onnxruntime runs it (one of its contrib ops)" if self.onnxruntime_runs
                else "plain onnxruntime cannot run it")
        return f"{self.count} x {self.op} left without a lowering rule (first: node {self.first}); {runs}"


@dataclass
class LoweringReport:
    """What one run of the pass did: nodes lowered per ``domain::op_type``, node counts (all graphs), and
    ``left``: the non-standard ops still in the lowered model (no rule for them), in order of appearance."""

    lowered: Counter = field(default_factory=Counter)
    nodes_before: int = 0
    nodes_after: int = 0
    left: tuple[LeftOp, ...] = ()

    def summary(self) -> str:
        per_op = ", ".join(f"{n} x {op}" for op, n in sorted(self.lowered.items())) or "no custom nodes"
        left = sum(op.count for op in self.left)
        kept = f"; {left} non-standard node(s) left ({len(self.left)} op type(s))" if left else ""
        return f"lowered {per_op}; nodes {self.nodes_before} -> {self.nodes_after}{kept}"


class LowerCustomOpsPass(InPlacePass):
    """onnx-ir pass: lower every registered custom node, in the main graph, subgraphs and functions.

    ``modified`` is True when at least one node was lowered (or the IR version / opsets had to change).
    After a call, ``self.report`` holds the :class:`LoweringReport`. The model is serialized, lowered as
    a proto and its graph and functions swapped back into the given ``ir.Model``.
    """

    def __init__(self, registry: Registry | None = None, *, onednn_single_output: str = "spec",
                 target: str = "onnxruntime") -> None:
        super().__init__()
        self.registry = registry
        self.options = LoweringOptions(onednn_single_output=onednn_single_output, target=target)
        self.report = LoweringReport()

    def call(self, model: ir.Model) -> PassResult:
        registry = self.registry if self.registry is not None else load_schemas()
        self.report = LoweringReport()
        with _collector_paused():
            proto = ir_bridge.to_proto(model)
            lowered, modified = lower_proto(proto, registry, self.options, self.report)
            if modified:
                ir_bridge.swap_into(model, lowered)
        return PassResult(model, modified)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector: the pass allocates many objects per emitted node and frees
    none, so the collector's generation scans (which grow with the heap) would cost a third of the pass."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def lower_model(model: ModelT, *, registry: Registry | None = None, onednn_single_output: str = "spec",
                target: str = "onnxruntime", strict: bool = False) -> ModelT:
    """Lower every custom node of ``model``: ``onnx.ModelProto`` in, a new ``ModelProto`` out (the input
    is not modified); ``onnx_ir.Model`` in, the same ``onnx_ir.Model`` out, lowered in place. ``target``:
    "onnxruntime" (tuned for its CPU provider) or "portable" (ops any conforming runtime runs with runtime
    tensors as every data input; see lowering.rules.TARGETS). Non-standard ops without a lowering rule stay
    as they are (see :class:`LoweringReport` ``left``); ``strict=True`` raises :class:`LeftOpsError` instead."""
    return lower_model_with_report(model, registry=registry, onednn_single_output=onednn_single_output,
                                   target=target, strict=strict)[0]


def lower_model_with_report(model: ModelT, *, registry: Registry | None = None, onednn_single_output: str = "spec",
                            target: str = "onnxruntime", strict: bool = False) -> tuple[ModelT, LoweringReport]:
    """:func:`lower_model` and the :class:`LoweringReport`. With ``strict``, a model that would keep
    non-standard ops raises :class:`LeftOpsError` (an ``onnx_ir.Model`` is then left unmodified)."""
    lowering_pass = LowerCustomOpsPass(registry, onednn_single_output=onednn_single_output, target=target)
    registry = registry if registry is not None else load_schemas()
    if isinstance(model, ir.Model):
        if strict:  # lowered as a proto first: a refused model stays as it was
            report = LoweringReport()
            with _collector_paused():
                lowered, modified = lower_proto(ir_bridge.to_proto(model), registry,
                                                lowering_pass.options, report)
            if report.left:
                raise LeftOpsError(report.left)
            if modified:
                ir_bridge.swap_into(model, lowered)
            return model, report
        lowering_pass(model)
        return model, lowering_pass.report
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"lower_model takes an onnx.ModelProto or an onnx_ir.Model, not {type(model).__name__}")
    check_structure(model)  # a broken graph gets a precise ModelError, not a failure halfway through
    report = LoweringReport()
    with _collector_paused():
        lowered, _ = lower_proto(model, registry, lowering_pass.options, report)
    if strict and report.left:
        raise LeftOpsError(report.left)
    return lowered, report


def lower_runnable(model: onnx.ModelProto, source: str, *, target: str = "onnxruntime") -> onnx.ModelProto:
    """Lower ``model`` for ``target`` and refuse what would not run there: any op left without a rule, but for
    onnxruntime's own contrib ops (FusedMatMul ...) on the onnxruntime target. Errors start with ``source``
    (the model's file). ``Shape`` / ``Size`` of statically shaped values become constants
    (:mod:`lowering.static_shapes`): a model run step after step should not recompute what is known. On the
    onnxruntime target a training graph's SoftmaxCrossEntropyLoss is written out in fewer kernels than
    onnxruntime's expansion of its function (:mod:`lowering.loss_forms`, the same bits)."""
    try:
        lowered, report = lower_model_with_report(model, target=target)
    except OplowerError as exc:
        raise LoweringError(f"{source}: {exc}") from None
    refused = [op for op in report.left if target == "portable" or not op.onnxruntime_runs]
    if refused:
        where = "plain onnxruntime" if target != "portable" else "the portable target"
        raise LoweringError(f"{source}: {where} cannot run {', '.join(sorted(op.op for op in refused))} (no "
                            f"lowering rule yet); first: node {refused[0].first} ({refused[0].op})")
    if lowered is model:  # nothing was lowered: the caller's model stays as it is
        lowered = onnx.ModelProto()
        lowered.CopyFrom(model)
    if target == "onnxruntime":  # the forward loss in fewer kernels than onnxruntime's inlined function
        shorten_cross_entropy(lowered)
    fold_static_shapes(lowered)
    return lowered


class LeftOpsError(LoweringError):
    """Strict lowering of a model that would keep non-standard ops (no lowering rule for them)."""

    def __init__(self, left: tuple[LeftOp, ...]) -> None:
        self.left = left
        ops = "; ".join(f"{op.count} x {op.op} (first: node {op.first})" for op in left)
        super().__init__(f"strict: {len(left)} non-standard op type(s) have no lowering rule and would stay: {ops}")


def left_ops(model: onnx.ModelProto) -> tuple[LeftOp, ...]:
    """The non-standard ops of ``model`` (every graph, subgraph and function), per op type in order of first
    appearance; calls of model-local functions are not ops."""
    local = {(f.domain, f.name) for f in model.functions}
    found: dict[str, list] = {}
    for node, index, where in located_nodes(model, _node_label):
        if node.domain in STANDARD_DOMAINS or (node.domain, node.op_type) in local:
            continue
        key = f"{node.domain}::{node.op_type}"
        entry = found.get(key)
        if entry is None:
            first = f"'{_node_label(node, index)}'" + (f" {where}" if where else "")
            found[key] = [node.domain, node.op_type, 1, first]
        else:
            entry[2] += 1
    if not found:
        return ()
    from runtime.session import onnxruntime_runs  # onnxruntime is imported only when something is left

    return tuple(LeftOp(key, count, first, onnxruntime_runs(domain, op_type))
                 for key, (domain, op_type, count, first) in found.items())


def lower_proto(model: onnx.ModelProto, registry: Registry, options: LoweringOptions,
                report: LoweringReport) -> tuple[onnx.ModelProto, bool]:
    """The pass itself: a lowered copy of ``model`` (never modified) and whether anything changed; the
    ops it leaves go into ``report.left``."""
    lowered, modified = _Lowering(model, registry, options, report).run()
    report.left = left_ops(lowered)
    return lowered, modified


@dataclass
class _Scope:
    """One graph being lowered: its value types (outer scopes' visible), what its tree reads, its opset."""

    graph: onnx.GraphProto | onnx.FunctionProto
    types: ChainMap | dict  # value name -> TensorType; lowered outputs are added as they appear
    reads: set[str]  # names consumed anywhere in the tree (main graph or function) the graph belongs to
    root: _Root
    constants: dict[tuple, str] = field(default_factory=dict)  # the graph's shared Constant nodes by value
    constant_names: set[str] = field(default_factory=set)  # their value names
    # lowering key -> what its rule emitted here: a _Replay, or where the first such node's nodes are in
    # ``graph.node`` until a second node with the key makes it worth a _Replay
    replays: dict[tuple, _Replay | tuple] = field(default_factory=dict)
    outputs: frozenset[str] = field(init=False)  # the graph's (function's) output names

    def __post_init__(self) -> None:
        outputs = self.graph.output
        self.outputs = frozenset(o if isinstance(o, str) else o.name for o in outputs)


@dataclass(frozen=True)
class _Replay:
    """What a rule emitted for one node, to emit again for a later node of the same graph with the same
    lowering key (op, attributes, argument types and sharing, wanted outputs, outputs that are graph
    outputs): the rule's output depends on nothing else (lowering.rules.Rule), so the nodes are copied and
    only the value and node names change. A lowering with subgraphs is never recorded.

    ``nodes`` holds the emitted nodes without their inputs, outputs and name; ``wiring`` has, per node, the
    indices of its inputs, outputs and name in a table made per copy: the custom node's inputs + outputs,
    then one fresh name per ``hints`` entry, then ``kept`` (the graph's shared constants, ""). The graph's
    shared Constant nodes are not among ``nodes``: they exist already.
    """

    nodes: tuple[onnx.NodeProto, ...]
    wiring: tuple[tuple[Callable[[list[str]], tuple], Callable[[list[str]], tuple], int], ...]
    hints: tuple[str, ...]
    kept: tuple[str, ...]


@dataclass
class _Root:
    """The main graph or one model-local function: where opsets are imported."""

    opset_import: object  # the repeated OperatorSetIdProto field
    where: str  # "the model" | "function 'name'"
    in_function: bool
    opset: int | None = None


class _Lowering:
    """One run of the pass over one model (a copy of it)."""

    def __init__(self, source: onnx.ModelProto, registry: Registry, options: LoweringOptions,
                 report: LoweringReport) -> None:
        self.source = source
        self.model = onnx.ModelProto()
        self.model.CopyFrom(source)
        self.registry = registry
        self.options = options
        self.report = report
        self._inferred: dict[str, TensorType] | None = None
        self._taken: set[str] = set()
        self._taken_prefixes: set[str] = set()  # what comes before the last "/" of each name in the model
        self._name_index: dict[str, int] = {}  # a free prefix -> the last number its names were given
        self._functions = {graphs.function_key(f) for f in self.model.functions}
        self._call_sites: dict[graphs.FunctionKey, list[tuple[TensorType | None, ...]]] = {}
        self._added = 0
        self._inferences: dict[tuple, tuple[NodeInference, tuple[str, ...]]] = {}
        # default-domain training ops (MaxPoolGrad ...) exist from an opset on: the model's decides
        self._default_opset = graphs.default_opset(self.model.opset_import)

    def _is_target(self, node: onnx.NodeProto) -> bool:
        if not node.domain and self._functions and graphs.call_key(node) in self._functions:
            return False  # a call of a model-local function that lives in the default domain
        return self.registry.handles(node.domain, node.op_type, self._default_opset)

    def run(self) -> tuple[onnx.ModelProto, bool]:
        model = self.model
        modified = graphs.merge_opsets(model.opset_import)
        for function in model.functions:
            modified |= graphs.merge_opsets(function.opset_import)
        if graphs.default_opset(model.opset_import) is None:
            model.opset_import.add(domain="", version=DEFAULT_OPSET)
            modified = True
        count = targets = 0
        for node in model_nodes(model):
            count += 1
            targets += self._is_target(node)
        self.report.nodes_before = self.report.nodes_after = count
        if targets:
            main = _Root(model.opset_import, "the model", in_function=False)
            self._opset(main)
            self._taken = graphs.names_in_use(model)
            self._taken_prefixes = {name.rpartition("/")[0] for name in self._taken if "/" in name}
            used = self._graph(_Scope(model.graph, value_types_of_graph(model.graph),
                                      graphs.names_read(model.graph), main))
            for function in graphs.functions_callers_first(model):
                declared = value_types_of_graph(function)
                key = graphs.function_key(function)
                declared.update(graphs.call_site_input_types(function, self._call_sites.get(key, ()), declared))
                root = _Root(function.opset_import, f"function {function.name!r}", in_function=True,
                             opset=None)
                function_used = self._graph(_Scope(function, declared, graphs.names_read(function), root))
                graphs.drop_opsets(function.opset_import, self.registry.domains - function_used)
                used |= function_used
            graphs.drop_opsets(model.opset_import, self.registry.domains - used)
            modified = True
            self.report.nodes_after = count + self._added
        versions = graphs.opset_versions(model.opset_import)
        ir_version = runtime_ir_version(model.ir_version, versions)
        if ir_version != model.ir_version:
            model.ir_version = ir_version
            modified = True
        if needs_old_runtime_forms():  # onnxruntime 1.23 (Python 3.10): forms it runs as ONNX defines them
            modified |= old_runtime_forms(model)
        return model, modified

    def _opset(self, root: _Root) -> int:
        """The root's default opset (imported into a function from the model when it has none), checked."""
        if root.opset is None:
            version = graphs.default_opset(root.opset_import)
            if version is None:
                version = graphs.default_opset(self.model.opset_import)
                root.opset_import.add(domain="", version=version)
            if version < MIN_OPSET:
                raise LoweringError(f"{root.where} imports default opset {version}; lowering needs {MIN_OPSET} "
                                    "or newer (convert it first, e.g. onnx.version_converter.convert_version)")
            root.opset = version
        return root.opset

    # -- one graph -------------------------------------------------------------------------------
    def _graph(self, scope: _Scope) -> set[str]:
        """Lower the custom nodes of ``scope.graph`` and its subgraphs; returns the domains its nodes use."""
        graph = scope.graph
        used: set[str] = set()
        if not any(self._is_target(node) for node in graph.node):
            for node in graph.node:
                used.add(node.domain)
                self._visit(node, scope, used)
            return used
        originals = list(graph.node)
        del graph.node[:]  # rebuilt once: untouched nodes as they were, custom nodes replaced in place
        for node in originals:
            if self._is_target(node):
                self._lower_node(node, scope)
                used.add("")
            else:
                graph.node.append(node)
                used.add(node.domain)
                self._visit(graph.node[-1], scope, used)
        return used

    def _visit(self, node: onnx.NodeProto, scope: _Scope, used: set[str]) -> None:
        """A node that stays: note the argument types of a function call, lower inside its subgraphs."""
        key = graphs.call_key(node)
        if key in self._functions:
            types = scope.types
            self._call_sites.setdefault(key, []).append(tuple(types.get(a) if a else None for a in node.input))
        if node.attribute:
            for sub in subgraphs(node):
                types = ChainMap(value_types_of_graph(sub), scope.types)
                used |= self._graph(_Scope(sub, types, scope.reads, scope.root))

    # -- one node --------------------------------------------------------------------------------
    def _lower_node(self, node: onnx.NodeProto, scope: _Scope) -> None:
        exposed, joins = frozenset(), []
        if scope.graph is self.model.graph:  # in-place updates become main-graph outputs (opdef.in_place)
            node, exposed, joins = in_place.expose(node, self.registry, scope.graph, self._taken, scope.types)
        inference, verified_names, key = self._infer(node, self._value_types(node, scope))
        wanted = frozenset(name for name in node.output if name in scope.reads) | exposed
        graph_outputs = frozenset(name for name in node.output if name in scope.outputs) | exposed
        # the options (target included) are part of the key: what a rule emits depends on them
        replay_key = (key, self.options, tuple(name in wanted for name in node.output),
                      tuple(map(graph_outputs.__contains__, node.output)))
        out = scope.graph.node
        prefix = node.name or node.op_type
        # a prefix no model name starts with ("<prefix>/...") is numbered on across nodes, never looked up
        prefix_free = prefix not in self._taken_prefixes
        builder = NodeBuilder(self._opset(scope.root), prefix, self._taken.__contains__, into=out,
                              constants=scope.constants, prefix_free=prefix_free,
                              first_index=self._name_index.get(prefix, 0) if prefix_free else 0)
        replay = scope.replays.get(replay_key)
        if replay is not None:
            if type(replay) is tuple:  # the second node with this key: record the first one's lowering
                first, first_prefix, start, count, new_constants = replay
                replay = scope.replays[replay_key] = _recorded(first, first_prefix, out[start:start + count],
                                                               new_constants, scope.constant_names)
            emitted = _replay(replay, node, builder, out)
        else:
            start = len(out)
            if verified_names is not None:
                inference = _renamed(inference, verified_names, node)
            request = LoweringRequest(inference, wanted, self.options, graph_outputs)
            check_target(inference.binding.rule, request)
            rule_for(inference.binding.rule)(builder, request)
            check_portable(request, (n.op_type for top in builder.nodes  # Loop / If bodies too
                                     for n in (top, *(m for g in subgraphs(top) for m in all_nodes(g)))))
            live, produced = _checked_live(node, builder, wanted, scope.constant_names)
            dead = [i for i in range(len(builder.nodes)) if i not in live]
            for i in reversed(dead):
                del out[start + i]
            new_constants = set()
            for name, constant in builder.new_constants.items():
                if name in produced:
                    scope.constant_names.add(name)
                    new_constants.add(name)
                else:  # a Constant nobody here reads is not there for later nodes either
                    del scope.constants[constant]
            emitted = len(live)
            if not any(a.type in _SUBGRAPH_ATTRIBUTES for n in out[start:] for a in n.attribute):
                scope.replays[replay_key] = (node, prefix, start, emitted, new_constants)
        if prefix_free:
            self._name_index[prefix] = builder.last_index
        else:
            self._taken |= builder.used_names
        for produced, exposed_name in joins:
            out.add(op_type="Identity", input=[produced], output=[exposed_name], name=builder.fresh("in_place"))
            emitted += 1
        self._added += emitted - 1
        self._note_output_types(node, inference.output_types, wanted, scope)
        self.report.lowered[f"{node.domain or 'ai.onnx'}::{node.op_type}"] += 1

    def _infer(self, node: onnx.NodeProto, types: Types) -> tuple[NodeInference, tuple[str, ...] | None, tuple]:
        """:func:`infer_node`, once per distinct node signature: verification depends on the op, the
        attributes, which arguments are given (and which share a value) and their types, never on the value
        names. (Only successes are kept: an error names its own node.)

        Returns the inference, the names it was made with (None: this node's own; else :func:`_renamed`
        turns it into this node's) and the signature."""
        inputs, outputs = tuple(node.input), tuple(node.output)
        first: dict[str, int] = {}
        sharing = tuple(first.setdefault(name, len(first)) if name else -1 for name in inputs + outputs)
        key = (node.domain, node.op_type, len(inputs), sharing, tuple(types.get(name) for name in inputs),
               tuple(types.get(name) for name in outputs), tuple(a.SerializeToString() for a in node.attribute))
        known = self._inferences.get(key)
        if known is None:
            inference = infer_node(node, types, registry=self.registry)
            self._inferences[key] = (inference, inputs + outputs)
            return inference, None, key
        return known[0], known[1], key

    def _value_types(self, node: onnx.NodeProto, scope: _Scope) -> Types:
        types = scope.types
        if scope.root.in_function:
            return types
        missing = [name for name in node.input if name and ((t := types.get(name)) is None or t.elem_type is None)]
        if not missing:
            return types
        inferred = self._inferred_types()
        found = {name: inferred[name] for name in missing if name in inferred}
        return ChainMap(found, types) if found else types

    def _inferred_types(self) -> dict[str, TensorType]:
        """onnx shape inference, once per model, on the model as given (custom ops known to onnx)."""
        if self._inferred is None:
            self._inferred = graphs.inferred_types(self.source, self.registry)
        return self._inferred

    def _note_output_types(self, node: onnx.NodeProto, output_types: tuple[TensorType | None, ...],
                           wanted: frozenset[str], scope: _Scope) -> None:
        """Later nodes see the lowered outputs' inferred types; a graph declares the ones it did not."""
        graph = scope.graph
        local = scope.types.maps[0] if isinstance(scope.types, ChainMap) else scope.types
        for name, t in zip(node.output, output_types, strict=False):
            if t is None or name not in wanted:
                continue
            if name in scope.outputs and graph is self.model.graph:
                _complete_output(graph, name, t)
            if isinstance(graph, onnx.GraphProto) and name not in local and t.elem_type is not None:
                graph.value_info.add(name=name).type.CopyFrom(tensor_type_to_proto(t))
            local[name] = t


def _node_label(node: onnx.NodeProto, index: int) -> str:
    if node.name:
        return node.name
    first = first_output(node)
    return f"#{index} -> {first}" if first else f"#{index}"


def _complete_output(graph: onnx.GraphProto, name: str, t: TensorType) -> None:
    """A main-graph output declared without a type, element type or shape gets the inferred ones: onnx.checker
    requires them there (and the lowered model is checked before it is written)."""
    vi = next((o for o in graph.output if o.name == name), None)
    if vi is None or t.elem_type is None or t.container not in (None, "seq", "optional"):
        return
    kind = vi.type.WhichOneof("value")
    if kind is None:
        vi.type.CopyFrom(tensor_type_to_proto(t))
    elif kind == "tensor_type" and t.container is None:
        tensor = vi.type.tensor_type
        if not tensor.elem_type:
            tensor.elem_type = t.elem_type
        if not tensor.HasField("shape") and t.shape is not None:
            tensor.shape.CopyFrom(tensor_type_to_proto(t).tensor_type.shape)


def _renamed(inference: NodeInference, names: tuple[str, ...], node: onnx.NodeProto) -> NodeInference:
    """An inference made for another node with the same signature (its value ``names``), for ``node``."""
    rename = dict(zip(names, (*node.input, *node.output), strict=True))
    return dataclasses.replace(
        inference, node_name=node.name, inputs=tuple(rename.get(n, n) for n in inference.inputs),
        outputs=tuple(rename.get(n, n) for n in inference.outputs),
        roles={role: rename.get(n, n) for role, n in inference.roles.items()})


def _recorded(node: onnx.NodeProto, prefix: str, emitted, new_constants: set[str], shared: set[str]) -> _Replay:
    """The :class:`_Replay` of what a rule emitted for ``node`` (``emitted``: its live nodes; ``shared``: the
    graph's shared constants, ``new_constants`` those of them it emitted)."""
    io = list(node.input) + list(node.output)
    positions: dict[str, int] = {}
    for i, name in enumerate(io):
        if name:
            positions.setdefault(name, i)
    fresh: dict[str, int] = {}
    kept: dict[str, int] = {}
    start = len(prefix) + 1
    live = [n for n in emitted if not (n.op_type == "Constant" and n.output[0] in new_constants)]
    for n in live:  # number the fresh names first: their slots follow the custom node's arguments
        for name in [*n.input, *n.output, n.name]:
            if name not in positions and name not in shared and name.startswith(prefix + "/"):
                fresh.setdefault(name, len(io) + len(fresh))
    hints = tuple(name[start:].rpartition("_")[0] for name in fresh)

    def slot(name: str) -> int:
        found = positions.get(name)
        if found is None:
            found = fresh.get(name)
        if found is None:  # a shared constant of the graph, or ""
            found = kept.setdefault(name, len(io) + len(fresh) + len(kept))
        return found

    nodes, wiring = [], []
    for n in live:
        bare = onnx.NodeProto()
        bare.CopyFrom(n)
        del bare.input[:], bare.output[:]
        bare.ClearField("name")
        nodes.append(bare)
        wiring.append((_getter([slot(name) for name in n.input]), _getter([slot(name) for name in n.output]),
                       slot(n.name)))
    return _Replay(tuple(nodes), tuple(wiring), hints, tuple(kept))


def _getter(indices: list[int]) -> Callable[[list[str]], tuple]:
    """``lambda table: tuple(table[i] for i in indices)``, at C speed."""
    if not indices:
        return lambda table: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda table: (table[i],)
    return operator.itemgetter(*indices)


def _replay(replay: _Replay, node: onnx.NodeProto, builder: NodeBuilder, out) -> int:
    """Emit ``replay`` for ``node`` into ``out`` with fresh names from ``builder``; returns the node count."""
    table = [*node.input, *node.output, *builder.fresh_names(replay.hints), *replay.kept]
    for template, (inputs, outputs, name) in zip(replay.nodes, replay.wiring, strict=True):
        new = out.add()
        new.CopyFrom(template)
        new.input.extend(inputs(table))
        new.output.extend(outputs(table))
        new.name = table[name]
    return len(replay.nodes)


def _checked_live(node: onnx.NodeProto, builder: NodeBuilder, wanted: frozenset[str],
                  shared: set[str]) -> tuple[set[int], set[str]]:
    """Indices of the emitted nodes that contribute to a wanted output (a rule may emit a little more
    than needed) and the names they produce, after checking that the rule read and wrote only what it may
    (its node's inputs, the graph's ``shared`` constants, what it produced before)."""
    signatures = builder.signatures
    needed = set(wanted)
    live: list[int] = []
    for i in range(len(signatures) - 1, -1, -1):
        inputs, outputs = signatures[i]
        if needed.intersection(outputs):
            live.append(i)
            needed.update(inputs)
    label = f"{node.domain} {node.op_type} '{node.name or '?'}'"
    scope = {name for name in node.input if name}
    produced: set[str] = set()
    for i in reversed(live):
        inputs, outputs = signatures[i]
        for name in inputs:
            if name and name not in produced and name not in scope and name not in shared:
                raise LoweringError(f"{label}: the lowering rule reads {name!r}, which is neither an input "
                                    "of the node nor produced before (a bug in the rule)")
        for name in outputs:
            if name in produced or name in scope:
                raise LoweringError(f"{label}: the lowering rule writes {name!r} twice (a bug in the rule)")
            produced.add(name)
    missing = sorted(wanted - produced)
    if missing:
        raise LoweringError(f"{label}: the lowering rule did not produce {missing} (a bug in the rule)")
    return set(live), produced
