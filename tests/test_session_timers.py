"""The edge's I/O thread sleeps until something is due: a weak push over TCP does not make it spin.

Over TCP (no in-process faults) a weak push goes again when the gateway answers a
later request, never on a timer; the thread used to list that timer anyway, and
once it had passed every poll returned at once: measured on 10 Mbit/s links, the
I/O thread took as many samples as training and each edge trained half as fast.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch
from torch import nn

from elasticfed.cloud.config import CloudConfig, GatewaySettings
from elasticfed.cloud.serve import build_gateway
from elasticfed.common.task import load_task
from elasticfed.common.tasks.digits import build_model
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.session import SessionOptions


def test_a_weak_push_over_tcp_leaves_the_io_thread_asleep() -> None:
    config = replace(
        CloudConfig(), mode="standalone", gateway=GatewaySettings(bind="tcp://127.0.0.1:0", checkpoint_dir="")
    )
    gateway = build_gateway(config, load_task(config.task))
    endpoint = gateway.bind()
    answering, paused, done = threading.Event(), threading.Event(), threading.Event()
    answering.set()

    def serve() -> None:  # stops reading when `answering` is cleared; the connection stays up
        while not done.is_set():
            if answering.is_set():
                gateway.poll_once(0.02)
            else:
                paused.set()
                done.wait(0.02)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    agent = ElasticEdge(build_model(), SessionOptions(gateway=endpoint, client_id="quiet", timeout_s=0.2))
    try:
        assert agent.wait_ready(10.0)
        session = agent.session
        ticks = [0]
        tick = session._tick

        def counted(now: float) -> None:
            ticks[0] += 1
            tick(now)

        session._tick = counted  # type: ignore[method-assign]
        answering.clear()  # the push below is never answered
        assert paused.wait(5.0)  # (a poll under way would still answer it)
        loss = nn.functional.cross_entropy(agent(torch.randn(8, 64)), torch.randint(0, 10, (8,)))
        loss.backward()
        deadline = time.monotonic() + 10.0
        while not sum(session.status()["metrics"].get("edge_weak_syncs_total", {}).values()):  # weak
            assert time.monotonic() < deadline, "the push never went weak"
            done.wait(0.05)
        ticks[0] = 0
        done.wait(1.0)
        # Probes every timeout/2 and heartbeats: a handful a second, not a poll per millisecond.
        assert ticks[0] < 60, ticks[0]
    finally:
        agent.close()
        done.set()
        thread.join(10)
        gateway.close()
