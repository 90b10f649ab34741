"""The edge's thermal guard (edge/thermal.py) over a temporary directory laid out like sysfs."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import pytest

from elasticfed.edge.thermal import NoThermalZones, ThermalGuard


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def write(path: Path, text: str) -> None:
    """Replace the file at once, as a sysfs read never sees half a value."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def zone(root: Path, n: int, kind: str | None, millidegrees: int | str) -> Path:
    d = root / f"thermal_zone{n}"
    d.mkdir(exist_ok=True)
    if kind is not None:
        write(d / "type", kind + "\n")
    write(d / "temp", f"{millidegrees}\n")
    return d / "temp"


def glob_of(root: Path) -> str:
    return str(root / "thermal_zone*" / "temp")


@pytest.fixture
def orin(tmp_path: Path) -> dict[str, Path]:
    """Part of a Jetson Orin's zones, all comfortable."""
    kinds = ["cpu-thermal", "gpu-thermal", "cv0-thermal", "soc0-thermal", "soc1-thermal", "tj-thermal"]
    return {kind: zone(tmp_path, n, kind, 45_000 + 1000 * n) for n, kind in enumerate(kinds)}


def test_hysteresis_pauses_at_the_threshold_and_resumes_only_below_the_lower_one(
    tmp_path: Path, orin: dict[str, Path]
) -> None:
    clock = FakeClock()
    guard = ThermalGuard(
        pause_above_c=80, resume_below_c=70, zones=glob_of(tmp_path), poll_s=1.0, clock=clock
    )
    assert not guard.hot() and guard.pauses_total == 0
    assert guard.hottest() == ("tj-thermal", 50.0)

    def reading(kind: str, millidegrees: int) -> bool:
        write(orin[kind], f"{millidegrees}\n")
        clock.advance(1.0)
        return guard.hot()

    assert not reading("gpu-thermal", 79_999)
    assert reading("gpu-thermal", 80_000)  # >= pause_above_c
    assert guard.pauses_total == 1 and guard.hottest() == ("gpu-thermal", 80.0)
    assert reading("gpu-thermal", 75_000)  # between the thresholds: still paused
    assert reading("gpu-thermal", 70_000)  # not yet below resume_below_c
    assert reading("cpu-thermal", 90_000)  # another zone heats up meanwhile: one pause, still
    assert guard.pauses_total == 1
    assert reading("cpu-thermal", 60_000)  # gpu still at 70
    assert not reading("gpu-thermal", 69_999)  # every zone below resume_below_c
    assert guard.hottest() == ("gpu-thermal", 69.999)
    assert not reading("gpu-thermal", 79_000)  # climbing back, not yet at the pause threshold
    assert reading("soc1-thermal", 85_000)
    assert guard.pauses_total == 2


def test_zones_are_read_at_most_once_per_poll_s(tmp_path: Path, orin: dict[str, Path]) -> None:
    clock = FakeClock()
    guard = ThermalGuard(80, 70, zones=glob_of(tmp_path), poll_s=2.0, clock=clock)
    reads = guard.reads_total
    assert reads == 1  # the check at construction
    write(orin["gpu-thermal"], "95000\n")
    for _ in range(100):
        assert not guard.hot()  # the file says hot, but the last read is younger than poll_s
        assert guard.hottest() == ("tj-thermal", 50.0)
    clock.advance(1.999)
    assert not guard.hot() and guard.reads_total == reads
    clock.advance(0.001)
    assert guard.hot() and guard.reads_total == reads + 1
    for _ in range(10):
        guard.hot()
    assert guard.reads_total == reads + 1
    write(orin["gpu-thermal"], "40000\n")
    clock.advance(2.0)
    assert not guard.hot() and guard.reads_total == reads + 2


def test_unreadable_and_garbage_zones_are_skipped(tmp_path: Path) -> None:
    zone(tmp_path, 0, "cpu-thermal", "garbage")
    zone(tmp_path, 1, "gpu-thermal", "")
    zone(tmp_path, 2, "cv0-thermal", "-256000")  # a powered-down sensor's sentinel, not a temperature
    zone(tmp_path, 3, "soc0-thermal", "91000.5")  # not an integer
    (tmp_path / "thermal_zone4").mkdir()
    (tmp_path / "thermal_zone4" / "temp").mkdir()  # a read fails with EISDIR
    (tmp_path / "thermal_zone5").mkdir()
    os.symlink(tmp_path / "nowhere", tmp_path / "thermal_zone5" / "temp")  # dangling
    zone(tmp_path, 6, "PMIC-Die", "999999999")  # implausible
    good = zone(tmp_path, 7, "tj-thermal", 52_500)
    untyped = zone(tmp_path, 10, None, 48_000)  # no type file: named after its directory
    clock = FakeClock()
    guard = ThermalGuard(80, 70, zones=glob_of(tmp_path), poll_s=1.0, clock=clock)
    assert guard.hottest() == ("tj-thermal", 52.5) and not guard.hot()
    assert [kind for _, kind in guard.zones][-2:] == ["tj-thermal", "thermal_zone10"]  # natural order

    write(untyped, "85000\n")
    clock.advance(1)
    assert guard.hot() and guard.hottest() == ("thermal_zone10", 85.0)

    # Every zone unreadable later: the last decision stands, hottest() says it knows nothing.
    write(good, "oops\n")
    write(untyped, "oops\n")
    clock.advance(1)
    assert guard.hot() and guard.hottest() is None
    write(untyped, "30000\n")
    clock.advance(1)
    assert not guard.hot() and guard.hottest() == ("thermal_zone10", 30.0)


def test_no_readable_zone_is_an_error_naming_the_glob(tmp_path: Path) -> None:
    zone(tmp_path, 0, "cpu-thermal", "garbage")
    zone(tmp_path, 1, "gpu-thermal", "-256000")
    pattern = glob_of(tmp_path)
    with pytest.raises(NoThermalZones, match="2 files match") as err:
        ThermalGuard(80, 70, zones=pattern)
    assert repr(pattern) in str(err.value)
    empty = str(tmp_path / "nothing" / "thermal_zone*" / "temp")
    with pytest.raises(NoThermalZones, match="nothing matches") as err:
        ThermalGuard(80, 70, zones=empty)
    assert repr(empty) in str(err.value)


@pytest.mark.parametrize(
    ("pause", "resume", "poll", "match"),
    [
        (70, 80, 1.0, "must be below"),
        (70, 70, 1.0, "must be below"),
        (math.nan, 70, 1.0, "pause_above_c must be a finite"),
        (80, -math.inf, 1.0, "resume_below_c must be a finite"),
        (80, 70, 0, "poll_s"),
        (80, 70, -1, "poll_s"),
        (80, 70, math.inf, "poll_s"),
    ],
)
def test_bad_settings_are_refused(
    tmp_path: Path, orin: dict[str, Path], pause: float, resume: float, poll: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ThermalGuard(pause, resume, zones=glob_of(tmp_path), poll_s=poll)


def progress_clock(holder: list[ThermalGuard], reads: int, reached: threading.Event):
    """A real clock that sets `reached` once the guard has read the zones `reads` times."""

    def clock() -> float:
        if holder and holder[0].reads_total >= reads:
            reached.set()
        return time.monotonic()

    return clock


def test_wait_until_cool_returns_when_the_zone_cools(tmp_path: Path, orin: dict[str, Path]) -> None:
    write(orin["gpu-thermal"], "88000\n")
    holder: list[ThermalGuard] = []
    waiting = threading.Event()
    guard = ThermalGuard(
        80, 70, zones=glob_of(tmp_path), poll_s=0.01, clock=progress_clock(holder, 3, waiting)
    )
    holder.append(guard)
    assert guard.hot()

    def cool_down() -> None:  # only rewrites the file once the guard is polling it
        if waiting.wait(timeout=30):
            write(orin["gpu-thermal"], "65000\n")

    fan = threading.Thread(target=cool_down)
    fan.start()
    t0 = time.monotonic()
    paused = guard.wait_until_cool(threading.Event(), max_wait_s=30)
    elapsed = time.monotonic() - t0
    fan.join(timeout=30)
    assert not fan.is_alive()
    assert waiting.is_set() and not guard.hot()
    assert guard.hottest() == ("gpu-thermal", 65.0)
    assert 0 < paused <= elapsed < 30
    assert guard.reads_total >= 4 and guard.paused_s_total == paused
    assert guard.wait_until_cool(threading.Event()) == 0.0  # cool: no wait at all


def test_wait_until_cool_returns_early_when_stop_is_set(tmp_path: Path, orin: dict[str, Path]) -> None:
    write(orin["cpu-thermal"], "99000\n")
    holder: list[ThermalGuard] = []
    polling = threading.Event()
    guard = ThermalGuard(
        80, 70, zones=glob_of(tmp_path), poll_s=0.01, clock=progress_clock(holder, 3, polling)
    )
    holder.append(guard)
    stop = threading.Event()
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(guard.wait_until_cool(stop)))
    worker.start()
    assert polling.wait(timeout=30)
    stop.set()
    worker.join(timeout=30)
    assert not worker.is_alive() and len(result) == 1 and result[0] > 0
    assert guard.hot()  # still hot: it returned because of stop
    # Already stopped: returns at once, hot or not.
    t0 = time.monotonic()
    assert guard.wait_until_cool(stop) < 1.0 and time.monotonic() - t0 < 1.0
    assert guard.paused_s_total == pytest.approx(sum(result), abs=1.0)


def test_wait_until_cool_gives_up_after_max_wait_s(tmp_path: Path, orin: dict[str, Path]) -> None:
    write(orin["tj-thermal"], "95000\n")
    guard = ThermalGuard(80, 70, zones=glob_of(tmp_path), poll_s=0.01)
    t0 = time.monotonic()
    paused = guard.wait_until_cool(threading.Event(), max_wait_s=0.05)
    assert 0.05 <= paused <= time.monotonic() - t0 < 10
    assert guard.hot()
