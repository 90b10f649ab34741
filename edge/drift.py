"""Drift control on the device: FedProx's proximal term (Li et al., "Federated Optimization in
Heterogeneous Networks", 2020), and a bound on how far an edge walks on its own.

An edge on skewed data (one site's products, one site's text) that trains many local
steps between adopted models walks towards its own optimum, and the fleet's average
of such walks is not the fleet's optimum.  FedProx adds (mu / 2) ||w - w_anchor||^2
to the local objective, w_anchor being the global model the edge last adopted: each
step's gradient gains mu (w - w_anchor), a pull back that grows with the drift.

Here it is added to `.grad` when backward finishes a unit, before the pushed
direction is read and before the user's optimizer steps, so the local step and what
the gateway receives are the same FedProx step.  Cost: one copy of the trainable
parameters (the anchor) on the model's device, only when mu > 0.

`Horizon` bounds the walk of an edge that can neither deliver nor fetch for a long
time (an outage, a gateway that publishes nothing): its steps keep full size for
`horizon` steps after the last adopted model, then shrink as (horizon / k)^2 at the
k-th.  The sizes sum to less than 2 x horizon however long the edge is cut off, so
it never moves further than 2 x horizon steps would; it still trains (no step is
skipped or dropped, every one is pushed at the size it was taken) and the next
adopted model restores full size.  It scales the gradient backward produced, before
the proximal pull and before the pushed direction is read: for SGD this is the
learning rate decaying, and the gateway receives exactly the steps taken.
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


class Horizon:
    """Scale of an edge's k-th step since it last adopted a global model: 1 up to `horizon`, then
    (horizon / k)^2, so the scales sum to under 2 x horizon."""

    def __init__(self, horizon: int) -> None:
        if type(horizon) is not int or horizon < 1:
            raise ValueError(f"the drift horizon must be a whole number of steps >= 1, got {horizon!r}")
        self.horizon = horizon

    def factor(self, since_adopted: int) -> float:
        if since_adopted <= self.horizon:
            return 1.0
        return (self.horizon / since_adopted) ** 2

    def scale(self, params: Sequence[torch.Tensor], since_adopted: int) -> None:
        """Scale the gradients backward just finished for the `since_adopted`-th step (in place)."""
        factor = self.factor(since_adopted)
        if factor == 1.0:
            return
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor)
