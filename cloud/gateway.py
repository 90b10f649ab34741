"""The edge gateway: a ROUTER service that terminates the Elastic Sync Protocol.

One thread owns the socket and does everything in order, so there are no locks
on the model: decode (which validates every frame), de-duplicate by
(client, seq), weigh by staleness, add into the per-layer accumulators, answer
with an ack that carries credit and the newest model version.  When the round
policy says so, the averages go through the optimizer, the version goes up,
and the next acks and heartbeats announce it; edges then ask for the model.

Bounded memory (DESIGN.md guarantee 2): a push is added into its layer's
accumulator as it arrives and then dropped, so nothing is queued per message;
per client the gateway keeps the verdicts of at most `window` recent pushes
(the edge tells it, with `resolved_below`, which ones it no longer needs); a
client may have at most `credit` pushes outstanding, so the socket's queues
are bounded too.  Sends use ROUTER_MANDATORY and never block: a message that
cannot be delivered is counted, never dropped silently.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from torch import nn

from cloud.aggregation import (
    DeadlineQuorum,
    LayerAccumulator,
    OpenRound,
    RoundPolicy,
    SuccessWeighted,
    Weighting,
)
from common.hooks import trainable_parameters
from common.metrics import STALENESS_BUCKETS, Metrics
from protocol import (
    DEFAULT_LIMITS,
    Ack,
    Dense,
    Heartbeat,
    Hello,
    LayerTensor,
    Limits,
    Manifest,
    Message,
    Model,
    ModelRequest,
    ProtocolError,
    Push,
    Reason,
    Reject,
    Welcome,
    apply_limits,
    decode,
    encode,
    frame_bytes,
)

log = logging.getLogger("elasticfed.gateway")

# Verdicts repeated in every ack and heartbeat reply: an edge has at most `credit`
# pushes outstanding, so this covers them all unless it falls far behind.
VERDICTS_PER_ANSWER = 64


@dataclass(frozen=True)
class GatewayOptions:
    bind: str = "tcp://*:7878"
    credit: int = 8  # pushes a client may have outstanding
    window: int = 1024  # verdicts kept per client for de-duplication
    limits: Limits = DEFAULT_LIMITS
    gateway_id: str = ""  # default: random, new at every start (edges notice a restart)

    def __post_init__(self) -> None:
        if self.credit < 1 or self.window < 1:
            raise ValueError(f"credit and window must be >= 1, got {self.credit}, {self.window}")


@dataclass
class ClientState:
    """What the gateway remembers of one edge: its route and its recent verdicts."""

    client_id: str
    route: bytes
    floor: int = 0  # every seq below this is resolved on the edge's side
    # seq -> (code, attempt): code "" is applied; attempt is the copy of the push that was judged.
    verdicts: dict[int, tuple[str, int]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # heap of the seqs in `verdicts`
    last_seen: float = 0.0

    def record(self, seq: int, code: str, attempt: int) -> None:
        self.verdicts[seq] = (code, attempt)
        heapq.heappush(self.order, seq)

    def pending(self, limit: int) -> tuple[tuple[int, str], ...]:
        """Verdicts the edge may not have heard yet (oldest first), for a cumulative acknowledgement."""
        seqs = self.order if len(self.order) <= limit else heapq.nsmallest(limit, self.order)
        return tuple((seq, self.verdicts[seq][0]) for seq in sorted(seqs))

    def raise_floor(self, floor: int) -> None:
        """The edge no longer needs verdicts below `floor`: forget them (bounded memory)."""
        self.floor = floor
        while self.order and self.order[0] < floor:
            self.verdicts.pop(heapq.heappop(self.order), None)


@dataclass(frozen=True)
class RoundSummary:
    number: int
    version: int
    clients: int
    complete_clients: int
    steps: int
    layers_updated: int
    staleness_mean: float
    staleness_max: int
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


class GatewayMetrics:
    def __init__(self) -> None:
        m = self.registry = Metrics()
        self.pushes = m.counter("gateway_pushes_total", "push messages received", ["client"])
        self.applied = m.counter(
            "gateway_applied_steps_total", "step-gradients added into the model", ["client", "layer"]
        )
        self.dropped_stale = m.counter(
            "gateway_dropped_stale_steps_total", "step-gradients dropped as too stale", ["client", "layer"]
        )
        self.duplicates = m.counter(
            "gateway_duplicates_total", "pushes answered before, not applied", ["client"]
        )
        self.rejected = m.counter("gateway_rejected_total", "messages refused", ["client", "reason"])
        self.bytes = m.counter("gateway_received_bytes_total", "bytes of push messages", ["client"])
        self.staleness = m.histogram(
            "gateway_staleness", "versions behind, per push", ["client"], STALENESS_BUCKETS
        )
        self.send_failures = m.counter(
            "gateway_send_failures_total", "replies that could not be sent", ["reason"]
        )
        self.rounds = m.counter("gateway_rounds_total", "rounds closed")
        self.version = m.gauge("gateway_model_version", "current model version")
        self.clients = m.gauge("gateway_clients", "clients that said hello")


class Gateway:
    """Per-layer accumulators, success-weighted averaging, rounds, model versions; one thread."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        options: GatewayOptions | None = None,
        weighting: Weighting | None = None,
        rounds: RoundPolicy | None = None,
        on_round: Callable[[RoundSummary], None] | None = None,
        version: int = 0,
        clock: Callable[[], float] = time.monotonic,
        lr_factor: Callable[[int], float] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options or GatewayOptions()
        self.weighting = weighting or SuccessWeighted()
        self.rounds = rounds or DeadlineQuorum()
        self.on_round = on_round
        self.clock = clock
        self.lr_factor = lr_factor  # round number -> multiplier of the optimizer's learning rate
        self._base_lr = [group["lr"] for group in optimizer.param_groups]
        self.gateway_id = self.options.gateway_id or f"gw-{os.urandom(6).hex()}"
        named = trainable_parameters(model)
        self.manifest = Manifest.from_parameters(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.layer_index = {n: i for i, n in enumerate(self.names)}
        self.acc = [LayerAccumulator(p.numel()) for p in self.params]
        self.version = version
        self.open = OpenRound(number=1, layers=len(self.params))
        self.clients: dict[str, ClientState] = {}
        self.routes: dict[bytes, str] = {}
        self.metrics = GatewayMetrics()
        self.metrics.version.set(value=version)
        self._snapshot = self._take_snapshot()
        self._sock: zmq.Socket | None = None
        self.bound_endpoint = ""
        self._bound = threading.Event()

    # -------------------------------------------------------------------- service
    def bind(self) -> str:
        """Create and bind the ROUTER socket (from the thread that will serve); returns the endpoint."""
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an undeliverable reply raises instead of vanishing
        # An edge keeps its routing id across reconnects: the new connection takes over the old
        # (possibly half-open) one, and the edge stays welcomed without another round trip.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        apply_limits(sock, self.options.limits)
        sock.bind(self.options.bind)
        self._sock = sock
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bound.set()
        log.info(
            "gateway %s listening on %s (model version %d)",
            self.gateway_id,
            self.bound_endpoint,
            self.version,
        )
        return self.bound_endpoint

    def wait_bound(self, timeout: float) -> str:
        if not self._bound.wait(timeout):
            raise TimeoutError(f"gateway did not bind within {timeout} s")
        return self.bound_endpoint

    def serve(self, stop: threading.Event, max_rounds: int | None = None) -> None:
        """Answer edges until `stop` is set (or `max_rounds` rounds have closed)."""
        if self._sock is None:
            self.bind()
        try:
            while not stop.is_set():
                self.poll_once(0.05)
                if max_rounds is not None and self.open.number > max_rounds:
                    return
        finally:
            self.close()

    def poll_once(self, timeout_s: float) -> None:
        assert self._sock is not None, "bind() first"
        wait = timeout_s
        left = self.rounds.time_left(self.open, self.clock())
        if left is not None:
            wait = max(0.0, min(wait, left))
        if self._sock.poll(int(wait * 1000) + 1, zmq.POLLIN):
            for _ in range(256):  # bounded batch, then check the round
                try:
                    frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.handle(frames)
        self.maybe_close_round()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # ------------------------------------------------------------------- messages
    def handle(self, frames: list[Any]) -> None:
        route, body = frames[0].bytes, frames[1:]
        now = self.clock()
        client = self.routes.get(route)
        who = client or f"unwelcomed peer {route[:24]!r}"
        try:
            msg = decode(body, limits=self.options.limits, manifest=self.manifest)
        except ProtocolError as exc:
            self.metrics.rejected.inc(client or "?", exc.reason.value)
            log.warning("refused a message from %s: %s", who, exc)
            self._reply(route, Reject(code=exc.reason.value, detail=exc.detail[:1024]))
            return
        if isinstance(msg, Hello):
            self._on_hello(route, msg, now)
            return
        state = self.clients.get(client) if client else None
        if state is None:
            self.metrics.rejected.inc("?", Reason.NOT_WELCOMED.value)
            if isinstance(msg, Push):
                self._ack(route, msg.seq, False, Reason.NOT_WELCOMED, "say hello first")
            else:
                self._reply(route, Reject(code=Reason.NOT_WELCOMED.value, detail="say hello first"))
            return
        state.last_seen = now
        if isinstance(msg, Push):
            self.metrics.bytes.inc(state.client_id, by=sum(len(frame_bytes(f)) for f in body))
            self._on_push(route, state, msg, now)
        elif isinstance(msg, Heartbeat):
            if msg.resolved_below > state.floor:
                state.raise_floor(msg.resolved_below)
            self._reply(
                route,
                Heartbeat(
                    nonce=msg.nonce,
                    reply=True,
                    model_version=self.version,
                    verdicts=state.pending(VERDICTS_PER_ANSWER),
                ),
            )
        elif isinstance(msg, ModelRequest):
            self._on_model_request(route, msg)
        else:
            self.metrics.rejected.inc(state.client_id, Reason.UNKNOWN_TYPE.value)
            self._reply(
                route, Reject(code=Reason.UNKNOWN_TYPE.value, detail=f"{msg.TYPE} is not for the gateway")
            )

    def _on_hello(self, route: bytes, msg: Hello, now: float) -> None:
        difference = self.manifest.first_difference(msg.manifest)
        if difference is not None:
            self.metrics.rejected.inc(msg.client_id, Reason.MANIFEST.value)
            detail = f"edge {msg.client_id}'s model differs from the gateway's: {difference}"
            log.error("%s", detail)
            self._reply(route, Reject(code=Reason.MANIFEST.value, detail=detail[:1024]))
            return
        state = self.clients.get(msg.client_id)
        if state is None:
            state = self.clients[msg.client_id] = ClientState(msg.client_id, route)
            log.info(
                "edge %s joined (model version %d, next seq %d)",
                msg.client_id,
                msg.model_version,
                msg.next_seq,
            )
        elif state.route != route:
            self.routes.pop(state.route, None)
            state.route = route
        self.routes[route] = msg.client_id
        state.last_seen = now
        self.metrics.clients.set(value=len(self.clients))
        self._reply(
            route,
            Welcome(
                gateway_id=self.gateway_id,
                manifest_digest=self.manifest.digest,
                model_version=self.version,
                durable_seq=0,
                settings={"credit": self.options.credit, "window": self.options.window},
            ),
        )

    def _on_push(self, route: bytes, state: ClientState, msg: Push, now: float) -> None:
        cid = state.client_id
        self.metrics.pushes.inc(cid)
        if msg.resolved_below > state.floor:
            state.raise_floor(msg.resolved_below)
        if msg.seq < state.floor or msg.seq in state.verdicts:
            self.metrics.duplicates.inc(cid)
            code, attempt = state.verdicts.get(msg.seq, ("", 0))
            self._ack(
                route,
                msg.seq,
                not code,
                code or Reason.DUPLICATE,
                "answered before; not applied again",
                count=False,
                attempt=attempt,
            )
            return
        if msg.seq >= state.floor + self.options.window or len(state.verdicts) >= self.options.window:
            self._ack(
                route, msg.seq, False, Reason.WINDOW, f"seq {msg.seq} is beyond the window from {state.floor}"
            )
            return
        staleness = max(0, self.version - msg.base_version)
        self.metrics.staleness.observe(cid, value=staleness)
        if not self.weighting.admit(staleness):
            for layer in msg.layers:
                self.metrics.dropped_stale.inc(cid, layer.name, by=layer.count)
            state.record(msg.seq, Reason.STALE.value, msg.attempt)
            self._ack(
                route, msg.seq, False, Reason.STALE, f"{staleness} versions behind", attempt=msg.attempt
            )
            return
        if not msg.layers:  # nothing to add; only the verdict (and the floor) matter
            state.record(msg.seq, "", msg.attempt)
            self._ack(route, msg.seq, True, None, "", attempt=msg.attempt)
            return
        scale = self.weighting.scale(staleness)
        indices = []
        count = 0
        for layer in msg.layers:
            i = self.layer_index[layer.name]  # the codec checked the name against the manifest
            self.acc[i].add(layer.payload.to_dense(), self.weighting.share(layer.count), scale)
            self.metrics.applied.inc(cid, layer.name, by=layer.count)
            indices.append(i)
            count = max(count, layer.count)
        self.open.record(cid, indices, count, staleness, now)
        state.record(msg.seq, "", msg.attempt)
        self._ack(route, msg.seq, True, None, "", attempt=msg.attempt)

    def _on_model_request(self, route: bytes, msg: ModelRequest) -> None:
        if msg.names:
            unknown = [n for n in msg.names if n not in self.layer_index]
            if unknown:
                self._reply(route, Reject(code=Reason.UNKNOWN_LAYER.value, detail=f"no layer {unknown[0]!r}"))
                return
            layers = tuple(LayerTensor(n, Dense(self._snapshot[n])) for n in msg.names)
            self._reply(route, Model(version=self.version, full=False, layers=layers))
            return
        layers = tuple(LayerTensor(n, Dense(self._snapshot[n])) for n in self.names)
        self._reply(route, Model(version=self.version, full=True, layers=layers))

    # --------------------------------------------------------------------- rounds
    def maybe_close_round(self) -> RoundSummary | None:
        now = self.clock()
        if not self.rounds.should_close(self.open, now):
            return None
        return self.close_round(now)

    def close_round(self, now: float | None = None) -> RoundSummary:
        """Average, step the optimizer, bump the version; layers nobody sent are left alone."""
        now = self.clock() if now is None else now
        rnd = self.open
        updated = 0
        for param, acc in zip(self.params, self.acc):
            avg = acc.average(self.weighting.min_divisor())
            if avg is None:
                param.grad = None
            else:
                param.grad = avg.view_as(param).to(param.dtype)
                updated += 1
            acc.reset()
        if updated:
            if self.lr_factor is not None:
                factor = self.lr_factor(rnd.number)
                for group, base in zip(self.optimizer.param_groups, self._base_lr):
                    group["lr"] = base * factor
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self._snapshot = self._take_snapshot()
        self.metrics.rounds.inc()
        self.metrics.version.set(value=self.version)
        summary = RoundSummary(
            number=rnd.number,
            version=self.version,
            clients=len(rnd.covered),
            complete_clients=rnd.complete_clients(),
            steps=rnd.steps,
            layers_updated=updated,
            staleness_mean=rnd.staleness_sum / rnd.contributions if rnd.contributions else 0.0,
            staleness_max=rnd.staleness_max,
            seconds=now - rnd.opened_at if rnd.opened_at is not None else 0.0,
        )
        self.open = OpenRound(number=rnd.number + 1, layers=len(self.params))
        log.debug("round %d closed: %s", summary.number, summary.as_dict())
        if self.on_round is not None:
            self.on_round(summary)
        return summary

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The current version's parameters; never modified afterwards (safe from any thread)."""
        return self._snapshot

    def _take_snapshot(self) -> dict[str, torch.Tensor]:
        # Immutable per version: model answers are sent zero-copy while the optimizer moves on.
        return {n: p.detach().to("cpu", copy=True).contiguous() for n, p in zip(self.names, self.params)}

    # ---------------------------------------------------------------------- replies
    def _ack(
        self,
        route: bytes,
        seq: int,
        accepted: bool,
        code: Reason | str | None,
        detail: str,
        count: bool = True,
        attempt: int = 0,
    ) -> None:
        # `count`: a repeated verdict (duplicate of a refused push) is not a second refusal.
        code_text = code.value if isinstance(code, Reason) else (code or "")
        client = self.routes.get(route)
        if count and not accepted and code_text not in (Reason.WINDOW.value, Reason.NOT_WELCOMED.value):
            self.metrics.rejected.inc(client or "?", code_text)
        state = self.clients.get(client) if client else None
        verdicts = state.pending(VERDICTS_PER_ANSWER) if state is not None else ()
        self._reply(
            route,
            Ack(
                seq=seq,
                accepted=accepted,
                credit=self.options.credit,
                code=code_text,
                detail=detail,
                model_version=self.version,
                attempt=attempt,
                verdicts=tuple(v for v in verdicts if v[0] != seq),
            ),
        )

    def _reply(self, route: bytes, msg: Message) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send_multipart([route, *encode(msg)], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.metrics.send_failures.inc("peer_queue_full")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.metrics.send_failures.inc("peer_gone")

    def status(self) -> dict[str, object]:
        return {
            "gateway_id": self.gateway_id,
            "version": self.version,
            "round": self.open.number,
            "clients": sorted(self.clients),
            "metrics": self.metrics.registry.snapshot(),
        }
