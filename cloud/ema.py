"""The model a gateway reports: an exponential moving average of the versions it published.

Why: on skewed sites each buffered round leans towards the sites that delivered in it, so the
live model swings between them.  Measured on digits split in label shards (8 edges, 30% loss):
the live model at the end 88.9% (its worst site 59.7%), the average of the versions before it
96.9%, the IID lossless reference's figure.  This is Polyak-Ruppert averaging as training
libraries ship it (an EMA of the weights, e.g. timm's ModelEma): edges keep training from the
live model, which is all they are ever served; what the gateway evaluates, reports and saves as
its result is the average.

The average starts once `window` versions were published (before, it is the newest version: in
a run of few versions each carries much progress, and averaging them lags: `cloud serve` through
three gateway kills publishes 4 versions and its average was a point below the live model);
then its window grows, decay (1 + n) / (10 + n) over the n versions averaged, capped at
1 - 1/window, so an early model does not linger.  Cost: one copy of the trainable parameters
and one pass over them per version.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 at least: at a weight of 1/50, a bf16 or fp16 average would lose the steps below
    its precision and stall."""
    return torch.promote_types(dtype, torch.float32)


class ModelEma:
    """An exponential moving average of named float tensors, one update per published version."""

    def __init__(self, window: int) -> None:
        if type(window) is not int or window < 1:
            raise ValueError(f"the averaging window must be a whole number of versions >= 1, got {window!r}")
        self.window = window
        self.count = 0  # versions folded in
        self.tensors: dict[str, torch.Tensor] = {}

    def decay(self) -> float:
        """The weight the average keeps when the next version is folded in: none until `window`
        versions were seen (a run of few versions, each carrying much progress, reports its
        newest), then a window growing from a tenth of the versions averaged to `window`."""
        if self.count < self.window:
            return 0.0
        averaged = self.count - self.window
        return min(1.0 - 1.0 / self.window, (1 + averaged) / (10 + averaged))

    def update(self, params: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            if not self.tensors:
                self.tensors = {
                    n: p.detach().to("cpu", accumulator_dtype(p.dtype), copy=True) for n, p in params.items()
                }
            else:
                weight = 1.0 - self.decay()
                for n, p in params.items():
                    avg = self.tensors[n]
                    avg.lerp_(p.detach().to("cpu", avg.dtype), weight)
        self.count += 1

    def load(self, tensors: Mapping[str, torch.Tensor], count: int) -> None:
        """State read back from a checkpoint (cloud/durability.py)."""
        if count < 0:
            raise ValueError(f"the averaged versions' count must be >= 0, got {count}")
        self.tensors = {
            n: t.detach().to("cpu", accumulator_dtype(t.dtype), copy=True) for n, t in tensors.items()
        }
        self.count = count
