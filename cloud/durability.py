"""Gateway state on disk: checkpoints at round boundaries, and the resume from the newest good one.

A checkpoint is taken right after a round closes, when every accumulator is
empty: the model, the optimizer's state, the model version and round number,
and each device's de-duplication state (`resolved_below` and its recent verdicts) are then
one consistent picture, in which every push the gateway judged is either in the
model or refused.  Files are `common/checkpoint.py` files (safetensors + JSON,
atomic, validated); a torn or foreign one is skipped with a message naming it.

Checkpoints are numbered (epochs; the number continues across restarts), and
every ack names the checkpoint that will hold the push: the next one.  Once
checkpoint E is on disk, every push this instance acknowledged with an epoch up
to E is durable, and the gateway says so to every connected edge (a `Commit`;
acks and heartbeat replies repeat it).  Edges keep
what is acknowledged but not yet durable and send it again if this instance
dies first (edge/cache.py).  The checkpoint records the lineage (each instance
whose checkpoints this one descends from, and the newest version it wrote), so
a restarted gateway can tell an edge which of its held acknowledgements were
written to disk by a predecessor.

Also recorded, for audits: the step-gradients applied per device and layer over
the whole checkpointed history.

This module knows files, not gateways: the gateway hands it a `GatewayState` value to save
(and says the commit itself once `save` returns), and takes one back from `restore`, which
tries the newest file first and skips any that does not decode or that the gateway refuses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from elasticfed.cloud.clients import ClientState
from elasticfed.common.checkpoint import CheckpointError, CheckpointStore, read_tensors

log = logging.getLogger("elasticfed.gateway")

KIND = "elasticfed-gateway"
MODEL_PREFIX = "model/"
EMA_PREFIX = "ema/"  # the average of the published versions the gateway reports (cloud/ema.py)
APPLIED_KEY = "audit/applied_steps"  # StepCounts.counts; its index is the meta's applied_steps_index


@dataclass(frozen=True)
class StepCounts:
    """Step-gradients applied per client and layer (the audit's history), as one int64 table.

    A table, not a map of maps: written as JSON, 10,000 devices times 101 layer names made the
    checkpoint's metadata 1 M entries, checked and serialised on the gateway's serving thread.
    """

    layers: tuple[str, ...]
    clients: tuple[str, ...]
    counts: torch.Tensor  # int64 [clients, layers]

    def __post_init__(self) -> None:
        shape = (len(self.clients), len(self.layers))
        if self.counts.dtype != torch.int64 or tuple(self.counts.shape) != shape:
            raise CheckpointError(
                f"applied steps: a {self.counts.dtype} table of shape {list(self.counts.shape)} for "
                f"{len(self.clients)} clients and {len(self.layers)} layers (int64 expected)"
            )

    @classmethod
    def empty(cls, layers: tuple[str, ...] = ()) -> StepCounts:
        return cls(layers, (), torch.zeros(0, len(layers), dtype=torch.int64))

    @classmethod
    def of(cls, layers: tuple[str, ...], by_client: dict[str, list[int]]) -> StepCounts:
        """From per-client counts in `layers`' order (the gateway's own form)."""
        if not by_client:
            return cls.empty(layers)
        counts = torch.tensor(list(by_client.values()), dtype=torch.int64)
        return cls(layers, tuple(by_client), counts.reshape(len(by_client), len(layers)))

    def by_client(self) -> dict[str, dict[str, int]]:
        """client -> layer -> count, the counts that are not 0."""
        rows = self.counts.tolist()
        return {c: {n: k for n, k in zip(self.layers, row) if k} for c, row in zip(self.clients, rows)}


@dataclass
class GatewayState:
    """A gateway between rounds, as a value: what one checkpoint holds.

    Every accumulator is empty when it is taken, so the model, the versions and the verdicts
    are one consistent picture (module docstring).  `epoch` is the checkpoint's number: the
    pushes acknowledged with it are durable once this value is on disk.
    """

    manifest: str  # the model's manifest digest: a checkpoint of another model is refused
    model: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_meta: dict[str, Any]
    version: int
    round: int  # the number of the next round to open
    epoch: int
    clients: dict[str, ClientState]  # resolved_below and verdicts (routes are this instance's)
    lineage: dict[str, int]  # instance -> the newest checkpoint it wrote, that this descends from
    applied_steps: StepCounts  # step-gradients applied per client and layer (the audit)
    ema: tuple[dict[str, torch.Tensor], int] | None = None  # (average, versions folded); None: none
    # The version edges were served (None: `version`).  Differs in hybrid mode, where `version`
    # counts rounds and the trainer's publishes number what edges download (cloud/hybrid.py).
    served_version: int | None = None


class Durability(Protocol):
    """Where a gateway's state goes: standalone, its own files (`GatewayCheckpoints`); hybrid, the
    job's checkpoints, which the trainer writes at its next step (cloud/hybrid_checkpoints.py).

    The gateway hands over a state (`save`) and tells edges a push is durable once
    `durable_epoch` reaches the epoch its ack named: at once when `save` writes, later otherwise.
    """

    durable_epoch: int  # the newest checkpoint on disk
    saved_version: int  # the gateway version of the newest state handed over (-1: none)

    def due_after_round(self, closed_round: int) -> bool: ...

    def due_when_idle(self, version: int, now: float, last_close: float) -> bool: ...

    def save(self, state: GatewayState) -> None: ...

    def restore(self, manifest: str, adopt: Callable[[GatewayState], None]) -> Path | None: ...

    def close(self) -> None: ...


class RoundCadence:
    """When a gateway's state is due: every `every_rounds` rounds, after `every_s`, or when idle."""

    every_rounds: int
    every_s: float
    idle_s: float
    last_saved_at: float
    saved_version: int

    def due_after_round(self, closed_round: int) -> bool:
        """Whether the round just closed is to be saved: every `every_rounds`, or `every_s` passed."""
        due = self.every_s > 0 and time.monotonic() - self.last_saved_at >= self.every_s
        return due or closed_round % self.every_rounds == 0

    def due_when_idle(self, version: int, now: float, last_close: float) -> bool:
        """Between rounds: whether unsaved rounds are to be saved because none closed for `idle_s`."""
        return self.saved_version != version and now - last_close >= self.idle_s


@dataclass
class GatewayCheckpoints(RoundCadence):
    """Where and how often the gateway checkpoints (every `every_rounds` rounds, and at a clean stop)."""

    directory: str
    every_rounds: int = 10
    keep: int = 3
    every_s: float = 0.0  # also at the first round close this long after the last checkpoint (0: off)
    # And once no round has closed for this long while rounds are unsaved: the last contributions
    # of a fleet that went quiet become durable without waiting for rounds that will not come.
    idle_s: float = 1.0
    lineage_max: int = 1024  # instances remembered in the lineage (the oldest are forgotten)
    store: CheckpointStore = field(init=False)
    last_saved: Path | None = field(default=None, init=False)
    skipped: list[tuple[Path, str]] = field(default_factory=list, init=False)
    last_saved_at: float = field(default_factory=time.monotonic, init=False)
    saved_version: int = field(default=-1, init=False)  # model version of the newest checkpoint
    durable_epoch: int = field(default=0, init=False)  # number of the newest checkpoint on disk

    def __post_init__(self) -> None:
        if self.every_rounds < 1 or self.keep < 1 or self.lineage_max < 1:
            raise ValueError(
                f"every_rounds, keep and lineage_max must be >= 1, got {self.every_rounds}, {self.keep}, "
                f"{self.lineage_max}"
            )
        if self.every_s < 0 or self.idle_s <= 0:
            raise ValueError(
                f"every_s must be >= 0 (0: off) and idle_s > 0, got {self.every_s}, {self.idle_s}"
            )
        self.store = CheckpointStore(self.directory, KIND, keep=self.keep, exclusive=True)

    def save(self, state: GatewayState) -> None:
        """Write `state`; once this returns it is on disk (the caller tells the edges: the commit)."""
        tensors, meta = encode(state, self.lineage_max)
        self.last_saved = self.store.save(state.version, tensors, meta)
        self.last_saved_at = time.monotonic()
        self.saved_version = state.version
        self.durable_epoch = state.epoch
        log.debug("checkpoint %d: %s (version %d)", state.epoch, self.last_saved, state.version)

    def close(self) -> None:
        """Let another gateway use the directory (as process exit does)."""
        self.store.close()

    def restore(self, manifest: str, adopt: Callable[[GatewayState], None]) -> Path | None:
        """Hand the newest checkpoint of the model whose manifest digest is `manifest`, that decodes
        and that `adopt` accepts, to `adopt`; None if there is none.

        `adopt` raises CheckpointError (or ValueError) for a state that does not fit, before it
        changes anything: the file is skipped with its name and the reason, and the next tried.
        """
        self.skipped = []
        for path in self.store.entries():
            try:
                tensors, meta = read_tensors(path, KIND)
                if meta.get("manifest") != manifest:
                    raise CheckpointError("written for another model (manifest digest differs)")
                state = decode(tensors, meta)
                adopt(state)
            except (CheckpointError, ValueError, KeyError, TypeError) as exc:
                why = str(exc) if str(path) in str(exc) else f"{path}: {exc}"
                self.skipped.append((path, why))
                log.warning("skipped checkpoint %s: %s", path, exc)
                continue
            self.saved_version = state.version
            self.durable_epoch = state.epoch
            log.info(
                "resumed from %s (checkpoint %d, model version %d, round %d)",
                path,
                state.epoch,
                state.version,
                state.round,
            )
            return path
        return None


def encode(state: GatewayState, lineage_max: int = 1024) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A state as a checkpoint file's tensors and JSON."""
    tensors = {MODEL_PREFIX + n: t.detach().to("cpu") for n, t in state.model.items()}
    tensors.update(state.optimizer_tensors)
    ema_count = None
    if state.ema is not None:
        averaged, ema_count = state.ema
        tensors.update({EMA_PREFIX + n: t for n, t in averaged.items()})
    tensors[APPLIED_KEY] = state.applied_steps.counts
    clients = {
        cid: {
            "resolved_below": client.resolved_below,
            "verdicts": [
                [seq, code, attempt, epoch] for seq, (code, attempt, epoch) in sorted(client.verdicts.items())
            ],
        }
        for cid, client in state.clients.items()
    }
    lineage = dict(state.lineage)
    if len(lineage) > lineage_max:
        lineage = dict(sorted(lineage.items(), key=lambda kv: kv[1])[-lineage_max:])
    meta = {
        "manifest": state.manifest,
        "version": state.version,
        "round": state.round,
        "epoch": state.epoch,
        "optimizer": state.optimizer_meta,
        "clients": clients,
        "lineage": lineage,
        "applied_steps_index": {
            "clients": list(state.applied_steps.clients),
            "layers": list(state.applied_steps.layers),
        },
        "ema_count": ema_count,  # None: no average saved (tensors under EMA_PREFIX otherwise)
    }
    if state.served_version is not None:
        meta["served_version"] = state.served_version
    return tensors, meta


def _applied_steps(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> StepCounts:
    index = meta.get("applied_steps_index")
    if index is None:  # written before the table: client -> layer -> count in the JSON
        by_layer = meta["applied_steps"]
        layers = tuple(sorted({str(n) for counts in by_layer.values() for n in counts}))
        column = {n: j for j, n in enumerate(layers)}
        rows = [[0] * len(layers) for _ in by_layer]
        for row, counts in zip(rows, by_layer.values()):
            for name, n in counts.items():
                row[column[str(name)]] = int(n)
        table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(layers))
        return StepCounts(layers, tuple(str(c) for c in by_layer), table)
    counts = tensors.get(APPLIED_KEY)
    if counts is None:
        raise CheckpointError(f"applied_steps_index without the {APPLIED_KEY} tensor")
    if counts.numel() and int(counts.min()) < 0:
        raise CheckpointError("applied steps: a negative count")
    return StepCounts(tuple(map(str, index["layers"])), tuple(map(str, index["clients"])), counts)


def decode(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> GatewayState:
    """A checkpoint file's tensors and JSON as a state; raises CheckpointError naming what is wrong.

    Only the file's own consistency is checked here; whether it fits a model is the adopter's.
    """
    epoch = meta["epoch"]
    count = meta.get("ema_count")
    ema = None
    if count is not None:
        if type(count) is not int or count < 1:
            raise CheckpointError(f"ema_count must be a whole number >= 1, got {count!r}")
        ema = ({k[len(EMA_PREFIX) :]: t for k, t in tensors.items() if k.startswith(EMA_PREFIX)}, count)
    clients = {}
    for cid, entry in meta["clients"].items():
        client = ClientState(str(cid), route=b"")
        # ("floor": its name in checkpoints written before it took the wire's name)
        client.resolved_below = int(entry["resolved_below"] if "resolved_below" in entry else entry["floor"])
        for seq, code, attempt, verdict_epoch in entry["verdicts"]:
            client.record(int(seq), str(code), int(attempt), int(verdict_epoch))
        client.forgotten_epoch = int(epoch)  # everything below resolved_below is in this file
        clients[str(cid)] = client
    return GatewayState(
        manifest=str(meta.get("manifest")),
        model={k[len(MODEL_PREFIX) :]: t for k, t in tensors.items() if k.startswith(MODEL_PREFIX)},
        optimizer_tensors={
            k: t
            for k, t in tensors.items()
            if not k.startswith((MODEL_PREFIX, EMA_PREFIX)) and k != APPLIED_KEY
        },
        optimizer_meta=meta["optimizer"],
        version=int(meta["version"]),
        round=int(meta["round"]),
        epoch=int(epoch),
        clients=clients,
        lineage={str(k): int(v) for k, v in meta["lineage"].items()},
        applied_steps=_applied_steps(tensors, meta),
        ema=ema,
        served_version=int(meta["served_version"]) if meta.get("served_version") is not None else None,
    )
