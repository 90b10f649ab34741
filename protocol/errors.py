"""The one exception the decoder raises, with a machine-readable reason code.

Every rejection carries a `Reason` so that the gateway can count refusals by
kind and put the same code in the reject ack it sends back.
"""

from __future__ import annotations

import enum


class Reason(str, enum.Enum):
    """Why a message was refused; the value is what goes on the wire."""

    MALFORMED = "malformed"  # not a msgpack map, truncated, trailing bytes
    VERSION = "version"  # protocol version this side does not speak
    UNKNOWN_TYPE = "unknown_type"
    UNKNOWN_FIELD = "unknown_field"
    MISSING_FIELD = "missing_field"
    BAD_FIELD = "bad_field"  # a field of the wrong type or out of range
    FRAME_COUNT = "frame_count"
    FRAME_SIZE = "frame_size"  # a payload frame whose length does not match its descriptor
    TOO_LARGE = "too_large"  # over a configured cap
    CHECKSUM = "checksum"
    ENCODING = "encoding"  # unknown payload encoding or inconsistent encoding parameters
    DTYPE = "dtype"
    SHAPE = "shape"
    UNKNOWN_LAYER = "unknown_layer"
    DUPLICATE_LAYER = "duplicate_layer"
    NONFINITE = "nonfinite"
    MANIFEST = "manifest"  # manifests of the two sides differ
    # Verdicts of the gateway on a well-formed push:
    DUPLICATE = "duplicate"  # this (client, seq) was answered before; not applied again
    STALE = "stale"  # based on a model too many versions old; dropped and counted
    NOT_WELCOMED = "not_welcomed"  # a push before a hello (e.g. the gateway restarted)
    WINDOW = "window"  # seq too far ahead of the oldest unanswered one; resend later
    NORM = "norm"  # a layer's gradient norm is over the gateway's bound (policy: reject)
    RATE_LIMITED = "rate_limited"  # more messages or bytes per second than allowed; resend later
    # Who is talking:
    UNAUTHENTICATED = "unauthenticated"  # no enrolled CURVE key behind the message (or it was revoked)
    IDENTITY = "identity"  # a hello naming another device than the one its key was enrolled as
    TOO_MANY_CLIENTS = "too_many_clients"  # the gateway's client table is full


class ProtocolError(Exception):
    """A message was refused; `reason` says which rule it broke, the text says where."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
