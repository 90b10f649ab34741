"""A whole model as one byte blob in manifest layout: what model chunks slice.

One flat buffer per served version lets the gateway answer any byte range
zero-copy, and lets an edge assemble a download in place and check it with one
digest, whatever the number of layers.  A patch (`ModelPatch`) travels the same
way: its codec frames, framed into one blob (`frame`, `unframe`).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from elasticfed.protocol.manifest import Manifest
from elasticfed.protocol.payload import FLOAT_DTYPES, checksum


def pack(manifest: Manifest, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A new uint8 tensor holding every layer at its `blob_layout` offset (padding zeroed)."""
    blob = torch.zeros(manifest.blob_bytes, dtype=torch.uint8)
    for spec, view in _views(manifest, blob):
        view.copy_(tensors[spec.name].detach().reshape(spec.shape))
    return blob


def unpack(manifest: Manifest, blob: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of each layer inside `blob` (no copy): valid while the blob is not modified."""
    if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() != manifest.blob_bytes:
        raise ValueError(f"a model blob for this manifest is {manifest.blob_bytes} bytes of uint8")
    return {spec.name: view for spec, view in _views(manifest, blob)}


def digest(blob: torch.Tensor) -> int:
    """xxh3-64 of the whole blob (what ModelChunk.digest states)."""
    return checksum(memoryview(blob.numpy()).cast("B"))


def _views(manifest: Manifest, blob: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
    out = []
    for spec, offset in manifest.blob_layout():
        dtype = FLOAT_DTYPES[spec.dtype]
        nbytes = spec.numel * dtype.itemsize
        out.append((spec, blob[offset : offset + nbytes].view(dtype).view(spec.shape)))
    return out


def frame(frames: Sequence[Any]) -> torch.Tensor:
    """Codec frames as one uint8 blob: a count, each frame's length (u32 little-endian), the frames."""
    views = [memoryview(f).cast("B") for f in frames]
    head = struct.pack(f"<{1 + len(views)}I", len(views), *(len(v) for v in views))
    out = bytearray(head)
    for v in views:
        out += v
    return torch.frombuffer(out, dtype=torch.uint8) if out else torch.empty(0, dtype=torch.uint8)


def unframe(data: torch.Tensor, max_frames: int) -> list[memoryview]:
    """The frames of a `frame` blob; ValueError if it is not one (a peer's bytes: checked)."""
    raw = memoryview(data.numpy()).cast("B")
    if len(raw) < 4:
        raise ValueError("a framed blob starts with a 4-byte frame count")
    (count,) = struct.unpack_from("<I", raw, 0)
    if not 1 <= count <= max_frames or len(raw) < 4 * (1 + count):
        raise ValueError(f"a framed blob of {len(raw)} bytes cannot hold {count} frames")
    lengths = struct.unpack_from(f"<{count}I", raw, 4)
    at = 4 * (1 + count)
    if at + sum(lengths) != len(raw):
        raise ValueError(f"framed blob: frames of {sum(lengths)} bytes in {len(raw) - at}")
    out = []
    for n in lengths:
        out.append(raw[at : at + n])
        at += n
    return out
