"""Drift control on the device (edge/drift.py): FedProx (each local step, and what the edge pushes, is
the gradient of the loss plus mu (w - w_anchor), the anchor being the last adopted global model),
SCAFFOLD's control variates, and the drift horizon."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common import config as cfg
from edge.agent import ElasticEdge
from edge.config import EdgeConfig
from edge.drift import ControlVariates, Horizon, Proximal
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


def test_an_edge_cut_off_from_the_gateway_walks_less_than_twice_its_horizon_and_pushes_every_step() -> None:
    """A constant gradient (all ones) for 2,000 steps that never see a new global model: plain SGD
    would walk 2,000 steps; the bound keeps the walk under 2 x horizon steps, and what the edge
    caches to push is exactly the walk it took, step by step (none skipped, none dropped)."""
    horizon, lr, steps = 10, 0.1, 2000
    model = nn.Linear(4, 1, bias=False)
    start = model.weight.detach().clone()
    agent = ElasticEdge(
        model,
        SessionOptions(gateway="tcp://127.0.0.1:9", client_id="cut-off"),
        start=False,
        drift_horizon=horizon,
        compression="none",
    )
    opt = torch.optim.SGD(agent.parameters(), lr=lr)
    agent.follow(opt)
    for _ in range(steps):
        opt.zero_grad()
        agent(torch.ones(1, 4)).sum().backward()  # d loss / d w = 1 for every entry
        opt.step()
    sizes = [1.0 if k <= horizon else (horizon / k) ** 2 for k in range(1, steps + 1)]
    walk = start - model.weight.detach()
    torch.testing.assert_close(walk, torch.full_like(walk, lr * sum(sizes)), rtol=1e-5, atol=0)
    assert float(walk.max()) < 2 * horizon * lr  # plain SGD: 2,000 x 0.1 = 200
    assert float(walk.min()) > 1.9 * horizon * lr  # and still training: nothing stalled at 1 x horizon
    unit = agent.cache.units[0]
    assert unit.pending_count == steps and agent.status()["steps_since_adopted"] == steps
    assert agent.cache.lr is not None
    torch.testing.assert_close(agent.cache.lr * unit.pending.view_as(walk), walk, rtol=1e-5, atol=1e-6)


def test_the_horizon_keeps_full_steps_until_it_and_is_checked() -> None:
    bound = Horizon(100)
    assert [bound.factor(k) for k in (1, 50, 100)] == [1.0, 1.0, 1.0]
    assert bound.factor(200) == 0.25 and bound.factor(1000) == pytest.approx(0.01)
    assert sum(bound.factor(k) for k in range(1, 1_000_000)) < 200
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="drift horizon must be a whole number of steps >= 1"):
            Horizon(bad)  # type: ignore[arg-type]
    assert cfg.load(EdgeConfig, None, {}).train.drift_horizon == 200
    assert cfg.load(EdgeConfig, None, {"train.drift_horizon": "0"}).train.drift_horizon == 0
    with pytest.raises(cfg.ConfigError, match="--train-drift-horizon: must be >= 0"):
        cfg.load(EdgeConfig, None, {"train.drift_horizon": "-1"})


def test_control_variates_by_hand() -> None:
    """c_i is a moving average of the edge's gradients; c is minus the adopted models' change over
    their step mass, times gradients per pushed step; each gradient becomes g - c_i + c once c is
    known, and older stretches count half."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    cv = ControlVariates([w], decay=0.5)
    w.grad = torch.tensor([4.0, 0.0])
    cv.correct([w])
    torch.testing.assert_close(cv.own(w), torch.tensor([2.0, 0.0]))  # 0.5 x 0 + 0.5 x g
    torch.testing.assert_close(w.grad, torch.tensor([4.0, 0.0]))  # c unknown: uncorrected
    cv.adopt([w], mass=3.0, gradients_per_step=[1.0])  # the first model: nothing to compare
    assert not cv.known
    with torch.no_grad():
        w -= torch.tensor([0.6, -0.3])  # the gateway moved the model by 0.6, -0.3
    cv.adopt([w], mass=6.0, gradients_per_step=[0.5])  # 3 units of mass later; momentum: 2 long
    assert cv.known and cv.stretches == 1
    torch.testing.assert_close(cv.fleet(w), torch.tensor([0.6, -0.3]) / 3.0 * 0.5)
    w.grad = torch.tensor([0.0, 2.0])
    cv.correct([w])
    own = torch.tensor([1.0, 1.0])  # 0.5 x (2, 0) + 0.5 x (0, 2)
    torch.testing.assert_close(cv.own(w), own)
    torch.testing.assert_close(w.grad, torch.tensor([0.0, 2.0]) - own + torch.tensor([0.1, -0.05]))
    with torch.no_grad():
        w -= torch.tensor([0.2, 0.2])
    cv.adopt([w], mass=7.0, gradients_per_step=[1.0])  # the old stretch counts half
    moved = 0.5 * torch.tensor([0.6, -0.3]) + torch.tensor([0.2, 0.2])
    torch.testing.assert_close(cv.fleet(w), moved / (0.5 * 3.0 + 1.0))
    before = cv.fleet(w).clone()
    with torch.no_grad():
        w += 5.0
    cv.adopt([w], mass=2.0, gradients_per_step=[1.0])  # mass went back (a new gateway): no lesson
    cv.adopt([w], mass=0.0, gradients_per_step=[1.0])  # a version that says none: no lesson
    torch.testing.assert_close(cv.fleet(w), before)
    assert cv.stretches == 2
    with pytest.raises(ValueError, match="decay must be in"):
        ControlVariates([w], decay=1.0)


def test_scaffold_on_an_edge_corrects_the_step_and_the_push_alike() -> None:
    """With c known, the local step and the pushed sum both use g - c_i + c (what the gateway receives
    is the step taken); the setting reaches the agent from the edge's config."""
    model = _model()
    agent = ElasticEdge(
        model, SessionOptions(gateway="tcp://127.0.0.1:9", client_id="s"), start=False, scaffold=True
    )
    assert agent.variates is not None
    params = list(model.parameters())
    agent.variates.adopt(params, 1.0, [1.0] * len(params))
    with torch.no_grad():
        for p in params:
            p -= 0.01
    agent.variates.adopt(params, 2.0, [1.0] * len(params))  # c = 0.01 everywhere
    opt = torch.optim.SGD(agent.parameters(), lr=0.3)
    start = [p.detach().clone() for p in params]
    raw_sum = [torch.zeros_like(p) for p in params]
    own = [torch.zeros_like(p) for p in params]
    expected = [torch.zeros_like(p) for p in params]
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(agent(x), y).backward()
        for i, p in enumerate(params):
            # the raw gradient, recovered from the corrected one and the variates as they are now
            raw = p.grad - 0.01 + agent.variates.own(p)
            own[i] = 0.99 * own[i] + 0.01 * raw
            torch.testing.assert_close(agent.variates.own(p), own[i], rtol=1e-5, atol=1e-7)
            raw_sum[i] += raw
            expected[i] += raw - own[i] + 0.01
        opt.step()
    cached = {}
    for unit in agent.cache.units:
        cached.update(zip(unit.names, unit.views(unit.pending)))
    for (name, p), s, e in zip(model.named_parameters(), start, expected):
        torch.testing.assert_close(s - p.detach(), 0.3 * e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cached[name], e, rtol=1e-5, atol=1e-6)
    assert cfg.load(EdgeConfig, None, {"train.scaffold": "true"}).train.scaffold is True
    assert cfg.load(EdgeConfig, None, {}).train.scaffold is False
