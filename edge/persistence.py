"""The edge's state on disk: its gradient cache and sequence numbers, saved atomically, loaded at start.

What is saved, per unit: the pending sum and its count, the unanswered flight
(seq, bytes, count; a compressed flight as its wire frames, so a re-send after a
restart is the same bytes and is checked by the codec when it loads), the
error-feedback residual, the held sums (acknowledged, not yet durable, with their
gateway instance and epoch) and the audit counts (and masses, when audited); and
the session's next seq.
Files are `common/checkpoint.py` files (safetensors + JSON, written to a temp
file, fsynced and renamed), two kept, so a power cut during a save leaves the
previous one.  A file that is torn, corrupt, of another device,
of another model or packed differently is skipped with a message naming it, and
the next older one is used; with none left, the edge starts empty.

Why a reload cannot count twice: a flight keeps its seq, so if it was sent and
applied before a crash, the gateway answers the reloaded copy "duplicate".  A
pending sum is never sent before a save has recorded it as a flight (the
session takes pending sums into flights just before it saves, and a sum saved
as pending waits for the next save; edge/cache.py), so a sum reloaded as pending
was never sent.  Fresh seqs are only handed out once a welcome in this process
said which seqs the gateway has seen (an earlier run may have used some after
its last save).  Held sums are
released or re-sent by what the next welcome says about their gateway instance.
What a kill -9 or power cut loses is what was produced since the last save:
at most `persist_every_s` of training (10 s by default).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elasticfed.common.checkpoint import CheckpointError, CheckpointStore, read_tensors, write_tensors
from elasticfed.edge.cache import MAX_HELD, GradientCache, SavedFlight, SavedHeld, UnitSnapshot
from elasticfed.protocol import (
    LayerGradient,
    Manifest,
    ProtocolError,
    Push,
    all_finite,
    decode,
    encode,
    limits_for,
)
from elasticfed.protocol.messages import MAX_RATE, is_rate

log = logging.getLogger("elasticfed.edge")

KIND = "elasticfed-edge"


def _prefix(client_id: str) -> str:
    # One directory may serve several agents (tests, a demo); file names must be safe.
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", client_id)[:48]
    return f"edge-{readable}-{hashlib.sha256(client_id.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class Loaded:
    """What a loaded state gives back to its session besides the cache (which it fills in)."""

    path: Path
    seq: int  # the session's next seq
    flights: dict[int, int]  # seq -> unit: the reloaded flights, weak and unsent, by seq
    wanted: set[int]  # units whose saved pending sums go out once a gateway welcomes the session


class EdgeState:
    """Where one agent's cache survives restarts.  It reads and fills a GradientCache; the session
    hands it the cache, the model's manifest and its next seq, and takes back `Loaded`."""

    def __init__(self, directory: str, client_id: str, keep: int = 2) -> None:
        self.client_id = client_id
        self.store = CheckpointStore(directory, KIND, keep=keep, prefix=_prefix(client_id), exclusive=True)
        self.saves = 0
        self.skipped: list[tuple[Path, str]] = []
        self.loaded: Path | None = None

    # ------------------------------------------------------------------ saving
    def save(self, cache: GradientCache, manifest: Manifest, seq: int) -> Path:
        """Save the cache and the next seq (from the session's I/O thread, or after it stopped)."""
        tensors, meta = export_state(cache, self.client_id, manifest, seq)
        self.saves += 1
        return self.store.save(self.saves, tensors, meta)

    # ----------------------------------------------------------------- loading
    def load(self, cache: GradientCache, manifest: Manifest, now: float) -> Loaded | None:
        """Load the newest whole state of this device and model into a new session's cache; None
        if there is none (the cache is then as it was)."""
        self.skipped = []
        for path in self.store.entries():
            try:
                tensors, meta = read_tensors(path, KIND, max_bytes=self.store.max_bytes)
                loaded = import_state(cache, self.client_id, manifest, tensors, meta, path, now)
            except (CheckpointError, ValueError, KeyError, TypeError, IndexError) as exc:
                reason = (
                    str(exc) if isinstance(exc, CheckpointError) else f"{path}: {type(exc).__name__}: {exc}"
                )
                self.skipped.append((path, reason))
                log.warning("skipped saved edge state %s", reason)
                continue
            except OSError as exc:
                self.skipped.append((path, f"{path}: cannot read: {exc}"))
                log.warning("skipped saved edge state %s: cannot read: %s", path, exc)
                continue
            number = int(path.name.rsplit("-", 1)[1].split(".")[0])
            self.saves = number
            self.loaded = path
            log.info(
                "loaded edge state %s: %d step-gradients not yet answered, %d held until durable",
                path,
                cache.undelivered(),
                cache.held_steps(),
            )
            return loaded
        if self.skipped:
            log.warning("no usable saved edge state: starting with an empty cache")
        return None


def export_state(
    cache: GradientCache, client_id: str, manifest: Manifest, seq: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and JSON of a device's cache (its snapshot) and next seq (its session takes what
    it can into flights first)."""
    tensors: dict[str, torch.Tensor] = {}
    units = []
    for unit, saved in zip(cache.units, cache.snapshot()):
        u = unit.index
        entry: dict[str, Any] = {
            "names": list(unit.names),
            "pending_count": saved.pending_count,
            "pending_base": saved.pending_base,
            "produced": saved.produced,
            "durable": saved.durable,
            "dropped": saved.dropped,
            "flight": None,
            "held": [],
        }
        if saved.pending is not None:
            tensors[f"{u}.pending"] = saved.pending
        flight = saved.flight
        if flight is not None:
            entry["flight"] = {"seq": flight.seq, "count": flight.count, "base": flight.base_version}
            if flight.payloads is None:
                tensors[f"{u}.flight"] = flight.buffer
            else:
                frames = _flight_frames(unit.names, flight)
                tensors[f"{u}.flight_wire"] = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8)
                entry["flight"]["frames"] = [len(f) for f in frames]
        if saved.residual is not None:
            tensors[f"{u}.residual"] = saved.residual
        if saved.mass is not None:
            tensors[f"{u}.produced_mass"], tensors[f"{u}.dropped_mass"] = saved.mass
        for j, held in enumerate(saved.held):
            tensors[f"{u}.held.{j}"] = held.buffer
            entry["held"].append(
                {
                    "instance": held.instance,
                    "epoch": held.epoch,
                    "count": held.count,
                    "base": held.base_version,
                }
            )
        units.append(entry)
    meta = {
        "client_id": client_id,
        "manifest": manifest.digest,
        "seq": seq,
        "lr": cache.lr,
        "units": units,
    }
    return tensors, meta


def _flight_frames(names: tuple[str, ...], flight: SavedFlight) -> list[bytes]:
    """A compressed flight's layers as the codec frames them (header, then payload frames)."""
    assert flight.payloads is not None
    layers = tuple(LayerGradient(n, p, flight.count) for n, p in zip(names, flight.payloads))
    push = Push(seq=flight.seq, base_version=flight.base_version, layers=layers)
    return [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in encode(push)]


def _load_flight_payloads(
    manifest: Manifest, unit: Any, wire: torch.Tensor | None, lengths: Any, where: str
) -> tuple[tuple[Any, ...], torch.Tensor]:
    """Decode a saved compressed flight (as strictly as the gateway would) into payloads and their sum."""
    if wire is None or wire.dtype != torch.uint8 or wire.dim() != 1:
        raise CheckpointError(f"{where}: compressed flight frames are missing")
    if (
        type(lengths) is not list
        or any(type(n) is not int or n < 0 for n in lengths)
        or sum(lengths) != wire.numel()
    ):
        raise CheckpointError(f"{where}: compressed flight frame lengths do not match its bytes")
    raw = wire.numpy().tobytes()
    frames, at = [], 0
    for n in lengths:
        frames.append(raw[at : at + n])
        at += n
    try:
        msg = decode(frames, limits=limits_for(manifest), manifest=manifest)
    except ProtocolError as exc:
        raise CheckpointError(f"{where}: saved compressed flight does not decode: {exc}") from None
    if not isinstance(msg, Push) or [layer.name for layer in msg.layers] != list(unit.names):
        raise CheckpointError(f"{where}: saved compressed flight holds other layers")
    buffer = torch.empty(unit.numel, dtype=unit.dtype)
    for view, layer in zip(unit.views(buffer), msg.layers):
        view.copy_(layer.payload.to_dense())
    return tuple(layer.payload for layer in msg.layers), buffer


def _count(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise CheckpointError(f"{where}: expected a non-negative integer, got {value!r}")
    return value


def import_state(
    cache: GradientCache,
    client_id: str,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    path: Path,
    now: float,
) -> Loaded:
    """Put saved state into the cache of a session that has not started; what the session takes
    back (its seq, flights and wanted units) is returned.  Raises CheckpointError naming what does
    not fit; everything is checked before anything is changed, so a refused file leaves the cache
    as it was.
    """
    if meta.get("client_id") != client_id:
        raise CheckpointError(f"{path}: saved by device {meta.get('client_id')!r}, not this one")
    if meta.get("manifest") != manifest.digest:
        raise CheckpointError(f"{path}: saved for another model (manifest digest differs)")
    units = meta["units"]
    if type(units) is not list or len(units) != len(cache.units):
        raise CheckpointError(f"{path}: saved with another packing of layers into units")
    seq = _count(meta["seq"], f"{path}: seq")
    lr = meta.get("lr")  # absent in files saved before sums had a rate unit
    if lr is not None and not is_rate(lr):
        raise CheckpointError(f"{path}: lr {lr!r} is not a learning rate in (0, {MAX_RATE:g}]")
    snapshots: list[UnitSnapshot] = []
    for unit, entry in zip(cache.units, units):
        where = f"{path}: unit {unit.index}"
        if entry["names"] != list(unit.names):
            raise CheckpointError(f"{where}: saved with other layers ({entry['names'][:3]}...)")

        def tensor(name: str, unit: Any = unit, where: str = where) -> torch.Tensor:
            t = tensors.get(f"{unit.index}.{name}")
            if t is None or t.dtype != unit.dtype or t.shape != (unit.numel,):
                raise CheckpointError(f"{where}: tensor {name} is missing or has another shape or dtype")
            if not all_finite(t):
                raise CheckpointError(f"{where}: tensor {name} holds NaN or Inf")
            return t

        pending_count = _count(entry["pending_count"], f"{where}: pending_count")
        flight = None
        if entry["flight"] is not None:
            f = entry["flight"]
            fseq = _count(f["seq"], f"{where}: flight seq")
            if not 0 < fseq < seq or _count(f["count"], f"{where}: flight count") < 1:
                raise CheckpointError(f"{where}: flight seq {fseq} or count {f['count']} out of range")
            base = _count(f["base"], f"{where}: flight base")
            if "frames" in f:
                wire = tensors.get(f"{unit.index}.flight_wire")
                payloads, buffer = _load_flight_payloads(manifest, unit, wire, f["frames"], where)
            else:
                payloads, buffer = None, tensor("flight")
            flight = SavedFlight(fseq, f["count"], base, buffer, payloads)
        mass = None
        if cache.audit:
            masses = [tensors.get(f"{unit.index}.{name}") for name in ("produced_mass", "dropped_mass")]
            if any(t is None or t.dtype != torch.float64 or t.shape != (unit.numel,) for t in masses):
                raise CheckpointError(f"{where}: saved without the mass audit this agent keeps")
            mass = (masses[0], masses[1])
        if type(entry["held"]) is not list or len(entry["held"]) > MAX_HELD:
            raise CheckpointError(f"{where}: more than {MAX_HELD} held sums")
        held = []
        for j, h in enumerate(entry["held"]):
            if type(h["instance"]) is not str or not h["instance"]:
                raise CheckpointError(f"{where}: held sum {j} names no gateway instance")
            held.append(
                SavedHeld(
                    h["instance"],
                    _count(h["epoch"], f"{where}: held epoch"),
                    _count(h["count"], f"{where}: held count"),
                    _count(h["base"], f"{where}: held base"),
                    tensor(f"held.{j}"),
                )
            )
        snapshots.append(
            UnitSnapshot(
                pending_count=pending_count,
                pending_base=_count(entry["pending_base"], f"{where}: pending_base"),
                produced=_count(entry["produced"], f"{where}: produced"),
                durable=_count(entry["durable"], f"{where}: durable"),
                dropped=_count(entry["dropped"], f"{where}: dropped"),
                pending=tensor("pending") if pending_count else None,
                flight=flight,
                residual=tensor("residual") if f"{unit.index}.residual" in tensors else None,
                held=tuple(held),
                mass=mass,
            )
        )
    flight_seqs = [s.flight.seq for s in snapshots if s.flight is not None]
    if len(set(flight_seqs)) != len(flight_seqs):
        raise CheckpointError(f"{path}: two units share a seq")

    # Everything checked: apply.
    flights = cache.restore(snapshots, None if lr is None else float(lr), now)
    # Saved pending sums go out once a gateway welcomes the session, without waiting for new steps.
    wanted = {u for u, saved in enumerate(snapshots) if saved.pending_count}
    return Loaded(path, seq, flights, wanted)


MASS_KIND = "elasticfed-edge-mass-audit"
MASS_AUDIT_FILE = "mass-audit.safetensors"  # in the state folder, written at exit
MASS_PARTS = ("produced", "dropped", "residual", "pending", "flight")


def write_mass_audit(cache: GradientCache, path: Path) -> None:
    """The cache's mass audit (`GradientCache(audit=True)`) as a file: per unit, its layers' names
    and the float64 sums by where they are, for a check against the gateway's `applied_mass`."""
    tensors: dict[str, torch.Tensor] = {}
    for u in range(len(cache.units)):
        for part, tensor in cache.mass(u).items():
            tensors[f"{u}.{part}"] = tensor
    meta = {"units": [list(unit.names) for unit in cache.units]}
    write_tensors(path, tensors, meta, MASS_KIND)


def read_mass_audit(path: Path) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
    """Per unit (its layers' names, {part: float64 sums}) from `write_mass_audit`'s file."""
    tensors, meta = read_tensors(path, MASS_KIND)
    units = meta.get("units")
    if not isinstance(units, list) or not all(
        isinstance(names, list) and all(isinstance(n, str) for n in names) for names in units
    ):
        raise CheckpointError(f"{path}: 'units' must be a list of lists of layer names")
    out = []
    for u, names in enumerate(units):
        parts = {part: tensors.get(f"{u}.{part}") for part in MASS_PARTS}
        missing = [part for part, t in parts.items() if t is None]
        if missing:
            raise CheckpointError(f"{path}: unit {u} has no {', '.join(missing)} sums")
        out.append((names, {part: t for part, t in parts.items() if t is not None}))
    return out
