"""The public model: what every edge holds bit for bit, moved toward the gateway's by sparse patches.

At 10 Mbit/s a 10 MB model takes 8 s to come down, every version.  Instead the
gateway keeps `x_public`, the model it has told edges about, and at each
version moves the `ratio` share of its entries that differ most from its own
model to their new values: `x_public[i] = x_global[i]` for those `i`.  What is
not sent stays as the difference `x_global - x_public` and is the first to go
once it is large (error feedback, on the model instead of the gradient), so the
distance between the two stays bounded (`distance`, reported as a metric).

An edge that holds version `b` asks for the patch from `b`, naming its digest:
the new values of every entry changed since, which it *sets* (not adds: the result is the
gateway's `x_public` bit for bit, whatever the edge's floating-point hardware),
and checks the whole model's digest.  The last `history` versions' changes are
kept; an edge further behind gets a snapshot.  Patches are built once per
(base, version) and kept for the edges that ask for the same one.

The first version is the gateway's starting model, whole.  An edge that built
the same seed model holds it already (same digest): its first model comes as a
patch from version 0, not as a download of the whole model (at 2 Mbit/s, 37 s
of the base model, measured).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from elasticfed.common.topk import largest_magnitudes
from elasticfed.protocol import LayerTensor, Manifest, ModelPatch, blob, encode
from elasticfed.protocol.payload import Dense, Sparse

PATCHES_KEPT = 16  # built patches kept for the edges that ask for the same one
DIGESTS_KEPT = 4096  # recent versions' digests: what an edge holding one must have (audits)


def downlink_ratio(spec: str) -> float:
    """The share of entries a version moves, from `full` (0.0: whole models) or `topk:<ratio>`."""
    if spec == "full":
        return 0.0
    if spec.startswith("topk:"):
        try:
            ratio = float(spec[5:])
        except ValueError:
            ratio = math.nan
        if 0.0 < ratio <= 1.0:
            return ratio
    raise ValueError(f"downlink must be full or topk:<ratio in (0, 1]>, got {spec!r}")


@dataclass(frozen=True)
class Patch:
    """A framed `ModelPatch` blob from `base` to `version`, its digest, and the model it makes."""

    base: int
    base_digest: int
    version: int
    data: torch.Tensor
    digest: int
    model_digest: int


class PublicModel:
    """`x_public` as a blob in manifest layout, the entries each recent version changed, built patches."""

    def __init__(self, manifest: Manifest, ratio: float, history: int = 32) -> None:
        if not 0.0 < ratio <= 1.0 or history < 1:
            raise ValueError(
                f"a public model needs a ratio in (0, 1] and history >= 1, got {ratio}, {history}"
            )
        self.manifest = manifest
        self.ratio = ratio
        self.history = history
        self.version = 0
        self.blob: torch.Tensor | None = None
        self.digest = 0
        self.distance = 0.0  # |x_global - x_public| / |x_global| after the last advance
        self.digests: OrderedDict[int, int] = OrderedDict()  # version -> digest of x_public then
        self._changes: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._oldest_base = 0  # the oldest version a patch may start from (its successors' changes are kept)
        self._patches: OrderedDict[tuple[int, int], Patch | None] = OrderedDict()  # None: too large

    def advance(self, version: int, target: torch.Tensor) -> torch.Tensor:
        """Move `x_public` toward the blob `target` (x_global) as `version`; returns the new
        public blob (a new tensor, never modified afterwards: it is served)."""
        if self.blob is None:
            self.blob = target.clone()  # the first version goes whole
            changes = None
            gap = 0.0
        else:
            new = target.clone()
            views = blob.unpack(self.manifest, new)
            old = blob.unpack(self.manifest, self.blob)
            changes = {}
            gap = total = 0.0
            for spec in self.manifest:
                target, public = views[spec.name].reshape(-1), old[spec.name].reshape(-1).clone()
                # In the layer's dtype: a difference of two distinct floats is never 0 (gradual
                # underflow), and only the order of magnitudes matters.
                diff = target - public
                k = min(diff.numel(), max(1, math.ceil(self.ratio * diff.numel())))
                idx = largest_magnitudes(diff, k)
                idx = idx[diff[idx] != 0]  # sorted; entries already equal need no patch
                public[idx] = target[idx]
                diff[idx] = 0.0  # what is left: x_global - x_public
                # Norms in float32 (a reported ratio, not a sum that must be exact): in float64
                # they took 36 ms each for the base model, in float32 2 ms.
                gap += float(torch.linalg.vector_norm(diff)) ** 2
                total += float(torch.linalg.vector_norm(target)) ** 2
                target.copy_(public)  # `new` holds x_public from here on
                changes[spec.name] = idx.to(torch.int32)  # half the memory, for `history` versions
            self.blob = new
            gap = math.sqrt(gap / total) if total > 0 else 0.0
        self.version, self.digest, self.distance = version, blob.digest(self.blob), gap
        self.digests[version] = self.digest
        while len(self.digests) > DIGESTS_KEPT:
            self.digests.popitem(last=False)
        if changes is None:
            self._changes.clear()
            self._oldest_base = version  # nothing before this version can be patched
        else:
            self._changes[version] = changes
            while len(self._changes) > self.history:
                self._oldest_base, _ = self._changes.popitem(last=False)  # its changes are gone
        return self.blob

    def patch(self, base: int, base_digest: int, version: int) -> Patch | None:
        """The patch from `base` to `version`, if the edge's base is this model's `base` (its
        digest), `version` is the newest (or built before) and the changes since `base` are all
        known; None: the edge needs a snapshot."""
        if not base_digest or self.digests.get(base) != base_digest:
            return None  # another instance's model, or another seed's, or forgotten
        if (base, version) in self._patches:
            self._patches.move_to_end((base, version))
            return self._patches[(base, version)]
        if version != self.version or self.blob is None or not self._oldest_base <= base < version:
            return None
        steps = [v for v in self._changes if v > base]
        views = blob.unpack(self.manifest, self.blob)
        layers = []
        for spec in self.manifest:
            idx = torch.cat([self._changes[v][spec.name] for v in steps]).long().unique(sorted=True)
            if idx.numel():
                values = views[spec.name].reshape(-1)[idx].clone()
                layers.append(LayerTensor(spec.name, Sparse.from_indices(idx, Dense(values), spec.shape)))
        data = blob.frame(encode(ModelPatch(base=base, version=version, layers=tuple(layers))))
        # Over many versions a patch can outgrow the model (6 bytes an entry against 4): then the
        # edge is better served whole.
        built = (
            Patch(base, base_digest, version, data, blob.digest(data), self.digest)
            if data.numel() < self.blob.numel()
            else None
        )
        self._patches[(base, version)] = built
        while len(self._patches) > PATCHES_KEPT:
            self._patches.popitem(last=False)
        return built
