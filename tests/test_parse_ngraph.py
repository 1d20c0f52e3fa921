"""The ngraph dialect: inline quirks, the seed, specs/ and the corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from opdef.dialects import ngraph
from opdef.errors import SpecError
from opdef.parse import read_spec_text
from opdef.schema import Argument, Attribute
from opdef.types import TYPE_CLASSES

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "ngraph" / "batch_norm_training_backprop.rst"
SEED = "seeds/002_f105ca9861223769.txt"
ANY = TYPE_CLASSES["any"]
REAL = TYPE_CLASSES["real"]


def facts(schema) -> dict:
    data = schema.to_json()
    del data["source"]
    return data


def grid(*rows: tuple[str, ...]) -> str:
    """A grid table whose first row is the header."""
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(len(rows[0]))]
    rule = "+" + "+".join("-" * w for w in widths) + "+"
    out = [rule, "|" + "|".join(f" {c}".ljust(w) for c, w in zip(rows[0], widths, strict=True)) + "|",
           rule.replace("-", "=")]
    for row in rows[1:]:
        out += ["|" + "|".join(f" {c}".ljust(w) for c, w in zip(row, widths, strict=True)) + "|", rule]
    return "\n".join(out)


def doc(inputs=None, outputs=None, attributes=None, title="Op", cls="ngraph::op::v0::Op") -> str:
    parts = [f"{'#' * len(title)}\n{title}\n{'#' * len(title)}\n\n.. code-block:: cpp\n\n   {title}  // Does it.\n"]
    for heading, table in (("Inputs", inputs), ("Attributes", attributes), ("Outputs", outputs)):
        if table is not None:
            parts.append(f"{heading}\n{'-' * len(heading)}\n\n{grid(*table)}\n")
    parts.append(f"C++ Interface\n=============\n\n.. doxygenclass:: {cls}\n   :project: ngraph\n   :members:\n")
    return "\n".join(parts)


HEAD = ("Name", "Element Type", "Shape")


def test_minimal_document_exact_rows():
    text = doc(inputs=[HEAD, ("``arg0``", "real", ":math:`(N, C)`"), ("``arg1``", "same as ``arg0``", "(C)")],
               outputs=[HEAD, ("``out``", "same as ``arg0``", "Same as ``arg0``")],
               attributes=[("Name", "Type", "Notes"), ("``eps``", "``double``", "Small bias.")],
               cls="ngraph::op::v1::Op")
    s = ngraph.parse(text, "op.rst")
    assert (s.name, s.version, s.domain, s.dialect, s.description) == ("Op", 1, "ngraph", "ngraph", "Does it.")
    assert s.inputs == (Argument("arg0", type_var="T", shape=":math:`(N, C)`"),
                        Argument("arg1", type_var="T", shape="(C)"))
    assert s.outputs == (Argument("out", type_var="T", shape="Same as ``arg0``"),)
    assert s.attributes == (Attribute("eps", "f64", True, None, (), "Small bias."),)
    assert s.type_constraints == (("T", REAL),)
    assert dict(s.extra)["doxygen_classes"] == ("ngraph::op::v1::Op",)


def _types(*rows, attributes=None):
    s = ngraph.parse(doc(inputs=[HEAD, *rows[:-1]], outputs=[HEAD, rows[-1]], attributes=attributes), "d")
    return [(a.name, a.type_var) for a in s.inputs + s.outputs], s.type_constraints


def test_independent_cells_get_their_own_variables():
    assert _types(("``a``", "any", "any"), ("``b``", "``ngraph::element::boolean``", "any"),
                  ("``out``", "``element::boolean``", "any")) == (
        [("a", "T1"), ("b", "T2"), ("out", "T3")], (("T1", ANY), ("T2", ("boolean",)), ("T3", ("boolean",))))


def test_same_as_may_refer_forward_and_to_an_output():
    assert _types(("``scale``", "Same as ``output``", "any"), ("``input``", "Any quantized type", "any"),
                  ("``output``", "real", "any")) == (
        [("scale", "T1"), ("input", "T2"), ("output", "T1")], (("T1", REAL), ("T2", ("s8", "u8"))))


def test_multi_line_concrete_types_and_floating_point_class():
    names, constraints = _types(("``a``", "``element::f32`` ``element::i64``", "any"),
                                ("``b``", "Any floating point type", "Scalar"), ("``o``", "same as ``a``", "any"))
    assert names == [("a", "T1"), ("b", "T2"), ("o", "T1")]
    assert constraints == (("T1", ("f32", "s64")), ("T2", REAL))


def test_self_reference_and_attribute_named_type_are_unconstrained():
    names, constraints = _types(("``lo``", "real", "Scalar"), ("``hi``", "Same as ``hi``", "Scalar"),
                                ("``out``", "``element_type``", "any"),
                                attributes=[("Name", "Type", "Notes"), ("``element_type``", "``element::Type``", "t")])
    assert names == [("lo", "T1"), ("hi", "T2"), ("out", "T3")]
    assert constraints == (("T1", REAL), ("T2", ANY), ("T3", ANY))


def test_nodes_type_column_is_one_variadic_input():
    s = ngraph.parse(doc(inputs=[("Name", "Type", "Notes"), ("``args``", "``Nodes``", "All element types the same.")],
                         outputs=[HEAD, ("``output``", "Same as ``args``", "x")]), "d")
    assert s.inputs == (Argument("args", variadic=True, type_var="T", description="All element types the same."),)
    assert s.outputs[0].type_var == "T"


@pytest.mark.parametrize(("spelled", "normalized"), [
    ("``double``", "f64"), ("``Shape[n]``", "s64[]"), ("``Strides[n]``", "s64[]"), ("``AxisSet``", "s64[]"),
    ("``Shape``", "s64[]"), ("``Boolean``", "bool"), ("``uint64_t``", "u64"), ("``size_t``", "s64"),
    ("``ngraph::element::type``", "dtype"), ("``op::PadMode``", "op::PadMode"),
])
def test_attribute_types_are_normalized(spelled, normalized):
    s = ngraph.parse(doc(attributes=[("Name", "Type", "Notes"), ("``a``", spelled, "n")]), "d")
    assert s.attributes[0].type == normalized


def test_attribute_requiredness_and_defaults_from_notes():
    s = ngraph.parse(doc(attributes=[
        ("Name", "Type", "Notes"), ("``a``", "``double``", "Small bias."), ("``b``", "``size_t``", "Optional."),
        ("``c``", "``size_t``", "The axis (default: 1)."), ("``d``", "``bool``", "Defaults to ``true``")]), "d")
    assert [(a.name, a.required, a.default) for a in s.attributes] == [
        ("a", True, None), ("b", False, None), ("c", False, 1), ("d", False, True)]


def test_attribute_table_without_type_column():
    s = ngraph.parse(doc(attributes=[("Name", "Description"), ("``axes``", "The axis positions")]), "d")
    assert s.attributes == (Attribute("axes", "undefined", True, None, (), "The axis positions"),)


def test_stub_page_is_an_empty_but_valid_schema():
    text = "#######\nArgMax\n#######\n\n.. code-block:: cpp\n\n   ArgMax  // Argmax\n\n\n" \
           "C++ Interface\n=============\n\n.. doxygenclass:: ngraph::op::v0::ArgMax\n   :project: ngraph\n"
    s = ngraph.parse(text, "arg_max.rst")
    assert (s.name, s.inputs, s.outputs, s.attributes, s.type_constraints) == ("ArgMax", (), (), (), ())
    assert dict(s.extra)["stub"] is True
    assert s.description == "Argmax"


def test_header_separator_with_wrong_joints_is_repaired():
    table = "\n".join([
        "+------+--------------+--------+-------+",
        "| Name | Element Type | Shape  | Notes |",
        "+======+==============+================+",
        "| ``a``| real         | Scalar | lo    |",
        "+------+--------------+--------+-------+",
    ])
    repaired = ngraph.repair_grid_tables(table).splitlines()
    assert repaired[2] == "+======+==============+========+=======+"
    s = ngraph.parse(f"##\nOp\n##\n\nInputs\n------\n\n{table}\n", "d")
    assert s.inputs == (Argument("a", type_var="T", shape="Scalar", description="lo"),)


def test_row_with_shifted_separators_is_realigned():
    table = "\n".join([
        "+--------+--------------+-------------+",
        "| Name   | Element Type | Shape       |",
        "+========+==============+=============+",
        "| ``o``  | real          | Same as x  |",
        "+--------+--------------+-------------+",
    ])
    assert ngraph.repair_grid_tables(table).splitlines()[3] == "| ``o``  | real         | Same as x   |"
    s = ngraph.parse(f"##\nOp\n##\n\nOutputs\n-------\n\n{table}\n", "d")
    assert s.outputs == (Argument("o", type_var="T", shape="Same as x"),)


def test_version_from_the_doxygen_namespace():
    assert ngraph.parse(doc(cls="ngraph::op::v1::Op"), "d").version == 1
    assert ngraph.parse(doc(cls="ngraph::op::v3::Op"), "d").version == 3
    assert ngraph.parse(doc(cls="ngraph::op::Op"), "d").version == 1


# -- malformed documents ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "line", "expected"), [
    ("Just a paragraph.\n", 1, "expected a title"),
    (doc(inputs=[("Element Type", "Shape"), ("real", "any")]), 12, "'Name' column"),
    (doc(inputs=[("Name", "Shape"), ("``a``", "any")]), 12, "'Element Type' column"),
    (doc(inputs=[HEAD, ("``a``", "same as ``zzz``", "any")]), 12, "names no input"),
    (doc(inputs=[HEAD, ("``a``", "quaternions", "any")]), 12, "expected an element type"),
    (doc(inputs=[HEAD, ("a b", "real", "any")]), 12, "name like ``name``"),
    (doc(inputs=[HEAD, ("``a``", "real", "any"), ("``a``", "real", "any")]), 12, "listed twice"),
    ("##\nOp\n##\n\nInputs\n------\n\n+------+-----+\n| Name | x\n+------+-----+\n", 9, "Malformed table"),
])
def test_malformed_documents_raise_spec_error_with_line(text, line, expected):
    with pytest.raises(SpecError) as err:
        ngraph.parse(text, "bad.rst")
    assert (err.value.source, err.value.line) == ("bad.rst", line)
    assert expected in err.value.message


# -- detection --------------------------------------------------------------------------------


def test_looks_like_scores_the_grid_table_grammar():
    assert ngraph.looks_like(doc(inputs=[HEAD, ("``a``", "real", "any")])) >= 0.9
    assert ngraph.looks_like("**Versioned name**: *Op-1*\n") == 0
    assert ngraph.looks_like("Title\n=====\n\nText.\n") == 0


def test_looks_like_does_not_claim_other_dialects(shared_dir):
    others = [p for d in ("onednn", "opset_v0", "directml") for p in sorted((shared_dir / "corpus" / d).glob("*.*"))
              if p.suffix in (".rst", ".md")]
    others += [shared_dir / "seeds" / s for s in ("000_086b69c5df1d398c.txt", "001_593e7bada2fa4e3e.txt",
                                                  "003_6d4ad439f9782f59.txt")]
    assert len(others) > 60
    assert [p.name for p in others if ngraph.looks_like(p.read_text(encoding="utf-8"))] == []


# -- the seed, the project's own document and the corpus --------------------------------------


def _check_batch_norm_backprop(s):
    assert (s.name, s.version, s.domain, s.dialect) == ("BatchNormTrainingBackprop", 1, "ngraph", "ngraph")
    assert [(a.name, a.optional, a.type_var, a.shape) for a in s.inputs] == [
        ("input", False, "T", r":math:`(\bullet, C, \ldots)`"), ("gamma", False, "T", ":math:`(C)`"),
        ("beta", False, "T", ":math:`(C)`"), ("mean", False, "T", ":math:`(C)`"),
        ("variance", False, "T", ":math:`(C)`"), ("normalized_delta", False, "T", ":math:`input`")]
    assert [(a.name, a.optional, a.type_var, a.shape) for a in s.outputs] == [
        ("input_delta", False, "T", "Same as ``input``"), ("gamma_delta", False, "T", ":math:`(C)`"),
        ("beta_delta", False, "T", ":math:`(C)`")]
    assert [(a.name, a.type, a.required, a.default) for a in s.attributes] == [("epsilon", "f64", True, None)]
    assert s.type_constraints == (("T", REAL),)


def test_project_spec_document():
    s = ngraph.parse(read_spec_text(SPEC), str(SPEC))
    _check_batch_norm_backprop(s)
    assert "Mathematical Definition" in read_spec_text(SPEC)


def test_seed_and_project_document_give_the_same_facts(shared_dir):
    seed = ngraph.parse(read_spec_text(shared_dir / SEED), "seed")
    _check_batch_norm_backprop(seed)
    ours = facts(ngraph.parse(read_spec_text(SPEC), str(SPEC)))
    theirs = facts(seed)
    del ours["description"], theirs["description"]
    assert theirs == ours


def corpus_docs():
    corpus = ROOT.parent / "shared" / "corpus" / "ngraph"  # the shared_dir fixture skips when it is absent
    return sorted(corpus.glob("*.rst")) if corpus.is_dir() else []


STUBS = {"arg_max.rst": "ArgMax", "drop_out.rst": "Unsqueeze", "tensor_iterator.rst": "TensorIterator",
         "topk.rst": "TopK", "unsqueeze.rst": "Unsqueeze"}


@pytest.mark.parametrize("path", corpus_docs(), ids=lambda p: p.name)
def test_corpus_document_parses(shared_dir, path):
    s = ngraph.parse(read_spec_text(path), str(path))
    if path.name in STUBS:
        assert (s.name, s.inputs, s.outputs, s.attributes) == (STUBS[path.name], (), (), ())
        assert dict(s.extra)["stub"] is True
    else:
        assert s.outputs and "stub" not in dict(s.extra)
        assert all(a.type_var in s.type_constraint_map for a in s.inputs + s.outputs)


SPOT_CHECKS = {
    "abs.rst": lambda s: [(a.name, a.type_var, a.shape) for a in s.inputs + s.outputs] == [
        ("arg", "T", "Any"), ("output", "T", "Same as ``arg``")] and s.type_constraints == (("T", ANY),),
    "add.rst": lambda s: s.version == 1 and [a.name for a in s.inputs] == ["arg0", "arg1"]
    and {a.type_var for a in s.inputs + s.outputs} == {"T"},
    "allreduce.rst": lambda s: s.type_constraints == (("T1", ("f32", "f64")), ("T2", ("f32", "f64"))),
    "avg_pool.rst": lambda s: [(a.name, a.type, a.required) for a in s.attributes] == [
        ("w", "s64[]", True), ("s", "s64[]", True), ("p", "s64[]", True), ("q", "s64[]", True), ("i", "bool", True)]
    and s.inputs[0].description == "n>0, d_i>0" and s.inputs[0].shape == r":math:`(N,C,d_1,\ldots,d_n)`",
    "batch_norm_inference.rst": lambda s: [a.name for a in s.inputs] == ["input", "gamma", "beta", "mean", "variances"]
    and s.outputs[0].name == "normalized" and s.type_constraints == (("T", REAL),),
    "broadcast.rst": lambda s: [(a.name, a.type) for a in s.attributes] == [("shape", "s64[]"),
                                                                          ("broadcast_axes", "s64[]")],
    "concat.rst": lambda s: s.inputs[0].variadic and s.attributes[0].type == "undefined"
    and s.outputs[0].shape == "Same as ``arg`` on non-``concatenation_axis`` Sum of ``concatenation_axis`` lengths "
                              "of ``args``",
    "convert.rst": lambda s: s.attribute("element_type").type == "dtype"
    and s.type_constraints == (("T1", ANY), ("T2", ANY)),
    "less.rst": lambda s: s.type_constraints == (("T1", ANY), ("T2", ("boolean",))),
    "parameter.rst": lambda s: s.inputs == () and [a.name for a in s.attributes] == ["element_type", "shape",
                                                                                     "cacheable"],
    "random_uniform.rst": lambda s: [(a.name, a.type_var, a.shape) for a in s.inputs] == [
        ("min_value", "T1", "Scalar"), ("max_value", "T2", "Scalar"), ("result_shape", "T3", "Vector of any size"),
        ("use_fixed_seed", "T4", "Scalar")] and s.outputs[0].type_var == "T1"
    and s.type_constraints[2:] == (("T3", ("s64",)), ("T4", ("boolean",)))
    and s.attribute("fixed_seed").type == "u64",
}


@pytest.mark.parametrize("name", sorted(SPOT_CHECKS))
def test_corpus_spot_checks(shared_dir, name):
    path = shared_dir / "corpus" / "ngraph" / name
    assert SPOT_CHECKS[name](ngraph.parse(read_spec_text(path), str(path)))
