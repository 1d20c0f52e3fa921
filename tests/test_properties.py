"""Property-based tests (hypothesis) through parser, verifier and pass.

- random shapes, layouts, element types and optional arguments: verify -> lower -> onnxruntime agrees with
  the float64 reference;
- randomly damaged spec documents: a schema or a SpecError naming the file (and a line inside it);
- randomly corrupted model bytes and protos: load_model -> verify_model -> lower_model raise nothing but
  the project's documented errors (OplowerError subclasses).

The "ci" profile (tests/conftest.py) bounds the number of examples; HYPOTHESIS_PROFILE=dev runs more.
"""

from __future__ import annotations

import math

import onnx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from lowering.demo.examples import BnCase, build_example
from lowering.modelio import load_model
from lowering.numerics import compare
from lowering.passes import lower_model
from opdef.errors import OplowerError, SpecError
from opdef.model_verify import verify_model
from opdef.parse import parse_spec
from opdef.registry import default_spec_dir, load_schemas
from runtime.session import run_model

F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
ONEDNN = ("onednn", "BatchNormTrainingBackward")
OPSET_V0 = ("onednn", "BatchNormTrainingBackprop")
NGRAPH = ("ngraph", "BatchNormTrainingBackprop")
DIRECTML = ("directml", "BATCH_NORMALIZATION_GRAD")
ORT_TRAINING = ("com.microsoft", "BatchNormalizationGrad")
ALL_ROLES = ("diff_src", "diff_gamma", "diff_beta")

SPECS = default_spec_dir()
BUNDLED = sorted(p for p in SPECS.rglob("*") if p.suffix in (".rst", ".md") and p.parent.name != "_include")
# Random data may make an output nearly cancel (a diff_beta over one channel of 100 values summing to ~0), so
# no f32 summation is within 2e-6 of the output's own scale; a wrong axis, layout or formula is off by O(1).
# The strict tolerance is test_lowering's, on data whose outputs do not cancel.
PROPERTY_REL = 1e-4
FUZZ = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def registry():
    return load_schemas()


# -- lowering agrees with the float64 reference ------------------------------------------------------------

@st.composite
def bn_cases(draw):
    op = draw(st.sampled_from([ONEDNN, OPSET_V0, NGRAPH, DIRECTML, ORT_TRAINING]))
    rank = draw(st.integers(1 if op == DIRECTML else 2, 5))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    symbolic = tuple(a for a in range(rank) if draw(st.booleans()) and draw(st.booleans()))
    kw = dict(symbolic=symbolic, epsilon=draw(st.floats(1e-6, 0.1)), seed=draw(st.integers(0, 2**16)))
    if op in (ONEDNN, OPSET_V0):
        io, stat = draw(st.sampled_from([(F32, F32), (BF16, F32), (BF16, BF16), (F16, F32)]))
        kw.update(layout=draw(st.sampled_from(["NCX", "NXC"])), gamma=draw(st.booleans()),
                  outputs=draw(st.sampled_from([("diff_src",), ALL_ROLES])))
    elif op == DIRECTML:
        io = stat = draw(st.sampled_from([F32, F16]))
        axes = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
        kw.update(reduce_axes=tuple(sorted(axes)))
    else:
        io = stat = draw(st.sampled_from([F32, F16] if op == ORT_TRAINING else [F32, F16, BF16]))
    # With 2 or 3 elements per channel diff_src is almost pure cancellation (exactly 0 for 2 elements and batch
    # statistics), so no f32 result is within 2e-6 of its own scale; the output-scale tolerance needs more.
    reduced = kw.get("reduce_axes") or [a for a in range(rank) if a != _channel_axis(op, kw.get("layout"), rank)]
    assume(math.prod(shape[a] for a in reduced) >= 4)
    consumed = draw(st.lists(st.sampled_from(ALL_ROLES), min_size=1, max_size=3, unique=True))
    declared = kw.get("outputs", ALL_ROLES)
    kw["consumed"] = tuple(r for r in ALL_ROLES if r in consumed and r in declared) or ("diff_src",)
    return BnCase(op, shape, io_type=io, stat_type=stat, **kw)


def _channel_axis(op, layout, rank):
    return rank - 1 if op in (ONEDNN, OPSET_V0) and layout == "NXC" else 1


@FUZZ
@given(cases=st.lists(bn_cases(), min_size=1, max_size=2))
def test_random_nodes_lower_to_the_float64_answer(registry, cases):
    cases = [BnCase(**{**c.__dict__, "name": f"n{i}"}) for i, c in enumerate(cases)]
    example = build_example(cases, registry)
    verify_model(example.model, registry)
    lowered = lower_model(example.model, registry=registry)
    onnx.checker.check_model(lowered, full_check=True)
    got = run_model(lowered, example.feeds)
    bad = [r.describe() for r in (compare(name, example.expected[name], got[name], example.output_types[name],
                                          rel=PROPERTY_REL) for name in example.expected) if not r.ok]
    assert not bad, "\n".join(bad)


# -- damaged spec documents --------------------------------------------------------------------------------

@st.composite
def damaged_documents(draw):
    path = draw(st.sampled_from(BUNDLED))
    lines = path.read_bytes().split(b"\n")
    for _ in range(draw(st.integers(1, 5))):
        if not lines:
            lines = [b""]
        i = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["drop", "duplicate", "truncate", "drop_block", "duplicate_block",
                                       "swap", "markup", "bytes"]))
        j = min(len(lines), i + draw(st.integers(1, 25)))
        if action == "drop":
            del lines[i]
        elif action == "duplicate":
            lines.insert(i, lines[i])
        elif action == "truncate":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        elif action == "drop_block":
            del lines[i:j]
        elif action == "duplicate_block":
            lines[i:i] = lines[i:j]
        elif action == "swap":
            k = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[k] = lines[k], lines[i]
        elif action == "markup":
            lines.insert(i, draw(st.sampled_from([b"```", b"+---+---+", b"|", b"=====", b"---", b"<table>", b"**",
                                                  b"* *", b"| a | b |", b"+===+", b".. include:: nothing.rst",
                                                  b".. |x| replace:: y", b"### -field", b"Type:", b":math:`"])))
        else:
            lines[i] = draw(st.binary(min_size=1, max_size=30))
    data = b"\n".join(lines)
    encoding = draw(st.sampled_from(["as is", "bom", "crlf", "cr"]))
    if encoding == "bom":
        data = b"\xef\xbb\xbf" + data
    elif encoding != "as is":
        data = data.replace(b"\n", b"\r\n" if encoding == "crlf" else b"\r")
    return path, data


@FUZZ
@given(document=damaged_documents())
def test_damaged_spec_parses_or_raises_spec_error(tmp_path_factory, document):
    origin, data = document
    path = tmp_path_factory.mktemp("spec") / origin.name
    path.write_bytes(data)
    try:
        schema = parse_spec(path, include_dirs=(origin.parent, SPECS / "_include"))
    except SpecError as err:
        assert err.source == str(path)
        assert err.line is None or 1 <= err.line <= data.count(b"\n") + data.count(b"\r") + 1
        assert "\n" not in str(err)
    else:
        assert schema.name


# -- corrupted models ----------------------------------------------------------------------------------------

def _pipeline(path, registry):
    model = load_model(path)
    verify_model(model, registry)
    lower_model(model, registry=registry)


@st.composite
def corrupted_model_bytes(draw):
    op = draw(st.sampled_from([ONEDNN, OPSET_V0, NGRAPH, DIRECTML, ORT_TRAINING]))
    data = bytearray(build_example([BnCase(op, (2, 3, 4))], load_schemas()).model.SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "delete"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if action == "truncate":
            data = data[:i]
        elif action == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif action == "overwrite" and data:
            data[i] = draw(st.integers(0, 255))
        elif action == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            del data[i:i + draw(st.integers(1, 8))]
    return bytes(data)


@FUZZ
@given(data=corrupted_model_bytes())
def test_corrupted_model_bytes_raise_only_documented_errors(tmp_path_factory, registry, data):
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    path.write_bytes(data)
    try:
        _pipeline(path, registry)
    except OplowerError as err:
        assert str(err)
    assert path.read_bytes() == data


ATTRIBUTE_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**63, 2**63 - 1), st.text(max_size=6),
    st.sampled_from(["NCX", "NXC", "ncx", ""]), st.lists(st.floats(-1, 1), min_size=1, max_size=3),
    st.lists(st.integers(-3, 3), min_size=1, max_size=3))


@st.composite
def corrupted_models(draw):
    op = draw(st.sampled_from([ONEDNN, OPSET_V0, NGRAPH, DIRECTML, ORT_TRAINING]))
    rank = draw(st.integers(0, 4))
    model = build_example([BnCase(op, (2, 3, 4), layout=draw(st.sampled_from(["NCX", "NXC"])))],
                          load_schemas()).model
    node = model.graph.node[0]
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["attr", "drop_attr", "input", "output", "dims", "elem", "drop_graph_input",
                                       "duplicate_node", "rename_node"]))
        if action == "attr":
            name = draw(st.sampled_from([a.name for a in node.attribute] + ["momentum"]))
            kept = [a for a in node.attribute if a.name != name]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute(name, draw(ATTRIBUTE_VALUES))])
        elif action == "drop_attr" and node.attribute:
            del node.attribute[draw(st.integers(0, len(node.attribute) - 1))]
        elif action == "input":
            values = list(node.input) + ["", "nowhere"]
            position = draw(st.integers(0, len(node.input)))
            value = draw(st.sampled_from(values))
            if position == len(node.input):
                node.input.append(value)
            else:
                node.input[position] = value
        elif action == "output" and node.output:
            node.output[draw(st.integers(0, len(node.output) - 1))] = draw(st.sampled_from(["", "x", *node.input]))
        elif action in ("dims", "elem"):
            vi = draw(st.sampled_from(list(model.graph.input) + list(model.graph.output)))
            tt = vi.type.tensor_type
            if action == "elem":
                tt.elem_type = draw(st.sampled_from([0, F32, F16, BF16, TensorProto.DOUBLE, TensorProto.INT64, 99]))
            else:
                tt.ClearField("shape")
                for d in draw(st.lists(st.sampled_from([0, 1, 3, -1, 2**40, "n"]), min_size=rank, max_size=rank)):
                    dim = tt.shape.dim.add()
                    if isinstance(d, str):
                        dim.dim_param = d
                    else:
                        dim.dim_value = d
        elif action == "drop_graph_input" and model.graph.input:
            del model.graph.input[draw(st.integers(0, len(model.graph.input) - 1))]
        elif action == "duplicate_node":
            model.graph.node.append(node)
        elif action == "rename_node":
            node.name = draw(st.sampled_from(["", "bn", "x" * 300, "\u00e9\u4e2d"]))
    return model.SerializeToString()


@FUZZ
@given(data=corrupted_models())
def test_corrupted_models_raise_only_documented_errors(tmp_path_factory, registry, data):
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    path.write_bytes(data)
    try:
        _pipeline(path, registry)
    except OplowerError as err:
        message = str(err)
        assert message.strip() and "Traceback" not in message  # a one-line message of its own


@pytest.mark.parametrize("consumed", [("diff_src", "diff_gamma"), ("diff_gamma",), ("diff_beta",)])
def test_regression_keep_rank_stats_with_a_symbolic_kept_axis(registry, consumed):
    """Found by test_random_nodes_lower_to_the_float64_answer: DirectML statistics [1,n,1] for src [2,n,2]
    summed over axes (1, 2) instead of (0, 2) — the lowering guessed axis 0 as the channel axis."""
    case = BnCase(DIRECTML, (2, 1, 2), reduce_axes=(0, 2), symbolic=(1,), consumed=consumed)
    example = build_example([case], registry)
    lowered = lower_model(example.model, registry=registry)
    onnx.checker.check_model(lowered, full_check=True)
    got = run_model(lowered, example.feeds)
    for name in example.expected:
        assert compare(name, example.expected[name], got[name], example.output_types[name]).ok
