"""Hostile input does no harm (DESIGN.md guarantee 3), against a live `elasticfed cloud serve` process.

An enrolled but hostile device sends over 5,000 bad messages (malformed,
oversized, mutated, wrongly shaped, NaN-laden, poisoned, replayed, stale,
out of window, of unknown types, with a false identity) while an honest device
trains through a fixed number of rounds.  The gateway must stay up with
bounded memory, answer every bad message with a refusal counted under the
reason it gave, and end with a model bit-identical to a run without the
hostile device.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import torch
from fleet import Proc, free_port
from scripted import NoReply, ScriptedDevice

from elasticfed.common.keys import KeyFolder, generate, read_key_file
from elasticfed.common.tasks.digits import build_model
from elasticfed.protocol import (
    Ack,
    Heartbeat,
    Hello,
    Manifest,
    Reason,
    Reject,
    Welcome,
    encode,
    limits_for,
)

pytestmark = pytest.mark.slow

ROUNDS = 25
NORM_BOUND = 1.0
MAX_STALENESS = 3


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Keys:
    def __init__(self, root: Path) -> None:
        self.folder = KeyFolder(root / "gw")
        self.gateway_public = read_key_file(self.folder.init()).public
        self.root = root

    def device(self, name: str, enrol: bool = True) -> tuple:
        public, secret = generate(name, self.root / "devices")
        if enrol:
            self.folder.enrol(name, public)
        return read_key_file(secret, need_secret=True), self.gateway_public


def start_gateway(keys: Keys) -> tuple[Proc, str]:
    port = free_port()
    argv = [
        sys.executable, "-m", "elasticfed.common.cli", "cloud", "serve", "--mode", "standalone",
        "--gateway-bind", f"tcp://127.0.0.1:{port}", "--security-keys-dir", str(keys.folder.root),
        "--gateway-quorum", "1", "--gateway-round-deadline-s", "60",
        "--gateway-max-grad-norm", str(NORM_BOUND), "--gateway-norm-policy", "reject",
        "--gateway-max-staleness", str(MAX_STALENESS), "--gateway-rate-messages-per-s", "0",
        "--log-level", "warning", "--gateway-checkpoint-dir", "",
    ]  # fmt: skip
    proc = Proc(argv, "gateway")
    ready = proc.wait_for(lambda e: e.get("event") == "ready", 60, "ready")
    return proc, ready["endpoint"]


def honest_grads(manifest: Manifest, round_: int) -> dict[str, torch.Tensor]:
    """Deterministic per round, each layer's norm half the bound."""
    gen = torch.Generator().manual_seed(1000 + round_)
    out = {}
    for spec in manifest:
        g = torch.randn(spec.shape, generator=gen)
        out[spec.name] = g * (0.5 * NORM_BOUND / float(g.norm()))
    return out


def train_honestly(dev: ScriptedDevice) -> None:
    assert isinstance(dev.hello(), Welcome)
    for r in range(1, ROUNDS + 1):
        answer = dev.push(honest_grads(dev.manifest, r))
        assert isinstance(answer, Ack) and answer.accepted, answer
        dev.wait_version(r)


class Hostile:
    """Sends bad messages one at a time and tallies the reason of every refusal it gets back."""

    def __init__(self, dev: ScriptedDevice, manifest: Manifest, seed: int = 7) -> None:
        self.dev = dev
        self.manifest = manifest
        self.rng = random.Random(seed)
        self.sent = 0
        self.codes: Counter[str] = Counter()  # refusals, by the reason the gateway gave
        self.duplicates = 0  # replays answered with the verdict given before
        self.dropped_by_libzmq = 0  # frames over ZMQ_MAXMSGSIZE: the connection is cut, nothing allocated
        self.limits = limits_for(manifest)

    def send(self, frames: list, expect: str | None = None, replay: bool = False) -> None:
        self.sent += 1
        answer = self.dev.ask(frames)
        if isinstance(answer, Reject):
            code = answer.code
        else:
            # A push under a seq judged before is answered with that verdict from its header alone
            # (its payload is not read: a copy must cost less than a push), never applied again.
            repeat = answer.code == Reason.DUPLICATE.value
            assert isinstance(answer, Ack) and (not answer.accepted or repeat), (
                f"a hostile message was accepted: {answer}"
            )
            code = answer.code
            replay = replay or repeat
        if replay:
            self.duplicates += 1
        else:
            self.codes[code] += 1
        if expect is not None:
            assert code == expect, (expect, code, answer)

    def grads(self, scale: float = 1.0, fill: float | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for spec in self.manifest:
            g = torch.randn(spec.shape) * scale
            if fill is not None:
                g.view(-1)[self.rng.randrange(g.numel())] = fill
            out[spec.name] = g
        return out

    def push(self, grads: dict[str, torch.Tensor], **kw: object) -> list:
        return encode(self.dev.push_message(grads, **kw))

    def with_header(self, frames: list, **changes: object) -> list:
        header = msgpack.unpackb(bytes(frames[0]))
        for key, value in changes.items():
            if key == "layer0":
                header["layers"][0].update(value)  # type: ignore[arg-type]
            else:
                header[key] = value
        return [msgpack.packb(header), *frames[1:]]

    def run(self) -> None:
        rng = self.rng
        poisoned = 1000 * NORM_BOUND
        # Malformed: random bytes, non-maps, extension types, truncated headers.
        for _ in range(600):
            kind = rng.randrange(4)
            if kind == 0:
                frames = [rng.randbytes(rng.randrange(1, 200))]
            elif kind == 1:
                frames = [msgpack.packb(rng.choice([[1, 2], "push", 7, None, 1.5]))]
            elif kind == 2:
                frames = [msgpack.packb({"v": 1, "type": "push", "x": msgpack.ExtType(5, b"ab")})]
            else:
                frames = [bytes(self.push(self.grads(fill=float("nan")))[0])[: rng.randrange(1, 20)]]
            self.send(frames)
        # Protocol versions and message types nobody speaks, and types not for a gateway.
        for _ in range(150):
            self.send([msgpack.packb({"v": rng.choice([0, 2, 99]), "type": "push"})], expect="version")
        for _ in range(150):
            self.send([msgpack.packb({"v": 1, "type": rng.choice(["shutdown", "exec", ""])})], "unknown_type")
        for _ in range(100):
            self.send(encode(Welcome(gateway_id="x", manifest_digest="0", model_version=0)),
                      expect="unknown_type")  # fmt: skip
        # Wrong shapes, dtypes, layer names, counts; NaN and Inf.
        name = next(iter(self.manifest)).name
        for _ in range(250):
            frames = self.push({name: torch.randn(3, 3)})
            self.send(frames, expect="shape")
        for _ in range(150):
            self.send(
                self.with_header(self.push(self.grads(fill=float("nan"))), layer0={"dtype": "int32"}), "dtype"
            )
        for _ in range(150):
            self.send(self.push({"no.such.layer": torch.randn(4)}), expect="unknown_layer")
        for _ in range(150):
            self.send(self.with_header(self.push(self.grads()), layer0={"count": 0}), "bad_field")
        for _ in range(500):
            bad = rng.choice([float("nan"), float("inf"), float("-inf")])
            self.send(self.push(self.grads(fill=bad)), expect="nonfinite")
        # Oversized: more bytes, frames or header than any message about this model can have.
        for _ in range(150):
            chunk = self.limits.max_message_bytes // 2 + 1
            self.send([msgpack.packb({"v": 1, "type": "push"}), b"\0" * chunk, b"\0" * chunk], "too_large")
        for _ in range(100):
            self.send(
                [msgpack.packb({"v": 1, "type": "push"})] + [b""] * (self.limits.max_frames + 1), "too_large"
            )
        for _ in range(100):
            self.send(
                [msgpack.packb({"v": 1, "type": "push", "pad": "x" * self.limits.max_header_bytes})],
                "too_large",
            )
        for _ in range(5):  # one frame over ZMQ_MAXMSGSIZE: libzmq drops the connection before allocating
            self.sent += 1
            self.dev.send_frames([b"\0" * (self.limits.max_message_bytes + 1)])
            with pytest.raises(NoReply):
                self.dev.receive(timeout_s=0.5)
            self.dropped_by_libzmq += 1
            self.dev.reopen()
            assert isinstance(self.dev.hello(), Welcome)
        # Mutations of a push (whose payload holds a NaN, so no mutation can make it acceptable).
        base = [bytes(f) for f in self.push(self.grads(fill=float("nan")))]
        for _ in range(1600):
            frames = [bytearray(f) for f in base]
            target = rng.randrange(len(frames))
            if rng.random() < 0.2:
                frames[target] = frames[target][: rng.randrange(len(frames[target]) + 1)]
            else:
                for _ in range(rng.randrange(1, 4)):
                    if frames[target]:
                        frames[target][rng.randrange(len(frames[target]))] ^= 1 << rng.randrange(8)
            if not frames[0]:
                frames[0] = bytearray(b"\xc1")
            self.send([bytes(f) for f in frames])
        # Poisoned pushes (x1000): refused by the norm bound; their replays answered as before.
        # (Pushes that pass the decoder take sequence numbers in the window from 1.)
        refused_seqs = []
        for seq in range(1, 301):
            frames = self.push({k: v * poisoned for k, v in honest_grads(self.manifest, 0).items()}, seq=seq)
            self.send(frames, expect="norm")
            refused_seqs.append(frames)
        for _ in range(300):
            self.send(rng.choice(refused_seqs), expect="norm", replay=True)
        # Out of the window; stale (based on a model too many versions old, or else over the norm).
        for _ in range(100):
            self.send(self.push(self.grads(scale=poisoned), seq=10_000_000), expect="window")
        for seq in range(301, 401):
            self.send(self.push(self.grads(scale=poisoned), seq=seq, base_version=0))
        # A false identity: a hello in another device's name.
        for _ in range(100):
            self.send(encode(Hello(client_id="honest", manifest=self.manifest, model_version=0, next_seq=1)),
                      expect="identity")  # fmt: skip
        # Harmless questions stay answered.
        assert isinstance(self.dev.ask(Heartbeat(nonce=1)), Heartbeat)


def test_hostile_device_cannot_hurt_the_model_or_the_gateway(tmp_path: Path) -> None:
    keys = Keys(tmp_path)
    honest_keys = keys.device("honest")
    hostile_keys = keys.device("mallory")
    stranger_keys = keys.device("stranger", enrol=False)
    manifest = Manifest.from_parameters(build_model().named_parameters())

    # The reference: the honest device alone.
    gateway, endpoint = start_gateway(keys)
    honest = ScriptedDevice(endpoint, "honest", manifest, curve=honest_keys)
    train_honestly(honest)
    reference = honest.fetch_model()
    honest.close()
    gateway.signal(signal.SIGTERM)
    assert gateway.summary(30)["rejected_by_reason"] == {}

    # The same training with a hostile device (and an unenrolled one) at work.
    gateway, endpoint = start_gateway(keys)
    honest = ScriptedDevice(endpoint, "honest", manifest, curve=honest_keys)
    mallory = ScriptedDevice(endpoint, "mallory", manifest, curve=hostile_keys)
    assert isinstance(mallory.hello(), Welcome)
    rss_before = rss_bytes(gateway.proc.pid)
    hostile = Hostile(mallory, manifest)
    failure: list[BaseException] = []

    def attack() -> None:
        try:
            hostile.run()
            for _ in range(20):  # strangers never get past the handshake
                stranger = ScriptedDevice(endpoint, "stranger", manifest, curve=stranger_keys)
                with pytest.raises(NoReply):
                    stranger.hello(timeout_s=0.2)
                stranger.close()
        except BaseException as exc:  # reported in the main thread
            failure.append(exc)

    attacker = threading.Thread(target=attack)
    attacker.start()
    train_honestly(honest)
    attacker.join(300)
    assert not attacker.is_alive() and not failure, failure
    rss_after = rss_bytes(gateway.proc.pid)
    assert gateway.proc.poll() is None, "the gateway died"
    model = honest.fetch_model()
    honest.close()
    mallory.close()
    gateway.signal(signal.SIGTERM)
    summary = gateway.summary(30)

    grown = (rss_after - rss_before) / 2**20
    print(f"hostile: {hostile.sent} messages, refusals {dict(hostile.codes)}, gateway RSS {grown:+.1f} MiB")
    assert hostile.sent >= 5000
    for name, tensor in reference.items():
        assert torch.equal(model[name], tensor), f"{name} differs from the run without the hostile device"
    assert summary["version"] == ROUNDS
    # Every refusal was counted under the reason the hostile device was given, and no other.
    assert summary["rejected_by_reason"] == dict(hostile.codes), (
        summary["rejected_by_reason"],
        hostile.codes,
    )
    assert summary["gateway_duplicates_total"] == hostile.duplicates
    assert summary["handshakes_refused"] >= 20
    assert set(summary["clients"]) == {"honest", "mallory"}
    assert rss_after - rss_before < 32 * 2**20, f"gateway RSS grew {(rss_after - rss_before) / 2**20:.1f} MiB"
