"""Shared test helpers: message equality with tensors compared bit for bit."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from fleet import Proc
from netns import netns_lab, netns_swept  # noqa: F401  (fixtures for tests/test_real_loss.py)

from elasticfed.protocol import Manifest, Message
from elasticfed.protocol.payload import Dense, LowRank, Quantized, Sparse, TopK


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts; whatever is still running when it ends (failed or not) is killed."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so NaN payloads and -0.0 compare exactly)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def same_payload(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, Dense):
        return same_tensor(a.tensor, b.tensor)
    if isinstance(a, TopK):
        return a.shape == b.shape and same_tensor(a.values, b.values) and same_tensor(a.indices, b.indices)
    if isinstance(a, LowRank):
        return a.shape == b.shape and same_tensor(a.p, b.p) and same_tensor(a.q, b.q)
    if isinstance(a, Quantized):
        return (
            a.shape == b.shape
            and a.chunk == b.chunk
            and same_tensor(a.codes, b.codes)
            and same_tensor(a.scales, b.scales)
        )
    if isinstance(a, Sparse):
        return (
            a.shape == b.shape
            and same_tensor(a.counts, b.counts)
            and same_tensor(a.offsets, b.offsets)
            and same_payload(a.values, b.values)
        )
    raise TypeError(type(a))


def same_message(a: Message, b: Message) -> bool:
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "layers":
            if len(x) != len(y):
                return False
            for lx, ly in zip(x, y):
                if lx.name != ly.name or getattr(lx, "count", 1) != getattr(ly, "count", 1):
                    return False
                if not same_payload(lx.payload, ly.payload):
                    return False
        elif isinstance(x, Manifest):
            if x != y or x.digest != y.digest:
                return False
        elif x != y:
            return False
    return True
