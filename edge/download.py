"""A model download in chunks: resumable across reconnects, paced by the edge, checked whole.

At 10 Mbit/s a 10 MB model takes 8 s.  Sent as one message it would hold every
ack and heartbeat reply behind it, and a reconnect would throw away what had
arrived.  Instead the edge asks for slices of one served version (`ModelFetch`)
and keeps no more of them outstanding than the link drains in about a second;
each arriving chunk is progress (liveness), and the chunks already here stay
here when the connection is replaced: the next requests ask only for the rest.

The gateway keeps the versions edges are fetching; when the one being fetched
is gone it answers with the newest, and only then does a download start over.
The finished blob is checked against the digest the gateway stated, then its
values for NaN/Inf, before the training thread may adopt it.

Once it holds a model, the edge asks with that version as `base` and its digest,
and the gateway answers, where it can, with a patch instead of the whole model
(cloud/publication.py): the new values of the entries changed since, a few
percent of the model.  Before any download the edge holds the model it built
(`hold`): the same seed model as the gateway's is its first version, patched
like any other.  The edge sets them in a copy of the model it holds and
checks the result against the digest of the gateway's whole model: bit for bit
the same, or it fetches a snapshot.

No socket here: the session sends what `requests` returns and hands every
`ModelChunk` to `on_chunk`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy
import torch

from elasticfed.protocol import (
    Dense,
    LayerTensor,
    Manifest,
    Model,
    ModelChunk,
    ModelPatch,
    ProtocolError,
    all_finite,
    blob,
    decode,
    limits_for,
)
from elasticfed.protocol.payload import Sparse

log = logging.getLogger("elasticfed.edge")


class Asks(NamedTuple):
    """When a chunk was first and last asked for (the same time if asked once)."""

    first: float
    last: float

    @property
    def timed_from(self) -> float | None:
        """The send time its answer times the link by; None when asked more than once.

        Which ask an answer is to is unknown then (Karn's rule, as TCP's round-trip timer):
        timed from the last, a chunk asked again just before its first answer came read as 20
        Mbit/s on a 5 Mbit/s link.
        """
        return self.first if self.first == self.last else None


@dataclass
class DownloadStats:
    chunks: int = 0  # chunks received and kept
    bytes: int = 0  # their bytes
    duplicates: int = 0  # chunks received twice (a re-asked request answered twice)
    restarts: int = 0  # downloads started over because the gateway no longer served the version
    corrupt: int = 0  # finished blobs whose digest or values were wrong (started over)
    resumed: int = 0  # connections replaced while a download was part-way (kept what had arrived)
    reasks: int = 0  # requests asked again on the same connection (a link that loses messages)
    patches: int = 0  # models that came as patches
    snapshots: int = 0  # models that came whole
    patch_failures: int = 0  # patches that did not make the gateway's model (a snapshot followed)


class ModelDownload:
    """One version at a time; chunk-sized requests, outstanding ones bounded by a byte budget."""

    def __init__(self, manifest: Manifest, chunk_bytes: int = 256 * 1024) -> None:
        if chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be at least 1024, got {chunk_bytes}")
        self.manifest = manifest
        self.limits = limits_for(manifest)
        self.size = manifest.blob_bytes
        self.chunk_bytes = chunk_bytes
        self.chunks = max(1, math.ceil(self.size / chunk_bytes))
        self.stats = DownloadStats()
        self.version = 0  # the version being assembled (0: none yet; the gateway says which)
        self.digest = 0
        self.base = 0  # a patch from this version is being assembled (with base_digest)
        self.base_digest = 0  # the digest of `base` (0: a whole model is being assembled)
        self.model_digest = 0  # the whole model's digest (for a patch: of the model it makes)
        self.mass = 0.0  # the step mass of the version being assembled (ModelChunk.mass)
        self._sized = True  # the size is known (a patch's, only once its first chunk came)
        # The last model assembled, bit for bit the gateway's public model of that version: the
        # base of the next patch.  Never modified (a patch is applied to a copy).
        self.public: torch.Tensor | None = None
        self.public_version = 0
        self.public_digest = 0
        self._buffer: torch.Tensor | None = None
        self._have = bytearray(self.chunks)  # 1: chunk i is in the buffer
        self._missing = self.chunks
        # chunk -> (when first asked, when last asked) on the current connection
        self._asked: dict[int, tuple[float, float]] = {}
        # The latest time every request sent before it is answered or lost (one FIFO each way): the
        # first ask of each answered chunk (an answer may be to any copy asked, so the earliest).
        self.answered_upto = -math.inf
        self._next = 0  # lowest chunk index that may still be missing and unasked
        self._began: float | None = None  # when this download's first request went out
        self.reasked = 0  # requests of this download asked again (restarts of it keep the count)
        # Seconds from the first request to the model assembled, of the last download that
        # finished (None: none yet).  The gateway paces its rounds no faster (ModelFetch.fetch_ms).
        self.last_fetch_s: float | None = None

    # ---------------------------------------------------------------- state
    @property
    def active(self) -> bool:
        return self._buffer is not None

    def outstanding_bytes(self) -> int:
        return sum(self._chunk_len(i) for i in self._asked)

    def missing_bytes(self) -> int:
        """At most this many bytes are not here yet (what is outstanding is a part of them)."""
        return min(self.size, self._missing * self.chunk_bytes) if self.active else 0

    def oldest_ask(self) -> float | None:
        return min((last for _, last in self._asked.values()), default=None)

    def start(self, version: int, whole: bool = False) -> None:
        """Begin fetching `version` (0: whichever the gateway serves newest), dropping any other;
        as a patch from the model held, unless `whole`."""
        if self.public is not None and not whole:
            self._reset(version, 0, base=self.public_version, base_digest=self.public_digest)
        else:
            self._reset(version, 0)
        self._began = None  # a new download (restarts of one keep its start: see on_chunk)
        self.reasked = 0

    def held(self) -> tuple[int, int] | None:
        """(version, digest) of the model last assembled: the gateway's public model of that version."""
        return None if self.public is None else (self.public_version, self.public_digest)

    def hold(self, version: int, model: torch.Tensor) -> None:
        """The edge holds `model` (a blob in manifest layout) as `version` before any download: the
        seed model it built, which is the gateway's first version where both used the same seed.
        The base of its first patch; the gateway checks the digest, and a model that is not its
        own gets a whole model, as without it."""
        if model.dtype != torch.uint8 or model.numel() != self.manifest.blob_bytes:
            raise ValueError(
                f"a held model is a {self.manifest.blob_bytes}-byte blob of this manifest, got "
                f"{model.numel()} {model.dtype} entries"
            )
        if self.public is None:
            self.public, self.public_version, self.public_digest = model, version, blob.digest(model)

    def forget_public(self) -> None:
        """A new gateway instance has its own public model: what this edge holds is no base for it.

        A patch download under way asked from that base: it goes on as a whole model of the same
        version.  Left a patch, every chunk of it was refused (its base no longer held) and asked
        again, forever: found in CI, an edge stuck 240 s after a gateway restart.
        """
        self.public, self.public_version, self.public_digest = None, 0, 0
        if self.active and self.base_digest:
            self._reset(self.version, 0)

    def connection_lost(self) -> None:
        """Requests sent on a replaced connection are not answered there: ask again on the next."""
        if self.active and self._missing < self.chunks:
            self.stats.resumed += 1
        self._asked.clear()
        self._next = 0

    def unasked(self, offset: int) -> None:
        """The request for the chunk at `offset` never left (no connection yet): ask it again."""
        i = offset // self.chunk_bytes
        if self._asked.pop(i, None) is not None:
            self._next = min(self._next, i)

    # ------------------------------------------------------------- requests
    def requests(
        self,
        budget_bytes: int,
        now: float,
        reask_after_s: float,
        lost_before: float = -math.inf,
        lost_after_s: float = 0.0,
    ) -> list[tuple[int, int, int]]:
        """(version, offset, length) to ask for now, within `budget_bytes` outstanding (of the
        patch from `base`, where there is a `base_digest`).

        A request older than `reask_after_s` is asked again (a link that loses messages on a live
        connection; over TCP the session passes infinity), and so is one asked before
        `lost_before` (or `answered_upto`) and at least `lost_after_s` ago: the link is FIFO each
        way and the gateway answers in order, so an answer to something sent later means this
        one's answer is lost (the gateway could not send it, or refused the request) and will
        never come.  `lost_after_s` spares a link that reorders a little an ask per overtaking.
        """
        if not self.active:
            return []
        if self._began is None:
            self._began = now
        out = []
        lost_before = max(lost_before, self.answered_upto)
        for i, (first, at) in list(self._asked.items()):
            if now - at >= reask_after_s or (at < lost_before and now - at >= lost_after_s):
                self._asked[i] = (first, now)
                self.stats.reasks += 1
                self.reasked += 1
                out.append(self._request(i))
        outstanding = self.outstanding_bytes()
        i = self._next
        while i < self.chunks and (outstanding == 0 or outstanding + self._chunk_len(i) <= budget_bytes):
            if not self._have[i] and i not in self._asked:
                self._asked[i] = (now, now)
                outstanding += self._chunk_len(i)
                out.append(self._request(i))
            i += 1
        self._next = i
        return out

    def _request(self, i: int) -> tuple[int, int, int]:
        return self.version, i * self.chunk_bytes, self._chunk_len(i)

    def _chunk_len(self, i: int) -> int:
        return min(self.chunk_bytes, self.size - i * self.chunk_bytes)

    # --------------------------------------------------------------- chunks
    def on_chunk(self, msg: ModelChunk, now: float) -> tuple[Model | None, Asks | None]:
        """Keep a chunk; (the finished model or None, when it was asked for or None)."""
        whole = self.manifest.blob_bytes
        if msg.base_digest and msg.version <= self.public_version:
            return None, None  # a late or duplicated answer about a patch already applied
        if (not msg.base_digest and (msg.base or msg.size != whole)) or (
            msg.base_digest
            and (
                (msg.base, msg.base_digest) != (self.public_version, self.public_digest)
                or not 0 < msg.size <= self.limits.max_message_bytes
            )
        ):
            log.warning(
                "model chunk of version %d (base %d) of %d bytes does not fit this edge's model "
                "(%d bytes, holding version %d): ignored",
                msg.version,
                msg.base,
                msg.size,
                whole,
                self.public_version,
            )
            return None, None
        if not self.active:
            return None, None  # nothing asked (a late answer after a finished download)
        same = msg.version == self.version and msg.base_digest == self.base_digest and self._sized
        if same and not self.digest:
            self.digest, self.model_digest = msg.digest, msg.model_digest  # the first chunk asked for
        elif not same or msg.digest != self.digest:
            if self.version and msg.version < self.version:
                return None, None  # a late answer about an older download
            if self.version and msg.version != self.version:
                self.stats.restarts += 1
                log.info(
                    "gateway no longer serves model %d: downloading %d instead", self.version, msg.version
                )
            self._reset(msg.version, msg.digest, msg.base, msg.base_digest, size=msg.size, keep_asked=True)
            self.model_digest = msg.model_digest
        i, rem = divmod(msg.offset, self.chunk_bytes)
        if rem or i >= self.chunks or len(msg.data) != self._chunk_len(i):
            log.warning(
                "model chunk at offset %d of %d bytes does not fit this edge's chunking: ignored",
                msg.offset,
                len(msg.data),
            )
            return None, None
        self.mass = msg.mass  # the version's, on every chunk of it (edge/drift.py reads it)
        pair = self._asked.pop(i, None)
        asked = None if pair is None else Asks(*pair)
        if asked is not None:
            self.answered_upto = max(self.answered_upto, asked.first)
        if self._have[i]:
            self.stats.duplicates += 1
            return None, asked
        assert self._buffer is not None
        start = msg.offset
        # numpy reads a read-only receive buffer as it is (torch.frombuffer would warn about it).
        self._buffer[start : start + len(msg.data)].numpy()[:] = numpy.frombuffer(msg.data, dtype=numpy.uint8)
        self._have[i] = 1
        self._missing -= 1
        self.stats.chunks += 1
        self.stats.bytes += len(msg.data)
        if self._missing:
            return None, asked
        return self._finish(now), asked

    def _finish(self, now: float) -> Model | None:
        assert self._buffer is not None
        data, version, digest = self._buffer, self.version, self.digest
        if blob.digest(data) != digest:
            self.stats.corrupt += 1
            log.warning("model %d failed its digest once assembled: downloading it again", version)
            self._reset(version, digest, self.base, self.base_digest, size=self.size)
            return None
        if self.base_digest:
            patched = self._apply_patch(data)
            if patched is None:
                self.stats.patch_failures += 1
                self._reset(version, 0)  # a snapshot of whichever version is newest
                self.version = 0
                return None
            data, digest = patched, self.model_digest
            self.stats.patches += 1
        else:
            self.stats.snapshots += 1
        layers = blob.unpack(self.manifest, data)
        bad = next((name for name, t in layers.items() if not all_finite(t)), None)
        if bad is not None:
            self.stats.corrupt += 1
            log.warning("model %d holds NaN or Inf in %s: not adopted", version, bad)
            self._buffer = None
            return None
        self._buffer = None  # the model owns it now; the next download gets a new one
        self.public, self.public_version, self.public_digest = data, version, digest
        if self._began is not None:
            self.last_fetch_s = max(0.0, now - self._began)
            self._began = None
        self.version = 0
        return Model(
            version=version,
            full=True,
            layers=tuple(LayerTensor(spec.name, Dense(layers[spec.name])) for spec in self.manifest),
            mass=self.mass,
        )

    def _apply_patch(self, data: torch.Tensor) -> torch.Tensor | None:
        """The held model with the patch's values set, if it makes the gateway's model; else None."""
        assert self.public is not None
        try:
            frames = blob.unframe(data, self.limits.max_frames)
            patch = decode(frames, limits=self.limits, manifest=self.manifest)
        except (ValueError, ProtocolError) as exc:
            log.warning("patch to model %d is malformed (%s): fetching the whole model", self.version, exc)
            return None
        if not isinstance(patch, ModelPatch) or (patch.base, patch.version) != (self.base, self.version):
            log.warning(
                "patch to model %d does not say what it patches: fetching the whole model", self.version
            )
            return None
        out = self.public.clone()
        views = blob.unpack(self.manifest, out)
        for layer in patch.layers:
            payload, flat = layer.payload, views[layer.name].view(-1)
            if isinstance(payload, Sparse):
                flat[payload.indices()] = payload.values.to_dense().to(flat.dtype)
            else:
                flat.copy_(payload.tensor.reshape(-1))
        if blob.digest(out) != self.model_digest:
            log.warning(
                "model %d patched from %d differs from the gateway's: fetching the whole model",
                self.version,
                self.base,
            )
            return None
        return out

    def _reset(
        self,
        version: int,
        digest: int,
        base: int = 0,
        base_digest: int = 0,
        size: int = 0,
        keep_asked: bool = False,
    ) -> None:
        """Assemble `version` from scratch: the whole model, or with `base_digest` the patch from `base`."""
        self.version = version
        self.digest = digest
        self.base, self.base_digest = (base, base_digest) if base_digest else (0, 0)
        # A patch's size is known once its first chunk came: until then, one chunk is asked for.
        self._sized = not base_digest or bool(size)
        self.size = size or (self.manifest.blob_bytes if not base_digest else self.chunk_bytes)
        self.chunks = max(1, math.ceil(self.size / self.chunk_bytes))
        self._buffer = torch.empty(self.size, dtype=torch.uint8)
        self._have = bytearray(self.chunks)
        self._missing = self.chunks
        if not keep_asked:
            self._asked.clear()
        for i in [i for i in self._asked if i >= self.chunks]:  # of a larger layout: never answered
            del self._asked[i]
        self._next = 0
