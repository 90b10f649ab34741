"""A scripted device: speaks the Elastic Sync Protocol message by message over a real DEALER socket.

The edge agent hides the protocol behind training; security and hostile-input
tests need to say exactly what goes on the wire (a push of chosen tensors, a
replayed sequence number, raw bytes) and read exactly what comes back.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from elasticfed.common.keys import KeyPair, configure_client
from elasticfed.protocol import (
    Ack,
    Commit,
    Dense,
    Heartbeat,
    Hello,
    LayerGradient,
    Manifest,
    Message,
    Model,
    ModelRequest,
    Push,
    Reject,
    Welcome,
    decode,
    encode,
)

_ids = itertools.count()


class NoReply(AssertionError):
    """The gateway did not answer within the deadline."""


class ScriptedDevice:
    def __init__(
        self,
        endpoint: str,
        client_id: str,
        manifest: Manifest,
        curve: tuple[KeyPair, bytes] | None = None,
        routing_id: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.client_id = client_id
        self.manifest = manifest
        self.curve = curve
        self.routing_id = routing_id if routing_id is not None else client_id
        self.seq = 1
        self.version = 0
        self.commits: list[Commit] = []
        self.sock = self._open()

    def _open(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.routing_id.encode() or f"scripted-{next(_ids)}".encode())
        if self.curve is not None:
            configure_client(sock, *self.curve)
        sock.connect(self.endpoint)
        return sock

    def reopen(self) -> None:
        """A new connection (after the gateway's libzmq dropped this one)."""
        self.sock.close(linger=0)
        self.sock = self._open()

    def close(self) -> None:
        self.sock.close(linger=0)

    # ------------------------------------------------------------------ raw
    def send_frames(self, frames: Sequence[Any], timeout_s: float = 5.0) -> None:
        # Never a blocking send: a pipe can go between POLLOUT and the send (a refused
        # handshake removes it), and a DEALER with no pipe would block for ever.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send_multipart(list(frames), flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoReply(f"{self.client_id}: could not send (handshake refused?)") from None
                self.sock.poll(int(min(left, 0.05) * 1000) + 1, zmq.POLLOUT)

    def receive(self, timeout_s: float = 5.0) -> Message:
        """The next answer; commits (sent unasked by a gateway that checkpoints) are set aside."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                raise NoReply(f"{self.client_id}: no answer within {timeout_s} s")
            msg = decode(self.sock.recv_multipart(copy=False))
            if isinstance(msg, Commit):
                self.commits.append(msg)
                continue
            return msg

    def ask(self, msg: Message | Sequence[Any], timeout_s: float = 5.0) -> Message:
        """Send a message (or raw frames) and return the answer."""
        self.send_frames(encode(msg) if isinstance(msg, Message) else msg, timeout_s)
        return self.receive(timeout_s)

    # ------------------------------------------------------------ protocol
    def hello(self, client_id: str | None = None, timeout_s: float = 5.0) -> Message:
        answer = self.ask(
            Hello(
                client_id=client_id or self.client_id,
                manifest=self.manifest,
                model_version=self.version,
                next_seq=self.seq,
            ),
            timeout_s,
        )
        if isinstance(answer, Welcome):
            self.version = answer.model_version
        return answer

    def push_message(
        self,
        grads: dict[str, torch.Tensor],
        count: int = 1,
        seq: int | None = None,
        base_version: int | None = None,
    ) -> Push:
        if seq is None:
            seq, self.seq = self.seq, self.seq + 1
        return Push(
            seq=seq,
            base_version=self.version if base_version is None else base_version,
            layers=tuple(LayerGradient(n, Dense(t.contiguous()), count) for n, t in grads.items()),
        )

    def push(self, grads: dict[str, torch.Tensor], count: int = 1, **kw: Any) -> Ack | Reject:
        answer = self.ask(self.push_message(grads, count, **kw))
        assert isinstance(answer, (Ack, Reject)), answer
        return answer

    def wait_version(self, version: int, timeout_s: float = 10.0) -> int:
        """Heartbeat until the gateway announces `version` (a round closed)."""
        deadline = time.monotonic() + timeout_s
        nonce = itertools.count(1)
        while time.monotonic() < deadline:
            answer = self.ask(Heartbeat(nonce=next(nonce)))
            if isinstance(answer, Heartbeat) and answer.model_version >= version:
                self.version = answer.model_version
                return self.version
            time.sleep(0.005)
        raise NoReply(f"{self.client_id}: version {version} not announced within {timeout_s} s")

    def fetch_model(self) -> dict[str, torch.Tensor]:
        answer = self.ask(ModelRequest(have_version=0))
        assert isinstance(answer, Model), answer
        return {layer.name: layer.payload.to_dense().clone() for layer in answer.layers}
