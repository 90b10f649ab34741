"""The gateway's optimizer: how a round's buffered update moves the model.

The round's average is a pseudo-gradient (Reddi et al., "Adaptive Federated
Optimization", 2021): under the buffered rule, the edges' mean local move divided
by the gateway's learning rate, so plain SGD at that rate lands exactly on the
mean move (FedAvg).  On top of that one mechanism, three policies:

- `sgd` (the default): SGD, momentum 0 by default (FedAvg); with momentum it is
  FedAvgM, and edges push raw gradients so momentum counts once (gateway.edge_push).
- `adam` (FedAdam): torch's Adam on the pseudo-gradient, eps = tau, the
  "adaptivity" Reddi et al. tune (1e-3 in most of their runs).
- `yogi` (FedYogi): Adam whose second moment moves additively, by at most
  (1 - beta2) g^2 per round, so one large round cannot shrink every later step.

Adaptive optimizers normalise the update, so their learning rate is in the units
of the parameters (a step of about lr per coordinate per round), not a multiple
of the edges' rate: their default is 0.01, not the task's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

OPTIMIZERS = ("sgd", "adam", "yogi")
ADAPTIVE_LR = 0.01


class Yogi(torch.optim.Optimizer):
    """Zaheer et al.'s Yogi as FedYogi uses it: v <- v - (1 - b2) g^2 sign(v - g^2); bias-corrected."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = ADAPTIVE_LR,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-3,
        initial_accumulator: float = 1e-6,
    ) -> None:
        if lr <= 0 or eps <= 0 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Yogi: need lr > 0, eps > 0 and betas in [0, 1); got {lr}, {eps}, {betas}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "initial_accumulator": initial_accumulator}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.full_like(p, group["initial_accumulator"])
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                g2 = g * g
                v.addcmul_(torch.sign(v - g2), g2, value=-(1 - beta2))
                t = state["step"]
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                p.addcdiv_(m_hat, v_hat.sqrt().add_(group["eps"]), value=-group["lr"])


def server_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter],
    lr: float,
    momentum: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.99),
    tau: float = 1e-3,
) -> torch.optim.Optimizer:
    """The gateway's optimizer by its setting's name; `lr` already resolved (see default_lr)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=tau)
    if name == "yogi":
        return Yogi(params, lr=lr, betas=betas, eps=tau)
    raise ValueError(f"gateway optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")


def default_lr(name: str, task_lr: float) -> float:
    """SGD steps at the task's rate (the mean move, FedAvg); adaptive ones at ADAPTIVE_LR."""
    return task_lr if name == "sgd" else ADAPTIVE_LR
