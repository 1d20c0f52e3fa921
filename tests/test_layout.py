"""The package layout docs/layout.md describes: imports only go down the layers
(opdef <- runtime <- lowering), no import cycles between modules, and every package is shipped.

Imports are read from the source (module-level and function-level alike), so a lazy import inside a
function counts too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("opdef", "lowering", "runtime")
# what each top-level package may import (besides itself)
MAY_IMPORT = {"opdef": set(), "runtime": {"opdef"}, "lowering": {"opdef", "runtime"}}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Project modules (and imported names, as ``module.name``) that ``path`` imports anywhere."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import (the project uses absolute imports)")
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def test_no_package_imports_upward():
    upward = [f"{module} imports {name}" for module, names in _graph().items() for name in names
              if name.split(".")[0] != module.split(".")[0]
              and name.split(".")[0] not in MAY_IMPORT[module.split(".")[0]]]
    assert not upward, upward


def _related(a: str, b: str) -> bool:
    """A package and its own submodules import each other by design (``__init__`` re-exports)."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def test_no_import_cycles_between_modules():
    graph = _graph()
    edges = {m: {d for d in deps if d in graph and d != m and not _related(m, d)} for m, deps in graph.items()}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(f"{m} <-> {d}" for m in edges for d in edges[m] if m in reachable(d))
    assert not cycles, cycles


def test_the_cycle_checker_finds_a_cycle(tmp_path, monkeypatch):
    """The checker itself can fail: two modules importing each other are reported."""
    pkg = tmp_path / "opdef"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from opdef.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from opdef.a import g\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGES", ("opdef",))
    with pytest.raises(AssertionError, match="opdef.a <-> opdef.b"):
        test_no_import_cycles_between_modules()


def test_every_package_is_listed_in_pyproject():
    """A subpackage missing from pyproject's list would be absent from the installed copy."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    listed = set(re.findall(r'"([a-z_.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1)))
    on_disk = {_module_name(init) for pkg in PACKAGES for init in (ROOT / pkg).rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)


def test_rule_modules_live_in_the_rules_packages():
    """Lowering rules register only from lowering/rules/, verification rules only from opdef/rules/."""
    for path in sorted((ROOT / "lowering").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "@register_rule(" in text:
            assert path.is_relative_to(ROOT / "lowering" / "rules"), path


def test_a_family_module_may_register_several_rule_keys(tmp_path, monkeypatch):
    """A rule key with no module of its name is found by importing the package's other modules."""
    from opdef.rules.base import import_rule_module

    pkg = tmp_path / "fam_rules"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("FOUND = set()\n")
    (pkg / "pools.py").write_text("from fam_rules import FOUND\nFOUND.update({'max_pool_grad', 'avg_pool_grad'})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_rule_module("fam_rules", "avg_pool_grad")
    import fam_rules

    assert fam_rules.FOUND == {"max_pool_grad", "avg_pool_grad"}
    import_rule_module("fam_rules", "no such rule")  # no module, no error: simply no rule


# the training side (lowering/training/) sits above the pass and its rules, below the CLI and the bench
TRAINING_USERS = ("lowering.training", "lowering.cli", "lowering.bench")


def test_the_pass_never_imports_the_training_side():
    graph = _graph()
    climbing = sorted(f"{module} imports {name}" for module, names in graph.items() for name in names
                      if name.startswith("lowering.training") and module.startswith("lowering")
                      and not module.startswith(TRAINING_USERS))
    assert not climbing, climbing
    below = sorted(f"{module} imports {name}" for module, names in graph.items() if module.startswith(
        "lowering.training") for name in names if name.startswith(("lowering.cli", "lowering.bench")))
    assert not below, below


def test_gradient_rules_live_in_the_gradients_package():
    for path in sorted((ROOT / "lowering").rglob("*.py")):
        if "@gradient_rule(" in path.read_text(encoding="utf-8"):
            assert path.is_relative_to(ROOT / "lowering" / "training" / "gradients"), path
