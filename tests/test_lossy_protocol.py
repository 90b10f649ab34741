"""The Elastic Sync Protocol where links are worst: re-send timing that adapts, and 95% message loss.

An edge cannot tell a lost push from a late one, so it re-sends on a timer
(Lazy Pirate) and the gateway's acks name which copy was applied.  On a link
that only delays, re-sends are pure duplicates and must back off; on a link
that loses, they are what gets through and must stay fast.  The edge here runs
in this process (its I/O thread is real, its socket real), the gateway in a thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import zmq
from fleet import applied_by_layer, gateway_thread, train_digits
from torch import nn

from elasticfed.common.link import Faults
from elasticfed.common.task import load_task
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.cache import GradientCache
from elasticfed.edge.session import EdgeSession, SessionOptions
from elasticfed.protocol import Ack, Heartbeat, Hello, Manifest, Message, Push, Welcome, decode, encode

TASK = load_task("elasticfed.common.tasks.digits:task")


def train(
    endpoint: str,
    faults: str,
    seconds: float,
    timeout_s: float = 0.1,
    setup: Callable[[ElasticEdge], None] | None = None,
) -> tuple[ElasticEdge, bool]:
    """Train on a quarter of digits for `seconds`, then drain; the agent, and whether all was delivered."""
    torch.manual_seed(0)
    agent = ElasticEdge(
        TASK.build_model(),
        SessionOptions(
            gateway=endpoint,
            client_id="e0",
            timeout_s=timeout_s,
            heartbeat_s=0.5,
            faults=Faults.parse(faults),
        ),
    )
    if setup is not None:
        setup(agent)
    train_digits(agent, seconds)
    return agent, agent.close(drain_s=60.0)


def exactly_once(gateway_status: dict, agent: ElasticEdge) -> None:
    produced = agent.status()["produced_steps"]
    applied = applied_by_layer(gateway_status, "e0", "gateway_applied_steps_total")
    dropped = applied_by_layer(gateway_status, "e0", "gateway_dropped_stale_steps_total")
    for layer, n in produced.items():
        assert applied.get(layer, 0) + dropped.get(layer, 0) == n, layer


@pytest.mark.slow
def test_a_link_that_only_delays_gets_no_resends_at_all() -> None:
    # 250 ms each way against a 100 ms deadline: every push is weak, none is lost, and an
    # answer to a later request never comes before the push's own ack (in-order link).
    with gateway_thread(quorum=1, round_deadline_s=0.2, max_staleness=1000) as gateway:
        agent, delivered = train(gateway.bound_endpoint, "delay_ms=250", seconds=5.0)
        status = gateway.status()
    session = agent.session
    assert delivered
    exactly_once(status, agent)
    assert session.metrics.weak.total() > 0
    assert session.metrics.retransmits.total() == 0
    assert not session.loses_messages


@pytest.mark.slow
def test_timed_resends_back_off_when_the_original_keeps_arriving_first() -> None:
    # A link that loses a little and delays a lot: the timer is on, but each ack names the
    # original as the applied copy, so the interval doubles; a fixed 100 ms timer would
    # send each push about 4 more times within the 500 ms round trip.
    with gateway_thread(quorum=1, round_deadline_s=0.2, max_staleness=1000) as gateway:
        agent, delivered = train(gateway.bound_endpoint, "loss=0.05,delay_ms=250,seed=2", seconds=8.0)
        status = gateway.status()
    session = agent.session
    assert delivered
    exactly_once(status, agent)
    weak, resent = session.metrics.weak.total(), session.metrics.retransmits.total()
    # Backed off: well under the fixed timer's four copies per weak push.  Measured: 0.4-0.8
    # copies per weak push alone, 1.08 once under CI's load (acks later than the 250 ms delay).
    assert 0 < resent <= 2 * weak, (resent, weak)
    assert session.resend_s > session.options.timeout_s


@pytest.mark.slow
def test_a_link_that_loses_messages_is_found_out_and_resends_stay_fast() -> None:
    def unaware(agent: ElasticEdge) -> None:
        agent.session.loses_messages = False  # as behind a message proxy the edge knows nothing of

    with gateway_thread(quorum=1, round_deadline_s=0.2, max_staleness=1000) as gateway:
        agent, delivered = train(gateway.bound_endpoint, "loss=0.5,seed=3", seconds=6.0, setup=unaware)
        status = gateway.status()
    session = agent.session
    assert delivered
    exactly_once(status, agent)
    # A re-sent copy was applied where the original on the same connection was not: proof.
    assert session.loses_messages
    assert session.metrics.retransmits.total() > 0
    assert session.resend_s <= 2 * session.options.timeout_s, session.resend_s


@pytest.mark.slow
def test_at_95_percent_loss_each_way_everything_still_arrives_exactly_once() -> None:
    # One round trip in 400 gets through.  Cumulative verdicts in every answer and timed
    # re-sends are what make this finish at all; the count audit must still be exact.
    with gateway_thread(quorum=1, round_deadline_s=0.2, max_staleness=1_000_000) as gateway:
        agent, delivered = train(gateway.bound_endpoint, "loss=0.95,seed=5", seconds=5.0, timeout_s=0.05)
        status = gateway.status()
    assert delivered, agent.status()["undelivered_steps"]
    exactly_once(status, agent)
    link = agent.status()
    assert link["link_up"]["lost"] > 0.9 * link["link_up"]["offered"]  # the loss was real


@pytest.mark.slow
def test_at_30_percent_loss_a_small_model_keeps_coming_down_every_few_rounds() -> None:
    # A lost model request is asked again after what it can wait for on this link, not after
    # the download window's worth of it: with a 105 KB model and rounds every 0.1-0.2 s the
    # edge fell 40-190 versions behind (re-asked every 8 s) and a fifth of its work was dropped
    # as stale.  Each try gets through with probability 0.7 x 0.7.  Counted from the first
    # model: until a chunk has measured the downlink the tries back off (from 0.1 s to its
    # guess's 1.7 s), and the seeded loss may take several.
    start: dict[str, int] = {}

    def first_model(agent: ElasticEdge) -> None:
        def note(*_: object) -> None:  # runs in each forward, after the agent adopted what came
            if agent.models_adopted and not start:
                start.update(version=agent.version, adopted=agent.models_adopted)

        agent.module.register_forward_pre_hook(note)

    with gateway_thread(quorum=1, round_deadline_s=0.2, max_staleness=1000) as gateway:
        agent, delivered = train(gateway.bound_endpoint, "loss=0.3,seed=4", seconds=10.0, setup=first_model)
        status = gateway.status()
    assert delivered
    exactly_once(status, agent)
    versions = status["version"] - start["version"]
    adopted = agent.models_adopted - start["adopted"]
    assert versions >= 15, versions  # the rounds this test is about did close
    # At least one model in every 4 versions (measured: 2 in 5; the 8 s timer: 0 in 64).
    assert adopted >= versions / 4, (adopted, versions)


def _scripted_resend(original_answer: str) -> EdgeSession:
    """An edge session against a hand-played gateway that leaves push 1's first copy unanswered
    until the edge sends it again, then answers as `original_answer` says:

    - "lost": the copy was applied but its ack was lost; the re-send is answered "duplicate,
      applied copy 0" (the only answer the edge gets for it);
    - "late": the original's own ack ("applied, copy 0") arrives only now, after the re-send.
    """
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    model = nn.Linear(3, 2)
    named = list(model.named_parameters())
    manifest = Manifest.from_parameters(named)
    cache = GradientCache([[(n, tuple(p.shape), p.dtype) for n, p in named]])
    session = EdgeSession(
        SessionOptions(gateway=f"tcp://127.0.0.1:{port}", client_id="e", timeout_s=0.2, heartbeat_s=0.2),
        manifest,
        cache,
    )
    session.start()

    def reply(route: bytes, msg: Message) -> None:
        router.send_multipart([route, *encode(msg)])

    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            if not router.poll(50):
                continue
            route, *frames = router.recv_multipart()
            msg = decode(frames, manifest=manifest)
            if isinstance(msg, Hello):
                reply(
                    route,
                    Welcome(
                        gateway_id="gw",
                        manifest_digest=manifest.digest,
                        model_version=0,
                        next_seq=1,
                        settings={"credit": 8, "window": 64, "push": "gradient"},
                    ),
                )
                if not session.cache.units[0].produced:  # one step, after the first welcome
                    session.cache.add(0, [torch.ones(2, 3), torch.ones(2)], base_version=0)
                    session.request_sync([0])
            elif isinstance(msg, Heartbeat):  # answered, with no verdict: push 1 is unknown here
                reply(route, Heartbeat(nonce=msg.nonce, reply=True, gateway_id="gw"))
            elif isinstance(msg, Push) and msg.attempt >= 1:
                code = "duplicate" if original_answer == "lost" else ""
                reply(route, Ack(seq=msg.seq, accepted=True, credit=8, code=code, attempt=0, gateway_id="gw"))
                wait = time.monotonic() + 5
                while session.cache.undelivered() and time.monotonic() < wait:
                    time.sleep(0.01)
                assert session.cache.undelivered() == 0
                return session
        raise AssertionError("the edge never sent push 1 again")
    finally:
        session.close()
        router.close()


def test_a_resend_whose_answer_says_the_original_was_applied_but_unanswered_keeps_resends_fast() -> None:
    # The re-send is what got the verdict through: the link loses messages.  Counted as a late
    # original (the interval doubled), 21% of pushes at 30% loss each way backed re-sends off to
    # seconds on loopback.
    session = _scripted_resend("lost")
    assert session.loses_messages
    assert session.resend_s <= session.options.timeout_s


def test_an_original_answered_after_its_resend_backs_resends_off() -> None:
    session = _scripted_resend("late")
    assert not session.loses_messages
    assert session.resend_s == 2 * session.options.timeout_s
