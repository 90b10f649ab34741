"""The edge's save policy and the gateway's commits (edge/durability.py), on a real cache, real
flights and a real state directory, without a session or a link."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from elasticfed.edge.cache import GradientCache
from elasticfed.edge.durability import SAVE_RETRY_S, Durability
from elasticfed.edge.flights import Flights
from elasticfed.edge.metrics import EdgeMetrics
from elasticfed.edge.persistence import EdgeState
from elasticfed.protocol import Manifest

PARAMS = [("w", torch.zeros(4)), ("b", torch.zeros(2))]


class Edge:
    """What a session lends its durability: the next seq, and taking pending sums into flights."""

    def __init__(self, state_dir: Path | None, persist_every_s: float = 10.0) -> None:
        self.cache = GradientCache([[(n, tuple(p.shape), p.dtype)] for n, p in PARAMS])
        self.flights = Flights(self.cache)
        self.metrics = EdgeMetrics()
        state = EdgeState(str(state_dir), "edge-0") if state_dir is not None else None
        manifest = Manifest.from_parameters(PARAMS)
        self.durability = Durability(
            self.cache, self.flights, manifest, state, persist_every_s, self.metrics, now=0.0
        )
        self.seq = 1

    def train(self, u: int, steps: int = 1) -> None:
        for _ in range(steps):
            self.cache.add(u, [torch.ones(self.cache.units[u].numel)], base_version=0)

    def take_pending(self, now: float) -> int:
        for u, unit in enumerate(self.cache.units):
            if unit.flight is None and unit.pending_count:
                flight = self.cache.take(u, self.seq, now, timeout_s=1.0)
                assert flight is not None
                self.flights.add(u, flight)
                self.seq += 1
        return self.seq

    def save(self, now: float, force: bool = False) -> bool:
        return self.durability.save(now, self.seq, self.take_pending, force)

    def saves(self) -> int:
        return int(self.metrics.registry.snapshot()["edge_state_saves_total"].get("_", 0))  # type: ignore[arg-type]


def test_a_save_records_pending_sums_as_flights_and_skips_when_nothing_changed(tmp_path: Path) -> None:
    edge = Edge(tmp_path)
    edge.train(0, steps=3)
    assert edge.save(1.0)
    assert edge.saves() == 1 and len(edge.flights) == 1  # the pending sum left as a flight, saved
    assert edge.durability.resolved_below(edge.seq) == 1  # the saved flight may come again
    assert edge.save(2.0) and edge.saves() == 1  # nothing changed: no write (the period restarts)
    edge.train(1)
    edge.durability.tick(11.9, edge.seq, window=1024, take_pending=edge.take_pending)
    assert edge.saves() == 1  # changed, but the period (10 s) is not over
    edge.durability.tick(12.0, edge.seq, window=1024, take_pending=edge.take_pending)
    assert edge.saves() == 2

    edge.durability.close()  # as the process ends
    again = Edge(tmp_path)  # a restart finds both flights, weak, with their seqs
    loaded = again.durability.load(seq=1, now=20.0)
    assert loaded is not None and loaded.seq == 3 and sorted(loaded.flights) == [1, 2]
    assert len(again.flights) == 2 and again.durability.resolved_below(3) == 1


def test_a_failed_forced_save_holds_sending_and_is_tried_again(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    edge = Edge(directory)
    edge.train(0)
    shutil.rmtree(directory)
    directory.write_bytes(b"")  # a file where the directory was: every write fails (even as root)
    assert not edge.save(1.0, force=True)
    assert edge.durability.must_save and edge.saves() == 0
    assert edge.durability.wake_times() == [11.0, 1.0 + SAVE_RETRY_S]
    directory.unlink()
    directory.mkdir()
    edge.durability.tick(1.0 + SAVE_RETRY_S - 0.01, edge.seq, window=1024, take_pending=edge.take_pending)
    assert edge.durability.must_save  # not before its retry time
    edge.durability.tick(1.0 + SAVE_RETRY_S, edge.seq, window=1024, take_pending=edge.take_pending)
    assert not edge.durability.must_save and edge.saves() == 1


def test_a_used_half_window_asks_for_a_save_that_frees_it(tmp_path: Path) -> None:
    edge = Edge(tmp_path, persist_every_s=3600.0)
    edge.train(0)
    assert edge.save(0.0)
    assert edge.durability.resolved_below(edge.seq) == 1
    (u, flight), *_ = list(edge.flights)
    edge.flights.answered(flight.seq)
    edge.cache.resolve(u)
    edge.seq = 9  # 8 seqs used since the save, of a window of 16: half
    assert edge.durability.resolved_below(edge.seq) == 1  # the gateway keeps what the save could re-send
    edge.durability.tick(1.0, edge.seq, window=64, take_pending=edge.take_pending)
    assert edge.saves() == 1  # a quarter of a larger window: no need yet
    edge.durability.tick(1.0, edge.seq, window=16, take_pending=edge.take_pending)
    assert edge.saves() == 2 and edge.durability.resolved_below(edge.seq) == 9


def test_commits_release_held_sums_once_and_a_dead_instances_go_back_to_pending() -> None:
    edge = Edge(None)
    for u, (instance, epoch) in enumerate([("gw-a", 3), ("gw-b", 5)]):
        edge.train(u, steps=2)
        edge.take_pending(0.0)
        hold = edge.durability.hold(instance, epoch)
        assert hold == (instance, epoch)
        edge.flights.answered(edge.seq - 1)
        edge.cache.resolve(u, hold)
    assert edge.cache.held_steps() == 4

    assert edge.durability.commit("gw-a", 2) == [0, 0]  # an older checkpoint holds none of it
    assert edge.durability.commit("gw-a", 3) == [2, 0]
    assert edge.durability.commit("gw-a", 3) == [0, 0]  # a repeated commit changes nothing
    assert edge.durability.hold("gw-a", 3) is None  # a late verdict for a checkpoint on disk
    assert edge.durability.hold("gw-a", 4) == ("gw-a", 4)
    assert edge.durability.hold("", 4) is None and edge.durability.hold("gw-a", 0) is None

    # A welcome from gw-c: gw-b wrote checkpoints through 4 only, so its epoch-5 sum died with it.
    released, moved = edge.durability.lost([("gw-b", 4), ("gw-c", 1)], alive="gw-c")
    assert released == [0, 0] and moved == [0, 2]
    unit = edge.cache.units[1]
    assert unit.pending_count == 2 and not unit.held and edge.cache.held_steps() == 0
    assert torch.equal(unit.pending, torch.full((2,), 2.0))
    assert edge.cache.units[0].durable == 2
