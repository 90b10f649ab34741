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
    compression: str = compression_setting("gradient compression between cloud ranks")
    strategy: str = setting(
        "layerwise", "how layers are grouped for sync", choices=("layerwise", "blockwise", "adaptive")
    )
    edge_weight: float = setting(0.5, "mixing weight of the edge average in the cloud step", min=0.0, max=1.0)
    log_level: str = log_level_setting()
    gateway: GatewaySettings = section(GatewaySettings, "edge gateway")
    security: CloudSecurity = section(CloudSecurity, "CURVE keys")
