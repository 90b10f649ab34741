"""A Prometheus /metrics endpoint for our own `Metrics` registries (common/metrics.py).

Why not serve `render_prometheus()` as a string: prometheus_client already does
content negotiation (text 0.0.4 or OpenMetrics for a Prometheus that asks for
it), gzip, and a threaded WSGI server; a custom collector lets it do all that
from our registries without a second copy of every metric.

Why not `prometheus_client.start_http_server`: it registers into the global
registry by default (two servers in one process, e.g. a test fleet, would
share it, and process/platform collectors come along), and in 0.17, our oldest
supported version, it returns nothing: no port for a bind on port 0, no way to
shut it down.
So the server here is `make_wsgi_app(own registry)` behind a wsgiref server
with ThreadingMixIn, an API that is the same in every version we support.

Names are exactly those of `render_prometheus()` (`<prefix>_<family>`), so a
dashboard does not care which of the two produced a scrape.  Two deliberate
differences, both in the numbers' spelling, never in their value:
`render_prometheus()` writes values with `%g` (six significant digits), this
endpoint writes them exactly; `le` labels are spelled as `render_prometheus()`
spells them wherever `%g` is exact.  A counter family whose name does not end in
`_total` is exposed as untyped under its own name (prometheus_client would
otherwise append `_total` and the name would change); every counter in the
code base ends in `_total`.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import generate_latest, make_wsgi_app
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.utils import floatToGoString

from elasticfed.common.metrics import Counter, Histogram, Metrics

log = logging.getLogger("elasticfed.metrics")

ExtraGauge = tuple[str, str, Callable[[], float | None]]
"""(name without prefix, help, callable): a gauge computed at scrape time; None means don't emit it."""

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
_BIND_HELP = "expected HOST:PORT, e.g. 127.0.0.1:9100, 0.0.0.0:0 (any free port) or [::]:9100"
_POLL_S = 0.1  # how quickly close() stops the serving loop; 10 wake-ups a second cost nothing


def _le(bound: float) -> str:
    """The `le` label of a bucket: render_prometheus()'s spelling where it is exact, else Go's."""
    if bound == math.inf:
        return "+Inf"
    short = f"{bound:g}"
    return short if float(short) == bound else floatToGoString(bound)


class RegistryCollector:
    """A prometheus_client collector over one or more of our registries, plus scrape-time gauges.

    Each registry is copied under its own lock, so one scrape shows one
    consistent state per registry (a histogram's count always equals its +Inf
    bucket, etc.).  Scrapes run in the server's request threads, in parallel.
    """

    def __init__(
        self, registries: Iterable[Metrics] = (), extra: Iterable[ExtraGauge] = (), prefix: str = "elasticfed"
    ) -> None:
        self.registries = list(registries)
        self.extra: list[tuple[str, str, Callable[[], float | None]]] = []
        for name, help, fn in extra:
            full = f"{prefix}_{name}" if prefix else name
            if not _NAME.fullmatch(full):
                raise ValueError(f"extra gauge name {full!r} is not a valid Prometheus metric name")
            if not callable(fn):
                raise ValueError(f"extra gauge {full!r}: {fn!r} is not callable")
            self.extra.append((full, help, fn))
        self._failing: set[str] = set()
        self._failing_lock = threading.Lock()
        names = [n for reg in self.registries for n in _family_names(reg)] + [e[0] for e in self.extra]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"metric names exposed twice by one endpoint: {dup}")

    def collect(self) -> Iterator[Metric]:
        seen: set[str] = set()
        for reg in self.registries:
            for fam in _families(reg):
                if fam[0] in seen:  # a family declared after construction with a clashing name
                    raise ValueError(f"metric {fam[0]} exposed twice by one endpoint")
                seen.add(fam[0])
                yield _to_metric(*fam)
        for full, help, fn in self.extra:
            value = self._call(full, fn)
            if value is not None:
                if full in seen:
                    raise ValueError(f"metric {full} exposed twice by one endpoint")
                seen.add(full)
                yield GaugeMetricFamily(full, help, value=value)

    def _call(self, name: str, fn: Callable[[], float | None]) -> float | None:
        """The gauge's value; a callable that raises costs its own gauge, never the scrape."""
        try:
            value = fn()
            value = None if value is None else float(value)
        except Exception:
            with self._failing_lock:
                first = name not in self._failing
                self._failing.add(name)
            if first:  # once per run of failures, not once per scrape
                log.warning("metrics: gauge %s failed; not exposed until it works again", name, exc_info=True)
            return None
        with self._failing_lock:
            self._failing.discard(name)
        return value


_Family = tuple[str, str, str, tuple[str, ...], tuple[float, ...], list[tuple[tuple[str, ...], object]]]


def _family_names(reg: Metrics) -> list[str]:
    with reg._lock:
        return [f"{reg.prefix}_{name}" for name in reg._families]


def _families(reg: Metrics) -> list[_Family]:
    """(full name, help, kind, label names, buckets, sorted rows), all copied under the registry lock."""
    out: list[_Family] = []
    with reg._lock:
        for fam in reg._families.values():
            if isinstance(fam, Histogram):
                rows: list[tuple[tuple[str, ...], object]] = [(k, list(v)) for k, v in fam.values.items()]
                buckets = fam.buckets
            else:
                rows = list(fam.values.items())  # type: ignore[attr-defined]
                buckets = ()
            rows.sort(key=lambda row: row[0])
            out.append((f"{reg.prefix}_{fam.name}", fam.help, fam.kind, fam.label_names, buckets, rows))
    return out


def _to_metric(
    full: str,
    help: str,
    kind: str,
    label_names: tuple[str, ...],
    buckets: tuple[float, ...],
    rows: list[tuple[tuple[str, ...], object]],
) -> Metric:
    labels = list(label_names)
    if kind == Histogram.kind:
        hist = HistogramMetricFamily(full, help, labels=labels)
        for key, row in rows:
            values: list[float] = row  # type: ignore[assignment]
            cumulative, out = 0.0, []
            for bound, n in zip((*buckets, math.inf), values):
                cumulative += n
                out.append((_le(bound), cumulative))
            hist.add_metric(list(key), out, values[-2])
            if float(out[0][0]) < 0:  # prometheus_client leaves out _count and _sum then; we don't
                plain = dict(zip(label_names, key))
                hist.add_sample(full + "_count", plain, cumulative)
                hist.add_sample(full + "_sum", plain, values[-2])
        return hist
    if kind == Counter.kind and full.endswith("_total"):
        metric: Metric = CounterMetricFamily(full, help, labels=labels)
    elif kind == Counter.kind:
        metric = UnknownMetricFamily(full, help, labels=labels)
    else:
        metric = GaugeMetricFamily(full, help, labels=labels)
    for key, value in rows:
        metric.add_metric(list(key), float(value))  # type: ignore[attr-defined,arg-type]
    return metric


def parse_bind(bind: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port).

    IPv6 hosts go in brackets ('[::]:9100'); without them the last colon starts
    the port (':::9100' is '::' port 9100, and '::1' is '::' port 1).
    """

    def bad(why: str = "") -> ValueError:
        return ValueError(f"metrics bind {bind!r}: {_BIND_HELP}" + (f" ({why})" if why else ""))

    if not isinstance(bind, str) or not bind:
        raise bad()
    if bind.startswith("["):
        m = re.fullmatch(r"\[([^\]]*)\]:([^:]*)", bind)
        if m is None:
            raise bad()
        host, port_text = m.groups()
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(f"{host!r} in brackets is not an IPv6 address") from None
    else:
        host, sep, port_text = bind.rpartition(":")
        if not sep or not host:
            raise bad()
        if ":" in host:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise bad(f"{host!r} is not an IPv6 address; write IPv6 hosts in brackets") from None
        elif not _HOSTNAME.fullmatch(host):
            raise bad(f"{host!r} is not a host name or address")
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or int(port_text) > 65535:
        raise bad(f"port {port_text!r} is not a number from 0 to 65535")
    return host, int(port_text)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """A scrape every few seconds is not news."""


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per request, so a stuck client cannot block Prometheus' scrape."""

    daemon_threads = True
    allow_reuse_address = True  # close() then bind again on the same port works at once

    def __init__(self, address: tuple, family: int) -> None:  # type: ignore[type-arg]
        self.address_family = family
        super().__init__(address, _QuietHandler)

    def server_bind(self) -> None:
        # Not HTTPServer.server_bind: its socket.getfqdn() can wait seconds on a reverse DNS lookup.
        if (
            self.address_family == socket.AF_INET6
            and ipaddress.IPv6Address(self.server_address[0].split("%")[0]).is_unspecified
        ):
            try:  # [::] accepts IPv4 too, whatever the host's bindv6only default says
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except (OSError, AttributeError):
                pass
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]
        self.setup_environ()


class MetricsServer:
    """Our registries (and scrape-time gauges) in a prometheus_client registry of its own, served over HTTP.

    `registry` is a fresh CollectorRegistry, never the global one: two servers
    in one process do not see each other's metrics, and process/platform/GC
    collectors are there only with `process_metrics=True`.  `render()` gives
    the text a scrape would get, without HTTP.
    """

    def __init__(
        self,
        registries: Iterable[Metrics] = (),
        extra: Iterable[ExtraGauge] = (),
        *,
        prefix: str = "elasticfed",
        collectors: Sequence[object] = (),
        process_metrics: bool = False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = RegistryCollector(registries, extra, prefix)
        self.registry.register(self.collector)  # type: ignore[arg-type]
        for c in collectors:
            self.registry.register(c)  # type: ignore[arg-type]
        if process_metrics:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        self.bind: str | None = None
        self.host: str | None = None
        self.port: int | None = None
        self._httpd: _ThreadingServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def render(self) -> str:
        """The Prometheus text format (0.0.4) of everything this server exposes."""
        return generate_latest(self.registry).decode("utf-8")

    def start(self, bind: str) -> MetricsServer:
        """Listen on 'HOST:PORT' (port 0: any free one; see `port`) and serve in a daemon thread."""
        host, port = parse_bind(bind)
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
        except socket.gaierror as e:
            raise ValueError(f"metrics bind {bind!r}: cannot resolve {host!r}: {e}") from None
        with self._lock:
            if self._httpd is not None or self._thread is not None:
                raise RuntimeError(f"metrics server already started on {self.bind!r}")
            try:
                httpd = _ThreadingServer(sockaddr, family)
            except OSError as e:
                raise OSError(e.errno, f"metrics bind {bind!r}: {e.strerror}") from e
            httpd.set_app(self._app())
            self._httpd = httpd
            self.bind = bind
            self.host = httpd.server_address[0]
            self.port = httpd.server_address[1]
            self._thread = threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": _POLL_S},
                name=f"metrics-http-{self.port}",
                daemon=True,
            )
            self._thread.start()
        return self

    @property
    def url(self) -> str:
        """Where a client on this host scrapes it (a wildcard bind is reached over loopback)."""
        if self.host is None or self.port is None:
            raise RuntimeError("metrics server not started")
        host = self.host.split("%")[0]
        if ":" in host:
            addr = ipaddress.IPv6Address(host)
            host = "[::1]" if addr.is_unspecified else f"[{host}]"
        elif host == "0.0.0.0":
            host = "127.0.0.1"
        return f"http://{host}:{self.port}/metrics"

    def _app(self) -> Callable:  # type: ignore[type-arg]
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict, start_response: Callable) -> list[bytes]:  # type: ignore[type-arg]
            if environ.get("PATH_INFO") in ("/", "/metrics"):
                return metrics_app(environ, start_response)
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: metrics are at /metrics\n"]

        return app

    def close(self) -> None:
        """Stop serving, release the port and join the serving thread; safe to call twice."""
        with self._lock:
            httpd, thread = self._httpd, self._thread
            self._httpd = self._thread = None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(
    bind: str,
    *registries: Metrics,
    extra: Iterable[ExtraGauge] = (),
    prefix: str = "elasticfed",
    collectors: Sequence[object] = (),
    process_metrics: bool = False,
) -> MetricsServer:
    """Serve `registries` (and `extra` gauges, named `<prefix>_<name>`) on 'HOST:PORT'; close() to stop."""
    server = MetricsServer(
        registries, extra, prefix=prefix, collectors=collectors, process_metrics=process_metrics
    )
    return server.start(bind)
