"""The Elastic Sync Protocol on the wire: messages, payload encodings, manifest, codec.

Knows bytes, tensors and messages; nothing of training.
"""

from elasticfed.protocol import blob
from elasticfed.protocol.codec import (
    DEFAULT_LIMITS,
    Limits,
    PushHead,
    all_finite,
    decode,
    encode,
    frame_bytes,
    limits_for,
    peek_push,
)
from elasticfed.protocol.errors import ProtocolError, Reason
from elasticfed.protocol.manifest import LayerSpec, Manifest
from elasticfed.protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    UINT_MAX,
    Ack,
    Commit,
    Heartbeat,
    Hello,
    LayerGradient,
    LayerTensor,
    Message,
    Model,
    ModelChunk,
    ModelFetch,
    ModelPatch,
    ModelRequest,
    Push,
    Reject,
    Welcome,
)
from elasticfed.protocol.payload import FLOAT_DTYPES, Dense, LowRank, Payload, Quantized, Sparse, TopK

__all__ = [
    "DEFAULT_LIMITS",
    "FLOAT_DTYPES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "UINT_MAX",
    "Ack",
    "Commit",
    "Dense",
    "Heartbeat",
    "Hello",
    "LayerGradient",
    "LayerSpec",
    "LayerTensor",
    "Limits",
    "LowRank",
    "Manifest",
    "Message",
    "Model",
    "ModelChunk",
    "ModelFetch",
    "ModelPatch",
    "ModelRequest",
    "Payload",
    "ProtocolError",
    "Push",
    "PushHead",
    "Quantized",
    "Reason",
    "Reject",
    "Sparse",
    "TopK",
    "Welcome",
    "all_finite",
    "blob",
    "decode",
    "encode",
    "frame_bytes",
    "limits_for",
    "peek_push",
]
