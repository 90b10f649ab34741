"""FedProx on the device (edge/drift.py): each local step, and what the edge pushes, is the gradient of
the loss plus mu (w - w_anchor), the anchor being the last adopted global model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common import config as cfg
from edge.agent import ElasticEdge
from edge.config import EdgeConfig
from edge.drift import Proximal
from edge.session import SessionOptions


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def hand_fedprox(mu: float, lr: float, steps: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain SGD on loss + mu/2 ||w - w0||^2, by autograd of the whole objective: (final weights, sum
    of the objective's gradients)."""
    model = _model()
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for step in range(steps):
        x, y = _batch(step)
        model.zero_grad()
        prox = sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
        (nn.functional.cross_entropy(model(x), y) + mu / 2 * prox).backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                total[n] += p.grad
                p -= lr * p.grad
    return {n: p.detach() for n, p in model.named_parameters()}, total


@pytest.mark.parametrize("mu", [0.5, 0.0])
def test_the_local_steps_and_the_pushed_sum_are_fedprox_steps(mu: float) -> None:
    model = _model()
    agent = ElasticEdge(
        model, SessionOptions(gateway="tcp://127.0.0.1:9", client_id="e"), start=False, proximal_mu=mu
    )
    assert (agent.drift is None) == (mu == 0.0)
    opt = torch.optim.SGD(agent.parameters(), lr=0.3)
    for step in range(5):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(agent(x), y).backward()
        opt.step()
    weights, pushed = hand_fedprox(mu, 0.3, 5)
    cached = {}
    for unit in agent.cache.units:
        cached.update(zip(unit.names, unit.views(unit.pending)))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cached[n], pushed[n], rtol=1e-5, atol=1e-6)
    if mu:  # the pull is real: without it the run ends elsewhere
        plain, _ = hand_fedprox(0.0, 0.3, 5)
        assert max(float((weights[n] - plain[n]).abs().max()) for n in weights) > 1e-3


def test_the_anchor_follows_each_adopted_model() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    drift = Proximal([w], mu=2.0)
    with torch.no_grad():
        w += 1.0
    w.grad = torch.zeros(2)
    drift.pull([w])
    torch.testing.assert_close(w.grad, torch.tensor([2.0, 2.0]))  # 2 x (w - anchor)
    drift.rebase([w])  # a global model was adopted where w now is
    w.grad = torch.zeros(2)
    drift.pull([w])
    torch.testing.assert_close(w.grad, torch.zeros(2))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="proximal mu must be a finite number above 0"):
            Proximal([w], mu=bad)


def test_the_edge_setting_is_checked() -> None:
    assert cfg.load(EdgeConfig, None, {"train.prox_mu": "0.1"}).train.prox_mu == 0.1
    with pytest.raises(cfg.ConfigError, match="--train-prox-mu: must be >= 0.0"):
        cfg.load(EdgeConfig, None, {"train.prox_mu": "-1"})
