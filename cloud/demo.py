"""`elasticfed demo`: a gateway and a few edge agents on this machine, over a lossy link.

The gateway runs in this process; each edge is its own process
(`python -m elasticfed.edge`), trains on its shard of the digits data and syncs through
an in-process fault-injecting link (default: 30% message loss in bursts).  A
progress bar follows the rounds with the task's test figure (accuracy for
digits, bits per byte for stdlib-lm), the strong/weak sync rates the edges
report and the staleness the gateway sees; at the end a table and a JSON line
(the last line) give that figure under its own name, rounds, time, bytes, weak
syncs, re-sends and the count audit (every step-gradient produced is applied
once, or dropped as too stale and counted).  A task that can generate (a
language model) also shows a few bytes the final model writes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import torch

from elasticfed.cloud.admission import CurveAdmission
from elasticfed.cloud.config import CloudConfig, DemoConfig, GatewaySettings
from elasticfed.cloud.gateway import GatewayDiverged, RoundSummary
from elasticfed.cloud.serve import EXIT_DIVERGED, build_gateway, evaluate_averaged, totals
from elasticfed.common.exits import fail
from elasticfed.common.keys import KeyFolder, generate
from elasticfed.common.link import Faults
from elasticfed.common.task import Task, TaskError, load_task, shard


class _EdgeProcess:
    """One edge agent process and the last status it printed."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.log = open(log_path, "w")
        # One compute thread per process: on a shared small machine OpenMP spinning across
        # five processes costs more than it gives.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env=env,
            preexec_fn=_die_with_parent,
        )
        self.status: dict[str, Any] = {}
        self.summary: dict[str, Any] | None = None
        self.started = threading.Event()  # its "start" line: it handles SIGTERM from then on
        self.reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self.reader.start()

    def _read(self, stream: TextIO) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "start":
                self.started.set()
            elif event.get("event") == "summary":
                self.summary = event
            elif event.get("event") == "status":
                self.status = event

    def stop(self, start_deadline: float) -> None:
        """SIGTERM, once the agent has started (or `start_deadline` passed): one still importing
        torch on a busy machine would die of it, without its summary."""
        while not self.started.is_set() and self.proc.poll() is None:
            left = start_deadline - time.monotonic()
            if left <= 0:
                break
            self.started.wait(min(0.1, left))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def finish(self, timeout: float) -> int | None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
        self.reader.join(timeout=2)
        self.log.close()
        return code


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the demo dies, however it dies (Linux), so no edge is left behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _demo_keys(folder: Path, edges: int) -> tuple[CurveAdmission, list[list[str]]]:
    """A gateway key folder with every edge enrolled, and each edge's key flags (CURVE, as in production)."""
    gateway_keys = KeyFolder(folder / "gateway")
    gateway_public = gateway_keys.init()
    flags = []
    for i in range(edges):
        public, secret = generate(f"edge-{i}", folder / f"edge-{i}")
        gateway_keys.enrol(f"edge-{i}", public)
        flags.append(
            [
                *("--security-device-secret-key", str(secret)),
                *("--security-gateway-public-key", str(gateway_public)),
            ]
        )
    return CurveAdmission.from_folder(str(gateway_keys.root)), flags


def _edge_argv(config: DemoConfig, i: int, endpoint: str, security: list[str]) -> list[str]:
    faults = Faults(
        loss=config.loss,
        burst=config.burst,
        delay_ms=config.delay_ms,
        jitter_ms=config.jitter_ms,
        seed=config.seed * 1000 + i,
    )
    spec = ",".join(
        f"{k}={v}"
        for k, v in (
            ("loss", faults.loss),
            ("burst", faults.burst),
            ("delay_ms", faults.delay_ms),
            ("jitter_ms", faults.jitter_ms),
            ("seed", faults.seed),
        )
    )
    return [
        sys.executable,
        "-m",
        "elasticfed.edge",
        "--gateway",
        endpoint,
        "--client-id",
        f"edge-{i}",
        "--task",
        config.task,
        "--timeout-ms",
        str(config.timeout_ms),
        "--heartbeat-ms",
        "500",
        "--faults",
        spec,
        "--train-shard",
        f"{i}/{config.edges}",
        "--train-partition",
        config.partition,
        "--train-seed",
        str(config.seed),
        "--train-epochs",
        "100000",
        "--train-lr",
        str(config.edge_lr),
        "--train-prox-mu",
        str(config.prox_mu),
        *(["--train-scaffold"] if config.scaffold else []),
        "--status-every-s",
        "0.5",
        "--drain-s",
        str(config.drain_s),
        "--state-dir",
        "",  # one run, nothing to resume
        *security,
        "--log-level",
        "warning",
    ]


class _Progress:
    """One line, redrawn in place on a terminal, printed every few seconds otherwise."""

    def __init__(self, out: TextIO, total: int, task: Task) -> None:
        self.out = out
        self.total = total
        self.task = task
        self.tty = out.isatty()
        self.last_print = 0.0

    def draw(
        self, rounds: int, score: float, edges: list[_EdgeProcess], staleness: float, elapsed: float
    ) -> None:
        strong = sum(_sum(e.status.get("edge_strong_syncs_total")) for e in edges)
        weak = sum(_sum(e.status.get("edge_weak_syncs_total")) for e in edges)
        done = min(rounds, self.total)
        width = 24
        filled = int(width * done / self.total)
        bar = "#" * filled + "." * (width - filled)
        share = (
            f"strong {strong / (strong + weak):.0%} weak {weak / (strong + weak):.0%}"
            if strong + weak
            else "no syncs yet"
        )
        line = (
            f"round {done:>4}/{self.total} [{bar}] {self.task.metric_label} "
            f"{self.task.format_metric(score):>6} | {share} | "
            f"staleness {staleness:4.1f} | {elapsed:5.1f} s"
        )
        if self.tty:
            self.out.write("\r" + line)
            self.out.flush()
        elif time.monotonic() - self.last_print >= 5.0:
            self.out.write(line + "\n")
            self.out.flush()
            self.last_print = time.monotonic()

    def end(self) -> None:
        if self.tty:
            self.out.write("\n")


def _sum(value: Any) -> float:
    return float(value or 0)


TracePoint = tuple[float, int, float]  # (seconds since training started, rounds closed, task's figure)
STARTUP_LIMIT_S = 120.0  # edge processes that have not started training by then are not waited for


def run(
    args: argparse.Namespace | None,
    config: DemoConfig,
    out: TextIO = sys.stdout,
    *,
    trace: list[TracePoint] | None = None,
    bind: str = "tcp://127.0.0.1:0",
    edge_command: Callable[[int, list[str], str], list[str]] | None = None,
    result: dict[str, Any] | None = None,
    gateway_settings: dict[str, Any] | None = None,
) -> int:
    """Run the demo; the keywords let benchmarks (convergence.py, noniid.py) record it and place the edges.

    `trace` receives a point per round (the task's figure); `edge_command(i, argv, endpoint)` may
    rewrite edge i's command line (e.g. to run it in a network namespace and point it
    at another address); `result` receives the figures of the final JSON line, and the final
    model's parameters under "model_state"; `gateway_settings` overrides GatewaySettings fields
    the demo has no flag for (e.g. the gateway's optimizer).
    """
    logging.basicConfig(level="WARNING", format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    task = load_task(config.task)
    test_set = task.test_set()
    if config.partition != "iid":
        try:  # here, not as a traceback in every edge's log
            shard(task.train_set(), 0, config.edges, config.partition, seed=config.seed)
        except (ValueError, TaskError) as exc:
            return fail("demo", f"--partition {config.partition}: {exc}")
    faults = Faults(
        loss=config.loss, burst=config.burst, delay_ms=config.delay_ms, jitter_ms=config.jitter_ms
    )
    cloud = replace(
        CloudConfig(),
        mode="standalone",
        task=config.task,
        gateway=GatewaySettings(
            bind="tcp://127.0.0.1:0",
            round_deadline_s=config.round_deadline_s,
            quorum=min(config.quorum, config.edges),
            max_staleness=config.max_staleness,
            staleness_exponent=config.staleness_exponent,
            weighting=config.weighting,
            edge_lr=config.edge_lr,
            momentum=config.momentum,
            lr_decay_rounds=config.rounds,
            seed=config.seed,
        ),
    )
    if gateway_settings:
        cloud = replace(cloud, gateway=replace(cloud.gateway, **gateway_settings))
    rounds_closed = 0
    staleness = 0.0
    round_lock = threading.Lock()
    trace_pace = _Pace()
    trace_model = task.build_model()

    def on_round(summary: RoundSummary) -> None:
        nonlocal rounds_closed, staleness
        with round_lock:
            rounds_closed = summary.number
            staleness = (
                0.8 * staleness + 0.2 * summary.staleness_mean
                if summary.number > 1
                else summary.staleness_mean
            )
            if trace is not None and trace_pace.due():
                # In the gateway's thread (its model is consistent here): every round on digits (about
                # a millisecond each), less often where one evaluation costs more (a language model).
                with trace_pace:
                    score = _evaluate(task, trace_model, test_set, gateway)  # the model it reports
                trace.append((time.monotonic() - training, summary.version, score))

    logs = Path(tempfile.mkdtemp(prefix="elasticfed-demo-"))
    admission: CurveAdmission | None = None
    security = [["--insecure"]] * config.edges
    if not config.insecure:
        admission, security = _demo_keys(logs / "keys", config.edges)
    cloud = replace(cloud, gateway=replace(cloud.gateway, bind=bind))
    gateway = build_gateway(cloud, task, on_round, admission)
    endpoint = gateway.bind()
    stop_gateway = threading.Event()

    def serve() -> None:
        try:
            gateway.serve(stop_gateway)
        except GatewayDiverged:
            pass  # logged, and in gateway.diverged: the loop below stops and the report says why

    serving = threading.Thread(target=serve, name="gateway", daemon=True)

    print(
        f"elasticfed demo: gateway on {endpoint}, {config.edges} edge processes, task {task.name}, "
        f"{config.partition} split, link: {faults.describe()}, per-layer deadline {config.timeout_ms} ms",
        file=out,
    )
    link = (
        f"CURVE-encrypted, {config.edges} devices enrolled (keys in {logs / 'keys'})"
        if admission is not None
        else "NOT encrypted or authenticated (--insecure)"
    )
    kept = "" if config.keep else " (removed at the end unless --keep or a failure)"
    print(f"  the link is {link}; edge logs in {logs}{kept}", file=out)
    started = training = time.monotonic()
    training_started = False  # an edge has reported a status line
    serving.start()
    argvs = [_edge_argv(config, i, endpoint, security[i]) for i in range(config.edges)]
    if edge_command is not None:
        argvs = [edge_command(i, argv, endpoint) for i, argv in enumerate(argvs)]
    edges = [_EdgeProcess(f"edge-{i}", argv, logs / f"edge-{i}.log") for i, argv in enumerate(argvs)]
    progress = _Progress(out, config.rounds, task)
    eval_model = task.build_model()  # loaded from each new snapshot; the gateway's own model keeps moving
    score = 0.0
    last_eval = -1
    pace = _Pace()
    interrupted = threading.Event()  # SIGTERM or Ctrl-C: stop the edges, drain, report
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: interrupted.set())
    try:
        while not interrupted.wait(0.2):
            with round_lock:
                current, stale = rounds_closed, staleness
            if current != last_eval and pace.due():
                # Evaluate a snapshot (the gateway thread keeps stepping the live model).
                with pace:
                    score = _evaluate(task, eval_model, test_set, gateway)
                last_eval = current
            now = time.monotonic()
            if not training_started and (any(e.status for e in edges) or now - started >= STARTUP_LIMIT_S):
                # The clock of the budget starts when the first edge trains: process start-up is
                # not training time, but the others' joining over a bad link is.
                training_started = True
                training = now
                if trace is not None:
                    with round_lock:
                        trace[:] = [(0.0, current, score)]
            # One clock from the demo's start; the time budget counts from the first edge's training.
            progress.draw(current, score, edges, stale, now - started)
            if current >= config.rounds or (training_started and now - training >= config.time_limit_s):
                break
            if all(e.proc.poll() is not None for e in edges) or gateway.diverged is not None:
                break
    finally:
        progress.end()
        trained_s = time.monotonic() - training
        for e in edges:
            e.stop(start_deadline=started + STARTUP_LIMIT_S)
        codes = [e.finish(timeout=60) for e in edges]
        stop_gateway.set()
        serving.join(timeout=10)
    if gateway.open.opened_at is not None and gateway.diverged is None:
        gateway.close_round()  # what arrived while the edges drained is in the model too
    live = task.evaluate(gateway.model, test_set)
    score = evaluate_averaged(task, gateway, test_set)
    if trace is not None:
        trace.append((time.monotonic() - training, gateway.version, score))
    code, figures = _report(
        out, task, config, gateway, edges, codes, (score, live), trained_s, time.monotonic() - started, result
    )
    if config.keep or code != 0:
        print(f"  edge logs{' and keys' if admission else ''} kept in {logs}", file=out)
    else:
        shutil.rmtree(logs, ignore_errors=True)  # keys included: they enrolled nothing that outlives the run
    print(json.dumps(figures), file=out, flush=True)  # the last line (DESIGN.md section 9)
    return code


class _Pace:
    """Evaluations take at most a fifth of a core: the edges share this machine's cores with them."""

    SHARE = 0.2

    def __init__(self) -> None:
        self.next_at = 0.0
        self.began = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def __enter__(self) -> None:
        self.began = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        now = time.monotonic()
        self.next_at = now + (now - self.began) * (1 / self.SHARE - 1)


def _evaluate(task: Any, model: torch.nn.Module, test_set: Any, gateway: Any) -> float:
    model.load_state_dict(gateway.averaged(), strict=False)  # the model the gateway reports
    return task.evaluate(model, test_set)


def _report(
    out: TextIO,
    task: Task,
    config: DemoConfig,
    gateway: Any,
    edges: list[_EdgeProcess],
    codes: list[int | None],
    scores: tuple[float, float],
    trained_s: float,
    total_s: float,
    result: dict[str, Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """The table and summary; the exit code and the figures (printed last, as JSON, by the caller)."""
    status = gateway.status()
    g = totals(status)
    applied = status["metrics"]["gateway_applied_steps_total"]
    dropped = status["metrics"]["gateway_dropped_stale_steps_total"]
    rows = []
    audit_ok = True
    produced_total = applied_total = dropped_total = held_total = 0
    for e, code in zip(edges, codes):
        s = e.summary or {}
        produced = s.get("produced_steps", {})
        held = s.get("undelivered_by_layer", {})
        for layer, n in produced.items():
            got = applied.get(f"client={e.name},layer={layer}", 0)
            lost = dropped.get(f"client={e.name},layer={layer}", 0)
            produced_total += n
            applied_total += got
            dropped_total += lost
            # Nothing counted twice, and whatever was not applied is still held by the edge
            # (an unanswered push may have been applied already: hence <=, not ==).
            audit_ok &= got + lost <= n and n - got - lost <= held.get(layer, 0)
            held_total += n - got - lost
        rows.append(
            (
                e.name,
                s.get("steps", 0),
                int(_sum(s.get("edge_strong_syncs_total"))),
                int(_sum(s.get("edge_weak_syncs_total"))),
                int(_sum(s.get("edge_retransmissions_total"))),
                int(_sum(s.get("edge_sent_bytes_total"))),
                s.get("undelivered_steps", "?"),
                code,
            )
        )
    audit_ok &= all(e.summary is not None for e in edges)
    header = ("edge", "steps", "strong", "weak", "re-sent", "bytes sent", "undelivered", "exit")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("", file=out)
    for r in [header, *rows]:
        print("  " + "  ".join(str(v).rjust(w) for v, w in zip(r, widths)), file=out)
    weak = sum(r[3] for r in rows)
    strong = sum(r[2] for r in rows)
    resent = sum(r[4] for r in rows)
    sent_bytes = sum(r[5] for r in rows)
    print("", file=out)
    score, live = scores
    name = "test " + task.metric.replace("_", " ")
    averaged = ""
    if gateway.ema is not None:
        live_figure = task.format_metric(live)
        averaged = f"; the average of the last {gateway.ema.window} versions, the live model {live_figure}"
    print(f"  {name:<18} {task.format_metric(score)} ({task.direction}){averaged}", file=out)
    print(f"  rounds             {gateway.version}", file=out)
    print(f"  time               {total_s:.1f} s ({trained_s:.1f} s training)", file=out)
    print(
        f"  bytes              {sent_bytes / 1e6:.1f} MB pushed by edges, "
        f"{g.get('gateway_received_bytes_total', 0) / 1e6:.1f} MB received by the gateway",
        file=out,
    )
    print(f"  weak syncs         {weak} of {strong + weak} layer pushes; {resent} re-sent", file=out)
    print(
        f"  count audit        {'OK' if audit_ok else 'MISMATCH'}: {produced_total} step-gradients produced, "
        f"{applied_total} applied once, {dropped_total} dropped as too stale, "
        f"{held_total} still held by edges",
        file=out,
    )
    if gateway.diverged is not None:
        print(f"  DIVERGED           {gateway.diverged}", file=out)
    elif task.sample is not None:
        _show_sample(out, task.sample(gateway.model))
    figures = {
        **task.figures(round(score, 4)),
        "live": task.figures(round(live, 4)) if math.isfinite(live) else None,  # a diverged one may be NaN
        "rounds": gateway.version,
        "seconds": round(total_s, 1),
        "edges": len(edges),
        "loss": config.loss,
        "burst": config.burst,
        "strong_syncs": strong,
        "weak_syncs": weak,
        "retransmissions": resent,
        "bytes_pushed": sent_bytes,
        "produced_steps": produced_total,
        "applied_steps": applied_total,
        "dropped_stale_steps": dropped_total,
        "held_steps": held_total,
        "duplicates": int(g.get("gateway_duplicates_total", 0)),
        "audit_ok": audit_ok,
        "diverged": gateway.diverged,
    }
    if result is not None:
        result.update(figures)
        state = {k: v.detach().clone() for k, v in gateway.model.state_dict().items()}
        result["model_state"] = {**state, **gateway.averaged()}  # the model the gateway reports
    if gateway.diverged is not None:
        return EXIT_DIVERGED, figures
    return 0 if audit_ok and all(c == 0 for c in codes) else 1, figures


def _show_sample(out: TextIO, text: bytes) -> None:
    """What the final model writes, indented; bytes that would drive the terminal print as '?'."""
    shown = "".join(c if c.isprintable() or c == "\n" else "?" for c in text.decode(errors="replace"))
    print("  sampled from the final model:", file=out)
    for line in shown.splitlines():
        print(f"    | {line}", file=out)
