"""Drift control on the device: FedProx's proximal term (Li et al., "Federated Optimization in
Heterogeneous Networks", 2020), SCAFFOLD's control variates (Karimireddy et al., "SCAFFOLD:
Stochastic Controlled Averaging for Federated Learning", 2020), and a bound on how far an edge
walks on its own.

An edge on skewed data (one site's products, one site's text) that trains many local
steps between adopted models walks towards its own optimum, and the fleet's average
of such walks is not the fleet's optimum.  FedProx adds (mu / 2) ||w - w_anchor||^2
to the local objective, w_anchor being the global model the edge last adopted: each
step's gradient gains mu (w - w_anchor), a pull back that grows with the drift.

Here it is added to `.grad` when backward finishes a unit, before the pushed
direction is read and before the user's optimizer steps, so the local step and what
the gateway receives are the same FedProx step.  Cost: one copy of the trainable
parameters (the anchor) on the model's device, only when mu > 0.

`ControlVariates` is SCAFFOLD's correction: each step's gradient g becomes g - c_i + c, where
c_i is this edge's own mean gradient and c the fleet's, so an edge on skewed data steps (and
pushes) along the fleet's direction plus its own noise, not towards its own optimum.  SCAFFOLD
sends c down and each c_i's change up beside the model; here neither travels.  c_i is a moving
average of the gradients backward produced on this edge.  c is read off the global models the
edge adopts: the gateway's update is minus its rate times the round's step mass times the mean
pushed direction (plain SGD on the buffered rule, the default), and every version says its
cumulative step mass (`ModelChunk.mass`), so between two adopted versions
-(x_new - x_old) / (mass_new - mass_old) is the fleet's mean pushed direction over that
stretch: c, after the local optimizer's momentum is taken out (a pushed direction is the
optimizer's step: with momentum beta restarted at each adopted model, the k-th step after it
is (1 - beta^k) / (1 - beta) gradients long, and the edge divides by the mean of that over its
own steps since the last adoption).  Older stretches count half at each adoption.  A
version that says no mass (a gateway with momentum or an adaptive optimizer, hybrid mode) or
a mass that went backwards (a restarted gateway) teaches nothing, and the edge steps
uncorrected until it knows c.  Not saved: after a restart c_i warms up again and c waits for
two adopted models.  Cost: three copies of the trainable
parameters (the last adopted model, c and c_i) and two passes over the gradients per step.
The pushed direction includes the correction, so what the gateway receives is the step taken.

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


class ControlVariates:
    """SCAFFOLD's g - c_i + c on each gradient, c_i a moving average of this edge's gradients and c
    the fleet's mean direction read off the adopted models' changes over their step mass."""

    def __init__(self, params: Sequence[torch.Tensor], decay: float = 0.99) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the control variate decay must be in (0, 1), got {decay}")
        self.decay = decay
        self._own = {id(p): torch.zeros_like(p, memory_format=torch.preserve_format) for p in params}
        self._fleet = {id(p): torch.zeros_like(p) for p in params}
        self._moved = {id(p): torch.zeros_like(p) for p in params}  # decayed sum of -(x_new - x_old)
        self._anchor = {id(p): p.detach().clone() for p in params}  # the model adopted last
        self._anchor_mass = 0.0
        self._mass = 0.0  # decayed sum of the step mass over the same stretches
        self.known = False  # c was read off at least one stretch: corrections apply
        self.stretches = 0

    def adopt(self, params: Sequence[torch.Tensor], mass: float, gradients_per_step: Sequence[float]) -> None:
        """A global model of cumulative step `mass` was just loaded into `params`;
        `gradients_per_step[i]` turns a pushed direction of params[i] into gradients (1: raw
        gradients pushed; below 1 under momentum)."""
        gained = mass - self._anchor_mass
        with torch.no_grad():
            if mass > 0 and self._anchor_mass > 0 and gained > 0:
                self._mass = 0.5 * self._mass + gained
                for p, per_step in zip(params, gradients_per_step):
                    moved = self._moved[id(p)]
                    moved.mul_(0.5).add_(self._anchor[id(p)]).sub_(p)  # += x_old - x_new
                    torch.mul(moved, per_step / self._mass, out=self._fleet[id(p)])
                self.known = True
                self.stretches += 1
            for p in params:
                self._anchor[id(p)].copy_(p)
        self._anchor_mass = mass

    def correct(self, params: Sequence[torch.Tensor]) -> None:
        """Fold each gradient backward just finished into c_i, then add c - c_i to it (in place)."""
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    continue
                own = self._own[id(p)]
                own.mul_(self.decay).add_(p.grad, alpha=1.0 - self.decay)
                if self.known:
                    p.grad.add_(self._fleet[id(p)]).sub_(own)

    def fleet(self, param: torch.Tensor) -> torch.Tensor:
        return self._fleet[id(param)]

    def own(self, param: torch.Tensor) -> torch.Tensor:
        return self._own[id(param)]


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
