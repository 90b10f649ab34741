"""A flight's states (edge/flights.py), moved by what happens to it, without a session or a link."""

from __future__ import annotations

import torch

from elasticfed.edge.cache import Flight, FlightState, GradientCache
from elasticfed.edge.flights import Flights

UNITS = [[("a", (4,), torch.float32)], [("b", (2,), torch.float32)]]


def _taken(cache: GradientCache, flights: Flights, u: int, seq: int, now: float = 0.0) -> Flight:
    cache.add(u, [torch.ones(cache.units[u].shapes[0])], base_version=0)
    flight = cache.take(u, seq, now, timeout_s=1.0)
    assert flight is not None
    flights.add(u, flight)
    return flight


def test_a_flight_goes_out_misses_goes_again_and_leaves_with_its_verdict() -> None:
    cache = GradientCache(UNITS)
    flights = Flights(cache)
    flight = _taken(cache, flights, 0, seq=7)
    assert flight.state is FlightState.QUEUED and flights.waiting()
    assert flights.due(0.0, answered_since=-1.0, on_timer=False) == [(0, flight)]  # a first send is due

    flights.sent(flight, now=1.0, deadline=2.0, resend_s=0.5)
    assert flight.state is FlightState.OUTSTANDING and flights.outstanding == 1 and not flights.waiting()
    assert flights.deadlines() == [2.0] and flights.overdue(1.5) == []
    assert flights.overdue(2.0) == [(0, flight)]

    assert flights.missed(flight, resend_s=0.5) is True  # the first miss is a weak sync
    assert flight.state is FlightState.WEAK and flights.outstanding == 0 and flight.resend_at == 1.5
    assert flights.due(2.0, answered_since=0.5, on_timer=False) == []  # nothing answered since it went
    assert flights.due(2.0, answered_since=1.5, on_timer=False) == [(0, flight)]  # a later request was
    assert flights.due(2.0, answered_since=0.5, on_timer=True) == [(0, flight)]  # or its timer is due

    flights.sent(flight, now=2.0, deadline=3.0, resend_s=0.5)  # again: same seq, one more attempt
    assert flight.attempts == 1 and flight.first_sent == 1.0 and flight.resend_at == 2.5
    assert flights.missed(flight, resend_s=0.5) is False  # missed before: not counted twice

    assert flights.answered(7) == 0
    assert len(flights) == 0 and flights.outstanding == 0 and 7 not in flights


def test_sent_back_unjudged_and_a_replaced_connection_make_weak_flights() -> None:
    cache = GradientCache(UNITS)
    flights = Flights(cache)
    a, b = _taken(cache, flights, 0, seq=1), _taken(cache, flights, 1, seq=2)
    flights.sent(a, 0.0, 5.0, 0.5)
    flights.sent(b, 0.0, 5.0, 0.5)
    a.attempts = 3
    flights.sent_back(a, forget_attempts=True)  # a new gateway: the copies it refused do not count
    assert a.state is FlightState.WEAK and a.attempts == 0 and not a.missed
    assert flights.outstanding == 1

    missed = flights.connection_replaced(resend_s=0.5)
    assert missed == [(1, b)]  # only the outstanding one missed; a was weak already
    assert b.state is FlightState.WEAK and flights.outstanding == 0
    assert flights.oldest(default=99) == 1
    assert [u for u, _ in flights] == [0, 1]  # oldest first


def test_a_sum_a_save_recorded_as_pending_waits_for_the_next_save() -> None:
    cache = GradientCache(UNITS)
    flights = Flights(cache)
    cache.add(0, [torch.ones(4)], base_version=0)
    (saved, _) = cache.snapshot()  # a save records the pending sum (edge/persistence.py)
    assert saved.pending_count == 1 and saved.pending is not None and saved.flight is None
    flight = _taken(cache, flights, 0, seq=1)
    assert flight.state is FlightState.SAVE_FIRST
    assert flights.due(0.0, answered_since=10.0, on_timer=True) == []  # never before the save
    flights.saved()
    assert flight.state is FlightState.QUEUED
    assert flights.due(0.0, answered_since=-1.0, on_timer=False) == [(0, flight)]
