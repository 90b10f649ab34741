"""The k entries of largest magnitude, found faster than a full top-k on large tensors."""

from __future__ import annotations

import math

import torch

TOPK_SAMPLE = 16384  # magnitudes sampled to find a threshold below the k-th largest
TOPK_MARGIN = 1.25  # the threshold aims at this many times k entries (then cut to k exactly)
_samples: dict[int, torch.Tensor] = {}  # layer size -> the sampled positions (fixed: seeded by the size)


def largest_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The sorted flat indices of the k entries of largest magnitude: exactly top-k's, about 2.5x
    faster on large layers.

    A threshold from a sample of the magnitudes keeps a little more than k candidates in one
    pass, and top-k runs on those alone (Deep Gradient Compression samples the same way).
    Where the candidates come short of k (a sample that missed), the exact top-k of the whole
    layer decides.  Both sides select this way: the edge every compressed push (on its CPU: a
    whole base-model push took 80 ms at top-k 0.01 before, more than a Jetson's step), the
    gateway every published version (cloud/publication.py).
    """
    n = flat.numel()
    magnitudes = flat.abs()
    if n <= 4 * TOPK_SAMPLE or k * 4 > n:
        return torch.topk(magnitudes, k, sorted=False).indices.sort().values
    where = _samples.get(n)
    if where is None:
        if len(_samples) >= 1024:
            _samples.clear()
        where = torch.randint(n, (TOPK_SAMPLE,), generator=torch.Generator().manual_seed(n))
        _samples[n] = where
    aim = min(TOPK_SAMPLE, math.ceil(TOPK_SAMPLE * k / n * TOPK_MARGIN) + 8)
    threshold = torch.topk(magnitudes[where], aim, sorted=False).values.min()
    candidates = (magnitudes >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return torch.topk(magnitudes, k, sorted=False).indices.sort().values
    keep = torch.topk(magnitudes[candidates], k, sorted=False).indices
    return candidates[keep].sort().values
