"""The explicit schema registry: specs/ parsed once, schemas looked up by (domain, op_type)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

from opdef.binding import Binding, read_binding_file
from opdef.errors import SpecError
from opdef.parse import parse_spec
from opdef.schema import OpSchema

BINDINGS_FILE = "bindings.json"
DEFAULT_DOMAINS = ("", "ai.onnx")  # two spellings of the default ONNX domain


def _domain(domain: str) -> str:
    return "" if domain in DEFAULT_DOMAINS else domain


@functools.cache
def _is_onnx_op(op_type: str) -> bool:
    """Whether onnx.defs knows ``op_type`` in the default domain (any opset), the ones registered since included:
    one lookup per name (listing every schema with its history to collect the names costs 15 ms)."""
    import onnx.defs

    return any(onnx.defs.has(op_type, domain) for domain in DEFAULT_DOMAINS)


def default_spec_dir() -> Path:
    """specs/ as installed (inside the package, as ``opdef/specs``) or, in a checkout, beside the packages."""
    here = Path(__file__).resolve().parent
    installed = here / "specs"
    if (installed / BINDINGS_FILE).is_file():
        return installed
    return here.parent / "specs"


@dataclasses.dataclass(frozen=True)
class Entry:
    schema: OpSchema
    binding: Binding


class Registry:
    """Schemas and bindings keyed by (domain, op_type). Built by :func:`load_schemas`."""

    def __init__(self, entries: list[Entry], spec_dir: Path, shared_domains: frozenset[str] = frozenset()) -> None:
        self.spec_dir = spec_dir
        self.shared_domains = frozenset(shared_domains)
        self._entries: dict[tuple[str, str], Entry] = {}
        for entry in entries:
            key = entry.binding.key
            if key in self._entries:
                raise SpecError(str(spec_dir / BINDINGS_FILE), None,
                                f"two bindings for {key[0]}::{key[1]}")
            self._entries[key] = entry

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def domains(self) -> frozenset[str]:
        """The custom domains the registry binds ops of (the default domain is never one)."""
        return frozenset(d for d, _ in self._entries if d != "")

    def handles(self, domain: str, op_type: str, opset: int | None = None) -> bool:
        """Whether a node is this registry's to verify and lower: every op of a domain the project owns
        (an unknown op there is an error), only the bound ops of a shared domain (``com.microsoft``).

        In the default domain (only when some binding is there): the bound non-standard ops (onnxruntime-
        training's MaxPoolGrad ...) from their ``since_opset`` on (``opset``: the model's default opset, None:
        any), and any name that is no standard ONNX op at all, so that verification reports it as unknown;
        every standard op is left alone."""
        domain = _domain(domain)
        if domain == "":
            return self._handles_default(op_type, opset)
        if domain not in self.domains:
            return False
        return domain not in self.shared_domains or (domain, op_type) in self._entries

    def _handles_default(self, op_type: str, opset: int | None) -> bool:
        entry = self._entries.get(("", op_type))
        if entry is not None:
            since = entry.binding.since_opset
            return opset is None or since is None or opset >= since
        if not any(d == "" for d, _ in self._entries):
            return False
        return not _is_onnx_op(op_type)

    def get(self, domain: str, op_type: str) -> Entry | None:
        return self._entries.get((_domain(domain), op_type))

    def schema(self, domain: str, op_type: str) -> OpSchema:
        return self._require(domain, op_type).schema

    def binding(self, domain: str, op_type: str) -> Binding:
        return self._require(domain, op_type).binding

    def find(self, op_type: str) -> list[Entry]:
        """Every entry whose op_type (or schema name) is ``op_type``, case-insensitively."""
        want = op_type.lower()
        return [e for e in self if e.binding.op_type.lower() == want or e.schema.name.lower() == want]

    def _require(self, domain: str, op_type: str) -> Entry:
        entry = self._entries.get((domain, op_type))
        if entry is None:
            known = ", ".join(f"{d}::{o}" for d, o in sorted(self._entries))
            raise KeyError(f"no schema for {domain}::{op_type} (known: {known})")
        return entry


def build_registry(spec_dir: Path) -> Registry:
    spec_dir = Path(spec_dir)
    entries = []
    bindings, shared_domains = read_binding_file(spec_dir / BINDINGS_FILE)
    for binding in bindings:
        path = spec_dir / binding.spec
        schema = parse_spec(path, binding.dialect, include_dirs=(path.parent, spec_dir / "_include"))
        if schema.name != binding.op_type:
            raise SpecError(str(path), None, f"document defines {schema.name!r} but bindings.json binds it "
                                             f"as {binding.op_type!r}")
        schema = dataclasses.replace(schema, domain=binding.domain)
        _check_roles(schema, binding, spec_dir / BINDINGS_FILE)
        entries.append(Entry(schema, binding))
    return Registry(entries, spec_dir, shared_domains)


def _check_roles(schema: OpSchema, binding: Binding, source: Path) -> None:
    names = {a.name for a in schema.inputs} | {a.name for a in schema.outputs} | {
        a.name for a in schema.attributes}
    for role, name in binding.roles:
        if name not in names:
            raise SpecError(str(source), None, f"{binding.domain}::{binding.op_type}: role {role!r} names "
                                               f"{name!r}, which the spec document does not define")


@functools.lru_cache(maxsize=8)
def _load(spec_dir: str) -> Registry:
    from opdef.registry_cache import cached_registry  # noqa: PLC0415

    return cached_registry(Path(spec_dir), build_registry, _from_cache)


def _from_cache(pairs, spec_dir: Path, shared) -> Registry:
    """A registry from the cache's (schema, binding) pairs."""
    return Registry([Entry(schema, binding) for schema, binding in pairs], spec_dir, shared)


def load_schemas(spec_dir: Path | str | None = None) -> Registry:
    """Parse specs/ (once per directory and process; the parsed registry is also cached on disk, see
    :mod:`opdef.registry_cache`) and return the registry."""
    return _load(str(Path(spec_dir).resolve()) if spec_dir else str(default_spec_dir()))
