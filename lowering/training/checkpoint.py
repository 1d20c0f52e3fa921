"""onnxruntime-training checkpoints: read and write the ``checkpoint`` file of a training artifact directory.

The file is a FlatBuffers buffer (file identifier ``ODTC``, checkpoint version 2 in onnxruntime-training
1.19): a ``ModuleState`` with the trainable (``requires_grad_params``) and frozen parameters as tensors,
optionally one ``OptimizerGroup`` (``group0``: the optimizer step, the initial learning rate, and per
trainable parameter its moments ``momentum0``, ``momentum1``), optionally a ``PropertyBag`` of named ints,
floats and strings. Plain onnxruntime ships the generated Python classes of this schema
(``onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs``); this module reads and builds buffers with
them and the ``flatbuffers`` package, adding only the checks a damaged file needs: every read is bounds
checked (a cut-short file is refused, never read short), vector lengths are bounded by the file's size,
and a file must end where its last object does (FlatBuffers pads a finished buffer to its largest
alignment, 8 bytes here, so a file cut by fewer bytes than that is caught by its length).

Errors are one line naming the file and the first mismatch (:class:`CheckpointError`).
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import flatbuffers
import numpy as np
from onnx import TensorProto, helper

from lowering.modelio import write_atomic
from opdef.errors import OplowerError


def _schema_classes() -> ModuleType:
    """onnxruntime's generated classes of the schema (``ort_flatbuffers_py.fbs``, which import only
    ``flatbuffers`` and, inside some accessors, ``ort_flatbuffers_py.fbs.*`` by that top-level name), loaded
    from its package directory under that name: imported as ``onnxruntime.tools.ort_format_model...`` they run
    ``onnxruntime.tools``' ``__init__``, which imports torch whenever torch is installed (1 s and ~170 MB of
    resident memory for every ``oplower train`` on such a machine)."""
    if "ort_flatbuffers_py" not in sys.modules:
        root = Path(importlib.util.find_spec("onnxruntime").origin).parent / "tools" / "ort_format_model" \
            / "ort_flatbuffers_py"
        spec = importlib.util.spec_from_file_location("ort_flatbuffers_py", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["ort_flatbuffers_py"] = module
        spec.loader.exec_module(module)
    return importlib.import_module("ort_flatbuffers_py.fbs")


_FBS = _schema_classes()
FbCheckpoint, FloatProperty, IntProperty, ModuleState, OptimizerGroup, ParameterOptimizerState, PropertyBag, \
    StringProperty, Tensor = (getattr(_FBS, n) for n in ("Checkpoint", "FloatProperty", "IntProperty", "ModuleState",
                                                          "OptimizerGroup", "ParameterOptimizerState", "PropertyBag",
                                                          "StringProperty", "Tensor"))

VERSION = 2  # onnxruntime-training 1.19's kCheckpointVersion
IDENTIFIER = b"ODTC"
GROUP = "group0"  # the one optimizer group onnxruntime-training writes
ALIGNMENT = 8  # a finished buffer's length is a multiple of its largest scalar (int64 dims, step)
# element types a parameter can have (onnx TensorProto numbering, which the schema's TensorDataType shares)
DTYPES = {t: np.dtype(helper.tensor_dtype_to_np_dtype(t)) for t in (
    TensorProto.FLOAT, TensorProto.UINT8, TensorProto.INT8, TensorProto.UINT16, TensorProto.INT16,
    TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT16, TensorProto.DOUBLE,
    TensorProto.UINT32, TensorProto.UINT64)}
CODES = {dtype: code for code, dtype in DTYPES.items()}


class CheckpointError(OplowerError):
    """A checkpoint file that cannot be read, or that does not fit the artifacts it is used with."""


@dataclass
class Checkpoint:
    """What a checkpoint holds. ``moments[p]`` are parameter ``p``'s optimizer moments in order
    (``momentum0`` = first_order_moments, ``momentum1`` = second_order_moments); empty without optimizer
    state. ``step`` counts the optimizer steps taken (the next one passes ``step + 1``)."""

    params: dict[str, np.ndarray]
    frozen: dict[str, np.ndarray] = field(default_factory=dict)
    moments: dict[str, list[np.ndarray]] = field(default_factory=dict)
    step: int = 0
    learning_rate: float | None = None  # the optimizer group's initial learning rate
    properties: dict[str, int | float | str] = field(default_factory=dict)

    @property
    def has_optimizer_state(self) -> bool:
        return bool(self.moments)


# -- reading ----------------------------------------------------------------------------------------------


class _Damaged(Exception):
    """Internal: a read outside the buffer or an impossible value."""


class _StrictBytes(bytes):
    """The file's bytes; a slice reaching past the end raises instead of coming back short (the generated
    classes read strings by slicing), and the furthest byte any slice read is remembered."""

    def __new__(cls, data: bytes):
        obj = super().__new__(cls, data)
        obj.end = 0
        return obj

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop = key.start or 0, key.stop if key.stop is not None else len(self)
            if start < 0 or stop > len(self) or start > stop:
                raise _Damaged(f"a string at byte {start} runs past the end of the file ({len(self)} bytes)")
            self.end = max(self.end, stop + 1)  # FlatBuffers strings carry a terminating zero byte
        return super().__getitem__(key)


def read_checkpoint(path: Path | str) -> Checkpoint:
    """Read ``path``; a missing, cut-short, damaged, foreign or other-version file raises :class:`CheckpointError`."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, expected a checkpoint file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return decode_checkpoint(data, str(path))


def decode_checkpoint(data: bytes, source: str = "checkpoint") -> Checkpoint:
    """The checkpoint in ``data`` (the bytes of a file named ``source`` in error messages)."""
    if len(data) < 8 or data[4:8] != IDENTIFIER:
        what = "empty" if not data else f"{len(data)} bytes" if len(data) < 8 else f"identifier {bytes(data[4:8])!r}"
        raise CheckpointError(f"{source}: not an onnxruntime-training checkpoint ({what}; expected the FlatBuffers "
                              f"file identifier {IDENTIFIER.decode()} at byte 4)")
    buf = _StrictBytes(bytes(data))
    try:
        return _decode(buf, source)
    except CheckpointError:
        raise
    except _Damaged as exc:
        raise CheckpointError(f"{source}: cut short or damaged: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- the flatbuffers package raises struct.error, IndexError, ValueError...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(f"{source}: cut short or damaged: {type(exc).__name__}: {reason}") from None


def _decode(buf: _StrictBytes, source: str) -> Checkpoint:
    size = len(buf)
    root = FbCheckpoint.Checkpoint.GetRootAs(buf, 0)
    _check_table(root, size, "the checkpoint table")
    version = root.Version()
    if version != VERSION:
        raise CheckpointError(f"{source}: checkpoint version {version}; oplower reads version {VERSION} "
                              "(onnxruntime-training 1.19)")
    module = root.ModuleState()
    if module is None:
        raise CheckpointError(f"{source}: no module state (no parameters)")
    _check_table(module, size, "the module state")
    if module.IsNominalState():
        raise CheckpointError(f"{source}: a nominal checkpoint (parameter names without values); oplower needs the "
                              "values")
    if module.HasExternalData():
        raise CheckpointError(f"{source}: parameter data in an external file, which oplower does not read")
    params = _tensors(module.RequiresGradParams, _count(module.RequiresGradParamsLength(), size, "parameters"),
                      size, "trainable parameter")
    frozen = _tensors(module.FrozenParams, _count(module.FrozenParamsLength(), size, "frozen parameters"),
                      size, "frozen parameter")
    both = sorted(set(params) & set(frozen))
    if both:
        raise CheckpointError(f"{source}: parameter {both[0]!r} is both trainable and frozen")
    out = Checkpoint(params, frozen)
    groups = _count(root.OptimizerGroupsLength(), size, "optimizer groups")
    if groups > 1:
        raise CheckpointError(f"{source}: {groups} optimizer groups; oplower handles one ({GROUP!r})")
    if groups:
        group = root.OptimizerGroups(0)
        _check_table(group, size, "the optimizer group")
        name = _text(group.GroupName(), "the optimizer group's name")
        out.step = int(group.Step())
        if out.step < 0:
            raise CheckpointError(f"{source}: optimizer group {name!r} has step {out.step}")
        out.learning_rate = float(group.InitialLearningRate())
        for j in range(_count(group.OptimizerStatesLength(), size, "optimizer states")):
            state = group.OptimizerStates(j)
            _check_table(state, size, "an optimizer state")
            param = _text(state.ParamName(), "an optimizer state's parameter name")
            if param not in params:
                raise CheckpointError(f"{source}: optimizer state for {param!r}, which is no trainable parameter")
            if param in out.moments:
                raise CheckpointError(f"{source}: two optimizer states for {param!r}")
            moments = _tensors(state.Momentums, _count(state.MomentumsLength(), size, "moments"), size,
                               f"moment of {param!r}")
            expected = [f"momentum{i}" for i in range(len(moments))]
            if list(moments) != expected:
                raise CheckpointError(f"{source}: the moments of {param!r} are {list(moments)}; expected "
                                      f"{expected}")
            for m, value in moments.items():
                if value.shape != params[param].shape or value.dtype != params[param].dtype:
                    raise CheckpointError(f"{source}: {m} of {param!r} is {value.dtype}{list(value.shape)}; the "
                                          f"parameter is {params[param].dtype}{list(params[param].shape)}")
            out.moments[param] = list(moments.values())
        lacking = [p for p in params if p not in out.moments]
        if out.moments and lacking:
            raise CheckpointError(f"{source}: no optimizer state for the trainable parameter {lacking[0]!r}")
        if len({len(m) for m in out.moments.values()}) > 1:
            raise CheckpointError(f"{source}: the parameters' optimizer states hold different numbers of moments")
    bag = root.PropertyBag()
    if bag is not None:
        _check_table(bag, size, "the property bag")
        for length, item in ((bag.IntsLength, bag.Ints), (bag.FloatsLength, bag.Floats),
                             (bag.StringsLength, bag.Strings)):
            for j in range(_count(length(), size, "properties")):
                prop = item(j)
                _check_table(prop, size, "a property")
                name = _text(prop.Name(), "a property's name")
                value = prop.Value()
                out.properties[name] = _text(value, f"property {name!r}") if isinstance(value, bytes | None) \
                    else value
    # the buffer ends where its last object does: the builder pads a finished buffer to ALIGNMENT bytes
    # (so the length is a multiple of it), and nothing after the furthest object read is longer than that
    if size % ALIGNMENT or size - buf.end >= ALIGNMENT:
        raise CheckpointError(f"{source}: cut short or damaged: {size} bytes, but its contents end at byte "
                              f"{buf.end} (a checkpoint's length is a multiple of {ALIGNMENT} bytes, at most "
                              f"{ALIGNMENT - 1} past its last object)")
    return out


def _count(n: int, size: int, what: str) -> int:
    # every vector element takes at least 4 bytes (an offset): a longer vector cannot be in the file
    if n < 0 or 4 * n > size:
        raise _Damaged(f"{n} {what} cannot fit in {size} bytes")
    return n


def _check_table(obj, size: int, what: str) -> None:
    tab = obj._tab
    pos = tab.Pos
    if not 0 <= pos <= size - 4:
        raise _Damaged(f"{what} at byte {pos} lies outside the file")
    vtable = pos - flatbuffers.encode.Get(flatbuffers.packer.soffset, tab.Bytes, pos)
    if not 0 <= vtable <= size - 4:
        raise _Damaged(f"{what}'s field table at byte {vtable} lies outside the file")


def _text(raw, what: str) -> str:
    if raw is None:
        raise _Damaged(f"{what} is missing")
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise _Damaged(f"{what} is not UTF-8 text") from None


def _tensors(item, n: int, size: int, what: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for j in range(n):
        t = item(j)
        _check_table(t, size, f"a {what}")
        name = _text(t.Name(), f"the name of a {what}")
        if name in out:
            raise _Damaged(f"two {what}s named {name!r}")
        out[name] = _tensor_value(t, size, f"{what} {name!r}")
    return out


def _tensor_value(t: Tensor.Tensor, size: int, what: str) -> np.ndarray:
    code = t.DataType()
    if code not in DTYPES:
        raise _Damaged(f"{what} has element type {code}, which is no numeric tensor type")
    if t.DocString() is not None:
        _text(t.DocString(), f"the doc string of {what}")
    if t.StringDataLength():
        raise _Damaged(f"{what} holds strings")
    if t.ExternalDataOffset() != -1:
        raise _Damaged(f"{what} refers to external data")
    dims = [] if t.DimsIsNone() else [int(d) for d in _numpy(t.DimsAsNumpy, t.DimsLength, 8, t._tab.Bytes)]
    if any(d < 0 for d in dims):
        raise _Damaged(f"{what} has dimensions {dims}")
    raw = b"" if t.RawDataIsNone() else _numpy(t.RawDataAsNumpy, t.RawDataLength, 1, t._tab.Bytes).tobytes()
    dtype = DTYPES[code]
    count = int(np.prod(dims, dtype=object)) if dims else 1
    if len(raw) != count * dtype.itemsize:
        raise _Damaged(f"{what} has {len(raw)} data bytes; {dtype}{dims} takes {count * dtype.itemsize}")
    return np.frombuffer(raw, dtype.newbyteorder("<")).astype(dtype).reshape(dims)


def _numpy(as_numpy, length, itemsize: int, buf: _StrictBytes) -> np.ndarray:
    n = length()
    if n < 0 or n * itemsize > len(buf):
        raise _Damaged(f"a vector of {n} elements cannot fit in {len(buf)} bytes")
    value = as_numpy()  # numpy refuses a vector reaching past the end
    if n:  # vectors are read through numpy, not slicing: mark their end for the length check
        start = value.ctypes.data - np.frombuffer(buf, np.uint8).ctypes.data
        buf.end = max(buf.end, start + n * itemsize)
    return value


# -- writing ----------------------------------------------------------------------------------------------


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    """The FlatBuffers bytes onnxruntime-training 1.19's ``CheckpointState.load_checkpoint`` reads (see
    :func:`encode_checkpoint_buffer`)."""
    return bytes(encode_checkpoint_buffer(checkpoint))


def encode_checkpoint_buffer(checkpoint: Checkpoint) -> memoryview:
    """:func:`encode_checkpoint`'s bytes as a view into the builder's buffer, for writing them (``bytes`` of it
    copies the whole checkpoint once more: 1.2 ms for 2.4 MB). Tensors sorted by name, as onnxruntime-training
    writes them; the optimizer group only with moments.

    The builder is sized up front (it would double its buffer a dozen times for a few MB, copying it each time),
    each tensor's bytes are copied once, straight into it, and the tensor tables -- all but a handful of a
    checkpoint's objects -- are laid out by :func:`_tensor_table`, byte for byte what the generated ``Tensor``
    functions and ``flatbuffers.Builder`` write, in a fraction of their Python calls (MobileNetV2 CIFAR's 262
    tensors, 2.4 MB: 11.3 -> 4.3 ms, 2.6 of it allocating and filling the buffer)."""
    builder = flatbuffers.Builder(_size_bound(checkpoint))

    def tensor(name: str, value: np.ndarray) -> int:
        shape = np.shape(value)  # before ascontiguousarray, which makes a 0-d value 1-d
        value = np.ascontiguousarray(value)
        if value.dtype not in CODES:
            raise CheckpointError(f"{name!r}: element type {value.dtype} cannot go into a checkpoint")
        return _tensor_table(builder, name.encode(), shape, CODES[value.dtype], _raw_bytes(value))

    def table_vector(start, offsets: Sequence[int]) -> int:
        start(builder, len(offsets))
        for off in reversed(offsets):
            builder.PrependUOffsetTRelative(off)
        return builder.EndVector()

    trainable = [tensor(n, checkpoint.params[n]) for n in sorted(checkpoint.params)]
    frozen = [tensor(n, checkpoint.frozen[n]) for n in sorted(checkpoint.frozen)]
    trainable_off = table_vector(ModuleState.StartRequiresGradParamsVector, trainable)
    frozen_off = table_vector(ModuleState.StartFrozenParamsVector, frozen)
    ModuleState.Start(builder)
    ModuleState.AddRequiresGradParams(builder, trainable_off)
    ModuleState.AddFrozenParams(builder, frozen_off)
    ModuleState.AddIsNominalState(builder, False)
    ModuleState.AddHasExternalData(builder, False)
    module_off = ModuleState.End(builder)

    groups_off = None
    if checkpoint.moments:
        states = []
        for name in sorted(checkpoint.moments):
            moments = [tensor(f"momentum{i}", m) for i, m in enumerate(checkpoint.moments[name])]
            moments_off = table_vector(ParameterOptimizerState.StartMomentumsVector, moments)
            name_off = builder.CreateString(name)
            ParameterOptimizerState.Start(builder)
            ParameterOptimizerState.AddParamName(builder, name_off)
            ParameterOptimizerState.AddMomentums(builder, moments_off)
            states.append(ParameterOptimizerState.End(builder))
        states_off = table_vector(OptimizerGroup.StartOptimizerStatesVector, states)
        group_name = builder.CreateString(GROUP)
        OptimizerGroup.Start(builder)
        OptimizerGroup.AddGroupName(builder, group_name)
        OptimizerGroup.AddStep(builder, int(checkpoint.step))
        OptimizerGroup.AddInitialLearningRate(builder, float(checkpoint.learning_rate or 0.0))
        OptimizerGroup.AddOptimizerStates(builder, states_off)
        groups_off = table_vector(FbCheckpoint.StartOptimizerGroupsVector, [OptimizerGroup.End(builder)])

    bag_off = _property_bag(builder, checkpoint.properties, table_vector) if checkpoint.properties else None
    FbCheckpoint.Start(builder)
    FbCheckpoint.AddVersion(builder, VERSION)
    FbCheckpoint.AddModuleState(builder, module_off)
    if groups_off is not None:
        FbCheckpoint.AddOptimizerGroups(builder, groups_off)
    if bag_off is not None:
        FbCheckpoint.AddPropertyBag(builder, bag_off)
    builder.Finish(FbCheckpoint.End(builder), file_identifier=IDENTIFIER)
    return memoryview(builder.Bytes)[builder.Head():]  # Output() would copy it


def _raw_bytes(value: np.ndarray) -> np.ndarray:
    """A contiguous array's little-endian bytes as a flat uint8 view (a copy only on a big-endian host)."""
    if sys.byteorder != "little" and value.dtype.itemsize > 1:
        value = value.astype(value.dtype.newbyteorder("<"))
    return value.reshape(-1).view(np.uint8)


_U16, _I32, _U32 = struct.Struct("<H"), struct.Struct("<i"), struct.Struct("<I")
_TENSOR_FIELDS = 7  # fbs.Tensor: name 0, doc_string 1, dims 2, data_type 3, raw_data 4, string_data 5, external 6


def _tensor_table(b: flatbuffers.Builder, name: bytes, dims: Sequence[int], code: int, raw: np.ndarray) -> int:
    """``b.CreateString(name)``, ``b.CreateNumpyVector(int64 dims)``, ``b.CreateNumpyVector(raw)`` (uint8), then
    ``Tensor.Start`` / ``AddName`` / ``AddDims`` / ``AddDataType`` / ``AddRawData`` / ``End``: the same bytes and
    builder state, the steps of flatbuffers' Builder (``Prep``'s alignment, ``WriteVtable``'s deduplication)
    written out for this one sequence. Padding writes nothing: bytes below the head are still the buffer's
    zeros (a grown buffer's too)."""

    def prep(size: int, additional: int) -> None:  # Builder.Prep: align ``size`` after ``additional`` bytes
        if size > b.minalign:
            b.minalign = size
        align = -(len(b.Bytes) - b.head + additional) & (size - 1)
        while b.head < align + size + additional:
            old = len(b.Bytes)
            b.GrowByteBuffer()
            b.head += len(b.Bytes) - old
        b.head -= align

    def vector(payload, count: int, elem: int) -> int:  # StartVector, the payload, EndVector
        prep(4, elem * count)
        prep(elem, elem * count)
        n = len(payload)
        b.head -= n
        b.Bytes[b.head:b.head + n] = payload
        b.head -= 4
        _U32.pack_into(b.Bytes, b.head, count)
        return len(b.Bytes) - b.head

    # CreateString: the bytes and a zero terminator (the buffer's own zero)
    prep(4, len(name) + 1)
    b.head -= 1 + len(name)
    b.Bytes[b.head:b.head + len(name)] = name
    b.head -= 4
    _U32.pack_into(b.Bytes, b.head, len(name))
    name_off = len(b.Bytes) - b.head
    dims_off = vector(np.asarray(dims, "<i8").tobytes(), len(dims), 8)
    raw_off = vector(raw.data, raw.size, 1)
    b.vectorNumElems = None

    # the table
    object_end = len(b.Bytes) - b.head
    slots = [0] * _TENSOR_FIELDS
    for slot, off in ((0, name_off), (2, dims_off)):
        prep(4, 0)
        _U32.pack_into(b.Bytes, b.head - 4, len(b.Bytes) - b.head - off + 4)
        b.head -= 4
        slots[slot] = len(b.Bytes) - b.head
    if code != 0:
        prep(4, 0)
        b.head -= 4
        _I32.pack_into(b.Bytes, b.head, code)
        slots[3] = len(b.Bytes) - b.head
    prep(4, 0)
    _U32.pack_into(b.Bytes, b.head - 4, len(b.Bytes) - b.head - raw_off + 4)
    b.head -= 4
    slots[4] = len(b.Bytes) - b.head

    # WriteVtable: the object's soffset to its vtable, the vtable written unless an equal one was
    prep(4, 0)
    b.head -= 4  # PrependSOffsetTRelative(0): overwritten below
    object_offset = len(b.Bytes) - b.head
    used = max(i for i, s in enumerate(slots) if s) + 1  # trailing empty slots are left out
    key = tuple(object_offset - s if s else 0 for s in reversed(slots[:used])) + (object_offset - object_end,)
    found = b.vtables.get(key)
    if found is None:
        for value in key[:-1]:
            prep(2, 0)
            b.head -= 2
            _U16.pack_into(b.Bytes, b.head, value)
        for value in (object_offset - object_end, (used + 2) * 2):
            prep(2, 0)
            b.head -= 2
            _U16.pack_into(b.Bytes, b.head, value)
        _I32.pack_into(b.Bytes, len(b.Bytes) - object_offset, len(b.Bytes) - b.head - object_offset)
        b.vtables[key] = len(b.Bytes) - b.head
    else:
        b.head = len(b.Bytes) - object_offset
        _I32.pack_into(b.Bytes, b.head, found - object_offset)
    b.current_vtable = None
    return object_offset


def _size_bound(checkpoint: Checkpoint) -> int:
    """An upper bound of the encoded size: each tensor's bytes, name and dims with room for its table, vtable,
    vector lengths and padding; the builder never grows then."""
    def tensors(values) -> int:
        return sum(np.asarray(v).nbytes + 8 * np.ndim(v) + len(n.encode()) + 96 for n, v in values)

    total = tensors(checkpoint.params.items()) + tensors(checkpoint.frozen.items())
    for name, moments in checkpoint.moments.items():
        total += tensors((f"momentum{i}", m) for i, m in enumerate(moments)) + len(name.encode()) + 64
    for name, value in checkpoint.properties.items():
        total += len(name.encode()) + (len(value.encode()) if isinstance(value, str) else 8) + 64
    return min(total + 1024, flatbuffers.Builder.MAX_BUFFER_SIZE)


def _property_bag(builder, properties: Mapping[str, int | float | str], table_vector) -> int:
    kinds = {"ints": [], "floats": [], "strings": []}
    for name in sorted(properties):
        value = properties[name]
        name_off = builder.CreateString(name)
        if isinstance(value, str):
            value_off = builder.CreateString(value)
            StringProperty.Start(builder)
            StringProperty.AddName(builder, name_off)
            StringProperty.AddValue(builder, value_off)
            kinds["strings"].append(StringProperty.End(builder))
        elif isinstance(value, int | np.integer):
            IntProperty.Start(builder)
            IntProperty.AddName(builder, name_off)
            IntProperty.AddValue(builder, int(value))
            kinds["ints"].append(IntProperty.End(builder))
        else:
            FloatProperty.Start(builder)
            FloatProperty.AddName(builder, name_off)
            FloatProperty.AddValue(builder, float(value))
            kinds["floats"].append(FloatProperty.End(builder))
    ints = table_vector(PropertyBag.StartIntsVector, kinds["ints"])
    floats = table_vector(PropertyBag.StartFloatsVector, kinds["floats"])
    strings = table_vector(PropertyBag.StartStringsVector, kinds["strings"])
    PropertyBag.Start(builder)
    PropertyBag.AddInts(builder, ints)
    PropertyBag.AddFloats(builder, floats)
    PropertyBag.AddStrings(builder, strings)
    return PropertyBag.End(builder)


def write_checkpoint(path: Path | str, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` to ``path`` (atomically: no partial file on failure)."""
    write_atomic(Path(path), encode_checkpoint_buffer(checkpoint))
