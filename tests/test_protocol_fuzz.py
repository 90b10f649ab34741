"""Throw random and mutated frames at the decoder: it may refuse, it may not crash.

Deterministic (seeded) so a failure reproduces; the seed and case index are in
the assertion message.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable

import msgpack
import torch

from elasticfed.protocol import (
    Ack,
    Dense,
    Heartbeat,
    Hello,
    LayerGradient,
    LayerTensor,
    Limits,
    LowRank,
    Manifest,
    Model,
    ModelChunk,
    ModelFetch,
    ModelRequest,
    ProtocolError,
    Push,
    TopK,
    decode,
    encode,
)

SEED = 20261129
CASES = 12_000
LIMITS = Limits(max_message_bytes=1 << 20, max_layer_elements=1 << 16)
MANIFEST = Manifest.from_parameters(
    [("a", torch.nn.Parameter(torch.zeros(6, 5))), ("b", torch.nn.Parameter(torch.zeros(5)))]
)


def seed_messages() -> list[list[bytes]]:
    gen = torch.Generator().manual_seed(SEED)
    msgs = [
        Push(
            1,
            0,
            (
                LayerGradient("a", Dense(torch.randn(6, 5, generator=gen)), 3),
                LayerGradient("b", Dense(torch.randn(5, generator=gen).half())),
            ),
        ),
        Push(
            2,
            1,
            (LayerGradient("a", TopK(torch.randn(4, generator=gen), torch.tensor([0, 7, 8, 29]), (6, 5))),),
        ),
        Push(
            3,
            1,
            (
                LayerGradient(
                    "a", LowRank(torch.randn(6, 2, generator=gen), torch.randn(5, 2, generator=gen), (6, 5))
                ),
            ),
        ),
        Hello("edge-1", MANIFEST, 4, 10, {"timeout_ms": 500, "codec": "dense"}),
        Ack(5, True, 8),
        ModelRequest(3, ("a",)),
        Model(4, False, (LayerTensor("b", Dense(torch.randn(5, generator=gen))),)),
        Heartbeat(99, True),
        ModelFetch(4, 2048, 1024),
        ModelChunk(4, 4096, 2**63 + 5, 2048, bytes(range(256)) * 4),
    ]
    return [[bytes(f) for f in encode(m)] for m in msgs]


def random_value(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(11 if depth < 2 else 8)
    return [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.randint(-(2**63), 2**64 - 1),
        lambda: rng.choice([0, 1, -1, 2**31, 2**63, 2**64 - 1]),
        lambda: rng.uniform(-1e300, 1e300),
        lambda: float(rng.choice(["nan", "inf", "-inf"])),
        lambda: "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(12))),
        lambda: rng.randbytes(rng.randrange(16)),
        lambda: [random_value(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {str(rng.randrange(5)): random_value(rng, depth + 1) for _ in range(rng.randrange(3))},
        lambda: [rng.randrange(-3, 10**6) for _ in range(rng.randrange(10))],
    ][choice]()


def mutate_header_value(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    try:
        header = msgpack.unpackb(frames[0])
    except Exception:  # an earlier mutation broke it already
        header = None
    if not isinstance(header, dict):
        return flip_bytes(rng, frames)
    target: dict = header
    layers = header.get("layers")
    if isinstance(layers, list) and layers and rng.random() < 0.6 and isinstance(layers[0], dict):
        target = layers[0]
    key = rng.choice(list(target) + ["bogus"])
    if rng.random() < 0.15:
        target.pop(key, None)
    else:
        target[key] = random_value(rng)
    return [msgpack.packb(header, use_bin_type=rng.random() < 0.9), *frames[1:]]


def flip_bytes(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    out = list(frames)
    if not out:
        return out
    i = rng.randrange(len(out))
    if not out[i]:
        return out
    data = bytearray(out[i])
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    out[i] = bytes(data)
    return out


def truncate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    out = list(frames)
    if not out:
        return out
    i = rng.randrange(len(out))
    out[i] = out[i][: rng.randrange(len(out[i]) + 1)]
    return out


def reshuffle_frames(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    out = list(frames)
    op = rng.randrange(4)
    if not out:
        return [rng.randbytes(8)]
    if op == 0 and len(out) > 1:
        del out[rng.randrange(1, len(out))]
    elif op == 1:
        out.insert(rng.randrange(1, len(out) + 1), rng.choice(out))
    elif op == 2:
        rng.shuffle(out)
    else:
        out.append(rng.randbytes(rng.randrange(64)))
    return out


def random_frames(rng: random.Random, _: list[bytes]) -> list[bytes]:
    frames = [rng.randbytes(rng.randrange(64)) for _ in range(rng.randrange(5))]
    if frames and rng.random() < 0.5:  # random but well-formed msgpack header
        frames[0] = msgpack.packb(
            {
                "v": 1,
                "type": rng.choice(["push", "hello", "model", "ack", "x"]),
                **{str(k): random_value(rng) for k in range(rng.randrange(4))},
            }
        )
    return frames


def splice(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    # A header from one message with the frames of another.
    other = rng.choice(seed_messages_cache)
    return [frames[0] if frames else b"", *other[1:]]


MUTATORS: list[Callable[[random.Random, list[bytes]], list[bytes]]] = [
    mutate_header_value,
    mutate_header_value,
    flip_bytes,
    truncate,
    reshuffle_frames,
    random_frames,
    splice,
]
seed_messages_cache = seed_messages()


def test_decoder_survives_ten_thousand_hostile_messages() -> None:
    rng = random.Random(SEED)
    outcomes: collections.Counter[str] = collections.Counter()
    for case in range(CASES):
        frames = rng.choice(seed_messages_cache)
        for _ in range(rng.randint(1, 3)):
            frames = rng.choice(MUTATORS)(rng, frames)
        for manifest in (None, MANIFEST):
            try:
                decode(frames, limits=LIMITS, manifest=manifest)
                outcomes["accepted"] += 1
            except ProtocolError as error:
                assert error.detail, f"case {case}: empty reason"
                if "undecodable message" in error.detail:  # the catch-all fired: a check is missing
                    raise AssertionError(f"seed {SEED} case {case}: unchecked failure {error}") from error
                outcomes[error.reason.value] += 1
    assert sum(outcomes.values()) == 2 * CASES
    # The mutations must actually reach deep checks, not only the header parser.
    for reason in (
        "malformed",
        "bad_field",
        "checksum",
        "frame_count",
        "frame_size",
        "unknown_field",
        "missing_field",
        "encoding",
        "shape",
        "dtype",
    ):
        assert outcomes[reason] > 0, f"no case was refused for {reason}: {dict(outcomes)}"
    assert outcomes["accepted"] < CASES, dict(outcomes)
