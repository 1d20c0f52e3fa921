"""An on-disk cache of parsed schema registries: specs/ parsed once per machine, not once per process.

Parsing the spec documents (docutils) costs 0.4-0.6 s, more than everything else ``oplower artifacts``, ``train``
or ``lower`` do on a CIFAR network; unpickling the result costs a few milliseconds. The cache file is keyed by a
hash of everything the result depends on: every file under the spec directory (its bytes and relative path), the
directory's own path (schemas record their source file), opdef's own source files (the parsers and the pickled
classes), the package's version, docutils' (its ``__init__.py``) and Python's. It lives in ``$XDG_CACHE_HOME/oplower``
(default ``~/.cache/oplower``), is written atomically (a temporary file, then ``os.replace``), and anything that
goes wrong reading, writing, unpickling or validating it falls back to parsing, silently: the cache can make a
run faster, never fail it. ``OPLOWER_NO_CACHE=1`` turns it off.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path

try:  # CPython's own BLAKE2 (hashlib would load OpenSSL too: 2.5 ms a process); 3x its own sha256's speed
    from _blake2 import blake2b as _blake2b
except ImportError:
    from hashlib import blake2b as _blake2b

from opdef.binding import Binding
from opdef.schema import OpSchema

__all__ = ["NO_CACHE_ENV", "cache_dir", "cache_key", "cached_registry"]

NO_CACHE_ENV = "OPLOWER_NO_CACHE"
_FORMAT = 1  # bump when the payload's layout changes
_MAGIC = "oplower-schema-registry"
_KEEP = 8  # cache files kept (one per spec directory and version in use); older ones are removed
_OPDEF = Path(__file__).resolve().parent


def enabled() -> bool:
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() in ("", "0", "false", "no")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"  # XDG: relative paths are invalid
    return root / "oplower"


def _version(distribution: str) -> str:
    try:
        import importlib.metadata  # noqa: PLC0415

        return importlib.metadata.version(distribution)
    except Exception:  # noqa: BLE001 -- not installed (a bare checkout): the sources' hash still keys it
        return "?"


def _docutils() -> bytes:
    """docutils' ``__init__.py`` (its ``__version__``): found without importing docutils, which a hit never needs,
    and without parsing its metadata (importlib.metadata: 0.6 ms)."""
    try:
        import importlib.util  # noqa: PLC0415

        with open(importlib.util.find_spec("docutils").origin, "rb") as fh:
            return fh.read()
    except Exception:  # noqa: BLE001 -- no docutils: parsing will say so
        return b"?"


def _files(root: str, suffix: str = "") -> list[tuple[str, str]]:
    """(path relative to ``root`` with / separators, full path) of every file under ``root``, sorted by the
    relative path, __pycache__ left out; only names ending in ``suffix`` when given."""
    out = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in it:
                name = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir():
                    if entry.name != "__pycache__":
                        stack.append(name)
                elif name.endswith(suffix):
                    out.append((name, entry.path))
    out.sort()
    return out


def cache_key(spec_dir: Path) -> str:
    """The hash of everything a registry parsed from ``spec_dir`` depends on (raises OSError if unreadable)."""
    h = _blake2b(digest_size=32)

    def add(label: str, data: bytes) -> None:
        h.update(f"{label}\0{len(data)}\0".encode())
        h.update(data)

    def read(path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    add("format", str(_FORMAT).encode())
    add("python", f"{sys.implementation.cache_tag} {sys.version}".encode())
    add("oplower", _version("oplower").encode())
    add("docutils", _docutils())
    add("spec_dir", str(spec_dir).encode())
    for rel, path in _files(str(_OPDEF), ".py"):
        add("opdef/" + rel, read(path))
    for rel, path in _files(str(spec_dir)):
        add("spec/" + rel, read(path))
    return h.hexdigest()


def cached_registry(spec_dir: Path, build: Callable[[Path], object], make: Callable[..., object]) -> object:
    """``build(spec_dir)``, or the registry a previous build of the same inputs left in the cache.

    ``make(pairs, spec_dir, shared_domains)`` rebuilds a registry from the cached (schema, binding) pairs
    (through ``Registry``'s own constructor, which checks them again); ``build``'s result must have
    ``spec_dir``, ``shared_domains`` and iterate over its entries (``schema``, ``binding``)."""
    if not enabled():
        return build(spec_dir)
    try:
        key = cache_key(spec_dir)
        path = cache_dir() / f"registry-{key[:32]}.pickle"
    except Exception:  # noqa: BLE001 -- an unreadable file: parse, which reports it properly
        return build(spec_dir)
    registry = _read(path, key, spec_dir, make)
    if registry is not None:
        return registry
    registry = build(spec_dir)
    _write(path, key, registry)
    return registry


def _read(path: Path, key: str, spec_dir: Path, make) -> object | None:
    try:
        with open(path, "rb") as fh:
            payload = pickle.load(fh)  # noqa: S301 -- the user's own cache directory, written by this module
        magic, fmt, stored_key, entries, shared = payload
        if magic != _MAGIC or fmt != _FORMAT or stored_key != key:
            return None
        if not isinstance(entries, list) or not isinstance(shared, frozenset) or not all(
                isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], OpSchema) and isinstance(e[1], Binding)
                for e in entries):
            return None
        return make(entries, spec_dir, shared)  # the registry module builds its entries (it imports this one)
    except Exception:  # noqa: BLE001 -- missing, truncated, corrupt, stale: parse instead
        return None


def _write(path: Path, key: str, registry) -> None:
    tmp = None
    try:
        # a fresh Binding drops what its cached properties memoised (a MappingProxyType does not pickle)
        entries = [(e.schema, dataclasses.replace(e.binding)) for e in registry]
        data = pickle.dumps((_MAGIC, _FORMAT, key, entries, frozenset(registry.shared_domains)),
                            protocol=pickle.HIGHEST_PROTOCOL)
        import tempfile  # noqa: PLC0415

        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".registry-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
        tmp = None
        _prune(path.parent, keep=path)
    except Exception:  # noqa: BLE001 -- read-only home, full disk, a schema that does not pickle: no cache
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _prune(directory: Path, keep: Path) -> None:
    """Remove all but the ``_KEEP`` most recently written registry files (spec edits leave old ones behind)."""
    files = sorted(directory.glob("registry-*.pickle"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[_KEEP:]:
        if old != keep:
            try:
                old.unlink()
            except OSError:
                pass
