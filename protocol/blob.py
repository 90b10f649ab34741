"""A whole model as one byte blob in manifest layout: what model chunks slice.

One flat buffer per served version lets the gateway answer any byte range
zero-copy, and lets an edge assemble a download in place and check it with one
digest, whatever the number of layers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from protocol.manifest import Manifest
from protocol.payload import FLOAT_DTYPES, checksum


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
