"""Every CLI failure: exactly one line on stderr naming the file (and node) and the problem, exit 1 (2 for
usage errors), no traceback unless --debug, the input files byte-identical, no output or temporary file left.

Cases run ``lowering.cli.main`` in-process; a few run ``python -m lowering`` to see the real process.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

from lowering.cli import main
from lowering.demo.examples import BnCase, build_example
from opdef.registry import default_spec_dir, load_schemas

ONEDNN = ("onednn", "BatchNormTrainingBackward")
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Workspace:
    dir: Path
    model: Path  # a valid model with one custom node
    inputs: Path  # its inputs as .npz
    spec: Path  # a valid spec document

    def file(self, name: str, data: bytes) -> Path:
        path = self.dir / name
        path.write_bytes(data)
        return path


@pytest.fixture
def ws(tmp_path) -> Workspace:
    example = build_example([BnCase(ONEDNN, (2, 3, 4, 5), layout="NCX", name="bn")], load_schemas())
    model = tmp_path / "model.onnx"
    onnx.save(example.model, model)
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **example.feeds)
    spec = tmp_path / "Op.rst"
    spec.write_bytes((default_spec_dir() / "onednn" / "BatchNormTrainingBackward.rst").read_bytes())
    return Workspace(tmp_path, model, inputs, spec)


# -- bad paths, shared by every subcommand that reads a file ----------------------------------------------

def _bad_model_bytes(ws: Workspace) -> bytes:
    model = onnx.load(ws.model)
    for attr in model.graph.node[0].attribute:
        if attr.name == "epsilon":
            attr.f = -1.0
    return model.SerializeToString()


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


BAD_PATHS: dict[str, tuple[Callable[[Workspace], Path], tuple[str, ...]]] = {
    "missing": (lambda ws: ws.dir / "absent.onnx", ("absent.onnx", "no such file")),
    "directory": (lambda ws: ws.dir, ("directory",)),
    "empty": (lambda ws: ws.file("empty.onnx", b""), ("empty.onnx", "empty")),
    "text": (lambda ws: ws.file("notes.onnx", b"just some notes\n"), ("notes.onnx", "not a readable")),
    "truncated": (lambda ws: ws.file("cut.onnx", ws.model.read_bytes()[:40]), ("cut.onnx", "not a readable")),
    "through-a-file": (lambda ws: ws.model / "inner.onnx", ("inner.onnx",)),
}

SPEC_PATHS: dict[str, tuple[Callable[[Workspace], Path], tuple[str, ...]]] = {
    "missing": (lambda ws: ws.dir / "absent.rst", ("absent.rst", "No such file")),
    "directory": (lambda ws: ws.dir / "specdir.rst", ("specdir.rst", "directory")),
    "empty": (lambda ws: ws.file("empty.rst", b""), ("empty.rst", "empty document")),
    "non-utf8": (lambda ws: ws.file("latin.rst", b"Op\n==\n\ncaf\xe9\n"), ("latin.rst:4", "not UTF-8")),
    "onnx-model": (lambda ws: ws.model, ("model.onnx",)),
    "through-a-file": (lambda ws: ws.spec / "x.rst", ("x.rst", "Not a directory")),
}

NPZ_PATHS: dict[str, tuple[Callable[[Workspace], Path], tuple[str, ...]]] = {
    "missing": (lambda ws: ws.dir / "absent.npz", ("absent.npz", "no such file")),
    "directory": (lambda ws: ws.dir, ("directory",)),
    "empty": (lambda ws: ws.file("empty.npz", b""), ("empty.npz", "not a readable .npz")),
    "text": (lambda ws: ws.file("notes.npz", b"a,b\n1,2\n"), ("notes.npz", "not a readable .npz")),
    "truncated-zip": (lambda ws: ws.file("cut.npz", ws.inputs.read_bytes()[:100]), ("cut.npz", "not a readable")),
    "npy": (lambda ws: ws.file("one.npz", _npy()), ("one.npz", "single array")),
    "pickled-objects": (lambda ws: ws.file("obj.npz", _npz(x=np.array([{}, None], dtype=object))),
                        ("obj.npz", "object arrays")),
    "extra-key": (lambda ws: ws.file("extra.npz", _npz(**_feeds(ws), stray=np.zeros(2))), ("'stray'",)),
    "missing-key": (lambda ws: ws.file("few.npz", _npz(**{k: v for k, v in _feeds(ws).items() if "mean" not in k})),
                    ("missing input", "bn.mean")),
    "wrong-dtype": (lambda ws: ws.file("f64.npz", _npz(**{k: v.astype(np.float64) for k, v in _feeds(ws).items()})),
                    ("float64",)),
    "zip-of-text": (lambda ws: ws.file("zipped.npz", _zip_of_text(ws)),
                    ("zipped.npz", "'bn.src'", "not a NumPy array")),
    "through-a-file": (lambda ws: ws.inputs / "x.npz", ("x.npz",)),
}


def _npy() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(3))
    return buffer.getvalue()


def _zip_of_text(ws: Workspace) -> bytes:
    """An .npz whose member for bn.src is text, the others arrays."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, array in _feeds(ws).items():
            member = io.BytesIO()
            np.save(member, array)
            z.writestr(f"{name}.npy", b"not an array" if name == "bn.src" else member.getvalue())
    return buffer.getvalue()


def _feeds(ws: Workspace) -> dict[str, np.ndarray]:
    with np.load(ws.inputs) as data:
        return {k: data[k] for k in data.files}


# -- running and checking ---------------------------------------------------------------------------------

def _digest(path: Path) -> bytes | None:
    return hashlib.sha256(path.read_bytes()).digest() if path.is_file() else None


def _leftovers(*dirs: Path) -> list[str]:
    return [p.name for d in dirs if d.is_dir() for p in d.iterdir() if p.name.endswith(".tmp")]


def _run(argv: list, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def expect_failure(argv: list, capsys, code: int, fragments, *, inputs=(), outputs=(), dirs=()) -> str:
    """Run; check the exit code, one stderr line holding every fragment, inputs unchanged, outputs absent."""
    inputs = [Path(p) for p in inputs]
    before = {p: _digest(p) for p in inputs}
    outputs_before = {Path(p): _digest(Path(p)) for p in outputs}
    got, _, err = _run(argv, capsys)
    lines = err.splitlines()
    assert got == code, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    for p in inputs:
        assert _digest(p) == before[p], f"{p} changed"
    for p, digest in outputs_before.items():
        assert _digest(p) == digest, f"{p} was written"
    assert not _leftovers(*[Path(d) for d in dirs])
    return lines[0]


# -- subcommands x bad paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", BAD_PATHS)
def test_check_bad_model_path(ws, capsys, kind):
    make, fragments = BAD_PATHS[kind]
    expect_failure(["check", make(ws)], capsys, 1, ("oplower check: error:", *fragments), inputs=[ws.model])


@pytest.mark.parametrize("kind", BAD_PATHS)
def test_lower_bad_model_path(ws, capsys, kind):
    make, fragments = BAD_PATHS[kind]
    out = ws.dir / "out.onnx"
    expect_failure(["lower", make(ws), "-o", out], capsys, 1, ("oplower lower: error:", *fragments),
                   inputs=[ws.model], outputs=[out], dirs=[ws.dir])


@pytest.mark.parametrize("kind", BAD_PATHS)
def test_run_bad_model_path(ws, capsys, kind):
    make, fragments = BAD_PATHS[kind]
    out = ws.dir / "out.npz"
    expect_failure(["run", make(ws), "--inputs", ws.inputs, "--outputs", out], capsys, 1,
                   ("oplower run: error:", *fragments), inputs=[ws.model, ws.inputs], outputs=[out], dirs=[ws.dir])


@pytest.mark.parametrize("kind", NPZ_PATHS)
def test_run_bad_inputs_npz(ws, capsys, kind):
    make, fragments = NPZ_PATHS[kind]
    out = ws.dir / "out.npz"
    expect_failure(["run", ws.model, "--inputs", make(ws), "--outputs", out], capsys, 1,
                   ("oplower run: error:", *fragments), inputs=[ws.model, ws.inputs], outputs=[out], dirs=[ws.dir])


@pytest.mark.parametrize("kind", SPEC_PATHS)
def test_schema_bad_spec_path(ws, capsys, kind):
    if kind == "directory":
        (ws.dir / "specdir.rst").mkdir()
    make, fragments = SPEC_PATHS[kind]
    expect_failure(["schema", make(ws)], capsys, 1, ("oplower schema: error:", *fragments), inputs=[ws.spec])


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: file permissions do not stop root "
                    "(CAP_DAC_OVERRIDE), and an unprivileged child cannot reach this venv's interpreter under "
                    "/root, so an unreadable file cannot be produced here; see test_permission_denied_path")
@pytest.mark.parametrize("command", ["check", "lower", "schema"])
def test_unreadable_file(ws, capsys, command):
    target = ws.spec if command == "schema" else ws.model
    target.chmod(0)
    argv = [command, target] + (["-o", ws.dir / "out.onnx"] if command == "lower" else [])
    expect_failure(argv, capsys, 1, (target.name, "ermission denied"))


def test_permission_denied_path(ws, capsys, monkeypatch):
    """The permission-denied branch of load_model, reached by making the read itself fail."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(onnx, "load", refuse)
    expect_failure(["check", ws.model], capsys, 1, ("model.onnx", "permission denied"), inputs=[ws.model])


# -- lower: outputs ------------------------------------------------------------------------------------------

def test_lower_output_equal_to_input_is_a_usage_error(ws, capsys):
    expect_failure(["lower", ws.model, "-o", ws.model], capsys, 2, ("--in-place",), inputs=[ws.model],
                   dirs=[ws.dir])


def test_lower_output_is_a_symlink_to_the_input(ws, capsys):
    link = ws.dir / "link.onnx"
    link.symlink_to(ws.model)
    expect_failure(["lower", ws.model, "-o", link], capsys, 2, ("--in-place",), inputs=[ws.model], dirs=[ws.dir])


def test_lower_output_directory_missing(ws, capsys):
    out = ws.dir / "nowhere" / "out.onnx"
    expect_failure(["lower", ws.model, "-o", out], capsys, 1, ("out.onnx", "does not exist"), inputs=[ws.model],
                   dirs=[ws.dir])
    assert not out.parent.exists()


def test_lower_output_is_a_directory(ws, capsys):
    out = ws.dir / "sub"
    out.mkdir()
    expect_failure(["lower", ws.model, "-o", out], capsys, 1, ("sub", "directory"), inputs=[ws.model],
                   dirs=[ws.dir, out])
    assert not list(out.iterdir())


def test_lower_output_under_a_file(ws, capsys):
    expect_failure(["lower", ws.model, "-o", ws.inputs / "out.onnx"], capsys, 1, ("out.onnx",),
                   inputs=[ws.model, ws.inputs], dirs=[ws.dir])


def test_lower_invalid_node_writes_nothing_and_keeps_an_old_output(ws, capsys):
    bad = ws.file("bad.onnx", _bad_model_bytes(ws))
    out = ws.file("out.onnx", b"previous result")
    expect_failure(["lower", bad, "-o", out], capsys, 1, ("'bn'", "epsilon is -1.0"), inputs=[bad],
                   outputs=[out], dirs=[ws.dir])


def test_check_invalid_node_names_file_and_node(ws, capsys):
    bad = ws.file("bad.onnx", _bad_model_bytes(ws))
    expect_failure(["check", bad], capsys, 1, ("bad.onnx", "'bn'", "epsilon is -1.0"), inputs=[bad])


def test_lower_in_place_keeps_the_file_mode(ws, capsys):
    ws.model.chmod(0o640)
    code, _, err = _run(["lower", ws.model, "-o", ws.model, "--in-place"], capsys)
    assert code == 0, err
    assert stat.S_IMODE(ws.model.stat().st_mode) == 0o640
    assert {n.domain for n in onnx.load(ws.model).graph.node} == {""}
    assert not _leftovers(ws.dir)


def test_lower_new_output_gets_the_umask_mode(ws, capsys):
    old = os.umask(0o022)
    try:
        code, _, err = _run(["lower", ws.model, "-o", ws.dir / "new.onnx"], capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    assert stat.S_IMODE((ws.dir / "new.onnx").stat().st_mode) == 0o644


# -- run: outputs --------------------------------------------------------------------------------------------

def test_run_outputs_equal_to_model_is_refused(ws, capsys):
    expect_failure(["run", ws.model, "--inputs", ws.inputs, "--outputs", ws.model], capsys, 1,
                   ("refusing to overwrite",), inputs=[ws.model, ws.inputs], dirs=[ws.dir])


def test_run_outputs_directory_missing(ws, capsys):
    out = ws.dir / "nowhere" / "out.npz"
    line = expect_failure(["run", ws.model, "--inputs", ws.inputs, "--outputs", out], capsys, 1,
                          ("out.npz", "does not exist"), inputs=[ws.model, ws.inputs], dirs=[ws.dir])
    assert "oplower run: error:" in line


def test_run_invalid_node(ws, capsys):
    bad = ws.file("bad.onnx", _bad_model_bytes(ws))
    expect_failure(["run", bad, "--inputs", ws.inputs], capsys, 1, ("bad.onnx", "'bn'", "epsilon"),
                   inputs=[bad, ws.inputs])


# -- usage errors (exit 2) ------------------------------------------------------------------------------------

USAGE = {
    "no-command": [],
    "unknown-command": ["frobnicate"],
    "unknown-global-option": ["--frob", "check", "m.onnx"],
    "check-no-model": ["check"],
    "check-unknown-option": ["check", "m.onnx", "--frob"],
    "lower-no-output": ["lower", "m.onnx"],
    "lower-no-model": ["lower", "-o", "out.onnx"],
    "lower-bad-single-output": ["lower", "m.onnx", "-o", "o.onnx", "--onednn-single-output", "maybe"],
    "lower-seed-not-int": ["lower", "m.onnx", "-o", "o.onnx", "--seed", "x"],
    "run-no-inputs": ["run", "m.onnx"],
    "run-threads-zero": ["run", "m.onnx", "--inputs", "i.npz", "--threads", "0"],
    "run-threads-text": ["run", "m.onnx", "--inputs", "i.npz", "--threads", "many"],
    "schema-bad-dialect": ["schema", "--dialect", "klingon"],
    "schema-two-targets": ["schema", "a", "b"],
    "demo-extra-argument": ["demo", "now"],
    "bench-bad-shapes": ["bench", "--shapes", "huge"],
    "bench-unknown-option": ["bench", "--fast"],
}


@pytest.mark.parametrize("name", USAGE)
def test_usage_error(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = expect_failure(USAGE[name], capsys, 2, ("error:", "--help"), dirs=[tmp_path])
    assert line.startswith("oplower")
    assert not list(tmp_path.iterdir())


# -- other subcommand failures ------------------------------------------------------------------------------

def test_schema_unknown_op(capsys):
    expect_failure(["schema", "NoSuchOp"], capsys, 1, ("NoSuchOp", "known:"))


def test_schema_wrong_dialect_forced(ws, capsys):
    expect_failure(["schema", ws.spec, "--dialect", "ngraph"], capsys, 1, ("Op.rst",), inputs=[ws.spec])


def test_bench_json_into_missing_directory_fails_before_timing(ws, capsys, monkeypatch):
    import lowering.bench

    def never(**kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(lowering.bench, "run_bench", never)
    expect_failure(["bench", "--shapes", "tiny", "--json", ws.dir / "nowhere" / "b.json"], capsys, 1,
                   ("b.json", "does not exist"), dirs=[ws.dir])


# -- the real process: exit codes, one line, traceback only with --debug ----------------------------------------

def _process(*argv, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "lowering", *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def test_process_failure_is_one_line_and_debug_shows_the_traceback(ws):
    bad = ws.file("bad.onnx", _bad_model_bytes(ws))
    before = _digest(bad)
    plain = _process("lower", bad, "-o", ws.dir / "o.onnx", cwd=ws.dir)
    assert plain.returncode == 1
    assert len(plain.stderr.splitlines()) == 1 and "'bn'" in plain.stderr and "Traceback" not in plain.stderr
    debug = _process("--debug", "lower", bad, "-o", ws.dir / "o.onnx", cwd=ws.dir)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "VerificationError" in debug.stderr
    assert _digest(bad) == before and not (ws.dir / "o.onnx").exists() and not _leftovers(ws.dir)


def test_process_usage_error_exit_2(ws):
    result = _process("lower", ws.model, cwd=ws.dir)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1


def core_case_count() -> int:
    """Bad CLI inputs: each parametrized case, each single test (the unreadable-file test counted once)."""
    tables = len(BAD_PATHS) * 3 + len(NPZ_PATHS) + len(SPEC_PATHS) + len(USAGE)
    singles = [name for name, fn in globals().items() if name.startswith("test_") and callable(fn)
               and not any(m.name == "parametrize" for m in getattr(fn, "pytestmark", []))]
    return tables + len(singles) + 1
