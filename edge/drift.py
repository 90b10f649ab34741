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

`ControlVariates` is SCAFFOLD's correction: each local step moves the model along
d - c_i + c instead of d, where d is the step's direction, c_i this edge's mean direction and
c the fleet's, so an edge on skewed data walks along the fleet's direction plus its own noise,
not towards its own optimum.  SCAFFOLD sends c down and each c_i's change up beside the
model; here neither travels.  c_i is a moving average of the directions this edge pushes.  c
is read off the global models the edge adopts: the gateway's update is minus the round's step
mass times the mean pushed direction (plain SGD on the buffered rule, the default), and every
version says its cumulative step mass (`ModelChunk.mass`), so between two adopted versions
-(x_new - x_old) / (mass_new - mass_old) is the fleet's mean pushed direction over that
stretch.  Both averages fade by the same 0.998 per local step (about the last 500 steps): short
windows are noise, because with top-k patches downlink (the default) the public model an edge
holds lags the gateway's by tens of versions in each entry, and that lag over the window is c's
error (measured with a constant gradient: 1-7% with whole models, 13-23% with patches; 50-70%
at a window of 100 steps).  That only holds if pushes carry the
uncorrected directions: pushing the corrected ones, the fleet's mean would be c itself plus
noise (sum of c - c_i over the fleet is about zero), any c would be a fixed point, and its
errors would add up until the model diverged (measured: the gateway's loss watch stopped it
in 41 rounds).  So the correction is a move of its own, -rate x (c - c_i) per step, applied
to the parameters before the next forward pass and not pushed: the pushes (and every audit of
them) are the optimizer's steps, as without SCAFFOLD.  A version that says no mass (a gateway
with momentum or an adaptive optimizer, hybrid mode) or a mass that went backwards (a
restarted gateway) makes the edge forget c and step uncorrected until it has read c anew.
Under the drift horizon a step's correction shrinks with the step (c_i learns the full-size
direction).  Not saved: after a restart c_i warms up again and c waits for two adopted
models.  Cost: four copies of the trainable parameters on the model's device (the last
adopted model, the moved sum, c and c_i) and two passes over them per step.

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
    """SCAFFOLD's correction as a move of its own: -rate x (c - c_i) per local step, c_i a moving
    average of this edge's pushed directions, c the fleet's read off the adopted models' change
    over their step mass."""

    def __init__(self, params: Sequence[torch.Tensor], decay: float = 0.998) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the control variate decay must be in (0, 1), got {decay}")
        self.decay = decay
        self._own = {id(p): torch.zeros_like(p) for p in params}  # decayed sum of pushed directions
        self._own_weight: dict[int, float] = {}  # param id -> decayed count of them (c_i's warm-up)
        self._fleet = {id(p): torch.zeros_like(p) for p in params}
        self._moved = {id(p): torch.zeros_like(p) for p in params}  # decayed sum of -(x_new - x_old)
        self._mass: dict[int, float] = {}  # param id -> decayed sum of the step mass, same stretches
        self._anchor = {id(p): p.detach().clone() for p in params}  # the model adopted last
        self._anchor_mass = 0.0
        self._pending: dict[int, float] = {}  # param id -> steps observed, not yet corrected (scaled)
        self._stretch: dict[int, int] = {}  # param id -> steps observed since the model adopted last
        self.known = False  # c was read off at least one stretch: corrections apply
        self.stretches = 0

    def observe(
        self, params: Sequence[torch.Tensor], directions: Sequence[torch.Tensor | None], scale: float = 1.0
    ) -> None:
        """The directions one step pushes for `params` (in the cache's units), taken at `scale` of
        full size (`Horizon`): c_i learns the full-size direction, and the step's correction is
        `scale` of a full one, so a cut-off edge's walk stays within the horizon's bound."""
        with torch.no_grad():
            for p, d in zip(params, directions):
                if d is None:
                    continue
                key = id(p)
                self._own[key].mul_(self.decay).add_(d.view_as(p), alpha=1.0 / scale)
                self._own_weight[key] = self._own_weight.get(key, 0.0) * self.decay + 1.0
                self._pending[key] = self._pending.get(key, 0.0) + scale
                self._stretch[key] = self._stretch.get(key, 0) + 1

    def correct(self, params: Sequence[torch.Tensor], rate: float) -> None:
        """Move each parameter by -rate x (c - c_i) for every step observed since the last call (at
        that step's scale)."""
        pending, self._pending = self._pending, {}
        if not self.known:
            return
        with torch.no_grad():
            for p in params:
                key = id(p)
                steps = pending.get(key)
                if steps:
                    own = rate * steps / self._own_weight[key]
                    p.sub_(self._fleet[key], alpha=rate * steps).add_(self._own[key], alpha=own)

    def adopt(self, params: Sequence[torch.Tensor], mass: float) -> None:
        """A global model of cumulative step `mass` was just loaded into `params`."""
        self._pending.clear()  # corrections of the replaced local model are moot
        stretch, self._stretch = self._stretch, {}
        gained = mass - self._anchor_mass
        with torch.no_grad():
            if mass > 0 and self._anchor_mass > 0 and gained > 0:
                for p in params:
                    # Older stretches fade as c_i's old steps do: both average over the same past.
                    key = id(p)
                    fade = self.decay ** stretch.get(key, 0)
                    self._mass[key] = self._mass.get(key, 0.0) * fade + gained
                    moved = self._moved[key]
                    moved.mul_(fade).add_(self._anchor[key]).sub_(p)  # += x_old - x_new
                    torch.div(moved, self._mass[key], out=self._fleet[key])
                self.known = True
                self.stretches += 1
            elif self._anchor_mass > 0 and (mass <= 0 or gained < 0):
                # No mass (the gateway now adds momentum, or hybrid) or less of it (a new gateway
                # instance counts from 0): c no longer describes this fleet's moves; read it anew.
                self.known = False
                self._mass.clear()
                for p in params:
                    self._moved[id(p)].zero_()
                    self._fleet[id(p)].zero_()
            for p in params:
                self._anchor[id(p)].copy_(p)
        self._anchor_mass = mass

    def fleet(self, param: torch.Tensor) -> torch.Tensor:
        return self._fleet[id(param)]

    def own(self, param: torch.Tensor) -> torch.Tensor:
        weight = self._own_weight.get(id(param), 0.0)
        return self._own[id(param)] / weight if weight else self._own[id(param)].clone()


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
