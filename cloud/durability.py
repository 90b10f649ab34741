"""Gateway state on disk: checkpoints at round boundaries, and the resume from the newest good one.

A checkpoint is taken right after a round closes, when every accumulator is
empty: the model, the optimizer's state, the model version and round number,
and each device's de-duplication state (its floor and recent verdicts) are then
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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cloud.ema import accumulator_dtype
from common.checkpoint import (
    CheckpointError,
    CheckpointStore,
    load_optimizer_state,
    optimizer_state_tensors,
    read_tensors,
)

if TYPE_CHECKING:
    from cloud.gateway import Gateway

log = logging.getLogger("elasticfed.gateway")

KIND = "elasticfed-gateway"
MODEL_PREFIX = "model/"
EMA_PREFIX = "ema/"  # the average of the published versions the gateway reports (cloud/ema.py)


@dataclass
class GatewayCheckpoints:
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

    def after_round(self, gateway: Gateway) -> None:
        closed = gateway.open.number - 1
        due = self.every_s > 0 and time.monotonic() - self.last_saved_at >= self.every_s
        if due or closed % self.every_rounds == 0:
            self.save(gateway)

    def when_idle(self, gateway: Gateway, now: float, last_close: float) -> None:
        """Between rounds (nothing open), save rounds not on disk once the gateway has been idle."""
        if (
            gateway.open.opened_at is None
            and self.saved_version != gateway.version
            and now - last_close >= self.idle_s
        ):
            self.save(gateway)

    def save(self, gateway: Gateway) -> Path:
        """Write the gateway's state; once it is on disk, edges are told (the commit)."""
        tensors, meta = export_state(gateway, self.lineage_max)
        self.last_saved = self.store.save(gateway.version, tensors, meta)
        self.last_saved_at = time.monotonic()
        self.saved_version = gateway.version
        log.debug("checkpoint %d: %s (version %d)", meta["epoch"], self.last_saved, gateway.version)
        gateway.on_durable(meta["epoch"])
        return self.last_saved

    def restore(self, gateway: Gateway) -> Path | None:
        """Load the newest checkpoint that is whole and of this model; None if there is none."""
        self.skipped = []
        for path in self.store.entries():
            try:
                tensors, meta = read_tensors(path, KIND)
                import_state(gateway, tensors, meta, path)
            except (CheckpointError, ValueError, KeyError, TypeError) as exc:
                self.skipped.append((path, str(exc)))
                log.warning("skipped checkpoint %s: %s", path, exc)
                continue
            self.saved_version = gateway.version
            log.info(
                "resumed from %s (checkpoint %d, model version %d, round %d)",
                path,
                gateway.durable_epoch,
                gateway.version,
                gateway.open.number,
            )
            return path
        return None


def export_state(gateway: Gateway, lineage_max: int = 1024) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and JSON of a gateway between rounds."""
    tensors = {MODEL_PREFIX + n: p.detach().to("cpu") for n, p in zip(gateway.names, gateway.params)}
    optim_tensors, optim_meta = optimizer_state_tensors(gateway.optimizer)
    tensors.update(optim_tensors)
    ema_count = None
    if gateway.ema is not None and gateway.ema.tensors:
        ema_count = gateway.ema.count
        tensors.update({EMA_PREFIX + n: t for n, t in gateway.averaged().items()})
    clients = {
        cid: {
            "floor": state.floor,
            "verdicts": [
                [seq, code, attempt, epoch] for seq, (code, attempt, epoch) in sorted(state.verdicts.items())
            ],
        }
        for cid, state in gateway.clients.items()
    }
    epoch = gateway.durable_epoch + 1
    lineage = dict(gateway.lineage)
    lineage[gateway.gateway_id] = epoch  # true once this file is on disk
    if len(lineage) > lineage_max:
        lineage = dict(sorted(lineage.items(), key=lambda kv: kv[1])[-lineage_max:])
    applied = {
        cid: {name: n for name, n in zip(gateway.names, counts) if n}
        for cid, counts in gateway.applied_steps.items()
    }
    meta = {
        "manifest": gateway.manifest.digest,
        "version": gateway.version,
        "round": gateway.open.number,
        "epoch": epoch,
        "optimizer": optim_meta,
        "clients": clients,
        "lineage": lineage,
        "applied_steps": applied,
        "ema_count": ema_count,  # None: no average saved (tensors under EMA_PREFIX otherwise)
    }
    return tensors, meta


def import_state(
    gateway: Gateway, tensors: dict[str, torch.Tensor], meta: dict[str, Any], path: Path
) -> None:
    """Put a checkpoint into a fresh gateway; raises CheckpointError naming what does not fit."""
    from cloud.gateway import ClientState

    if meta.get("manifest") != gateway.manifest.digest:
        raise CheckpointError(f"{path}: written for another model (manifest digest differs)")
    for name, param in zip(gateway.names, gateway.params):
        saved = tensors.get(MODEL_PREFIX + name)
        if saved is None or saved.shape != param.shape or saved.dtype != param.dtype:
            raise CheckpointError(f"{path}: model tensor {name} is missing or has another shape or dtype")
    ema = _saved_average(gateway, tensors, meta, path)
    clients = {}
    for cid, entry in meta["clients"].items():
        state = ClientState(str(cid), route=b"")
        state.floor = int(entry["floor"])
        for seq, code, attempt, epoch in entry["verdicts"]:
            state.record(int(seq), str(code), int(attempt), int(epoch))
        state.forgotten_epoch = int(meta["epoch"])  # everything below the floor is in this file
        clients[cid] = state
    lineage = {str(k): int(v) for k, v in meta["lineage"].items()}
    applied: dict[str, list[int]] = {}
    for cid, by_layer in meta["applied_steps"].items():
        counts = applied[str(cid)] = [0] * len(gateway.names)
        for name, n in by_layer.items():
            counts[gateway.layer_index[name]] = int(n)
    saved_optimizer = meta["optimizer"].get("optimizer") if isinstance(meta["optimizer"], dict) else None
    if saved_optimizer is not None and saved_optimizer != type(gateway.optimizer).__name__:
        # --gateway-optimizer changed between runs: what was applied and acknowledged stays (the
        # model, the versions, every edge's verdicts); only the optimizer's moments start afresh.
        log.warning(
            "checkpoint %s holds %s state and the gateway's optimizer is now %s: the model, versions "
            "and verdicts are restored, the optimizer starts fresh",
            path,
            saved_optimizer,
            type(gateway.optimizer).__name__,
        )
    else:
        load_optimizer_state(gateway.optimizer, tensors, meta["optimizer"])
    with torch.no_grad():
        for name, param in zip(gateway.names, gateway.params):
            param.copy_(tensors[MODEL_PREFIX + name])
    if gateway.ema is not None:
        saved_tensors, count = ema if ema is not None else ({}, 0)
        gateway.ema.load(saved_tensors, count)
    gateway.resume(int(meta["version"]), int(meta["round"]), clients, int(meta["epoch"]), lineage, applied)


def _saved_average(
    gateway: Gateway, tensors: dict[str, torch.Tensor], meta: dict[str, Any], path: Path
) -> tuple[dict[str, torch.Tensor], int] | None:
    """The saved average and its count, checked against the model; None if none was saved (a
    checkpoint from before averaging, or a gateway without it: the average starts afresh)."""
    count = meta.get("ema_count")
    if count is None or gateway.ema is None:
        return None
    if type(count) is not int or count < 1:
        raise CheckpointError(f"{path}: ema_count must be a whole number >= 1, got {count!r}")
    saved = {}
    for name, param in zip(gateway.names, gateway.params):
        t = tensors.get(EMA_PREFIX + name)
        if t is None or t.shape != param.shape or t.dtype != accumulator_dtype(param.dtype):
            raise CheckpointError(f"{path}: averaged tensor {name} is missing or has another shape or dtype")
        saved[name] = t
    return saved, count
