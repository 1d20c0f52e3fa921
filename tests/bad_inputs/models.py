"""Corrupted models, built from a valid one-node model of a bundled op (or from its bytes).

Each :class:`ModelCase` makes the model file's bytes; ``error`` is the exact class the library
(``load_model`` -> ``verify_model`` -> ``lower_model``) must raise and ``fragments`` what its message must
say: the node's name and the problem. ``error=None`` marks a strange but valid model that must lower.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from lowering.demo.examples import BnCase, build_example
from opdef.errors import LoweringError, ModelError, OplowerError, VerificationError
from opdef.registry import load_schemas

ONEDNN = ("onednn", "BatchNormTrainingBackward")
OPSET_V0 = ("onednn", "BatchNormTrainingBackprop")
NGRAPH = ("ngraph", "BatchNormTrainingBackprop")
DIRECTML = ("directml", "BATCH_NORMALIZATION_GRAD")
MS_GRAD = ("com.microsoft", "BatchNormalizationGrad")
OPS = {"onednn": ONEDNN, "opset_v0": OPSET_V0, "ngraph": NGRAPH, "directml": DIRECTML, "ms": MS_GRAD}


@dataclass(frozen=True)
class ModelCase:
    id: str
    make: Callable[[], bytes]
    error: type[OplowerError] | None
    fragments: tuple[str, ...] = ()


def base(op=ONEDNN, shape=(2, 3, 4, 5), name="bn", **kw) -> onnx.ModelProto:
    """A valid model: one node named ``name``, values named ``<name>.<role>``."""
    return build_example([BnCase(op, tuple(shape), name=name, **kw)], load_schemas()).model


def node_of(model: onnx.ModelProto) -> onnx.NodeProto:
    return model.graph.node[0]


def _edit(op=ONEDNN, **kw):
    """Decorator: the case's bytes are ``fn(model)`` applied to ``base(op, **kw)``."""
    def wrap(fn):
        def make():
            model = base(op, **kw)
            fn(model)
            return model.SerializeToString()
        return make
    return wrap


def _set_attr(model, name, value, attr_type=None):
    node = node_of(model)
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    attr = helper.make_attribute(name, value, attr_type=attr_type)
    node.attribute.append(attr)


CASES: list[ModelCase] = []


def case(id, error, *fragments, op=ONEDNN, **kw):
    def register(fn):
        CASES.append(ModelCase(id, _edit(op, **kw)(fn), error, fragments))
        return fn
    return register


# -- bytes ------------------------------------------------------------------------------------------

def _bytes_case(id, fn, *fragments):
    CASES.append(ModelCase(id, lambda: fn(base().SerializeToString()), ModelError, fragments))


_bytes_case("bytes-truncated-to-1", lambda b: b[:1], "not a readable ONNX model")
_bytes_case("bytes-truncated-to-7", lambda b: b[:7], "not a readable ONNX model")
_bytes_case("bytes-truncated-to-half", lambda b: b[: len(b) // 2], "not a readable ONNX model")
_bytes_case("bytes-last-byte-cut", lambda b: b[:-1], "not a readable ONNX model")
_bytes_case("bytes-text-file", lambda b: b"ir_version: 10\ngraph { }\n", "not a readable ONNX model")
_bytes_case("bytes-zeros", lambda b: bytes(64), "")
_bytes_case("bytes-ff", lambda b: b"\xff" * 64, "not a readable ONNX model")
_bytes_case("bytes-zip", lambda b: b"PK\x03\x04" + bytes(60), "not a readable ONNX model")
_bytes_case("bytes-npy", lambda b: b"\x93NUMPY\x01\x00" + bytes(56), "not a readable ONNX model")
_bytes_case("bytes-bad-utf8-graph-name", lambda b: b.replace(b"examples", b"\xe5xamples"), "model.graph.name",
            "UTF-8")
_bytes_case("bytes-bad-utf8-domain", lambda b: b.replace(b":\x06onednn", b":\x06\xffnednn", 1), "domain", "UTF-8")
_bytes_case("bytes-empty-model", lambda b: onnx.ModelProto(ir_version=10).SerializeToString(), "no graph")
_bytes_case("bytes-bad-utf8-name", lambda b: b.replace(b"bn.mean", b"bn.m\xffan"), "b'bn.m\\xffan'", "UTF-8")
_bytes_case("bytes-bad-utf8-node-name", lambda b: b.replace(b"\x1a\x02bn", b"\x1a\x02\xc3\x28", 1),
            "node name", "UTF-8")


# -- arity ------------------------------------------------------------------------------------------

@case("arity-too-many-inputs", VerificationError, "'bn'", "has 6 inputs", "at most 5")
def _(m):
    node_of(m).input.append("bn.src")


@case("arity-missing-required-input", VerificationError, "'bn'", "required input 'variance'", "missing")
def _(m):
    del node_of(m).input[3:]


@case("arity-empty-required-input", VerificationError, "'bn'", "required input 'mean'", "missing")
def _(m):
    node_of(m).input[2] = ""


@case("arity-no-inputs", VerificationError, "'bn'", "required input 'src'", "missing")
def _(m):
    del node_of(m).input[:]


@case("arity-too-many-outputs", VerificationError, "'bn'", "has 4 outputs", "at most 3")
def _(m):
    node_of(m).output.append("bn.extra")


@case("arity-no-outputs", VerificationError, "'bn'", "required output 'diff_src'", "missing")
def _(m):
    del node_of(m).output[:]
    del m.graph.output[:]


@case("arity-ngraph-missing-beta", VerificationError, "'bn'", "required input", op=NGRAPH)
def _(m):
    node_of(m).input[2] = ""


@case("arity-directml-too-many-outputs", VerificationError, "'bn'", "outputs", op=DIRECTML)
def _(m):
    node_of(m).output.append("bn.extra")


@case("arity-ms-missing-inv-std", VerificationError, "'bn'", "required input", "missing", op=MS_GRAD)
def _(m):
    del node_of(m).input[4:]


# -- attributes -------------------------------------------------------------------------------------

@case("attr-epsilon-missing", VerificationError, "'bn'", "required attribute 'epsilon'")
def _(m):
    node = node_of(m)
    kept = [a for a in node.attribute if a.name != "epsilon"]
    del node.attribute[:]
    node.attribute.extend(kept)


for _id, _value in [("attr-epsilon-int", 1), ("attr-epsilon-string", "1e-5"), ("attr-epsilon-floats", [1e-5, 2e-5]),
                    ("attr-epsilon-tensor", helper.make_tensor("e", TensorProto.FLOAT, [], [1e-5]))]:
    case(_id, VerificationError, "'bn'", "epsilon")(lambda m, v=_value: _set_attr(m, "epsilon", v))

for _id, _value in [("attr-data-format-int", 1), ("attr-data-format-strings", ["NCX"]),
                    ("attr-data-format-float", 0.5)]:
    case(_id, VerificationError, "'bn'", "data_format")(lambda m, v=_value: _set_attr(m, "data_format", v))

for _id, _value, _frag in [("attr-epsilon-nan", math.nan, "nan"), ("attr-epsilon-inf", math.inf, "inf"),
                           ("attr-epsilon-neg-inf", -math.inf, "inf"), ("attr-epsilon-negative", -1e-5, "-1e-05"),
                           ("attr-epsilon-zero", 0.0, "0"), ("attr-epsilon-negative-zero", -0.0, "0"),
                           ("attr-epsilon-denormal-to-zero-in-f32", 1e-50, "0")]:
    case(_id, VerificationError, "'bn'", "epsilon", _frag)(lambda m, v=_value: _set_attr(m, "epsilon", v))
    case(f"{_id}-directml", VerificationError, "'bn'", "Epsilon", op=DIRECTML)(
        lambda m, v=_value: _set_attr(m, "Epsilon", v))

for _id, _value in [("attr-data-format-unknown", "NHWC"), ("attr-data-format-lowercase", "ncx"),
                    ("attr-data-format-empty", ""), ("attr-data-format-space", "NCX ")]:
    case(_id, VerificationError, "'bn'", "data_format", repr(_value))(
        lambda m, v=_value: _set_attr(m, "data_format", v))


@case("attr-unknown", VerificationError, "'bn'", "unknown attribute 'momentum'")
def _(m):
    _set_attr(m, "momentum", 0.9)


@case("attr-data-format-on-ngraph", VerificationError, "'bn'", "unknown attribute 'data_format'", op=NGRAPH)
def _(m):
    _set_attr(m, "data_format", "NCX")


@case("attr-duplicate-epsilon", ModelError, "bn", "epsilon")
def _(m):
    node_of(m).attribute.append(helper.make_attribute("epsilon", 1e-3))


# -- shapes and types -------------------------------------------------------------------------------

def _retype(m, name, elem=None, dims=None):
    for vi in list(m.graph.input) + list(m.graph.output):
        if vi.name == name:
            tt = vi.type.tensor_type
            if elem is not None:
                tt.elem_type = elem
            if dims is not None:
                tt.ClearField("shape")
                tt.shape.SetInParent()
                for d in dims:
                    tt.shape.dim.add().dim_value = d


def _all_ranks(m, dims_src, dims_stat):
    for vi in list(m.graph.input) + list(m.graph.output):
        data = vi.name.endswith(("src", "diff_dst"))
        _retype(m, vi.name, dims=dims_src if data else dims_stat)


@case("rank-0-src", VerificationError, "'bn'", "rank")
def _(m):
    _all_ranks(m, [], [])


@case("rank-1-src", VerificationError, "'bn'", "rank")
def _(m):
    _all_ranks(m, [3], [3])


@case("rank-0-src-directml", VerificationError, "'bn'", "rank", op=DIRECTML)
def _(m):
    _all_ranks(m, [], [])


@case("rank-1-src-ngraph", VerificationError, "'bn'", "rank", op=NGRAPH, shape=(2, 3))
def _(m):
    _all_ranks(m, [3], [3])


@case("rank-0-mean", VerificationError, "'bn'", "mean", "shape")
def _(m):
    _retype(m, "bn.mean", dims=[])


@case("stats-wrong-channels", VerificationError, "'bn'", "mean", "[4]", "expected [5]", layout="NXC")
def _(m):
    _retype(m, "bn.mean", dims=[4])


@case("stats-wrong-channels-ncx", VerificationError, "'bn'", "variance", "[5]", "expected [3]", layout="NCX")
def _(m):
    _retype(m, "bn.variance", dims=[5])


@case("diff-dst-shape-differs", VerificationError, "'bn'", "diff_dst has shape [2,3,4,6]")
def _(m):
    _retype(m, "bn.diff_dst", dims=[2, 3, 4, 6])


@case("src-f64", VerificationError, "'bn'", "src", "f64")
def _(m):
    _retype(m, "bn.src", elem=TensorProto.DOUBLE)
    _retype(m, "bn.diff_dst", elem=TensorProto.DOUBLE)


@case("src-int32", VerificationError, "'bn'", "src", "s32")
def _(m):
    _retype(m, "bn.src", elem=TensorProto.INT32)


@case("stats-f16-for-f32-data", VerificationError, "'bn'", "f16")
def _(m):
    for name in ("bn.mean", "bn.variance", "bn.gamma"):
        _retype(m, name, elem=TensorProto.FLOAT16)


@case("src-not-a-tensor", VerificationError, "'bn'", "src is a seq(tensor(f32)); a tensor is required")
def _(m):
    vi = m.graph.input[0]
    vi.type.CopyFrom(helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 3])))


@case("directml-stats-not-keep-rank", VerificationError, "'bn'", "MeanTensor", op=DIRECTML, shape=(2, 3, 4))
def _(m):
    _retype(m, "bn.mean", dims=[3])


@case("directml-stats-rank-mismatch", VerificationError, "'bn'", "rank", op=DIRECTML, shape=(2, 3, 4))
def _(m):
    for name in ("bn.mean", "bn.variance", "bn.gamma"):
        _retype(m, name, dims=[1, 3, 1, 1])


@case("negative-dimension", ModelError, "-2")
def _(m):
    _retype(m, "bn.src", dims=[2, -2, 4, 5])


@case("zero-channels", None, layout="NCX")
def _(m):
    _all_ranks(m, [2, 0, 4, 5], [0])


@case("zero-elements-per-channel", None, layout="NCX")
def _(m):
    _all_ranks(m, [0, 3, 4, 5], [3])


# -- graph structure ---------------------------------------------------------------------------------

@case("missing-initializer", ModelError, "bn", "bn.variance")
def _(m):
    kept = [vi for vi in m.graph.input if vi.name != "bn.variance"]
    del m.graph.input[:]
    m.graph.input.extend(kept)


@case("missing-initializer-gamma", ModelError, "bn", "bn.gamma")
def _(m):
    kept = [vi for vi in m.graph.input if vi.name != "bn.gamma"]
    del m.graph.input[:]
    m.graph.input.extend(kept)


@case("duplicate-value-name", ModelError, "bn.diff_src")
def _(m):
    node = onnx.NodeProto()
    node.CopyFrom(node_of(m))
    node.name = "bn2"
    m.graph.node.append(node)


@case("duplicate-graph-input", ModelError, "bn.src")
def _(m):
    m.graph.input.append(m.graph.input[0])


@case("graph-output-not-produced", ModelError, "nowhere")
def _(m):
    m.graph.output.append(helper.make_tensor_value_info("nowhere", TensorProto.FLOAT, [1]))


@case("node-output-is-graph-input", ModelError, "bn.src")
def _(m):
    node_of(m).output[0] = "bn.src"


@case("cycle", ModelError, "bn")
def _(m):
    node = node_of(m)
    node.input[3] = "loop"
    m.graph.node.append(helper.make_node("Identity", ["bn.diff_src"], ["loop"], name="id"))


@case("unknown-op-in-known-domain", VerificationError, "'bn'", "unknown op type 'BatchNormTrainingBackwardX'")
def _(m):
    node_of(m).op_type = "BatchNormTrainingBackwardX"


@case("opset-11", LoweringError, "opset 11", "12")
def _(m):
    m.opset_import[0].version = 11


@case("no-default-opset-import", None)
def _(m):
    kept = [o for o in m.opset_import if o.domain not in ("", "ai.onnx")]
    del m.opset_import[:]
    m.opset_import.extend(kept)


@case("custom-domain-not-imported", ModelError, "bn", "No opset import for domain onednn")
def _(m):
    kept = [o for o in m.opset_import if o.domain == ""]
    del m.opset_import[:]
    m.opset_import.extend(kept)


@case("ir-version-3", None)
def _(m):
    m.ir_version = 3


@case("ir-version-99", ModelError, "IR version 99 is newer")
def _(m):
    m.ir_version = 99


@case("duplicate-node-names", None)
def _(m):
    other = onnx.NodeProto()
    other.CopyFrom(node_of(m))
    for i, v in enumerate(other.output):
        other.output[i] = v + "2"
    for vi in list(m.graph.output):
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(vi)
        copy.name = vi.name + "2"
        m.graph.output.append(copy)
    m.graph.node.append(other)


@case("huge-dimensions", None, layout="NCX")
def _(m):
    _all_ranks(m, [2**31, 3, 2**20, 2**20], [3])


@case("symbolic-everything", None)
def _(m):
    for vi in list(m.graph.input) + list(m.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            d.dim_param = "n"


# -- custom nodes in subgraphs and model-local functions -------------------------------------------------

def _into_if(m, edit_then=None):
    """Move the node into both branches of an If (outer-scope inputs); ``edit_then`` damages the then-copy."""
    bn = node_of(m)
    branches = []
    for branch in ("then", "else"):
        inner = onnx.NodeProto()
        inner.CopyFrom(bn)
        inner.name = f"bn_{branch}"
        inner.output[:] = [f"{o}_{branch}" if o else "" for o in bn.output]
        if branch == "then" and edit_then is not None:
            edit_then(inner)
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in inner.output[:1]]
        branches.append(helper.make_graph([inner], f"{branch}_branch", [], outs))
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    m.graph.input.append(cond)
    if_node = helper.make_node("If", ["cond"], [bn.output[0]], name="if", then_branch=branches[0],
                               else_branch=branches[1])
    del m.graph.node[:]
    m.graph.node.append(if_node)
    del m.graph.output[1:]


def _into_function(m, edit=None):
    """Move the node into a model-local function ``local::BnFn`` called from the main graph."""
    bn = node_of(m)
    inner = onnx.NodeProto()
    inner.CopyFrom(bn)
    inner.name = "bn_fn"
    if edit is not None:
        edit(inner)
    inputs = [i for i in bn.input if i]
    fn = helper.make_function("local", "BnFn", inputs, [bn.output[0]], [inner],
                              [helper.make_opsetid("", 17), helper.make_opsetid(bn.domain, 1)])
    m.functions.append(fn)
    m.opset_import.append(helper.make_opsetid("local", 1))
    del m.graph.node[:]
    m.graph.node.append(helper.make_node("BnFn", inputs, [bn.output[0]], name="call", domain="local"))
    del m.graph.output[1:]


def _set_node_attr(node, name, value):
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(name, value)])


case("if-branch-valid", None)(lambda m: _into_if(m))
case("function-valid", None)(lambda m: _into_function(m))
case("if-branch-epsilon-negative", VerificationError, "'bn_then'", "epsilon is -1.0")(
    lambda m: _into_if(m, lambda n: _set_node_attr(n, "epsilon", -1.0)))
case("if-branch-data-format-unknown", VerificationError, "'bn_then'", "'NHWC'")(
    lambda m: _into_if(m, lambda n: _set_node_attr(n, "data_format", "NHWC")))
case("if-branch-too-many-inputs", VerificationError, "'bn_then'", "has 6 inputs")(
    lambda m: _into_if(m, lambda n: n.input.append("bn.src")))
case("if-branch-undefined-input", ModelError, "node 'bn_then'", "'nowhere'", "then_branch")(
    lambda m: _into_if(m, lambda n: n.input.__setitem__(3, "nowhere")))
case("if-branch-duplicate-attribute", ModelError, "node 'bn_then'", "attribute 'epsilon' twice")(
    lambda m: _into_if(m, lambda n: n.attribute.append(helper.make_attribute("epsilon", 1e-3))))
case("function-epsilon-nan", VerificationError, "'bn_fn'", "epsilon is nan")(
    lambda m: _into_function(m, lambda n: _set_node_attr(n, "epsilon", math.nan)))
case("function-missing-input", VerificationError, "'bn_fn'", "required input 'variance'")(
    lambda m: _into_function(m, lambda n: n.input.__delitem__(slice(3, None))))
case("function-unknown-attribute", VerificationError, "'bn_fn'", "unknown attribute 'momentum'")(
    lambda m: _into_function(m, lambda n: _set_node_attr(n, "momentum", 0.9)))
case("function-undefined-input", ModelError, "node 'bn_fn'", "'nowhere'", "function local::BnFn")(
    lambda m: _into_function(m, lambda n: n.input.__setitem__(2, "nowhere")))
case("function-output-not-produced", ModelError, "function local::BnFn", "output 'bn.diff_src'")(
    lambda m: _into_function(m, lambda n: n.output.__setitem__(0, "other")))


@case("elem-type-unknown", ModelError, "bn.diff_src", "unknown element type 99")
def _(m):
    _retype(m, "bn.diff_src", elem=99)


# -- keep-rank statistics (DirectML) with symbolic dims ------------------------------------------------------

def _stat_dim(m, axis, value):
    for vi in m.graph.input:
        if vi.name in ("bn.mean", "bn.variance", "bn.gamma"):
            dim = vi.type.tensor_type.shape.dim[axis]
            if isinstance(value, str):
                dim.dim_param = value
            else:
                dim.dim_value = value


@case("directml-stats-own-symbol", LoweringError, "'bn'", "cannot tell which axes", "[1,k,1]", op=DIRECTML,
      shape=(2, 3, 4), symbolic=(1,))
def _(m):
    _stat_dim(m, 1, "k")


case("directml-stats-src-symbol", None, op=DIRECTML, shape=(2, 1, 2), symbolic=(1,))(lambda m: None)
