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
import logging
import os
import statistics
import sys
import time

import torch
from torch import nn

from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.session import SessionOptions

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


def wait_idle(agent: ElasticEdge, quiet_s: float = 1.0, deadline_s: float = 60.0) -> None:
    """Until every push is answered and no model is coming down, for `quiet_s` in a row (a round
    closes and announces a version after the last push).  The gateway dies right after "warm": a
    push or model slices still queued then stretch the edge's first silence by what the link needs
    to carry them (liveness is judged by progress: 6.5 s here), and the outage's reconnect count
    varied with that timing (54-84 in 27 s, measured before this wait)."""
    session = agent.session
    quiet_since = None
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        idle = (
            session.cache.undelivered() == 0
            and not session.download.active
            and session.announced <= session.have_version
        )
        now = time.monotonic()
        if not idle:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            return
        time.sleep(0.01)  # a poll with a deadline: the session has no idle event to wait on
    raise SystemExit(
        "the edge did not go idle within a minute of warm-up: "
        f"undelivered {session.cache.undelivered()}, download active {session.download.active}, "
        f"announced {session.announced}, have {session.have_version}"
    )


def main(endpoint: str, state_dir: str, outage_steps: int = OUTAGE_STEPS) -> None:
    logging.basicConfig(
        level=os.environ.get("PROBE_LOG", "WARNING"), format="%(asctime)s %(name)s %(message)s"
    )
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
    wait_idle(agent)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    emit("warm", model_bytes=model_bytes, rss=rss(), cache_bytes=agent.cache.host_bytes())
    assert sys.stdin.readline().strip() == "outage"

    # RSS once per step (between steps: the step's own transient buffers are gone); the
    # outage's start and end are the medians of its first and last tenth.
    samples: list[int] = []
    started = time.monotonic()
    for _ in range(outage_steps):
        step()
        samples.append(rss())
    tenth = max(1, outage_steps // 10)
    baseline = statistics.median(samples[:tenth])
    end = statistics.median(samples[-tenth:])
    status = agent.session.status()
    metrics = status["metrics"]
    emit(
        "outage_done",
        model_bytes=model_bytes,
        baseline_rss=baseline,
        peak_rss=max(samples),
        end_rss=end,
        seconds=round(time.monotonic() - started, 1),
        steps=outage_steps,
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
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
