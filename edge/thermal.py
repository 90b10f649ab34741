"""Pause local training while the device is hot (Jetson Orin in a closed box, in the sun).

A Jetson that reaches its thermal limits throttles its clocks itself and, past
the shutdown trip, powers off; training through that is slow at best and loses
the unsaved steps at worst.  Pausing between steps is cheap and lets the
enclosure cool.  The training loop asks `hot()` before each local step (one
sysfs read at most per `poll_s`, so a step costs a dictionary lookup most of the
time) and, when hot, calls `wait_until_cool()`.

Temperatures come from the Linux thermal sysfs ABI
(Documentation/ABI/testing/sysfs-class-thermal): `thermal_zoneN/temp` in
millidegrees Celsius, `thermal_zoneN/type` the zone's name (cpu-thermal,
gpu-thermal, soc0-thermal, tj-thermal, ... on Orin).  The decision uses the
hottest readable zone, with hysteresis so the loop does not flap at the
threshold: hot from `>= pause_above_c`, cool again only `< resume_below_c`.

Temperature only, deliberately: the kernel documents `cooling_deviceN/cur_state`
but not what a state means for a given device (on a Jetson dev kit one cooling
device is the fan, whose state > 0 says nothing about clocks), and we found no
NVIDIA documentation naming a sysfs throttle indicator for Orin.  Put
`pause_above_c` below the throttling trip points instead.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable

log = logging.getLogger("elasticfed.edge")

DEFAULT_ZONES = "/sys/class/thermal/thermal_zone*/temp"

# Readings outside this range are not temperatures but sentinels (e.g. -256 °C
# for a sensor that is powered down); skipped like an unreadable zone.
PLAUSIBLE_C = (-100.0, 200.0)

_INTEGER = re.compile(rb"\s*(-?[0-9]+)\s*")


class NoThermalZones(RuntimeError):
    """No file matching the zones glob holds a temperature: the guard would decide blind."""


def _natural(path: str) -> list[object]:
    """thermal_zone2 before thermal_zone10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _zone_type(temp_path: str) -> str:
    """The sibling `type` file (e.g. 'gpu-thermal'), else the zone's directory name."""
    directory = os.path.dirname(temp_path)
    try:
        with open(os.path.join(directory, "type"), encoding="utf-8", errors="replace") as f:
            name = f.read(256).strip()
    except OSError:
        name = ""
    return name or os.path.basename(directory) or temp_path


def read_celsius(path: str) -> float | None:
    """One zone's temperature in °C, or None if the file can't be read or holds no plausible integer."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = os.read(fd, 64)
        finally:
            os.close(fd)
    except OSError:  # missing, EACCES, or EAGAIN/EIO from a sensor that is powered down
        return None
    m = _INTEGER.fullmatch(raw)
    if m is None:
        return None
    celsius = int(m.group(1)) / 1000.0
    return celsius if PLAUSIBLE_C[0] < celsius < PLAUSIBLE_C[1] else None


class ThermalGuard:
    """Hot/cool decision with hysteresis over all thermal zones, read at most once per `poll_s`.

    Counters for metrics: `pauses_total` (times the decision went from cool to
    hot), `paused_s_total` (seconds spent in `wait_until_cool`, by `clock`),
    `reads_total` (sysfs sweeps).  If every zone becomes unreadable after
    construction, the last decision stands (and `hottest()` is None) rather
    than resuming blind or pausing forever.
    """

    def __init__(
        self,
        pause_above_c: float,
        resume_below_c: float,
        zones: str = DEFAULT_ZONES,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("pause_above_c", pause_above_c), ("resume_below_c", resume_below_c)):
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"thermal guard: {name} must be a finite temperature in °C, got {value!r}")
        if not resume_below_c < pause_above_c:
            raise ValueError(
                f"thermal guard: resume_below_c ({resume_below_c}) must be below pause_above_c "
                f"({pause_above_c}); without a gap the guard would pause and resume at every reading"
            )
        if not isinstance(poll_s, (int, float)) or not (math.isfinite(poll_s) and poll_s > 0):
            raise ValueError(f"thermal guard: poll_s must be a positive number of seconds, got {poll_s!r}")
        self.pause_above_c = float(pause_above_c)
        self.resume_below_c = float(resume_below_c)
        self.zones_glob = zones
        self.poll_s = float(poll_s)
        self.clock = clock
        paths = sorted(glob.glob(zones), key=_natural)
        self._zones = [(path, _zone_type(path)) for path in paths]  # zones don't come and go at runtime
        self._lock = threading.Lock()
        self._hot = False
        self._hottest: tuple[str, float] | None = None
        self._read_at: float | None = None
        self._blind = False
        self.pauses_total = 0
        self._paused_since: float | None = None  # inside wait_until_cool since then
        self.paused_s_total = 0.0
        self.reads_total = 0
        self._refresh(force=True)
        if self._hottest is None:
            found = (
                f"{len(paths)} files match, none readable as millidegrees C" if paths else "nothing matches"
            )
            raise NoThermalZones(f"thermal guard: no readable thermal zone in {zones!r} ({found})")

    @property
    def zones(self) -> list[tuple[str, str]]:
        """(temp file, zone type) of every zone matched at construction."""
        return list(self._zones)

    def hot(self) -> bool:
        """Whether to pause now (re-reads the zones if the last read is `poll_s` old)."""
        self._refresh()
        return self._hot

    def hottest(self) -> tuple[str, float] | None:
        """(zone type, °C) of the hottest readable zone at the latest read; None if none was readable."""
        self._refresh()
        return self._hottest

    def state(self) -> tuple[bool, tuple[str, float] | None, float]:
        """(paused?, hottest zone, seconds paused so far, the current pause included) as last read.

        Never reads the sensors: for metrics scrapes from another thread, which must not
        change the decision the training loop acts on.
        """
        with self._lock:
            ongoing = self.clock() - self._paused_since if self._paused_since is not None else 0.0
            return self._hot, self._hottest, self.paused_s_total + max(0.0, ongoing)

    def wait_until_cool(self, stop: threading.Event, max_wait_s: float | None = None) -> float:
        """Block while hot, re-reading every `poll_s`; return the seconds paused.

        Returns early when `stop` is set or after `max_wait_s` (by `clock`);
        either way the caller checks `hot()` again if it cares why.  Reads here
        are spaced by waiting `poll_s` on `stop`, whatever `clock` says.
        """
        start = self.clock()
        if not self.hot():
            return 0.0
        with self._lock:
            self._paused_since = start
        deadline = None if max_wait_s is None else start + max_wait_s
        while True:
            timeout = self.poll_s
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - self.clock()))
            if stop.wait(timeout):
                break
            self._refresh(force=True)
            if not self._hot or (deadline is not None and self.clock() >= deadline):
                break
        paused = max(0.0, self.clock() - start)
        with self._lock:
            self.paused_s_total += paused
            self._paused_since = None
        return paused

    def _refresh(self, force: bool = False) -> None:
        with self._lock:
            now = self.clock()
            if not force and self._read_at is not None and now - self._read_at < self.poll_s:
                return
            self._read_at = now
            self.reads_total += 1
            hottest: tuple[str, float] | None = None
            for path, name in self._zones:
                celsius = read_celsius(path)
                if celsius is not None and (hottest is None or celsius > hottest[1]):
                    hottest = (name, celsius)
            self._hottest = hottest
            if hottest is None:
                if not self._blind:
                    log.warning("thermal: no zone in %r readable; keeping the last decision", self.zones_glob)
                self._blind = True
                return
            self._blind = False
            name, celsius = hottest
            if not self._hot and celsius >= self.pause_above_c:
                self._hot = True
                self.pauses_total += 1
                log.warning(
                    "thermal: %s at %.1f °C >= %.1f, pausing training", name, celsius, self.pause_above_c
                )
            elif self._hot and celsius < self.resume_below_c:
                self._hot = False
                log.info("thermal: hottest zone %s at %.1f °C, resuming training", name, celsius)
