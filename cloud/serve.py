"""`elasticfed cloud serve --mode standalone`: the edge gateway on its own (pure federated).

Builds the task's model (seeded, so edges that start from the same seed agree
before the first model arrives), serves edges until SIGTERM/SIGINT or
`--gateway-max-rounds`, logs one line per round, and prints a JSON summary
(version, rounds, test accuracy, counters) as its last line.  The first line
on stdout is a JSON `ready` event with the bound endpoint, for supervisors and
tests that bind to port 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from cloud.admission import CurveAdmission
from cloud.aggregation import (
    CosineDecay,
    DeadlineQuorum,
    LocalProgress,
    SuccessWeighted,
    Weighting,
    aggregation_named,
)
from cloud.config import CloudConfig
from cloud.durability import GatewayCheckpoints
from cloud.gateway import Gateway, GatewayOptions, RoundSummary
from common.checkpoint import CheckpointError
from common.keys import KeyFileError
from common.task import Task, TaskError, load_task

log = logging.getLogger("elasticfed.gateway")

EXIT_NOT_BUILT = 69


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


def build_gateway(
    config: CloudConfig,
    task: Task,
    on_round: Callable[[RoundSummary], None] | None = None,
    admission: CurveAdmission | None = None,
    checkpoints: GatewayCheckpoints | None = None,
) -> Gateway:
    """The gateway the `[gateway]` table describes, around the task's model."""
    g = config.gateway
    torch.manual_seed(g.seed)
    model = task.build_model()
    lr = g.lr or task.lr
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=g.momentum)
    weighting: Weighting
    if g.weighting == "progress":
        weighting = LocalProgress(
            edge_lr=g.edge_lr or task.lr,
            gateway_lr=lr,
            max_staleness=g.max_staleness,
            discount=g.staleness_discount,
            expected=g.quorum,
        )
    else:
        weighting = SuccessWeighted(max_staleness=g.max_staleness, discount=g.staleness_discount)
    return Gateway(
        model,
        optimizer,
        GatewayOptions(
            bind=g.bind,
            credit=g.credit,
            window=g.window,
            max_clients=g.max_clients,
            rate_messages_per_s=g.rate_messages_per_s,
            rate_burst=g.rate_burst,
            rate_bytes_per_s=g.rate_bytes_per_s,
            max_grad_norm=g.max_grad_norm,
            norm_policy=g.norm_policy,
        ),
        weighting=weighting,
        aggregation=aggregation_named(g.aggregation, g.trim),
        admission=admission,
        checkpoints=checkpoints,
        rounds=DeadlineQuorum(deadline_s=g.round_deadline_s, quorum=g.quorum),
        on_round=on_round,
        lr_factor=CosineDecay(g.lr_decay_rounds) if g.lr_decay_rounds else None,
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


def run(args: argparse.Namespace, config: CloudConfig) -> int:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if config.mode != "standalone":
        print(
            "elasticfed cloud serve: hybrid mode (cloud workers plus the gateway on rank 0) is not built "
            "yet (tracked in issue #8); use --mode standalone for the gateway alone.",
            file=sys.stderr,
        )
        return EXIT_NOT_BUILT
    try:
        task = load_task(config.task)
        admission = load_admission(config)
    except (TaskError, KeyFileError) as exc:
        print(f"elasticfed cloud serve: error: {exc}", file=sys.stderr)
        return 2
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

    g = config.gateway
    checkpoints = None
    if g.checkpoint_dir:
        try:
            checkpoints = GatewayCheckpoints(
                g.checkpoint_dir, g.checkpoint_every_rounds, g.checkpoint_keep, every_s=g.checkpoint_every_s
            )
        except (CheckpointError, OSError) as exc:
            print(f"elasticfed cloud serve: error: --gateway-checkpoint-dir: {exc}", file=sys.stderr)
            return 2
    else:
        log.warning(
            "no --gateway-checkpoint-dir: acknowledged contributions live in memory only and a crash "
            "loses them (and the model); edges are not told anything is durable"
        )
    gateway = build_gateway(config, task, on_round, admission, checkpoints)
    resumed = checkpoints.restore(gateway) if checkpoints is not None else None
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
    }
    print(json.dumps(ready), flush=True)
    started = time.monotonic()
    gateway.serve(stop, max_rounds=config.gateway.max_rounds or None)
    accuracy = task.evaluate(gateway.model, task.test_set())
    status = gateway.status()
    print(
        json.dumps(
            {
                "event": "summary",
                "gateway_id": gateway.gateway_id,
                "version": gateway.version,
                "accuracy": accuracy,
                "seconds": round(time.monotonic() - started, 3),
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
        ),
        flush=True,
    )
    return 0
