"""Settings of the edge agent (`elasticfed edge`, edge.toml)."""

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
class EdgeSecurity:
    insecure: bool = insecure_setting("run without CURVE encryption and authentication (loud warning)")
    gateway_public_key: str = setting("", "file holding the gateway's CURVE public key")
    device_secret_key: str = setting("", "file holding this device's CURVE secret key (mode 0600)")


@dataclass(frozen=True)
class EdgeConfig:
    gateway: str = setting("tcp://127.0.0.1:7878", "gateway endpoint to push to", check=tcp_endpoint)
    client_id: str = setting("", "name of this device in logs and metrics (default: host name)")
    task: str = task_setting()
    timeout_ms: int = setting(500, "per-layer deadline for an ack before the layer is weakly synced", min=1)
    sync_every: int = setting(1, "local steps between syncs (1 = push every step)", min=1)
    compression: str = compression_setting("payload compression")
    cache_dir: str = setting(".elasticfed/edge", "where the weak-sync cache survives restarts")
    log_level: str = log_level_setting()
    security: EdgeSecurity = section(EdgeSecurity, "CURVE keys")
