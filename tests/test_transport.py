"""The transport boundary (common/transport): the in-process links keep the ZeroMQ links' semantics,
the fault wrapper is the one fault model, and the whole protocol runs on the in-process pair.

The last tests run a real gateway and a real training edge, each with its real I/O loop, over a
`MemoryHub` instead of sockets: the protocol's state machines (welcome, credit, weak pushes,
re-sends, cumulative verdicts, reconnects) are exercised with nothing between them but queues.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fleet import applied_by_layer, serving, train_digits

from elasticfed.cloud.config import CloudConfig, GatewaySettings
from elasticfed.cloud.durability import GatewayCheckpoints
from elasticfed.cloud.gateway import Gateway
from elasticfed.cloud.serve import build_gateway
from elasticfed.common.link import Faults
from elasticfed.common.task import load_task
from elasticfed.common.transport import DealerLink, Event, FaultyLink, Link, MemoryHub, Refusal, SendRefused
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.session import SessionOptions

TASK = load_task("elasticfed.common.tasks.digits:task")


def test_a_dealer_without_a_router_is_refused_and_nothing_waits_for_one() -> None:
    hub = MemoryHub()
    dealer = hub.dealer_link(b"e0")
    dealer.open()
    with pytest.raises(SendRefused) as refused:
        dealer.send([b"hello"])
    assert refused.value.refusal is Refusal.NO_PEER
    router = hub.router_link()
    router.open()
    assert [e.kind for e in dealer.events()] == [Event.UP]  # the moment to say hello again
    assert router.receive() is None  # the refused message was not queued for later


def test_messages_keep_their_order_and_name_their_sender() -> None:
    hub = MemoryHub()
    router = hub.router_link()
    router.open()
    a, b = hub.dealer_link(b"a", user_id="KEY-A"), hub.dealer_link(b"b")
    a.open()
    b.open()
    for i in range(5):
        a.send([b"a", bytes([i])])
        b.send([b"b", bytes([i])])
    got = [router.receive() for _ in range(10)]
    assert router.receive() is None
    from_a = [m.frames[1] for m in got if m is not None and m.peer == b"a"]
    assert from_a == [bytes([i]) for i in range(5)]
    assert {m.user_id for m in got if m is not None and m.peer == b"a"} == {"KEY-A"}
    router.send([b"reply"], peer=b"b")
    reply = b.receive()
    assert reply is not None and reply.frames == [b"reply"] and a.receive() is None


def test_a_sent_buffer_may_be_reused_at_once() -> None:
    hub = MemoryHub()
    router = hub.router_link()
    router.open()
    dealer = hub.dealer_link(b"e0")
    dealer.open()
    buffer = bytearray(b"first")
    assert dealer.send([memoryview(buffer)], track=True).done
    buffer[:] = b"XXXXX"
    message = router.receive()
    assert message is not None and message.frames == [b"first"]


def test_a_reconnected_dealer_takes_over_its_route_and_loses_what_was_in_flight() -> None:
    hub = MemoryHub()
    router = hub.router_link()
    router.open()
    old = hub.dealer_link(b"e0")
    old.open()
    router.send([b"to the old connection"], peer=b"e0")
    old.open()  # a reconnect: the reply in flight dies with the old connection
    assert old.receive() is None
    newer = hub.dealer_link(b"e0")  # a new process with the same routing id
    newer.open()
    router.send([b"to the newest"], peer=b"e0")
    assert newer.receive() is not None and old.receive() is None
    with pytest.raises(SendRefused) as refused:
        old.send([b"from a replaced connection"])
    assert refused.value.refusal is Refusal.NO_PEER
    with pytest.raises(SendRefused) as gone:
        router.send([b"x"], peer=b"nobody")
    assert gone.value.refusal is Refusal.PEER_GONE


def test_wake_ends_a_poll_from_another_thread() -> None:
    hub = MemoryHub()
    dealer = hub.dealer_link(b"e0")
    dealer.open()
    _assert_woken(dealer)


def _assert_woken(link: Link) -> None:
    """A wake from another thread ends a long poll well before its timeout."""
    timer = threading.Timer(0.05, link.wake)
    timer.start()
    started = time.monotonic()
    link.poll(30.0)
    assert time.monotonic() - started < 10.0
    timer.join()


def test_the_zeromq_dealer_wakes_too_and_survives_being_reopened() -> None:
    dealer = DealerLink("tcp://127.0.0.1:1", b"e0")  # nothing listens: sends are refused
    try:
        dealer.open()
        with pytest.raises(SendRefused):
            dealer.send([b"x"])
        dealer.open()
        _assert_woken(dealer)
    finally:
        dealer.close()
    dealer.wake()  # after close: a no-op, not an error (the training thread may still call it)


def _faulty_pair(faults: Faults, now: list[float]) -> tuple[FaultyLink, object]:
    hub = MemoryHub()
    router = hub.router_link()
    router.open()
    link = FaultyLink(hub.dealer_link(b"e0"), faults, clock=lambda: now[0])
    link.open()
    return link, router


def test_the_fault_wrapper_loses_the_share_it_is_told_and_repeats_itself() -> None:
    def run() -> list[bytes]:
        now = [0.0]
        link, router = _faulty_pair(Faults(loss=0.3, seed=7), now)
        for i in range(2000):
            link.send([i.to_bytes(2, "big")])
        got = []
        while (m := router.receive()) is not None:  # type: ignore[attr-defined]
            got.append(m.frames[0])
        return got

    first, second = run(), run()
    assert first == second  # seeded: a run can be repeated exactly
    assert 0.25 < 1 - len(first) / 2000 < 0.35
    assert first == sorted(first)  # loss alone never reorders


def test_the_fault_wrapper_delays_and_a_reconnect_drops_what_it_holds() -> None:
    now = [0.0]
    link, router = _faulty_pair(Faults(delay_ms=100), now)
    link.send([b"late"])
    assert router.receive() is None  # type: ignore[attr-defined]
    now[0] = 0.2
    link.poll(0.0)
    assert router.receive() is not None  # type: ignore[attr-defined]
    link.send([b"never"])
    link.open()  # the connection is replaced before the message left
    now[0] = 1.0
    link.poll(0.0)
    assert router.receive() is None  # type: ignore[attr-defined]
    assert link.stats()["link_up"]["lost"] == 1


def _memory_gateway(
    hub: MemoryHub, checkpoints: GatewayCheckpoints | None = None, **settings: object
) -> Gateway:
    config = replace(CloudConfig(), mode="standalone", gateway=GatewaySettings(**settings))  # type: ignore[arg-type]
    return build_gateway(config, TASK, checkpoints=checkpoints, link=hub.router_link())


def _train(hub: MemoryHub, faults: str, seconds: float, client_id: str = "e0") -> tuple[ElasticEdge, bool]:
    torch.manual_seed(0)
    agent = ElasticEdge(
        TASK.build_model(),
        SessionOptions(
            gateway="memory://hub",
            client_id=client_id,
            timeout_s=0.1,
            heartbeat_s=0.5,
            faults=Faults.parse(faults),
        ),
        link=hub.dealer_link(client_id.encode()),
    )
    train_digits(agent, seconds)
    return agent, agent.close(drain_s=60.0)


def _exactly_once(status: dict, agent: ElasticEdge, client_id: str = "e0") -> None:
    produced = agent.status()["produced_steps"]
    applied = applied_by_layer(status, client_id, "gateway_applied_steps_total")
    dropped = applied_by_layer(status, client_id, "gateway_dropped_stale_steps_total")
    assert produced and all(n > 0 for n in produced.values())
    for layer, n in produced.items():
        assert applied.get(layer, 0) + dropped.get(layer, 0) == n, (layer, applied, dropped, n)


def test_the_protocol_delivers_exactly_once_over_a_lossy_in_process_link() -> None:
    """Bursty loss, duplicates, reordering and an outage, and no socket anywhere."""
    hub = MemoryHub()
    gateway = _memory_gateway(hub, quorum=1, round_deadline_s=0.2, max_staleness=1000)
    with serving(gateway):
        agent, delivered = _train(
            hub, "loss=0.3,burst=3,duplicate=0.05,reorder=0.05,outage=1+1.5,seed=3", seconds=4.0
        )
        status = gateway.status()
    session = agent.session
    assert delivered
    _exactly_once(status, agent)
    assert session.loses_messages  # known from the start: the faults are injected here
    assert session.metrics.retransmits.total() > 0  # losses were repaired, not absent
    assert session.status()["link_up"]["lost_in_outage"] > 0
    assert status["metrics"]["gateway_duplicates_total"]  # duplicates arrived and were told apart


def test_a_gateway_restart_on_the_same_hub_is_found_and_nothing_is_counted_twice(tmp_path: Path) -> None:
    """A new gateway instance (restored from the first one's checkpoint) on the same hub: the edge
    finds it by itself, and over both instances every step-gradient is applied exactly once."""
    hub = MemoryHub()

    def instance() -> Gateway:
        gateway = _memory_gateway(hub, checkpoints=GatewayCheckpoints(str(tmp_path)), quorum=1)
        gateway.restore()
        return gateway

    first = instance()
    torch.manual_seed(0)
    agent = ElasticEdge(
        TASK.build_model(),
        SessionOptions(gateway="memory://hub", client_id="e0", timeout_s=0.1, heartbeat_s=0.2, liveness=3),
        link=hub.dealer_link(b"e0"),
    )
    with serving(first):
        train_digits(agent, 1.0)
    second = instance()
    assert second.gateway_id != first.gateway_id
    with serving(second):
        train_digits(agent, 1.0)
        assert agent.close(drain_s=60.0)
        status = second.status()
    assert agent.session.gateway_id == second.gateway_id  # it was welcomed by the new instance
    produced = agent.status()["produced_steps"]
    # Over the checkpointed history of both instances, per layer: applied once, none twice.
    assert status["history_applied_steps"]["e0"] == produced


def test_an_edge_whose_model_is_one_unit_measures_its_uplink_and_auto_chooses_from_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One unit means one push in flight at a time: each push leaves as the answer to the one
    before arrives.  Those pushes are the link's busy run (edge/pacing.py), so the uplink gets
    measured and `auto` (the default) picks its encoding from it.  When the I/O loop stamped
    those sends a moment after the answers, no run ever formed and `auto` kept its unmeasured
    int8 forever (the demo pushed a quarter of its bytes, all of them int8).  Which encoding it
    then picks depends on the round trips this machine gives (dense at 14-25 Mbit/s in the demo);
    that it picks from a measurement is what this checks."""
    hub = MemoryHub()
    gateway = _memory_gateway(hub, quorum=1)
    caplog.set_level(logging.INFO, logger="elasticfed.edge")
    with serving(gateway):
        torch.manual_seed(0)
        agent = ElasticEdge(
            TASK.build_model(),
            # 20 ms each way: the next step's sum is always pending when an answer comes (a digits
            # step takes a few ms), as on any link slower than training.  On a link faster than
            # training, pushes leave as steps end, the link idles between them, and there is no
            # run to time (a lone int8 push of this model is under RATE_SAMPLE_MIN_BYTES).
            SessionOptions(
                gateway="memory://hub",
                client_id="e0",
                timeout_s=0.5,
                heartbeat_s=1.0,
                faults=Faults.parse("delay_ms=20"),
            ),
            link=hub.dealer_link(b"e0"),
        )
        session = agent.session
        assert len(session.cache.units) == 1  # the case in question
        assert session.cache.compression.spec == "auto"  # the default
        train_digits(agent, 2.0)
        assert agent.close(drain_s=30.0)
    chosen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compression ")]
    assert session.uplink.measured, session.status()
    assert chosen, "auto never chose from a measured uplink"


OPEN_FILES_SCRIPT = """
import logging, resource, sys
import torch
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.common.transport.zeromq import allow_open_files
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
cap = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, cap))
print("cap", cap)
model = torch.nn.Linear(2, 2)
gw = Gateway(model, torch.optim.SGD(model.parameters(), lr=0.1),
             GatewayOptions(bind="tcp://127.0.0.1:0", max_clients=2000))
gw.bind()
print("after bind", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
gw.close()
print("short", allow_open_files(10_000))
"""


def test_a_gateway_raises_its_open_file_limit_for_its_devices_and_says_when_it_cannot() -> None:
    """A connection is a file: a soft limit of 256 would refuse the 257th device, unexplained."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", OPEN_FILES_SCRIPT], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    cap = int(out.split("cap ")[1].split()[0])
    assert f"after bind {min(cap, 2064)}" in out, out  # max_clients and the process's own files
    assert f"short {cap}" in out and "needs about 10000" in out and "ulimit -Hn" in out, out
