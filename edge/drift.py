"""Drift control on the device: FedProx's proximal term (Li et al., "Federated Optimization in
Heterogeneous Networks", 2020).

An edge on skewed data (one site's products, one site's text) that trains many local
steps between adopted models walks towards its own optimum, and the fleet's average
of such walks is not the fleet's optimum.  FedProx adds (mu / 2) ||w - w_anchor||^2
to the local objective, w_anchor being the global model the edge last adopted: each
step's gradient gains mu (w - w_anchor), a pull back that grows with the drift.

Here it is added to `.grad` when backward finishes a unit, before the pushed
direction is read and before the user's optimizer steps, so the local step and what
the gateway receives are the same FedProx step.  Cost: one copy of the trainable
parameters (the anchor) on the model's device, only when mu > 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Proximal:
    """mu (w - w_anchor) added to each parameter's gradient; the anchor moves with each adopted model."""

    def __init__(self, params: Sequence[torch.Tensor], mu: float) -> None:
        if not 0.0 < mu < float("inf"):  # NaN fails it too
            raise ValueError(f"the proximal mu must be a finite number above 0, got {mu}")
        self.mu = mu
        self._anchor = {id(p): p.detach().clone() for p in params}

    def rebase(self, params: Sequence[torch.Tensor]) -> None:
        """A global model was adopted: it is the new anchor."""
        with torch.no_grad():
            for p in params:
                self._anchor[id(p)].copy_(p)

    def pull(self, params: Sequence[torch.Tensor]) -> None:
        """Add mu (w - w_anchor) to the gradients backward just finished (in place)."""
        with torch.no_grad():
            for p in params:
                if p.grad is not None:  # in place, no temporary: this runs in the backward hook
                    p.grad.add_(p, alpha=self.mu).sub_(self._anchor[id(p)], alpha=self.mu)
