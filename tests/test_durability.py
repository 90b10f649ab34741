"""Durability: acknowledged vs durable, gateway crashes, edge restarts, torn edge state.

Real sockets and a real edge session (its I/O thread); the gateway is pumped by
a thread of this process so that a crash can be exact: the pump stops and the
socket closes without the clean stop's checkpoint, as after kill -9.  The
multi-process version with real kill -9 is tests/test_chaos.py.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fleet import Proc, edge, free_port, on_pump, pumped
from torch import nn

from elasticfed.cloud.aggregation import DeadlineQuorum
from elasticfed.cloud.durability import KIND, GatewayCheckpoints, encode
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.common.checkpoint import CheckpointError, read_tensors
from elasticfed.common.cli import main as cli_main
from elasticfed.edge.cache import GradientCache
from elasticfed.edge.persistence import KIND as EDGE_KIND
from elasticfed.edge.persistence import EdgeState
from elasticfed.edge.persistence import export_state as export_edge_state
from elasticfed.edge.session import EdgeSession, SessionOptions
from elasticfed.protocol import Manifest

LR = 0.5
CLIENT = "jetson-1"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def make_gateway(directory: Path, endpoint: str, every_rounds: int = 1000, idle_s: float = 3600.0) -> Gateway:
    """Saves every `every_rounds` rounds and after `idle_s` without one: by default never while
    idle, so that what a test sees is not moved by a save that a slow machine let happen."""
    model = make_model()
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        GatewayOptions(bind=endpoint),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=1),
        checkpoints=GatewayCheckpoints(str(directory), every_rounds=every_rounds, idle_s=idle_s),
    )
    gw.restore()
    return gw


def edge_session(endpoint: str, state_dir: Path | None = None) -> EdgeSession:
    model = make_model()
    named = list(model.named_parameters())
    cache = GradientCache([[(n, tuple(p.shape), p.dtype) for n, p in named]])
    options = SessionOptions(
        gateway=endpoint,
        client_id=CLIENT,
        timeout_s=0.3,
        heartbeat_s=0.1,
        liveness=20,  # a checkpoint's fsyncs on a busy disk are not a dead gateway
        reconnect_first_s=0.05,
        reconnect_cap_s=0.2,
        state_dir=str(state_dir) if state_dir is not None else "",
        persist_every_s=3600.0,  # saves are explicit in these tests
    )
    session = EdgeSession(options, Manifest.from_parameters(model.named_parameters()), cache)
    session.start()
    return session


def push(session: EdgeSession, value: float, sync: bool = True) -> None:
    """One step-gradient whose every entry is `value`."""
    grads = [torch.full((2, 3), value), torch.full((2,), value)]  # weight, bias
    session.cache.add(0, grads, base_version=session.have_version)
    if sync:
        session.request_sync([0])


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def crash(session: EdgeSession) -> None:
    """The edge as after kill -9: the I/O thread stops; nothing is saved, nothing is drained."""
    session._stop.set()
    session.link.wake()
    session._thread.join(10)  # the I/O thread closes the link as it ends; nothing more
    if session.state is not None:
        session.state.store.close()  # as the kernel does for a process that died


def expected(*values: float) -> torch.Tensor:
    """The weight after one SGD step per value (each round averages one push of count 1)."""
    weight = make_model().weight.detach().clone()
    for v in values:
        weight -= LR * v
    return weight


def applied(gw: Gateway) -> list[int]:
    return list(gw.applied_steps.get(CLIENT, [0, 0]))


def test_acknowledged_but_not_durable_pushes_are_sent_again_after_a_gateway_crash(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = make_gateway(tmp_path, endpoint)
    session = edge_session(endpoint)
    try:
        with pumped(first):
            push(session, 1.0)
            wait_for(lambda: first.version == 1, "round 1")
            on_pump(first, first.checkpoint)  # a commit goes out
            wait_for(lambda: session.cache.units[0].durable == 1, "the commit of version 1")
            push(session, 10.0)
            wait_for(lambda: first.version == 2 and session.cache.held_steps() == 1, "an ack of push 2")
            assert session.cache.units[0].held[0].epoch == 2  # durable once checkpoint 2 is written
        # Crashed before writing version 2: the second push was acknowledged, then lost.
        second = make_gateway(tmp_path, endpoint)
        assert second.version == 1 and second.lineage == {first.gateway_id: 1}
        with pumped(second):
            wait_for(lambda: second.version == 2, "the lost push, sent again and applied")
            on_pump(second, second.checkpoint)
            wait_for(lambda: session.cache.units[0].durable == 2, "the commit of version 2")
            assert session.cache.held_steps() == 0 and session.cache.undelivered() == 0
            assert applied(second) == [2, 2]  # once each, over the checkpointed history
            assert torch.equal(second.model.weight.detach(), expected(1.0, 10.0))
            lost = session.metrics.resent_lost.get("weight")
            assert lost == 1, "the edge counts what a dead gateway lost"
    finally:
        session.close()


def test_a_checkpoint_whose_commit_never_arrived_is_not_applied_twice(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = make_gateway(tmp_path, endpoint)
    session = edge_session(endpoint)
    try:
        with pumped(first):
            push(session, 1.0)
            wait_for(lambda: first.version == 1 and session.cache.held_steps() == 1, "an ack of push 1")
            # Written, then the gateway dies before it can say so.
            tensors, meta = encode(first.state())
            first.checkpoints.store.save(first.version, tensors, meta)  # type: ignore[union-attr]
        second = make_gateway(tmp_path, endpoint)
        assert second.version == 1
        with pumped(second):
            wait_for(lambda: session.cache.units[0].durable == 1, "the welcome saying version 1 is on disk")
            assert session.cache.held_steps() == 0
            push(session, 3.0)  # the link works: the next push is applied; the first is not again
            wait_for(lambda: second.version == 2, "round 2")
            assert applied(second) == [2, 2]
            assert torch.equal(second.model.weight.detach(), expected(1.0, 3.0))
    finally:
        session.close()


def test_an_edge_killed_after_saving_does_not_count_a_sum_twice(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gw = make_gateway(tmp_path / "gateway", endpoint, every_rounds=1)
    state = tmp_path / "edge"
    with pumped(gw):
        session = edge_session(endpoint, state)
        push(session, 1.0)
        wait_for(lambda: session.cache.units[0].durable == 1, "push 1 durable")
        push(session, 5.0, sync=False)
        assert session.save_now()  # the sum is saved as a flight with its seq (sent right after)
        session.request_sync([0])
        wait_for(lambda: session.cache.units[0].durable == 2, "the saved sum applied and durable")
        crash(session)  # killed: the file holds the sum as an unanswered flight
        duplicates_before = gw.metrics.duplicates.get(CLIENT)

        again = edge_session(endpoint, state)
        try:
            unit = again.cache.units[0]
            assert again.state is not None and again.state.loaded is not None
            wait_for(
                lambda: again.cache.undelivered() == 0 and unit.durable == 2, "the reloaded sum answered"
            )
            assert gw.metrics.duplicates.get(CLIENT) == duplicates_before + 1  # recognised by its seq
            assert applied(gw) == [2, 2] and gw.version == 2
            assert torch.equal(gw.model.weight.detach(), expected(1.0, 5.0))
            push(again, 2.0)  # and new seqs are fresh
            wait_for(lambda: unit.durable == 3, "a new push after the restart")
            assert applied(gw) == [3, 3]
        finally:
            again.close()


def test_an_edge_that_lost_its_state_gets_fresh_seqs_from_the_welcome(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gw = make_gateway(tmp_path, endpoint, every_rounds=1)
    with pumped(gw):
        session = edge_session(endpoint)
        for value in (1.0, 2.0, 3.0):
            push(session, value)
            wait_for(lambda: session.cache.undelivered() == 0, "an answer")
        crash(session)
        fresh = edge_session(endpoint)  # no state directory: starts at seq 1
        try:
            wait_for(lambda: fresh.welcomed, "a welcome")
            assert fresh.seq >= 4
            push(fresh, 4.0)
            wait_for(lambda: applied(gw) == [4, 4], "the new push applied, not taken for a duplicate")
            assert gw.metrics.duplicates.get(CLIENT) == 0
        finally:
            fresh.close()


@pytest.mark.parametrize("damage", ["truncate", "random", "other_model", "other_device", "bad_lr"])
def test_a_torn_or_foreign_edge_state_is_refused_and_the_previous_one_loaded(
    tmp_path: Path, damage: str
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: everything stays cached
    session = edge_session(endpoint, tmp_path)
    push(session, 1.0, sync=False)
    assert session.save_now()
    push(session, 1.0, sync=False)
    assert session.save_now()
    crash(session)
    assert session.state is not None
    newest, older = session.state.store.entries()
    if damage == "truncate":
        newest.write_bytes(newest.read_bytes()[:-7])
    elif damage == "random":
        newest.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    elif damage == "bad_lr":
        # Whole and of this device, but its sums claim a rate unit no optimizer runs at.
        store = EdgeState(str(tmp_path), CLIENT).store
        tensors, meta = read_tensors(newest, EDGE_KIND)
        store.save(int(newest.name.split("-")[-1].split(".")[0]), tensors, {**meta, "lr": -0.5})
        store.close()
    else:
        # A whole, valid file of another model or another device under this device's name.
        other = nn.Linear(3, 3) if damage == "other_model" else make_model()
        named = list(other.named_parameters())
        cache = GradientCache([[(n, tuple(p.shape), p.dtype) for n, p in named]])
        options = SessionOptions(
            gateway=endpoint, client_id=CLIENT if damage == "other_model" else "someone-else"
        )
        stranger = EdgeSession(options, Manifest.from_parameters(other.named_parameters()), cache)
        stranger.cache.add(0, [torch.ones(p.shape) for _, p in named], 0)
        tensors, meta = export_edge_state(stranger.cache, options.client_id, stranger.manifest, stranger.seq)
        store = EdgeState(str(tmp_path), CLIENT).store
        store.save(int(newest.name.split("-")[-1].split(".")[0]), tensors, meta)
        store.close()
        stranger.close()

    again = edge_session(endpoint, tmp_path)
    try:
        assert again.state is not None
        assert again.state.loaded == older
        assert [p for p, _ in again.state.skipped] == [newest]
        reason = again.state.skipped[0][1]
        assert str(newest) in reason
        expect = {
            "truncate": "",
            "random": "",
            "other_model": "another model",
            "other_device": "saved by device 'someone-else'",
            "bad_lr": "lr -0.5 is not a learning rate",
        }[damage]
        assert expect in reason
        assert again.cache.units[0].pending_count == 1  # the older save: one step
        assert torch.equal(again.cache.units[0].pending[:6], torch.ones(6))
    finally:
        again.close()


def test_the_rate_unit_of_saved_sums_survives_a_restart(tmp_path: Path) -> None:
    """Sums are in units of the first rate the edge ran at (edge/agent.py); a restart at another
    rate must not reinterpret the sums it reloads."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: everything stays cached
    session = edge_session(endpoint, tmp_path)
    assert session.cache.rate_unit(0.2) == 0.2
    push(session, 1.0, sync=False)
    assert session.save_now()
    crash(session)
    again = edge_session(endpoint, tmp_path)
    try:
        assert again.cache.lr == 0.2
        assert again.cache.rate_unit(0.05) == 0.2  # a later, smaller rate does not move the unit
    finally:
        again.close()


def test_a_second_gateway_or_edge_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    first = GatewayCheckpoints(str(tmp_path))
    with pytest.raises(CheckpointError, match="another process is using this directory"):
        GatewayCheckpoints(str(tmp_path))
    first.store.close()  # what process exit does
    GatewayCheckpoints(str(tmp_path)).store.close()
    edge = EdgeState(str(tmp_path), CLIENT)
    with pytest.raises(CheckpointError, match="another process is using this directory"):
        EdgeState(str(tmp_path), CLIENT)
    EdgeState(str(tmp_path), "another-device").store.close()  # one directory, several devices
    edge.store.close()


@pytest.mark.parametrize("idle_before_push", [False, True])
def test_the_last_rounds_of_a_fleet_that_went_quiet_become_durable_without_more_rounds(
    tmp_path: Path, idle_before_push: bool
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gw = make_gateway(tmp_path, endpoint)  # every 1000 rounds: only idleness can trigger a save
    checkpoints = gw.checkpoints
    assert checkpoints is not None
    session = edge_session(endpoint)
    try:
        with pumped(gw):
            if idle_before_push:  # what a slow start does: the untouched model is saved first
                checkpoints.idle_s = 0.2
                wait_for(lambda: checkpoints.saved_version == 0, "the idle save of version 0")
                checkpoints.idle_s = 3600.0
            push(session, 1.0)
            wait_for(lambda: gw.version == 1 and session.cache.held_steps() == 1, "an ack")
            assert session.cache.units[0].durable == 0  # acknowledged, not on disk
            checkpoints.idle_s = 0.2  # the fleet goes quiet
            wait_for(lambda: session.cache.units[0].durable == 1, "the commit once the gateway is idle")
            # After an idle save of version 0 the epoch is 2: what matters is version 1 on disk.
            assert checkpoints.saved_version == 1 and checkpoints.last_saved is not None
            _, meta = read_tensors(checkpoints.last_saved, KIND)
            assert meta["version"] == 1 and meta["epoch"] == gw.durable_epoch
    finally:
        session.close()


def test_a_sum_saved_before_any_welcome_is_not_taken_for_a_duplicate_later(tmp_path: Path) -> None:
    # Run 1 uses seq 2 after its last save and dies; run 2 reloads (seq counter 2), is never
    # welcomed, trains and saves; run 3 must not send run 2's sum as seq 2 (applied already).
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    state = tmp_path / "edge"
    with pumped(make_gateway(tmp_path / "gateway", endpoint, every_rounds=1)) as gw:
        first = edge_session(endpoint, state)
        push(first, 1.0)
        wait_for(lambda: first.cache.units[0].durable == 1, "push 1 durable")
        assert first.save_now()
        push(first, 2.0)  # seq 2, after the save
        wait_for(lambda: first.cache.units[0].durable == 2 and gw.version == 2, "push 2 durable")
        crash(first)
    second = edge_session(endpoint, state)  # nobody listens
    push(second, 5.0, sync=False)
    assert second.save_now()
    unit = second.cache.units[0]
    assert unit.flight is None and unit.pending_count == 1  # saved as pending: no seq can be trusted yet
    crash(second)
    # Reloaded before the gateway is back: welcomed at once, the session could send the sum before
    # the check (it did, once, on a loaded machine).
    third = edge_session(endpoint, state)
    reloaded = third.cache.units[0].pending_count
    with pumped(make_gateway(tmp_path / "gateway", endpoint, every_rounds=1)) as gw:
        try:
            assert reloaded == 1
            wait_for(lambda: gw.version == 3, "run 2's sum applied")
            assert applied(gw) == [3, 3] and gw.metrics.duplicates.get(CLIENT) == 0
            assert torch.equal(gw.model.weight.detach(), expected(1.0, 2.0, 5.0))
        finally:
            third.close()


def test_sigterm_saves_the_edge_state_and_the_next_start_loads_it_even_before_training(
    tmp_path: Path, procs: list[Proc]
) -> None:
    # Nobody listens: everything the agent trains stays cached, and must survive the restart.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    flags = ["--state-dir", str(tmp_path), "--persist-every-s", "3600", "--drain-s", "0.5"]
    first = edge(endpoint, "sigterm", "--train-epochs", "100000", "--status-every-s", "0.05", *flags)
    procs.append(first)
    first.wait_for(lambda e: e.get("event") == "status" and e["steps"] >= 20, 60, "20 steps")
    first.signal(signal.SIGTERM)
    assert first.proc.wait(60) == 5  # exit 5: stopped with gradients undelivered (and saved)
    summary = first.wait_for(lambda e: e.get("event") == "summary", 10, "a summary")
    assert summary["undelivered_steps"] == summary["steps"] >= 20  # saved at exit, not on a timer
    # A long --timeout-ms: it waits for the gateway (nobody) far longer than this test takes (and
    # heartbeats to match: a deadline past the connection's liveness is refused).
    slow = ["--timeout-ms", "60000", "--heartbeat-ms", "12000"]
    again = edge(endpoint, "sigterm", "--train-max-steps", "1", *slow, *flags)
    procs.append(again)
    start = again.wait_for(lambda e: e.get("event") == "start", 60, "a start event")
    assert start["resumed_from"] is not None and start["skipped_states"] == []
    assert start["undelivered_steps"] == summary["undelivered_steps"]
    assert start["produced_steps"] == summary["produced_steps"]
    # Stopped while it still waits for the gateway (before its first step): it trains nothing,
    # says so in a summary and keeps what it holds (exit 5), instead of dying of the signal.
    again.signal(signal.SIGTERM)
    assert again.proc.wait(60) == 5, again.stderr[-20:]
    stopped = again.wait_for(lambda e: e.get("event") == "summary", 10, "a summary")
    assert stopped["steps"] == 0 and stopped["undelivered_steps"] == summary["undelivered_steps"]


def test_a_gateway_directory_in_use_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    holder = GatewayCheckpoints(str(tmp_path))
    try:
        argv = [
            "cloud",
            "serve",
            "--mode",
            "standalone",
            "--insecure",
            "--gateway-checkpoint-dir",
            str(tmp_path),
        ]
        assert cli_main(argv) == 2
        assert "another process is using this directory" in capsys.readouterr().err
    finally:
        holder.store.close()
