"""Edge programs run as separate processes by the sync tests (importable by multiprocessing's spawn)."""

from __future__ import annotations

import torch
from torch import nn

from elasticfed.common.checkpoint import write_tensors
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.session import SessionOptions


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def exact_edge(endpoint: str, client_id: str, steps: int, seed: int, out_path: str) -> None:
    """Train `steps` local steps, sync once at the end (sync_every = steps), save what was pushed."""
    model = small_model()
    agent = ElasticEdge(
        model,
        SessionOptions(gateway=endpoint, client_id=client_id, timeout_s=5.0),
        sync_every=steps,
        compression="none",  # the exact sums the test computes by hand
    )
    optimizer = torch.optim.SGD(agent.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    sums = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        loss = nn.functional.cross_entropy(agent(x), y)
        optimizer.zero_grad()
        loss.backward()
        for n, p in model.named_parameters():
            sums[n] += p.grad
        optimizer.step()
    delivered = agent.close(drain_s=30.0)
    write_tensors(out_path, sums, {"count": steps, "delivered": delivered}, kind="test-edge-sums")
