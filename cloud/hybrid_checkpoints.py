"""Hybrid mode on disk: one checkpoint holds the cloud model and its optimizer, where training
stood, the gateway's verdicts, and the edge rounds not yet mixed: one consistent cut.

Why one file: in hybrid mode an edge push is judged on the gateway thread and enters the
model on the trainer thread a step or more later (cloud/hybrid.py).  Saved apart, a crash
between the two writes would lose an acknowledged push or apply it twice.  The cut:

1. The gateway, at a round close its cadence picks (every N rounds, every S seconds, when idle,
   or at an epoch end on the trainer's request), hands its state to `save` on its own thread.
   The verdicts are encoded there and then (the next message changes them); the model is not
   (it is the trainer's, mid-step); and the round queue is sealed, so no later round merges
   into a round this state covers.  From then on acks name the next epoch.
2. At the end of its next step, before it takes another round, rank 0's trainer `cut`s: it
   writes the model, the optimizer and schedule, the position in the data, the queued rounds
   the state covers, what was mixed so far, and the encoded verdicts.  Every round the state
   covers is then in the model or in the file, and no later round is in either.
3. The gateway thread sees `durable_epoch` rise and tells the edges (the commit).

Every rank resumes from the same file (the directory must be storage every node shares):
the model, the optimizer and the position on every rank; the verdicts and the unmixed rounds
on rank 0.  Files are `common/checkpoint.py` files: atomic, checksummed, no pickle.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elasticfed.cloud.durability import (
    APPLIED_KEY,
    EMA_PREFIX,
    MODEL_PREFIX,
    GatewayState,
    RoundCadence,
    decode,
    encode,
)
from elasticfed.cloud.hybrid import EdgeRound, EdgeRounds, MixingCounts, Position
from elasticfed.cloud.train import agree_on_checkpoint, load_schedule_state, schedule_state
from elasticfed.common.checkpoint import (
    CheckpointError,
    CheckpointStore,
    load_optimizer_state,
    optimizer_state_tensors,
    read_tensors,
)

log = logging.getLogger("elasticfed.hybrid")

KIND = "elasticfed-hybrid"
TRAIN_OPTIMIZER = "train-optim/"
PENDING = "pending/"


@dataclass
class _Request:
    """A gateway state handed over, waiting for the trainer's next step boundary."""

    epoch: int
    last_round: int  # the newest round the state covers
    tensors: dict[str, torch.Tensor]  # the gateway's (its average of versions, if any)
    meta: dict[str, Any]


@dataclass
class Resumed:
    """A hybrid checkpoint as read back, checked against the model."""

    path: Path
    epoch: int
    gateway: GatewayState
    position: Position
    model: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_meta: dict[str, Any]
    schedule: dict[str, Any]
    pending: list[EdgeRound]
    counts: MixingCounts


class HybridCheckpoints(RoundCadence):
    """The job's checkpoints in hybrid mode: the gateway's `Durability`, the trainer's checkpoints.

    Made on every rank; only rank 0 writes (and holds the directory's lock).
    """

    def __init__(
        self,
        directory: str,
        task: str,
        keep: int = 3,
        every_rounds: int = 10,
        every_s: float = 0.0,
        idle_s: float = 1.0,
        lineage_max: int = 1024,
    ) -> None:
        if every_rounds < 1 or every_s < 0 or idle_s <= 0:
            raise ValueError(
                f"every_rounds must be >= 1, every_s >= 0 and idle_s > 0, got {every_rounds}, "
                f"{every_s}, {idle_s}"
            )
        self.rank = dist.get_rank()
        # Its own file names: a standalone gateway's checkpoints may share the directory.
        self.store = CheckpointStore(directory, KIND, keep=keep, prefix="hybrid", exclusive=self.rank == 0)
        self.task = task
        self.every_rounds = every_rounds
        self.every_s = every_s
        self.idle_s = idle_s
        self.lineage_max = lineage_max
        self.last_saved_at = time.monotonic()
        self.saved_version = -1
        self.durable_epoch = 0
        self.last_saved: Path | None = None
        self.rounds: EdgeRounds | None = None  # rank 0: the queue the cut reads
        self.resumed: Resumed | None = None
        self._lock = threading.Lock()
        self._request: _Request | None = None
        self._wanted = threading.Event()  # the trainer asks for a checkpoint (an epoch ended)
        self._module: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._schedule: torch.optim.lr_scheduler.LRScheduler | None = None

    # ------------------------------------------------------------ the gateway's thread (rank 0)
    def due_after_round(self, closed_round: int) -> bool:
        return self._wanted.is_set() or super().due_after_round(closed_round)

    def due_when_idle(self, version: int, now: float, last_close: float) -> bool:
        return self._wanted.is_set() or super().due_when_idle(version, now, last_close)

    def save(self, state: GatewayState) -> None:
        """Take the gateway's state now; it is written at the trainer's next step boundary."""
        tensors, meta = encode(replace(state, model={}, optimizer_tensors={}), self.lineage_max)
        request = _Request(state.epoch, state.round - 1, tensors, meta)
        if self.rounds is not None:
            self.rounds.seal(state.epoch)
        with self._lock:
            self._request = request  # a newer state covers everything an older one did
        self._wanted.clear()
        self.saved_version = state.version
        self.last_saved_at = time.monotonic()

    def restore(self, manifest: str, adopt: Any) -> Path | None:
        """Hand the state `load` read to the gateway (rank 0, before it serves)."""
        if self.resumed is None:
            return None
        if self.resumed.gateway.manifest != manifest:
            raise CheckpointError(f"{self.resumed.path}: written for another model (manifest digest differs)")
        try:
            adopt(self.resumed.gateway)
        except (CheckpointError, ValueError) as exc:
            raise CheckpointError(f"{self.resumed.path}: {exc}") from None
        self.durable_epoch = self.resumed.epoch
        self.saved_version = self.resumed.gateway.version
        return self.resumed.path

    def close(self) -> None:
        """The gateway stops; the trainer still writes what it handed over (`finish` closes)."""

    def queue_pending(self, rounds: EdgeRounds, params: list[torch.nn.Parameter]) -> None:
        """Rank 0 at a resume: queue the rounds the checkpoint holds unmixed, checked against the
        gateway's layers."""
        found = self.resumed
        if found is None:
            return
        if len(found.counts.steps_by_layer) != len(params):
            raise CheckpointError(
                f"{found.path}: counts {len(found.counts.steps_by_layer)} layers, the model has {len(params)}"
            )
        for rnd in found.pending:
            for j, (avg, param) in enumerate(zip(rnd.averages, params)):
                if avg is not None and (avg.numel() != param.numel() or not avg.dtype.is_floating_point):
                    raise CheckpointError(
                        f"{found.path}: unmixed round {rnd.numbers} holds layer {j} as {avg.dtype} "
                        f"{tuple(avg.shape)}, the model's is {tuple(param.shape)}"
                    )
        rounds.restore(found.pending)

    # --------------------------------------------------------------------------- the trainer
    def want(self) -> None:
        """Ask the gateway for its state at its next chance (an epoch ended: save the cloud's work
        even while no edge is there)."""
        if self.rank == 0:
            self._wanted.set()

    def resume(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        device: torch.device,
    ) -> Position:
        """Load what `load` read into this rank's trainer; where to go on from (zeros: nothing)."""
        del device  # `load` agreed on the file already
        self._module, self._optimizer, self._schedule = module, optimizer, schedule
        found = self.resumed
        if found is None:
            return Position(0, 0, 0)
        try:
            with torch.no_grad():
                module.load_state_dict(found.model)
            load_optimizer_state(optimizer, found.optimizer_tensors, found.optimizer_meta)
        except (ValueError, RuntimeError, KeyError) as exc:
            raise CheckpointError(f"{found.path}: the trainer's state does not fit: {exc}") from None
        load_schedule_state(schedule, found.schedule)
        return found.position

    def epoch_done(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        epoch: int,
        steps: int,
        score: float,
    ) -> None:
        """An epoch ended: ask for a checkpoint (written through the gateway's cadence, not here)."""
        del model, optimizer, schedule, epoch, steps, score
        self.want()

    def cut(self, position: Position, counts: MixingCounts, served_version: int) -> Path | None:
        """Rank 0, between steps: write the state the gateway handed over, if any, with the model
        as it is now and the queued rounds it covers.  A write that fails is logged and the job
        goes on: nothing more is durable until one succeeds (the gateway commits nothing)."""
        with self._lock:
            request, self._request = self._request, None
        if request is None:
            return None
        try:
            path = self._write(request, position, counts, served_version)
        except (OSError, CheckpointError, ValueError) as exc:
            log.error(
                "checkpoint %d not written, nothing more is durable until one is: %s", request.epoch, exc
            )
            return None
        assert self.rounds is not None
        self.rounds.unseal(request.epoch)
        self.last_saved = path
        self.last_saved_at = time.monotonic()
        self.durable_epoch = request.epoch  # the gateway thread reads it and sends the commit
        log.debug("checkpoint %d: %s at %s", request.epoch, path, position)
        return path

    def _write(
        self, request: _Request, position: Position, counts: MixingCounts, served_version: int
    ) -> Path:
        assert self._module is not None and self._optimizer is not None and self._schedule is not None
        assert self.rounds is not None
        tensors = dict(request.tensors)
        tensors.update({MODEL_PREFIX + k: v.detach().to("cpu") for k, v in self._module.state_dict().items()})
        optim_tensors, optim_meta = optimizer_state_tensors(self._optimizer, prefix=TRAIN_OPTIMIZER)
        tensors.update(optim_tensors)
        pending = []
        for i, rnd in enumerate(self.rounds.covered(request.last_round)):
            layers = {}
            for j, avg in enumerate(rnd.averages):
                if avg is not None:
                    tensors[f"{PENDING}{i}/{j}"] = avg.detach().to("cpu")
                    layers[str(j)] = rnd.layer_steps[j]
            pending.append({"numbers": list(rnd.numbers), "layers": layers})
        meta = {
            "task": self.task,
            "gateway": {**request.meta, "served_version": served_version + 1},
            "position": [position.epoch, position.batches, position.steps],
            "optimizer": optim_meta,
            "schedule": schedule_state(self._schedule),
            "pending": pending,
            "mixed": {
                "rounds": counts.rounds,
                "mixing_steps": counts.mixing_steps,
                "steps_by_layer": list(counts.steps_by_layer),
            },
        }
        return self.store.save(request.epoch, tensors, meta)

    def load(self, module: torch.nn.Module, device: torch.device) -> Resumed | None:
        """Every rank: read the newest checkpoint that fits `module`, and agree with the other ranks
        on which (they must share the storage).  Raises CheckpointError when they disagree."""
        expect = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
        found = None
        entries = self.store.entries()
        older = sorted(self.store.directory.glob("ckpt-*.safetensors"))
        if not entries and older and self.rank == 0:
            log.warning(
                "%s holds no hybrid checkpoint, only %d other ones (epoch-end checkpoints of an older "
                "version, or a standalone gateway's): the job starts afresh",
                self.store.directory,
                len(older),
            )
        for path in entries:
            try:
                found = self._read(path, expect)
                break
            except (CheckpointError, OSError, ValueError, KeyError, TypeError) as exc:
                why = str(exc) if str(path) in str(exc) else f"{path}: {exc}"
                log.warning("skipped checkpoint %s", why)
        epoch = found.epoch if found is not None else 0
        agree_on_checkpoint(epoch, device, self.store.directory)
        self.resumed = found
        if found is not None:
            self.durable_epoch = found.epoch
            if self.rank == 0:
                log.info("resumed from %s: checkpoint %d at %s", found.path, found.epoch, found.position)
        return found

    def _read(self, path: Path, expect: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Resumed:
        tensors, meta = read_tensors(path, KIND, max_bytes=self.store.max_bytes)
        if meta.get("task") != self.task:
            raise CheckpointError(f"{path}: written for task {meta.get('task')!r}, not {self.task!r}")
        model = {k[len(MODEL_PREFIX) :]: t for k, t in tensors.items() if k.startswith(MODEL_PREFIX)}
        for name, spec in expect.items():
            t = model.get(name)
            if t is None or (tuple(t.shape), t.dtype) != spec:
                raise CheckpointError(f"{path}: model tensor {name} is missing or has another shape or dtype")
        mine = (MODEL_PREFIX, EMA_PREFIX)
        ours = {k: t for k, t in tensors.items() if k.startswith(mine) or k == APPLIED_KEY}
        gateway = decode(ours, meta["gateway"])
        position = Position(*(int(v) for v in meta["position"]))
        if min(position.epoch, position.batches, position.steps) < 0:
            raise CheckpointError(f"{path}: position {meta['position']} has a negative entry")
        layers = len(meta["mixed"]["steps_by_layer"])
        pending = []
        for i, entry in enumerate(meta["pending"]):
            averages: list[torch.Tensor | None] = [None] * layers
            steps = [0] * layers
            for j, n in entry["layers"].items():
                j = int(j)
                if not 0 <= j < layers or f"{PENDING}{i}/{j}" not in tensors:
                    raise CheckpointError(f"{path}: unmixed round {i} names layer {j}, not in the file")
                averages[j], steps[j] = tensors[f"{PENDING}{i}/{j}"], int(n)
            pending.append(EdgeRound([int(n) for n in entry["numbers"]], averages, steps))
        mixed = meta["mixed"]
        return Resumed(
            path=path,
            epoch=gateway.epoch,
            gateway=replace(gateway, model=model),
            position=position,
            model=model,
            optimizer_tensors={k: t for k, t in tensors.items() if k.startswith(TRAIN_OPTIMIZER)},
            optimizer_meta=meta["optimizer"],
            schedule=dict(meta["schedule"]),
            pending=pending,
            counts=MixingCounts(
                rounds=int(mixed["rounds"]),
                mixing_steps=int(mixed["mixing_steps"]),
                steps_by_layer=[int(n) for n in mixed["steps_by_layer"]],
            ),
        )

    def finish(self) -> None:
        """The job ends: let another job use the directory."""
        self.store.close()
