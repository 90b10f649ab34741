"""The edge's connection (edge/connection.py) on the in-process link: liveness judged by progress,
backoff as longer patience (never a pause without a connection), heartbeats that time the path,
and handshake failures counted every time but logged now and then."""

from __future__ import annotations

import logging
import math
import random

import pytest

from elasticfed.common.link import Backoff
from elasticfed.common.metrics import Metrics
from elasticfed.common.transport import MemoryHub
from elasticfed.common.transport.base import Event, LinkEvent
from elasticfed.edge.connection import MAX_QUEUED_SILENCE_S, Connection
from elasticfed.protocol import Heartbeat, decode


def _connection(hub: MemoryHub) -> tuple[Connection, Metrics]:
    metrics = Metrics()
    connection = Connection(
        hub.dealer_link(b"edge-0"),
        "memory://gateway",
        heartbeat_s=1.0,
        liveness=3,
        backoff=Backoff(first_s=2.0, cap_s=8.0, rng=random.Random(0)),
        reconnects=metrics.counter("reconnects", "test"),
        handshake_failures=metrics.counter("handshake_failures", "test", ["kind"]),
    )
    return connection, metrics


def test_silence_means_dead_only_past_the_heartbeats_and_what_is_queued() -> None:
    hub = MemoryHub()
    connection, _ = _connection(hub)
    connection.open(now=100.0)
    assert not connection.dead(103.0, queued_s=0.0)  # 3 heartbeats of 1 s: not yet
    assert connection.dead(103.01, queued_s=0.0)
    assert not connection.dead(110.0, queued_s=7.5)  # an answer waits behind 7.5 s of queued bytes
    assert connection.dead(103.0 + MAX_QUEUED_SILENCE_S + 0.01, queued_s=1e9)  # at most a minute more
    connection.heard(now=110.0)
    assert not connection.dead(113.0, queued_s=0.0)  # judged from the last answer


def test_a_replacement_opens_at_once_and_only_lengthens_the_next_patience() -> None:
    hub = MemoryHub()
    router = hub.router_link()
    router.open()
    connection, metrics = _connection(hub)
    connection.open(now=0.0)
    connection.replace(now=10.0)
    assert connection.up
    assert metrics.snapshot()["reconnects"] == {"_": 1}
    assert connection.send([b"still", b"sending"], now=10.0) is not None  # no pause without a socket
    assert router.receive() is not None
    # The backoff's grace (2 s at most, 1 s at least, first try): longer than 3 heartbeats, bounded.
    assert not connection.dead(13.5, queued_s=0.0)
    assert connection.dead(15.01, queued_s=0.0)
    connection.heard(now=20.0)  # an answer resets the grace
    assert connection.dead(23.01, queued_s=0.0)


def test_a_send_refused_by_the_link_is_lost_not_raised() -> None:
    hub = MemoryHub()  # no gateway: a dealer with no peer refuses (ZMQ_IMMEDIATE)
    connection, _ = _connection(hub)
    connection.open(now=0.0)
    assert connection.send([b"x"], now=1.0) is None
    assert not connection.idle(1.5)  # a refused send still counts as trying
    assert connection.idle(2.0)


def test_a_heartbeats_answer_names_when_it_was_sent() -> None:
    hub = MemoryHub()
    router = hub.router_link()
    router.open()
    connection, _ = _connection(hub)
    connection.open(now=0.0)
    connection.probe(now=5.0, resolved_below=42, quiet=True)
    connection.probe(now=6.0, resolved_below=42)
    beats = []
    for _ in range(2):
        received = router.receive()
        assert received is not None
        beats.append(decode(received.frames))
    beat, busy = beats
    assert isinstance(beat, Heartbeat) and beat.resolved_below == 42 and isinstance(busy, Heartbeat)
    assert connection.probe_answered(beat.nonce) == (5.0, True)
    assert connection.probe_answered(busy.nonce) == (6.0, False)  # queued behind: no round trip
    assert connection.probe_answered(beat.nonce).sent_at == -math.inf  # used once
    assert connection.probe_answered(beat.nonce + 1000).sent_at == -math.inf  # not ours


def test_handshake_failures_are_counted_every_time_and_logged_now_and_then(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = MemoryHub()
    connection, metrics = _connection(hub)
    failed = LinkEvent(Event.REFUSED, "key not enrolled")
    with caplog.at_level(logging.ERROR, logger="elasticfed.edge"):
        for t in (0.0, 1.0, 2.0, 11.0):
            assert connection.on_event(failed, now=t) is False
    assert metrics.snapshot()["handshake_failures"] == {"kind=refused": 4}
    logged = [r for r in caplog.records if "refused this device's CURVE key" in r.getMessage()]
    assert len(logged) == 2  # at 0 s and 11 s
    assert connection.on_event(LinkEvent(Event.UP), now=12.0) is True


def test_a_failed_handshake_without_keys_does_not_blame_keys(caplog: pytest.LogCaptureFixture) -> None:
    hub = MemoryHub()
    connection, _ = _connection(hub)
    with caplog.at_level(logging.WARNING, logger="elasticfed.edge"):
        connection.on_event(LinkEvent(Event.FAILED, "plain"), now=0.0)
        connection.on_event(LinkEvent(Event.FAILED, "curve"), now=20.0)
    plain, curve = (r.getMessage() for r in caplog.records)
    assert "CURVE" not in plain and "key" not in plain and "went away" in plain
    assert "--security-gateway-public-key" in curve
