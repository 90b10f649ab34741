"""`elasticfed linksim` between real processes and real sockets on loopback.

(a) zmq layer, lossless: two edges train through it, everything is delivered, the count audit holds;
(b) zmq layer, 30% loss: about 30% of messages are lost each way, and the audit still holds;
    and a rerun with the same seed repeats each edge's fates; idle upstream sockets close and reopen;
(c) the rate cap, measured with raw pyzmq through the proxy, and the tail-drop buffer's counts;
(d) tcp layer: the added delay on round trips; an outage holds traffic, which then flows again;
    with outage_mode=reset the connection is reset and ZeroMQ reconnects;
(e) bad settings exit 2 with a message that names the flag; an edge with CURVE cannot pass the zmq layer.
"""

from __future__ import annotations

import math
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq
from fleet import (
    REPO,
    Proc,
    applied_by_layer,
    edge,
    free_port,
    gateway_process,
    gateway_thread,
    process_env,
)

from elasticfed.common.cli import EXIT_USAGE, main
from elasticfed.common.link import TokenBucket

LOCAL = "tcp://127.0.0.1:0"


Started = tuple[Proc, str, float]


@pytest.fixture
def linksim() -> Iterator[Callable[..., Started]]:
    """Starts linksim processes: each with its bound endpoint and when its fault clock started."""
    started: list[Proc] = []

    def start(*flags: str) -> Started:
        argv = [sys.executable, "-m", "elasticfed.common.cli", "linksim", "--listen", LOCAL, *flags]
        proc = Proc(argv, "linksim")
        started.append(proc)
        ready = proc.wait_for(lambda e: e.get("event") == "ready", 30, "a ready event")
        # Its own monotonic time (one clock on Linux): the outage windows do not move with how
        # late this process reads the line.
        return proc, ready["endpoint"], float(ready["clock_started"])

    yield start
    for proc in started:  # a failed test leaves none running
        proc.kill()


def stop(proc: Proc) -> dict[str, Any]:
    proc.signal(signal.SIGTERM)
    return proc.summary(timeout=30)


def conserved(direction: dict[str, int]) -> bool:
    """Every message that came in went out once (plus duplicates), or was counted as not going out."""
    gone = direction["lost"] + direction["queue_dropped"] + direction["send_failed"] + direction["pending"]
    return direction["messages_in"] == gone + direction["messages_out"] - direction["duplicated"]


def audit(gateway: dict[str, Any], edge_summary: dict[str, Any]) -> None:
    """Per layer: applied once + dropped as stale == produced (as in test_elastic_sync)."""
    status = {
        "metrics": {
            "gateway_applied_steps_total": gateway["applied_steps"],
            "gateway_dropped_stale_steps_total": gateway["dropped_stale_steps"],
        }
    }
    client = edge_summary["client"]
    applied = applied_by_layer(status, client, "gateway_applied_steps_total")
    dropped = applied_by_layer(status, client, "gateway_dropped_stale_steps_total")
    assert edge_summary["undelivered_steps"] == 0 and edge_summary["delivered_all"], edge_summary
    assert edge_summary["produced_steps"]
    for layer, produced in edge_summary["produced_steps"].items():
        assert applied.get(layer, 0) + dropped.get(layer, 0) == produced, (client, layer, applied, dropped)
        assert edge_summary["delivered_steps"].get(layer, 0) == applied.get(layer, 0)


@dataclass
class Upstream:
    """A raw ROUTER standing in for the gateway: records what arrives, echoes it if asked."""

    echo: bool
    endpoint: str = ""
    arrivals: list[tuple[float, bytes, int]] = field(default_factory=list)  # time, routing id, bytes
    payloads: list[bytes] = field(default_factory=list)
    outbox: list[tuple[bytes, bytes]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def wait(self, count: int, timeout: float) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: len(self.arrivals) >= count, timeout):
                raise AssertionError(f"upstream got {len(self.arrivals)} of {count} messages in {timeout} s")

    def send(self, routing_id: bytes, payload: bytes) -> None:
        with self.changed:
            self.outbox.append((routing_id, payload))


@contextmanager
def upstream(echo: bool, curve_secret_key: bytes = b"") -> Iterator[Upstream]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_secret_key:
        sock.curve_server = True
        sock.curve_secretkey = curve_secret_key
    sock.bind(LOCAL)
    up = Upstream(echo, sock.getsockopt_string(zmq.LAST_ENDPOINT))
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            if sock.poll(20):
                routing_id, payload = sock.recv_multipart()
                if up.echo:
                    sock.send_multipart([routing_id, payload])
                with up.changed:
                    up.arrivals.append((time.monotonic(), routing_id, len(payload)))
                    up.payloads.append(payload)
                    up.changed.notify_all()
            with up.changed:
                outbox, up.outbox = up.outbox, []
            for routing_id, payload in outbox:
                sock.send_multipart([routing_id, payload])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield up
    finally:
        done.set()
        thread.join(5)
        sock.close()


@contextmanager
def dealer(
    endpoint: str, routing_id: bytes = b"", curve: tuple[bytes, bytes, bytes] | None = None
) -> Iterator[zmq.Socket]:
    """A DEALER connected to `endpoint`; `curve`: (server public, our public, our secret) key."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if curve:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()


def rate(times: list[float], sizes: list[int]) -> float:
    """Bytes per second after the first arrival (the first one passes at once: nothing to pace it against)."""
    return sum(sizes[1:]) / (times[-1] - times[0])


# -------------------------------------------------------------- (a), (b): a real fleet through the zmq layer


@pytest.mark.slow
def test_a_lossless_zmq_link_delivers_everything_to_the_gateway_one_peer_per_edge(
    linksim: Callable[..., Started],
) -> None:
    port = free_port()
    gateway = gateway_process(port, "--gateway-quorum", "1", "--gateway-round-deadline-s", "0.2")
    try:
        sim, endpoint, _ = linksim("--upstream", f"tcp://127.0.0.1:{port}", "--status-every-s", "0.5")
        edges = [
            edge(
                endpoint,
                f"via-{i}",
                "--train-max-steps",
                "40",
                "--timeout-ms",
                "300",
                "--train-shard",
                f"{i}/2",
            )
            for i in range(2)
        ]
        summaries = [e.summary(timeout=120) for e in edges]
        link = stop(sim)
        gw = stop(gateway)
    finally:
        gateway.kill()
    assert sorted(gw["clients"]) == ["via-0", "via-1"]
    for s in summaries:
        audit(gw, s)
        assert s["steps"] == 40 and sum(s["delivered_steps"].values()) > 0
    # One upstream socket per edge, nothing lost, every message accounted for.
    assert link["edges"] == 2 and link["upstream_opened"] == 2
    for direction in ("up", "down"):
        counts = link[direction]
        assert counts["lost"] == counts["queue_dropped"] == counts["duplicated"] == 0, counts
        assert counts["messages_in"] >= 20 and conserved(counts), counts
    assert link["up"]["bytes_out"] == link["up"]["bytes_in"]
    assert sim.statuses(), "no status lines"


@pytest.mark.slow
def test_b_thirty_percent_loss_each_way_and_the_audit_still_holds(linksim: Callable[..., Started]) -> None:
    # The gateway in a thread here (test (a) runs the real process): its status is there for the audit.
    with gateway_thread(quorum=1, round_deadline_s=0.2) as gateway:
        sim, endpoint, _ = linksim("--upstream", gateway.bound_endpoint, "--faults", "loss=0.3,seed=5")
        # One push per layer (--pack-cap-kib 0) for a few seconds: some hundreds of messages each way.
        flags = (
            "--train-duration-s 5 --train-epochs 100000 --timeout-ms 100 --heartbeat-ms 300 --pack-cap-kib 0"
        )
        summary = edge(endpoint, "lossy", *flags.split()).summary(timeout=120)
        link = stop(sim)
        metrics = gateway.status()["metrics"]
    gw = {
        "applied_steps": metrics["gateway_applied_steps_total"],
        "dropped_stale_steps": metrics["gateway_dropped_stale_steps_total"],
    }
    audit(gw, summary)
    assert summary["edge_retransmissions_total"] > 0  # the loss was real and the protocol worked for it
    for direction in ("up", "down"):
        counts = link[direction]
        n = counts["messages_in"]
        assert n >= 150 and conserved(counts), counts
        share = counts["lost"] / n
        tolerance = 4 * math.sqrt(0.3 * 0.7 / n)  # independent losses: binomial, 4 standard deviations
        assert abs(share - 0.3) <= tolerance, (direction, share, tolerance, counts)


def delivered(linksim: Callable[..., Started], routing_id: bytes, count: int) -> list[int]:
    """Which of `count` numbered messages from one DEALER got through a 30% lossy zmq link."""
    with upstream(echo=False) as up:
        sim, endpoint, _ = linksim(
            "--upstream", up.endpoint, "--faults", "loss=0.3,seed=3", "--status-every-s", "0.1"
        )
        with dealer(endpoint, routing_id) as client:
            for i in range(count):
                client.send(i.to_bytes(4, "big"))
            settled = sim.wait_for(
                lambda e: (
                    e.get("event") == "status" and e["up"]["messages_in"] == count and e["up"]["pending"] == 0
                ),
                30,
                "every message taken",
            )
            up.wait(settled["up"]["messages_out"], timeout=10)
        with up.changed:
            got = [int.from_bytes(payload, "big") for payload in up.payloads]
        stop(sim)
    return got


@pytest.mark.slow
def test_the_same_seed_and_edge_see_the_same_fates_and_other_edges_other_ones(
    linksim: Callable[..., Started],
) -> None:
    first = delivered(linksim, b"cam-1", 300)
    assert first == delivered(linksim, b"cam-1", 300)  # a rerun repeats exactly
    assert 0.2 < 1 - len(first) / 300 < 0.4
    assert delivered(linksim, b"cam-2", 300) != first  # each edge its own link


def test_an_idle_upstream_socket_is_closed_and_opened_again_when_needed(
    linksim: Callable[..., Started],
) -> None:
    with upstream(echo=True) as up:
        sim, endpoint, _ = linksim(
            "--upstream", up.endpoint, "--idle-close-s", "0.3", "--status-every-s", "0.1"
        )
        with dealer(endpoint, b"sleepy") as client:
            assert ping(client, 10) is not None
            sim.wait_for(
                lambda e: (
                    e.get("event") == "status"
                    and e["upstream_idle_closed"] == 1
                    and e["upstream_sockets"] == 0
                ),
                20,
                "the idle upstream socket closed",
            )
            assert ping(client, 10) is not None  # the edge speaks again: a new upstream socket carries it
        link = stop(sim)
    assert link["upstream_opened"] == 2 and link["edges"] == 1
    assert [rid for _, rid, _ in up.arrivals] == [b"sleepy", b"sleepy"]  # the gateway sees the edge's id


# ---------------------------------------------------------------- (c): the rate cap


@pytest.mark.slow
def test_c_the_rate_cap_holds_each_way_within_a_quarter(linksim: Callable[..., Started]) -> None:
    kbit, size, count = 4000, 16 * 1024, 64  # 500 kB/s, 1 MiB each way: about 2 s each
    with upstream(echo=False) as up:
        sim, endpoint, _ = linksim("--upstream", up.endpoint, "--rate-kbit", str(kbit), "--queue-kib", "4096")
        with dealer(endpoint, b"meter") as client:
            for _ in range(count):
                client.send(b"u" * size)
            up.wait(count, timeout=60)
            upward = rate([t for t, _, _ in up.arrivals], [n for _, _, n in up.arrivals])
            for _ in range(count):
                up.send(b"meter", b"d" * size)
            times, sizes = [], []
            for _ in range(count):
                assert client.poll(30_000), f"got {len(times)} of {count} messages back"
                sizes.append(len(client.recv()))
                times.append(time.monotonic())
            downward = rate(times, sizes)
        link = stop(sim)
    cap = kbit * 1000 / 8
    for name, measured in (("up", upward), ("down", downward)):
        assert abs(measured / cap - 1) <= 0.25, (name, measured, cap)
    assert link["up"]["queue_dropped"] == link["down"]["queue_dropped"] == 0


def test_c_a_full_buffer_tail_drops_and_counts_it(linksim: Callable[..., Started]) -> None:
    size, count = 16 * 1024, 40
    with upstream(echo=False) as up:
        sim, endpoint, _ = linksim(
            "--upstream", up.endpoint, "--rate-kbit", "800", "--queue-kib", "64", "--status-every-s", "0.1"
        )
        with dealer(endpoint) as client:
            for _ in range(count):
                client.send(b"x" * size)
            settled = sim.wait_for(
                lambda e: (
                    e.get("event") == "status" and e["up"]["messages_in"] == count and e["up"]["pending"] == 0
                ),
                30,
                "every message taken and none pending",
            )
            up.wait(settled["up"]["messages_out"], timeout=10)
        link = stop(sim)
    counts = link["up"]
    assert counts["queue_dropped"] >= count // 2, counts  # a 64 KiB buffer holds 4 of them, not 40
    assert counts["messages_out"] == len(up.arrivals) == count - counts["queue_dropped"]
    assert counts["queue_dropped_bytes"] == counts["queue_dropped"] * size


def test_token_bucket_paces_big_messages_at_the_average_rate() -> None:
    bucket = TokenBucket(rate=1000.0, depth=100.0, now=0.0)
    now, sent = 0.0, 0
    for _ in range(50):
        now = bucket.ready_at(400, now)  # bigger than the depth: passes on a full bucket, leaves debt
        bucket.take(400, now)
        sent += 400
    assert abs(sent / now - 1000.0) / 1000.0 < 0.05


# ---------------------------------------------------------------- (d): the tcp layer


def ping(client: zmq.Socket, timeout_s: float) -> float | None:
    """A round trip through the echo upstream, in seconds, or None if no answer came in time."""
    sent = time.monotonic()
    client.send(b"ping")
    if not client.poll(int(timeout_s * 1000)):
        return None
    client.recv()
    return time.monotonic() - sent


@pytest.mark.slow
def test_d_tcp_layer_adds_its_delay_and_holds_traffic_through_an_outage(
    linksim: Callable[..., Started],
) -> None:
    delay_ms, outage_start, outage_s = 40.0, 2.5, 1.5
    with upstream(echo=True) as up:
        with dealer(up.endpoint) as direct:
            base = statistics.median(r for r in (ping(direct, 5) for _ in range(10)) if r is not None)
        faults = f"delay_ms={delay_ms},jitter_ms=2,outage={outage_start}+{outage_s}"
        sim, endpoint, ready_at = linksim("--layer", "tcp", "--upstream", up.endpoint, "--faults", faults)
        pings: list[tuple[float, float]] = []  # (sent, answered), seconds after ready
        with dealer(endpoint) as client:
            while time.monotonic() - ready_at < outage_start + outage_s + 1.5:
                sent = time.monotonic() - ready_at
                rtt = ping(client, 10)
                assert rtt is not None, f"no answer to a ping sent {sent:.2f} s after ready"
                pings.append((sent, sent + rtt))
        link = stop(sim)
    # Outages count from `ready_at` exactly (linksim's clock); the margins below are for the RTT.
    before = [b - a - base for a, b in pings if b < outage_start - 0.1]
    assert len(before) >= 5, pings
    added = statistics.median(before)
    assert 2 * delay_ms * 0.8 / 1000 <= added <= 2 * delay_ms / 1000 + 0.08, (added, before)
    assert min(before) >= 2 * (delay_ms - 3 * 2) / 1000 * 0.95, before
    # Nothing answered inside the outage; the ping caught in it was held and answered after it.
    inside = [(a, b) for a, b in pings if outage_start + 0.2 < b < outage_start + outage_s - 0.3]
    assert not inside, inside
    held = [(a, b) for a, b in pings if a < outage_start + 0.2 and b >= outage_start + outage_s - 0.3]
    assert held and held[0][1] - held[0][0] > outage_s / 2, held
    after = [b - a for a, b in pings if a > outage_start + outage_s + 0.1]
    assert len(after) >= 3 and statistics.median(after) < 2 * delay_ms / 1000 + 0.1, after
    assert link["up"]["held_in_outage"] + link["down"]["held_in_outage"] >= 1, link
    assert link["up"]["bytes_in"] == link["up"]["bytes_out"] and link["resets"] == 0
    for counts in (link["up"], link["down"]):
        assert counts["lost"] == counts["duplicated"] == counts["reordered"] == 0


@pytest.mark.slow
def test_d_tcp_layer_outage_reset_mode_resets_and_zeromq_reconnects(linksim: Callable[..., Started]) -> None:
    with upstream(echo=True) as up:
        sim, endpoint, ready_at = linksim(
            "--layer", "tcp", "--upstream", up.endpoint, "--faults", "outage=1+1", "--outage-mode", "reset"
        )
        with dealer(endpoint) as client:
            client.setsockopt(zmq.RECONNECT_IVL, 100)
            assert ping(client, 5) is not None  # before the outage
            answered_after = 0
            deadline = ready_at + 20
            while answered_after < 3 and time.monotonic() < deadline:
                rtt = ping(client, 0.5)  # a ping that was in flight at the reset is gone: ask again
                if rtt is not None and time.monotonic() - ready_at > 2.0:
                    answered_after += 1
            assert answered_after == 3, "no answers after the outage"
        link = stop(sim)
    assert link["resets"] >= 1 and link["connections"] >= 2, link


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_d_tcp_layer_carries_curve_end_to_end(linksim: Callable[..., Started]) -> None:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    with upstream(echo=True, curve_secret_key=server_secret) as up:
        sim, endpoint, _ = linksim("--layer", "tcp", "--upstream", up.endpoint, "--faults", "delay_ms=10")
        with dealer(endpoint, curve=(server_public, client_public, client_secret)) as client:
            rtts = [ping(client, 10) for _ in range(3)]
        link = stop(sim)
    assert all(r is not None and r >= 0.019 for r in rtts), rtts
    assert link["up"]["bytes_out"] == link["up"]["bytes_in"] > 0


# ---------------------------------------------------------------- (e): refusals


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--layer", "tcp", "--faults", "loss=0.1"], "--faults: loss cannot be simulated with --layer tcp"),
        (["--layer", "tcp", "--faults", "duplicate=0.1,reorder=0.1"], "duplicate, reorder cannot"),
        (["--listen", "localhost:7000"], "--listen: must be a TCP endpoint"),
        (["--upstream", "tcp://*:7878"], "--upstream: must name a host and a port"),
        (["--rate-kbit", "-1"], "--rate-kbit: must be >= 0"),
        (["--queue-kib", "0"], "--queue-kib: must be >= 1"),
        (["--faults", "loss=2"], "--faults: faults: loss must be in [0, 1)"),
        (["--outage-mode", "reset"], "--outage-mode reset applies to --layer tcp"),
        (["--layer", "udp"], "--layer: must be one of zmq, tcp"),
    ],
)
def test_e_bad_settings_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    upstream_flag = (
        [] if any(a.startswith("--upstream") for a in argv) else ["--upstream", "tcp://127.0.0.1:1"]
    )
    assert main(["linksim", *upstream_flag, *argv]) == EXIT_USAGE
    assert expected in capsys.readouterr().err


def test_e_the_command_refuses_loss_in_tcp_mode_and_a_missing_upstream() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "elasticfed.common.cli", "linksim", *args]
        return subprocess.run(argv, capture_output=True, text=True, env=process_env(), cwd=REPO, timeout=60)

    tcp_loss = run("--layer", "tcp", "--upstream", "tcp://127.0.0.1:1", "--faults", "loss=0.3")
    assert tcp_loss.returncode == EXIT_USAGE and not tcp_loss.stdout
    assert "corrupt" in tcp_loss.stderr and "nftables" in tcp_loss.stderr and "--layer zmq" in tcp_loss.stderr
    missing = run()
    assert missing.returncode == EXIT_USAGE and "--upstream is required" in missing.stderr


def test_e_a_port_in_use_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with upstream(echo=False) as up:
        assert main(["linksim", "--listen", up.endpoint, "--upstream", "tcp://127.0.0.1:1"]) == EXIT_USAGE
        assert f"--listen {up.endpoint}: cannot listen there" in capsys.readouterr().err
        assert (
            main(["linksim", "--layer", "tcp", "--listen", up.endpoint, "--upstream", "tcp://127.0.0.1:1"])
            == 2
        )
        assert f"--listen {up.endpoint}: cannot listen there" in capsys.readouterr().err


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_a_curve_edge_through_the_zmq_layer_fails_its_handshake_and_is_counted(
    linksim: Callable[..., Started],
) -> None:
    gateway_public, _ = zmq.curve_keypair()
    with upstream(echo=True) as up:
        sim, endpoint, _ = linksim("--upstream", up.endpoint, "--status-every-s", "0.1")
        with dealer(endpoint, curve=(gateway_public, *zmq.curve_keypair())) as client:
            client.send(b"hello")
            sim.wait_for(
                lambda e: e.get("event") == "status" and e["handshake_failures"] >= 1,
                20,
                "a handshake failure",
            )
        link = stop(sim)
    assert link["up"]["messages_in"] == 0 and not up.arrivals
    assert any("use --layer tcp with CURVE" in line for line in sim.stderr)
