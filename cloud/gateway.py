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

Hostile input (DESIGN.md guarantees 3 and 4), checked in this order, cheapest
first, each refusal counted by reason and logged naming the device: who is
talking (the enrolled CURVE key behind the message, cloud/admission.py), its
message and byte rate, then the decoder's caps (sized from the model's
manifest, before anything is allocated), structure, shapes, dtypes, checksums
and NaN/Inf, then a push's checks (cloud/verdicts.py: replay, window, staleness,
finiteness once expanded, the gradient-norm bound), each deciding a verdict that
`_answer` alone records, counts and acknowledges.  A refused message changes
neither the model nor any other device's state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from elasticfed.cloud import verdicts
from elasticfed.cloud.admission import CurveAdmission
from elasticfed.cloud.aggregation import (
    Aggregation,
    Buffered,
    DeadlineQuorum,
    MeanAggregation,
    MeanStep,
    OpenRound,
    RoundPolicy,
    Weighting,
    contribution,
)
from elasticfed.cloud.clients import ClientState
from elasticfed.cloud.config import GatewaySettings
from elasticfed.cloud.delivery import DeliveryPace
from elasticfed.cloud.durability import Durability, GatewayCheckpoints, GatewayState, StepCounts
from elasticfed.cloud.ema import ModelEma, accumulator_dtype
from elasticfed.cloud.publication import PublicModel, downlink_ratio
from elasticfed.cloud.verdicts import NORM_POLICIES, Verdict
from elasticfed.cloud.watch import LossWatch
from elasticfed.common.checkpoint import CheckpointError, load_optimizer_state, optimizer_state_tensors
from elasticfed.common.gradient_hooks import trainable_parameters
from elasticfed.common.link import TokenBucket
from elasticfed.common.metrics import LATENCY_BUCKETS_S, STALENESS_BUCKETS, Metrics
from elasticfed.common.transport import Link, Received, Refusal, RouterLink, SendRefused
from elasticfed.protocol import (
    DEFAULT_LIMITS,
    Ack,
    Commit,
    Dense,
    Heartbeat,
    Hello,
    LayerGradient,
    LayerTensor,
    Limits,
    Manifest,
    Message,
    Model,
    ModelChunk,
    ModelFetch,
    ModelRequest,
    ProtocolError,
    Push,
    Reason,
    Reject,
    Welcome,
    all_finite,
    blob,
    decode,
    encode,
    frame_bytes,
    limits_for,
    peek_push,
)

log = logging.getLogger("elasticfed.gateway")

# The send_failures metric's labels, from before the transport boundary (dashboards read them).
_SEND_FAILURES = {
    Refusal.QUEUE_FULL: "peer_queue_full",
    Refusal.PEER_GONE: "peer_gone",
    Refusal.NO_PEER: "peer_gone",
}

_DEFAULTS = GatewaySettings()  # `cloud serve`'s [gateway] defaults: GatewayOptions' too

# Verdicts repeated in every ack and heartbeat reply: an edge has at most `credit`
# pushes outstanding, so this covers them all unless it falls far behind.
VERDICTS_PER_ANSWER = 64


class GatewayDiverged(RuntimeError):
    """A round's update made the model non-finite; the gateway stops without serving or saving it."""


class ModelUpdate(Protocol):
    """Where a closed round's per-layer averages go: the one point standalone and hybrid differ."""

    # True: the model changed in apply(), and the gateway publishes the new version to edges itself.
    # False: someone else owns the model and calls Gateway.publish() (hybrid: the cloud trainer).
    publishes: bool

    def apply(
        self, round_number: int, averages: Sequence[torch.Tensor | None], layer_steps: Sequence[int]
    ) -> None:
        """`averages[i]` for layer i of the manifest (None: nobody sent it), of `layer_steps[i]` steps."""


def edge_push(optimizer: torch.optim.Optimizer | None) -> str:
    """What edges that follow their optimizer should push to a gateway stepping with `optimizer`.

    Momentum is applied once.  A gateway whose step is plain SGD without momentum takes the
    mean of the edges' moves (FedAvg), and an adaptive one (FedAdam, FedYogi:
    cloud/server_optimizers.py) takes that move as its pseudo-gradient (Reddi et al.): edges
    push their optimizer's step, momentum included ("step", edge/direction.py).  SGD with
    momentum (or a cloud trainer's optimizer, hybrid: None here) supplies its own: edges push
    raw gradients ("gradient"), or momentum counts twice (measured on the digits fleet: 10%
    accuracy instead of 96%).
    """
    if optimizer is None:
        return "gradient"
    if type(optimizer) is torch.optim.SGD:
        return "gradient" if any(g["momentum"] for g in optimizer.param_groups) else "step"
    return "step"


class OptimizerStep:
    """Standalone: the gateway's own optimizer steps its model with the averages as gradients."""

    publishes = True

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        lr_factor: Callable[[int], float] | None = None,
    ) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.lr_factor = lr_factor  # round number -> multiplier of the optimizer's learning rate
        self._base_lr = [group["lr"] for group in optimizer.param_groups]

    def apply(
        self, round_number: int, averages: Sequence[torch.Tensor | None], layer_steps: Sequence[int]
    ) -> None:
        for param, avg in zip(self.params, averages):
            param.grad = None if avg is None else avg.view_as(param).to(param.dtype)
        if self.lr_factor is not None:
            factor = self.lr_factor(round_number)
            for group, base in zip(self.optimizer.param_groups, self._base_lr):
                group["lr"] = base * factor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class GatewayOptions:
    """How the gateway serves edges.  The defaults are `[gateway]`'s (cloud/config.py): one source,
    so a gateway built in code behaves as `cloud serve` does; `from_settings` maps a section."""

    bind: str = _DEFAULTS.bind
    credit: int = _DEFAULTS.credit  # pushes a client may have outstanding
    window: int = _DEFAULTS.window  # verdicts kept per client for de-duplication
    limits: Limits | None = None  # None: the tightest caps for the model (protocol.limits_for)
    gateway_id: str = ""  # prefix of the instance id, which is new at every start (edges notice a restart)
    max_clients: int = _DEFAULTS.max_clients  # devices remembered at once; a hello beyond is refused
    client_idle_s: float = 600.0  # ... unless the device silent the longest has been silent this long
    # Payload encodings accepted from edges: dense (fp32/fp16), and what uplink compression sends
    # (int8, sparse top-k).  The general top-k and low-rank forms cost an expansion per push.
    encodings: tuple[str, ...] = ("dense", "int8", "sparse")
    rate_messages_per_s: float = _DEFAULTS.rate_messages_per_s  # per device, all message types (0: none)
    rate_burst: int = _DEFAULTS.rate_burst  # messages a device may send back to back
    rate_bytes_per_s: float = _DEFAULTS.rate_bytes_per_s  # per device (0: no limit)
    # Bound on a layer's gradient norm per unit of weight (a step for success weighting, a
    # contribution for local progress); 0: no bound.  Over it: clip to it, or refuse the push.
    max_grad_norm: float = _DEFAULTS.max_grad_norm
    norm_policy: str = _DEFAULTS.norm_policy
    # Served model versions kept for chunked downloads (ModelFetch), the least recently fetched
    # forgotten first: an edge part-way through one finishes it rather than starting over.
    model_versions_kept: int = _DEFAULTS.model_versions_kept
    # Per edge and layer, a float64 sum of the decoded pushes it applied (before weighting): with
    # the edge's own sums, proves compression loses nothing (tests, benchmarks).
    audit_mass: bool = _DEFAULTS.audit_mass
    # Downlink: each version moves this share of the public model's entries (those furthest from
    # the gateway's model) and edges fetch patches (cloud/publication.py); 0: whole models.
    downlink_ratio: float = downlink_ratio(_DEFAULTS.downlink)
    downlink_history: int = _DEFAULTS.downlink_history  # versions a patch may span; further: a snapshot
    max_chunk_bytes: int = 4 * 2**20  # the most one ModelChunk carries, whatever an edge asks

    @classmethod
    def from_settings(cls, g: GatewaySettings) -> GatewayOptions:
        """The options a `[gateway]` section sets (the rest keep their defaults)."""
        return cls(
            bind=g.bind,
            credit=g.credit,
            window=g.window,
            max_clients=g.max_clients,
            rate_messages_per_s=g.rate_messages_per_s,
            rate_burst=g.rate_burst,
            rate_bytes_per_s=g.rate_bytes_per_s,
            max_grad_norm=g.max_grad_norm,
            norm_policy=g.norm_policy,
            model_versions_kept=g.model_versions_kept,
            audit_mass=g.audit_mass,
            downlink_ratio=downlink_ratio(g.downlink),
            downlink_history=g.downlink_history,
        )

    def __post_init__(self) -> None:
        if self.credit < 1 or self.window < 1:
            raise ValueError(f"credit and window must be >= 1, got {self.credit}, {self.window}")
        if self.max_clients < 1 or self.rate_burst < 1:
            raise ValueError(
                f"max_clients and rate_burst must be >= 1, got {self.max_clients}, {self.rate_burst}"
            )
        if self.rate_messages_per_s < 0 or self.rate_bytes_per_s < 0 or self.max_grad_norm < 0:
            raise ValueError("rates and max_grad_norm must be >= 0 (0: off)")
        if self.norm_policy not in NORM_POLICIES:
            raise ValueError(f"norm_policy must be one of {NORM_POLICIES}, got {self.norm_policy!r}")
        if self.model_versions_kept < 1 or self.max_chunk_bytes < 1024:
            raise ValueError(
                f"model_versions_kept must be >= 1 and max_chunk_bytes >= 1024, got "
                f"{self.model_versions_kept}, {self.max_chunk_bytes}"
            )


@dataclass(frozen=True)
class ServedModel:
    """One served model version as a blob (protocol/blob.py) and its digest."""

    version: int
    blob: torch.Tensor
    digest: int
    mass: float = 0.0  # the step mass applied up to it (ModelChunk.mass; 0: not known)


class _Rate:
    """One device's message and byte budgets (token buckets)."""

    __slots__ = ("bytes", "messages")

    def __init__(self, options: GatewayOptions, now: float) -> None:
        self.messages = (
            TokenBucket(options.rate_messages_per_s, options.rate_burst, now)
            if options.rate_messages_per_s
            else None
        )
        self.bytes = (
            TokenBucket(options.rate_bytes_per_s, max(options.rate_bytes_per_s, 1.0), now)
            if options.rate_bytes_per_s
            else None
        )

    def allow(self, size: int, now: float) -> bool:
        if self.messages is not None and self.messages.ready_at(1, now) > now:
            return False
        if self.bytes is not None and self.bytes.ready_at(size, now) > now:
            return False
        if self.messages is not None:
            self.messages.take(1, now)
        if self.bytes is not None:
            self.bytes.take(size, now)
        return True


class _RefusalLog:
    """A warning per refusal, naming the device, but at most one per (device, reason) a second.

    A flood of bad messages must not become a flood of log lines (a disk is a resource too);
    the counters count every one.
    """

    def __init__(self, interval_s: float = 1.0, max_keys: int = 4096) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def warn(self, who: str, reason: str, detail: str, now: float) -> None:
        key = (who, reason)
        last, quiet = self._last.get(key, (-1e18, 0))
        if now - last < self.interval_s:
            self._last[key] = (last, quiet + 1)
            return
        if len(self._last) >= self.max_keys:
            self._last.clear()
        self._last[key] = (now, 0)
        more = f" ({quiet} more like it not logged)" if quiet else ""
        log.warning("refused a message from %s (%s): %s%s", who, reason, detail, more)


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
        self.nonfinite = m.counter(
            "gateway_nonfinite_layers_total",
            "round averages not applied: NaN or Inf after summing",
            ["layer"],
        )
        self.clipped = m.counter(
            "gateway_clipped_total", "layer contributions scaled down to the norm bound", ["client", "layer"]
        )
        self.bytes = m.counter("gateway_received_bytes_total", "bytes of push messages", ["client"])
        self.staleness = m.histogram(
            "gateway_staleness", "versions behind, per push", ["client"], STALENESS_BUCKETS
        )
        self.sent_bytes = m.counter("gateway_sent_bytes_total", "bytes of replies (acks, models)", ["client"])
        self.send_failures = m.counter(
            "gateway_send_failures_total", "replies that could not be sent", ["reason"]
        )
        self.rounds = m.counter("gateway_rounds_total", "rounds closed")
        self.round_seconds = m.histogram(
            "gateway_round_seconds", "from a round's first contribution to its close", [], LATENCY_BUCKETS_S
        )
        self.version = m.gauge("gateway_model_version", "version of the model served to edges")
        self.clients = m.gauge("gateway_clients", "clients that said hello")
        self.public_distance = m.gauge(
            "gateway_public_model_distance",
            "|x_global - x_public| / |x_global|: how far the model edges hold (patched) is behind",
        )
        self.model_served_bytes = m.counter(
            "gateway_model_served_bytes_total",
            "model bytes sent to edges, by kind (snapshot or patch)",
            ("kind",),
        )


class Gateway:
    """Per-layer accumulators, success-weighted averaging, rounds, model versions; one thread."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        options: GatewayOptions | None = None,
        weighting: Weighting | None = None,
        rounds: RoundPolicy | None = None,
        on_round: Callable[[RoundSummary], None] | None = None,
        version: int = 0,
        clock: Callable[[], float] = time.monotonic,
        lr_factor: Callable[[int], float] | None = None,
        admission: CurveAdmission | None = None,
        aggregation: Aggregation | None = None,
        checkpoints: Durability | None = None,
        update: ModelUpdate | None = None,
        watch: LossWatch | None = None,
        ema: ModelEma | None = None,
        link: Link | None = None,
    ) -> None:
        self.model = model
        self.watch = watch  # None: no loss probe (non-finite models are still refused)
        self.ema = ema  # None: the gateway reports its live model (cloud/ema.py)
        self._ema_lock = threading.Lock()  # the demo reads the average while this thread folds
        self.optimizer = optimizer  # None when `update` steps someone else's optimizer (hybrid)
        self.diverged: str | None = None  # why the gateway stopped applying (GatewayDiverged)
        self.options = options or GatewayOptions()
        self.admission = admission  # None: --insecure (anyone reaching the port may talk)
        self.checkpoints = checkpoints  # None: state lives in memory only
        self.aggregation = aggregation or MeanAggregation()
        self.weighting = weighting or MeanStep()
        self.rounds = rounds or DeadlineQuorum()
        self.on_round = on_round
        self.clock = clock
        # New at every start, even with a configured prefix: edges tell instances apart by it, and
        # an instance's acknowledgements are durable only through what that instance wrote to disk.
        self.gateway_id = f"{self.options.gateway_id or 'gw'}-{os.urandom(6).hex()}"
        named = trainable_parameters(model)
        self.manifest = Manifest.from_parameters(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if update is None:
            if optimizer is None:
                raise ValueError("a gateway needs an optimizer, or an update policy that owns the model")
            update = OptimizerStep(self.params, optimizer, lr_factor)
        elif isinstance(checkpoints, GatewayCheckpoints):
            raise ValueError(
                "gateway checkpoints hold the gateway's own model and optimizer; with an update "
                "policy that owns the model, checkpoint where the model lives (hybrid mode: "
                "cloud/hybrid_checkpoints.py)"
            )
        self.update = update
        self.edge_push = edge_push(optimizer if isinstance(update, OptimizerStep) else None)
        # The step mass applied so far (this instance; ModelChunk.mass), where it is known.
        self.mass = 0.0
        self._mass_known = (
            isinstance(update, OptimizerStep)
            and type(optimizer) is torch.optim.SGD
            and not any(g["momentum"] for g in optimizer.param_groups)
            and isinstance(self.weighting, Buffered)
            and isinstance(self.aggregation, MeanAggregation)
        )
        self.layer_index = {n: i for i, n in enumerate(self.names)}
        self.limits = self.options.limits or dataclasses.replace(
            limits_for(self.manifest, DEFAULT_LIMITS), encodings=self.options.encodings
        )
        self.acc = [self.aggregation.accumulator(p.numel()) for p in self.params]
        self._applied_mass: dict[str, list[torch.Tensor]] = {}
        self.public = (
            PublicModel(self.manifest, self.options.downlink_ratio, self.options.downlink_history)
            if self.options.downlink_ratio
            else None
        )
        self._dense_bytes = {n: p.numel() * p.element_size() for n, p in named}
        self.delivery = DeliveryPace(sum(self._dense_bytes.values()))
        self._rates: dict[str, _Rate] = {}
        self._refusals = _RefusalLog()
        self.version = version
        self.open = OpenRound(number=1, layers=len(self.params))
        self.clients: dict[str, ClientState] = {}
        # Devices forgotten to make room (_evict_idle) holding verdicts their edge has not said it
        # heard: kept until they return, and saved with the others, so a push re-sent after the
        # device's return is answered as before, never applied twice.  At most max_clients of them.
        self._dormant: dict[str, ClientState] = {}
        self.routes: dict[bytes, str] = {}
        # Durability (with checkpoints), in checkpoint numbers (epochs): the newest on disk, and
        # for each instance the checkpoints we descend from were written by, the newest it wrote
        # (what a restarted edge's held acknowledgements are judged against).
        self.durable_epoch = 0
        # The newest epoch whose state went to `checkpoints.save`: acks name the one after it.  The
        # same as durable_epoch standalone (save writes); ahead of it in hybrid mode until the
        # trainer has written the state (cloud/hybrid_checkpoints.py).
        self._taken_epoch = 0
        self.lineage: dict[str, int] = {}
        # Step-gradients applied per client and layer, over the whole checkpointed history (audit).
        self.applied_steps: dict[str, list[int]] = {}
        self.metrics = GatewayMetrics()
        self.metrics.version.set(value=version)
        # Served versions as blobs (protocol/blob.py), newest last; the newest is what edges are
        # told of.  Each is immutable: chunks leave zero-copy while the optimizer moves on.
        self._served: OrderedDict[int, ServedModel] = OrderedDict()
        self._served_lock = threading.Lock()  # hybrid: the trainer publishes while this thread serves
        # (version, parameters) served to edges; replaced whole, so a reader never sees a mix.
        self._published = self._serve(version)
        self._last_close = clock()
        # When a welcomed edge last sent anything (pushes, heartbeats): hybrid mode's drain.
        self.last_heard_at: float | None = None
        # The socket edges talk to (common/transport): a ZeroMQ ROUTER made at bind() unless given
        # (an in-process hub's router in protocol tests).
        self.link: Link | None = link
        self._bound_link = False
        self.bound_endpoint = ""
        self._bound = threading.Event()

    # -------------------------------------------------------------------- service
    def bind(self) -> str:
        """Open the link (from the thread that will serve); returns the endpoint."""
        if self.link is None:
            self.link = RouterLink(
                self.options.bind,
                self.limits,
                # Per connection, libzmq queues at most this many messages while this thread is
                # busy, then stops reading that connection (back-pressure, nothing dropped).
                # Credit keeps an honest edge far below it.
                queue_per_peer=4 * self.options.credit + 16,
                peers=self.options.max_clients,
                secure=self.admission.secure if self.admission is not None else None,
            )
        self.bound_endpoint = self.link.open()
        self._bound_link = True
        self._bound.set()
        log.info(
            "gateway %s listening on %s (model version %d, %s)",
            self.gateway_id,
            self.bound_endpoint,
            self.version,
            "CURVE, enrolled devices only" if self.admission is not None else "INSECURE",
        )
        if self.admission is None:
            log.warning(
                "--insecure: edges connect WITHOUT encryption or authentication; anyone who reaches "
                "%s can push gradients",
                self.bound_endpoint,
            )
        return self.bound_endpoint

    def wait_bound(self, timeout: float) -> str:
        if not self._bound.wait(timeout):
            raise TimeoutError(f"gateway did not bind within {timeout} s")
        return self.bound_endpoint

    def serve(self, stop: threading.Event, max_rounds: int | None = None) -> None:
        """Answer edges until `stop` is set (or `max_rounds` rounds have closed)."""
        if not self._bound_link:
            self.bind()
        try:
            while not stop.is_set():
                self.poll_once(0.05)
                if max_rounds is not None and self.open.number > max_rounds:
                    return
        finally:
            self.close()

    def poll_once(self, timeout_s: float) -> None:
        assert self.link is not None and self._bound_link, "bind() first"
        wait = timeout_s
        left = self.rounds.time_left(self.open, self.clock())
        if left is not None:
            wait = max(0.0, min(wait, left))
        if self.link.poll(wait):
            for _ in range(256):  # bounded batch, then check the round
                message = self.link.receive()
                if message is None:
                    break
                self.handle(message)
        self.maybe_close_round()
        if (
            self.checkpoints is not None
            and self.open.opened_at is None
            and self.checkpoints.due_when_idle(self.version, self.clock(), self._last_close)
        ):
            self.checkpoint()
        if self.checkpoints is not None:
            self._commit()

    def close(self, linger_s: float = 1.0) -> None:
        """Stop serving; replies already queued (the last round's acks) get `linger_s` to leave.

        With checkpoints, what the open round holds is applied first and saved: a clean stop
        keeps every contribution the gateway acknowledged.
        """
        if self.checkpoints is not None and self._bound_link:
            if self.diverged is None:  # diverged: the last checkpoint is the last good model
                if self.open.opened_at is not None:
                    self.close_round()
                if self.checkpoints.saved_version != self.version:
                    self.checkpoint()
            self.checkpoints.close()
        if self.link is not None and self._bound_link:
            self.link.close(linger_s)
            self._bound_link = False
        if self.admission is not None:
            self.admission.close()

    # ------------------------------------------------------------------- messages
    def handle(self, message: Received) -> None:
        """One message; whatever it holds, the serving thread survives it."""
        route = message.peer
        try:
            self._handle(route, message.frames, message.user_id)
        except Exception as exc:  # a check we missed must cost one message, not the service
            log.exception("failed to handle a message from route %r", route[:24])
            detail = f"could not be handled: {type(exc).__name__}: {exc}"
            self._refuse(route, self.routes.get(route), Reason.MALFORMED, detail, self.clock())

    def _handle(self, route: bytes, body: list[Any], user_id: str | None) -> None:
        now = self.clock()
        client = self.routes.get(route)
        identity = None  # the enrolled name behind the message (CURVE), never a header's claim
        if self.admission is not None:
            identity = self.admission.identity(user_id)
            if identity is None:
                self._refuse(route, None, Reason.UNAUTHENTICATED, "no enrolled CURVE key (revoked?)", now)
                return
            # The key decides who this is, whatever the route: a device that reconnected (a new
            # routing id) is followed, and a route never lends its device's name to another key.
            client = identity
            known = self.clients.get(identity)
            if known is not None and known.route != route:
                self.routes.pop(known.route, None)
                known.route = route
                self.routes[route] = identity
        who = identity or client
        size = sum(len(frame_bytes(f)) for f in body)
        if who is not None and (self.options.rate_messages_per_s or self.options.rate_bytes_per_s):
            rate = self._rates.get(who)
            if rate is None:
                rate = self._rates[who] = _Rate(self.options, now)
            if not rate.allow(size, now):
                self._refuse(route, who, Reason.RATE_LIMITED, "over the rate limit; slow down", now)
                return
        state = self.clients.get(client) if client else None
        if state is not None and state.welcomed and self._answered_before(route, state, body, size, now):
            return
        try:
            msg = decode(body, limits=self.limits, manifest=self.manifest)
        except ProtocolError as exc:
            self._refuse(route, who, exc.reason, exc.detail, now)
            return
        if isinstance(msg, Hello):
            self._on_hello(route, msg, now, identity)
            return
        if state is None or not state.welcomed:
            self.metrics.rejected.inc(who or "?", Reason.NOT_WELCOMED.value)
            if isinstance(msg, Push):
                self._ack(route, msg.seq, False, Reason.NOT_WELCOMED, "say hello first")
            else:
                self._reply(route, Reject(code=Reason.NOT_WELCOMED.value, detail="say hello first"))
            return
        state.last_seen = now
        self.last_heard_at = now
        dense = sum(self._dense_bytes[layer.name] for layer in msg.layers) if isinstance(msg, Push) else 0
        self.delivery.arrived(state.client_id, size, now, dense)
        if isinstance(msg, Push):
            self.metrics.bytes.inc(state.client_id, by=size)
            self._on_push(route, state, msg, now)
        elif isinstance(msg, Heartbeat):
            state.resolve_below(msg.resolved_below)
            self._reply(
                route,
                Heartbeat(
                    nonce=msg.nonce,
                    reply=True,
                    model_version=self.served_version,
                    verdicts=state.pending(VERDICTS_PER_ANSWER),
                    durable_epoch=self.durable_epoch,
                    gateway_id=self.gateway_id,
                ),
            )
        elif isinstance(msg, ModelFetch):
            self._on_model_fetch(route, state, msg, now)
        elif isinstance(msg, ModelRequest):
            self._on_model_request(route, msg)
        else:
            detail = f"{msg.TYPE} is not for the gateway"
            self._refuse(route, state.client_id, Reason.UNKNOWN_TYPE, detail, now)

    def _refuse(self, route: bytes, who: str | None, reason: Reason, detail: str, now: float) -> None:
        """Count, log (rate-limited) and answer a refused message; nothing else changes."""
        name = who or f"unknown peer {route[:24]!r}"
        self.metrics.rejected.inc(who or "?", reason.value)
        self._refusals.warn(name, reason.value, detail, now)
        self._reply(route, Reject(code=reason.value, detail=detail[:1024]))

    def _on_hello(self, route: bytes, msg: Hello, now: float, identity: str | None = None) -> None:
        if identity is not None and msg.client_id != identity:
            detail = f"this key is enrolled as {identity!r}; the hello says {msg.client_id!r}"
            self._refuse(route, identity, Reason.IDENTITY, detail, now)
            return
        # A claimed name labels metrics only once it is proven (CURVE) or welcomed: claims are free.
        who = identity or (msg.client_id if msg.client_id in self.clients else None)
        difference = self.manifest.first_difference(msg.manifest)
        if difference is not None:
            detail = f"edge {msg.client_id}'s model differs from the gateway's: {difference}"
            self._refuse(route, who, Reason.MANIFEST, detail, now)
            return
        state = self.clients.get(msg.client_id)
        # A device back from aside leaves room there for the one it may displace.
        returning = self._dormant.pop(msg.client_id, None) if state is None else None
        if state is None and len(self.clients) >= self.options.max_clients and not self._evict_idle(now):
            if returning is not None:
                self._dormant[msg.client_id] = returning
            detail = f"the gateway serves at most {self.options.max_clients} devices"
            if len(self._dormant) >= self.options.max_clients:
                detail += (
                    f" and keeps the unheard verdicts of at most {self.options.max_clients} that went "
                    "silent; none can be forgotten until they return (raise max_clients)"
                )
            self._refuse(route, who, Reason.TOO_MANY_CLIENTS, detail, now)
            return
        if returning is not None:
            state = self.clients[msg.client_id] = returning
            state.route = route
            log.info("edge %s is back (its %d unheard verdicts kept)", msg.client_id, len(state.verdicts))
        elif state is None:
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
        state.welcomed = True
        state.resolve_below(msg.resolved_below)
        self.metrics.clients.set(value=len(self.clients))
        # Every instance asked about is answered: one this gateway does not descend from wrote
        # nothing it resumed from (0), so what it acknowledged is to be sent again.
        durable = []
        for instance in dict.fromkeys(msg.holding):
            if instance == self.gateway_id:
                durable.append((instance, self.durable_epoch))
            else:
                durable.append((instance, self.lineage.get(instance, 0)))
        self._reply(
            route,
            Welcome(
                gateway_id=self.gateway_id,
                manifest_digest=self.manifest.digest,
                model_version=self.served_version,
                durable=tuple(durable),
                next_seq=max(state.resolved_below, max(state.verdicts, default=-1) + 1),
                settings={
                    "credit": self.options.credit,
                    "window": self.options.window,
                    "commits": self.checkpoints is not None,
                    "push": self.edge_push,
                    "encodings": ",".join(self.options.encodings),
                },
            ),
        )

    def _evict_idle(self, now: float) -> bool:
        """Make room by forgetting a device silent over `client_idle_s` (the longest silent).

        Its verdicts the edge has not said it heard (pushes it may send again: it went silent
        before their answers came) are kept aside (`_dormant`); forgotten with the rest, the same
        push re-sent after its return was applied a second time."""
        idle = [c for c in self.clients.values() if now - c.last_seen >= self.options.client_idle_s]
        # The one silent longest among those with nothing to keep; else among those whose
        # verdicts fit aside (exactly-once before room: with neither, newcomers wait).
        bare = [c for c in idle if not c.verdicts]
        if bare:
            oldest = min(bare, key=lambda c: c.last_seen)
        elif idle and len(self._dormant) < self.options.max_clients:
            oldest = min(idle, key=lambda c: c.last_seen)
            self._dormant[oldest.client_id] = oldest
            oldest.welcomed = False  # it says hello again when it is back
        else:
            return False
        log.info("forgetting edge %s: silent for %.0f s", oldest.client_id, now - oldest.last_seen)
        del self.clients[oldest.client_id]
        self.routes.pop(oldest.route, None)
        self._rates.pop(oldest.client_id, None)
        self.delivery.forget(oldest.client_id)
        return True

    def _answered_before(
        self, route: bytes, state: ClientState, body: list[Any], size: int, now: float
    ) -> bool:
        """A copy of a push judged before, found from its header and answered again (True), its payload
        never decoded: a duplicate must cost far less than the push it repeats (`peek_push`)."""
        head = peek_push(body, self.limits)
        if head is None:
            return False
        # Its `resolved_below` is not taken: the payload is unread, and a message that turns out
        # malformed must change nothing (the next push or heartbeat says it again).
        verdict = verdicts.repeated(state, head, self.durable_epoch)
        if verdict is None:
            return False
        state.last_seen = now
        self.last_heard_at = now
        self.delivery.arrived(state.client_id, size, now)
        self.metrics.bytes.inc(state.client_id, by=size)
        self.metrics.pushes.inc(state.client_id)
        self._answer(route, state, head.seq, (), verdict, now)
        return True

    def _on_push(self, route: bytes, state: ClientState, msg: Push, now: float) -> None:
        """Judge a push by the checks in order (cloud/verdicts.py), the first verdict wins; a push
        that passes them all enters the open round.  Then record, count and answer, in one place."""
        self.metrics.pushes.inc(state.client_id)
        state.resolve_below(msg.resolved_below)
        verdict = verdicts.repeated(state, msg, self.durable_epoch) or verdicts.beyond_window(
            state, msg, self.options.window
        )
        if verdict is None:
            verdict = self._admit(state, msg, now)
        self._answer(route, state, msg.seq, msg.layers, verdict, now)

    def _admit(self, state: ClientState, msg: Push, now: float) -> Verdict:
        """Staleness, then the payload's bounds; a push that passes enters the open round."""
        staleness = max(0, self.served_version - msg.base_version)
        self.metrics.staleness.observe(state.client_id, value=staleness)
        avoidable = verdicts.avoidable_staleness(
            state, msg.base_version, self.served_version, self.weighting, now
        )
        verdict = verdicts.too_stale(msg, staleness, avoidable, self.weighting)
        if verdict is not None:
            return verdict
        if not msg.layers:  # nothing to add; only the verdict (and resolved_below) matter
            return Verdict.applied(msg.attempt, self._epoch())
        # A sparse push stays sparse (its k entries, not the layer's n): checks, the audit and the
        # accumulators take either (cloud/aggregation.py).
        parts = [contribution(layer.payload) for layer in msg.layers]
        verdict = verdicts.not_finite(msg, parts)
        if verdict is not None:
            return verdict
        factors = verdicts.norm_factors(
            msg, parts, self.options.max_grad_norm, self.options.norm_policy, self.weighting
        )
        if isinstance(factors, Verdict):
            return factors
        self._add(state, msg, parts, factors, staleness, now)
        return Verdict.applied(msg.attempt, self._epoch())

    def _add(
        self,
        state: ClientState,
        msg: Push,
        parts: Sequence[torch.Tensor],
        factors: Sequence[float],
        staleness: int,
        now: float,
    ) -> None:
        """An admitted push's layers into the open round (and the mass audit), weighed by staleness."""
        cid = state.client_id
        scale = self.weighting.scale(staleness, msg.lr or None)
        indices = []
        count = 0
        applied = self.applied_steps.get(cid)
        if applied is None:
            applied = self.applied_steps[cid] = [0] * len(self.params)
        mass = self._audited_mass(cid) if self.options.audit_mass else None
        for layer, tensor, factor in zip(msg.layers, parts, factors):
            i = self.layer_index[layer.name]  # the codec checked the name against the manifest
            if factor != 1.0:
                self.metrics.clipped.inc(cid, layer.name)
            if mass is not None:
                if tensor.is_sparse:
                    mass[i].index_add_(0, tensor.indices()[0], tensor.values().double())
                else:
                    mass[i].add_(tensor.reshape(-1))  # float64 += float32: computed in float64
            self.acc[i].add(cid, tensor, self.weighting.share(layer.count), scale * factor)
            self.metrics.applied.inc(cid, layer.name, by=layer.count)
            applied[i] += layer.count
            self.open.layer_steps[i] += layer.count
            self.open.layer_mass[i] += scale * layer.count
            indices.append(i)
            count = max(count, layer.count)
        self.open.record(cid, indices, count, staleness, now, self.delivery.delivery_s(cid), state.fetch_s)

    def _answer(
        self,
        route: bytes,
        state: ClientState,
        seq: int,
        layers: Sequence[LayerGradient],
        verdict: Verdict,
        now: float,
    ) -> None:
        """Carry out a verdict on push `seq` (of `layers`): remember it under the seq, count and log
        it, acknowledge it."""
        cid = state.client_id
        if verdict.repeat:
            self.metrics.duplicates.inc(cid)
        if verdict.recorded:
            state.record(seq, "" if verdict.accepted else verdict.code, verdict.attempt, verdict.epoch)
        if verdict.code == Reason.STALE.value and not verdict.repeat:
            for layer in layers:
                self.metrics.dropped_stale.inc(cid, layer.name, by=layer.count)
        if verdict.logged:
            self._refusals.warn(cid, verdict.code, verdict.detail, now)
        self._ack(
            route,
            seq,
            verdict.accepted,
            verdict.code or None,
            verdict.detail,
            count=not verdict.repeat,
            attempt=verdict.attempt,
            epoch=verdict.epoch,
        )

    def _audited_mass(self, cid: str) -> list[torch.Tensor]:
        """`cid`'s float64 sums of applied pushes, made once: a default built on every call (setdefault's)
        allocated the whole model in float64 per layer of every push, 62% of a gateway's time (base
        model, GPU edges: acks took 3.7 s and edges adopted no model in 36 s of a benchmark)."""
        mass = self._applied_mass.get(cid)
        if mass is None:
            mass = [torch.zeros(p.numel(), dtype=torch.float64) for p in self.params]
            self._applied_mass[cid] = mass
        return mass

    def _on_model_request(self, route: bytes, msg: ModelRequest) -> None:
        unknown = [n for n in msg.names if n not in self.layer_index]
        if unknown:
            self._reply(route, Reject(code=Reason.UNKNOWN_LAYER.value, detail=f"no layer {unknown[0]!r}"))
            return
        with self._served_lock:
            served = self._newest_served()  # the model edges hold (the public one), not x_global
        params = blob.unpack(self.manifest, served.blob)
        names = msg.names or self.names
        layers = tuple(LayerTensor(n, Dense(params[n])) for n in names)
        self._reply(route, Model(version=served.version, full=not msg.names, layers=layers, mass=served.mass))

    def _on_model_fetch(self, route: bytes, state: ClientState, msg: ModelFetch, now: float) -> None:
        """A slice of a served version (the newest if that one is gone); the edge paces these."""
        with self._served_lock:
            newest = self._newest_served()
            served = self._served.get(msg.version or newest.version)
            if served is None:
                served = newest  # forgotten: the edge starts over on the newest
            else:
                self._served.move_to_end(served.version)  # recently fetched: kept longest
            patch = None
            if msg.base_digest and self.public is not None:
                # The patch from what the edge holds, to the version asked for, else the newest.
                patch = self.public.patch(msg.base, msg.base_digest, served.version) or self.public.patch(
                    msg.base, msg.base_digest, newest.version
                )
            mass = (served if patch is None or patch.version == served.version else newest).mass
        if patch is not None:
            version, data_blob, digest, base = patch.version, patch.data, patch.digest, patch.base
            model_digest, base_digest = patch.model_digest, patch.base_digest
        else:
            version, data_blob, digest, base = served.version, served.blob, served.digest, 0
            model_digest, base_digest = served.digest, 0
        state.fetching, state.fetched_at = version, now
        if msg.fetch_ms:
            state.fetch_s = msg.fetch_ms / 1000.0  # the round policy caps what it trusts
        size = data_blob.numel()
        start = min(msg.offset, size)
        end = min(size, start + min(msg.length, self.options.max_chunk_bytes))
        data = memoryview(data_blob.numpy()[start:end])
        self.metrics.model_served_bytes.inc("patch" if base_digest else "snapshot", by=len(data))
        self._reply(
            route,
            ModelChunk(
                version=version,
                size=size,
                digest=digest,
                offset=start,
                data=data,
                base=base,
                model_digest=model_digest,
                mass=mass,
                base_digest=base_digest,
            ),
        )

    def _newest_served(self) -> ServedModel:
        return self._newest  # under _served_lock; never forgotten

    # --------------------------------------------------------------------- rounds
    def maybe_close_round(self) -> RoundSummary | None:
        now = self.clock()
        if not self.rounds.should_close(self.open, now):
            return None
        return self.close_round(now)

    def close_round(self, now: float | None = None) -> RoundSummary:
        """Average, hand the averages to the update policy, bump the version; unsent layers stay."""
        now = self.clock() if now is None else now
        rnd = self.open
        averages: list[torch.Tensor | None] = []
        divisor = self.weighting.min_divisor()
        moved = self._step_mass(rnd, divisor)
        for name, acc in zip(self.names, self.acc):
            avg = acc.average(divisor)
            if avg is not None and not all_finite(avg):
                # Finite contributions can still overflow float32 together; the model must stay finite.
                log.error(
                    "round %d: layer %s's average is not finite; that layer is not updated", rnd.number, name
                )
                self.metrics.nonfinite.inc(name)
                avg = None
            averages.append(avg)
            acc.reset()
        updated = sum(avg is not None for avg in averages)
        if updated:
            # A layer whose average was dropped brought no step-gradient into the model.
            steps = [n if avg is not None else 0 for n, avg in zip(rnd.layer_steps, averages)]
            self.update.apply(rnd.number, averages, steps)
            if self.update.publishes:
                self._refuse_a_broken_model(rnd.number, averages)
                self._refuse_an_exploded_model(rnd.number)
            if moved is not None:
                lr = self.optimizer.param_groups[0]["lr"]  # type: ignore[union-attr]  # after any decay
                self.mass += lr * sum(m for m, avg in zip(moved, averages) if avg is not None) / len(moved)
        self.version += 1
        if self.update.publishes:
            self.publish(self.version)
        self.metrics.rounds.inc()
        if rnd.opened_at is not None:
            self.metrics.round_seconds.observe(value=now - rnd.opened_at)
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
        self._last_close = now
        log.debug("round %d closed: %s", summary.number, summary.as_dict())
        if self.checkpoints is not None and self.checkpoints.due_after_round(rnd.number):
            self.checkpoint()
        if self.on_round is not None:
            self.on_round(summary)
        return summary

    def _step_mass(self, rnd: OpenRound, divisor: int) -> list[float] | None:
        """Per layer, the round's step mass over the gateway's rate (sum of scale x steps over the
        divisor), where the update is exactly minus rate x mass x the mean pushed direction: the
        buffered rule's weighted mean into plain SGD.  None where momentum, an adaptive optimizer
        or a robust aggregation bends the step (the mass is then not known, ModelChunk.mass 0)."""
        if not self._mass_known:
            return None
        return [
            m / max(acc.count, divisor) if acc.count else 0.0  # type: ignore[attr-defined]
            for m, acc in zip(rnd.layer_mass, self.acc)
        ]

    def _refuse_a_broken_model(self, round_number: int, averages: Sequence[torch.Tensor | None]) -> None:
        """Stop before serving or saving a model the round made non-finite (the averages were finite:
        the optimizer overflowed it, e.g. a learning rate far too large for the task).  Only the
        layers the round updated are read: an optimizer leaves the others as they were."""
        broken = [
            name
            for name, p, avg in zip(self.names, self.params, averages)
            if avg is not None and not all_finite(p.detach())
        ]
        if not broken:
            return
        self.diverged = (
            f"round {round_number} made the model non-finite (layers {', '.join(broken[:3])}"
            f"{' ...' if len(broken) > 3 else ''}) with finite averages: the gateway's optimizer "
            "diverged; lower --gateway-lr. Not served and not saved: the last checkpoint holds the "
            "model before it, and edges re-send what was not yet durable"
        )
        log.error("%s", self.diverged)
        raise GatewayDiverged(self.diverged)

    def _refuse_an_exploded_model(self, round_number: int) -> None:
        """Stop before serving or saving a finite model whose loss exploded (cloud/watch.py)."""
        why = self.watch.check(self.model) if self.watch is not None else None
        if why is None:
            return
        self.diverged = (
            f"round {round_number}: {why}: training diverged; lower --gateway-lr (or the edges' "
            "learning rate). Not served and not saved: the last checkpoint holds the model before "
            "it, and edges re-send what was not yet durable"
        )
        log.error("%s", self.diverged)
        raise GatewayDiverged(self.diverged)

    def _epoch(self) -> int:
        """The number of the checkpoint that will hold what is applied now (0: no checkpoints)."""
        return self._taken_epoch + 1 if self.checkpoints is not None else 0

    # ---------------------------------------------------------------- durability
    def state(self) -> GatewayState:
        """This gateway between rounds, as a value (cloud/durability.py).  It shares the live
        parameters and client states: write it before the next message is handled."""
        optimizer_tensors, optimizer_meta = (
            optimizer_state_tensors(self.optimizer) if self.optimizer is not None else ({}, {})
        )
        epoch = self._taken_epoch + 1
        ema = None
        if self.ema is not None:
            with self._ema_lock:  # the average and its count as one (the trainer folds, hybrid)
                if self.ema.tensors:
                    ema = ({n: t.clone() for n, t in self.ema.tensors.items()}, self.ema.count)
        return GatewayState(
            manifest=self.manifest.digest,
            # The model is saved by its owner: here, unless an update policy owns it (hybrid: the
            # trainer, mid-step on another thread; cloud/hybrid_checkpoints.py).
            model={n: p.detach().to("cpu") for n, p in zip(self.names, self.params)}
            if self.update.publishes
            else {},
            optimizer_tensors=optimizer_tensors,
            optimizer_meta=optimizer_meta,
            version=self.version,
            round=self.open.number,
            epoch=epoch,
            clients={**self._dormant, **self.clients},
            lineage={**self.lineage, self.gateway_id: epoch},  # true once the state is on disk
            applied_steps=StepCounts.of(tuple(self.names), self.applied_steps),
            ema=ema,
            served_version=self.served_version,
        )

    def checkpoint(self) -> None:
        """Save the state; once it is on disk, tell every connected edge (the commit)."""
        assert self.checkpoints is not None
        state = self.state()
        self.checkpoints.save(state)
        self._taken_epoch = state.epoch
        self._commit()

    def _commit(self) -> None:
        """Tell every connected edge what is on disk now, if more than they were told."""
        assert self.checkpoints is not None
        epoch = self.checkpoints.durable_epoch
        if epoch <= self.durable_epoch:
            return
        self.durable_epoch = epoch
        self.lineage[self.gateway_id] = epoch
        frames = encode(Commit(durable_epoch=epoch, gateway_id=self.gateway_id))
        for route in list(self.routes):  # one message for all: encoded once (10,000 edges: 0.2 s each)
            self._reply(route, frames)

    def restore(self) -> Path | None:
        """Resume from the newest checkpoint that fits this model; None if there is none."""
        if self.checkpoints is None:
            return None
        return self.checkpoints.restore(self.manifest.digest, self.adopt)

    def adopt(self, state: GatewayState) -> None:
        """Resume from `state` (a checkpoint's); edges re-route with their next hello.  Raises
        CheckpointError naming what does not fit this model, before anything is changed."""
        if state.manifest != self.manifest.digest:
            raise CheckpointError("written for another model (manifest digest differs)")
        for name, param in zip(self.names, self.params):
            saved = state.model.get(name)
            if saved is None or saved.shape != param.shape or saved.dtype != param.dtype:
                raise CheckpointError(f"model tensor {name} is missing or has another shape or dtype")
        if state.ema is not None and self.ema is not None:
            for name, param in zip(self.names, self.params):
                t = state.ema[0].get(name)
                if t is None or t.shape != param.shape or t.dtype != accumulator_dtype(param.dtype):
                    raise CheckpointError(f"averaged tensor {name} is missing or has another shape or dtype")
        applied = state.applied_steps
        used = applied.counts.any(dim=0).tolist()  # layers some client has steps in
        unknown = {n for n, u in zip(applied.layers, used) if u} - set(self.layer_index)
        if unknown:
            raise CheckpointError(f"applied steps name layers this model lacks: {sorted(unknown)[:3]}")
        meta = state.optimizer_meta
        saved_optimizer = meta.get("optimizer") if isinstance(meta, dict) else None
        if self.optimizer is None:
            pass  # an update policy owns the model and its optimizer (hybrid: no gateway checkpoints)
        elif saved_optimizer is not None and saved_optimizer != type(self.optimizer).__name__:
            # --gateway-optimizer changed between runs: what was applied and acknowledged stays (the
            # model, the versions, every edge's verdicts); only the optimizer's moments start afresh.
            log.warning(
                "the checkpoint holds %s state and the gateway's optimizer is now %s: the model, "
                "versions and verdicts are restored, the optimizer starts fresh",
                saved_optimizer,
                type(self.optimizer).__name__,
            )
        else:
            load_optimizer_state(self.optimizer, state.optimizer_tensors, state.optimizer_meta)
        with torch.no_grad():
            for name, param in zip(self.names, self.params):
                param.copy_(state.model[name])
        if self.ema is not None:
            saved, count = state.ema if state.ema is not None else ({}, 0)
            self.ema.load(saved, count)
        self.durable_epoch = self._taken_epoch = state.epoch
        self.lineage = dict(state.lineage)
        self.applied_steps = {}
        columns = [(j, self.layer_index[n]) for j, (n, u) in enumerate(zip(applied.layers, used)) if u]
        for cid, row in zip(applied.clients, applied.counts.tolist()):
            counts = self.applied_steps[cid] = [0] * len(self.names)
            for j, i in columns:
                counts[i] = row[j]
        self.version = state.version
        self.open = OpenRound(number=state.round, layers=len(self.params))
        self.clients = state.clients
        self._dormant = {}
        self.routes = {}
        self._served.clear()
        served = state.version if state.served_version is None else state.served_version
        self._published = self._serve(served)
        self.metrics.version.set(value=served)
        self.metrics.clients.set(value=len(state.clients))

    @property
    def served_version(self) -> int:
        """The version of the model edges download now: what acks announce and staleness counts from.

        Standalone, the round count; in hybrid mode, the trainer's publishes (cloud/hybrid.py).
        """
        return self._published[0]

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The gateway's parameters as of the version served now (x_global: what to evaluate; edges
        hold the public model, `served_digest`); never modified afterwards (safe from any thread)."""
        return self._published[1]

    def served_digest(self, version: int) -> int | None:
        """The digest of the model edges get as `version` (the public model), if still kept."""
        with self._served_lock:
            served = self._served.get(version)
            if served is not None:
                return served.digest
            return self.public.digests.get(version) if self.public is not None else None

    def publish(self, version: int) -> None:
        """Serve the model's current parameters as `version` from now on.

        Called by whoever owns the model, between its updates: the gateway's own thread in
        standalone mode, the cloud trainer on rank 0 in hybrid mode (cloud/hybrid.py).
        """
        self._published = self._serve(version)
        self.metrics.version.set(value=version)
        if self.ema is not None:
            with self._ema_lock:
                self.ema.update(self._published[1])

    def averaged(self) -> dict[str, torch.Tensor]:
        """The model the gateway reports and saves as its result: the average of its published
        versions (cloud/ema.py), or without one the version served now; a copy."""
        if self.ema is not None:
            with self._ema_lock:
                if self.ema.tensors:
                    return {n: t.clone() for n, t in self.ema.tensors.items()}
        return {n: t.clone() for n, t in self.snapshot().items()}

    def _serve(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        """Snapshot the parameters as `version`'s blob; (version, per-layer views of it)."""
        cpu = {n: p.detach().to("cpu") for n, p in zip(self.names, self.params)}
        model = blob.pack(self.manifest, cpu)  # x_global as of `version`: what snapshot() shows
        if self.public is not None:
            with self._served_lock:  # hybrid: patches are built on the serving thread
                data = self.public.advance(version, model)  # what edges hold
                digest = self.public.digest
            self.metrics.public_distance.set(value=self.public.distance)
        else:
            data, digest = model, blob.digest(model)
        served = ServedModel(version, data, digest, self.mass if self._mass_known else 0.0)
        with self._served_lock:
            self._served.pop(version, None)
            self._served[version] = served
            self._newest = served
            while len(self._served) > self.options.model_versions_kept:
                # The least recently published or fetched, never the newest.
                del self._served[next(v for v in self._served if v != version)]
        return version, blob.unpack(self.manifest, model)

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
        epoch: int = 0,
    ) -> None:
        # `count`: a repeated verdict (duplicate of a refused push) is not a second refusal.
        code_text = code.value if isinstance(code, Reason) else (code or "")
        client = self.routes.get(route)
        # not_welcomed is counted where it is found (handle); every other refusal here.
        if count and not accepted and code_text != Reason.NOT_WELCOMED.value:
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
                model_version=self.served_version,
                attempt=attempt,
                verdicts=tuple(v for v in verdicts if v[0] != seq),
                epoch=epoch if accepted else 0,
                durable_epoch=self.durable_epoch,
                gateway_id=self.gateway_id,
            ),
        )

    def _reply(self, route: bytes, msg: Message | list[Any]) -> None:
        """Send `msg` (or its frames, encoded once for many edges) to one edge."""
        if self.link is None or not self._bound_link:
            return
        frames = msg if isinstance(msg, list) else encode(msg)
        try:
            self.link.send(frames, peer=route)
        except SendRefused as exc:
            self.metrics.send_failures.inc(_SEND_FAILURES[exc.refusal])
            return
        sent = sum(len(frame_bytes(f)) for f in frames)
        self.metrics.sent_bytes.inc(self.routes.get(route, "?"), by=sent)

    def applied_mass(self, client_id: str) -> dict[str, torch.Tensor]:
        """Per layer, the float64 sum of `client_id`'s pushes this gateway applied (`audit_mass`)."""
        if not self.options.audit_mass:
            raise RuntimeError("the mass audit needs GatewayOptions(audit_mass=True)")
        mass = self._applied_mass.get(client_id)
        return {
            name: (mass[i].clone() if mass else torch.zeros(p.numel(), dtype=torch.float64))
            for i, (name, p) in enumerate(zip(self.names, self.params))
        }

    def status(self) -> dict[str, object]:
        return {
            "gateway_id": self.gateway_id,
            "version": self.version,
            "round": self.open.number,
            "secure": self.admission is not None,
            "durable_epoch": self.durable_epoch if self.checkpoints is not None else None,
            "clients": sorted(self.clients),
            "dormant_clients": len(self._dormant),  # forgotten to make room, their verdicts kept
            # over the checkpointed history (resumes included), not only this process
            "history_applied_steps": {
                cid: {name: n for name, n in zip(self.names, counts) if n}
                for cid, counts in self.applied_steps.items()
            },
            "metrics": self.metrics.registry.snapshot(),
        }
