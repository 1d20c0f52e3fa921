"""What the installed onnxruntime needs of a lowered model: the ONNX IR version it reads (onnx 1.23's helpers write
14; older runtimes stop at 13), and, for onnxruntime 1.23 (the last release for Python 3.10), the forms of three
standard ops it would run wrongly rewritten (``old_runtime_forms``)."""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import helper, numpy_helper

from lowering.static_shapes import ceil_windows

OLDEST_PROBED = 7  # opset 12 needs IR 7


def runtime_ir_version(ir_version: int, opset_imports: dict[str, int]) -> int:
    """The IR version to declare: ``ir_version`` if onnxruntime reads it, else the newest one it reads,
    never below what the opsets need (onnx.helper.find_min_ir_version_for)."""
    if _runtime_accepts(ir_version):
        return ir_version
    ids = [helper.make_opsetid(d, v) for d, v in opset_imports.items()]
    needed = helper.find_min_ir_version_for(ids, ignore_unknown=True)
    for candidate in range(ir_version - 1, OLDEST_PROBED - 1, -1):
        if _runtime_accepts(candidate):
            return max(candidate, needed)
    return ir_version


@functools.cache
def _runtime_accepts(ir_version: int) -> bool:
    """Probe the runtime with a one-node model (no other way to ask it)."""
    if ir_version < OLDEST_PROBED:
        return True
    try:
        import onnxruntime
    except ImportError:  # no runtime: nothing to adapt to
        return True
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = ir_version
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    try:
        onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 -- any refusal means "not this version"
        return False
    return True


# -- forms onnxruntime < 1.24 runs wrongly ------------------------------------------------------------------------
# onnxruntime 1.23 is the last release for Python 3.10. Three forward forms it gets wrong (1.24 and later are
# right) are rewritten, when it is the installed runtime, into standard forms it runs as ONNX defines them:
#   - a Transpose whose perm is the identity: its GemmTransposeFusion folds it into a Gemm as if it swapped the
#     two axes (a gradient Gemm then multiplies the wrong way round: "GEMM: Dimension mismatch");
#   - a Reduce* with noop_with_empty_axes=1 and no axes input: its kernel fails ("Reduction on all axes, output
#     size should be 1"), while an empty axes tensor works;
#   - AveragePool with ceil_mode=1 and count_include_pad=1: a window that runs past the padded input is divided
#     by the whole kernel size instead of the positions it covers (as ONNX's reference, torch and onnxruntime
#     1.24+ do). Where the input's spatial size is known, the pool's output is multiplied by kernel size / covered
#     positions, a constant that is 1 but at those windows. (A Pad and count_include_pad=0 would be exact on every
#     runtime, but 1.23's PadFusion folds such a Pad back into the pool, bug included.) This one is a correction
#     of 1.23's numbers, right for it alone.
FIXED_IN = (1, 24)
_AXES_INPUT_SINCE = {"ReduceSum": 13}  # the other Reduce* take axes as an input from opset 18
_IDENTITY_REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                        "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")


def runtime_version() -> tuple[int, ...] | None:
    """The installed onnxruntime's (major, minor), None without one."""
    try:
        import onnxruntime
    except ImportError:
        return None
    parts = onnxruntime.__version__.split(".")
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts[:2])


def needs_old_runtime_forms() -> bool:
    version = runtime_version()
    return version is not None and version < FIXED_IN


def old_runtime_forms(model: onnx.ModelProto) -> bool:
    """Rewrite, in place, the forms listed above into ones onnxruntime < 1.24 runs as ONNX defines them (main
    graph, subgraphs and local functions); returns whether anything changed. The Transpose and Reduce* rewrites
    mean the same on every runtime; the AveragePool correction is right for onnxruntime 1.23 alone, so the caller
    applies this only for it (``needs_old_runtime_forms``), as ``lower_model`` does."""
    from lowering import graphs

    versions = graphs.opset_versions(model.opset_import)
    taken: set[str] = set()
    counter = [0]

    def fresh(base: str) -> str:
        if not counter[0]:  # the names in use, looked up once a rewrite needs a new one
            taken.update(graphs.names_in_use(model))
        while True:
            counter[0] += 1
            name = f"{base}/runtime_form_{counter[0]}"
            if name not in taken:
                taken.add(name)
                return name

    shapes = _spatial_shapes(model)
    changed = _rewrite_nodes(model.graph, versions.get("", 0), fresh, shapes)
    for function in model.functions:
        opset = graphs.opset_versions(function.opset_import).get("", versions.get("", 0))
        changed |= _rewrite_nodes(function, opset, fresh, {})
    return changed


def _spatial_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | None]]]:
    """The element type and declared or inferred dims of the inputs of the AveragePools the rewrite may touch
    (shape inference runs only where there is such a pool: most models pay nothing)."""
    pools = {n.input[0] for n in _all_nodes(model.graph) if _ceil_counting_pads(n)}
    if not pools:
        return {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 -- without shapes the pools are left as they are
        inferred = model
    graph = inferred.graph
    found: dict[str, tuple[int, list[int | None]]] = {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        t = vi.type.tensor_type
        if vi.name in pools and t.HasField("shape"):
            found[vi.name] = (t.elem_type, [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim])
    return found


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                        list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else []):
                yield from _all_nodes(sub)


def _rewrite_nodes(container, opset: int, fresh, shapes: dict[str, tuple[int, list[int | None]]]) -> bool:
    changed = False
    rewritten: list[onnx.NodeProto] = []
    for node in container.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                        list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else []):
                changed |= _rewrite_nodes(sub, opset, fresh, shapes)
        replacement = _replacement(node, opset, fresh, shapes) if node.domain in ("", "ai.onnx") else None
        if replacement is None:
            rewritten.append(node)
        else:
            rewritten.extend(replacement)
            changed = True
    if changed:
        del container.node[:]
        container.node.extend(rewritten)
    return changed


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _ceil_counting_pads(node: onnx.NodeProto) -> bool:
    """An AveragePool in ceil mode that counts the padding: the form 1.23 divides wrongly."""
    attrs = _attrs(node)
    return node.op_type == "AveragePool" and bool(attrs.get("ceil_mode")) and bool(attrs.get("count_include_pad"))


def _replacement(node: onnx.NodeProto, opset: int, fresh,
                 shapes: dict[str, tuple[int, list[int | None]]]) -> list[onnx.NodeProto] | None:
    if node.op_type == "Transpose":
        perm = _attrs(node).get("perm")
        if perm is not None and list(perm) == list(range(len(perm))):
            return [helper.make_node("Identity", list(node.input), list(node.output), name=node.name)]
        return None
    if node.op_type in _IDENTITY_REDUCTIONS:
        if opset < _AXES_INPUT_SINCE.get(node.op_type, 18) or not _attrs(node).get("noop_with_empty_axes"):
            return None
        if len(node.input) > 1 and node.input[1]:
            return None
        axes = fresh(node.output[0])
        constant = helper.make_node("Constant", [], [axes], name=fresh(node.name or node.output[0]),
                                    value=helper.make_tensor(axes, onnx.TensorProto.INT64, [0], []))
        fixed = onnx.NodeProto()
        fixed.CopyFrom(node)
        del fixed.input[:]
        fixed.input.extend([node.input[0], axes])
        return [constant, fixed]
    if node.op_type == "AveragePool":
        return _average_pool(node, fresh, shapes.get(node.input[0]))
    return None


_POOL_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
               onnx.TensorProto.FLOAT16: np.float16}


def _average_pool(node: onnx.NodeProto, fresh,
                  typed: tuple[int, list[int | None]] | None) -> list[onnx.NodeProto] | None:
    if not _ceil_counting_pads(node) or typed is None:
        return None
    elem, dims = typed
    attrs = _attrs(node)
    auto_pad, kernel, dilations = attrs.get("auto_pad", b"NOTSET"), attrs.get("kernel_shape"), attrs.get("dilations")
    if auto_pad not in (b"NOTSET", b"VALID") or not kernel or (dilations and any(d != 1 for d in dilations)):
        return None
    spatial = len(kernel)
    strides = attrs.get("strides") or [1] * spatial
    pads = (attrs.get("pads") if auto_pad == b"NOTSET" else None) or [0] * (2 * spatial)
    sizes = dims[2:]
    if len(strides) != spatial or len(pads) != 2 * spatial or len(sizes) != spatial or None in sizes \
            or elem not in _POOL_TYPES:
        return None  # unknown sizes (or malformed: onnxruntime says so itself)
    factor = np.ones([1, 1], np.float64)
    for size, begin, end, k, s in zip(sizes, pads[:spatial], pads[spatial:], kernel, strides, strict=True):
        starts = np.arange(ceil_windows(size, begin, end, k, s)[1]) * s - begin
        covered = np.minimum(starts + k, size + end) - starts  # the positions inside the padded input
        factor = np.multiply.outer(factor, k / covered)
    if np.all(factor == 1.0):
        return None  # no window runs past the padded input
    pooled, scale = fresh(node.output[0]), fresh(node.output[0])
    fixed = onnx.NodeProto()
    fixed.CopyFrom(node)
    del fixed.output[:]
    fixed.output.append(pooled)
    return [fixed,
            helper.make_node("Constant", [], [scale], name=fresh(node.name or node.output[0]),
                             value=numpy_helper.from_array(factor.astype(_POOL_TYPES[elem]), scale)),
            helper.make_node("Mul", [pooled, scale], list(node.output), name=fresh(node.name or node.output[0]))]
