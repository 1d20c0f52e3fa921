"""encode_checkpoint's fast tensor tables (lowering/training/checkpoint.py ``_tensor_table``) write the bytes the
generated ``Tensor`` functions and ``flatbuffers.Builder`` write: compared byte for byte against that reference,
on random checkpoints (dtypes, ranks, empty and 0-d tensors, names, moments, properties) and with a builder that
has to grow."""

from __future__ import annotations

from collections.abc import Sequence

import flatbuffers
import numpy as np
import pytest

from lowering.training import checkpoint as ckpt_module
from lowering.training.checkpoint import (
    CODES,
    GROUP,
    IDENTIFIER,
    VERSION,
    Checkpoint,
    FbCheckpoint,
    ModuleState,
    OptimizerGroup,
    ParameterOptimizerState,
    Tensor,
    _property_bag,
    decode_checkpoint,
    encode_checkpoint,
    encode_checkpoint_buffer,
)


def reference_encode(checkpoint: Checkpoint) -> bytes:
    """encode_checkpoint as it was: every object through the generated classes and flatbuffers.Builder."""
    builder = flatbuffers.Builder(1024)

    def tensor(name: str, value: np.ndarray) -> int:
        shape = np.shape(value)
        value = np.ascontiguousarray(value)
        name_off = builder.CreateString(name)
        dims_off = builder.CreateNumpyVector(np.asarray(shape, np.int64))
        raw_off = builder.CreateNumpyVector(np.frombuffer(value.astype(value.dtype.newbyteorder("<")).tobytes(),
                                                          np.uint8))
        Tensor.Start(builder)
        Tensor.AddName(builder, name_off)
        Tensor.AddDims(builder, dims_off)
        Tensor.AddDataType(builder, CODES[value.dtype])
        Tensor.AddRawData(builder, raw_off)
        return Tensor.End(builder)

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
    return bytes(builder.Output())


DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.int8, np.uint8, np.bool_, np.uint16,
          np.int16, np.uint32, np.uint64]


def random_checkpoint(rng: np.random.Generator) -> Checkpoint:
    def value():
        rank = int(rng.integers(0, 5))
        shape = tuple(int(d) for d in rng.integers(0, 4 if rng.random() < 0.2 else 6, rank))
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        v = (rng.standard_normal(shape) * 100).astype(dtype)
        if rank >= 2 and rng.random() < 0.3:
            v = v.T  # not contiguous
        return v

    def name():
        alphabet = list("abcdefgh._/0123456789") + ["é", "ß", "名"]
        return "".join(rng.choice(alphabet) for _ in range(int(rng.integers(1, 24))))

    params = {name(): value() for _ in range(int(rng.integers(1, 12)))}
    frozen = {name(): value() for _ in range(int(rng.integers(0, 6)))}
    moments = {}
    if params and rng.random() < 0.5:
        kinds = int(rng.integers(1, 3))  # SGD-like one moment or AdamW's two, the same for every parameter
        moments = {p: [np.zeros_like(v), np.ones_like(v)][:kinds] for p, v in params.items()}
    props = {}
    if rng.random() < 0.5:
        props = {"ints": int(rng.integers(-5, 5)), "floats": float(rng.random()), "strings": name()}
    return Checkpoint(params=params, frozen=frozen, moments=moments, step=int(rng.integers(0, 9)) if moments else 0,
                      learning_rate=0.001 if moments else None, properties=props)


@pytest.mark.parametrize("seed", range(40))
def test_random_checkpoints_encode_to_the_reference_bytes(seed):
    checkpoint = random_checkpoint(np.random.default_rng(seed))
    data = encode_checkpoint(checkpoint)
    assert data == reference_encode(checkpoint)
    assert bytes(encode_checkpoint_buffer(checkpoint)) == data
    back = decode_checkpoint(data)
    assert sorted(back.params) == sorted(checkpoint.params) and sorted(back.frozen) == sorted(checkpoint.frozen)
    for name, v in {**checkpoint.params, **checkpoint.frozen}.items():
        got = {**back.params, **back.frozen}[name]
        assert got.dtype == v.dtype and got.shape == np.shape(v)
        np.testing.assert_array_equal(got, v)


@pytest.mark.parametrize("seed", range(8))
def test_a_builder_that_must_grow_writes_the_same_bytes(seed, monkeypatch):
    """The size bound is what keeps the builder from growing: with a tiny first buffer every growth path runs."""
    checkpoint = random_checkpoint(np.random.default_rng(100 + seed))
    monkeypatch.setattr(ckpt_module, "_size_bound", lambda checkpoint: 8)
    assert encode_checkpoint(checkpoint) == reference_encode(checkpoint)


def test_many_tensors_share_vtables_as_the_reference_does():
    rng = np.random.default_rng(7)
    params = {f"p{i:03d}": rng.standard_normal(tuple(rng.integers(1, 4, int(rng.integers(0, 4))))).astype(np.float32)
              for i in range(200)}
    checkpoint = Checkpoint(params=params, frozen={"f": np.arange(3)})
    assert encode_checkpoint(checkpoint) == reference_encode(checkpoint)


def test_the_size_bound_is_an_upper_bound():
    for seed in range(30):
        checkpoint = random_checkpoint(np.random.default_rng(200 + seed))
        assert len(encode_checkpoint(checkpoint)) <= ckpt_module._size_bound(checkpoint)
