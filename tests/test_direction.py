"""An edge pushes the move its optimizer makes, over the learning rate (edge/direction.py)."""

from __future__ import annotations

import time

import pytest
import torch
from fleet import gateway_thread, serving
from torch import nn

from elasticfed.cloud.aggregation import Buffered, DeadlineQuorum
from elasticfed.cloud.gateway import Gateway, GatewayOptions, edge_push
from elasticfed.common.task import load_task
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.direction import RawGradient, SgdDirection
from elasticfed.edge.session import SessionOptions

SETTINGS = [
    {"momentum": 0.0},
    {"momentum": 0.9},
    {"momentum": 0.9, "weight_decay": 1e-2},
    {"momentum": 0.9, "nesterov": True},
    {"momentum": 0.8, "dampening": 0.3},
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_direction_is_what_the_step_then_subtracts_over_the_learning_rate(settings: dict) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, **settings)
    direction = SgdDirection(opt)
    for step in range(5):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        ahead = [direction(p, p.grad) for p in model.parameters()]
        opt.step()
        for p, b, d in zip(model.parameters(), before, ahead):
            torch.testing.assert_close(b - p.detach(), 0.3 * d, rtol=1e-5, atol=1e-7)


def test_an_edge_that_follows_its_optimizer_caches_its_local_move() -> None:
    model = _model()
    agent = ElasticEdge(model, SessionOptions(gateway="tcp://127.0.0.1:9", client_id="e"), start=False)
    opt = torch.optim.SGD(agent.parameters(), lr=0.2, momentum=0.9)
    agent.follow(opt)
    agent.session.push = "step"  # as a gateway without momentum says in its welcome
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(6):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(agent(x), y).backward()
        opt.step()
    cached = {}
    for unit in agent.cache.units:
        assert unit.pending_count == 6
        cached.update(zip(unit.names, unit.views(unit.pending)))
    for n, p in model.named_parameters():
        # Six momentum steps moved the model about 4x as far as 0.2 x the gradients' sum would say.
        torch.testing.assert_close(cached[n] * 0.2, start[n] - p.detach(), rtol=1e-4, atol=1e-6)


def test_an_optimizer_whose_step_is_not_known_at_backward_time_is_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="follow torch.optim.SGD only.*got Adam"):
        SgdDirection(torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="maximize"):
        SgdDirection(torch.optim.SGD(model.parameters(), lr=0.1, maximize=True))


def test_a_restart_forgets_the_momentum_built_on_the_replaced_model() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    direction = SgdDirection(opt)
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    direction.restart()  # a newer global model was loaded
    x, y = _batch(3)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    ahead = [direction(p, p.grad) for p in model.parameters()]
    for p, d in zip(model.parameters(), ahead):
        torch.testing.assert_close(d, p.grad)  # a fresh run's first step is its gradient
    opt.step()
    for p, b, d in zip(model.parameters(), before, ahead):
        torch.testing.assert_close(b - p.detach(), 0.3 * d)  # and the optimizer agrees


def test_momentum_is_applied_once_the_gateway_says_where() -> None:
    model = _model()
    assert edge_push(torch.optim.SGD(model.parameters(), lr=0.1)) == "step"
    assert edge_push(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == "gradient"
    # FedAdam (cloud/server_optimizers.py): the clients' move is the pseudo-gradient (Reddi et al.).
    assert edge_push(torch.optim.Adam(model.parameters())) == "step"
    assert edge_push(None) == "gradient"  # a cloud trainer's optimizer steps the model (hybrid)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_edge_pushes_what_its_gateway_asks_for(momentum: float) -> None:
    with gateway_thread(momentum=momentum) as gateway:
        torch.manual_seed(0)
        agent = ElasticEdge(
            load_task("elasticfed.common.tasks.digits:task").build_model(),
            SessionOptions(gateway=gateway.bound_endpoint, client_id="e", timeout_s=0.5),
        )
        try:
            opt = torch.optim.SGD(agent.parameters(), lr=0.05, momentum=0.9)
            agent.follow(opt)
            assert agent.wait_ready(30.0)
            expected = "gradient" if momentum else "step"
            assert agent.session.push == expected
            assert isinstance(agent.direction, RawGradient if momentum else SgdDirection)
        finally:
            agent.close()


def test_edges_at_different_rates_and_schedules_land_the_gateway_on_their_mean_move() -> None:
    """Neither edge's rate is the gateway's `edge_lr` (7.0 here, wrong on purpose): each push says
    the rate its sum is in units of, and one edge's rate halves every step (a schedule)."""
    gw_model = _model()
    gw = Gateway(
        gw_model,
        torch.optim.SGD(gw_model.parameters(), lr=0.05),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        weighting=Buffered(edge_lr=7.0, gateway_lr=0.05, expected=2),
        rounds=DeadlineQuorum(deadline_s=600.0, quorum=2),
    )
    x0 = [p.detach().clone() for p in gw_model.parameters()]
    with serving(gw):
        agents, moves = [], []
        for name, lr, halve in (("steady", 0.3, False), ("scheduled", 0.08, True)):
            model = _model()
            agent = ElasticEdge(
                model,
                SessionOptions(gateway=gw.bound_endpoint, client_id=name),
                start=False,
                pack_cap_bytes=1 << 20,  # one unit, one push: both land in the first round
                compression="none",  # exact sums (compression's residual is tested on its own)
            )
            opt = torch.optim.SGD(agent.parameters(), lr=lr)
            agent.follow(opt)
            schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5 if halve else 1.0)
            for step in range(6):
                x, y = _batch(step + (100 if halve else 0))
                opt.zero_grad()
                nn.functional.cross_entropy(agent(x), y).backward()
                opt.step()
                schedule.step()
            moves.append([p.detach() - x for p, x in zip(model.parameters(), x0)])
            agents.append(agent)
        assert agents[0].cache.lr == 0.3 and agents[1].cache.lr == 0.08  # the first rate each ran at
        try:
            for agent in agents:
                agent.session.start()
            deadline = time.monotonic() + 30
            while gw.version < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert gw.version == 1
            for p, x, ma, mb in zip(gw_model.parameters(), x0, *moves):
                torch.testing.assert_close(p.detach(), x + (ma + mb) / 2, rtol=1e-5, atol=1e-6)
        finally:
            for agent in agents:
                agent.close()
