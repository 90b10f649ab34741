"""Every message and payload encoding survives encode -> (ZeroMQ) -> decode, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings

from elasticfed.protocol import (
    Dense,
    LayerGradient,
    LayerTensor,
    LowRank,
    Manifest,
    Model,
    Push,
    Quantized,
    Sparse,
    TopK,
    decode,
    encode,
)
from elasticfed.protocol.payload import FLOAT_DTYPES
from tests.conftest import same_message
from tests.strategies import messages, payloads


@settings(max_examples=400, deadline=None)
@given(messages)
def test_every_message_round_trips(msg) -> None:
    frames = encode(msg)
    decoded = decode(frames)
    assert same_message(decoded, msg)


@settings(max_examples=300, deadline=None)
@given(payloads())
def test_every_encoding_round_trips_and_densifies_identically(payload) -> None:
    msg = Push(seq=7, base_version=3, layers=(LayerGradient("w", payload, 5),))
    decoded = decode(encode(msg)).layers[0]
    assert decoded.count == 5
    assert same_message(decode(encode(msg)), msg)
    dense_in, dense_out = payload.to_dense(), decoded.payload.to_dense()
    assert dense_out.shape == dense_in.shape
    assert torch.equal(dense_out, dense_in)


@settings(max_examples=100, deadline=None)
@given(messages)
def test_decoding_bytes_copies_of_frames_gives_the_same_message(msg) -> None:
    # What a copying receiver (recv_multipart(copy=True)) hands the decoder.
    frames = [bytes(f) for f in encode(msg)]
    assert same_message(decode(frames), msg)


def _address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data if len(buf) else 0


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES.values()))
def test_encode_hands_zeromq_views_of_tensor_storage(dtype: torch.dtype) -> None:
    dense = torch.randn(64, 32).to(dtype)
    topk = TopK(torch.randn(10).to(dtype), torch.arange(10, dtype=torch.int32), (64, 32))
    low = LowRank(torch.randn(64, 2).to(dtype), torch.randn(32, 2).to(dtype), (64, 32))
    msg = Push(
        seq=1,
        base_version=0,
        layers=(LayerGradient("a", Dense(dense)), LayerGradient("b", topk), LayerGradient("c", low)),
    )
    frames = encode(msg)
    sources = [dense, topk.values, topk.indices, low.p, low.q]
    assert [_address(f) for f in frames[1:]] == [t.data_ptr() for t in sources]


@pytest.mark.parametrize("int8", [False, True])
def test_sparse_indices_cross_the_16_bit_blocks_of_their_coding(int8: bool) -> None:
    # Offsets are 16 bits within blocks of 65,536: entries at both edges of every block,
    # an empty block, and the layer's last element (a short last block).
    shape = (5, 60_000)
    indices = torch.tensor([0, 65_535, 65_536, 65_537, 131_071, 262_144, 299_999])
    k = indices.numel()
    values = (
        Quantized(torch.arange(1, k + 1, dtype=torch.int8), torch.full((2,), 0.5), 4, (k,))
        if int8
        else Dense(torch.arange(1.0, k + 1))
    )
    payload = Sparse.from_indices(indices, values, shape)
    assert payload.counts.tolist() == [2, 3, 0, 0, 2]
    decoded = (
        decode(encode(Push(seq=1, base_version=0, layers=(LayerGradient("w", payload),)))).layers[0].payload
    )
    assert torch.equal(decoded.indices(), indices)
    dense = decoded.to_dense().view(-1)
    expected = torch.zeros(300_000)
    expected[indices] = values.to_dense()
    assert torch.equal(dense, expected)
    # 2 bytes an index, 4 bytes per block: what makes top-k pay on a slow link.
    frames = encode(Push(seq=1, base_version=0, layers=(LayerGradient("w", payload),)))
    assert len(frames[1]) + len(frames[2]) == 5 * 4 + 2 * k


def test_non_contiguous_tensor_is_sent_correctly() -> None:
    base = torch.randn(8, 6)
    transposed = base.T  # not contiguous: the codec must lay it out, not send raw storage
    decoded = decode(encode(Push(seq=1, base_version=0, layers=(LayerGradient("w", Dense(transposed)),))))
    assert torch.equal(decoded.layers[0].payload.tensor, transposed)


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
def test_zero_copy_over_real_zeromq_sockets(transport: str) -> None:
    """A 4 MiB layer crosses DEALER -> ROUTER and is decoded over the received buffer."""
    manifest = Manifest.from_parameters([("layer", torch.nn.Parameter(torch.zeros(1024, 1024)))])
    grad = torch.randn(1024, 1024)
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        for sock in (router, dealer):
            sock.linger = 0
            sock.rcvtimeo = 5000
        if transport == "tcp":
            port = router.bind_to_random_port("tcp://127.0.0.1")
            dealer.connect(f"tcp://127.0.0.1:{port}")
        else:
            router.bind("inproc://codec-test")
            dealer.connect("inproc://codec-test")
        dealer.send_multipart(
            encode(Push(seq=9, base_version=2, layers=(LayerGradient("layer", Dense(grad), 3),))), copy=False
        )
        identity, *frames = router.recv_multipart(copy=False)
        msg = decode(frames, manifest=manifest)
        received = msg.layers[0].payload.tensor
        assert torch.equal(received, grad)
        assert received.data_ptr() == _address(frames[1].buffer)  # no copy on the decode side
        assert (msg.seq, msg.base_version, msg.layers[0].count) == (9, 2, 3)
    finally:
        router.close()
        dealer.close()
        ctx.term()


def test_model_announcement_round_trips_against_manifest() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    manifest = Manifest.from_parameters(model.named_parameters())
    msg = Model(
        version=12,
        full=True,
        layers=tuple(LayerTensor(n, Dense(p.detach())) for n, p in model.named_parameters()),
    )
    decoded = decode(encode(msg), manifest=manifest)
    assert same_message(decoded, msg)


def test_unaligned_receive_buffer_is_copied_into_an_aligned_tensor() -> None:
    grad = torch.randn(100)
    frames = encode(Push(seq=1, base_version=0, layers=(LayerGradient("w", Dense(grad)),)))
    shifted = bytearray(len(frames[1]) + 1)
    shifted[1:] = bytes(frames[1])
    unaligned = memoryview(shifted)[1:]  # starts at an odd address
    decoded = decode([frames[0], unaligned]).layers[0].payload.tensor
    assert decoded.data_ptr() % 4 == 0
    assert torch.equal(decoded, grad)
