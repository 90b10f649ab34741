"""Settings of the cloud service: workers and the edge gateway (`elasticfed cloud`, cloud.toml)."""

from __future__ import annotations

from dataclasses import dataclass

from elasticfed.common.config import section, setting
from elasticfed.common.shared_settings import (
    compression_setting,
    insecure_setting,
    log_format_setting,
    log_level_setting,
    metrics_setting,
    partition_spec,
    problem_of,
    shard_spec,
    task_setting,
    tcp_endpoint,
)


def downlink_spec(value: str) -> str | None:
    """The `--gateway-downlink` syntax (cloud/publication.py), checked when a config loads."""
    from elasticfed.cloud.publication import downlink_ratio  # torch: not for `--help`

    return problem_of(downlink_ratio, value)


# The names before 2026-12: `auto` chose progress standalone and success in hybrid mode.
WEIGHTING_ALIASES = {"progress": "buffered", "success": "mean-step", "auto": "buffered"}


@dataclass(frozen=True)
class GatewaySettings:
    bind: str = setting("tcp://*:7878", "endpoint the edge gateway listens on", check=tcp_endpoint)
    round_deadline_s: float = setting(5.0, "a round closes this long after its first contribution", min=0.01)
    quorum: int = setting(1, "a round closes early once this many edges contributed to every layer", min=1)
    max_staleness: int = setting(
        1000,
        "contributions older than this many versions are dropped and counted (they are already "
        "weighed by staleness_exponent: at 0.5 one 1000 versions old counts 3%; at 8, the old "
        "default, 30-37% of an 8-edge digits fleet's step-gradients were dropped at 30% loss)",
        min=0,
    )
    staleness_exponent: float = setting(
        0.5,
        "scale a contribution by (1 + its staleness)^-exponent (0.5: FedBuff's 1/sqrt(1 + s); 0: none)",
        min=0.0,
        max=4.0,
    )
    staleness_discount: float = setting(
        1.0, "also scale it by this to the power of its staleness (1: none)", min=0.001, max=1.0
    )
    weighting: str = setting(
        "buffered",
        "how contributions are averaged: buffered (FedBuff's rule, the success-weighted average: a "
        "contribution weighs as many local steps as it synced, and the round's update is the sum of "
        "the edges' moves over max(contributions, quorum); keeps local progress over lossy and slow "
        "links) or mean-step (a layer's sum over its step count: one mean step per round, which "
        "throws away what a contribution of many steps carries)",
        choices=("buffered", "mean-step"),
        aliases=WEIGHTING_ALIASES,
    )
    edge_lr: float = setting(
        0.0,
        "the local learning rate assumed for edges whose pushes do not say theirs (0: the task's); "
        "edges that follow an optimizer (the edge CLI does) say it with every push",
        min=0.0,
    )
    optimizer: str = setting(
        "sgd",
        "the gateway's optimizer on the round's update (cloud/server_optimizers.py): sgd (with "
        "momentum 0, the edges' mean move: FedAvg), adam (FedAdam) or yogi (FedYogi)",
        choices=("sgd", "adam", "yogi"),
    )
    lr: float = setting(
        0.0,
        "learning rate of the gateway's optimizer (0: the task's for sgd, which lands on the edges' "
        "mean move; 0.01 for adam and yogi, whose steps are about lr per coordinate)",
        min=0.0,
    )
    momentum: float = setting(
        0.0,
        "momentum of the gateway's SGD on the buffered update (0: the update is the edges' mean move, "
        "as in FedAvg; momentum on top of moves of hundreds of local steps overshoots)",
        min=0.0,
        max=0.999,
    )
    beta1: float = setting(0.9, "adam and yogi: decay of the first moment", min=0.0, max=0.999)
    beta2: float = setting(0.99, "adam and yogi: decay of the second moment", min=0.0, max=0.99999)
    tau: float = setting(
        0.001, "adam and yogi: the adaptivity (eps; Reddi et al.'s tau), larger is closer to SGD", min=1e-9
    )
    max_loss_ratio: float = setting(
        10.0,
        "stop applying, serving and saving once the model's loss on a probe of the task's test data "
        "exceeds this many times an untrained model's (a finite model that diverged; probed within 2% "
        "of the gateway's time; 0: off)",
        check=lambda v: None if v == 0 or v > 1 else f"must be 0 (off) or above 1, got {v}",
    )
    ema_window: int = setting(
        50,
        "the model the gateway reports and saves as its result is the moving average of its last "
        "this many versions (cloud/ema.py): on skewed sites the live model leans towards whoever "
        "delivered last; edges always train from the live model (0: report the live model)",
        min=0,
    )
    lr_decay_rounds: int = setting(
        0, "decay the learning rate along a cosine over this many rounds, to 5% (0: constant)", min=0
    )
    aggregation: str = setting(
        "mean",
        "how each layer's contributions are combined: mean (weighted, DESIGN section 6), or robust to "
        "faulty devices: median or trimmed_mean (per coordinate, over devices)",
        choices=("mean", "median", "trimmed_mean"),
    )
    trim: float = setting(
        0.2, "aggregation=trimmed_mean: share of devices dropped at each end", min=0.0, max=0.49
    )
    max_grad_norm: float = setting(
        0.0,
        "bound on a layer's gradient norm per step (mean-step) or per contribution (buffered); 0: none",
        min=0.0,
    )
    norm_policy: str = setting(
        "clip", "a layer over max_grad_norm is clipped to it, or its push refused", choices=("clip", "reject")
    )
    rate_messages_per_s: float = setting(
        5000.0, "messages one device may send per second (0: no limit)", min=0.0
    )
    rate_burst: int = setting(5000, "messages one device may send back to back", min=1)
    rate_bytes_per_s: float = setting(0.0, "bytes one device may send per second (0: no limit)", min=0.0)
    max_clients: int = setting(
        16384,
        "devices the gateway serves at once (about 6 KiB of memory and one open file each)",
        min=1,
    )
    credit: int = setting(8, "pushes one edge may have outstanding (flow control)", min=1, max=4096)
    model_versions_kept: int = setting(
        8,
        "model versions kept for edges to download in chunks (the least recently fetched go first; "
        "each costs one model's memory)",
        min=1,
        max=1024,
    )
    downlink: str = setting(
        "topk:0.02",
        "how models reach edges: topk:<ratio> (each version moves that share of the entries of the "
        "public model every edge holds bit for bit, those furthest from the gateway's, and edges "
        "fetch patches of those values) or full (every version whole)",
        check=downlink_spec,
    )
    downlink_history: int = setting(
        32, "versions a downlink patch may span; an edge further behind gets the whole model", min=1, max=4096
    )
    audit_mass: bool = setting(
        False,
        "keep, per edge and layer, a float64 sum of what its pushes added (the mass audit of "
        "compressed pushes; costs two model copies per edge)",
    )
    window: int = setting(1024, "recent push verdicts kept per edge for de-duplication", min=16)
    max_rounds: int = setting(0, "stop after this many rounds (0: serve until stopped)", min=0)
    seed: int = setting(0, "seed of the initial model", min=0)
    checkpoint_dir: str = setting(
        ".elasticfed/gateway",
        "checkpoint gateway state here and resume from the newest good checkpoint (empty: off, and "
        "nothing is ever durable; hybrid mode: the job's checkpoints, unless --train-checkpoint-dir)",
    )
    checkpoint_every_rounds: int = setting(10, "rounds between checkpoints (and one at a clean stop)", min=1)
    checkpoint_keep: int = setting(3, "checkpoints kept; older ones are deleted", min=1)
    checkpoint_every_s: float = setting(
        30.0,
        "also checkpoint at the first round close this long after the last one (0: rounds only)",
        min=0.0,
    )


@dataclass(frozen=True)
class SyncSettings:
    strategy: str = setting(
        "layerwise", "how layers are grouped for sync", choices=("layerwise", "blockwise", "adaptive")
    )
    compression: str = compression_setting("gradient compression between cloud ranks (with error feedback)")
    overlap: bool = setting(
        True, "overlap each layer's all-reduce with the rest of backward (off: block per layer)"
    )
    streams: int = setting(
        1, "process groups over the same ranks; units are spread across them", min=1, max=16
    )
    pack_cap_kib: int = setting(1024, "layers smaller than this are packed into one collective", min=0)
    timeout_s: float = setting(
        300.0, "a collective not done after this long raises, naming the layer", min=0.1
    )
    check_every: int = setting(0, "compare parameter checksums across ranks every N steps (0: off)", min=0)
    find_unused_parameters: bool = setting(
        False, "leave gradients of parameters no rank used as None, exactly like DDP (one small all-reduce)"
    )


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = setting(20, "passes over this worker's shard of the training data", min=1)
    batch_size: int = setting(0, "examples per step on each worker (0: the task's default)", min=0)
    lr: float = setting(0.0, "SGD learning rate (0: the task's default)", min=0.0)
    seed: int = setting(0, "seed for model initialisation and data shuffling", min=0)
    backend: str = setting(
        "auto",
        "torch.distributed backend (auto: nccl with a GPU, else gloo)",
        choices=("auto", "gloo", "nccl"),
    )
    checkpoint_dir: str = setting(
        "",
        "checkpoint after every epoch and resume from the newest good checkpoint, so that torchrun "
        "--max-restarts restarts continue (shared by all nodes; empty: off; hybrid mode: the job's "
        "checkpoints, cloud model and gateway state together, at the gateway's cadence)",
    )
    checkpoint_keep: int = setting(2, "checkpoints kept; older ones are deleted", min=1)
    shard: str = setting(
        "",
        "train on part i of n of the task's data, as 'i/n' (hybrid: leave the other parts to the "
        "edges; empty: all); the ranks split that part between them",
        check=shard_spec,
    )


@dataclass(frozen=True)
class HybridSettings:
    publish_every_s: float = setting(
        5.0,
        "serve edges the cloud model at least this often, and after every mixed round (each is a new "
        "version edges download)",
        min=0.01,
    )
    idle_s: float = setting(
        2.0, "after the last epoch, go on while an edge was heard from within this long", min=0.0
    )
    drain_s: float = setting(30.0, "but at most this long after the last epoch", min=0.0)
    nproc_per_node: int = setting(
        0,
        "started without torchrun: start this many workers on this machine under torchrun --standalone "
        "(0: train alone)",
        min=0,
        max=1024,
    )
    wait_for_edges: int = setting(
        0,
        "before the first step, wait until this many edges said hello (Flower's min_available_clients)",
        min=0,
    )
    wait_s: float = setting(120.0, "but at most this long, then train anyway", min=0.0)
    max_queued_rounds: int = setting(
        4, "closed edge rounds waiting for a cloud step; more are added into the newest", min=1
    )


@dataclass(frozen=True)
class CloudSecurity:
    insecure: bool = insecure_setting(
        "accept edges without CURVE encryption and authentication (loud warning)"
    )
    keys_dir: str = setting(
        "",
        "the gateway's key folder (`elasticfed keys init`): its key pair and enrolled/ device keys",
    )


@dataclass(frozen=True)
class CloudConfig:
    mode: str = setting(
        "hybrid", "hybrid: cloud data plus edges; standalone: edges only", choices=("hybrid", "standalone")
    )
    task: str = task_setting()
    edge_weight: float = setting(
        0.5,
        "hybrid: a step that mixes an edge round takes (1 - w) x the cloud gradient + w x the edge average",
        min=0.0,
        max=1.0,
    )
    log_level: str = log_level_setting()
    log_format: str = log_format_setting()
    metrics_bind: str = metrics_setting(9400)
    sync: SyncSettings = section(SyncSettings, "layer-wise gradient sync between cloud ranks")
    train: TrainSettings = section(TrainSettings, "cloud training loop")
    gateway: GatewaySettings = section(GatewaySettings, "edge gateway")
    hybrid: HybridSettings = section(HybridSettings, "hybrid mode: edge rounds in the cloud steps")
    security: CloudSecurity = section(CloudSecurity, "CURVE keys")


@dataclass(frozen=True)
class DemoConfig:
    edges: int = setting(4, "edge agents to start, each its own process", min=1, max=32)
    rounds: int = setting(500, "rounds the gateway closes before the edges are told to stop", min=1)
    time_limit_s: float = setting(150.0, "stop the edges after this long even if rounds remain", min=1.0)
    loss: float = setting(0.3, "share of messages lost, each direction", min=0.0, max=0.99)
    burst: float = setting(3.0, "mean length of a loss burst in messages (1: independent losses)", min=1.0)
    delay_ms: float = setting(1.0, "one-way delay added to every message", min=0.0)
    jitter_ms: float = setting(1.0, "standard deviation of that delay", min=0.0)
    timeout_ms: int = setting(100, "per-layer deadline before a push is weakly synced", min=1)
    edge_lr: float = setting(
        0.01,
        "learning rate of the edges' local steps (the gateway uses the task's); small limits drift",
        min=0.0,
    )
    partition: str = setting(
        "iid",
        "how the edges split the data: iid, shards (by label), dirichlet:<alpha> (label skew), "
        "quantity:<alpha> (size skew) or package (by top-level package, stdlib-lm); all but iid are "
        "non-IID",
        check=partition_spec,
    )
    weighting: str = setting(
        "buffered",
        "buffered (the success-weighted rule: the mean of the edges' local moves; holds up at 95% "
        "loss) or mean-step (sum / step count)",
        choices=("buffered", "mean-step"),
        aliases=WEIGHTING_ALIASES,
    )
    drain_s: float = setting(30.0, "at the end, how long edges may take to deliver what they hold", min=0.0)
    prox_mu: float = setting(
        0.0, "FedProx's mu on the edges' local steps (edge/drift.py; 0: off)", min=0.0, max=1000.0
    )
    scaffold: bool = setting(False, "SCAFFOLD's control variates on the edges' local steps (edge/drift.py)")
    momentum: float = setting(
        0.9,
        "momentum of the gateway's SGD; the demo's edges take small local steps (edge_lr) and adopt "
        "a model every few, so what they push is close to raw gradients (`cloud serve` defaults to 0)",
        min=0.0,
        max=0.999,
    )
    quorum: int = setting(2, "a round closes once this many edges contributed to every layer", min=1)
    round_deadline_s: float = setting(0.5, "or this long after its first contribution", min=0.01)
    max_staleness: int = setting(50, "contributions more versions behind than this are dropped", min=0)
    staleness_exponent: float = setting(
        0.0,
        "scale a contribution by (1 + staleness)^-exponent; the demo's rounds close every half "
        "second, so a few versions are a second or two (`cloud serve` defaults to 0.5)",
        min=0.0,
        max=4.0,
    )
    seed: int = setting(0, "seed for the model, the data split and the link", min=0)
    insecure: bool = insecure_setting(
        "run the demo without CURVE (by default it makes keys in a temporary folder and enrols the edges)"
    )
    keep: bool = setting(
        False,
        "keep the run's folder (edge logs, the demo's keys) after it ends; kept anyway when an edge "
        "fails or the count audit does not add up",
    )
    task: str = task_setting()


def contradictions(config: CloudConfig) -> str | None:
    """Settings that are each valid but say opposite things together; checked before anything starts."""
    g = config.gateway
    if g.optimizer != "sgd" and g.momentum:
        return (
            f"--gateway-momentum {g.momentum} is SGD's; --gateway-optimizer {g.optimizer} has its own "
            "(--gateway-beta1): set one or the other"
        )
    if g.credit > g.window:
        return (
            f"--gateway-credit {g.credit} lets an edge have more pushes outstanding than the verdicts "
            f"the gateway keeps for it (--gateway-window {g.window}): the pushes beyond would be refused "
            "and sent again forever; raise the window or lower the credit"
        )
    if g.quorum > g.max_clients:
        return (
            f"--gateway-quorum {g.quorum} is more edges than the gateway serves (--gateway-max-clients "
            f"{g.max_clients}): no round could reach it, every round would wait for its deadline"
        )
    if config.mode == "hybrid" and g.optimizer != "sgd":
        return (
            f"--gateway-optimizer {g.optimizer}: in hybrid mode the cloud trainer's optimizer applies "
            "the edges' rounds (mixed into its gradients); the gateway has none of its own"
        )
    return None
