"""The directml dialect: DirectML operator pages, rendered and upstream-source forms."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opdef.dialects import directml
from opdef.errors import SpecError
from opdef.parse import parse_spec, read_spec_text
from opdef.schema import Argument, Attribute, Constraint, OpSchema

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "directml" / "dml_batch_normalization_grad_operator_desc.md"
SEED = "seeds/003_6d4ad439f9782f59.txt"
TENSOR = "Type: **const [DML_TENSOR_DESC](/windows/win32/api/directml/ns-directml-dml_tensor_desc)\\***"


def doc(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def parse(text: str, source: str = "op.md") -> OpSchema:
    return directml.parse(doc(text), source)


def names(args) -> list[str]:
    return [a.name for a in args]


# ------------------------------------------------------------------------------------------------
# the two spellings of the grammar

RENDERED = f"""
## Description

Adds things. **DML_ELEMENT_WISE_ADD_OPERATOR_DESC** is linked from [**DML_OTHER_OPERATOR_DESC**](/x).

## Members

### `ATensor`

{TENSOR}

The left side.

### `OutputTensor`

{TENSOR}

The result.

## Availability
This operator was introduced in `DML_FEATURE_LEVEL_1_0`.

## Tensor constraints
*ATensor* and *OutputTensor* must have the same *DataType*.

## Tensor support
| Tensor | Kind | Supported dimension counts | Supported data types |
| ------ | ---- | -------------------------- | -------------------- |
| ATensor | Input | 4 | FLOAT32, FLOAT16 |
| OutputTensor | Output | 4 | FLOAT32, FLOAT16 |
"""


def test_rendered_page_name_from_unlinked_bold_and_backquoted_member_headings():
    s = parse(RENDERED)
    assert (s.name, s.domain, s.dialect, s.version) == ("ELEMENT_WISE_ADD", "directml", "directml", 1)
    assert dict(s.extra)["struct_name"] == "DML_ELEMENT_WISE_ADD_OPERATOR_DESC"
    assert s.inputs == (Argument("ATensor", type_var="T", description="The left side.", types=("f32", "f16"),
                                 min_rank=4, max_rank=4),)
    assert names(s.outputs) == ["OutputTensor"]
    assert s.type_constraints == (("T", ("f32", "f16")),)
    assert dict(s.extra)["feature_level"] == "DML_FEATURE_LEVEL_1_0"


SOURCE = f"""
---
UID: NS:directml.DML_ACTIVATION_ELU_OPERATOR_DESC
title: DML_ACTIVATION_ELU_OPERATOR_DESC (directml.h)
description: Performs an ELU.
req.include-header:
api_name:
 - DML_ACTIVATION_ELU_OPERATOR_DESC
---

## -description

Performs an ELU.

## -struct-fields

### -field InputTensor

{TENSOR}

The input.

### -field OutputTensor

{TENSOR}

The output.

### -field Alpha

Type: [**FLOAT**](/windows/desktop/winprog/windows-data-types)

The coefficient.

## Tensor support
| Tensor | Kind | Supported dimension counts | Supported data types |
| ------ | ---- | -------------------------- | -------------------- |
| InputTensor | Input | 1 to 8 | FLOAT32, FLOAT16 |
| OutputTensor | Output | 1 to 8 | FLOAT32, FLOAT16 |
| Bogus | Sideways | 1 to 8 | FLOAT32 |
"""


def test_source_form_front_matter_names_the_op_and_keeps_line_numbers():
    with pytest.raises(SpecError) as err:
        parse(SOURCE, "elu.md")
    # The line number counts the front matter's lines too.
    line = doc(SOURCE).split("\n").index("| Bogus | Sideways | 1 to 8 | FLOAT32 |") + 1
    assert err.value.line == line == 39
    assert str(err.value).startswith("elu.md:39: expected Kind 'Input' or 'Output'")
    s = parse(SOURCE.replace("| Bogus | Sideways | 1 to 8 | FLOAT32 |\n", ""))
    assert s.name == "ACTIVATION_ELU"
    assert names(s.inputs) == ["InputTensor"] and names(s.outputs) == ["OutputTensor"]
    assert s.attributes == (Attribute("Alpha", "f32", required=True, description="The coefficient."),)
    assert (s.inputs[0].min_rank, s.inputs[0].max_rank) == (1, 8)
    assert s.description == "Performs an ELU."


def test_html_type_lines_h1_name_and_html_table():
    s = parse("""
        # DML_ACTIVATION_SHRINK_OPERATOR_DESC structure

        ## -struct-fields

        ### -field InputTensor

        Type: **const [DML_TENSOR_DESC](/x)\\***

        In.

        ### -field OutputTensor

        Type: **const [DML_TENSOR_DESC](/x)\\***

        Out.

        ### -field Bias

        Type: <b><a href="https://docs.microsoft.com/windows/desktop/WinProg/windows-data-types">FLOAT</a></b>

        <b>TRUE</b> never; a float.

        ## Tensor support

        <table>
        <tr><th>Tensor</th><th>Kind</th><th>Supported dimension counts</th><th>Supported data types</th></tr>
        <tr><td>InputTensor</td><td>Input</td><td>1 to 8</td><td>FLOAT32,<br>FLOAT16</td></tr>
        <tr><td>OutputTensor</td><td>Output</td><td>1 to 8</td><td>FLOAT32, FLOAT16</td></tr>
        </table>
        """)
    assert s.name == "ACTIVATION_SHRINK"
    assert s.attributes == (Attribute("Bias", "f32", True, description="TRUE never; a float."),)
    assert s.input("InputTensor").types == ("f32", "f16")
    assert (s.output("OutputTensor").min_rank, s.output("OutputTensor").max_rank) == (1, 8)


def test_html_table_rows_report_their_own_line():
    with pytest.raises(SpecError) as err:
        parse("""
            # DML_X_OPERATOR_DESC structure

            ## -struct-fields

            ### -field InputTensor

            Type: **const [DML_TENSOR_DESC](/x)\\***

            ## Tensor support

            <table>
            <tr><th>Tensor</th><th>Kind</th><th>Supported data types</th></tr>
            <tr><td>InputTensor</td><td>Input</td><td>FLOAT 32!</td></tr>
            </table>
            """)
    assert err.value.line == 13


# ------------------------------------------------------------------------------------------------
# tensor-support tables

LEVELS = f"""
---
title: DML_ELEMENT_WISE_MULTIPLY_OPERATOR_DESC
---

## -struct-fields

### -field ATensor

{TENSOR}

### -field OutputTensor

{TENSOR}

## Tensor support
### DML_FEATURE_LEVEL_3_0 and above
| Tensor | Kind | Dimensions | Supported dimension counts | Supported data types |
| ------ | ---- | ---------- | -------------------------- | -------------------- |
| ATensor | Input | {{ D0, D1 }} | 1 to 8 | FLOAT32, FLOAT16, INT32 |
| OutputTensor | Output | {{ D0, D1 }} | 1 to 8 | FLOAT32, FLOAT16, INT32 |

### DML_FEATURE_LEVEL_1_0 and above
| Tensor | Kind | Dimensions | Supported dimension counts | Supported data types |
| ------ | ---- | ---------- | -------------------------- | -------------------- |
| ATensor | Input | {{ N, C, H, W }} | 4 to 5 | FLOAT32, UINT8 |
| OutputTensor | Output | {{ N, C, H, W }} | 4 to 5 | FLOAT32, UINT8 |
"""


def test_feature_level_tables_union_and_per_level_detail():
    s = parse(LEVELS)
    a = s.input("ATensor")
    assert a.types == ("f32", "f16", "s32", "u8")
    assert (a.min_rank, a.max_rank) == (1, 8)
    assert a.shape == "{ D0, D1 }"  # the first (newest) table's Dimensions cell
    levels = dict(dict(s.extra)["tensor_support"])
    assert list(levels) == ["DML_FEATURE_LEVEL_3_0 and above", "DML_FEATURE_LEVEL_1_0 and above"]
    assert levels["DML_FEATURE_LEVEL_1_0 and above"][0] == ("ATensor", "input", "{ N, C, H, W }", (4, 5), ("f32", "u8"))


def test_missing_dimensions_column_leaves_shape_unset():
    s = parse(RENDERED)
    assert s.input("ATensor").shape is None
    assert s.output("OutputTensor").shape is None


def test_tables_grouped_by_function_headings():
    s = parse(f"""
        ---
        title: DML_REDUCE_OPERATOR_DESC
        ---
        ## -struct-fields
        ### -field InputTensor
        {TENSOR}
        ### -field OutputTensor
        {TENSOR}
        ## Tensor support according to function
        ### ARGMIN and ARGMAX
        #### DML_FEATURE_LEVEL_3_0 and above
        | Tensor | Kind | Supported dimension counts | Supported data types |
        | ------ | ---- | -------------------------- | -------------------- |
        | InputTensor | Input | 1 to 8 | FLOAT32 |
        | OutputTensor | Output | 1 to 8 | INT64, UINT32 |
        ### SUM
        #### DML_FEATURE_LEVEL_1_0 and above
        | Tensor | Kind | Supported dimension counts | Supported data types |
        | ------ | ---- | -------------------------- | -------------------- |
        | InputTensor | Input | 4 | FLOAT16 |
        | OutputTensor | Output | 4 | FLOAT16 |
        """)
    assert [label for label, _ in dict(s.extra)["tensor_support"]] == [
        "ARGMIN and ARGMAX / DML_FEATURE_LEVEL_3_0 and above", "SUM / DML_FEATURE_LEVEL_1_0 and above"]
    assert s.output("OutputTensor").types == ("s64", "u32", "f16")
    # No "same DataType" bullet: input and output have their own type variables.
    assert s.type_constraints == (("T1", ("f32", "f16")), ("T2", ("s64", "u32", "f16")))


def test_table_row_naming_no_member_is_paired_with_the_unnamed_member():
    s = parse(f"""
        ---
        title: DML_ACTIVATION_RELU_GRAD_OPERATOR_DESC
        ---
        ## -struct-fields
        ### -field InputTensor
        {TENSOR}
        ### -field OutputTensor
        {TENSOR}
        ## Tensor constraints
        *InputTensor* and *OutputGradientTensor* must have the same *DataType*.
        ## Tensor support
        | Tensor | Kind | Supported dimension counts | Supported data types |
        | ------ | ---- | -------------------------- | -------------------- |
        | InputTensor | Input | 1 to 8 | FLOAT32 |
        | OutputGradientTensor | Output | 1 to 8 | FLOAT32 |
        """)
    assert names(s.outputs) == ["OutputTensor"]
    assert s.output("OutputTensor").types == ("f32",)
    assert dict(s.extra)["aliases"] == (("OutputGradientTensor", "OutputTensor"),)
    assert s.constraints[0].arguments == ("InputTensor", "OutputTensor")


def test_array_of_inputs_is_variadic():
    s = parse(f"""
        ---
        title: DML_JOIN_OPERATOR_DESC
        ---
        ## -struct-fields
        ### -field InputCount
        Type: [**UINT**](/x)
        ### -field InputTensors
        Type: \\_Field\\_size\\_(InputCount) **const [DML_TENSOR_DESC](/x)\\***
        ### -field OutputTensor
        {TENSOR}
        ## Tensor support
        | Tensor | Kind | Supported dimension counts | Supported data types |
        | ------ | ---- | -------------------------- | -------------------- |
        | InputTensors | Array of inputs | 4 | FLOAT32 |
        | OutputTensor | Output | 4 | FLOAT32 |
        """)
    assert s.input("InputTensors").variadic and not s.output("OutputTensor").variadic
    assert dict(s.extra)["array_counts"] == (("InputTensors", "InputCount"),)
    assert s.attributes == (Attribute("InputCount", "u32", True),)


# ------------------------------------------------------------------------------------------------
# members: optional tensors, attributes

def test_optional_tensors_from_maybenull_kind_and_text():
    s = parse(f"""
        ---
        title: DML_X_OPERATOR_DESC
        ---
        ## -struct-fields
        ### -field InputTensor
        {TENSOR}

        Read, and optionally rescaled.
        ### -field ScaleTensor
        Type: \\_Maybenull\\_ **const [DML_TENSOR_DESC](/x)\\***
        ### -field BiasTensor
        {TENSOR}

        This tensor can be null regardless of *ScaleTensor*.
        ### -field AddTensor
        {TENSOR}
        ### -field OutputTensor
        {TENSOR}
        ### -field OutputIndicesTensor
        {TENSOR}
        ## Tensor support
        | Tensor | Kind | Supported dimension counts | Supported data types |
        | ------ | ---- | -------------------------- | -------------------- |
        | InputTensor | Input | 4 | FLOAT32 |
        | ScaleTensor | Input | 4 | FLOAT32 |
        | BiasTensor | Input | 4 | FLOAT32 |
        | AddTensor | Optional input | 4 | FLOAT32 |
        | OutputTensor | Output | 4 | FLOAT32 |
        | OutputIndicesTensor | Optional output | 4 | UINT32 |
        """)
    assert [(a.name, a.optional) for a in s.inputs + s.outputs] == [
        ("InputTensor", False), ("ScaleTensor", True), ("BiasTensor", True), ("AddTensor", True),
        ("OutputTensor", False), ("OutputIndicesTensor", True)]


def test_non_tensor_members_are_attributes_with_normalized_types():
    s = parse(f"""
        ---
        title: DML_POOL_OPERATOR_DESC
        ---
        ## -struct-fields
        ### -field InputTensor
        {TENSOR}
        ### -field Epsilon
        Type: <b><a href="/x">FLOAT</a></b>
        ### -field DimensionCount
        Type: [**UINT**](/x)
        ### -field Offset
        Type: **INT**
        ### -field IncludePadding
        Type: <b><a href="/x">BOOL</a></b>
        ### -field Direction
        Type: **[DML_AXIS_DIRECTION](/x)**
        ### -field Strides
        Type: \\_Field\\_size\\_(DimensionCount) <b>const [UINT](/x)*</b>
        ### -field Scales
        Type: \\_Field\\_size\\_(DimensionCount) **const [FLOAT](/x)\\***
        ### -field FusedActivation
        Type: \\_Maybenull\\_ **const [DML_OPERATOR_DESC](/x)\\***

        An optional fused activation.
        ### -field LearningRate
        Type: **float**
        """)
    assert [(a.name, a.type, a.required) for a in s.attributes] == [
        ("Epsilon", "f32", True), ("DimensionCount", "u32", True), ("Offset", "s32", True),
        ("IncludePadding", "bool", True), ("Direction", "DML_AXIS_DIRECTION", True), ("Strides", "u32[]", True),
        ("Scales", "f32[]", True), ("FusedActivation", "DML_OPERATOR_DESC", False), ("LearningRate", "f32", True)]
    assert dict(dict(s.extra)["members"])["Strides"] == "_Field_size_(DimensionCount) const UINT*"
    assert all(a.default is None for a in s.attributes)


def test_struct_syntax_block_supplies_name_and_member_types():
    s = parse("""
        ## Syntax

        ```cpp
        struct DML_ELEMENT_WISE_IDENTITY_OPERATOR_DESC {
          const DML_TENSOR_DESC *InputTensor;   // read
          const DML_TENSOR_DESC *OutputTensor;
          const DML_SCALE_BIAS  *ScaleBias;
        };
        ```

        ## Members

        ### `InputTensor`

        The input.

        ### `OutputTensor`

        The output.

        ### `ScaleBias`

        An optional scale and bias.
        """, "page.txt")
    assert s.name == "ELEMENT_WISE_IDENTITY"
    assert names(s.inputs) == ["InputTensor"] and names(s.outputs) == ["OutputTensor"]
    assert s.attributes == (Attribute("ScaleBias", "DML_SCALE_BIAS", False, description="An optional scale and bias."),)
    assert dict(s.extra)["kind_guessed"] == ("InputTensor", "OutputTensor")


def test_old_page_without_tables_guesses_kind_from_the_member_name():
    s = parse(f"""
        ---
        title: DML_ELEMENT_WISE_ATAN_OPERATOR_DESC
        ---

        # DML_ELEMENT_WISE_ATAN_OPERATOR_DESC structure


        ## -description




        Describes an arctangent.


        ## -struct-fields




        ### -field InputTensor

        {TENSOR}

        A pointer to the tensor to read from.


        ### -field OutputTensor

        {TENSOR}

        A pointer to the tensor to write the results to.
        """)
    assert names(s.inputs) == ["InputTensor"] and names(s.outputs) == ["OutputTensor"]
    assert s.inputs[0].types == () and s.inputs[0].min_rank is None
    assert s.inputs[0].type_var is None and s.type_constraints == ()
    assert s.description == "Describes an arctangent."


def test_name_from_file_name_when_the_page_has_none():
    s = parse(RENDERED.replace("**DML_ELEMENT_WISE_ADD_OPERATOR_DESC**", "It"),
              "pages/ns-directml-dml_element_wise_add1_operator_desc.md")
    assert s.name == "ELEMENT_WISE_ADD1"


def test_stub_page_is_an_empty_schema_with_its_name():
    s = parse("""
        ---
        title: DML_FUTURE_OPERATOR_DESC
        ---
        ## -description

        Not documented yet.
        """)
    assert (s.name, s.inputs, s.outputs, s.attributes, s.constraints) == ("FUTURE", (), (), (), ())


def test_page_with_only_a_table_takes_its_rows_as_arguments():
    s = parse("""
        # DML_Y_OPERATOR_DESC structure
        ## Tensor support
        | Tensor | Kind | Supported dimension counts | Supported data types |
        | ------ | ---- | -------------------------- | -------------------- |
        | XTensor | Input | 4 | FLOAT32 |
        | OutputTensor | Output | 4 | FLOAT32 |
        """)
    assert names(s.inputs) == ["XTensor"] and names(s.outputs) == ["OutputTensor"]
    assert dict(s.extra)["members_from"] == "table"


def test_formula_lines_stay_in_the_argument_description():
    s = parse(f"""
        ---
        title: DML_G_OPERATOR_DESC
        ---
        ## -struct-fields
        ### -field OutputGradientTensor
        {TENSOR}

        For every value,
        `OutputGradient = InputGradient * (Scale / sqrt(Variance + Epsilon))`.
        """)
    assert s.outputs[0].description == (
        "For every value,\nOutputGradient = InputGradient * (Scale / sqrt(Variance + Epsilon)).")
    assert dict(s.extra)["formulas"] == (
        ("OutputGradientTensor", "OutputGradient = InputGradient * (Scale / sqrt(Variance + Epsilon))"),)


# ------------------------------------------------------------------------------------------------
# tensor constraints

CONSTRAINED = f"""
---
title: DML_MAX_POOLING2_OPERATOR_DESC
---
## -struct-fields
### -field InputTensor
{TENSOR}
### -field OutputTensor
{TENSOR}
### -field OutputIndicesTensor
Type: \\_Maybenull\\_ **const [DML_TENSOR_DESC](/x)\\***
### -field ScaleTensor
{TENSOR}
## Tensor constraints
* *InputTensor*, *OutputIndicesTensor*, and *OutputTensor* must have the same *DimensionCount*.
* *InputTensor* and *OutputTensor* must have the same *DataType*.
* *ScaleTensor* and *OutputTensor* must have the same *DataType* and *Sizes*.
* The output sizes depend on the window.
## Tensor support
| Tensor | Kind | Supported dimension counts | Supported data types |
| ------ | ---- | -------------------------- | -------------------- |
| InputTensor | Input | 4 to 5 | FLOAT32, FLOAT16, INT8 |
| OutputTensor | Output | 4 to 5 | FLOAT32, FLOAT16, INT8, UINT8 |
| OutputIndicesTensor | Optional output | 4 to 5 | UINT32, UINT64 |
| ScaleTensor | Input | 4 to 5 | FLOAT16, FLOAT32 |
"""


def test_same_datatype_bullets_share_a_type_variable_with_intersected_types():
    s = parse(CONSTRAINED)
    assert [(a.name, a.type_var) for a in s.inputs + s.outputs] == [
        ("InputTensor", "T1"), ("ScaleTensor", "T1"), ("OutputTensor", "T1"), ("OutputIndicesTensor", "T2")]
    assert s.type_constraints == (("T1", ("f32", "f16")), ("T2", ("u32", "u64")))
    # The per-argument lists stay as the table wrote them.
    assert s.output("OutputTensor").types == ("f32", "f16", "s8", "u8")


def test_every_constraint_bullet_is_numbered_with_the_tensors_it_names():
    s = parse(CONSTRAINED)
    assert s.constraints == (
        Constraint("C1", "InputTensor, OutputIndicesTensor, and OutputTensor must have the same DimensionCount.",
                   ("InputTensor", "OutputIndicesTensor", "OutputTensor")),
        Constraint("C2", "InputTensor and OutputTensor must have the same DataType.", ("InputTensor", "OutputTensor")),
        Constraint("C3", "ScaleTensor and OutputTensor must have the same DataType and Sizes.",
                   ("ScaleTensor", "OutputTensor")),
        Constraint("C4", "The output sizes depend on the window.", ()),
    )


def test_a_constraint_paragraph_counts_like_a_bullet():
    s = parse(RENDERED)
    assert s.constraints == (Constraint("C1", "ATensor and OutputTensor must have the same DataType.",
                                        ("ATensor", "OutputTensor")),)


def test_contradictory_same_datatype_falls_back_to_the_union_and_says_so():
    s = parse(CONSTRAINED.replace("| UINT32, UINT64 |", "| BOOLISH |").replace(
        "* *InputTensor* and *OutputTensor* must", "* *InputTensor*, *OutputIndicesTensor* and *OutputTensor* must"))
    assert s.type_constraints[0][0] == "T"
    assert "boolish" in s.type_constraints[0][1]
    assert dict(s.extra)["type_conflicts"][0][0] == "T"


# ------------------------------------------------------------------------------------------------
# malformed documents

@pytest.mark.parametrize(("text", "line", "message"), [
    ("---\ntitle: DML_X_OPERATOR_DESC\n\n## -struct-fields\n", 1, "never closed"),
    ("---\ntitle: DML_X_OPERATOR_DESC\nthis is not yaml\n---\n", 3, "expected 'key: value'"),
    ("---\ntitle: DML_X_OPERATOR_DESC\n---\n## -struct-fields\n### -field A\n\nNo type here.\n", 5,
     "expected a 'Type:' line"),
    ("---\ntitle: DML_X_OPERATOR_DESC\n---\n## -struct-fields\n### -field A\nType:\n", 6, "empty 'Type:' line"),
    ("---\ntitle: DML_X_OPERATOR_DESC\n---\n## -struct-fields\n### -field A\nType: ***\n", 6, "expected a C type"),
    ("---\ntitle: DML_X_OPERATOR_DESC\n---\n## -struct-fields\n### -field\nType: FLOAT\n", 5,
     "expected a struct member name"),
    ("---\ntitle: DML_X_OPERATOR_DESC\n---\n## -struct-fields\n### -field A\nType: FLOAT\n### -field A\nType: UINT\n",
     7, "documented twice"),
    ("# DML_X_OPERATOR_DESC\n## Tensor support\n| Tensor | Kind | Supported dimension counts |\n|--|--|--|\n"
     "| A | Input | many |\n", 5, "supported dimension counts"),
    ("# DML_X_OPERATOR_DESC\n## Tensor support\n| Tensor | Kind | Supported data types |\n|--|--|--|\n"
     "| A | Input |  |\n", 5, "data types"),
    ("# DML_X_OPERATOR_DESC\n## Tensor support\n| Name | Type |\n|--|--|\n| A | Input |\n", 3, "columns Tensor, Kind"),
    ("# DML_X_OPERATOR_DESC\n## Tensor support\n| Tensor | Kind |\n|--|--|\n| A | Input |\n", 3, "neither"),
    ("# DML_X_OPERATOR_DESC\n## Tensor support\n| Tensor | Kind | Supported data types |\n|--|--|--|\n"
     "|  | Input | FLOAT32 |\n", 5, "empty Tensor cell"),
    ("# DML_X_OPERATOR_DESC\n## -struct-fields\n### -field A\nType: **const DML_TENSOR_DESC\\***\n## Tensor support\n"
     "| Tensor | Kind | Supported data types |\n|--|--|--|\n| A | Input | FLOAT32 |\n| B | Input | FLOAT32 |\n", 9,
     "names no DML_TENSOR_DESC member"),
])
def test_malformed_documents_raise_spec_error_with_line(text, line, message):
    with pytest.raises(SpecError) as err:
        directml.parse(text, "bad.md")
    assert err.value.line == line
    assert message in err.value.message
    assert str(err.value).startswith(f"bad.md:{line}: ")


def test_no_name_anywhere_is_a_spec_error():
    with pytest.raises(SpecError, match="cannot find the operator's struct name"):
        directml.parse("## Members\n\n### `A`\n\nType: FLOAT\n", "<string>")
    # Bold type names and linked bold names of *other* operators are not the page's name.
    with pytest.raises(SpecError, match="cannot find the operator's struct name"):
        directml.parse(doc(RENDERED).replace("**DML_ELEMENT_WISE_ADD_OPERATOR_DESC**", "It"), "page.txt")


@given(st.text(alphabet=st.one_of(st.sampled_from(list("#|-*`_:\n <>/ab1")), st.characters()), max_size=300))
def test_arbitrary_text_gives_a_schema_or_a_spec_error(text):
    try:
        assert isinstance(directml.parse(text, "fuzz.md"), OpSchema)
    except SpecError:
        pass


@given(st.data())
def test_damaged_corpus_documents_give_a_schema_or_a_spec_error(shared_dir, data):
    files = sorted((shared_dir / "corpus" / "directml").glob("*.md")) + [shared_dir / SEED]
    lines = data.draw(st.sampled_from(files)).read_text().split("\n")
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(lines) - 1))
        how = data.draw(st.sampled_from(["drop", "copy", "poke"]))
        if how == "drop":
            del lines[i]
        elif how == "copy":
            lines.insert(i, lines[data.draw(st.integers(0, len(lines) - 1))])
        else:
            at = data.draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + data.draw(st.sampled_from(["|", "*", "`", "<b>", "\n", "- ", ":", "#"])) \
                + lines[i][at:]
    try:
        assert isinstance(directml.parse("\n".join(lines), "fuzz.md"), OpSchema)
    except SpecError:
        pass


def test_list_valued_front_matter_and_split_type_paragraph():
    s = parse(f"""
        ---
        title:
         - DML_LISTED_OPERATOR_DESC
        ---
        ## -struct-fields
        ### -field InputTensor
        {TENSOR}

        This tensor is not optional.
        """)
    assert s.name == "LISTED"
    assert not s.inputs[0].optional
    # "Type" and ":" on two lines is no type line: the member has none.
    with pytest.raises(SpecError, match="expected a 'Type:' line"):
        parse("""
            # DML_LISTED_OPERATOR_DESC
            ## -struct-fields
            ### -field Scale
            Type
            : FLOAT
            """)


@given(st.data())
def test_damaged_seed_like_documents_give_a_schema_or_a_spec_error(data):
    lines = doc(CONSTRAINED).split("\n")
    drop = data.draw(st.sets(st.integers(0, len(lines) - 1), max_size=6))
    text = "\n".join(ln for i, ln in enumerate(lines) if i not in drop)
    try:
        assert isinstance(directml.parse(text, "fuzz.md"), OpSchema)
    except SpecError:
        pass


# ------------------------------------------------------------------------------------------------
# detection

def test_looks_like_claims_both_forms_and_not_rst():
    assert directml.looks_like(doc(SOURCE)) > 0
    assert directml.looks_like(doc(RENDERED)) > 0
    rst = "BatchNorm\n#########\n\n.. note::\n   DML_TENSOR_DESC\n\nTensor support\n==============\n"
    assert directml.looks_like(rst) == 0
    assert directml.looks_like("Plain text about nothing.\n") == 0


def test_looks_like_rejects_the_other_seeds(shared_dir):
    for seed in ("000_086b69c5df1d398c.txt", "001_593e7bada2fa4e3e.txt", "002_f105ca9861223769.txt"):
        assert directml.looks_like((shared_dir / "seeds" / seed).read_text()) == 0
    assert directml.looks_like((shared_dir / SEED).read_text()) > 0


# ------------------------------------------------------------------------------------------------
# the seed, the project's spec, the corpus

def _facts(s: OpSchema):
    return (
        s.name, s.domain, s.dialect,
        [(a.name, a.optional, a.variadic, a.type_var, a.types, a.min_rank, a.max_rank, a.shape) for a in s.inputs],
        [(a.name, a.optional, a.variadic, a.type_var, a.types, a.min_rank, a.max_rank, a.shape) for a in s.outputs],
        [(a.name, a.type, a.required, a.default) for a in s.attributes],
        s.type_constraints,
        [sorted(c.arguments) for c in s.constraints],
        dict(s.extra)["feature_level"], dict(s.extra)["struct_name"],
    )


def test_spec_document_matches_the_seed(shared_dir):
    seed = parse_spec(shared_dir / SEED, dialect="directml")
    spec = parse_spec(SPEC, dialect="directml")
    assert _facts(spec) == _facts(seed)


def test_spec_document_facts():
    s = parse_spec(SPEC, dialect="directml")
    assert s.key == ("directml", "BATCH_NORMALIZATION_GRAD")
    assert names(s.inputs) == ["InputTensor", "InputGradientTensor", "MeanTensor", "VarianceTensor", "ScaleTensor"]
    assert names(s.outputs) == ["OutputGradientTensor", "OutputScaleGradientTensor", "OutputBiasGradientTensor"]
    assert not any(a.optional for a in s.inputs + s.outputs)
    assert s.attributes == (Attribute("Epsilon", "f32", True,
                                      description="Added to the variance before the square root so that the "
                                                  "division stays finite."),)
    assert s.type_constraints == (("T", ("f32", "f16")),)
    assert {(a.min_rank, a.max_rank) for a in s.inputs + s.outputs} == {(1, 8)}
    assert s.input("MeanTensor").shape == "{ MeanDimensions[] }"
    assert [c.label for c in s.constraints] == ["C1", "C2", "C3"]
    assert s.constraints[2].arguments == ("InputTensor", "InputGradientTensor", "OutputGradientTensor")
    assert "frozen" in s.description
    # Frozen statistics: no batch-statistics correction terms in the input gradient.
    assert dict(dict(s.extra)["formulas"])["OutputGradientTensor"] == (
        "OutputGradient = InputGradient * Scale / sqrt(Variance + Epsilon)")
    assert dict(s.extra)["feature_level"] == "DML_FEATURE_LEVEL_3_1"


def test_seed_formulas_are_kept(shared_dir):
    s = parse_spec(shared_dir / SEED, dialect="directml")
    assert "OutputGradient = InputGradient * (Scale / sqrt(Variance + Epsilon))" in s.output(
        "OutputGradientTensor").description
    assert s.output("OutputBiasGradientTensor").description.endswith("OutputBiasGradient = sum(InputGradient)")


def _corpus(shared_dir):
    files = sorted((shared_dir / "corpus" / "directml").glob("*.md"))
    assert len(files) >= 13
    return files


def test_every_corpus_document_parses(shared_dir):
    for path in _corpus(shared_dir):
        text = read_spec_text(path)
        assert directml.looks_like(text) > 0, path
        s = directml.parse(text, str(path))
        stem = path.stem.removeprefix("ns-directml-dml_").removesuffix("_operator_desc").upper()
        assert s.name == stem, path
        assert s.inputs and s.outputs, path
        assert dict(s.extra)["feature_level"].startswith("DML_FEATURE_LEVEL_"), path
        for a in s.inputs + s.outputs:
            assert a.types and a.min_rank is not None and a.type_var, (path, a.name)


def _corpus_schema(shared_dir, op: str) -> OpSchema:
    return parse_spec(shared_dir / "corpus" / "directml" / f"ns-directml-dml_{op}_operator_desc.md",
                      dialect="directml")


def test_corpus_batch_normalization(shared_dir):
    s = _corpus_schema(shared_dir, "batch_normalization")
    assert [(a.name, a.optional) for a in s.inputs] == [
        ("InputTensor", False), ("MeanTensor", False), ("VarianceTensor", False), ("ScaleTensor", False),
        ("BiasTensor", False)]
    assert names(s.outputs) == ["OutputTensor"]
    assert [(a.name, a.type, a.required) for a in s.attributes] == [
        ("Spatial", "bool", True), ("Epsilon", "f32", True), ("FusedActivation", "DML_OPERATOR_DESC", False)]
    assert s.input("VarianceTensor").shape == "{ VarianceDimensions[] }"
    assert (s.input("InputTensor").min_rank, s.input("InputTensor").max_rank) == (1, 8)
    assert s.type_constraints == (("T", ("f32", "f16")),)
    assert [c.arguments for c in s.constraints][1] == ("InputTensor", "OutputTensor")
    levels = dict(dict(s.extra)["tensor_support"])
    assert levels["DML_FEATURE_LEVEL_1_0 and above"][0][3] == (4, 4)


def test_corpus_batch_normalization_training_optional_fused_add(shared_dir):
    s = _corpus_schema(shared_dir, "batch_normalization_training")
    assert [(a.name, a.optional) for a in s.inputs] == [
        ("InputTensor", False), ("ScaleTensor", False), ("BiasTensor", False), ("FusedAddTensor", True)]
    assert names(s.outputs) == ["OutputTensor", "OutputMeanTensor", "OutputVarianceTensor"]
    assert len(s.constraints) == 3


def test_corpus_mean_variance_normalization1_optional_scale_and_bias(shared_dir):
    s = _corpus_schema(shared_dir, "mean_variance_normalization1")
    assert [(a.name, a.optional) for a in s.inputs] == [
        ("InputTensor", False), ("ScaleTensor", True), ("BiasTensor", True)]
    assert s.attribute("Axes").type == "u32[]"
    assert s.attribute("AxisCount").type == "u32"


def test_corpus_max_pooling2_two_type_variables(shared_dir):
    s = _corpus_schema(shared_dir, "max_pooling2")
    assert [(a.name, a.optional, a.type_var) for a in s.outputs] == [
        ("OutputTensor", False, "T1"), ("OutputIndicesTensor", True, "T2")]
    assert s.type_constraints == (("T1", ("f32", "f16", "s8", "u8")), ("T2", ("u32",)))
    assert s.attribute("Dilations").type == "u32[]"


def test_corpus_join_and_reduce_and_relu_grad(shared_dir):
    join = _corpus_schema(shared_dir, "join")
    assert join.input("InputTensors").variadic
    assert join.input("InputTensors").types == ("f32", "f16", "s32", "s16", "s8", "u32", "u16", "u8")
    reduce = _corpus_schema(shared_dir, "reduce")
    assert reduce.attribute("Function").type == "DML_REDUCE_FUNCTION"
    assert reduce.input("InputTensor").type_var != reduce.output("OutputTensor").type_var
    assert "s64" in reduce.output("OutputTensor").types
    relu = _corpus_schema(shared_dir, "activation_relu_grad")
    assert names(relu.inputs) == ["InputTensor", "InputGradientTensor"]
    assert dict(relu.extra)["aliases"] == (("OutputGradientTensor", "OutputTensor"),)
    clip = _corpus_schema(shared_dir, "element_wise_clip1")
    assert [(a.name, a.type, a.required) for a in clip.attributes] == [
        ("ScaleBias", "DML_SCALE_BIAS", False), ("MinMaxDataType", "DML_TENSOR_DATA_TYPE", True),
        ("Min", "DML_SCALAR_UNION", True), ("Max", "DML_SCALAR_UNION", True)]
