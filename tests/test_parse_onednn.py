"""The onednn dialect parser: one test per grammar quirk on small inline documents, then the seed, the
project's own spec document and the upstream corpus against oneDNN v3.2's C++ schemas."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opdef.dialects import onednn
from opdef.errors import SpecError
from opdef.parse import parse_spec, read_spec_text
from opdef.schema import Attribute, Constraint

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "onednn" / "BatchNormTrainingBackward.rst"
SEED = "seeds/000_086b69c5df1d398c.txt"


# -- building small documents --------------------------------------------------------------------------
def grid(header: list[str], rows: list[list[str | list[str]]]) -> str:
    """An RST grid table; a cell given as a list of strings spans several lines."""
    cells = [[c if isinstance(c, list) else [c] for c in row] for row in [header, *rows]]
    widths = [max(len(line) for row in cells for line in row[i]) + 2 for i in range(len(header))]

    def border(char):
        return "+" + "+".join(char * w for w in widths) + "+"

    out = [border("-")]
    for r, row in enumerate(cells):
        for k in range(max(len(c) for c in row)):
            out.append("|" + "|".join(" " + (c[k] if k < len(c) else "").ljust(w - 1) for c, w in zip(row, widths,
                                                                                                   strict=True)) + "|")
        out.append(border("=" if r == 0 else "-"))
    return "\n".join(out)


def simple(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    rule = " ".join("=" * w for w in widths)

    def line(row):
        return " ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return "\n".join([rule, line(header), rule, *(line(r) for r in rows), rule])


ATTR_HEADER = ["Attribute Name", "Description", "Value Type", "Supported Values", "Required or Optional"]
ARG_HEADER = ["Index", "Argument Name", "Required or Optional"]
ATTR_ROWS = [["|attr_alpha|", "Slope", "f32", "Arbitrary f32 value", "Required"]]
IN_ROWS = [["0", "``src``", "Required"], ["1", "``diff_dst``", "Required"]]
OUT_ROWS = [["0", "``diff_src``", "Required"]]
TYPES = simple(["Src / Diff_dst", "Diff_src"], [["f32", "f32"], ["bf16", "bf16"]])


def document(*, title="OpName", intro="OpName does a thing.", attributes: str | None = None,
             inputs: str | None = None, outputs: str | None = None, types: str | None = None,
             notes: str = "", head: str = "") -> str:
    attributes = grid(ATTR_HEADER, ATTR_ROWS) if attributes is None else attributes
    inputs = simple(ARG_HEADER, IN_ROWS) if inputs is None else inputs
    outputs = simple(ARG_HEADER, OUT_ROWS) if outputs is None else outputs
    types = TYPES if types is None else types
    return f"""{head}

{title}
{"#" * len(title)}

{intro}

Operation Attributes
********************

{attributes}

Execution Arguments
*******************

Inputs
======

{inputs}

Outputs
=======

{outputs}

{notes}

Supported Data Types
********************

{types}
"""


def parse(text: str, source: str = "doc.rst", **kwargs):
    return onednn.parse(text, source, **kwargs)


def attribute(values: str, value_type: str = "string", marker: str = "Optional") -> Attribute:
    """The single attribute of a document whose Supported Values cell is ``values``."""
    rows = [["|attr_x|", "An attribute", value_type, values.split("\n"), marker]]
    return parse(document(attributes=grid(ATTR_HEADER, rows))).attributes[0]


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


# -- title, description, attributes ------------------------------------------------------------------------
def test_title_is_the_op_name_and_first_paragraphs_the_description():
    schema = parse(document(title="FancyOp", intro="First paragraph\nover two lines.\n\nSecond one.\n\n"
                                                 ".. math::\n\n   x = y\n\nAfter the formula."))
    assert (schema.name, schema.domain, schema.dialect, schema.version) == ("FancyOp", "onednn", "onednn", 1)
    assert schema.description == "First paragraph over two lines.\n\nSecond one."


def test_attribute_grid_table_with_multi_line_cells():
    rows = [["|attr_alpha|", ["A number", "spread over", "three lines"], "f32", ["Arbitrary", "f32 value"],
             "Required"]]
    (alpha,) = parse(document(attributes=grid(ATTR_HEADER, rows))).attributes
    assert alpha == Attribute("alpha", "f32", True, None, (), "A number spread over three lines")


def test_substitution_resolved_through_include_relative_to_the_document(tmp_path):
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "subs.inc.rst").write_text(".. |attr_alpha| replace:: :any:`negative_slope<x::y>`\n")
    doc = tmp_path / "ops" / "Op.rst"
    doc.parent.mkdir()
    doc.write_text(document(head=".. include:: ../inc/subs.inc.rst"))
    assert [a.name for a in parse_spec(doc, "onednn").attributes] == ["negative_slope"]


def test_substitution_resolved_through_include_dirs_by_file_name(tmp_path):
    (tmp_path / "subs.inc.rst").write_text(".. |attr_alpha| replace:: negative_slope\n")
    text = document(head=".. include:: ../../somewhere/else/subs.inc.rst")
    assert [a.name for a in parse(text).attributes] == ["alpha"]
    assert [a.name for a in parse(text, include_dirs=(tmp_path,)).attributes] == ["negative_slope"]


def test_substitution_without_definition_reads_as_the_bare_attribute_name():
    assert [a.name for a in parse(document()).attributes] == ["alpha"]


def test_substitution_defined_in_the_document_itself_wins():
    text = document(head=".. |attr_alpha| replace:: slope")
    assert [a.name for a in parse(text).attributes] == ["slope"]


@pytest.mark.parametrize(("value_type", "values", "expected"), [
    ("f32", "A positive f32 value", "f32"),
    ("s64", "A s64 value", "s64"),
    ("s64", "A s64 list containing\npositive values", "s64[]"),
    ("f32", "A f32 list", "f32[]"),
    ("s64[]", "Any", "s64[]"),
    ("string", "``a``, ``b``", "string"),
    ("bool", "``true``, ``false``", "bool"),
    ("boolean", "True, False", "bool"),
    ("float", "Arbitrary value", "f32"),
])
def test_attribute_value_type_normalized(value_type, values, expected):
    assert attribute(values, value_type).type == expected


@pytest.mark.parametrize(("value_type", "values", "default", "allowed"), [
    ("string", "``NCX``,\n``NXC``\n(default)", "NXC", ("NCX", "NXC")),
    ("string", "``NCX`` ,\n``NXC``\n(default)", "NXC", ("NCX", "NXC")),
    ("string", "``none``,\n``numpy``,\n(default)", "numpy", ("none", "numpy")),
    ("string", "``none``\n(default),\n``same_upper``,\n``valid``", "none", ("none", "same_upper", "valid")),
    ("string", "``nearest``,\n``linear``", None, ("nearest", "linear")),
    ("bool", "``true``\n(default),\n``false``", True, (True, False)),
    ("bool", "``false``,\n``true``\n(default)", True, (False, True)),
    ("bool", "True, False", None, (True, False)),
    ("s64", "Arbitrary\ns64 value\n(``1`` in\ndefault)", 1, ()),
    ("s64", "Arbitrary\ns64 value\n(``-1`` in\ndefault)", -1, ()),
    ("s64", "A positive\ns64 value,\n``1`` by\ndefault", 1, ()),
    ("s64", "A s64 value\nin the\nrange of\n[-r, r-1]\nwhere r =\nrank(src),\n``1`` by\ndefault", 1, ()),
    ("s64", "[-r,r-1],where\nr=rank(src).\n-1 is default", -1, ()),
    ("f32", "Arbitrary\npositive\nf32 value,\n``1e-5``\n(default)", 1e-5, ()),
    ("s64", "A s64 list\ncontaining\npositive\nvalues,\n``none`` is\ndefault", None, ()),
    ("f32", "A f32 list,\n``none`` is\ndefault", None, ()),
    ("s64", "A s64 list\nvalues.\nEmpty list(default)", [], ()),
    ("s64", "A s64 list\ncontaining\npositive\nvalues, a\nlist of\n``1`` s\n(default)\nmeans no\ndilation", 1, ()),
    ("s64", "A s64 list\ncontaining\nvalues, all\nzeros by\ndefault", 0, ()),
    ("s64", "A s64 value,\ndefault is 4", 4, ()),
    ("f32", "A f32 list\n(only one\nelement if\nqtype is\n``per_tensor``)", None, ()),
    ("f32", "A positive\nf32 value", None, ()),
])
def test_supported_values_default_and_allowed(value_type, values, default, allowed):
    attr = attribute(values, value_type)
    assert (attr.default, attr.allowed_values) == (default, allowed)
    assert type(attr.default) is type(default)


@pytest.mark.parametrize(("marker", "required"), [
    ("Required", True), ("required", True), ("REQUIRED", True), ("Required.", True),
    ("Optional", False), ("optional", False), ("*Optional*", False),
])
def test_required_or_optional_marker_variants(marker, required):
    assert attribute("Anything", "f32", marker).required is required


def test_required_attribute_ignores_a_default_marker():
    attr = attribute("``none``,\n``numpy``\n(default)", "string", "Required")
    assert (attr.required, attr.default, attr.allowed_values) == (True, None, ("none", "numpy"))


def test_prose_instead_of_an_attribute_table_means_no_attributes():
    schema = parse(document(attributes="OpName operation does not support any attribute."))
    assert schema.attributes == ()


# -- execution arguments -------------------------------------------------------------------------------
def test_argument_names_with_a_math_suffix():
    rows = [["0", "``src``", "Required"], ["1", r"``gamma`` (:math:`\gamma`)", "Optional"]]
    schema = parse(document(inputs=simple(ARG_HEADER, rows)))
    assert [(a.name, a.optional) for a in schema.inputs] == [("src", False), ("gamma", True)]


def test_argument_names_escaped_and_alternatives():
    rows = [["0", r"\src", "Required"], ["1", "``src`` / ``dst``", "required"]]
    schema = parse(document(inputs=simple(["Index", "Argument Name", "Required or Optional"], rows)))
    assert [a.name for a in schema.inputs] == ["src", "src/dst"]


def test_indexed_family_name_is_variadic():
    schema = parse(document(inputs=simple(ARG_HEADER, [["0", "``src_i``", "Required"]])))
    assert [(a.name, a.variadic) for a in schema.inputs] == [("src_i", True)]


def test_note_on_an_arbitrary_number_of_inputs_makes_the_last_input_variadic():
    schema = parse(document(notes="@note The op can accept arbitrary number of inputs."))
    assert [a.variadic for a in schema.inputs] == [False, True]
    assert [a.variadic for a in schema.outputs] == [False]


def test_prose_saying_there_are_no_outputs():
    schema = parse(document(outputs="This operation has no outputs."))
    assert schema.outputs == ()


# -- data types ----------------------------------------------------------------------------------------
def test_data_type_columns_name_arguments_and_diff_x_takes_x():
    types = simple(["Src / Diff_dst / Dst", "Mean / Gamma"], [["f32", "f32"], ["bf16", "f32, bf16"]])
    rows = [["0", "``src``", "Required"], ["1", "``diff_dst``", "Required"], ["2", "``mean``", "Required"]]
    outs = [["0", "``diff_src``", "Required"], ["1", "``diff_gamma``", "Optional"]]
    schema = parse(document(inputs=simple(ARG_HEADER, rows), outputs=simple(ARG_HEADER, outs), types=types))
    assert [a.type_var for a in schema.inputs] == ["T1", "T1", "T2"]
    assert [a.type_var for a in schema.outputs] == ["T1", "T2"]  # diff_src <- src, diff_gamma <- gamma
    assert schema.type_constraints == (("T1", ("f32", "bf16")), ("T2", ("f32", "bf16")))
    assert schema.type_combinations == ((("T1", "f32"), ("T2", "f32")), (("T1", "bf16"), ("T2", "f32")),
                                        (("T1", "bf16"), ("T2", "bf16")))


def test_argument_not_named_in_any_header_takes_the_first_column():
    types = simple(["Src", "Scale"], [["f32", "f32"], ["f16", "f32"]])
    outs = [["0", "``out``", "Required"]]
    rows = [["0", "``src``", "Required"], ["1", "``scale``", "Required"]]
    schema = parse(document(inputs=simple(ARG_HEADER, rows), outputs=simple(ARG_HEADER, outs), types=types))
    assert [a.type_var for a in schema.inputs + schema.outputs] == ["T1", "T2", "T1"]


def test_columns_equal_in_every_row_are_one_variable_named_t():
    schema = parse(document())  # Src / Diff_dst | Diff_src, rows f32 f32 and bf16 bf16
    assert {a.type_var for a in schema.inputs + schema.outputs} == {"T"}
    assert schema.type_constraints == (("T", ("f32", "bf16")),)
    assert schema.type_combinations == ((("T", "f32"),), (("T", "bf16"),))


def test_prose_instead_of_a_data_type_table_leaves_arguments_untyped():
    schema = parse(document(types="OpName supports arbitrary data type combinations."))
    assert [a.type_var for a in schema.inputs] == [None, None]
    assert schema.type_constraints == ()


# -- notes, stubs, detection ---------------------------------------------------------------------------
def test_notes_become_numbered_constraints_naming_arguments():
    notes = ("@note ``diff_dst`` must match\n``src`` in shape.\n\n"
             "@note Values of |attr_alpha| below zero are clipped.")
    schema = parse(document(notes=notes))
    assert schema.constraints == (
        Constraint("C1", "diff_dst must match src in shape.", ("diff_dst", "src")),
        Constraint("C2", "Values of alpha below zero are clipped.", ()),
    )


def test_stub_page_without_tables_is_an_empty_schema():
    schema = parse("Stub\n####\n\nThis page will describe the Stub op.\n")
    assert (schema.name, schema.description, schema.inputs, schema.outputs, schema.attributes) == \
        ("Stub", "This page will describe the Stub op.", (), (), ())
    assert dict(schema.extra) == {"stub": True}


def test_looks_like_scores_onednn_documents_only():
    assert onednn.looks_like(document()) > 0.5
    assert onednn.looks_like(document(intro="Example::\n\n    # a comment in a code block")) > 0.5
    assert onednn.looks_like("**Versioned name**: *Op-1*\n\nOperation Attributes\n") == 0
    ngraph = "Inputs\n------\n\n+------+--------------+-------+\n| Name | Element Type | Shape |\n"
    assert onednn.looks_like(ngraph) == 0
    assert onednn.looks_like("---\nUID: NS\n---\n\n# DML_X struct\n\n## -struct-fields\n") == 0


def test_looks_like_rejects_the_other_dialects_corpora(shared_dir):
    for folder in ("opset_v0", "ngraph", "directml"):
        for path in sorted((shared_dir / "corpus" / folder).iterdir()):
            assert onednn.looks_like(read_spec_text(path)) == 0, path
    for seed in sorted((shared_dir / "seeds").glob("00[123]_*.txt")):
        assert onednn.looks_like(read_spec_text(seed)) == 0, seed


# -- malformed documents -------------------------------------------------------------------------------
MALFORMED = {
    "inputs table without the Required column": (
        dict(inputs=simple(["Index", "Argument Name"], [["0", "``src``"]])),
        "Index", "expected a required or optional column"),
    "duplicate argument names": (
        dict(inputs=simple(ARG_HEADER, [["0", "``src``", "Required"], ["1", "``src``", "Required"]])),
        "1     ``src``", "'src' is listed twice"),
    "index out of order": (
        dict(inputs=simple(ARG_HEADER, [["0", "``src``", "Required"], ["2", "``diff_dst``", "Required"]])),
        "2     ``diff_dst``", "expected input index 1"),
    "unknown Required/Optional marker": (
        dict(outputs=simple(ARG_HEADER, [["0", "``diff_src``", "Sometimes"]])),
        "Sometimes", "expected 'Required' or 'Optional'"),
    "missing marker cell": (
        dict(outputs=simple(ARG_HEADER, [["0", "``diff_src``", ""]])),
        "``diff_src``", "expected 'Required' or 'Optional'"),
    "unknown attribute marker": (
        dict(attributes=grid(ATTR_HEADER, [["|attr_a|", "x", "f32", "y", "Perhaps"]])),
        "Perhaps", "expected 'Required' or 'Optional'"),
    "attribute table without Value Type": (
        dict(attributes=grid(["Attribute Name", "Description", "Required or Optional"],
                             [["|attr_a|", "x", "Required"]])),
        "Attribute Name", "expected a value type column"),
    "unknown value type": (
        dict(attributes=grid(ATTR_HEADER, [["|attr_a|", "x", "quaternion", "y", "Required"]])),
        "quaternion", "expected a value type"),
    "default of the wrong type": (
        dict(attributes=grid(ATTR_HEADER, [["|attr_a|", "x", "s64", "``many`` (default)", "Optional"]])),
        "many", "expected a s64 value"),
    "duplicate attribute": (
        dict(attributes=grid(ATTR_HEADER, [["|attr_a|", "x", "f32", "y", "Required"],
                                           ["|attr_a|", "z", "f32", "y", "Required"]])),
        "| z ", "attribute 'a' is listed twice"),
    "argument name that is not a name": (
        dict(inputs=simple(ARG_HEADER, [["0", "the source tensor", "Required"]])),
        "the source tensor", "expected an argument name"),
    "unknown data type": (
        dict(types=simple(["Src", "Dst"], [["f32", "f33"]])),
        "f33", "expected a data type"),
    "empty data type cell": (
        dict(types=simple(["Src", "Dst", "Extra"], [["f32", "", "f32"]])),
        "f32     f32", "expected data types"),
    "include without a file name": (
        dict(head=".. include::"),
        ".. include::", "expected a file name"),
    "inputs section without a table": (
        dict(inputs="The inputs are described elsewhere."),
        "Inputs", "expected an inputs table"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_document_raises_spec_error_with_file_and_line(case):
    kwargs, needle, message = MALFORMED[case]
    text = document(**kwargs)
    with pytest.raises(SpecError) as info:
        parse(text, "bad.rst")
    err = info.value
    assert err.source == "bad.rst" and err.line is not None
    assert message in err.message
    assert str(err).startswith(f"bad.rst:{err.line}: ")
    assert abs(err.line - line_of(text, needle)) <= 2, (err.line, line_of(text, needle))


def test_document_without_a_title_raises_spec_error():
    with pytest.raises(SpecError, match=r"^x\.rst:1: expected a document title"):
        parse("Just a paragraph.\n", "x.rst")


def test_document_with_arguments_but_no_outputs_section_raises_spec_error():
    text = document().replace("Outputs\n=======", "More\n====")
    with pytest.raises(SpecError, match=r"^x\.rst:\d+: expected an 'Outputs' section"):
        parse(text, "x.rst")


# -- the seed and the project's own spec document ------------------------------------------------------
def facts(schema):
    return {
        "name": schema.name,
        "inputs": [(a.name, a.optional, a.variadic, a.type_var) for a in schema.inputs],
        "outputs": [(a.name, a.optional, a.variadic, a.type_var) for a in schema.outputs],
        "attributes": [(a.name, a.type, a.required, a.default, a.allowed_values) for a in schema.attributes],
        "type_constraints": schema.type_constraints,
        "type_combinations": schema.type_combinations,
        "constraints": [(c.label, c.arguments) for c in schema.constraints],
    }


BATCH_NORM_FACTS = {
    "name": "BatchNormTrainingBackward",
    "inputs": [("src", False, False, "T1"), ("diff_dst", False, False, "T1"), ("mean", False, False, "T2"),
               ("variance", False, False, "T2"), ("gamma", True, False, "T2")],
    "outputs": [("diff_src", False, False, "T1"), ("diff_gamma", True, False, "T2"), ("diff_beta", True, False, "T2")],
    "attributes": [("epsilon", "f32", True, None, ()), ("data_format", "string", False, "NXC", ("NCX", "NXC"))],
    "type_constraints": (("T1", ("f32", "bf16", "f16")), ("T2", ("f32", "bf16"))),
    "type_combinations": ((("T1", "f32"), ("T2", "f32")), (("T1", "bf16"), ("T2", "f32")),
                          (("T1", "bf16"), ("T2", "bf16")), (("T1", "f16"), ("T2", "f32"))),
    "constraints": [("C1", ("diff_gamma", "diff_beta", "gamma"))],
}


def test_project_spec_document_has_the_batch_norm_facts():
    schema = parse_spec(SPEC, "onednn")
    assert facts(schema) == BATCH_NORM_FACTS
    assert onednn.looks_like(read_spec_text(SPEC)) == 1.0


def test_project_spec_document_includes_its_own_substitutions():
    document_tree = onednn.parse_rst(read_spec_text(SPEC), str(SPEC))
    paths = onednn._include_paths(document_tree, str(SPEC), ())
    assert paths == [(ROOT / "specs" / "_include" / "replacements.inc.rst").resolve()]
    assert onednn._include_definitions(str(paths[0])) == {"attr_epsilon": "epsilon", "attr_data_format": "data_format"}


def test_seed_yields_the_same_facts_as_the_project_spec(shared_dir):
    seed = parse_spec(shared_dir / SEED, "onednn")
    assert facts(seed) == facts(parse_spec(SPEC, "onednn"))


# -- the upstream corpus against oneDNN v3.2's C++ schemas ----------------------------------------------
# Facts the documents do not state (or state differently from the C++ definitions); each is narrow.
DOC_ONLY_ATTRIBUTES = {
    ("ConvTransposeBackwardData", "output_padding"): "documented, but v3.2's C++ schema declares no such attribute",
}
ATTRIBUTE_TYPE_EXCEPTIONS = {
    ("AvgPoolBackward", "src_shape"): "the row is a copy of data_format (string, NCX/NXC); C++ declares s64[]",
    ("StaticReshape", "shape"): "the row is a copy of auto_broadcast (string, none/numpy); C++ declares s64[]",
    ("SoftPlus", "beta"): "the document says s64; C++ declares f32",
}
DEFAULT_EXCEPTIONS = {
    ("AvgPoolBackward", "src_shape"): "the copied data_format row says NXC; C++ defaults to a zero-filled list",
    ("ConvolutionBackwardWeights", "weights_shape"): "the document states no default; C++ zero-fills the list",
}
ARGUMENT_TYPE_EXCEPTIONS = {
    ("AvgPoolBackward", "src_shape"): "the data-type table says s64; C++ declares s32",
}
# C++ gives independent type variables where the document's table only lists rows of equal types.
TYPE_VARIABLE_EXCEPTIONS = {
    "Divide": "C++ has T1/T2/T3 independent; the table rows tie src_0, src_1 and dst",
    "Multiply": "C++ has T1/T2/T3 independent; the table rows tie src_0, src_1 and dst",
    "Wildcard": "no data-type table (prose: arbitrary combinations); C++ says 'any'",
    "AvgPoolBackward": "C++ names its variables T and T1; the rule names two variables T1 and T2",
}


def _expected_ops(shared_dir):
    return json.loads((shared_dir / "corpus" / "onednn" / "expected_schemas.json").read_text())["ops"]


@pytest.fixture(scope="module")
def corpus(shared_dir):
    folder = shared_dir / "corpus" / "onednn"
    schemas = {}
    for path in sorted(folder.glob("*.rst")):
        schema = parse_spec(path, "onednn", include_dirs=(folder / "_include",))
        schemas[schema.name] = schema
    return schemas


def test_every_corpus_document_parses(shared_dir, corpus):
    assert len(corpus) == len(list((shared_dir / "corpus" / "onednn").glob("*.rst")))
    assert {op["name"] for op in _expected_ops(shared_dir)} <= set(corpus)


def _same_default(ours, theirs) -> bool:
    if isinstance(theirs, dict) and "repeat" in theirs:  # C++ per-axis fill; the parser keeps the element
        return ours == theirs["repeat"]
    if isinstance(theirs, str):
        return isinstance(ours, str) and ours.lower() == theirs.lower()
    if isinstance(theirs, float):
        return isinstance(ours, (int, float)) and math.isclose(ours, theirs, rel_tol=1e-6)
    return ours == theirs and type(ours) is type(theirs)


def test_corpus_matches_the_cpp_schemas(shared_dir, corpus):
    problems = []
    for op in _expected_ops(shared_dir):
        name = op["name"]
        schema = corpus[name]
        for kind, ours, theirs in (("input", schema.inputs, op["inputs"]), ("output", schema.outputs, op["outputs"])):
            got = [(a.name, a.optional, a.variadic) for a in ours]
            want = [(a["name"], a["optional"], a["variadic"]) for a in theirs]
            if got != want:
                problems.append(f"{name} {kind}s {got} != {want}")
        attrs = {a.name: a for a in schema.attributes}
        want_names = {a["name"] for a in op["attrs"]}
        extra = {n for n in set(attrs) - want_names if (name, n) not in DOC_ONLY_ATTRIBUTES}
        if extra or want_names - set(attrs):
            problems.append(f"{name} attributes {sorted(attrs)} != {sorted(want_names)}")
        for want in op["attrs"]:
            got = attrs.get(want["name"])
            if got is None:
                continue
            key = (name, want["name"])
            if got.required != want["required"]:
                problems.append(f"{key} required {got.required}")
            if key not in ATTRIBUTE_TYPE_EXCEPTIONS and got.type != want["type"]:
                problems.append(f"{key} type {got.type} != {want['type']}")
            if key not in DEFAULT_EXCEPTIONS:
                if want["has_default"] and not _same_default(got.default, want["default"]):
                    problems.append(f"{key} default {got.default!r} != {want['default']!r}")
                if not want["has_default"] and got.default is not None:
                    problems.append(f"{key} default {got.default!r}, expected none")
            if want.get("candidates") and {str(v).lower() for v in got.allowed_values} != \
                    {str(v).lower() for v in want["candidates"]}:
                problems.append(f"{key} allowed {got.allowed_values} != {want['candidates']}")
        problems += _type_problems(schema, op)
    assert problems == []


def _type_problems(schema, op) -> list[str]:
    name, problems = schema.name, []
    if name in TYPE_VARIABLE_EXCEPTIONS and name != "AvgPoolBackward":
        return problems
    constraint = schema.type_constraint_map
    ours = list(schema.inputs + schema.outputs)
    theirs = op["inputs"] + op["outputs"]
    for arg, want in zip(ours, theirs, strict=True):
        if (name, arg.name) not in ARGUMENT_TYPE_EXCEPTIONS and \
                set(constraint.get(arg.type_var, ())) != set(want["dtypes"]):
            problems.append(f"{name} {arg.name} types {constraint.get(arg.type_var)} != {want['dtypes']}")
    # Which arguments share a variable must agree; the variable names too, where C++ names them the same way.
    if name not in TYPE_VARIABLE_EXCEPTIONS:
        if [a.type_var for a in ours] != [w["dtype_var"] for w in theirs]:
            problems.append(f"{name} type vars {[a.type_var for a in ours]} != {[w['dtype_var'] for w in theirs]}")
    else:
        renaming = dict(zip((a.type_var for a in ours), (w["dtype_var"] for w in theirs), strict=True))
        if [renaming[a.type_var] for a in ours] != [w["dtype_var"] for w in theirs] or \
                len(set(renaming.values())) != len(renaming):
            problems.append(f"{name} type-variable sharing differs")
    return problems


# -- robustness ----------------------------------------------------------------------------------------
@given(st.data())
def test_damaged_documents_give_a_schema_or_a_spec_error(data):
    """Dropping, duplicating or truncating lines never escapes as anything but SpecError."""
    lines = read_spec_text(SPEC).splitlines()
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(lines) - 1))
        action = data.draw(st.sampled_from(["drop", "duplicate", "truncate"]))
        if action == "drop":
            del lines[i]
        elif action == "duplicate":
            lines.insert(i, lines[i])
        else:
            lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])))]
        if not lines:
            lines = [""]
    try:
        schema = parse("\n".join(lines), "damaged.rst")
    except SpecError as err:
        assert err.source == "damaged.rst"
    else:
        assert schema.name
