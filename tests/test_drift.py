"""Drift control on the device (edge/drift.py): FedProx (each local step, and what the edge pushes, is
the gradient of the loss plus mu (w - w_anchor), the anchor being the last adopted global model),
SCAFFOLD's control variates, and the drift horizon."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from elasticfed.common import config as cfg
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.config import EdgeConfig
from elasticfed.edge.drift import ControlVariates, Horizon, Proximal
from elasticfed.edge.session import SessionOptions


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
    """c_i is a (warm-up corrected) moving average of the pushed directions; c is minus the adopted
    models' change over their step mass, older stretches fading as c_i's old steps do; once c is
    known each observed step moves the model by -rate x (c - c_i)."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    cv = ControlVariates([w], decay=0.5)
    cv.observe([w], [torch.tensor([4.0, 0.0])])
    torch.testing.assert_close(cv.own(w), torch.tensor([4.0, 0.0]))  # one step: its direction
    cv.correct([w], rate=0.1)
    torch.testing.assert_close(w.detach(), torch.tensor([1.0, 2.0]))  # c unknown: no move
    cv.adopt([w], mass=3.0)  # the first model: nothing to compare with
    assert not cv.known
    with torch.no_grad():
        w -= torch.tensor([0.6, -0.3])  # the gateway moved the model by -0.6, +0.3
    cv.adopt([w], mass=6.0)  # 3 units of step mass later
    assert cv.known and cv.stretches == 1
    torch.testing.assert_close(cv.fleet(w), torch.tensor([0.2, -0.1]))
    at = w.detach().clone()
    cv.observe([w], [torch.tensor([0.0, 2.0])])
    cv.observe([w], [torch.tensor([0.0, 2.0])])  # two steps before the next forward pass
    # weights 0.25, 0.5, 1 on (4, 0), (0, 2), (0, 2), over their sum 1.75
    own = torch.tensor([1.0, 3.0]) / 1.75
    torch.testing.assert_close(cv.own(w), own)
    cv.correct([w], rate=0.1)
    torch.testing.assert_close(w.detach(), at - 0.1 * 2 * (torch.tensor([0.2, -0.1]) - own))
    cv.correct([w], rate=0.1)  # nothing observed since: no move
    torch.testing.assert_close(w.detach(), at - 0.1 * 2 * (torch.tensor([0.2, -0.1]) - own))
    before_adopt = w.detach().clone()
    with torch.no_grad():
        w -= torch.tensor([0.2, 0.2])
    cv.observe([w], [torch.tensor([1.0, 1.0])])
    cv.adopt([w], mass=7.0)  # 3 steps this stretch: the old one fades by 0.5^3; the pending step is moot
    moved = 0.125 * torch.tensor([0.6, -0.3]) + (before_adopt - w.detach()) + (at - before_adopt)
    torch.testing.assert_close(cv.fleet(w), moved / (0.125 * 3.0 + 1.0))
    at = w.detach().clone()
    cv.correct([w], rate=0.1)
    torch.testing.assert_close(w.detach(), at)
    # A step cut short by the drift horizon (a quarter of full size): c_i learns the full-size
    # direction and the correction is a quarter of a full step's.
    c, own_before, weight = cv.fleet(w).clone(), cv.own(w).clone(), 1.0 + 0.5 + 0.25 + 0.125
    cv.observe([w], [torch.tensor([0.5, 0.5])], scale=0.25)
    own = (own_before * weight * 0.5 + torch.tensor([2.0, 2.0])) / (weight * 0.5 + 1.0)
    torch.testing.assert_close(cv.own(w), own)
    at = w.detach().clone()
    cv.correct([w], rate=0.1)
    torch.testing.assert_close(w.detach(), at - 0.1 * 0.25 * (c - own))
    with torch.no_grad():
        w += 5.0
    cv.adopt([w], mass=2.0)  # the mass went back (a new gateway instance): c is forgotten
    assert not cv.known and cv.stretches == 2
    torch.testing.assert_close(cv.fleet(w), torch.zeros(2))
    cv.observe([w], [torch.tensor([1.0, 1.0])])
    at = w.detach().clone()
    cv.correct([w], rate=0.1)
    torch.testing.assert_close(w.detach(), at)  # uncorrected until c is read anew
    with torch.no_grad():
        w -= 0.4
    cv.adopt([w], mass=4.0)  # read anew from this instance's masses
    assert cv.known and cv.stretches == 3
    torch.testing.assert_close(cv.fleet(w), torch.tensor([0.2, 0.2]))
    cv.adopt([w], mass=0.0)  # a version that says none (the gateway now adds momentum): forgotten
    assert not cv.known
    with pytest.raises(ValueError, match="decay must be in"):
        ControlVariates([w], decay=1.0)


def test_scaffold_on_an_edge_pushes_the_steps_and_moves_the_model_by_the_correction() -> None:
    """With c known, the pushed sum is exactly the optimizer's steps (as without SCAFFOLD) and each
    step also moves the model by -lr (c - c_i) before the next forward pass."""
    model = _model()
    agent = ElasticEdge(
        model, SessionOptions(gateway="tcp://127.0.0.1:9", client_id="s"), start=False, scaffold=True
    )
    assert agent.variates is not None
    params = list(model.parameters())
    agent.variates.adopt(params, 1.0)
    with torch.no_grad():
        for p in params:
            p -= 0.01
    agent.variates.adopt(params, 2.0)  # c = 0.01 everywhere
    assert agent.status()["scaffold_stretches"] == 1
    lr = 0.3
    opt = torch.optim.SGD(agent.parameters(), lr=lr)
    agent.follow(opt)
    pushed = [torch.zeros_like(p) for p in params]
    own_now: list[torch.Tensor] = []
    for step in range(4):
        x, y = _batch(step)
        opt.zero_grad()
        before = [p.detach().clone() for p in params]
        d = agent.variates.decay
        own_sum = [agent.variates.own(p) * (1 - d**step) / (1 - d) for p in params]  # undo the mean
        loss = nn.functional.cross_entropy(agent(x), y)  # the forward pass applies the last correction
        if step:
            for p, b, o in zip(params, before, own_now):
                torch.testing.assert_close(p.detach(), b - lr * (0.01 - o), rtol=1e-5, atol=1e-7)
        loss.backward()
        for i, p in enumerate(params):
            pushed[i] += p.grad
            mean = (d * own_sum[i] + p.grad) * (1 - d) / (1 - d ** (step + 1))
            torch.testing.assert_close(agent.variates.own(p), mean, rtol=1e-5, atol=1e-7)
        own_now = [agent.variates.own(p).clone() for p in params]
        opt.step()
    cached = {}
    for unit in agent.cache.units:
        cached.update(zip(unit.names, unit.views(unit.pending)))
    for (name, _), s in zip(model.named_parameters(), pushed):
        torch.testing.assert_close(cached[name], s, rtol=1e-5, atol=1e-6)
    assert cfg.load(EdgeConfig, None, {"train.scaffold": "true"}).train.scaffold is True
    assert cfg.load(EdgeConfig, None, {}).train.scaffold is False


@pytest.mark.parametrize(
    ("downlink_ratio", "momentum", "steps", "tolerance"),
    [(0.0, 0.0, 1000, 0.01), (0.02, 0.9, 3000, 0.25)],
    ids=["whole models", "top-k patches, momentum"],
)
def test_scaffold_reads_the_fleet_direction_off_a_real_gateway(
    downlink_ratio: float, momentum: float, steps: int, tolerance: float
) -> None:
    """One edge is the whole fleet and its gradient is constant (a loss linear in the weights), so the
    fleet's direction read off the adopted models (through the real download path and the step mass
    each version says) must be this edge's own mean pushed direction, c_i.  With whole models and
    plain SGD it is exact (measured 2e-4).  Two things make it lag, measured 12 times each after
    other tests in one process: momentum (the pushed steps ramp up over the first tens of steps, and
    the models move by pushes delivered a download later than c_i saw them: 0.011-0.10 with whole
    models), and patches, which leave the public model up to tens of versions behind the gateway's
    in each entry (0.025-0.10 with momentum): over c's window of about 500 steps that lag is the
    top-k case's tolerance."""
    from fleet import serving

    from elasticfed.cloud.aggregation import Buffered, DeadlineQuorum
    from elasticfed.cloud.gateway import Gateway, GatewayOptions

    lr = 0.01
    torch.manual_seed(0)
    gw_model = nn.Linear(32, 16)
    gw = Gateway(
        gw_model,
        torch.optim.SGD(gw_model.parameters(), lr=lr),
        GatewayOptions(bind="tcp://127.0.0.1:0", downlink_ratio=downlink_ratio),
        weighting=Buffered(edge_lr=lr, gateway_lr=lr, expected=1, exponent=0.5, max_staleness=1000),
        rounds=DeadlineQuorum(deadline_s=0.02, quorum=1),
    )
    x, coef = torch.randn(5, 32), torch.randn(5, 16)
    with serving(gw):
        torch.manual_seed(0)
        agent = ElasticEdge(
            nn.Linear(32, 16),
            SessionOptions(gateway=gw.bound_endpoint, client_id="alone"),
            scaffold=True,
            # Full-size steps only: past the horizon an edge's steps shrink, and the models it adopts
            # then move less per step of mass than the full-size directions c_i learns (thousands of
            # steps a second here, so a slow download is hundreds: 0.28 measured with patches).
            drift_horizon=10**9,
        )
        try:
            assert agent.wait_ready(30)
            opt = torch.optim.SGD(agent.parameters(), lr=lr, momentum=momentum)
            agent.follow(opt)
            deadline = time.monotonic() + 120
            taken = 0
            while (agent.variates.stretches < 5 or taken < steps) and time.monotonic() < deadline:  # type: ignore[union-attr]
                opt.zero_grad()
                (agent(x) * coef).sum().backward()  # d/dw: constant
                opt.step()
                taken += 1
            assert agent.variates is not None and agent.variates.stretches >= 5 and taken >= steps
            for p in agent.parameters():
                own, fleet = agent.variates.own(p), agent.variates.fleet(p)
                error = torch.linalg.vector_norm(fleet - own) / torch.linalg.vector_norm(own)
                assert float(error) < tolerance, float(error)
        finally:
            agent.close()
