"""The edge side of the Elastic Sync Protocol: one I/O thread that owns the link to the gateway.

The training thread never touches the socket.  It adds gradients into the
`GradientCache` and asks for units to be synced; this thread turns them into
pushes, one unanswered push per unit, and keeps the protocol's promises:

- a push is answered within `timeout_s` (strongly synced) or it is *weak*: it
  stays in the cache and is re-sent, same sequence number and bytes, in one
  batch as soon as the gateway answers a request sent after it (on an in-order
  link its own answer would have come first: it was lost), or the connection is
  replaced.  A live TCP connection never loses a message, so that is all a TCP
  link needs; re-sending on a timer there only queues copies behind the
  original (at 1 Mbit/s, seconds of them).  Links that do lose messages on a
  live connection (a message proxy, the in-process fault wrapper) show it: an
  ack names which copy of a push was applied (`attempt`, counted per
  connection), and a re-sent copy applied where its original on the same
  connection was not is proof.  From then on weak pushes are also re-sent on a
  timer (Lazy Pirate), whose interval halves on more proof and doubles when the
  original turns out to have arrived first;
- every answer repeats the gateway's verdicts on all unresolved pushes of this
  edge (a cumulative acknowledgement), so one answer through a lossy link
  settles everything judged so far;
- credit: no more pushes outstanding than the gateway granted, so the gateway's
  queues stay bounded and nothing is dropped at a high-water mark;
- Paranoid Pirate (edge/connection.py): heartbeats when idle; a connection
  silent for too long is replaced at once by a new one that says hello again,
  forever (a restarted gateway is found without help).  The routing id stays
  the same, so the new connection takes over the old one at the gateway and
  pushes continue without waiting for the welcome;
- announced model versions (in acks, heartbeats and the welcome) are fetched
  and left for the training thread to adopt between steps; when training says
  how many local steps it will take first (`expect_adoption`), a download
  starts only when it would otherwise arrive late, so versions that would be
  replaced before adoption are not fetched at all;
- durability: with a gateway that checkpoints, an ack names the checkpoint
  (`epoch`) that will hold the push, and the push stays *held* in the cache
  until that checkpoint is on disk (a commit, repeated in acks and heartbeat
  replies).  The hello names the gateway instances whose pushes are held; the
  welcome says through which version each of them wrote checkpoints that this
  gateway resumed from.  Held sums beyond that were lost with a dead instance
  and are sent again as new pushes;
- with `state_dir`, the cache, the sequence numbers and the counts are saved
  there every `persist_every_s` when they changed, at once after held sums went
  back to pending, and at close, and loaded at start (edge/persistence.py).

The link (common/transport) is a ZeroMQ DEALER unless the caller gives another (an
in-process pair in protocol tests); faults, when given, wrap it in a `FaultyLink`,
which is how tests and the demo make a loopback link lossy, late, duplicating or
down.  Nothing here touches a socket.

With `curve` set (the default in `elasticfed edge`), the socket is a CURVE
client of the gateway's public key, and its routing id carries a random
suffix (sent encrypted), so no other device can take over its connection.
A refused or failed handshake (key not enrolled or revoked; the wrong gateway
public key) is logged and counted, and retried: the refusal in a CURVE
handshake is not authenticated, so anyone on the path could forge one.  What
the gateway says over an authenticated connection is final: a revoked key, a
name that is not this key's, a different model end the session with
`EdgeRefused`.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticfed.common.keys import KeyPair
from elasticfed.common.link import Backoff, Faults
from elasticfed.common.transport import DealerLink, FaultyLink, Link, Tracker
from elasticfed.edge.cache import Flight, FlightState, GradientCache
from elasticfed.edge.config import LIVENESS
from elasticfed.edge.connection import Connection
from elasticfed.edge.download import ModelDownload
from elasticfed.edge.durability import Durability
from elasticfed.edge.flights import Flights
from elasticfed.edge.metrics import EdgeMetrics
from elasticfed.edge.pacing import Backlog, LinkMeter, UploadCap
from elasticfed.edge.persistence import EdgeState
from elasticfed.protocol import (
    DEFAULT_LIMITS,
    UINT_MAX,
    Ack,
    Commit,
    Dense,
    Heartbeat,
    Hello,
    LayerGradient,
    Limits,
    Manifest,
    Model,
    ModelChunk,
    ModelFetch,
    ProtocolError,
    Push,
    Reason,
    Reject,
    Welcome,
    decode,
    encode,
    limits_for,
)
from elasticfed.protocol.payload import payload_bytes

log = logging.getLogger("elasticfed.edge")


@dataclass(frozen=True)
class SessionOptions:
    """How the edge talks to the gateway; validated here so a bad value fails at start."""

    gateway: str
    client_id: str
    timeout_s: float = 0.5
    heartbeat_s: float = 1.0
    liveness: int = LIVENESS  # heartbeats of silence before the connection is replaced
    reconnect_first_s: float = 0.2
    reconnect_cap_s: float = 5.0
    # Unanswered hellos on one connection are asked again after a wait that doubles up to this (with
    # jitter): at a fixed 0.25 s, 10,000 edges waiting on a busy gateway sent it 40,000 hellos a
    # second and it welcomed none in time (benchmarks/fleet.py).  A new connection says hello at once;
    # a link that loses messages on a live connection keeps the fixed pace (see _say_hello).
    hello_cap_s: float = 30.0
    faults: Faults = field(default_factory=Faults)
    limits: Limits = DEFAULT_LIMITS
    settings: dict[str, object] = field(default_factory=dict)  # told to the gateway in hello
    # (this device's key pair, the gateway's public key), both Z85; None: no CURVE (--insecure)
    curve: tuple[KeyPair, bytes] | None = field(default=None, repr=False)
    state_dir: str = ""  # where the cache survives restarts ("": it does not)
    persist_every_s: float = 10.0  # at most this much training is lost to a power cut
    upload_mbit: float = 0.0  # average cap on what this device sends, in Mbit/s (0: none)
    model_chunk_bytes: int = 256 * 1024  # a model comes down in slices of this size (edge/download.py)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.heartbeat_s <= 0:
            raise ValueError("timeout_s and heartbeat_s must be positive")
        if self.upload_mbit < 0:
            raise ValueError(f"upload_mbit must be >= 0 (0: no cap), got {self.upload_mbit}")
        if not 1024 <= self.model_chunk_bytes <= 4 * 2**20:
            raise ValueError(f"model_chunk_bytes must be in [1 KiB, 4 MiB], got {self.model_chunk_bytes}")
        if self.liveness < 1:
            raise ValueError("liveness is a number of heartbeats, at least 1")
        if self.timeout_s > self.heartbeat_s * self.liveness:
            raise ValueError(
                f"timeout_s ({self.timeout_s}) must be at most heartbeat_s x liveness "
                f"({self.heartbeat_s} x {self.liveness}), the silence after which the connection is "
                "replaced: a push must be able to go weak (and be re-sent) before that"
            )
        if self.persist_every_s <= 0:
            raise ValueError("persist_every_s must be positive")
        if not self.hello_cap_s > 0:
            raise ValueError(f"hello_cap_s must be positive, got {self.hello_cap_s}")
        if not self.client_id:
            raise ValueError("client_id must not be empty")
        if len(self.client_id.encode()) > 255 or self.client_id.startswith("\x00"):
            raise ValueError("client_id is the socket's routing id: at most 255 bytes, not starting with NUL")


class EdgeRefused(RuntimeError):
    """The gateway refused this edge for good (e.g. its model does not match); the text says why."""


MIN_WAIT_S = 0.005  # the I/O thread's shortest timer: a due action it cannot take waits at least this

# Refusals after which trying again cannot help: the operator has to act.
_FATAL_REJECTS = {
    Reason.MANIFEST.value: "the gateway refused this edge's model",
    Reason.UNAUTHENTICATED.value: "the gateway does not accept this device's key (not enrolled, or revoked)",
    Reason.IDENTITY.value: "the gateway refused this device's name",
}


class EdgeSession:
    """Owns the socket and the protocol state; its methods are called from the training thread."""

    def __init__(
        self,
        options: SessionOptions,
        manifest: Manifest,
        cache: GradientCache,
        model_version: int = 0,
        clock: Callable[[], float] = time.monotonic,
        link: Link | None = None,
    ) -> None:
        self.options = options
        self.manifest = manifest
        self.limits = limits_for(manifest, options.limits)  # what a gateway may send us, at most
        self.cache = cache
        self.clock = clock
        self.metrics = EdgeMetrics()

        # Shared with the training thread (guarded by _lock).
        self._lock = threading.Lock()
        self._wanted: set[int] = set()
        self._save_requests: list[threading.Event] = []
        self._model: Model | None = None  # newest received model not yet taken by training
        self._refetch = False  # the training thread wants the newest model again (refetch_model)
        self._adoption: tuple[int, float] | None = None  # (steps until training adopts, said at)
        self._error: BaseException | None = None
        self.have_version = model_version  # newest model this edge has (adopted or waiting)

        # Owned by the I/O thread.
        self.seq = 1
        self.credit = 0
        self.window = 1024
        self.welcomed = False
        self.gateway_id = ""
        self.commits = False  # whether the gateway checkpoints (acks then carry epochs)
        # Until a welcome in this process says which seqs the gateway has seen, a saved state's
        # seq counter may be behind what an earlier run used after its last save: no fresh seq
        # is handed out before then.
        self.seq_known = False
        self.announced = model_version
        # Models come down in chunks the edge asks for at the link's pace (edge/download.py).
        self.download = ModelDownload(manifest, options.model_chunk_bytes)
        # Measured rates each way (edge/pacing.py): how much may be queued on the connection, how
        # long answers may take, and so how long silence means a dead link.
        # Until measured, queues and the silence allowed assume a slow link (1 Mbit/s), so a large
        # first transfer never looks like a dead link; the first answers replace the guess.
        self.uplink = LinkMeter(initial_bps=125e3, queue_s=1.0)
        self.downlink = LinkMeter(initial_bps=125e3, queue_s=1.0)
        self.upload_cap = UploadCap(options.upload_mbit, clock())
        # Pushes sent on this connection and not answered yet: seq -> (bytes, first send).  They
        # are in the connection's queue (or the gateway's) whatever their deadlines say; an answer
        # to anything sent later means they never will be (one FIFO each way), see _covers.
        self._queued: dict[int, tuple[int, float]] = {}
        self._queued_bytes = 0
        self._uplink_fluid = Backlog(self.uplink)  # what the rate says has not crossed yet
        self._largest_unit = max((u.numel * u.dtype.itemsize for u in cache.units), default=0)
        self._dense_bytes = sum(u.numel * u.dtype.itemsize for u in cache.units)
        # `auto` compression's inputs (_tune_compression): the time a training step takes.
        self._steps_seen = 0
        self._steps_seen_at: float | None = None
        self._step_s: float | None = None
        self._compression_rung = ""
        self._cap_ready_at = 0.0  # the upload cap holds back the next push until then
        self._link_ready_at = 0.0  # the uplink's backlog holds back the next push until then
        # What an agent that follows its optimizer pushes (the gateway says, cloud.gateway.edge_push):
        # raw gradients until told, never momentum twice (steps cached before a late welcome into
        # a gateway with momentum 0.9 took the lossless digits demo to 32%).
        self.push = "gradient"
        self._refetching = False  # downloading the newest model again, whatever its version
        self.flights = Flights(cache)  # the unanswered pushes (edge/flights.py moves their state)
        # With CURVE the routing id is unguessable (it travels encrypted): handover then only ever
        # moves this session's own connection.  Without, the client id keeps linksim's per-edge
        # fates reproducible.
        suffix = f".{secrets.token_hex(8)}" if options.curve is not None else ""
        self.routing_id = options.client_id.encode()[: 255 - len(suffix)] + suffix.encode()
        # Send time of the newest request answered since the last tick: on a FIFO link a weak
        # push sent before it, still unanswered, was lost rather than late.
        self._answer_covers = -math.inf
        self._probes_answered_upto = -math.inf  # heartbeats answered: see _handle and _ask_model
        self._last_probe = 0.0
        self._last_hello = -math.inf
        self._hello_quiet = False
        self._probe_s = min(options.heartbeat_s, options.timeout_s / 2)
        self._hello_backoff = Backoff(self._probe_s, max(self._probe_s, options.hello_cap_s))
        self._hello_wait_s = self._probe_s  # after the last hello, the next one if still unanswered
        # Lazy Pirate re-send interval for weak pushes, adapted by the acks' `attempt` echo.
        self._resend_min_s = options.timeout_s
        self._resend_max_s = options.heartbeat_s * options.liveness
        self.resend_s = options.timeout_s
        start = clock()
        self.started = start
        # The transport (common/transport): a DEALER to the gateway unless given (an in-process
        # pair in protocol tests); with faults, seen through a wrapper that injects them, which is
        # how tests and the demo make a loopback link lossy.
        if link is None:
            link = DealerLink(options.gateway, self.routing_id, self.limits, options.curve)
        if options.faults.active:
            link = FaultyLink(link, options.faults, clock)
        self.link = link
        # Opened, replaced when silent, probed (edge/connection.py).
        self.connection = Connection(
            link,
            options.gateway,
            options.heartbeat_s,
            options.liveness,
            Backoff(options.reconnect_first_s, options.reconnect_cap_s),
            self.metrics.reconnects,
            self.metrics.handshake_failures,
        )
        # Whether the link loses messages on a live connection (see the module docstring); known
        # from the start when the faults are injected here.
        self.loses_messages = link.loses_messages
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"edge-io-{options.client_id}", daemon=True)

        # Saves, and the gateway's commits (edge/durability.py).
        state = EdgeState(options.state_dir, options.client_id) if options.state_dir else None
        self.durability = Durability(
            cache, self.flights, manifest, state, options.persist_every_s, self.metrics, start
        )
        loaded = self.durability.load(self.seq, clock())
        if loaded is not None:
            self.seq = loaded.seq
            self._wanted.update(loaded.wanted)

    @property
    def state(self) -> EdgeState | None:
        """Where this edge's cache survives restarts (None: nowhere)."""
        return self.durability.state

    # ============================================================ training thread
    def start(self) -> None:
        self._thread.start()

    def request_sync(self, units: Sequence[int]) -> None:
        """Push these units' pending sums as soon as the protocol allows."""
        self.raise_if_failed()
        with self._lock:
            self._wanted.update(units)
            self._wake()

    def save_now(self, timeout_s: float = 10.0) -> bool:
        """Save the state now (from the I/O thread, which owns it); True once saved.

        For a planned shutdown or a test; saves otherwise happen on their own policy.
        """
        if not self.durability.saves:
            return False
        done = threading.Event()
        with self._lock:
            self._save_requests.append(done)
            self._wake()
        return done.wait(timeout_s)

    def refetch_model(self) -> None:
        """Download the newest model again even if it is the one this edge has (its copy diverged)."""
        with self._lock:
            self._refetch = True
            self._wake()

    def expect_adoption(self, steps: int) -> None:
        """Training adopts a model after `steps` more steps (0: at once); until a download started
        now would be needed by then, none starts.

        Why: an edge taking 8 local steps per model adopted 1 version in 9 it received (WAN run,
        10 Mbit/s: 267 patches, 25 adopted, 41 MB per edge); each unused one cost the downlink,
        the edge's CPU to apply and check, and the gateway's to build."""
        if steps < 0:
            raise ValueError(f"steps until adoption must be >= 0, got {steps}")
        with self._lock:
            was = self._adoption
            self._adoption = (steps, self.clock())
            if steps == 0 and (was is None or was[0] > 0):
                self._wake()

    def take_model(self) -> Model | None:
        """The newest model received since the last call, if any."""
        with self._lock:
            model, self._model = self._model, None
            return model

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self, drain_s: float = 0.0) -> bool:
        """Stop, first waiting up to `drain_s` for every cached gradient to be answered; True if all were."""
        deadline = self.clock() + drain_s
        with self._lock:
            self._wanted.update(range(len(self.cache.units)))
            self._wake()
        # Delivered, and (from a gateway that checkpoints) durable: without a state directory,
        # what is held when the agent exits is lost if the gateway then dies before its checkpoint.
        while (
            (self.cache.undelivered() or (self.commits and self.cache.held_steps()))
            and self.clock() < deadline
            and self._error is None
        ):
            time.sleep(0.01)
        delivered = self.cache.undelivered() == 0
        self._stop.set()
        self.link.wake()
        if self._thread.ident is not None:  # started: the I/O thread closes the link as it ends
            self._thread.join(timeout=5.0)
        else:
            self.connection.close()
        if self.durability.saves and not self._thread.is_alive():
            self._save(self.clock(), force=True)
            self.durability.close()
        elif self.cache.held_steps():
            log.warning(
                "%d acknowledged step-gradients are not durable yet and are not saved (no state "
                "directory): they are lost if the gateway dies before its next checkpoint",
                self.cache.held_steps(),
            )
        return delivered

    def _wake(self) -> None:
        self.link.wake()  # the I/O thread reads all of _wanted at its next tick

    # ================================================================= I/O thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                now = self.clock()
                if not self.connection.up:
                    self._connect(now)
                self.link.poll(max(0.0, self._next_wakeup(now) - now))
                now = self.clock()
                if self.connection.up_events(now):
                    self._say_hello(now)  # the one at connect was likely refused (not connected yet)
                self._receive(now)
                # The same instant: a push that an answer just let go was sent as the link fell
                # idle, so it joins the uplink's busy run (edge/pacing.py).  With a fresh clock an
                # edge whose model is one unit (one push in flight at a time) never formed a run,
                # its uplink was never measured, and `auto` kept int8 on any link.
                self._tick(now)
        except EdgeRefused as exc:
            self._error = exc
            log.error("%s", exc)
        except BaseException as exc:  # the training thread must learn that syncing stopped
            self._error = RuntimeError(f"edge I/O thread failed: {type(exc).__name__}: {exc}")
            log.exception("edge I/O thread failed")
        finally:
            self.connection.close()

    def _next_wakeup(self, now: float) -> float:
        times = [now + self.options.heartbeat_s]
        times.extend(self.durability.wake_times())
        if self.flights.waiting():
            times.append(self._last_probe + self._probe_s)
        if self.loses_messages:  # otherwise a weak push goes again on an answer, not a timer
            times.extend(max(t, self._link_ready_at) for t in self.flights.resend_times())
        times.extend(self.flights.deadlines())
        if self.connection.up and not self.welcomed:
            times.append(self._last_hello + self._hello_wait_s)
        if self._cap_ready_at > now:
            times.append(self._cap_ready_at)
        if self._link_ready_at > now:  # something waits for the uplink's backlog to drain
            times.append(self._link_ready_at)
        if self.download.active and self.loses_messages:
            times.append(now + self.resend_s)
        elif not self.download.active and self.announced > self.have_version:
            due = self._fetch_due_at()
            if due is not None:  # a model to fetch once it would otherwise arrive late
                times.append(max(now, due))
        return min(times)

    # ---------------------------------------------------------------- connection
    def _connect(self, now: float) -> None:
        self.connection.open(now)
        # Still welcomed after a reconnect: the gateway knows this routing id.  The hello
        # refreshes that; a restarted gateway answers pushes with not_welcomed instead.  With
        # CURVE it is likely refused (not connected yet): the link's UP event says it again.
        self._say_hello(now)

    def _reconnect(self, now: float) -> None:
        """The connection was silent too long (edge/connection.py): what was on it is lost."""
        silent = self.connection.silent_for(now)
        self._connection_replaced()  # whatever was outstanding is lost with the connection
        self._covers(now)  # what went out on the old socket is answered there or not at all
        self._uplink_fluid.clear()
        resumed = self.download.stats.resumed
        self.download.connection_lost()  # what has arrived stays; the rest is asked for anew
        self.metrics.download_resumes.inc(by=self.download.stats.resumed - resumed)
        self.uplink.connection_replaced()
        self.downlink.connection_replaced()
        log.info("no answer from %s for %.1f s: reconnecting", self.options.gateway, silent)
        self.connection.replace(now)
        self._say_hello(now)

    def _say_hello(self, now: float) -> None:
        hello = Hello(
            client_id=self.options.client_id,
            manifest=self.manifest,
            model_version=self.have_version,
            next_seq=self.seq,
            settings=dict(self.options.settings),
            holding=tuple(self.cache.holding()[:16]),
            resolved_below=self._resolved_below(),
        )
        self._last_hello, self._hello_quiet = now, self._quiet()
        # Over TCP a hello on a live connection arrives: no answer means a busy gateway, to be asked
        # less often.  Where messages are lost on a live connection (found out, or simulated), the
        # hello itself may be lost, and only asking again at the probe's pace gets a welcome through.
        lossy = self.loses_messages or self.options.faults.active
        self._hello_wait_s = self._probe_s if lossy else self._hello_backoff.next_delay()
        self._send(encode(hello), now)

    # ------------------------------------------------------------------- sending
    def _send(self, frames: list[Any], now: float, track: bool = False) -> Tracker | None:
        return self.connection.send(frames, now, track)

    def _push(self, u: int, flight: Flight, now: float) -> bool:
        unit = self.cache.units[u]
        payloads = flight.payloads or tuple(Dense(view) for view in unit.views(flight.buffer))
        layers = tuple(
            LayerGradient(name, payload, flight.count) for name, payload in zip(unit.names, payloads)
        )
        msg = Push(
            seq=flight.seq,
            base_version=flight.base_version,
            layers=layers,
            resolved_below=self._resolved_below(),
            attempt=flight.attempts,
            lr=self.cache.lr or 0.0,
        )
        result = self._send(encode(msg), now, track=True)
        self.upload_cap.take(flight.wire_bytes, now)
        self.metrics.pushes.inc()
        if result is not None:
            nbytes, first = self._queued.get(flight.seq, (0, now))
            self._queued[flight.seq] = (nbytes + flight.wire_bytes, first)
            self._queued_bytes += flight.wire_bytes
            self._uplink_fluid.add(flight.wire_bytes, now)
        for name, payload in zip(unit.names, payloads):
            self.metrics.sent_bytes.inc(name, by=payload_bytes(payload))
            self.metrics.staleness.observe(name, value=max(0, self.announced - flight.base_version))
        if result is None:
            return False
        flight.release = result
        return True

    def _time_steps(self, now: float) -> None:
        """The time a training step takes (a moving average), for `auto` and for when to fetch."""
        if not self.cache.units:
            return
        produced = self.cache.units[0].produced  # one step-gradient per step, in every unit
        if produced > self._steps_seen:
            if self._steps_seen_at is not None:
                interval = (now - self._steps_seen_at) / (produced - self._steps_seen)
                if self._step_s is not None:
                    # A pause (thermal, an evaluation, a checkpoint) is not a slow step: it would
                    # read as seconds per step, and fetches planned with it would come late.
                    interval = min(interval, 2.0 * self._step_s)
                self._step_s = interval if self._step_s is None else 0.8 * self._step_s + 0.2 * interval
            self._steps_seen, self._steps_seen_at = produced, now

    def _tune_compression(self, now: float) -> None:
        """Tell `auto` compression the measured uplink and the time a training step takes."""
        observe = getattr(self.cache.compression, "observe", None)
        if observe is None or not self.cache.units:
            return
        if self.uplink.measured and self._step_s is not None:
            was_probing = getattr(self.cache.compression, "probing", False)
            chosen = observe(self.uplink.rate, self._step_s, self._dense_bytes, now)
            if not was_probing and getattr(self.cache.compression, "probing", False):
                self.uplink.new_run(now)  # the probe's pushes are timed by themselves
            if chosen.spec != self._compression_rung:
                log.info(
                    "compression %s: uplink %.2f Mbit/s, a step every %.2f s",
                    chosen.spec,
                    self.uplink.rate * 8 / 1e6,
                    self._step_s,
                )
                self._compression_rung = chosen.spec

    def _schedule(self, now: float, answered_since: float) -> None:
        """The one scheduler of pushes, bound by credit and the link's room, oldest first: flights
        due (weak ones to re-send, taken ones waiting for their first send; see Flights.due), then
        new flights from the units training asked for.  The first that may not go yet stops it."""
        if not self.welcomed or self.durability.must_save:
            return  # (sums moved back to pending are not on disk yet, see edge/durability.py)
        self._time_steps(now)
        self._tune_compression(now)
        for u, flight in self.flights.due(now, answered_since, self.loses_messages):
            if not self._may_send(flight.wire_bytes, now):
                return
            self._send_flight(u, flight, now)
        with self._lock:
            wanted = sorted(self._wanted)
        for u in wanted:
            unit = self.cache.units[u]
            if unit.flight is not None:
                continue  # waits for the unanswered push of this unit
            if not self._may_send(self.cache.wire_bytes(u), now):
                return
            if self.seq - self._resolved_below() >= self.window:
                return
            flight = self._take(u, now)
            if flight is None:
                if not unit.pending_count:
                    with self._lock:
                        self._wanted.discard(u)
                continue  # (or its held sums wait for a commit: it stays wanted)
            if flight.state is FlightState.SAVE_FIRST:
                # It holds a sum the last save recorded as pending: it leaves after the next save.
                self.durability.save_before_sending()
                return
            self._send_flight(u, flight, now)

    def _take(self, u: int, now: float) -> Flight | None:
        """Unit `u`'s pending sum becomes a flight under the next seq (None: nothing to take)."""
        flight = self.cache.take(u, self.seq, now, self.options.timeout_s)
        if flight is None:
            return None
        self.seq += 1
        self.flights.add(u, flight)
        with self._lock:
            self._wanted.discard(u)
        return flight

    def _send_flight(self, u: int, flight: Flight, now: float) -> None:
        """Send a flight, for the first time or again (weak: same seq and bytes)."""
        again = flight.state is FlightState.WEAK
        self.flights.sent(flight, now, self._deadline(flight.wire_bytes, now), self.resend_s)
        if again:
            for name in self.cache.units[u].names:
                self.metrics.retransmits.inc(name)
        if self._push(u, flight, now):
            return
        if again:
            self.flights.sent_back(flight)  # refused by the link at once: it waits its timer
        else:
            self._miss(u, flight)

    def _take_for_save(self, now: float) -> int:
        """Pending sums become flights just before a save, so that the save records them as
        flights; returns the next seq, which the save records."""
        if not self.seq_known:
            return self.seq  # fresh seqs only once a welcome in this process said which are fresh
        for u, unit in enumerate(self.cache.units):
            if unit.flight is not None or not unit.pending_count:
                continue
            if self.seq - self._resolved_below() >= self.window:
                break
            self._take(u, now)
        return self.seq

    def _resolved_below(self) -> int:
        """The gateway may forget this edge's verdicts below it (edge/durability.py)."""
        return self.durability.resolved_below(self.seq)

    def _save(self, now: float, force: bool = False) -> bool:
        return self.durability.save(now, self.seq, self._take_for_save, force)

    def _may_send(self, nbytes: int, now: float) -> bool:
        """Credit, and room on the link: what is queued drains within the uplink's budget, and the cap."""
        if self.flights.outstanding >= self.credit:
            return False
        backlog = self._uplink_backlog(now)
        excess = backlog + nbytes - self.uplink.budget(nbytes)
        if backlog and excess > 0:
            # Wake when that much has drained, not at a resend time already past (a 1 ms spin).
            self._link_ready_at = now + max(MIN_WAIT_S, self.uplink.expected_s(excess))
            return False
        ready = self.upload_cap.ready_at(nbytes, now)
        if ready > now:
            self._cap_ready_at = ready
            return False
        return True

    def _uplink_backlog(self, now: float) -> int:
        """Bytes of pushes still on the uplink: unanswered, and not yet drained at the measured rate."""
        return min(self._queued_bytes, int(self._uplink_fluid.level(now)))

    def _deadline(self, nbytes: int, now: float) -> float:
        """When an answer is overdue: the per-layer deadline plus twice what the link needs for the
        bytes ahead of this push, the push, and the model chunks asked for before it, which its
        answer queues behind (a push slower than that is weak; one merely large is not)."""
        if not self.uplink.measured:  # a guess must not hide loss: the first slow push may go weak
            return now + self.options.timeout_s
        link_s = self.uplink.expected_s(self._uplink_backlog(now) + nbytes)
        if self.downlink.measured:
            link_s += self.downlink.expected_s(self.download.outstanding_bytes())
        return now + self.options.timeout_s + 2 * link_s

    def _miss(self, u: int, flight: Flight) -> None:
        """An outstanding flight went weak (its deadline passed, or its connection went)."""
        if self.loses_messages and flight.seq in self._queued:
            # A link that loses messages on a live connection: past its deadline it is presumed lost.
            self._queued_bytes -= self._queued.pop(flight.seq)[0]
        if self.flights.missed(flight, self.resend_s):
            for name in self.cache.units[u].names:
                self.metrics.weak.inc(name)

    def _connection_replaced(self) -> None:
        for u, flight in self.flights.connection_replaced(self.resend_s):
            for name in self.cache.units[u].names:
                self.metrics.weak.inc(name)
            if self.loses_messages and flight.seq in self._queued:
                self._queued_bytes -= self._queued.pop(flight.seq)[0]

    # ----------------------------------------------------------------- receiving
    def _receive(self, now: float) -> None:
        while (message := self.link.receive()) is not None:
            self._handle(message.frames, now)

    def _handle(self, frames: list[Any], now: float) -> None:
        try:
            msg = decode(frames, limits=self.limits, manifest=self.manifest)
        except ProtocolError as exc:
            log.warning("dropped a message from the gateway: %s", exc)
            return
        self.connection.heard(now)
        if isinstance(msg, Ack):
            self._on_ack(msg, now)
        elif isinstance(msg, Heartbeat):
            probe, quiet = self.connection.probe_answered(msg.nonce)
            if quiet:
                self._rtt_sample(now - probe)
            self._covers(probe)
            # A heartbeat is answered once, at once: unlike an ack (to which copy of a push?) it
            # says for sure that everything sent before it was answered or lost.
            self._probes_answered_upto = max(self._probes_answered_upto, probe)
            self._announce(msg.model_version)
            if not msg.gateway_id or msg.gateway_id == self.gateway_id:  # as in _on_ack
                self._settle(msg.verdicts, msg.gateway_id, now)
            self._commit(msg.gateway_id, msg.durable_epoch)
        elif isinstance(msg, Commit):
            self._commit(msg.gateway_id, msg.durable_epoch)
        elif isinstance(msg, Welcome):
            self._on_welcome(msg, now)
        elif isinstance(msg, ModelChunk):
            self._on_chunk(msg, now)
        elif isinstance(msg, Model):
            self._on_model(msg)
        elif isinstance(msg, Reject):
            self._on_reject(msg, now)
        else:
            log.warning("unexpected %s from the gateway, ignored", msg.TYPE)

    def _quiet(self) -> bool:
        """Nothing of ours is on the link either way: a small message sent now times the path.

        A heartbeat queued behind model chunks is no measure of the path: on a 5 Mbit/s link
        busy with patches every round trip read 56 ms on a 2 ms path, and subtracting that from
        each patch's time read the link as 7.3 Mbit/s.
        """
        return not self._queued and not self.download.outstanding_bytes()

    def _rtt_sample(self, seconds: float) -> None:
        """A small message's round trip on a quiet link: the path's latency (no measure of its
        rate), which a lone answer's time holds besides its bytes (edge/pacing.py)."""
        if math.isfinite(seconds):
            self.uplink.observe_rtt(seconds)
            self.downlink.observe_rtt(seconds)

    def _on_welcome(self, msg: Welcome, now: float) -> None:
        if self._hello_quiet:
            self._rtt_sample(now - self._last_hello)
        if msg.manifest_digest != self.manifest.digest:
            raise EdgeRefused("the gateway welcomed a different model (manifest digest differs)")
        # Hellos are repeated until answered, so welcomes may come in several; only one from a
        # gateway instance we have not seen changes anything beyond the settings.
        new_instance = msg.gateway_id != self.gateway_id
        restarted = new_instance and bool(self.gateway_id)
        self.gateway_id = msg.gateway_id
        self.welcomed = True
        self._hello_backoff.reset()
        self.credit = _int_setting(msg.settings, "credit", 8)
        self.window = _int_setting(msg.settings, "window", 1024)
        self.commits = msg.settings.get("commits") is True
        push = msg.settings.get("push", "gradient")  # a gateway that does not say: raw gradients
        if push not in ("step", "gradient"):
            log.warning("ignored push=%r from the gateway (not 'step' or 'gradient'): gradients it is", push)
            push = "gradient"
        self.push = push
        accepted = msg.settings.get("encodings", "dense")  # a gateway that does not say: dense only
        compression = self.cache.compression
        if compression is not None and isinstance(accepted, str):
            missing = sorted(compression.encodings - set(accepted.split(",")))
            if missing:
                raise EdgeRefused(
                    f"the gateway does not accept {', '.join(missing)} payloads, which compression "
                    f"{compression.spec} sends (it accepts {accepted}): run with another --compression, "
                    "or add the encodings to the gateway's"
                )
        # Above everything the gateway judged from this client id: after a restart that lost
        # this edge's newest state, a reused seq would be taken for a duplicate.
        if msg.next_seq > UINT_MAX // 2:
            log.warning("ignored next_seq %d from the gateway: not a plausible sequence number", msg.next_seq)
        else:
            self.seq = max(self.seq, msg.next_seq)
        if new_instance:
            # A simulated link still holds messages of the connection to the old instance: as over
            # TCP, none of them may arrive now (an old instance's ack, an old copy of a push).
            self.link.drop_in_flight()
        if not self.seq_known:
            self.seq_known = True
            self._save(now, force=True)  # pending sums get their seqs before any is sent
        self._on_durable_list(msg, now)
        if new_instance:
            self._covers(now)  # reloaded flights (edge/persistence.py) go again now
        if restarted:
            log.info("gateway %s is a new instance: re-sending every unanswered push", msg.gateway_id)
            self._covers(now)  # it holds nothing we sent its predecessor
            self._connection_replaced()
        if restarted:
            # Its public model is its own: what this edge holds is no base for its patches.  (The
            # first instance's may be: the seed model the edge built is its first version.)
            self.download.forget_public()
        if new_instance and msg.model_version != self.have_version:
            # A restarted gateway may be behind us: its model is the one that counts.
            self.announced = msg.model_version
            self.download.start(msg.model_version)  # whatever a predecessor half-sent is void
            self._ask_model(now)
        else:
            self._announce(msg.model_version)

    def _on_ack(self, msg: Ack, now: float) -> None:
        if msg.gateway_id and msg.gateway_id != self.gateway_id:
            # From an instance that did not welcome this edge (a new one, typically refusing with
            # not_welcomed; or a dead one's late answer): its verdict cannot tag held sums.  The
            # push stays unanswered and goes again once the instance that answers has welcomed us.
            self._commit(msg.gateway_id, msg.durable_epoch)
            if self.welcomed:
                self.welcomed = False
                self._say_hello(now)
            return
        self.credit = msg.credit
        self._announce(msg.model_version)
        flight = self.flights.flight(msg.seq)
        if flight is not None:
            queued = self._queued.get(msg.seq)
            if queued is not None and msg.attempt == flight.attempts:
                self.uplink.answered(flight.wire_bytes, queued[1], now)
            self._covers(flight.last_sent)
            if flight.attempts and msg.code != Reason.NOT_WELCOMED.value:
                self._adapt_resend(msg.attempt, msg.code == Reason.DUPLICATE.value)
            self._verdict(msg.seq, msg.accepted, msg.code, msg.detail, now, msg.gateway_id, msg.epoch)
        self._settle(msg.verdicts, msg.gateway_id, now)
        self._commit(msg.gateway_id, msg.durable_epoch)

    # ---------------------------------------------------------------- durability
    def _commit(self, instance: str, durable_epoch: int) -> None:
        """`instance` has written checkpoint `durable_epoch`: a unit that waited on its held sums
        may send again."""
        self._want_again(self.durability.commit(instance, durable_epoch))

    def _on_durable_list(self, msg: Welcome, now: float) -> None:
        """The welcome's answer about held instances: durable through a version, or lost."""
        released, moved = self.durability.lost(msg.durable, alive=msg.gateway_id)
        self._want_again(released)
        if any(moved):
            self._want_again(moved)
            # Before anything is sent: a reload must not find those sums held *and* in pending.
            self._save(now, force=True)

    def _want_again(self, per_unit: Sequence[int]) -> None:
        with self._lock:
            self._wanted.update(u for u, n in enumerate(per_unit) if n and self.cache.units[u].pending_count)

    def _covers(self, sent_at: float) -> None:
        """An answer to a request sent at `sent_at` came: on a FIFO link, whatever was sent before
        and is still unanswered was lost (weak pushes go again, see Flights.due), and no longer
        queued on the connection."""
        self._answer_covers = max(self._answer_covers, sent_at)
        if self._queued and sent_at > -math.inf:
            for seq, (nbytes, at) in list(self._queued.items()):
                if at <= sent_at:
                    del self._queued[seq]
                    self._queued_bytes -= nbytes

    def _adapt_resend(self, applied_attempt: int, duplicate: bool) -> None:
        """A re-sent push was judged: was the applied copy a re-send (the link loses) or the original?

        `duplicate`: this answer is to a later copy; the original was applied but, on a FIFO link,
        its own answer was lost, so the re-send was what got the verdict through (the link loses).
        Counted as waste (21% of pushes at 30% loss each way), it doubled the interval: `cloud
        serve`'s defaults with 2 digits edges at 30% loss, 3 runs each, mean sync latency 0.58-0.88
        s before, 0.44-0.64 s after.
        """
        if applied_attempt == 0 and not duplicate:  # the original was only late: re-sends were waste
            self.resend_s = min(self._resend_max_s, self.resend_s * 2)
        else:  # the original, on this same connection, never arrived
            if not self.loses_messages:
                log.info("this link loses messages on a live connection: re-sending weak pushes on a timer")
            self.loses_messages = True
            self.resend_s = max(self._resend_min_s, self.resend_s / 2)

    def _settle(self, verdicts: Sequence[tuple[int, str, int]], instance: str, now: float) -> None:
        """Verdicts repeated by the gateway (a cumulative ack): settle the pushes still waiting."""
        for seq, code, epoch in verdicts:
            if seq in self.flights:
                self._verdict(seq, not code, code, "", now, instance, epoch)

    def _verdict(
        self, seq: int, accepted: bool, code: str, detail: str, now: float, instance: str = "", epoch: int = 0
    ) -> None:
        unanswered = self.flights.flight(seq)
        if unanswered is None:
            return  # an answer to a push already answered (a duplicate or late ack)
        if not accepted and code in (Reason.WINDOW.value, Reason.NOT_WELCOMED.value):
            # Not judged: keep it and send again later (to a new gateway, the copies it refused
            # do not count).
            self.flights.sent_back(unanswered, forget_attempts=code == Reason.NOT_WELCOMED.value)
            if code == Reason.NOT_WELCOMED.value:
                self.welcomed = False
                self._say_hello(now)
            return
        u = self.flights.answered(seq)
        assert u is not None
        # Applied by a gateway that checkpoints: held until its checkpoint of `epoch` is on disk.
        hold = self.durability.hold(instance, epoch) if accepted else None
        durable = accepted and hold is None and bool(epoch)  # that checkpoint is on disk already
        flight = self.cache.resolve(u, hold, durable)
        if flight is None:
            return
        if not accepted:
            self.cache.dropped(u, flight)
        elif durable:
            for name in self.cache.units[u].names:
                self.metrics.durable.inc(name, by=flight.count)
        names = self.cache.units[u].names
        for name in names:
            self.metrics.latency.observe(name, value=now - flight.first_sent)
            if accepted:
                self.metrics.delivered.inc(name, by=flight.count)
                (self.metrics.late if flight.missed else self.metrics.strong).inc(name)
            elif code == Reason.STALE.value:
                self.metrics.dropped_stale.inc(name, by=flight.count)
        if not accepted:
            self.metrics.rejected.inc(code or "unknown")
            if code != Reason.STALE.value:
                log.error("gateway refused push %d (%s): %s", seq, code, detail)

    def _on_reject(self, msg: Reject, now: float) -> None:
        if msg.code in _FATAL_REJECTS:
            raise EdgeRefused(f"{_FATAL_REJECTS[msg.code]}: {msg.detail}")
        if msg.code == Reason.NOT_WELCOMED.value:
            self.welcomed = False
            self._say_hello(now)
            return
        self.metrics.rejected.inc(msg.code)
        if msg.code == Reason.RATE_LIMITED.value:  # the push stays cached and goes again later
            log.debug("gateway rate-limited this edge: %s", msg.detail)
            return
        log.error("gateway rejected a message (%s): %s", msg.code, msg.detail)

    # -------------------------------------------------------------------- models
    def _announce(self, version: int) -> None:
        if version > self.announced:
            self.announced = version

    def _ask_model(self, now: float) -> None:
        """Ask for the next slices of the model being downloaded, as far as the downlink drains them."""
        if not self.welcomed or not self.connection.up:
            return
        with self._lock:
            refetch, self._refetch = self._refetch, False
        if refetch:
            self._refetching = True
        if not self.download.active:
            if self.announced <= self.have_version and not self._refetching:
                return
            if not self._refetching and not self._adoption_near(now):
                return
            self.download.start(self.announced, whole=self._refetching)
        # Asked for now, answered once the request got past what is queued on the uplink: enough
        # to keep the downlink busy until the next chance to ask (see the order in _tick), twice
        # over.  The rate is measured from these very requests, whose wait on the uplink it
        # cannot tell from time on the downlink: a window of exactly (1 + wait) x rate settles
        # at a fraction of the link (measured: 2.2 of 5 Mbit/s); twice that at three quarters
        # or more.  Acks queue behind it, which deadlines and the uplink's backlog allow for.
        # (Only once the uplink is measured: its first guess is deliberately slow.)
        uplink_full = max(self._uplink_backlog(now), self.uplink.budget(self._largest_unit))
        ahead_s = min(8.0, self.uplink.expected_s(uplink_full)) if self.uplink.measured else 0.0
        budget = int(self.downlink.budget(self.download.chunk_bytes) * 2 * (1.0 + ahead_s))
        # Over TCP a request is answered unless the connection goes (then all are asked anew) or
        # the gateway cannot send the answer (its queue to this edge full, a refusal): found by
        # answers to later messages, a heartbeat's or a later chunk's (`lost_before`, and the
        # download's own `answered_upto`), after `resend_s` (a link that reorders a little); a link
        # that loses messages on a live connection also needs a timer: twice what a request can
        # wait for, which is the uplink's backlog ahead of it, then at most what is outstanding
        # (a part of what is missing) ahead of its answer.  Not the window: a whole model is
        # often far smaller (a 105 KB model waited 8 s to be asked again after a loss).
        reask = math.inf
        if self.loses_messages:
            queued = min(budget, self.download.missing_bytes())
            waits = self.uplink.expected_s(self._uplink_backlog(now)) if self.uplink.measured else 0.0
            reask = max(self.resend_s, 2 * (waits + self.downlink.expected_s(queued)))
            if not self.downlink.measured:
                # The guess (1 Mbit/s) may be far too slow for this link (a 105 KB model: asked
                # again every 1.7 s at 30% loss).  Until a chunk has measured it, one chunk is a
                # probe, asked again on the push timer, doubling each time up to the guess's.
                # Each download starts from the push timer: patches (a few KB) never measure the
                # link, and a count over all downloads had them asked again every 3.2 s after 15
                # losses (1 model in 6 versions at 30% loss, found in CI).
                budget = self.download.chunk_bytes
                reask = min(reask, self.resend_s * 2.0 ** min(self.download.reasked, 20))
        # A patch from the model held (its version and digest), or the whole model (digest 0).
        base, base_digest = self.download.base, self.download.base_digest
        took = self.download.last_fetch_s
        fetch_ms = 0 if took is None else max(1, round(took * 1000))
        requests = self.download.requests(budget, now, reask, self._probes_answered_upto, self.resend_s)
        for k, (version, offset, length) in enumerate(requests):
            fetch = ModelFetch(
                version=version,
                offset=offset,
                length=length,
                base=base,
                fetch_ms=fetch_ms,
                base_digest=base_digest,
            )
            if self._send(encode(fetch), now) is None:
                # Refused at once (a replaced connection not up yet, with ZMQ_IMMEDIATE): over TCP
                # nothing would ask again, and the download would wait for them forever.
                for _version, unsent, _length in requests[k:]:
                    self.download.unasked(unsent)
                break

    def _adoption_near(self, now: float) -> bool:
        """Whether a download started now is needed before training adopts: it would take about
        as long as the last one (twice that, for a patch spanning more versions and for a slower
        link) and training adopts after the steps it said, at the measured time per step."""
        due = self._fetch_due_at()
        return due is None or now >= due

    def _fetch_due_at(self) -> float | None:
        """When a download must start to arrive before training adopts (None: at once, nothing
        to plan with)."""
        with self._lock:
            adoption = self._adoption
        took = self.download.last_fetch_s
        if adoption is None or self._step_s is None or took is None:
            return None
        steps, said_at = adoption
        return said_at + steps * self._step_s - 2.0 * took - self._step_s

    def _on_chunk(self, msg: ModelChunk, now: float) -> None:
        restarts = self.download.stats.restarts + self.download.stats.corrupt
        model, asked = self.download.on_chunk(msg, now)
        if asked is not None:
            if asked.timed_from is not None:
                self.downlink.answered(len(msg.data), asked.timed_from, now)
            self._covers(asked.first)  # the answer may be to the first ask: nothing later is lost
            self.metrics.model_bytes.inc(by=len(msg.data))
        if self.download.stats.restarts + self.download.stats.corrupt > restarts:
            self.metrics.download_restarts.inc()
        self._announce(msg.version)
        if model is not None:
            self._on_model(model)
        self._ask_model(now)

    def _on_model(self, msg: Model) -> None:
        if not msg.full:
            log.warning("partial model %d ignored: this edge asks for whole models", msg.version)
            return
        if msg.version == self.have_version and self._model is None and not self._refetching:
            return
        self._refetching = False
        self.metrics.models.inc()
        with self._lock:
            self._model = msg
            self.have_version = msg.version
        self.announced = max(self.announced, msg.version)

    # ---------------------------------------------------------------------- timers
    def _tick(self, now: float) -> None:
        with self._lock:
            requests, self._save_requests = self._save_requests, []
        if requests and self._save(now, force=True):
            for done in requests:
                done.set()
        self.durability.tick(now, self.seq, self.window, self._take_for_save)
        if not self.connection.up:
            return
        for u, flight in self.flights.overdue(now):
            self._miss(u, flight)
        covers, self._answer_covers = self._answer_covers, -math.inf
        # Model requests first: they are small, and would otherwise wait behind the pushes below.
        self._ask_model(now)
        self._schedule(now, answered_since=covers)
        if self.connection.dead(now, self._queued_s()):
            self._reconnect(now)
        elif self.welcomed and self.flights.waiting() and now - self._last_probe >= self._probe_s:
            # Weak pushes wait for the link to answer: ask it, more often than an idle heartbeat.
            self._last_probe = now
            self.connection.probe(now, self._resolved_below())  # pushes are waiting: not quiet
        elif not self.welcomed:
            if now - self._last_hello >= self._hello_wait_s:  # Lazy Pirate: ask again until answered
                self._say_hello(now)
        elif self.connection.idle(now):
            self.connection.probe(now, self._resolved_below(), quiet=self._quiet())

    def _queued_s(self) -> float:
        """What the link needs to carry what is queued on it each way: an answer waits behind it."""
        return self.uplink.expected_s(self._queued_bytes) + self.downlink.expected_s(
            self.download.outstanding_bytes()
        )

    # ---------------------------------------------------------------------- state
    def status(self) -> dict[str, object]:
        """Counters for summaries and tests (JSON-able)."""
        out: dict[str, object] = {
            "client_id": self.options.client_id,
            "welcomed": self.welcomed,
            "link_t": round(self.clock() - self.started, 3),
            "model_version": self.have_version,
            "undelivered_steps": self.cache.undelivered(),
            "held_steps": self.cache.held_steps(),
            "cache_bytes": self.cache.host_bytes(),
            "cache_bound_bytes": self.cache.bound_bytes(),
            "uplink_mbit": round(self.uplink.rate * 8 / 1e6, 3) if self.uplink.measured else None,
            "downlink_mbit": round(self.downlink.rate * 8 / 1e6, 3) if self.downlink.measured else None,
            "download": dict(self.download.stats.__dict__),
            "metrics": self.metrics.registry.snapshot(),
        }
        out.update(self.link.stats())
        return out


def _int_setting(settings: dict[str, object], key: str, default: int) -> int:
    value = settings.get(key, default)
    return value if type(value) is int and value > 0 else default
