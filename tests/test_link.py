"""The fault-injecting link: its loss model has the rate and burst length asked for, and is reproducible."""

from __future__ import annotations

import pytest

from elasticfed.common.link import Backoff, Faults, FaultyChannel, RecentMax


def channel(faults: Faults, stream: int = 0) -> FaultyChannel[int]:
    return FaultyChannel(faults, stream, start=0.0, copy=lambda m: m)


def run_lengths(losses: list[bool]) -> list[int]:
    runs, current = [], 0
    for lost in losses:
        if lost:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs


@pytest.mark.parametrize(("loss", "burst"), [(0.3, 1.0), (0.3, 3.0), (0.6, 5.0), (0.95, 25.0)])
def test_loss_rate_and_mean_burst_match_the_request(loss: float, burst: float) -> None:
    ch = channel(Faults(loss=loss, burst=burst, seed=7))
    n = 200_000
    delivered = []
    for i in range(n):
        ch.offer(i, now=0.0)
        delivered.extend(ch.due(0.0))
    got = set(delivered)
    losses = [i not in got for i in range(n)]
    assert abs(sum(losses) / n - loss) < 0.01
    mean_run = sum(run_lengths(losses)) / len(run_lengths(losses))
    expected = burst if burst > 1 else 1 / (1 - loss)  # independent losses: geometric runs
    assert abs(mean_run - expected) / expected < 0.05


def test_same_seed_same_fate_and_directions_differ() -> None:
    faults = Faults(loss=0.3, burst=3, duplicate=0.1, reorder=0.1, seed=42)

    def fates(stream: int) -> list[int]:
        ch = channel(faults, stream)
        out = []
        for i in range(2000):
            ch.offer(i, now=0.0)
            out.extend(ch.due(0.0))
        return out

    assert fates(0) == fates(0)
    assert fates(0) != fates(1)


def test_outage_drops_everything_inside_the_window_only() -> None:
    ch = channel(Faults(outages=((1.0, 2.0),)))
    for t in (0.5, 1.0, 2.9, 3.0):
        ch.offer(int(t * 10), now=t)
    assert ch.due(10.0) == [5, 30]
    assert ch.stats.lost_in_outage == 2


def test_duplicates_reorders_and_delays_are_real() -> None:
    ch = channel(Faults(duplicate=0.2, reorder=0.2, delay_ms=10, jitter_ms=5, seed=1))
    for i in range(1000):
        ch.offer(i, now=i * 0.001)
    assert ch.due(0.0) == []  # nothing arrives before its delay
    out = ch.due(100.0)
    assert sorted(set(out)) == list(range(1000)) or len(set(out)) == 999  # the last one may be held back
    assert len(out) > len(set(out))  # duplicates
    assert any(b < a for a, b in zip(out, out[1:]))  # reordered
    assert ch.stats.duplicated > 100 and ch.stats.reordered > 100


def test_held_back_messages_are_copied() -> None:
    data = bytearray(b"abc")
    ch: FaultyChannel[bytearray] = FaultyChannel(
        Faults(delay_ms=5), 0, start=0.0, copy=lambda m: bytearray(m)
    )
    ch.offer(data, now=0.0)
    data[0] = ord("X")  # the sender reuses its buffer while the message is on the wire
    assert ch.due(1.0) == [bytearray(b"abc")]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("loss=1.5", "loss must be in [0, 1)"),
        ("loss=0.95,burst=3", "needs bursts of at least 19.0"),
        ("burst=0.5", "at least 1"),
        ("outage=10", "START_S+DURATION_S"),
        ("lose=0.3", "unknown key 'lose'"),
        ("loss=abc", "is not a number"),
        ("loss", "is not key=value"),
    ],
)
def test_bad_fault_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        Faults.parse(spec)
    assert message in str(err.value)


def test_fault_spec_round_trip() -> None:
    faults = Faults.parse(
        "loss=0.3,burst=3,delay_ms=5,jitter_ms=1,duplicate=0.1,reorder=0.05,outage=10+5,seed=9"
    )
    assert faults == Faults(0.3, 3.0, 5.0, 1.0, 0.1, 0.05, ((10.0, 5.0),), 9)
    assert "30% loss (bursts of 3)" in faults.describe() and "outage 5 s at 10 s" in faults.describe()
    assert not Faults.parse("").active


def test_backoff_grows_with_full_jitter_up_to_the_cap() -> None:
    backoff = Backoff(first_s=0.1, cap_s=1.0)
    delays = [backoff.next_delay() for _ in range(8)]
    for k, d in enumerate(delays):
        ceiling = min(1.0, 0.1 * 2**k)
        assert ceiling / 2 <= d <= ceiling
    backoff.reset()
    assert backoff.next_delay() <= 0.1


def test_backoff_keeps_its_cap_however_many_tries_failed() -> None:
    """A gateway down for hours (a reconnect each time) or a link losing 95% (a hello each try):
    2.0 ** 1024 overflowed and the edge's I/O thread died."""
    backoff = Backoff(first_s=0.025, cap_s=5.0)
    delays = [backoff.next_delay() for _ in range(5000)]
    assert all(2.5 <= d <= 5.0 for d in delays[-4000:])


def test_recent_max_keeps_the_largest_recent_lower_bound_and_forgets_old_ones() -> None:
    rates = RecentMax(window_s=30.0)
    assert rates.value is None
    rates.add(10.0, now=0.0)
    rates.add(4.0, now=5.0)  # an idle spell: a lower bound that says nothing new
    assert rates.value == 10.0
    rates.add(6.0, now=40.0)  # the link got slower: the old maximum ages out
    assert rates.value == 6.0
    rates.add(2.0, now=100.0)  # all older than the window: the newest stands
    assert rates.value == 2.0
    rates.add(9.0, now=110.0)
    rates.add(7.0, now=125.0)
    rates.add(5.0, now=130.0)
    assert rates.value == 9.0
    rates.add(3.0, now=141.0)  # 9 aged out: the largest of what is left in the window, not the newest
    assert rates.value == 7.0
    with pytest.raises(ValueError, match="window_s"):
        RecentMax(0.0)
