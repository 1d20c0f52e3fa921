"""The opset_v0 dialect (oneDNN Graph opset spec, 2022): inline quirks, the seed, specs/ and the corpus."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from opdef.dialects import opset_v0
from opdef.errors import SpecError
from opdef.parse import read_spec_text
from opdef.schema import Argument, Attribute, TypeRule

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "opset_v0" / "BatchNormTrainingBackprop_1.rst"
SEED = "seeds/001_593e7bada2fa4e3e.txt"


def parse(text: str, source: str = "doc.rst"):
    return opset_v0.parse(textwrap.dedent(text), source)


def collapse(text: str) -> str:
    return " ".join(text.split())


def facts(schema) -> dict:
    data = schema.to_json()
    del data["source"]
    return data


def args(arguments):
    return [(a.name, a.optional, a.variadic, a.type_var, a.types) for a in arguments]


MINIMAL = """\
    -----
    Scale
    -----

    **Versioned name**: *Scale-3*

    **Category**: *Arithmetic*

    **Short description**: *Scale* multiplies by a factor.

    **Attributes**:

    * *factor*

      * **Description**: the factor.
      * **Range of values**: arbitrary f32 value
      * **Type**: f32
      * **Required**: *yes*

    * *mode*

      * **Description**: how.
      * **Range of values**: *fast* or *exact* (exact is slower)
      * **Type**: string
      * **Default value**: *exact*
      * **Required**: *no*

    **Inputs**:

    * **1**: ``src`` - the input. **Required.**

      * **Type**: T1

    * **2**: ``shift`` - added afterwards. **Optional.**

      * **Type**: T2

    **Outputs**

    * **1**: ``dst`` - the result.

      * **Type**: T1

    **Types**:

    * *T1*: f32, f16, bf16.
    * *T2*: f32, bf16.
    * Constraints: *T2* can be bf16 only when *T1* is bf16.
"""


def test_minimal_document_exact_rows():
    s = parse(MINIMAL)
    assert (s.name, s.version, s.domain, s.dialect) == ("Scale", 3, "onednn", "opset_v0")
    assert s.description == "Scale multiplies by a factor."
    assert s.inputs == (Argument("src", False, False, "T1", "the input."),
                        Argument("shift", True, False, "T2", "added afterwards."))
    assert s.outputs == (Argument("dst", False, False, "T1", "the result."),)
    assert s.attributes == (
        Attribute("factor", "f32", True, None, (), "the factor."),
        Attribute("mode", "string", False, "exact", ("fast", "exact"), "how."),
    )
    assert s.type_constraints == (("T1", ("f32", "f16", "bf16")), ("T2", ("f32", "bf16")))
    assert s.type_rules == (TypeRule("T2", ("bf16",), "T1", ("bf16",), "T2 can be bf16 only when T1 is bf16."),)
    assert dict(s.extra)["category"] == "Arithmetic"


def test_collapsed_minimal_document_gives_the_same_facts():
    normal = parse(MINIMAL)
    collapsed = opset_v0.parse(collapse(textwrap.dedent(MINIMAL)), "doc.rst")
    assert facts(collapsed) == facts(normal)


def test_collapsed_layout_is_detected_and_restored():
    text = collapse(textwrap.dedent(MINIMAL))
    assert opset_v0.is_collapsed(text)
    assert not opset_v0.is_collapsed(textwrap.dedent(MINIMAL))
    restored, line_map = opset_v0.restore_layout(text)
    lines = restored.splitlines()
    assert lines[:3] == ["-----", "Scale", "-----"]
    assert "* *factor*" in lines
    assert "  * **Type**: f32" in lines
    assert "* **2**: ``shift`` - added afterwards. **Optional.**" in lines
    assert "* Constraints: *T2* can be bf16 only when *T1* is bf16." in lines
    assert set(line_map) == {1}


def test_collapsed_nested_enumeration_stays_under_its_property():
    doc = """\
        **Versioned name**: *Pool-1*

        **Attributes**:

        * *rounding_type*

          * **Description**: rounding.
          * **Range of values**:

            * *ceil*
            * *floor*

          * **Type**: string
          * **Default value**: *floor*
          * **Required**: *no*

        * *kernel*

          * **Description**: size.
          * **Type**: s64[]
          * **Required**: *yes*

        **Inputs**:

        * **1**: ``input`` - x. **Required.**

          * **Type**: T

        **Outputs**

        * **1**: ``output`` - y.

          * **Type**: T

        **Types**:

        * **T**: f32.
    """
    normal = parse(doc)
    assert [(a.name, a.allowed_values, a.default) for a in normal.attributes] == [
        ("rounding_type", ("ceil", "floor"), "floor"), ("kernel", (), None)]
    assert facts(opset_v0.parse(collapse(textwrap.dedent(doc)), "d")) == facts(normal)


def _one_arg_doc(inputs: str, types: str = "* **T**: f32, f16, bf16.", attributes: str = "") -> str:
    return (f"**Versioned name**: *Op-1*\n\n{attributes}**Inputs**:\n\n{inputs}\n\n"
            f"**Outputs**\n\n* **1**: ``output`` - y.\n\n  * **Type**: T\n\n**Types**:\n\n{types}\n")


def test_two_names_for_one_argument_are_joined_with_a_slash():
    s = opset_v0.parse(_one_arg_doc("* **1**:  ``result_forward`` / ``input_forward`` - either one.. **Required.**"
                                    "\n\n  * **Type**: T"), "d")
    assert s.inputs[0].name == "result_forward/input_forward"
    assert s.inputs[0].description == "either one.."


def test_required_markers_outside_the_bold_and_missing_marker():
    s = opset_v0.parse(_one_arg_doc(
        "* **1**: ``a`` - x. **Required**.\n\n  * **Type**: T\n\n"
        "* **2**: ``b`` - y. **Optional**.\n\n  * **Type**: T\n\n"
        "* **3**: ``c`` - Required by attribute ``x``. **Optional.**.\n\n  * **Type**: T\n\n"
        "* **4**: ``d`` - no marker.\n\n  * **Type**: T"), "d")
    assert [(a.name, a.optional) for a in s.inputs] == [("a", False), ("b", True), ("c", True), ("d", False)]
    assert s.outputs[0].optional is False


def test_variadic_input_and_concrete_element_type():
    s = opset_v0.parse(_one_arg_doc(
        "* **1..N**: ``input`` - tensors. **Required.**\n\n  * **Type**: T\n\n"
        "* **2**: ``shape`` - 1D. **Optional**.\n\n  * **Type**: s32"), "d")
    assert args(s.inputs) == [("input", False, True, "T", ()), ("shape", True, False, None, ("s32",))]


def test_type_variables_in_bold_or_italics_and_notes_ignored():
    s = opset_v0.parse(_one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T",
                                    types="* **T**: f32, bf16\n* **Note**: all the same type T."), "d")
    assert s.type_constraints == (("T", ("f32", "bf16")),)


def test_several_type_rules():
    doc = _one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T", types=(
        "* *T*: f32, f16, bf16.\n* *T2*: f32, bf16, f16.\n"
        "* Constraints: *T2* can be bf16 only when *T* is bf16. *T2* can be f16 or bf16 only if *T* is f16 or bf16."))
    s = opset_v0.parse(doc, "d")
    assert [(r.var, r.types, r.when_var, r.when_types) for r in s.type_rules] == [
        ("T2", ("bf16",), "T", ("bf16",)), ("T2", ("f16", "bf16"), "T", ("f16", "bf16"))]


def test_attributes_as_prose_mean_none():
    doc = _one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T",
                       attributes="**Attributes**: *ReLU* operation has no attributes.\n\n")
    assert opset_v0.parse(doc, "d").attributes == ()


@pytest.mark.parametrize(("spelled", "attr_type", "default", "allowed", "range_"), [
    ("*NXC*", "string", "NXC", ("NXC", "NCX"), "*NXC* or *NCX* (X means HW for 2D, DHW for 3D)"),
    ('"per_tensor"', "string", "per_tensor", ("per_tensor", "per_channel"), '"per_tensor" or "per_channel"'),
    ("``half_pixel``", "string", "half_pixel", ("nearest", "half_pixel"), "one of ``nearest``, ``half_pixel``"),
    ("True", "bool", True, (), "True or False"),
    ("-1", "s64", -1, (), "[-r, r-1] where r = rank(input)"),
    ("1e-5", "f32", 1e-5, (), "arbitrary positive f32 value"),
    ("empty list", "s64[]", [], (), "positive s64 values"),
    ("all zeros", "s64[]", None, (), "Non-negative s64 values."),
    ("none", "f32[]", None, (), "f32 values"),
])
def test_default_values_and_enumerated_ranges(spelled, attr_type, default, allowed, range_):
    attributes = (f"**Attributes**:\n\n* *a*\n\n  * **Description**: d.\n  * **Range of values**: {range_}\n"
                  f"  * **Type**: {attr_type}\n  * **Default value**: {spelled}\n  * **Required**: *no*\n\n")
    (attr,) = opset_v0.parse(_one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T", attributes=attributes),
                             "d").attributes
    assert (attr.type, attr.required, attr.default, attr.allowed_values) == (attr_type, False, default, allowed)
    if spelled == "all zeros":
        assert attr.description == "d. (default: all zeros)"


def test_attribute_type_spellings_are_normalized():
    attributes = ("**Attributes**:\n\n* *order*\n\n  * **Description**: d.\n  * **Type**: int64[]\n"
                  "  * **Required**: *yes*\n\n* *flag*\n\n  * **Type**: boolean\n  * **Required**: *no*\n\n")
    s = opset_v0.parse(_one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T", attributes=attributes), "d")
    assert [(a.name, a.type, a.required, a.default) for a in s.attributes] == [
        ("order", "s64[]", True, None), ("flag", "bool", False, None)]


def test_stub_document_is_an_empty_but_valid_schema():
    s = opset_v0.parse("---\nOp\n---\n\n**Versioned name**: *Op-2*\n\n**Category**: *Misc*\n", "d")
    assert (s.name, s.version, s.inputs, s.outputs, s.attributes, s.type_constraints) == ("Op", 2, (), (), (), ())
    assert dict(s.extra) == {"stub": True, "category": "Misc"}


# -- malformed documents ----------------------------------------------------------------------


@pytest.mark.parametrize(("doc", "line", "expected"), [
    ("-----\nOp\n-----\n\n**Category**: x\n", 1, "Versioned name"),
    ("**Versioned name**: *Op*\n\n**Inputs**\n\n* **1**: ``x`` - x.\n", 1, "*Op-N*"),
    ("**Versioned name**: *Op-1*\n\n**Types**:\n\n* *T*: f32.\n", 1, "'**Inputs**' and '**Outputs**'"),
    (_one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T",
                  attributes="**Attributes**:\n\n* *a*\n\n  * **Type**: f32\n  * **Required**: *maybe*\n\n"),
     8, "'**Required**: *yes*'"),
    (_one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T",
                  attributes="**Attributes**:\n\n* *a*\n\n  * **Required**: *no*\n\n"), 5, "'**Type**:'"),
    (_one_arg_doc("* **1**: - nameless.\n\n  * **Type**: T"), 5, "name as ``name``"),
    (_one_arg_doc("* **one**: ``x`` - x.\n\n  * **Type**: T"), 5, "number like **1**"),
    (_one_arg_doc("* **1**: ``x`` - x.\n\n* **2**: ``x`` - again."), 7, "listed twice"),
    (_one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T", types="* **T**: f32, quaternion."), 17, "element types"),
    ("**Versioned name**: *Op-1*\n\n**Inputs**:\n\n**Outputs**\n\n* **1**: ``y`` - y.\n", 3, "bullet list of inputs"),
    (_one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T3"), None, "T3"),
])
def test_malformed_documents_raise_spec_error_with_line(doc, line, expected):
    with pytest.raises(SpecError) as err:
        opset_v0.parse(doc, "bad.rst")
    assert err.value.source == "bad.rst"
    assert err.value.line == line
    assert expected in err.value.message


def test_constraint_sentence_of_no_known_form_is_kept_as_text_with_a_warning():
    # issue 13: an unread constraint sentence is documentation, never a SpecError
    s = opset_v0.parse(_one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T",
                                    types="* **T**: f32.\n* Constraints: T is nice."), "odd.rst")
    assert s.type_rules == ()
    assert [(c.label, c.text) for c in s.constraints] == [("C1", "T is nice.")]
    assert [(w.line, w.message) for w in s.warnings] == [
        (18, "type constraint not in a form read as a rule; kept as constraint C1: 'T is nice.'")]


def test_malformed_collapsed_document_reports_its_only_line():
    doc = collapse(_one_arg_doc("* **1**: ``x`` - x.\n\n  * **Type**: T", types="* **T**: f32, quaternion."))
    with pytest.raises(SpecError) as err:
        opset_v0.parse(doc, "bad.rst")
    assert (err.value.line, str(err.value).split(":")[:2]) == (1, ["bad.rst", "1"])


# -- detection --------------------------------------------------------------------------------


def test_looks_like_scores_the_versioned_name_grammar_normal_and_collapsed():
    assert opset_v0.looks_like(textwrap.dedent(MINIMAL)) > 0.8
    assert opset_v0.looks_like(collapse(textwrap.dedent(MINIMAL))) > 0.8
    assert opset_v0.looks_like("Abs\n###\n\nSome text with **bold**.\n") == 0


def test_looks_like_does_not_claim_other_dialects(shared_dir):
    others = [p for d in ("onednn", "ngraph", "directml") for p in sorted((shared_dir / "corpus" / d).glob("*.*"))
              if p.suffix in (".rst", ".md")]
    others += [shared_dir / "seeds" / s for s in ("000_086b69c5df1d398c.txt", "002_f105ca9861223769.txt",
                                                  "003_6d4ad439f9782f59.txt")]
    assert len(others) > 60
    assert [p.name for p in others if opset_v0.looks_like(p.read_text(encoding="utf-8"))] == []


# -- the seed, the project's own document and the corpus --------------------------------------

BN_INPUTS = [("input_forward", False, False, "T1", ()), ("output_delta", False, False, "T1", ()),
             ("mean", False, False, "T2", ()), ("variance", False, False, "T2", ()), ("gamma", True, False, "T2", ())]
BN_OUTPUTS = [("input_delta", False, False, "T1", ()), ("gamma_delta", True, False, "T2", ()),
              ("beta_delta", True, False, "T2", ())]


def _check_batch_norm_backprop(s):
    assert (s.name, s.version, s.domain) == ("BatchNormTrainingBackprop", 1, "onednn")
    assert args(s.inputs) == BN_INPUTS
    assert args(s.outputs) == BN_OUTPUTS
    assert [(a.name, a.type, a.required, a.default, a.allowed_values) for a in s.attributes] == [
        ("epsilon", "f32", True, None, ()), ("data_format", "string", False, "NXC", ("NXC", "NCX"))]
    assert s.type_constraints == (("T1", ("f32", "f16", "bf16")), ("T2", ("f32", "bf16")))
    assert [(r.var, r.types, r.when_var, r.when_types) for r in s.type_rules] == [("T2", ("bf16",), "T1", ("bf16",))]


def test_project_spec_document():
    _check_batch_norm_backprop(opset_v0.parse(read_spec_text(SPEC), str(SPEC)))


def test_seed_is_collapsed_and_parses_to_the_project_documents_facts(shared_dir):
    seed_text = read_spec_text(shared_dir / SEED)
    assert opset_v0.is_collapsed(seed_text) and seed_text.count("\n") <= 1
    seed = opset_v0.parse(seed_text, "seed")
    _check_batch_norm_backprop(seed)
    ours = facts(opset_v0.parse(read_spec_text(SPEC), str(SPEC)))
    theirs = facts(seed)
    del ours["description"], theirs["description"]  # prose: ours is our own wording
    assert theirs == ours


def corpus_docs():
    corpus = ROOT.parent / "shared" / "corpus" / "opset_v0"  # the shared_dir fixture skips when it is absent
    return sorted(corpus.glob("*.rst")) if corpus.is_dir() else []


@pytest.mark.parametrize("path", corpus_docs(), ids=lambda p: p.name)
def test_corpus_document_parses_in_both_layouts(shared_dir, path):
    text = read_spec_text(path)
    schema = opset_v0.parse(text, str(path))
    assert schema.name and schema.version == 1 and schema.outputs
    vars_ = schema.type_constraint_map
    assert all(a.type_var in vars_ or a.types for a in schema.inputs + schema.outputs)
    assert facts(opset_v0.parse(collapse(text), str(path))) == facts(schema)


SPOT_CHECKS = {
    "activation__ClampBackward_1.rst": lambda s: (
        s.name == "ClampBackprop" and s.inputs[0].name == "result_forward/input_forward"
        and [(a.name, a.required, a.default) for a in s.attributes]
        == [("min", True, None), ("max", True, None), ("use_dst", False, True)]),
    "activation__ReLU_1.rst": lambda s: s.attributes == () and args(s.inputs) == [("input", False, False, "T", ())],
    "activation__GELUBackward_1.rst": lambda s: s.attributes == () and len(s.inputs) == 2,
    "arithmetic__Add_1.rst": lambda s: s.attribute("auto_broadcast").allowed_values == ("none", "numpy")
    and s.attribute("auto_broadcast").default == "numpy",
    "convolution__ConvolutionBackwardWeights_1.rst": lambda s: (
        args(s.inputs)[2] == ("weights_shape", True, False, None, ("s32",))
        and s.attribute("weights_shape") == Attribute("weights_shape", "s64[]", False, None, (),
                                                      "weights_shape denotes the shape of the weights.")),
    "convolution__ConvTranspose_1.rst": lambda s: (
        [a.name for a in s.inputs] == ["input", "filter", "bias"] and s.input("bias").optional
        and s.attribute("output_padding").default is None and s.attribute("groups").default == 1
        and s.attribute("filter_format").allowed_values == ("XIO", "OIX")),
    "image__InterpolateBackward_1.rst": lambda s: (
        s.attribute("mode").allowed_values == ("nearest", "linear", "bilinear", "trilinear")
        and s.attribute("mode").required
        and s.attribute("coordinate_transformation_mode").allowed_values == ("half_pixel", "align_corners")
        and s.type_constraints == (("T1", ("f32", "f16", "bf16")), ("T2", ("s32",)))),
    "lower_precision__Dequantize_1.rst": lambda s: (
        s.type_constraints == (("T1", ("s8", "u8")), ("T2", ("f32",)))
        and s.attribute("qtype").default == "per_tensor" and s.attribute("scales").type == "f32[]"),
    "movement__Concat_1.rst": lambda s: args(s.inputs) == [("input", False, True, "T", ())],
    "movement__StaticTranspose_1.rst": lambda s: s.attribute("order").type == "s64[]",
    "normalization__LayerNorm_1.rst": lambda s: (
        [(a.name, a.optional) for a in s.outputs] == [("output", False), ("mean", True), ("variance", True)]
        and s.attribute("epsilon").default == 1e-5 and s.attribute("begin_norm_axis").default == -1
        and len(s.type_rules) == 1),
    "pooling__AvgPool_1.rst": lambda s: (
        s.attribute("rounding_type").allowed_values == ("ceil", "floor")
        and s.attribute("auto_pad").allowed_values == () and s.attribute("exclude_pad").required),
    "reduction__ReduceSum_1.rst": lambda s: (
        s.attribute("axes").default == [] and s.input("axes").optional and s.attribute("keep_dims").default is False),
}


@pytest.mark.parametrize("name", sorted(SPOT_CHECKS))
def test_corpus_spot_checks(shared_dir, name):
    path = shared_dir / "corpus" / "opset_v0" / name
    assert SPOT_CHECKS[name](opset_v0.parse(read_spec_text(path), str(path)))
