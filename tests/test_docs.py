"""The documentation stays true to the code: README.md and docs/*.md link only to files and headings that
exist, every flag the CLI's --help lists is documented in docs/cli.md under its command's heading, and
every op bound in specs/bindings.json is named in docs/ops.md and in the README's op table."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from lowering.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are examples, not links)."""
    return _CODE.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    return [target for target in _LINK.findall(_prose(path.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked


def test_the_docs_pages_exist():
    names = {p.name for p in DOCS}
    assert {"cli.md", "ops.md", "training.md", "targets.md", "numerics.md", "performance.md", "spec-grammars.md",
            "extending.md", "layout.md"} <= names


def test_slug_follows_github():
    assert _slug("oplower train") == "oplower-train"
    assert _slug("4. How it is checked") == "4-how-it-is-checked"
    assert _slug("Errors and exit codes") == "errors-and-exit-codes"
    assert _slug("Training step (`oplower bench --training`)") == "training-step-oplower-bench---training"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert broken == []


def test_the_link_check_finds_a_broken_link_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading\n", encoding="utf-8")
    page.write_text("[ok](other.md#a-code-heading) [bad](other.md#nope) [gone](missing.md) "
                    "`[not a link](x.md)` [web](https://example.com)\n", encoding="utf-8")
    assert relative_links(page) == ["other.md#a-code-heading", "other.md#nope", "missing.md"]
    assert anchors(tmp_path / "other.md") == {"other", "a-code-heading"}


# -- the CLI's flags ------------------------------------------------------------------------------------------

def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """The option strings --help shows (not -h/--help, not options hidden with help=SUPPRESS)."""
    return [flag for action in parser._actions if action.help != argparse.SUPPRESS
            for flag in action.option_strings if flag not in ("-h", "--help")]


def sections(path: Path, level: str = "##") -> dict[str, str]:
    """Each ``## heading``'s text, up to the next heading of that level (code blocks included)."""
    found: dict[str, str] = {}
    heading = None
    lines: list[str] = []
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if not in_fence and re.match(rf"{level}\s", line):
            if heading is not None:
                found[heading] = "\n".join(lines)
            heading, lines = line[len(level):].strip(), []
        elif heading is not None:
            lines.append(line)
    if heading is not None:
        found[heading] = "\n".join(lines)
    return found


def _mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


GLOBAL = "Global options"


def test_every_global_flag_is_documented():
    cli = sections(ROOT / "docs" / "cli.md")
    assert GLOBAL in cli
    missing = [flag for flag in _flags(build_parser()) if not _mentions(cli[GLOBAL], flag)]
    assert missing == [], f"flags of `oplower --help` missing under '## {GLOBAL}' in docs/cli.md"


@pytest.mark.parametrize("command", list(_commands()))
def test_every_flag_of_a_command_is_documented_under_its_heading(command):
    cli = sections(ROOT / "docs" / "cli.md")
    heading = f"oplower {command}"
    assert heading in cli, f"docs/cli.md has no '## {heading}' section"
    global_flags = set(_flags(build_parser()))
    missing = [flag for flag in _flags(_commands()[command])
               if flag not in global_flags and not _mentions(cli[heading], flag)]
    assert missing == [], f"flags of `oplower {command} --help` missing under '## {heading}' in docs/cli.md"


def test_the_flag_check_reads_the_help_the_user_sees(capsys):
    parser = _commands()["lower"]
    parser.print_help()
    shown = capsys.readouterr().out
    assert all(_mentions(shown, flag) for flag in _flags(parser))
    hidden = _commands()["bench"]
    hidden.print_help()
    assert "--shapes" not in _flags(hidden) and "--shapes" not in capsys.readouterr().out  # a test-only option
    assert "--verify" in _flags(parser) and "-o" in _flags(parser) and "--output" in _flags(parser)
    assert not _mentions("--verify-all", "--verify") and _mentions("(`--verify`)", "--verify")


# -- the ops ------------------------------------------------------------------------------------------------

def _bound_ops() -> list[tuple[str, str]]:
    bindings = json.loads((ROOT / "specs" / "bindings.json").read_text(encoding="utf-8"))
    return sorted({(entry["domain"], entry["op_type"]) for entry in bindings["ops"]})


def _readme_op_table() -> str:
    text = sections(ROOT / "README.md")["Supported ops"]
    return "\n".join(line for line in text.splitlines() if line.startswith("|"))


@pytest.mark.parametrize("op", _bound_ops(), ids=lambda op: f"{op[0] or 'ai.onnx'}::{op[1]}")
def test_every_bound_op_is_in_the_ops_page_and_the_readme_table(op):
    _, op_type = op
    assert _mentions((ROOT / "docs" / "ops.md").read_text(encoding="utf-8"), op_type)
    assert _mentions(_readme_op_table(), op_type)
