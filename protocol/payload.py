"""Tensor payloads on the wire: dense, top-k and low-rank, each as raw frames.

Encoding never copies a contiguous CPU tensor: the frame handed to ZeroMQ is a
memoryview over the tensor's own storage.  Decoding builds tensors over the
received buffers.  Each frame carries an xxh3-64 checksum in the header: it
runs at memory speed, where zlib.crc32 would cost 4x the copy it guards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


Payload = Dense | TopK | LowRank
