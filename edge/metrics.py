"""What an edge records (common/metrics.py), per layer where it makes sense: one registry for the
session, its connection and its durability, read by `status()` and the /metrics endpoint."""

from __future__ import annotations

from elasticfed.common.metrics import LATENCY_BUCKETS_S, STALENESS_BUCKETS, Metrics


class EdgeMetrics:
    """The edge's counters and histograms, declared once."""

    def __init__(self) -> None:
        m = self.registry = Metrics()
        self.strong = m.counter(
            "edge_strong_syncs_total", "layer pushes answered within the deadline", ["layer"]
        )
        self.weak = m.counter("edge_weak_syncs_total", "layer pushes that missed their deadline", ["layer"])
        self.late = m.counter(
            "edge_late_deliveries_total", "weak layer pushes the gateway answered later", ["layer"]
        )
        self.retransmits = m.counter("edge_retransmissions_total", "layer pushes sent again", ["layer"])
        self.sent_bytes = m.counter("edge_sent_bytes_total", "payload bytes pushed", ["layer"])
        self.delivered = m.counter(
            "edge_delivered_steps_total", "step-gradients the gateway applied", ["layer"]
        )
        self.dropped_stale = m.counter(
            "edge_dropped_stale_steps_total", "step-gradients the gateway dropped as too stale", ["layer"]
        )
        self.rejected = m.counter("edge_rejected_total", "pushes refused by the gateway", ["reason"])
        self.latency = m.histogram(
            "edge_sync_latency_seconds", "first send to answer, per layer push", ["layer"], LATENCY_BUCKETS_S
        )
        self.staleness = m.histogram(
            "edge_push_staleness",
            "versions between a push's base model and the newest known",
            ["layer"],
            STALENESS_BUCKETS,
        )
        self.reconnects = m.counter("edge_reconnects_total", "sockets closed and opened again after silence")
        self.handshake_failures = m.counter(
            "edge_handshake_failures_total", "CURVE handshakes with the gateway that failed", ["kind"]
        )
        self.models = m.counter("edge_models_received_total", "model versions received")
        self.durable = m.counter(
            "edge_durable_steps_total", "step-gradients the gateway wrote to disk (a commit)", ["layer"]
        )
        self.resent_lost = m.counter(
            "edge_lost_by_gateway_steps_total",
            "acknowledged step-gradients a gateway lost in a crash, sent again",
            ["layer"],
        )
        self.persists = m.counter("edge_state_saves_total", "times the cache was saved to disk")
        self.model_bytes = m.counter("edge_model_bytes_total", "model bytes received in chunks")
        self.download_restarts = m.counter(
            "edge_model_download_restarts_total",
            "downloads started over (the gateway stopped serving that version, or a corrupt blob)",
        )
        self.download_resumes = m.counter(
            "edge_model_download_resumes_total", "part-way downloads carried over to a new connection"
        )
        self.pushes = m.counter("edge_pushes_total", "push messages sent (first sends and re-sends)")
