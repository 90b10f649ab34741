"""`elasticfed edge`: train a task on this device's data and sync with the gateway.

Prints JSON status lines while training (with `--status-every-s`) and a JSON
summary as the last line: steps, step-gradients produced and delivered per
layer, what is still undelivered, link and sync counters.  SIGTERM or SIGINT
ends training early; cached gradients are then delivered for up to `--drain-s`
seconds before the agent exits.

With `--metrics-bind` the agent serves Prometheus metrics (sync latency per
layer, strong/weak syncs, retransmissions, staleness, bytes, cache, thermal
pauses); with `--thermal-pause-above-c` it pauses local training while the
device is hot, and its link keeps delivering what is cached meanwhile.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from elasticfed.common.checkpoint import CheckpointError
from elasticfed.common.exits import EXIT_REFUSED, fail
from elasticfed.common.keys import KeyFileError, KeyPair, read_key_file
from elasticfed.common.link import Faults
from elasticfed.common.logs import configure_logging
from elasticfed.common.metrics_http import ExtraGauge, MetricsServer, serve_metrics
from elasticfed.common.progress import ProgressBar
from elasticfed.common.task import TaskError, load_task, shard
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.config import EdgeConfig, contradictions
from elasticfed.edge.persistence import MASS_AUDIT_FILE, write_mass_audit
from elasticfed.edge.session import EdgeRefused, SessionOptions
from elasticfed.edge.thermal import NoThermalZones, ThermalGuard

log = logging.getLogger("elasticfed.edge")


def training_device(spec: str) -> torch.device:
    """The device `--train-device` names; a GPU asked for and not there is an error, not the CPU."""
    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{spec}: torch sees no CUDA device here (a CPU-only build, or no driver)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{spec}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def load_curve(config: EdgeConfig) -> tuple[KeyPair, bytes] | None:
    """This device's key pair and the gateway's public key, or None with --insecure.

    Raises KeyFileError (naming the file) for a missing, unreadable or too open key file.
    """
    sec = config.security
    if sec.insecure:
        return None
    if not sec.device_secret_key or not sec.gateway_public_key:
        raise KeyFileError(
            "CURVE is on by default: pass --security-device-secret-key and "
            "--security-gateway-public-key (made with `elasticfed keys generate` and `keys init`), "
            "or --insecure to run without encryption and authentication"
        )
    device = read_key_file(sec.device_secret_key, need_secret=True)
    gateway = read_key_file(sec.gateway_public_key).public
    return device, gateway


def session_options(
    config: EdgeConfig, client_id: str, curve: tuple[KeyPair, bytes] | None = None
) -> SessionOptions:
    return SessionOptions(
        gateway=config.gateway,
        client_id=client_id,
        timeout_s=config.timeout_ms / 1000.0,
        heartbeat_s=config.heartbeat_ms / 1000.0,
        faults=Faults.parse(config.faults),
        settings={"sync_every": config.sync_every, "timeout_ms": config.timeout_ms},
        curve=curve,
        state_dir=config.state_dir,
        persist_every_s=config.persist_every_s,
        upload_mbit=config.upload_mbit,
    )


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, default=str), flush=True)


def _compression_now(agent: ElasticEdge) -> str:
    """The spec, and for `auto` the rung it is on (e.g. `auto:int8`)."""
    compression = agent.cache.compression
    if compression is None:
        return "none"
    current = getattr(compression, "current", None)
    return compression.spec if current is None else f"{compression.spec}:{current.spec}"


def _totals(status: dict[str, Any]) -> dict[str, Any]:
    metrics = status["metrics"]
    out = {name: sum(rows.values()) for name, rows in metrics.items() if name.endswith("_total")}
    latency = [row for row in metrics.get("edge_sync_latency_seconds", {}).values()]
    if latency:
        count = sum(r["count"] for r in latency)
        out["sync_latency_mean_s"] = sum(r["mean"] * r["count"] for r in latency) / count if count else 0.0
        out["sync_latency_max_s"] = max(r["max"] for r in latency)
    return out


def _by_layer(rows: dict[str, Any]) -> dict[str, Any]:
    return {key.partition("=")[2]: value for key, value in rows.items()}


def thermal_guard(config: EdgeConfig) -> ThermalGuard | None:
    """The `[thermal]` table's guard, or None when it is off; raises ValueError/NoThermalZones."""
    t = config.thermal
    if not t.pause_above_c:
        return None
    resume = t.resume_below_c or t.pause_above_c - 5.0
    return ThermalGuard(t.pause_above_c, resume, zones=t.zones, poll_s=t.poll_s)


def thermal_gauges(guard: ThermalGuard | None) -> list[ExtraGauge]:
    """Scrape-time gauges that read the guard's last decision (a scrape never re-reads sensors)."""
    if guard is None:
        return []

    def hottest() -> float | None:
        found = guard.state()[1]
        return found[1] if found is not None else None

    return [
        ("edge_thermal_hottest_celsius", "temperature of the hottest thermal zone", hottest),
        ("edge_thermal_paused", "1 while local training is paused because the device is hot",
         lambda: float(guard.state()[0])),
        ("edge_thermal_pauses", "times training paused for heat", lambda: float(guard.pauses_total)),
        ("edge_thermal_paused_seconds", "seconds training spent paused for heat, the current pause included",
         lambda: guard.state()[2]),
    ]  # fmt: skip


def run(args: argparse.Namespace, config: EdgeConfig) -> int:
    # First: a stop asked for while the agent loads its data or meets the gateway ends it
    # cleanly, with a summary and its cache saved, instead of killing it.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    configure_logging(config.log_level, config.log_format, role="edge")
    problem = contradictions(config)
    if problem is not None:
        return fail("edge", problem)
    try:
        curve = load_curve(config)
    except KeyFileError as exc:
        return fail("edge", f"{exc}")
    # With CURVE the gateway knows this device by the name its key was enrolled under; the key
    # file's own name is the usual choice.
    client_id = config.client_id or (curve[0].name if curve and curve[0].name else socket.gethostname())
    if curve is None:
        log.warning("--insecure: this agent's link to %s is NOT encrypted or authenticated", config.gateway)
    try:
        task = load_task(config.task)
    except TaskError as exc:
        return fail("edge", f"{exc}")
    try:
        guard = thermal_guard(config)
    except (ValueError, NoThermalZones) as exc:
        return fail("edge", f"--thermal-*: {exc}")
    try:
        device = training_device(config.train.device)
    except ValueError as exc:
        return fail("edge", f"--train-device: {exc}")
    torch.manual_seed(config.train.seed)
    model = task.build_model().to(device)
    try:
        data = task.train_set()
        if config.train.shard:
            index, parts = (int(v) for v in config.train.shard.split("/"))
            try:
                data = shard(data, index, parts, config.train.partition, seed=config.train.seed)
            except ValueError as exc:  # a partition this task's data cannot take
                raise TaskError(f"--train-partition {config.train.partition}: {exc}") from exc
    except TaskError as exc:
        return fail("edge", f"{exc}")
    loader = DataLoader(
        data,
        batch_size=config.train.batch_size or task.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(config.train.seed + 17),
    )
    try:
        agent = ElasticEdge(
            model,
            session_options(config, client_id, curve),
            sync_every=config.sync_every,
            local_steps=config.train.local_steps,
            pack_cap_bytes=config.pack_cap_kib * 1024,
            compression=config.compression,
            audit=config.audit_mass,
            proximal_mu=config.train.prox_mu,
            drift_horizon=config.train.drift_horizon,
            scaffold=config.train.scaffold,
        )
    except (OSError, CheckpointError) as exc:
        return fail("edge", f"--state-dir {config.state_dir}: {exc}")
    metrics: MetricsServer | None = None
    if config.metrics_bind:
        try:
            metrics = serve_metrics(
                config.metrics_bind,
                agent.session.metrics.registry,
                extra=thermal_gauges(guard),
                process_metrics=True,
            )
        except OSError as exc:
            agent.close(drain_s=0)
            return fail("edge", f"--metrics-bind {config.metrics_bind}: {exc}")
    try:
        return _train(config, client_id, task, loader, agent, guard, metrics, stop, device)
    finally:
        if metrics is not None:
            metrics.close()


def _train(
    config: EdgeConfig,
    client_id: str,
    task: Any,
    loader: DataLoader,
    agent: ElasticEdge,
    guard: ThermalGuard | None,
    metrics: MetricsServer | None,
    stop: threading.Event,
    device: torch.device,
) -> int:
    state = agent.session.state
    begin = agent.status()
    _emit(
        "start",
        client=client_id,
        device=str(device),
        resumed_from=str(state.loaded) if state is not None and state.loaded else None,
        skipped_states=[f"{p}: {why}" for p, why in state.skipped] if state is not None else [],
        produced_steps=begin["produced_steps"],
        durable_steps=begin["durable_by_layer"],
        undelivered_steps=begin["undelivered_steps"],
        held_steps=begin["held_steps"],
        metrics_url=metrics.url if metrics is not None else None,
    )
    optimizer = torch.optim.SGD(agent.parameters(), lr=config.train.lr or task.lr, momentum=task.momentum)
    agent.follow(optimizer)  # its steps where the gateway adds no momentum, else raw gradients
    # Start from the gateway's model when it answers soon; train from our own seed otherwise.
    ready = agent.wait_ready(timeout_s=max(2.0, 4 * config.timeout_ms / 1000.0), stop=stop)
    if not ready and not stop.is_set():
        log.warning("no answer from the gateway at %s yet: training from the local model", config.gateway)

    started = time.monotonic()
    last_status = started - config.status_every_s  # the first status right after the first step
    loss = torch.tensor(0.0)
    bar = ProgressBar(config.train.max_steps or config.train.epochs * len(loader), "edge")
    try:
        for _ in range(config.train.epochs):
            for x, y in loader:
                if stop.is_set():  # asked before the first step: train nothing
                    break
                if guard is not None and guard.hot():
                    paused = guard.wait_until_cool(stop)
                    log.info("thermal: training paused %.1f s while the device was hot", paused)
                    if stop.is_set():
                        break
                if device.type != "cpu":
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = task.loss(agent(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                bar.update(agent.steps, loss=loss.detach(), version=agent.version)
                now = time.monotonic()
                if (
                    stop.is_set()
                    or (config.train.max_steps and agent.steps >= config.train.max_steps)
                    or (config.train.duration_s and now - started >= config.train.duration_s)
                ):
                    break
                if config.status_every_s and now - last_status >= config.status_every_s:
                    last_status = now
                    status = agent.status()
                    _emit(
                        "status",
                        client=client_id,
                        t=round(now - started, 3),
                        link_t=status["link_t"],
                        steps=agent.steps,
                        # step-gradients of the least advanced unit over the saved history
                        produced=min(unit.produced for unit in agent.cache.units),
                        loss=float(loss.detach()),
                        version=agent.version,
                        undelivered_steps=status["undelivered_steps"],
                        held_steps=status["held_steps"],
                        cache_bytes=status["cache_bytes"],
                        models_adopted=status["models_adopted"],
                        nonfinite_steps=status["nonfinite_steps"],
                        compression=_compression_now(agent),
                        uplink_mbit=status["uplink_mbit"],
                        downlink_mbit=status["downlink_mbit"],
                        **_totals(status),
                    )
            else:
                continue
            break
    except EdgeRefused as exc:
        print(f"elasticfed edge: {exc}", file=sys.stderr)
        agent.close()
        return EXIT_REFUSED
    bar.close()
    trained = time.monotonic() - started
    delivered_all = agent.close(drain_s=config.drain_s)
    status = agent.status()
    if config.audit_mass:
        try:
            write_mass_audit(agent.cache, Path(config.state_dir) / MASS_AUDIT_FILE)
        except OSError as exc:
            log.error("could not write the mass audit to --state-dir %s: %s", config.state_dir, exc)
    _emit(
        "summary",
        client=client_id,
        steps=agent.steps,
        seconds=round(trained, 3),
        loss=float(loss.detach()),
        delivered_all=delivered_all,
        undelivered_steps=status["undelivered_steps"],
        produced_steps=status["produced_steps"],
        durable_steps=status["durable_by_layer"],
        dropped_steps=status["dropped_by_layer"],
        held_steps=status["held_steps"],
        undelivered_by_layer=status["undelivered_by_layer"],
        delivered_steps=_by_layer(status["metrics"]["edge_delivered_steps_total"]),
        dropped_stale_steps=_by_layer(status["metrics"]["edge_dropped_stale_steps_total"]),
        cache_bytes=status["cache_bytes"],
        cache_bound_bytes=status["cache_bound_bytes"],
        uplink_mbit=status["uplink_mbit"],
        downlink_mbit=status["downlink_mbit"],
        download=status["download"],
        nonfinite_steps=status["nonfinite_steps"],
        link_up=status.get("link_up"),
        link_down=status.get("link_down"),
        models_adopted=agent.models_adopted,
        units=len(agent.cache.units),
        compression=_compression_now(agent),
        model_held=agent.session.download.held(),
        **_totals(status),
    )
    return 0 if delivered_all else 5
