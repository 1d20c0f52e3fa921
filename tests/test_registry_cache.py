"""The on-disk cache of parsed schema registries (opdef/registry_cache.py): a hit gives the registry a parse would,
anything changed or broken falls back to parsing, never to an error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opdef import registry as registry_mod
from opdef import registry_cache
from opdef.registry import BINDINGS_FILE, build_registry, default_spec_dir

SPECS = default_spec_dir()
OPS = ("ReluGrad", "InPlaceAccumulatorV2", "MaxPoolGrad")  # a shared domain, an in-place op, the default domain


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """The cache under tmp_path (never the real ~/.cache) and enabled whatever the environment says."""
    home = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv(registry_cache.NO_CACHE_ENV, raising=False)
    return home / "oplower"


@pytest.fixture
def spec_dir(tmp_path) -> Path:
    """A small spec directory: three of the bundled documents, their bindings and the include directory."""
    target = tmp_path / "specs"
    data = json.loads((SPECS / BINDINGS_FILE).read_text())
    data["ops"] = [o for o in data["ops"] if o["op_type"] in OPS]
    assert len(data["ops"]) == len(OPS)
    for op in data["ops"]:
        (target / op["spec"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SPECS / op["spec"], target / op["spec"])
    shutil.copytree(SPECS / "_include", target / "_include")
    (target / BINDINGS_FILE).write_text(json.dumps(data))
    return target


@pytest.fixture
def parses(monkeypatch) -> list[Path]:
    """Every real parse (build_registry call) of a load, recorded."""
    calls: list[Path] = []

    def counting(spec_dir):
        calls.append(spec_dir)
        return build_registry(spec_dir)

    monkeypatch.setattr(registry_mod, "build_registry", counting)
    return calls


def load(spec_dir: Path):
    """load_schemas without its per-process memo: what a fresh process gets."""
    return registry_mod._load.__wrapped__(str(spec_dir.resolve()))


def same(a, b) -> None:
    assert [e.binding.key for e in a] == [e.binding.key for e in b]
    for x, y in zip(a, b, strict=True):
        assert x.schema == y.schema and x.binding == y.binding
        assert x.schema.to_json() == y.schema.to_json() and x.schema.warnings == y.schema.warnings
        assert x.schema.extra == y.schema.extra
    assert a.spec_dir == b.spec_dir and a.shared_domains == b.shared_domains and a.domains == b.domains
    for domain, op, opset in (("com.microsoft", "ReluGrad", None), ("", "MaxPoolGrad", 8), ("", "MaxPoolGrad", 9),
                              ("", "Relu", 17), ("com.microsoft", "FusedMatMul", None)):
        assert a.handles(domain, op, opset) == b.handles(domain, op, opset)


def cache_files(home: Path) -> list[Path]:
    return sorted(home.glob("registry-*.pickle")) if home.is_dir() else []


def test_hit_gives_an_equal_registry(cache_home, spec_dir, parses):
    first = load(spec_dir)
    assert len(parses) == 1 and len(cache_files(cache_home)) == 1
    second = load(spec_dir)
    assert len(parses) == 1, "the second load parsed again instead of reading the cache"
    same(second, first)
    same(second, build_registry(spec_dir))
    assert second.binding("com.microsoft", "InPlaceAccumulatorV2").arg("buffer_out") == "accumulation_buffer_out"
    assert not list(cache_home.glob(".registry-*")), "a temporary file was left behind"


def test_the_bundled_specs_round_trip(cache_home, parses):
    """Every bundled schema (all dialects, warnings, extras) pickles and comes back equal."""
    first = load(SPECS)
    second = load(SPECS)
    assert len(parses) == 1 and len(second) == len(first) > 40
    same(second, first)


@pytest.mark.parametrize("edit", ["document", "bindings", "include", "new_file"])
def test_a_changed_spec_file_misses(cache_home, spec_dir, parses, edit):
    before = load(spec_dir)
    doc = spec_dir / "com.microsoft" / "ReluGrad.rst"
    if edit == "document":
        doc.write_text(doc.read_text() + "\n.. an edit: a comment changes no schema, but the bytes\n")
    elif edit == "bindings":
        data = json.loads((spec_dir / BINDINGS_FILE).read_text())
        data["ops"] = [o for o in data["ops"] if o["op_type"] != "MaxPoolGrad"]
        (spec_dir / BINDINGS_FILE).write_text(json.dumps(data))
    elif edit == "include":
        inc = next((spec_dir / "_include").iterdir())
        inc.write_text(inc.read_text() + "\n")
    else:
        (spec_dir / "notes.txt").write_text("any file beside the specs keys the cache too\n")
    after = load(spec_dir)
    assert len(parses) == 2, "a changed spec directory was served from the cache"
    same(after, build_registry(spec_dir))
    if edit == "bindings":
        assert len(after) == len(before) - 1
    assert len(cache_files(cache_home)) == 2
    load(spec_dir)
    assert len(parses) == 2


def test_another_directory_with_the_same_content_misses(cache_home, spec_dir, parses, tmp_path):
    """Schemas record their source file: a copy elsewhere is parsed (and cached) on its own."""
    load(spec_dir)
    other = shutil.copytree(spec_dir, tmp_path / "other")
    registry = load(other)
    assert len(parses) == 2
    assert registry.spec_dir == other.resolve()
    assert all(str(other.resolve()) in e.schema.source for e in registry)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "other_pickle", "wrong_key", "wrong_entries"])
def test_a_corrupt_or_truncated_cache_file_falls_back(cache_home, spec_dir, parses, damage):
    import pickle

    first = load(spec_dir)
    (path,) = cache_files(cache_home)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x80\x05not a pickle at all" + os.urandom(64))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "other_pickle":
        path.write_bytes(pickle.dumps({"a": 1}))
    elif damage == "wrong_key":
        magic, fmt, key, entries, shared = pickle.loads(data)
        path.write_bytes(pickle.dumps((magic, fmt, "0" * 64, entries, shared)))
    else:
        magic, fmt, key, entries, shared = pickle.loads(data)
        path.write_bytes(pickle.dumps((magic, fmt, key, [(e[1], e[0]) for e in entries], shared)))
    again = load(spec_dir)
    assert len(parses) == 2
    same(again, first)
    # the parse rewrote a good file: the next load hits
    load(spec_dir)
    assert len(parses) == 2


def test_a_cache_file_of_another_format_is_ignored(cache_home, spec_dir, parses, monkeypatch):
    load(spec_dir)
    monkeypatch.setattr(registry_cache, "_FORMAT", registry_cache._FORMAT + 1)
    load(spec_dir)
    assert len(parses) == 2


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_an_unwritable_cache_dir_is_fine(cache_home, spec_dir, parses):
    cache_home.mkdir(parents=True)
    cache_home.chmod(0o500)
    try:
        a, b = load(spec_dir), load(spec_dir)
    finally:
        cache_home.chmod(0o700)
    assert len(parses) == 2 and not cache_files(cache_home)
    same(a, b)


def test_permission_denied_everywhere_is_fine(cache_home, spec_dir, parses, monkeypatch):
    """What an unwritable cache dir does to a process running as root too: every write attempt refused."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    import tempfile

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    a, b = load(spec_dir), load(spec_dir)
    assert len(parses) == 2 and not cache_files(cache_home)
    same(a, b)


def test_a_cache_dir_that_cannot_exist_is_fine(tmp_path, monkeypatch, spec_dir, parses):
    """XDG_CACHE_HOME names a file (works for root too, unlike a read-only directory)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.delenv(registry_cache.NO_CACHE_ENV, raising=False)
    a, b = load(spec_dir), load(spec_dir)
    assert len(parses) == 2
    same(a, b)
    assert blocker.read_text() == "not a directory"


def test_a_write_failure_leaves_nothing_behind(cache_home, spec_dir, parses, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(registry_cache.os, "replace", fail)
    load(spec_dir)
    assert len(parses) == 1
    assert not list(cache_home.iterdir())


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_the_env_var_disables_it(cache_home, spec_dir, parses, monkeypatch, value):
    monkeypatch.setenv(registry_cache.NO_CACHE_ENV, value)
    load(spec_dir)
    load(spec_dir)
    assert len(parses) == 2 and not cache_files(cache_home)
    monkeypatch.setenv(registry_cache.NO_CACHE_ENV, "0")
    load(spec_dir)
    load(spec_dir)
    assert len(parses) == 3


def test_spec_errors_are_not_cached(cache_home, spec_dir, parses):
    from opdef.errors import SpecError

    doc = spec_dir / "com.microsoft" / "ReluGrad.rst"
    good = doc.read_bytes()
    doc.write_bytes(b"\xff\xfe not utf-8")
    for _ in range(2):
        with pytest.raises(SpecError):
            load(spec_dir)
    assert len(parses) == 2 and not cache_files(cache_home)
    doc.write_bytes(good)
    load(spec_dir)
    assert len(cache_files(cache_home)) == 1


def test_old_files_are_pruned(cache_home, spec_dir, parses):
    doc = spec_dir / "com.microsoft" / "ReluGrad.rst"
    text = doc.read_text()
    for i in range(registry_cache._KEEP + 3):
        doc.write_text(text + "\n" * (i + 1))
        load(spec_dir)
    assert len(cache_files(cache_home)) == registry_cache._KEEP


def test_the_test_session_never_uses_the_real_cache():
    """conftest.py points XDG_CACHE_HOME at a temporary directory for the whole session (subprocesses too)."""
    home = Path(os.environ["XDG_CACHE_HOME"])
    assert home != Path.home() / ".cache" and Path.home() / ".cache" not in home.parents
    assert registry_cache.cache_dir().parent == home


def test_a_fresh_process_reads_what_another_wrote(cache_home, spec_dir):
    """The real thing: two interpreters, the second does not import docutils (no parse)."""
    code = ("import sys; from opdef.registry import load_schemas; r = load_schemas(sys.argv[1]); "
            "print(len(r), 'docutils' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    runs = [subprocess.run([sys.executable, "-c", code, str(spec_dir)], capture_output=True, text=True, env=env,
                           check=True).stdout.split() for _ in range(2)]
    assert runs == [[str(len(OPS)), "True"], [str(len(OPS)), "False"]]
