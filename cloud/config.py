"""Settings of the cloud service: workers and the edge gateway (`elasticfed cloud`, cloud.toml)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import section, setting
from common.shared_settings import (
    compression_setting,
    insecure_setting,
    log_level_setting,
    task_setting,
    tcp_endpoint,
)


@dataclass(frozen=True)
class GatewaySettings:
    bind: str = setting("tcp://*:7878", "endpoint the edge gateway listens on", check=tcp_endpoint)
    round_deadline_s: float = setting(5.0, "a round closes this long after it opens", min=0.01)
    quorum: int = setting(1, "a round may close early once this many edges contributed", min=1)
    max_staleness: int = setting(8, "contributions older than this many versions are dropped", min=0)
    checkpoint_dir: str = setting(".elasticfed/gateway", "where gateway state is checkpointed")


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


@dataclass(frozen=True)
class CloudSecurity:
    insecure: bool = insecure_setting(
        "accept edges without CURVE encryption and authentication (loud warning)"
    )
    gateway_secret_key: str = setting("", "file holding the gateway's CURVE secret key (mode 0600)")
    enrolled_dir: str = setting("", "folder of enrolled device public keys")


@dataclass(frozen=True)
class CloudConfig:
    mode: str = setting(
        "hybrid", "hybrid: cloud data plus edges; standalone: edges only", choices=("hybrid", "standalone")
    )
    task: str = task_setting()
    edge_weight: float = setting(0.5, "mixing weight of the edge average in the cloud step", min=0.0, max=1.0)
    log_level: str = log_level_setting()
    sync: SyncSettings = section(SyncSettings, "layer-wise gradient sync between cloud ranks")
    train: TrainSettings = section(TrainSettings, "cloud training loop")
    gateway: GatewaySettings = section(GatewaySettings, "edge gateway")
    security: CloudSecurity = section(CloudSecurity, "CURVE keys")
