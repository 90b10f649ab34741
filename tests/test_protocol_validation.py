"""Each way a message can be malformed is refused with the right reason, and only with ProtocolError."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import msgpack
import pytest
import torch

from elasticfed.protocol import (
    Ack,
    Dense,
    Hello,
    LayerGradient,
    LayerTensor,
    Limits,
    LowRank,
    Manifest,
    Model,
    ModelChunk,
    ProtocolError,
    Push,
    Quantized,
    Reason,
    Sparse,
    TopK,
    decode,
    encode,
    peek_push,
)
from elasticfed.protocol.payload import checksum

MANIFEST = Manifest.from_parameters(
    [("enc.weight", torch.nn.Parameter(torch.zeros(4, 3))), ("enc.bias", torch.nn.Parameter(torch.zeros(4)))]
)


def push_frames(*layers: LayerGradient, seq: int = 1) -> list[bytes]:
    return [bytes(f) for f in encode(Push(seq=seq, base_version=0, layers=layers))]


def good_push() -> list[bytes]:
    return push_frames(
        LayerGradient("enc.weight", Dense(torch.randn(4, 3)), 2),
        LayerGradient("enc.bias", Dense(torch.randn(4))),
    )


def edit_header(frames: list[bytes], change: Callable[[dict], None]) -> list[bytes]:
    header = msgpack.unpackb(frames[0])
    change(header)
    return [msgpack.packb(header), *frames[1:]]


def edit_frame(frames: list[bytes], index: int, data: bytes) -> list[bytes]:
    """Replace payload frame `index` (of a one-layer push), re-checksummed: only the content lies."""
    frames = edit_header(
        frames, lambda h: h["layers"][0]["xxh"].__setitem__(index, checksum(memoryview(data)))
    )
    frames[1 + index] = data
    return frames


def sparse_frames(indices: list[int], numel: int = 10, *, int8: bool = False) -> list[bytes]:
    k = len(indices)
    values = (
        Quantized(torch.ones(k, dtype=torch.int8), torch.ones(1), 8, (k,)) if int8 else Dense(torch.ones(k))
    )
    return push_frames(LayerGradient("w", Sparse.from_indices(torch.tensor(indices), values, (numel,))))


def int8_frames(numel: int = 6, chunk: int = 4) -> list[bytes]:
    scales = torch.ones(-(-numel // chunk))
    return push_frames(
        LayerGradient("w", Quantized(torch.ones(numel, dtype=torch.int8), scales, chunk, (numel,)))
    )


def refused(frames: list, **kwargs) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames, **kwargs)
    return info.value


def test_good_push_decodes() -> None:
    msg = decode(good_push(), manifest=MANIFEST)
    assert [layer.name for layer in msg.layers] == ["enc.weight", "enc.bias"]
    assert msg.lr == 0.0  # its sums' rate unit not said
    said = decode(edit_header(good_push(), lambda h: h.update(lr=0.05)), manifest=MANIFEST)
    assert said.lr == 0.05
    with pytest.raises(ProtocolError, match=r"push\.lr: expected a learning rate"):
        decode(edit_header(good_push(), lambda h: h.update(lr=-1)), manifest=MANIFEST)


def test_decoded_layer_names_are_the_manifest_s_strings_not_a_copy_per_message() -> None:
    """What the gateway keeps per edge and layer is keyed by these names: one string per layer, not
    one per edge (a copy each was 6.7 KB per edge of a 101-layer model)."""
    ours = {spec.name: spec.name for spec in MANIFEST}
    for _ in range(2):
        msg = decode([bytes(f) for f in good_push()], manifest=MANIFEST)
        assert all(layer.name is ours[layer.name] for layer in msg.layers)


def test_a_push_s_numbers_are_read_from_its_header_alone() -> None:
    frames = edit_header(good_push(), lambda h: h.update(seq=7, attempt=2, resolved_below=5))
    head = peek_push([frames[0]])  # no payload frames: they are not read
    assert (head.seq, head.attempt, head.resolved_below) == (7, 2, 5)
    plain = peek_push(good_push())
    assert (plain.seq, plain.attempt, plain.resolved_below) == (1, 0, 0)  # the wire's defaults
    # Anything that is not a push `decode` would take is not peeked at: decoding it says why.
    not_pushes = [
        encode(Hello(client_id="a", manifest=MANIFEST, model_version=0, next_seq=1)),
        edit_header(good_push(), lambda h: h.update(v=2)),
        edit_header(good_push(), lambda h: h.update(v=True)),
        edit_header(good_push(), lambda h: h.pop("seq")),
        edit_header(good_push(), lambda h: h.update(seq=-1)),
        edit_header(good_push(), lambda h: h.update(seq=True)),
        edit_header(good_push(), lambda h: h.update(attempt="2")),
        [b"\xc1"],  # not msgpack
        [msgpack.packb([1, 2])],  # not a map
        [],
    ]
    for frames in not_pushes:
        assert peek_push(frames) is None, frames[:1]
    big = edit_header(good_push(), lambda h: h.update(pad="x" * 200))
    assert peek_push(big, Limits(max_header_bytes=128)) is None


def test_a_model_chunk_says_a_step_mass_or_none() -> None:
    chunk = ModelChunk(version=3, size=4, digest=1, offset=0, data=memoryview(b"abcd"))
    assert decode(encode(chunk)).mass == 0.0  # not known
    said = decode(encode(dataclasses.replace(chunk, mass=12.5)))
    assert said.mass == 12.5
    for bad in (-1.0, float("nan"), float("inf"), 1e16, True, "3"):
        frames = edit_header(encode(chunk), lambda h, bad=bad: h.update(mass=bad))
        error = refused(frames)
        assert error.reason is Reason.BAD_FIELD, bad
        assert "model_chunk.mass: expected a finite number in [0, 1e+15]" in str(error)


CASES: dict[str, tuple[Callable[[], list], Reason]] = {
    "no frames": (lambda: [], Reason.FRAME_COUNT),
    "header not msgpack": (lambda: [b"\xc1garbage"], Reason.MALFORMED),
    "header truncated": (lambda: [good_push()[0][:-3], *good_push()[1:]], Reason.MALFORMED),
    "trailing bytes after header": (lambda: [good_push()[0] + b"\x00", *good_push()[1:]], Reason.MALFORMED),
    "header is a list": (lambda: [msgpack.packb([1, "push"])], Reason.MALFORMED),
    "header uses an ext type": (lambda: [msgpack.packb({"v": msgpack.ExtType(5, b"x")})], Reason.MALFORMED),
    "frame is not bytes": (lambda: [good_push()[0], 12345, good_push()[2]], Reason.MALFORMED),
    "unknown version": (lambda: edit_header(good_push(), lambda h: h.update(v=2)), Reason.VERSION),
    "version as string": (lambda: edit_header(good_push(), lambda h: h.update(v="1")), Reason.VERSION),
    "unknown type": (lambda: edit_header(good_push(), lambda h: h.update(type="pull")), Reason.UNKNOWN_TYPE),
    "unknown field": (lambda: edit_header(good_push(), lambda h: h.update(extra=1)), Reason.UNKNOWN_FIELD),
    "missing field": (lambda: edit_header(good_push(), lambda h: h.pop("seq")), Reason.MISSING_FIELD),
    "negative seq": (lambda: edit_header(good_push(), lambda h: h.update(seq=-1)), Reason.BAD_FIELD),
    "bool as seq": (lambda: edit_header(good_push(), lambda h: h.update(seq=True)), Reason.BAD_FIELD),
    "float as version number": (
        lambda: edit_header(good_push(), lambda h: h.update(base_version=1.5)),
        Reason.BAD_FIELD,
    ),
    "negative learning rate": (
        lambda: edit_header(good_push(), lambda h: h.update(lr=-0.1)),
        Reason.BAD_FIELD,
    ),
    "NaN learning rate": (
        lambda: edit_header(good_push(), lambda h: h.update(lr=float("nan"))),
        Reason.BAD_FIELD,
    ),
    "huge learning rate": (lambda: edit_header(good_push(), lambda h: h.update(lr=1e9)), Reason.BAD_FIELD),
    "bool as learning rate": (
        lambda: edit_header(good_push(), lambda h: h.update(lr=True)),
        Reason.BAD_FIELD,
    ),
    "layers not a list": (lambda: edit_header(good_push(), lambda h: h.update(layers={})), Reason.BAD_FIELD),
    "layer not a map": (
        lambda: edit_header(good_push(), lambda h: h["layers"].__setitem__(0, 3)),
        Reason.BAD_FIELD,
    ),
    "unknown layer key": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(scale=2)),
        Reason.UNKNOWN_FIELD,
    ),
    "missing layer key": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].pop("count")),
        Reason.MISSING_FIELD,
    ),
    "zero count": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(count=0)),
        Reason.BAD_FIELD,
    ),
    "unknown encoding": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(enc="zstd")),
        Reason.ENCODING,
    ),
    "unknown dtype": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(dtype="int8")),
        Reason.DTYPE,
    ),
    "shape with negative dim": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(shape=[-4, -3])),
        Reason.SHAPE,
    ),
    "shape with too many dims": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(shape=[1] * 9)),
        Reason.SHAPE,
    ),
    "shape not matching frame": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(shape=[4, 4])),
        Reason.FRAME_SIZE,
    ),
    "checksum list too short": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(xxh=[])),
        Reason.BAD_FIELD,
    ),
    "checksum not an integer": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(xxh=["abc"])),
        Reason.BAD_FIELD,
    ),
    "checksum mismatch": (
        lambda: edit_header(good_push(), lambda h: h["layers"][0].update(xxh=[h["layers"][0]["xxh"][0] ^ 1])),
        Reason.CHECKSUM,
    ),
    "payload byte flipped": (
        lambda: [*good_push()[:1], bytes([good_push()[1][0] ^ 0xFF]) + good_push()[1][1:], good_push()[2]],
        Reason.CHECKSUM,
    ),
    "frame missing": (lambda: good_push()[:2], Reason.FRAME_COUNT),
    "extra frame": (lambda: [*good_push(), b"more"], Reason.FRAME_COUNT),
    "payload frame truncated": (
        lambda: [good_push()[0], good_push()[1][:-1], good_push()[2]],
        Reason.FRAME_SIZE,
    ),
    "duplicate layer": (
        lambda: push_frames(
            LayerGradient("w", Dense(torch.ones(2))), LayerGradient("w", Dense(torch.ones(2)))
        ),
        Reason.DUPLICATE_LAYER,
    ),
    "nan gradient": (
        lambda: push_frames(LayerGradient("w", Dense(torch.tensor([1.0, math.nan])))),
        Reason.NONFINITE,
    ),
    "inf gradient": (
        lambda: push_frames(LayerGradient("w", Dense(torch.tensor([-math.inf, 1.0])))),
        Reason.NONFINITE,
    ),
    "inf in fp16": (
        lambda: push_frames(LayerGradient("w", Dense(torch.tensor([7e4, 1.0]).half()))),
        Reason.NONFINITE,
    ),
    "nan in top-k values": (
        lambda: push_frames(LayerGradient("w", TopK(torch.tensor([math.nan]), torch.tensor([0]), (3,)))),
        Reason.NONFINITE,
    ),
    "nan in low-rank factor": (
        lambda: push_frames(
            LayerGradient("w", LowRank(torch.tensor([[math.nan], [1.0]]), torch.ones(3, 1), (2, 3)))
        ),
        Reason.NONFINITE,
    ),
    "top-k index out of range": (
        lambda: push_frames(LayerGradient("w", TopK(torch.ones(2), torch.tensor([0, 6]), (2, 3)))),
        Reason.ENCODING,
    ),
    "top-k negative index": (
        lambda: push_frames(LayerGradient("w", TopK(torch.ones(1), torch.tensor([-1]), (2, 3)))),
        Reason.ENCODING,
    ),
    "top-k more values than elements": (
        lambda: edit_header(
            push_frames(LayerGradient("w", TopK(torch.ones(4), torch.arange(4), (4,)))),
            lambda h: h["layers"][0].update(shape=[2]),
        ),
        Reason.ENCODING,
    ),
    "top-k bad index dtype": (
        lambda: edit_header(
            push_frames(LayerGradient("w", TopK(torch.ones(1), torch.tensor([0]), (4,)))),
            lambda h: h["layers"][0].update(index_dtype="uint8"),
        ),
        Reason.DTYPE,
    ),
    "low-rank rank above the matrix": (
        lambda: edit_header(
            push_frames(LayerGradient("w", LowRank(torch.ones(2, 1), torch.ones(3, 1), (2, 3)))),
            lambda h: h["layers"][0].update(rank=3),
        ),
        Reason.ENCODING,
    ),
    "low-rank of a vector": (
        lambda: edit_header(
            push_frames(LayerGradient("w", LowRank(torch.ones(2, 1), torch.ones(3, 1), (2, 3)))),
            lambda h: h["layers"][0].update(shape=[6]),
        ),
        Reason.ENCODING,
    ),
    "int8 code -128": (
        lambda: edit_frame(int8_frames(), 0, bytes([1, 2, 0x80, 4, 5, 6])),
        Reason.ENCODING,
    ),
    "int8 negative scale": (
        lambda: edit_frame(int8_frames(), 1, torch.tensor([1.0, -1.0]).numpy().tobytes()),
        Reason.ENCODING,
    ),
    "int8 nan scale": (
        lambda: edit_frame(int8_frames(), 1, torch.tensor([1.0, math.nan]).numpy().tobytes()),
        Reason.NONFINITE,
    ),
    "int8 scales for another chunk": (
        lambda: edit_header(int8_frames(), lambda h: h["layers"][0].update(chunk=2)),
        Reason.FRAME_SIZE,
    ),
    "int8 chunk zero": (
        lambda: edit_header(int8_frames(), lambda h: h["layers"][0].update(chunk=0)),
        Reason.ENCODING,
    ),
    "sparse indices not sorted": (
        lambda: edit_frame(
            sparse_frames([1, 5]), 1, torch.tensor([5, 1], dtype=torch.int16).numpy().tobytes()
        ),
        Reason.ENCODING,
    ),
    "sparse index repeated": (
        lambda: edit_frame(
            sparse_frames([1, 5]), 1, torch.tensor([5, 5], dtype=torch.int16).numpy().tobytes()
        ),
        Reason.ENCODING,
    ),
    "sparse index past the layer": (
        lambda: edit_frame(
            sparse_frames([1, 5]), 1, torch.tensor([1, 10], dtype=torch.int16).numpy().tobytes()
        ),
        Reason.ENCODING,
    ),
    "sparse counts do not add up": (
        lambda: edit_frame(sparse_frames([1, 5]), 0, torch.tensor([3], dtype=torch.int32).numpy().tobytes()),
        Reason.ENCODING,
    ),
    "sparse negative count": (
        lambda: edit_frame(sparse_frames([1, 5]), 0, torch.tensor([-2], dtype=torch.int32).numpy().tobytes()),
        Reason.ENCODING,
    ),
    "sparse more entries than elements": (
        lambda: edit_header(sparse_frames(list(range(10))), lambda h: h["layers"][0].update(shape=[5])),
        Reason.ENCODING,
    ),
    "sparse values of unknown kind": (
        lambda: edit_header(sparse_frames([1, 5]), lambda h: h["layers"][0].update(values="int4")),
        Reason.ENCODING,
    ),
    "sparse float values with a chunk": (
        lambda: edit_header(sparse_frames([1, 5]), lambda h: h["layers"][0].update(chunk=8)),
        Reason.UNKNOWN_FIELD,
    ),
    "sparse int8 values without a chunk": (
        lambda: edit_header(sparse_frames([1, 5], int8=True), lambda h: h["layers"][0].pop("chunk")),
        Reason.MISSING_FIELD,
    ),
    "sparse int8 value -128": (
        lambda: edit_frame(sparse_frames([1, 5], int8=True), 2, bytes([1, 0x80])),
        Reason.ENCODING,
    ),
    "settings value is a map": (
        lambda: edit_header(
            [bytes(f) for f in encode(Hello("e", MANIFEST, 0, 1))],
            lambda h: h.update(settings={"a": {"b": 1}}),
        ),
        Reason.BAD_FIELD,
    ),
    "manifest entry malformed": (
        lambda: edit_header(
            [bytes(f) for f in encode(Hello("e", MANIFEST, 0, 1))],
            lambda h: h["manifest"].__setitem__(0, ["w", [2], "int8"]),
        ),
        Reason.BAD_FIELD,
    ),
    "manifest with duplicate names": (
        lambda: edit_header(
            [bytes(f) for f in encode(Hello("e", MANIFEST, 0, 1))],
            lambda h: h["manifest"].append(list(h["manifest"][0])),
        ),
        Reason.BAD_FIELD,
    ),
    "ack string too long": (
        lambda: edit_header(
            [bytes(f) for f in encode(Ack(1, False, 0))], lambda h: h.update(detail="x" * 2000)
        ),
        Reason.BAD_FIELD,
    ),
    "compressed parameters": (
        lambda: edit_header(
            [bytes(f) for f in encode(Model(1, True, (LayerTensor("enc.bias", Dense(torch.ones(4))),)))],
            lambda h: h["layers"][0].update(enc="topk", index_dtype="int32"),
        ),
        Reason.ENCODING,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_input_is_refused_with_its_reason(case: str) -> None:
    make, reason = CASES[case]
    error = refused(make())
    assert error.reason is reason, str(error)
    assert error.detail  # a person can read what was wrong


def test_manifest_checks_name_shape_and_parameter_dtype() -> None:
    unknown = push_frames(LayerGradient("dec.weight", Dense(torch.ones(4, 3))))
    assert refused(unknown, manifest=MANIFEST).reason is Reason.UNKNOWN_LAYER
    wrong_shape = push_frames(LayerGradient("enc.weight", Dense(torch.ones(3, 4))))
    error = refused(wrong_shape, manifest=MANIFEST)
    assert error.reason is Reason.SHAPE and "[3, 4]" in error.detail and "[4, 3]" in error.detail
    # Gradients may travel compressed to fp16; parameters must match the model's dtype.
    half_grad = push_frames(LayerGradient("enc.bias", Dense(torch.ones(4).half())))
    assert decode(half_grad, manifest=MANIFEST).layers[0].payload.tensor.dtype == torch.float16
    half_param = [
        bytes(f) for f in encode(Model(1, True, (LayerTensor("enc.bias", Dense(torch.ones(4).half())),)))
    ]
    assert refused(half_param, manifest=MANIFEST).reason is Reason.DTYPE


def test_size_caps_apply_before_parsing() -> None:
    frames = good_push()
    total = sum(len(f) for f in frames)
    assert refused(frames, limits=Limits(max_message_bytes=total - 1)).reason is Reason.TOO_LARGE
    assert decode(frames, limits=Limits(max_message_bytes=total)).seq == 1
    assert refused(frames, limits=Limits(max_header_bytes=len(frames[0]) - 1)).reason is Reason.TOO_LARGE
    assert refused([frames[0]] + [b""] * 10, limits=Limits(max_frames=5)).reason is Reason.TOO_LARGE


def test_claimed_huge_shape_is_refused_without_allocating_it() -> None:
    # A top-k layer claiming 2**40 elements: within the wire format, beyond the element cap.
    frames = edit_header(
        push_frames(LayerGradient("w", TopK(torch.ones(1), torch.tensor([0]), (4,)))),
        lambda h: h["layers"][0].update(shape=[2**20, 2**20]),
    )
    assert refused(frames).reason is Reason.TOO_LARGE
    # Same claim under a raised element cap: still no allocation, decode keeps it sparse.
    msg = decode(frames, limits=Limits(max_layer_elements=2**41))
    assert msg.layers[0].payload.values.numel() == 1


def test_nonfinite_allowed_when_asked() -> None:
    frames = push_frames(LayerGradient("w", Dense(torch.tensor([math.nan, 1.0]))))
    decoded = decode(frames, limits=Limits(allow_nonfinite=True))
    assert math.isnan(decoded.layers[0].payload.tensor[0])


def test_large_finite_values_are_not_mistaken_for_inf() -> None:
    # Their fp32 sum overflows; the exact check must still accept them.
    frames = push_frames(LayerGradient("w", Dense(torch.full((8,), 3e38))))
    assert decode(frames).layers[0].payload.tensor.max() == pytest.approx(3e38)


def test_limits_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="max_frames"):
        Limits(max_frames=0)


def test_socket_refuses_oversized_frames_before_they_reach_the_decoder() -> None:
    import zmq

    from elasticfed.common.transport.zeromq import apply_limits

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    senders = [ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)]
    try:
        apply_limits(router, Limits(max_message_bytes=64 * 1024))
        port = router.bind_to_random_port("tcp://127.0.0.1")
        for sock in [router, *senders]:
            sock.linger = 0
        for sock in senders:
            sock.connect(f"tcp://127.0.0.1:{port}")
        big, small = senders
        big.send_multipart(push_frames(LayerGradient("w", Dense(torch.zeros(32 * 1024)))))  # 128 KiB
        small.send_multipart(push_frames(LayerGradient("w", Dense(torch.ones(8))), seq=2))
        assert router.poll(5000), "the well-behaved peer's message never arrived"
        _, *frames = router.recv_multipart()
        assert decode(frames).seq == 2
        # The oversized message was dropped by libzmq: nothing else arrives.
        assert not router.poll(300)
    finally:
        for sock in [router, *senders]:
            sock.close()
        ctx.term()


def _chunk_frames() -> list[bytes]:
    from elasticfed.protocol import ModelChunk

    return [bytes(f) for f in encode(ModelChunk(version=2, size=64, digest=7, offset=0, data=b"\x01" * 32))]


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda h, fr: h["data"].update(len=31), Reason.FRAME_SIZE),  # the header lies about the length
        (lambda h, fr: h["data"].update(xxh=h["data"]["xxh"] ^ 1), Reason.CHECKSUM),
        (lambda h, fr: h["data"].update(extra=1), Reason.BAD_FIELD),
        (lambda h, fr: h.update(data=[32, 0]), Reason.BAD_FIELD),
        (lambda h, fr: fr.pop(), Reason.FRAME_COUNT),  # the frame itself is missing
        (lambda h, fr: fr.append(b"more"), Reason.FRAME_COUNT),
        (lambda h, fr: h.update(digest="7"), Reason.BAD_FIELD),
        (lambda h, fr: h.update(digest=-1), Reason.BAD_FIELD),
    ],
)
def test_a_model_chunk_s_raw_frame_is_checked_against_its_header(
    mutate: Callable[[dict, list[bytes]], object], reason: Reason
) -> None:
    frames = _chunk_frames()
    header = msgpack.unpackb(frames[0])
    mutate(header, frames)
    frames[0] = msgpack.packb(header)
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert err.value.reason == reason, err.value
