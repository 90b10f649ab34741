"""`elasticfed cloud serve`: the edge gateway, alone (standalone) or inside cloud rank 0 (hybrid).

Standalone (pure federated): builds the task's model (seeded, so edges that
start from the same seed agree before the first model arrives), serves edges
until SIGTERM/SIGINT or `--gateway-max-rounds`, logs one line per round, and
prints a JSON summary (version, rounds, the task's test figure, counters) as its last
line.

Hybrid (`torchrun ... -m elasticfed.cloud serve --mode hybrid`): every rank trains on the
cloud's data with layer-wise sync, and rank 0 hosts the gateway, whose rounds
enter the cloud steps (cloud/hybrid.py).  Rank 0 prints the summary, with every
rank's SHA-256 of its final parameters.

Either way the first line on stdout is a JSON `ready` event with the bound
endpoint, for supervisors and tests that bind to port 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticfed.cloud.admission import CurveAdmission
from elasticfed.cloud.aggregation import (
    Buffered,
    CosineDecay,
    DeadlineQuorum,
    MeanStep,
    Weighting,
    aggregation_named,
)
from elasticfed.cloud.collectives import CollectiveError
from elasticfed.cloud.config import CloudConfig, contradictions
from elasticfed.cloud.durability import Durability, GatewayCheckpoints
from elasticfed.cloud.ema import ModelEma
from elasticfed.cloud.gateway import Gateway, GatewayDiverged, GatewayOptions, ModelUpdate, RoundSummary
from elasticfed.cloud.hybrid import EdgeMixing, EdgeRounds
from elasticfed.cloud.hybrid_checkpoints import HybridCheckpoints
from elasticfed.cloud.layerwise import DivergenceError
from elasticfed.cloud.server_optimizers import default_lr, server_optimizer
from elasticfed.cloud.train import (
    EXIT_SYNC_FAILED,
    configure_worker_logging,
    join_process_group,
    pick_backend,
    train,
)
from elasticfed.cloud.watch import LossWatch
from elasticfed.common.checkpoint import CheckpointError
from elasticfed.common.exits import EXIT_DIVERGED, EXIT_FAILED, fail
from elasticfed.common.gradient_hooks import trainable_parameters
from elasticfed.common.keys import KeyFileError
from elasticfed.common.logs import configure_logging
from elasticfed.common.metrics import Metrics
from elasticfed.common.metrics_http import ExtraGauge, MetricsServer, serve_metrics
from elasticfed.common.task import Task, TaskError, load_task, shard
from elasticfed.common.transport import Link

log = logging.getLogger("elasticfed.gateway")

GATEWAY_JOIN_S = 30.0  # a gateway thread told to stop answers within its poll interval


def load_admission(config: CloudConfig) -> CurveAdmission | None:
    """CURVE from the `[security]` table, or None with --insecure; raises KeyFileError naming the file."""
    sec = config.security
    if sec.insecure:
        return None
    if not sec.keys_dir:
        raise KeyFileError(
            "CURVE is on by default: pass --security-keys-dir DIR (create it with `elasticfed keys init "
            "--keys-dir DIR` and enrol devices with `elasticfed keys enrol`), or --insecure to accept "
            "edges without encryption and authentication"
        )
    return CurveAdmission.from_folder(sec.keys_dir)


def evaluate_averaged(task: Task, gateway: Gateway, test_set: Any) -> float:
    """The task's figure for the model the gateway reports (its average, cloud/ema.py)."""
    model = task.build_model()
    model.load_state_dict(gateway.model.state_dict())  # buffers, and parameters the average lacks
    model.load_state_dict(gateway.averaged(), strict=False)
    return task.evaluate(model, test_set)


def build_gateway(
    config: CloudConfig,
    task: Task,
    on_round: Callable[[RoundSummary], None] | None = None,
    admission: CurveAdmission | None = None,
    checkpoints: Durability | None = None,
    model: torch.nn.Module | None = None,
    update: ModelUpdate | None = None,
    link: Link | None = None,
) -> Gateway:
    """The gateway the `[gateway]` table describes, around the task's model (or `model`, hybrid);
    it listens on a ZeroMQ ROUTER at `bind` unless given another `link` (common/transport)."""
    g = config.gateway
    if model is None:
        torch.manual_seed(g.seed)
        model = task.build_model()
    problem = contradictions(config)
    if problem is not None:
        raise ValueError(problem)
    lr = g.lr or default_lr(g.optimizer, task.lr)
    # With an update policy the model belongs to someone else, and so does its optimizer.
    optimizer = (
        None
        if update is not None
        else server_optimizer(
            g.optimizer, model.parameters(), lr, g.momentum, betas=(g.beta1, g.beta2), tau=g.tau
        )
    )
    weighting: Weighting
    if g.weighting == "buffered":
        weighting = Buffered(
            edge_lr=g.edge_lr or task.lr,
            # SGD: the mean move over the gateway's rate, so its step lands on the move.  Adaptive:
            # the move itself is the pseudo-gradient (Reddi et al.), which tau is measured against.
            gateway_lr=lr if g.optimizer == "sgd" or update is not None else 1.0,
            max_staleness=g.max_staleness,
            discount=g.staleness_discount,
            exponent=g.staleness_exponent,
            expected=g.quorum,
        )
    else:
        weighting = MeanStep(
            max_staleness=g.max_staleness, discount=g.staleness_discount, exponent=g.staleness_exponent
        )
    return Gateway(
        model,
        optimizer,
        GatewayOptions.from_settings(g),
        weighting=weighting,
        aggregation=aggregation_named(g.aggregation, g.trim),
        admission=admission,
        checkpoints=checkpoints,
        # Standalone only: in hybrid mode the model and its loss are the cloud trainer's.
        watch=LossWatch.for_task(task, g.max_loss_ratio) if g.max_loss_ratio and update is None else None,
        ema=ModelEma(g.ema_window) if g.ema_window and update is None else None,
        rounds=DeadlineQuorum(deadline_s=g.round_deadline_s, quorum=g.quorum),
        on_round=on_round,
        lr_factor=CosineDecay(g.lr_decay_rounds) if g.lr_decay_rounds and update is None else None,
        update=update,
        link=link,
    )


def totals(status: dict[str, Any]) -> dict[str, float]:
    """Each counter of a gateway status summed over its labels."""
    return {name: sum(rows.values()) for name, rows in status["metrics"].items() if name.endswith("_total")}


def _by_label(rows: dict[str, float], label: str) -> dict[str, float]:
    """A labelled counter summed over every label but `label` (e.g. rejections per reason)."""
    out: dict[str, float] = {}
    for key, value in rows.items():
        parts = dict(part.split("=", 1) for part in key.split(",") if "=" in part)
        name = parts.get(label, "")
        out[name] = out.get(name, 0) + value
    return out


def round_logger(admission: CurveAdmission | None) -> Callable[[RoundSummary], None]:
    """One log line per round (a warning in insecure mode, so it is never missed)."""
    insecure = " [INSECURE: no CURVE, anyone may push]" if admission is None else ""

    def on_round(summary: RoundSummary) -> None:
        log.log(
            logging.WARNING if admission is None else logging.INFO,
            "round %d -> version %d: %d edges (%d complete), %d step-gradients, staleness mean %.2f max %d%s",
            summary.number,
            summary.version,
            summary.clients,
            summary.complete_clients,
            summary.steps,
            summary.staleness_mean,
            summary.staleness_max,
            insecure,
        )

    return on_round


def gateway_summary(gateway: Gateway, admission: CurveAdmission | None) -> dict[str, Any]:
    """The gateway's half of the summary line: clients, the audit counts, refusals by reason."""
    status = gateway.status()
    return {
        "gateway_id": gateway.gateway_id,
        "version": gateway.version,  # rounds closed
        "served_version": gateway.served_version,  # the model edges download (hybrid: trainer publishes)
        "clients": status["clients"],
        "secure": status["secure"],
        "handshakes_refused": admission.handshakes_refused if admission is not None else 0,
        "applied_steps": status["metrics"]["gateway_applied_steps_total"],
        "durable_epoch": status["durable_epoch"],
        "history_applied_steps": status["history_applied_steps"],
        "dropped_stale_steps": status["metrics"]["gateway_dropped_stale_steps_total"],
        "rejected_by_reason": _by_label(status["metrics"]["gateway_rejected_total"], "reason"),
        **totals(status),
    }


# An edge heartbeats every second when idle; one heard from within this long counts as connected.
CONNECTED_WITHIN_S = 10.0


def gateway_gauges(
    gateway: Gateway, checkpoints: GatewayCheckpoints | HybridCheckpoints | None
) -> list[ExtraGauge]:
    """Gauges computed when Prometheus scrapes: connected devices, checkpoint age."""

    def connected() -> float:
        now = gateway.clock()
        return float(sum(1 for c in list(gateway.clients.values()) if now - c.last_seen < CONNECTED_WITHIN_S))

    def checkpoint_age() -> float | None:
        if checkpoints is None or checkpoints.last_saved is None:
            return None
        return time.monotonic() - checkpoints.last_saved_at

    return [
        ("gateway_connected_devices", f"devices heard from in the last {CONNECTED_WITHIN_S:g} s", connected),
        ("gateway_checkpoint_age_seconds", "seconds since the newest checkpoint was written", checkpoint_age),
    ]


def start_metrics(bind: str, *registries: Metrics, extra: list[ExtraGauge]) -> MetricsServer | None:
    """The /metrics endpoint when --metrics-bind asks for one; raises OSError naming the bind."""
    if not bind:
        return None
    server = serve_metrics(bind, *registries, extra=extra, process_metrics=True)
    log.info("Prometheus metrics at %s", server.url)
    return server


def run(args: argparse.Namespace, config: CloudConfig) -> int:
    problem = contradictions(config)
    if problem is not None:
        return fail("cloud serve", f"{problem}")
    if config.mode == "hybrid":
        return run_hybrid(config)
    configure_logging(config.log_level, config.log_format, role="gateway")
    try:
        task = load_task(config.task)
        admission = load_admission(config)
    except (TaskError, KeyFileError) as exc:
        return fail("cloud serve", f"{exc}")
    on_round = round_logger(admission)
    g = config.gateway
    checkpoints = None
    if g.checkpoint_dir:
        try:
            checkpoints = GatewayCheckpoints(
                g.checkpoint_dir, g.checkpoint_every_rounds, g.checkpoint_keep, every_s=g.checkpoint_every_s
            )
        except (CheckpointError, OSError) as exc:
            return fail("cloud serve", f"--gateway-checkpoint-dir: {exc}")
    else:
        log.warning(
            "no --gateway-checkpoint-dir: acknowledged contributions live in memory only and a crash "
            "loses them (and the model); edges are not told anything is durable"
        )
    gateway = build_gateway(config, task, on_round, admission, checkpoints)
    resumed = gateway.restore()
    try:
        metrics = start_metrics(
            config.metrics_bind, gateway.metrics.registry, extra=gateway_gauges(gateway, checkpoints)
        )
    except OSError as exc:
        return fail("cloud serve", f"--metrics-bind {config.metrics_bind}: {exc}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    endpoint = gateway.bind()
    ready = {
        "event": "ready",
        "endpoint": endpoint,
        "gateway_id": gateway.gateway_id,
        "version": gateway.version,
        "durable_epoch": gateway.durable_epoch if checkpoints else None,
        "resumed_from": str(resumed) if resumed else None,
        "skipped_checkpoints": [f"{p}: {why}" for p, why in checkpoints.skipped] if checkpoints else [],
        "metrics_url": metrics.url if metrics is not None else None,
    }
    print(json.dumps(ready), flush=True)
    started = time.monotonic()
    try:
        gateway.serve(stop, max_rounds=config.gateway.max_rounds or None)
    except GatewayDiverged as exc:
        print(f"elasticfed cloud serve: error: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    finally:
        if metrics is not None:
            metrics.close()
    test_set = task.test_set()
    live = task.evaluate(gateway.model, test_set)
    score = evaluate_averaged(task, gateway, test_set)
    print(
        json.dumps(
            {
                "event": "summary",
                "mode": "standalone",
                **task.figures(score),  # the model the gateway reports (cloud/ema.py)
                "live": task.figures(live),  # the one edges train from
                "seconds": round(time.monotonic() - started, 3),
                **gateway_summary(gateway, admission),
            }
        ),
        flush=True,
    )
    return 0


def parameters_digest(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter and buffer's bytes, in state_dict order (ranks compare these)."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def wait_for_edges(gateway: Gateway, count: int, wait_s: float) -> bool:
    """Poll (the gateway thread fills `clients`) until `count` edges said hello, or `wait_s` passed."""
    deadline = time.monotonic() + wait_s
    log.info("waiting up to %.0f s for %d edge(s) to say hello", wait_s, count)
    while (welcomed := sum(1 for c in list(gateway.clients.values()) if c.welcomed)) < count:
        if time.monotonic() >= deadline:
            log.warning("only %d of %d edges after %.0f s: training anyway", welcomed, count, wait_s)
            return False
        time.sleep(0.05)
    return True


def gather_digests(digest: str, device: torch.device) -> list[str]:
    """Every rank's parameter digest, on every rank (a 32-byte all-gather; ranks' stdout would interleave)."""
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [bytes(t.cpu().tolist()).hex() for t in every]


def torchrun_argv(argv: list[str], nproc: int) -> list[str]:
    """The command that runs this same `cloud serve` under torchrun, `nproc` workers on this machine."""
    if "serve" not in argv[1:]:
        raise ValueError(f"cannot find the serve command in {argv!r}")
    flags = argv[argv.index("serve", 1) + 1 :]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "elasticfed.cloud", "serve", *flags,
    ]  # fmt: skip


def _serve_edges(gateway: Gateway, stop: threading.Event) -> None:
    """The gateway thread of rank 0; its death is logged here and stops the job (EdgeMixing)."""
    try:
        gateway.serve(stop)
    except BaseException:
        log.exception("the gateway thread failed")
        raise


def run_hybrid(config: CloudConfig) -> int:
    """Every rank trains on cloud data; rank 0 also serves edges, whose rounds enter the steps."""
    if "RANK" not in os.environ and config.hybrid.nproc_per_node > 1:
        # Become torchrun: signals reach it, and it supervises the workers (which find RANK set).
        argv = torchrun_argv(sys.argv, config.hybrid.nproc_per_node)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, argv)
    configure_worker_logging(config)
    rank_name = os.environ.get("RANK", "0")
    try:
        task = load_task(config.task)
        backend = pick_backend(config.train.backend)
    except (TaskError, RuntimeError) as exc:
        return fail("cloud serve", f"{exc}")
    admission = None
    if rank_name == "0":
        try:
            admission = load_admission(config)
        except KeyFileError as exc:
            return fail("cloud serve", f"{exc}")
    # The job's checkpoints: the cloud model, the gateway's state and the unmixed rounds in one file.
    # --train-checkpoint-dir when given (storage every node shares), else the gateway's directory
    # (on by default, as standalone: one node needs nothing shared).
    # A node-local default would leave the other nodes without the file at a restart.
    one_node = os.environ.get("WORLD_SIZE", "1") == os.environ.get("LOCAL_WORLD_SIZE", "1")
    directory = config.train.checkpoint_dir or (config.gateway.checkpoint_dir if one_node else "")
    keep = config.train.checkpoint_keep if config.train.checkpoint_dir else config.gateway.checkpoint_keep
    if rank_name == "0" and not directory:
        log.warning(
            "no checkpoints (--train-checkpoint-dir: storage every node shares; on one node "
            "--gateway-checkpoint-dir also does): acknowledged edge contributions and the cloud model "
            "live in memory only and a crash loses them; edges are not told anything is durable"
        )
    device, launched = join_process_group(backend, config.sync.timeout_s)
    if not launched:
        log.warning(
            "not started by torchrun: one cloud worker plus the gateway; use "
            "`torchrun --nproc-per-node=N -m elasticfed.cloud serve --mode hybrid` for N workers"
        )
    rank = dist.get_rank()
    torch.manual_seed(config.train.seed)
    module = task.build_model().to(device)
    data = task.train_set()
    if config.train.shard:
        index, parts = (int(v) for v in config.train.shard.split("/"))
        data = shard(data, index, parts, "iid", seed=config.train.seed)
    gateway = None
    rounds = None
    stop_gateway = threading.Event()
    thread = None
    checkpoints = None
    resumed = None
    g = config.gateway
    try:
        if directory:
            checkpoints = HybridCheckpoints(
                directory,
                task.name,
                keep=keep,
                every_rounds=g.checkpoint_every_rounds,
                every_s=g.checkpoint_every_s,
            )
            resumed = checkpoints.load(module, device)
        if rank == 0:
            rounds = EdgeRounds(max_queued=config.hybrid.max_queued_rounds)
            gateway = build_gateway(
                config, task, round_logger(admission), admission, checkpoints, model=module, update=rounds
            )
            if checkpoints is not None:
                checkpoints.rounds = rounds
                if gateway.restore() is not None:
                    checkpoints.queue_pending(rounds, gateway.params)
    except (CheckpointError, OSError) as exc:
        dist.destroy_process_group()
        flag = "--train-checkpoint-dir" if config.train.checkpoint_dir else "--gateway-checkpoint-dir"
        return fail("cloud serve", f"{flag}: {exc}")
    if rank == 0:
        assert gateway is not None
        try:
            endpoint = gateway.bind()  # here, so a taken port fails the job at once
        except Exception as exc:  # zmq.ZMQError and friends: say which endpoint
            dist.destroy_process_group()
            return fail("cloud serve", f"--gateway-bind {config.gateway.bind}: {exc}")
        # The socket moves to the serving thread; starting a thread is a full memory barrier.
        thread = threading.Thread(
            target=_serve_edges, args=(gateway, stop_gateway), name="gateway", daemon=True
        )
        thread.start()
        ready = {
            "event": "ready",
            "mode": "hybrid",
            "endpoint": endpoint,
            "gateway_id": gateway.gateway_id,
            "world_size": dist.get_world_size(),
            "backend": backend,
            "pid": os.getpid(),  # rank 0's process, not torchrun's: what a chaos test kills
            "durable_epoch": gateway.durable_epoch if checkpoints is not None else None,
            "resumed_from": str(resumed.path) if resumed is not None else None,
        }
        print(json.dumps(ready), flush=True)

    def leave(code: int) -> int:
        """Stop the gateway thread and leave the process group, on every way out: a thread or a
        group still alive when Python shuts down can abort a run that succeeded (common.cli)."""
        stop_gateway.set()
        if thread is not None:
            thread.join(GATEWAY_JOIN_S)
            if thread.is_alive():
                log.error("the gateway thread did not stop within %.0f s", GATEWAY_JOIN_S)
        if checkpoints is not None:
            checkpoints.finish()
        dist.destroy_process_group()
        return code

    if gateway is not None and config.hybrid.wait_for_edges:
        wait_for_edges(gateway, config.hybrid.wait_for_edges, config.hybrid.wait_s)
    params = gateway.params if gateway is not None else [p for _, p in trainable_parameters(module)]
    mixing = EdgeMixing(
        params,
        config.edge_weight,
        gateway=gateway,
        rounds=rounds,
        stop_gateway=stop_gateway,
        gateway_thread=thread,
        publish_every_s=config.hybrid.publish_every_s,
        idle_s=config.hybrid.idle_s,
        drain_s=config.hybrid.drain_s,
        checkpoints=checkpoints,
        counts=resumed.counts if resumed is not None else None,
    )
    metrics = None
    if gateway is not None:
        try:
            metrics = start_metrics(
                config.metrics_bind,
                gateway.metrics.registry,
                mixing.metrics.registry,
                extra=gateway_gauges(gateway, checkpoints),
            )
        except OSError as exc:
            print(
                f"elasticfed cloud serve: error: --metrics-bind {config.metrics_bind}: {exc}", file=sys.stderr
            )
            return leave(2)
        if metrics is not None:
            print(json.dumps({"event": "metrics", "metrics_url": metrics.url}), flush=True)
    # The handlers hold the event, not `mixing`: a handler outlives this function until Python
    # shuts down, and what it held (process groups among it) would be freed then (see common.cli).
    stop_requested = mixing.stop_requested
    previous = {
        sig: signal.signal(sig, lambda *_: stop_requested.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        result = train(
            task, config.sync, config.train, device, module=module, mixing=mixing, data=data,
            checkpoints=checkpoints,
        )  # fmt: skip
    except (CollectiveError, DivergenceError) as exc:
        log.error("%s", exc)
        return leave(EXIT_SYNC_FAILED)
    except CheckpointError as exc:
        print(f"elasticfed cloud serve: error: --train-checkpoint-dir: {exc}", file=sys.stderr)
        return leave(2)
    except TaskError as exc:
        print(f"elasticfed cloud serve: error: {exc}", file=sys.stderr)
        return leave(2)
    finally:
        if metrics is not None:
            metrics.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if mixing.gateway_failed:
        print("elasticfed cloud serve: error: the gateway thread failed (logged above)", file=sys.stderr)
        return leave(EXIT_FAILED)
    digests = gather_digests(parameters_digest(module), device)
    if gateway is not None:
        counts = mixing.counts
        print(
            json.dumps(
                {
                    "event": "summary",
                    "mode": "hybrid",
                    "world_size": dist.get_world_size(),
                    "backend": backend,
                    **result.as_dict(),
                    "model_sha256_by_rank": digests,
                    "edge_weight": config.edge_weight,
                    "edge_rounds_mixed": counts.rounds,
                    "mixing_steps": counts.mixing_steps,
                    "rounds_merged": rounds.merged if rounds is not None else 0,
                    "edge_steps_mixed": {
                        name: n for name, n in zip(gateway.names, counts.steps_by_layer) if n
                    },
                    **gateway_summary(gateway, admission),
                }
            ),
            flush=True,
        )
    return leave(0)
