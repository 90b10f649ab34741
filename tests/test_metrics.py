"""Fleet metrics: labelled counters and histograms, a JSON snapshot, and Prometheus text."""

from __future__ import annotations

import re
import threading

import pytest

from elasticfed.common.metrics import LATENCY_BUCKETS_S, Metrics


def test_counters_histograms_and_snapshot() -> None:
    m = Metrics()
    weak = m.counter("edge_weak_syncs_total", "weak layer pushes", ["layer"])
    latency = m.histogram("edge_sync_latency_seconds", "latency", ["layer"], LATENCY_BUCKETS_S)
    weak.inc("fc.weight")
    weak.inc("fc.weight", by=2)
    weak.inc("fc.bias")
    for v in (0.004, 0.02, 3.0):
        latency.observe("fc.weight", value=v)
    assert weak.get("fc.weight") == 3 and weak.total() == 4
    snap = m.snapshot()
    assert snap["edge_weak_syncs_total"] == {"layer=fc.weight": 3, "layer=fc.bias": 1}
    row = snap["edge_sync_latency_seconds"]["layer=fc.weight"]
    assert row["count"] == 3 and row["max"] == 3.0 and row["mean"] == pytest.approx((0.004 + 0.02 + 3.0) / 3)
    with pytest.raises(ValueError, match="takes labels"):
        weak.inc()
    with pytest.raises(ValueError, match="declared twice"):
        m.counter("edge_weak_syncs_total", "again")


def test_prometheus_text_is_well_formed_and_cumulative() -> None:
    m = Metrics()
    c = m.counter("gateway_rejected_total", "refused", ["client", "reason"])
    c.inc('cam "7"', "nonfinite")
    h = m.histogram("gateway_staleness", "versions behind", ["client"], (0, 1, 4))
    for v in (0, 1, 1, 3, 10):
        h.observe("a", value=v)
    text = m.render_prometheus()
    assert "# TYPE elasticfed_gateway_rejected_total counter" in text
    assert 'elasticfed_gateway_rejected_total{client="cam \\"7\\"",reason="nonfinite"} 1' in text
    buckets = re.findall(r'elasticfed_gateway_staleness_bucket\{client="a",le="([^"]+)"\} (\d+)', text)
    assert buckets == [("0", "1"), ("1", "3"), ("4", "4"), ("+Inf", "5")]
    assert 'elasticfed_gateway_staleness_count{client="a"} 5' in text
    assert 'elasticfed_gateway_staleness_sum{client="a"} 15' in text


def test_counting_from_two_threads_loses_nothing() -> None:
    c = Metrics().counter("n_total", "n", ["layer"])

    def work() -> None:
        for _ in range(20_000):
            c.inc("x")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.get("x") == 80_000
