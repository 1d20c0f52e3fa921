"""Mutation fuzzer: fixed-seed semantic corruptions of training graphs through ``oplower lower`` and ``check``.

Bases: the committed onnxruntime-training artifacts (training and optimizer models), one batch-norm model per
dialect, and the first recorded one-node case of every training op (``tests/_recorded.py``: an op another
family adds joins by itself). A case applies one or two mutations (element types incl. sequences and
optionals, dropped type information, shapes, attribute values and types, dropped and added attributes,
opset imports, input arity and order, duplicated outputs, cycles) and runs ``check`` and ``lower`` (both
targets) in-process.

The contract each case asserts (issue 24): exit 0, 1 or 2; on an error exactly one line on stderr, no
traceback and no "internal error", and no output file; on exit 0 a file that ``onnx.checker`` accepts
(full_check), that onnxruntime loads when no custom node is left in it, and no more than
``MAX_NODES_PER_NODE`` nodes per custom node (no unbounded expansion).

The default run takes a spread of about 30 cases; the full set (``FULL_CASES``) is behind the ``fuzz_full``
marker, deselected by default in pyproject.toml: ``pytest -m fuzz_full tests/test_mutation_fuzz.py``.
"""

from __future__ import annotations

import contextlib
import io
import math
import random
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from _models import SEED_OPS, bn_model
from _recorded import FIXTURES, recorded_cases
from onnx import AttributeProto, TensorProto, helper

from lowering.cli import main
from lowering.rules import TARGETS
from opdef.graphs import model_nodes as all_nodes_of
from opdef.registry import load_schemas
from runtime.session import find_custom_nodes

SEED = 24
FULL_CASES = 1200
DEFAULT_CASES = 30
ARTIFACTS = FIXTURES / "artifacts"
MAX_NODES_PER_NODE = 400  # the largest lowering (a batch-norm gradient) emits a few dozen nodes

ELEM_TYPES = (TensorProto.INT64, TensorProto.INT32, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16,
              TensorProto.BOOL, TensorProto.UINT8, TensorProto.STRING, TensorProto.FLOAT)
DIMS = (0, 1, 2, 3, 7, 100, 20000, "N")
INTS = (-1, 0, 1, 2, 3, 100, 20000, 2**31, 2**63 - 1, -(2**63))
FLOATS = (math.nan, math.inf, -1.0, 0.0, 1e-30, 1e30)
OPSETS = (1, 7, 11, 12, 13, 15, 16, 18, 21, 99)


# -- the bases -----------------------------------------------------------------------------------------

def _bases() -> list[tuple[str, bytes]]:
    bases = []
    for directory in sorted(p for p in ARTIFACTS.iterdir() if p.is_dir()):
        for name in ("training_model", "optimizer_model"):
            path = directory / f"{name}.onnx"
            if path.is_file():
                bases.append((f"{directory.name}/{name}", path.read_bytes()))
    registry = load_schemas()
    for key in (*SEED_OPS, ("com.microsoft", "BatchNormalizationGrad")):
        model = bn_model(registry.get(*key), (2, 3, 4, 4))
        bases.append((f"bn/{key[0]}.{key[1]}", model.SerializeToString()))
    first: dict[str, dict] = {}
    for case in recorded_cases():
        first.setdefault(case["op_type"], case)
    for op_type, case in sorted(first.items()):
        bases.append((f"op/{op_type}/{case['variant']}", (FIXTURES / case["model"]).read_bytes()))
    return bases


# -- mutations: each changes ``model`` in place and returns what it did, or None when it does not apply -------

def _targets(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    registry = load_schemas()
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return [n for n in model.graph.node if registry.handles(n.domain, n.op_type, opset)]


def _declared(model: onnx.ModelProto, touching: bool = True) -> list[onnx.ValueInfoProto]:
    """Declared values (inputs, outputs, value_info), those a custom node reads or writes first."""
    values = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    if touching:
        names = {v for n in _targets(model) for v in (*n.input, *n.output) if v}
        near = [vi for vi in values if vi.name in names]
        values = near or values
    return values


def m_elem_type(model, rng):
    values = [vi for vi in _declared(model) if vi.type.HasField("tensor_type")]
    if not values:
        return None
    vi = rng.choice(values)
    t = rng.choice(ELEM_TYPES)
    vi.type.tensor_type.elem_type = t
    return f"{vi.name} elem {TensorProto.DataType.Name(t)}"


def _wrap(model, rng, kind):
    values = [vi for vi in _declared(model) if vi.type.HasField("tensor_type")]
    if not values:
        return None
    vi = rng.choice(values)
    inner = onnx.TypeProto()
    inner.CopyFrom(vi.type)
    if rng.random() < 0.3:
        inner.tensor_type.elem_type = rng.choice(ELEM_TYPES)
    vi.type.ClearField("tensor_type")
    getattr(vi.type, kind).elem_type.CopyFrom(inner)
    return f"{vi.name} as {kind}"


def m_to_sequence(model, rng):
    return _wrap(model, rng, "sequence_type")


def m_to_optional(model, rng):
    return _wrap(model, rng, "optional_type")


def m_sequence_elem(model, rng):
    values = [vi for vi in _declared(model, touching=False) if vi.type.HasField("sequence_type")]
    if not values:
        return m_to_sequence(model, rng)
    vi = rng.choice(values)
    if rng.random() < 0.3:  # a sequence where a sequence is required, of sequences
        inner = onnx.TypeProto()
        inner.CopyFrom(vi.type)
        vi.type.sequence_type.elem_type.CopyFrom(inner)
        return f"{vi.name} seq(seq)"
    t = rng.choice(ELEM_TYPES)
    vi.type.sequence_type.elem_type.tensor_type.elem_type = t
    return f"{vi.name} seq elem {TensorProto.DataType.Name(t)}"


def m_drop_type(model, rng):
    values = _declared(model)
    if rng.random() < 0.5 and model.graph.input:
        values = list(model.graph.input)
    vi = rng.choice(values)
    vi.ClearField("type")
    return f"{vi.name} untyped"


def m_drop_value_info(model, rng):
    if not model.graph.value_info:
        return None
    del model.graph.value_info[:]
    return "value_info dropped"


def m_shape(model, rng):
    values = [vi for vi in _declared(model) if vi.type.HasField("tensor_type")]
    if not values:
        return None
    vi = rng.choice(values)
    tt = vi.type.tensor_type
    choice = rng.random()
    if choice < 0.15:
        tt.ClearField("shape")
        return f"{vi.name} shape dropped"
    dims = tt.shape.dim
    if choice < 0.3 or not dims:
        dims.add().dim_value = rng.choice((1, 2, 3))
        return f"{vi.name} extra dim"
    if choice < 0.4:
        del dims[-1]
        return f"{vi.name} dim removed"
    d = dims[rng.randrange(len(dims))]
    value = rng.choice(DIMS)
    if isinstance(value, str):
        d.dim_param = value
    else:
        d.dim_value = value
    return f"{vi.name} dim {value}"


def _attr_node(model, rng):
    nodes = [n for n in _targets(model) if n.attribute]
    return rng.choice(nodes) if nodes else None


def m_attr_value(model, rng):
    node = _attr_node(model, rng)
    if node is None:
        return None
    a = rng.choice(list(node.attribute))
    if a.type == AttributeProto.INT:
        a.i = rng.choice(INTS)
    elif a.type == AttributeProto.FLOAT:
        a.f = rng.choice(FLOATS)
    elif a.type == AttributeProto.INTS:
        if a.ints and rng.random() < 0.7:
            a.ints[rng.randrange(len(a.ints))] = rng.choice(INTS)
        else:
            a.ints.append(rng.choice(INTS))
    elif a.type == AttributeProto.STRING:
        a.s = rng.choice((b"", b"bogus", b"NCX", b"none", b"sum"))
    else:
        return None
    return f"{node.name or node.op_type}.{a.name} value"


def m_attr_type(model, rng):
    node = _attr_node(model, rng)
    if node is None:
        return None
    i = rng.randrange(len(node.attribute))
    name = node.attribute[i].name
    value = rng.choice((1, 2.5, "x", [1, 2], [0.5]))
    node.attribute[i].CopyFrom(helper.make_attribute(name, value))
    return f"{node.name or node.op_type}.{name} -> {value!r}"


def m_attr_drop(model, rng):
    node = _attr_node(model, rng)
    if node is None:
        return None
    i = rng.randrange(len(node.attribute))
    name = node.attribute[i].name
    del node.attribute[i]
    return f"{node.name or node.op_type}.{name} dropped"


def m_attr_add(model, rng):
    nodes = _targets(model)
    if not nodes:
        return None
    node = rng.choice(nodes)
    entry = load_schemas().get(node.domain, node.op_type)
    names = [a.name for a in entry.schema.attributes] if entry else []
    given = {a.name for a in node.attribute}
    free = [n for n in names if n not in given]
    name = rng.choice(free) if free and rng.random() < 0.8 else "bogus_attribute"
    value = rng.choice((rng.choice(INTS), [rng.choice((1, 2, 3, 100, 20000))] * rng.choice((1, 2, 3)),
                        rng.choice(FLOATS), "NCX"))
    node.attribute.append(helper.make_attribute(name, value))
    return f"{node.name or node.op_type}.{name} = {value!r}"


def m_opset_version(model, rng):
    imports = list(model.opset_import)
    o = rng.choice(imports)
    o.version = rng.choice(OPSETS) if o.domain in ("", "ai.onnx") else rng.choice((0, 2, 99))
    return f"opset {o.domain or 'ai.onnx'} {o.version}"


def m_opset_conflict(model, rng):
    version = rng.choice((7, 17, 17, 12, 99))
    model.opset_import.add(domain=rng.choice(("ai.onnx", "")), version=version)
    return f"second default opset import {version}"


def m_opset_drop(model, rng):
    i = rng.randrange(len(model.opset_import))
    domain = model.opset_import[i].domain
    del model.opset_import[i]
    return f"opset {domain or 'ai.onnx'} dropped"


def m_arity(model, rng):
    nodes = _targets(model)
    if not nodes:
        return None
    node = rng.choice(nodes)
    choice = rng.random()
    if choice < 0.3 and node.input:
        del node.input[-1]
        return f"{node.name or node.op_type} last input dropped"
    if choice < 0.5 and node.input:
        node.input[rng.randrange(len(node.input))] = ""
        return f"{node.name or node.op_type} input omitted"
    if choice < 0.75:
        node.input.append(rng.choice(list(node.input) or [""]))
        return f"{node.name or node.op_type} extra input"
    node.output.append(f"fuzz_extra_{rng.randrange(1000)}")
    return f"{node.name or node.op_type} extra output"


def m_swap_inputs(model, rng):
    nodes = [n for n in _targets(model) if len(n.input) >= 2]
    if not nodes:
        return None
    node = rng.choice(nodes)
    i, j = rng.sample(range(len(node.input)), 2)
    node.input[i], node.input[j] = node.input[j], node.input[i]
    return f"{node.name or node.op_type} inputs {i}<->{j}"


def m_duplicate_output(model, rng):
    nodes = [n for n in _targets(model) if n.output]
    if not nodes:
        return None
    node = rng.choice(nodes)
    others = [v for n in model.graph.node if n is not node for v in n.output if v] + \
        [vi.name for vi in model.graph.input]
    if not others:
        return None
    node.output[rng.randrange(len(node.output))] = rng.choice(others)
    return f"{node.name or node.op_type} duplicated output"


def m_cycle(model, rng):
    nodes = list(model.graph.node)
    target = _targets(model)
    if len(nodes) < 2 or not target:
        node = target[0] if target else None
        if node is None or not node.input or not node.output:
            return None
        node.input[0] = node.output[0]  # reads itself
        return "self loop"
    last = target[-1]
    first = nodes[0]
    if first is last or not first.input or not last.output:
        return None
    first.input[0] = last.output[0]
    return f"{first.name or first.op_type} reads {last.output[0]} (cycle)"


def m_label_range(model, rng):
    """SoftmaxCrossEntropyLossGrad: an int32 label with an ignore_index it cannot hold, or a huge one."""
    nodes = [n for n in _targets(model) if n.op_type == "SoftmaxCrossEntropyLossGrad"]
    if not nodes:
        return m_attr_value(model, rng)
    node = rng.choice(nodes)
    schema = load_schemas().get(node.domain, node.op_type).schema
    label = node.input[[a.name for a in schema.inputs].index("label")]
    for vi in _declared(model):
        if vi.name == label and vi.type.HasField("tensor_type"):
            vi.type.tensor_type.elem_type = rng.choice((TensorProto.INT32, TensorProto.INT64))
    value = rng.choice((2**31, -(2**31) - 1, 2**63 - 1, -(2**63), -100))
    kept = [a for a in node.attribute if a.name != "ignore_index"]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute("ignore_index", value)])
    return f"{node.name or node.op_type} int label, ignore_index {value}"


def m_pool_window(model, rng):
    """A pooling gradient with a window wider than its input, below opset 16 or not."""
    nodes = [n for n in _targets(model) if n.op_type in ("MaxPoolGrad", "AveragePoolGrad")]
    if not nodes:
        return m_attr_add(model, rng)
    node = rng.choice(nodes)
    kernel = next((a for a in node.attribute if a.name == "kernel_shape"), None)
    if kernel is None:
        return None
    width = rng.choice((2, 5, 13, 100, 20000))
    kernel.ints[:] = [width] * len(kernel.ints)
    if rng.random() < 0.6:
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = rng.choice((12, 13, 15))
    return f"{node.name or node.op_type} kernel {width}"


MUTATIONS = (m_label_range, m_pool_window,
             m_elem_type, m_to_sequence, m_to_optional, m_sequence_elem, m_drop_type, m_drop_value_info, m_shape,
             m_attr_value, m_attr_type, m_attr_drop, m_attr_add, m_opset_version, m_opset_conflict, m_opset_drop,
             m_arity, m_swap_inputs, m_duplicate_output, m_cycle)


@dataclass(frozen=True)
class Case:
    id: str
    base: str
    data: bytes


def make_cases(count: int, seed: int = SEED) -> list[Case]:
    rng = random.Random(seed)
    bases = _bases()
    cases = []
    attempts = 0
    while len(cases) < count and attempts < count * 10:
        attempts += 1
        base, data = bases[len(cases) % len(bases)]
        model = onnx.load_from_string(data)
        done = []
        for _ in range(1 if rng.random() < 0.75 else 2):
            mutate = rng.choice(MUTATIONS)
            what = mutate(model, rng)
            if what is not None:
                done.append(what)
        if not done:
            continue
        cases.append(Case(f"{len(cases):04d}-{base}-{'+'.join(done)}"[:150], base, model.SerializeToString()))
    return cases


# -- the contract --------------------------------------------------------------------------------------

def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def breaches(case: Case, directory: Path) -> list[str]:
    """What the case shows wrong (empty: the contract holds)."""
    found = []
    source = directory / "model.onnx"
    source.write_bytes(case.data)
    commands = [("check", ["check", str(source)], None)]
    for target_name in TARGETS:
        target = directory / target_name / "lowered.onnx"
        target.parent.mkdir()
        commands.append((f"lower --target {target_name}", ["lower", str(source), "-o", str(target), "--target",
                                                         target_name], target))
    for command, argv, target in commands:
        code, _, err = _run(argv)
        lines = [line for line in err.splitlines() if line.strip()]
        if code not in (0, 1, 2):
            found.append(f"{command}: exit {code}")
        if "Traceback" in err or "internal error" in err:
            found.append(f"{command}: {err.strip()[:300]}")
        elif code != 0 and len(lines) != 1:
            found.append(f"{command}: {len(lines)} lines on stderr: {err.strip()[:300]}")
        if target is None:
            continue
        written = sorted(p.name for p in target.parent.iterdir())
        if code != 0:
            if written:
                found.append(f"{command}: exit {code} but wrote {written}")
            continue
        if written != ["lowered.onnx"]:
            found.append(f"{command}: exit 0 but the output directory holds {written}")
            continue
        lowered = onnx.load(str(target))
        original = onnx.load_from_string(case.data)
        before = sum(1 for _ in all_nodes_of(original))
        after = sum(1 for _ in all_nodes_of(lowered))
        if after > before + MAX_NODES_PER_NODE * len(_targets(original)):  # unbounded work
            found.append(f"{command}: {before} nodes became {after}")
        try:
            onnx.checker.check_model(lowered, full_check=True)
        except Exception as exc:
            found.append(f"{command}: wrote a model onnx.checker refuses: {' '.join(str(exc).split())[:300]}")
            continue
        if not find_custom_nodes(lowered):
            try:
                ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
            except Exception as exc:
                found.append(f"{command}: wrote a model onnxruntime refuses: {' '.join(str(exc).split())[:300]}")
    return found


_DEFAULT = None


def _default_cases() -> list[Case]:
    global _DEFAULT
    if _DEFAULT is None:
        full = make_cases(FULL_CASES)
        _DEFAULT = full[:: max(1, len(full) // DEFAULT_CASES)][:DEFAULT_CASES]
    return _DEFAULT


def test_fuzzer_covers_every_base_and_mutation():
    cases = make_cases(FULL_CASES)
    assert len(cases) == FULL_CASES
    names = {n for c in cases for n in [c.base]}
    assert names == {name for name, _ in _bases()}
    assert any(c.base.startswith("op/") for c in cases) and any(c.base.startswith("bn/") for c in cases)
    ops = {c.base.split("/")[1] for c in cases if c.base.startswith("op/")}
    assert {"MaxPoolGrad", "SoftmaxCrossEntropyLossGrad", "AdamWOptimizer"} <= ops


@pytest.mark.parametrize("index", range(DEFAULT_CASES))
def test_mutation(index, tmp_path):
    case = _default_cases()[index]
    assert breaches(case, tmp_path) == [], case.id


@pytest.mark.fuzz_full
@pytest.mark.parametrize("index", range(FULL_CASES))
def test_mutation_full(index, tmp_path):
    case = make_cases_cached()[index]
    assert breaches(case, tmp_path) == [], case.id


_FULL = None


def make_cases_cached() -> list[Case]:
    global _FULL
    if _FULL is None:
        _FULL = make_cases(FULL_CASES)
    return _FULL


if __name__ == "__main__":  # a tally: python tests/test_mutation_fuzz.py [COUNT]
    import sys
    import tempfile
    from collections import Counter

    count = int(sys.argv[1]) if len(sys.argv) > 1 else FULL_CASES
    kinds = Counter()
    total = 0
    for case in make_cases(count):
        with tempfile.TemporaryDirectory() as tmp:
            found = breaches(case, Path(tmp))
        if found:
            total += 1
            for f in found:
                kinds[f.split(":")[0] + ": " + f.split(":", 1)[1].strip()[:60]] += 1
            print(case.id, "|", found[0][:240], flush=True)
    print(f"{total} of {count} cases breach the contract")
    for kind, n in kinds.most_common(40):
        print(f"{n:5d}  {kind}")
