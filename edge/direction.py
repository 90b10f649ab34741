"""What an edge pushes for a step: the direction its optimizer is about to move each parameter along.

The gateway turns an edge's pushed sum into a move by multiplying by the edge's
learning rate (the buffered rule, `cloud/aggregation.py`).  A raw gradient is
only what plain SGD moves by: an edge running SGD with momentum 0.9 moves its
local model by about ten times the learning rate times each gradient (spread
over the next steps), and the global model, built from raw gradients, moved a
tenth as far as the edges' own models did.  So the edge pushes, at backward
time, the exact vector `optimizer.step()` is about to subtract, over the
learning rate: for SGD with momentum that is the new momentum buffer, which the
step has not yet written.  Summed over a contribution it is the edge's local
move in gradient units; FedAvg's mean of local moves is what the gateway builds.
The momentum restarts at each adopted model (`restart`), as a FedAvg client's
fresh optimizer each round: kept across models, it is momentum on stale
gradients (measured on the base text task, four edges uncapped: the served
model swung between 6 and 17 bits per byte).

Only `torch.optim.SGD` is computable ahead of its step; another optimizer is
refused by `SgdDirection` (and the agent pushes raw gradients without one).
Momentum must be applied once: a gateway with momentum of its own asks for raw
gradients in its welcome, and the agent pushes those (`cloud.gateway.edge_push`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Direction(Protocol):
    """The per-step vector an edge adds to its cache for one parameter, from its gradient."""

    def __call__(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor: ...

    def restart(self) -> None:
        """A newer global model was loaded: the local run starts from it afresh."""
        ...


class RawGradient:
    """What an edge that follows no optimizer pushes: the gradient itself (plain SGD's direction)."""

    def __call__(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def restart(self) -> None:
        pass


class SgdDirection:
    """torch.optim.SGD's update direction for the step about to happen (momentum, dampening,
    Nesterov, weight decay), read from the optimizer's own state: no buffer is duplicated."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if type(optimizer) is not torch.optim.SGD:
            raise ValueError(
                f"an edge can follow torch.optim.SGD only (its step is computable at backward time), "
                f"got {type(optimizer).__name__}; without follow() it pushes raw gradients"
            )
        self.optimizer = optimizer
        self._groups: dict[int, dict] = {}
        for group in optimizer.param_groups:
            if group.get("maximize"):
                raise ValueError("SGD with maximize=True: an edge pushes descent directions")
            for p in group["params"]:
                self._groups[id(p)] = group

    def lr(self, param: torch.Tensor) -> float:
        """The rate the coming step moves `param` at (a scheduler writes it into the group)."""
        group = self._groups.get(id(param))
        if group is None:
            raise ValueError("a parameter the followed optimizer does not update")
        return float(group["lr"])

    def __call__(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        group = self._groups.get(id(param))
        if group is None:
            raise ValueError("a parameter the followed optimizer does not update")
        d = grad
        decay = group["weight_decay"]
        if decay:
            d = d.add(param.detach(), alpha=decay)
        beta = group["momentum"]
        if not beta:
            return d
        buf = self.optimizer.state.get(param, {}).get("momentum_buffer")
        # torch: the first step's buffer is the direction itself; later ones blend in the old buffer.
        new = d.clone() if buf is None else buf.mul(beta).add_(d, alpha=1 - group["dampening"])
        return d.add(new, alpha=beta) if group["nesterov"] else new

    def restart(self) -> None:
        # As a FedAvg client's fresh optimizer each round: momentum built on the model just
        # replaced would keep moving the new one along the old one's path.
        for state in self.optimizer.state.values():
            state.pop("momentum_buffer", None)
