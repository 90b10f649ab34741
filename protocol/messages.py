"""The Elastic Sync Protocol's messages, and the wire schema of each header field.

A message is a frozen dataclass; each field's metadata names its `Kind`, which
checks a decoded header value and says what was wrong with it.  Fields holding
tensors (`GRADIENTS`, `PARAMETERS`) travel as frames and are handled by the codec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from elasticfed.protocol.errors import ProtocolError, Reason
from elasticfed.protocol.manifest import Manifest
from elasticfed.protocol.payload import Dense, Payload, Sparse

PROTOCOL_VERSION = 1
UINT_MAX = 2**63 - 1


class Kind:
    """Wire type of one header field: validates what came off the wire."""

    def check(self, value: object, where: str) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def to_wire(self, value: Any) -> object:
        return value


def _bad(where: str, expected: str, value: object) -> ProtocolError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ProtocolError(Reason.BAD_FIELD, f"{where}: expected {expected}, got {shown}")


class UInt(Kind):
    def check(self, value: object, where: str) -> int:
        if type(value) is not int or not 0 <= value <= UINT_MAX:
            raise _bad(where, f"an integer in [0, {UINT_MAX}]", value)
        return value


class Str(Kind):
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def check(self, value: object, where: str) -> str:
        if type(value) is not str or len(value) > self.max_len:
            raise _bad(where, f"a string of at most {self.max_len} characters", value)
        return value


class Bool(Kind):
    def check(self, value: object, where: str) -> bool:
        if type(value) is not bool:
            raise _bad(where, "true or false", value)
        return value


class StrList(Kind):
    def __init__(self, max_items: int, max_len: int) -> None:
        self.max_items = max_items
        self.item = Str(max_len)

    def check(self, value: object, where: str) -> tuple[str, ...]:
        if type(value) is not list or len(value) > self.max_items:
            raise _bad(where, f"a list of at most {self.max_items} strings", value)
        return tuple(self.item.check(v, f"{where}[{i}]") for i, v in enumerate(value))

    def to_wire(self, value: Any) -> object:
        return list(value)


class Settings(Kind):
    """A flat map of negotiated settings: string keys, scalar values."""

    MAX_ITEMS = 64

    def check(self, value: object, where: str) -> dict[str, object]:
        if type(value) is not dict or len(value) > self.MAX_ITEMS:
            raise _bad(where, f"a map of at most {self.MAX_ITEMS} settings", value)
        for key, item in value.items():
            if type(key) is not str or len(key) > 64:
                raise _bad(where, "setting names as strings of at most 64 characters", key)
            ok = type(item) in (int, bool, str) or (type(item) is float and math.isfinite(item))
            if not ok or (type(item) is str and len(item) > 256):
                raise _bad(f"{where}.{key}", "a bool, integer, finite float or short string", item)
        return dict(value)


class ManifestKind(Kind):
    MAX_LAYERS = 100_000

    def check(self, value: object, where: str) -> Manifest:
        if type(value) is not list or len(value) > self.MAX_LAYERS:
            raise _bad(where, f"a list of at most {self.MAX_LAYERS} layer entries", value)
        try:
            return Manifest.from_wire(value)
        except ValueError as exc:
            raise ProtocolError(Reason.BAD_FIELD, f"{where}: {exc}") from None

    def to_wire(self, value: Any) -> object:
        return value.to_wire()


class VerdictList(Kind):
    """Verdicts on recent pushes as [seq, code, epoch]; code "" means applied, epoch as in Ack."""

    MAX_ITEMS = 256

    def check(self, value: object, where: str) -> tuple[tuple[int, str, int], ...]:
        if type(value) is not list or len(value) > self.MAX_ITEMS:
            raise _bad(where, f"a list of at most {self.MAX_ITEMS} [seq, code, epoch] triples", value)
        out = []
        for i, item in enumerate(value):
            if type(item) is not list or len(item) != 3:
                raise _bad(f"{where}[{i}]", "a [seq, code, epoch] triple", item)
            at = f"{where}[{i}]"
            out.append(
                (
                    UINT.check(item[0], f"{at}[0]"),
                    CODE.check(item[1], f"{at}[1]"),
                    UINT.check(item[2], f"{at}[2]"),
                )
            )
        return tuple(out)

    def to_wire(self, value: Any) -> object:
        return [[seq, code, epoch] for seq, code, epoch in value]


class DurableList(Kind):
    """[instance, version] pairs: through which model version each gateway instance's pushes are on disk."""

    MAX_ITEMS = 16
    instance = Str(256)

    def check(self, value: object, where: str) -> tuple[tuple[str, int], ...]:
        if type(value) is not list or len(value) > self.MAX_ITEMS:
            raise _bad(where, f"a list of at most {self.MAX_ITEMS} [instance, version] pairs", value)
        out = []
        for i, item in enumerate(value):
            if type(item) is not list or len(item) != 2:
                raise _bad(f"{where}[{i}]", "an [instance, version] pair", item)
            out.append(
                (self.instance.check(item[0], f"{where}[{i}][0]"), UINT.check(item[1], f"{where}[{i}][1]"))
            )
        return tuple(out)

    def to_wire(self, value: Any) -> object:
        return [[instance, version] for instance, version in value]


class Layers(Kind):
    """Tensor-carrying field; the codec turns it into descriptors plus frames.

    Gradients (`with_count`) may travel in any encoding; parameters only dense, or, in a
    patch (`sparse`), as sparse new values of some entries.
    """

    def __init__(self, with_count: bool, sparse: bool = False) -> None:
        self.with_count = with_count
        self.sparse = sparse


class Blob(Kind):
    """Raw bytes in a frame of their own; the header carries their length and checksum (the codec)."""


UINT, BOOL = UInt(), Bool()


class UInt64(Kind):
    """A full 64-bit unsigned value (checksums); msgpack carries it natively."""

    def check(self, value: object, where: str) -> int:
        if type(value) is not int or not 0 <= value < 2**64:
            raise _bad(where, "an integer in [0, 2**64)", value)
        return value


UINT64 = UInt64()


MAX_RATE = 1000.0


def is_rate(value: object) -> bool:
    """A learning rate an edge may say: a finite number in (0, MAX_RATE] (pushes, saved edge state)."""
    return type(value) in (int, float) and math.isfinite(value) and 0.0 < value <= MAX_RATE  # type: ignore[arg-type]


class Rate(Kind):
    """A learning rate, or 0 for "not said"."""

    def check(self, value: object, where: str) -> float:
        if not (is_rate(value) or (type(value) in (int, float) and value == 0)):
            raise _bad(where, f"a learning rate in (0, {MAX_RATE:g}], or 0 when not said", value)
        return float(value)  # type: ignore[arg-type]


RATE = Rate()
MAX_MASS = 1e15


class Mass(Kind):
    """A non-negative finite amount (a version's step mass), 0 when not known."""

    def check(self, value: object, where: str) -> float:
        if not (type(value) in (int, float) and math.isfinite(value) and 0 <= value <= MAX_MASS):  # type: ignore[arg-type]
            raise _bad(where, f"a finite number in [0, {MAX_MASS:g}]", value)
        return float(value)  # type: ignore[arg-type]


MASS = Mass()
ID = Str(256)
CODE = Str(64)
VERDICTS = VerdictList()
GRADIENTS, PARAMETERS = Layers(with_count=True), Layers(with_count=False)
PATCH_VALUES = Layers(with_count=False, sparse=True)
BLOB = Blob()


def wire(kind: Kind, **kwargs: Any) -> Any:
    """Declare a message field and its wire kind."""
    return field(metadata={"wire": kind}, **kwargs)


@dataclass(frozen=True)
class LayerGradient:
    """A layer's gradient sum over `count` step-gradients (count weights the average)."""

    name: str
    payload: Payload
    count: int = 1


@dataclass(frozen=True)
class LayerTensor:
    """A layer's parameter values, as in a model announcement (sparse: some entries, in a patch)."""

    name: str
    payload: Dense | Sparse


class Message:
    """Base of all messages; TYPE is the header's "type" value."""

    TYPE: ClassVar[str]


@dataclass(frozen=True)
class Hello(Message):
    """Edge -> gateway, first on every (re)connection."""

    TYPE: ClassVar[str] = "hello"
    client_id: str = wire(ID)
    manifest: Manifest = wire(ManifestKind())
    model_version: int = wire(UINT)
    next_seq: int = wire(UINT)
    settings: dict[str, object] = wire(Settings(), default_factory=dict)
    # Gateway instances whose acknowledged pushes this edge still holds, not yet known durable.
    holding: tuple[str, ...] = wire(StrList(DurableList.MAX_ITEMS, 256), default=())
    # As in Push, applied before the welcome: after a gateway restart, a late copy of a push
    # below it (a proxy can hold one across connections) is a duplicate, never applied.
    resolved_below: int = wire(UINT, default=0)


@dataclass(frozen=True)
class Welcome(Message):
    """Gateway -> edge: accepted; what the gateway already holds from this edge.

    `gateway_id` is new at every start of a gateway.  `durable` answers the hello's
    `holding`: for each of those instances, the newest checkpoint (epoch) it wrote
    among the checkpoints this gateway descends from (0: none).  What another
    instance acknowledged beyond that is lost with it: the edge sends it again.
    """

    TYPE: ClassVar[str] = "welcome"
    gateway_id: str = wire(ID)
    manifest_digest: str = wire(Str(64))
    model_version: int = wire(UINT)
    durable: tuple[tuple[str, int], ...] = wire(DurableList(), default=())
    # The lowest seq this edge may use for a new push (above everything the gateway judged).
    next_seq: int = wire(UINT, default=0)
    settings: dict[str, object] = wire(Settings(), default_factory=dict)


@dataclass(frozen=True)
class Push(Message):
    """Edge -> gateway: gradients computed against model `base_version`."""

    TYPE: ClassVar[str] = "push"
    seq: int = wire(UINT)
    base_version: int = wire(UINT)
    layers: tuple[LayerGradient, ...] = wire(GRADIENTS)
    # The edge holds no unanswered push below this number: the gateway may forget them.
    resolved_below: int = wire(UINT, default=0)
    # 0 for the first send, n for the n-th re-send; the ack echoes the copy that was applied,
    # so the edge learns whether its re-sends deliver or only duplicate (see edge/session.py).
    attempt: int = wire(UINT, default=0)
    # The learning rate the sums are in units of: each step's direction entered them times its own
    # rate over this one, so `lr` x sum is how far the edge's model moved (schedules and rates that
    # differ per edge included).  0: not said; the gateway assumes its configured edge rate.
    lr: float = wire(RATE, default=0.0)


@dataclass(frozen=True)
class Ack(Message):
    """Gateway -> edge: the verdict on push `seq`, and how many more pushes it may send."""

    TYPE: ClassVar[str] = "ack"
    seq: int = wire(UINT)
    accepted: bool = wire(BOOL)
    credit: int = wire(UINT)
    code: str = wire(CODE, default="")
    detail: str = wire(Str(1024), default="")
    model_version: int = wire(UINT, default=0)  # newest model the gateway has (an announcement)
    attempt: int = wire(UINT, default=0)  # the push's attempt whose copy was applied
    # Verdicts on this edge's other unresolved pushes: any one answer that gets through a
    # lossy link settles everything the gateway has judged (a cumulative acknowledgement).
    verdicts: tuple[tuple[int, str, int], ...] = wire(VERDICTS, default=())
    # Checkpoints are numbered (epochs); an applied push is in checkpoint `epoch`, the next one
    # this gateway writes.  `durable_epoch`: the newest checkpoint on disk.  0: no checkpoints.
    epoch: int = wire(UINT, default=0)
    durable_epoch: int = wire(UINT, default=0)
    gateway_id: str = wire(ID, default="")  # the instance whose epochs these are


@dataclass(frozen=True)
class Commit(Message):
    """Gateway -> edge: every push this gateway instance acknowledged with an epoch up to
    `durable_epoch` is in a checkpoint on disk and survives any crash.

    Durability is named by checkpoint number (epoch) rather than by sequence number: the
    edge sums acknowledged pushes of a layer while it waits (bounded memory), and a sum can
    only be released or re-sent as a whole; all pushes applied between two checkpoints share
    the second one's number, and no other checkpoint holds part of them.
    """

    TYPE: ClassVar[str] = "commit"
    durable_epoch: int = wire(UINT)
    gateway_id: str = wire(ID, default="")


@dataclass(frozen=True)
class ModelRequest(Message):
    """Edge -> gateway: send me the model if newer than `have_version` (all or `names`)."""

    TYPE: ClassVar[str] = "model_request"
    have_version: int = wire(UINT)
    names: tuple[str, ...] = wire(StrList(100_000, 512), default=())


@dataclass(frozen=True)
class Model(Message):
    """Gateway -> edge: parameters of model `version`, all of them when `full`."""

    TYPE: ClassVar[str] = "model"
    version: int = wire(UINT)
    full: bool = wire(BOOL)
    layers: tuple[LayerTensor, ...] = wire(PARAMETERS)
    mass: float = wire(MASS, default=0.0)  # as in ModelChunk


@dataclass(frozen=True)
class ModelFetch(Message):
    """Edge -> gateway: bytes [offset, offset + length) of model `version`'s blob (0: the newest served).

    The blob is every parameter in manifest order (`Manifest.blob_layout`).  Large models
    come down as many small answers the edge asks for a few at a time, so nothing else it
    waits for (an ack, a heartbeat reply) queues behind megabytes, and a download that a
    reconnect interrupts goes on from the chunks it already holds.  With `base_digest`, the
    edge holds version `base` bit for bit, that being its digest, and asks for the patch from
    it (a `ModelPatch` blob) instead, if the gateway has one; version 0 included: an edge that
    built the same seed model as the gateway holds its first version without a download.  The
    gateway patches only from a base whose digest it published as that version, so a base
    held from another gateway instance (or built from another seed) gets a whole model.
    `fetch_ms` is how long the edge's last finished download
    took, first request to model assembled (0: none yet): the gateway mints versions no faster
    than its edges can fetch them (cloud/aggregation.py, DeadlineQuorum).
    """

    TYPE: ClassVar[str] = "model_fetch"
    version: int = wire(UINT)
    offset: int = wire(UINT)
    length: int = wire(UINT)
    base: int = wire(UINT, default=0)
    fetch_ms: int = wire(UINT, default=0)
    base_digest: int = wire(UINT64, default=0)  # 0: the edge holds no base (a whole model)


@dataclass(frozen=True)
class ModelChunk(Message):
    """Gateway -> edge: a slice of model `version`'s blob of `size` bytes whose xxh3-64 is `digest`.

    `version` may differ from the one asked for: the gateway no longer serves that one, and
    the edge starts over on this one.  With `base_digest`, the blob is the patch from `base`
    (the model of that digest) to `version`, and `model_digest` the digest of the whole model
    it makes; without, the blob is the whole model and `base` is 0.

    `mass` is the version's step mass: the learning-rate-weighted step-gradients the gateway's
    updates applied up to it (per round, the sum of lr x staleness weight x steps over the
    round's divisor, a mean over layers; cumulative over this gateway instance).  Between two
    versions, minus the model's change over the change of mass is the fleet's mean step
    direction: SCAFFOLD's server control variate, without sending it (edge/drift.py).  0: not
    known (a gateway whose optimizer adds momentum or adapts its steps, or hybrid mode).
    """

    TYPE: ClassVar[str] = "model_chunk"
    version: int = wire(UINT)
    size: int = wire(UINT)
    digest: int = wire(UINT64)
    offset: int = wire(UINT)
    data: memoryview = wire(BLOB)
    base: int = wire(UINT, default=0)
    model_digest: int = wire(UINT64, default=0)
    mass: float = wire(MASS, default=0.0)
    base_digest: int = wire(UINT64, default=0)  # 0: a whole model, not a patch


@dataclass(frozen=True)
class ModelPatch(Message):
    """What turns model `base` into model `version`: the new values of the entries that changed.

    Never sent alone: it is the blob `ModelChunk`s carry when asked with a base.  New
    values, not differences: setting them gives the gateway's public model bit for bit,
    where adding a difference could round differently on the edge's hardware.
    """

    TYPE: ClassVar[str] = "model_patch"
    base: int = wire(UINT)
    version: int = wire(UINT)
    layers: tuple[LayerTensor, ...] = wire(PATCH_VALUES)


@dataclass(frozen=True)
class Heartbeat(Message):
    """Either way; any message proves liveness, this one exists for idle links."""

    TYPE: ClassVar[str] = "heartbeat"
    nonce: int = wire(UINT)
    reply: bool = wire(BOOL, default=False)
    model_version: int = wire(UINT, default=0)  # from the gateway: its newest model (an announcement)
    resolved_below: int = wire(UINT, default=0)  # from the edge: as in Push
    verdicts: tuple[tuple[int, str, int], ...] = wire(VERDICTS, default=())  # from the gateway: as in Ack
    durable_epoch: int = wire(UINT, default=0)  # from the gateway: as in Ack
    gateway_id: str = wire(ID, default="")  # from the gateway: as in Ack


@dataclass(frozen=True)
class Reject(Message):
    """Gateway -> edge: a message was refused and no ack can carry the verdict."""

    TYPE: ClassVar[str] = "reject"
    code: str = wire(Str(64))
    detail: str = wire(Str(1024))
    ref_seq: int = wire(UINT, default=0)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Welcome,
        Push,
        Ack,
        Commit,
        ModelRequest,
        Model,
        ModelFetch,
        ModelChunk,
        ModelPatch,
        Heartbeat,
        Reject,
    )
}
