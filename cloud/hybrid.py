"""Hybrid mode: torchrun workers train on cloud data, and edge rounds enter the same steps.

Follow one edge round from the gateway to every cloud rank:

1. Rank 0 hosts the gateway in a thread.  When a round closes, the gateway hands
   its per-layer averages to `EdgeRounds` (a short queue) instead of stepping an
   optimizer of its own: the cloud model has one owner, the training loop.
2. At the end of a cloud step, rank 0 takes the next round off the queue, if any,
   and tells every rank, in a two-number broadcast on a small gloo group of its
   own, whether the next step mixes a round (and whether to stop).  The
   broadcast is launched at the end of one step and waited for at the start of
   the next, so it overlaps the data loading and costs no round trip.
3. In a mixing step every rank scales its loss by (1 - w), and rank 0 starts
   backward with `W * w * average` already in `.grad` (W ranks, w the mixing
   weight).  The layer-wise all-reduce averages over the ranks, so every rank
   ends with `(1 - w) * cloud mean + w * edge average`: the same bits on every
   rank, with neither the model nor the average broadcast.
4. Rank 0 publishes the model to the gateway (the snapshot edges download)
   before the first step, after each mixed round and at least every
   `publish_every_s`.  Each publish is a new version: the gateway announces it,
   edges download it, and staleness counts publishes behind.

At the end of the planned epochs the job goes on training (at the schedule's
last learning rate) while edges are still there: until the gateway has heard
nothing from any edge (pushes, heartbeats) for `idle_s`, at most `drain_s`.  Then rank 0 stops the gateway,
closes its open round, mixes what is queued, and every rank stops at the same
step.  SIGTERM on rank 0 takes the same way out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from elasticfed.cloud.gateway import Gateway
from elasticfed.common.metrics import Metrics

log = logging.getLogger("elasticfed.hybrid")


@dataclass
class EdgeRound:
    """A closed gateway round waiting for a cloud step."""

    numbers: list[int]  # gateway round numbers (more than one when rounds were merged)
    averages: list[torch.Tensor | None]
    layer_steps: list[int]
    # The newest checkpoint epoch whose state covers this round (0: none pending): no later round
    # may merge into it until that checkpoint is written (cloud/hybrid_checkpoints.py).
    sealed_by: int = 0


@dataclass(frozen=True)
class Position:
    """Where the training loop is, at a step boundary: what a checkpoint resumes from."""

    epoch: int  # epochs finished
    batches: int  # batches of the epoch under way already taken
    steps: int  # steps taken in all


class EdgeRounds:
    """The gateway's ModelUpdate in hybrid mode: closed rounds wait here for the trainer.

    Bounded: past `max_queued` rounds, a new round is added into the newest one
    (each average still enters the model once, with weight w), so memory stays
    at a few copies of the model however far the trainer falls behind.
    """

    publishes = False  # the trainer owns the model and publishes it

    def __init__(self, max_queued: int = 4) -> None:
        self.max_queued = max_queued
        self._queue: deque[EdgeRound] = deque()
        self._lock = threading.Lock()
        self.merged = 0

    def apply(
        self, round_number: int, averages: Sequence[torch.Tensor | None], layer_steps: Sequence[int]
    ) -> None:
        with self._lock:
            if len(self._queue) < self.max_queued:
                self._queue.append(EdgeRound([round_number], list(averages), list(layer_steps)))
                return
            last = self._queue[-1]
            if last.sealed_by:  # over the bound until that checkpoint is written
                self._queue.append(EdgeRound([round_number], list(averages), list(layer_steps)))
                return
            self.merged += 1
            last.numbers.append(round_number)
            for i, avg in enumerate(averages):
                if avg is not None:
                    last.averages[i] = avg if last.averages[i] is None else last.averages[i] + avg
                    last.layer_steps[i] += layer_steps[i]

    def take(self) -> EdgeRound | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def seal(self, epoch: int) -> None:
        """No later round merges into those queued now: checkpoint `epoch` covers them."""
        with self._lock:
            if self._queue:
                self._queue[-1].sealed_by = epoch

    def covered(self, last_round: int) -> list[EdgeRound]:
        """Copies of the queued rounds numbered up to `last_round`, oldest first (not taken):
        what a checkpoint written now holds besides the model.  Copies, taken under the lock: a
        round closing meanwhile cannot change what is written."""
        with self._lock:
            return [
                EdgeRound(list(r.numbers), list(r.averages), list(r.layer_steps))
                for r in self._queue
                if max(r.numbers) <= last_round
            ]

    def unseal(self, epoch: int) -> None:
        """Checkpoint `epoch` is written: lift its seals and older ones (a newer one's stay)."""
        with self._lock:
            for r in self._queue:
                if r.sealed_by <= epoch:
                    r.sealed_by = 0

    def restore(self, rounds: Sequence[EdgeRound]) -> None:
        """Queue a checkpoint's unmixed rounds ahead of any new one (at a start, before serving)."""
        with self._lock:
            self._queue.extendleft(reversed(list(rounds)))

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)


@dataclass
class MixingCounts:
    """What entered the cloud model from the edges (the audit's cloud side)."""

    rounds: int = 0
    mixing_steps: int = 0
    steps_by_layer: list[int] = field(default_factory=list)


class StepCheckpoints(Protocol):
    """Checkpoints written between steps (cloud/hybrid_checkpoints.py)."""

    def cut(self, position: Position, counts: MixingCounts, served_version: int) -> object: ...


class HybridMetrics:
    def __init__(self) -> None:
        m = self.registry = Metrics()
        self.cloud_steps = m.counter("hybrid_cloud_steps_total", "cloud training steps taken")
        self.mixing_steps = m.counter("hybrid_mixing_steps_total", "cloud steps that mixed an edge round")
        self.rounds = m.counter("hybrid_edge_rounds_mixed_total", "gateway rounds mixed into the cloud model")
        self.steps = m.counter(
            "hybrid_edge_steps_mixed_total", "edge step-gradients mixed into the cloud model", ["layer"]
        )
        self.queued = m.gauge("hybrid_edge_rounds_queued", "closed edge rounds waiting for a cloud step")


class EdgeMixing:
    """Runs on every cloud rank inside the training loop; rank 0 also drives the gateway.

    The loop calls `begin_step()` (None: stop), `seed_gradients()` between
    zero_grad and backward, and `end_step(planned_done, position)` after the optimizer
    step.  Every rank must call them at every step: they carry the control
    broadcast.  With `checkpoints`, rank 0 cuts the checkpoint the gateway asked for at the
    end of a step, before it takes the next round (cloud/hybrid_checkpoints.py).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        weight: float,
        gateway: Gateway | None = None,
        rounds: EdgeRounds | None = None,
        stop_gateway: threading.Event | None = None,
        gateway_thread: threading.Thread | None = None,
        publish_every_s: float = 5.0,
        idle_s: float = 2.0,
        drain_s: float = 30.0,
        checkpoints: StepCheckpoints | None = None,
        counts: MixingCounts | None = None,
    ) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"edge weight {weight} is not between 0 and 1")
        self.params = list(params)
        self.weight = weight
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if (self.rank == 0) != (gateway is not None and rounds is not None):
            raise ValueError("rank 0, and only rank 0, hosts the gateway and its round queue")
        self.gateway = gateway
        self.rounds = rounds
        self.stop_gateway = stop_gateway
        self.gateway_thread = gateway_thread
        self.publish_every_s = publish_every_s
        self.idle_s = idle_s
        self.drain_s = drain_s
        self.checkpoints = checkpoints if self.rank == 0 else None
        # Resumed: what the checkpointed history mixed (the audit spans restarts).
        self.counts = counts or MixingCounts(steps_by_layer=[0] * len(self.params))
        self.metrics = HybridMetrics()
        self._names = gateway.names if gateway is not None else []
        self.stop_requested = threading.Event()  # rank 0's SIGTERM
        # Its own group: the control broadcast never interleaves with the gradient collectives.
        self._group = dist.new_group(backend="gloo")
        self._control = torch.zeros(2, dtype=torch.int64)  # [mix next step, stop]
        self._work: dist.Work | None = None
        self._next: EdgeRound | None = None  # rank 0: the round the next step mixes
        self._mixing: EdgeRound | None = None
        self._mix = False
        self._last_publish = time.monotonic()
        self._version = gateway.served_version if gateway is not None else 0
        self._published_once = False
        self.gateway_failed = False  # rank 0: the gateway's thread died under the job
        self._done_at: float | None = None  # when the planned epochs ended
        self._gateway_stopped = False
        self._known_at = gateway.clock() if gateway is not None and gateway.clients else None
        self._send(mix=False, stop=False)

    # ------------------------------------------------------------------ the loop's calls
    def begin_step(self) -> float | None:
        """The loss scale of this step (1, or 1 - w when it mixes a round); None: stop now."""
        assert self._work is not None
        self._work.wait()
        mix, stop = (bool(v) for v in self._control.tolist())
        if stop:
            return None
        if self.rank == 0 and not self._published_once:
            self._publish(time.monotonic())  # the model as training starts (resumed, maybe)
        self._mix = mix
        self._mixing, self._next = self._next, None
        return 1.0 - self.weight if mix else 1.0

    @property
    def mixes(self) -> bool:
        """Whether the current step mixes an edge round (the same answer on every rank)."""
        return self._mix

    def seed_gradients(self) -> None:
        """Rank 0 starts backward with W * w * average in `.grad`; autograd adds the cloud gradient."""
        if self._mixing is None:
            return
        scale = self.world * self.weight
        with torch.no_grad():
            for param, avg in zip(self.params, self._mixing.averages):
                if avg is not None:
                    param.grad = (avg.to(param.device, param.dtype) * scale).view_as(param)

    def end_step(self, planned_done: bool, position: Position | None = None) -> None:
        """Count what was mixed, publish the model, and tell every rank what the next step does."""
        self.metrics.cloud_steps.inc()
        if self._mix:
            self.counts.mixing_steps += 1
            self.metrics.mixing_steps.inc()
        if self.rank != 0:
            self._send(mix=False, stop=False)  # the values come from rank 0
            return
        now = time.monotonic()
        if self._mixing is not None:
            self.counts.rounds += len(self._mixing.numbers)
            self.metrics.rounds.inc(by=len(self._mixing.numbers))
            for i, n in enumerate(self._mixing.layer_steps):
                self.counts.steps_by_layer[i] += n
                if n:
                    self.metrics.steps.inc(self._names[i], by=n)
            self._publish(now)
            self._mixing = None
        elif now - self._last_publish >= self.publish_every_s:
            self._publish(now)
        if planned_done and self._done_at is None:
            self._done_at = now
        if not self._gateway_stopped and self._should_stop_gateway(now):
            self._stop_gateway()
        assert self.rounds is not None
        if self.checkpoints is not None and position is not None:
            # Here, between the model taking in every round taken so far and the next take: the
            # only point where the model, the queue and the gateway's verdicts can agree.
            self.checkpoints.cut(position, self.counts, self._version)
        self._next = self.rounds.take()
        self.metrics.queued.set(value=len(self.rounds))
        stop = self._gateway_stopped and self._next is None
        self._send(mix=self._next is not None, stop=stop)

    def finish(self) -> None:
        """After the loop: wait for the last broadcast (every rank), and on rank 0 stop the gateway."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self.rank == 0 and not self._gateway_stopped:
            self._stop_gateway()  # the loop ended without a stop decision (an error): no more pushes
        dist.destroy_process_group(self._group)

    # ---------------------------------------------------------------------- rank 0
    def _should_stop_gateway(self, now: float) -> bool:
        if self.stop_requested.is_set():
            return True
        if self.gateway_thread is not None and not self.gateway_thread.is_alive():
            log.error("the gateway thread is gone (see its error above): stopping the job")
            self.gateway_failed = True
            return True
        if self._done_at is None:
            return False
        if now - self._done_at >= self.drain_s:
            log.warning("edges were still delivering %.0f s after the last epoch: stopping", self.drain_s)
            return True
        gw = self.gateway
        assert gw is not None and self.rounds is not None
        # Edges heartbeat while they live: silence means they finished (or their link is down).
        # A job resumed with devices on record counts from its start: they are reconnecting, with
        # what the dead instance acknowledged to send again.
        heard = gw.last_heard_at if gw.last_heard_at is not None else self._known_at
        quiet = heard is None or gw.clock() - heard >= self.idle_s
        return quiet and gw.open.opened_at is None and len(self.rounds) == 0

    def _stop_gateway(self) -> None:
        """No more pushes are taken; the open round is closed and queued, so nothing acked is lost."""
        assert self.gateway is not None
        if self.stop_gateway is not None:
            self.stop_gateway.set()
        if self.gateway_thread is not None:
            self.gateway_thread.join()
        if self.gateway.open.opened_at is not None:
            self.gateway.close_round()
        self._gateway_stopped = True

    def _publish(self, now: float) -> None:
        assert self.gateway is not None
        self._version += 1
        self.gateway.publish(self._version)
        self._published_once = True
        self._last_publish = now

    def _send(self, mix: bool, stop: bool) -> None:
        if self.rank == 0:
            self._control[0] = int(mix)
            self._control[1] = int(stop)
        self._work = dist.broadcast(self._control, src=0, group=self._group, async_op=True)
