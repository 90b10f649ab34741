"""common.checkpoint: pickle-free checkpoints that round-trip exactly and refuse every bad file by name."""

from __future__ import annotations

import ast
import json
import logging
import os
import random
import stat
import struct
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch

from elasticfed.common import checkpoint
from elasticfed.common.checkpoint import (
    CheckpointError,
    CheckpointStore,
    load_optimizer_state,
    optimizer_state_tensors,
    read_tensors,
    tensor_specs,
    write_tensors,
)

KIND = "elasticfed-gateway"


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    f32 = torch.randn(4, 5, generator=g)
    f32[0, 0] = -0.0
    f32[0, 1] = 1e-45  # subnormal
    return {
        "fc1.weight": f32,
        "fc1.bias": torch.randn(5, generator=g).to(torch.float16),
        "emb": torch.randn(3, 2, generator=g).to(torch.bfloat16),
        "counts": torch.tensor([0, -1, 2**63 - 1, -(2**63)], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 3),
        "transposed": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),  # not contiguous
    }


def _data_start(path: Path) -> int:
    raw = path.read_bytes()
    return 8 + struct.unpack("<Q", raw[:8])[0]


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : _data_start(path)])


def _refused(path: Path, *words: str, **kwargs: object) -> str:
    with pytest.raises(CheckpointError) as info:
        read_tensors(path, KIND, **kwargs)
    message = str(info.value)
    assert str(path) in message, message
    for word in words:
        assert word in message, (word, message)
    return message


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt-0000000042.safetensors"
    write_tensors(path, _sample(), {"model_version": 42}, KIND)
    return path


# ------------------------------------------------------------------------------------------- round trip


def test_round_trip_is_bit_exact_for_tensors_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    tensors = _sample()
    meta = {
        "model_version": 42,
        "big": 2**70,
        "lr": 0.1 + 0.2,
        "tiny": 5e-324,
        "neg_zero": -0.0,
        "name": "jetson-\u00e9\u4e2d",
        "devices": {"edge-1": {"last_seq": 17, "seen": [1, 2, 3]}, "edge-2": None},
        "flags": [True, False],
    }
    written = write_tensors(path, tensors, meta, KIND)
    assert written == path.stat().st_size

    got, got_meta = read_tensors(path, KIND, expect=tensor_specs(tensors))
    assert got_meta == meta
    assert repr(got_meta["lr"]) == repr(meta["lr"]) and str(got_meta["neg_zero"]) == "-0.0"
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert _bits(got[name]) == _bits(t), name

    # The tensors own their memory: writable without warnings, and independent of each other.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got["fc1.weight"].add_(1)
        got["counts"][0] = 5
    assert _bits(got["fc1.weight"]) != _bits(tensors["fc1.weight"])


def test_tensors_on_views_store_only_the_view(tmp_path: Path) -> None:
    base = torch.arange(10, dtype=torch.float32)
    path = tmp_path / "views.safetensors"
    write_tensors(path, {"a": base[2:5], "b": base[5:7]}, {}, KIND)
    got, _ = read_tensors(path, KIND)
    assert got["a"].tolist() == [2, 3, 4] and got["b"].tolist() == [5, 6]


def test_metadata_must_be_exact_json(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    t = {"x": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"\['loss'\].*nan"):
        write_tensors(path, t, {"stats": {"loss": float("nan")}}, KIND)
    with pytest.raises(ValueError, match=r"key 3 is not a string"):
        write_tensors(path, t, {"devices": {3: "edge"}}, KIND)
    with pytest.raises(ValueError, match=r"\['when'\].*object"):
        write_tensors(path, t, {"when": object()}, KIND)
    assert list(tmp_path.iterdir()) == []


def test_writing_nonfinite_tensors_needs_consent(tmp_path: Path) -> None:
    path = tmp_path / "nan.safetensors"
    bad = {"ok": torch.ones(2), "w": torch.tensor([1.0, float("inf")], dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="'w' holds NaN or Inf"):
        write_tensors(path, bad, {}, KIND)
    assert not path.exists()
    write_tensors(path, bad, {}, KIND, allow_nonfinite=True)
    _refused(path, "tensor 'w' holds NaN or Inf")
    got, _ = read_tensors(path, KIND, allow_nonfinite=True)
    assert torch.isinf(got["w"][1])


def test_file_is_safetensors_and_module_uses_no_pickle(good: Path) -> None:
    raw = good.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    assert 8 + header_len < len(raw) and raw[8:9] == b"{"
    assert not raw.startswith(b"\x80") and not raw.startswith(b"PK")  # pickle protocol 2+, torch zip
    # Any safetensors reader can open it; ours is only stricter.
    assert set(safetensors.torch.load_file(good)) == set(_sample())

    source = Path(checkpoint.__file__).read_text()
    calls = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            calls |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            calls.add(node.module or "")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            calls.add(f"{node.value.id}.{node.attr}")
    forbidden = {"pickle", "cloudpickle", "dill", "torch.save", "torch.load", "numpy.load", "np.load"}
    assert not calls & forbidden, calls & forbidden


# ------------------------------------------------------------------------------------------- bad files


def test_truncated_files_are_refused_at_every_cut(good: Path) -> None:
    raw = good.read_bytes()
    data_start = _data_start(good)
    cuts = {
        0: "empty",
        5: "shorter than the 8-byte header length",
        8: "header length",
        20: "header length",
        data_start - 1: "header length",
        data_start: "truncated: header says",
        data_start + 9: "truncated: header says",
        len(raw) - 1: "truncated: header says",
    }
    for cut, words in cuts.items():
        good.write_bytes(raw[:cut])
        _refused(good, words)
    good.write_bytes(raw + b"\0")
    _refused(good, "1 unexpected bytes after")


def test_random_bytes_and_empty_files_are_refused(tmp_path: Path) -> None:
    rng = random.Random(1)
    path = tmp_path / "noise.safetensors"
    path.write_bytes(b"\xff" * 8 + bytes(rng.randrange(256) for _ in range(1000)))
    _refused(path, "header length 18446744073709551615 is larger than the file", "not a safetensors file")
    path.write_bytes(struct.pack("<Q", 100) + bytes(rng.randrange(256) for _ in range(500)))
    _refused(path, "not a safetensors file")
    path.write_bytes(struct.pack("<Q", 10) + b"{not json}" + b"x" * 10)
    _refused(path, "not valid JSON")
    path.write_bytes(b"")
    _refused(path, "empty file")


def test_plain_safetensors_without_our_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"w": torch.ones(3)}, path)
    _refused(path, "without elasticfed metadata")
    safetensors.torch.save_file({"w": torch.ones(3)}, path, metadata={"format": "pt"})
    _refused(path, "without elasticfed metadata")


def test_wrong_kind_is_refused(good: Path) -> None:
    with pytest.raises(CheckpointError, match="wrong kind: a 'elasticfed-gateway' checkpoint, expected 'x'"):
        read_tensors(good, "x")


def test_future_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.safetensors"
    doc = {"format": KIND, "version": 2, "meta": {}, "tensors": {}, "xxh3": "0"}
    path.write_bytes(safetensors.torch.save({"w": torch.ones(2)}, metadata={"elasticfed": json.dumps(doc)}))
    _refused(path, "written by format 'elasticfed-gateway' version 2, this reads version 1")


def test_flipped_bit_in_tensor_data_is_a_checksum_mismatch(good: Path) -> None:
    entry = _header(good)["fc1.weight"]
    offset = _data_start(good) + entry["data_offsets"][0] + 9
    raw = bytearray(good.read_bytes())
    raw[offset] ^= 0x01
    good.write_bytes(bytes(raw))
    _refused(good, "checksum mismatch in tensor 'fc1.weight'")


def test_corrupted_header_fields_are_detected(good: Path) -> None:
    raw = good.read_bytes()
    header_end = _data_start(good)
    # A digit of the user metadata changes: still valid JSON, same length.
    old = b'\\"model_version\\":42'
    assert raw.count(old) == 1
    good.write_bytes(raw.replace(old, b'\\"model_version\\":43'))
    _refused(good, "checksum mismatch in the elasticfed metadata")
    # The dtype code of a tensor changes to another of the same width: safetensors alone would accept it.
    header = raw[:header_end]
    assert b'"dtype":"F32"' in header
    good.write_bytes(header.replace(b'"dtype":"F32"', b'"dtype":"I32"', 1) + raw[header_end:])
    _refused(good, "corrupt header", "in the elasticfed metadata")


def test_expected_names_shapes_and_dtypes(good: Path) -> None:
    expect = tensor_specs(_sample())
    read_tensors(good, KIND, expect=expect)

    _refused(
        good,
        "tensor 'fc1.weight' has shape [4, 5], expected [4, 4]",
        expect={**expect, "fc1.weight": ((4, 4), torch.float32)},
    )
    _refused(
        good,
        "tensor 'fc1.bias' has dtype torch.float16, expected torch.float32",
        expect={**expect, "fc1.bias": ((5,), torch.float32)},
    )
    fewer = {k: v for k, v in expect.items() if k not in ("mask", "emb")}
    _refused(good, "unexpected tensors ['emb', 'mask']", expect=fewer)
    more = {**expect, "fc2.weight": ((2, 2), torch.float32)}
    message = _refused(good, "missing tensors ['fc2.weight']", expect=more)
    assert "unexpected" not in message


def test_files_above_the_size_limit_are_refused_before_reading(good: Path) -> None:
    _refused(good, "too large", max_bytes=100)


# ------------------------------------------------------------------------------------------- optimizers


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95)),
        lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    ],
    ids=["sgd-momentum", "sgd-nesterov", "adam", "adamw-amsgrad"],
)
def test_optimizer_state_round_trip_continues_bit_identically(tmp_path: Path, make) -> None:
    model = _model()
    optimizer = make(model.parameters())
    for seed in range(3):
        _step(model, optimizer, seed)

    tensors, optim_meta = optimizer_state_tensors(optimizer)
    assert tensors and all(name.startswith("optim/state/") for name in tensors)
    params = {f"model/{k}": v for k, v in model.state_dict().items()}
    path = tmp_path / "ckpt.safetensors"
    write_tensors(path, {**params, **tensors}, {"optimizer": optim_meta, "model_version": 3}, KIND)

    got, meta = read_tensors(path, KIND)
    restored = _model()
    restored.load_state_dict({k.removeprefix("model/"): v for k, v in got.items() if k.startswith("model/")})
    restored_optimizer = make(restored.parameters())
    load_optimizer_state(restored_optimizer, got, meta["optimizer"])

    a, b = optimizer.state_dict(), restored_optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        for key, value in a["state"][index].items():
            other = b["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert other.dtype == value.dtype and _bits(other) == _bits(value), (index, key)
            else:
                assert other == value, (index, key)

    _step(model, optimizer, 99)
    _step(restored, restored_optimizer, 99)
    for (name, p), q in zip(model.named_parameters(), restored.parameters()):
        assert _bits(p.detach()) == _bits(q.detach()), name


def test_optimizer_state_without_momentum_or_steps_round_trips(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tensors, meta = optimizer_state_tensors(optimizer)
    restored = torch.optim.SGD(_model().parameters(), lr=0.5)
    load_optimizer_state(restored, tensors, json.loads(json.dumps(meta)))
    assert restored.param_groups[0]["lr"] == 0.1


def test_optimizer_state_refuses_mismatches_and_unstorable_values() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, optimizer, 0)
    tensors, meta = optimizer_state_tensors(optimizer)

    with pytest.raises(ValueError, match="holds SGD state, the optimizer is Adam"):
        load_optimizer_state(torch.optim.Adam(model.parameters()), tensors, meta)
    with pytest.raises(ValueError, match="checkpoint has 4 parameters, the optimizer has 2"):
        load_optimizer_state(torch.optim.SGD(list(model.parameters())[:2], lr=0.1), tensors, meta)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    two_groups = torch.optim.SGD([{"params": weights}, {"params": biases}], lr=0.1)
    with pytest.raises(ValueError, match="checkpoint has 1 parameter groups, the optimizer has 2"):
        load_optimizer_state(two_groups, tensors, meta)
    missing = {k: v for k, v in tensors.items() if not k.endswith("/0/momentum_buffer")}
    with pytest.raises(ValueError, match="optim/state/0/momentum_buffer"):
        load_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1), missing, meta)

    optimizer.param_groups[0]["schedule"] = {"warmup": 10}
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['schedule'\] is a dict"):
        optimizer_state_tensors(optimizer)


# ------------------------------------------------------------------------------------------- store


def _save(store: CheckpointStore, number: int) -> Path:
    return store.save(number, {"w": torch.full((3,), float(number))}, {"model_version": number})


def test_store_keeps_the_newest_and_ignores_foreign_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "gateway", KIND, keep=3)
    (store.directory / "notes.txt").write_text("mine")
    (store.directory / "ckpt-latest.safetensors").write_text("not ours")
    for number in range(1, 6):
        path = _save(store, number)
        assert path.name == f"ckpt-{number:010d}.safetensors"
    assert [p.name for p in store.entries()] == [f"ckpt-{n:010d}.safetensors" for n in (5, 4, 3)]
    assert (store.directory / "notes.txt").exists() and (store.directory / "ckpt-latest.safetensors").exists()

    # A lower number written after resuming from an older checkpoint is kept, with the keep-1 newest.
    _save(store, 2)
    assert [p.name[5:15] for p in store.entries()] == ["0000000005", "0000000004", "0000000002"]


def test_store_resumes_from_newest_valid_and_reports_skipped(tmp_path: Path, caplog) -> None:
    store = CheckpointStore(tmp_path, KIND, keep=5)
    for number in (1, 2, 3, 4):
        _save(store, number)
    newest, noise = store.path_for(4), store.path_for(3)
    newest.write_bytes(newest.read_bytes()[:-7])
    noise.write_bytes(random.Random(0).randbytes(300))

    with caplog.at_level(logging.WARNING, logger="elasticfed.checkpoint"):
        found = store.load_latest(expect={"w": ((3,), torch.float32)})
    assert found is not None
    path, tensors, meta = found
    assert path == store.path_for(2) and meta == {"model_version": 2} and tensors["w"].tolist() == [2.0] * 3
    assert [p for p, _ in store.skipped] == [newest, noise]
    assert "truncated" in store.skipped[0][1] and "not a safetensors file" in store.skipped[1][1]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and str(newest) in warned[0] and str(noise) in warned[1]

    # A model of another shape is never loaded either.
    assert store.load_latest(expect={"w": ((4,), torch.float32)}) is None
    assert len(store.skipped) == 4
    assert CheckpointStore(tmp_path / "empty", KIND).load_latest() is None


def test_failed_write_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path, KIND)
    _save(store, 1)
    before = store.path_for(1).read_bytes()

    def crash(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="No space left"):
        store.save(1, {"w": torch.zeros(3)}, {"model_version": 99})
    with pytest.raises(OSError):
        _save(store, 2)
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000001.safetensors"]
    assert store.path_for(1).read_bytes() == before
    found = store.load_latest()
    assert found is not None and found[0] == store.path_for(1) and found[2] == {"model_version": 1}


def test_leftover_temp_files_of_a_crashed_write_are_removed_on_open(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, KIND)
    good = _save(store, 1)
    partial = tmp_path / ".ckpt-0000000002.safetensors.k3j9x2.tmp"
    partial.write_bytes(good.read_bytes()[:50])
    unrelated = tmp_path / ".other.tmp"
    unrelated.write_text("not ours")

    reopened = CheckpointStore(tmp_path, KIND)
    assert not partial.exists() and unrelated.exists()
    found = reopened.load_latest()
    assert found is not None and found[0] == good and reopened.skipped == []


def test_permissions_are_private(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # the widest: nothing but our own modes keeps it private
    try:
        store = CheckpointStore(tmp_path / "state" / "gateway", KIND)
        path = _save(store, 7)
        loose = tmp_path / "loose.safetensors"
        write_tensors(loose, {"w": torch.ones(1)}, {}, KIND)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(loose.stat().st_mode) == 0o600


def test_store_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, KIND, keep=0)
    with pytest.raises(ValueError, match="prefix"):
        CheckpointStore(tmp_path, KIND, prefix="../x")
    with pytest.raises(ValueError, match="non-negative"):
        CheckpointStore(tmp_path, KIND).path_for(-1)
