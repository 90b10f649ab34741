"""Tensor payloads on the wire: dense, top-k, low-rank, int8 and sparse, each as raw frames.

`Quantized` (int8 codes, one scale per chunk) and `Sparse` (the largest entries,
their indices coded in 16 bits) are what edges push under uplink compression;
`TopK` and `LowRank` are the general forms.

Encoding never copies a contiguous CPU tensor: the frame handed to ZeroMQ is a
memoryview over the tensor's own storage.  Decoding builds tensors over the
received buffers.  Each frame carries an xxh3-64 checksum in the header: it
runs at memory speed, where zlib.crc32 would cost 4x the copy it guards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy
import torch
import xxhash

# Float dtypes a payload may carry, by wire name.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
INDEX_DTYPES: dict[str, torch.dtype] = {"int32": torch.int32, "int64": torch.int64}
_DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in (FLOAT_DTYPES | INDEX_DTYPES).items()}

MAX_DIMS = 8
# A sparse payload's indices are offsets within blocks of this many elements: 16 bits an index,
# plus a count per block (4 bytes per 65,536 elements of the layer).
SPARSE_BLOCK = 2**16
INT8_MAX = 127  # codes are symmetric: -128 is refused, so a code and its negation both exist


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a dtype; refuses dtypes the protocol cannot carry."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be sent; use one of {sorted(_DTYPE_NAMES.values())}"
        ) from None


def checksum(buf: memoryview) -> int:
    """64-bit checksum of one frame."""
    return xxhash.xxh3_64_intdigest(buf)


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor's storage, without copying when it is contiguous.

    The caller must not modify the tensor until ZeroMQ has sent the frame.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor is on {tensor.device}; copy it to host memory before encoding")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def tensor_from_buffer(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `buf` (whose length the caller has checked), copying only if it must.

    A copy happens for a read-only buffer (bytes) or one not aligned to the element
    size; ZeroMQ frames received with copy=False are neither.
    """
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    if buf.readonly:  # torch.frombuffer would warn, and writes through it would be undefined
        buf = memoryview(bytearray(buf))
    tensor = torch.frombuffer(buf, dtype=dtype)
    if tensor.data_ptr() % dtype.itemsize:
        tensor = tensor.clone()
    return tensor.view(shape)


@dataclass(frozen=True)
class Dense:
    """A full tensor: fp32, fp16, bf16 (or fp64)."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def to_dense(self) -> torch.Tensor:
        return self.tensor


@dataclass(frozen=True)
class TopK:
    """The k entries of largest magnitude: values and flat indices into `shape`.

    Repeated indices add up in `to_dense`, which is what a sum of sparse
    contributions means.
    """

    values: torch.Tensor
    indices: torch.Tensor
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.values.dim() != 1 or self.indices.dim() != 1:
            raise ValueError("top-k values and indices must be 1-D")
        if self.values.numel() != self.indices.numel():
            raise ValueError(f"top-k has {self.values.numel()} values but {self.indices.numel()} indices")
        if self.indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"top-k indices must be int32 or int64, not {self.indices.dtype}")

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(math.prod(self.shape), dtype=self.values.dtype)
        out.index_add_(0, self.indices.long(), self.values)
        return out.view(self.shape)


@dataclass(frozen=True)
class LowRank:
    """PowerSGD factors: the layer, seen as a (shape[0], rest) matrix, is p @ q.T."""

    p: torch.Tensor
    q: torch.Tensor
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.shape) < 2:
            raise ValueError("low-rank payloads need a layer of at least 2 dimensions")
        rows = self.shape[0]
        cols = math.prod(self.shape[1:])
        if self.p.dim() != 2 or self.q.dim() != 2 or self.p.shape[1] != self.q.shape[1]:
            raise ValueError(
                f"low-rank factors must be (rows, r) and (cols, r), got "
                f"{tuple(self.p.shape)} and {tuple(self.q.shape)}"
            )
        if self.p.shape[0] != rows or self.q.shape[0] != cols:
            raise ValueError(
                f"low-rank factors {tuple(self.p.shape)}, {tuple(self.q.shape)} do not "
                f"match layer shape {self.shape} seen as ({rows}, {cols})"
            )
        if self.p.dtype != self.q.dtype:
            raise ValueError("low-rank factors must share a dtype")

    @property
    def rank(self) -> int:
        return int(self.p.shape[1])

    def to_dense(self) -> torch.Tensor:
        return (self.p @ self.q.T).view(self.shape)


@dataclass(frozen=True)
class Quantized:
    """int8 codes with one scale per `chunk` consecutive elements: element i is codes[i] * scales[i // chunk].

    The decoded dtype is the scales' dtype.  Per-chunk scales keep one large entry
    from flattening a whole layer's resolution.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    chunk: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.int8 or self.codes.dim() != 1:
            raise ValueError("int8 codes must be a 1-D int8 tensor")
        if self.codes.numel() != math.prod(self.shape):
            raise ValueError(f"{self.codes.numel()} codes for shape {self.shape}")
        if type(self.chunk) is not int or self.chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {self.chunk!r}")
        if self.scales.dim() != 1 or self.scales.numel() != -(-self.codes.numel() // self.chunk):
            raise ValueError(
                f"{self.codes.numel()} codes in chunks of {self.chunk} need "
                f"{-(-self.codes.numel() // self.chunk)} scales, got {self.scales.numel()}"
            )
        if not self.scales.is_floating_point():
            raise ValueError("scales must be a float tensor")

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def to_dense(self) -> torch.Tensor:
        n = self.codes.numel()
        if n == 0:
            return torch.zeros(self.shape, dtype=self.dtype)
        full = n - n % self.chunk
        out = torch.empty(n, dtype=self.dtype)
        if full:
            out[:full].view(-1, self.chunk).copy_(self.codes[:full].view(-1, self.chunk))
            out[:full].view(-1, self.chunk).mul_(self.scales[: full // self.chunk, None])
        if full < n:
            out[full:].copy_(self.codes[full:]).mul_(self.scales[-1])
        return out.view(self.shape)


@dataclass(frozen=True)
class Sparse:
    """Some entries of a layer at sorted, unique flat indices, the rest zero.

    The indices travel as a count per block of `SPARSE_BLOCK` elements and a
    16-bit offset within its block per entry (the int16 tensor is read as
    unsigned): 2 bytes an index instead of 4 or 8.  `values` is dense (float) or
    int8-quantized, one entry per index.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    values: Dense | Quantized
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        blocks = -(-math.prod(self.shape) // SPARSE_BLOCK)
        if self.counts.dtype != torch.int32 or self.counts.shape != (blocks,):
            raise ValueError(f"sparse counts must be int32 with one entry per block ({blocks})")
        if self.offsets.dtype != torch.int16 or self.offsets.dim() != 1:
            raise ValueError("sparse offsets must be a 1-D int16 tensor")
        if self.values.shape != (self.offsets.numel(),):
            raise ValueError(f"{self.offsets.numel()} offsets but values of shape {self.values.shape}")
        c = self.counts.numpy()  # numpy for small arrays: a torch call's overhead, per layer and push
        if blocks and (int(c.min()) < 0 or int(c.sum(dtype=numpy.int64)) != self.offsets.numel()):
            raise ValueError(f"sparse block counts do not add up to the {self.offsets.numel()} offsets")

    @classmethod
    def from_indices(cls, indices: torch.Tensor, values: Dense | Quantized, shape: tuple[int, ...]) -> Sparse:
        """From sorted, unique flat indices (the caller's promise; the decoder checks a peer's)."""
        blocks = -(-math.prod(shape) // SPARSE_BLOCK)
        indices = indices.long()
        counts = torch.bincount(indices >> 16, minlength=blocks).to(torch.int32)
        offsets = (indices & 0xFFFF).to(torch.int32)
        offsets = torch.where(offsets >= 2**15, offsets - 2**16, offsets).to(torch.int16)
        return cls(counts, offsets, values, shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype if isinstance(self.values, Quantized) else self.values.tensor.dtype

    def indices(self) -> torch.Tensor:
        """Flat int64 indices, from the counts and offsets."""
        blocks = numpy.arange(self.counts.numel(), dtype=numpy.int64) * SPARSE_BLOCK
        base = numpy.repeat(blocks, self.counts.numpy())
        return torch.from_numpy(base + self.offsets.numpy().view(numpy.uint16))

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(math.prod(self.shape), dtype=self.dtype)
        out[self.indices()] = self.values.to_dense()
        return out.view(self.shape)

    def to_sparse_coo(self) -> torch.Tensor:
        """The flat layer as a coalesced sparse COO tensor: k entries of work, not the layer's n."""
        return torch.sparse_coo_tensor(
            self.indices()[None],
            self.values.to_dense(),
            (math.prod(self.shape),),
            is_coalesced=True,  # sorted and unique: the decoder checked a peer's, from_indices the caller's
            check_invariants=False,  # the same promise: torch's check would cost what sparsity saves
        )


Payload = Dense | TopK | LowRank | Quantized | Sparse


def payload_bytes(payload: Payload) -> int:
    """Bytes of a payload's frames on the wire."""

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    if isinstance(payload, Dense):
        return size(payload.tensor)
    if isinstance(payload, Quantized):
        return size(payload.codes) + size(payload.scales)
    if isinstance(payload, Sparse):
        return size(payload.counts) + size(payload.offsets) + payload_bytes(payload.values)
    if isinstance(payload, TopK):
        return size(payload.values) + size(payload.indices)
    if isinstance(payload, LowRank):
        return size(payload.p) + size(payload.q)
    raise TypeError(type(payload).__name__)
