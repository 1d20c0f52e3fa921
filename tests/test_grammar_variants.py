"""Grammar variants of real upstream documents (issue 13): each one a small inline document with exact facts.

Every variant is well formed: it parses to a schema; the unusual ones also carry warnings
(``OpSchema.warnings``), which ``oplower schema`` prints and ``--strict`` turns into errors.
"""

from __future__ import annotations

import textwrap

import pytest

from lowering.cli import main
from opdef.errors import SpecError
from opdef.parse import parse_spec_text
from opdef.registry import load_schemas
from opdef.schema import SpecWarning, TypeRule


def parse(text: str, dialect: str | None = None, source: str = "doc.rst"):
    return parse_spec_text(textwrap.dedent(text), source, dialect)


def args(arguments):
    return [(a.name, a.optional, a.type_var) for a in arguments]


def attrs(attributes):
    return [(a.name, a.type, a.required, a.default) for a in attributes]


def warned(schema) -> list[tuple[int | None, str]]:
    return [(w.line, w.message) for w in schema.warnings]


# -- oneDNN Graph (RST tables) -------------------------------------------------------------------------------

ONEDNN_INPUTS = """\
    Inputs
    ======

    ===== ============= ====================
    Index Argument Name Required or Optional
    ===== ============= ====================
    0     ``src``       Required
    ===== ============= ====================
"""

ONEDNN_NO_OUTPUT = """\
    End
    ###

    End marks where a tensor's uses end.

    Operation Attributes
    ********************

    End operation does not support any attribute.

    Execution Arguments
    *******************

""" + ONEDNN_INPUTS + """
    Outputs
    =======

    {sentence}
"""


@pytest.mark.parametrize("sentence", [
    "This operation has no output tensor.",
    "End operation does not support output tensor.",
    "The operation doesn't produce any outputs.",
])
def test_onednn_outputs_section_saying_there_are_none_gives_zero_outputs(sentence):
    s = parse(ONEDNN_NO_OUTPUT.format(sentence=sentence), "onednn")
    assert s.name == "End"
    assert args(s.inputs) == [("src", False, None)]
    assert s.outputs == ()
    assert s.attributes == ()
    assert s.warnings == ()


def test_onednn_outputs_prose_that_denies_nothing_is_still_a_spec_error():
    text = ONEDNN_NO_OUTPUT.format(sentence="The output is written in place.")
    with pytest.raises(SpecError, match=r"doc\.rst:\d+: expected an outputs table"):
        parse(text, "onednn")


ONEDNN_MATH = """\
    .. include:: ../../replacements.inc.rst

    Pow
    ###

    ## General

    Pow raises every element of the input to the power :math:`\\beta`.

    ## Operation attributes

    +-------------+----------------+------------+--------------+-------------+
    |  Attribute  | Description    | Value Type |  Supported   | Required or |
    |     Name    |                |            |    Values    |  Optional   |
    +=============+================+============+==============+=============+
    | |attr_beta| | exponent,      | f32        | Arbitrary    |  Required   |
    |             | :math:`\\beta`  |            | f32 value    |             |
    |             | in the         |            |              |             |
    |             | formula.       |            |              |             |
    +-------------+----------------+------------+--------------+-------------+
    | ``alpha``   | :math:`\\alpha` | f32        | ``1.0``      | Optional    |
    |             | scales it.     |            | (default)    |             |
    +-------------+----------------+------------+--------------+-------------+

""" + ONEDNN_INPUTS + """
    Outputs
    =======

    ===== ============= ====================
    Index Argument Name Required or Optional
    ===== ============= ====================
    0     ``dst``       Required
    ===== ============= ====================

    Supported Data Types
    ********************

    ==== ====
    Src  Dst
    ==== ====
    f32  f32
    f16  f16
    ==== ====
"""


def test_onednn_attribute_rows_with_inline_math_under_markdown_headings_keep_their_attributes():
    s = parse(ONEDNN_MATH)  # the dialect is detected although the page has "## ..." lines
    assert s.dialect == "onednn"
    assert attrs(s.attributes) == [("beta", "f32", True, None), ("alpha", "f32", False, 1.0)]
    assert s.attribute("beta").description == "exponent, \\beta in the formula."
    assert args(s.inputs) == [("src", False, "T")]
    assert args(s.outputs) == [("dst", False, "T")]
    assert s.description == "Pow raises every element of the input to the power \\beta."
    assert warned(s) == [
        (6, "Markdown heading '## General' in an RST page; read as the section 'General'"),
        (10, "Markdown heading '## Operation attributes' in an RST page; read as the section 'Operation attributes'"),
    ]


def test_onednn_attribute_row_with_math_in_a_plain_page_has_no_warning():
    text = ONEDNN_MATH.replace("## General\n", "General\n    =======").replace(
        "## Operation attributes\n", "Operation Attributes\n    ********************")
    s = parse(text)
    assert [a.name for a in s.attributes] == ["beta", "alpha"]
    assert s.warnings == ()


def test_onednn_table_cut_short_is_a_spec_error_not_a_page_without_attributes():
    lines = textwrap.dedent(ONEDNN_MATH).split("\n")
    cut = [k for k, line in enumerate(lines) if line.startswith("| ``alpha``")][0]
    lines[cut] = lines[cut][:-5]  # the row's right border is gone
    with pytest.raises(SpecError, match=r"doc\.rst:\d+: expected a well-formed table: Malformed table"):
        parse_spec_text("\n".join(lines), "doc.rst")


def test_onednn_attributes_prose_that_denies_nothing_is_read_as_none_with_a_warning():
    text = ONEDNN_NO_OUTPUT.format(sentence="This operation has no output tensor.").replace(
        "End operation does not support any attribute.", "See the Wildcard page.")
    s = parse(text, "onednn")
    assert s.attributes == ()
    assert warned(s) == [(7, "no attribute table and no sentence saying there are no attributes; read as none: "
                             "'See the Wildcard page.'")]


# -- warnings in the CLI -------------------------------------------------------------------------------------


def test_schema_command_prints_warnings_and_strict_turns_them_into_an_error(tmp_path, capsys):
    path = tmp_path / "Pow.rst"
    path.write_text(textwrap.dedent(ONEDNN_MATH), encoding="utf-8")
    assert main(["schema", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("onednn::Pow (version 1, dialect onednn)")
    assert err.splitlines() == [
        f"{path}:6: warning: Markdown heading '## General' in an RST page; read as the section 'General'",
        f"{path}:10: warning: Markdown heading '## Operation attributes' in an RST page; read as the section "
        "'Operation attributes'",
    ]
    assert main(["schema", str(path), "--strict"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1] == (f"oplower schema: error: {path}:6: Markdown heading '## General' in an RST page; "
                                    "read as the section 'General' (and 1 more); --strict makes warnings errors")
    assert "Traceback" not in err


def test_schema_command_json_lists_the_warnings(tmp_path, capsys):
    import json

    path = tmp_path / "Pow.rst"
    path.write_text(textwrap.dedent(ONEDNN_MATH), encoding="utf-8")
    assert main(["schema", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [w["line"] for w in data["warnings"]] == [6, 10]


def test_bundled_specs_parse_without_warnings_and_strict_passes(capsys):
    assert all(entry.schema.warnings == () for entry in load_schemas())
    assert main(["schema", "--strict"]) == 0
    assert capsys.readouterr().err == ""


def test_spec_warning_formats_as_one_line():
    assert str(SpecWarning("a.rst", 3, "odd")) == "a.rst:3: warning: odd"
    assert str(SpecWarning("a.rst", None, "odd")) == "a.rst: warning: odd"


# -- oneDNN Graph opset (bullet grammar) ---------------------------------------------------------------------

OPSET = """\
    --------
    TypeCast
    --------

    **Versioned name**: *TypeCast-1*

    **Category**: *Conversion*

    **Short description**: converts the element type of a tensor.

    {attributes}

    **Inputs**

    * **1**: ``input`` - the tensor. **Required.**

      * **Type**: T1

    **Outputs**

    * **1**: ``output`` - the converted tensor.

      * **Type**: T2

    **Types**

    * *T1*: f32, f16, bf16.
    * *T2*: f32, f16, bf16.
    {constraints}
"""

ATTRIBUTE_LIST = """\
* *axis*

      * **Description**: the axis.
      * **Type**: s64
      * **Default value**: 1
      * **Required**: *no*

    * *mode*

      * **Description**: how.
      * **Range of values**: *up* or *down*
      * **Type**: string
      * **Required**: *yes*"""


def opset_doc(attributes: str, constraints: str = "") -> str:
    return OPSET.format(attributes=attributes, constraints=constraints)


def test_opset_attributes_label_and_first_bullet_on_one_line():
    s = parse(opset_doc("**Attributes**: " + ATTRIBUTE_LIST), "opset_v0")
    expected = parse(opset_doc("**Attributes**:\n\n    " + ATTRIBUTE_LIST), "opset_v0")
    assert attrs(s.attributes) == [("axis", "s64", False, 1), ("mode", "string", True, None)]
    assert s.attribute("mode").allowed_values == ("up", "down")
    assert s == expected  # the same facts as with the line break in place
    assert args(s.inputs) == [("input", False, "T1")] and args(s.outputs) == [("output", False, "T2")]
    assert warned(s) == [(11, "**Attributes**: and its first item share a line (a lost line break); read as a "
                              "label and a list")]
    assert expected.warnings == ()


@pytest.mark.parametrize("label", ["**Attributes**:", "**Attributes**"])
def test_opset_attributes_label_and_first_bullet_without_a_space_parse_like_the_spaced_form(label):
    # "**Attributes**:* *axis*" with the properties indented two spaces under that first item (issue 23)
    s = parse(opset_doc(label + ATTRIBUTE_LIST), "opset_v0")
    spaced = parse(opset_doc(label + " " + ATTRIBUTE_LIST), "opset_v0")
    assert attrs(s.attributes) == [("axis", "s64", False, 1), ("mode", "string", True, None)]
    assert s.attribute("axis").description == "the axis."
    assert s.attribute("mode").allowed_values == ("up", "down")
    assert args(s.inputs) == [("input", False, "T1")] and args(s.outputs) == [("output", False, "T2")]
    assert s == spaced
    assert warned(s) == [(11, f"{label} and its first item share a line (a lost line break); read as a label and "
                              "a list")]


def test_opset_single_attribute_on_the_label_line_without_a_space():
    # once "expected an attribute item '* *name*', got 'Description: the axis.'": the indented properties
    # were read as the list of attributes
    one = ATTRIBUTE_LIST.split("\n\n    * *mode*")[0]
    s = parse(opset_doc("**Attributes**:" + one), "opset_v0")
    assert attrs(s.attributes) == [("axis", "s64", False, 1)]
    assert s.attribute("axis").description == "the axis."
    assert warned(s) == [(11, "**Attributes**: and its first item share a line (a lost line break); read as a "
                              "label and a list")]
    broken = parse(opset_doc("**Attributes**:\n\n    " + one), "opset_v0")
    assert (s.attributes, s.inputs, s.outputs) == (broken.attributes, broken.inputs, broken.outputs)
    assert broken.warnings == ()


def test_opset_attributes_label_over_an_indented_sentence_means_no_attributes():
    s = parse(opset_doc("**Attributes**:\n\n      No attributes available."), "opset_v0")
    assert s.attributes == ()
    assert args(s.inputs) == [("input", False, "T1")]
    assert s.warnings == ()


def test_opset_attributes_label_over_prose_that_denies_nothing_warns():
    s = parse(opset_doc("**Attributes**:\n\n      See the Convert operation."), "opset_v0")
    assert s.attributes == ()
    assert warned(s) == [(11, "no list after this label, only prose; read as no attributes: "
                              "'See the Convert operation.'")]


SEVERAL_CLAUSES = ("* Constraints: When *T1* is f32, *T2* should be f16 or bf16; when *T1* is f16 or bf16, "
                   "*T2* should be f32.")


def _legal(schema) -> set[tuple[str, str]]:
    """The (T1, T2) pairs no type rule forbids, read the way opdef.verify checks a TypeRule."""
    domains = schema.type_constraint_map
    return {(t1, t2) for t1 in domains["T1"] for t2 in domains["T2"]
            if not any(({"T1": t1, "T2": t2}[r.var] in r.types and {"T1": t1, "T2": t2}[r.when_var]
                         not in r.when_types) for r in schema.type_rules)}


def test_opset_constraint_sentence_with_several_clauses_becomes_type_rules():
    s = parse(opset_doc("**Attributes**: *TypeCast* has no attributes.", SEVERAL_CLAUSES), "opset_v0")
    assert s.type_rules == (
        TypeRule("T2", ("f32",), "T1", ("f16", "bf16"), "When T1 is f32, T2 should be f16 or bf16"),
        TypeRule("T2", ("f16", "bf16"), "T1", ("f32",), "when T1 is f16 or bf16, T2 should be f32"),
    )
    # what the sentence says, written out: f32 goes to a 16-bit type and a 16-bit type to f32
    assert _legal(s) == {("f32", "f16"), ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32")}
    assert s.constraints == () and s.warnings == ()


def test_opset_constraint_in_then_when_order_and_the_only_when_form():
    s = parse(opset_doc("**Attributes**: none.", "* Constraints: *T2* must be f32 if *T1* is bf16. "
                                                 "*T2* can be bf16 only when *T1* is bf16."), "opset_v0")
    assert _legal(s) == {("f32", "f32"), ("f32", "f16"), ("f16", "f32"), ("f16", "f16"), ("bf16", "f32")}


def test_opset_constraint_sentence_of_another_form_is_kept_verbatim():
    sentence = "T2 follows the rounding mode of T1; see the Convert notes."
    s = parse(opset_doc("**Attributes**: none.", f"* Constraints: {sentence}"), "opset_v0")
    assert s.type_rules == ()
    assert [(c.label, c.text) for c in s.constraints] == [("C1", sentence)]
    assert warned(s) == [(29, f"type constraint not in a form read as a rule; kept as constraint C1: {sentence!r}")]


# -- nGraph (grid tables) ------------------------------------------------------------------------------------

NGRAPH = """\
    #######
    Reshape
    #######

    Description
    ===========

    Reshapes a tensor.

    Inputs
    ------

    +-----------------+-------------------------+--------------------------------+
    | Name            | Element Type            | Shape                          |
    +=================+=========================+================================+
    | ``arg``         | real                    | Any                            |
    +-----------------+-------------------------+--------------------------------+

    Outputs
    -------

    +-----------------+-------------------------+--------------------------------+
    | Name            | Element Type            | Shape                          |
    +=================+=========================+================================+
    | ``output``      | Same as ``arg``         | Any                            |
    +-----------------+-------------------------+--------------------------------+

    {after}

    C++ Interface
    =============

    .. doxygenclass:: ngraph::op::v1::Reshape
       :project: ngraph
       :members:
"""

EXAMPLES = """\
+---------------+-----------------------+--------------+
    | ``arg`` Shape | ``input_order`` Value | Output Shape |
    +===============+=======================+==============+
    | (2, 3)        | (0, 1)                | (2, 3)       |
    +---------------+-----------------------+--------------+
    | (2, 3)        | (1, 0)                | (3, 2)       |
    +---------------+-----------------------+--------------+"""


def test_ngraph_example_table_after_the_outputs_table_is_not_an_argument_table():
    s = parse(NGRAPH.format(after=EXAMPLES), "ngraph")
    plain = parse(NGRAPH.format(after=""), "ngraph")
    assert (s.name, s.version) == ("Reshape", 1)
    assert [(a.name, a.type_var, a.shape) for a in s.inputs] == [("arg", "T", "Any")]
    assert [(a.name, a.type_var, a.shape) for a in s.outputs] == [("output", "T", "Any")]
    assert s.type_constraints == (("T", ("f32", "f16", "bf16", "f64")),)
    assert s == plain
    assert warned(s) == [(28, "table with columns ['arg Shape', 'input_order Value', 'Output Shape'] after the "
                              "outputs table has no Name column; read as examples, not outputs")]
    assert plain.warnings == ()


def test_ngraph_argument_table_with_wrong_columns_is_still_a_spec_error():
    no_name = NGRAPH.format(after="").replace("| Name            | Element Type", "| Tensor          | Element Type")
    with pytest.raises(SpecError, match=r"doc\.rst:\d+: expected a 'Name' column in the inputs table"):
        parse(no_name, "ngraph")
    second = EXAMPLES.replace("``arg`` Shape", "Name         ")
    with pytest.raises(SpecError, match=r"doc\.rst:\d+: expected an 'Element Type' column in the outputs table"):
        parse(NGRAPH.format(after=second), "ngraph")


def test_ngraph_output_repeating_an_input_name():
    text = NGRAPH.format(after="").replace("| ``output``      | Same as ``arg``         | Any      ",
                                           "| ``arg``         | Same as ``arg``         | Same as ``arg``")
    s = parse(text, "ngraph")
    assert [(a.name, a.type_var, a.shape) for a in s.inputs] == [("arg", "T", "Any")]
    assert [(a.name, a.type_var, a.shape) for a in s.outputs] == [("arg", "T", "Same as ``arg``")]
    assert s.type_constraints == (("T", ("f32", "f16", "bf16", "f64")),)
    assert warned(s) == [(22, "output 'arg' has the name of an input; kept as two arguments")]


# -- DirectML (Markdown) -------------------------------------------------------------------------------------

DML_TENSOR = "Type: **const [DML_TENSOR_DESC](/windows/win32/api/directml/ns-directml-dml_tensor_desc)\\\\***"

DIRECTML = f"""\
    ## Description

    Copies a tensor. **DML_IDENTITY_OPERATOR_DESC**

    ## Members

    ### `InputTensor`

    {DML_TENSOR}

    The input.

    ### `OutputTensor`

    {DML_TENSOR}

    The output.

    ## Tensor constraints
    *InputTensor* and *OutputTensor* must have the same *DataType*.

    ## Tensor support
    | Tensor | Kind | Supported dimension counts | Supported data types |
    | ------ | ---- | -------------------------- | -------------------- |
    | InputTensor | Input | 4 | FLOAT32, FLOAT16 |
    | {{out}} | Output | 4 | {{out_types}} |
"""


def test_directml_plain_page_has_no_warnings():
    s = parse(DIRECTML.format(out="OutputTensor", out_types="FLOAT32, FLOAT16"), "directml", "op.md")
    assert [(a.name, a.type_var) for a in s.inputs + s.outputs] == [("InputTensor", "T"), ("OutputTensor", "T")]
    assert s.type_constraints == (("T", ("f32", "f16")),)
    assert s.warnings == ()


def test_directml_unusual_pages_parse_with_warnings():
    renamed = parse(DIRECTML.format(out="OutputGradientTensor", out_types="FLOAT32"), "directml", "op.md")
    assert [a.name for a in renamed.outputs] == ["OutputTensor"]
    assert renamed.output("OutputTensor").types == ("f32",)
    assert warned(renamed) == [(26, "tensor-support row 'OutputGradientTensor' names no struct member; paired with "
                                    "'OutputTensor', the member no row names")]
    conflict = parse(DIRECTML.format(out="OutputTensor", out_types="UINT32"), "directml", "op.md")
    assert conflict.type_constraints == (("T", ("f32", "f16", "u32")),)
    assert warned(conflict) == [(None, "InputTensor, OutputTensor share a DataType but their tables allow no "
                                       "common type; T allows the union")]


@pytest.mark.parametrize("t1", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("t2", ["f32", "f16", "bf16"])
def test_opset_clause_rules_are_what_node_verification_checks(t1, t2):
    import onnx

    from opdef.errors import VerificationError
    from opdef.node import TensorType
    from opdef.types import ONNX_ELEM_TYPE
    from opdef.verify import infer_with_schema

    # verification binds type variables from the inputs, so T2 gets an input of its own here
    text = opset_doc("**Attributes**: none.", SEVERAL_CLAUSES).replace(
        "**Outputs**", "* **2**: ``scale`` - the scale. **Required.**\n\n      * **Type**: T2\n\n    **Outputs**")
    s = parse(text, "opset_v0")
    assert [(a.name, a.type_var) for a in s.inputs] == [("input", "T1"), ("scale", "T2")]
    node = onnx.helper.make_node("TypeCast", ["x", "s"], ["y"], name="cast", domain="onednn")
    types = {"x": TensorType(ONNX_ELEM_TYPE[t1], (2, 3)), "s": TensorType(ONNX_ELEM_TYPE[t2], (3,)), "y": None}
    legal = {("f32", "f16"), ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32")}  # the sentence, written out
    if (t1, t2) in legal:
        assert infer_with_schema(s, None, node, types).type_vars == {"T1": ONNX_ELEM_TYPE[t1],
                                                                     "T2": ONNX_ELEM_TYPE[t2]}
    else:
        with pytest.raises(VerificationError, match=r"T2 is \w+ while T1 is \w+; .*\([Ww]hen T1 is"):
            infer_with_schema(s, None, node, types)


def test_onednn_markdown_heading_without_a_blank_line_after_it_stays_text_with_a_warning():
    text = ONEDNN_MATH.replace("## General\n\n", "## General\n")
    s = parse(text)
    assert s.description.startswith("## General Pow raises")
    assert [a.name for a in s.attributes] == ["beta", "alpha"]
    assert warned(s)[0] == (6, "Markdown heading '## General' has no blank line after it; read as text")


NGRAPH_QUALIFIED = """\
    ##########
    ScatterAdd
    ##########

    Description
    ===========

    Adds updates into a tensor at the given indices.

    Inputs{inputs}
    ------{inputs_rule}

    +-----------------+-------------------------+--------------------------------+
    | Name            | Element Type            | Shape                          |
    +=================+=========================+================================+
    | ``inputs``      | real                    | Any                            |
    +-----------------+-------------------------+--------------------------------+
    | ``indices``     | element::i64            | Any                            |
    +-----------------+-------------------------+--------------------------------+
    | ``updates``     | same as ``inputs``      | Any                            |
    +-----------------+-------------------------+--------------------------------+

    Attributes{attributes}
    ----------{attributes_rule}

    +-----------------+-------------------------+--------------------------------+
    | Name            | Type                    | Notes                          |
    +=================+=========================+================================+
    | ``axis``        | ``size_t``              | default: 0                     |
    +-----------------+-------------------------+--------------------------------+

    Outputs{outputs}
    -------{outputs_rule}

    +-----------------+-------------------------+--------------------------------+
    | Name            | Element Type            | Shape                          |
    +=================+=========================+================================+
    | ``output``      | same as ``inputs``      | same as ``inputs``             |
    +-----------------+-------------------------+--------------------------------+

    C++ Interface
    =============

    .. doxygenclass:: ngraph::op::v3::ScatterAdd
       :project: ngraph
       :members:
"""


def ngraph_qualified(inputs: str = "", attributes: str = "", outputs: str = "") -> str:
    return NGRAPH_QUALIFIED.format(inputs=inputs, inputs_rule="-" * len(inputs), attributes=attributes,
                                   attributes_rule="-" * len(attributes), outputs=outputs,
                                   outputs_rule="-" * len(outputs))


def test_ngraph_section_heading_with_a_qualifier_reads_as_its_section_with_a_warning():
    s = parse(ngraph_qualified(outputs=" (in place)"), "ngraph")
    assert (s.name, s.version) == ("ScatterAdd", 3)
    assert [(a.name, a.type_var, a.shape) for a in s.inputs] == [
        ("inputs", "T1", "Any"), ("indices", "T2", "Any"), ("updates", "T1", "Any")]
    assert [(a.name, a.type_var, a.shape) for a in s.outputs] == [("output", "T1", "same as ``inputs``")]
    assert s.type_constraints == (("T1", ("f32", "f16", "bf16", "f64")), ("T2", ("s64",)))
    assert attrs(s.attributes) == [("axis", "s64", False, 0)]
    assert warned(s) == [(32, "section heading 'Outputs (in place)' has the qualifier 'in place'; read as the "
                              "section 'Outputs'")]
    plain = parse(ngraph_qualified(), "ngraph")
    assert plain.warnings == ()
    assert s.inputs == plain.inputs and s.outputs == plain.outputs and s.attributes == plain.attributes


def test_ngraph_inputs_and_attributes_headings_with_qualifiers_and_a_colon():
    s = parse(ngraph_qualified(" (in place)", " (optional):", " (in place)"), "ngraph")
    plain = parse(ngraph_qualified(), "ngraph")
    assert (s.inputs, s.outputs, s.attributes, s.type_constraints) == (
        plain.inputs, plain.outputs, plain.attributes, plain.type_constraints)
    assert [i.name for i in s.inputs] == ["inputs", "indices", "updates"]
    assert warned(s) == [
        (10, "section heading 'Inputs (in place)' has the qualifier 'in place'; read as the section 'Inputs'"),
        (23, "section heading 'Attributes (optional):' has the qualifier 'optional'; read as the section "
             "'Attributes'"),
        (32, "section heading 'Outputs (in place)' has the qualifier 'in place'; read as the section 'Outputs'"),
    ]


def test_ngraph_heading_with_a_qualifier_on_another_section_is_not_an_argument_section():
    text = ngraph_qualified().replace("    Outputs\n    -------\n", "    Examples (outputs)\n    ------------------\n")
    s = parse(text, "ngraph")
    assert s.outputs == () and s.warnings == ()
