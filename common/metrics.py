"""Counters, gauges and histograms with labels, for the fleet view of edges and the gateway.

Both sides record per edge and per layer (strong/weak syncs, retransmissions,
staleness, bytes, sync latency).  `snapshot()` gives a JSON-able dict for
summaries and tests; `render_prometheus()` gives the text exposition format, so
an HTTP endpoint only has to serve that string.  Thread-safe: the edge records
from its training thread and its I/O thread.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

Labels = tuple[str, ...]

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


class _Family:
    kind = ""

    def __init__(self, lock: threading.Lock, name: str, help: str, labels: Sequence[str]) -> None:
        self._lock = lock
        self.name = name
        self.help = help
        self.label_names = tuple(labels)

    def _key(self, labels: Sequence[str]) -> Labels:
        if len(labels) != len(self.label_names):
            raise ValueError(f"metric {self.name} takes labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(v) for v in labels)


class Counter(_Family):
    kind = "counter"

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        # Without labels there is one series, and it exists from the start (Prometheus sees a 0, not
        # a missing series whose rate it cannot take).
        self.values: dict[Labels, float] = {} if self.label_names else {(): 0}

    def inc(self, *labels: str, by: float = 1) -> None:
        key = self._key(labels)
        with self._lock:
            self.values[key] = self.values.get(key, 0) + by

    def get(self, *labels: str) -> float:
        return self.values.get(self._key(labels), 0)

    def total(self) -> float:
        with self._lock:
            return sum(self.values.values())


class Gauge(Counter):
    kind = "gauge"

    def set(self, *labels: str, value: float) -> None:
        key = self._key(labels)
        with self._lock:
            self.values[key] = value


class Histogram(_Family):
    kind = "histogram"

    def __init__(
        self, lock: threading.Lock, name: str, help: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> None:
        super().__init__(lock, name, help, labels)
        self.buckets = tuple(buckets)
        self.values: dict[Labels, list[float]] = {}  # per label: bucket counts..., +Inf count, sum, max

    def observe(self, *labels: str, value: float) -> None:
        key = self._key(labels)
        with self._lock:
            row = self.values.get(key)
            if row is None:
                row = self.values[key] = [0.0] * (len(self.buckets) + 3)
            row[bisect.bisect_left(self.buckets, value)] += 1
            row[-2] += value
            row[-1] = max(row[-1], value)

    def summary(self, *labels: str) -> dict[str, float]:
        row = self.values.get(self._key(labels))
        if row is None:
            return {"count": 0, "mean": 0.0, "max": 0.0}
        count = sum(row[: len(self.buckets) + 1])
        return {"count": count, "mean": row[-2] / count if count else 0.0, "max": row[-1]}

    def merged(self) -> dict[str, float]:
        """Count, mean and max over every label set."""
        with self._lock:
            rows = list(self.values.values())
        count = sum(sum(r[: len(self.buckets) + 1]) for r in rows)
        total = sum(r[-2] for r in rows)
        return {
            "count": count,
            "mean": total / count if count else 0.0,
            "max": max((r[-1] for r in rows), default=0.0),
        }


class Metrics:
    """A registry: families are declared once, by name, with their label names."""

    def __init__(self, prefix: str = "elasticfed") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}

    def _add(self, family: _Family) -> _Family:
        if family.name in self._families:
            raise ValueError(f"metric {family.name} declared twice")
        self._families[family.name] = family
        return family

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(self._lock, name, help, labels))  # type: ignore[return-value]

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(self._lock, name, help, labels))  # type: ignore[return-value]

    def histogram(self, name: str, help: str, labels: Sequence[str], buckets: Sequence[float]) -> Histogram:
        return self._add(Histogram(self._lock, name, help, labels, buckets))  # type: ignore[return-value]

    def snapshot(self) -> dict[str, dict[str, object]]:
        """{family: {"label=value,...": value}} (histograms as count/mean/max)."""
        out: dict[str, dict[str, object]] = {}
        with self._lock:
            families = list(self._families.values())
        for fam in families:
            rows: dict[str, object] = {}
            for key in list(fam.values):  # type: ignore[attr-defined]
                name = ",".join(f"{k}={v}" for k, v in zip(fam.label_names, key)) or "_"
                if isinstance(fam, Histogram):
                    rows[name] = fam.summary(*key)
                else:
                    rows[name] = fam.values[key]  # type: ignore[attr-defined]
            out[fam.name] = rows
        return out

    def render_prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        with self._lock:
            families = list(self._families.values())
            for fam in families:
                full = f"{self.prefix}_{fam.name}"
                lines.append(f"# HELP {full} {fam.help}")
                lines.append(f"# TYPE {full} {fam.kind}")
                for key, value in sorted(fam.values.items()):  # type: ignore[attr-defined]
                    labels = [f'{k}="{_escape(v)}"' for k, v in zip(fam.label_names, key)]
                    if isinstance(fam, Histogram):
                        cumulative = 0.0
                        for bound, n in zip((*fam.buckets, math.inf), value):
                            cumulative += n
                            le = "+Inf" if bound == math.inf else f"{bound:g}"
                            bucket_labels = _braces([*labels, 'le="' + le + '"'])
                            lines.append(f"{full}_bucket{bucket_labels} {_number(cumulative)}")
                        lines.append(f"{full}_sum{_braces(labels)} {_number(value[-2])}")
                        lines.append(f"{full}_count{_braces(labels)} {_number(cumulative)}")
                    else:
                        lines.append(f"{full}{_braces(labels)} {_number(value)}")
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """Exact: `%g` would round a byte counter to six digits, and its rate would read 0 between steps."""
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _braces(labels: list[str]) -> str:
    return "{" + ",".join(labels) + "}" if labels else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
