"""A poisoned device (gradients x1000) against the norm bound and the robust aggregation policies.

Three honest devices and one poisoned one push every round to a real gateway
over real sockets; each round waits for all four (quorum 4), and the gateway
steps plain SGD (no momentum), so a round's model change is exactly
-lr * the round's aggregate and can be checked against what was sent.
"""

from __future__ import annotations

import pytest
import torch
from fleet import serving
from scripted import ScriptedDevice

from elasticfed.cloud.aggregation import (
    Aggregation,
    CoordinateMedian,
    DeadlineQuorum,
    MeanAggregation,
    TrimmedMean,
)
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.protocol import Ack, Manifest, Welcome

LR = 0.1
BOUND = 1.0
ROUNDS = 4
HONEST = 3


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def gateway(options: GatewayOptions, aggregation: Aggregation, quorum: int = HONEST + 1) -> Gateway:
    model = small_model()
    return Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        options,
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=quorum),
        aggregation=aggregation,
    )


def run_rounds(gateway: Gateway) -> list[tuple[dict, list[dict], dict]]:
    """Per round: (model before, the honest devices' gradients, model after)."""
    manifest = Manifest.from_parameters(gateway.model.named_parameters())
    devices = [
        ScriptedDevice(gateway.bound_endpoint, name, manifest)
        for name in [f"honest-{i}" for i in range(HONEST)] + ["poisoned"]
    ]
    for dev in devices:
        assert isinstance(dev.hello(), Welcome)
    gen = torch.Generator().manual_seed(3)
    out = []
    for r in range(1, ROUNDS + 1):
        before = gateway.snapshot()
        honest = [
            {s.name: torch.randn(s.shape, generator=gen) * 0.05 for s in manifest} for _ in range(HONEST)
        ]
        poison = {name: 1000 * torch.randn(g.shape, generator=gen) for name, g in honest[0].items()}
        for dev, grads in zip(devices, [*honest, poison]):
            answer = dev.push(grads)
            assert isinstance(answer, Ack), answer
        devices[0].wait_version(r)
        for dev in devices:
            dev.version = r
        out.append((before, honest, gateway.snapshot()))
    for dev in devices:
        dev.close()
    return out


def test_without_defences_the_poisoned_device_drags_the_model() -> None:
    with serving(gateway(GatewayOptions(bind="tcp://127.0.0.1:0"), MeanAggregation())) as gw:
        rounds = run_rounds(gw)
    moved = max(float((after[n] - before[n]).norm()) for before, _, after in rounds for n in before)
    assert moved > 50 * LR * BOUND  # the attack is real: this is what the defences must stop


@pytest.mark.parametrize("policy", ["clip", "reject"])
def test_the_norm_bound_limits_how_far_any_round_moves_the_model(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    options = GatewayOptions(bind="tcp://127.0.0.1:0", max_grad_norm=BOUND, norm_policy=policy)
    # A refused push adds nothing to its round: the round closes on the honest devices.
    with serving(gateway(options, MeanAggregation(), HONEST if policy == "reject" else HONEST + 1)) as gw:
        rounds = run_rounds(gw)
        metrics = gw.status()["metrics"]
    for before, honest, after in rounds:
        for name in before:
            step = after[name] - before[name]
            # Each admitted step-gradient has norm <= BOUND, so their mean does: |step| <= lr * BOUND.
            assert float(step.norm()) <= LR * BOUND * (1 + 1e-5), (policy, name, float(step.norm()))
            if policy == "reject":  # the poisoned push is out; the honest ones (under the bound) are the mean
                assert all(float(g[name].norm()) < BOUND for g in honest)
                torch.testing.assert_close(
                    step, -LR * sum(g[name] for g in honest) / HONEST, rtol=0, atol=1e-6
                )
    if policy == "clip":
        assert sum(v for k, v in metrics["gateway_clipped_total"].items() if "poisoned" in k) == ROUNDS * 4
    else:
        assert metrics["gateway_rejected_total"] == {"client=poisoned,reason=norm": ROUNDS}
        assert "refused a message from poisoned (norm): layer" in caplog.text  # the log names the device


@pytest.mark.parametrize(
    "aggregation", [CoordinateMedian(), TrimmedMean(trim=0.25)], ids=["median", "trimmed"]
)
def test_robust_aggregation_keeps_every_coordinate_in_the_honest_range(aggregation: Aggregation) -> None:
    with serving(gateway(GatewayOptions(bind="tcp://127.0.0.1:0"), aggregation)) as gw:
        rounds = run_rounds(gw)
    for before, honest, after in rounds:
        for name in before:
            step = after[name] - before[name]
            moves = torch.stack([-LR * g[name] for g in honest])
            assert bool((step >= moves.min(dim=0).values - 1e-6).all()), name
            assert bool((step <= moves.max(dim=0).values + 1e-6).all()), name
