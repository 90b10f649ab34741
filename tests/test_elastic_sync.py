"""The Elastic Sync Protocol end to end: real edge processes, real ZeroMQ sockets on loopback.

(a) lossless: the model after a round equals the hand-computed success-weighted step;
(b) 30% bursty loss: every step-gradient is applied exactly once, or dropped as too stale and reported;
(c) duplication and reordering: nothing counts twice;
(d) a 10 s outage (50x the deadline): training goes on, memory stays bounded, all is delivered after;
(e) the gateway is killed and started again: edges find it without help.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import edge_cases
import pytest
import torch
from fleet import applied_by_layer, audit, edge, free_port, gateway_process, gateway_thread, model_bytes

from elasticfed.cloud.aggregation import DeadlineQuorum, MeanStep
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.common.checkpoint import read_tensors
from elasticfed.common.tasks.digits import build_model
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.cache import MAX_HELD
from elasticfed.edge.session import EdgeRefused, SessionOptions

pytestmark = pytest.mark.slow


def test_a_lossless_round_equals_the_hand_computed_success_weighted_step(tmp_path: Path) -> None:
    model = edge_cases.small_model()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    gateway = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        weighting=MeanStep(),
        rounds=DeadlineQuorum(deadline_s=120.0, quorum=2),  # the round waits for both edges
    )
    stop = threading.Event()
    # Serve until the edges are done: a gateway that stops right after the round can take the
    # last acks with it (an edge with ZMQ_IMMEDIATE drops unread replies when the peer goes).
    serving = threading.Thread(target=gateway.serve, args=(stop,), daemon=True)
    serving.start()
    endpoint = gateway.wait_bound(10)
    ctx = mp.get_context("spawn")
    runs = {"a": (1, 11), "b": (3, 12)}  # client: (steps = count of its one push, data seed)
    procs = [
        ctx.Process(
            target=edge_cases.exact_edge, args=(endpoint, c, steps, seed, str(tmp_path / f"{c}.safetensors"))
        )
        for c, (steps, seed) in runs.items()
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    stop.set()
    serving.join(30)
    assert not serving.is_alive() and gateway.version == 1  # one round: both edges, once each
    pushed = {c: read_tensors(tmp_path / f"{c}.safetensors", kind="test-edge-sums") for c in runs}
    assert all(meta["delivered"] for _, meta in pushed.values())
    total = sum(meta["count"] for _, meta in pushed.values())
    assert total == 4
    for name, param in model.named_parameters():
        average = sum(sums[name] for sums, _ in pushed.values()) / total
        torch.testing.assert_close(param.detach(), w0[name] - 0.5 * average, rtol=0, atol=1e-6)
    # ...and the gateway counted each edge's steps with their weight.
    status = gateway.status()
    assert applied_by_layer(status, "b", "gateway_applied_steps_total") == {n: 3 for n in w0}


def test_bursty_loss_every_step_gradient_is_applied_exactly_once_or_reported_stale() -> None:
    with gateway_thread(quorum=2, round_deadline_s=0.2, max_staleness=3) as gateway:
        faults = "loss=0.3,burst=3,seed={}"
        edges = [
            edge(gateway.bound_endpoint, f"lossy-{i}", "--faults", faults.format(i),
                 "--train-max-steps", "300", "--timeout-ms", "100", "--heartbeat-ms", "300",
                 "--train-shard", f"{i}/3")
            for i in range(3)
        ]  # fmt: skip
        summaries = [e.summary(timeout=120) for e in edges]
        status = gateway.status()
    for s in summaries:
        audit(status, s)
        assert s["steps"] == 300
    # The loss was real and the protocol worked for its living: weak syncs, re-sends, lost messages.
    assert sum(s["link_up"]["lost"] + s["link_down"]["lost"] for s in summaries) > 20
    assert sum(s["edge_weak_syncs_total"] for s in summaries) > 0
    assert sum(s["edge_retransmissions_total"] for s in summaries) > 0


def test_duplicated_and_reordered_messages_count_once() -> None:
    # Steps enough for 27-69 messages each (measured): 300 took a second, in which an edge that
    # re-sends a weak push only on an answer (over TCP) sent 9, none duplicated in 1 run of 2.
    with gateway_thread(quorum=1, round_deadline_s=0.2, max_staleness=1000) as gateway:
        faults = "duplicate=0.3,reorder=0.3,delay_ms=2,jitter_ms=2,seed={}"
        edges = [
            edge(gateway.bound_endpoint, f"dup-{i}", "--faults", faults.format(i),
                 "--train-max-steps", "3000", "--timeout-ms", "200", "--train-shard", f"{i}/2")
            for i in range(2)
        ]  # fmt: skip
        summaries = [e.summary(timeout=120) for e in edges]
        status = gateway.status()
    for s in summaries:
        audit(status, s)
        assert sum(s["dropped_stale_steps"].values()) == 0
        assert s["link_up"]["duplicated"] > 0 and s["link_up"]["reordered"] > 0, s["link_up"]
    assert sum(status["metrics"]["gateway_duplicates_total"].values()) > 0  # duplicates did arrive


def test_a_long_outage_trains_on_in_bounded_memory_and_delivers_everything_after() -> None:
    outage_start, outage_s, timeout_ms = 3.0, 10.0, 200
    with gateway_thread(quorum=1, round_deadline_s=0.2, max_staleness=1_000_000) as gateway:
        down = edge(
            gateway.bound_endpoint, "outage", "--faults", f"outage={outage_start}+{outage_s}",
            "--train-duration-s", "16", "--train-epochs", "100000", "--timeout-ms", str(timeout_ms),
            "--heartbeat-ms", "300", "--status-every-s", "0.25", "--train-shard", "0/2",
        )  # fmt: skip
        healthy = edge(
            gateway.bound_endpoint, "healthy", "--train-duration-s", "16", "--train-epochs", "100000",
            "--timeout-ms", str(timeout_ms),
            "--train-shard", "1/2",
        )  # fmt: skip
        summary = down.summary(timeout=120)
        healthy_summary = healthy.summary(timeout=60)
        status = gateway.status()
    audit(status, summary)
    audit(status, healthy_summary)
    assert summary["link_up"]["lost_in_outage"] > 0 and summary["edge_reconnects_total"] >= 1

    # During the outage (by the link's clock, which starts before training's): steps go on,
    # nothing is delivered, the undelivered count grows, and memory stays within two buffers per unit.
    inside = [
        s for s in down.statuses() if outage_start + 0.5 <= s["link_t"] <= outage_start + outage_s - 0.5
    ]
    assert len(inside) >= 10
    first, last = inside[0], inside[-1]
    assert last["edge_delivered_steps_total"] == first["edge_delivered_steps_total"]
    assert last["undelivered_steps"] > first["undelivered_steps"]
    trained = last["steps"] - first["steps"]
    # Had each step waited for its deadline, at most (window / deadline) steps would fit in the window.
    waited_bound = (last["t"] - first["t"]) / (timeout_ms / 1000)
    assert trained > 5 * waited_bound, (trained, waited_bound)
    # Pending and one unanswered send per unit, and under the default `auto` compression the
    # residual and the flight's encoded payload (at most dense); nothing is held until durable (no
    # checkpoints here).
    dense = model_bytes(build_model())
    assert summary["cache_bound_bytes"] == (2 + MAX_HELD + 2) * dense
    assert max(s["cache_bytes"] for s in down.statuses()) <= 4 * dense


def test_edges_find_a_restarted_gateway_without_help() -> None:
    port = free_port()
    first = gateway_process(port, "--gateway-quorum", "1", "--gateway-round-deadline-s", "0.2")
    first.wait_for(lambda e: e.get("event") == "ready", 60, "a ready event")
    endpoint = f"tcp://127.0.0.1:{port}"
    flags = "--train-epochs 100000 --timeout-ms 200 --heartbeat-ms 200"  # until told to stop
    flags += " --status-every-s 0.2"
    edges = [edge(endpoint, f"restart-{i}", *flags.split(), "--train-shard", f"{i}/2") for i in range(2)]
    for e in edges:
        e.wait_for(
            lambda s: s.get("event") == "status" and s["version"] >= 3, 60, "a model from the first gateway"
        )
    first.signal(signal.SIGKILL)
    first.proc.wait(10)
    killed_at = {e.name: len(e.statuses()) for e in edges}
    second = gateway_process(port, "--gateway-quorum", "1", "--gateway-round-deadline-s", "0.2")
    second.wait_for(lambda e: e.get("event") == "ready", 60, "a ready event")
    for e in edges:
        # Deliveries resume: the delivered count grows past its value at the kill.
        before = e.statuses()[killed_at[e.name] - 1]["edge_delivered_steps_total"]
        e.wait_for(
            lambda s, b=before: s.get("event") == "status" and s["edge_delivered_steps_total"] > b + 50,
            60,
            "deliveries to the new gateway",
        )
    for e in edges:
        e.signal(signal.SIGTERM)  # stop training, deliver what is cached, exit 0
    summaries = [e.summary(timeout=90) for e in edges]
    second.signal(signal.SIGTERM)
    gw = second.summary(timeout=30)
    assert sorted(gw["clients"]) == ["restart-0", "restart-1"]
    for s in summaries:
        assert s["delivered_all"] and s["undelivered_steps"] == 0
        applied = {k: v for k, v in gw["applied_steps"].items() if k.startswith(f"client={s['client']},")}
        assert applied and min(applied.values()) > 0
    assert gw["version"] > 0


def test_an_edge_with_a_different_model_is_refused_with_the_first_difference() -> None:
    with gateway_thread() as gateway:
        wrong = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 9))
        agent = ElasticEdge(wrong, SessionOptions(gateway=gateway.bound_endpoint, client_id="wrong"))
        try:
            first = r"entry 0: ours is 4.bias \[10\] float32, theirs is 2.bias \[9\]"
            with pytest.raises(EdgeRefused, match=first):
                agent.wait_ready(timeout_s=10)
        finally:
            agent.close()


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@contextmanager
def digits_edge(client_id: str, local_steps: int) -> Iterator[tuple[ElasticEdge, torch.nn.Module]]:
    """A ready digits edge on a gateway that closes a round per push; it must deliver all at the end."""
    with gateway_thread(quorum=1, round_deadline_s=0.05) as gateway:
        torch.manual_seed(0)
        model = build_model()
        options = SessionOptions(gateway=gateway.bound_endpoint, client_id=client_id)
        agent = ElasticEdge(model, options, local_steps=local_steps)
        try:
            assert agent.wait_ready(timeout_s=30)
            yield agent, model
        except BaseException:
            agent.close()
            raise
        assert agent.close(drain_s=30)


def test_an_edge_adopts_a_newer_model_only_after_its_local_steps() -> None:
    # Each step waits until a newer version is announced, and the step that may adopt until it
    # has come: adopting whenever one is here, every gap would be one step (plain SGD between
    # models: momentum restarts with each).
    with digits_edge("local", local_steps=4) as (agent, _):
        x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        adopted_at: list[int] = []
        while len(adopted_at) < 4:
            if agent.since_adopted >= agent.local_steps:
                wait_for(lambda: agent.session.have_version > agent.version, "a newer model in time")
            before = agent.models_adopted
            loss = torch.nn.functional.cross_entropy(agent(x), y)  # forward: adopts if it may
            if agent.models_adopted > before:
                adopted_at.append(agent.steps)
            loss.backward()
            wait_for(lambda: agent.session.announced > agent.version, "a newer version announced")
        assert [b - a for a, b in zip(adopted_at, adopted_at[1:])] == [4, 4, 4], adopted_at


def test_an_edge_fetches_only_the_models_it_will_adopt() -> None:
    # A version is published after every step and announced in its ack; an edge that adopts
    # nothing for 1000 steps fetches none of them (it fetched each before: 20 of 20).
    with digits_edge("lazy", local_steps=1000) as (agent, _):
        x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        torch.nn.functional.cross_entropy(agent(x), y).backward()
        wait_for(lambda: agent.session.have_version > agent.version, "the first model")
        agent(x)  # the first model is adopted at once
        assert agent.models_adopted == 1
        received = agent.session.metrics.models.get()
        for _ in range(20):
            announced = agent.session.announced
            torch.nn.functional.cross_entropy(agent(x), y).backward()
            wait_for(lambda seen=announced: agent.session.announced > seen, "the next version announced")
        # Until two steps are timed the session fetches as soon as announced (nothing to plan with).
        assert agent.session.metrics.models.get() - received <= 2
        assert agent.models_adopted == 1


def test_a_diverged_edge_adopts_the_next_model_without_its_local_steps() -> None:
    with digits_edge("nan", local_steps=1000) as (agent, model):
        x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        torch.nn.functional.cross_entropy(agent(x), y).backward()
        wait_for(lambda: agent.session.have_version > agent.version, "a newer model")
        agent(x)  # the first model is adopted at once
        assert agent.models_adopted == 1
        with torch.no_grad():
            next(model.parameters()).fill_(float("nan"))
        torch.nn.functional.cross_entropy(agent(x), y).backward()
        assert agent.nonfinite_steps == 1
        wait_for(lambda: agent.adopt_newest() or agent.models_adopted == 2, "the model fetched again")
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_step_with_nan_gradients_is_not_sent_and_the_global_model_comes_back() -> None:
    """A local model that diverged must neither crash the agent nor poison its cache."""
    with gateway_thread() as gateway:
        torch.manual_seed(0)
        model = build_model()
        agent = ElasticEdge(model, SessionOptions(gateway=gateway.bound_endpoint, client_id="nan"))
        try:  # close() once: a second close of a closed session is not supported
            assert agent.wait_ready(timeout_s=30)
            x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
            torch.nn.functional.cross_entropy(agent(x), y).backward()  # a good step
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))  # the local model diverges
            torch.nn.functional.cross_entropy(agent(x), y).backward()
            assert agent.nonfinite_steps == 1
            assert all(unit.produced == 1 for unit in agent.cache.units)  # only the good step
            # The global model is fetched again and adopted: the local copy is finite once more.
            deadline = time.monotonic() + 30
            while agent.models_adopted == 0 and time.monotonic() < deadline:
                agent.adopt_newest()
                agent.session.raise_if_failed()
                time.sleep(0.01)
            assert agent.models_adopted == 1
            assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
            delivered = agent.close(drain_s=30)
        except BaseException:
            agent.close()
            raise
        assert delivered  # the good step is delivered; nothing failed
        assert gateway.status()["history_applied_steps"]["nan"] == {n: 1 for n in gateway.names}
