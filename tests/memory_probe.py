"""An edge agent in its own process for memory measurements (tests/test_memory.py).

Trains a 17 MB model with the edge's timers scaled down 30x (deadline 17 ms,
heartbeat 33 ms, saves every 0.33 s), so that 3,000 steps are ten minutes of a
device at 5 steps/s with the default timers: as many reconnects, saves and
re-sends.  Protocol on stdin/stdout, one JSON line each way:

    -> {"event": "warm", ...}       after warm-up steps with the gateway up
    <- "outage"                      the gateway is gone: train through it
    -> {"event": "outage_done", "baseline_rss": .., "peak_rss": .., ...}
    <- "drain"                       the gateway is back: deliver and stop
    -> {"event": "summary", ...}
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
from torch import nn

from edge.agent import ElasticEdge
from edge.session import SessionOptions

SCALE = 30.0
OUTAGE_STEPS = 3000


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main(endpoint: str, state_dir: str) -> None:
    torch.set_num_threads(1)
    model = build_model()
    options = SessionOptions(
        gateway=endpoint,
        client_id="probe",
        timeout_s=0.5 / SCALE,
        heartbeat_s=1.0 / SCALE,
        reconnect_first_s=0.2 / SCALE,
        reconnect_cap_s=5.0 / SCALE,
        state_dir=state_dir,
        persist_every_s=10.0 / SCALE,
    )
    agent = ElasticEdge(model, options)
    optimizer = torch.optim.SGD(agent.parameters(), lr=0.001)
    x, y = torch.randn(8, 2048), torch.randint(0, 10, (8,))

    def step() -> None:
        loss = nn.functional.cross_entropy(agent(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(30):
        step()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    emit("warm", model_bytes=model_bytes, rss=rss(), cache_bytes=agent.cache.host_bytes())
    assert sys.stdin.readline().strip() == "outage"

    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            samples.append(rss())

    baseline = rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    for _ in range(OUTAGE_STEPS):
        step()
    done.set()
    sampler.join()
    status = agent.session.status()
    metrics = status["metrics"]
    emit(
        "outage_done",
        model_bytes=model_bytes,
        baseline_rss=baseline,
        peak_rss=max(samples + [rss()]),
        end_rss=rss(),
        seconds=round(time.monotonic() - started, 1),
        steps=OUTAGE_STEPS,
        undelivered_steps=status["undelivered_steps"],
        cache_bytes=status["cache_bytes"],
        reconnects=sum(metrics["edge_reconnects_total"].values()),
        saves=sum(metrics["edge_state_saves_total"].values()),
    )
    assert sys.stdin.readline().strip() == "drain"
    delivered = agent.close(drain_s=60)
    status = agent.session.status()
    emit(
        "summary",
        delivered=delivered,
        undelivered_steps=status["undelivered_steps"],
        held_steps=status["held_steps"],
        produced=min(u.produced for u in agent.cache.units),
        durable=min(u.durable for u in agent.cache.units),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
