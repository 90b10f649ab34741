"""Gateway state on disk: checkpoints at round boundaries, and the resume from the newest good one.

A checkpoint is taken right after a round closes, when every accumulator is
empty: the model, the optimizer's state, the model version and round number,
and each device's de-duplication state (its floor and recent verdicts) are then
one consistent picture, in which every push the gateway judged is either in the
model or refused.  Files are `common/checkpoint.py` files (safetensors + JSON,
atomic, validated); a torn or foreign one is skipped with a message naming it.

What this does not do yet (issue #7): tell edges which pushes are durable
(the commit half of the protocol), and checkpoint on a timer between rounds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

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


@dataclass
class GatewayCheckpoints:
    """Where and how often the gateway checkpoints (every `every_rounds` rounds, and at a clean stop)."""

    directory: str
    every_rounds: int = 10
    keep: int = 3
    store: CheckpointStore = field(init=False)
    last_saved: Path | None = field(default=None, init=False)
    skipped: list[tuple[Path, str]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.every_rounds < 1 or self.keep < 1:
            raise ValueError(f"every_rounds and keep must be >= 1, got {self.every_rounds}, {self.keep}")
        self.store = CheckpointStore(self.directory, KIND, keep=self.keep)

    def after_round(self, gateway: Gateway) -> None:
        closed = gateway.open.number - 1
        if closed % self.every_rounds == 0:
            self.save(gateway)

    def save(self, gateway: Gateway) -> Path:
        tensors, meta = export_state(gateway)
        self.last_saved = self.store.save(gateway.version, tensors, meta)
        log.debug("checkpoint %s (version %d)", self.last_saved, gateway.version)
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
            log.info(
                "resumed from %s (model version %d, round %d)", path, gateway.version, gateway.open.number
            )
            return path
        return None


def export_state(gateway: Gateway) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and JSON of a gateway between rounds."""
    tensors = {MODEL_PREFIX + n: p.detach().to("cpu") for n, p in zip(gateway.names, gateway.params)}
    optim_tensors, optim_meta = optimizer_state_tensors(gateway.optimizer)
    tensors.update(optim_tensors)
    clients = {
        cid: {
            "floor": state.floor,
            "verdicts": [[seq, code, attempt] for seq, (code, attempt) in sorted(state.verdicts.items())],
        }
        for cid, state in gateway.clients.items()
    }
    meta = {
        "manifest": gateway.manifest.digest,
        "version": gateway.version,
        "round": gateway.open.number,
        "optimizer": optim_meta,
        "clients": clients,
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
    clients = {}
    for cid, entry in meta["clients"].items():
        state = ClientState(str(cid), route=b"")
        state.floor = int(entry["floor"])
        for seq, code, attempt in entry["verdicts"]:
            state.record(int(seq), str(code), int(attempt))
        clients[cid] = state
    load_optimizer_state(gateway.optimizer, tensors, meta["optimizer"])
    with torch.no_grad():
        for name, param in zip(gateway.names, gateway.params):
            param.copy_(tensors[MODEL_PREFIX + name])
    gateway.resume(int(meta["version"]), int(meta["round"]), clients)
