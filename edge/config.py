"""Settings of the edge agent (`elasticfed edge`, edge.toml)."""

from __future__ import annotations

from dataclasses import dataclass

from elasticfed.common.config import section, setting
from elasticfed.common.shared_settings import (
    faults_spec,
    insecure_setting,
    log_format_setting,
    log_level_setting,
    metrics_setting,
    partition_spec,
    shard_spec,
    task_setting,
    tcp_endpoint,
)

# Local steps at full size after each adopted model (edge/drift.py `Horizon`); 0 turns the bound off.
# Measured on digits (a step is 2.5 ms; a connected edge at 30% loss adopts a model about every 800
# steps): `cloud serve`'s defaults, 2 edges at 30% loss, the gateway killed 3 times, 95.3-96.9% in
# eight runs at 1000 (94.4% in CI), 96.4-96.9% in four at 200; without kills 95.3% mean without the
# bound, 95.7-96.0% with 100, 300 or 1000.  On a realistic model (a step of 0.1 s or more) 200 steps
# are 20 s or more: it binds in outages, not between a connected edge's models.
DRIFT_HORIZON = 200
# Local steps on one global model before adopting a newer one (its SGD momentum runs across them
# and restarts with each model, edge/direction.py).  Adopting after every step, an edge runs plain
# SGD: on the small text task at 2 Mbit/s (4 edges, 60 s, one run each) the served model was at
# 4.3-5.1 bits per byte with relapses to 10-12, at 4 steps 4.24, at 8 steps 4.08 and smooth, at 16
# 4.15.  A Jetson's step of tens of milliseconds makes 8 of them a fraction of a second.
LOCAL_STEPS = 8


def device_spec(value: str) -> str | None:
    """`--train-device`: a name torch reads, checked when a config loads (CUDA's presence at start)."""
    v = value.strip().lower()
    if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
        return None
    return f"{value!r} is not a device: auto, cpu, cuda or cuda:<index>"


@dataclass(frozen=True)
class EdgeSecurity:
    insecure: bool = insecure_setting("run without CURVE encryption and authentication (loud warning)")
    gateway_public_key: str = setting("", "file holding the gateway's CURVE public key")
    device_secret_key: str = setting("", "file holding this device's CURVE secret key (mode 0600)")


@dataclass(frozen=True)
class EdgeTrain:
    epochs: int = setting(20, "passes over this edge's data", min=1)
    max_steps: int = setting(0, "stop after this many steps (0: no limit)", min=0)
    duration_s: float = setting(0.0, "stop after training this many seconds (0: no limit)", min=0.0)
    batch_size: int = setting(0, "examples per step (0: the task's default)", min=0)
    lr: float = setting(0.0, "local SGD learning rate (0: the task's default)", min=0.0)
    prox_mu: float = setting(
        0.0,
        "FedProx's mu: each local step also pulls the model towards the last adopted global model by "
        "mu (w - w_global), bounding how far an edge on skewed data drifts (0: off; 0.01-1 in Li et "
        "al.; costs one copy of the model)",
        min=0.0,
        max=1000.0,
    )
    scaffold: bool = setting(
        False,
        "SCAFFOLD's control variates: each local step also moves the model by -lr (c - c_i), this "
        "edge's mean direction out and the fleet's in (c read off the adopted models' changes over "
        "the step mass their gateway applied), so an edge on skewed data walks along the fleet's "
        "direction; pushes stay the optimizer's steps; needs the gateway's plain SGD (its default); "
        "costs four copies of the model",
    )
    local_steps: int = setting(
        LOCAL_STEPS,
        "local steps on one global model before adopting a newer one that came meanwhile, as a "
        "FedAvg or FedBuff client's local steps: the optimizer's momentum runs across them (1: adopt "
        "before every step, plain SGD between models); pushes still leave every sync step",
        min=1,
    )
    drift_horizon: int = setting(
        DRIFT_HORIZON,
        "local steps at full size after each adopted global model; later ones shrink as "
        "(horizon/k)^2, so an edge cut off from the gateway never moves further than 2 x horizon "
        "steps would, and still trains (0: no bound)",
        min=0,
    )
    seed: int = setting(0, "seed for model initialisation and shuffling", min=0)
    device: str = setting(
        "auto",
        "where the model trains: auto (the GPU when torch sees one, as on a Jetson; else the CPU), "
        "cpu, cuda or cuda:<index>; gradients reach the cache without waiting for the copy to host",
        check=device_spec,
    )
    shard: str = setting(
        "", "train on part i of n of the task's data, as 'i/n' (empty: all)", check=shard_spec
    )
    partition: str = setting(
        "iid",
        "how shards split the data: iid; non-IID: shards (two label-sorted slices each), "
        "dirichlet:<alpha> (each label spread over the devices by Dirichlet(alpha) shares; 0.1: strong "
        "skew), quantity:<alpha> (IID examples, Dirichlet(alpha) amounts), or package (whole top-level "
        "packages each, stdlib-lm)",
        check=partition_spec,
    )


@dataclass(frozen=True)
class EdgeThermal:
    pause_above_c: float = setting(
        0.0,
        "pause local training while any thermal zone is at or above this many °C (0: off; Jetson "
        "Orin throttles its clocks near 99 °C)",
        min=0.0,
        max=150.0,
    )
    resume_below_c: float = setting(
        0.0, "resume once every zone is below this (0: pause_above_c - 5)", min=0.0
    )
    zones: str = setting("/sys/class/thermal/thermal_zone*/temp", "thermal zone files to read (a glob)")
    poll_s: float = setting(1.0, "read the zones at most this often", min=0.05)


def uplink_compression_spec(value: str) -> str | None:
    """The `--compression` syntax (edge/compression.py), checked when a config loads."""
    from elasticfed.edge.compression import UplinkCompression  # torch: not for `--help`

    try:
        UplinkCompression.parse(value)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class EdgeConfig:
    gateway: str = setting("tcp://127.0.0.1:7878", "gateway endpoint to push to", check=tcp_endpoint)
    client_id: str = setting("", "name of this device in logs and metrics (default: host name)")
    task: str = task_setting()
    timeout_ms: int = setting(500, "per-layer deadline for an ack before the layer is weakly synced", min=1)
    sync_every: int = setting(1, "local steps between syncs (1 = push every step)", min=1)
    heartbeat_ms: int = setting(
        1000, "heartbeat interval when idle; silence for 5 of them: reconnect", min=10
    )
    upload_mbit: float = setting(
        0.0,
        "cap on this device's average upload to the gateway, in Mbit/s, so the site keeps the rest "
        "of its link (0: no cap; the protocol paces itself to the measured link either way)",
        min=0.0,
    )
    pack_cap_kib: int = setting(1024, "small layers are packed into one push up to this size", min=0)
    drain_s: float = setting(30.0, "at the end, wait this long for cached gradients to be delivered", min=0.0)
    status_every_s: float = setting(0.0, "print a JSON status line this often (0: only at the end)", min=0.0)
    faults: str = setting(
        "",
        "inject faults on this agent's link, e.g. 'loss=0.3,burst=3,seed=1' (tests, demos)",
        check=faults_spec,
    )
    compression: str = setting(
        "auto",
        "uplink compression with error feedback: auto (as much as the measured link needs for a "
        "push per training step: none on a fast link, top-k on a slow one), none, fp16, int8, "
        "topk:<ratio>, or topk:<ratio>+fp16|int8 (topk:0.01+int8: about 130x fewer bytes); what a "
        "push leaves out enters the next",
        check=uplink_compression_spec,
    )
    audit_mass: bool = setting(
        False,
        "keep float64 sums of every step-gradient produced and of what the edge still holds, and write "
        "them to <state-dir>/mass-audit at exit: with the gateway's audit_mass, proves compression "
        "loses nothing (benchmarks; costs two model copies of memory)",
    )
    state_dir: str = setting(
        ".elasticfed/edge", "where the gradient cache and sequence numbers survive restarts (empty: nowhere)"
    )
    persist_every_s: float = setting(
        10.0, "save the cache this often when it changed (what a power cut can lose)", min=0.1
    )
    log_level: str = log_level_setting()
    log_format: str = log_format_setting()
    metrics_bind: str = metrics_setting(9401)
    train: EdgeTrain = section(EdgeTrain, "local training")
    security: EdgeSecurity = section(EdgeSecurity, "CURVE keys")
    thermal: EdgeThermal = section(EdgeThermal, "pause training when the device runs hot")


LIVENESS = 5  # heartbeats of silence after which the edge replaces its connection (edge/connection.py)


def contradictions(config: EdgeConfig) -> str | None:
    """Settings that are each valid but say opposite things together; checked before anything starts."""
    if config.timeout_ms > LIVENESS * config.heartbeat_ms:
        return (
            f"--timeout-ms {config.timeout_ms} is longer than the silence after which the connection is "
            f"replaced ({LIVENESS} x --heartbeat-ms {config.heartbeat_ms} = {LIVENESS * config.heartbeat_ms} "
            "ms): a push could not go weak before its connection is given up, and weak pushes' re-send "
            "interval would start above its cap; lower --timeout-ms or raise --heartbeat-ms"
        )
    if config.audit_mass and not config.state_dir:
        return "--audit-mass writes to --state-dir, which is empty"
    t = config.thermal
    if t.resume_below_c and not t.pause_above_c:
        return "--thermal-resume-below-c is set but the guard is off (--thermal-pause-above-c 0)"
    if t.pause_above_c and t.resume_below_c >= t.pause_above_c:
        return (
            f"--thermal-resume-below-c {t.resume_below_c} must be below --thermal-pause-above-c "
            f"{t.pause_above_c}: without a gap the guard would pause and resume at every reading"
        )
    return None
