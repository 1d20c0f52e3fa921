"""Damaged spec documents give a SpecError naming the file, the line and the problem — never anything else.

Every bundled document under specs/ gets the hand-picked line edits of ``bad_inputs.spec_cases`` (one per
distinct problem) and the dialect-independent damage of ``bad_inputs.spec_generic``; the seed documents of
../shared get the generic damage too (skipped when ../shared is absent).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from bad_inputs.spec_cases import SPEC_CASES
from bad_inputs.spec_generic import GENERIC, Generic

from opdef.errors import SpecError
from opdef.parse import parse_spec
from opdef.registry import default_spec_dir

SPECS = default_spec_dir()
BUNDLED = sorted(str(p.relative_to(SPECS)) for p in SPECS.rglob("*")
                 if p.suffix in (".rst", ".md") and p.parent.name != "_include")
SEEDS = ("000_086b69c5df1d398c.txt", "001_593e7bada2fa4e3e.txt", "002_f105ca9861223769.txt",
         "003_6d4ad439f9782f59.txt")


def _parse(path: Path, origin: Path):
    return parse_spec(path, include_dirs=(origin.parent, SPECS / "_include"))


def _same_facts(a, b) -> bool:
    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")


def test_every_bundled_document_has_hand_picked_cases():
    assert {c.doc for c in SPEC_CASES} == set(BUNDLED)
    assert len({c.id for c in SPEC_CASES}) == len(SPEC_CASES)


@pytest.mark.parametrize("case", SPEC_CASES, ids=lambda c: c.id)
def test_damaged_bundled_document(case, tmp_path):
    origin = SPECS / case.doc
    text = origin.read_text(encoding="utf-8")
    anchor_line = case.edit.line_of(text.split("\n")) + 1
    path = tmp_path / origin.name
    path.write_text(case.edit.apply(text), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        _parse(path, origin)
    err = info.value
    assert err.source == str(path)
    assert err.line == (None if case.line is None else anchor_line + case.line - 1), str(err)
    assert case.fragment in err.message
    assert "\n" not in str(err)


def _check_generic(generic: Generic, origin: Path, tmp_path: Path) -> None:
    raw = origin.read_bytes()
    path = tmp_path / origin.name
    path.write_bytes(generic.make(raw))
    n_lines = raw.count(b"\n") * 2 + 2  # doubled documents are twice as long
    if generic.expect == "same":
        assert _same_facts(_parse(path, origin), _parse(origin, origin))
        return
    if generic.expect == "error_or_parse":
        try:
            schema = _parse(path, origin)
        except SpecError as err:
            assert err.source == str(path)
            assert err.line is None or 1 <= err.line <= n_lines, str(err)
            assert "\n" not in str(err)
        else:
            assert schema.name
        return
    with pytest.raises(SpecError) as info:
        _parse(path, origin)
    err = info.value
    assert err.source == str(path)
    assert err.line == generic.line(raw), str(err)
    assert generic.fragment in err.message
    assert "\n" not in str(err)


@pytest.mark.parametrize("generic", GENERIC, ids=lambda g: g.id)
@pytest.mark.parametrize("doc", BUNDLED)
def test_generic_damage_of_bundled_document(doc, generic, tmp_path):
    _check_generic(generic, SPECS / doc, tmp_path)


@pytest.mark.parametrize("generic", GENERIC, ids=lambda g: g.id)
@pytest.mark.parametrize("seed", SEEDS)
def test_generic_damage_of_seed_document(seed, generic, shared_dir, tmp_path):
    _check_generic(generic, shared_dir / "seeds" / seed, tmp_path)


def test_text_api_refuses_empty_and_nul_text():
    from opdef.parse import parse_spec_text

    with pytest.raises(SpecError, match="empty document"):
        parse_spec_text("", "given.rst")
    with pytest.raises(SpecError, match=r"given.rst:3: NUL byte"):
        parse_spec_text("a\nb\nc\x00d\n", "given.rst")


@pytest.mark.parametrize("path_kind", ["missing", "directory"])
def test_unreadable_paths(path_kind, tmp_path):
    path = tmp_path / "nothing.rst"
    if path_kind == "directory":
        path.mkdir()
    with pytest.raises(SpecError) as info:
        parse_spec(path)
    assert info.value.source == str(path)
    assert ("directory" if path_kind == "directory" else "No such file") in info.value.message


def core_case_count() -> int:
    """Bad spec inputs that need nothing outside the project (for test_bad_input_count)."""
    return len(SPEC_CASES) + len(GENERIC) * len(BUNDLED) + 2 + 2
