"""Codec throughput: encode+decode (checksums and validation on) against a plain memcpy.

Figures: one 4 MiB fp32 layer, and one push of 100 small 4 KiB layers.  The
reference is libc memcpy of the same bytes, timed in the same run, alternating
with the codec so machine noise hits both.  Then the gateway's CPU cost of a
push per dense-equivalent MB for each uplink compression an edge may send
(`gateway_ms_per_dense_mb`): decode with every check, expand (a sparse push to
its k entries, anything else to dense), check finiteness, add into a round's accumulator, as
`Gateway._on_push` does.  Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import numpy as np
import torch

from elasticfed.cloud.aggregation import LayerAccumulator, contribution, entries
from elasticfed.edge.compression import UplinkCompression
from elasticfed.protocol import Dense, LayerGradient, Manifest, Push, all_finite, decode, encode

EDGE_SPECS = ("none", "fp16", "int8", "topk:0.01", "topk:0.01+int8")


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _time(fn, repeat: int) -> float:
    """Median seconds per call over `repeat` calls, after a warm-up."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15, help="alternating codec/memcpy rounds")
    parser.add_argument("--repeat", type=int, default=40, help="calls per timing")
    opts = parser.parse_args()

    big = torch.randn(1 << 20)  # 4 MiB fp32
    small = [torch.randn(1024) for _ in range(100)]  # 100 x 4 KiB
    manifest = Manifest.from_parameters(
        [("big", torch.nn.Parameter(big))] + [(f"s{i}", torch.nn.Parameter(t)) for i, t in enumerate(small)]
    )
    big_msg = Push(seq=1, base_version=0, layers=(LayerGradient("big", Dense(big)),))
    small_msg = Push(
        seq=2, base_version=0, layers=tuple(LayerGradient(f"s{i}", Dense(t)) for i, t in enumerate(small))
    )

    def codec_big() -> None:
        decode(encode(big_msg), manifest=manifest)

    def codec_small() -> None:
        decode(encode(small_msg), manifest=manifest)

    dst = bytearray(big.numel() * 4)
    dst_addr = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))

    def memcpy_big() -> None:
        ctypes.memmove(dst_addr, big.data_ptr(), len(dst))

    small_dst = [torch.empty_like(t) for t in small]

    def memcpy_small() -> None:
        for d, s in zip(small_dst, small):
            ctypes.memmove(d.data_ptr(), s.data_ptr(), 4096)

    codec_s, memcpy_s, small_s, small_copy_s = [], [], [], []
    for _ in range(opts.rounds):
        codec_s.append(_time(codec_big, opts.repeat))
        memcpy_s.append(_time(memcpy_big, opts.repeat))
        small_s.append(_time(codec_small, opts.repeat))
        small_copy_s.append(_time(memcpy_small, opts.repeat))

    # Copies: does a frame handed to ZeroMQ share the tensor's memory, and does the
    # decoded tensor share the frame's?
    frames = encode(small_msg)
    tensors = [t for t in small]
    encode_copies = sum(_address(f) != t.data_ptr() for f, t in zip(frames[1:], tensors)) / len(tensors)
    decoded = decode(frames, manifest=manifest)
    decode_copies = sum(
        layer.payload.tensor.data_ptr() != _address(f) for layer, f in zip(decoded.layers, frames[1:])
    ) / len(tensors)

    gateway_ms = {}
    for spec in EDGE_SPECS:
        compression = UplinkCompression.parse(spec)
        payload = Dense(big) if compression is None else compression.encode(big, tuple(big.shape))
        frames = [bytes(memoryview(f).cast("B")) for f in encode(
            Push(seq=3, base_version=0, layers=(LayerGradient("big", payload, 1),))
        )]  # fmt: skip
        acc = LayerAccumulator(big.numel())

        def gateway_push(frames: list[bytes] = frames, acc: LayerAccumulator = acc) -> None:
            msg = decode(frames, manifest=manifest)
            for layer in msg.layers:
                part = contribution(layer.payload)
                if not isinstance(layer.payload, Dense) and not all_finite(entries(part)):
                    raise AssertionError("the benchmark's payload expanded to NaN or Inf")
                acc.add("edge", part, layer.count, 1.0)

        seconds = statistics.median(_time(gateway_push, opts.repeat) for _ in range(max(1, opts.rounds // 3)))
        gateway_ms[spec] = round(seconds * 1e3 / (big.numel() * 4 / 1e6), 3)

    nbytes = big.numel() * 4
    t_codec, t_copy = statistics.median(codec_s), statistics.median(memcpy_s)
    t_small, t_small_copy = statistics.median(small_s), statistics.median(small_copy_s)
    result = {
        "encode_decode_gbps_4mib": round(nbytes / t_codec / 1e9, 3),
        "memcpy_gbps": round(nbytes / t_copy / 1e9, 3),
        "ratio_vs_memcpy": round(t_copy / t_codec, 3),
        "small_layers_per_s": round(100 / t_small),
        "small_memcpy_layers_per_s": round(100 / t_small_copy),
        "small_us_per_layer": round(t_small / 100 * 1e6, 2),
        "copies_per_payload": encode_copies,
        "decode_copies_per_payload": decode_copies,
        "torch_threads": torch.get_num_threads(),
        "gateway_ms_per_dense_mb": gateway_ms,
        "memcpy_ms_per_mb": round(t_copy * 1e3 / (nbytes / 1e6), 3),
    }
    print(f"{'case':34s} {'codec':>12s} {'memcpy':>12s}")
    gbps, copy_gbps = result["encode_decode_gbps_4mib"], result["memcpy_gbps"]
    print(f"{'4 MiB fp32 layer (GB/s)':34s} {gbps:12.2f} {copy_gbps:12.2f}")
    print(
        f"{'100 x 4 KiB layers (layers/s)':34s} {result['small_layers_per_s']:12d} "
        f"{result['small_memcpy_layers_per_s']:12d}"
    )
    print(f"ratio vs memcpy (4 MiB): {result['ratio_vs_memcpy']}")
    print(f"copies per payload: encode {encode_copies}, decode {decode_copies}")
    print("gateway CPU per dense-equivalent MB (decode, checks, expand, finiteness, accumulate):")
    for spec, ms in gateway_ms.items():
        print(f"  {spec:16s} {ms:8.3f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
