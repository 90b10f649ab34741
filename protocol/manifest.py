"""The layer manifest: every trainable parameter, in backward order, and its digest.

Both sides exchange the digest at handshake.  When they differ the manifests
themselves are compared so the refusal names the first entry that differs,
never a shape error three layers into training.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgpack
import torch

from elasticfed.protocol.payload import FLOAT_DTYPES, MAX_DIMS, dtype_name


@dataclass(frozen=True)
class LayerSpec:
    """One synchronised unit: a named parameter's shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"layer name must be a non-empty string, got {self.name!r}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"layer {self.name}: dtype {self.dtype!r} is not one of {sorted(FLOAT_DTYPES)}")
        if len(self.shape) > MAX_DIMS or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape
        ):
            raise ValueError(f"layer {self.name}: bad shape {self.shape!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return f"{self.name} {list(self.shape)} {self.dtype}"


class Manifest:
    """An ordered, name-unique list of layer specs."""

    def __init__(self, layers: Iterable[LayerSpec]) -> None:
        self._layers = tuple(layers)
        self._by_name: dict[str, LayerSpec] = {}
        for spec in self._layers:
            if spec.name in self._by_name:
                raise ValueError(f"layer {spec.name} appears twice in the manifest")
            self._by_name[spec.name] = spec
        packed = msgpack.packb(self.to_wire())
        self.digest = hashlib.sha256(packed).hexdigest()

    @classmethod
    def from_parameters(cls, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """Trainable parameters in reverse registration order.

        That is the order backward usually produces gradients in, and what DDP
        assumes for its first buckets; it only needs to be the same on both sides.
        """
        trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
        return cls(LayerSpec(n, tuple(p.shape), dtype_name(p.dtype)) for n, p in reversed(trainable))

    @classmethod
    def from_wire(cls, entries: object) -> Manifest:
        """Rebuild from `to_wire()` output; raises ValueError naming the bad entry."""
        if not isinstance(entries, list):
            raise ValueError("manifest must be a list of [name, shape, dtype] entries")
        specs = []
        for i, entry in enumerate(entries):
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[1], list)):
                raise ValueError(f"manifest entry {i} is not [name, shape, dtype]")
            name, shape, dtype = entry
            try:
                specs.append(LayerSpec(name, tuple(shape), dtype))
            except ValueError as exc:
                raise ValueError(f"manifest entry {i}: {exc}") from None
        return cls(specs)

    def blob_layout(self) -> tuple[tuple[LayerSpec, int], ...]:
        """Each layer with its byte offset in a model blob (ModelChunk); offsets 8-byte aligned.

        Both sides derive it from the manifest alone, so a blob needs no descriptors.
        """
        out = []
        offset = 0
        for spec in self._layers:
            out.append((spec, offset))
            nbytes = spec.numel * FLOAT_DTYPES[spec.dtype].itemsize
            offset += (nbytes + 7) // 8 * 8
        return tuple(out)

    @property
    def blob_bytes(self) -> int:
        """Size of a model blob (padding included)."""
        layout = self.blob_layout()
        if not layout:
            return 0
        spec, offset = layout[-1]
        return offset + (spec.numel * FLOAT_DTYPES[spec.dtype].itemsize + 7) // 8 * 8

    def to_wire(self) -> list[list[object]]:
        return [[s.name, list(s.shape), s.dtype] for s in self._layers]

    def first_difference(self, other: Manifest) -> str | None:
        """None if equal, else a sentence naming the first differing entry."""
        for i, (ours, theirs) in enumerate(zip(self._layers, other._layers)):
            if ours != theirs:
                return f"entry {i}: ours is {ours.describe()}, theirs is {theirs.describe()}"
        if len(self._layers) != len(other._layers):
            n = min(len(self._layers), len(other._layers))
            longer, side = (self, "ours") if len(self) > len(other) else (other, "theirs")
            return (
                f"entry {n}: only {side} has it ({longer._layers[n].describe()}); "
                f"{len(self)} layers here, {len(other)} there"
            )
        return None

    def __getitem__(self, name: str) -> LayerSpec:
        return self._by_name[name]

    def get(self, name: str) -> LayerSpec | None:
        return self._by_name.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[LayerSpec]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Manifest) and self._layers == other._layers

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Manifest({len(self)} layers, digest={self.digest[:12]})"
