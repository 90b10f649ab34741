"""Hypothesis strategies for every message type and payload encoding."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from elasticfed.protocol import (
    Ack,
    Commit,
    Dense,
    Heartbeat,
    Hello,
    LayerGradient,
    LayerSpec,
    LayerTensor,
    LowRank,
    Manifest,
    Model,
    ModelChunk,
    ModelFetch,
    ModelRequest,
    Push,
    Quantized,
    Reject,
    Sparse,
    TopK,
    Welcome,
)
from elasticfed.protocol.messages import UINT_MAX

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
uints = st.integers(0, UINT_MAX)
names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw: st.DrawFn, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None):
    shape = draw(shapes) if shape is None else shape
    dtype = draw(st.sampled_from(FLOATS)) if dtype is None else dtype
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-6, 1.0, 100.0]))
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


@st.composite
def payloads(draw: st.DrawFn, shape: tuple[int, ...] | None = None):
    shape = draw(shapes) if shape is None else shape
    numel = math.prod(shape)
    dtype = draw(st.sampled_from(FLOATS))
    kinds = ["dense"]
    if numel > 0:
        kinds.append("topk")
    if len(shape) >= 2 and numel > 0:
        kinds.append("lowrank")
    kinds.append("int8")
    if numel > 0:
        kinds.append("sparse")
    kind = draw(st.sampled_from(kinds))
    if kind == "dense":
        return Dense(draw(tensors(shape, dtype)))
    if kind == "int8":
        return draw(quantized(shape, dtype))
    if kind == "sparse":
        # Indices may straddle the 65,536-element blocks of the index coding.
        k = draw(st.integers(0, numel))
        indices = torch.tensor(sorted(draw(st.sets(st.integers(0, numel - 1), min_size=k, max_size=k))))
        values = draw(st.one_of(st.just(None), quantized((k,), dtype)))
        if values is None:
            values = Dense(draw(tensors((k,), dtype)))
        return Sparse.from_indices(indices, values, shape)
    if kind == "topk":
        k = draw(st.integers(1, numel))
        index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
        indices = torch.tensor(
            draw(st.lists(st.integers(0, numel - 1), min_size=k, max_size=k)), dtype=index_dtype
        )
        return TopK(draw(tensors((k,), dtype)), indices, shape)
    rows, cols = shape[0], numel // shape[0]
    rank = draw(st.integers(1, min(rows, cols)))
    return LowRank(draw(tensors((rows, rank), dtype)), draw(tensors((cols, rank), dtype)), shape)


@st.composite
def quantized(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype):
    numel = math.prod(shape)
    chunk = draw(st.integers(1, max(numel, 1) + 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    codes = torch.randint(-127, 128, (numel,), generator=gen, dtype=torch.int8)
    scales = draw(tensors((-(-numel // chunk),), dtype)).abs()
    return Quantized(codes, scales, chunk, shape)


manifests = st.lists(
    st.builds(LayerSpec, names, shapes, st.sampled_from(["float32", "float16", "bfloat16", "float64"])),
    max_size=6,
    unique_by=lambda s: s.name,
).map(Manifest)

settings = st.dictionaries(
    st.text(max_size=10),
    st.one_of(
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    ),
    max_size=5,
)

gradient_layers = st.lists(
    st.builds(LayerGradient, names, payloads(), st.integers(1, 2**40)), max_size=5, unique_by=lambda g: g.name
).map(tuple)

parameter_layers = st.lists(
    st.builds(LayerTensor, names, tensors().map(Dense)), max_size=5, unique_by=lambda g: g.name
).map(tuple)

short = st.text(max_size=64)
messages = st.one_of(
    st.builds(
        Hello,
        client_id=st.text(max_size=256),
        manifest=manifests,
        model_version=uints,
        next_seq=uints,
        settings=settings,
        holding=st.lists(st.text(max_size=256), max_size=16).map(tuple),
        resolved_below=uints,
    ),
    st.builds(
        Welcome,
        gateway_id=st.text(max_size=256),
        manifest_digest=st.text(max_size=64),
        model_version=uints,
        durable=st.lists(st.tuples(st.text(max_size=256), uints), max_size=16).map(tuple),
        next_seq=uints,
        settings=settings,
    ),
    st.builds(
        Push,
        seq=uints,
        base_version=uints,
        layers=gradient_layers,
        resolved_below=uints,
        lr=st.floats(0.0, 1000.0, allow_nan=False),
    ),
    st.builds(
        Ack,
        seq=uints,
        accepted=st.booleans(),
        credit=uints,
        code=short,
        detail=st.text(max_size=1024),
        model_version=uints,
        epoch=uints,
        durable_epoch=uints,
        gateway_id=st.text(max_size=256),
    ),
    st.builds(Commit, durable_epoch=uints, gateway_id=st.text(max_size=256)),
    st.builds(ModelRequest, have_version=uints, names=st.lists(names, max_size=5).map(tuple)),
    st.builds(
        Model,
        version=uints,
        full=st.booleans(),
        layers=parameter_layers,
        mass=st.floats(0.0, 1e15, allow_nan=False),
    ),
    st.builds(ModelFetch, version=uints, offset=uints, length=uints),
    st.builds(
        ModelChunk,
        version=uints,
        size=uints,
        digest=st.integers(0, 2**64 - 1),
        offset=uints,
        data=st.binary(max_size=4096),
        mass=st.floats(0.0, 1e15, allow_nan=False),
    ),
    st.builds(
        Heartbeat,
        nonce=uints,
        reply=st.booleans(),
        model_version=uints,
        durable_epoch=uints,
        gateway_id=st.text(max_size=256),
    ),
    st.builds(Reject, code=short, detail=st.text(max_size=1024), ref_seq=uints),
)
