"""Checkpoints on disk without pickle: safetensors files with a checked JSON header.

The project promises that no pickle is ever read, on the wire or from disk, so a
checkpoint is a safetensors file (a length-prefixed JSON header, then raw tensor
bytes) and everything that is not a tensor goes into one JSON document stored in
the header's ``__metadata__`` under the key ``"elasticfed"``.  That document
records the format kind and version, the caller's metadata, every tensor's dtype,
shape and xxh3-64 checksum of its stored bytes, and a checksum of the document
itself: safetensors checks structure but not content, and a flipped bit in a
parameter would otherwise be loaded silently.

Writes are atomic (temp file in the same directory, fsync, rename, fsync of the
directory), so a crash leaves the old file or the new one.  Reads validate
everything before returning and raise `CheckpointError`, whose message names the
file and the problem, for any malformed, truncated, corrupted, foreign or
mismatched file.  `CheckpointStore` keeps numbered checkpoints in a directory and
resumes from the newest one that passes, saying which ones it skipped and why.

Optimizer state (``optimizer.state_dict()``) becomes named tensors plus JSON with
`optimizer_state_tensors` and goes back with `load_optimizer_state`.

Checksums are over the stored (little-endian) bytes; writers hash the in-memory
bytes, which are the same on every little-endian host (x86-64, aarch64/Jetson).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import struct
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

# safetensors' own parser (a length-prefixed JSON header and raw bytes): no pickle involved.
from safetensors.torch import load as parse_safetensors

from elasticfed.common.host_memory import release_free_memory

log = logging.getLogger("elasticfed.checkpoint")

FORMAT_VERSION = 1
METADATA_KEY = "elasticfed"
DEFAULT_MAX_BYTES = 64 << 30
# safetensors refuses headers above 100 MB; say so before it does, with the file name.
MAX_HEADER_BYTES = 100_000_000

PathLike = str | os.PathLike[str]
TensorSpec = tuple[tuple[int, ...], torch.dtype]

if sys.byteorder != "little":  # pragma: no cover - no target is big-endian
    raise ImportError("common.checkpoint checksums in-memory tensor bytes and needs a little-endian host")


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointError(Exception):
    """A checkpoint file is unusable; the message names the file and what was wrong with it."""


# ---------------------------------------------------------------------------------------------- helpers


def _json_check(value: Any, where: str) -> None:
    """Refuse what JSON would not give back exactly (NaN, non-str keys, sets, objects)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(
                f"{where}: {value!r} is not allowed in checkpoint metadata (JSON has no NaN/Inf)"
            )
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _json_check(item, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: key {key!r} is not a string (JSON keys are strings)")
            _json_check(item, f"{where}[{key!r}]")
        return
    raise ValueError(f"{where}: {type(value).__name__} is not JSON-serialisable")


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON here")


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as laid out in the file (contiguous, native = little-endian)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _checksum(data: Any) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: Any) -> torch.dtype | None:
    found = getattr(torch, name, None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) else None


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable: without it a power cut can undo os.replace."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - directories that cannot be opened (not on Linux)
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _finite(t: torch.Tensor) -> bool:
    # In slices: a whole-tensor isfinite() would allocate a mask as large as the tensor's elements.
    flat = t.reshape(-1)
    return all(bool(part.isfinite().all()) for part in flat.split(1 << 20))


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The `expect` argument of `read_tensors` for tensors shaped like these (e.g. a model's state_dict)."""
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


# ---------------------------------------------------------------------------------------------- write


def _prepare(tensors: Mapping[str, torch.Tensor], allow_nonfinite: bool) -> dict[str, torch.Tensor]:
    prepared: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is not allowed (non-empty string, not '__metadata__')")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors are stored")
        t = tensor.detach().to("cpu").contiguous()
        if not allow_nonfinite and (t.is_floating_point() or t.is_complex()) and not _finite(t):
            raise ValueError(
                f"tensor {name!r} holds NaN or Inf (pass allow_nonfinite=True to store it anyway)"
            )
        prepared[name] = t
    return prepared


def write_tensors(
    path: PathLike,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    kind: str,
    *,
    allow_nonfinite: bool = False,
) -> int:
    """Write `tensors` and JSON `meta` to `path` atomically; returns the bytes written.

    `kind` names the format (e.g. "elasticfed-gateway") so that one role never
    resumes from another's file.  Tensors may live on any device; CPU copies are
    stored.  Floating tensors holding NaN/Inf are refused (ValueError) unless
    `allow_nonfinite`: a diverged model must not replace the last good checkpoint.
    The file gets mode 0600 (checkpoints may hold model IP).
    """
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind must be a non-empty string, got {kind!r}")
    if not isinstance(meta, Mapping):
        raise ValueError(f"meta must be a mapping, got {type(meta).__name__}")
    _json_check(meta, "meta")
    prepared = _prepare(tensors, allow_nonfinite)
    doc: dict[str, Any] = {
        "format": kind,
        "version": FORMAT_VERSION,
        "meta": dict(meta),
        "tensors": {
            name: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "xxh3": _checksum(_tensor_bytes(t))}
            for name, t in prepared.items()
        },
    }
    doc["xxh3"] = _checksum(_dumps(doc).encode())
    # The safetensors layout, written tensor by tensor from the tensors' own memory: no copy of
    # the whole checkpoint is ever built (an edge saving during an outage must not double its RSS).
    header: dict[str, Any] = {"__metadata__": {METADATA_KEY: _dumps(doc)}}
    offset = 0
    for name, t in prepared.items():
        code = _SAFETENSORS_DTYPES.get(t.dtype)
        if code is None:
            raise ValueError(f"safetensors cannot store tensor {name!r} of dtype {t.dtype}")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = _dumps(header).encode()
    head += b" " * (-len(head) % 8)  # aligned tensor data, as safetensors' own writer does

    path = Path(path)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for t in prepared.values():
                if t.numel():
                    f.write(_tensor_bytes(t))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp_name, path)
    except BaseException:
        try:
            os.unlink(temp_name)
        except OSError:
            pass
        raise
    _fsync_directory(path.parent)
    release_free_memory()  # what preparing the file allocated (common/host_memory.py)
    return 8 + len(head) + offset


# ---------------------------------------------------------------------------------------------- read


def _parse_header(path: Path, data: bytes) -> tuple[dict[str, Any], int]:
    """Check the safetensors framing ourselves so that random bytes get a clear message."""
    size = len(data)
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes)")
    if size < 8:
        raise CheckpointError(
            f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)"
        )
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > size - 8:
        raise CheckpointError(
            f"{path}: truncated or not a safetensors file "
            f"(header length {header_len} is larger than the file, which has {size - 8} bytes after it)"
        )
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: not a safetensors file (header length {header_len} is over 100 MB)")
    raw = data[8 : 8 + header_len]
    if not raw.startswith(b"{"):
        raise CheckpointError(f"{path}: not a safetensors file (header does not start with '{{')")
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt header (not valid JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header (a JSON {type(header).__name__}, not an object)")

    data_start = 8 + header_len
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(f"{path}: corrupt header (tensor {name!r} has no valid data_offsets)")
        end = max(end, offsets[1])
    have = size - data_start
    if end > have:
        raise CheckpointError(f"{path}: truncated: header says {end} bytes of tensors, file has {have}")
    if end < have:
        raise CheckpointError(
            f"{path}: corrupt: {have - end} unexpected bytes after the {end} bytes of tensors "
            "the header lists"
        )
    return header, data_start


def _parse_document(path: Path, header: dict[str, Any], kind: str) -> dict[str, Any]:
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        raise CheckpointError(
            f"{path}: a safetensors file without elasticfed metadata "
            f"(no {METADATA_KEY!r} key in __metadata__; not written by common.checkpoint)"
        )
    text = metadata[METADATA_KEY]
    try:
        if not isinstance(text, str):
            raise ValueError("not a string")
        doc = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt elasticfed metadata (not valid JSON: {exc})") from exc
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: corrupt elasticfed metadata (not a JSON object)")

    found_kind, version = doc.get("format"), doc.get("version")
    if found_kind != kind:
        raise CheckpointError(f"{path}: wrong kind: a {found_kind!r} checkpoint, expected {kind!r}")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise CheckpointError(
            f"{path}: written by format {found_kind!r} version {version!r}, "
            f"this reads version {FORMAT_VERSION}"
        )
    recorded = doc.pop("xxh3", None)
    try:
        actual = _checksum(_dumps(doc).encode())
    except ValueError:
        actual = None
    if recorded != actual:
        raise CheckpointError(f"{path}: checksum mismatch in the elasticfed metadata (header corrupted)")
    if not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("tensors"), dict):
        raise CheckpointError(f"{path}: corrupt elasticfed metadata (no 'meta' or 'tensors' object)")
    return doc


def _check_tensors(
    path: Path,
    header: dict[str, Any],
    doc: dict[str, Any],
    data: bytes,
    data_start: int,
    tensors: dict[str, torch.Tensor],
) -> None:
    recorded: dict[str, Any] = doc["tensors"]
    in_header = {name for name in header if name != "__metadata__"}
    if in_header != set(recorded) or set(tensors) != in_header:
        raise CheckpointError(
            f"{path}: corrupt: the header lists tensors {sorted(in_header)}, "
            f"the elasticfed metadata records {sorted(recorded)}"
        )
    view = memoryview(data)
    for name in sorted(recorded):
        record, tensor = recorded[name], tensors[name]
        dtype = _dtype_from_name(record.get("dtype")) if isinstance(record, dict) else None
        if (
            dtype is None
            or not isinstance(record.get("shape"), list)
            or not isinstance(record.get("xxh3"), str)
        ):
            raise CheckpointError(f"{path}: corrupt elasticfed metadata (bad record for tensor {name!r})")
        if tensor.dtype != dtype or list(tensor.shape) != record["shape"]:
            raise CheckpointError(
                f"{path}: corrupt header: tensor {name!r} is {tensor.dtype} {list(tensor.shape)} "
                "in the header, "
                f"{dtype} {record['shape']} in the elasticfed metadata"
            )
        begin, end = header[name]["data_offsets"]
        if _checksum(view[data_start + begin : data_start + end]) != record["xxh3"]:
            raise CheckpointError(f"{path}: checksum mismatch in tensor {name!r} (its data is corrupted)")


def _check_expected(path: Path, tensors: dict[str, torch.Tensor], expect: Mapping[str, TensorSpec]) -> None:
    missing = sorted(set(expect) - set(tensors))
    extra = sorted(set(tensors) - set(expect))
    if missing or extra:
        parts = [f"missing tensors {missing}"] if missing else []
        parts += [f"unexpected tensors {extra}"] if extra else []
        raise CheckpointError(f"{path}: {'; '.join(parts)}")
    for name in sorted(expect):
        shape, dtype = expect[name]
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        if tensor.dtype != dtype:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, expected {dtype}")


def read_tensors(
    path: PathLike,
    kind: str,
    expect: Mapping[str, TensorSpec] | None = None,
    allow_nonfinite: bool = False,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and fully validate a file from `write_tensors`; returns (tensors, meta).

    Raises CheckpointError naming the file and the problem for anything wrong with
    its contents: bad framing, truncation, foreign or future format, checksum
    mismatch, names/shapes/dtypes other than `expect` ({name: (shape, dtype)}),
    NaN/Inf in floating tensors unless `allow_nonfinite`.  Files above
    `max_bytes` are refused before reading.  OSError (missing file, permissions,
    I/O error) propagates unchanged.  Returned tensors are CPU, writable and own
    their memory.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise CheckpointError(f"{path}: too large ({size} bytes; the limit is {max_bytes})")
        data = f.read(size + 1)
    if len(data) != size:
        raise CheckpointError(f"{path}: changed size while being read ({size} bytes, then {len(data)})")

    header, data_start = _parse_header(path, data)
    doc = _parse_document(path, header, kind)
    try:
        tensors = parse_safetensors(data)
    except Exception as exc:  # SafetensorError, unknown dtype (KeyError/ValueError), ...
        raise CheckpointError(f"{path}: safetensors refused it: {exc}") from exc
    _check_tensors(path, header, doc, data, data_start, tensors)
    if expect is not None:
        _check_expected(path, tensors, expect)
    if not allow_nonfinite:
        for name in sorted(tensors):
            t = tensors[name]
            if (t.is_floating_point() or t.is_complex()) and not bool(t.isfinite().all()):
                raise CheckpointError(f"{path}: tensor {name!r} holds NaN or Inf")
    return tensors, doc["meta"]


# ---------------------------------------------------------------------------------------------- optimizer


def _encode(value: Any, where: str, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for one state_dict value; tensors go to `tensors` under `name`, tuples/NaN are tagged."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value
        return {"tensor": name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{where}[{i}]", f"{name}/{i}", tensors) for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"tuple": items}
    raise ValueError(
        f"optimizer state {where} is a {type(value).__name__}; it cannot be stored without pickle"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "tensor" in value:
            name = value["tensor"]
            if name not in tensors:
                raise ValueError(
                    f"optimizer state needs tensor {name!r}, which is not among the tensors given"
                )
            return tensors[name]
        if "tuple" in value:
            return tuple(_decode(v, tensors) for v in value["tuple"])
        if "float" in value:
            return float(value["float"])
        raise ValueError(f"optimizer state holds an unknown tagged value {value!r}")
    return value


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer, prefix: str = "optim/"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten `optimizer.state_dict()` into named tensors and JSON, for `write_tensors`.

    Tensors are named "{prefix}state/<param index>/<key>" (and
    "{prefix}group/<group>/<key>" for tensor hyper-parameters such as a tensor
    lr); put the JSON under a key of your meta.  Values other than tensors,
    None, bool, int, float, str and lists/tuples of those are refused with a
    ValueError naming them.
    """
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    groups = []
    for g, group in enumerate(state_dict["param_groups"]):
        groups.append(
            {
                key: _encode(value, f"param_groups[{g}][{key!r}]", f"{prefix}group/{g}/{key}", tensors)
                for key, value in group.items()
            }
        )
    state = []
    for index, values in state_dict["state"].items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"optimizer state key {index!r} is not a parameter index")
        state.append(
            {
                "param": index,
                "values": {
                    key: _encode(value, f"state[{index}][{key!r}]", f"{prefix}state/{index}/{key}", tensors)
                    for key, value in values.items()
                },
            }
        )
    return tensors, {"optimizer": type(optimizer).__name__, "param_groups": groups, "state": state}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> None:
    """Rebuild the state_dict from `optimizer_state_tensors` output and load it into `optimizer`.

    Raises ValueError when the saved state belongs to another optimizer class or
    another parameter layout (group count, parameters per group) rather than
    letting torch load it into the wrong parameters.
    """
    if not isinstance(meta, Mapping) or not {"optimizer", "param_groups", "state"} <= set(meta):
        raise ValueError("optimizer meta lacks 'optimizer', 'param_groups' or 'state'")
    if meta["optimizer"] != type(optimizer).__name__:
        raise ValueError(
            f"checkpoint holds {meta['optimizer']} state, the optimizer is {type(optimizer).__name__}"
        )
    groups = [{key: _decode(value, tensors) for key, value in g.items()} for g in meta["param_groups"]]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint has {len(groups)} parameter groups, the optimizer has {len(optimizer.param_groups)}"
        )
    for g, (saved, live) in enumerate(zip(groups, optimizer.param_groups)):
        if len(saved.get("params", [])) != len(live["params"]):
            raise ValueError(
                f"parameter group {g}: checkpoint has {len(saved.get('params', []))} parameters, "
                f"the optimizer has {len(live['params'])}"
            )
    known = {index for g in groups for index in g["params"]}
    state: dict[int, dict[str, Any]] = {}
    for entry in meta["state"]:
        index = entry["param"]
        if index not in known:
            raise ValueError(f"checkpoint has state for parameter {index}, which no parameter group lists")
        state[index] = {key: _decode(value, tensors) for key, value in entry["values"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------------------------------------- store


class CheckpointStore:
    """Numbered checkpoints in one directory: save with retention, resume from the newest valid one.

    Files are "{prefix}-{number:010d}.safetensors".  One writer per directory.
    Opening the store removes temp files left by writes that crashed.
    """

    def __init__(
        self,
        directory: PathLike,
        kind: str,
        keep: int = 3,
        prefix: str = "ckpt",
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        exclusive: bool = False,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix) or prefix.startswith("."):
            raise ValueError(
                f"prefix {prefix!r} must be letters, digits, '_', '-', '.' and not start with '.'"
            )
        self.directory = Path(directory)
        self.kind = kind
        self.keep = keep
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.skipped: list[tuple[Path, str]] = []
        self._name = re.compile(rf"{re.escape(prefix)}-(\d{{10,}})\.safetensors")
        self._temp = re.compile(rf"\.{re.escape(prefix)}-\d{{10,}}\.safetensors\..*\.tmp")
        if not self.directory.exists():
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.directory, 0o700)  # mkdir's mode is masked by the umask
        self._lock_fd: int | None = None
        if exclusive:
            self._lock()
        for leftover in self.directory.iterdir():
            if self._temp.fullmatch(leftover.name) and leftover.is_file():
                log.info("removing %s, left by a checkpoint write that did not finish", leftover)
                leftover.unlink(missing_ok=True)

    def _lock(self) -> None:
        # Two writers would resume from and overwrite each other's files; the kernel drops the
        # lock when the process dies, so a kill -9 never leaves the directory locked.
        path = self.directory / f".{self.prefix}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"{self.directory}: another process is using this directory for {self.prefix} "
                f"checkpoints ({path} is locked); give each one its own directory"
            ) from None
        self._lock_fd = fd

    def close(self) -> None:
        """Let another process use the directory (also what process exit does)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def path_for(self, number: int) -> Path:
        """Where checkpoint `number` lives."""
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise ValueError(f"checkpoint number must be a non-negative int, got {number!r}")
        return self.directory / f"{self.prefix}-{number:010d}.safetensors"

    def entries(self) -> list[Path]:
        """Checkpoint files of this store, highest number first (other files are ignored)."""
        found = []
        for entry in self.directory.iterdir():
            match = self._name.fullmatch(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), entry))
        return [entry for _, entry in sorted(found, reverse=True)]

    def save(
        self,
        number: int,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any],
        *,
        allow_nonfinite: bool = False,
    ) -> Path:
        """Write checkpoint `number` atomically, then delete all but the `keep` highest-numbered ones.

        The file just written is never deleted, even when its number is lower
        than those already there (resumed from an older one after skipping).
        """
        path = self.path_for(number)
        write_tensors(path, tensors, meta, self.kind, allow_nonfinite=allow_nonfinite)
        for old in [p for p in self.entries() if p != path][self.keep - 1 :]:
            log.debug("removing old checkpoint %s (keep=%d)", old, self.keep)
            old.unlink(missing_ok=True)
        return path

    def load_latest(
        self, expect: Mapping[str, TensorSpec] | None = None, allow_nonfinite: bool = False
    ) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
        """The newest checkpoint that passes `read_tensors`, as (path, tensors, meta); None if none does.

        Each file skipped on the way is logged as a warning and listed in
        `self.skipped` as (path, reason): a corrupt or half-written checkpoint
        is never loaded.
        """
        self.skipped = []
        for path in self.entries():
            try:
                tensors, meta = read_tensors(
                    path, self.kind, expect, allow_nonfinite, max_bytes=self.max_bytes
                )
            except CheckpointError as exc:
                reason = str(exc)
            except OSError as exc:
                reason = f"{path}: cannot read: {exc}"
            else:
                log.info("resuming from checkpoint %s", path)
                return path, tensors, meta
            log.warning("skipping checkpoint: %s", reason)
            self.skipped.append((path, reason))
        return None
