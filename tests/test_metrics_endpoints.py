"""The /metrics endpoints of the real gateway and agent, scraped over HTTP and parsed.

- `cloud serve` with `--metrics-bind`: after two edges finished, the scrape's
  applied step-gradients per device and layer equal what each edge was told was
  delivered, and its counters equal the gateway's own summary at exit.
- An in-process agent after a run: every sample of the scrape equals the
  agent's own counters (the exporter adds and loses nothing).
- `elasticfed edge` with `--thermal-pause-above-c` on a thermal zone laid out
  like sysfs: hot at start, the agent pauses before its first step, and its
  endpoint says so; cooled, it trains and finishes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from elasticfed.common.metrics_http import serve_metrics
from elasticfed.common.task import load_task
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.session import SessionOptions
from tests.fleet import Proc, edge, free_port, gateway_process, gateway_thread
from tests.test_metrics_http import expected, samples, scrape


def by_label(values: dict, name: str, label: str, **fixed: str) -> dict[str, float]:
    """{label value: sample value} of family samples `name` whose other labels equal `fixed`."""
    out = {}
    for (sample, labels), value in values.items():
        labels = dict(labels)
        if sample == name and all(labels.get(k) == v for k, v in fixed.items()):
            out[labels[label]] = value
    return out


def total(values: dict, name: str) -> float:
    return sum(v for (sample, _), v in values.items() if sample == name)


@pytest.mark.slow
def test_gateway_endpoint_counts_what_edges_delivered(procs: list[Proc]) -> None:
    gw = gateway_process(free_port(), "--metrics-bind", "127.0.0.1:0", "--gateway-round-deadline-s", "0.2")
    procs.append(gw)
    ready = gw.wait_for(lambda e: e.get("event") == "ready", 60, "the gateway")
    url = ready["metrics_url"]
    assert url.startswith("http://127.0.0.1:")
    edges = [
        edge(ready["endpoint"], f"cam-{i}", "--train-shard", f"{i}/2", "--train-max-steps", "60")
        for i in range(2)
    ]
    procs.extend(edges)
    summaries = [e.summary(120) for e in edges]
    scraped = samples(scrape(url))
    for s in summaries:
        applied = by_label(scraped, "elasticfed_gateway_applied_steps_total", "layer", client=s["client"])
        assert applied == {k: float(v) for k, v in s["delivered_steps"].items()}, s["client"]
        assert sum(applied.values()) > 0
    assert total(scraped, "elasticfed_gateway_clients") == 2
    assert total(scraped, "elasticfed_gateway_connected_devices") in (0, 1, 2)  # gone once they stop
    assert "process_resident_memory_bytes" in {name for name, _ in scraped}
    # Every closed round was timed.
    assert total(scraped, "elasticfed_gateway_round_seconds_count") == total(
        scraped, "elasticfed_gateway_rounds_total"
    )

    gw.signal()
    summary = gw.summary(60)
    for counter in (
        "gateway_pushes_total",
        "gateway_applied_steps_total",
        "gateway_received_bytes_total",
        "gateway_duplicates_total",
        "gateway_rejected_total",
    ):
        assert total(scraped, "elasticfed_" + counter) == summary[counter], counter


def test_agent_endpoint_equals_the_agents_own_counters() -> None:
    task = load_task("elasticfed.common.tasks.digits:task")
    torch.manual_seed(0)
    model = task.build_model()
    data = torch.utils.data.DataLoader(task.train_set(), batch_size=32, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with gateway_thread(round_deadline_s=0.1) as gateway:
        agent = ElasticEdge(model, SessionOptions(gateway=gateway.wait_bound(10), client_id="cam-9"))
        assert agent.wait_ready(10)
        for step, (x, y) in enumerate(data):
            optimizer.zero_grad(set_to_none=True)
            task.loss(agent(x), y).backward()
            optimizer.step()
            if step == 30:
                break
        assert agent.close(drain_s=20)
    registry = agent.session.metrics.registry
    with serve_metrics("127.0.0.1:0", registry) as server:
        scraped = samples(scrape(server.url))
    assert scraped == pytest.approx(expected(registry))
    delivered = by_label(scraped, "elasticfed_edge_delivered_steps_total", "layer")
    assert delivered and all(v == 31 for v in delivered.values()), delivered
    latency = by_label(scraped, "elasticfed_edge_sync_latency_seconds_count", "layer")
    assert set(latency) == set(delivered) and all(n > 0 for n in latency.values())


@pytest.mark.slow
def test_a_hot_device_pauses_training_and_says_so(procs: list[Proc], tmp_path: Path) -> None:
    zone = tmp_path / "thermal_zone0"
    zone.mkdir()
    (zone / "type").write_text("gpu-thermal\n")
    (zone / "temp").write_text("91500\n")  # millidegrees, as sysfs has it
    gw = gateway_process(free_port())
    procs.append(gw)
    ready = gw.wait_for(lambda e: e.get("event") == "ready", 60, "the gateway")
    agent = edge(
        ready["endpoint"], "jetson-1", "--train-max-steps", "20", "--metrics-bind", "127.0.0.1:0",
        "--thermal-pause-above-c", "85", "--thermal-zones", str(tmp_path / "thermal_zone*" / "temp"),
        "--thermal-poll-s", "0.05", "--status-every-s", "0.01",
    )  # fmt: skip
    procs.append(agent)
    start = agent.wait_for(lambda e: e.get("event") == "start", 60, "the agent's start line")
    url = start["metrics_url"]

    def paused() -> dict:
        values = samples(scrape(url))
        return values if total(values, "elasticfed_edge_thermal_paused") == 1 else {}

    deadline = time.monotonic() + 30  # a poll with a deadline: the agent reads the zone at its first step
    while not (values := paused()):
        assert agent.proc.poll() is None, "the agent exited instead of pausing"
        assert time.monotonic() < deadline, "the endpoint never said the agent paused"
        time.sleep(0.05)
    assert math.isclose(total(values, "elasticfed_edge_thermal_hottest_celsius"), 91.5)
    assert total(values, "elasticfed_edge_pushes_total") == 0  # no step taken while hot
    assert not agent.statuses(), "a training step ran while the device was hot"

    (zone / "temp").write_text("40000\n")
    summary = agent.summary(60)
    assert summary["steps"] == 20 and summary["delivered_all"]
