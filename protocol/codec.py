"""Messages to ZeroMQ multipart frames and back: one msgpack header, then raw tensor frames.

`encode` hands ZeroMQ memoryviews of tensor storage (send with copy=False).
`decode` trusts nothing: every way a frame list can be wrong ends in
`ProtocolError` with a reason, checked in an order that never allocates for a
size the sender merely claimed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy
import torch

from elasticfed.protocol.errors import ProtocolError, Reason
from elasticfed.protocol.manifest import Manifest
from elasticfed.protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Blob,
    Kind,
    LayerGradient,
    Layers,
    LayerTensor,
    Message,
    Push,
    Str,
    UInt,
)
from elasticfed.protocol.payload import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    INT8_MAX,
    MAX_DIMS,
    SPARSE_BLOCK,
    Dense,
    LowRank,
    Payload,
    Quantized,
    Sparse,
    TopK,
    checksum,
    dtype_name,
    tensor_buffer,
    tensor_from_buffer,
)

Frame = Any  # bytes, bytearray, memoryview or zmq.Frame (which has .buffer)

_ENVELOPE = ("v", "type")
_NAME = Str(512)
_UINT = UInt()


@dataclass(frozen=True)
class Limits:
    """Caps the decoder enforces before it looks at (or allocates for) a payload."""

    max_message_bytes: int = 256 * 2**20
    max_header_bytes: int = 4 * 2**20
    max_frames: int = 20_001
    max_layer_elements: int = 2**31 - 1
    allow_nonfinite: bool = False
    verify_checksums: bool = True
    encodings: tuple[str, ...] = ("dense", "topk", "lowrank", "int8", "sparse")  # payload encodings accepted

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in (int, "int") and (type(value) is not int or value < 1):
                raise ValueError(f"Limits.{f.name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = Limits()


def limits_for(manifest: Manifest, base: Limits = DEFAULT_LIMITS) -> Limits:
    """The tightest caps a well-formed message about this model can meet.

    The largest frame is a layer in float64 (or a top-k index frame of int64);
    a message holds at most every layer twice (low-rank and top-k send two
    frames each, a sparse int8 layer four frames of 7 bytes an element at most);
    the header holds at most a manifest (a hello).  A hostile
    peer can then make the gateway allocate no more than such messages, and only
    as many per connection as the socket's receive high-water mark lets queue,
    instead of `base`'s generic 256 MiB each.
    """
    layers = list(manifest)
    largest = max((spec.numel for spec in layers), default=0)
    total = sum(spec.numel for spec in layers)
    header = 64 * 2**10 + sum(256 + 16 * len(spec.shape) + len(spec.name.encode()) for spec in layers)
    return dataclasses.replace(
        base,
        max_message_bytes=min(base.max_message_bytes, header + 2 * 8 * total),
        max_header_bytes=min(base.max_header_bytes, header),
        max_frames=min(base.max_frames, 1 + 4 * len(layers)),
        max_layer_elements=min(base.max_layer_elements, max(largest, 1)),
    )


# ---------------------------------------------------------------- encoding


def encode(msg: Message) -> list[Any]:
    """Frames for `socket.send_multipart(frames, copy=False)`.

    Payload frames are views of the tensors: do not modify them until sent.
    """
    header: dict[str, object] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    frames: list[Any] = [b""]
    for f in dataclasses.fields(msg):
        kind: Kind = f.metadata["wire"]
        value = getattr(msg, f.name)
        if isinstance(kind, Layers):
            header[f.name] = [_describe(layer, kind, frames) for layer in value]
        elif isinstance(kind, Blob):
            buf = memoryview(value).cast("B") if not isinstance(value, bytes) else value
            header[f.name] = {"len": len(buf), "xxh": checksum(memoryview(buf))}
            frames.append(buf)
        else:
            header[f.name] = kind.to_wire(value)
    frames[0] = msgpack.packb(header)
    return frames


def _describe(layer: LayerGradient | LayerTensor, kind: Layers, frames: list[Any]) -> dict:
    payload = layer.payload
    desc: dict[str, object] = {"name": layer.name}
    if kind.with_count:
        desc["count"] = layer.count
    if isinstance(payload, Dense):
        desc.update(enc="dense", dtype=dtype_name(payload.tensor.dtype), shape=list(payload.shape))
        parts = [payload.tensor]
    elif isinstance(payload, TopK):
        desc.update(
            enc="topk",
            dtype=dtype_name(payload.values.dtype),
            shape=list(payload.shape),
            index_dtype=dtype_name(payload.indices.dtype),
        )
        parts = [payload.values, payload.indices]
    elif isinstance(payload, LowRank):
        desc.update(
            enc="lowrank",
            dtype=dtype_name(payload.p.dtype),
            shape=list(payload.shape),
            rank=payload.rank,
        )
        parts = [payload.p, payload.q]
    elif isinstance(payload, Quantized):
        desc.update(
            enc="int8", dtype=dtype_name(payload.dtype), shape=list(payload.shape), chunk=payload.chunk
        )
        parts = [payload.codes, payload.scales]
    elif isinstance(payload, Sparse):
        desc.update(enc="sparse", dtype=dtype_name(payload.dtype), shape=list(payload.shape))
        parts = [payload.counts, payload.offsets]
        if isinstance(payload.values, Quantized):
            desc.update(values="int8", chunk=payload.values.chunk)
            parts += [payload.values.codes, payload.values.scales]
        else:
            desc.update(values="float")
            parts.append(payload.values.tensor)
    else:
        raise TypeError(f"layer {layer.name}: unknown payload type {type(payload).__name__}")
    sums = []
    for tensor in parts:
        buf = tensor_buffer(tensor)
        sums.append(checksum(buf))
        frames.append(buf)
    desc["xxh"] = sums
    return desc


# ---------------------------------------------------------------- decoding


def decode(
    frames: Sequence[Frame],
    *,
    limits: Limits = DEFAULT_LIMITS,
    manifest: Manifest | None = None,
) -> Message:
    """Parse and validate a multipart message; raises only ProtocolError."""
    try:
        return _decode(frames, limits, manifest)
    except ProtocolError:
        raise
    except Exception as exc:  # a check we missed must still not crash a server
        raise ProtocolError(Reason.MALFORMED, f"undecodable message ({type(exc).__name__}: {exc})") from exc


def _decode(frames: Sequence[Frame], limits: Limits, manifest: Manifest | None) -> Message:
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError(Reason.FRAME_COUNT, "a message needs at least a header frame")
    if len(frames) > limits.max_frames:
        raise ProtocolError(Reason.TOO_LARGE, f"{len(frames)} frames, limit {limits.max_frames}")
    bufs = [_as_bytes(f, i) for i, f in enumerate(frames)]
    total = sum(len(b) for b in bufs)
    if total > limits.max_message_bytes:
        raise ProtocolError(Reason.TOO_LARGE, f"{total} bytes, limit {limits.max_message_bytes}")
    if len(bufs[0]) > limits.max_header_bytes:
        raise ProtocolError(
            Reason.TOO_LARGE, f"header of {len(bufs[0])} bytes, limit {limits.max_header_bytes}"
        )
    header = _unpack_header(bufs[0])

    version = header.get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError(
            Reason.VERSION,
            f"protocol version {version!r} is not spoken here (this side speaks {PROTOCOL_VERSION})",
        )
    mtype = header.get("type")
    cls = MESSAGE_TYPES.get(mtype) if type(mtype) is str else None
    if cls is None:
        raise ProtocolError(Reason.UNKNOWN_TYPE, f"message type {mtype!r} is unknown")

    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in header:
        if key not in fields and key not in _ENVELOPE:
            raise ProtocolError(Reason.UNKNOWN_FIELD, f"{mtype}: unknown field {key!r}")

    reader = _LayerReader(bufs[1:], limits, manifest)
    values: dict[str, object] = {}
    for name, f in fields.items():
        where = f"{mtype}.{name}"
        if name not in header:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(Reason.MISSING_FIELD, f"{where} is required")
            continue
        kind: Kind = f.metadata["wire"]
        if isinstance(kind, Layers):
            values[name] = reader.layers(header[name], kind, where)
        elif isinstance(kind, Blob):
            values[name] = reader.blob(header[name], where)
        else:
            values[name] = kind.check(header[name], where)
    if reader.used != len(reader.frames):
        raise ProtocolError(
            Reason.FRAME_COUNT,
            f"{mtype}: header describes {reader.used} payload frames, message has {len(reader.frames)}",
        )
    return cls(**values)


@dataclass(frozen=True)
class PushHead:
    """What a push says of itself in its header: enough to find it was judged before."""

    seq: int
    attempt: int
    resolved_below: int


_PUSH_KINDS = {f.name: f.metadata["wire"] for f in dataclasses.fields(Push)}


def peek_push(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS) -> PushHead | None:
    """A push's numbers read from its header alone; None for anything else, a push with a header
    `decode` would refuse included (decoding it then says why).

    Why: a copy of a push sent again (its ack lost, or late) is answered from what the gateway
    remembers of the first.  Decoding and checking its payload first cost a duplicate as much as a
    push (22 ms for a compressed push of 101 layers), and under load the duplicates lengthen the
    very queue that makes edges send them again.
    """
    if not isinstance(frames, (list, tuple)) or not frames:
        return None
    try:
        raw = _as_bytes(frames[0], 0)
        if len(raw) > limits.max_header_bytes:
            return None
        header = _unpack_header(raw)
        version = header.get("v")
        if type(version) is not int or version != PROTOCOL_VERSION or header.get("type") != Push.TYPE:
            return None
        numbers = {}
        for name in ("seq", "attempt", "resolved_below"):
            value = header.get(name, 0 if name != "seq" else None)
            numbers[name] = _PUSH_KINDS[name].check(value, f"push.{name}")
    except ProtocolError:
        return None
    return PushHead(**numbers)


def frame_bytes(frame: Frame) -> Any:
    """The bytes of a frame as sent or received (a zmq.Frame exposes them as .buffer)."""
    return getattr(frame, "buffer", frame)


def _as_bytes(frame: Frame, index: int) -> memoryview:
    buf = frame_bytes(frame)
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise ProtocolError(Reason.MALFORMED, f"frame {index} is a {type(frame).__name__}, not bytes")
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _reject_ext(code: int, data: bytes) -> object:
    raise ProtocolError(Reason.MALFORMED, f"header uses msgpack extension type {code}")


def _unpack_header(raw: memoryview) -> dict:
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext, timestamp=0
        )
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(Reason.MALFORMED, f"header is not valid msgpack ({exc})") from None
    if type(header) is not dict:
        raise ProtocolError(Reason.MALFORMED, f"header is a {type(header).__name__}, not a map")
    return header


_COMMON_KEYS = frozenset({"name", "enc", "dtype", "shape", "xxh"})
_ENC_KEYS = {
    "dense": frozenset(),
    "topk": frozenset({"index_dtype"}),
    "lowrank": frozenset({"rank"}),
    "int8": frozenset({"chunk"}),
    "sparse": frozenset({"values"}),  # and "chunk" when the values are int8
}


class _LayerReader:
    """Turns layer descriptors into payloads, consuming payload frames in order.

    Every size is derived from the header and checked against the frame before
    a tensor is built over it, so a lying header costs nothing but a refusal.
    """

    def __init__(self, frames: list[memoryview], limits: Limits, manifest: Manifest | None) -> None:
        self.frames = frames
        self.used = 0
        self.limits = limits
        self.manifest = manifest

    def layers(self, descs: object, kind: Layers, where: str) -> tuple:
        if type(descs) is not list:
            raise ProtocolError(Reason.BAD_FIELD, f"{where}: expected a list of layers")
        out = []
        seen: set[str] = set()
        for i, desc in enumerate(descs):
            layer = self.layer(desc, kind, f"{where}[{i}]")
            if layer.name in seen:
                raise ProtocolError(Reason.DUPLICATE_LAYER, f"{where}: layer {layer.name} appears twice")
            seen.add(layer.name)
            out.append(layer)
        return tuple(out)

    def blob(self, desc: object, where: str) -> memoryview:
        """A raw frame whose length and checksum the header states."""
        if type(desc) is not dict or set(desc) != {"len", "xxh"}:
            raise ProtocolError(Reason.BAD_FIELD, f"{where}: expected a map of exactly len and xxh")
        size = _UINT.check(desc["len"], f"{where}.len")
        if self.used >= len(self.frames):
            raise ProtocolError(Reason.FRAME_COUNT, f"{where}: message ends before its frame")
        buf = self.frames[self.used]
        if len(buf) != size:
            raise ProtocolError(Reason.FRAME_SIZE, f"{where}: frame has {len(buf)} bytes, header says {size}")
        if self.limits.verify_checksums:
            want = desc["xxh"]
            if type(want) is not int or not 0 <= want < 2**64:
                raise ProtocolError(Reason.BAD_FIELD, f"{where}: checksum is not a 64-bit integer")
            if checksum(buf) != want:
                raise ProtocolError(Reason.CHECKSUM, f"{where}: frame fails its checksum")
        self.used += 1
        return buf

    def layer(self, desc: object, kind: Layers, where: str) -> LayerGradient | LayerTensor:
        if type(desc) is not dict:
            raise ProtocolError(Reason.BAD_FIELD, f"{where}: layer descriptor is not a map")
        name = _NAME.check(desc.get("name"), f"{where}.name")
        where = f"{where} ({name})"
        enc = self._check_keys(desc, kind, where)
        dtype = FLOAT_DTYPES.get(desc["dtype"]) if type(desc["dtype"]) is str else None
        if dtype is None:
            raise ProtocolError(
                Reason.DTYPE, f"{where}: dtype {desc['dtype']!r} is not one of {sorted(FLOAT_DTYPES)}"
            )
        shape = _check_shape(desc["shape"], where, self.limits)
        name = self._check_manifest(name, shape, desc["dtype"], kind, where)

        tensors = self._read(self._layout(desc, enc, dtype, shape, where), desc["xxh"], where)
        payload = _payload(enc, desc, tensors, shape, where)
        if not kind.with_count:
            return LayerTensor(name, payload)  # type: ignore[arg-type]  # dense, checked above
        count = _UINT.check(desc["count"], f"{where}.count")
        if count < 1:
            raise ProtocolError(Reason.BAD_FIELD, f"{where}: count must be at least 1")
        return LayerGradient(name, payload, count)

    def _check_keys(self, desc: dict, kind: Layers, where: str) -> str:
        enc = desc.get("enc")
        if type(enc) is not str or enc not in _ENC_KEYS:
            raise ProtocolError(Reason.ENCODING, f"{where}: unknown encoding {enc!r}")
        if enc not in self.limits.encodings:
            raise ProtocolError(Reason.ENCODING, f"{where}: encoding {enc} is not accepted here")
        if not kind.with_count and enc != "dense":
            patch_values = kind.sparse and enc == "sparse" and desc.get("values") == "float"
            if not patch_values:
                raise ProtocolError(
                    Reason.ENCODING,
                    f"{where}: parameters must be dense (or sparse float values in a patch), not {enc}",
                )
        allowed = _COMMON_KEYS | _ENC_KEYS[enc] | ({"count"} if kind.with_count else frozenset())
        if enc == "sparse" and desc.get("values") == "int8":
            allowed |= {"chunk"}
        for key in desc:
            if key not in allowed:
                raise ProtocolError(Reason.UNKNOWN_FIELD, f"{where}: unknown key {key!r}")
        for key in allowed:
            if key not in desc:
                raise ProtocolError(Reason.MISSING_FIELD, f"{where}: {key} is required")
        return enc

    def _check_manifest(self, name: str, shape: tuple[int, ...], dtype: str, kind: Layers, where: str) -> str:
        """The layer's name as the manifest holds it: the one string every message shares, so what is
        kept per edge and layer (counters keyed by both) does not hold a copy per edge (67 B x 101
        layers x 10,000 edges)."""
        if self.manifest is None:
            return name
        spec = self.manifest.get(name)
        if spec is None:
            raise ProtocolError(Reason.UNKNOWN_LAYER, f"{where}: no such layer in the manifest")
        if spec.shape != shape:
            raise ProtocolError(
                Reason.SHAPE, f"{where}: shape {list(shape)}, manifest says {list(spec.shape)}"
            )
        # Gradients may travel in a narrower float type, never a wider one (a float64 sum for a
        # float32 layer could overflow it); parameters must match the model.
        if not kind.with_count and dtype != spec.dtype:
            raise ProtocolError(Reason.DTYPE, f"{where}: dtype {dtype}, manifest says {spec.dtype}")
        if kind.with_count and FLOAT_DTYPES[dtype].itemsize > FLOAT_DTYPES[spec.dtype].itemsize:
            raise ProtocolError(
                Reason.DTYPE, f"{where}: dtype {dtype} is wider than the layer's {spec.dtype}"
            )
        return spec.name

    def _layout(
        self, desc: dict, enc: str, dtype: torch.dtype, shape: tuple[int, ...], where: str
    ) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of each of this layer's frames, from the header alone."""
        numel = math.prod(shape)
        if enc == "dense":
            return [(dtype, shape)]
        if enc == "topk":
            idx = INDEX_DTYPES.get(desc["index_dtype"]) if type(desc["index_dtype"]) is str else None
            if idx is None:
                raise ProtocolError(
                    Reason.DTYPE, f"{where}: index_dtype {desc['index_dtype']!r} is not int32 or int64"
                )
            if self.used >= len(self.frames):
                raise ProtocolError(Reason.FRAME_COUNT, f"{where}: message ends before this layer's frames")
            k = len(self.frames[self.used]) // dtype.itemsize  # k is implied by the values frame
            if k > numel:
                raise ProtocolError(Reason.ENCODING, f"{where}: top-k sends {k} values for {numel} elements")
            return [(dtype, (k,)), (idx, (k,))]
        if enc == "int8":
            chunk = _chunk(desc, numel, where)
            return [(torch.int8, (numel,)), (dtype, (-(-numel // chunk),))]
        if enc == "sparse":
            if desc["values"] not in ("float", "int8"):
                raise ProtocolError(
                    Reason.ENCODING, f"{where}: sparse values {desc['values']!r} are not float or int8"
                )
            if self.used + 1 >= len(self.frames):
                raise ProtocolError(Reason.FRAME_COUNT, f"{where}: message ends before this layer's frames")
            k = len(self.frames[self.used + 1]) // 2  # k is implied by the offsets frame
            if k > numel:
                raise ProtocolError(
                    Reason.ENCODING, f"{where}: sparse sends {k} entries for {numel} elements"
                )
            layout = [(torch.int32, (-(-numel // SPARSE_BLOCK),)), (torch.int16, (k,))]
            if desc["values"] == "float":
                return [*layout, (dtype, (k,))]
            chunk = _chunk(desc, k, where)
            return [*layout, (torch.int8, (k,)), (dtype, (-(-k // chunk),))]
        rank = _UINT.check(desc["rank"], f"{where}.rank")
        if len(shape) < 2 or rank < 1 or rank > min(shape[0], numel // max(shape[0], 1)):
            raise ProtocolError(
                Reason.ENCODING, f"{where}: rank {rank} is impossible for a layer of shape {list(shape)}"
            )
        return [(dtype, (shape[0], rank)), (dtype, (numel // shape[0], rank))]

    def _read(
        self, layout: list[tuple[torch.dtype, tuple[int, ...]]], sums: object, where: str
    ) -> list[torch.Tensor]:
        if type(sums) is not list or len(sums) != len(layout):
            raise ProtocolError(Reason.BAD_FIELD, f"{where}: xxh must list {len(layout)} checksums")
        if self.used + len(layout) > len(self.frames):
            raise ProtocolError(Reason.FRAME_COUNT, f"{where}: message ends before this layer's frames")
        tensors = []
        for j, (dtype, shape) in enumerate(layout):
            buf = self.frames[self.used + j]
            expected = math.prod(shape) * dtype.itemsize
            if len(buf) != expected:
                raise ProtocolError(
                    Reason.FRAME_SIZE, f"{where}: frame {j} has {len(buf)} bytes, expected {expected}"
                )
            if self.limits.verify_checksums:
                want = sums[j]
                if type(want) is not int or not 0 <= want < 2**64:
                    raise ProtocolError(Reason.BAD_FIELD, f"{where}: checksum {j} is not a 64-bit integer")
                if checksum(buf) != want:
                    raise ProtocolError(Reason.CHECKSUM, f"{where}: frame {j} fails its checksum")
            tensor = tensor_from_buffer(buf, dtype, shape)
            if not self.limits.allow_nonfinite and tensor.is_floating_point() and not all_finite(tensor):
                raise ProtocolError(Reason.NONFINITE, f"{where}: frame {j} holds NaN or Inf")
            tensors.append(tensor)
        self.used += len(layout)
        return tensors


def _payload(
    enc: str, desc: dict, tensors: list[torch.Tensor], shape: tuple[int, ...], where: str
) -> Payload:
    if enc == "dense":
        return Dense(tensors[0])
    numel = math.prod(shape)
    if enc == "topk":
        values, indices = tensors
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise ProtocolError(Reason.ENCODING, f"{where}: top-k index outside [0, {numel})")
        return TopK(values, indices, shape)
    if enc == "int8":
        return _quantized(tensors[0], tensors[1], desc["chunk"], shape, where)
    if enc == "sparse":
        counts, offsets = tensors[0], tensors[1]
        k = offsets.numel()
        # In numpy (views, no copies): these checks run on every layer of every push, most of
        # them small, where a torch call's overhead was most of a layer's decode.
        c = counts.numpy()
        if numel:
            last = numel - (c.size - 1) * SPARSE_BLOCK  # the last block may be short
            if (
                int(c.min()) < 0
                or int(c[:-1].max(initial=0)) > SPARSE_BLOCK
                or int(c[-1]) > last
                or int(c.sum(dtype=numpy.int64)) != k
            ):
                raise ProtocolError(
                    Reason.ENCODING,
                    f"{where}: sparse block counts are negative, exceed their block or do not add up to {k}",
                )
        if desc["values"] == "float":
            values: Dense | Quantized = Dense(tensors[2])
        else:
            values = _quantized(tensors[2], tensors[3], desc["chunk"], (k,), where)
        payload = Sparse(counts, offsets, values, shape)
        if k:
            flat = payload.indices().numpy()  # the counts are checked: at most k entries
            if k > 1 and not bool((flat[1:] > flat[:-1]).all()):
                raise ProtocolError(Reason.ENCODING, f"{where}: sparse indices are not sorted and unique")
            if int(flat[-1]) >= numel:
                raise ProtocolError(Reason.ENCODING, f"{where}: sparse index outside [0, {numel})")
        return payload
    return LowRank(tensors[0], tensors[1], shape)


def _chunk(desc: dict, numel: int, where: str) -> int:
    chunk = _UINT.check(desc["chunk"], f"{where}.chunk")
    if chunk < 1:
        raise ProtocolError(Reason.ENCODING, f"{where}: int8 chunk must be at least 1, got {chunk}")
    return chunk


def _quantized(
    codes: torch.Tensor, scales: torch.Tensor, chunk: int, shape: tuple[int, ...], where: str
) -> Quantized:
    if codes.numel() and int(codes.numpy().min()) < -INT8_MAX:
        raise ProtocolError(Reason.ENCODING, f"{where}: int8 code -128 (codes are -127..127)")
    if scales.numel() and float(scales.min()) < 0:
        raise ProtocolError(Reason.ENCODING, f"{where}: negative int8 scale")
    return Quantized(codes, scales, chunk, shape)


def _check_shape(shape: object, where: str, limits: Limits) -> tuple[int, ...]:
    if type(shape) is not list or len(shape) > MAX_DIMS or any(type(d) is not int or d < 0 for d in shape):
        raise ProtocolError(
            Reason.SHAPE, f"{where}: shape must be a list of at most {MAX_DIMS} non-negative integers"
        )
    numel = math.prod(shape)
    if numel > limits.max_layer_elements:
        raise ProtocolError(Reason.TOO_LARGE, f"{where}: {numel} elements, limit {limits.max_layer_elements}")
    return tuple(shape)


def all_finite(tensor: torch.Tensor) -> bool:
    """One pass at memory speed: any NaN or Inf makes the sum non-finite.

    A non-finite sum can also be an overflow of finite values, so that rare
    case is settled by the exact elementwise test.
    """
    if tensor.numel() == 0:
        return True
    if math.isfinite(float(tensor.sum(dtype=torch.float32 if tensor.dtype != torch.float64 else None))):
        return True
    return bool(torch.isfinite(tensor).all())
