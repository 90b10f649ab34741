"""Settings both roles declare (task, compression, log level, insecure) and checks for their values."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from elasticfed.common.config import setting
from elasticfed.common.link import Faults
from elasticfed.common.tasks import BUILT_IN

_TASK = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
_TCP = re.compile(r"^tcp://(\*|\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_SHARD = re.compile(r"^(\d+)/(\d+)$")
_COMPRESSION = re.compile(r"^(none|fp16|bf16|topk:(0?\.\d+|1(\.0*)?)|powersgd:[1-9]\d*)$")


def task_spec(value: str) -> str | None:
    """A built-in's short name, or `package.module:function`, the way a user's task plugs in."""
    if value in BUILT_IN or _TASK.match(value):
        return None
    return f"must be a built-in task ({', '.join(BUILT_IN)}) or look like 'package.module:function'"


def problem_of(parse: Callable[[str], object], value: str) -> str | None:
    """A parser's ValueError as a config check's answer: the parser stays the one place that knows."""
    try:
        parse(value)
    except ValueError as exc:
        return str(exc)
    return None


def partition_spec(value: str) -> str | None:
    """How shards split a task's data (`common.task.shard`), checked when a config loads."""
    from elasticfed.common.task import parse_partition  # torch: not for `--help`

    return problem_of(parse_partition, value)


def tcp_endpoint(value: str) -> str | None:
    """A ZeroMQ TCP endpoint with a port in range."""
    match = _TCP.match(value)
    if not match or not 0 < int(match.group(2)) < 65536:
        return "must be a ZeroMQ TCP endpoint like 'tcp://host:7878'"
    return None


def compression(value: str) -> str | None:
    """`none`, `fp16`, `bf16`, `topk:<ratio in (0, 1]>` or `powersgd:<rank>`."""
    if not _COMPRESSION.match(value) or value in ("topk:0", "topk:.0", "topk:0.0"):
        return "must be none, fp16, bf16, topk:<ratio in (0, 1]> or powersgd:<rank>"
    if value.startswith("topk:") and float(value[5:]) <= 0:
        return "topk ratio must be above 0"
    return None


def shard_spec(value: str) -> str | None:
    """`i/n`: train on part i (0-based) of n of the task's data; empty: the whole training set."""
    if not value:
        return None
    match = _SHARD.match(value)
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        return "must look like 'i/n' with 0 <= i < n, e.g. '2/4'"
    return None


def metrics_bind(value: str) -> str | None:
    """`HOST:PORT` for the Prometheus endpoint (common/metrics_http.py), or empty."""
    if not value:
        return None
    from elasticfed.common.metrics_http import parse_bind  # prometheus_client only when asked for

    try:
        parse_bind(value)
    except ValueError as exc:
        return str(exc)
    return None


def metrics_setting(port: int) -> Any:
    return setting(
        "",
        f"serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 0.0.0.0:{port} (empty: off)",
        check=metrics_bind,
    )


def log_format_setting() -> Any:
    return setting(
        "text",
        "log lines as text, or as one JSON object per line (for log shippers)",
        choices=("text", "json"),
    )


def task_setting() -> Any:
    return setting(
        "digits",
        f"built-in task ({', '.join(BUILT_IN)}) or a user task as module:function (model, data, loss)",
        check=task_spec,
    )


def compression_setting(help: str) -> Any:
    return setting("none", help, check=compression)


def log_level_setting() -> Any:
    return setting("info", "log verbosity", choices=("debug", "info", "warning", "error"))


def insecure_setting(help: str) -> Any:
    """`--insecure`: the one explicit way to run without CURVE (DESIGN.md guarantee 4)."""
    return setting(False, help, flag="--insecure")


def faults_spec(value: str) -> str | None:
    """The `--faults` syntax (common.link.Faults), checked when a config loads so the error names the flag."""
    try:
        Faults.parse(value)
    except ValueError as exc:
        return str(exc)
    return None
