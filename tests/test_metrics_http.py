"""The /metrics endpoint (common/metrics_http.py): real HTTP scrapes, parsed, equal to the registry."""

from __future__ import annotations

import math
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from elasticfed.common.metrics import LATENCY_BUCKETS_S, Metrics
from elasticfed.common.metrics_http import MetricsServer, parse_bind, serve_metrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

NASTY = 'cam "7" \\ back\nslash'  # a label value that needs every escape of the text format


def scrape(url: str, accept: str | None = None) -> str:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        return response.read().decode("utf-8")


def samples(text: str, parse=text_string_to_metric_families) -> Samples:
    out: Samples = {}
    for family in parse(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"sample {key} twice"
            out[key] = s.value
    return out


def types(text: str) -> dict[str, str]:
    """{name as the TYPE line spells it: type}."""
    return {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}


def expected(m: Metrics) -> Samples:
    """What a scrape must show, computed from the registry's own numbers (not via any exporter)."""
    out: Samples = {}
    for name, fam in m._families.items():
        full = f"{m.prefix}_{name}"
        for key, value in fam.values.items():
            labels = list(zip(fam.label_names, key))
            if fam.kind == "histogram":
                cumulative = 0.0
                for bound, n in zip((*fam.buckets, math.inf), value):
                    cumulative += n
                    le = "+Inf" if bound == math.inf else f"{bound:g}"
                    out[(full + "_bucket", frozenset([*labels, ("le", le)]))] = cumulative
                out[(full + "_count", frozenset(labels))] = cumulative
                out[(full + "_sum", frozenset(labels))] = value[-2]
            else:
                out[(full, frozenset(labels))] = float(value)
    return out


class Fleet(Metrics):
    """Counters, gauges and histograms with labels (some needing escapes), already counted into."""

    def __init__(self) -> None:
        super().__init__()
        self.applied = self.counter(
            "gateway_applied_steps_total", "step-gradients added", ["client", "layer"]
        )
        self.rejected = self.counter("gateway_rejected_total", "refused", ["client", "reason"])
        self.rounds = self.counter("gateway_rounds_total", "rounds closed")
        self.clients = self.gauge("gateway_clients", "clients that said hello")
        self.version = self.gauge("gateway_model_version", "model version", ["shard"])
        self.latency = self.histogram("edge_sync_latency_seconds", "latency", ["layer"], LATENCY_BUCKETS_S)
        self.staleness = self.histogram("gateway_staleness", "versions behind", ["client"], (0, 1, 2, 4, 8))
        self.applied.inc("cam-1", "fc.weight", by=3)
        self.applied.inc(NASTY, "fc.bias")
        self.rejected.inc(NASTY, "nonfinite")
        self.rounds.inc()
        self.clients.set(value=2)
        self.version.set("0", value=-1.5)
        for v in (0.0004, 0.004, 0.02, 3.0, 99.0):
            self.latency.observe("fc.weight", value=v)
        self.latency.observe(NASTY, value=0.25)
        for v in (0, 1, 1, 3, 10):
            self.staleness.observe("a", value=v)


@pytest.fixture
def servers():
    started: list[MetricsServer] = []
    yield started
    for s in started:
        s.close()


def test_scrape_equals_registry_and_follows_it(servers) -> None:
    m = Fleet()
    server = serve_metrics("127.0.0.1:0", m)
    servers.append(server)
    assert server.port and server.url == f"http://127.0.0.1:{server.port}/metrics"

    text = scrape(server.url)
    assert samples(text) == expected(m)
    # The names are render_prometheus()'s, `_total` included, HELP/TYPE lines too.
    assert types(text) == types(m.render_prometheus())
    assert "# TYPE elasticfed_gateway_applied_steps_total counter" in text
    assert "# HELP elasticfed_gateway_applied_steps_total step-gradients added" in text
    # Buckets are cumulative and end in +Inf == count.
    staleness = {
        dict(k[1])["le"]: v for k, v in samples(text).items() if k[0] == "elasticfed_gateway_staleness_bucket"
    }
    assert staleness == {"0": 1, "1": 3, "2": 3, "4": 4, "8": 4, "+Inf": 5}

    before = samples(text)
    m.applied.inc("cam-1", "fc.weight")
    m.applied.inc("cam-2", "fc.weight", by=5)  # a new label set
    m.clients.set(value=7)
    m.latency.observe("fc.weight", value=0.003)
    m.rounds.inc(by=123_456_789)  # beyond %g's six digits: the endpoint stays exact
    after = samples(scrape(server.url))
    assert after == expected(m) and after != before
    assert (
        after[
            (
                "elasticfed_gateway_applied_steps_total",
                frozenset({("client", "cam-1"), ("layer", "fc.weight")}),
            )
        ]
        == 4
    )
    assert after[("elasticfed_gateway_rounds_total", frozenset())] == 123_456_790
    assert after[("elasticfed_edge_sync_latency_seconds_count", frozenset({("layer", "fc.weight")}))] == 6

    # "/" serves the same; any other path is a 404.
    assert samples(scrape(server.url.replace("/metrics", "/"))) == after
    with pytest.raises(urllib.error.HTTPError) as err:
        scrape(server.url.replace("/metrics", "/nope"))
    assert err.value.code == 404


def test_render_prometheus_and_the_endpoint_are_one_format(servers) -> None:
    m = Fleet()
    server = serve_metrics("127.0.0.1:0", m)
    servers.append(server)
    http_text = scrape(server.url)
    ours = m.render_prometheus()

    http_families = {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(http_text)}
    our_families = {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(ours)}
    assert http_families == our_families
    assert types(http_text) == types(ours)
    http_samples, our_samples = samples(http_text), samples(ours)
    assert http_samples.keys() == our_samples.keys()  # same names, labels and `le` spellings
    for key, value in our_samples.items():  # render_prometheus() writes %g: six significant digits
        assert http_samples[key] == pytest.approx(value, rel=5e-6), key
    assert server.render() == http_text


def test_the_real_gateway_and_edge_registries_keep_their_names() -> None:
    from elasticfed.cloud.gateway import GatewayMetrics
    from elasticfed.edge.metrics import EdgeMetrics

    for owner in (GatewayMetrics(), EdgeMetrics()):
        m = owner.registry
        for fam in m._families.values():  # one row each, so every family has samples
            labels = [f"v{i}" for i in range(len(fam.label_names))]
            if fam.kind == "histogram":
                fam.observe(*labels, value=1)
            elif fam.kind == "gauge":
                fam.set(*labels, value=1)
            else:
                fam.inc(*labels)
        text = MetricsServer([m]).render()
        assert types(text) == types(m.render_prometheus())
        assert samples(text) == expected(m)


def test_openmetrics_scrapes_carry_the_same_samples(servers) -> None:
    """A Prometheus server asks for OpenMetrics first; the samples must not change with the format."""
    m = Fleet()
    server = serve_metrics("127.0.0.1:0", m)
    servers.append(server)
    text = scrape(server.url, accept="application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert text.rstrip().endswith("# EOF")
    assert samples(text, parse=om_families) == expected(m)


def test_extra_gauges_are_computed_at_scrape_time_and_none_hides_them(servers) -> None:
    m = Metrics()
    box: list[float | None] = [None]

    def broken() -> float:
        raise RuntimeError("no checkpoint directory")

    server = serve_metrics(
        "127.0.0.1:0",
        m,
        extra=[
            ("gateway_checkpoint_age_seconds", "seconds since the last checkpoint", lambda: box[0]),
            ("gateway_broken", "raises", broken),
        ],
    )
    servers.append(server)
    age = ("elasticfed_gateway_checkpoint_age_seconds", frozenset())
    text = scrape(server.url)
    assert age not in samples(text) and "checkpoint_age" not in text
    assert "gateway_broken" not in text  # a failing callable costs its gauge, not the scrape
    box[0] = 12.5
    text = scrape(server.url)
    assert samples(text)[age] == 12.5
    assert "# TYPE elasticfed_gateway_checkpoint_age_seconds gauge" in text
    box[0] = 13.0
    assert samples(scrape(server.url))[age] == 13.0
    box[0] = None
    assert age not in samples(scrape(server.url))


def test_two_servers_in_one_process_each_serve_their_own_registry(servers) -> None:
    a, b = Metrics(), Metrics()
    a.counter("gateway_pushes_total", "pushes").inc(by=2)
    b.counter("edge_pushes_total", "pushes").inc(by=3)
    sa = serve_metrics("127.0.0.1:0", a)
    servers.append(sa)
    sb = serve_metrics("127.0.0.1:0", b)
    servers.append(sb)
    assert sa.port != sb.port
    assert samples(scrape(sa.url)) == {("elasticfed_gateway_pushes_total", frozenset()): 2}
    assert samples(scrape(sb.url)) == {("elasticfed_edge_pushes_total", frozenset()): 3}
    # No process/platform/GC collectors unless asked for.
    with_process = MetricsServer([a], process_metrics=True).render()
    assert "python_info" in with_process and "python_info" not in sa.render()


def test_one_endpoint_refuses_a_name_twice() -> None:
    a, b = Metrics(), Metrics()
    a.counter("x_total", "x")
    b.counter("x_total", "x")
    with pytest.raises(ValueError, match="elasticfed_x_total"):
        MetricsServer([a, b])
    with pytest.raises(ValueError, match="elasticfed_x_total"):
        MetricsServer([a], extra=[("x_total", "again", lambda: 1.0)])
    with pytest.raises(ValueError, match="not a valid"):
        MetricsServer([], extra=[("bad name", "x", lambda: 1.0)])


def test_histogram_with_negative_buckets_keeps_count_and_sum() -> None:
    m = Metrics()
    h = m.histogram("skew_seconds", "clock skew", [], (-1, 0, 1))
    for v in (-2, -0.5, 0.5, 3):
        h.observe(value=v)
    text = MetricsServer([m]).render()
    assert samples(text) == expected(m)
    assert samples(text).keys() == samples(m.render_prometheus()).keys()


@pytest.mark.parametrize(
    "bind",
    [
        "",
        "x",
        "9100",
        "127.0.0.1",
        "127.0.0.1:",
        ":9100",
        "127.0.0.1:99999",
        "127.0.0.1:-1",
        "127.0.0.1:http",
        "local host:9100",
        "[::1:9100",
        "[::1]9100",
        "[example.com]:9100",
        "1::2::3:9100",
        "http://127.0.0.1:9100",
    ],
)
def test_bad_binds_say_which(bind: str) -> None:
    with pytest.raises(ValueError, match="metrics bind") as err:
        serve_metrics(bind, Metrics())
    assert repr(bind) in str(err.value) and "HOST:PORT" in str(err.value)


def test_bind_forms() -> None:
    assert parse_bind("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_bind("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_bind("localhost:65535") == ("localhost", 65535)
    assert parse_bind("[::]:9100") == ("::", 9100)
    assert parse_bind(":::9100") == ("::", 9100)
    assert parse_bind("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError, match="cannot resolve"):
        serve_metrics("no-such-host.invalid:0", Metrics())


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_and_wildcard_binds_serve(servers) -> None:
    m = Metrics()
    m.gauge("g", "g").set(value=1)
    for bind in ("[::1]:0", "[::]:0", "0.0.0.0:0"):
        server = serve_metrics(bind, m)
        servers.append(server)
        assert samples(scrape(server.url)) == {("elasticfed_g", frozenset()): 1}
    assert servers[0].url.startswith("http://[::1]:") and servers[1].url.startswith("http://[::1]:")
    assert servers[2].url.startswith("http://127.0.0.1:")


def test_close_frees_the_port_and_stops_the_thread() -> None:
    m = Metrics()
    m.gauge("g", "g").set(value=1)
    server = serve_metrics("127.0.0.1:0", m)
    port, thread = server.port, server._thread
    scrape(server.url)
    with pytest.raises(OSError, match=f"metrics bind '127.0.0.1:{port}'"):
        serve_metrics(f"127.0.0.1:{port}", m)  # taken while it serves
    server.close()
    assert thread is not None and not thread.is_alive()
    server.close()  # twice is fine
    with pytest.raises(urllib.error.URLError):
        scrape(f"http://127.0.0.1:{port}/metrics")
    again = serve_metrics(f"127.0.0.1:{port}", m)
    try:
        assert again.port == port
        assert samples(scrape(again.url)) == {("elasticfed_g", frozenset()): 1}
    finally:
        again.close()
