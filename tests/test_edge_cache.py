"""The edge cache: counts add up, one unanswered send per unit, memory bounded per unit (`bound_bytes`)."""

from __future__ import annotations

import pytest
import torch

from elasticfed.edge.cache import MAX_HELD, GradientCache

UNITS = [[("b", (4,), torch.float32), ("w", (4, 3), torch.float32)], [("v", (5,), torch.float32)]]
MODEL_BYTES = (4 + 12 + 5) * 4


def test_pending_sums_and_counts_and_views_match_the_layers() -> None:
    cache = GradientCache(UNITS)
    cache.add(0, [torch.ones(4), torch.full((4, 3), 2.0)], base_version=3)
    cache.add(0, [None, torch.full((4, 3), 1.0)], base_version=4)  # b unused this step: zero
    unit = cache.units[0]
    b, w = unit.views(unit.pending)
    assert torch.equal(b, torch.ones(4)) and torch.equal(w, torch.full((4, 3), 3.0))
    assert unit.pending_count == 2 and unit.pending_base == 3  # the oldest base counts
    flight = cache.take(0, seq=1, now=0.0, timeout_s=0.5)
    assert flight is not None and flight.count == 2 and flight.base_version == 3 and flight.deadline == 0.5
    assert unit.pending_count == 0
    # The recycled buffer is not zeroed; the next step's gradient overwrites it (None: zeros).
    unit.pending.fill_(7.0)
    cache.add(0, [None, torch.full((4, 3), 5.0)], base_version=5)
    b, w = unit.views(unit.pending)
    assert torch.equal(b, torch.zeros(4)) and torch.equal(w, torch.full((4, 3), 5.0))
    assert unit.pending_base == 5


def test_one_unanswered_send_per_unit_and_bounded_memory_through_an_outage() -> None:
    cache = GradientCache(UNITS)
    cache.add(1, [torch.ones(5)], 0)
    flight = cache.take(1, seq=1, now=0.0, timeout_s=0.1)
    assert flight is not None
    for step in range(1000):  # the link is down: nothing is ever answered
        cache.add(0, [torch.ones(4), torch.ones(4, 3)], step)
        cache.add(1, [torch.ones(5)], step)
        assert cache.take(1, seq=2 + step, now=1.0, timeout_s=0.1) is None  # waits for the flight
        # Pending and flight: no ack, so nothing is held until durable.
        assert cache.host_bytes() <= 2 * MODEL_BYTES
    assert cache.bound_bytes() == (2 + MAX_HELD) * MODEL_BYTES
    assert cache.undelivered() == 1 + 1000 + 1000
    assert cache.units[1].flight is flight and torch.equal(flight.buffer, torch.ones(5))  # unchanged bytes
    assert cache.resolve(1) is flight
    again = cache.take(1, seq=5000, now=2.0, timeout_s=0.1)
    assert again is not None and again.count == 1000 and torch.equal(again.buffer, torch.full((5,), 1000.0))


def test_a_buffer_still_held_by_the_transport_is_not_reused() -> None:
    class Pending:
        done = False

    cache = GradientCache(UNITS)
    cache.add(1, [torch.ones(5)], 0)
    flight = cache.take(1, seq=1, now=0.0, timeout_s=0.1)
    assert flight is not None
    flight.release = Pending()
    cache.resolve(1)
    assert cache.units[1].spare is None  # dropped, not zeroed under the sender's feet
    assert torch.equal(flight.buffer, torch.ones(5))
    cache.add(1, [torch.ones(5)], 0)
    second = cache.take(1, seq=2, now=0.0, timeout_s=0.1)
    assert second is not None and second.buffer.data_ptr() != flight.buffer.data_ptr()


def test_units_must_keep_one_dtype() -> None:
    try:
        GradientCache([[("a", (2,), torch.float32), ("b", (2,), torch.float16)]])
    except ValueError as exc:
        assert "mixes dtypes" in str(exc)
    else:
        raise AssertionError("a unit of two dtypes was accepted")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_gradients_are_staged_asynchronously_and_sum_like_cpu_ones() -> None:
    cache = GradientCache(UNITS, pin_memory=True)
    grads = [torch.randn(4, device="cuda"), torch.randn(4, 3, device="cuda")]
    cache.add(0, grads, 0)
    assert cache.units[0].staged  # not added yet: backward did not wait for the copy
    cache.add(0, grads, 0)
    flight = cache.take(0, seq=1, now=0.0, timeout_s=1.0)
    assert flight is not None and flight.count == 2 and flight.buffer.is_pinned()
    b, w = cache.units[0].views(flight.buffer)
    torch.testing.assert_close(b, 2 * grads[0].cpu())
    torch.testing.assert_close(w, 2 * grads[1].cpu())


def test_a_snapshot_restored_into_a_fresh_cache_is_the_same_state_with_its_flights_weak() -> None:
    from elasticfed.edge.cache import FlightState
    from elasticfed.edge.compression import UplinkCompression

    def build() -> GradientCache:
        return GradientCache(UNITS, compression=UplinkCompression.parse("topk:0.5"), audit=True)

    cache = build()
    cache.rate_unit(0.1)
    grads = [torch.arange(4.0), torch.linspace(-1, 1, 12).reshape(4, 3)]
    cache.add(0, grads, base_version=2)
    flight = cache.take(0, seq=7, now=0.0, timeout_s=0.5)  # compressed: payloads, a residual
    assert flight is not None and flight.payloads is not None
    cache.add(0, grads, base_version=3)  # pending behind the flight
    cache.add(1, [torch.ones(5)], base_version=2)
    held = cache.take(1, seq=8, now=0.0, timeout_s=0.5)
    assert held is not None
    cache.resolve(1, hold=("gw-a", 4))
    before = cache.snapshot()
    assert cache.units[0].saved_pending  # a flight taken from this pending sum waits for a save

    fresh = build()
    flights = fresh.restore(before, lr=cache.lr, now=5.0)
    assert flights == {7: 0} and fresh.lr == 0.1
    after = fresh.snapshot()
    for a, b in zip(before, after):
        assert (a.pending_count, a.pending_base, a.produced, a.durable, a.dropped) == (
            b.pending_count,
            b.pending_base,
            b.produced,
            b.durable,
            b.dropped,
        )
        for x, y in [(a.pending, b.pending), (a.residual, b.residual)]:
            assert (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        assert [(h.instance, h.epoch, h.count) for h in a.held] == [
            (h.instance, h.epoch, h.count) for h in b.held
        ]
        assert a.mass is not None and b.mass is not None and all(map(torch.equal, a.mass, b.mass))
    reloaded = fresh.units[0].flight
    assert reloaded is not None and reloaded.state is FlightState.WEAK and reloaded.missed
    assert reloaded.seq == 7 and reloaded.payloads == flight.payloads  # a re-send is the same bytes
    assert reloaded.buffer is not flight.buffer and torch.equal(reloaded.buffer, flight.buffer)
    assert fresh.undelivered() == cache.undelivered() and fresh.held_steps() == cache.held_steps() == 1
    with pytest.raises(ValueError, match="a snapshot of 1 units for a cache of 2"):
        build().restore(before[:1], lr=None, now=0.0)
